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

DQSGD (dynamic widths, ``dynamic_and_error_feedback.md`` §1.5): every width in [min_bits,
max_bits] has its own levels and header variables (:class:`~.state.WidthState`), and encode,
markers and decode are ``tf.switch_case`` branches over the widths, selected by the state's
``width_index`` variable — each branch with its own static payload size, so the gathered payload
sizes change from step to step (allgather and alltoall accept that) and the step never retraces.
Every payload's header states its bits; a decoder expecting another width refuses it (gathered
size or header check: ``PayloadError`` / ``InvalidArgumentError``). After the decode the graph
adds the float64 sum of squares of every decoded bucket and allreduced small tensor — pairwise
within a tensor, then pairwise over the tensors in layout order, so it is bitwise the same on
every rank — into a variable that ``refit`` reads and hands to ``observe_aggregate``; the core's
rule then picks the next width, which ``refit`` copies into ``width_index``.

ECQ-SGD (:class:`~horovod_aq.ErrorFeedback`, §2): each fused bucket has a float32 memory variable
h (:meth:`~.state.TFState.memory_variable`). Stage 1 quantizes ``compensate_value(g, h)`` =
g + α·h (allgather: the bucket; two-phase: the padded bucket before chunking, as on PyTorch);
after every check passed the graph decodes this rank's own payload(s) g̃ and assigns
``updated_memory(h, g, g̃)`` = β·h + (g − g̃) (zero, counted and logged by ``refit``, if that is
non-finite). A step in which any rank sent non-finite markers updates no memory: with
``nonfinite="raise"`` every rank stops before the update, with "skip" every rank skips it (on
PyTorch the ranks with finite gradients update theirs). The memory never leaves the rank except
through :func:`horovod_aq.tensorflow.checkpoint.state_dict` (collective, like PyTorch's
optimizer ``state_dict``).

Refits and telemetry: :meth:`end_step` (eager, after the optimizer step) =
``horovod_aq.tensorflow.refit(compressor, process_set=...)``: it reads the statistics recorded
in-graph on recording steps, runs ``compressor.end_step(comm)`` (the shared protocol), updates the
variables, and records one :class:`~horovod_aq.telemetry.StepRecord` per exchange that ran
(bytes from the deterministic payload sizes of the step's width, like PyTorch; with
ErrorFeedback ``extra["ef_memory_norm"]``).
"""

from __future__ import annotations

import dataclasses
import functools
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
    DEFAULT_FUSION_BYTES,
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
    WidthState,
    state_variable,
    tf_state,
)

logger = logging.getLogger(__name__)

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
    small_bytes_sent: int = 0        # the uncompressed allreduces' bytes
    exchanges: dict[str, int] = dataclasses.field(default_factory=dict)
    fn: Any = None                   # eager entry: tf.function over the exchange
    checked: bool = False
    _wire: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)

    def wire_bytes(self, bits: int, bucket_size: int, ranks: int) -> tuple[int, int]:
        """(payload bytes, bytes sent) of one exchange of this layout at code width ``bits``."""
        if bits not in self._wire:
            payload, sent = 0, self.small_bytes_sent
            for b in self.buckets:
                if b.mode == "allgather":
                    payload += codec.payload_size(b.numel, bits, bucket_size)
                else:
                    payload += ranks * codec.payload_size(
                        chunk_numel(b.numel, ranks, bucket_size), bits, bucket_size)
                sent += bytes_sent(b.mode, b.numel, bits, bucket_size, ranks)
            self._wire[bits] = (payload, sent)
        return self._wire[bits]


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
        #: DQSGD: float64 Σ‖decoded aggregate‖² of the exchanges since the last refit.
        self._aggregate_sq = (state_variable(np.float64(0.0),
                                             name=f"aq_aggregate_sq_{op_name(self.prefix)}")
                              if self._state.dqsgd is not None else None)
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

    # AutoGraph would convert this module and the kernels at every first trace in a user's
    # tf.function (seconds): the exchange has no Python control flow on tensors, so skip it.
    @tf.autograph.experimental.do_not_convert
    def reduce(self, grads: Sequence[Any], sources: Sequence[Any]) -> list[Any]:
        """Average ``grads`` (one per source; None stays None) over the process set.

        IndexedSlices are densified. Works eagerly and inside ``tf.function``. With the
        compressor's ``nonfinite="skip"``, tensors of a bucket in which some rank had NaN/Inf come
        back NaN on every rank (see :meth:`reduce_with_status`).
        """
        return self.reduce_with_status(grads, sources)[0]

    @tf.autograph.experimental.do_not_convert
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

    def state_dict(self) -> dict[str, Any]:
        """The compressor's state with every rank's error memory (collective on this exchange's
        process set); see :func:`horovod_aq.tensorflow.checkpoint.state_dict`."""
        from horovod_aq.tensorflow.checkpoint import state_dict

        return state_dict(self.compression, process_set=self.process_set)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` on this rank; see
        :func:`horovod_aq.tensorflow.checkpoint.load_state_dict`."""
        from horovod_aq.tensorflow.checkpoint import load_state_dict

        load_state_dict(self.compression, state, process_set=self.process_set)

    # ------------------------------------------------------------------ refit support
    def take_aggregate(self) -> float:
        """DQSGD: Σ‖decoded aggregate‖² (float64) of the exchanges since the last call, then
        reset to 0 (eager). Bitwise the same on every rank. 0.0 for other compressors."""
        if self._aggregate_sq is None:
            return 0.0
        value = float(self._aggregate_sq.numpy())
        self._aggregate_sq.assign(0.0)
        return value

    def take_calls(self) -> tuple[int, int]:
        """(exchanges run, of which skipped for non-finite input) since the last call (eager)."""
        calls, skipped = int(self._calls.numpy()), int(self._skipped.numpy())
        delta = (calls - self._calls_seen, skipped - self._skipped_seen)
        self._calls_seen, self._skipped_seen = calls, skipped
        return delta

    def record_step(self, step: int, refitted: bool, calls: int, skipped: int = 0,
                    bits: int | None = None) -> StepRecord:
        """Record the telemetry of the step that just ended (the last layout that ran);
        ``bits`` is the code width the step used (default: the current table's)."""
        plan_id = int(self._plan_id.numpy())
        plan = self._plan_list[plan_id] if 0 <= plan_id < len(self._plan_list) else None
        comp = self.compression
        if bits is None:
            bits = comp.table.bits if comp.quantizes else comp.bits
        rec = StepRecord(step=step, method=comp.method, ranks=self.ranks, bits=bits)
        if plan is not None:
            payload, sent = plan.wire_bytes(bits, comp.bucket_size, self.ranks)
            rec.numel = plan.numel * calls
            rec.numel_quantized = plan.numel_quantized * calls
            rec.payload_bytes = payload * calls
            rec.bytes_sent = sent * calls
            rec.exchanges = {k: v * calls for k, v in plan.exchanges.items()}
        rec.bytes_fp32 = bytes_sent("allreduce_fp32", rec.numel, 0, 1, self.ranks)
        if comp.quantizes:
            rec.table_version = comp.table.version
        rec.refit = refitted
        if refitted:
            rec.levels = comp.table.levels.tolist()
        if skipped:
            rec.extra["skipped"] = float(skipped)
        if self._state.error_feedback is not None:
            rec.extra["ef_memory_norm"] = self._state.error_feedback.memory_norm()
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
            prefix=f"{self.prefix}.{len(self._plan_list)}",
            cap_numel=max(1, self.fusion_bytes // 4),
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
        for i in small:
            plan.numel += numels[i]
            wire = "allreduce_fp16" if comp.method == "fp16" else "allreduce_fp32"
            plan.small_bytes_sent += bytes_sent(wire, numels[i], 0, 1, P)
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

    def _by_width(self, fn) -> tf.Tensor:
        """``fn(width)`` for the current code width: a plain call for a fixed-width compressor,
        a ``tf.switch_case`` over DQSGD's widths on the ``width_index`` variable otherwise (each
        branch has its own static sizes; the result's size is then dynamic)."""
        st = self._state
        if st.width_index is None:
            return fn(st.widths[0])
        return tf.switch_case(st.width_index.read_value(),
                              [functools.partial(fn, w) for w in st.widths])

    def _header(self, width: WidthState, numel: int) -> tf.Tensor:
        return width.header(numel, self.compression.bucket_size, self.compression.norm)

    def _encode(self, x: tf.Tensor, numel: int, bucket: str, phase: str,
                seed: tf.Tensor) -> tf.Tensor:
        """Encode a flat float32 tensor of ``numel`` elements with the table variables of the
        current width and the uniforms of ``seed`` (``bucket``/``phase`` name the call for
        instrumentation)."""
        comp = self.compression
        return self._by_width(lambda w: kernels.encode_with(
            x, w.levels, self._header(w, numel), bits=w.bits, bucket_size=comp.bucket_size,
            norm=comp.norm, seed=seed, check=False))

    def _marker(self, numel: int, first_bad: tf.Tensor) -> tf.Tensor:
        """``codec.nonfinite_payload`` in-graph: this table's header with ``FLAG_NONFINITE`` and
        the first bad element, zeros elsewhere, the size of a real payload."""
        where = tf.bitcast(tf.cast(tf.minimum(first_bad, 2**32 - 1), tf.uint32), tf.uint8)

        def marker(w: WidthState) -> tf.Tensor:
            header = self._header(w, numel)
            size = codec.payload_size(numel, w.bits, self.compression.bucket_size)
            return tf.concat([header[:FLAGS_OFFSET], tf.constant([FLAG_NONFINITE], tf.uint8),
                              header[FLAGS_OFFSET + 1:MARKER_INDEX_OFFSET], where,
                              tf.zeros([size - HEADER_SIZE], tf.uint8)], axis=0)

        return self._by_width(marker)

    def _rows(self, gathered: tf.Tensor, numel: int, bucket: BucketPlan) -> tf.Tensor:
        """The gathered (or all-to-all received) payloads of ``numel`` elements as [P, size].

        With DQSGD the size is only known at run time: it is checked first against this rank's
        width, so that ranks disagreeing on the width fail with a clear message on every rank
        (every rank received the same sizes) instead of decoding misaligned rows."""
        P, st = self.ranks, self._state
        if st.width_index is None:
            return tf.reshape(gathered, [P, -1])
        B = self.compression.bucket_size
        index = st.width_index.read_value()
        sizes = tf.constant([codec.payload_size(numel, w.bits, B) for w in st.widths], tf.int64)
        bits = tf.constant([w.bits for w in st.widths], tf.int64)
        got = tf.size(gathered, out_type=tf.int64)
        check = tf.debugging.Assert(
            tf.equal(got, P * tf.gather(sizes, index)),
            [f"payload size differs: the {P} payloads of bucket {bucket.name} hold", got,
             "bytes, but at the width of this rank,", tf.gather(bits, index), "bits, they need",
             P * tf.gather(sizes, index), "; the payload of rank 0 states bits =",
             tf.cast(gathered[3], tf.int64), ": ranks disagree on the DQSGD bit width"])
        with tf.control_dependencies([check]):
            return tf.reshape(gathered, [P, -1])

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

    def _header_checks(self, rows: tf.Tensor, numel: int, check: bool) -> list:
        """DQSGD: the decoder's header check of every row of ``rows`` [P, size], done once
        against the current width's expected header (outside the width branches, which then
        skip it: the check's assertions are most of a decoder's graph). Fixed width: none here,
        the kernel checks."""
        st = self._state
        if st.width_index is None or not check:
            return []
        expected = tf.gather(tf.stack([self._header(w, numel) for w in st.widths]),
                             st.width_index.read_value())
        return kernels._decoder_header_check(rows[:, :HEADER_SIZE], expected)

    def _decode_average(self, rows: tf.Tensor, numel: int) -> tf.Tensor:
        """Decode the P rows of ``rows`` and average them (header checks included)."""
        B = self.compression.bucket_size
        inner = self._state.width_index is None
        with tf.control_dependencies(self._header_checks(rows, numel, True)):
            return self._by_width(lambda w: kernels.decode_average_with(
                rows, w.levels, self._header(w, numel), numel=numel, bits=w.bits,
                bucket_size=B, check=inner))

    def _decode_rows(self, rows: tf.Tensor, numel: int, check: bool = True) -> tf.Tensor:
        """Decode every row of ``rows`` [R, size] and concatenate them (R·numel values)."""
        B = self.compression.bucket_size
        inner = check and self._state.width_index is None

        def decode(w: WidthState) -> tf.Tensor:
            header = self._header(w, numel)
            return tf.concat([kernels.decode_with(rows[r], w.levels, header, numel=numel,
                                                  bits=w.bits, bucket_size=B, check=inner)
                              for r in range(int(rows.shape[0]))], axis=0)

        with tf.control_dependencies(self._header_checks(rows, numel, check)):
            return self._by_width(decode)

    def _update_memory(self, own: dict[int, tuple], buckets: dict[int, BucketPlan],
                       any_skipped: tf.Tensor, after: list[tf.Tensor]) -> list[tf.Tensor]:
        """ECQ-SGD: h ← β·h + (g − g̃) for every bucket of ``own``, g̃ = the decode of this
        rank's own payload(s); runs after ``after`` (every check passed) and not at all when
        a rank sent non-finite markers."""
        st = self._state
        ef, resets = st.error_feedback, st.memory_resets
        assert ef is not None and resets is not None
        ops = []
        with tf.control_dependencies(after):
            for index, (memory, h, raw, payloads, parts, m) in own.items():
                numel = buckets[index].numel

                def commit(memory=memory, h=h, raw=raw, payloads=payloads, parts=parts, m=m,
                           numel=numel) -> tf.Tensor:
                    rows = tf.reshape(payloads, [parts, -1])
                    sent = self._decode_rows(rows, m, check=False)[:numel]
                    new = ef.updated_memory(h, raw, sent)          # β·h + (g − g̃)
                    deps = []
                    if ef.reset_on_nonfinite:
                        finite = tf.reduce_all(tf.math.is_finite(new))
                        new = tf.where(finite, new, tf.zeros_like(new))
                        deps.append(resets.assign_add(
                            tf.cast(tf.logical_not(finite), tf.int64)))
                    deps.append(memory.assign(new))
                    with tf.control_dependencies(deps):
                        return tf.constant(True)

                ops.append(tf.cond(any_skipped, lambda: tf.constant(False), commit))
        return ops

    def _slot(self, numel: int, bucket: str) -> StatsSlot | None:
        return self._state.new_slot(numel, f"{bucket}#{next(self._slot_ids)}")

    def _exchange(self, plan: _Plan, tensors: list[tf.Tensor]) -> tuple[list[tf.Tensor], tf.Tensor]:
        """The exchange graph of one layout (module docstring: stages 1, 2a, 2b, 3). Returns the
        averaged tensors and whether a rank sent non-finite markers (nonfinite="skip": the
        affected tensors are NaN)."""
        comp, P, ps, st = self.compression, self.ranks, self.process_set, self._state
        ef = st.error_feedback
        B = comp.bucket_size if comp.quantizes else 1
        first: dict[int, tf.Tensor] = {}    # bucket index -> phase-1 collective output
        own: dict[int, tuple] = {}          # ECQ: bucket index -> (h var, h, g, payloads, parts, m)
        side_effects: list[tf.Tensor] = []
        skipped = [tf.constant(False)]
        nan = float("nan")
        # stage 1: encode and submit every first collective, small allreduces
        for b in plan.buckets:
            parts = [tf.reshape(tf.cast(tensors[m], tf.float32), [-1]) for m in b.members]
            raw = parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)
            flat = raw
            if ef is not None:
                memory = st.memory_variable(b.name, b.numel)
                h = memory.read_value()
                flat = ef.compensate_value(raw, h)                 # g + α·h
            slot = self._slot(b.numel, b.name)
            if slot is not None:
                side_effects.append(slot.record(flat))
            if b.mode == "allgather":
                payloads = self._submit(flat, b.numel, b, "submit")
                sent = (payloads, 1, b.numel)
                first[b.index] = hvd.allgather(payloads, name=f"aq.ag.{b.name}",
                                               ignore_name_scope=True, process_set=ps)
            else:
                m = chunk_numel(b.numel, P, B)
                padded = tf.pad(flat, [[0, P * m - b.numel]])
                payloads = self._submit(padded, m, b, "submit", parts=P)
                sent = (payloads, P, m)
                first[b.index] = hvd.alltoall(payloads, name=f"aq.a2a.{b.name}",
                                              ignore_name_scope=True, process_set=ps)
            if ef is not None:
                own[b.index] = (memory, h, raw, *sent)
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
                    rows = self._rows(first[b.index], m, b)
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
        decoded: list[tuple[tf.Tensor, tf.Tensor]] = []   # (bucket average, skipped) in order
        with tf.control_dependencies(stage1 + list(second.values())):
            for b in plan.buckets:
                if b.mode == "allgather":
                    rows = self._rows(first[b.index], b.numel, b)
                    bad, check = self._nonfinite_check(plan, b, rows)
                    skipped.append(bad)
                    with tf.control_dependencies([check]):
                        flat = tf.cond(bad, lambda b=b: tf.fill([b.numel], nan),
                                       lambda rows=rows, b=b: self._decode_average(rows, b.numel))
                else:
                    m = chunk_numel(b.numel, P, B)
                    rows = self._rows(second[b.index], m, b)
                    bad, _ = self._nonfinite_check(plan, b, rows, check=False)  # skip mode

                    def decode_all(rows=rows, m=m, b=b):
                        return self._decode_rows(rows, m)[:b.numel]

                    flat = tf.cond(bad, lambda b=b: tf.fill([b.numel], nan), decode_all)
                decoded.append((flat, bad))
                for pos in b.members:
                    off = plan.offsets[pos]
                    n = int(np.prod(plan.shapes[pos], dtype=np.int64))
                    g = tensors[pos]
                    results[pos] = tf.cast(tf.reshape(flat[off:off + n], tf.shape(g)), g.dtype)
        results.update(small)
        any_skipped = tf.reduce_any(tf.stack(skipped))
        if own:
            side_effects += self._update_memory(own, {b.index: b for b in plan.buckets},
                                                any_skipped, list(results.values()))
        if self._aggregate_sq is not None:
            decoded += [(small[i], tf.constant(False)) for i in plan.small]
            side_effects.append(self._aggregate_sq.assign_add(_aggregate_sum_sq(decoded)))
        counters = [self._calls.assign_add(1), self._plan_id.assign(plan.index),
                    self._skipped.assign_add(tf.cast(any_skipped, tf.int64))]
        with tf.control_dependencies(side_effects + counters):
            outs = [tf.identity(results[pos]) for pos in range(len(tensors))]
            return outs, tf.identity(any_skipped)


def _pairwise_sum(v: tf.Tensor) -> tf.Tensor:
    """Sum of a static-length float64 vector in the canonical pairwise order (zero-padded to a
    power of two, then halved): a fixed order, so equal inputs give equal bits on every rank."""
    n = int(v.shape.num_elements())
    if n == 0:
        return tf.constant(0.0, tf.float64)
    width = 1 << (n - 1).bit_length()
    acc = tf.pad(tf.reshape(v, [n]), [[0, width - n]])
    while width > 1:
        width //= 2
        acc = acc[:width] + acc[width:]
    return acc[0]


def _aggregate_sum_sq(parts: list[tuple[tf.Tensor, tf.Tensor]]) -> tf.Tensor:
    """Σ‖part‖² in float64 over the decoded aggregate (``DQSGD.observe_aggregate``'s input):
    pairwise within every part, then pairwise over the parts in layout order; a skipped part
    (NaN, some rank was non-finite) counts 0, as PyTorch observes only decoded buckets."""
    if not parts:
        return tf.constant(0.0, tf.float64)
    sums = [tf.where(bad, tf.constant(0.0, tf.float64),
                     _pairwise_sum(tf.square(tf.cast(tf.reshape(x, [-1]), tf.float64))))
            for x, bad in parts]
    return _pairwise_sum(tf.stack(sums))


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
