"""``horovod_aq.torch.DistributedOptimizer``: Horovod's optimizer with bit-packed gradient exchange.

Built on Horovod's own machinery (its AccumulateGrad hooks, ``backward_passes_per_step`` delays,
``synchronize``/``skip_synchronize``/``zero_grad`` checks) without patching Horovod: the class is
created at run time like ``hvd.DistributedOptimizer`` does (base = the user's optimizer class,
attributes = Horovod's ``_DistributedOptimizer`` overlaid with :class:`_PackedOptimizer`), and
only the submission of a gradient and the end of ``synchronize`` are replaced.

Exchange (DESIGN.md, ``horovod.md`` §5):

* Parameters are fused into **buckets** in reverse registration order (≈ backward order), at
  most ``fusion_bytes`` of fp32 each, one device per bucket. A parameter's hook copies its
  gradient into its bucket; the bucket is encoded and submitted as soon as its last gradient
  arrived, so communication overlaps the rest of the backward pass.
* A bucket travels as one named uint8 collective: ``allgather`` ("aq.ag.<bucket>"; every rank
  decodes all P payloads in rank order and averages) or the **two-phase** exchange
  ("aq.a2a.<bucket>": alltoall of P chunks, decode and average chunk r, re-encode, then
  "aq.ag.<bucket>" allgather of the averaged chunks). ``exchange="auto"`` picks per bucket with
  the cost model of :mod:`horovod_aq.exchange`. Both give bitwise-identical gradients on every
  rank.
* Parameters below ``small_tensor_threshold`` elements (and all of them for NoCompression/FP16)
  go through a named Horovod allreduce ("aq.ar.<param>"), fp16 for :class:`~horovod_aq.FP16`.
* At the first exchange the ranks compare settings, level table, step and bucket layout with one
  allgather ("aq.handshake.<k>") and all fail with the same message on a mismatch — no hang.
* After each ``synchronize`` the compressor's ``end_step`` runs the refit protocol when its
  schedule says so (stats gathered to rank 0, fitted, broadcast; mpi4py under the MPI
  controller) and telemetry records the step.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch
from horovod.torch.mpi_ops import (
    Average,
    allgather_async,
    allreduce_async_,
    alltoall_async,
    poll,
    synchronize,
)
from horovod.torch.optimizer import _DistributedOptimizer as _HorovodOptimizer

from horovod_aq import codec
from horovod_aq.compressors import Compressor, NoCompression
from horovod_aq.error_feedback import ErrorFeedback
from horovod_aq.exchange import (
    DEFAULT_FUSION_BYTES,
    BucketPlan,
    NetworkModel,
    bytes_sent,
    chunk_numel,
    layout_digest,
    plan_buckets,
    resolve_exchange,
)
from horovod_aq.sync import ConfigMismatchError, check_handshake, handshake_vector
from horovod_aq.telemetry import StepRecord, Telemetry
from horovod_aq.torch import kernels
from horovod_aq.torch.comm import comm_for
from horovod_aq.torch.stock import torch_state

logger = logging.getLogger(__name__)

_optimizer_counter = itertools.count()
#: Poll interval bounds (seconds) while waiting for a collective; see ``wait``.
WAIT_POLL_MIN_S = 20e-6
WAIT_POLL_MAX_S = 1e-3


def wait(handle: Any) -> Any:
    """``synchronize(handle)`` without spinning on a core.

    Horovod 0.28.1's ``synchronize`` (``WaitAndClear`` in ``horovod/torch/mpi_ops_v2.cc``) loops
    on ``std::this_thread::yield()`` until the collective finishes, so a rank waiting for a slow
    network keeps a core busy; where ranks share cores (several ranks per CPU host) that time
    is taken from the ranks still encoding or decoding. Here the wait polls with a sleep that
    doubles from ``WAIT_POLL_MIN_S`` up to ``WAIT_POLL_MAX_S`` (at most ~1 ms of added latency),
    then calls ``synchronize``, which returns at once (and raises the collective's error).
    """
    delay = WAIT_POLL_MIN_S
    while not poll(handle):
        time.sleep(delay)
        delay = min(2 * delay, WAIT_POLL_MAX_S)
    return synchronize(handle)


class _Bucket:
    """A fused group of parameters exchanged as one payload, and its in-flight state."""

    def __init__(self, plan: BucketPlan, params: list[torch.Tensor]) -> None:
        self.index, self.name, self.mode, self.numel = plan.index, plan.name, plan.mode, plan.numel
        self.params = params
        self.slots: dict[torch.Tensor, tuple[int, int]] = {}
        offset = 0
        for p in params:
            self.slots[p] = (offset, p.numel())
            offset += p.numel()
        self.buffer = torch.zeros(self.numel, dtype=torch.float32, device=params[0].device)
        self.padded: torch.Tensor | None = None   # two-phase: buffer + zeros to P equal chunks
        self.arrived: set[torch.Tensor] = set()
        self.stage = "idle"           # idle → (a2a →) ag | ag2 → done
        self.handle: Any = None
        self.result: torch.Tensor | None = None

    def reset(self) -> None:
        self.arrived.clear()
        self.stage, self.handle, self.result = "idle", None, None


class _PackedOptimizer(torch.optim.Optimizer):
    """Methods overlaid on Horovod's ``_DistributedOptimizer`` (see the module docstring)."""

    def __init__(self, params, named_parameters, compression: Compressor, *,
                 backward_passes_per_step: int, process_set: hvd.ProcessSet, exchange: str,
                 fusion_bytes: int, small_tensor_threshold: int, sparse_as_dense: bool,
                 network: NetworkModel, telemetry: Telemetry | None) -> None:
        self._aq = compression
        self._aq_exchange = exchange
        self._aq_network = network
        self._aq_telemetry = telemetry if telemetry is not None else Telemetry()
        self._aq_index = next(_optimizer_counter)
        self._aq_checked = False
        self._aq_skip = False
        self._aq_record: StepRecord | None = None
        _HorovodOptimizer.__init__(
            self, params, named_parameters, compression=hvd.Compression.none,
            backward_passes_per_step=backward_passes_per_step, op=Average,
            gradient_predivide_factor=1.0, groups=None, sparse_as_dense=sparse_as_dense,
            process_set=process_set)
        self._aq_active = bool(self._requires_update)
        self._aq_ranks = process_set.size() if process_set.included() else 1
        self._aq_plan(fusion_bytes, small_tensor_threshold)

    # ------------------------------------------------------------------ layout
    def _aq_plan(self, fusion_bytes: int, small_tensor_threshold: int) -> None:
        """Assign every trainable parameter to a bucket or to the allreduce route, in reverse
        registration order (≈ backward order); see :func:`horovod_aq.exchange.plan_buckets`."""
        ordered = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        ordered.reverse()
        names = [self._parameter_names[p] for p in ordered]
        plans, small = plan_buckets(
            names, [p.numel() for p in ordered], [str(p.device) for p in ordered],
            prefix=f"{self._aq.name}.o{self._aq_index}", cap_numel=max(1, fusion_bytes // 4),
            small_threshold=small_tensor_threshold, quantizes=self._aq.quantizes,
            exchange=self._aq_exchange, bits=self._aq.bits, bucket_size=self._aq.bucket_size,
            ranks=self._aq_ranks, network=self._aq_network)
        self._aq_route: dict[torch.Tensor, _Bucket | None] = {ordered[i]: None for i in small}
        self._aq_buckets = [_Bucket(plan, [ordered[i] for i in plan.members]) for plan in plans]
        for bucket in self._aq_buckets:
            for p in bucket.params:
                self._aq_route[p] = bucket
        self._aq_layout = layout_digest(plans, [names[i] for i in small])

    @property
    def buckets(self) -> list[tuple[str, int, str, list[str]]]:
        """(name, numel, exchange mode, parameter names) of every fused bucket."""
        return [(b.name, b.numel, b.mode, [self._parameter_names[p] for p in b.params])
                for b in self._aq_buckets]

    @property
    def compression(self) -> Compressor:
        return self._aq

    @property
    def telemetry(self) -> Telemetry:
        return self._aq_telemetry

    # ------------------------------------------------------------------ first-exchange check
    def _aq_handshake(self) -> None:
        """One allgather of settings, table, step and layout; every rank raises the same error."""
        mine = handshake_vector(self._aq.fingerprint(), self._aq_layout, self._aq_ranks)
        gathered = hvd.allgather(torch.from_numpy(mine).reshape(1, -1),
                                 name=f"aq.handshake.{self._aq_index}",
                                 process_set=self.process_set).numpy()
        self._aq_checked = True
        check_handshake(gathered, self._aq.describe_fingerprint)

    # ------------------------------------------------------------------ submission (hook)
    def _allreduce_grad_async(self, p: torch.Tensor):
        if p.grad is None:
            p.grad = p.data.new(p.size()).zero_()
        if not self._aq_checked:
            self._aq_handshake()
        if self._aq_record is None:
            self._aq_record = StepRecord(step=self._aq.step, method=self._aq.method,
                                         ranks=self._aq_ranks, bits=self._aq.bits)
        bucket = self._aq_route[p]
        grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
        if bucket is None:
            return self._aq_allreduce(p, grad), None
        offset, numel = bucket.slots[p]
        bucket.buffer[offset:offset + numel].copy_(grad.reshape(-1))
        bucket.arrived.add(p)
        if len(bucket.arrived) == len(bucket.params):
            self._aq_submit(bucket)
        self._aq_poll()
        return self._aq_output(bucket, p), None

    def _aq_allreduce(self, p: torch.Tensor, grad: torch.Tensor) -> Callable[[], torch.Tensor]:
        dtype = grad.dtype
        wire = grad.to(torch.float16) if self._aq.method == "fp16" else grad.clone()
        handle = allreduce_async_(wire, name=f"aq.ar.{self._parameter_names[p]}", op=Average,
                                  process_set=self.process_set)
        rec = self._aq_record
        rec.numel += grad.numel()
        rec.bytes_sent += bytes_sent("allreduce_fp16" if wire.dtype == torch.float16
                                     else "allreduce_fp32", grad.numel(), 0, 1, self._aq_ranks)
        def output() -> torch.Tensor:
            out = wait(handle)
            self._aq.observe_aggregate(out)
            return out.to(dtype)
        return output

    def _aq_encode(self, x: torch.Tensor, bucket: _Bucket, part: int = 0) -> torch.Tensor:
        """Encode with the uniforms of (step, bucket, part) — see ``TorchState.stream``."""
        comp = self._aq
        gen = torch_state(comp).stream(x.device, comp.step, bucket.index, part)
        return kernels.encode(x, comp.table, bucket_size=comp.bucket_size, norm=comp.norm,
                              generator=gen)

    def _aq_submit(self, bucket: _Bucket) -> None:
        comp, P, rec = self._aq, self._aq_ranks, self._aq_record
        ef = comp if isinstance(comp, ErrorFeedback) else None
        raw = bucket.buffer
        first_bad = kernels.first_nonfinite(raw)
        if first_bad is not None:   # send a marker of the same size: every rank learns of it
            self._aq_send_marker(bucket, first_bad)
            return
        x = ef.compensate(bucket.name, raw) if ef is not None else raw   # g + α·h
        if comp.recording:
            comp.record_stats(*kernels.bucket_stats(x, comp.bucket_size),
                              histogram=kernels.normalized_histogram(x, comp.bucket_size)
                              if comp.wants_histogram else None)
        rec.numel += bucket.numel
        rec.numel_quantized += bucket.numel
        rec.exchanges[bucket.mode] = rec.exchanges.get(bucket.mode, 0) + 1
        if bucket.mode == "allgather":
            payload = self._aq_encode(x, bucket)
            if ef is not None:   # h ← β·h + (g − g̃), g̃ = what this rank sent
                ef.update(bucket.name, raw,
                          kernels.decode(payload, comp.table, dtype=torch.float32))
            rec.payload_bytes += payload.numel()
            rec.bytes_sent += (P - 1) * payload.numel()
            bucket.handle = allgather_async(payload, name=f"aq.ag.{bucket.name}",
                                            process_set=self.process_set)
            bucket.stage = "ag"
            return
        m = chunk_numel(bucket.numel, P, comp.bucket_size)
        if bucket.padded is None or bucket.padded.numel() != P * m:   # zero tail, kept
            bucket.padded = torch.zeros(P * m, dtype=torch.float32, device=x.device)
        padded = bucket.padded
        padded[:bucket.numel] = x
        chunk_payloads = [self._aq_encode(chunk, bucket, k)
                          for k, chunk in enumerate(padded.view(P, m))]
        if ef is not None:
            sent = torch.cat([kernels.decode(c, comp.table, dtype=torch.float32)
                              for c in chunk_payloads])[:bucket.numel]
            ef.update(bucket.name, raw, sent)
        payloads = torch.cat(chunk_payloads)
        rec.payload_bytes += payloads.numel()
        rec.bytes_sent += 2 * (P - 1) * (payloads.numel() // P)
        bucket.handle = alltoall_async(payloads, name=f"aq.a2a.{bucket.name}",
                                       process_set=self.process_set)
        bucket.stage = "a2a"

    def _aq_send_marker(self, bucket: _Bucket, first_bad: int) -> None:
        """Submit non-finite markers (``codec.nonfinite_payload``) in place of the payloads."""
        comp, P = self._aq, self._aq_ranks
        numel = bucket.numel if bucket.mode == "allgather" else chunk_numel(
            bucket.numel, P, comp.bucket_size)
        marker = torch.from_numpy(codec.nonfinite_payload(
            numel, comp.table, comp.bucket_size, comp.norm, first_bad)).to(bucket.buffer.device)
        if bucket.mode == "allgather":
            bucket.handle = allgather_async(marker, name=f"aq.ag.{bucket.name}",
                                            process_set=self.process_set)
            bucket.stage = "ag"
        else:
            bucket.handle = alltoall_async(marker.repeat(P), name=f"aq.a2a.{bucket.name}",
                                           process_set=self.process_set)
            bucket.stage = "a2a"

    def _aq_nonfinite(self, bucket: _Bucket, rows: torch.Tensor) -> bool:
        """Handle markers among gathered ``rows`` identically on every rank: raise naming the
        rank and parameter, or (nonfinite="skip") fill the bucket with NaN and skip the step."""
        flags = rows[:, codec.FLAGS_OFFSET].cpu().numpy()
        bad_ranks = codec.nonfinite_rows(flags)
        if not bad_ranks:
            return False
        if self._aq.nonfinite == "skip":
            bucket.result = torch.full((bucket.numel,), float("nan"), device=rows.device)
            bucket.stage = "done"
            self._aq_skip = True
            return True
        rank = bad_ranks[0]
        header = codec.parse_header(rows[rank, :codec.HEADER_SIZE].cpu().numpy())
        where = header.first_nonfinite
        if bucket.stage == "a2a":   # a chunk of the padded bucket: the sender flagged all chunks
            where = None
        param = self._aq_param_at(bucket, where)
        raise codec.NonFiniteGradientError(
            f"rank {rank} (of the process set) computed a non-finite gradient"
            f"{f' for parameter {param!r}' if param else f' in bucket {bucket.name}'}; every "
            "rank stops here. Lower the learning rate or use loss scaling, or pass "
            "nonfinite='skip' to the compressor to skip such steps on every rank.", where)

    def _aq_param_at(self, bucket: _Bucket, element: int | None) -> str | None:
        if element is None:
            return None
        for p, (offset, numel) in bucket.slots.items():
            if offset <= element < offset + numel:
                return self._parameter_names[p]
        return None

    def _aq_poll(self) -> None:
        """Advance two-phase buckets whose alltoall finished (overlaps the rest of backward)."""
        for bucket in self._aq_buckets:
            if bucket.stage == "a2a" and poll(bucket.handle):
                self._aq_progress(bucket)

    def _aq_progress(self, bucket: _Bucket) -> None:
        """Move ``bucket`` one stage on, blocking on its collective."""
        comp, P = self._aq, self._aq_ranks
        if bucket.stage == "a2a":
            received = wait(bucket.handle)
            received = received[0] if isinstance(received, (tuple, list)) else received
            if self._aq_nonfinite(bucket, received.view(P, -1)):
                return
            chunk = kernels.decode_average(received.view(P, -1), comp.table, dtype=torch.float32)
            bucket.handle = allgather_async(self._aq_encode(chunk, bucket, P),
                                            name=f"aq.ag.{bucket.name}",
                                            process_set=self.process_set)
            bucket.stage = "ag2"
        elif bucket.stage in ("ag", "ag2"):
            gathered = wait(bucket.handle).view(P, -1)
            if bucket.stage == "ag" and self._aq_nonfinite(bucket, gathered):
                return
            if bucket.stage == "ag":
                bucket.result = kernels.decode_average(gathered, comp.table, dtype=torch.float32)
            else:
                parts = [kernels.decode(row, comp.table, dtype=torch.float32) for row in gathered]
                bucket.result = torch.cat(parts)[:bucket.numel]
            comp.observe_aggregate(bucket.result)
            bucket.stage = "done"
        else:
            raise RuntimeError(f"bucket {bucket.name} was never submitted (stage {bucket.stage})")

    def _aq_output(self, bucket: _Bucket, p: torch.Tensor) -> Callable[[], torch.Tensor]:
        def output() -> torch.Tensor:
            while bucket.stage != "done":
                self._aq_progress(bucket)
            offset, numel = bucket.slots[p]
            return bucket.result[offset:offset + numel].view(p.shape).to(p.grad.dtype)
        return output

    # ------------------------------------------------------------------ end of step
    def synchronize(self) -> None:
        self._aq_skip = False
        _HorovodOptimizer.synchronize(self)
        if not self.process_set.included():
            return
        for bucket in self._aq_buckets:
            bucket.reset()
        rec = self._aq_record
        self._aq_record = None
        if not self._aq_active:
            self._aq.step += 1
            return
        refitted = self._aq.end_step(comm_for(self.process_set)) if self._aq.quantizes else False
        if not self._aq.quantizes:
            self._aq.step += 1
        if rec is not None:
            rec.bytes_fp32 = bytes_sent("allreduce_fp32", rec.numel, 0, 1, self._aq_ranks)
            if self._aq.quantizes:
                rec.table_version = self._aq.table.version
            rec.refit = refitted
            if refitted:
                rec.levels = self._aq.table.levels.tolist()
            if isinstance(self._aq, ErrorFeedback):
                rec.extra["ef_memory_norm"] = self._aq.memory_norm()
            if self._aq_skip:
                rec.extra["skipped"] = 1.0
            self._aq_telemetry.record(rec)

    def step(self, closure=None):
        """Horovod's step (synchronize, then the wrapped optimizer's step), except that a step
        whose gradients were non-finite on some rank (``nonfinite="skip"``) is skipped on every
        rank."""
        if self._should_synchronize:
            if self._synchronized:
                logger.warning("optimizer.step() called without optimizer.skip_synchronize() "
                               "after optimizer.synchronize(): gradients are exchanged twice")
            self.synchronize()
        self._synchronized = False
        if self._aq_skip:
            logger.warning("step %d skipped on every rank: a rank's gradient was non-finite",
                           self._aq.step - 1)
            return None
        return super(self.__class__, self).step(closure)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus the compressor's (``"horovod_aq"``).

        With :class:`~horovod_aq.ErrorFeedback` and more than one rank this is **collective**:
        every rank's error memory differs, so it is gathered (one allgather per bucket) and the
        dict holds all of them; call it on every rank and save it on rank 0. Without error
        feedback it is local and the same on every rank.
        """
        state = super(self.__class__, self).state_dict()
        aq_state = self._aq.state_dict()
        if isinstance(self._aq, ErrorFeedback):
            local = aq_state.pop("memory")
            aq_state["memory"] = {}
            aq_state["memory_by_rank"] = self._aq_gather_memory(local)
            aq_state["world"] = self._aq_ranks
        state["horovod_aq"] = aq_state
        return state

    def _aq_gather_memory(self, local: dict[str, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
        if self._aq_ranks == 1 or not self._aq_active:
            return {0: local}
        out: dict[int, dict[str, np.ndarray]] = {r: {} for r in range(self._aq_ranks)}
        for bucket in self._aq_buckets:
            mine = local.get(bucket.name)
            mine = np.zeros(bucket.numel, np.float32) if mine is None else mine.reshape(-1)
            rows = hvd.allgather(torch.from_numpy(mine).reshape(1, -1),
                                 name=f"aq.efstate.{bucket.name}",
                                 process_set=self.process_set).numpy()
            for r in range(self._aq_ranks):
                out[r][bucket.name] = rows[r].copy()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (saved on one rank, loaded on all). Levels, versions and
        step counters always come back; error-feedback memory only if the number of ranks is
        unchanged (otherwise it restarts from zero, with a warning)."""
        state = dict(state_dict)
        aq_state = state.pop("horovod_aq", None)
        _HorovodOptimizer.load_state_dict(self, state)
        for bucket in self._aq_buckets:
            bucket.reset()
        self._aq_record = None
        self._aq_checked = False
        if aq_state is None:
            return
        if isinstance(self._aq, ErrorFeedback) and "memory_by_rank" in aq_state:
            aq_state = dict(aq_state)
            by_rank, world = aq_state.pop("memory_by_rank"), aq_state.pop("world")
            if world == self._aq_ranks:
                aq_state["memory"] = by_rank.get(self.process_set.rank(), {})
            else:
                logger.warning("error-feedback memory was saved with %d ranks and this job has "
                               "%d: it restarts from zero (levels and steps are kept)",
                               world, self._aq_ranks)
                aq_state["memory"] = {}
        self._aq.load_state_dict(aq_state)


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Compressor | None = None,
    *,
    backward_passes_per_step: int = 1,
    process_set: hvd.ProcessSet = hvd.global_process_set,
    exchange: str = "auto",
    fusion_bytes: int = DEFAULT_FUSION_BYTES,
    small_tensor_threshold: int = 0,
    sparse_as_dense: bool = False,
    network: NetworkModel | None = None,
    telemetry: Telemetry | None = None,
    op: Any = Average,
    groups: Any = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are averaged with the packed quantized exchange.

    Args:
        optimizer: the local optimizer (its class becomes the base of the returned object).
        named_parameters: ``model.named_parameters()``; names make collectives rank-independent.
        compression: a horovod_aq compressor, e.g. ``horovod_aq.ALQ(bits=3)`` (default: none).
        backward_passes_per_step: local gradient accumulation steps before an exchange.
        process_set: the Horovod process set to average over (all collectives use it).
        exchange: "auto" (cost model), "allgather" or "two_phase".
        fusion_bytes: cap of a fused bucket in bytes of fp32 gradient.
        small_tensor_threshold: parameters with fewer elements are allreduced uncompressed.
        sparse_as_dense: accepted for Horovod compatibility; sparse gradients are always
            densified into the quantized exchange.
        network: parameters of the exchange cost model.
        telemetry: where step records go (default: an in-memory :class:`Telemetry`).
        op, groups: only ``op=hvd.Average`` and ``groups=None`` are supported.
    """
    if op != Average:
        raise ValueError("the packed exchange averages gradients (op=hvd.Average); use "
                         "hvd.DistributedOptimizer for Sum or Adasum")
    if groups is not None:
        raise ValueError("groups= is not supported: the packed exchange fuses gradients into its "
                         "own buckets (tune fusion_bytes instead)")
    if compression is None:
        compression = NoCompression()
    if not isinstance(compression, Compressor):
        raise TypeError(
            "compression must be a horovod_aq compressor such as horovod_aq.ALQ(bits=3); Horovod's "
            "hvd.Compression.* objects belong to hvd.DistributedOptimizer")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if fusion_bytes < 4:
        raise ValueError(f"fusion_bytes must be >= 4, got {fusion_bytes}")
    resolve_exchange(exchange, 1, 1, 1, 1)  # validates the name
    if not hvd.is_initialized():
        raise RuntimeError("call horovod.torch.init() before creating the DistributedOptimizer")
    attrs = dict(_HorovodOptimizer.__dict__)
    attrs.update({k: v for k, v in _PackedOptimizer.__dict__.items()
                  if k not in ("__dict__", "__weakref__")})
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), attrs)
    return cls(optimizer.param_groups, named_parameters, compression,
               backward_passes_per_step=backward_passes_per_step, process_set=process_set,
               exchange=exchange, fusion_bytes=fusion_bytes,
               small_tensor_threshold=small_tensor_threshold, sparse_as_dense=sparse_as_dense,
               network=network or NetworkModel(), telemetry=telemetry)


__all__ = ["DistributedOptimizer", "ConfigMismatchError", "DEFAULT_FUSION_BYTES"]
