"""The packed gradient exchange in TensorFlow, shared by the tape and the Keras optimizer.

:class:`PackedExchange` turns a list of local gradients into their average over a Horovod process
set, sending bit-packed codes (docs/protocol.md §5). The per-rank decisions are the core's,
called at trace time: argument checks, handshake and telemetry (:mod:`horovod_aq.packed.protocol`),
a bucket's send order and markers (``packed.send``, ``packed.marker``), the receive outcome and
the parameter it names (``packed.receive``, ``packed.params``), the two-phase chunk's zero spans
(``packed.chunks``); the graph computes their inputs and moves tensors. Both
``horovod_aq.tensorflow.DistributedGradientTape`` and ``horovod_aq.keras.DistributedOptimizer``
call :meth:`PackedExchange.reduce`; nothing about the exchange is duplicated between them.

Wire per bucket, chosen by ``exchange`` ("auto" = the cost model of :mod:`horovod_aq.packed.cost`):
allgather "aq.ag.<bucket>" of one payload per rank, or two-phase: alltoall "aq.a2a.<bucket>" of P
chunks, decode and average chunk r, re-encode, allgather "aq.ag.<bucket>". Small tensors (all of
them for NoCompression / FP16) go through a named allreduce. Every rank decodes the same bytes,
so the averaged gradients are bitwise identical on all ranks.

Coding (``wire=``): "fixed" payloads have one static size per bucket and code width; "entropy"
payloads (docs/format.md §12, docs/protocol.md §5.4) have sizes known only when the graph runs
(shape [None], no retrace): the allgather takes a different first dimension on every rank and
the rows are delimited on receipt by their own headers (``packed.delimit``, no extra
collective), the alltoall sends its chunks with their splits, and the decoders of variable rows
read them (:mod:`horovod_aq.tensorflow.entropy`). The codes are those of the fixed wire, so the
averages are bitwise the same. Telemetry counts the bytes really sent (``packed.send.
sent_bytes``, summed in-graph into the counters of :mod:`horovod_aq.tensorflow.counters`).

The graph is built in stages, one method each (docs/protocol.md §13): (0) the per-step agreement
on what trains (``packed.trainable``, docs/protocol.md §3.1: one small allgather and its check,
which every collective of the exchange waits for); (1) encode and submit every first collective
and the small allreduces; (2a) check and decode every two-phase chunk; (2b) re-encode the
averaged chunks and allgather them; (3) check and decode everything; then the step end
(error-feedback update, DQSGD aggregate, counters, refit when due). How the stages keep
a failing check from leaving a collective submitted on some ranks only, how DQSGD switches
widths and ECQ-SGD updates memory without retracing: docs/protocol.md §13.

Modules around this one: the layouts (bucket plans, content names, the agreement row)
:mod:`horovod_aq.tensorflow.plans`; the payload ops :mod:`horovod_aq.tensorflow.payloads`; with
error feedback the compensated encode and the memory update :mod:`horovod_aq.tensorflow.
compensated`; the marker decision on received rows :mod:`horovod_aq.tensorflow.receive`; the
in-graph counters :mod:`horovod_aq.tensorflow.counters`; local aggregation and local sources
around the exchange :mod:`horovod_aq.tensorflow.aggregation`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_aq.packed import plan as names
from horovod_aq.packed.chunks import chunk_zero_spans
from horovod_aq.packed.cost import chunk_numel, inner_mode
from horovod_aq.packed.plan import (
    DEFAULT_FUSION_BYTES,
    BucketPlan,
    op_name,
)
from horovod_aq.packed.protocol import (
    ExchangeSettings,
    check_compression,
    check_wire,
    handshake,
    measured_traffic,
    step_record,
)
from horovod_aq.packed.send import reencode_part, sent_bytes
from horovod_aq.packed.trainable import agree_first
from horovod_aq.packed.waiting import Deadline
from horovod_aq.packed.waiting import stall_timeout_s as stall_timeout_of
from horovod_aq.telemetry import StepRecord, Telemetry
from horovod_aq.tensorflow.agreement import Agreement
from horovod_aq.tensorflow.checks import translate_error
from horovod_aq.tensorflow.comm import comm_for
from horovod_aq.tensorflow.compensated import MemoryUpdate, update_memory
from horovod_aq.tensorflow.counters import Counters
from horovod_aq.tensorflow.payloads import PayloadOps
from horovod_aq.tensorflow.plans import Plan, make_plan, plan_traffic_at, small_numels
from horovod_aq.tensorflow.receive import nonfinite_check
from horovod_aq.tensorflow.sources import dense_gradient, source_name, static_shape
from horovod_aq.tensorflow.stall import arm_in_graph, disarm_in_graph, translate, watchdog
from horovod_aq.tensorflow.state import StatsSlot, TFState, state_variable, tf_state
from horovod_aq.tensorflow.step import end_step_in_graph

__all__ = ["PackedExchange", "check_tf_wire", "exchange_for"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Trace:
    """The tensors one traced exchange of a layout passes from stage to stage."""

    plan: Plan
    tensors: list[tf.Tensor]
    raise_nonfinite: bool
    agreed: tf.Tensor                # the step's agreement passed: every collective waits for it
    first: dict[int, tf.Tensor] = dataclasses.field(default_factory=dict)   # stage 1 output
    splits: dict[int, tf.Tensor] = dataclasses.field(default_factory=dict)  # received (a2a)
    sent: list[tuple[tf.Tensor, tf.Tensor]] = dataclasses.field(default_factory=list)  # bytes
    small: dict[int, tf.Tensor] = dataclasses.field(default_factory=dict)   # by source
    own: dict[int, MemoryUpdate] = dataclasses.field(default_factory=dict)  # ECQ, by bucket
    chunk_avgs: dict[int, tf.Tensor] = dataclasses.field(default_factory=dict)  # stage 2a
    second: dict[int, tf.Tensor] = dataclasses.field(default_factory=dict)  # stage 2b output
    results: dict[int, tf.Tensor] = dataclasses.field(default_factory=dict)  # by source
    decoded: list[tuple[tf.Tensor, tf.Tensor]] = dataclasses.field(default_factory=list)
    skipped: list[tf.Tensor] = dataclasses.field(default_factory=list)
    side_effects: list[tf.Tensor] = dataclasses.field(default_factory=list)

    @property
    def stage1(self) -> list[tf.Tensor]:
        return list(self.first.values()) + list(self.small.values())


class PackedExchange:
    """Averages gradients over ``process_set`` with the packed exchange (module docstring).

    Obtain one with :func:`exchange_for` (one per compressor and settings, reused by every tape
    built in a ``tf.function`` step).
    """

    def __init__(self, compression: Any, *, process_set: hvd.ProcessSet,
                 settings: ExchangeSettings, telemetry: Telemetry | None, index: int,
                 coding: str = "fixed", stall_timeout: float | None = None) -> None:
        self.compression = compression
        #: How payloads are coded: "fixed" or "entropy" (``wire=``; module docstring).
        self.coding = coding
        self.quantizer = compression.quantizer    # table, bits, step, seed, refits
        #: How long the collectives of one exchange may wait (:mod:`~horovod_aq.tensorflow.
        #: stall`; None: forever).
        self.deadline = Deadline(stall_timeout, step=lambda: self.quantizer.step)
        self.process_set = process_set
        self.settings = settings
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        self.index = index                        # among this compression's exchanges
        #: a process-local label of this exchange's variables (never a collective's name)
        self.label = op_name(f"{compression.name}.x{index}")
        self.included = bool(process_set.included())
        self.ranks = process_set.size() if self.included else 1
        self.active = self.included and self.ranks > 1
        self._state: TFState = tf_state(compression)
        self._plans: dict[tuple, Plan] = {}
        self._plan_list: list[Plan] = []
        #: The per-step agreement on what trains (``packed.trainable``): its allgather's name is
        #: fixed by the first layout this exchange plans (:meth:`_make_plan`), so no later
        #: layout renames it; whether a handshake passed (``agree_first``); and 1 while the
        #: agreement of the next exchange that runs was collected at trace time (the graph then
        #: skips its own: one agreement per step).
        self._agreement = Agreement(process_set, self.ranks)
        self._handshaken = False
        self._agreed = state_variable(np.int64(0), name=f"aq_agreed_{self.label}")
        #: Exchanges run and skipped, the layout that ran, bytes sent, DQSGD's Σ‖aggregate‖²
        #: (:mod:`horovod_aq.tensorflow.counters`).
        self._counters = Counters(self.label, self._state.dynamic)
        self._slot_ids = itertools.count()
        self._ops = PayloadOps(compression, self._state, ranks=self.ranks, rank=hvd.rank(),
                               coding=coding)
        #: Tapes' local gradient aggregations by backward_passes_per_step
        #: (:func:`horovod_aq.tensorflow.aggregation.aggregation_for`).
        self.aggregations: dict[int, Any] = {}

    # ------------------------------------------------------------------ public
    @property
    def lock(self):
        """The lock of the compressor's TensorFlow state (guards :attr:`aggregations`)."""
        return self._state.lock

    @property
    def tap(self) -> Callable[[BucketPlan, int, np.ndarray, np.ndarray], Any] | None:
        """The payload tap, as PyTorch's ``Wire.tap``: None, or a callable receiving
        ``(bucket, part, values, payload)`` for every payload this exchange encodes, when the
        graph runs — the bucket (its ``name``, its ``index`` in the stream key), the stream part
        (k < P: the allgather payload or two-phase chunk k; P: the re-encoded averaged chunk,
        docs/format.md §6), the float32 values encoded and the payload bytes (numpy copies).
        Read when a layout's graph is traced: set it before the first exchange."""
        return self._ops.tap

    @tap.setter
    def tap(self, fn: Callable[..., Any] | None) -> None:
        self._ops.tap = fn

    @property
    def buckets(self) -> list[tuple[str, int, str, list[str]]]:
        """(name, numel, mode, source names) of every bucket of the latest layout."""
        if not self._plan_list:
            return []
        plan = self._plan_list[-1]
        return [(b.name, b.numel, b.mode, [plan.names[i] for i in b.members]) for b in plan.buckets]

    # AutoGraph would convert this module and the kernels at every first trace in a user's
    # tf.function (seconds): the exchange has no Python control flow on tensors, so skip it.
    @tf.autograph.experimental.do_not_convert
    def reduce(self, grads: Sequence[Any], sources: Sequence[Any]) -> list[Any]:
        """Average ``grads`` (one per source; None stays None) over the process set.

        IndexedSlices (an ``Embedding``'s gradient) are densified to their source's static
        shape. Works eagerly and inside ``tf.function``. With the compressor's
        ``nonfinite="skip"``, tensors of a bucket in which some rank had NaN/Inf come back NaN on
        every rank (see :meth:`reduce_with_status`).
        """
        return self.reduce_with_status(grads, sources)[0]

    @tf.autograph.experimental.do_not_convert
    def reduce_with_status(self, grads: Sequence[Any], sources: Sequence[Any], *,
                           nonfinite: str | None = None) -> tuple[list[Any], tf.Tensor]:
        """:meth:`reduce`, plus a bool tensor: whether a rank sent non-finite markers (the step
        should be skipped on every rank; only with ``nonfinite="skip"``, else that raises).

        ``nonfinite`` overrides the compressor's setting for this call ("skip": the markers'
        buckets come back NaN on every rank and nothing raises — what a ``LossScaleOptimizer``
        needs, since it decides on the averaged gradients)."""
        grads = list(grads)
        sources = list(sources)
        if len(grads) != len(sources):
            raise ValueError(f"got {len(grads)} gradients for {len(sources)} sources")
        mode = self.compression.nonfinite if nonfinite is None else nonfinite
        if mode not in ("raise", "skip"):
            raise ValueError(f"nonfinite must be 'raise' or 'skip', got {mode!r}")
        raise_nonfinite = mode == "raise"
        dense = [None if g is None else dense_gradient(g, s) for g, s in zip(grads, sources)]
        present = [i for i, g in enumerate(dense) if g is not None]
        if not self.active or not present:
            return dense, tf.constant(False)
        labels = [source_name(sources[i], i) for i in present]
        shapes = [tuple(static_shape(dense[i], labels[k])) for k, i in enumerate(present)]
        key = tuple(zip(labels, shapes, (dense[i].dtype.name for i in present)))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._make_plan(key, labels, shapes)
        if not plan.checked:
            if agree_first(handshake_due=True, handshaken_in_world=self._handshaken):
                self._agree_now(plan)
            self._handshake(plan)
        tensors = [dense[i] for i in present]
        if tf.executing_eagerly():
            fn = plan.fns.get(raise_nonfinite)
            if fn is None:
                fn = plan.fns[raise_nonfinite] = tf.function(
                    functools.partial(self._exchange_args, plan, raise_nonfinite),
                    autograph=False)
            try:
                outs, skipped = fn(*tensors)
            except tf.errors.OpError as err:
                if watchdog().stalled is not None:   # Horovod's error after a stall
                    raise translate(err) from err
                translated = translate_error(err)   # an error raised on the host in-graph
                if translated is not err:
                    raise translated from None
                raise
        else:
            outs, skipped = self._exchange(plan, tensors, raise_nonfinite)
        result = list(dense)
        for i, out in zip(present, outs):
            result[i] = out
        return result, skipped

    def _exchange_args(self, plan: Plan, raise_nonfinite: bool, *tensors: tf.Tensor):
        return self._exchange(plan, list(tensors), raise_nonfinite)

    def end_step(self) -> bool:
        """End the training step (eager): refit when due, record telemetry. See
        :func:`horovod_aq.tensorflow.refit`."""
        from horovod_aq.tensorflow.step import refit

        return refit(self.compression, process_set=self.process_set)

    def state_dict(self) -> dict[str, Any]:
        """The compressor's state, never a collective (this rank's error memory, or every
        rank's after :meth:`consolidate_state_dict`); see
        :func:`horovod_aq.tensorflow.checkpoint.state_dict`."""
        from horovod_aq.tensorflow.checkpoint import state_dict

        return state_dict(self.compression, process_set=self.process_set)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's error memory to rank ``to`` for its next :meth:`state_dict`
        (collective on this exchange's process set); see
        :func:`horovod_aq.tensorflow.checkpoint.consolidate_state_dict`."""
        from horovod_aq.tensorflow.checkpoint import consolidate_state_dict

        consolidate_state_dict(self.compression, to=to, process_set=self.process_set)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` on this rank; see
        :func:`horovod_aq.tensorflow.checkpoint.load_state_dict`."""
        from horovod_aq.tensorflow.checkpoint import load_state_dict

        load_state_dict(self.compression, state, process_set=self.process_set)

    # ------------------------------------------------------------------ refit support
    def take_aggregate(self) -> float:
        """DQSGD: Σ‖decoded aggregate‖² (float64) of the exchanges since the last call, then
        reset to 0 (eager). Bitwise the same on every rank. 0.0 for other compressors."""
        return self._counters.take_aggregate()

    def take_calls(self) -> tuple[int, int]:
        """(exchanges run, of which skipped for non-finite input) since the last call (eager)."""
        return self._counters.take_calls()

    def take_sent(self) -> dict[str, int]:
        """``payload_bytes`` and ``bytes_sent`` (quantized buckets only) that this rank's
        exchanges really sent since the last call (eager; the in-graph counters)."""
        return self._counters.take_sent()

    def record_step(self, step: int, refitted: bool, calls: int, skipped: int = 0,
                    bits: int | None = None) -> StepRecord:
        """Record the telemetry of the step that just ended (the last layout that ran);
        ``bits`` is the code width the step used (default: the current table's). The byte
        counts are the measured ones (``protocol.measured_traffic``: the sizes really sent, so
        ``bits_per_coordinate`` is the entropy wire's real rate; docs/protocol.md §8)."""
        plan_id = int(self._counters.plan_id.numpy())
        plan = self._plan_list[plan_id] if 0 <= plan_id < len(self._plan_list) else None
        comp = self.compression
        if bits is None:
            bits = comp.code_bits
        sent = self.take_sent()
        traffic = None if plan is None else plan_traffic_at(plan, comp, self.ranks, bits)
        rec = step_record(comp, step=step, ranks=self.ranks, bits=bits, traffic=traffic,
                          calls=calls, refitted=refitted, skipped=skipped)
        if plan is not None:
            measured = measured_traffic(traffic, sent, small_numels(plan) * calls,
                                        fp16=comp.fp16_wire, ranks=self.ranks)
            rec.payload_bytes, rec.bytes_sent = measured["payload_bytes"], measured["bytes_sent"]
        self.telemetry.record(rec)
        return rec

    # ------------------------------------------------------------------ layout
    def _make_plan(self, key: tuple, source_names: list[str],
                   shapes: list[tuple[int, ...]]) -> Plan:
        """Plan a new layout of these sources (:func:`horovod_aq.tensorflow.plans.make_plan`)."""
        plan = make_plan(self.compression, self.settings, ranks=self.ranks, coding=self.coding,
                         index=len(self._plan_list), source_names=source_names, shapes=shapes)
        if self._agreement.name is None:   # what the exchange was first used with
            self._agreement.name = names.agreement_name(plan.content)
        self._plans[key] = plan
        self._plan_list.append(plan)
        return plan

    def _handshake(self, plan: Plan) -> None:
        """Compare settings, table, step and layout across the set (``packed.protocol.handshake``
        over this set's one Comm; eager, once per layout)."""
        with tf.init_scope():
            handshake(comm_for(self.process_set), self.compression, plan.layout)
        plan.checked = self._handshaken = True

    # ------------------------------------------------------------------ what trains
    def _agree_now(self, plan: Plan) -> None:
        """This step's agreement on what trains, collected before ``plan``'s handshake (trace
        time, eager; ``packed.trainable.agree_first``): a rank that planned a new layout alone
        meets here the others' agreement in their graph, and every rank raises the same
        ConfigMismatchError. Passed, it is the step's: the graph that runs next skips its own."""
        self._agreement.now(plan.agreement)
        with tf.init_scope():
            self._agreed.assign(1)

    def _agree(self, plan: Plan) -> tf.Tensor:
        """The graph's agreement on what trains (:class:`~horovod_aq.tensorflow.agreement.
        Agreement`, before any collective of the exchange is submitted) — unless it was
        collected at trace time for this run (:meth:`_agree_now`). No gradient flows in, so it
        can run while the backward pass computes. Returns the op every collective of the
        exchange waits for."""
        owed = self._agreed.read_value()
        agreed = tf.cond(owed > 0, lambda: tf.constant(True),
                         lambda: self._agreement.in_graph(plan.agreement))
        with tf.control_dependencies([agreed]):
            return self._agreed.assign(0, read_value=False)

    # ------------------------------------------------------------------ graph
    def _slot(self, numel: int, bucket: str) -> StatsSlot | None:
        return self._state.new_slot(numel, f"{bucket}#{next(self._slot_ids)}")

    def _exchange(self, plan: Plan, tensors: list[tf.Tensor],
                  raise_nonfinite: bool = True) -> tuple[list[tf.Tensor], tf.Tensor]:
        """The exchange graph of one layout, stage by stage (module docstring). Returns the
        averaged tensors and whether a rank sent non-finite markers (``raise_nonfinite`` False,
        nonfinite="skip": the affected tensors are NaN)."""
        token = arm_in_graph(self.deadline, [str(self._agreement.name)] + [
            names.alltoall_name(b.name) if b.mode == "two_phase" else names.allgather_name(b.name)
            for b in plan.buckets])     # the stall deadline, until the step has ended
        with tf.control_dependencies([token]):
            agreed = self._agree(plan)
        t = _Trace(plan, tensors, raise_nonfinite, agreed, skipped=[tf.constant(False)])
        self._submit_stage(t)
        self._decode_chunks_stage(t)
        self._reencode_stage(t)
        self._decode_stage(t)
        outs, skipped = self._end_stage(t)
        with tf.control_dependencies(outs + [skipped]):
            disarmed = disarm_in_graph(token)
        with tf.control_dependencies([disarmed]):
            return [tf.identity(o) for o in outs], tf.identity(skipped)

    def _submit_stage(self, t: _Trace) -> None:
        """Stage 1: encode every bucket (``PayloadOps.send_parts``; with error feedback
        ``send_compensated``: x = g + α·h, its payloads and h' in one op; statistics recorded on
        what is quantized, markers for what cannot travel) and submit its first collective,
        then the small tensors' allreduces."""
        comp, P, ps, st = self.compression, self.ranks, self.process_set, self._state
        for b in t.plan.buckets:
            parts = [tf.reshape(tf.cast(t.tensors[m], tf.float32), [-1]) for m in b.members]
            raw = parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)
            slot = self._slot(b.numel, b.name)
            record = None if slot is None else slot.record
            if st.error_memory is not None:
                memory = st.memory_variable(b.name, b.numel)
                sent, fused = self._ops.send_compensated(raw, memory.read_value(), b,
                                                         mode=b.mode, record=record)
                t.own[b.index] = MemoryUpdate(memory, fused.memory, fused.finite)
            else:
                sent = self._ops.send_parts(raw, b, mode=b.mode, record=record)
            sizes = [tf.size(p, out_type=tf.int64) for p in sent]
            t.sent.append(sent_bytes(b.mode, sizes, ps.rank(), P))
            with tf.control_dependencies([t.agreed]):   # no collective before the agreement
                if b.mode == "allgather":   # any first dimension per rank (entropy: delimited)
                    t.first[b.index] = hvd.allgather(sent[0], name=names.allgather_name(b.name),
                                                     ignore_name_scope=True, process_set=ps)
                elif self._ops.variable:   # the chunks with their sizes; received splits back
                    t.first[b.index], t.splits[b.index] = hvd.alltoall(
                        tf.concat(sent, axis=0), splits=tf.cast(tf.stack(sizes), tf.int32),
                        name=names.alltoall_name(b.name), ignore_name_scope=True,
                        process_set=ps)
                else:
                    t.first[b.index] = hvd.alltoall(
                        tf.concat(sent, axis=0), name=names.alltoall_name(b.name),
                        ignore_name_scope=True, process_set=ps)
        for i in t.plan.small:
            g = t.tensors[i]
            wire = tf.cast(g, tf.float16) if comp.fp16_wire else g
            with tf.control_dependencies([t.agreed]):
                out = hvd.allreduce(wire, op=hvd.Average,
                                    name=names.allreduce_name(t.plan.content, t.plan.names[i]),
                                    ignore_name_scope=True, process_set=ps)
            t.small[i] = tf.cast(out, g.dtype)

    def _decode_chunks_stage(self, t: _Trace) -> None:
        """Stage 2a: check and decode-average every two-phase chunk this rank received, before
        any second collective (NaN for a chunk with markers)."""
        with tf.control_dependencies(t.stage1):
            for b in t.plan.buckets:
                if b.mode != "two_phase":
                    continue
                m = chunk_numel(b.numel, self.ranks, self.compression.bucket_size)
                rows = self._ops.rows(t.first[b.index], m, b, t.splits.get(b.index))
                bad, check = nonfinite_check(self._ops, t.plan, b, rows, t.raise_nonfinite,
                                             names.alltoall_name(b.name))
                t.skipped.append(bad)
                with tf.control_dependencies([check]):
                    t.chunk_avgs[b.index] = tf.cond(
                        bad, lambda m=m: tf.fill([m], float("nan")),
                        lambda rows=rows, m=m: self._ops.decode_average(rows, m))

    def _reencode_stage(self, t: _Trace) -> None:
        """Stage 2b: re-encode this rank's averaged chunk (stream part ``send.reencode_part``;
        markers if it is NaN) and allgather it. Where the chunk holds no gradient
        (``chunks.chunk_zero_spans``: the bucket's zero padding) the decoded average is noise
        that would inflate the re-encoded norm: exact zeros go there (docs/protocol.md §15)."""
        P, ps = self.ranks, self.process_set
        with tf.control_dependencies(list(t.chunk_avgs.values())):
            for b in t.plan.buckets:
                if b.mode != "two_phase":
                    continue
                m = chunk_numel(b.numel, P, self.compression.bucket_size)
                avg = t.chunk_avgs[b.index]
                for lo, hi in chunk_zero_spans(b.numel, m, ps.rank()):
                    avg = tf.concat([avg[:lo], tf.zeros([hi - lo], avg.dtype), avg[hi:]], axis=0)
                payload = self._ops.send(avg, b, mode="allgather", first_part=reencode_part(P))
                size = tf.size(payload, out_type=tf.int64)
                t.sent.append((tf.constant(0, tf.int64), sent_bytes("allgather", [size],
                                                                    ps.rank(), P)[1]))
                t.second[b.index] = hvd.allgather(payload, name=names.allgather_name(b.name),
                                                  ignore_name_scope=True, process_set=ps)

    def _decode_stage(self, t: _Trace) -> None:
        """Stage 3: after every collective completed, check and decode every bucket (NaN for a
        bucket with markers) and cut it back into the sources' tensors."""
        plan, nan = t.plan, float("nan")
        with tf.control_dependencies(t.stage1 + list(t.second.values())):
            for b in plan.buckets:
                if b.mode == "allgather":
                    rows = self._ops.rows(t.first[b.index], b.numel, b)
                    bad, check = nonfinite_check(self._ops, plan, b, rows, t.raise_nonfinite,
                                                 names.allgather_name(b.name))
                    t.skipped.append(bad)
                    with tf.control_dependencies([check]):
                        flat = tf.cond(bad, lambda b=b: tf.fill([b.numel], nan),
                                       lambda rows=rows, b=b: self._ops.decode_average(
                                           rows, b.numel))
                else:
                    m = chunk_numel(b.numel, self.ranks, self.compression.bucket_size)
                    rows = self._ops.rows(t.second[b.index], m, b)
                    bad, _ = nonfinite_check(self._ops, plan, b, rows, False,   # skip mode
                                             names.allgather_name(b.name))

                    def decode_all(rows=rows, m=m, b=b):
                        return self._ops.decode_rows(rows, m)[:b.numel]

                    flat = tf.cond(bad, lambda b=b: tf.fill([b.numel], nan), decode_all)
                t.decoded.append((flat, bad))
                for pos in b.members:
                    off = plan.offsets[pos]
                    n = int(np.prod(plan.shapes[pos], dtype=np.int64))
                    g = t.tensors[pos]
                    t.results[pos] = tf.cast(tf.reshape(flat[off:off + n], tf.shape(g)), g.dtype)
        t.results.update(t.small)

    def _end_stage(self, t: _Trace) -> tuple[list[tf.Tensor], tf.Tensor]:
        """The step end: ECQ-SGD's memory update, the counters (DQSGD's Σ‖aggregate‖² too), then the
        compressor's step end (refit when due, telemetry: :mod:`horovod_aq.tensorflow.step`);
        the outputs wait for all of it."""
        any_skipped = tf.reduce_any(tf.stack(t.skipped))
        side_effects = list(t.side_effects)
        if t.own:   # ECQ-SGD: h ← h' after every check passed (docs/protocol.md §13)
            side_effects += update_memory(self._state.error_memory, self._state.memory_resets,
                                          t.own.values(), any_skipped, list(t.results.values()))
        decoded = t.decoded + [(t.small[i], tf.constant(False)) for i in t.plan.small]
        side_effects += self._counters.in_graph(t.plan.index, any_skipped, t.sent, decoded)
        with tf.control_dependencies(side_effects):
            ended = end_step_in_graph(self.compression, self.process_set)
        with tf.control_dependencies([ended]):
            outs = [tf.identity(t.results[pos]) for pos in range(len(t.tensors))]
            return outs, tf.identity(any_skipped)


def check_tf_wire(wire: Any) -> str:
    """The ``wire=`` of the TensorFlow tape and Keras optimizer: "fixed" or "entropy"
    (``packed.protocol.check_wire``). "auto" (the wire chosen by timing the candidates on the
    job's steps, docs/protocol.md §5.5) is refused with what to pass instead: it is implemented
    for the PyTorch exchanges only."""
    if isinstance(wire, str) and wire == "auto":
        raise ValueError("wire='auto' (the wire chosen by timed trials, docs/protocol.md §5.5) "
                         "is implemented for the PyTorch exchanges only for now; pass "
                         "wire='fixed' or wire='entropy' to the TensorFlow tape and the Keras "
                         "optimizer")
    return check_wire(wire)


def check_tf_exchange(exchange: Any) -> None:
    """The node-aware modes (docs/protocol.md §5.7) are refused with what to pass instead: the
    TensorFlow exchange is flat (docs/keras.md §2)."""
    if isinstance(exchange, str) and inner_mode(exchange) is not None:
        raise ValueError(f"exchange={exchange!r} (node-aware, docs/protocol.md §5.7) is "
                         "implemented for the PyTorch exchanges only for now; pass "
                         "exchange='auto', 'allgather' or 'two_phase' to the TensorFlow tape "
                         "and the Keras optimizer")


def exchange_for(compression: Any, *, process_set: hvd.ProcessSet, exchange: str = "auto",
                 fusion_bytes: int = DEFAULT_FUSION_BYTES, small_tensor_threshold: int = 0,
                 network: Any = None, telemetry: Telemetry | None = None,
                 wire: str = "fixed", stall_timeout_s: float | None = None) -> PackedExchange:
    """The :class:`PackedExchange` of ``compression`` with these settings (created once);
    ``wire``: how payloads are coded, "fixed" or "entropy" (:func:`check_tf_wire`);
    ``stall_timeout_s``: how long one exchange may wait (default
    ``$HOROVOD_AQ_STALL_TIMEOUT_S``, else 300 s; 0: forever; :mod:`horovod_aq.tensorflow.
    stall`)."""
    check_compression(compression, "hvd.DistributedGradientTape")
    wire = check_tf_wire(wire)
    check_tf_exchange(exchange)
    stall = stall_timeout_of(stall_timeout_s)
    settings = ExchangeSettings(exchange, fusion_bytes, small_tensor_threshold, network)
    if not hvd.is_initialized():
        raise RuntimeError("call horovod.tensorflow.init() before creating the packed exchange")
    state = tf_state(compression)
    key = (process_set.process_set_id, settings,
           id(telemetry) if telemetry is not None else None, wire, stall)
    with state.lock:
        found = state.exchanges.get(key)
    if found is None:
        found = PackedExchange(compression, process_set=process_set, settings=settings,
                               telemetry=telemetry, index=len(state.exchanges), coding=wire,
                               stall_timeout=stall)
        with state.lock:
            state.exchanges[key] = found
    return found
