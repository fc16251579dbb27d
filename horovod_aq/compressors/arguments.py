"""The argument checks of the compressor constructors: bits, bucket size, seed, step, name and
refit schedule, on top of the generic checks of :mod:`horovod_aq._arguments` (re-exported here:
``SettingTypeError``, ``integer``, ``real``, ``optional``, ``choice``; the rules and the error
types are described there). This module imports no framework.
"""

from __future__ import annotations

from typing import Any

from horovod_aq._arguments import SettingTypeError, choice, integer, optional, real, shown
from horovod_aq.codec.format import MAX_BUCKET_SIZE
from horovod_aq.levels.table import MAX_BITS
from horovod_aq.schedule import RefitSchedule

__all__ = ["SettingTypeError", "bits", "bucket_size", "choice", "integer", "name", "optional",
           "real", "schedule", "seed", "step"]

#: How a refit schedule may be given (the error message of :func:`schedule`).
SCHEDULE_FORMS = ('a horovod_aq.RefitSchedule (e.g. RefitSchedule(steps=(0, 100, 2000), '
                  'every=10000)), a string in the reference format "0,100,2000,10000" (refit '
                  'steps, then the period; "0" = never), or None (the default)')


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
        raise SettingTypeError(f"name must be a string or None, got {shown(value)}")
    return value


def schedule(value: Any):
    """A refit schedule: a ``RefitSchedule``, its string form (parsed) or None (the default).

    An int or a list is refused rather than guessed: 100 could be one refit step or a period.
    """
    if value is None or isinstance(value, RefitSchedule):
        return value
    if isinstance(value, str):
        return RefitSchedule.parse(value)
    raise SettingTypeError(f"schedule must be {SCHEDULE_FORMS}; got {shown(value)}")
