"""``horovod_aq.torch.DistributedOptimizer``: Horovod's optimizer with bit-packed gradient exchange.

Built on Horovod's own machinery (its AccumulateGrad hooks, ``backward_passes_per_step`` delays,
``synchronize``/``skip_synchronize``/``zero_grad`` checks) without patching Horovod: the class is
created at run time like ``hvd.DistributedOptimizer`` does (base = the user's optimizer class,
attributes = Horovod's ``_DistributedOptimizer`` overlaid with :class:`_PackedOptimizer`), and
only the submission of a gradient and the end of ``synchronize`` are replaced.

Exchange (docs/protocol.md §5; the per-rank decisions are :mod:`horovod_aq.packed.protocol`'s):

* Parameters are fused into **buckets** in reverse registration order (≈ backward order), at
  most ``fusion_bytes`` of fp32 each, one device per bucket. A parameter's hook copies its
  gradient into its bucket; the bucket is encoded and submitted as soon as its last gradient
  arrived, so communication overlaps the rest of the backward pass.
* A bucket travels as one named uint8 collective: ``allgather`` ("aq.ag.<bucket>"; every rank
  decodes all P payloads in rank order and averages) or the **two-phase** exchange
  ("aq.a2a.<bucket>": alltoall of P chunks, decode and average chunk r, re-encode, then
  "aq.ag.<bucket>" allgather of the averaged chunks). ``exchange="auto"`` picks per bucket with
  the cost model of :mod:`horovod_aq.packed.cost`. Both give bitwise-identical gradients on every
  rank.
* Parameters below ``small_tensor_threshold`` elements (and all of them for NoCompression/FP16)
  go through a named Horovod allreduce ("aq.ar.<prefix>.<param>"), fp16 for
  :class:`~horovod_aq.FP16`.
* At the first exchange the ranks compare settings, level table, step and bucket layout with one
  allgather ("aq.handshake.x<k>.0") and all fail with the same message on a mismatch — no hang.
* After each ``synchronize`` the compressor's ``end_step`` runs the refit protocol when its
  schedule says so (stats gathered to rank 0, fitted, broadcast; mpi4py under the MPI
  controller) and telemetry records the step.
"""

from __future__ import annotations

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
from horovod_aq.codec.stream import StreamKey
from horovod_aq.compressors import NoCompression
from horovod_aq.error_feedback import collective_state_dict, select_memory
from horovod_aq.packed import plan as names
from horovod_aq.packed.cost import NetworkModel, chunk_numel
from horovod_aq.packed.plan import (
    DEFAULT_FUSION_BYTES,
    BucketPlan,
    layout_digest,
    next_exchange_index,
    plan_buckets,
)
from horovod_aq.packed.protocol import (
    ConfigMismatchError,
    ExchangeSettings,
    Traffic,
    check_average,
    check_compression,
    check_handshake,
    handshake_vector,
    nonfinite_message,
    plan_traffic,
    step_record,
)
from horovod_aq.telemetry import Telemetry
from horovod_aq.torch import kernels
from horovod_aq.torch.comm import comm_for

logger = logging.getLogger(__name__)
#: What the packed optimizer times per step (``StepRecord.extra[<name>_s]``): encoding the
#: payloads, decoding and averaging them, and waiting for the collectives.
TIMED = ("encode", "decode", "wait")
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

    def __init__(self, params, named_parameters, compression: Any, *,
                 backward_passes_per_step: int, process_set: hvd.ProcessSet,
                 settings: ExchangeSettings, sparse_as_dense: bool,
                 telemetry: Telemetry | None) -> None:
        self._aq = compression
        self._aq_q = compression.quantizer          # table, bits, step, refits
        self._aq_memory = compression.error_memory  # ECQ-SGD memory, or None
        self._aq_settings = settings
        self._aq_telemetry = telemetry if telemetry is not None else Telemetry()
        self._aq_index = next_exchange_index()
        self._aq_prefix = names.exchange_prefix(compression.name, self._aq_index)
        self._aq_checked = False
        self._aq_skip = False
        self._aq_started: tuple[int, int] | None = None   # (step, code bits) of this exchange
        self._aq_traffic: dict[int, Traffic] = {}
        #: Seconds this step spent encoding, decoding and waiting for collectives (telemetry).
        self._aq_seconds = dict.fromkeys(TIMED, 0.0)
        _HorovodOptimizer.__init__(
            self, params, named_parameters, compression=hvd.Compression.none,
            backward_passes_per_step=backward_passes_per_step, op=Average,
            gradient_predivide_factor=1.0, groups=None, sparse_as_dense=sparse_as_dense,
            process_set=process_set)
        self._aq_active = bool(self._requires_update)
        self._aq_ranks = process_set.size() if process_set.included() else 1
        self._aq_global_rank = hvd.rank()
        self._aq_plan()

    # ------------------------------------------------------------------ layout
    def _aq_plan(self) -> None:
        """Assign every trainable parameter to a bucket or to the allreduce route, in reverse
        registration order (≈ backward order); see :func:`horovod_aq.packed.plan.plan_buckets`."""
        ordered = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        ordered.reverse()
        param_names = [self._parameter_names[p] for p in ordered]
        comp, settings = self._aq, self._aq_settings
        plans, small = plan_buckets(
            param_names, [p.numel() for p in ordered], [str(p.device) for p in ordered],
            prefix=f"{self._aq_prefix}.0", cap_numel=settings.cap_numel,
            small_threshold=settings.small_tensor_threshold, quantizes=comp.quantizes,
            exchange=settings.exchange, bits=comp.code_bits, bucket_size=comp.bucket_size,
            ranks=self._aq_ranks, network=settings.network)
        self._aq_route: dict[torch.Tensor, _Bucket | None] = {ordered[i]: None for i in small}
        self._aq_small_numels = [ordered[i].numel() for i in small]
        self._aq_plans = plans
        self._aq_buckets = [_Bucket(plan, [ordered[i] for i in plan.members]) for plan in plans]
        for bucket in self._aq_buckets:
            for p in bucket.params:
                self._aq_route[p] = bucket
        self._aq_layout = layout_digest(plans, [param_names[i] for i in small])

    @property
    def buckets(self) -> list[tuple[str, int, str, list[str]]]:
        """(name, numel, exchange mode, parameter names) of every fused bucket."""
        return [(b.name, b.numel, b.mode, [self._parameter_names[p] for p in b.params])
                for b in self._aq_buckets]

    @property
    def compression(self) -> Any:
        return self._aq

    @property
    def telemetry(self) -> Telemetry:
        return self._aq_telemetry

    # ------------------------------------------------------------------ first-exchange check
    def _aq_handshake(self) -> None:
        """One allgather of settings, table, step and layout; every rank raises the same error."""
        mine = handshake_vector(self._aq.fingerprint(), self._aq_layout, self._aq_ranks)
        gathered = hvd.allgather(torch.from_numpy(mine).reshape(1, -1),
                                 name=names.handshake_name(self._aq_index, 0),
                                 process_set=self.process_set).numpy()
        self._aq_checked = True
        check_handshake(gathered, self._aq.describe_fingerprint)

    # ------------------------------------------------------------------ submission (hook)
    def _allreduce_grad_async(self, p: torch.Tensor):
        if p.grad is None:
            p.grad = p.data.new(p.size()).zero_()
        if not self._aq_checked:
            self._aq_handshake()
        if self._aq_started is None:
            self._aq_started = (self._aq_q.step, self._aq.code_bits)
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
        wire = grad.to(torch.float16) if self._aq.fp16_wire else grad.clone()
        handle = allreduce_async_(wire, name=names.allreduce_name(self._aq_prefix,
                                                                  self._parameter_names[p]),
                                  op=Average, process_set=self.process_set)

        def output() -> torch.Tensor:
            out = self._aq_wait(handle)
            self._aq_q.observe_aggregate(out)
            return out.to(dtype)
        return output

    def _aq_wait(self, handle: Any) -> Any:
        started = time.perf_counter()
        out = wait(handle)
        self._aq_seconds["wait"] += time.perf_counter() - started
        return out

    def _aq_decode(self, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        started = time.perf_counter()
        out = fn(*args, dtype=torch.float32)
        self._aq_seconds["decode"] += time.perf_counter() - started
        return out

    def _aq_encode(self, x: torch.Tensor, bucket: _Bucket, part: int = 0) -> torch.Tensor:
        """Encode with the format's stream of (seed, rank, step, bucket, part) (docs/format.md §6):
        a resumed run draws exactly what an uninterrupted one would."""
        q = self._aq_q
        key = StreamKey(q.seed, self._aq_global_rank, q.step, bucket.index, part)
        started = time.perf_counter()
        out = kernels.encode(x, q.table, bucket_size=q.bucket_size, norm=q.norm, key=key)
        self._aq_seconds["encode"] += time.perf_counter() - started
        return out

    def _aq_submit(self, bucket: _Bucket) -> None:
        q, P, ef = self._aq_q, self._aq_ranks, self._aq_memory
        raw = bucket.buffer
        first_bad = kernels.first_nonfinite(raw)
        if first_bad is not None:   # send a marker of the same size: every rank learns of it
            self._aq_send_marker(bucket, first_bad)
            return
        x = ef.compensate(bucket.name, raw) if ef is not None else raw   # g + α·h
        if q.recording:
            q.record_stats(*kernels.bucket_moments(x, q.bucket_size),
                           histogram=kernels.normalized_histogram(x, q.bucket_size)
                           if q.wants_histogram else None)
        if bucket.mode == "allgather":
            payload = self._aq_encode(x, bucket)
            if ef is not None:   # h ← β·h + (g − g̃), g̃ = what this rank sent
                ef.update(bucket.name, raw, kernels.decode(payload, q.table, dtype=torch.float32))
            bucket.handle = allgather_async(payload, name=names.allgather_name(bucket.name),
                                            process_set=self.process_set)
            bucket.stage = "ag"
            return
        m = chunk_numel(bucket.numel, P, q.bucket_size)
        if bucket.padded is None or bucket.padded.numel() != P * m:   # zero tail, kept
            bucket.padded = torch.zeros(P * m, dtype=torch.float32, device=x.device)
        padded = bucket.padded
        padded[:bucket.numel] = x
        chunk_payloads = [self._aq_encode(chunk, bucket, k)
                          for k, chunk in enumerate(padded.view(P, m))]
        if ef is not None:
            sent = torch.cat([kernels.decode(c, q.table, dtype=torch.float32)
                              for c in chunk_payloads])[:bucket.numel]
            ef.update(bucket.name, raw, sent)
        bucket.handle = alltoall_async(torch.cat(chunk_payloads),
                                       name=names.alltoall_name(bucket.name),
                                       process_set=self.process_set)
        bucket.stage = "a2a"

    def _aq_send_marker(self, bucket: _Bucket, first_bad: int) -> None:
        """Submit non-finite markers (``codec.nonfinite_payload``) in place of the payloads."""
        q, P = self._aq_q, self._aq_ranks
        numel = bucket.numel if bucket.mode == "allgather" else chunk_numel(
            bucket.numel, P, q.bucket_size)
        marker = torch.from_numpy(codec.nonfinite_payload(
            numel, q.table, q.bucket_size, q.norm, first_bad)).to(bucket.buffer.device)
        if bucket.mode == "allgather":
            bucket.handle = allgather_async(marker, name=names.allgather_name(bucket.name),
                                            process_set=self.process_set)
            bucket.stage = "ag"
        else:
            bucket.handle = alltoall_async(marker.repeat(P), name=names.alltoall_name(bucket.name),
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
        raise codec.NonFiniteGradientError(nonfinite_message(rank, param, bucket.name), where)

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
        table, P = self._aq_q.table, self._aq_ranks
        if bucket.stage == "a2a":
            received = self._aq_wait(bucket.handle)
            received = received[0] if isinstance(received, (tuple, list)) else received
            if self._aq_nonfinite(bucket, received.view(P, -1)):
                return
            chunk = self._aq_decode(kernels.decode_average, received.view(P, -1), table)
            bucket.handle = allgather_async(self._aq_encode(chunk, bucket, P),
                                            name=names.allgather_name(bucket.name),
                                            process_set=self.process_set)
            bucket.stage = "ag2"
        elif bucket.stage in ("ag", "ag2"):
            gathered = self._aq_wait(bucket.handle).view(P, -1)
            if bucket.stage == "ag" and self._aq_nonfinite(bucket, gathered):
                return
            if bucket.stage == "ag":
                bucket.result = self._aq_decode(kernels.decode_average, gathered, table)
            else:
                parts = [self._aq_decode(kernels.decode, row, table) for row in gathered]
                bucket.result = torch.cat(parts)[:bucket.numel]
            self._aq_q.observe_aggregate(bucket.result)
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
        started, self._aq_started = self._aq_started, None
        q = self._aq_q
        if not self._aq_active:
            q.step += 1
            return
        refitted = q.end_step(comm_for(self.process_set)) if q.quantizes else False
        if not q.quantizes:
            q.step += 1
        seconds = {f"{k}_s": v for k, v in self._aq_seconds.items()}
        self._aq_seconds = dict.fromkeys(TIMED, 0.0)
        if started is not None:
            step, bits = started
            rec = step_record(self._aq, step=step, ranks=self._aq_ranks, bits=bits,
                              traffic=self._aq_traffic_at(bits), refitted=refitted,
                              skipped=int(self._aq_skip))
            rec.extra.update(seconds)
            self._aq_telemetry.record(rec)

    def _aq_traffic_at(self, bits: int) -> Traffic:
        """What one exchange of this optimizer's plan sends at code width ``bits``."""
        if bits not in self._aq_traffic:
            self._aq_traffic[bits] = plan_traffic(
                self._aq_plans, self._aq_small_numels, fp16=self._aq.fp16_wire, bits=bits,
                bucket_size=self._aq.bucket_size, ranks=self._aq_ranks)
        return self._aq_traffic[bits]

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
                           self._aq_q.step - 1)
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
        world = self._aq_ranks if self._aq_active else 1
        state["horovod_aq"] = collective_state_dict(
            self._aq, [(b.name, b.numel) for b in self._aq_buckets], world, self._aq_allgather)
        return state

    def _aq_allgather(self, rows: np.ndarray, name: str) -> np.ndarray:
        return hvd.allgather(torch.from_numpy(rows), name=name,
                             process_set=self.process_set).numpy()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (saved on one rank, loaded on all). Levels, versions and
        step counters always come back; error-feedback memory only if the number of ranks is
        unchanged (otherwise it restarts from zero, with a warning)."""
        state = dict(state_dict)
        aq_state = state.pop("horovod_aq", None)
        _HorovodOptimizer.load_state_dict(self, state)
        for bucket in self._aq_buckets:
            bucket.reset()
        self._aq_started = None
        self._aq_checked = False
        if aq_state is None:
            return
        rank = self.process_set.rank() if self.process_set.included() else 0
        self._aq.load_state_dict(select_memory(self._aq, aq_state, rank, self._aq_ranks))


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Any = None,
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
    check_average(op, Average, "hvd.DistributedOptimizer")
    if groups is not None:
        raise ValueError("groups= is not supported: the packed exchange fuses gradients into its "
                         "own buckets (tune fusion_bytes instead)")
    if compression is None:
        compression = NoCompression()
    check_compression(compression, "hvd.DistributedOptimizer")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    settings = ExchangeSettings(exchange, fusion_bytes, small_tensor_threshold, network)
    if not hvd.is_initialized():
        raise RuntimeError("call horovod.torch.init() before creating the DistributedOptimizer")
    attrs = dict(_HorovodOptimizer.__dict__)
    attrs.update({k: v for k, v in _PackedOptimizer.__dict__.items()
                  if k not in ("__dict__", "__weakref__")})
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), attrs)
    return cls(optimizer.param_groups, named_parameters, compression,
               backward_passes_per_step=backward_passes_per_step, process_set=process_set,
               settings=settings, sparse_as_dense=sparse_as_dense, telemetry=telemetry)


__all__ = ["DistributedOptimizer", "ConfigMismatchError", "DEFAULT_FUSION_BYTES"]
