"""The argument checks of the compressor constructors, :class:`~horovod_aq.RefitSchedule` and
the packed exchange (``horovod_aq.packed.protocol.check_exchange_args``).

Every check returns the value in its canonical type or raises at construction, with a message
that names the argument, what is allowed and what was given:

* a value of the wrong type (``bits=True``, ``top_k="5"``, ``QSGD(s=2.5)``, ``seed=None``,
  ``schedule=100``) raises :class:`SettingTypeError`, a ``TypeError`` that is also a
  ``ValueError`` (these settings raised ``ValueError`` before, and callers may catch that);
* a value of the right type outside its range (``bits=9``, ``bucket_size=2**40``,
  ``step=-7``) raises ``ValueError``.

Integers are Python or numpy integers, never ``bool`` and never floats (``2.5`` would be
truncated, and ``2.0`` is refused alike so that a float never passes silently). Real numbers are
Python or numpy integers or floats, never ``bool``, ``str`` or NaN. This module imports no
framework.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from horovod_aq.codec.format import MAX_BUCKET_SIZE
from horovod_aq.levels.table import MAX_BITS

__all__ = ["SettingTypeError", "bits", "bucket_size", "choice", "integer", "name", "optional",
           "real", "schedule", "seed", "step"]

#: How a refit schedule may be given (the error message of :func:`schedule`).
SCHEDULE_FORMS = ('a horovod_aq.RefitSchedule (e.g. RefitSchedule(steps=(0, 100, 2000), '
                  'every=10000)), a string in the reference format "0,100,2000,10000" (refit '
                  'steps, then the period; "0" = never), or None (the default)')


class SettingTypeError(TypeError, ValueError):
    """A setting of the wrong type. A ``TypeError``, and a ``ValueError`` as well: earlier
    versions raised ``ValueError`` for some of these, and callers may catch that."""


def _shown(value: Any) -> str:
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
        raise SettingTypeError(f"{name} must be {allowed}, got {_shown(value)}")
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
        raise SettingTypeError(f"{name} must be {allowed}, got {_shown(value)}")
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
        raise SettingTypeError(f"{name} must be one of {tuple(options)}, got {_shown(value)}")
    if value not in options:
        raise ValueError(f"{name} must be one of {tuple(options)}, got {value!r}")
    return value


def bits(value: Any) -> int:
    """Bits per code, 1..8 (``bits=True`` is not 1)."""
    return integer("bits", value, 1, MAX_BITS)


def bucket_size(value: Any) -> int:
    """Coordinates per bucket: 2 .. 2³² − 1 (the payload header stores it as a u32)."""
    return integer("bucket_size", value, 2, MAX_BUCKET_SIZE,
                   allowed=f"an integer >= 2 and <= {MAX_BUCKET_SIZE} (the payload header "
                           "stores it in 32 bits)")


def seed(value: Any) -> int:
    """The user's seed of the random stream: an integer ≥ 0, the same on every rank."""
    return integer("seed", value, 0,
                   allowed=">= 0 (an integer, the same on every rank: it keys the random "
                           "stream of stochastic rounding)")


def step(value: Any) -> int:
    """A training step counter: an integer ≥ 0 (for setters of a compressor's ``step``)."""
    return integer("step", value, 0)


def name(value: Any) -> str | None:
    """A compressor's name: a string, or None for the default."""
    if value is not None and not isinstance(value, str):
        raise SettingTypeError(f"name must be a string or None, got {_shown(value)}")
    return value


def schedule(value: Any):
    """A refit schedule: a ``RefitSchedule``, its string form (parsed) or None (the default).

    An int or a list is refused rather than guessed: 100 could be one refit step or a period.
    """
    from horovod_aq.schedule import RefitSchedule

    if value is None or isinstance(value, RefitSchedule):
        return value
    if isinstance(value, str):
        return RefitSchedule.parse(value)
    raise SettingTypeError(f"schedule must be {SCHEDULE_FORMS}; got {_shown(value)}")
