"""The format's random stream of stochastic rounding in TensorFlow ops (docs/format.md §6;
``horovod_aq.codec.stream`` is the definition), graph-safe."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from horovod_aq.codec.stream import UNIFORM_BITS, WORDS_PER_COUNTER, StreamKey, philox4x32

__all__ = ["stream_uniforms"]


def stream_uniforms(n: int, key: Any, start: int = 0) -> tf.Tensor:
    """``codec.stream_uniforms`` in TensorFlow ops (graph-safe): coordinates start … start+n−1
    of the format's Philox stream (docs/format.md §6). ``key`` is a ``codec.StreamKey`` or its
    ``scalars()`` (k0, k1, step, bucket, part), where the step may be an int64 tensor (a
    variable read inside a traced step: no retrace per step)."""
    if n == 0:
        return tf.zeros([0], tf.float32)
    k0, k1, step, bucket, part = key.scalars() if isinstance(key, StreamKey) else key
    first, last = start // WORDS_PER_COUNTER, (start + n - 1) // WORDS_PER_COUNTER
    c0 = tf.range(first, last + 1, dtype=tf.int64)
    c1, c2, c3 = (tf.fill(tf.shape(c0), tf.cast(c, tf.int64) & 0xFFFFFFFF)
                  for c in (step, bucket, part))
    words = philox4x32((c0, c1, c2, c3), (k0, k1), rshift=tf.bitwise.right_shift)
    flat = tf.reshape(tf.stack(words, axis=1), [-1])
    offset = start - first * WORDS_PER_COUNTER
    top = tf.bitwise.right_shift(flat[offset:offset + n], 32 - UNIFORM_BITS)
    return tf.cast(top, tf.float32) * (2.0 ** -UNIFORM_BITS)
