"""The generic argument checks (type and range) behind every setting the package validates:
the compressor constructors (:mod:`horovod_aq.compressors.arguments`),
:class:`~horovod_aq.RefitSchedule` and the packed exchange
(``horovod_aq.packed.protocol.check_exchange_args``).

A leaf module (it imports numpy only), so that :mod:`horovod_aq.schedule` can check its
arguments without importing the compressors that take a schedule.

Every check returns the value in its canonical type or raises at construction, with a message
that names the argument, what is allowed and what was given:

* a value of the wrong type (``bits=True``, ``top_k="5"``, ``QSGD(s=2.5)``, ``seed=None``,
  ``schedule=100``) raises :class:`SettingTypeError`, a ``TypeError`` that is also a
  ``ValueError`` (these settings raised ``ValueError`` before, and callers may catch that);
* a value of the right type outside its range (``bits=9``, ``bucket_size=2**40``,
  ``step=-7``) raises ``ValueError``.

Integers are Python or numpy integers, never ``bool`` and never floats (``2.5`` would be
truncated, and ``2.0`` is refused alike so that a float never passes silently). Real numbers are
Python or numpy integers or floats, never ``bool``, ``str`` or NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["SettingTypeError", "choice", "integer", "optional", "real", "shown"]


class SettingTypeError(TypeError, ValueError):
    """A setting of the wrong type. A ``TypeError``, and a ``ValueError`` as well: earlier
    versions raised ``ValueError`` for some of these, and callers may catch that."""


def shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _is_integer(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def integer(name: str, value: Any, lo: int, hi: int | None = None, *,
            allowed: str | None = None) -> int:
    """``value`` as an int in lo..hi (hi None: no upper bound). ``allowed`` phrases the allowed
    values in the messages (default "an integer in lo..hi" or ">= lo (an integer)")."""
    if allowed is None:
        allowed = f"an integer in {lo}..{hi}" if hi is not None else f">= {lo} (an integer)"
    if not _is_integer(value):
        raise SettingTypeError(f"{name} must be {allowed}, got {shown(value)}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def real(name: str, value: Any, *, lo: float | None = None, hi: float | None = None,
         open_interval: bool = False, allowed: str | None = None) -> float:
    """``value`` as a finite float, within [lo, hi] (``open_interval``: (lo, hi))."""
    if allowed is None:
        left, right = ("(", ")") if open_interval else ("[", "]")
        bounds = (f" in {left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}"
                  f"{right}") if lo is not None or hi is not None else ""
        allowed = f"a real number{bounds}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                    np.floating)):
        raise SettingTypeError(f"{name} must be {allowed}, got {shown(value)}")
    value = float(value)
    below = lo is not None and (value <= lo if open_interval else value < lo)
    above = hi is not None and (value >= hi if open_interval else value > hi)
    if not math.isfinite(value) or below or above:
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def optional(check, name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
    """``None``, or ``check(name, value, *args, **kwargs)``."""
    return None if value is None else check(name, value, *args, **kwargs)


def choice(name: str, value: Any, options: Sequence[str]) -> str:
    """``value`` if it is one of ``options`` (strings)."""
    if not isinstance(value, str):
        raise SettingTypeError(f"{name} must be one of {tuple(options)}, got {shown(value)}")
    if value not in options:
        raise ValueError(f"{name} must be one of {tuple(options)}, got {value!r}")
    return value
