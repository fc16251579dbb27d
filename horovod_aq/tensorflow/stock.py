"""TensorFlow's side of Horovod's stock ``compression=`` path (decisions: :mod:`horovod_aq.stock`).

``hvd.DistributedGradientTape(tape, compression=horovod_aq.ALQ(bits=3))`` and
``horovod.tensorflow.keras.DistributedOptimizer(opt, compression=...)`` (tf_keras) call
``compression.compress(grad)`` inside Horovod's cached ``tf.function``, *sum* what it returns
with an allreduce, then call ``decompress``. Packed codes cannot be summed, so here the compressor
quantizes the gradient with its level table (unbiased stochastic rounding: the training sees the
true quantization noise), dequantizes it, scales it by the power of two
:func:`horovod_aq.stock.wire_scale` (so the fp16 wire has the range of Horovod's own fp16, as on
the PyTorch stock path) and ships **fp16** — 2x less traffic than fp32, not ``bits`` per
coordinate (a one-time log line says so; the bit-packed exchange is
``horovod_aq.tensorflow.DistributedGradientTape`` / ``horovod_aq.keras.DistributedOptimizer``).

Everything below is graph code, traced once per gradient by Horovod:

* levels and the table identity come from the compressor's :class:`~.state.TFState` variables,
  so a refit is seen by the traced function without retracing; the first ``compress`` of each
  traced graph ends the previous step (refit when due) before it quantizes
  (:func:`step_boundary`), so no user call is needed;
* uniforms come from the state's ``tf.random.Generator`` (this rank's stream);
* when the compressor is recording, the tensor's bucket statistics are written into a
  :class:`~.state.StatsSlot` for the next ``refit``;
* range guard: an fp16 *sum* over P ranks must stay finite, so max|c·q|·P ≤ 65504 is asserted
  for the scaled values c·q (``tf.errors.InvalidArgumentError`` naming the remedy);
  ``decompress`` divides the average by c in float32 (exact: c is a power of two);
* non-finite gradients pass through, as with ``hvd.Compression.fp16``: the finite coordinates
  are quantized, NaN/±Inf are sent as they are, so every rank's sum is non-finite in the same
  places. With ``nonfinite="skip"`` that is all: the optimizer's own inf handling decides, alike
  on every rank (a loss-scale optimizer lowers its scale; Horovod's local gradient aggregation
  with ``backward_passes_per_step > 1`` clears its sums as with fp16). With
  ``nonfinite="raise"`` (default) ``decompress`` asserts that the *sum* is finite, so every rank
  raises the same ``InvalidArgumentError`` after the allreduce — none waits in a collective that
  another rank left (the stock hook cannot say which rank or parameter);
* shapes known only at run time (Horovod's eager ``sparse_as_dense``: the densified embedding
  gradient enters Horovod's ``tf.function`` as [None, d]) are quantized by the numpy codec in a
  ``tf.numpy_function`` (same table, this rank's stream, statistics recorded directly); the
  graph kernels need static sizes.

FP16 casts only; NoCompression never gets here (its ``compress`` is the identity). DQSGD is
refused here (its width follows the aggregated gradient, which this path does not see in a
rank-identical order) and ErrorFeedback refuses the stock hook by itself; both work on the packed
exchange.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.framework.func_graph import FuncGraph

from horovod_aq import codec, stock
from horovod_aq.backend import horovod_world
from horovod_aq.compressors import Compressor
from horovod_aq.tensorflow import compat, kernels
from horovod_aq.tensorflow.state import tf_state
from horovod_aq.tensorflow.step import begin_step_in_graph

compat.install()   # Horovod's tape keys sources by ref(): Keras 3 variables get one

FP16_MAX = stock.FP16_MAX
_call_sites = itertools.count()
#: Per traced graph, the compressors whose step boundary it already holds.
_boundaries: "weakref.WeakKeyDictionary[Any, set[int]]" = weakref.WeakKeyDictionary()


def step_boundary(compressor: Compressor) -> list[tf.Tensor]:
    """The step boundary op for the first ``compress`` of ``compressor`` in the graph being
    traced (:func:`~horovod_aq.tensorflow.step.begin_step_in_graph`), else nothing.

    Horovod traces its allreduce function once per gradient structure and runs it once per
    step; each ``compress`` sits in its own ``tf.cond`` branch, so the key is the outermost traced
    graph, and its first call site marks the start of a step. Eager calls (no graph)
    have no boundary: such loops call ``horovod_aq.tensorflow.refit`` themselves.
    """
    if tf.executing_eagerly():
        return []
    graph = tf.compat.v1.get_default_graph()
    while isinstance(getattr(graph, "outer_graph", None), FuncGraph):
        graph = graph.outer_graph    # Horovod wraps every allreduce in a tf.cond branch graph
    seen = _boundaries.setdefault(graph, set())
    if id(compressor) in seen:
        return []
    seen.add(id(compressor))
    return [begin_step_in_graph(compressor)]


def quantize_local(compressor: Compressor, flat: tf.Tensor,
                   record: tf.Tensor | None = None) -> tf.Tensor:
    """Quantize→dequantize a flat float32 tensor with the table variables and this rank's stream;
    records refit statistics of ``record`` (default ``flat``) in-graph when the compressor is
    recording."""
    state = tf_state(compressor)
    n = int(flat.shape.num_elements())
    header = state.header(n)
    table = compressor.table
    payload = kernels.encode_with(flat, state.levels, header, bits=table.bits,
                                  bucket_size=compressor.bucket_size, norm=compressor.norm,
                                  seed=state.generator)
    out = kernels.decode_with(payload, state.levels, header, numel=n, bits=table.bits,
                              bucket_size=compressor.bucket_size, check=False)
    slot = state.new_slot(n, f"stock{next(_call_sites)}")
    if slot is not None:
        with tf.control_dependencies([slot.record(flat if record is None else record)]):
            out = tf.identity(out)
    return out


def quantize_dynamic(compressor: Compressor, flat: tf.Tensor, record: tf.Tensor) -> tf.Tensor:
    """:func:`quantize_local` for a flat tensor whose size is known only at run time: the numpy
    codec inside a ``tf.numpy_function``, with the compressor's current table, uniforms from this
    rank's stream, and the statistics of ``record`` (when finite, on recording steps) handed to
    the compressor directly."""
    state = tf_state(compressor)
    uniforms = state.generator.uniform(tf.shape(flat), dtype=tf.float32)
    q = compressor.quantizer
    bucket_size = compressor.bucket_size

    def run(x: np.ndarray, u: np.ndarray, raw: np.ndarray) -> np.ndarray:
        if x.size == 0:
            return x.astype(np.float32)
        table = compressor.table
        payload = codec.encode(x, table, bucket_size=bucket_size, norm=compressor.norm,
                               uniforms=u)
        out = codec.decode(payload, table)
        if q.adaptive and q.recording and q.step_open and np.isfinite(raw).all():
            from horovod_aq.levels.stats import bucket_moments, normalized_histogram

            norms, means, stds = bucket_moments(raw, bucket_size)
            if q.wants_histogram:
                q.record_stats(norms, means, stds,
                               histogram=normalized_histogram(raw, bucket_size))
            elif norms.size:
                q.record_stats(norms, means, stds)
        return out.astype(np.float32)

    out = tf.numpy_function(run, [flat, uniforms, record], tf.float32, stateful=True,
                            name="aq_stock_quantize_dynamic")
    return tf.reshape(out, tf.shape(flat))


class _Context:
    """``compress``'s context for ``decompress``: the gradient's dtype, the wire scale c
    (:func:`horovod_aq.stock.wire_scale`) and, with nonfinite="raise", what to say when the sum
    is not finite."""

    __slots__ = ("dtype", "scale", "message")

    def __init__(self, dtype: tf.DType, scale: float, message: str | None) -> None:
        self.dtype = dtype
        self.scale = scale
        self.message = message


def _nonfinite_sum_message(compressor: Compressor, shape: Any) -> str:
    # no quotes: a graph assertion prints its strings C-escaped
    return (f"{compressor.name}: the allreduced gradient of shape {tuple(shape)} is not finite: "
            "some rank's gradient had NaN/Inf values (every rank stops here; Horovod's "
            "compression= hook cannot say which rank or parameter, the packed "
            f"{stock.PACKED_API['tensorflow']} names them). Set the compressor's nonfinite "
            "option to skip to let non-finite values through to the optimizer, as "
            "hvd.Compression.fp16 does (e.g. for loss scaling or local gradient aggregation).")


def compress(compressor: Compressor, tensor: Any) -> tuple[Any, Any]:
    tensor = tf.convert_to_tensor(tensor)
    if not tensor.dtype.is_floating:
        return tensor, None
    route = stock.route(compressor, "tensorflow")
    if route == "identity":
        return tensor, None
    if route == "fp16":
        return tf.cast(tensor, tf.float16), tensor.dtype
    static = tensor.shape.is_fully_defined()
    if tensor.shape.rank is None and not tf.executing_eagerly():
        raise ValueError(f"{compressor.name}: the stock compression= path needs gradients of a "
                         f"known rank, got {tensor.shape}")
    with tf.control_dependencies(step_boundary(compressor)):
        flat = tf.cast(tf.reshape(tensor, [-1]), tf.float32)
    finite = tf.math.is_finite(flat)
    clean = tf.where(finite, flat, tf.zeros_like(flat))   # what the quantizer may see
    scale = stock.wire_scale(compressor)

    def quantized() -> tf.Tensor:
        if static:
            q = quantize_local(compressor, clean, record=flat)
        else:
            q = quantize_dynamic(compressor, clean, flat)
        q = q * scale     # a power of two: exact
        peak = tf.reduce_max(tf.concat([tf.abs(q), tf.zeros([1], q.dtype)], axis=0))
        world = horovod_world("horovod.tensorflow")[1]
        guard = tf.debugging.Assert(
            peak * tf.cast(world, tf.float32) <= FP16_MAX,
            [stock.fp16_range_message(compressor, "tensorflow") + ". Peak value:", peak])
        with tf.control_dependencies([guard]):
            return tf.identity(q)

    # NaN/±Inf go through as they are (hvd.Compression.fp16 does the same), the rest quantized
    q = tf.where(finite, quantized(), flat)
    message = None if compressor.nonfinite == "skip" else \
        _nonfinite_sum_message(compressor, tensor.shape)
    return (tf.reshape(tf.cast(q, tf.float16), tf.shape(tensor)),
            _Context(tensor.dtype, scale, message))


def decompress(compressor: Compressor, tensor: Any, ctx: Any) -> Any:
    if ctx is None:
        return tensor
    if not isinstance(ctx, _Context):
        return tf.cast(tensor, ctx)
    if ctx.message is not None:
        check = tf.debugging.Assert(tf.reduce_all(tf.math.is_finite(tensor)), [ctx.message])
        with tf.control_dependencies([check]):
            tensor = tf.identity(tensor)
    # undo stock.wire_scale in float32 (exact), then the gradient's dtype
    return tf.cast(tf.cast(tensor, tf.float32) / ctx.scale, ctx.dtype)
