"""Gradient sources on the TensorFlow packed exchange: their rank-independent names and the
dense, statically shaped gradients the exchange buckets."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["dense_gradient", "source_name", "source_shape", "static_shape"]


def source_name(source: Any, position: int) -> str:
    """Rank-independent name of a gradient source: Keras 3 ``path``, else ``name``, + position."""
    base = getattr(source, "path", None)
    if not isinstance(base, str):
        try:
            base = source.name
        except (AttributeError, ValueError):  # eager tensors have no name
            base = None
    if not isinstance(base, str) or not base:
        base = "source"
    base = base.removesuffix(":0")
    return f"{position}:{base}"


def source_shape(source: Any) -> tf.TensorShape:
    """The static shape of a gradient source (Keras 3 variables: a tuple; ``tf.Variable``: a
    TensorShape); unknown when it has none."""
    shape = getattr(source, "shape", None)
    try:
        return tf.TensorShape(shape)
    except (TypeError, ValueError):
        return tf.TensorShape(None)


def dense_gradient(g: Any, source: Any = None) -> tf.Tensor:
    """``g`` as a dense tensor with the static shape of ``source`` where TensorFlow lost it.

    An ``Embedding``'s gradient is an IndexedSlices whose ``dense_shape`` is a tensor; once it
    crossed a ``tf.function`` boundary (Horovod's eager sub-graph, a Keras train function) that
    shape is unknown at trace time, and ``tf.convert_to_tensor`` gives [None, d]. Scattering the
    slices into the variable's static row count (what Horovod's ``sparse_as_dense`` does, with
    the shape kept) gives a tensor the packed exchange can bucket."""
    shape = source_shape(source)
    if isinstance(g, tf.IndexedSlices):
        if shape.is_fully_defined() and shape.rank:
            rows = tf.math.unsorted_segment_sum(g.values, g.indices, int(shape[0]))
            return tf.reshape(rows, shape)
        return tf.convert_to_tensor(g)
    g = tf.convert_to_tensor(g)
    if not g.shape.is_fully_defined() and shape.is_fully_defined() \
            and g.shape.is_compatible_with(shape):
        g = tf.ensure_shape(g, shape)
    return g


def static_shape(g: tf.Tensor, name: str) -> list[int]:
    """The static shape of ``g``; a ValueError naming the source when it has none."""
    if not g.shape.is_fully_defined():
        raise ValueError(f"the packed exchange needs gradients with static shapes; {name} has "
                         f"shape {g.shape}")
    return g.shape.as_list()
