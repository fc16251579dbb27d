"""LSB-first bit packing of the codes in TensorFlow ops (``horovod_aq.codec.bits``, codec step 5;
docs/format.md), graph-safe with static sizes."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from horovod_aq.codec.format import packed_size

__all__ = ["pack_bits", "unpack_bits"]


def _word(bits: int):
    return (tf.int32, 4) if bits <= 4 else (tf.int64, 8)


def pack_bits(codes: tf.Tensor, n: int, bits: int) -> tf.Tensor:
    """LSB-first bit packing of n int32 codes into ⌈n·bits/8⌉ bytes (codec step 5)."""
    nbytes = packed_size(n, bits)
    if bits == 8:
        return tf.cast(codes, tf.uint8)
    groups = -(-n // 8)
    dtype, _ = _word(bits)
    grouped = tf.reshape(tf.pad(codes, [[0, groups * 8 - n]]), [groups, 8])
    shifts = tf.constant(np.arange(8) * bits, dtype=dtype)
    words = tf.reduce_sum(tf.bitwise.left_shift(tf.cast(grouped, dtype), shifts), axis=1)
    stream = tf.reshape(tf.bitcast(words, tf.uint8)[:, :bits], [-1])
    return stream[:nbytes]


def unpack_bits(stream: tf.Tensor, n: int, bits: int) -> tf.Tensor:
    """The n int32 codes of a packed stream of ⌈n·bits/8⌉ bytes."""
    if bits == 8:
        return tf.cast(stream, tf.int32)
    groups = -(-n // 8)
    dtype, word_bytes = _word(bits)
    padded = tf.pad(stream, [[0, groups * bits - packed_size(n, bits)]])
    padded = tf.pad(tf.reshape(padded, [groups, bits]), [[0, 0], [0, word_bytes - bits]])
    words = tf.bitcast(padded, dtype)[:, None]
    shifts = tf.constant(np.arange(8) * bits, dtype=dtype)
    codes = tf.bitwise.bitwise_and(tf.bitwise.right_shift(words, shifts),
                                   tf.constant((1 << bits) - 1, dtype=dtype))
    return tf.cast(tf.reshape(codes, [-1])[:n], tf.int32)
