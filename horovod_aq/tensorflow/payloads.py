"""The payload ops of the TensorFlow packed exchange at the compressor's current code width.

:class:`PayloadOps` builds, at trace time, what :class:`~horovod_aq.tensorflow.packed.
PackedExchange` sends and receives: encoding a flat bucket (or its P two-phase chunks) with the
format's stream keys, the non-finite marker instead when the bucket cannot travel, the gathered
rows, their decoding and averaging. Everything reads the table variables of
:mod:`horovod_aq.tensorflow.state`, so a refit or a DQSGD width change never retraces: a
fixed-width compressor builds one branch, DQSGD one per width under a ``tf.switch_case``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

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
from horovod_aq.packed.plan import BucketPlan
from horovod_aq.packed.protocol import norm_may_overflow
from horovod_aq.tensorflow import kernels
from horovod_aq.tensorflow.state import TFState, WidthState

__all__ = ["PayloadOps"]


class PayloadOps:
    """Encode, mark, gather-check and decode payloads of one compressor in-graph."""

    def __init__(self, compression: Any, state: TFState, *, ranks: int, rank: int) -> None:
        self.compression = compression
        self.state = state
        self.ranks = ranks            #: P, the process set's size
        self.rank = rank              #: the global rank (keys the random stream)
        #: called with every payload encoded, when the graph runs (``PackedExchange.tap``)
        self.tap: Callable[..., Any] | None = None

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
        return self.by_width(lambda w: kernels.encode_with(
            x, w.levels, self.header(w, numel), bits=w.bits, bucket_size=comp.bucket_size,
            norm=comp.norm, key=key, check=False, checksum=comp.quantizer.checksum))

    def marker(self, numel: int, first_bad: tf.Tensor) -> tf.Tensor:
        """``codec.nonfinite_payload`` in-graph: this table's header with ``FLAG_NONFINITE`` and
        the first bad element, zeros elsewhere, the size of a real payload."""
        where = tf.bitcast(tf.cast(tf.minimum(first_bad, 2**32 - 1), tf.uint32), tf.uint8)

        def marker(w: WidthState) -> tf.Tensor:
            header = self.header(w, numel)
            size = codec.payload_size(numel, w.bits, self.compression.bucket_size)
            return tf.concat([header[:FLAGS_OFFSET], tf.constant([FLAG_NONFINITE], tf.uint8),
                              header[FLAGS_OFFSET + 1:MARKER_INDEX_OFFSET], where,
                              tf.zeros([size - HEADER_SIZE], tf.uint8)], axis=0)

        return self.by_width(marker)

    def submit(self, flat: tf.Tensor, numel: int, bucket: BucketPlan, parts: int = 1,
               first_part: int = 0) -> tf.Tensor:
        """Encode ``flat`` (``parts`` equal chunks of ``numel``, streams ``first_part`` …) or, when
        it holds NaN/Inf, send non-finite markers of the same size instead (``codec`` module
        docstring). A bucket of finite values whose norm overflows float32 is sent as markers too
        (``packed.protocol.first_unsendable``, docs/protocol.md §15)."""
        bad = tf.logical_not(tf.math.is_finite(flat))
        if self.compression.quantizes:
            bad = tf.logical_or(bad, self.unsendable(flat, numel, parts))

        def encode_part(r: int) -> tf.Tensor:
            x = flat[r * numel:(r + 1) * numel]
            key = self.stream_key(bucket.index, first_part + r)
            return self._tapped(bucket, first_part + r, x, self.encode(x, numel, key), key)

        def encode() -> tf.Tensor:
            chunks = [encode_part(r) for r in range(parts)]
            return chunks[0] if parts == 1 else tf.concat(chunks, axis=0)

        def markers() -> tf.Tensor:
            first = tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int64)
            return tf.tile(self.marker(numel, first), [parts])

        return tf.cond(tf.reduce_any(bad), markers, encode)

    def _tapped(self, bucket: BucketPlan, part: int, x: tf.Tensor, payload: tf.Tensor,
                key: tuple) -> tf.Tensor:
        """``payload``, after handing (bucket name, part, stream key, input, payload) as numpy
        values to :attr:`tap` when the graph runs (a host call; only traced when a tap is
        set)."""
        tap = self.tap
        if tap is None:
            return payload

        def call(k: np.ndarray, values: np.ndarray, out: np.ndarray) -> np.int64:
            tap(bucket.name, part, tuple(int(v) for v in k), values.copy(), out.copy())
            return np.int64(0)

        scalars = tf.stack([tf.cast(v, tf.int64) for v in key])
        done = tf.numpy_function(call, [scalars, x, payload], tf.int64, stateful=True,
                                 name="aq_payload_tap")
        with tf.control_dependencies([done]):
            return tf.identity(payload)

    def unsendable(self, flat: tf.Tensor, numel: int, parts: int) -> tf.Tensor:
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

    # ------------------------------------------------------------------ receive
    def rows(self, gathered: tf.Tensor, numel: int, bucket: BucketPlan) -> tf.Tensor:
        """The gathered (or all-to-all received) payloads of ``numel`` elements as [P, size].

        With DQSGD the size is only known at run time: it is checked first against this rank's
        width, so that ranks disagreeing on the width fail with a clear message on every rank
        (every rank received the same sizes) instead of decoding misaligned rows."""
        P, st = self.ranks, self.state
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

    def header_checks(self, rows: tf.Tensor, numel: int, check: bool) -> list:
        """DQSGD: the decoder's header check of every row of ``rows`` [P, size], done once
        against the current width's expected header (outside the width branches, which then
        skip it: the check's assertions are most of a decoder's graph). Fixed width: none here,
        the kernel checks."""
        st = self.state
        if st.width_index is None or not check:
            return []
        expected = tf.gather(tf.stack([self.header(w, numel) for w in st.widths]),
                             st.width_index.read_value())
        return kernels.decoder_header_check(rows[:, :HEADER_SIZE], expected)

    def decode_average(self, rows: tf.Tensor, numel: int) -> tf.Tensor:
        """Decode the P rows of ``rows`` and average them (header checks included)."""
        B = self.compression.bucket_size
        inner = self.state.width_index is None
        with tf.control_dependencies(self.header_checks(rows, numel, True)):
            return self.by_width(lambda w: kernels.decode_average_with(
                rows, w.levels, self.header(w, numel), numel=numel, bits=w.bits,
                bucket_size=B, check=inner))

    def decode_rows(self, rows: tf.Tensor, numel: int, check: bool = True) -> tf.Tensor:
        """Decode every row of ``rows`` [R, size] and concatenate them (R·numel values)."""
        B = self.compression.bucket_size
        inner = check and self.state.width_index is None

        def decode(w: WidthState) -> tf.Tensor:
            header = self.header(w, numel)
            return tf.concat([kernels.decode_with(rows[r], w.levels, header, numel=numel,
                                                  bits=w.bits, bucket_size=B, check=inner)
                              for r in range(int(rows.shape[0]))], axis=0)

        with tf.control_dependencies(self.header_checks(rows, numel, check)):
            return self.by_width(decode)

    def flagged(self, rows: tf.Tensor) -> tf.Tensor:
        """Per row of ``rows`` [P, size]: whether it is a non-finite marker."""
        return tf.bitwise.bitwise_and(rows[:, FLAGS_OFFSET], FLAG_NONFINITE) > 0

    @staticmethod
    def marker_index(rows: tf.Tensor, rank: tf.Tensor) -> tf.Tensor:
        """The first bad element a marker row states (u32 at ``MARKER_INDEX_OFFSET``), int64."""
        return tf.cast(tf.bitcast(rows[rank, MARKER_INDEX_OFFSET:HEADER_SIZE], tf.uint32),
                       tf.int64)

