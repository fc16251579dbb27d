"""The :class:`~horovod_aq.backend.Backend` of TensorFlow tensors and variables (registered by
:mod:`horovod_aq.backend` under the module names ``tensorflow``, ``keras`` and ``tf_keras``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from horovod_aq.tensorflow import stock


class TensorFlowBackend:
    name = "tensorflow"

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x.numpy() if hasattr(x, "numpy") else tf.convert_to_tensor(x).numpy())

    def like(self, x: Any, value: np.ndarray) -> tf.Tensor:
        return tf.constant(value, dtype=tf.float32)

    def all_finite(self, x: Any) -> bool:
        return bool(tf.reduce_all(tf.math.is_finite(x)))

    def sum_of_squares(self, x: Any) -> float:
        return float(tf.reduce_sum(tf.square(tf.cast(x, tf.float64))))

    # Horovod calls the stock hooks inside its own tf.function, whose AutoGraph would otherwise
    # convert this package's quantizer, kernels, checks and logging at every first trace (the
    # stock sparse_as_dense check of tests/test_tf_dropin.py, two traces: 27.7 s a rank with
    # the conversion, 15.8 s without). They have no Python control flow on tensors, so they run
    # as written, as the packed exchange's ``PackedExchange.reduce`` does.
    @tf.autograph.experimental.do_not_convert
    def compress(self, compressor: Any, tensor: Any) -> tuple[Any, Any]:
        return stock.compress(compressor, tensor)

    @tf.autograph.experimental.do_not_convert
    def decompress(self, compressor: Any, tensor: Any, ctx: Any) -> Any:
        return stock.decompress(compressor, tensor, ctx)


BACKEND = TensorFlowBackend()
