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
  allgather ("aq.handshake") and all fail with the same message on a mismatch — no hang.
* After each ``synchronize`` the compressor's ``end_step`` runs the refit protocol when its
  schedule says so (stats gathered to rank 0, fitted, broadcast; mpi4py under the MPI
  controller) and telemetry records the step.

Horovod drop-in (docs/horovod_compat.md): the factory takes ``hvd.DistributedOptimizer``'s whole
signature, in its order. ``NoCompression``/``FP16`` (or ``hvd.Compression.none``/``.fp16``)
*pass through*: every gradient takes Horovod's own allreduce path (its hooks, names, ``op``,
pre/post-scaling, ``groups``, sparse allreduce), so turning quantization off gives Horovod's speed.
The class keeps Horovod's ``__module__``, so ``hvd.broadcast_optimizer_state`` initializes empty
state with the wrapped optimizer's local ``step()`` (no collective, no compressor step), and the
compressor's state travels from the root in that same call (:meth:`_PackedOptimizer.state_dict`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch
from horovod.common.util import split_list
from horovod.torch import functions as _hvd_functions
from horovod.torch.compression import FP16Compressor, NoneCompressor
from horovod.torch.mpi_ops import (
    Adasum,
    Average,
    Sum,
    allgather_async,
    allreduce_async_,
    alltoall_async,
    poll,
    synchronize,
)
from horovod.torch.optimizer import _DistributedOptimizer as _HorovodOptimizer

from horovod_aq import codec
from horovod_aq.codec.stream import StreamKey
from horovod_aq.compressors import FP16, Compressor, NoCompression
from horovod_aq.error_feedback import collective_state_dict, select_memory
from horovod_aq.packed import plan as names
from horovod_aq.packed.cost import NetworkModel, chunk_numel
from horovod_aq.packed.plan import (
    DEFAULT_FUSION_BYTES,
    BucketPlan,
    layout_digest,
    plan_buckets,
)
from horovod_aq.packed.protocol import (
    ConfigMismatchError,
    ExchangeSettings,
    Traffic,
    check_compression,
    check_handshake,
    first_unsendable,
    handshake_vector,
    nonfinite_message,
    plan_traffic,
    step_record,
)
from horovod_aq.packed.receive import JoinedRankError, joined_message, joined_rows
from horovod_aq.packed.waiting import ExchangeStalledError
from horovod_aq.packed.waiting import stall_timeout_s as stall_timeout_s_of
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
#: The key under which the compressor's state rides in ``hvd.broadcast_optimizer_state`` (a
#: param-group option of the dict :meth:`_PackedOptimizer.state_dict` returns there).
BROADCAST_KEY = "horovod_aq"
#: Horovod's ``broadcast_optimizer_state``: ``state_dict()`` called from it is local (see there).
_BROADCAST_STATE_CODE = _hvd_functions.broadcast_optimizer_state.__code__
#: Horovod's warning when ``step()`` follows ``synchronize()`` outside ``skip_synchronize()``.
DOUBLE_SYNC_MESSAGE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")
ADASUM_MESSAGE = (
    "op=hvd.Adasum cannot run on quantized gradients: Adasum combines the full-precision gradient "
    "vectors of pairs of ranks adaptively (scaling each by their dot products and norms, "
    "recursively), and packed codes cannot be combined that way, nor summed. Use op=hvd.Average "
    "(or hvd.Sum) with horovod_aq compression, or hvd.DistributedOptimizer(op=hvd.Adasum) without "
    "it (horovod_aq.torch.DistributedOptimizer with NoCompression()/FP16() hands Adasum to "
    "Horovod's own optimizer).")


def wait(handle: Any, timeout_s: float | None = None,
         stalled: Callable[[], Exception] | None = None) -> Any:
    """``synchronize(handle)`` without spinning on a core, and with a deadline.

    Horovod 0.28.1's ``synchronize`` (``WaitAndClear`` in ``horovod/torch/mpi_ops_v2.cc``) loops
    on ``std::this_thread::yield()`` until the collective finishes, so a rank waiting for a slow
    network keeps a core busy; where ranks share cores (several ranks per CPU host) that time
    is taken from the ranks still encoding or decoding. Here the wait polls with a sleep that
    doubles from ``WAIT_POLL_MIN_S`` up to ``WAIT_POLL_MAX_S`` (at most ~1 ms of added latency),
    then calls ``synchronize``, which returns at once (and raises the collective's error).
    After ``timeout_s`` seconds (None: never) it raises ``stalled()`` instead
    (:class:`~horovod_aq.packed.protocol.ExchangeStalledError`): Horovod's stall inspector
    only warns, and a rank in another collective would otherwise hang every rank.
    """
    delay = WAIT_POLL_MIN_S
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not poll(handle):
        if deadline is not None and time.monotonic() > deadline:
            raise stalled() if stalled is not None else TimeoutError(
                f"collective did not complete within {timeout_s:g} s")
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
        #: Parameters whose ``.grad`` was None on this rank this step (sent as zeros), and
        #: those whose gradient was None on every rank (their ``.grad`` stays None).
        self.absent: set[torch.Tensor] = set()
        self.gone: list[torch.Tensor] = []
        #: Bytes of the presence mask appended to every payload (one bit per parameter).
        self.mask_bytes = (len(params) + 7) // 8
        self.stage = "idle"           # idle → (a2a →) ag | ag2 → done
        self.handle: Any = None
        self.result: torch.Tensor | None = None

    def reset(self) -> None:
        self.arrived.clear()
        self.absent.clear()
        self.gone = []
        self.stage, self.handle, self.result = "idle", None, None

    def mask(self) -> torch.Tensor:
        """This rank's presence mask: bit i (``np.packbits`` order) set when parameter i had a
        gradient."""
        present = np.array([p not in self.absent for p in self.params], dtype=bool)
        return torch.from_numpy(np.packbits(present)).to(self.buffer.device)

    def split(self, rows: torch.Tensor) -> torch.Tensor:
        """The payload part of gathered ``[P, size + mask]`` rows; records in :attr:`gone` the
        parameters that no rank had a gradient for (their result is zeroed)."""
        k = self.mask_bytes
        masks = np.unpackbits(rows[:, -k:].cpu().numpy(), axis=1)[:, :len(self.params)]
        anywhere = masks.any(axis=0)
        self.gone = [p for p, seen in zip(self.params, anywhere) if not seen]
        return rows[:, :-k].contiguous()

    def clear_chunk(self, chunk: torch.Tensor, rank: int) -> None:
        """Exact zeros in this rank's averaged two-phase chunk where there is no gradient: the
        zero padding past the bucket's end and the parameters no rank had a gradient for.
        Their decoded zeros carry rounding noise, which would enter the norm of the chunk's
        re-encoding and so add variance to the real coordinates (docs/protocol.md §15)."""
        m = chunk.numel()
        start = rank * m
        real = self.numel - start
        if real < m:
            chunk[max(real, 0):] = 0
        for p in self.gone:
            offset, numel = self.slots[p]
            lo, hi = max(offset, start), min(offset + numel, start + m)
            if lo < hi:
                chunk[lo - start:hi - start] = 0

    def clear_gone(self) -> None:
        """Exact zeros where no rank had a gradient (the decoded zeros carry rounding noise)."""
        for p in self.gone:
            offset, numel = self.slots[p]
            self.result[offset:offset + numel] = 0


class _PackedOptimizer(torch.optim.Optimizer):
    """Methods overlaid on Horovod's ``_DistributedOptimizer`` (see the module docstring)."""

    def __init__(self, params, named_parameters, compression: Any, *,
                 backward_passes_per_step: int, process_set: hvd.ProcessSet,
                 settings: ExchangeSettings, sparse_as_dense: bool,
                 telemetry: Telemetry | None, op: Any = Average,
                 gradient_predivide_factor: float = 1.0, groups: Any = None,
                 stall_timeout: float | None = None) -> None:
        self._aq = compression
        self._aq_q = compression.quantizer          # table, bits, step, refits
        self._aq_memory = compression.error_memory  # ECQ-SGD memory, or None
        self._aq_settings = settings
        #: Seconds a wait for one collective may last (None: forever); ExchangeStalledError.
        self._aq_stall_s = stall_timeout
        self._aq_telemetry = telemetry if telemetry is not None else Telemetry()
        self._aq_checked = False
        self._aq_skip = False
        #: A collective of this step was submitted by this rank (zero_grad can no longer
        #: forget the step: the other ranks would wait for, or meet, that collective).
        self._aq_submitted = False
        self._aq_started: tuple[int, int] | None = None   # (step, code bits) of this exchange
        self._aq_traffic: dict[int, Traffic] = {}
        #: Seconds this step spent encoding, decoding and waiting for collectives (telemetry).
        self._aq_seconds = dict.fromkeys(TIMED, 0.0)
        #: NoCompression/FP16: every gradient takes Horovod's own allreduce path (its op,
        #: scaling, groups and sparse handling), as ``hvd.DistributedOptimizer`` would.
        self._aq_passthrough = not compression.quantizes and compression.error_memory is None
        self._aq_sum = op == Sum
        self._aq_groups = groups
        #: The "horovod_aq" state last given to load_state_dict (shipped by
        #: broadcast_optimizer_state until the next exchange), and the frame of a
        #: broadcast_optimizer_state call that found this rank's state empty.
        self._aq_loaded: dict[str, Any] | None = None
        self._aq_bcast_frame: Any = None
        if self._aq_passthrough:
            _HorovodOptimizer.__init__(
                self, params, named_parameters,
                compression=hvd.Compression.fp16 if compression.fp16_wire else hvd.Compression.none,
                backward_passes_per_step=backward_passes_per_step, op=op,
                gradient_predivide_factor=gradient_predivide_factor, groups=groups,
                sparse_as_dense=sparse_as_dense, process_set=process_set)
        else:   # our hooks do the exchange; op and the factor are kept for reference
            _HorovodOptimizer.__init__(
                self, params, named_parameters, compression=hvd.Compression.none,
                backward_passes_per_step=backward_passes_per_step, op=op,
                gradient_predivide_factor=gradient_predivide_factor, groups=None,
                sparse_as_dense=sparse_as_dense, process_set=process_set)
        self._aq_active = bool(self._requires_update)
        self._aq_ranks = process_set.size() if process_set.included() else 1
        self._aq_global_rank = hvd.rank()
        #: Content name of this exchange (docs/protocol.md §6): the same on every rank that
        #: builds the same model and settings, however many other optimizers a rank created.
        self._aq_prefix = names.exchange_key(compression.name, [
            (self._parameter_names[p], p.numel()) for group in self.param_groups
            for p in group["params"] if p.requires_grad], (
            settings.exchange, settings.fusion_bytes, settings.small_tensor_threshold,
            self._aq_ranks, backward_passes_per_step, _groups_key(groups, self._parameter_names)))
        _LIVE[self._aq_prefix] = self
        # Horovod's split of an average into a pre- and a post-scale (the C++ side divides by
        # the set size for Average); the small-tensor allreduces use it as Horovod does.
        self._aq_scale = ((1.0 / gradient_predivide_factor, gradient_predivide_factor)
                          if op == Average else (1.0, 1.0))
        self._aq_plan()

    # ------------------------------------------------------------------ layout
    def _aq_plan(self) -> None:
        """Assign every trainable parameter to a bucket or to the allreduce route, in reverse
        registration order (≈ backward order); see :func:`horovod_aq.packed.plan.plan_buckets`.
        With Horovod ``groups``, no bucket mixes two groups (:meth:`_aq_group_ids`)."""
        ordered = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        ordered.reverse()
        param_names = [self._parameter_names[p] for p in ordered]
        numels = [p.numel() for p in ordered]
        devices = [str(p.device) for p in ordered]
        comp, settings = self._aq, self._aq_settings

        def plan(members: list[int], prefix: str) -> tuple[list[BucketPlan], list[int]]:
            sub, small = plan_buckets(
                [param_names[i] for i in members], [numels[i] for i in members],
                [devices[i] for i in members], prefix=prefix, cap_numel=settings.cap_numel,
                small_threshold=settings.small_tensor_threshold, quantizes=comp.quantizes,
                exchange=settings.exchange, bits=comp.code_bits, bucket_size=comp.bucket_size,
                ranks=self._aq_ranks, network=settings.network)
            return sub, [members[i] for i in small]

        group_ids = None if self._aq_passthrough else self._aq_group_ids(ordered)
        if group_ids is None:
            plans, small = plan(list(range(len(ordered))), f"{self._aq_prefix}.0")
        else:
            plans, small = [], []
            for gid in dict.fromkeys(group_ids):   # groups in backward order of first member
                members = [i for i, g in enumerate(group_ids) if g == gid]
                sub, sub_small = plan(members, f"{self._aq_prefix}.0.g{gid}")
                for b in sub:   # one index space for all buckets (the stream key uses it)
                    plans.append(dataclasses.replace(
                        b, index=len(plans), members=tuple(members[m] for m in b.members)))
                small.extend(sub_small)
        self._aq_route: dict[torch.Tensor, _Bucket | None] = {ordered[i]: None for i in small}
        self._aq_small_numels = [ordered[i].numel() for i in small]
        self._aq_plans = plans
        self._aq_buckets = [_Bucket(plan, [ordered[i] for i in plan.members]) for plan in plans]
        for bucket in self._aq_buckets:
            for p in bucket.params:
                self._aq_route[p] = bucket
        self._aq_layout = layout_digest(plans, [param_names[i] for i in small])

    def _aq_group_ids(self, ordered: list[torch.Tensor]) -> list[int] | None:
        """Horovod's ``groups`` as a group number per parameter of ``ordered`` (None: no groups).

        ``groups=n`` splits the trainable parameters, in registration order, into n contiguous
        groups as Horovod does (``split_list``); ``groups=[[p, ...], ...]`` names groups
        explicitly, and the parameters outside every list share one more group (fused as
        without groups; Horovod allreduces each of them on its own, but its tensor fusion
        batches them again). A group's gradients then travel in buckets of their own, each
        submitted when its last member's gradient is ready — what Horovod's grouped allreduce
        does for a group.
        """
        groups = self._aq_groups
        if groups is None:
            return None
        if isinstance(groups, list):
            number = {id(p): k for k, members in enumerate(groups) for p in members}
            return [number.get(id(p), len(groups)) for p in ordered]
        registered = [p for group in self.param_groups for p in group["params"]
                      if p.requires_grad]
        number = {id(p): k for k, chunk in enumerate(split_list(registered, groups))
                  for p in chunk}
        return [number[id(p)] for p in ordered]

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
        name = names.handshake_name()
        handle = allgather_async(torch.from_numpy(mine).reshape(1, -1), name=name,
                                 process_set=self.process_set)
        gathered = self._aq_wait(handle, name, doing="comparing settings with the other ranks "
                                 "at the first exchange of this optimizer").numpy()
        self._aq_checked = True
        check_handshake(gathered, self._aq.describe_fingerprint)

    # ------------------------------------------------------------------ submission (hook)
    def _aq_begin(self) -> None:
        """What the first gradient of a step does before anything is submitted."""
        if self._aq_started is None:
            self._aq_check_parameters()
            self._aq_adopt_broadcast()
        if not self._aq_checked:
            self._aq_handshake()
        if self._aq_started is None:
            self._aq_started = (self._aq_q.step, self._aq.code_bits)

    def _aq_check_parameters(self) -> None:
        """Refuse trainable parameters that appeared after construction (``add_param_group``,
        or ``requires_grad`` switched on): they have no hook and no place in the exchange, so
        each rank would apply its own gradient and the replicas would drift apart silently.
        Raised at the first gradient of a step, before this rank submits anything."""
        known = self._requires_update
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.requires_grad and p not in known:
                    name = self._parameter_names.get(p)
                    what = f"'{name}'" if name else f"of shape {tuple(p.shape)}"
                    raise RuntimeError(
                        f"horovod_aq: parameter {what} (param group {g}, position {i}) is "
                        "trainable but was not when the DistributedOptimizer was built "
                        "(add_param_group, or requires_grad set to True afterwards): its "
                        "gradient would not be averaged and the ranks would diverge. Build the "
                        "DistributedOptimizer after adding or unfreezing parameters (wrap the "
                        "local optimizer again, on every rank), or leave them trainable from "
                        "the start")

    def _allreduce_grad_async(self, p: torch.Tensor):
        absent = p.grad is None
        if absent:   # Horovod's zeros (synchronize submits parameters whose hook never ran)
            p.grad = p.data.new(p.size()).zero_()
        self._aq_begin()
        if self._aq_passthrough:   # Horovod's own path: its op, scaling, names, sparse handling
            self._aq_submitted = True
            return _HorovodOptimizer._allreduce_grad_async(self, p)
        bucket = self._aq_route[p]
        grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
        if bucket is None:
            return self._aq_allreduce(p, grad), None
        offset, numel = bucket.slots[p]
        bucket.buffer[offset:offset + numel].copy_(grad.reshape(-1))
        bucket.arrived.add(p)
        if absent:
            bucket.absent.add(p)
        if len(bucket.arrived) == len(bucket.params):
            self._aq_submit(bucket)
        self._aq_poll()
        return self._aq_output(bucket, p), None

    def _grouped_allreduce_grad_async(self, ps):
        """Horovod's grouped allreduce (pass-through only: quantized groups become buckets)."""
        self._aq_begin()
        self._aq_submitted = True
        return _HorovodOptimizer._grouped_allreduce_grad_async(self, ps)

    def _aq_allreduce(self, p: torch.Tensor, grad: torch.Tensor) -> Callable[[], torch.Tensor]:
        """A small tensor's uncompressed allreduce, with Horovod's op and pre/post-scaling."""
        dtype = grad.dtype
        wire = grad.to(torch.float16) if self._aq.fp16_wire else grad.clone()
        prescale, postscale = self._aq_scale
        self._aq_submitted = True
        handle = allreduce_async_(wire, name=names.allreduce_name(self._aq_prefix,
                                                                  self._parameter_names[p]),
                                  op=Sum if self._aq_sum else Average,
                                  prescale_factor=prescale, postscale_factor=postscale,
                                  process_set=self.process_set)

        name = names.allreduce_name(self._aq_prefix, self._parameter_names[p])

        def output() -> torch.Tensor:
            out = self._aq_wait(handle, name)
            self._aq_q.observe_aggregate(out / self._aq_ranks if self._aq_sum else out)
            return out.to(dtype)
        return output

    def _aq_wait(self, handle: Any, collective: str = "", bucket: str | None = None,
                 doing: str = "waiting for the gradient exchange in optimizer.step()") -> Any:
        started = time.perf_counter()

        def stalled() -> Exception:
            return ExchangeStalledError(collective, bucket=bucket, step=self._aq_q.step,
                                        doing=doing, timeout_s=self._aq_stall_s)
        out = wait(handle, self._aq_stall_s, stalled)
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
        out = kernels.encode(x, q.table, bucket_size=q.bucket_size, norm=q.norm, key=key,
                             checksum=q.checksum)
        self._aq_seconds["encode"] += time.perf_counter() - started
        return out

    def _aq_submit(self, bucket: _Bucket) -> None:
        q, ef = self._aq_q, self._aq_memory
        raw = bucket.buffer
        first_bad = kernels.first_nonfinite(raw)
        if first_bad is not None:   # send a marker of the same size: every rank learns of it
            self._aq_send_marker(bucket, first_bad)
            return
        self._aq_submitted = True
        x = ef.compensate(bucket.name, raw) if ef is not None else raw   # g + α·h
        mask = bucket.mask()
        try:
            self._aq_submit_payload(bucket, raw, x, mask)
        except ValueError:
            # Finite values whose bucket norm does not fit in float32 (or a compensated value
            # that is not finite): not sendable — a marker, so every rank decides alike.
            bad = first_unsendable(kernels.bucket_norms(x, q.bucket_size, q.norm).cpu().numpy())
            if bad is None:
                raise
            self._aq_send_marker(bucket, bad * q.bucket_size)

    def _aq_submit_payload(self, bucket: _Bucket, raw: torch.Tensor, x: torch.Tensor,
                           mask: torch.Tensor) -> None:
        q, P, ef = self._aq_q, self._aq_ranks, self._aq_memory
        if bucket.mode == "allgather":
            payload = self._aq_encode(x, bucket)
            if q.recording:
                self._aq_record(x)
            if ef is not None:   # h ← β·h + (g − g̃), g̃ = what this rank sent
                ef.update(bucket.name, raw, kernels.decode(payload, q.table, dtype=torch.float32))
            bucket.handle = allgather_async(torch.cat([payload, mask]),
                                            name=names.allgather_name(bucket.name),
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
        if q.recording:
            self._aq_record(x)
        if ef is not None:
            sent = torch.cat([kernels.decode(c, q.table, dtype=torch.float32)
                              for c in chunk_payloads])[:bucket.numel]
            ef.update(bucket.name, raw, sent)
        bucket.handle = alltoall_async(torch.cat([t for c in chunk_payloads for t in (c, mask)]),
                                       name=names.alltoall_name(bucket.name),
                                       process_set=self.process_set)
        bucket.stage = "a2a"

    def _aq_record(self, x: torch.Tensor) -> None:
        q = self._aq_q
        q.record_stats(*kernels.bucket_moments(x, q.bucket_size),
                       histogram=kernels.normalized_histogram(x, q.bucket_size)
                       if q.wants_histogram else None)

    def _aq_send_marker(self, bucket: _Bucket, first_bad: int) -> None:
        """Submit non-finite markers (``codec.nonfinite_payload``) in place of the payloads."""
        q, P = self._aq_q, self._aq_ranks
        self._aq_submitted = True
        numel = bucket.numel if bucket.mode == "allgather" else chunk_numel(
            bucket.numel, P, q.bucket_size)
        marker = torch.from_numpy(codec.nonfinite_payload(
            numel, q.table, q.bucket_size, q.norm, first_bad)).to(bucket.buffer.device)
        marker = torch.cat([marker, bucket.mask()])
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
        rank and parameter, or (nonfinite="skip") fill the bucket with NaN and skip the step.
        Rows of zeros (a rank that called ``hvd.join()``) raise :class:`JoinedRankError`."""
        joined = joined_rows(rows[:, :len(codec.MAGIC)].cpu().numpy())
        if joined:
            collective = (names.alltoall_name if bucket.stage == "a2a"
                          else names.allgather_name)(bucket.name)
            raise JoinedRankError(joined_message(joined, collective))
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
            received = self._aq_wait(bucket.handle, names.alltoall_name(bucket.name), bucket.name)
            received = received[0] if isinstance(received, (tuple, list)) else received
            rows = received.view(P, -1)
            if self._aq_nonfinite(bucket, rows):
                return
            chunk = self._aq_decode(kernels.decode_average, bucket.split(rows), table)
            bucket.clear_chunk(chunk, self.process_set.rank())
            bucket.handle = allgather_async(self._aq_encode(chunk, bucket, P),
                                            name=names.allgather_name(bucket.name),
                                            process_set=self.process_set)
            bucket.stage = "ag2"
        elif bucket.stage in ("ag", "ag2"):
            gathered = self._aq_wait(bucket.handle, names.allgather_name(bucket.name),
                                     bucket.name).view(P, -1)
            if bucket.stage == "ag" and self._aq_nonfinite(bucket, gathered):
                return
            joined = joined_rows(gathered[:, :len(codec.MAGIC)].cpu().numpy())
            if joined:   # two-phase, second phase
                raise JoinedRankError(joined_message(joined, names.allgather_name(bucket.name)))
            if bucket.stage == "ag":
                bucket.result = self._aq_decode(kernels.decode_average, bucket.split(gathered),
                                                table)
            else:
                parts = [self._aq_decode(kernels.decode, row, table) for row in gathered]
                bucket.result = torch.cat(parts)[:bucket.numel]
            bucket.clear_gone()
            self._aq_q.observe_aggregate(bucket.result)
            if self._aq_sum:   # op=hvd.Sum: the average times the set size, as Horovod defines it
                bucket.result.mul_(torch.full((), P, dtype=bucket.result.dtype,
                                              device=bucket.result.device))
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
        if self._aq_started is None:
            self._aq_adopt_broadcast()
        self._aq_skip = False
        _HorovodOptimizer.synchronize(self)
        if not self.process_set.included():
            return
        self._aq_submitted = False
        for bucket in self._aq_buckets:
            for p in bucket.gone:   # no rank had a gradient: as without one, nothing to apply
                p.grad = None
            bucket.reset()
        started, self._aq_started = self._aq_started, None
        self._aq_loaded = None   # an exchange ran: the state loaded last is no longer current
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
        rank. Like Horovod, a ``step()`` right after ``synchronize()`` outside
        ``skip_synchronize()`` warns (``UserWarning``) and exchanges again."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(DOUBLE_SYNC_MESSAGE, UserWarning, stacklevel=2)
            self.synchronize()
        self._synchronized = False
        if self._aq_skip:
            logger.warning("step %d skipped on every rank: a rank's gradient was non-finite",
                           self._aq_q.step - 1)
            return None
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Horovod's check (no zero_grad between backward and step/synchronize), then the
        wrapped optimizer's ``zero_grad(set_to_none=...)`` (torch's default: True)."""
        if self._handles:
            if not self._aq_submitted and not self._aq_passthrough:
                # A backward that stopped (an exception the caller caught) before this rank
                # submitted anything: no rank waits for this rank yet, and a retried backward
                # submits the very collectives the other ranks are waiting in. Forget it.
                self._aq_forget_step()
            elif self._aq_submitted:
                raise AssertionError(
                    "optimizer.zero_grad() was called after loss.backward() but before "
                    "optimizer.step() or optimizer.synchronize(), and this rank has already "
                    "submitted part of this step's gradient exchange (the other ranks take part "
                    "in it). To recover from a backward pass that failed after that, call "
                    "optimizer.step() — it completes the exchange with the other ranks, "
                    "counting the gradients that did not arrive as zeros, and applies the same "
                    "average they apply — then optimizer.zero_grad() and go on with the next "
                    "step (a rank that retried the backward instead would meet the other ranks "
                    "one step out of line).")
            else:
                raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                     "but before optimizer.step() or optimizer.synchronize(). "
                                     "This is prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def _aq_forget_step(self) -> None:
        """Drop the bookkeeping of a step whose backward stopped before anything was submitted:
        Horovod's handles and delays, the buckets' arrivals (logged at WARNING)."""
        logger.warning("%s: zero_grad() after an incomplete backward pass (nothing was "
                       "submitted yet): this rank's partial step is discarded", self._aq.name)
        self._handles.clear()
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        if self._groups is not None:
            for group in self._group_counts:
                self._group_counts[group] = 0
        for bucket in self._aq_buckets:
            bucket.reset()
        self._aq_started = None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus the compressor's (``"horovod_aq"``).

        With :class:`~horovod_aq.ErrorFeedback` and more than one rank this is **collective**:
        every rank's error memory differs, so it is gathered (one allgather per bucket) and the
        dict holds all of them; call it on every rank and save it on rank 0. Without error
        feedback it is local and the same on every rank.

        Called by ``hvd.broadcast_optimizer_state`` it is always local and returns what that
        function broadcasts: the wrapped optimizer's state, with the compressor's state as an
        option of the first param group (see :meth:`_aq_broadcast_state_dict`).
        """
        caller = sys._getframe(1)
        if caller.f_code is _BROADCAST_STATE_CODE:
            return self._aq_broadcast_state_dict(caller)
        if self._aq_started is None:
            self._aq_adopt_broadcast()
        state = super(self.__class__, self).state_dict()
        world = self._aq_ranks if self._aq_active else 1
        state["horovod_aq"] = collective_state_dict(
            self._aq, [(b.name, b.numel) for b in self._aq_buckets], world, self._aq_allgather)
        return state

    def _aq_allgather(self, rows: np.ndarray, name: str) -> np.ndarray:
        return hvd.allgather(torch.from_numpy(rows), name=name,
                             process_set=self.process_set).numpy()

    # ------------------------------------------------------------------ broadcast_optimizer_state
    def _aq_broadcast_state_dict(self, frame: Any) -> dict[str, Any]:
        """What ``hvd.broadcast_optimizer_state`` gets from ``state_dict()`` (protocol in
        docs/horovod_compat.md):

        * It is local on every rank: Horovod calls ``state_dict()`` once where the state is
          non-empty and twice where it is empty, so no collective may run here.
        * An empty state is returned as it is the first time, so that Horovod initializes it
          with the wrapped optimizer's local ``step()`` on zero gradients (this class keeps
          Horovod's ``__module__``: our collective ``step`` is not called, and no compressor
          step is counted).
        * Otherwise the first param group carries :data:`BROADCAST_KEY`: the compressor's state
          (the checkpoint's, with every rank's error memory, if one was loaded since the last
          exchange). Horovod broadcasts param-group options from the root and assigns them to
          ``optimizer.param_groups`` on every rank; the next use of the optimizer adopts it
          (:meth:`_aq_adopt_broadcast`).
        * If the state is still empty after Horovod's local step, the optimizer keeps no state
          (e.g. SGD without momentum) — on every rank, as every rank runs the same optimizer —
          and Horovod would return without broadcasting: one placeholder entry makes it go on.
        """
        _TARGET[0] = weakref.ref(self)
        state = super(self.__class__, self).state_dict()
        if not state["state"]:
            if self._aq_bcast_frame is not frame:
                self._aq_bcast_frame = frame
                return state
            state["state"][BROADCAST_KEY] = {}
        self._aq_bcast_frame = None
        if state["param_groups"]:
            state["param_groups"][0] = {**state["param_groups"][0],
                                        BROADCAST_KEY: self._aq_shipped_state()}
        return state

    def _aq_shipped_state(self) -> _Shipped:
        state = self._aq_loaded if self._aq_loaded is not None else self._aq.state_dict()
        return _Shipped(self._aq_prefix, state)

    def _aq_adopt_broadcast(self) -> None:
        """Take the compressor state ``hvd.broadcast_optimizer_state`` left in the param groups.
        Receiving ranks installed it when it arrived (:func:`_arrive`), the root already has it;
        every rank then compares settings, table, step and layout again at the next exchange."""
        shipped = None
        for group in self.param_groups:
            if BROADCAST_KEY in group:
                shipped = group.pop(BROADCAST_KEY)
        if shipped is None:
            return
        if isinstance(shipped, _Shipped) and not shipped.adopted:
            self._aq_install(shipped.state)
        for bucket in self._aq_buckets:
            bucket.reset()
        self._aq_loaded = None
        self._aq_checked = False

    def _aq_install(self, shipped: dict[str, Any]) -> None:
        """Install a compressor state broadcast from the root (the same on every rank). Each
        rank keeps its own random streams and, unless the root shipped a loaded checkpoint
        holding every rank's, its own error memory. A state saved with other settings is not
        installed (warning): the handshake then stops every rank with the settings of each."""
        own = self._aq.state_dict()
        rank = self.process_set.rank() if self.process_set.included() else 0
        keep = ("framework",)
        if self._aq_memory is not None and "memory_by_rank" not in shipped:
            keep = ("framework", "memory")
        state = _keep_local(select_memory(self._aq, shipped, rank, self._aq_ranks), own, keep)
        try:
            self._aq.load_state_dict(state)
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("%s: not adopting the compressor state broadcast by "
                           "broadcast_optimizer_state: %s", self._aq.name, exc)
        self._aq_loaded = None
        self._aq_checked = False

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (saved on one rank, loaded on all — or loaded on the root
        only and spread with ``hvd.broadcast_optimizer_state``). Levels, versions and step
        counters always come back; error-feedback memory only if the number of ranks is
        unchanged (otherwise it restarts from zero, with a warning).

        Everything is checked before anything changes: a state saved with other compressor
        settings, or for other parameter groups, raises and leaves the optimizer and the
        compressor as they were.
        """
        if self._aq_started is None:
            self._aq_adopt_broadcast()
        state = dict(state_dict)
        aq_state = state.pop("horovod_aq", None)
        _check_param_groups(self.param_groups, state)
        before = None
        if aq_state is not None:
            rank = self.process_set.rank() if self.process_set.included() else 0
            selected = select_memory(self._aq, aq_state, rank, self._aq_ranks)
            before = self._aq.state_dict()
            try:
                self._aq.load_state_dict(selected)
            except Exception:
                _restore(self._aq, before)
                raise
        try:
            _HorovodOptimizer.load_state_dict(self, state)
        except Exception:
            if before is not None:
                _restore(self._aq, before)
            raise
        for bucket in self._aq_buckets:
            bucket.reset()
        self._aq_started = None
        self._aq_checked = False
        self._aq_loaded = aq_state


#: Live packed optimizers by exchange index (the same index on every rank): where a compressor
#: state broadcast by ``hvd.broadcast_optimizer_state`` is installed on arrival.
_LIVE: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
#: The optimizer whose ``hvd.broadcast_optimizer_state`` call is running (its ``state_dict``
#: runs first on every rank): where a state arriving in that call is installed, also when
#: several live optimizers share a content name.
_TARGET: list[Any] = [None]


class _Shipped:
    """A compressor state riding in ``hvd.broadcast_optimizer_state``'s param-group options.

    Horovod pickles the root's options, unpickles them on every other rank and assigns them to
    the optimizer's param groups. Unpickling calls :func:`_arrive`, which installs the state into
    the optimizer of the same exchange index at once, so ``optimizer.compression`` shows the
    root's step and table as soon as ``broadcast_optimizer_state`` returns. The root's own copy
    is never unpickled and counts as installed.
    """

    def __init__(self, index: str, state: dict[str, Any], adopted: bool = True) -> None:
        self.index, self.state, self.adopted = index, state, adopted

    def __reduce__(self) -> tuple[Any, ...]:
        return _arrive, (self.index, self.state)


def _arrive(index: str, state: dict[str, Any]) -> _Shipped:
    shipped = _Shipped(index, state, adopted=False)
    target = _TARGET[0]() if _TARGET[0] is not None else None
    optimizer = target if target is not None and target._aq_prefix == index else _LIVE.get(index)
    if optimizer is not None and optimizer._aq_started is None:
        optimizer._aq_install(state)
        shipped.adopted = True
    return shipped


def _keep_local(shipped: Any, own: Any, keys: tuple[str, ...]) -> Any:
    """``shipped`` with the entries named ``keys`` taken from ``own`` at every level of nesting
    (this rank's random streams and error memory in a state broadcast from the root)."""
    if not isinstance(shipped, dict) or not isinstance(own, dict):
        return shipped
    out = {k: _keep_local(v, own.get(k), keys) for k, v in shipped.items() if k not in keys}
    out.update({k: own[k] for k in keys if k in own})
    return out


def _restore(compression: Any, state: dict[str, Any]) -> None:
    """Put back a compressor state saved just before a failed load (same settings: cannot fail
    on them)."""
    try:
        compression.load_state_dict(state)
    except Exception:   # noqa: BLE001 — the original error is the one to report
        logger.exception("%s: could not restore the compressor state", compression.name)


def _check_param_groups(groups: list[dict[str, Any]], state: dict[str, Any]) -> None:
    """torch's own checks of ``Optimizer.load_state_dict``, before anything is loaded."""
    saved = state.get("param_groups")
    if saved is None or "state" not in state:
        raise ValueError("optimizer state_dict must hold 'state' and 'param_groups' (from "
                         "optimizer.state_dict())")
    if len(groups) != len(saved):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved)):
        raise ValueError("loaded state dict contains a parameter group that doesn't match the "
                         "size of optimizer's group")


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Any = None,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: hvd.ProcessSet = hvd.global_process_set,
    *,
    exchange: str = "auto",
    fusion_bytes: int = DEFAULT_FUSION_BYTES,
    small_tensor_threshold: int = 0,
    network: NetworkModel | None = None,
    telemetry: Telemetry | None = None,
    stall_timeout_s: float | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are averaged with the packed quantized exchange.

    The arguments up to ``process_set`` are ``hvd.DistributedOptimizer``'s, in its order and
    with its meaning (docs/horovod_compat.md); the keyword-only ones tune the packed exchange.

    Args:
        optimizer: the local optimizer (its class becomes the base of the returned object).
        named_parameters: ``model.named_parameters()``; names make collectives rank-independent.
        compression: a horovod_aq compressor, e.g. ``horovod_aq.ALQ(bits=3)``; a compressor
            class (``horovod_aq.ALQ``) is instantiated with its default settings (logged);
            ``hvd.Compression.none`` / ``.fp16`` mean ``NoCompression()`` / ``FP16()``.
            Default: no compression. Without quantization every gradient takes Horovod's own
            allreduce path (Horovod's speed, ``op``, scaling, ``groups``, sparse allreduce).
        backward_passes_per_step: local gradient accumulation steps before an exchange.
        op: ``hvd.Average`` (default) or ``hvd.Sum`` (the average times the set size).
            ``hvd.Adasum`` cannot combine quantized gradients (ValueError); without
            quantization it is handed to ``hvd.DistributedOptimizer`` unchanged. Without
            quantization any op Horovod's allreduce takes is passed on.
        gradient_predivide_factor: Horovod's split of the average (divide by f before the sum,
            by size/f after; only with ``op=hvd.Average``). Applied exactly as Horovod does to
            the allreduced tensors; the quantized buckets give the average either way (their
            payloads carry fp32 norms, so there is no fp16 range to protect).
        num_groups: Horovod's deprecated spelling of ``groups=n`` (DeprecationWarning).
        groups: Horovod's explicit grouping, ``n`` or a list of lists of parameters. Quantized
            buckets never mix two groups (each group's gradients are fused into buckets of their
            own, within ``fusion_bytes``); without quantization Horovod groups the allreduces.
        sparse_as_dense: Horovod's switch. Quantized: sparse gradients are always densified into
            the exchange (the result is the same dense average). Without quantization: as Horovod
            (sparse allreduce unless True).
        process_set: the Horovod process set to average over (all collectives use it).
        exchange: "auto" (cost model), "allgather" or "two_phase".
        fusion_bytes: cap of a fused bucket in bytes of fp32 gradient.
        small_tensor_threshold: parameters with fewer elements are allreduced uncompressed.
        network: parameters of the exchange cost model.
        telemetry: where step records go (default: an in-memory :class:`Telemetry`).
        stall_timeout_s: seconds a wait for one of the packed exchange's collectives may last
            before every stuck rank raises :class:`ExchangeStalledError` naming the collective
            (default ``$HOROVOD_AQ_STALL_TIMEOUT_S``, else 300; 0: wait forever).
    """
    compression = _resolve_compression(compression)
    check_compression(compression, "hvd.DistributedOptimizer")
    passthrough = not compression.quantizes and compression.error_memory is None
    if op == Adasum and not passthrough:
        raise ValueError(ADASUM_MESSAGE)
    if gradient_predivide_factor != 1.0:
        if op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if not (isinstance(gradient_predivide_factor, (int, float))
                and math.isfinite(gradient_predivide_factor) and gradient_predivide_factor > 0):
            raise ValueError("gradient_predivide_factor must be a finite number > 0, got "
                             f"{gradient_predivide_factor!r}")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    _check_groups(groups)
    if isinstance(backward_passes_per_step, bool) or not isinstance(
            backward_passes_per_step, (int, np.integer)) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got "
                         f"{backward_passes_per_step!r}")
    if op == Adasum:
        logger.info("op=hvd.Adasum with %s: using hvd.DistributedOptimizer (Horovod's Adasum "
                    "optimizer); the packed exchange's arguments and telemetry do not apply",
                    type(compression).__name__)
        return hvd.DistributedOptimizer(
            optimizer, named_parameters=named_parameters,
            compression=hvd.Compression.fp16 if compression.fp16_wire else hvd.Compression.none,
            backward_passes_per_step=backward_passes_per_step, op=Adasum,
            gradient_predivide_factor=gradient_predivide_factor, groups=groups,
            sparse_as_dense=sparse_as_dense, process_set=process_set)
    if not passthrough and op not in (Average, Sum):
        raise ValueError("the packed exchange averages quantized gradients: op must be "
                         f"hvd.Average or hvd.Sum, got {op!r}; use hvd.DistributedOptimizer "
                         "without horovod_aq compression for other reductions")
    _check_exchange_args(exchange=exchange, fusion_bytes=fusion_bytes,
                         small_tensor_threshold=small_tensor_threshold)
    settings = ExchangeSettings(exchange, fusion_bytes, small_tensor_threshold, network)
    stall = stall_timeout_s_of(stall_timeout_s)
    if not hvd.is_initialized():
        raise RuntimeError("call horovod.torch.init() before creating the DistributedOptimizer")
    attrs = dict(_HorovodOptimizer.__dict__)
    # Keep Horovod's __module__: hvd.broadcast_optimizer_state recognizes its optimizers by it
    # and then initializes empty state with the wrapped optimizer's local step() instead of
    # this class's collective one (which would deadlock and count a compressor step).
    attrs.update({k: v for k, v in _PackedOptimizer.__dict__.items()
                  if k not in ("__dict__", "__weakref__", "__module__")})
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), attrs)
    return cls(optimizer.param_groups, named_parameters, compression,
               backward_passes_per_step=int(backward_passes_per_step), process_set=process_set,
               settings=settings, sparse_as_dense=sparse_as_dense, telemetry=telemetry, op=op,
               gradient_predivide_factor=gradient_predivide_factor, groups=groups,
               stall_timeout=stall)


def _groups_key(groups: Any, parameter_names: dict[Any, str]) -> Any:
    """Horovod ``groups`` as rank-independent content (parameter names, not tensors)."""
    if isinstance(groups, list):
        return [[parameter_names.get(p, "?") for p in members] for members in groups]
    return groups


def _resolve_compression(compression: Any) -> Any:
    """None and Horovod's ``Compression.none`` → NoCompression(), ``Compression.fp16`` → FP16(),
    a compressor class → an instance with its default settings; anything else as it is."""
    if compression is None or _is_horovod(compression, NoneCompressor):
        return NoCompression()
    if _is_horovod(compression, FP16Compressor):
        return FP16()
    if isinstance(compression, type) and issubclass(compression, Compressor):
        try:
            instance = compression()
        except Exception as exc:
            raise TypeError(
                f"compression=horovod_aq.{compression.__name__} is a class that cannot be used "
                f"with default settings ({exc}); pass an instance, e.g. "
                "compression=horovod_aq.ALQ(bits=3)") from exc
        logger.info("compression=horovod_aq.%s (the class): using %r, its default settings; "
                    "pass an instance such as horovod_aq.ALQ(bits=3) to choose them",
                    compression.__name__, instance)
        return instance
    return compression


def _is_horovod(compression: Any, cls: type) -> bool:
    return (isinstance(compression, type) and issubclass(compression, cls)) or isinstance(
        compression, cls)


def _check_groups(groups: Any) -> None:
    """Horovod's rules for ``groups``: None, an integer > 0 or a list of lists of tensors, each
    tensor at most once."""
    if groups is None:
        return
    if isinstance(groups, list):
        seen: set[int] = set()
        for members in groups:
            for p in members:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
        return
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups <= 0:
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         f"torch.Tensor, got {groups!r}.")


def _check_exchange_args(*, exchange: str, fusion_bytes: int, small_tensor_threshold: int) -> None:
    """The packed exchange's own arguments: the shared validator
    (``horovod_aq.packed.protocol.check_exchange_args``) where it exists, else these checks."""
    from horovod_aq.packed import protocol

    shared = getattr(protocol, "check_exchange_args", None)
    if shared is not None:
        shared(exchange=exchange, fusion_bytes=fusion_bytes,
               small_tensor_threshold=small_tensor_threshold)
        return
    for name, value, low in (("small_tensor_threshold", small_tensor_threshold, 0),
                             ("fusion_bytes", fusion_bytes, 4)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


__all__ = ["DistributedOptimizer", "ConfigMismatchError", "DEFAULT_FUSION_BYTES",
           "BROADCAST_KEY", "ExchangeStalledError", "JoinedRankError"]
