"""The payload ops of the TensorFlow packed exchange at the compressor's current code width.

:class:`PayloadOps` builds, at trace time, what :class:`~horovod_aq.tensorflow.packed.
PackedExchange` sends and receives: encoding a flat bucket (or its P two-phase chunks) with the
format's stream keys, the non-finite marker instead when the bucket cannot travel, the gathered
rows, their decoding and averaging; with error feedback (``send_compensated``) the
compensated encode of :mod:`horovod_aq.tensorflow.compensated`, which returns the new memory
h' with the payloads (no decode of this rank's own payloads). Everything reads the table
variables of
:mod:`horovod_aq.tensorflow.state`, so a refit or a DQSGD width change never retraces: a
fixed-width compressor builds one branch, DQSGD one per width under a ``tf.switch_case``.

Coding (``coding``, the exchange's ``wire=``): "fixed" payloads have one static size per width
and arrive as [P, size] rows; "entropy" payloads (docs/format.md §12) have sizes known only at
run time (shape [None]) and arrive as :class:`~horovod_aq.tensorflow.entropy.VariableRows`
(delimited on receipt, docs/protocol.md §5.4); their encoders and decoders are the compiled
host kernels of :mod:`horovod_aq.tensorflow.entropy`. Markers are fixed-size on both wires.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from horovod_aq import codec
from horovod_aq.codec import (
    FLAG_NONFINITE,
    FLAGS_OFFSET,
    HEADER_SIZE,
    MARKER_INDEX_OFFSET,
    TABLE_ID_SLICE,
)
from horovod_aq.codec.stream import StreamKey
from horovod_aq.packed.marker import Marker, marker_for, marker_index
from horovod_aq.packed.plan import BucketPlan
from horovod_aq.packed.protocol import norm_may_overflow
from horovod_aq.packed.send import Fused, SendSteps, first_bad_element, send_bucket
from horovod_aq.tensorflow import compensated, entropy, kernels
from horovod_aq.tensorflow.entropy import VariableRows
from horovod_aq.tensorflow.state import TFState, WidthState

__all__ = ["PayloadOps", "Rows"]

#: Received payloads: [P, size] rows (fixed coding) or :class:`VariableRows` (entropy coding).
Rows = tf.Tensor | VariableRows


class _Unsendable(NamedTuple):
    """What the in-graph check of a bucket found: whether markers go out, and the values the
    host looks at to name the first bad element (``send.first_bad_element``)."""

    flag: tf.Tensor   # bool scalar
    raw: tf.Tensor    # g
    x: tf.Tensor      # g + α·h


def _graph_branch(bad: _Unsendable, on_bad: Callable[[], list], on_ok: Callable[[], list]) -> list:
    """``send.send_bucket``'s choice in a graph: markers or payloads, a ``tf.cond``."""
    return tf.cond(bad.flag, on_bad, on_ok)


def _first_nonfinite(v: np.ndarray) -> int | None:
    bad = np.flatnonzero(~np.isfinite(v))
    return int(bad[0]) if bad.size else None


def _peak(v: np.ndarray) -> float:
    return float(np.max(np.abs(v))) if v.size else 0.0


class PayloadOps:
    """Encode, mark, gather-check and decode payloads of one compressor in-graph."""

    def __init__(self, compression: Any, state: TFState, *, ranks: int, rank: int,
                  coding: str = "fixed") -> None:
        self.compression = compression
        self.state = state
        self.ranks = ranks            #: P, the process set's size
        self.rank = rank              #: the global rank (keys the random stream)
        self.coding = coding          #: "fixed" or "entropy" (``packed.plan.CODINGS``)
        #: called with every payload encoded, when the graph runs (``PackedExchange.tap``)
        self.tap: Callable[..., Any] | None = None

    @property
    def variable(self) -> bool:
        """Whether payload sizes vary by rank and step (the entropy-coded wire)."""
        return self.coding == "entropy"

    # ------------------------------------------------------------------ widths
    def stream_key(self, bucket_index: int, part: int) -> tuple:
        """The format's stream key (docs/format.md §6) of (step, bucket, part) on this rank, as
        ``StreamKey.scalars()`` with the step read from the state variable (no retrace): the
        same uniforms as every other kernel, so a resumed run draws what an uninterrupted one
        would."""
        k0, k1 = StreamKey(self.compression.quantizer.seed, self.rank).philox_key()
        return k0, k1, self.state.step.read_value(), bucket_index, part

    def by_width(self, fn: Callable[[WidthState], tf.Tensor]) -> tf.Tensor:
        """``fn(width)`` for the current code width: a plain call for a fixed-width compressor,
        a ``tf.switch_case`` over DQSGD's widths on the ``width_index`` variable otherwise (each
        branch has its own static sizes; the result's size is then dynamic)."""
        st = self.state
        if st.width_index is None:
            return fn(st.widths[0])
        return tf.switch_case(st.width_index.read_value(),
                              [functools.partial(fn, w) for w in st.widths])

    def header(self, width: WidthState, numel: int) -> tf.Tensor:
        return width.header(numel, self.compression.bucket_size, self.compression.norm)

    # ------------------------------------------------------------------ send
    def encode(self, x: tf.Tensor, numel: int, key: tuple) -> tf.Tensor:
        """Encode a flat float32 tensor of ``numel`` elements with the table variables of the
        current width and the uniforms of the stream ``key``."""
        comp = self.compression
        if self.variable:   # codec.encode_entropy's bytes, of the same stream (shape [None])
            _, _, step, bucket, part = key
            return self.by_width(lambda w: entropy.encode_entropy(
                x, lambda: w.source.table, seed=comp.quantizer.seed, rank=self.rank,
                step=step, bucket=bucket, part=part, bucket_size=comp.bucket_size,
                norm=comp.norm, checksum=comp.quantizer.checksum))
        return self.by_width(lambda w: kernels.encode_with(
            x, w.levels, self.header(w, numel), bits=w.bits, bucket_size=comp.bucket_size,
            norm=comp.norm, key=key, check=False, checksum=comp.quantizer.checksum))

    def send(self, raw: tf.Tensor, bucket: BucketPlan, *, mode: str,
             record: Callable[[tf.Tensor], tf.Tensor] | None = None,
             first_part: int = 0) -> tf.Tensor:
        """:meth:`send_parts`, concatenated (what a collective without splits sends)."""
        sent = self.send_parts(raw, bucket, mode=mode, record=record, first_part=first_part)
        return sent[0] if len(sent) == 1 else tf.concat(sent, axis=0)

    def send_parts(self, raw: tf.Tensor, bucket: BucketPlan, *, mode: str,
                   record: Callable[[tf.Tensor], tf.Tensor] | None = None,
                   first_part: int = 0) -> list[tf.Tensor]:
        """The payloads of the flat float32 ``raw`` sent by ``mode`` ("allgather": one payload;
        "two_phase": the P chunks of the zero-padded bucket, streams ``first_part`` …), in the
        order of :func:`horovod_aq.packed.send.send_bucket`: check, record (``record``: the
        refit statistics), encode — or, when something cannot travel, the non-finite markers of
        :func:`horovod_aq.packed.marker.marker_for` instead. The check is a ``tf.cond``; the
        first bad element a marker names is found on the host, by ``send.first_bad_element``,
        only when markers are sent. With error feedback: :meth:`send_compensated`."""
        layout = self._layout(raw, mode)
        recorded: list[tf.Tensor] = []

        def record_stats(x: tf.Tensor) -> None:
            if record is not None:
                recorded.append(record(x))

        def encode(values: tf.Tensor, k: int) -> tf.Tensor:
            key = self.stream_key(bucket.index, first_part + k)
            with tf.control_dependencies(recorded):
                return self._tapped(bucket, first_part + k, values,
                                    self.encode(values, layout.numel, key))

        steps = SendSteps(
            compensate=tf.identity, first_bad=self._first_bad, record=record_stats,
            parts=lambda x: self._parts(x, layout), encode=encode,
            markers=lambda bad: self._markers(bad, mode), branch=_graph_branch)
        return list(send_bucket(raw, steps))

    def send_compensated(self, raw: tf.Tensor, h: tf.Tensor, bucket: BucketPlan, *, mode: str,
                         record: Callable[[tf.Tensor], tf.Tensor] | None = None,
                         ) -> tuple[list[tf.Tensor], compensated.Compensated]:
        """:meth:`send_parts` with error feedback (memory ``h``): the fused order of
        ``send.send_bucket`` — the compensated encode (:meth:`encode_compensated`: payloads and
        h'), then its outcome as the check (markers named by ``send.first_bad_element`` when it
        refused), the statistics of x = g + α·h on recording steps only, the tap. Returns the
        payloads sent and the encode's outcome; the graph installs h' later, after every check
        passed (``compensated.update_memory``)."""
        ef = self.state.error_memory
        layout = self._layout(raw, mode)
        fused = self.encode_compensated(raw, h, bucket, layout)
        recorded: list[tf.Tensor] = []

        def compensate(g: tf.Tensor) -> tf.Tensor:
            return ef.compensate_value(g, h)                         # g + α·h

        def when(flag: Any, action: Callable[[], tf.Tensor]) -> None:
            if flag is not False:
                recorded.append(tf.cond(flag, action, lambda: tf.constant(-1, tf.int64)))

        def branch(refused: tf.Tensor, on_bad: Callable[[], list],
                   on_ok: Callable[[], list]) -> list:
            def ok() -> list:
                sent = list(on_ok())
                if self.tap is not None:   # the values encoded, computed for the tap only
                    x = self._parts(compensate(raw), layout)
                    sent = [self._tapped(bucket, k, x[k], p) for k, p in enumerate(sent)]
                with tf.control_dependencies(recorded):
                    return [tf.identity(p) for p in sent]
            return tf.cond(refused, on_bad, ok)

        steps = SendSteps(
            compensate=compensate, first_bad=self._first_bad,
            record=record if record is not None else tf.identity,
            parts=lambda x: self._parts(x, layout),
            encode=lambda values, k: self.encode(values, layout.numel,
                                                 self.stream_key(bucket.index, k)),
            markers=lambda bad: self._markers(bad, mode), branch=branch,
            encode_compensated=lambda g: Fused(list(fused.payloads), lambda: None,
                                               fused.refused),
            recording=(lambda: self.state.recording.read_value()) if record is not None
            else (lambda: False),
            when=when)
        return list(send_bucket(raw, steps)), fused

    def encode_compensated(self, raw: tf.Tensor, h: tf.Tensor, bucket: BucketPlan,
                           layout: Marker) -> compensated.Compensated:
        """The compensated encode of g = ``raw`` with memory ``h`` at the current width
        (:mod:`horovod_aq.tensorflow.compensated`: a host pass without a GPU and on the
        entropy-coded wire, graph ops otherwise)."""
        comp, ef = self.compression, self.state.error_memory
        parts = compensated.Parts(
            numel=int(raw.shape.num_elements()), size=layout.numel, copies=layout.copies,
            bucket=bucket.index, alpha=ef.alpha, beta=ef.beta, bucket_size=comp.bucket_size,
            norm=comp.norm, checksum=comp.quantizer.checksum)
        step = self.state.step.read_value()

        def one(w: WidthState) -> compensated.Compensated:
            if self.variable:
                return compensated.on_host(raw, h, step, parts, seed=comp.quantizer.seed,
                                           rank=self.rank, bits=w.bits,
                                           table_of=lambda: w.source.table)
            levels, header = tf.convert_to_tensor(w.levels), self.header(w, layout.numel)
            if kernels.use_fused():
                return compensated.on_host(raw, h, step, parts, seed=comp.quantizer.seed,
                                           rank=self.rank, bits=w.bits, levels=levels,
                                           header=header)
            return compensated.in_graph(
                raw, h, levels, header,
                [self.stream_key(bucket.index, k) for k in range(layout.copies)], parts,
                bits=w.bits, compensate=ef.compensate_value, update=ef.updated_memory,
                unsendable=lambda g, x: self._first_bad(g, x).flag)

        return self.by_width(one)

    def _layout(self, raw: tf.Tensor, mode: str) -> Marker:
        """The parts of a bucket sent by ``mode`` (``marker_for``: copies × numel)."""
        return marker_for(mode, int(raw.shape.num_elements()), self.ranks,
                          self.state.widths[0].bits, self.compression.bucket_size)

    @staticmethod
    def _parts(x: tf.Tensor, layout: Marker) -> list[tf.Tensor]:
        """[x], or the ``copies`` chunks of x zero-padded to copies·numel coordinates."""
        if layout.copies == 1:
            return [x]
        padded = tf.pad(x, [[0, layout.copies * layout.numel - int(x.shape.num_elements())]])
        return [padded[r * layout.numel:(r + 1) * layout.numel] for r in range(layout.copies)]

    def _first_bad(self, raw: tf.Tensor, x: tf.Tensor) -> _Unsendable:
        """Whether something of g or x = g + α·h cannot travel (NaN/±Inf, or a quantization
        bucket whose norm does not fit a float32), as a bool tensor; the element is found on
        the host only when markers are sent (:meth:`_markers`)."""
        bad = tf.logical_not(tf.logical_and(tf.reduce_all(tf.math.is_finite(raw)),
                                            tf.reduce_all(tf.math.is_finite(x))))
        if self.compression.quantizes:
            bad = tf.logical_or(bad, self.overflows(x))
        return _Unsendable(bad, raw, x)

    def overflows(self, x: tf.Tensor) -> tf.Tensor:
        """Whether a quantization bucket of ``x`` has a norm (exact in float64) past float32 —
        ``first_unsendable``'s rule in-graph, computed only when ``norm_may_overflow``."""
        B = self.compression.bucket_size
        n = int(x.shape.num_elements())
        nb = -(-n // B)

        def exact() -> tf.Tensor:
            v = tf.pad(tf.cast(x, tf.float64), [[0, nb * B - n]])
            norms = tf.sqrt(tf.reduce_sum(tf.square(tf.reshape(v, [nb, B])), axis=1))
            return tf.reduce_any(tf.math.is_inf(tf.cast(norms, tf.float32)))

        risky = norm_may_overflow(tf.reduce_max(tf.abs(x)), B)
        return tf.cond(risky, exact, lambda: tf.constant(False))

    def _markers(self, bad: _Unsendable, mode: str) -> list[tf.Tensor]:
        """The markers sent in place of the payloads (:func:`marker_for`: one per part), naming
        the first bad element of the whole bucket (``send.first_bad_element`` on the host)."""
        B, norm = self.compression.bucket_size, self.compression.norm
        numel = int(bad.raw.shape.num_elements())

        def first(raw: np.ndarray, x: np.ndarray) -> np.int64:
            with np.errstate(over="ignore"):
                found = first_bad_element(
                    raw, x, first_nonfinite=_first_nonfinite, peak=_peak, bucket_size=B,
                    norms=lambda v: codec.bucket_norms(v, B, "l2"))
            return np.int64(marker_index(0 if found is None else found))

        index = tf.numpy_function(first, [bad.raw, bad.x], tf.int64, stateful=False,
                                  name="aq_first_bad")
        where = tf.bitcast(tf.cast(index, tf.uint32), tf.uint8)
        where.set_shape([4])

        def one(w: WidthState) -> tf.Tensor:
            mk = marker_for(mode, numel, self.ranks, w.bits, B)
            const = np.frombuffer(codec.make_header(mk.numel, w.source.table, B, norm,
                                                    first_nonfinite=0), dtype=np.uint8)
            return tf.concat([tf.constant(const[:TABLE_ID_SLICE.start]), w.table_id.read_value(),
                              tf.constant(const[TABLE_ID_SLICE.stop:MARKER_INDEX_OFFSET]), where,
                              tf.zeros([mk.size - HEADER_SIZE], tf.uint8)], axis=0)

        copies = marker_for(mode, numel, self.ranks, self.state.widths[0].bits, B).copies
        return [self.by_width(one)] * copies

    def _tapped(self, bucket: BucketPlan, part: int, x: tf.Tensor,
                payload: tf.Tensor) -> tf.Tensor:
        """``payload``, after handing ``(bucket, part, values, payload)`` to :attr:`tap` when
        the graph runs (numpy copies; a host call, traced only when a tap is set)."""
        tap = self.tap
        if tap is None:
            return payload

        def call(values: np.ndarray, out: np.ndarray) -> np.int64:
            tap(bucket, part, values.copy(), out.copy())
            return np.int64(0)

        done = tf.numpy_function(call, [x, payload], tf.int64, stateful=True,
                                 name="aq_payload_tap")
        with tf.control_dependencies([done]):
            return tf.identity(payload)

    # ------------------------------------------------------------------ receive
    def rows(self, gathered: tf.Tensor, numel: int, bucket: BucketPlan,
             splits: tf.Tensor | None = None) -> Rows:
        """The gathered (or all-to-all received) payloads of ``numel`` elements as [P, size].

        With DQSGD the size is only known at run time: it is checked first against this rank's
        width, so that ranks disagreeing on the width fail with a clear message on every rank
        (every rank received the same sizes) instead of decoding misaligned rows.

        Entropy coding: :class:`VariableRows`, sized by the alltoall's received ``splits`` or,
        for an allgather, by the payloads' own headers (``entropy.delimited``)."""
        P, st = self.ranks, self.state
        if self.variable:
            return (entropy.delimited(gathered, P) if splits is None
                    else entropy.received(gathered, splits, P))
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

    @staticmethod
    def heads(rows: Rows) -> tf.Tensor:
        """[P, 32]: the header bytes of every received row."""
        return rows.heads if isinstance(rows, VariableRows) else rows[:, :HEADER_SIZE]

    def header_checks(self, rows: Rows, numel: int, check: bool) -> list:
        """DQSGD: the decoder's header check of every row of ``rows`` [P, size], done once
        against the current width's expected header (outside the width branches, which then
        skip it: the check's assertions are most of a decoder's graph). Fixed width: none here,
        the kernel checks. Entropy coding: always here (the host decoders then check the
        headers against the table once more, with the oracle's messages)."""
        st = self.state
        variable = isinstance(rows, VariableRows)
        if not check or (st.width_index is None and not variable):
            return []
        if st.width_index is None:
            expected = self.header(st.widths[0], numel)
        else:
            expected = tf.gather(tf.stack([self.header(w, numel) for w in st.widths]),
                                 st.width_index.read_value())
        return kernels.decoder_header_check(self.heads(rows), expected, entropy=variable)

    def decode_average(self, rows: Rows, numel: int) -> tf.Tensor:
        """Decode the P rows of ``rows`` and average them (header checks included)."""
        B = self.compression.bucket_size
        if isinstance(rows, VariableRows):
            with tf.control_dependencies(self.header_checks(rows, numel, True)):
                return self.by_width(lambda w: entropy.decode_average(
                    rows, lambda: w.source.table, numel=numel, bucket_size=B,
                    norm=self.compression.norm))
        inner = self.state.width_index is None
        with tf.control_dependencies(self.header_checks(rows, numel, True)):
            return self.by_width(lambda w: kernels.decode_average_with(
                rows, w.levels, self.header(w, numel), numel=numel, bits=w.bits,
                bucket_size=B, check=inner))

    def decode_rows(self, rows: Rows, numel: int, check: bool = True) -> tf.Tensor:
        """Decode every row of ``rows`` [R, size] and concatenate them (R·numel values)."""
        B = self.compression.bucket_size
        if isinstance(rows, VariableRows):
            with tf.control_dependencies(self.header_checks(rows, numel, check)):
                return self.by_width(lambda w: entropy.decode_rows(
                    rows, lambda: w.source.table, numel=numel, bucket_size=B,
                    norm=self.compression.norm))
        inner = check and self.state.width_index is None

        def decode(w: WidthState) -> tf.Tensor:
            header = self.header(w, numel)
            return tf.concat([kernels.decode_with(rows[r], w.levels, header, numel=numel,
                                                  bits=w.bits, bucket_size=B, check=inner)
                              for r in range(int(rows.shape[0]))], axis=0)

        with tf.control_dependencies(self.header_checks(rows, numel, check)):
            return self.by_width(decode)

    def flagged(self, rows: Rows) -> tf.Tensor:
        """Per row of ``rows``: whether it is a non-finite marker."""
        return tf.bitwise.bitwise_and(self.heads(rows)[:, FLAGS_OFFSET], FLAG_NONFINITE) > 0
