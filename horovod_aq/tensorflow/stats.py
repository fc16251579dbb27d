"""Per-bucket statistics of a TensorFlow gradient, for level fitting (docs/quantizers.md §5.1).

:func:`bucket_moments` is the TensorFlow version of ``horovod_aq.levels.stats.bucket_moments``
(same definition, float64, eager; re-exported by ``horovod_aq.tensorflow.kernels``).
:func:`graph_bucket_moments` and :func:`graph_normalized_histogram` are the graph-safe versions
the traced exchange writes into its statistics slots (``horovod_aq.tensorflow.state``);
:func:`aggregate_sum_sq` is DQSGD's rank-identical Σ‖decoded aggregate‖² (docs/protocol.md §13).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from horovod_aq import codec
from horovod_aq.tensorflow.tensors import as_float32_flat, static_numel

__all__ = ["aggregate_sum_sq", "bucket_moments", "graph_bucket_moments",
           "graph_normalized_histogram"]


def bucket_moments(x: Any, bucket_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(norms, means, stds) of the full non-zero buckets as float64 numpy arrays (eager only).

    Same definition as ``horovod_aq.levels.stats.bucket_moments`` (u = v/‖v‖₂, std with
    ddof = 1), computed with TF ops; only the three result vectors are copied to the host.
    """
    bucket_size = codec.check_int("bucket_size", bucket_size, 2, codec.MAX_BUCKET_SIZE)
    flat = tf.cast(as_float32_flat(x), tf.float64)
    full_buckets = static_numel(flat) // bucket_size
    rows = tf.reshape(flat[: full_buckets * bucket_size], [full_buckets, bucket_size])
    norms = tf.sqrt(tf.reduce_sum(tf.square(rows), axis=1))
    keep = norms > 0
    u = tf.boolean_mask(rows, keep) / tf.boolean_mask(norms, keep)[:, None]
    means = tf.reduce_mean(u, axis=1)
    var = tf.reduce_sum(tf.square(u - means[:, None]), axis=1) / (bucket_size - 1)
    return tf.boolean_mask(norms, keep).numpy(), means.numpy(), tf.sqrt(var).numpy()


def graph_bucket_moments(flat: tf.Tensor,
                         bucket_size: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(norms, means, stds) in float64 of EVERY full bucket of a flat tensor, graph-safe.

    Same definition as :func:`bucket_moments` (u = v/‖v‖₂, std with divisor B − 1) except that
    zero buckets are kept (with mean 0, std 0) so that the shapes are static; the eager side
    drops them (``norms > 0``) before ``compressor.record_stats``.
    """
    n = int(flat.shape.num_elements())
    full = n // bucket_size
    rows = tf.reshape(tf.cast(flat[: full * bucket_size], tf.float64), [full, bucket_size])
    norms = tf.sqrt(tf.reduce_sum(tf.square(rows), axis=1))
    u = rows / tf.where(norms > 0, norms, tf.ones_like(norms))[:, None]
    means = tf.reduce_mean(u, axis=1)
    var = tf.reduce_sum(tf.square(u - means[:, None]), axis=1) / (bucket_size - 1)
    return norms, means, tf.sqrt(var)


def graph_normalized_histogram(flat: tf.Tensor, bucket_size: int) -> tf.Tensor:
    """``levels.stats.normalized_histogram`` in-graph: float64 weights of the default grid.

    Every bucket, the partial tail with its own norm, zero buckets skipped; in float64
    a = max|v|, s = v/a, ρ = √Σs², r = clip(s/ρ, −1, 1), weight (a·ρ)², bin = number of edges
    ≤ r minus one, clamped to [0, H − 1] (the binning rule of ``levels.stats``).
    """
    from horovod_aq.levels.histogram import histogram_edges

    edges_np = histogram_edges()
    bins = edges_np.size - 1
    n = int(flat.shape.num_elements())
    full = n // bucket_size
    x = tf.cast(flat, tf.float64)
    blocks = []
    if full:
        blocks.append(tf.reshape(x[: full * bucket_size], [full, bucket_size]))
    if n > full * bucket_size:
        blocks.append(tf.reshape(x[full * bucket_size:], [1, n - full * bucket_size]))
    out = tf.zeros([bins], tf.float64)
    edges = tf.constant(edges_np[None, :])
    for block in blocks:
        amax = tf.reduce_max(tf.abs(block), axis=1)
        keep = amax > 0
        scaled = block / tf.where(keep, amax, tf.ones_like(amax))[:, None]
        root = tf.sqrt(tf.reduce_sum(tf.square(scaled), axis=1))
        r = tf.clip_by_value(scaled / tf.where(keep, root, tf.ones_like(root))[:, None], -1.0, 1.0)
        weight = tf.where(keep, tf.square(amax * root), tf.zeros_like(amax))
        k = tf.searchsorted(edges, tf.reshape(r, [1, -1]), side="right", out_type=tf.int32) - 1
        k = tf.clip_by_value(tf.reshape(k, [-1]), 0, bins - 1)
        w = tf.reshape(tf.broadcast_to(weight[:, None], tf.shape(block)), [-1])
        out += tf.math.unsorted_segment_sum(w, k, bins)
    return out


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


def aggregate_sum_sq(parts: list[tuple[tf.Tensor, tf.Tensor]]) -> tf.Tensor:
    """Σ‖part‖² in float64 over the decoded aggregate (``DQSGD.observe_aggregate``'s input):
    pairwise within every part, then pairwise over the parts in layout order; a skipped part
    (NaN, some rank was non-finite) counts 0, as PyTorch observes only decoded buckets."""
    if not parts:
        return tf.constant(0.0, tf.float64)
    sums = [tf.where(bad, tf.constant(0.0, tf.float64),
                     _pairwise_sum(tf.square(tf.cast(tf.reshape(x, [-1]), tf.float64))))
            for x, bad in parts]
    return _pairwise_sum(tf.stack(sums))
