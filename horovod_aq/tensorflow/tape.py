"""``horovod_aq.tensorflow.DistributedGradientTape``: a GradientTape averaging with packed codes.

Usage, eager or inside ``tf.function`` (Keras 3 variables and plain ``tf.Variable``s alike)::

    comp = horovod_aq.ALQ(bits=3)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = horovod_aq.tensorflow.DistributedGradientTape(tape, comp)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for x, y in dataset:
        train_step(x, y)        # the step ends inside: refit when due, telemetry

The tape is rebuilt at every trace, but the exchange it uses is cached on the compressor
(:func:`~horovod_aq.tensorflow.packed.exchange_for`), so layouts, handshakes, statistics slots
and telemetry persist across steps and traces. Each exchange ends its step itself
(docs/protocol.md §14), so no ``refit(comp)`` call is needed (an explicit one, or
``tape.end_step()``, finds the step ended). Refits change only variables: the traced step is not
retraced.

Every horovod_aq compressor works here, also :class:`~horovod_aq.DQSGD` (the width changes at
``refit`` through a variable the graph switches on: no retrace) and
:class:`~horovod_aq.ErrorFeedback` / ``ECQ`` (per-bucket memory variables updated in-graph);
checkpoint those with :func:`horovod_aq.tensorflow.checkpoint.state_dict` (local: this rank's
memory; every rank's after :func:`~horovod_aq.tensorflow.checkpoint.consolidate_state_dict` on
every rank) and :func:`~horovod_aq.tensorflow.checkpoint.load_state_dict`, or
``tape.exchange.state_dict()``.

Horovod's own tape keys sources by ``Variable.ref()``, which Keras 3 variables lack (horovod
#4290); this one names sources by their Keras ``path`` / ``name`` and position instead. The class
is built at run time like Horovod's (base = the wrapped tape's class, so ``isinstance`` holds),
sharing the recorded tape.

Differences from ``tf.GradientTape.gradient``: gradients come back averaged over the process set;
IndexedSlices (an ``Embedding``'s gradient) come back dense, with the variable's shape (Horovod's
``sparse_as_dense``; the argument is accepted, the packed exchange always densifies); None
gradients (sources the target does not depend on) stay None and are not exchanged — the graph
decides that identically on every rank, and the first-exchange handshake compares the layouts.

Horovod's model-parallel pattern works as there: ``tape.register_local_source(v)`` (or
:func:`PartialDistributedGradientTape` with ``local_layers=``) keeps ``v``'s gradient out of the
exchange, divided by the set size unless ``scale_local_gradients=False``;
``get_local_and_global_gradients`` splits the result.

Local gradient aggregation (``backward_passes_per_step=N``, an argument Horovod has on its
optimizers): every call adds this micro-batch's gradients to local sums; every N-th call
exchanges the sums (divided by N with ``average_aggregated_gradients=True``) and returns them.
The other calls return zeros and ``tape.exchanged`` is False there: apply with
``tape.apply_gradients(optimizer, zip(grads, variables))``, which updates on exchanging calls
only and otherwise counts the optimizer's iteration, as Horovod's aggregating optimizers do. The
compressor's step counts exchanges, not micro-batches.
"""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd
import tensorflow as tf

from horovod_aq import error_feedback_setting
from horovod_aq.compressors import FP16, Compressor, NoCompression
from horovod_aq.packed.cost import NetworkModel
from horovod_aq.packed.plan import DEFAULT_FUSION_BYTES
from horovod_aq.packed.protocol import check_average, check_compression
from horovod_aq.telemetry import Telemetry
from horovod_aq.tensorflow import compat
from horovod_aq.tensorflow.aggregation import GradientReducer, LocalAggregation, aggregation_for
from horovod_aq.tensorflow.packed import PackedExchange, exchange_for

compat.install()


class _DistributedGradientTape(tf.GradientTape):
    """Methods overlaid on the wrapped tape's class (see the module docstring)."""

    def __init__(self, tape: Any, exchange: PackedExchange, persistent: bool = False,
                 watch_accessed_variables: bool = True, *,
                 aggregation: LocalAggregation | None = None,
                 average_aggregated_gradients: bool = False,
                 scale_local_gradients: bool = True) -> None:
        super(self.__class__, self).__init__(persistent, watch_accessed_variables)
        self._tape = tape
        self._aq_exchange = exchange
        self._aq_reducer = GradientReducer(exchange, scale_local_gradients=scale_local_gradients)
        self._aq_aggregation = aggregation
        self._aq_average = bool(average_aggregated_gradients)
        self._aq_exchanged: Any = True
        self._aq_skipped: Any = False

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """``tf.GradientTape.gradient``, then the packed average over the process set (module
        docstring: local sources, ``backward_passes_per_step``)."""
        grads = super(self.__class__, self).gradient(
            target, sources, output_gradients=output_gradients,
            unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        if self._aq_aggregation is None:
            reduced, self._aq_skipped = self._aq_reducer.reduce(flat_grads, flat_sources)
            self._aq_exchanged = True
        else:
            reduced, self._aq_exchanged, self._aq_skipped = self._aq_reducer.aggregate(
                self._aq_aggregation, flat_grads, flat_sources, average=self._aq_average)
        return tf.nest.pack_sequence_as(grads, reduced)

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient on this rank (not exchanged; divided by the set size with
        ``scale_local_gradients``), as Horovod's ``register_local_source``."""
        self._aq_reducer.register_local(source)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None):
        """(local (source, gradient) pairs, exchanged pairs), as Horovod's tape."""
        flat = tf.nest.flatten(sources)
        grads = tf.nest.flatten(self.gradient(target, sources, output_gradients=output_gradients))
        local = [(s, g) for s, g in zip(flat, grads) if self._aq_reducer.is_local(s)]
        shared = [(s, g) for s, g in zip(flat, grads) if not self._aq_reducer.is_local(s)]
        return local, shared

    @property
    def exchanged(self) -> Any:
        """Whether the last ``gradient()`` exchanged (bool tensor with
        ``backward_passes_per_step > 1``; True otherwise)."""
        return self._aq_exchanged

    @property
    def skipped(self) -> Any:
        """Whether a rank sent non-finite markers in the last exchange (``nonfinite="skip"``)."""
        return self._aq_skipped

    def apply_gradients(self, optimizer: Any, grads_and_vars: Any) -> Any:
        """``optimizer.apply_gradients(grads_and_vars)`` on calls that exchanged; on the other
        micro-batches of ``backward_passes_per_step`` only ``optimizer.iterations`` advances
        (Horovod's semantics). Without aggregation this is a plain ``apply_gradients``."""
        pairs = list(grads_and_vars)
        if self._aq_aggregation is None:
            return optimizer.apply_gradients(pairs)
        if hasattr(optimizer, "built") and not optimizer.built:
            optimizer.build([v for _, v in pairs])   # variables cannot be made in a tf.cond
            optimizer.built = True

        def update() -> tf.Tensor:
            optimizer.apply_gradients(pairs)
            return tf.constant(True)

        def count() -> tf.Tensor:
            iterations = getattr(optimizer, "iterations", None)
            if iterations is not None:
                iterations.assign_add(1)
            return tf.constant(False)

        return tf.cond(self._aq_exchanged, update, count)

    def end_step(self) -> bool:
        """End the training step eagerly (refit when due, telemetry); see
        :func:`horovod_aq.tensorflow.refit`."""
        return self._aq_exchange.end_step()

    @property
    def compression(self) -> Any:
        return self._aq_exchange.compression

    @property
    def exchange(self) -> PackedExchange:
        return self._aq_exchange

    @property
    def telemetry(self) -> Telemetry:
        return self._aq_exchange.telemetry

    @property
    def buckets(self) -> list[tuple[str, int, str, list[str]]]:
        """(name, numel, exchange mode, source names) of every fused bucket."""
        return self._aq_exchange.buckets


_DEFAULT: list[NoCompression] = []


def _default_compression() -> NoCompression:
    """One shared NoCompression, so that tapes rebuilt every step reuse one exchange."""
    if not _DEFAULT:
        _DEFAULT.append(NoCompression())
    return _DEFAULT[0]


def DistributedGradientTape(
    gradtape: tf.GradientTape,
    compression: Any = None,
    *,
    process_set: hvd.ProcessSet = hvd.global_process_set,
    exchange: str = "auto",
    fusion_bytes: int = DEFAULT_FUSION_BYTES,
    small_tensor_threshold: int = 0,
    network: NetworkModel | None = None,
    telemetry: Telemetry | None = None,
    wire: str = "fixed",
    op: Any = hvd.Average,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    scale_local_gradients: bool = True,
    device_dense: str = "",
    device_sparse: str = "",
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    error_feedback: bool | str = "auto",
    stall_timeout_s: float | None = None,
) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` averages with the packed quantized exchange.

    Args:
        gradtape: the tape that recorded the forward pass.
        compression: a horovod_aq compressor, e.g. ``horovod_aq.ALQ(bits=3)`` (default: none);
            Horovod's ``hvd.Compression.none`` / ``.fp16`` and compressor classes are accepted
            (:func:`resolve_compression`).
        process_set: the Horovod process set to average over (all collectives use it).
        exchange: "auto" (cost model), "allgather" or "two_phase".
        fusion_bytes: cap of a fused bucket in bytes of fp32 gradient.
        small_tensor_threshold: sources with fewer elements are allreduced uncompressed.
        network: parameters of the exchange cost model.
        telemetry: where step records go (default: an in-memory :class:`Telemetry`).
        wire: "fixed" (fixed-width codes, one payload size per bucket) or "entropy" (the
            entropy-coded, variable-length payloads of docs/format.md §12: the same averages,
            fewer bytes; docs/protocol.md §5.4). "auto" is PyTorch-only for now.
        op: only ``hvd.Average`` (the packed exchange averages).
        sparse_as_dense: accepted for Horovod compatibility; IndexedSlices are always densified
            (to the source's static shape).
        backward_passes_per_step: exchange every N-th call (module docstring).
        average_aggregated_gradients: divide the N aggregated gradients by N.
        scale_local_gradients: divide the gradients of local sources by the set size.
        device_dense, device_sparse, gradient_predivide_factor, num_groups, groups: Horovod's;
            only their defaults are accepted (placement follows the gradients; buckets are
            fused by ``fusion_bytes``).
        error_feedback: "auto" (the default) wraps a quantizer of at most 3 bits per code in
            ``horovod_aq.ErrorFeedback`` (default coefficients; one INFO line), True any
            quantizer, False none; an ``ErrorFeedback`` given stays as it is. The wrapper is made
            once per compressor, so a tape rebuilt every step keeps one memory
            (:mod:`horovod_aq.error_feedback_setting`, docs/quantizers.md §5.9).
        stall_timeout_s: seconds one exchange may wait for the other ranks before this rank
            logs ``ExchangeStalledError`` naming the collectives and shuts Horovod down, so no
            rank hangs (default ``$HOROVOD_AQ_STALL_TIMEOUT_S``, else 300; 0: forever;
            :mod:`horovod_aq.tensorflow.stall`).
    """
    check_average(op, hvd.Average, "hvd.DistributedGradientTape")
    check_horovod_defaults("horovod_aq.tensorflow.DistributedGradientTape",
                           device_dense=device_dense, device_sparse=device_sparse,
                           gradient_predivide_factor=gradient_predivide_factor,
                           num_groups=num_groups, groups=groups)
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"gradtape must be a tf.GradientTape, got {type(gradtape).__name__}")
    packed = exchange_for(packed_compression(compression, error_feedback,
                                             "hvd.DistributedGradientTape"),
                          process_set=process_set,
                          exchange=exchange, fusion_bytes=fusion_bytes,
                          small_tensor_threshold=small_tensor_threshold, network=network,
                          telemetry=telemetry, wire=wire, stall_timeout_s=stall_timeout_s)
    aggregation = None
    if backward_passes_per_step != 1:
        aggregation = aggregation_for(packed, backward_passes_per_step)
    attrs = {k: v for k, v in _DistributedGradientTape.__dict__.items()
             if k not in ("__dict__", "__weakref__")}
    cls = type(gradtape.__class__.__name__, (gradtape.__class__,), attrs)
    return cls(gradtape._tape, packed, gradtape._persistent,
               getattr(gradtape, "_watch_accessed_variables", True), aggregation=aggregation,
               average_aggregated_gradients=average_aggregated_gradients,
               scale_local_gradients=scale_local_gradients)


def PartialDistributedGradientTape(
    gradtape: tf.GradientTape,
    compression: Any = None,
    *,
    local_layers: Any = None,
    **kwargs: Any,
) -> tf.GradientTape:
    """:func:`DistributedGradientTape` whose ``local_layers`` (a Keras layer or a list of them)
    keep their gradients local (Horovod's ``PartialDistributedGradientTape``): each trainable
    weight of those layers is a registered local source."""
    layers = _as_layers(local_layers)
    tape = DistributedGradientTape(gradtape, compression, **kwargs)
    for layer in layers:
        for variable in layer.trainable_weights:
            tape.register_local_source(variable)
    return tape


def _as_layers(local_layers: Any) -> list[Any]:
    """``local_layers`` as a list of layers (Keras 3 or tf_keras), refusing anything else."""
    if local_layers is None:
        return []
    items = [local_layers] if hasattr(local_layers, "trainable_weights") else list(local_layers)
    for layer in items:
        if not hasattr(layer, "trainable_weights"):
            raise ValueError(f"local_layers must be Keras layers, got {type(layer).__name__}")
    return items


def resolve_compression(compression: Any) -> Any:
    """Horovod's ``hvd.Compression.none`` / ``.fp16`` → ``NoCompression()`` / ``FP16()`` (one
    shared instance each, so tapes rebuilt every step reuse one exchange), a horovod_aq
    compressor class → its :meth:`~horovod_aq.Compressor.shared` instance (as on the stock
    path); None → the shared NoCompression; anything else as it is."""
    from horovod.tensorflow.compression import FP16Compressor, NoneCompressor

    def horovods(cls: type) -> bool:
        return (isinstance(compression, type) and issubclass(compression, cls)) or \
            isinstance(compression, cls)

    if compression is None or horovods(NoneCompressor):
        return _default_compression()
    if horovods(FP16Compressor):
        return FP16.shared()
    if isinstance(compression, type) and issubclass(compression, Compressor):
        return compression.shared()
    return compression


def packed_compression(compression: Any, error_feedback: Any, horovod_api: str,
                       optimizer: Any = None) -> Any:
    """The compressor a packed exchange uses: :func:`resolve_compression`, checked (
    ``horovod_api`` names Horovod's wrapper for ``hvd.Compression`` objects), then with error
    feedback as ``error_feedback`` says for ``optimizer`` (None: not known;
    :func:`horovod_aq.error_feedback_setting.resolve`)."""
    error_feedback_setting.check(error_feedback)
    compression = resolve_compression(compression)
    check_compression(compression, horovod_api)
    return error_feedback_setting.resolve(compression, error_feedback, optimizer)


def check_horovod_defaults(api: str, **given: Any) -> None:
    """Refuse Horovod arguments that the packed exchange does not implement, unless they have
    Horovod's default value (so Horovod scripts that pass the defaults keep working)."""
    defaults = {"device_dense": "", "device_sparse": "", "gradient_predivide_factor": 1.0,
                "num_groups": 0, "groups": None}
    for name, value in given.items():
        if value != defaults[name]:
            raise ValueError(
                f"{api}: {name}={value!r} is not supported (only Horovod's default "
                f"{defaults[name]!r}): the packed exchange places its work on the gradients' "
                "device, fuses buckets by fusion_bytes and averages")
