"""horovod_aq compressors as a PyTorch DDP communication hook.

::

    state = horovod_aq.torch.ddp.QuantizedHookState(
        horovod_aq.ALQ(bits=3), named_parameters=model.named_parameters())
    ddp_model.register_comm_hook(state, horovod_aq.torch.ddp.quantized_hook)
    # or: state = horovod_aq.torch.ddp.register(ddp_model, horovod_aq.ALQ(bits=3))

An explicit state object and a stateless hook, as PyTorch's PowerSGD hook; like
``PowerSGDState`` the state is lazy: the process group and everything that depends on it are
resolved at the first bucket, so the state can be built before ``init_process_group`` (e.g. for
Lightning or Accelerate, docs/ddp.md §1; Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers
hooks on CUDA only, so on CPU a callback registers it). The hook encodes each ``GradBucket``'s flat
buffer with the packed kernels and exchanges the payloads over ``torch.distributed`` — the one
torch wire engine (:class:`horovod_aq.torch.wire.Wire`) over
:class:`~horovod_aq.torch.dist_comm.DistCollectives`: allgather, or the two-phase exchange, per
bucket by the cost model of :mod:`horovod_aq.packed.cost`. It returns the average, bitwise
identical on every rank. docs/ddp.md describes the use; the protocol is docs/protocol.md's:

1. **Steps.** DDP has no step hook. It calls the hook once per bucket, in index order, and
   ``bucket.is_last()`` marks the last bucket of a backward pass. There the hook finishes every
   bucket of the step (DDP waits for them right after), feeds the averages to the compressor in
   bucket order (DQSGD's next width), and calls ``compressor.end_step(comm)`` on the state's one
   :class:`~horovod_aq.torch.dist_comm.DistComm`: refits run on schedule (gather → fit on rank
   0 → broadcast, §2), and the new table is used from the next step.
2. **Handshake** (§3). Before the first exchange of every bucket layout (the first bucket, each
   bucket DDP rebuilds after the first iteration, and again after :meth:`load_state_dict`) the
   ranks compare settings, table, step and the bucket digest
   (``packed.protocol.handshake``); any difference raises the same
   :class:`~horovod_aq.packed.protocol.ConfigMismatchError` on every rank.
3. **Non-finite gradients** (§4): markers instead of payloads; every rank raises
   :class:`~horovod_aq.codec.NonFiniteGradientError` naming the rank and parameter, or with
   ``nonfinite="skip"`` every rank gets NaN for the bucket (:attr:`QuantizedHookState.skipped`).
4. **Checkpoints** (§7): :meth:`QuantizedHookState.state_dict` holds the compressor's state
   (tables, step, DQSGD rule, error memory — collective with ``ErrorFeedback``) and the bucket
   layout. DDP restarts with one bucket of every parameter and rebuilds its buckets after the
   first iteration; after :meth:`~QuantizedHookState.load_state_dict` the hook exchanges the
   saved buckets inside DDP's initial one, so a resumed run is bit-identical to an
   uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from horovod_aq import error_feedback_setting
from horovod_aq.compressors import NoCompression
from horovod_aq.error_feedback import checkpoint_state, consolidate_memory, select_memory
from horovod_aq.packed.autowire import AutoWire
from horovod_aq.packed.cost import NetworkModel
from horovod_aq.packed.plan import BucketPlan, layout_digest, op_name, plan_buckets
from horovod_aq.packed.protocol import (
    ConfigMismatchError,
    ExchangeSettings,
    check_compression,
    check_wire,
    handshake,
    measured_traffic,
    plan_traffic,
    step_record,
)
from horovod_aq.packed.waiting import Deadline, wait_until
from horovod_aq.packed.waiting import stall_timeout_s as stall_timeout_of
from horovod_aq.packed.wire_setting import WireSetting
from horovod_aq.telemetry import Telemetry
from horovod_aq.torch.dist_comm import DistCollectives, DistComm, group_or_world, topology_of
from horovod_aq.torch.node_exchange import build_wire
from horovod_aq.torch.process_exit import destroy_and_exit
from horovod_aq.torch.wire import Bucket, Wire

logger = logging.getLogger(__name__)

#: Version of the dict :meth:`QuantizedHookState.state_dict` returns.
STATE_FORMAT = 1
#: The exchange mode of a unit whose compressor does not quantize: one ``all_reduce``.
ALLREDUCE = "allreduce"


class _Unit(Bucket):
    """One exchanged vector: a DDP ``GradBucket`` — or, in the first step after a resume, one of
    the saved buckets inside DDP's initial bucket — and where its parameters sit in the DDP
    buffer."""

    __slots__ = ("segments",)

    def __init__(self, plan: BucketPlan, names: tuple[str, ...], numels: tuple[int, ...],
                 segments: tuple[tuple[int, int], ...] | None = None) -> None:
        #: (offset, numel) of each parameter in the DDP bucket's buffer; None: the whole buffer.
        self.segments = segments
        super().__init__(plan, names, numels)

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


@dataclasses.dataclass
class _Step:
    """A DDP bucket of the current step: its buffer, its units and the future DDP waits on."""

    buffer: torch.Tensor
    units: list[_Unit]
    future: torch.futures.Future


class QuantizedHookState:
    """The state of :func:`quantized_hook`: compressor, process group, layout, step.

    Everything that needs the process group is resolved at the first bucket (or the first
    :meth:`state_dict` / :meth:`load_state_dict`), so the state may be built before
    ``torch.distributed.init_process_group``.

    Args:
        compression: any horovod_aq compression (``ALQ(bits=3)``, ``QSGD``, ``DQSGD``,
            ``ErrorFeedback(...)``, ``FP16()``, ``NoCompression()``).
        process_group: the DDP model's process group (None: the default group).
        named_parameters: the model's ``named_parameters()`` (of the module DDP wraps). Names
            make bucket names, error messages and checkpoints independent of DDP's bucketing;
            without them a resumed run's first step is not bit-identical.
        exchange: "auto" (the cost model), "allgather" or "two_phase".
        network: the cost model's parameters.
        telemetry: where step records go (default: an in-memory :class:`Telemetry`).
        name: prefix of bucket names and error-memory keys (default ``<compressor>.ddp``).
        stall_timeout_s: seconds a wait for one collective may last before every stuck rank
            raises ``ExchangeStalledError`` naming it (default ``$HOROVOD_AQ_STALL_TIMEOUT_S``,
            else 300; 0: wait forever).
        wire: "fixed" (fixed-width codes), "entropy" (entropy-coded, variable-length
            payloads where smaller, docs/format.md §12; sizes are gathered before the payloads,
            docs/protocol.md §5.4) or "auto" (the default: every candidate wire runs a few
            steps in turn, then every rank takes the one rank 0 measured fastest, or within
            3 % of it the one with the fewest bytes, docs/protocol.md §5.5; one log line); an
            ``horovod_aq.packed.autowire.AutoWire`` sets the schedule.
            Kept in :attr:`coding`, which may be changed between steps (the same on every rank;
            a change measures again); :attr:`autowire` shows the decision, which
            :meth:`state_dict` holds.
        error_feedback: "auto" (the default) wraps a quantizer of at most 3 bits per code in
            ``horovod_aq.ErrorFeedback`` (default coefficients; one INFO line), True any
            quantizer, False none; an ``ErrorFeedback`` given stays as it is. Resolved at
            construction (:mod:`horovod_aq.error_feedback_setting`, docs/quantizers.md §5.9);
            :attr:`compression` is the compressor used.
        optimizer: the local optimizer that steps on the averaged gradient. DDP never shows it
            to a hook, so pass it: with an adaptive one (Adam, AdamW, RMSprop, ...) "auto"
            sends the plain quantizer, as the packed optimizers do, where error feedback costs
            accuracy (docs/quantizers.md §5.11). Only its class is read; it is not kept.
    """

    __slots__ = (
        # what is exchanged, and how
        "compression", "settings", "telemetry", "prefix", "_deadline", "_wire_setting",
        # the process group (resolved lazily)
        "_group", "_resolved", "_wire", "_comm", "_collectives",
        # bucket layout and checkpoints
        "_names", "_plans", "_checked", "_target", "_warned_layout", "layout",
        # the step in progress
        "_steps", "_pending", "_started", "skipped",
    )

    def __init__(self, compression: Any = None, process_group: Any = None, *,
                 named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 exchange: str = "auto", network: NetworkModel | None = None,
                 telemetry: Telemetry | None = None, name: str | None = None,
                 stall_timeout_s: float | None = None, wire: Any = "auto",
                 error_feedback: bool | str = "auto", optimizer: Any = None) -> None:
        compression = NoCompression() if compression is None else compression
        check_wire(wire)
        error_feedback_setting.check(error_feedback)
        check_compression(compression, "torch.distributed.algorithms.ddp_comm_hooks")
        # resolved here, not at the first bucket: it needs no process group, and the name
        # prefix below is the compressor's that is used
        compression = error_feedback_setting.resolve(compression, error_feedback, optimizer)
        self.compression = compression
        self.settings = ExchangeSettings(exchange, network=network)
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        self.prefix = op_name(name or f"{compression.name}.ddp")
        self._wire_setting = WireSetting(wire, name=self.prefix,
                                         exchange=self.settings.exchange)
        self._deadline = Deadline(stall_timeout_of(stall_timeout_s),
                                  step=lambda: compression.quantizer.step)
        self._group, self._resolved = process_group, False
        self._wire: Wire | None = None
        self._comm: DistComm | None = None
        self._collectives: DistCollectives | None = None
        self._names: dict[torch.Tensor, str] = (
            {p: n for n, p in named_parameters} if named_parameters is not None else {})
        self._plans: dict[tuple, BucketPlan] = {}
        self._checked: set[tuple] = set()
        self._target: dict[str, tuple[int, tuple[str, ...]]] | None = None
        self._warned_layout = False
        #: (index, name, numel, parameter names) of every unit of the last completed step.
        self.layout: list[tuple[int, str, int, tuple[str, ...]]] = []
        self._steps: list[_Step] = []
        self._pending: list[_Unit] = []
        self._started: tuple[int, int] | None = None
        #: Whether the last step had non-finite gradients on some rank (nonfinite="skip").
        self.skipped = False

    # ------------------------------------------------------------------ the process group
    def _resolve(self) -> None:
        """Bind the process group (at first use, after ``init_process_group``)."""
        if self._resolved:
            return
        if not dist.is_initialized():
            raise RuntimeError("horovod_aq: the DDP hook state needs torch.distributed: call "
                               "torch.distributed.init_process_group() before the first "
                               "backward pass")
        self._group = group_or_world(self._group)
        self._comm = DistComm(self._group, self._deadline)
        self._collectives = DistCollectives(self._group, self._deadline)
        # the global rank keys the random stream, as on the Horovod paths (docs/format.md §6)
        self._wire = build_wire(self.compression, self._collectives,
                                stream_rank=dist.get_rank(), deadline=self._deadline,
                                topology=topology_of(self._group), defer=True)
        self._wire_setting.attach(self._wire)
        self._resolved = True

    @property
    def coding(self) -> str:
        """The ``wire=`` setting: "fixed", "entropy" or "auto" (docs/protocol.md §5.4, §5.5).
        Settable between steps, to the same value on every rank: the ranks then compare it
        again before the next exchange, and "auto" measures again."""
        return self._wire_setting.wire

    @coding.setter
    def coding(self, wire: Any) -> None:
        check_wire(wire)
        if wire == self.coding:
            return
        self._wire_setting = WireSetting(wire, name=self.prefix,
                                         exchange=self.settings.exchange)
        if self._wire is not None:
            self._wire_setting.attach(self._wire)
        self._checked.clear()

    @property
    def autowire(self) -> AutoWire:
        """The ``wire=`` setting's :class:`~horovod_aq.packed.autowire.AutoWire`: its schedule
        (``decision_step``) and, with ``wire="auto"``, the agreed ``decision``."""
        return self._wire_setting.auto

    @property
    def process_group(self) -> Any:
        """The process group (resolved: needs ``init_process_group``)."""
        self._resolve()
        return self._group

    @property
    def wire(self) -> Wire:
        """The exchange engine (its ``tap`` sees every payload encoded)."""
        self._resolve()
        return self._wire

    @property
    def ranks(self) -> int:
        """The size of the process group."""
        return self.wire.ranks

    # ------------------------------------------------------------------ the hook
    def exchange(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """What :func:`quantized_hook` does for one bucket (see the module docstring)."""
        wire = self.wire
        index, buffer = bucket.index(), bucket.buffer()
        if index == 0:
            self._begin_step()
        for unit in self._pending:   # the next stage of earlier buckets, in bucket order
            wire.advance(unit)
        self._pending = [u for u in self._pending if wire.advances(u)]
        units = self._units_for(index, list(bucket.parameters()), buffer)
        step = self.compression.quantizer.step
        for unit in units:
            if unit.mode != ALLREDUCE:   # this step's coding and mode (wire="auto": per step)
                unit.coding = self._wire_setting.coding(step, unit.index)
                mode = self._wire_setting.mode(step, unit.index, unit.plan.mode)
                if mode != unit.plan.mode:
                    unit.plan = dataclasses.replace(unit.plan, mode=mode)
            self._handshake(unit)
            raw = unit.gather(buffer)
            if unit.mode == ALLREDUCE:
                self._allreduce(unit, raw)
            else:
                wire.submit(unit, raw)
            if unit.mode != ALLREDUCE and wire.advances(unit):
                self._pending.append(unit)
        devices = [buffer.device] if buffer.device.type == "cuda" else None
        future = torch.futures.Future(devices=devices)
        self._steps.append(_Step(buffer, units, future))
        if bucket.is_last():
            self._end_step()
        return future

    def _allreduce(self, unit: _Unit, raw: torch.Tensor) -> None:
        """Compressors that do not quantize: one ``all_reduce`` of the mean (fp16 for FP16)."""
        wire = raw.to(torch.float16) if self.compression.fp16_wire else raw.clone()
        unit.stage = "ar"

        def done(mean: torch.Tensor) -> None:
            unit.result, unit.stage = mean.float(), "done"
        unit.pending = self._collectives.allreduce_mean(wire, unit.name, done)

    def _finish(self, unit: _Unit) -> torch.Tensor:
        """A unit's averaged gradient (waits; raises what a callback kept)."""
        if unit.mode != ALLREDUCE:
            return self.wire.finish(unit)
        pending, unit.pending = unit.pending, None
        wait_until(pending.done, self._deadline, f"allreduce of {unit.name}", unit.name)
        pending.wait()
        return unit.result

    def _begin_step(self) -> None:
        if self._steps or self._pending:
            logger.warning("%s: a backward pass started before the previous one finished its "
                           "last bucket; dropping that step's exchanges", self.prefix)
        self._steps, self._pending = [], []
        self._started = (self.compression.quantizer.step, self.compression.code_bits)
        self.skipped = False

    def _end_step(self) -> None:
        """The last bucket: finish every unit, hand the averages over, end the step."""
        q = self.compression.quantizer
        steps, self._steps, self._pending = self._steps, [], []
        held = [(s, unit) for s in steps for unit in s.units]
        errors: dict[int, BaseException] = {}   # by unit position: the first, after all finished
        for k, (_, unit) in enumerate(held):
            try:
                self._finish(unit)
            except BaseException as exc:  # noqa: BLE001
                errors[k] = exc
        # the device flags of every unit's decode, read in one copy (docs/protocol.md §5.8)
        position = {id(unit): k for k, (_, unit) in enumerate(held)}
        for unit, exc in self.wire.settle([u for k, (_, u) in enumerate(held) if k not in errors]):
            errors[position[id(unit)]] = exc
        if errors:
            self._started = None
            raise errors[min(errors)]
        for s, unit in held:
            unit.scatter(s.buffer, unit.result)
            if unit.skipped:
                self.skipped = True
            else:
                q.observe_aggregate(unit.result)
        for s in steps:
            s.future.set_result(s.buffer)
        units = [u for s in steps for u in s.units]
        refitted = q.end_step(self._comm)   # counts the step; refits when due
        self._end_wire(units)
        self.layout = [(u.index, u.name, u.numel, u.names) for u in units]
        self._forget_memory({self.wire.memory_key(u) for u in units if u.mode != ALLREDUCE})
        if self._target is not None and all(u.segments is None for u in units):
            self._target = None    # DDP's buckets are the saved ones again
        self._record(units, refitted)

    def _end_wire(self, units: list[_Unit]) -> None:
        """``wire="auto"``: the step's time and bytes go to the trials, and the agreement runs
        at the end of the step it is due (every rank), for this step's quantized units in index
        order; the ranks compare the decided wire again before the next exchange of every unit
        (a changed mode changes the layout)."""
        if self._started is None:
            return
        step = self._started[0]
        plans = sorted((self._plans[(u.index, u.names)] for u in units if u.mode != ALLREDUCE),
                       key=lambda p: p.index)   # as planned (the trials change the modes)
        if self._wire_setting.end_step(step, self._comm, plans,
                                       sent=self.wire.sent) is not None:
            self._checked.clear()

    def _record(self, units: list[_Unit], refitted: bool) -> None:
        started, self._started = self._started, None
        if started is None:
            return
        step, bits = started
        comp = self.compression
        small = [u.numel for u in units if u.mode == ALLREDUCE]
        traffic = plan_traffic([u.plan for u in units if u.mode != ALLREDUCE], small,
                               fp16=comp.fp16_wire, bits=bits, bucket_size=comp.bucket_size,
                               ranks=self.ranks, per_node=self.wire.per_node)
        traffic = dataclasses.replace(traffic, **measured_traffic(   # the bytes really sent
            traffic, self.wire.take_sent(), small, fp16=comp.fp16_wire, ranks=self.ranks))
        self.telemetry.record(step_record(comp, step=step, ranks=self.ranks, bits=bits,
                                          traffic=traffic, refitted=refitted,
                                          skipped=int(self.skipped)))

    def _forget_memory(self, names: set[str]) -> None:
        """Drop error memory of buckets DDP no longer has (its first-iteration bucket)."""
        memory = self.compression.error_memory
        if memory is None:
            return
        for key in [k for k in memory.memory if k not in names]:
            memory.forget(key)

    # ------------------------------------------------------------------ layout
    def _name(self, p: torch.Tensor, index: int, position: int) -> str:
        name = self._names.get(p)
        return name if name is not None else f"b{index}.{position}{list(p.shape)}"

    def _units_for(self, index: int, params: list[torch.Tensor],
                   buffer: torch.Tensor) -> list[_Unit]:
        names = tuple(self._name(p, index, i) for i, p in enumerate(params))
        numels = tuple(p.numel() for p in params)
        device = str(buffer.device)
        cover = self._cover(names) if self._target is not None else None
        if cover is None or cover == [(index, names)]:
            return [_Unit(self._plan(index, names, numels, device), names, numels)]
        where, at = {}, 0
        for name, n in zip(names, numels):
            where[name] = (at, n)
            at += n
        units = []
        for t_index, t_names in cover:
            segments = tuple(where[n] for n in t_names)
            t_numels = tuple(n for _, n in segments)
            units.append(_Unit(self._plan(t_index, t_names, t_numels, device), t_names,
                               t_numels, segments))
        return units

    def _cover(self, names: tuple[str, ...]) -> list[tuple[int, tuple[str, ...]]] | None:
        """The saved buckets that make up exactly this DDP bucket, in saved order (None: they
        do not; this step then cannot match the saved run bit for bit)."""
        target = self._target
        chosen = {target[n] for n in names if n in target}
        if all(n in target for n in names) and {n for _, ns in chosen for n in ns} == set(names):
            return sorted(chosen)
        if not self._warned_layout:
            self._warned_layout = True
            logger.warning("%s: DDP's buckets do not contain the buckets saved in the "
                           "checkpoint; the resumed run uses DDP's buckets (correct, but not "
                           "bit-identical to an uninterrupted run)", self.prefix)
        return None

    def _plan(self, index: int, names: tuple[str, ...], numels: tuple[int, ...],
              device: str) -> BucketPlan:
        """The bucket's name and wire (the cost model at the current code width), cached."""
        key = (index, names)
        if key in self._plans:
            return self._plans[key]
        comp, settings = self.compression, self.settings
        total = sum(numels)
        plans, _ = plan_buckets(
            list(names), list(numels), [device] * len(names), prefix=f"{self.prefix}.b{index}",
            cap_numel=max(1, total), small_threshold=0, quantizes=comp.quantizes,
            exchange=settings.exchange, bits=comp.code_bits, bucket_size=comp.bucket_size,
            ranks=self.ranks, network=settings.network, per_node=self.wire.per_node)
        if plans:
            plan = dataclasses.replace(plans[0], index=index)
        else:   # nothing quantized: one allreduce of the bucket
            plan = BucketPlan(index, f"{self.prefix}.b{index}", tuple(range(len(names))), total,
                              ALLREDUCE)
        self._plans[key] = plan
        return plan

    def _handshake(self, unit: _Unit) -> None:
        """Before a layout's first exchange; every rank raises the same error."""
        key = (unit.index, unit.names)
        if key in self._checked:
            return
        plan = unit.plan
        layout = (layout_digest([plan], [], self._wire_setting.digest())
                  if plan.mode != ALLREDUCE else layout_digest([], [f"{plan.name}:{plan.numel}"]))
        self._checked.add(key)
        handshake(self._comm, self.compression, layout)

    @property
    def buckets(self) -> list[tuple[str, int, str, list[str]]]:
        """(name, numel, exchange mode, parameter names) of the last step's exchanges (the
        planned mode, or the decided one with ``wire="auto"``)."""
        step = self.compression.quantizer.step

        def mode(index: int, names: tuple[str, ...]) -> str:
            plan = self._plans.get((index, names))
            if plan is None or plan.mode == ALLREDUCE:
                return "?" if plan is None else plan.mode
            return self._wire_setting.mode(step, index, plan.mode)
        return [(name, numel, mode(i, names), list(names)) for i, name, numel, names in self.layout]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The compressor's state (tables, versions, step, DQSGD rule) and the bucket layout.
        Never a collective, so rank 0 alone may call it: with
        :class:`~horovod_aq.ErrorFeedback` it holds this rank's error memory, tagged with this
        rank, or every rank's right after :meth:`consolidate_state_dict`
        (``error_feedback.checkpoint_state``)."""
        self._resolve()
        compression = checkpoint_state(self.compression, rank=self._comm.rank, world=self.ranks)
        return {"format": STATE_FORMAT, "compression": compression,
                "layout": [[i, name, numel, list(names)] for i, name, numel, names in self.layout],
                "wire": self._wire_setting.state_dict()}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's error memory to rank ``to`` of the hook's group, whose next
        :meth:`state_dict` before the next step holds all of them. Collective: call it on every
        rank between steps (``ZeroRedundancyOptimizer.consolidate_state_dict``'s pattern)."""
        self._resolve()
        buckets = [(name, numel) for _, name, numel, _ in self.layout]
        consolidate_memory(self.compression, buckets, rank=self._comm.rank, world=self.ranks,
                           to=to, allgather=self._comm.allgather)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the same checkpoint on every rank). The handshake runs
        again at the next exchange; a rank gets its error memory back where the checkpoint
        holds it with the same number of ranks, otherwise it restarts from zero (one log
        line)."""
        if int(state.get("format", 0)) != STATE_FORMAT:
            raise ValueError(f"hook state format {state.get('format')!r}; this build reads "
                             f"{STATE_FORMAT}")
        self._resolve()
        self.compression.load_state_dict(
            select_memory(self.compression, state["compression"], self._comm.rank, self.ranks))
        self.layout = [(int(i), str(name), int(numel), tuple(names))
                       for i, name, numel, names in state["layout"]]
        self._target = ({n: (i, names) for i, _, _, names in self.layout for n in names}
                        if self.layout and self._names else None)
        self._warned_layout = False
        self._wire_setting.load_state_dict(state.get("wire"))   # None: measure again
        self._checked.clear()
        self._steps, self._pending, self._started = [], [], None


def quantized_hook(state: QuantizedHookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """The DDP communication hook: ``ddp_model.register_comm_hook(state, quantized_hook)``."""
    return state.exchange(bucket)


# DDP checks the hook's annotations against the objects themselves (not the strings that
# ``from __future__ import annotations`` leaves).
quantized_hook.__annotations__ = {"state": QuantizedHookState, "bucket": dist.GradBucket,
                                  "return": torch.futures.Future[torch.Tensor]}


def register(model: torch.nn.parallel.DistributedDataParallel, compression: Any,
             **kwargs: Any) -> QuantizedHookState:
    """Create the state for ``model`` (its process group and its module's parameter names) and
    register :func:`quantized_hook`; ``kwargs`` go to :class:`QuantizedHookState`."""
    kwargs.setdefault("named_parameters", model.module.named_parameters())
    state = QuantizedHookState(compression, kwargs.pop("process_group", model.process_group),
                               **kwargs)
    model.register_comm_hook(state, quantized_hook)
    return state


__all__ = ["ConfigMismatchError", "QuantizedHookState", "destroy_and_exit", "quantized_hook",
           "register"]
