"""The packed gradient exchange in TensorFlow, shared by the tape and the Keras optimizer.

:class:`PackedExchange` turns a list of local gradients into their average over a Horovod process
set, sending bit-packed codes (docs/protocol.md §5); the per-rank decisions (argument checks,
handshake, non-finite message, telemetry) are :mod:`horovod_aq.packed.protocol`'s. Both
``horovod_aq.tensorflow.DistributedGradientTape`` and ``horovod_aq.keras.DistributedOptimizer``
call :meth:`PackedExchange.reduce`; nothing about the exchange is duplicated between them.

Wire per bucket, chosen by ``exchange`` ("auto" = the cost model of :mod:`horovod_aq.packed.cost`):
allgather "aq.ag.<bucket>" of one payload per rank, or two-phase: alltoall "aq.a2a.<bucket>" of P
chunks, decode and average chunk r, re-encode, allgather "aq.ag.<bucket>". Small tensors (all of
them for NoCompression / FP16) go through a named allreduce. Every rank decodes the same bytes,
so the averaged gradients are bitwise identical on all ranks.

How the graph is staged so that a failing check never leaves a collective submitted on some
ranks only, how DQSGD switches widths and ECQ-SGD updates memory without retracing, and what
the eager end of the step does: docs/protocol.md §13.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
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
    MARKER_INDEX_OFFSET,
)
from horovod_aq.codec.stream import StreamKey
from horovod_aq.packed import plan as names
from horovod_aq.packed.cost import chunk_numel
from horovod_aq.packed.plan import (
    DEFAULT_FUSION_BYTES,
    BucketPlan,
    layout_digest,
    op_name,
    plan_buckets,
)
from horovod_aq.packed.protocol import (
    ExchangeSettings,
    Traffic,
    check_compression,
    check_handshake,
    handshake_vector,
    nonfinite_pieces,
    norm_may_overflow,
    plan_traffic,
    step_record,
)
from horovod_aq.telemetry import StepRecord, Telemetry
from horovod_aq.tensorflow import kernels
from horovod_aq.tensorflow.checks import translate_error
from horovod_aq.tensorflow.state import (
    StatsSlot,
    TFState,
    WidthState,
    state_variable,
    tf_state,
)
from horovod_aq.tensorflow.stats import aggregate_sum_sq
from horovod_aq.tensorflow.step import end_step_in_graph

logger = logging.getLogger(__name__)


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
    fns: dict = dataclasses.field(default_factory=dict)  # eager entries by "raise" flag
    checked: bool = False
    handshake: str = ""              # the handshake collective's name (content, not counters)
    content: str = ""                # the layout's content key (bucket and allreduce names)
    traffic: dict[int, Traffic] = dataclasses.field(default_factory=dict)  # by code width


class PackedExchange:
    """Averages gradients over ``process_set`` with the packed exchange (module docstring).

    Obtain one with :func:`exchange_for` (one per compressor and settings, reused by every tape
    built in a ``tf.function`` step).
    """

    def __init__(self, compression: Any, *, process_set: hvd.ProcessSet,
                 settings: ExchangeSettings, telemetry: Telemetry | None, index: int) -> None:
        self.compression = compression
        self.quantizer = compression.quantizer    # table, bits, step, seed, refits
        self.process_set = process_set
        self.settings = settings
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        self.index = index                        # among this compression's exchanges
        self.prefix = names.exchange_prefix(compression.name, index)
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
                              if self._state.dynamic else None)
        self._calls_seen = 0
        self._skipped_seen = 0
        self._slot_ids = itertools.count()
        #: Tapes' local gradient aggregations by backward_passes_per_step (aggregation_for).
        self._aggregations: dict[int, LocalAggregation] = {}

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
        shapes = [tuple(_static_shape(dense[i], labels[k])) for k, i in enumerate(present)]
        key = tuple(zip(labels, shapes, (dense[i].dtype.name for i in present)))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._make_plan(key, labels, shapes)
        if not plan.checked:
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
            except tf.errors.InvalidArgumentError as err:
                raise translate_error(err) from None
        else:
            outs, skipped = self._exchange(plan, tensors, raise_nonfinite)
        result = list(dense)
        for i, out in zip(present, outs):
            result[i] = out
        return result, skipped

    def _exchange_args(self, plan: _Plan, raise_nonfinite: bool, *tensors: tf.Tensor):
        return self._exchange(plan, list(tensors), raise_nonfinite)

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
            bits = comp.code_bits
        rec = step_record(comp, step=step, ranks=self.ranks, bits=bits,
                          traffic=None if plan is None else self._traffic(plan, bits),
                          calls=calls, refitted=refitted, skipped=skipped)
        self.telemetry.record(rec)
        return rec

    def _traffic(self, plan: _Plan, bits: int) -> Traffic:
        """What one exchange of ``plan`` sends at code width ``bits``."""
        if bits not in plan.traffic:
            numels = [int(np.prod(plan.shapes[i], dtype=np.int64)) for i in plan.small]
            plan.traffic[bits] = plan_traffic(
                plan.buckets, numels, fp16=self.compression.fp16_wire, bits=bits,
                bucket_size=self.compression.bucket_size, ranks=self.ranks)
        return plan.traffic[bits]

    # ------------------------------------------------------------------ layout
    def _make_plan(self, key: tuple, source_names: list[str],
                   shapes: list[tuple[int, ...]]) -> _Plan:
        comp, P, settings = self.compression, self.ranks, self.settings
        numels = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        order = list(range(len(source_names)))[::-1]
        # content names (docs/protocol.md §6): the same on every rank that averages the same
        # sources with the same settings, whatever else a rank created
        content = names.exchange_key(comp.name, zip(source_names, numels),
                                     (settings.exchange, settings.cap_numel,
                                      settings.small_tensor_threshold, P))
        plans, small = plan_buckets(
            [source_names[i] for i in order], [numels[i] for i in order], [""] * len(order),
            prefix=f"{content}.0", cap_numel=settings.cap_numel,
            small_threshold=settings.small_tensor_threshold, quantizes=comp.quantizes,
            exchange=settings.exchange, bits=comp.code_bits, bucket_size=comp.bucket_size,
            ranks=P, network=settings.network)
        # map back from the reversed order to source positions
        buckets = [dataclasses.replace(b, members=tuple(order[m] for m in b.members))
                   for b in plans]
        small = [order[m] for m in small]
        plan = _Plan(len(self._plan_list), source_names, shapes, buckets, small,
                     layout_digest(buckets, [source_names[i] for i in small]), {})
        #: the handshake's name depends on the sources only, so ranks that disagree on the
        #: settings it compares still meet in it
        plan.content = content
        plan.handshake = names.handshake_name(
            names.exchange_key("tf", zip(source_names, numels)), 0)
        for b in buckets:
            offset = 0
            for m in b.members:
                plan.offsets[m] = offset
                offset += numels[m]
        self._plans[key] = plan
        self._plan_list.append(plan)
        return plan

    def _handshake(self, plan: _Plan) -> None:
        """Compare settings, table, step and layout across the set (eager, once per layout)."""
        comp = self.compression
        mine = handshake_vector(comp.fingerprint(), plan.layout, self.ranks)
        with tf.init_scope():
            gathered = hvd.allgather(tf.constant(mine[None, :]),
                                     name=plan.handshake,
                                     process_set=self.process_set).numpy()
        plan.checked = True
        check_handshake(gathered, comp.describe_fingerprint)

    # ------------------------------------------------------------------ graph
    def _stream_key(self, bucket_index: int, part: int) -> tuple:
        """The format's stream key (docs/format.md §6) of (step, bucket, part) on this rank, as
        ``StreamKey.scalars()`` with the step read from the state variable (no retrace): the
        same uniforms as every other kernel, so a resumed run draws what an uninterrupted one
        would."""
        k0, k1 = StreamKey(self.quantizer.seed, hvd.rank()).philox_key()
        return k0, k1, self._state.step.read_value(), bucket_index, part

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
                key: tuple) -> tf.Tensor:
        """Encode a flat float32 tensor of ``numel`` elements with the table variables of the
        current width and the uniforms of the stream ``key`` (``bucket``/``phase`` name the call
        for instrumentation)."""
        comp = self.compression
        return self._by_width(lambda w: kernels.encode_with(
            x, w.levels, self._header(w, numel), bits=w.bits, bucket_size=comp.bucket_size,
            norm=comp.norm, key=key, check=False, checksum=self.quantizer.checksum))

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
        """(any marker among ``rows``, the op raising on one when ``check``: nonfinite="raise").

        Every rank gathered the same rows, so every rank decides alike. The message names the
        first flagged rank and the source holding the first bad element."""
        flagged = tf.bitwise.bitwise_and(rows[:, FLAGS_OFFSET], FLAG_NONFINITE) > 0
        any_bad = tf.reduce_any(flagged)
        if not check:
            return any_bad, tf.no_op()
        rank = tf.argmax(tf.cast(flagged, tf.int32), output_type=tf.int32)
        where = tf.bitcast(rows[rank, MARKER_INDEX_OFFSET:HEADER_SIZE], tf.uint32)
        starts = [plan.offsets[m] for m in bucket.members]
        order = np.argsort(starts)
        quoted = tf.constant([f"'{plan.names[bucket.members[i]].split(':', 1)[1]}'"
                              for i in order])
        index = tf.searchsorted(tf.constant(np.asarray(starts, np.int64)[order]),
                                tf.reshape(tf.cast(where, tf.int64), [1]), side="right")[0] - 1
        source = tf.gather(quoted, tf.clip_by_value(index, 0, len(starts) - 1))
        before, middle, after = nonfinite_pieces(bucket.name)
        check = tf.debugging.Assert(tf.logical_not(any_bad),
                                    [before, rank, middle, source, after])
        return any_bad, check

    def _submit(self, flat: tf.Tensor, numel: int, bucket: BucketPlan, phase: str,
                parts: int = 1, first_part: int = 0):
        """Encode ``flat`` (``parts`` equal chunks of ``numel``, streams ``first_part`` …) or, when
        it holds NaN/Inf, send non-finite markers of the same size instead (``codec`` module
        docstring). A bucket of finite values whose norm overflows float32 is sent as markers too
        (``packed.protocol.first_unsendable``, docs/protocol.md §15)."""
        bad = tf.logical_not(tf.math.is_finite(flat))
        if self.compression.quantizes:
            bad = tf.logical_or(bad, self._unsendable(flat, numel, parts))

        def encode() -> tf.Tensor:
            chunks = [self._encode(flat[r * numel:(r + 1) * numel], numel, bucket.name, phase,
                                   self._stream_key(bucket.index, first_part + r))
                      for r in range(parts)]
            return chunks[0] if parts == 1 else tf.concat(chunks, axis=0)

        def markers() -> tf.Tensor:
            first = tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int64)
            return tf.tile(self._marker(numel, first), [parts])

        return tf.cond(tf.reduce_any(bad), markers, encode)

    def _unsendable(self, flat: tf.Tensor, numel: int, parts: int) -> tf.Tensor:
        """Per element: whether it lies in a bucket whose norm (exact in float64) does not fit a
        float32 — ``first_unsendable``'s rule in-graph. Only computed when
        ``norm_may_overflow``."""
        B = self.compression.bucket_size
        nb = -(-numel // B)

        def exact() -> tf.Tensor:
            x = tf.pad(tf.reshape(tf.cast(flat, tf.float64), [parts, numel]),
                       [[0, 0], [0, nb * B - numel]])
            norms = tf.sqrt(tf.reduce_sum(tf.square(tf.reshape(x, [parts, nb, B])), axis=2))
            over = tf.math.is_inf(tf.cast(norms, tf.float32))
            return tf.reshape(tf.repeat(over, B, axis=1)[:, :numel], [-1])

        risky = norm_may_overflow(tf.reduce_max(tf.abs(flat)), B)
        return tf.cond(risky, exact, lambda: tf.zeros(tf.shape(flat), tf.bool))

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
        return kernels.decoder_header_check(rows[:, :HEADER_SIZE], expected)

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
        ef, resets = st.error_memory, st.memory_resets
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

    def _exchange(self, plan: _Plan, tensors: list[tf.Tensor],
                  raise_nonfinite: bool = True) -> tuple[list[tf.Tensor], tf.Tensor]:
        """The exchange graph of one layout (module docstring: stages 1, 2a, 2b, 3). Returns the
        averaged tensors and whether a rank sent non-finite markers (``raise_nonfinite`` False,
        nonfinite="skip": the affected tensors are NaN)."""
        comp, P, ps, st = self.compression, self.ranks, self.process_set, self._state
        ef = st.error_memory
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
                first[b.index] = hvd.allgather(payloads, name=names.allgather_name(b.name),
                                               ignore_name_scope=True, process_set=ps)
            else:
                m = chunk_numel(b.numel, P, B)
                padded = tf.pad(flat, [[0, P * m - b.numel]])
                payloads = self._submit(padded, m, b, "submit", parts=P)
                sent = (payloads, P, m)
                first[b.index] = hvd.alltoall(payloads, name=names.alltoall_name(b.name),
                                              ignore_name_scope=True, process_set=ps)
            if ef is not None:
                own[b.index] = (memory, h, raw, *sent)
        small: dict[int, tf.Tensor] = {}
        for i in plan.small:
            g = tensors[i]
            wire = tf.cast(g, tf.float16) if comp.fp16_wire else g
            out = hvd.allreduce(wire, op=hvd.Average,
                                name=names.allreduce_name(plan.content, plan.names[i]),
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
                    bad, check = self._nonfinite_check(plan, b, rows, raise_nonfinite)
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
                    # this rank's chunk ends in the zero padding of the bucket: the padding's
                    # decoded average is noise that would inflate the re-encoded norm; send
                    # exact zeros there (docs/protocol.md §15)
                    valid = min(max(b.numel - ps.rank() * m, 0), m)
                    avg = chunk_avgs[b.index]
                    if valid < m:
                        avg = tf.concat([avg[:valid], tf.zeros([m - valid], avg.dtype)], axis=0)
                    payload = self._submit(avg, m, b, "reencode", first_part=P)
                    second[b.index] = hvd.allgather(payload, name=names.allgather_name(b.name),
                                                    ignore_name_scope=True, process_set=ps)
        # stage 3: check and decode (after every collective completed)
        results: dict[int, tf.Tensor] = {}
        decoded: list[tuple[tf.Tensor, tf.Tensor]] = []   # (bucket average, skipped) in order
        with tf.control_dependencies(stage1 + list(second.values())):
            for b in plan.buckets:
                if b.mode == "allgather":
                    rows = self._rows(first[b.index], b.numel, b)
                    bad, check = self._nonfinite_check(plan, b, rows, raise_nonfinite)
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
            side_effects.append(self._aggregate_sq.assign_add(aggregate_sum_sq(decoded)))
        counters = [self._calls.assign_add(1), self._plan_id.assign(plan.index),
                    self._skipped.assign_add(tf.cast(any_skipped, tf.int64))]
        with tf.control_dependencies(side_effects + counters):
            ended = end_step_in_graph(comp, ps)     # refit when due, telemetry (step.py)
        with tf.control_dependencies([ended]):
            outs = [tf.identity(results[pos]) for pos in range(len(tensors))]
            return outs, tf.identity(any_skipped)


class LocalAggregation:
    """Horovod's local gradient aggregation (``backward_passes_per_step``) in variables.

    :meth:`add` adds one micro-batch's dense gradients into float sums (one non-trainable
    variable per gradient, created eagerly on first use, per layout) and counts the call; the
    returned bool tensor is True at every ``passes``-th call — identical on every rank, which
    makes the same number of calls. :meth:`take`, placed in the branch that exchanges, reads the
    sums and resets them and the counter. The exchange — and so the compressor's step
    (docs/protocol.md §14) — runs only in that branch: steps count exchanges, not micro-batches.
    """

    def __init__(self, passes: int, name: str) -> None:
        if isinstance(passes, bool) or not isinstance(passes, (int, np.integer)) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
        self.passes = int(passes)
        self.name = name
        self.counter = state_variable(np.int64(0), name=f"aq_agg_count_{name}")
        self._sums: dict[tuple, list[tf.Variable | None]] = {}

    def _variables(self, dense: list[Any]) -> list[tf.Variable | None]:
        key = tuple(None if g is None else (tuple(g.shape.as_list()), g.dtype.name)
                    for g in dense)
        found = self._sums.get(key)
        if found is None:
            found = [None if g is None else state_variable(
                np.zeros(g.shape.as_list(), dtype=g.dtype.as_numpy_dtype),
                name=f"aq_agg_{self.name}_{len(self._sums)}_{i}") for i, g in enumerate(dense)]
            self._sums[key] = found
        return found

    def add(self, dense: list[Any]) -> tuple[tf.Tensor, list[tf.Variable | None]]:
        """Add ``dense`` (static shapes; None skipped) to the sums; (ready, sums)."""
        sums = self._variables(dense)
        adds = [v.assign_add(g) for v, g in zip(sums, dense) if g is not None]
        with tf.control_dependencies(adds):
            count = self.counter.assign_add(1)
        return tf.equal(count, self.passes), sums

    def take(self, sums: list[tf.Variable | None]) -> list[tf.Tensor | None]:
        """The accumulated sums; the sums and the counter restart from zero (graph op)."""
        values = [None if v is None else v.read_value() for v in sums]
        read = [x for x in values if x is not None]
        with tf.control_dependencies(read):
            resets = [v.assign(tf.zeros_like(v)) for v in sums if v is not None]
            resets.append(self.counter.assign(0))
        with tf.control_dependencies(resets):
            return [None if x is None else tf.identity(x) for x in values]

    def pending(self) -> int:
        """Micro-batches accumulated since the last exchange (eager)."""
        return int(self.counter.numpy())


class GradientReducer:
    """What Horovod's tape and Keras optimizer do around the allreduce, on the packed exchange.

    * **Local sources** (:meth:`register_local`, Horovod's ``register_local_source`` /
      ``register_local_var``; model parallelism): their gradients are not exchanged; with
      ``scale_local_gradients`` (Horovod's default) they are divided by the set size.
    * **Local aggregation** (:meth:`aggregate`, ``backward_passes_per_step``): sums of N
      micro-batches are exchanged every N-th call, divided by N with
      ``average_aggregated_gradients``.

    Sources are matched by identity (Keras 3 variables have no ``ref()``).
    """

    def __init__(self, exchange: PackedExchange, *, scale_local_gradients: bool = True) -> None:
        self.exchange = exchange
        self.scale_local_gradients = bool(scale_local_gradients)
        self._local: dict[int, Any] = {}

    def register_local(self, source: Any) -> None:
        self._local[id(source)] = source

    def is_local(self, source: Any) -> bool:
        return id(source) in self._local

    @property
    def local_sources(self) -> list[Any]:
        return list(self._local.values())

    def reduce(self, grads: Sequence[Any], sources: Sequence[Any], *,
               nonfinite: str | None = None) -> tuple[list[Any], tf.Tensor]:
        """Average the gradients of non-local sources (:meth:`PackedExchange.reduce_with_status`)
        and scale the local ones; (gradients in ``sources`` order, skipped)."""
        grads, sources = list(grads), list(sources)
        shared = [i for i, s in enumerate(sources) if not self.is_local(s)]
        if len(shared) == len(sources):
            return self.exchange.reduce_with_status(grads, sources, nonfinite=nonfinite)
        reduced, skipped = self.exchange.reduce_with_status(
            [grads[i] for i in shared], [sources[i] for i in shared], nonfinite=nonfinite)
        out = list(grads)
        for i, g in zip(shared, reduced):
            out[i] = g
        if self.scale_local_gradients and self.exchange.included:
            size = float(self.exchange.process_set.size())
            for i, s in enumerate(sources):
                if self.is_local(s) and out[i] is not None:
                    out[i] = _scaled(out[i], 1.0 / size)
        return out, skipped

    def aggregate(self, aggregation: LocalAggregation, grads: Sequence[Any],
                  sources: Sequence[Any], *, average: bool,
                  nonfinite: str | None = None) -> tuple[list[Any], tf.Tensor, tf.Tensor]:
        """Add one micro-batch; at every N-th call exchange the sums (÷N when ``average``).

        Returns (gradients, exchanged, skipped): on calls that do not exchange the gradients
        are zeros and ``exchanged`` is False (apply nothing then; Horovod's optimizers count the
        iteration only)."""
        sources = list(sources)
        dense = [None if g is None else dense_gradient(g, s) for g, s in zip(grads, sources)]
        for i, g in enumerate(dense):
            if g is not None:
                _static_shape(g, source_name(sources[i], i))
        ready, sums = aggregation.add(dense)
        present = [i for i, g in enumerate(dense) if g is not None]

        def exchange() -> list[tf.Tensor]:
            values = aggregation.take(sums)
            reduced, skipped = self.reduce(values, sources, nonfinite=nonfinite)
            if average and aggregation.passes > 1:
                reduced = [None if g is None else _scaled(g, 1.0 / aggregation.passes)
                           for g in reduced]
            return [tf.convert_to_tensor(reduced[i]) for i in present] + [skipped]

        def wait() -> list[tf.Tensor]:
            return [tf.zeros_like(dense[i]) for i in present] + [tf.constant(False)]

        outs = tf.cond(ready, exchange, wait)
        result: list[Any] = [None] * len(dense)
        for i, g in zip(present, outs[:-1]):
            result[i] = g
        return result, ready, outs[-1]


def _scaled(g: Any, factor: float) -> Any:
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype), g.indices,
                                g.dense_shape)
    return g * tf.cast(factor, g.dtype)


def aggregation_for(exchange: PackedExchange, passes: int) -> LocalAggregation:
    """The :class:`LocalAggregation` of ``passes`` shared by every tape built on ``exchange``
    (tapes are rebuilt every step or trace; the sums must outlive them)."""
    with exchange._state.lock:
        found = exchange._aggregations.get(passes)
        if found is None:
            found = exchange._aggregations[passes] = LocalAggregation(
                passes, f"{op_name(exchange.prefix)}_tape{passes}")
    return found


def source_shape(source: Any) -> tf.TensorShape:
    """The static shape of a gradient source (Keras 3 variables: a tuple; ``tf.Variable``: a
    TensorShape); unknown when it has none."""
    shape = getattr(source, "shape", None)
    try:
        return tf.TensorShape(shape)
    except (TypeError, ValueError):
        return tf.TensorShape(None)


def dense_gradient(g: Any, source: Any = None) -> tf.Tensor:
    """``g`` as a dense tensor with the static shape of ``source`` where TensorFlow lost it.

    An ``Embedding``'s gradient is an IndexedSlices whose ``dense_shape`` is a tensor; once it
    crossed a ``tf.function`` boundary (Horovod's eager sub-graph, a Keras train function) that
    shape is unknown at trace time, and ``tf.convert_to_tensor`` gives [None, d]. Scattering the
    slices into the variable's static row count (what Horovod's ``sparse_as_dense`` does, with
    the shape kept) gives a tensor the packed exchange can bucket."""
    shape = source_shape(source)
    if isinstance(g, tf.IndexedSlices):
        if shape.is_fully_defined() and shape.rank:
            rows = tf.math.unsorted_segment_sum(g.values, g.indices, int(shape[0]))
            return tf.reshape(rows, shape)
        return tf.convert_to_tensor(g)
    g = tf.convert_to_tensor(g)
    if not g.shape.is_fully_defined() and shape.is_fully_defined() \
            and g.shape.is_compatible_with(shape):
        g = tf.ensure_shape(g, shape)
    return g


def _static_shape(g: tf.Tensor, name: str) -> list[int]:
    if not g.shape.is_fully_defined():
        raise ValueError(f"the packed exchange needs gradients with static shapes; {name} has "
                         f"shape {g.shape}")
    return g.shape.as_list()


def exchange_for(compression: Any, *, process_set: hvd.ProcessSet, exchange: str = "auto",
                 fusion_bytes: int = DEFAULT_FUSION_BYTES, small_tensor_threshold: int = 0,
                 network: Any = None, telemetry: Telemetry | None = None) -> PackedExchange:
    """The :class:`PackedExchange` of ``compression`` with these settings (created once)."""
    check_compression(compression, "hvd.DistributedGradientTape")
    settings = ExchangeSettings(exchange, fusion_bytes, small_tensor_threshold, network)
    if not hvd.is_initialized():
        raise RuntimeError("call horovod.tensorflow.init() before creating the packed exchange")
    state = tf_state(compression)
    key = (process_set.process_set_id, settings,
           id(telemetry) if telemetry is not None else None)
    with state.lock:
        found = state.exchanges.get(key)
    if found is None:
        found = PackedExchange(compression, process_set=process_set, settings=settings,
                               telemetry=telemetry, index=len(state.exchanges))
        with state.lock:
            state.exchanges[key] = found
    return found
