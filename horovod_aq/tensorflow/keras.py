"""Keras 3 integration: a packed-exchange ``DistributedOptimizer`` and the callbacks ``fit`` needs.

Horovod 0.28.1's Keras optimizer reduces gradients in Keras-2 hooks that Keras 3's trainer never
calls (``train_step`` → ``optimizer.apply_gradients`` → ``apply``), and its callbacks use
``Variable.ref()``, which Keras 3 variables lack. Here::

    comp = horovod_aq.ALQ(bits=3)
    opt = horovod_aq.keras.DistributedOptimizer(keras.optimizers.SGD(0.05), comp)
    model.compile(optimizer=opt, loss=..., jit_compile=False)   # Horovod ops have no XLA kernels
    model.fit(x, y, callbacks=[
        horovod_aq.keras.BroadcastGlobalVariablesCallback(0),  # same initial weights everywhere
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
* Steps end inside the train function (docs/protocol.md §14): after the exchange's last
  collective a ``tf.py_function`` runs the refit protocol when due and records telemetry, with
  no callback and also with ``steps_per_execution > 1``. :class:`RefitCallback` is optional
  (it adds the table version to the epoch logs).
* DQSGD and ErrorFeedback (``ECQ``) work as on the tape: DQSGD moves to the next width at the
  end of each step (a variable the graph switches on: no retrace); checkpoint the compressor with
  ``opt.exchange.state_dict()`` (local: this rank's ErrorFeedback memory; every rank's after
  ``opt.exchange.consolidate_state_dict()`` on every rank) /
  ``opt.exchange.load_state_dict(state)``.
* ``model.compile(jit_compile=...)`` must be False (the callbacks check it; "auto" turns XLA on
  with a GPU).
* Horovod's Keras arguments: ``backward_passes_per_step=N`` accumulates N local gradients and
  exchanges and applies every N-th call (``optimizer.iterations`` counts every call; the
  compressor's step counts exchanges), ``average_aggregated_gradients`` divides the sum by N;
  ``register_local_var`` / :func:`PartialDistributedOptimizer` keep model-parallel variables
  local; ``sparse_as_dense`` is implied (an ``Embedding``'s IndexedSlices are densified to the
  variable's shape).
* Mixed precision (``keras.mixed_precision.set_global_policy("mixed_float16")``): ``compile``
  wraps the optimizer in a ``LossScaleOptimizer``; its overflow decision is made on the averaged
  gradients, so every rank skips alike and keeps one loss scale
  (:mod:`horovod_aq.tensorflow.compat`).
* Copies: ``opt.__class__.from_config(opt.get_config())`` is a distributed optimizer on the same
  compressor and settings (the class carries them); ``get_config()`` is the wrapped optimizer's,
  so a saved model loads without horovod_aq as the plain optimizer, and with
  :func:`load_model` as a distributed one.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from horovod_aq.compressors import NoCompression
from horovod_aq.packed import plan as names
from horovod_aq.packed.cost import NetworkModel
from horovod_aq.packed.plan import DEFAULT_FUSION_BYTES
from horovod_aq.packed.protocol import check_average
from horovod_aq.telemetry import Telemetry
from horovod_aq.tensorflow import compat
from horovod_aq.tensorflow.aggregation import GradientReducer, LocalAggregation
from horovod_aq.tensorflow.callbacks import (
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
    RefitCallback,
    broadcast_variables,
)
from horovod_aq.tensorflow.packed import PackedExchange, exchange_for
from horovod_aq.tensorflow.sources import dense_gradient, source_name
from horovod_aq.tensorflow.tape import _as_layers, check_horovod_defaults, packed_compression

compat.install()
logger = logging.getLogger(__name__)

__all__ = ["BroadcastGlobalVariablesCallback", "DistributedOptimizer",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "MetricAverageCallback",
           "PartialDistributedOptimizer", "RefitCallback", "broadcast_variables", "load_model"]


@dataclasses.dataclass(eq=False)
class _Settings:
    """What a distributed optimizer class carries: every instance (also a ``from_config`` copy)
    averages with this exchange and these Horovod options."""

    exchange: PackedExchange
    backward_passes_per_step: int = 1
    average_aggregated_gradients: bool = False
    scale_local_gradients: bool = True
    local: tuple = ()                 # variables registered at construction (local_layers)


_instances = iter(range(1 << 62))


def _distributed_class(base: type, settings: _Settings) -> type:
    """``base`` with ``apply`` replaced by "packed average, then ``base.apply``", carrying
    ``settings`` (one class per :func:`DistributedOptimizer` call, as Horovod does)."""

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        self._aq_setup()

    def _aq_setup(self) -> None:
        s = self._aq_settings
        self._aq_exchange = s.exchange
        self._aq_reducer = GradientReducer(s.exchange,
                                           scale_local_gradients=s.scale_local_gradients)
        for var in s.local:
            self._aq_reducer.register_local(var)
        self._aq_aggregation = None
        if s.backward_passes_per_step > 1:
            self._aq_aggregation = LocalAggregation(
                s.backward_passes_per_step,
                f"{s.exchange.label}_opt{next(_instances)}")
        self._aq_prereduced = False

    def _aq_build(self, variables: list) -> None:
        if not self.built:  # variables cannot be created inside the tf.cond branches below
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True

    def _aq_update(self, grads: list, skipped: Any, trainable_variables: Any) -> None:
        """``base.apply`` of averaged gradients; with nonfinite="skip" not where a rank sent
        non-finite markers (every rank got NaN there and skips alike)."""
        if self._aq_exchange.compression.nonfinite != "skip":
            base.apply(self, grads, trainable_variables)
            return

        def update() -> tf.Tensor:
            base.apply(self, grads, trainable_variables)
            return tf.constant(True)

        tf.cond(skipped, lambda: tf.constant(False), update)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if self._aq_prereduced or not grads or (trainable_variables is None and not self.built):
            return base.apply(self, grads, trainable_variables)
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(self._trainable_variables))
        reducer, aggregation = self._aq_reducer, self._aq_aggregation
        if aggregation is None:
            reduced, skipped = reducer.reduce(grads, variables)
            if self._aq_exchange.compression.nonfinite == "skip":
                self._aq_build(variables)
            self._aq_update(reduced, skipped, trainable_variables)
            return None
        self._aq_build(variables)
        dense = [None if g is None else dense_gradient(g, v) for g, v in zip(grads, variables)]
        ready, sums = aggregation.add(dense)
        average = self._aq_settings.average_aggregated_gradients

        def exchange_and_apply() -> tf.Tensor:
            reduced, skipped = reducer.reduce(aggregation.take(sums), variables)
            if average:
                reduced = [None if g is None else g / tf.cast(aggregation.passes, g.dtype)
                           for g in reduced]
            self._aq_update(reduced, skipped, trainable_variables)
            return tf.constant(True)

        def count_only() -> tf.Tensor:
            self.iterations.assign_add(1)   # Horovod: every call counts an iteration
            return tf.constant(False)

        tf.cond(ready, exchange_and_apply, count_only)
        return None

    def _aq_loss_scale_apply(self, lso, grads, trainable_variables=None):
        """``LossScaleOptimizer.apply`` when this optimizer is its inner one (compat hook): the
        exchange first (non-finite markers, never raising), then Keras' loss-scale logic on the
        averaged gradients — identical on every rank, so all skip or update together."""
        if self._aq_aggregation is not None:
            raise ValueError(
                "horovod_aq: a LossScaleOptimizer (mixed_float16) around a DistributedOptimizer "
                "with backward_passes_per_step > 1 is not supported: the loss scale would change "
                "between the micro-batches of one exchange; use backward_passes_per_step=1")
        grads = list(grads)
        if not lso.built:
            with keras.name_scope(lso.name, caller=lso):
                lso.build(trainable_variables)
            lso.built = True
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(lso._trainable_variables))
        reduced, _ = self._aq_reducer.reduce(grads, variables, nonfinite="skip")
        finite = lso.check_finite(reduced)
        local = [(i, g) for i, (g, v) in enumerate(zip(reduced, variables))
                 if g is not None and self._aq_reducer.is_local(v)]
        if local and self._aq_exchange.active:   # local gradients differ: agree on them too
            ok = tf.cast(lso.check_finite([g for _, g in local]), tf.int32)
            # named by content (the local variables), like every collective (docs/protocol.md §6)
            key = names.exchange_key(self._aq_exchange.compression.name, [
                (source_name(variables[i], i), g.shape.num_elements()) for i, g in local])
            ok = hvd.allreduce(ok, op=hvd.Min, name=names.allreduce_name(key, "lso_finite"),
                               ignore_name_scope=True,
                               process_set=self._aq_exchange.process_set)
            finite = tf.logical_and(finite, ok > 0)

        def update() -> tf.Tensor:
            self._aq_prereduced = True   # inner.apply below: already averaged
            try:
                lso._stateful_handle_finite_grads(reduced, trainable_variables)
            finally:
                self._aq_prereduced = False
            return tf.constant(True)

        def skip() -> tf.Tensor:
            lso._stateful_handle_non_finite_grads()
            return tf.constant(False)

        tf.cond(finite, update, skip)

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient local (not exchanged; divided by the set size with
        ``scale_local_gradients``), as Horovod's ``register_local_var``."""
        self._aq_reducer.register_local(var)

    def end_step(self) -> bool:
        """End the training step eagerly (refit when due, telemetry)."""
        return self._aq_exchange.end_step()

    attrs = {
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
        "__init__": __init__,
        "_aq_settings": settings,
        "_aq_setup": _aq_setup,
        "_aq_build": _aq_build,
        "_aq_update": _aq_update,
        "_aq_loss_scale_apply": _aq_loss_scale_apply,
        "apply": apply,
        "register_local_var": register_local_var,
        "end_step": end_step,
        "compression": property(lambda self: self._aq_exchange.compression),
        "exchange": property(lambda self: self._aq_exchange),
        "telemetry": property(lambda self: self._aq_exchange.telemetry),
        "buckets": property(lambda self: self._aq_exchange.buckets),
        "backward_passes_per_step": property(
            lambda self: self._aq_settings.backward_passes_per_step),
        "aggregation_counter": property(
            lambda self: (None if self._aq_aggregation is None
                          else self._aq_aggregation.counter)),
    }
    return type(base.__name__, (base,), attrs)


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"horovod_aq.keras.DistributedOptimizer wraps a Keras 3 optimizer, got "
            f"{type(optimizer).__module__}.{type(optimizer).__name__}; for tf_keras (Keras 2, "
            "TF_USE_LEGACY_KERAS=1) use horovod.tensorflow.keras.DistributedOptimizer(opt, "
            "compression=...) (the stock fp16 path)")
    if keras.backend.backend() != "tensorflow":
        raise ValueError(f"horovod_aq.keras needs the TensorFlow backend of Keras, not "
                         f"{keras.backend.backend()!r} (set KERAS_BACKEND=tensorflow)")
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError("gradient_accumulation_steps is not supported: the exchange would run "
                         "on every micro-batch; pass backward_passes_per_step=N to "
                         "horovod_aq.keras.DistributedOptimizer instead")
    if hasattr(optimizer, "_aq_settings"):
        raise ValueError("this optimizer is already a horovod_aq DistributedOptimizer")


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    compression: Any = None,
    *,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = hvd.Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: hvd.ProcessSet = hvd.global_process_set,
    scale_local_gradients: bool = True,
    exchange: str = "auto",
    fusion_bytes: int = DEFAULT_FUSION_BYTES,
    small_tensor_threshold: int = 0,
    network: NetworkModel | None = None,
    telemetry: Telemetry | None = None,
    local_layers: Any = None,
    wire: str = "fixed",
    error_feedback: bool | str = "auto",
    stall_timeout_s: float | None = None,
) -> keras.optimizers.Optimizer:
    """A copy of the Keras 3 ``optimizer`` (same class and config) that averages gradients over
    ``process_set`` with the packed quantized exchange before every update.

    The exchange arguments (``exchange``, ``fusion_bytes``, ``small_tensor_threshold``,
    ``network``, ``telemetry``, ``wire`` — "fixed" or "entropy", the entropy-coded
    variable-length payloads —, ``stall_timeout_s``) are those of
    :func:`horovod_aq.tensorflow.DistributedGradientTape`.
    Horovod's arguments keep their meaning: ``backward_passes_per_step``,
    ``average_aggregated_gradients``, ``scale_local_gradients``, ``process_set``, ``op``
    (``hvd.Average`` only); ``sparse_as_dense`` is accepted and implied; ``name`` renames the
    copy; ``device_dense``, ``device_sparse``, ``gradient_predivide_factor``, ``num_groups`` and
    ``groups`` accept only Horovod's defaults. A ``LossScaleOptimizer`` is rebuilt around a
    distributed copy of its inner optimizer. ``error_feedback``: "auto" (the default) wraps a
    quantizer of at most 3 bits per code in ``horovod_aq.ErrorFeedback`` unless ``optimizer`` is
    adaptive (Adam, AdamW, RMSprop, ...: docs/quantizers.md §5.11), True any quantizer, False
    none (docs/quantizers.md §5.9); ``compression`` is the compressor used.

    The returned object also has ``register_local_var``, ``end_step()``, ``compression``,
    ``exchange``, ``telemetry`` and ``buckets``.
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        inner = DistributedOptimizer(
            optimizer.inner_optimizer, compression, device_dense=device_dense,
            device_sparse=device_sparse, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
            groups=groups, process_set=process_set,
            scale_local_gradients=scale_local_gradients, exchange=exchange,
            fusion_bytes=fusion_bytes, small_tensor_threshold=small_tensor_threshold,
            network=network, telemetry=telemetry, local_layers=local_layers, wire=wire,
            error_feedback=error_feedback, stall_timeout_s=stall_timeout_s)
        return keras.optimizers.LossScaleOptimizer(
            inner, initial_scale=optimizer.initial_scale,
            dynamic_growth_steps=optimizer.dynamic_growth_steps,
            name=name or optimizer.name)
    _check_optimizer(optimizer)
    settings = _settings(compression, op=op, device_dense=device_dense,
                         device_sparse=device_sparse,
                         gradient_predivide_factor=gradient_predivide_factor,
                         backward_passes_per_step=backward_passes_per_step,
                         average_aggregated_gradients=average_aggregated_gradients,
                         num_groups=num_groups, groups=groups, process_set=process_set,
                         scale_local_gradients=scale_local_gradients, exchange=exchange,
                         fusion_bytes=fusion_bytes, small_tensor_threshold=small_tensor_threshold,
                         network=network, telemetry=telemetry, local_layers=local_layers,
                         wire=wire, error_feedback=error_feedback,
                         stall_timeout_s=stall_timeout_s, optimizer=optimizer)
    cls = _distributed_class(type(optimizer), settings)
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    return cls.from_config(config)


def _settings(compression: Any, *, op: Any = hvd.Average, device_dense: str = "",
              device_sparse: str = "", sparse_as_dense: bool = False,
              gradient_predivide_factor: float = 1.0, backward_passes_per_step: int = 1,
              average_aggregated_gradients: bool = False, num_groups: int = 0,
              groups: Any = None, process_set: hvd.ProcessSet = hvd.global_process_set,
              scale_local_gradients: bool = True, exchange: str = "auto",
              fusion_bytes: int = DEFAULT_FUSION_BYTES, small_tensor_threshold: int = 0,
              network: NetworkModel | None = None, telemetry: Telemetry | None = None,
              local_layers: Any = None, wire: str = "fixed",
              error_feedback: bool | str = "auto",
              stall_timeout_s: float | None = None, optimizer: Any = None) -> _Settings:
    """Validate :func:`DistributedOptimizer`'s arguments into the settings its class carries."""
    check_average(op, hvd.Average, "horovod.tensorflow.keras.DistributedOptimizer")
    check_horovod_defaults("horovod_aq.keras.DistributedOptimizer", device_dense=device_dense,
                           device_sparse=device_sparse,
                           gradient_predivide_factor=gradient_predivide_factor,
                           num_groups=num_groups, groups=groups)
    if isinstance(backward_passes_per_step, bool) or int(backward_passes_per_step) < 1:
        raise ValueError("backward_passes_per_step must be an integer >= 1, got "
                         f"{backward_passes_per_step!r}")
    compression = NoCompression() if compression is None else compression
    compression = packed_compression(compression, error_feedback,
                                     "horovod.tensorflow.keras.DistributedOptimizer", optimizer)
    packed = exchange_for(compression, process_set=process_set, exchange=exchange,
                          fusion_bytes=fusion_bytes,
                          small_tensor_threshold=small_tensor_threshold, network=network,
                          telemetry=telemetry, wire=wire, stall_timeout_s=stall_timeout_s)
    local = tuple(v for layer in _as_layers(local_layers) for v in layer.trainable_weights)
    return _Settings(packed, int(backward_passes_per_step), bool(average_aggregated_gradients),
                     bool(scale_local_gradients), local)


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer, compression: Any = None,
                                *, local_layers: Any = None,
                                **kwargs: Any) -> keras.optimizers.Optimizer:
    """:func:`DistributedOptimizer` whose ``local_layers`` (a Keras layer or a list of them) keep
    their gradients local (Horovod's ``horovod.keras.PartialDistributedOptimizer``): each
    trainable weight of those layers is a registered local variable."""
    return DistributedOptimizer(optimizer, compression, local_layers=local_layers, **kwargs)


def _optimizer_classes() -> list[type]:
    """Keras 3's optimizer classes (every subclass of ``keras.optimizers.Optimizer``)."""
    found, todo = [], [keras.optimizers.Optimizer]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found and not hasattr(sub, "_aq_settings"):
                found.append(sub)
                todo.append(sub)
    return [c for c in found if c is not keras.optimizers.LossScaleOptimizer]


def load_model(filepath: Any, compression: Any = None, *, custom_optimizers: Any = None,
               custom_objects: dict | None = None, compile: bool = True, safe_mode: bool = True,
               **kwargs: Any) -> keras.Model:
    """``keras.models.load_model`` whose optimizer comes back as a :func:`DistributedOptimizer`
    on ``compression`` (Horovod's ``hvd.load_model``); ``kwargs`` are DistributedOptimizer's.

    A saved optimizer is stored under its own class name (a distributed optimizer saves the
    wrapped optimizer's config), so ``keras.models.load_model`` alone gives the plain optimizer
    back; here every Keras optimizer class name (and ``custom_optimizers``) maps to a
    distributed class while loading, with the saved variables restored into it."""
    settings = _settings(compression, **kwargs)
    objects: dict[str, Any] = {cls.__name__: _distributed_class(cls, settings)
                               for cls in _optimizer_classes() + list(custom_optimizers or [])}
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects, compile=compile,
                                   safe_mode=safe_mode)
