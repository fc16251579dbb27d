"""``horovod_aq.torch.DistributedOptimizer``: Horovod's optimizer with bit-packed gradient exchange.

Built on Horovod's own machinery (its AccumulateGrad hooks, ``backward_passes_per_step`` delays,
``synchronize``/``skip_synchronize``/``zero_grad`` checks) without patching Horovod: the class is
created at run time like ``hvd.DistributedOptimizer`` does (base = the user's optimizer class,
attributes = Horovod's ``_DistributedOptimizer`` overlaid with :class:`_PackedOptimizer`), and
only the submission of a gradient and the end of ``synchronize`` are replaced.

Exchange (docs/protocol.md §5; the engine is :class:`horovod_aq.torch.wire.Wire` over Horovod's
named collectives, :class:`horovod_aq.torch.comm.HorovodCollectives`):

* Parameters are fused into **buckets** in reverse registration order (≈ backward order), at
  most ``fusion_bytes`` of fp32 each, one device per bucket. A parameter's hook copies its
  gradient into its bucket; the bucket is encoded and submitted as soon as its last gradient
  arrived, so communication overlaps the rest of the backward pass.
* A bucket travels as one named uint8 collective: ``allgather`` ("aq.ag.<bucket>") or the
  **two-phase** exchange ("aq.a2a.<bucket>", then "aq.ag.<bucket>"); ``exchange="auto"`` picks
  per bucket with the cost model of :mod:`horovod_aq.packed.cost`. Both give bitwise-identical
  gradients on every rank. Finished alltoalls are advanced while the backward pass goes on.
* Parameters below ``small_tensor_threshold`` elements (and all of them for NoCompression/FP16)
  go through a named Horovod allreduce ("aq.ar.<prefix>.<param>"), fp16 for
  :class:`~horovod_aq.FP16`.
* At the first exchange the ranks compare settings, level table, step and bucket layout with one
  allgather ("aq.handshake") and all fail with the same message on a mismatch — no hang.
* After each ``synchronize`` the compressor's ``end_step`` runs the refit protocol when its
  schedule says so (stats gathered to rank 0, fitted, broadcast; mpi4py under the MPI
  controller) and telemetry records the step. Handshake, refits and checkpoints all go through
  the optimizer's one :class:`~horovod_aq.refit.Comm` (``comm_for`` of its process set).

Horovod drop-in (docs/horovod_compat.md): the factory takes ``hvd.DistributedOptimizer``'s whole
signature, in its order. ``NoCompression``/``FP16`` (or ``hvd.Compression.none``/``.fp16``)
*pass through*: every gradient takes Horovod's own allreduce path (its hooks, names, ``op``,
pre/post-scaling, ``groups``, sparse allreduce), so turning quantization off gives Horovod's speed.
The class keeps Horovod's ``__module__``, so ``hvd.broadcast_optimizer_state`` initializes empty
state with the wrapped optimizer's local ``step()`` (no collective, no compressor step), and the
compressor's state travels from the root in that same call (:mod:`horovod_aq.torch.checkpoint`).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import horovod.torch as hvd
import torch
from horovod.common.util import split_list
from horovod.torch.mpi_ops import (
    Adasum,
    Average,
    Sum,
    allgather_async,
    allreduce_async,
    allreduce_async_,
)
from horovod.torch.optimizer import _DistributedOptimizer as _HorovodOptimizer

from horovod_aq.packed import plan as names
from horovod_aq.packed.autowire import AutoWire, with_modes
from horovod_aq.packed.cost import NetworkModel
from horovod_aq.packed.plan import DEFAULT_FUSION_BYTES, BucketPlan, layout_digest, plan_buckets
from horovod_aq.packed.protocol import (
    ConfigMismatchError,
    ExchangeSettings,
    Traffic,
    check_exchange_args,
    check_wire,
    handshake,
    measured_traffic,
    plan_traffic,
    step_record,
)
from horovod_aq.packed.receive import JoinedRankError
from horovod_aq.packed.trainable import (
    Trainable,
    agree_first,
    agreement_row,
    agreement_terms,
    check_agreement_sums,
)
from horovod_aq.packed.trainable import replan_reason as trainable_change
from horovod_aq.packed.waiting import Deadline, ExchangeStalledError
from horovod_aq.packed.waiting import stall_timeout_s as stall_timeout_s_of
from horovod_aq.packed.wire_setting import WireSetting
from horovod_aq.packed.world import World, replan_reason
from horovod_aq.telemetry import Telemetry
from horovod_aq.torch import arguments, checkpoint
from horovod_aq.torch.checkpoint import BROADCAST_KEY
from horovod_aq.torch.comm import HorovodCollectives, comm_for, wait
from horovod_aq.torch.uneven import JoinedStep, log_joined
from horovod_aq.torch.wire import Bucket, Wire

logger = logging.getLogger(__name__)
#: Horovod's warning when ``step()`` follows ``synchronize()`` outside ``skip_synchronize()``.
DOUBLE_SYNC_MESSAGE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")


class _Bucket(Bucket):
    """A fused group of parameters: the wire's bucket, plus where its parameters' gradients land
    and which of them arrived (and had a gradient) this step."""

    __slots__ = ("params", "slots", "buffer", "arrived", "absent", "delivered")

    def __init__(self, plan: BucketPlan, params: list[torch.Tensor],
                 param_names: list[str]) -> None:
        self.params = params
        self.buffer = torch.zeros(plan.numel, dtype=torch.float32, device=params[0].device)
        #: Parameters whose gradient arrived this step, and those whose ``.grad`` was None on
        #: this rank (sent as zeros; the presence mask tells the other ranks).
        self.arrived: set[torch.Tensor] = set()
        self.absent: set[torch.Tensor] = set()
        super().__init__(plan, param_names, [p.numel() for p in params], masked=True)
        #: (offset, numel) of each parameter in :attr:`buffer`.
        self.slots = {p: (o, n) for p, o, n in zip(params, self.offsets, self.numels)}

    def reset(self) -> None:
        super().reset()
        self.arrived.clear()
        self.absent.clear()
        #: Whether the result was handed over (observed, scaled) this step.
        self.delivered = False

    def present(self) -> list[bool]:
        """Which parameters had a gradient on this rank (the presence mask)."""
        return [p not in self.absent for p in self.params]


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
        self._aq_error: BaseException | None = None
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
        self._aq_trainable = self._aq_trainable_now()
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
        self._aq_agreement_name = names.agreement_name(self._aq_identity)
        self._aq_agreement: Any = None
        #: This step's exchange when some rank called ``hvd.join()`` (None: every rank trains);
        #: known once the agreement is collected (:mod:`horovod_aq.torch.uneven`).
        self._aq_joined: JoinedStep | None = None
        self._aq_joined_before = False   # the last step was a joined one (log once)
        self._aq_build(self._aq_world_now())

    # ------------------------------------------------------------------ the world
    def _aq_world_now(self) -> World:
        """This rank's place in the world as Horovod sees it now (``packed.world``)."""
        ps = self.process_set
        inside = bool(ps.included())
        return World(size=ps.size() if inside else 1, rank=ps.rank() if inside else 0,
                     global_rank=hvd.rank())

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
            self._aq_agreement = None   # one in flight belonged to the old world
        self._aq_world = world
        self._aq_ranks = world.size
        tap = self._aq_wire.tap if self._aq_wire is not None else None
        #: The engine (None on the pass-through): the global rank keys the random stream.
        self._aq_wire = None if self._aq_passthrough else Wire(
            self._aq, HorovodCollectives(self.process_set), stream_rank=world.global_rank,
            deadline=self._aq_deadline)
        if self._aq_wire is not None:
            self._aq_wire.tap = tap
        settings = self._aq_settings
        #: Content name of this exchange (docs/protocol.md §6): the same on every rank that
        #: builds the same model and settings, however many other optimizers a rank created.
        self._aq_prefix = names.exchange_key(self._aq.name, self._aq_trainable.tensors, (
            settings.exchange, settings.fusion_bytes, settings.small_tensor_threshold,
            self._aq_ranks, self.backward_passes_per_step, self._aq_groups_key))
        #: How the buckets' payloads are coded, per step (``wire=``; docs/protocol.md §5.5).
        self._aq_wire_setting = WireSetting(self._aq_wire_arg, name=self._aq_prefix,
                                            exchange=settings.exchange)
        if self._aq_wire is not None:
            self._aq_wire_setting.attach(self._aq_wire)
        self._aq_traffic: dict[int, Traffic] = {}
        self._aq_plan()
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
    def _aq_trainable_params(self) -> list[torch.Tensor]:
        """The parameters that get gradients, in registration order."""
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _aq_trainable_now(self) -> Trainable:
        return Trainable.of((self._aq_name(p), p.numel()) for p in self._aq_trainable_params())

    def _aq_name(self, p: torch.Tensor) -> str:
        """The parameter's name: from ``named_parameters``, or for a parameter added later
        without one, Horovod's unnamed form by its place (the same on every rank)."""
        name = self._parameter_names.get(p)
        if name is None:
            g, i = next((g, i) for g, group in enumerate(self.param_groups)
                        for i, q in enumerate(group["params"]) if q is p)
            name = self._parameter_names[p] = f"allreduce.noname.{g}.{i}"
        return name

    def _aq_follow_trainable(self) -> bool:
        """At the first gradient of a step: if what trains changed since the plan
        (``requires_grad`` flipped, ``add_param_group``), give the new parameters Horovod's
        hooks, stop waiting for frozen ones, and plan the exchange again from the new set, with
        the error memory from zero (docs/horovod_compat.md § Changing what trains). Returns
        whether it re-planned."""
        if not self._aq_hooks:
            return False
        now = self._aq_trainable_now()
        reason = trainable_change(self._aq_trainable, now)
        if reason is None:
            return False
        if self._aq_passthrough and self._aq_groups is not None:
            raise RuntimeError(
                f"horovod_aq: {reason}, but Horovod's groups= without quantization cannot be "
                "planned again: build the DistributedOptimizer again after the change (on every "
                "rank), or leave groups= out")
        trainable = self._aq_trainable_params()
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
        """Collect this step's agreement on what trains (submitted at the step's first
        gradient): every rank raises the same ConfigMismatchError if a rank differs; the sums
        also tell whether ranks called ``hvd.join()`` (then this step is a
        :class:`~horovod_aq.torch.uneven.JoinedStep`)."""
        if self._aq_agreement is None or self._aq_agreement is True:
            return
        handle, self._aq_agreement = self._aq_agreement, True
        sums = wait(handle, self._aq_deadline, self._aq_agreement_name).numpy()
        active = check_agreement_sums(sums, self._aq_ranks, self._aq_agreement_rows)
        if active < self._aq_ranks:
            if not self._aq_joined_before:
                log_joined(self._aq.name, self._aq_ranks - active, self._aq_ranks,
                           self._aq_q.step)
            self._aq_joined = JoinedStep(self._aq_ranks - active, self._aq_ranks)

    def _aq_agreement_rows(self) -> Any:
        """Every rank's agreement row, for the message of a disagreement (every rank)."""
        row = torch.from_numpy(agreement_row(self._aq_trainable, self._aq_layout)).view(1, -1)
        name = f"{self._aq_agreement_name}.rows"
        handle = allgather_async(row, name=name, process_set=self.process_set)
        return wait(handle, self._aq_deadline, name).numpy()

    # ------------------------------------------------------------------ layout
    def _aq_plan(self) -> None:
        """Assign every trainable parameter to a bucket or to the allreduce route, in reverse
        registration order (≈ backward order); see :func:`horovod_aq.packed.plan.plan_buckets`.
        With Horovod ``groups``, no bucket mixes two groups (:meth:`_aq_group_ids`)."""
        ordered = self._aq_trainable_params()
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
        self._aq_small_names = [param_names[i] for i in small]
        self._aq_plans = self._aq_planned = plans
        self._aq_buckets = [_Bucket(plan, [ordered[i] for i in plan.members],
                                    [param_names[i] for i in plan.members]) for plan in plans]
        for bucket in self._aq_buckets:
            for p in bucket.params:
                self._aq_route[p] = bucket
        self._aq_set_layout()

    def _aq_set_layout(self) -> None:
        """The layout digest the handshake compares: buckets, modes, allreduced tensors and the
        wire (with ``wire="auto"``, its schedule and decision)."""
        self._aq_layout = layout_digest(self._aq_plans, self._aq_small_names,
                                        self._aq_wire_setting.digest())

    def _aq_replan(self) -> None:
        """Give the buckets the exchange modes of the wire decision, or the planned ones
        without a decision (every rank at the same step boundary); the handshake runs again
        before the next exchange."""
        decision = self._aq_wire_setting.decision
        plans = (self._aq_planned if decision is None
                 else with_modes(self._aq_planned, decision))
        if [p.mode for p in plans] != [p.mode for p in self._aq_plans]:
            self._aq_plans = plans
            for bucket, plan in zip(self._aq_buckets, plans):
                bucket.plan = plan
            self._aq_traffic.clear()
        self._aq_set_layout()
        self._aq_checked = False

    def _aq_load_wire(self, state: dict[str, Any] | None) -> None:
        """Install a saved wire setting state (None: measure again), re-plan to it."""
        self._aq_wire_setting.load_state_dict(state, self._aq_planned)
        self._aq_replan()

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
        registered = self._aq_trainable_params()
        number = {id(p): k for k, chunk in enumerate(split_list(registered, groups))
                  for p in chunk}
        return [number[id(p)] for p in ordered]

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
            self._aq_wire_for(step)

    def _aq_wire_for(self, step: int) -> None:
        """This step's coding and exchange mode of every bucket (``wire="auto"``: the trials'
        candidate, then the decision's; packed.wire_setting) — the same on every rank, so the
        layout digest and the handshake stand."""
        setting = self._aq_wire_setting
        for bucket, planned in zip(self._aq_buckets, self._aq_planned):
            bucket.coding = setting.coding(step, bucket.index)
            mode = setting.mode(step, bucket.index, planned.mode)
            if mode != bucket.plan.mode:
                bucket.plan = dataclasses.replace(bucket.plan, mode=mode)
                self._aq_traffic.clear()
        self._aq_plans = [bucket.plan for bucket in self._aq_buckets]

    def _aq_submit_agreement(self) -> None:
        """This step's agreement on what trains (one small allreduce of
        ``packed.trainable.agreement_terms``, once per step): collected by :meth:`_aq_agree`
        before the first bucket of the step goes out."""
        if self._aq_agreement is not None or not self._aq_hooks:
            return
        terms = torch.from_numpy(agreement_terms(agreement_row(self._aq_trainable,
                                                               self._aq_layout)))
        self._aq_agreement = allreduce_async(terms, name=self._aq_agreement_name, op=Sum,
                                             process_set=self.process_set)

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
        for other in self._aq_buckets:   # advance finished alltoalls (overlaps the backward)
            if other.stage == "a2a" and self._aq_wire.ready(other):
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

    def _aq_output(self, bucket: _Bucket, p: torch.Tensor) -> Callable[[], torch.Tensor]:
        def output() -> torch.Tensor:
            offset, numel = bucket.slots[p]
            result = self._aq_result(bucket)
            return result[offset:offset + numel].view(p.shape).to(p.grad.dtype)
        return output

    def _aq_result(self, bucket: _Bucket) -> torch.Tensor:
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
        try:
            result = self._aq_wire.finish(bucket)
        except Exception as exc:
            return self._aq_fail(bucket, exc)
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

    def _aq_fail(self, bucket: _Bucket, exc: BaseException) -> torch.Tensor:
        """A bucket that raised (the same error at the same bucket on every rank): its error is
        kept for :meth:`synchronize`, which raises the step's first once every bucket finished,
        and its result is zeros until then."""
        if self._aq_error is None:
            self._aq_error = exc
        bucket.stage, bucket.pending = "failed", None
        bucket.result = torch.zeros(bucket.numel, dtype=torch.float32,
                                    device=bucket.buffer.device)
        return bucket.result

    # ------------------------------------------------------------------ end of step
    def synchronize(self) -> None:
        if self._aq_started is None and self._aq_hooks:
            self._aq_begin()   # no hook ran this step: plan before the missing gradients go
        elif self._aq_started is None:
            checkpoint.adopt_broadcast(self)
        self._aq_skip = False
        self._aq_error = None
        try:
            self._aq_agree()   # first: a rank that changed alone must not leave others waiting
            _HorovodOptimizer.synchronize(self)
        finally:
            self._aq_agreement = None
            joined, self._aq_joined = self._aq_joined, None
            self._aq_joined_before = joined is not None
        if self._aq_error is not None:   # after every bucket finished (_aq_result)
            error, self._aq_error = self._aq_error, None
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
            self._aq_replan()    # the decided wire from the next step, on every rank
        seconds = self._aq_wire.take_seconds() if self._aq_wire is not None else {}
        sent = self._aq_wire.take_sent() if self._aq_wire is not None else None
        if started is not None:
            step, bits = started
            traffic = self._aq_traffic_at(bits)
            if sent is not None:   # the bytes this step really sent (variable sizes)
                traffic = dataclasses.replace(traffic, **measured_traffic(
                    traffic, sent, self._aq_small_numels, fp16=self._aq.fp16_wire,
                    ranks=self._aq_ranks))
            rec = step_record(self._aq, step=step, ranks=self._aq_ranks, bits=bits,
                              traffic=traffic, refitted=refitted, skipped=int(self._aq_skip))
            rec.extra.update({f"{k}_s": v for k, v in seconds.items()})
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
    wire: Any = "auto",
    error_feedback: bool | str = "auto",
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
        wire: "fixed" (fixed-width codes, one payload size per bucket), "entropy" (the
            entropy-coded body of docs/format.md §12 where it is smaller: variable-length
            payloads, docs/protocol.md §5.4; telemetry counts the bytes really sent) or "auto":
            the first steps measure the collectives and codecs, then every rank takes the
            coding (and with ``exchange="auto"`` the mode) that rank 0 chose per bucket from
            the fitted link model (docs/protocol.md §5.5; one log line; the default). An
            ``horovod_aq.packed.autowire.AutoWire`` sets the measurement's schedule
            (``AutoWire("auto", warmup_steps=2, measure_steps=8)``). The decision is in
            :meth:`state_dict` (``"horovod_aq_wire"``); :attr:`autowire` shows it.
        error_feedback: "auto" (the default) wraps a quantizer of at most 3 bits per code in
            ``horovod_aq.ErrorFeedback`` (its default coefficients, one INFO line), True any
            quantizer, False none; an ``ErrorFeedback`` given stays as it is
            (:mod:`horovod_aq.error_feedback_setting`, docs/quantizers.md §5.9).
            :attr:`compression` is the compressor used.
    """
    wire = check_wire(wire)
    compression, groups = arguments.check_horovod_args(
        optimizer, compression, op=op, gradient_predivide_factor=gradient_predivide_factor,
        num_groups=num_groups, groups=groups, backward_passes_per_step=backward_passes_per_step,
        error_feedback=error_feedback)
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
    if compression.quantizes or compression.error_memory is not None:
        arguments.check_packed_op(op)
    check_exchange_args(exchange=exchange, fusion_bytes=fusion_bytes,
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
    cls = PackedOptimizer.register(
        type(optimizer.__class__.__name__, (optimizer.__class__,), attrs))
    return cls(optimizer.param_groups, named_parameters, compression,
               backward_passes_per_step=int(backward_passes_per_step), process_set=process_set,
               settings=settings, sparse_as_dense=sparse_as_dense, telemetry=telemetry, op=op,
               gradient_predivide_factor=gradient_predivide_factor, groups=groups,
               stall_timeout=stall, wire=wire)


__all__ = ["BROADCAST_KEY", "ConfigMismatchError", "DEFAULT_FUSION_BYTES", "DistributedOptimizer",
           "ExchangeStalledError", "JoinedRankError", "PackedOptimizer"]
