"""Shape and dtype helpers of the TensorFlow kernels (a leaf: TensorFlow and nothing of the
package), shared by :mod:`horovod_aq.tensorflow.kernels` and :mod:`horovod_aq.tensorflow.stats`.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["FLOAT_DTYPES", "as_float32_flat", "next_pow2", "per_bucket", "split_buckets",
           "static_numel"]

#: The gradient dtypes the kernels accept (cast to float32 on entry).
FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def static_numel(x: tf.Tensor, what: str = "x") -> int:
    """The number of elements of ``x``'s static shape (the kernels fix sizes at trace time)."""
    n = x.shape.num_elements()
    if n is None:
        raise ValueError(f"{what} needs a fully defined static shape, got {x.shape}; give the "
                         "tf.function an input_signature with static shapes")
    return int(n)


def as_float32_flat(x: Any) -> tf.Tensor:
    """``x`` flattened and cast to float32, after checking its dtype and static size."""
    x = tf.convert_to_tensor(x)
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"expected a floating-point gradient, got dtype {x.dtype.name}")
    static_numel(x)
    return tf.cast(tf.reshape(x, [-1]), tf.float32)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the width of a pairwise sum."""
    return 1 << max(0, int(n) - 1).bit_length()


def split_buckets(flat: tf.Tensor, n: int, bucket_size: int) -> list[tuple[tf.Tensor, int]]:
    """[(rows, first bucket)]: the full buckets as a [k, B] matrix, the partial tail as [1, B']."""
    full_buckets = n // bucket_size
    full = full_buckets * bucket_size
    parts = []
    if full_buckets:
        parts.append((tf.reshape(flat[:full], [full_buckets, bucket_size]), 0))
    if full < n:
        parts.append((tf.reshape(flat[full:], [1, n - full]), full_buckets))
    return parts


def per_bucket(op, flat: tf.Tensor, values: tf.Tensor, n: int, bucket_size: int):
    """op(flat_i, values[bucket(i)]) with static shapes, flattened."""
    outs = [tf.reshape(op(rows, values[first : first + rows.shape[0], None]), [-1])
            for rows, first in split_buckets(flat, n, bucket_size)]
    return outs[0] if len(outs) == 1 else tf.concat(outs, axis=0)
