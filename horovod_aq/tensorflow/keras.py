"""Keras 3 integration: a packed-exchange ``DistributedOptimizer`` and the callbacks ``fit`` needs.

Horovod 0.28.1's Keras optimizer reduces gradients in Keras-2 hooks that Keras 3's trainer never
calls (``train_step`` → ``optimizer.apply_gradients`` → ``apply``), and its callbacks use
``Variable.ref()``, which Keras 3 variables lack. Here::

    comp = horovod_aq.ALQ(bits=3)
    opt = horovod_aq.keras.DistributedOptimizer(keras.optimizers.SGD(0.05), comp)
    model.compile(optimizer=opt, loss=..., jit_compile=False)   # Horovod ops have no XLA kernels
    model.fit(x, y, callbacks=[
        horovod_aq.keras.BroadcastGlobalVariablesCallback(0),  # same initial weights everywhere
        horovod_aq.keras.RefitCallback(opt),                    # refits + telemetry, every batch
        horovod_aq.keras.MetricAverageCallback(),               # epoch metrics averaged
    ])

* :func:`DistributedOptimizer` builds, like Horovod, a class at run time whose base is the user's
  optimizer class, re-created from its config, overriding only ``apply(grads, variables)``: the
  gradients are averaged by :class:`~horovod_aq.tensorflow.packed.PackedExchange` — the same
  object the tape uses — and handed to the base class. ``apply_gradients`` forwards to ``apply``.
  In ``fit`` this runs inside Keras' traced train function, so the exchange is traced once.
* Non-finite gradients on a rank: every rank raises ``NonFiniteGradientError`` (in ``fit``:
  ``InvalidArgumentError`` with the same text), or with the compressor's ``nonfinite="skip"``
  every rank skips that update.
* Refits happen eagerly between batches: :class:`RefitCallback` calls the exchange's
  ``end_step`` (:func:`horovod_aq.tensorflow.refit`) after every batch. Without it adaptive levels
  are never refitted and telemetry stays empty.
* DQSGD and ErrorFeedback (``ECQ``) work as on the tape: :class:`RefitCallback` moves DQSGD
  to the next width between batches (no retrace); checkpoint the compressor with
  ``opt.exchange.state_dict()`` (collective with ErrorFeedback memory) /
  ``opt.exchange.load_state_dict(state)``.
* ``model.compile(jit_compile=...)`` must be False (the callbacks check it; "auto" turns XLA on
  with a GPU), and ``steps_per_execution`` must be 1 for :class:`RefitCallback` (one refit step
  per optimizer step).
"""

from __future__ import annotations

import logging
from typing import Any

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from horovod_aq.compressors import NoCompression
from horovod_aq.packed.cost import NetworkModel
from horovod_aq.packed.protocol import is_compression
from horovod_aq.telemetry import Telemetry
from horovod_aq.tensorflow.packed import DEFAULT_FUSION_BYTES, PackedExchange, exchange_for
from horovod_aq.tensorflow.step import refit

logger = logging.getLogger(__name__)

_CLASSES: dict[type, type] = {}


def _distributed_class(base: type) -> type:
    """``base`` with ``apply`` replaced by "packed average, then ``base.apply``" (cached)."""
    if base in _CLASSES:
        return _CLASSES[base]

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if not grads or (trainable_variables is None and not self.built):
            return base.apply(self, grads, trainable_variables)
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(self._trainable_variables))
        grads, skipped = self._aq_exchange.reduce_with_status(grads, variables)
        if self._aq_exchange.compression.nonfinite != "skip":
            return base.apply(self, grads, trainable_variables)
        if not self.built:  # build outside the cond below (variables cannot be made in a branch)
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True

        def update() -> tf.Tensor:
            base.apply(self, grads, trainable_variables)
            return tf.constant(True)

        # a rank's gradient was NaN/Inf: every rank got NaN there and skips the update alike
        tf.cond(skipped, lambda: tf.constant(False), update)

    def end_step(self) -> bool:
        """End the training step eagerly (refit when due, telemetry)."""
        return self._aq_exchange.end_step()

    attrs = {
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
        "apply": apply,
        "end_step": end_step,
        "compression": property(lambda self: self._aq_exchange.compression),
        "exchange": property(lambda self: self._aq_exchange),
        "telemetry": property(lambda self: self._aq_exchange.telemetry),
        "buckets": property(lambda self: self._aq_exchange.buckets),
    }
    cls = type(base.__name__, (base,), attrs)
    _CLASSES[base] = cls
    return cls


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    compression: Any = None,
    *,
    process_set: hvd.ProcessSet = hvd.global_process_set,
    exchange: str = "auto",
    fusion_bytes: int = DEFAULT_FUSION_BYTES,
    small_tensor_threshold: int = 0,
    network: NetworkModel | None = None,
    telemetry: Telemetry | None = None,
) -> keras.optimizers.Optimizer:
    """A copy of the Keras 3 ``optimizer`` (same class and config) that averages gradients over
    ``process_set`` with the packed quantized exchange before every update.

    Args are those of :func:`horovod_aq.tensorflow.DistributedGradientTape`. The returned object
    also has ``end_step()``, ``compression``, ``exchange``, ``telemetry`` and ``buckets``.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"horovod_aq.keras.DistributedOptimizer wraps a Keras 3 optimizer, got "
            f"{type(optimizer).__module__}.{type(optimizer).__name__}; for tf_keras (Keras 2, "
            "TF_USE_LEGACY_KERAS=1) use horovod.tensorflow.keras.DistributedOptimizer(opt, "
            "compression=...) (the stock fp16 path) with horovod_aq.tensorflow.refit")
    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"horovod_aq.keras needs the TensorFlow backend of Keras, not "
                         f"{keras.backend.backend()!r} (set KERAS_BACKEND=tensorflow)")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise NotImplementedError(
            "LossScaleOptimizer is not supported: its overflow check must see the gradients "
            "before the exchange; use float32 training or scale the loss manually")
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError("gradient_accumulation_steps is not supported: the exchange would run "
                         "on every micro-batch; accumulate before calling the optimizer instead")
    packed = exchange_for(compression if compression is not None else NoCompression(),
                          process_set=process_set, exchange=exchange, fusion_bytes=fusion_bytes,
                          small_tensor_threshold=small_tensor_threshold, network=network,
                          telemetry=telemetry)
    cls = _distributed_class(type(optimizer))
    distributed = cls.from_config(optimizer.get_config())
    distributed._aq_exchange = packed
    return distributed


# ---------------------------------------------------------------------- variables


def _read(variable: Any) -> tf.Tensor:
    """The current value of a Keras 3 or TensorFlow variable as a tensor."""
    if isinstance(variable, tf.Variable):
        return tf.convert_to_tensor(variable)
    return tf.convert_to_tensor(variable.value)


def _as_bytes(t: tf.Tensor) -> tf.Tensor:
    if t.dtype == tf.bool:
        t = tf.cast(t, tf.uint8)
    if t.dtype != tf.uint8:
        t = tf.bitcast(t, tf.uint8)
    return tf.reshape(t, [-1])


def _from_bytes(raw: tf.Tensor, dtype: tf.DType, shape: tf.TensorShape) -> tf.Tensor:
    if dtype == tf.bool:
        return tf.reshape(tf.cast(raw, tf.bool), shape)
    if dtype == tf.uint8:
        return tf.reshape(raw, shape)
    return tf.reshape(tf.bitcast(tf.reshape(raw, [-1, dtype.size]), dtype), shape)


def broadcast_variables(variables: list[Any], root_rank: int = 0, *,
                        process_set: hvd.ProcessSet = hvd.global_process_set,
                        name: str = "aq.bcast") -> None:
    """Overwrite ``variables`` (Keras 3 or ``tf.Variable``) with ``root_rank``'s values (eager).

    All values travel as one uint8 buffer (bit-cast), so every dtype works — also those Horovod's
    broadcast lacks (uint32 seed states, bfloat16) — in a single named collective. ``root_rank``
    is a global rank, as in Horovod.
    """
    if not tf.executing_eagerly():
        raise RuntimeError("broadcast_variables runs eagerly (outside tf.function)")
    if not process_set.included() or process_set.size() < 2 or not variables:
        return
    values = [_read(v) for v in variables]
    payload = tf.concat([_as_bytes(v) for v in values], axis=0)
    received = hvd.broadcast(payload, root_rank=root_rank, name=name, process_set=process_set)
    offset = 0
    for var, value in zip(variables, values):
        size = int(value.shape.num_elements()) * value.dtype.size
        var.assign(_from_bytes(received[offset:offset + size], value.dtype, value.shape))
        offset += size


def _check_model(model: Any, *, one_step: bool = False) -> None:
    if getattr(model, "jit_compile", False):
        raise ValueError("horovod_aq: compile the model with jit_compile=False; Horovod's "
                         "collectives have no XLA kernels (jit_compile='auto' enables XLA when "
                         "a GPU is present)")
    if one_step and getattr(model, "steps_per_execution", 1) != 1:
        raise ValueError("horovod_aq.keras.RefitCallback needs steps_per_execution=1: the refit "
                         "protocol must run after every optimizer step")


# ---------------------------------------------------------------------- callbacks


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from ``root_rank`` at the start of
    training, so every rank starts from the same weights (Keras 3 compatible: no ``.ref()``)."""

    def __init__(self, root_rank: int = 0, *,
                 process_set: hvd.ProcessSet = hvd.global_process_set) -> None:
        super().__init__()
        self.root_rank = int(root_rank)
        self.process_set = process_set
        self.broadcast_done = False

    def on_train_begin(self, logs=None) -> None:
        _check_model(self.model)
        if self.broadcast_done:
            return
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and getattr(optimizer, "built", False):
            variables += list(optimizer.variables)
        broadcast_variables(variables, self.root_rank, process_set=self.process_set)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the numeric epoch logs (loss, metrics) over the process set at each epoch end,
    so that later callbacks (checkpoints, early stopping) decide alike on every rank."""

    def __init__(self, *, process_set: hvd.ProcessSet = hvd.global_process_set) -> None:
        super().__init__()
        self.process_set = process_set

    def on_epoch_end(self, epoch, logs=None) -> None:
        if logs is None or not self.process_set.included() or self.process_set.size() < 2:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0
                      and isinstance(np.asarray(v).item(), (int, float)))
        if not keys:
            return
        values = tf.constant([float(logs[k]) for k in keys], dtype=tf.float64)
        averaged = hvd.allreduce(values, op=hvd.Average, name="aq.metrics",
                                 process_set=self.process_set).numpy()
        for k, v in zip(keys, averaged):
            logs[k] = float(v)


class RefitCallback(keras.callbacks.Callback):
    """End every training step of a horovod_aq compressor: refit adaptive levels when due
    (the shared refit protocol) and record telemetry; at each epoch end add ``aq_table_version``
    and ``aq_bits_per_coordinate`` to the logs.

    ``target`` is a :func:`DistributedOptimizer` (packed exchange) or a compressor used on
    Horovod's stock path (then pass its ``process_set`` if it is not the global one).
    """

    def __init__(self, target: Any, *, process_set: hvd.ProcessSet | None = None) -> None:
        super().__init__()
        exchange = getattr(target, "_aq_exchange", None)
        if isinstance(exchange, PackedExchange):
            self.compression = exchange.compression
            self.process_set = exchange.process_set
            self.telemetry: Telemetry | None = exchange.telemetry
        elif is_compression(target):
            self.compression = target
            self.process_set = process_set or hvd.global_process_set
            self.telemetry = None
        else:
            raise TypeError("RefitCallback takes a horovod_aq.keras.DistributedOptimizer or a "
                            f"horovod_aq compressor, got {type(target).__name__}")
        self.refits = 0

    def on_train_begin(self, logs=None) -> None:
        _check_model(self.model, one_step=True)

    def on_train_batch_end(self, batch, logs=None) -> None:
        self.refits += int(refit(self.compression, process_set=self.process_set))

    def on_epoch_end(self, epoch, logs=None) -> None:
        if logs is None:
            return
        if self.compression.quantizes:
            logs["aq_table_version"] = float(self.compression.table.version)
        last = self.telemetry.last if self.telemetry is not None else None
        if last is not None:
            logs["aq_bits_per_coordinate"] = float(last.bits_per_coordinate)
