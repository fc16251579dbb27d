"""Which wire the buckets take with ``wire="auto"``: the candidates and the rule that picks one
from their timed trials (docs/protocol.md §5.5; the schedule and the agreement:
:mod:`.autowire`).

**Candidates** (:func:`candidates`). Every coding of the payload body, "fixed" and "entropy"
(docs/format.md §12), in every exchange mode the set size allows (:func:`allowed_modes`:
allgather alone for P ≤ 2, two-phase alone from ``TWO_PHASE_MIN_RANKS``, both in between, on a
topology the node-aware modes too (docs/protocol.md §5.7), or the user's forced mode). The
fixed codes in the planned mode come first: that is the wire when nothing is decided.

**Rule** (:func:`choose`). A trial is one step of the job with every bucket on one candidate;
each rank times its step from the end of the one before and counts the bytes it sent. A step's
time is its slowest rank's; a candidate's time T is the mean of the faster half of its steps
(⌈k/2⌉ of k). A step is never faster than the wire allows, only slower (another process on the
core, a cache miss after a mode switch, a rank descheduled), so the faster half estimates the
wire and ignores up to half of the steps being slowed. With T* the fastest candidate's time:

* the candidate that sent the fewest bytes is chosen when its T ≤ (1 + ``TOLERANCE``)·T*: the
  trials cannot tell it from the fastest, and it leaves the most room on the network;
* otherwise the fastest.

So the choice is never measured more than ``TOLERANCE`` slower than the fastest candidate.
tests/test_wire_choice.py checks the rule on noisy trials drawn with such slow outliers: with
k = 4 and 3 % jitter the choice is truly within 5 % of the fastest in all but about 0.5 % of
random draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from horovod_aq.packed.cost import FLAT_MODES, MODES, NODE_PREFIX, TWO_PHASE_MIN_RANKS

#: What a ``wire=`` setting accepts: "auto" (this module's choice), or a forced coding.
CODINGS = ("fixed", "entropy")
WIRES = ("auto",) + CODINGS
#: How much slower than the fastest candidate the one with the fewest bytes may be measured and
#: still be chosen (relative): below what the trials resolve on a shared host.
TOLERANCE = 0.03


@dataclass(frozen=True)
class WireChoice:
    """A wire: ``coding`` (``CODINGS``) and ``mode`` (``MODES``); from trials also the measured
    ``seconds`` per step, those of the first candidate (``fixed_seconds``, the fixed codes in
    the planned mode) and the payload's measured ``bits_per_coordinate``."""

    coding: str
    mode: str
    seconds: float = 0.0
    fixed_seconds: float = 0.0
    bits_per_coordinate: float = 0.0


@dataclass(frozen=True)
class Trials:
    """The trials of one candidate: the steps' times (each its slowest rank's) and the bytes
    every rank sent, summed over ranks, per step."""

    seconds: tuple[float, ...]
    bytes_sent: tuple[float, ...]

    @property
    def time(self) -> float:
        """T: the mean of the faster half of the steps (⌈k/2⌉ of k)."""
        fast = np.sort(np.asarray(self.seconds, dtype=np.float64))
        return float(np.mean(fast[:(fast.size + 1) // 2]))

    @property
    def bytes(self) -> float:
        """The mean bytes sent per step (every rank)."""
        return float(np.mean(self.bytes_sent))


def allowed_modes(ranks: int, exchange: str = "auto", per_node: int = 1) -> tuple[str, ...]:
    """cost.py's rule: allgather for P ≤ 2, two-phase from TWO_PHASE_MIN_RANKS, else both; on
    a topology of M > 1 nodes of L = ``per_node`` > 1 ranks also the node-aware modes whose
    inner mode the same rule allows for M ranks. A forced ``exchange`` is the only one."""
    if exchange in MODES:
        return (exchange,)
    if exchange != "auto":
        raise ValueError(f"exchange must be 'auto' or one of {MODES}, got {exchange!r}")
    if ranks <= 2:
        flat: tuple[str, ...] = ("allgather",)
    elif ranks >= TWO_PHASE_MIN_RANKS:
        flat = ("two_phase",)
    else:
        flat = FLAT_MODES
    if per_node < 2 or ranks % per_node or ranks == per_node:
        return flat
    return flat + tuple(NODE_PREFIX + m for m in allowed_modes(ranks // per_node))


def candidates(ranks: int, exchange: str = "auto", planned: str = "allgather",
               per_node: int = 1) -> tuple[WireChoice, ...]:
    """The wires the trials compare (module docstring): every coding in every allowed mode, the
    planned mode first, fixed before entropy."""
    modes = allowed_modes(ranks, exchange, per_node)
    modes = tuple(sorted(modes, key=lambda m: m != planned))
    return tuple(WireChoice(coding, mode) for mode in modes for coding in CODINGS)


def choose(trials: Sequence[Trials], tolerance: float = TOLERANCE) -> tuple[int, str]:
    """(index of the chosen candidate, why in words) by the rule of the module docstring."""
    if not trials or any(not t.seconds for t in trials):
        raise ValueError("every candidate needs at least one timed step")
    times = [t.time for t in trials]
    fastest = int(np.argmin(times))
    leanest = int(np.argmin([t.bytes for t in trials]))
    if times[leanest] <= (1 + tolerance) * times[fastest]:
        if leanest == fastest:
            return leanest, "the fastest, and the fewest bytes"
        return leanest, (f"the fewest bytes, and within {tolerance:.0%} of the fastest "
                         f"({times[leanest] / times[fastest]:.3f}x)")
    return fastest, (f"the fastest (the candidate with the fewest bytes took "
                     f"{times[leanest] / times[fastest]:.2f}x as long)")


__all__ = ["CODINGS", "MODES", "TOLERANCE", "Trials", "WIRES", "WireChoice", "allowed_modes",
           "candidates", "choose"]
