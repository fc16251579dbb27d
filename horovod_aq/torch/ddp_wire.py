"""How one payload exchange of the DDP hook travels over ``torch.distributed``.

A :class:`Unit` is one fused gradient vector exchanged as one payload stream: a DDP
``GradBucket`` — or, in the first step after a resume, one of the saved buckets inside DDP's
initial bucket (:mod:`horovod_aq.torch.ddp`). :class:`Wire` moves units through the stages of
docs/protocol.md §5 with the packed kernels; every per-rank decision (cost model, names,
non-finite message) is :mod:`horovod_aq.packed`'s.

* **allgather** (§5.1): encode with the stream of (seed, rank, step, bucket, part 0), one async
  ``all_gather`` of the uint8 payloads, then — in the work's future callback, overlapping the
  rest of the backward pass — check the flags bytes and ``decode_average`` the P rows.
* **two-phase** (§5.2): pad to P chunks of whole quantization buckets, encode chunk k with part
  k, one async ``all_to_all_single``; :meth:`Wire.advance` (called by the hook at the next bucket
  or at the end of the step, never from a callback) decodes and averages chunk r, re-encodes it
  with part P and starts the ``all_gather``, whose callback decodes all P chunks.
* **allreduce**: compressors that do not quantize (``NoCompression``, ``FP16``) average with
  one ``all_reduce`` (fp16 on the wire for ``FP16``), divided by P first.

``torch.distributed`` pairs collectives by the order a group issues them, so every collective is
issued from the hook itself (the autograd thread), in bucket order, never from a callback:
callbacks only decode. A rank whose gradient is not finite sends a non-finite marker of the
payload's size (one per allgather, P copies for a two-phase alltoall, §4), so every rank sees the
same flags and acts alike. Errors found in a callback are kept on the unit and raised by
:meth:`Wire.finish` in the hook, at the same point on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from horovod_aq import codec
from horovod_aq.codec.stream import StreamKey
from horovod_aq.packed.cost import chunk_numel
from horovod_aq.packed.plan import BucketPlan
from horovod_aq.packed.protocol import first_unsendable, nonfinite_message, norm_may_overflow
from horovod_aq.torch import kernels
from horovod_aq.torch.dist_comm import all_gather_flat, group_or_world

#: The exchange mode of a unit whose compressor does not quantize.
ALLREDUCE = "allreduce"


@dataclasses.dataclass(eq=False)
class Unit:
    """One exchanged vector: its plan, its parameters and where they sit in the DDP buffer."""

    plan: BucketPlan
    names: tuple[str, ...]
    numels: tuple[int, ...]
    #: (offset, numel) of each parameter in the DDP bucket's buffer, in unit order; None: the
    #: unit is the whole buffer.
    segments: tuple[tuple[int, int], ...] | None = None
    stage: str = "idle"            # idle → (a2a →) ag | ag2 | ar → done
    work: Any = None
    received: torch.Tensor | None = None
    future: Any = None
    table: Any = None
    result: torch.Tensor | None = None
    error: BaseException | None = None
    skipped: bool = False

    @property
    def index(self) -> int:
        return self.plan.index

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def numel(self) -> int:
        return self.plan.numel

    @property
    def mode(self) -> str:
        return self.plan.mode

    def gather(self, buffer: torch.Tensor) -> torch.Tensor:
        """This unit's float32 input out of the bucket buffer (a view when it is the buffer)."""
        flat = buffer if self.segments is None else torch.cat(
            [buffer[o:o + n] for o, n in self.segments])
        return flat.float()

    def scatter(self, buffer: torch.Tensor, result: torch.Tensor) -> None:
        """Write the averaged ``result`` back where the unit's parameters sit in ``buffer``."""
        if self.segments is None:
            buffer.copy_(result)
            return
        at = 0
        for o, n in self.segments:
            buffer[o:o + n].copy_(result[at:at + n])
            at += n

    def param_at(self, element: int | None) -> str | None:
        """The parameter holding element ``element`` of the unit (None if unknown)."""
        if element is None:
            return None
        at = 0
        for name, n in zip(self.names, self.numels):
            if at <= element < at + n:
                return name
            at += n
        return None


class Wire:
    """The stages of one unit's exchange on one process group (see the module docstring)."""

    def __init__(self, compression: Any, group: Any = None) -> None:
        self.compression = compression
        self.q = compression.quantizer
        self.memory = compression.error_memory
        self.group = group_or_world(group)
        self.ranks = dist.get_world_size(self.group)
        #: The global rank keys the random stream, as on the Horovod paths (docs/format.md §6).
        self.rank = dist.get_rank()
        #: The rank within the group: which two-phase chunk this rank averages.
        self.group_rank = dist.get_rank(self.group)

    # ------------------------------------------------------------------ submission
    def submit(self, unit: Unit, raw: torch.Tensor) -> None:
        """Encode ``raw`` (the unit's float32 gradient) and start its first collective."""
        if unit.mode == ALLREDUCE:
            self._allreduce(unit, raw)
            return
        q, ef, P = self.q, self.memory, self.ranks
        unit.table = q.table
        first_bad = kernels.first_nonfinite(raw)
        if first_bad is not None:
            self._send_marker(unit, first_bad, raw.device)
            return
        x = ef.compensate(unit.name, raw) if ef is not None else raw      # g + α·h
        bad = self._first_unsendable(x, unit)
        if bad is not None:   # finite values whose bucket norm overflows float32: like NaN
            self._send_marker(unit, bad, raw.device)
            return
        if q.recording:
            q.record_stats(*kernels.bucket_moments(x, q.bucket_size),
                           histogram=kernels.normalized_histogram(x, q.bucket_size)
                           if q.wants_histogram else None)
        if unit.mode == "allgather":
            payload = self._encode(x, unit, 0)
            if ef is not None:   # h ← β·h + (g − g̃), g̃ = what this rank sent
                ef.update(unit.name, raw, kernels.decode(payload, unit.table))
            self._all_gather(unit, payload, "ag")
            return
        m = chunk_numel(unit.numel, P, q.bucket_size)
        padded = torch.zeros(P * m, dtype=torch.float32, device=x.device)
        padded[:unit.numel] = x
        chunks = [self._encode(chunk, unit, k) for k, chunk in enumerate(padded.view(P, m))]
        if ef is not None:
            sent = torch.cat([kernels.decode(c, unit.table) for c in chunks])[:unit.numel]
            ef.update(unit.name, raw, sent)
        self._all_to_all(unit, torch.cat(chunks))

    def _first_unsendable(self, x: torch.Tensor, unit: Unit) -> int | None:
        """The first element of a quantization bucket whose norm does not fit a float32
        (``packed.protocol.first_unsendable``), or None. Only looked at when
        ``norm_may_overflow``."""
        q = self.q
        B = q.bucket_size
        if not x.numel() or not norm_may_overflow(float(x.abs().max()), B):
            return None
        if unit.mode != "two_phase":
            bad = first_unsendable(kernels.bucket_norms(x, B, q.norm).cpu().numpy())
            return None if bad is None else bad * B
        m = chunk_numel(unit.numel, self.ranks, B)
        for k in range(self.ranks):
            chunk = x[k * m:(k + 1) * m]
            bad = first_unsendable(kernels.bucket_norms(chunk, B, q.norm).cpu().numpy()) \
                if chunk.numel() else None
            if bad is not None:
                return k * m + bad * B
        return None

    def _encode(self, x: torch.Tensor, unit: Unit, part: int) -> torch.Tensor:
        q = self.q
        key = StreamKey(q.seed, self.rank, q.step, unit.index, part)
        return kernels.encode(x, unit.table, bucket_size=q.bucket_size, norm=q.norm, key=key,
                              checksum=q.checksum)

    def _send_marker(self, unit: Unit, first_bad: int, device: torch.device) -> None:
        q, P = self.q, self.ranks
        two_phase = unit.mode == "two_phase"
        numel = chunk_numel(unit.numel, P, q.bucket_size) if two_phase else unit.numel
        marker = torch.from_numpy(codec.nonfinite_payload(
            numel, unit.table, q.bucket_size, q.norm, first_bad)).to(device)
        if two_phase:
            self._all_to_all(unit, marker.repeat(P))
        else:
            self._all_gather(unit, marker, "ag")

    def _all_gather(self, unit: Unit, payload: torch.Tensor, stage: str) -> None:
        out = torch.empty(self.ranks * payload.numel(), dtype=torch.uint8, device=payload.device)
        work = all_gather_flat(out, payload, self.group, async_op=True)
        unit.stage = stage
        unit.future = work.get_future().then(lambda _: self._guarded(unit, out))

    def _all_to_all(self, unit: Unit, payloads: torch.Tensor) -> None:
        unit.received = torch.empty_like(payloads)
        unit.work = dist.all_to_all_single(unit.received, payloads, group=self.group,
                                           async_op=True)
        unit.stage = "a2a"

    def _allreduce(self, unit: Unit, raw: torch.Tensor) -> None:
        wire = raw.to(torch.float16) if self.compression.fp16_wire else raw.clone()
        wire.div_(self.ranks)
        work = dist.all_reduce(wire, group=self.group, async_op=True)
        unit.stage = "ar"

        def done(_: Any) -> None:
            unit.result = wire.float()
        unit.future = work.get_future().then(done)

    # ------------------------------------------------------------------ later stages
    def advance(self, unit: Unit) -> None:
        """Two-phase stage 2, in the hook: wait for the alltoall, decode and average chunk r,
        re-encode it (part P) and start the allgather of the averaged chunks."""
        if unit.stage != "a2a":
            return
        unit.work.wait()
        rows = unit.received.view(self.ranks, -1)
        unit.work, unit.received = None, None
        if self._nonfinite(unit, rows):
            return
        q = self.q
        m = chunk_numel(unit.numel, self.ranks, q.bucket_size)
        chunk = kernels.decode_average(rows, unit.table, numel=m, bucket_size=q.bucket_size,
                                       norm=q.norm)
        # a chunk ending in the unit's zero padding: send exact zeros there, not the padding's
        # decoded noise (it would inflate the re-encoded norm; docs/protocol.md §15)
        chunk[min(max(unit.numel - self.group_rank * m, 0), m):] = 0.0
        self._all_gather(unit, self._encode(chunk, unit, self.ranks), "ag2")

    def _guarded(self, unit: Unit, gathered: torch.Tensor) -> None:
        """The allgather callback: decode, keeping any error for :meth:`finish`."""
        try:
            self._decode_gathered(unit, gathered.view(self.ranks, -1))
        except BaseException as exc:  # noqa: BLE001 - raised again by finish(), in the hook
            unit.error = exc

    def _decode_gathered(self, unit: Unit, rows: torch.Tensor) -> None:
        q = self.q
        if unit.stage == "ag":
            if self._nonfinite(unit, rows):
                return
            unit.result = kernels.decode_average(rows, unit.table, numel=unit.numel,
                                                 bucket_size=q.bucket_size, norm=q.norm)
        else:
            m = chunk_numel(unit.numel, self.ranks, q.bucket_size)
            parts = [kernels.decode(row, unit.table, numel=m, bucket_size=q.bucket_size,
                                    norm=q.norm) for row in rows]
            unit.result = torch.cat(parts)[:unit.numel]
        unit.stage = "done"

    def _nonfinite(self, unit: Unit, rows: torch.Tensor) -> bool:
        """Markers among ``rows``: raise naming the first flagged rank and the parameter (every
        marker, also each two-phase chunk's, carries the index of the first bad element of the
        whole unit), or with nonfinite="skip" give the unit a NaN result."""
        bad = codec.nonfinite_rows(rows[:, codec.FLAGS_OFFSET].cpu().numpy())
        if not bad:
            return False
        if self.compression.nonfinite == "skip":
            unit.result = torch.full((unit.numel,), float("nan"), device=rows.device)
            unit.skipped = True
            unit.stage = "done"
            return True
        rank = bad[0]
        where = codec.parse_header(rows[rank, :codec.HEADER_SIZE].cpu().numpy()).first_nonfinite
        raise codec.NonFiniteGradientError(
            nonfinite_message(rank, unit.param_at(where), unit.name), where)

    def finish(self, unit: Unit) -> torch.Tensor:
        """The unit's averaged float32 gradient (waits; raises what a callback kept)."""
        self.advance(unit)
        if unit.future is not None:
            unit.future.wait()
            unit.future = None
        if unit.error is not None:
            raise unit.error
        if unit.result is None:
            raise RuntimeError(f"bucket {unit.name} finished without a result (stage "
                               f"{unit.stage})")
        return unit.result


__all__ = ["ALLREDUCE", "Unit", "Wire"]
