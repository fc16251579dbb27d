"""What Horovod's tape and Keras optimizer do around the allreduce, on the packed exchange:
local gradient aggregation (``backward_passes_per_step``) and local sources (model parallelism).

:class:`LocalAggregation` keeps the micro-batch sums in variables, :class:`GradientReducer` wraps
a :class:`~horovod_aq.tensorflow.packed.PackedExchange` with both, :func:`aggregation_for` shares
one aggregation among the tapes built on an exchange.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from horovod_aq.tensorflow.sources import dense_gradient, source_name, static_shape
from horovod_aq.tensorflow.state import state_variable

if TYPE_CHECKING:
    from horovod_aq.tensorflow.packed import PackedExchange

__all__ = ["GradientReducer", "LocalAggregation", "aggregation_for", "scaled"]


class LocalAggregation:
    """Horovod's local gradient aggregation (``backward_passes_per_step``) in variables.

    :meth:`add` adds one micro-batch's dense gradients into float sums (one non-trainable
    variable per gradient, created eagerly on first use, per layout) and counts the call; the
    returned bool tensor is True at every ``passes``-th call — identical on every rank, which
    makes the same number of calls. :meth:`take`, placed in the branch that exchanges, reads the
    sums and resets them and the counter. The exchange — and so the compressor's step
    (docs/protocol.md §14) — runs only in that branch: steps count exchanges, not micro-batches.
    """

    def __init__(self, passes: int, name: str) -> None:
        if isinstance(passes, bool) or not isinstance(passes, (int, np.integer)) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {passes!r}")
        self.passes = int(passes)
        self.name = name
        self.counter = state_variable(np.int64(0), name=f"aq_agg_count_{name}")
        self._sums: dict[tuple, list[tf.Variable | None]] = {}

    def _variables(self, dense: list[Any]) -> list[tf.Variable | None]:
        key = tuple(None if g is None else (tuple(g.shape.as_list()), g.dtype.name)
                    for g in dense)
        found = self._sums.get(key)
        if found is None:
            found = [None if g is None else state_variable(
                np.zeros(g.shape.as_list(), dtype=g.dtype.as_numpy_dtype),
                name=f"aq_agg_{self.name}_{len(self._sums)}_{i}") for i, g in enumerate(dense)]
            self._sums[key] = found
        return found

    def add(self, dense: list[Any]) -> tuple[tf.Tensor, list[tf.Variable | None]]:
        """Add ``dense`` (static shapes; None skipped) to the sums; (ready, sums)."""
        sums = self._variables(dense)
        adds = [v.assign_add(g) for v, g in zip(sums, dense) if g is not None]
        with tf.control_dependencies(adds):
            count = self.counter.assign_add(1)
        return tf.equal(count, self.passes), sums

    def take(self, sums: list[tf.Variable | None]) -> list[tf.Tensor | None]:
        """The accumulated sums; the sums and the counter restart from zero (graph op)."""
        values = [None if v is None else v.read_value() for v in sums]
        read = [x for x in values if x is not None]
        with tf.control_dependencies(read):
            resets = [v.assign(tf.zeros_like(v)) for v in sums if v is not None]
            resets.append(self.counter.assign(0))
        with tf.control_dependencies(resets):
            return [None if x is None else tf.identity(x) for x in values]

    def pending(self) -> int:
        """Micro-batches accumulated since the last exchange (eager)."""
        return int(self.counter.numpy())


class GradientReducer:
    """What Horovod's tape and Keras optimizer do around the allreduce, on the packed exchange.

    * **Local sources** (:meth:`register_local`, Horovod's ``register_local_source`` /
      ``register_local_var``; model parallelism): their gradients are not exchanged; with
      ``scale_local_gradients`` (Horovod's default) they are divided by the set size.
    * **Local aggregation** (:meth:`aggregate`, ``backward_passes_per_step``): sums of N
      micro-batches are exchanged every N-th call, divided by N with
      ``average_aggregated_gradients``.

    Sources are matched by identity (Keras 3 variables have no ``ref()``).
    """

    def __init__(self, exchange: PackedExchange, *, scale_local_gradients: bool = True) -> None:
        self.exchange = exchange
        self.scale_local_gradients = bool(scale_local_gradients)
        self._local: dict[int, Any] = {}

    def register_local(self, source: Any) -> None:
        self._local[id(source)] = source

    def is_local(self, source: Any) -> bool:
        return id(source) in self._local

    @property
    def local_sources(self) -> list[Any]:
        return list(self._local.values())

    def reduce(self, grads: Sequence[Any], sources: Sequence[Any], *,
               nonfinite: str | None = None) -> tuple[list[Any], tf.Tensor]:
        """Average the gradients of non-local sources (:meth:`PackedExchange.reduce_with_status`)
        and scale the local ones; (gradients in ``sources`` order, skipped)."""
        grads, sources = list(grads), list(sources)
        shared = [i for i, s in enumerate(sources) if not self.is_local(s)]
        if len(shared) == len(sources):
            return self.exchange.reduce_with_status(grads, sources, nonfinite=nonfinite)
        reduced, skipped = self.exchange.reduce_with_status(
            [grads[i] for i in shared], [sources[i] for i in shared], nonfinite=nonfinite)
        out = list(grads)
        for i, g in zip(shared, reduced):
            out[i] = g
        if self.scale_local_gradients and self.exchange.included:
            size = float(self.exchange.process_set.size())
            for i, s in enumerate(sources):
                if self.is_local(s) and out[i] is not None:
                    out[i] = scaled(out[i], 1.0 / size)
        return out, skipped

    def aggregate(self, aggregation: LocalAggregation, grads: Sequence[Any],
                  sources: Sequence[Any], *, average: bool,
                  nonfinite: str | None = None) -> tuple[list[Any], tf.Tensor, tf.Tensor]:
        """Add one micro-batch; at every N-th call exchange the sums (÷N when ``average``).

        Returns (gradients, exchanged, skipped): on calls that do not exchange the gradients
        are zeros and ``exchanged`` is False (apply nothing then; Horovod's optimizers count the
        iteration only)."""
        sources = list(sources)
        dense = [None if g is None else dense_gradient(g, s) for g, s in zip(grads, sources)]
        for i, g in enumerate(dense):
            if g is not None:
                static_shape(g, source_name(sources[i], i))
        ready, sums = aggregation.add(dense)
        present = [i for i, g in enumerate(dense) if g is not None]

        def exchange() -> list[tf.Tensor]:
            values = aggregation.take(sums)
            reduced, skipped = self.reduce(values, sources, nonfinite=nonfinite)
            if average and aggregation.passes > 1:
                reduced = [None if g is None else scaled(g, 1.0 / aggregation.passes)
                           for g in reduced]
            return [tf.convert_to_tensor(reduced[i]) for i in present] + [skipped]

        def wait() -> list[tf.Tensor]:
            return [tf.zeros_like(dense[i]) for i in present] + [tf.constant(False)]

        outs = tf.cond(ready, exchange, wait)
        result: list[Any] = [None] * len(dense)
        for i, g in zip(present, outs[:-1]):
            result[i] = g
        return result, ready, outs[-1]


def scaled(g: Any, factor: float) -> Any:
    """``g · factor`` in ``g``'s dtype; an IndexedSlices stays one (its values scaled)."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * tf.cast(factor, g.values.dtype), g.indices,
                                g.dense_shape)
    return g * tf.cast(factor, g.dtype)


def aggregation_for(exchange: PackedExchange, passes: int) -> LocalAggregation:
    """The :class:`LocalAggregation` of ``passes`` shared by every tape built on ``exchange``
    (tapes are rebuilt every step or trace; the sums must outlive them)."""
    with exchange.lock:
        found = exchange.aggregations.get(passes)
        if found is None:
            found = exchange.aggregations[passes] = LocalAggregation(
                passes, f"{exchange.label}_tape{passes}")
    return found
