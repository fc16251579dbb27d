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
        train_step(x, y)
        horovod_aq.tensorflow.refit(comp)   # eager: refit when due, telemetry

The tape is rebuilt at every trace, but the exchange it uses is cached on the compressor
(:func:`~horovod_aq.tensorflow.packed.exchange_for`), so layouts, handshakes, statistics slots
and telemetry persist across steps and traces. ``refit(comp)`` must be called once per step,
eagerly, on every rank (``tape.end_step()`` does the same when the tape object is at hand, i.e.
in eager loops). Refits change only variables: the traced step is not retraced.

Every horovod_aq compressor works here, also :class:`~horovod_aq.DQSGD` (the width changes at
``refit`` through a variable the graph switches on: no retrace) and
:class:`~horovod_aq.ErrorFeedback` / ``ECQ`` (per-bucket memory variables updated in-graph);
checkpoint those with :func:`horovod_aq.tensorflow.checkpoint.state_dict` (collective: every
rank's memory) and :func:`~horovod_aq.tensorflow.checkpoint.load_state_dict`, or
``tape.exchange.state_dict()``.

Horovod's own tape keys sources by ``Variable.ref()``, which Keras 3 variables lack (horovod
#4290); this one names sources by their Keras ``path`` / ``name`` and position instead. The class
is built at run time like Horovod's (base = the wrapped tape's class, so ``isinstance`` holds),
sharing the recorded tape.

Differences from ``tf.GradientTape.gradient``: gradients come back averaged over the process set;
IndexedSlices come back dense; None gradients (sources the target does not depend on) stay None
and are not exchanged — the graph decides that identically on every rank, and the first-exchange
handshake compares the layouts.
"""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd
import tensorflow as tf

from horovod_aq.compressors import NoCompression
from horovod_aq.packed.cost import NetworkModel
from horovod_aq.packed.protocol import check_average
from horovod_aq.telemetry import Telemetry
from horovod_aq.tensorflow.packed import DEFAULT_FUSION_BYTES, PackedExchange, exchange_for


class _DistributedGradientTape(tf.GradientTape):
    """Methods overlaid on the wrapped tape's class (see the module docstring)."""

    def __init__(self, tape: Any, exchange: PackedExchange, persistent: bool = False,
                 watch_accessed_variables: bool = True) -> None:
        super(self.__class__, self).__init__(persistent, watch_accessed_variables)
        self._tape = tape
        self._aq_exchange = exchange

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        """``tf.GradientTape.gradient``, then the packed average over the process set."""
        grads = super(self.__class__, self).gradient(
            target, sources, output_gradients=output_gradients,
            unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        reduced = self._aq_exchange.reduce(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(grads, reduced)

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
    op: Any = hvd.Average,
) -> tf.GradientTape:
    """Wrap ``gradtape`` so that ``gradient()`` averages with the packed quantized exchange.

    Args:
        gradtape: the tape that recorded the forward pass.
        compression: a horovod_aq compressor, e.g. ``horovod_aq.ALQ(bits=3)`` (default: none).
        process_set: the Horovod process set to average over (all collectives use it).
        exchange: "auto" (cost model), "allgather" or "two_phase".
        fusion_bytes: cap of a fused bucket in bytes of fp32 gradient.
        small_tensor_threshold: sources with fewer elements are allreduced uncompressed.
        network: parameters of the exchange cost model.
        telemetry: where step records go (default: an in-memory :class:`Telemetry`).
        op: only ``hvd.Average`` (the packed exchange averages).
    """
    check_average(op, hvd.Average, "hvd.DistributedGradientTape")
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"gradtape must be a tf.GradientTape, got {type(gradtape).__name__}")
    packed = exchange_for(compression if compression is not None else _default_compression(),
                          process_set=process_set, exchange=exchange, fusion_bytes=fusion_bytes,
                          small_tensor_threshold=small_tensor_threshold, network=network,
                          telemetry=telemetry)
    attrs = {k: v for k, v in _DistributedGradientTape.__dict__.items()
             if k not in ("__dict__", "__weakref__")}
    cls = type(gradtape.__class__.__name__, (gradtape.__class__,), attrs)
    return cls(gradtape._tape, packed, gradtape._persistent,
               getattr(gradtape, "_watch_accessed_variables", True))
