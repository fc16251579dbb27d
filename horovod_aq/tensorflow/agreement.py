"""The TensorFlow exchange's per-step agreement on what trains (docs/protocol.md §3.1).

Every exchange of the tape and the Keras optimizer starts with it, in the traced step: one
allreduce of the sums of ``packed.trainable.agreement_terms`` (named ``aq.trainable.<key>``),
decided on the host by ``packed.trainable.agreement_sums`` — the same verdict on every rank,
since every rank holds the same sums:

1. rows agree, every rank present: the exchange goes on;
2. a rank called ``hvd.join()`` (it added zeros): ``JoinedRankError`` at once on the ranks still
   training (``packed.trainable.refuse_joined``: this exchange needs every rank's payload);
3. rows differ: every rank allgathers the rows (``aq.trainable.<key>.rows``, in the branch all
   ranks take) and ``packed.trainable.check_agreement`` raises the same
   ``ConfigMismatchError`` on every rank, one line per rank.

Before a new layout's handshake the same collectives run eagerly at trace time
(:meth:`Agreement.now`), so that a rank that re-planned alone meets there the graph agreement of
a rank that did not. TensorFlow wraps the host errors in ``InvalidArgumentError``;
``checks.translate_error`` unwraps them on the eager paths.

The graph reads the terms and the row from variables, never from constants: Horovod's
TensorFlow collectives are not stateful ops, so Grappler's constant folding would run a
collective of constant inputs once, while it optimizes the graph, and give its result at every
step after (measured: an allreduce of a constant kept returning the sum of both ranks after one
of them had joined).
"""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_aq.packed.trainable import (
    agreement_sums,
    agreement_terms,
    check_agreement,
    refuse_joined,
)
from horovod_aq.tensorflow.state import state_variable


class Agreement:
    """The collectives and decisions of one exchange's agreement, named ``name`` (set by the
    first layout the exchange plans: no later layout renames it)."""

    def __init__(self, process_set: hvd.ProcessSet, ranks: int) -> None:
        self.process_set, self.ranks = process_set, ranks
        self.name: str | None = None
        self._eager: dict[str, Any] = {}
        #: row → the variables the graph reads its terms and row from
        self._variables: dict[tuple[int, ...], tuple[tf.Variable, tf.Variable]] = {}

    # ------------------------------------------------------------------ the collectives
    def _sum(self, terms: tf.Tensor) -> tf.Tensor:
        return hvd.allreduce(terms, op=hvd.Sum, name=self.name, ignore_name_scope=True,
                             process_set=self.process_set)

    def _rows(self, row: tf.Tensor) -> tf.Tensor:
        return hvd.allgather(row, name=f"{self.name}.rows", ignore_name_scope=True,
                             process_set=self.process_set)

    # ------------------------------------------------------------------ the decisions
    def _verdict(self, sums: np.ndarray) -> np.bool_:
        """Steps 1-2 on the host: whether the rows agree."""
        active, agree = agreement_sums(sums)
        refuse_joined(active, self.ranks, str(self.name))
        return np.bool_(agree)

    @staticmethod
    def _refuse(rows: np.ndarray) -> np.bool_:
        """Step 3 on the host."""
        check_agreement(rows, "tensorflow")
        return np.bool_(True)   # rows that differ in the sums differ here: never reached

    # ------------------------------------------------------------------ where it runs
    def in_graph(self, row: np.ndarray) -> tf.Tensor:
        """The agreement of ``row`` (``packed.trainable.agreement_row``) in the traced step; a
        bool tensor every collective of the exchange waits for."""
        key = tuple(int(v) for v in row)
        if key not in self._variables:   # created eagerly (tf.init_scope), once per row
            self._variables[key] = (
                state_variable(agreement_terms(row), name="aq_agreement_terms"),
                state_variable(np.asarray(row, np.int64)[None], name="aq_agreement_row"))
        terms, rows_in = self._variables[key]
        agree = tf.reshape(tf.numpy_function(self._verdict, [self._sum(terms.read_value())],
                                             tf.bool, stateful=True,
                                             name="aq_agreement_verdict"), [])

        def refuse() -> tf.Tensor:
            rows = self._rows(rows_in.read_value())
            return tf.reshape(tf.numpy_function(self._refuse, [rows], tf.bool, stateful=True,
                                                name="aq_check_agreement"), [])
        return tf.cond(agree, lambda: tf.constant(True), refuse)

    def now(self, row: np.ndarray) -> None:
        """The same agreement eagerly (trace time, ``packed.trainable.agree_first``)."""
        with tf.init_scope():
            if not self._eager:
                self._eager = {"sum": tf.function(self._sum, autograph=False),
                               "rows": tf.function(self._rows, autograph=False)}
            sums = self._eager["sum"](tf.constant(agreement_terms(row)))
            if not self._verdict(sums.numpy()):
                self._refuse(self._eager["rows"](
                    tf.constant(np.asarray(row, np.int64)[None])).numpy())


__all__ = ["Agreement"]
