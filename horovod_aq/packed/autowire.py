"""``wire="auto"``: which wire the buckets take, decided by timing the candidates on the job's
own steps (docs/protocol.md §5.5). Every rank runs the same schedule, a function of the global
step, over the same candidates (:func:`candidates`: every coding, "fixed" and "entropy", in
every exchange mode the set size allows, the fixed codes in the planned mode first):

=============================================  =================================================
steps (s = first exchanged step, C candidates)  what the wire does
=============================================  =================================================
s … s + W − 1             (warm-up)             fixed codes, planned modes (compiles, allocators)
s + W + j, 0 ≤ j < C·k    (trials)              every bucket takes candidate j mod C; each rank
                                                records the step's seconds (from the end of the
                                                step before) and the bytes it sent
end of step s + W + C·k − 1 (the boundary)      :meth:`AutoWire.decide`: agreement (below)
s + W + C·k …                                   the decided candidate
=============================================  =================================================

**Why trials and not a model.** The candidates are interleaved, so slow drifts of a shared host
hit them alike, and what is compared is what the user waits for: whole steps, with the overlap
of the backward pass, the ranks' contention for cores, the mix of fast and slow links of several
ranks per host, none of which a model of one link captures (issue: a fitted ring model picked
allgather where two-phase was 2-3x faster).

**Decision** (on rank 0, ``choice.choose``). A step's time is the slowest rank's; a candidate's
is the mean of the faster half of its k steps (robust to slow steps: a cache miss, a
descheduled rank). The fastest candidate wins, unless the candidate that sends the fewest bytes
is within ``TOLERANCE`` of it: then that one, since the measurement cannot tell them apart and
fewer bytes leave more room on a busy network. The log line says which and why.

**Agreement** (the refit protocol's shape, refit.py): one allgather of every rank's trial rows
(float64, a fixed count per rank), the choice on rank 0, one broadcast of the decision
(:class:`WireDecision` as a float64 vector). Every rank installs exactly the root's vector, so
every rank takes the same path; a failure on the root is broadcast as a fallback decision
(fixed codes, the planned modes). The decision is part of :meth:`AutoWire.state_dict`, so a
resumed job keeps it; an unfinished measurement restarts at the first step after the resume.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from horovod_aq.packed.choice import (
    CODINGS,
    WIRES,
    Trials,
    WireChoice,
    candidates,
    choose,
)
from horovod_aq.packed.cost import MODES
from horovod_aq.packed.plan import BucketPlan

logger = logging.getLogger(__name__)

#: Warm-up steps W before the trials: the first steps compile kernels (numba, Triton, TF graphs)
#: and grow allocators, and the last of them starts the first trial's clock.
WARMUP_STEPS = 2
#: Trial steps k per candidate.
TRIALS = 4
#: Values per trial row a rank records: the trial's index j, the step's seconds (NaN: no clock
#: yet), the bytes this rank sent and the bytes of its first-phase payloads.
ROW = 4
#: First slot of the decision vector (its format), and its status values.
DECISION_FORMAT = 2.0
DECIDED, FALLBACK = 1.0, 0.0
HEAD = 5  # format, status, step, layout, buckets
PER_BUCKET = 5  # coding, mode, seconds, fixed seconds, bits per coordinate


def plans_digest(plans: Sequence[BucketPlan]) -> int:
    """CRC-32 of the buckets' names and sizes (not their modes, which a decision changes)."""
    return zlib.crc32(repr([(b.name, b.numel) for b in plans]).encode()) & 0xFFFFFFFF


@dataclass(frozen=True)
class WireDecision:
    """The agreed wire of every bucket from ``step`` on, for the plans of digest ``layout``;
    ``decided``: False for the fallback (fixed codes, planned modes)."""

    step: int
    layout: int
    choices: tuple[WireChoice, ...]
    decided: bool = True

    def to_array(self) -> np.ndarray:
        """The broadcast vector: HEAD slots, then PER_BUCKET per bucket."""
        head = [DECISION_FORMAT, DECIDED if self.decided else FALLBACK, self.step, self.layout,
                len(self.choices)]
        body = [[CODINGS.index(c.coding), MODES.index(c.mode), c.seconds, c.fixed_seconds,
                 c.bits_per_coordinate] for c in self.choices]
        return np.concatenate([np.array(head, dtype=np.float64),
                               np.array(body, dtype=np.float64).reshape(-1)])

    @classmethod
    def from_array(cls, array: Any) -> WireDecision:
        a = np.asarray(array, dtype=np.float64).reshape(-1)
        if a.size < HEAD or a[0] != DECISION_FORMAT or a.size != HEAD + PER_BUCKET * int(a[4]):
            raise ValueError(f"not a wire decision vector (format {DECISION_FORMAT:g}, "
                             f"{HEAD} + {PER_BUCKET}·buckets values): {a.size} values")
        rows = a[HEAD:].reshape(-1, PER_BUCKET)
        choices = tuple(WireChoice(CODINGS[int(r[0])], MODES[int(r[1])], float(r[2]),
                                   float(r[3]), float(r[4])) for r in rows)
        return cls(int(a[2]), int(a[3]), choices, a[1] == DECIDED)


def with_modes(plans: Sequence[BucketPlan], decision: WireDecision) -> list[BucketPlan]:
    """The plans with the decided modes (the layout changes: re-plan at the step boundary)."""
    if plans_digest(plans) != decision.layout or len(plans) != len(decision.choices):
        raise ValueError("this wire decision was made for other buckets; restart the "
                         "measurement (AutoWire.restart) after a re-plan")
    return [dataclasses.replace(p, mode=c.mode) for p, c in zip(plans, decision.choices)]


class AutoWire:
    """The schedule, trials and decision of ``wire`` ("auto", or a forced coding) of one
    exchange (module docstring). ``name`` makes the agreement's collective names unique and
    rank-independent (e.g. the exchange key); ``exchange``: "auto" or a forced mode; ``ranks``
    and ``per_node``: the set size and the ranks per node of its topology (1: none), known when
    the engine attaches (:mod:`.wire_setting`)."""

    __slots__ = ("wire", "warmup_steps", "trials", "name", "exchange", "ranks", "per_node",
                 "start", "decision", "_rows")

    def __init__(self, wire: str = "auto", *, warmup_steps: int = WARMUP_STEPS,
                 trials: int = TRIALS, name: str = "wire", exchange: str = "auto",
                 ranks: int = 1, per_node: int = 1) -> None:
        if wire not in WIRES:
            raise ValueError(f"wire must be one of {WIRES}, got {wire!r}")
        if warmup_steps < 1 or trials < 1:
            raise ValueError("warmup_steps must be >= 1 (its last step starts the first "
                             f"trial's clock) and trials >= 1, got {warmup_steps} and {trials}")
        self.wire = wire
        self.warmup_steps, self.trials = int(warmup_steps), int(trials)
        self.name, self.exchange, self.ranks = name, exchange, int(ranks)
        self.per_node = int(per_node)
        self.start: int | None = None
        self.decision: WireDecision | None = None
        self._rows: list[tuple[float, ...]] = []

    # ------------------------------------------------------------------ schedule
    @property
    def candidates(self) -> tuple[WireChoice, ...]:
        """The wires the trials compare (``choice.candidates`` for this set and exchange)."""
        return candidates(self.ranks, self.exchange, per_node=self.per_node)

    @property
    def measure_steps(self) -> int:
        """C·k: the trial steps."""
        return len(self.candidates) * self.trials

    def begin(self, step: int) -> None:
        """Anchor the schedule at the first exchanged step (the same on every rank)."""
        if self.start is None:
            self.start = int(step)

    def restart(self, step: int) -> None:
        """Forget the decision and trials; measure again from ``step`` (after a re-plan)."""
        self.start, self.decision = int(step), None
        self._rows.clear()

    @property
    def decision_step(self) -> int | None:
        """The first step of the decided wire: s + W + C·k."""
        return None if self.start is None else (self.start + self.warmup_steps
                                                + self.measure_steps)

    def trial(self, step: int) -> int | None:
        """The trial index j of ``step`` (None: not a trial step)."""
        if self.wire != "auto" or self.decision is not None or self.start is None:
            return None
        j = step - self.start - self.warmup_steps
        return j if 0 <= j < self.measure_steps else None

    def due(self, step: int) -> bool:
        """Whether :meth:`decide` runs at the end of ``step``."""
        end = self.decision_step
        return (self.wire == "auto" and self.decision is None and end is not None
                and step >= end - 1)

    def _wire_at(self, step: int, index: int) -> WireChoice | None:
        """The decided or trial wire of bucket ``index`` at ``step`` (None: warm-up)."""
        if self.decision is not None and step >= self.decision.step:
            return self.decision.choices[index]
        j = self.trial(step)
        return None if j is None else self.candidates[j % len(self.candidates)]

    def coding(self, step: int, index: int) -> str:
        """The coding bucket ``index`` sends at ``step`` (anchors the schedule on first use)."""
        self.begin(step)
        if self.wire != "auto":
            return self.wire
        found = self._wire_at(step, index)
        return "fixed" if found is None else found.coding

    def mode(self, step: int, index: int, planned: str) -> str:
        """The mode of bucket ``index`` at ``step``: the trial's or the decided one, else
        ``planned``."""
        found = self._wire_at(step, index) if self.wire == "auto" else None
        return planned if found is None else found.mode

    # ------------------------------------------------------------------ trials
    def record_step(self, step: int, seconds: float, bytes_sent: float,
                    payload_bytes: float) -> None:
        """The end of exchanged step ``step`` on this rank: its seconds (from the end of the
        step before; NaN: unknown) and the bytes it sent; kept on trial steps."""
        j = self.trial(step)
        if j is not None:
            self._rows.append((j, seconds, bytes_sent, payload_bytes))

    # ------------------------------------------------------------------ agreement
    def decide(self, comm: Any, plans: Sequence[BucketPlan]) -> WireDecision:
        """The agreement of the module docstring over ``comm`` (a refit ``Comm``); every rank
        returns and keeps the root's decision, effective from :attr:`decision_step`."""
        if self.start is None:
            raise ValueError("decide() before any step: call coding() on every exchanged step")
        step, layout = int(self.decision_step), plans_digest(plans)
        if comm.size <= 1:
            decision = WireDecision(step, layout, tuple(
                WireChoice("fixed", p.mode) for p in plans), True)
        else:
            mine = np.full((self.measure_steps, ROW), np.nan, dtype=np.float64)
            for row in self._rows[:self.measure_steps]:
                mine[int(row[0])] = row
            every = comm.allgather(mine.reshape(-1), name=f"aq.wire.trials.{self.name}")
            message = np.zeros(HEAD + PER_BUCKET * len(plans), dtype=np.float64)
            if comm.rank == 0:
                message = self._root(np.asarray(every, dtype=np.float64).reshape(
                    comm.size, self.measure_steps, ROW), plans, step, layout).to_array()
            message = comm.broadcast(message, root=0, name=f"aq.wire.decision.{self.name}")
            decision = WireDecision.from_array(message)
        self.decision = decision
        self._rows.clear()
        return decision

    def _root(self, rows: np.ndarray, plans: Sequence[BucketPlan], step: int,
              layout: int) -> WireDecision:
        """The trials of every rank ([P, C·k, ROW]) → the decision, logged; any failure is
        the fallback decision."""
        try:
            with warnings.catch_warnings():   # steps no rank timed stay NaN (dropped below)
                warnings.simplefilter("ignore", RuntimeWarning)
                seconds = np.nanmax(rows[:, :, 1], axis=0)       # a step: its slowest rank
                sent = np.nansum(rows[:, :, 2], axis=0)          # bytes of every rank
                payload = np.nanmean(rows[:, :, 3], axis=0)      # one rank's payload bytes
            wires = self.candidates
            count = len(wires)
            trials = []
            for c in range(count):
                steps = [j for j in range(self.measure_steps)
                         if j % count == c and np.isfinite(seconds[j])]
                trials.append(Trials(tuple(float(seconds[j]) for j in steps),
                                     tuple(float(sent[j]) for j in steps)))
            chosen, why = choose(trials)
            numel = sum(p.numel for p in plans)
            bits = 8.0 * float(np.mean([payload[j] for j in range(self.measure_steps)
                                        if j % count == chosen])) / max(1, numel)
            wire = wires[chosen]
            choice = WireChoice(wire.coding, wire.mode, trials[chosen].time, trials[0].time,
                                bits)
            logger.info(
                "horovod_aq: %s: wire from step %d: %s/%s for every bucket, %.4g s per step, "
                "%.3g bits/coordinate: %s; trials (faster half of %d steps, slowest rank; bytes "
                "sent by all ranks per step): %s", self.name, step, wire.coding, wire.mode,
                choice.seconds, bits, why, self.trials, "; ".join(
                    f"{w.coding}/{w.mode} {t.time:.4g} s {t.bytes / 1e6:.4g} MB"
                    for w, t in zip(wires, trials)))
            return WireDecision(step, layout, tuple(choice for _ in plans), True)
        except Exception as exc:  # noqa: BLE001 - any failure gives every rank the fallback
            logger.warning("horovod_aq: the wire choice failed on the root, every rank keeps "
                           "fixed codes and the planned modes: %s", exc)
            return WireDecision(step, layout, tuple(WireChoice("fixed", p.mode) for p in plans),
                                False)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The setting, the schedule's anchor and the decision vector (None: undecided)."""
        return {"wire": self.wire, "start": self.start if self.decision is not None else None,
                "decision": None if self.decision is None else self.decision.to_array().tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a decision; without one (or saved under another ``wire``, or in an older
        format) the measurement restarts at the first step after the resume."""
        self.start, self.decision = None, None
        self._rows.clear()
        if state.get("wire") != self.wire:
            logger.info("horovod_aq: the checkpoint's wire=%r differs from wire=%r: measuring "
                        "again", state.get("wire"), self.wire)
            return
        if state.get("decision") is not None:
            try:
                self.decision = WireDecision.from_array(state["decision"])
            except ValueError as exc:
                logger.info("horovod_aq: the checkpoint's wire decision is not this version's "
                            "(%s): measuring again", exc)
                return
            self.start = state.get("start")


__all__ = ["AutoWire", "DECISION_FORMAT", "ROW", "TRIALS", "WARMUP_STEPS", "WireDecision",
           "plans_digest", "with_modes"]
