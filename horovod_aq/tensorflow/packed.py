"""The packed gradient exchange in TensorFlow, shared by the tape and the Keras optimizer.

:class:`PackedExchange` turns a list of local gradients into their average over a Horovod process
set, sending bit-packed codes (DESIGN.md, ``horovod.md`` §5). Both
``horovod_aq.tensorflow.DistributedGradientTape`` and ``horovod_aq.keras.DistributedOptimizer``
call :meth:`PackedExchange.reduce`; nothing about the exchange is duplicated between them.

Layout (:func:`horovod_aq.exchange.plan_buckets`, the same planner as PyTorch): the dense
gradients are fused in *reversed* source order (≈ backward order) into buckets of at most
``fusion_bytes`` of fp32. A source is named by its Keras 3 ``path`` or ``tf.Variable.name`` plus
its position, so bucket names ("<compressor>.t<k>.<i>.<crc32>") are rank-independent. Sources below
``small_tensor_threshold`` elements — all of them for NoCompression / FP16 — are averaged by a
named allreduce "aq.ar.<prefix>.<i>.<name>" (fp16 on the wire for FP16).

Wire per bucket, chosen by ``exchange`` ("auto" = the cost model of :mod:`horovod_aq.exchange`):

* allgather: encode → ``hvd.allgather`` "aq.ag.<bucket>" → ``decode_average`` of the P rows;
* two-phase: pad to P chunks of whole buckets, encode each → ``hvd.alltoall`` "aq.a2a.<bucket>"
  → ``decode_average`` of the P versions of chunk r → re-encode → ``hvd.allgather``
  "aq.ag.<bucket>" → decode every chunk.

Every rank decodes the same bytes, so the averaged gradients are bitwise identical on all ranks.
The uniforms of (step, bucket, part) come from a stateless stream keyed by the compressor's seed,
the rank and that triple (:meth:`PackedExchange._stream_seed`), as on PyTorch: a resumed run
draws what an uninterrupted one would.

Graph structure. :meth:`reduce` builds plain graph code: inside a user's ``tf.function`` (a
custom loop, Keras' train function) it is traced once with the caller; called eagerly it runs a
``tf.function`` per layout. The level table, its identity bytes and the recording flag are read
from the compressor's :class:`~.state.TFState` variables, so refits never retrace. The graph runs
in stages separated by control dependencies — (1) encode and submit every first-phase
collective, (2a) decode and check every two-phase chunk, (2b) re-encode and submit the second
allgathers, (3) decode and check everything else — so that a check that fails (it fails on every
rank alike, because every rank checks the same headers) can never leave a collective submitted on
some ranks only: no hang.

Checks: payload headers must equal this rank's expected header (another table version, bits or
layout → ``PayloadError`` eagerly; inside a graph ``tf.errors.InvalidArgumentError`` with the same
text). A rank whose gradient holds NaN/Inf (or whose bucket norm overflows float32) sends its
payload with a NaN norm, and every rank's decoder reports it (``ValueError`` /
``InvalidArgumentError``), instead of that rank failing alone and the others waiting.

First exchange of a layout: one eager allgather of ``sync.handshake_vector`` (settings, table,
step, layout digest, P) named "aq.handshake.x<serial>.<plan>" — independent of the settings it
compares, so mismatched ranks meet in it; ``check_handshake`` raises the same
``ConfigMismatchError`` on every rank. It runs at trace time (``tf.init_scope``).

Refits and telemetry: :meth:`end_step` (eager, after the optimizer step) =
``horovod_aq.tensorflow.refit(compressor, process_set=...)``: it reads the statistics recorded
in-graph on recording steps, runs ``compressor.end_step(comm)`` (the shared protocol), updates the
variables, and records one :class:`~horovod_aq.telemetry.StepRecord` per exchange that ran
(bytes from the deterministic payload sizes, like PyTorch).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
from collections.abc import Sequence
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_aq import codec
from horovod_aq.codec import (
    FLAG_NONFINITE,
    FLAGS_OFFSET,
    HEADER_SIZE,
    NonFiniteGradientError,
    PayloadError,
)
from horovod_aq.compressors import Compressor, seed_for_rank
from horovod_aq.exchange import (
    BucketPlan,
    NetworkModel,
    bytes_sent,
    chunk_numel,
    layout_digest,
    plan_buckets,
    resolve_exchange,
)
from horovod_aq.sync import check_handshake, handshake_vector
from horovod_aq.telemetry import StepRecord, Telemetry
from horovod_aq.tensorflow import kernels
from horovod_aq.tensorflow.state import (
    StatsSlot,
    TFState,
    check_supported,
    state_variable,
    tf_state,
)

logger = logging.getLogger(__name__)

#: Largest fused bucket, in bytes of fp32 gradient (the PyTorch integration's default).
DEFAULT_FUSION_BYTES = 25 * 2**20
#: Start of the non-finite check's message (translated to NonFiniteGradientError eagerly).
NONFINITE_MARK = "horovod_aq: non-finite gradient"
#: Header bytes holding a marker's first bad element (u32; ``codec.make_header``'s last field).
MARKER_INDEX_OFFSET = HEADER_SIZE - 4
_serials = itertools.count()  # exchanges created in this process (same order on every rank)


def source_name(source: Any, position: int) -> str:
    """Rank-independent name of a gradient source: Keras 3 ``path``, else ``name``, + position."""
    base = getattr(source, "path", None)
    if not isinstance(base, str):
        try:
            base = source.name
        except (AttributeError, ValueError):  # eager tensors have no name
            base = None
    if not isinstance(base, str) or not base:
        base = "source"
    base = base.removesuffix(":0")
    return f"{position}:{base}"


def op_name(text: str) -> str:
    """A Horovod/TF op name: no '/' (Horovod strips name scopes up to the last one) or ':'."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", text)


@dataclasses.dataclass
class _Plan:
    """One layout: the buckets of a list of sources and its static telemetry numbers."""

    index: int
    names: list[str]
    shapes: list[tuple[int, ...]]
    buckets: list[BucketPlan]
    small: list[int]
    layout: int
    offsets: dict[int, int]          # source position -> offset inside its bucket
    numel: int = 0
    numel_quantized: int = 0
    payload_bytes: int = 0
    bytes_sent: int = 0
    exchanges: dict[str, int] = dataclasses.field(default_factory=dict)
    fn: Any = None                   # eager entry: tf.function over the exchange
    checked: bool = False


class PackedExchange:
    """Averages gradients over ``process_set`` with the packed exchange (module docstring).

    Obtain one with :func:`exchange_for` (one per compressor and settings, reused by every tape
    built in a ``tf.function`` step).
    """

    def __init__(self, compression: Compressor, *, process_set: hvd.ProcessSet, exchange: str,
                 fusion_bytes: int, small_tensor_threshold: int, network: NetworkModel,
                 telemetry: Telemetry | None, index: int) -> None:
        self.compression = compression
        self.process_set = process_set
        self.exchange = exchange
        self.fusion_bytes = int(fusion_bytes)
        self.small_tensor_threshold = int(small_tensor_threshold)
        self.network = network
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        self.index = index
        self.prefix = f"{compression.name}.t{index}"
        self.serial = next(_serials)
        self.included = bool(process_set.included())
        self.ranks = process_set.size() if self.included else 1
        self.active = self.included and self.ranks > 1
        self._state: TFState = tf_state(compression)
        self._plans: dict[tuple, _Plan] = {}
        self._plan_list: list[_Plan] = []
        self._calls = state_variable(np.int64(0), name=f"aq_calls_{op_name(self.prefix)}")
        self._plan_id = state_variable(np.int64(-1), name=f"aq_plan_{op_name(self.prefix)}")
        self._skipped = state_variable(np.int64(0), name=f"aq_skipped_{op_name(self.prefix)}")
        self._calls_seen = 0
        self._skipped_seen = 0
        self._slot_ids = itertools.count()

    # ------------------------------------------------------------------ public
    @property
    def buckets(self) -> list[tuple[str, int, str, list[str]]]:
        """(name, numel, mode, source names) of every bucket of the latest layout."""
        if not self._plan_list:
            return []
        plan = self._plan_list[-1]
        return [(b.name, b.numel, b.mode, [plan.names[i] for i in b.members]) for b in plan.buckets]

    def reduce(self, grads: Sequence[Any], sources: Sequence[Any]) -> list[Any]:
        """Average ``grads`` (one per source; None stays None) over the process set.

        IndexedSlices are densified. Works eagerly and inside ``tf.function``. With the
        compressor's ``nonfinite="skip"``, tensors of a bucket in which some rank had NaN/Inf come
        back NaN on every rank (see :meth:`reduce_with_status`).
        """
        return self.reduce_with_status(grads, sources)[0]

    def reduce_with_status(self, grads: Sequence[Any],
                           sources: Sequence[Any]) -> tuple[list[Any], tf.Tensor]:
        """:meth:`reduce`, plus a bool tensor: whether a rank sent non-finite markers (the step
        should be skipped on every rank; only with ``nonfinite="skip"``, else that raises)."""
        grads = list(grads)
        sources = list(sources)
        if len(grads) != len(sources):
            raise ValueError(f"got {len(grads)} gradients for {len(sources)} sources")
        dense = [None if g is None else _dense(g) for g in grads]
        present = [i for i, g in enumerate(dense) if g is not None]
        if not self.active or not present:
            return dense, tf.constant(False)
        names = [source_name(sources[i], i) for i in present]
        shapes = [tuple(_static_shape(dense[i], names[k])) for k, i in enumerate(present)]
        key = tuple(zip(names, shapes, (dense[i].dtype.name for i in present)))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._make_plan(key, names, shapes)
        if not plan.checked:
            self._handshake(plan)
        tensors = [dense[i] for i in present]
        if tf.executing_eagerly():
            try:
                outs, skipped = plan.fn(*tensors)
            except tf.errors.InvalidArgumentError as err:
                raise translate_error(err) from None
        else:
            outs, skipped = self._exchange(plan, tensors)
        result = list(dense)
        for i, out in zip(present, outs):
            result[i] = out
        return result, skipped

    def end_step(self) -> bool:
        """End the training step (eager): refit when due, record telemetry. See
        :func:`horovod_aq.tensorflow.refit`."""
        from horovod_aq.tensorflow.step import refit

        return refit(self.compression, process_set=self.process_set)

    # ------------------------------------------------------------------ refit support
    def take_calls(self) -> tuple[int, int]:
        """(exchanges run, of which skipped for non-finite input) since the last call (eager)."""
        calls, skipped = int(self._calls.numpy()), int(self._skipped.numpy())
        delta = (calls - self._calls_seen, skipped - self._skipped_seen)
        self._calls_seen, self._skipped_seen = calls, skipped
        return delta

    def record_step(self, step: int, refitted: bool, calls: int, skipped: int = 0) -> StepRecord:
        """Record the telemetry of the step that just ended (the last layout that ran)."""
        plan_id = int(self._plan_id.numpy())
        plan = self._plan_list[plan_id] if 0 <= plan_id < len(self._plan_list) else None
        comp = self.compression
        rec = StepRecord(step=step, method=comp.method, ranks=self.ranks,
                         bits=comp.table.bits if comp.quantizes else comp.bits)
        if plan is not None:
            rec.numel = plan.numel * calls
            rec.numel_quantized = plan.numel_quantized * calls
            rec.payload_bytes = plan.payload_bytes * calls
            rec.bytes_sent = plan.bytes_sent * calls
            rec.exchanges = {k: v * calls for k, v in plan.exchanges.items()}
        rec.bytes_fp32 = bytes_sent("allreduce_fp32", rec.numel, 0, 1, self.ranks)
        if comp.quantizes:
            rec.table_version = comp.table.version
        rec.refit = refitted
        if refitted:
            rec.levels = comp.table.levels.tolist()
        if skipped:
            rec.extra["skipped"] = float(skipped)
        self.telemetry.record(rec)
        return rec

    # ------------------------------------------------------------------ layout
    def _make_plan(self, key: tuple, names: list[str], shapes: list[tuple[int, ...]]) -> _Plan:
        comp, P = self.compression, self.ranks
        numels = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        order = list(range(len(names)))[::-1]
        bits = comp.table.bits if comp.quantizes else comp.bits
        plans, small = plan_buckets(
            [names[i] for i in order], [numels[i] for i in order], [""] * len(order),
            prefix=f"{self.prefix}.{len(self._plan_list)}", cap_numel=max(1, self.fusion_bytes // 4),
            small_threshold=self.small_tensor_threshold, quantizes=comp.quantizes,
            exchange=self.exchange, bits=bits, bucket_size=comp.bucket_size, ranks=P,
            network=self.network)
        # map back from the reversed order to source positions
        buckets = [dataclasses.replace(b, members=tuple(order[m] for m in b.members))
                   for b in plans]
        small = [order[m] for m in small]
        plan = _Plan(len(self._plan_list), names, shapes, buckets, small,
                     layout_digest(buckets, [names[i] for i in small]), {})
        for b in buckets:
            offset = 0
            for m in b.members:
                plan.offsets[m] = offset
                offset += numels[m]
            plan.numel += b.numel
            plan.numel_quantized += b.numel
            plan.exchanges[b.mode] = plan.exchanges.get(b.mode, 0) + 1
            if b.mode == "allgather":
                size = codec.payload_size(b.numel, bits, comp.bucket_size)
            else:
                size = P * codec.payload_size(chunk_numel(b.numel, P, comp.bucket_size), bits,
                                              comp.bucket_size)
            plan.payload_bytes += size
            plan.bytes_sent += bytes_sent(b.mode, b.numel, bits, comp.bucket_size, P)
        for i in small:
            plan.numel += numels[i]
            wire = "allreduce_fp16" if comp.method == "fp16" else "allreduce_fp32"
            plan.bytes_sent += bytes_sent(wire, numels[i], 0, 1, P)
        plan.fn = tf.function(lambda *ts: self._exchange(plan, list(ts)), autograph=False)
        self._plans[key] = plan
        self._plan_list.append(plan)
        return plan

    def _handshake(self, plan: _Plan) -> None:
        """Compare settings, table, step and layout across the set (eager, once per layout)."""
        comp = self.compression
        mine = handshake_vector(comp.fingerprint(), plan.layout, self.ranks)
        with tf.init_scope():
            gathered = hvd.allgather(tf.constant(mine[None, :]),
                                     name=f"aq.handshake.x{self.serial}.{plan.index}",
                                     process_set=self.process_set).numpy()
        plan.checked = True
        check_handshake(gathered, comp.describe_fingerprint)

    # ------------------------------------------------------------------ graph
    def _stream_seed(self, bucket_index: int, part: int) -> tf.Tensor:
        """The stateless seed of the uniforms of (step, bucket, part) on this rank.

        ``[seed_for_rank(seed, rank), exchange index]`` with the step (read from the state
        variable, so no retrace), the bucket index and the part folded in: as on PyTorch, a
        resumed run draws exactly what an uninterrupted one would, whatever ran in between."""
        seed = tf.constant([seed_for_rank(self.compression.seed, hvd.rank()), self.index],
                           dtype=tf.int64)
        for data in (self._state.step.read_value(), bucket_index, part):
            seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(data, tf.int64))
        return seed

    def _encode(self, x: tf.Tensor, numel: int, bucket: str, phase: str,
                seed: tf.Tensor) -> tf.Tensor:
        """Encode a flat float32 tensor of ``numel`` elements with the table variables and the
        uniforms of ``seed`` (``bucket``/``phase`` name the call for instrumentation)."""
        comp, st = self.compression, self._state
        return kernels.encode_with(x, st.levels, st.header(numel), bits=comp.table.bits,
                                   bucket_size=comp.bucket_size, norm=comp.norm, seed=seed,
                                   check=False)

    def _marker(self, numel: int, first_bad: tf.Tensor) -> tf.Tensor:
        """``codec.nonfinite_payload`` in-graph: this table's header with ``FLAG_NONFINITE`` and
        the first bad element, zeros elsewhere, the size of a real payload."""
        comp = self.compression
        header = self._state.header(numel)
        where = tf.bitcast(tf.cast(tf.minimum(first_bad, 2**32 - 1), tf.uint32), tf.uint8)
        size = codec.payload_size(numel, comp.table.bits, comp.bucket_size)
        return tf.concat([header[:FLAGS_OFFSET], tf.constant([FLAG_NONFINITE], tf.uint8),
                          header[FLAGS_OFFSET + 1:MARKER_INDEX_OFFSET], where,
                          tf.zeros([size - HEADER_SIZE], tf.uint8)], axis=0)

    def _nonfinite_check(self, plan: _Plan, bucket: BucketPlan, rows: tf.Tensor,
                         check: bool = True):
        """(any marker among ``rows``, the op that raises on one when nonfinite="raise").

        Every rank gathered the same rows, so every rank decides alike. The message names the
        first flagged rank and the source holding the first bad element."""
        flagged = tf.bitwise.bitwise_and(rows[:, FLAGS_OFFSET], FLAG_NONFINITE) > 0
        any_bad = tf.reduce_any(flagged)
        if self.compression.nonfinite != "raise" or not check:
            return any_bad, tf.no_op()
        rank = tf.argmax(tf.cast(flagged, tf.int32), output_type=tf.int32)
        where = tf.bitcast(rows[rank, MARKER_INDEX_OFFSET:HEADER_SIZE], tf.uint32)
        starts = [plan.offsets[m] for m in bucket.members]
        order = np.argsort(starts)
        names = tf.constant([plan.names[bucket.members[i]].split(":", 1)[1] for i in order])
        index = tf.searchsorted(tf.constant(np.asarray(starts, np.int64)[order]),
                                tf.reshape(tf.cast(where, tf.int64), [1]), side="right")[0] - 1
        source = tf.gather(names, tf.clip_by_value(index, 0, len(starts) - 1))
        check = tf.debugging.Assert(
            tf.logical_not(any_bad),
            [f"{NONFINITE_MARK} on rank", rank, "(of the process set) for", source,
             (f"(bucket {bucket.name}); every rank stops here. Lower the learning rate or use "
              "loss scaling, or pass nonfinite='skip' to the compressor to skip such steps on "
              "every rank")])
        return any_bad, check

    def _submit(self, flat: tf.Tensor, numel: int, bucket: BucketPlan, phase: str,
                parts: int = 1, first_part: int = 0):
        """Encode ``flat`` (``parts`` equal chunks of ``numel``, streams ``first_part`` …) or, when
        it holds NaN/Inf, send non-finite markers of the same size instead (``codec`` module
        docstring)."""
        bad = tf.logical_not(tf.math.is_finite(flat))

        def encode() -> tf.Tensor:
            chunks = [self._encode(flat[r * numel:(r + 1) * numel], numel, bucket.name, phase,
                                   self._stream_seed(bucket.index, first_part + r))
                      for r in range(parts)]
            return chunks[0] if parts == 1 else tf.concat(chunks, axis=0)

        def markers() -> tf.Tensor:
            first = tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int64)
            return tf.tile(self._marker(numel, first), [parts])

        return tf.cond(tf.reduce_any(bad), markers, encode)

    def _decode_average(self, rows: tf.Tensor, numel: int) -> tf.Tensor:
        comp, st = self.compression, self._state
        return kernels.decode_average_with(rows, st.levels, st.header(numel), numel=numel,
                                           bits=comp.table.bits, bucket_size=comp.bucket_size)

    def _decode(self, row: tf.Tensor, numel: int) -> tf.Tensor:
        comp, st = self.compression, self._state
        return kernels.decode_with(row, st.levels, st.header(numel), numel=numel,
                                   bits=comp.table.bits, bucket_size=comp.bucket_size)

    def _slot(self, numel: int, bucket: str) -> StatsSlot | None:
        return self._state.new_slot(numel, f"{bucket}#{next(self._slot_ids)}")

    def _exchange(self, plan: _Plan, tensors: list[tf.Tensor]) -> tuple[list[tf.Tensor], tf.Tensor]:
        """The exchange graph of one layout (module docstring: stages 1, 2a, 2b, 3). Returns the
        averaged tensors and whether a rank sent non-finite markers (nonfinite="skip": the
        affected tensors are NaN)."""
        comp, P, ps = self.compression, self.ranks, self.process_set
        B = comp.bucket_size if comp.quantizes else 1
        first: dict[int, tf.Tensor] = {}     # bucket index -> phase-1 collective output
        side_effects: list[tf.Tensor] = []
        skipped = [tf.constant(False)]
        nan = float("nan")
        # stage 1: encode and submit every first collective, small allreduces
        for b in plan.buckets:
            parts = [tf.reshape(tf.cast(tensors[m], tf.float32), [-1]) for m in b.members]
            flat = parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)
            slot = self._slot(b.numel, b.name)
            if slot is not None:
                side_effects.append(slot.record(flat))
            if b.mode == "allgather":
                payload = self._submit(flat, b.numel, b, "submit")
                first[b.index] = hvd.allgather(payload, name=f"aq.ag.{b.name}",
                                               ignore_name_scope=True, process_set=ps)
            else:
                m = chunk_numel(b.numel, P, B)
                padded = tf.pad(flat, [[0, P * m - b.numel]])
                payloads = self._submit(padded, m, b, "submit", parts=P)
                first[b.index] = hvd.alltoall(payloads, name=f"aq.a2a.{b.name}",
                                              ignore_name_scope=True, process_set=ps)
        small: dict[int, tf.Tensor] = {}
        for i in plan.small:
            g = tensors[i]
            wire = tf.cast(g, tf.float16) if comp.method == "fp16" else g
            out = hvd.allreduce(wire, op=hvd.Average,
                                name=f"aq.ar.{op_name(self.prefix)}.{op_name(plan.names[i])}",
                                ignore_name_scope=True, process_set=ps)
            small[i] = tf.cast(out, g.dtype)
        stage1 = list(first.values()) + list(small.values())
        # stage 2a: check and decode every two-phase chunk before any second collective
        chunk_avgs: dict[int, tf.Tensor] = {}
        with tf.control_dependencies(stage1):
            for b in plan.buckets:
                if b.mode == "two_phase":
                    m = chunk_numel(b.numel, P, B)
                    rows = tf.reshape(first[b.index], [P, -1])
                    bad, check = self._nonfinite_check(plan, b, rows)
                    skipped.append(bad)
                    with tf.control_dependencies([check]):
                        chunk_avgs[b.index] = tf.cond(
                            bad, lambda m=m: tf.fill([m], nan),
                            lambda rows=rows, m=m: self._decode_average(rows, m))
        # stage 2b: re-encode the averaged chunks (markers if they are NaN) and allgather them
        second: dict[int, tf.Tensor] = {}
        with tf.control_dependencies(list(chunk_avgs.values())):
            for b in plan.buckets:
                if b.mode == "two_phase":
                    m = chunk_numel(b.numel, P, B)
                    payload = self._submit(chunk_avgs[b.index], m, b, "reencode", first_part=P)
                    second[b.index] = hvd.allgather(payload, name=f"aq.ag.{b.name}",
                                                    ignore_name_scope=True, process_set=ps)
        # stage 3: check and decode (after every collective completed)
        results: dict[int, tf.Tensor] = {}
        with tf.control_dependencies(stage1 + list(second.values())):
            for b in plan.buckets:
                if b.mode == "allgather":
                    rows = tf.reshape(first[b.index], [P, -1])
                    bad, check = self._nonfinite_check(plan, b, rows)
                    skipped.append(bad)
                    with tf.control_dependencies([check]):
                        flat = tf.cond(bad, lambda b=b: tf.fill([b.numel], nan),
                                       lambda rows=rows, b=b: self._decode_average(rows, b.numel))
                else:
                    m = chunk_numel(b.numel, P, B)
                    rows = tf.reshape(second[b.index], [P, -1])
                    bad, _ = self._nonfinite_check(plan, b, rows, check=False)  # skip mode

                    def decode_all(rows=rows, m=m, b=b):
                        parts = [self._decode(rows[r], m) for r in range(P)]
                        return tf.concat(parts, axis=0)[:b.numel]

                    flat = tf.cond(bad, lambda b=b: tf.fill([b.numel], nan), decode_all)
                for pos in b.members:
                    off = plan.offsets[pos]
                    n = int(np.prod(plan.shapes[pos], dtype=np.int64))
                    g = tensors[pos]
                    results[pos] = tf.cast(tf.reshape(flat[off:off + n], tf.shape(g)), g.dtype)
        results.update(small)
        any_skipped = tf.reduce_any(tf.stack(skipped))
        counters = [self._calls.assign_add(1), self._plan_id.assign(plan.index),
                    self._skipped.assign_add(tf.cast(any_skipped, tf.int64))]
        with tf.control_dependencies(side_effects + counters):
            outs = [tf.identity(results[pos]) for pos in range(len(tensors))]
            return outs, tf.identity(any_skipped)


def _dense(g: Any) -> tf.Tensor:
    """A dense tensor (IndexedSlices, e.g. from an embedding, are scattered into one)."""
    return tf.convert_to_tensor(g)


def _static_shape(g: tf.Tensor, name: str) -> list[int]:
    if not g.shape.is_fully_defined():
        raise ValueError(f"the packed exchange needs gradients with static shapes; {name} has "
                         f"shape {g.shape}")
    return g.shape.as_list()


def translate_error(err: tf.errors.InvalidArgumentError) -> Exception:
    """A graph assertion of the exchange as the eager API's exception (PayloadError/ValueError)."""
    found = re.search(r"assertion failed: (.*)", err.message)
    if found is None:
        return err
    parts = re.findall(r"\[([^\[\]]*)\]", found.group(1))
    text = " ".join(p.strip() for p in parts).replace(" ;", ";")
    if "payload" in text and "differs" in text:
        return PayloadError(f"horovod_aq: {text}")
    if NONFINITE_MARK in text:
        return NonFiniteGradientError(text)
    return err


def exchange_for(compression: Compressor, *, process_set: hvd.ProcessSet, exchange: str = "auto",
                 fusion_bytes: int = DEFAULT_FUSION_BYTES, small_tensor_threshold: int = 0,
                 network: NetworkModel | None = None,
                 telemetry: Telemetry | None = None) -> PackedExchange:
    """The :class:`PackedExchange` of ``compression`` with these settings (created once)."""
    if not isinstance(compression, Compressor):
        raise TypeError(
            "compression must be a horovod_aq compressor such as horovod_aq.ALQ(bits=3); Horovod's "
            "hvd.Compression.* objects belong to hvd.DistributedGradientTape")
    check_supported(compression)
    resolve_exchange(exchange, 1, 1, 1, 1)  # validates the name
    if fusion_bytes < 4:
        raise ValueError(f"fusion_bytes must be >= 4, got {fusion_bytes}")
    if small_tensor_threshold < 0:
        raise ValueError(f"small_tensor_threshold must be >= 0, got {small_tensor_threshold}")
    if not hvd.is_initialized():
        raise RuntimeError("call horovod.tensorflow.init() before creating the packed exchange")
    network = network or NetworkModel()
    state = tf_state(compression)
    key = (process_set.process_set_id, exchange, int(fusion_bytes), int(small_tensor_threshold),
           network, id(telemetry) if telemetry is not None else None)
    with state.lock:
        found = state.exchanges.get(key)
    if found is None:
        found = PackedExchange(compression, process_set=process_set, exchange=exchange,
                               fusion_bytes=fusion_bytes,
                               small_tensor_threshold=small_tensor_threshold, network=network,
                               telemetry=telemetry, index=len(state.exchanges))
        with state.lock:
            state.exchanges[key] = found
    return found
