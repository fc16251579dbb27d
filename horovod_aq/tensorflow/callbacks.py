"""Keras 3 callbacks for distributed ``model.fit`` (the names ``horovod_aq.keras`` exports).

Horovod 0.28.1's Keras callbacks do not run under Keras 3: they call ``Variable.ref()``,
``optimizer.variables()`` and ``keras.backend.get_value``/``set_value``, none of which Keras 3
has. These are written for Keras 3 with Horovod's arguments and semantics:

* :class:`BroadcastGlobalVariablesCallback` — rank ``root_rank``'s model (and, once built,
  optimizer) variables everywhere at the start of training; ``local_variables`` /
  ``register_local_var`` keep model-parallel variables out of it.
* :class:`MetricAverageCallback` — epoch logs averaged over the ranks.
* :class:`LearningRateScheduleCallback` / :class:`LearningRateWarmupCallback` — Horovod's
  learning-rate schedule and gradual warmup ("Accurate, Large Minibatch SGD", Goyal et al.
  2017): the learning rate is ``initial_lr · multiplier(epoch)``, set with
  ``optimizer.learning_rate.assign`` (a variable the traced train function reads: no retrace).
  Momentum correction: when the rate changes from η to η', Horovod multiplies the momentum by
  η'/η for one batch; Keras 3 bakes ``momentum`` into the traced function as a constant, so
  here the momentum *buffers* are multiplied by η'/η instead, which gives the same update
  (``v ← m·(η'/η)·v − η'·g``) for SGD and RMSprop; other optimizers with a ``momentum``
  attribute get a warning and no correction.
* :class:`RefitCallback` — optional: adds the table version to the epoch logs.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from horovod_aq.packed.protocol import is_compression
from horovod_aq.telemetry import Telemetry
from horovod_aq.tensorflow.packed import PackedExchange
from horovod_aq.tensorflow.step import refit

logger = logging.getLogger(__name__)

__all__ = ["BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback", "RefitCallback",
           "broadcast_variables"]


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


def check_model(model: Any) -> None:
    if getattr(model, "jit_compile", False):
        raise ValueError("horovod_aq: compile the model with jit_compile=False; Horovod's "
                         "collectives have no XLA kernels (jit_compile='auto' enables XLA when "
                         "a GPU is present)")


def _inner(optimizer: Any) -> Any:
    """The optimizer that holds the hyperparameters (a LossScaleOptimizer's inner one)."""
    return getattr(optimizer, "inner_optimizer", optimizer)


# ---------------------------------------------------------------------- callbacks
class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from ``root_rank`` at the start of
    training, so every rank starts from the same weights (Keras 3 compatible: no ``.ref()``).

    ``local_variables`` (or :meth:`register_local_var`): model variables that stay as each rank
    has them (Horovod's model-parallel pattern). ``device`` is accepted for Horovod
    compatibility and ignored (the broadcast runs where the variables are)."""

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Any = None, *,
                 process_set: hvd.ProcessSet = hvd.global_process_set) -> None:
        super().__init__()
        self.root_rank = int(root_rank)
        self.device = device
        self.process_set = process_set
        self.broadcast_done = False
        self._local: dict[int, Any] = {}
        if local_variables is not None:
            items = (list(local_variables) if isinstance(local_variables, (list, tuple, set))
                     else [local_variables])
            for var in items:
                self.register_local_var(var)

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` out of the broadcast (it is worker-local)."""
        if not hasattr(var, "assign"):
            raise ValueError(f"local variables must be variables, got {type(var).__name__}")
        self._local[id(var)] = var

    def on_train_begin(self, logs=None) -> None:
        check_model(self.model)
        if self.broadcast_done:
            return
        variables = [v for v in self.model.variables if id(v) not in self._local]
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and getattr(optimizer, "built", False):
            variables += list(optimizer.variables)
        broadcast_variables(variables, self.root_rank, process_set=self.process_set)
        self.broadcast_done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the numeric epoch logs (loss, metrics) over the process set at each epoch end,
    so that later callbacks (checkpoints, early stopping) decide alike on every rank.
    ``device`` is accepted for Horovod compatibility and ignored."""

    def __init__(self, device: str = "", *,
                 process_set: hvd.ProcessSet = hvd.global_process_set) -> None:
        super().__init__()
        self.device = device
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


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Horovod's learning-rate schedule for Keras 3: the rate is ``initial_lr ·
    multiplier(epoch)`` from ``start_epoch`` until before ``end_epoch`` (None: to the end).

    ``multiplier`` is a function of the (fractional) epoch, or a number m for exponential decay
    ``m ** (epoch − start_epoch)``. With ``staircase`` the rate changes at the first batch of each
    epoch; otherwise at every batch, with the fractional epoch ``epoch + batch / steps_per_epoch``
    (``steps_per_epoch`` defaults to the ``steps`` Keras passes to ``fit``'s callbacks).
    ``momentum_correction``: see the module docstring. At each epoch end ``logs["lr"]`` holds the
    current rate.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch: int | None = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor ** (epoch - start_epoch)
        self._warned_momentum = False

    # -- the optimizer's rate and momentum
    def _rate_variable(self) -> Any:
        optimizer = self.model.optimizer
        rate = getattr(optimizer, "learning_rate", None)
        if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule) or \
                not hasattr(rate, "assign"):
            raise TypeError(
                f"{type(self).__name__} sets the optimizer's learning rate, but this optimizer's "
                f"learning_rate is {type(rate).__name__}; create the optimizer with a float "
                "learning_rate")
        return rate

    def _get_rate(self) -> float:
        return float(keras.ops.convert_to_numpy(self._rate_variable()))

    def _correct_momentum(self, ratio: float) -> None:
        optimizer = _inner(self.model.optimizer)
        momentum = getattr(optimizer, "momentum", None)
        if not isinstance(momentum, (int, float)) or momentum == 0:
            return
        if not getattr(optimizer, "built", False):
            return     # no buffers yet: they start at zero, nothing to correct
        buffers = getattr(optimizer, "momentums", None)
        if buffers is None:
            buffers = getattr(optimizer, "_momentums", None)
        if buffers is None:
            if not self._warned_momentum:
                self._warned_momentum = True
                warnings.warn(f"{type(self).__name__}: momentum correction is not applied to "
                              f"{type(optimizer).__name__} (its momentum buffers are unknown); "
                              "pass momentum_correction=False to silence this", stacklevel=2)
            return
        for buffer in buffers:
            buffer.assign(buffer * ratio)

    def _adjust_learning_rate(self, epoch: float) -> None:
        rate = self._rate_variable()
        old = self._get_rate()
        new = self.initial_lr * self.multiplier(epoch)
        rate.assign(new)
        if self.momentum_correction and old > 0 and new != old:
            self._correct_momentum(new / old)

    # -- Keras hooks
    def _autodetect_steps_per_epoch(self) -> int:
        params = self.params or {}
        if params.get("steps"):
            return int(params["steps"])
        if params.get("samples") and params.get("batch_size"):
            return int(params["samples"]) // int(params["batch_size"])
        raise ValueError("Could not autodetect the number of steps per epoch. Please specify the "
                         f"steps_per_epoch parameter to the {type(self).__name__}() (fit got no "
                         "steps_per_epoch and its data has no known length)")

    def on_train_begin(self, logs=None) -> None:
        self._rate_variable()
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch, logs=None) -> None:
        epoch = self.current_epoch if self.current_epoch is not None else 0
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust_learning_rate(epoch)
        elif not self.staircase:
            self._adjust_learning_rate(epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None) -> None:
        if logs is not None:
            logs["lr"] = self._get_rate()


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's gradual learning-rate warmup for Keras 3: over the first ``warmup_epochs`` the
    rate rises, at every batch, from ``initial_lr / size`` to ``initial_lr`` (``initial_lr`` is
    the rate scaled for the ranks, e.g. ``0.001 * hvd.size()``), then stays. With ``verbose`` rank
    0 logs (INFO, logger ``horovod_aq.tensorflow.callbacks``) when the warmup ends."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0, *,
                 process_set: hvd.ProcessSet = hvd.global_process_set) -> None:
        self.process_set = process_set

        def multiplier(epoch: float) -> float:
            size = self.process_set.size()
            # the epoch at the end of the batch, so that epochs end on round numbers
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and hvd.rank() == 0:
            logger.info("Epoch %d: finished gradual learning rate warmup to %g.", epoch + 1,
                        self._get_rate())


class RefitCallback(keras.callbacks.Callback):
    """Optional: report refits in the logs. At each epoch end it adds ``aq_table_version`` and
    ``aq_bits_per_coordinate`` to the logs.

    Steps end, and adaptive levels are refitted, by themselves inside the train function
    (docs/protocol.md §14); after every batch this callback's ``refit`` call finds the step already
    ended and changes nothing, so old scripts that pass it keep working (``refits`` counts the
    batches whose step refitted).

    ``target`` is a :func:`~horovod_aq.tensorflow.keras.DistributedOptimizer` (packed exchange)
    or a compressor used on Horovod's stock path (then pass its ``process_set`` if it is not the
    global one).
    """

    def __init__(self, target: Any, *, process_set: hvd.ProcessSet | None = None) -> None:
        super().__init__()
        exchange = getattr(_inner(target), "_aq_exchange", None)
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
        check_model(self.model)

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
