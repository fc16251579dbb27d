"""``wire="auto"``: when the wire is measured, who decides, and when the decision takes effect
(docs/protocol.md §5.5). Every rank runs the same schedule, a function of the global step:

===========================================  ===================================================
steps (s = first exchanged step)             what the wire does
===========================================  ===================================================
s … s + W − 1            (warm-up)           fixed codes, nothing recorded (compiles, allocators)
s + W … s + W + K − 1    (measurement)       bucket i at step t sends ``MEASURE_CODINGS[(t + i)
                                             mod 2]``, so every step and every bucket has both
                                             codings; collectives, codec calls and entropy
                                             payload sizes are recorded
end of step s + W + K − 1 (the boundary)     :meth:`AutoWire.decide`: agreement (below)
s + W + K …                                  the decided (coding, mode) of every bucket
===========================================  ===================================================

**Agreement** (the refit protocol's shape, refit.py): one allgather of every rank's sample count
(int64), one allgather of the samples padded to the largest count (float64 rows, NaN padding),
the fit and the choice on rank 0 (:mod:`.link`, :mod:`.choice`), one broadcast of the decision
(:class:`WireDecision` as a float64 vector). Every rank installs exactly the root's vector, so
every rank takes the same path; a failure on the root is broadcast as a fallback decision (fixed
codes, the planned modes). Rank 0 logs one line per decision. The decision is part of
:meth:`AutoWire.state_dict`, so a resumed job keeps it; an unfinished measurement restarts at
the first step after the resume.

A bucket's entropy size is the *largest* over ranks of each rank's median body bits per
coordinate h (a ring allgather's round waits for its largest block).
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from horovod_aq.packed.choice import (
    MODES,
    WIRES,
    WireChoice,
    body_bits,
    choose_wires,
)
from horovod_aq.packed.link import (
    CODINGS,
    KINDS,
    OPERATIONS,
    CodecSample,
    LinkModel,
    LinkSample,
    fit_codec,
    fit_link,
)
from horovod_aq.packed.plan import BucketPlan

logger = logging.getLogger(__name__)

#: Warm-up steps W before measuring: the first steps compile kernels (Triton, TF graphs) and
#: grow allocators, so their times are not the link's.
WARMUP_STEPS = 2
#: Measurement steps K: each bucket sends each coding K/2 times.
MEASURE_STEPS = 8
#: The coding of bucket i at measurement step t is MEASURE_CODINGS[(t + i) % 2].
MEASURE_CODINGS = ("fixed", "entropy")
#: Most sample rows a rank keeps (5 float64 each: 160 kB in the agreement's allgather).
MAX_SAMPLE_ROWS = 4096
#: Row tags of the gathered samples: a collective, a codec call, an entropy payload's size.
TAG_LINK, TAG_CODEC, TAG_SIZE = 0.0, 1.0, 2.0
ROW = 5
#: First slot of the decision vector (its format), and its status values.
DECISION_FORMAT = 1.0
DECIDED, FALLBACK = 1.0, 0.0
HEAD = 10  # format, status, step, layout, α, β, identified, clamped, classes, buckets
PER_BUCKET = 5  # coding, mode, seconds, fixed seconds, bits per coordinate


def plans_digest(plans: Sequence[BucketPlan]) -> int:
    """CRC-32 of the buckets' names and sizes (not their modes, which a decision changes)."""
    return zlib.crc32(repr([(b.name, b.numel) for b in plans]).encode()) & 0xFFFFFFFF


@dataclass(frozen=True)
class WireDecision:
    """The agreed wire of every bucket from ``step`` on, for the plans of digest ``layout``.

    ``decided``: False for the fallback (the root could not fit: fixed codes, planned modes);
    ``link``: the fitted model (None when nothing was fitted)."""

    step: int
    layout: int
    choices: tuple[WireChoice, ...]
    link: LinkModel | None
    decided: bool = True

    def to_array(self) -> np.ndarray:
        """The broadcast vector: HEAD slots, then PER_BUCKET per bucket."""
        head = [DECISION_FORMAT, DECIDED if self.decided else FALLBACK, self.step, self.layout]
        link = self.link
        head += ([link.latency, link.bandwidth, link.identified, link.clamped, link.classes]
                 if link is not None else [np.nan] * 5)
        head.append(len(self.choices))
        body = [[CODINGS.index(c.coding), MODES.index(c.mode), c.seconds, c.fixed_seconds,
                 c.bits_per_coordinate] for c in self.choices]
        return np.concatenate([np.array(head, dtype=np.float64),
                               np.array(body, dtype=np.float64).reshape(-1)])

    @classmethod
    def from_array(cls, array: Any) -> WireDecision:
        a = np.asarray(array, dtype=np.float64).reshape(-1)
        if a.size < HEAD or a[0] != DECISION_FORMAT or a.size != HEAD + PER_BUCKET * int(a[9]):
            raise ValueError(f"not a wire decision vector (format {DECISION_FORMAT:g}, "
                             f"{HEAD} + {PER_BUCKET}·buckets values): {a.size} values")
        link = None if np.isnan(a[4]) else LinkModel(float(a[4]), float(a[5]), bool(a[6]),
                                                     bool(a[7]), int(a[8]))
        rows = a[HEAD:].reshape(-1, PER_BUCKET)
        choices = tuple(WireChoice(CODINGS[int(r[0])], MODES[int(r[1])], float(r[2]),
                                   float(r[3]), float(r[4])) for r in rows)
        return cls(int(a[2]), int(a[3]), choices, link, a[1] == DECIDED)

    def describe(self, plans: Sequence[BucketPlan]) -> str:
        """The one log line of this decision."""
        link = self.link
        head = (f"horovod_aq: wire from step {self.step}: "
                + (f"link α = {link.latency * 1e6:.1f} µs, β = {link.bandwidth * 8 / 1e9:.3g} "
                   f"Gbit/s ({link.note})" if link is not None else "no link model")
                + ("" if self.decided else " [fallback: the root could not fit]"))
        buckets = [f"{p.name} ({p.numel}): {c.coding}/{c.mode} {c.bits_per_coordinate:.2f} "
                   f"bits/coord, {c.seconds * 1e3:.3g} ms (fixed {c.fixed_seconds * 1e3:.3g} ms)"
                   for p, c in zip(plans, self.choices)]
        return head + "; " + "; ".join(buckets)


def with_modes(plans: Sequence[BucketPlan], decision: WireDecision) -> list[BucketPlan]:
    """The plans with the decided modes (the layout changes: re-plan at the step boundary)."""
    if plans_digest(plans) != decision.layout or len(plans) != len(decision.choices):
        raise ValueError("this wire decision was made for other buckets; restart the "
                         "measurement (AutoWire.restart) after a re-plan")
    return [dataclasses.replace(p, mode=c.mode) for p, c in zip(plans, decision.choices)]


class AutoWire:
    """The schedule, samples and decision of ``wire`` ("auto", or a forced coding) of one
    exchange (module docstring). ``name`` makes the agreement's collective names unique and
    rank-independent (e.g. the exchange key)."""

    __slots__ = ("wire", "warmup_steps", "measure_steps", "name", "start", "decision",
                 "_rows", "_dropped")

    def __init__(self, wire: str = "auto", *, warmup_steps: int = WARMUP_STEPS,
                 measure_steps: int = MEASURE_STEPS, name: str = "wire") -> None:
        if wire not in WIRES:
            raise ValueError(f"wire must be one of {WIRES}, got {wire!r}")
        if warmup_steps < 0 or measure_steps < 2:
            raise ValueError("warmup_steps must be >= 0 and measure_steps >= 2 (both codings "
                             f"are measured), got {warmup_steps} and {measure_steps}")
        self.wire = wire
        self.warmup_steps = int(warmup_steps)
        self.measure_steps = int(measure_steps)
        self.name = name
        self.start: int | None = None
        self.decision: WireDecision | None = None
        self._rows: list[tuple[float, ...]] = []
        self._dropped = 0

    # ------------------------------------------------------------------ schedule
    def begin(self, step: int) -> None:
        """Anchor the schedule at the first exchanged step (the same on every rank)."""
        if self.start is None:
            self.start = int(step)

    def restart(self, step: int) -> None:
        """Forget the decision and samples; measure again from ``step`` (after a re-plan)."""
        self.start, self.decision = int(step), None
        self._rows.clear()

    @property
    def decision_step(self) -> int | None:
        """The first step of the decided wire: s + W + K."""
        return None if self.start is None else self.start + self.warmup_steps + self.measure_steps

    def measuring(self, step: int) -> bool:
        """Whether ``step`` is a measurement step."""
        if self.wire != "auto" or self.decision is not None or self.start is None:
            return False
        first = self.start + self.warmup_steps
        return first <= step < first + self.measure_steps

    def due(self, step: int) -> bool:
        """Whether :meth:`decide` runs at the end of ``step``."""
        end = self.decision_step
        return (self.wire == "auto" and self.decision is None and end is not None
                and step >= end - 1)

    def coding(self, step: int, index: int) -> str:
        """The coding bucket ``index`` sends at ``step`` (anchors the schedule on first use)."""
        self.begin(step)
        if self.wire != "auto":
            return self.wire
        if self.decision is not None and step >= self.decision.step:
            return self.decision.choices[index].coding
        if self.measuring(step):
            return MEASURE_CODINGS[(step + index) % 2]
        return "fixed"

    def mode(self, step: int, index: int, planned: str) -> str:
        """The mode of bucket ``index`` at ``step``: the decided one, else ``planned``."""
        if self.decision is not None and step >= self.decision.step:
            return self.decision.choices[index].mode
        return planned

    # ------------------------------------------------------------------ samples
    def _keep(self, step: int, make: Any, row: tuple[float, ...]) -> None:
        if not self.measuring(step):
            return
        try:
            make()
        except ValueError as exc:
            self._drop(f"invalid sample dropped: {exc}")
            return
        if len(self._rows) >= MAX_SAMPLE_ROWS:
            self._drop(f"more than {MAX_SAMPLE_ROWS} samples on this rank, later ones dropped")
            return
        self._rows.append(row)

    def _drop(self, why: str) -> None:
        # A bad sample must not raise on one rank while the others go on into a collective.
        if not self._dropped:
            logger.warning("horovod_aq: wire measurement: %s", why)
        self._dropped += 1

    def record_collective(self, step: int, kind: str, nbytes: float, ranks: int,
                          seconds: float) -> None:
        """A collective of a measurement step (:class:`~.link.LinkSample`); ignored on other
        steps, dropped with one warning when invalid."""
        self._keep(step, lambda: LinkSample(kind, nbytes, ranks, seconds),
                   (TAG_LINK, KINDS.index(kind) if kind in KINDS else -1, nbytes, ranks,
                    seconds))

    def record_codec(self, step: int, coding: str, operation: str, coordinates: float,
                     seconds: float) -> None:
        """One encode or decode call (:class:`~.link.CodecSample`)."""
        self._keep(step, lambda: CodecSample(coding, operation, coordinates, seconds),
                   (TAG_CODEC, CODINGS.index(coding) if coding in CODINGS else -1,
                    OPERATIONS.index(operation) if operation in OPERATIONS else -1,
                    coordinates, seconds))

    def record_payload(self, step: int, index: int, numel: int, nbytes: int,
                       bits: int) -> None:
        """The size of one payload bucket ``index`` sent entropy-coded (``numel``: the
        coordinates of that payload — the bucket, or a two-phase chunk)."""
        def check() -> None:
            if index < 0 or numel <= 0 or nbytes <= 0 or not 1 <= bits <= 8:
                raise ValueError(f"payload sample needs index >= 0, numel > 0, bytes > 0 and "
                                 f"bits in 1..8, got {(index, numel, nbytes, bits)}")
        self._keep(step, check, (TAG_SIZE, index, numel, nbytes, bits))

    # ------------------------------------------------------------------ agreement
    def decide(self, comm: Any, plans: Sequence[BucketPlan], *, bits: int, bucket_size: int,
               num_levels: int, exchange: str = "auto") -> WireDecision:
        """The agreement of the module docstring over ``comm`` (a refit ``Comm``); every rank
        returns and keeps the root's decision, effective from :attr:`decision_step`."""
        if self.start is None:
            raise ValueError("decide() before any step: call coding() on every exchanged step")
        step, layout = int(self.decision_step), plans_digest(plans)
        if comm.size <= 1:
            decision = WireDecision(step, layout, tuple(
                WireChoice("fixed", "allgather") for _ in plans), None, True)
        else:
            rows = self._gathered(comm)
            message = np.zeros(HEAD + PER_BUCKET * len(plans), dtype=np.float64)
            if comm.rank == 0:
                message = self._root(rows, plans, comm.size, step, layout, bits=bits,
                                     bucket_size=bucket_size, num_levels=num_levels,
                                     exchange=exchange).to_array()
            message = comm.broadcast(message, root=0, name=f"aq.wire.decision.{self.name}")
            decision = WireDecision.from_array(message)
        self.decision = decision
        self._rows.clear()
        if comm.rank == 0:
            logger.info("%s", decision.describe(plans))
        return decision

    def _gathered(self, comm: Any) -> list[np.ndarray]:
        """Every rank's sample rows ([count, ROW] each), by rank."""
        counts = comm.allgather(np.array([len(self._rows)], dtype=np.int64),
                                name=f"aq.wire.count.{self.name}").reshape(-1)
        longest = int(counts.max())
        mine = np.full((longest, ROW), np.nan, dtype=np.float64)
        if self._rows:
            mine[:len(self._rows)] = np.array(self._rows, dtype=np.float64)
        every = comm.allgather(mine.reshape(-1), name=f"aq.wire.samples.{self.name}")
        every = np.asarray(every, dtype=np.float64).reshape(comm.size, longest, ROW)
        return [every[r, :int(counts[r])] for r in range(comm.size)]

    def _root(self, rows: list[np.ndarray], plans: Sequence[BucketPlan], ranks: int, step: int,
              layout: int, **kw: Any) -> WireDecision:
        """Fit and choose on the root; any failure is the fallback decision."""
        try:
            link, codec, hs = unpack_samples(rows, len(plans), bits=kw["bits"],
                                             bucket_size=kw["bucket_size"],
                                             num_levels=kw["num_levels"])
            choices = choose_wires([p.numel for p in plans], hs, ranks=ranks, link=link,
                                   codec=codec, wire="auto", **kw)
            return WireDecision(step, layout, tuple(choices), link, True)
        except Exception as exc:  # noqa: BLE001 - any failure gives every rank the fallback
            logger.warning("horovod_aq: the wire choice failed on the root, every rank keeps "
                           "fixed codes and the planned modes: %s", exc)
            return WireDecision(step, layout, tuple(WireChoice("fixed", p.mode) for p in plans),
                                None, False)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The setting, the schedule's anchor and the decision vector (None: undecided)."""
        return {"wire": self.wire, "start": self.start if self.decision is not None else None,
                "decision": None if self.decision is None else self.decision.to_array().tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a decision; without one (or saved under another ``wire``) the measurement
        restarts at the first step after the resume."""
        self.start, self.decision = None, None
        self._rows.clear()
        if state.get("wire") != self.wire:
            logger.info("horovod_aq: the checkpoint's wire=%r differs from wire=%r: measuring "
                        "again", state.get("wire"), self.wire)
            return
        if state.get("decision") is not None:
            self.decision = WireDecision.from_array(state["decision"])
            self.start = state.get("start")


def unpack_samples(rows: Sequence[np.ndarray], buckets: int, *, bits: int, bucket_size: int,
                   num_levels: int) -> tuple[LinkModel, Any, list[float | None]]:
    """(link model, codec costs, h per bucket) from every rank's sample rows. h of a bucket:
    the largest over ranks of each rank's median body bits per coordinate at ``bits`` (None:
    no entropy payload of the bucket was measured)."""
    all_rows = np.concatenate([np.asarray(r, dtype=np.float64).reshape(-1, ROW) for r in rows])
    link = fit_link(LinkSample(KINDS[int(r[1])], r[2], int(r[3]), r[4])
                    for r in all_rows if r[0] == TAG_LINK)
    codec = fit_codec(CodecSample(CODINGS[int(r[1])], OPERATIONS[int(r[2])], r[3], r[4])
                      for r in all_rows if r[0] == TAG_CODEC)
    hs: list[float | None] = []
    for i in range(buckets):
        per_rank = []
        for mine in rows:
            h = [body_bits(int(r[2]), int(r[3]), bits, bucket_size, num_levels)
                 for r in np.asarray(mine).reshape(-1, ROW)
                 if r[0] == TAG_SIZE and int(r[1]) == i and int(r[4]) == bits]
            if h:
                per_rank.append(float(np.median(h)))
        hs.append(max(per_rank) if per_rank else None)
    return link, codec, hs
