"""TensorFlow's side of Horovod's stock ``compression=`` path (decisions: :mod:`horovod_aq.stock`).

``hvd.DistributedGradientTape(tape, compression=horovod_aq.ALQ(bits=3))`` and
``horovod.tensorflow.keras.DistributedOptimizer(opt, compression=...)`` (tf_keras) call
``compression.compress(grad)`` inside Horovod's cached ``tf.function``, *sum* what it returns
with an allreduce, then call ``decompress``. Packed codes cannot be summed, so here the compressor
quantizes the gradient with its level table (unbiased stochastic rounding: the training sees the
true quantization noise), dequantizes it and ships **fp16** — 2x less traffic than fp32, not
``bits`` per coordinate (a one-time log line says so; the bit-packed exchange is
``horovod_aq.tensorflow.DistributedGradientTape`` / ``horovod_aq.keras.DistributedOptimizer``).

Everything below is graph code, traced once per gradient by Horovod:

* levels and the table identity come from the compressor's :class:`~.state.TFState` variables,
  so a refit (``horovod_aq.tensorflow.refit(compressor)``, eager, once per step) is seen by the
  traced function without retracing;
* uniforms come from the state's ``tf.random.Generator`` (this rank's stream);
* when the compressor is recording, the tensor's bucket statistics are written into a
  :class:`~.state.StatsSlot` for the next ``refit``;
* range guard: an fp16 *sum* over P ranks must stay finite, so max|q|·P ≤ 65504 is asserted
  (``tf.errors.InvalidArgumentError`` naming the remedy);
* non-finite gradients: asserted on this rank (``nonfinite="raise"``), or sent as NaN so that
  every rank's sum is NaN and every rank can skip the step (``nonfinite="skip"``).

FP16 casts only; NoCompression never gets here (its ``compress`` is the identity). DQSGD is
refused here (its width follows the aggregated gradient, which this path does not see in a
rank-identical order) and ErrorFeedback refuses the stock hook by itself; both work on the packed
exchange.
"""

from __future__ import annotations

import itertools
from typing import Any

import tensorflow as tf

from horovod_aq import stock
from horovod_aq.backend import horovod_world
from horovod_aq.compressors import Compressor
from horovod_aq.tensorflow import kernels
from horovod_aq.tensorflow.state import tf_state

FP16_MAX = stock.FP16_MAX
_call_sites = itertools.count()


def quantize_local(compressor: Compressor, flat: tf.Tensor) -> tf.Tensor:
    """Quantize→dequantize a flat float32 tensor with the table variables and this rank's stream;
    records refit statistics in-graph when the compressor is recording."""
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
        with tf.control_dependencies([slot.record(flat)]):
            out = tf.identity(out)
    return out


def compress(compressor: Compressor, tensor: Any) -> tuple[Any, Any]:
    tensor = tf.convert_to_tensor(tensor)
    if not tensor.dtype.is_floating:
        return tensor, None
    route = stock.route(compressor, "tensorflow")
    if route == "identity":
        return tensor, None
    if route == "fp16":
        return tf.cast(tensor, tf.float16), tensor.dtype
    if tensor.shape.num_elements() is None:
        raise ValueError(f"{compressor.name}: the stock compression= path needs gradients with "
                         f"static shapes, got {tensor.shape}")
    flat = tf.cast(tf.reshape(tensor, [-1]), tf.float32)
    n = int(flat.shape.num_elements())
    finite = tf.reduce_all(tf.math.is_finite(flat))

    def quantized() -> tf.Tensor:
        q = quantize_local(compressor, flat)
        if n:
            peak = tf.reduce_max(tf.abs(q))
            world = horovod_world("horovod.tensorflow")[1]
            guard = tf.debugging.Assert(
                peak * tf.cast(world, tf.float32) <= FP16_MAX,
                [stock.fp16_range_message(compressor, "tensorflow") + ". Peak value:", peak])
            with tf.control_dependencies([guard]):
                q = tf.identity(q)
        return q

    if compressor.nonfinite == "skip":  # every rank's sum becomes NaN: all skip alike
        q = tf.cond(finite, quantized, lambda: tf.fill([n], float("nan")))
    else:
        check = tf.debugging.Assert(
            finite, [stock.nonfinite_message(compressor, tensor.shape, "tensorflow")])
        with tf.control_dependencies([check]):
            q = quantized()
    return tf.reshape(tf.cast(q, tf.float16), tf.shape(tensor)), tensor.dtype


def decompress(compressor: Compressor, tensor: Any, ctx: Any) -> Any:
    return tensor if ctx is None else tf.cast(tensor, ctx)
