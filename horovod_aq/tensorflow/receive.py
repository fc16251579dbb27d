"""What the TensorFlow packed exchange does with received rows that hold non-finite markers.

Every rank received the same rows, so every rank decides alike (docs/protocol.md §4): the graph
only tests the flags byte of each row; when a marker arrived, the decision and its message are
the core's ``packed.receive.receive_outcome`` (the first flagged rank, and the parameter holding
the first bad element, ``packed.params.param_at``), run on the host (``tf.numpy_function``), so
the error names the same rank and parameter as PyTorch's.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from horovod_aq.packed.params import param_at
from horovod_aq.packed.plan import BucketPlan
from horovod_aq.packed.receive import receive_outcome
from horovod_aq.tensorflow.payloads import PayloadOps, Rows
from horovod_aq.tensorflow.plans import Plan

__all__ = ["nonfinite_check"]


def nonfinite_check(ops: PayloadOps, plan: Plan, bucket: BucketPlan, rows: Rows,
                    raise_nonfinite: bool, collective: str) -> tuple[tf.Tensor, tf.Tensor]:
    """(any marker among ``rows``, the op that raises on one when ``raise_nonfinite``: an
    ``InvalidArgumentError`` with ``receive_outcome``'s message; a no-op otherwise)."""
    any_bad = tf.reduce_any(ops.flagged(rows))
    if not raise_nonfinite:
        return any_bad, tf.no_op()
    members = bucket.members
    sources = [plan.names[m].split(":", 1)[1] for m in members]
    offsets = [plan.offsets[m] for m in members]
    numels = [int(np.prod(plan.shapes[m], dtype=np.int64)) for m in members]

    def decide(heads: np.ndarray) -> np.bool_:
        receive_outcome(heads, nonfinite="raise", bucket=bucket.name, collective=collective,
                        param_at=lambda e: param_at(e, offsets, numels, sources), joined=False)
        return np.bool_(True)

    check = tf.cond(any_bad, lambda: tf.numpy_function(
        decide, [ops.heads(rows)], tf.bool, stateful=True, name="aq_receive_outcome"),
        lambda: tf.constant(True))
    return any_bad, check
