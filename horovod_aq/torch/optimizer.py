"""The packed optimizer's class: Horovod's ``_DistributedOptimizer`` with the bit-packed gradient
exchange (``horovod_aq.torch.DistributedOptimizer`` builds it, :mod:`.distributed_optimizer`).

Built on Horovod's own machinery (its AccumulateGrad hooks, ``backward_passes_per_step`` delays,
``synchronize``/``skip_synchronize``/``zero_grad`` checks) without patching Horovod: only the
submission of a gradient and the end of ``synchronize`` are replaced. The exchange
(docs/protocol.md §5) is :class:`horovod_aq.torch.wire.Wire` over Horovod's named collectives
(:class:`horovod_aq.torch.comm.HorovodCollectives`); the buckets and their wire are
:mod:`.layout`'s, the checkpoints :mod:`.checkpoint`'s, the steps some rank joined
:mod:`.uneven`'s.

* A parameter's hook copies its gradient into its fused bucket; a full bucket is encoded and
  submitted at once (allgather, or the two-phase exchange: finished alltoalls are advanced while
  the backward pass goes on), so communication overlaps the backward pass; small tensors (and
  all of them for NoCompression/FP16) take a named Horovod allreduce.
* At the first exchange of a layout the ranks compare settings, table, step and layout
  ("aq.handshake"); every step they agree on what trains ("aq.trainable.<key>", an allreduce of
  sums that also counts the ranks that have not called ``hvd.join()``).
* ``synchronize`` ends the step: the compressor's ``end_step`` (refits on schedule), the wire
  setting's trials and decision, telemetry. Handshake, refits and checkpoints go through the
  optimizer's one :class:`~horovod_aq.refit.Comm`.

``NoCompression``/``FP16`` *pass through*: every gradient takes Horovod's own allreduce path (its
hooks, names, ``op``, pre/post-scaling, ``groups``, sparse allreduce). The class keeps
Horovod's ``__module__``, so ``hvd.broadcast_optimizer_state`` initializes empty state with the
wrapped optimizer's local ``step()``, and the compressor's state travels from the root in that
same call.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.mpi_ops import (
    Average,
    Sum,
    allreduce_async_,
)
from horovod.torch.optimizer import _DistributedOptimizer as _HorovodOptimizer

from horovod_aq.packed import plan as names
from horovod_aq.packed.autowire import AutoWire
from horovod_aq.packed.protocol import (
    ExchangeSettings,
    Traffic,
    handshake,
    measured_traffic,
    step_record,
)
from horovod_aq.packed.trainable import (
    agree_first,
    agreement_row,
)
from horovod_aq.packed.trainable import replan_reason as trainable_change
from horovod_aq.packed.waiting import Deadline
from horovod_aq.packed.wire_setting import WireSetting
from horovod_aq.packed.world import World, replan_reason
from horovod_aq.telemetry import Telemetry
from horovod_aq.torch import arguments, checkpoint, layout
from horovod_aq.torch.agreement import StepAgreement
from horovod_aq.torch.comm import HorovodCollectives, comm_for, wait, world_of
from horovod_aq.torch.layout import OptimizerBucket
from horovod_aq.torch.node_exchange import build_wire
from horovod_aq.torch.uneven import JoinedStep, log_joined
from horovod_aq.torch.wire import Wire

logger = logging.getLogger(__name__)
#: Horovod's warning when ``step()`` follows ``synchronize()`` outside ``skip_synchronize()``.
DOUBLE_SYNC_MESSAGE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


class PackedOptimizer(abc.ABC):
    """What ``isinstance`` recognizes every optimizer :func:`DistributedOptimizer` returns as
    (each is a subclass of the optimizer it wraps, built by :func:`DistributedOptimizer`, and
    registered here)."""


class _PackedOptimizer(torch.optim.Optimizer):
    """Methods overlaid on Horovod's ``_DistributedOptimizer`` (see the module docstring)."""

    def __init__(self, params, named_parameters, compression: Any, *,
                 backward_passes_per_step: int, process_set: hvd.ProcessSet,
                 settings: ExchangeSettings, sparse_as_dense: bool,
                 telemetry: Telemetry | None, op: Any = Average,
                 gradient_predivide_factor: float = 1.0, groups: Any = None,
                 stall_timeout: float | None = None, wire: Any = "auto") -> None:
        self._aq = compression
        self._aq_q = compression.quantizer          # table, bits, step, refits
        self._aq_settings = settings
        #: The ``wire=`` argument ("fixed" / "entropy" / "auto" / an AutoWire); the
        #: :class:`WireSetting` is built once the exchange's content key is known.
        self._aq_wire_arg = wire
        self._aq_telemetry = telemetry if telemetry is not None else Telemetry()
        #: Seconds a wait for one collective may last (None: forever): ExchangeStalledError.
        self._aq_deadline = Deadline(stall_timeout, step=lambda: self._aq_q.step)
        self._aq_checked = False
        self._aq_skip = False
        #: The first error a bucket of this step raised (kept until every bucket finished).
        self._aq_error: tuple[int, BaseException] | None = None   # (bucket index, error)
        #: Whether this step's buckets were finished and settled (:meth:`_aq_settle`).
        self._aq_settled = False
        #: A collective of this step was submitted by this rank (zero_grad can no longer
        #: forget the step: the other ranks would wait for, or meet, that collective).
        self._aq_submitted = False
        self._aq_started: tuple[int, int] | None = None   # (step, code bits) of this exchange
        #: NoCompression/FP16: every gradient takes Horovod's own allreduce path (its op,
        #: scaling, groups and sparse handling), as ``hvd.DistributedOptimizer`` would.
        self._aq_passthrough = not compression.quantizes and compression.error_memory is None
        self._aq_sum = op == Sum
        self._aq_groups = groups
        self._aq_ckpt = checkpoint.Checkpoint()
        passthrough = self._aq_passthrough   # else our hooks exchange; op, factor for reference
        _HorovodOptimizer.__init__(
            self, params, named_parameters, compression=hvd.Compression.fp16
            if passthrough and compression.fp16_wire else hvd.Compression.none,
            backward_passes_per_step=backward_passes_per_step, op=op,
            gradient_predivide_factor=gradient_predivide_factor,
            groups=groups if passthrough else None, sparse_as_dense=sparse_as_dense,
            process_set=process_set)
        checkpoint.watch_broadcasts(self)
        #: Whether Horovod registered gradient hooks (it does not on a single rank): what
        #: trains is followed only then (:meth:`_aq_follow_trainable`).
        self._aq_hooks = bool(process_set.included() and (
            hvd.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"))
        self._aq_hooked = set(self._requires_update)
        self._aq_active = bool(self._requires_update)
        self._aq_groups_key = arguments.groups_key(groups, self._parameter_names)
        # Horovod's split of an average into a pre- and a post-scale (the C++ side divides by
        # the set size for Average); the small-tensor allreduces use it as Horovod does.
        self._aq_scale = ((1.0 / gradient_predivide_factor, gradient_predivide_factor)
                          if op == Average else (1.0, 1.0))
        self._aq_wire = None
        self._aq_world: World | None = None
        self._aq_trainable = layout.trainable_now(self)
        #: What this optimizer exchanges, as built: the content key of all its parameters and
        #: the settings that shape the layout, without the world size, so that neither a change
        #: of what trains nor a change of world alters it. It names the per-step agreement
        #: (``packed.trainable``) and marks the compressor state ``hvd.broadcast_optimizer_state``
        #: ships (:mod:`horovod_aq.torch.checkpoint`), which a worker joining an elastic job
        #: must install although its world already differs from the others'.
        self._aq_identity = names.exchange_key(self._aq.name, [
            (self._parameter_names[p], p.numel()) for group in self.param_groups
            for p in group["params"]], (
            settings.exchange, settings.fusion_bytes, settings.small_tensor_threshold,
            self.backward_passes_per_step, self._aq_groups_key))
        self._aq_agreement = StepAgreement(names.agreement_name(self._aq_identity),
                                           process_set, self._aq_deadline)
        #: This step's exchange when some rank called ``hvd.join()`` (None: every rank trains);
        #: known once the agreement is collected (:mod:`horovod_aq.torch.uneven`).
        self._aq_joined: JoinedStep | None = None
        self._aq_joined_before = False   # the last step was a joined one (log once)
        self._aq_build(self._aq_world_now())

    # ------------------------------------------------------------------ the world
    def _aq_world_now(self) -> World:
        """This rank's place in the world as Horovod sees it now (``packed.world``)."""
        return world_of(self.process_set)

    def _aq_build(self, world: World) -> None:
        """Derive everything that depends on the world (at construction, and again after an
        elastic change of world): the rank count, the engine with its collectives (this rank's
        chunk, the global rank that keys the random stream), the exchange's content name, the
        ``wire=`` setting (its measurement starts afresh), the refit Comm, the traffic cache and
        the bucket plan; the handshake runs before the next exchange. In the same world (a
        change of what trains) the refit Comm is kept."""
        if world != self._aq_world:
            self._aq_comm_cache = None
            #: Whether a handshake passed in this world (``packed.trainable.agree_first``).
            self._aq_handshaken = False
            self._aq_agreement.reset()   # one in flight belonged to the old world
        self._aq_world = world
        self._aq_ranks, self._aq_per_node = world.size, world.per_node
        tap = self._aq_wire.tap if self._aq_wire is not None else None
        if self._aq_wire is not None:
            self._aq_wire.settle([])   # the old wire's held sends keep or give back their memory
        #: The engine (None on the pass-through): the global rank keys the random stream.
        self._aq_wire = None if self._aq_passthrough else build_wire(
            self._aq, HorovodCollectives(self.process_set), stream_rank=world.global_rank,
            deadline=self._aq_deadline, topology=world.topology, defer=True)
        if self._aq_wire is not None:
            self._aq_wire.tap = tap
        settings = self._aq_settings
        #: Content name of this exchange (docs/protocol.md §6): the same on every rank that
        #: builds the same model and settings, however many other optimizers a rank created.
        self._aq_prefix = names.exchange_key(self._aq.name, self._aq_trainable.tensors, (
            settings.exchange, settings.fusion_bytes, settings.small_tensor_threshold,
            self._aq_ranks, self.backward_passes_per_step, self._aq_groups_key) + (
            (f"{world.topology.nodes}x{world.per_node}",) if world.topology else ()))
        #: How the buckets' payloads are coded, per step (``wire=``; docs/protocol.md §5.5).
        self._aq_wire_setting = WireSetting(self._aq_wire_arg, name=self._aq_prefix,
                                            exchange=settings.exchange)
        if self._aq_wire is not None:
            self._aq_wire_setting.attach(self._aq_wire)
        self._aq_traffic: dict[int, Traffic] = {}
        layout.plan(self)
        self._aq_checked = False

    def _aq_follow_world(self) -> None:
        """At the first gradient of a step (every rank at the same step boundary, where elastic
        Horovod changes the world): re-derive the exchange if the world is not the one it was
        planned for, and restart the error memory from zero (docs/horovod_compat.md § Elastic
        Horovod). A rank that did not re-plan meets the others' handshake and every rank raises
        the same ConfigMismatchError."""
        now = self._aq_world_now()
        reason = replan_reason(self._aq_world, now)
        if reason is None:
            return
        logger.info("horovod_aq: %s: %s; planning the exchange again (buckets, collectives, "
                    "wire measurement%s)", self._aq.name, reason,
                    "; error memory from zero" if self._aq.error_memory is not None else "")
        if self._aq.error_memory is not None:
            self._aq.error_memory.reset(reason)
        self._aq_build(now)

    # ------------------------------------------------------------------ what trains
    def _aq_follow_trainable(self) -> bool:
        """At the first gradient of a step: if what trains changed since the plan
        (``requires_grad`` flipped, ``add_param_group``), give the new parameters Horovod's
        hooks, stop waiting for frozen ones, and plan the exchange again from the new set, with
        the error memory from zero (docs/horovod_compat.md § Changing what trains). Returns
        whether it re-planned."""
        if not self._aq_hooks:
            return False
        now = layout.trainable_now(self)
        reason = trainable_change(self._aq_trainable, now)
        if reason is None:
            return False
        if self._aq_passthrough and self._aq_groups is not None:
            raise RuntimeError(
                f"horovod_aq: {reason}, but Horovod's groups= without quantization cannot be "
                "planned again: build the DistributedOptimizer again after the change (on every "
                "rank), or leave groups= out")
        trainable = layout.trainable_params(self)
        for p in trainable:
            self._allreduce_delay.setdefault(p, self.backward_passes_per_step)
            if p not in self._aq_hooked:   # Horovod's hook, as its _register_hooks makes it
                with torch.enable_grad():  # (a hook runs inside backward, without grad mode)
                    grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
                grad_acc.register_hook(self._make_hook(p))
                self._grad_accs.append(grad_acc)
                self._aq_hooked.add(p)
        self._requires_update.clear()
        self._requires_update.update(trainable)
        self._aq_active = bool(trainable)
        logger.info("horovod_aq: %s: step %d: %s; planning the exchange again (buckets, "
                    "collectives, wire measurement%s)", self._aq.name, self._aq_q.step, reason,
                    "; error memory from zero" if self._aq.error_memory is not None else "")
        if self._aq.error_memory is not None:
            self._aq.error_memory.reset(reason)
        self._aq_trainable = now
        self._aq_build(self._aq_world)
        return True

    def _aq_agree(self) -> None:
        """Collect this step's agreement on what trains (:mod:`~horovod_aq.torch.agreement`):
        every rank raises the same ConfigMismatchError if a rank differs; when some rank called
        ``hvd.join()`` this step is a :class:`~horovod_aq.torch.uneven.JoinedStep`."""
        active = self._aq_agreement.collect(self._aq_ranks)
        if active is not None and active < self._aq_ranks:
            if not self._aq_joined_before:
                log_joined(self._aq.name, self._aq_ranks - active, self._aq_ranks,
                           self._aq_q.step)
            self._aq_joined = JoinedStep(self._aq_ranks - active, self._aq_ranks)

    @property
    def buckets(self) -> list[tuple[str, int, str, list[str]]]:
        """(name, numel, exchange mode, parameter names) of every fused bucket."""
        return [(b.name, b.numel, b.mode, list(b.names)) for b in self._aq_buckets]

    @property
    def compression(self) -> Any:
        return self._aq

    @property
    def telemetry(self) -> Telemetry:
        return self._aq_telemetry

    @property
    def wire(self) -> Wire | None:
        """The exchange engine (its ``tap`` sees every payload encoded); None when the
        compressor does not quantize (Horovod's own allreduce path)."""
        return self._aq_wire

    @property
    def autowire(self) -> AutoWire:
        """The ``wire=`` setting's :class:`~horovod_aq.packed.autowire.AutoWire`: its schedule
        (``decision_step``) and, with ``wire="auto"``, the agreed ``decision``."""
        return self._aq_wire_setting.auto

    @property
    def _aq_comm(self) -> Any:
        """The one :class:`~horovod_aq.refit.Comm` of this optimizer (handshake, refits,
        checkpoints), built at first use — on every rank at the same point."""
        if self._aq_comm_cache is None:
            self._aq_comm_cache = comm_for(self.process_set, self._aq_deadline)
        return self._aq_comm_cache

    # ------------------------------------------------------------------ submission (hook)
    def _aq_begin(self) -> None:
        """What the first gradient of a step does before anything is submitted: follow a change
        of what trains or of the world; the handshake when due, with this step's agreement on
        what trains collected before it or submitted after it (``packed.trainable.agree_first``);
        otherwise the agreement goes out, collected by :meth:`synchronize`."""
        if self._aq_started is None:
            self._aq_error = None   # a step that raised elsewhere (e.g. its agreement) left it
            self._aq_follow_trainable()
            checkpoint.adopt_broadcast(self)
            self._aq_follow_world()
            if agree_first(handshake_due=not self._aq_checked,
                           handshaken_in_world=self._aq_handshaken):
                self._aq_submit_agreement()
                self._aq_agree()
        if not self._aq_checked:   # one allgather; every rank raises the same error
            self._aq_checked = True
            handshake(self._aq_comm, self._aq, self._aq_layout)
            self._aq_handshaken = True
        if self._aq_started is None:
            self._aq_submit_agreement()
            step = self._aq_q.step
            self._aq_started = (step, self._aq.code_bits)
            layout.wire_for(self, step)

    def _aq_submit_agreement(self) -> None:
        """This step's agreement on what trains (once per step; :meth:`_aq_agree` collects
        it before the step's first bucket goes out)."""
        if self._aq_hooks:
            self._aq_agreement.submit(agreement_row(self._aq_trainable, self._aq_layout))

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
            self._aq_submitted = True
            self._aq_agree()   # who still trains (hvd.join()), before the step's first bucket
            if self._aq_joined is not None:
                bucket.stage = "joined"
                self._aq_joined.submit(bucket.name, bucket.buffer, self.process_set)
            else:
                self._aq_wire.submit(bucket, bucket.buffer, bucket.present())
        for other in self._aq_buckets:   # advance finished collectives (overlaps the backward)
            if other.stage not in ("idle", "joined", "failed") and self._aq_wire.advanceable(
                    other):
                try:
                    self._aq_wire.advance(other)
                except Exception as exc:   # kept for synchronize: every bucket goes out first
                    self._aq_fail(other, exc)
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
        name = names.allreduce_name(self._aq_prefix, self._parameter_names[p])
        self._aq_submitted = True
        handle = allreduce_async_(wire, name=name, op=Sum if self._aq_sum else Average,
                                  prescale_factor=prescale, postscale_factor=postscale,
                                  process_set=self.process_set)

        def output() -> torch.Tensor:
            started = time.perf_counter()
            out = wait(handle, self._aq_deadline, name)
            self._aq_wire.seconds["wait"] += time.perf_counter() - started
            if self._aq_joined is None:   # a joined step is no compressor step (torch.uneven)
                self._aq_q.observe_aggregate(out / self._aq_ranks if self._aq_sum else out)
            return out.to(dtype)
        return output

    def _aq_output(self, bucket: OptimizerBucket, p: torch.Tensor) -> Callable[[], torch.Tensor]:
        def output() -> torch.Tensor:
            offset, numel = bucket.slots[p]
            result = self._aq_result(bucket)
            return result[offset:offset + numel].view(p.shape).to(p.grad.dtype)
        return output

    def _aq_result(self, bucket: OptimizerBucket) -> torch.Tensor:
        """The bucket's average (waits), handed over once: the compressor sees it (DQSGD's next
        width), op=hvd.Sum scales it; a skipped bucket (nonfinite="skip") skips the step.

        A bucket that raises (a non-finite marker, a stall, a bad payload: every rank meets the
        same error at the same bucket) keeps its error for :meth:`synchronize`, which raises it
        once every other bucket of the step has finished: no rank leaves the step while another
        still waits for one of its collectives (it would see Horovod shut down instead)."""
        if bucket.stage == "failed":
            return bucket.result
        if bucket.stage == "joined":   # some rank called hvd.join(): Horovod's average
            bucket.result, bucket.stage = self._aq_joined.result(bucket.name,
                                                                 self._aq_deadline), "done"
            if self._aq_sum:
                bucket.result.mul_(self._aq_ranks)
            return bucket.result
        self._aq_settle()
        if bucket.stage == "failed":   # its error, found as the step settled
            return bucket.result
        try:
            self._aq_wire.finish(bucket)
            for _, exc in self._aq_wire.settle([bucket]):   # submitted after the step settled
                raise exc
        except Exception as exc:
            return self._aq_fail(bucket, exc)
        result = bucket.result
        if not bucket.delivered:
            bucket.delivered = True
            if bucket.skipped:
                self._aq_skip = True
            else:
                self._aq_q.observe_aggregate(result)
                if self._aq_sum:   # the average times the set size, as Horovod defines it
                    result.mul_(torch.full((), self._aq_ranks, dtype=result.dtype,
                                           device=result.device))
        return result

    def _aq_settle(self) -> None:
        """Once per step, when the first bucket is handed over: every submitted bucket's
        exchange finished, then the device flags of their decodes read in one copy
        (``Wire.settle``, docs/protocol.md §5.8). A bucket that fails keeps its error
        (:meth:`_aq_fail`)."""
        if self._aq_settled:
            return
        self._aq_settled = True
        finished = []
        for bucket in self._aq_buckets:
            if bucket.stage in ("idle", "joined", "failed"):
                continue
            try:
                self._aq_wire.finish(bucket)
            except Exception as exc:
                self._aq_fail(bucket, exc)
            else:
                finished.append(bucket)
        for bucket, exc in self._aq_wire.settle(finished):
            self._aq_fail(bucket, exc)

    def _aq_fail(self, bucket: OptimizerBucket, exc: BaseException) -> torch.Tensor:
        """A bucket that raised: its error is kept for :meth:`synchronize`, which raises, once
        every bucket finished, the error of the lowest-numbered bucket that raised (ranks meet
        failing buckets in different orders, each bucket's error is the same on every rank), and
        its result is zeros until then."""
        if self._aq_error is None or bucket.index < self._aq_error[0]:
            self._aq_error = (bucket.index, exc)
        bucket.stage, bucket.pending = "failed", None
        bucket.result = torch.zeros(bucket.numel, dtype=torch.float32,
                                    device=bucket.buffer.device)
        return bucket.result

    # ------------------------------------------------------------------ end of step
    def synchronize(self) -> None:
        if self._aq_started is None and self._aq_hooks:
            self._aq_begin()   # no hook ran this step: plan before the missing gradients go
        elif self._aq_started is None:
            self._aq_error = None
            checkpoint.adopt_broadcast(self)
        self._aq_skip = False   # not the error: buckets that failed during the backward keep it
        try:
            self._aq_agree()   # first: a rank that changed alone must not leave others waiting
            _HorovodOptimizer.synchronize(self)
        finally:
            self._aq_settled = False
            self._aq_agreement.reset()
            joined, self._aq_joined = self._aq_joined, None
            self._aq_joined_before = joined is not None
        if self._aq_error is not None:   # after every bucket finished (_aq_result)
            (_, error), self._aq_error = self._aq_error, None
            self._aq_submitted, self._aq_started = False, None   # the step did not happen
            for bucket in self._aq_buckets:
                bucket.reset()
            raise error
        if not self.process_set.included():
            return
        self._aq_submitted = False
        for bucket in self._aq_buckets:
            for k in bucket.gone:   # no rank had a gradient: as without one, nothing to apply
                bucket.params[k].grad = None
            bucket.reset()
        started, self._aq_started = self._aq_started, None
        self._aq_ckpt.loaded = None   # an exchange ran: the state loaded last is no longer current
        q = self._aq_q
        if joined is not None:   # ranks joined: no compressor step, no refit (torch.uneven)
            if self._aq_wire is not None:
                self._aq_wire.take_seconds()
                self._aq_wire.take_sent()
            return
        if not self._aq_active:
            q.advance_step()
            return
        refitted = q.end_step(self._aq_comm)   # counts the step; refits when due
        if started is not None and self._aq_wire is not None and self._aq_wire_setting.end_step(
                started[0], self._aq_comm, self._aq_planned, sent=self._aq_wire.sent) is not None:
            layout.replan(self)    # the decided wire from the next step, on every rank
        seconds = self._aq_wire.take_seconds() if self._aq_wire is not None else {}
        sent = self._aq_wire.take_sent() if self._aq_wire is not None else None
        if started is not None:
            step, bits = started
            traffic = layout.traffic_at(self, bits)
            if sent is not None:   # the bytes this step really sent (variable sizes)
                traffic = dataclasses.replace(traffic, **measured_traffic(
                    traffic, sent, self._aq_small_numels, fp16=self._aq.fp16_wire,
                    ranks=self._aq_ranks))
            rec = step_record(self._aq, step=step, ranks=self._aq_ranks, bits=bits,
                              traffic=traffic, refitted=refitted, skipped=int(self._aq_skip))
            rec.extra.update({f"{k}_s": v for k, v in seconds.items()})
            self._aq_telemetry.record(rec)

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
        self._aq_reset_step()

    def _aq_reset_step(self) -> None:
        """Forget the buckets' exchanges of a step that is not going on (a new step starts)."""
        for bucket in self._aq_buckets:
            bucket.reset()
        self._aq_started = None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus the compressor's (``"horovod_aq"``); never a
        collective, so rank 0 alone may call it (Horovod's checkpoint pattern).

        With :class:`~horovod_aq.ErrorFeedback` it holds this rank's error memory, tagged with
        this rank: a job resumed from it with the same ranks gives that rank its memory back,
        and the other ranks restart theirs from zero (one log line). For every rank's memory,
        call :meth:`consolidate_state_dict` on every rank first. Called by
        ``hvd.broadcast_optimizer_state`` it returns what that function broadcasts
        (:mod:`horovod_aq.torch.checkpoint`).
        """
        return checkpoint.state_dict(self)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's error memory to rank ``to`` (its rank in the process set), whose
        next :meth:`state_dict` before the next step then holds all of them, so that a job
        resumed with the same ranks gives every rank its own memory back. Collective: call it
        on every rank at the same point between steps (as torch's
        ``ZeroRedundancyOptimizer.consolidate_state_dict``). Nothing to gather without error
        feedback."""
        checkpoint.consolidate_state_dict(self, to)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (saved on one rank, loaded on all — or loaded on the root
        only and spread with ``hvd.broadcast_optimizer_state``). Levels, versions and step
        counters always come back; error-feedback memory where the checkpoint holds this
        rank's (every rank's after :meth:`consolidate_state_dict`, else the saving rank's) and
        the number of ranks is unchanged, otherwise it restarts from zero (one log line).

        Everything is checked before anything changes: a state saved with other compressor
        settings, or for other parameter groups, raises and leaves the optimizer and the
        compressor as they were.
        """
        checkpoint.load_state_dict(self, state_dict)


__all__ = ["PackedOptimizer"]
