"""The in-graph counters of a TensorFlow packed exchange, which feed its telemetry.

Every exchange graph ends by adding to variables, with no host call (docs/protocol.md §8, §13):
the exchanges run and how many of them were skipped for non-finite input, the layout that ran,
the bytes of this rank's first-phase payloads and the bytes it sent to other ranks
(``packed.send.sent_bytes``; the small tensors' allreduces are added by
``protocol.measured_traffic``) and, for DQSGD, the float64 Σ‖decoded aggregate‖² its rule reads.
The eager step end (:mod:`horovod_aq.tensorflow.step`) takes what was added since its last call.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from horovod_aq.tensorflow.state import state_variable
from horovod_aq.tensorflow.stats import aggregate_sum_sq

__all__ = ["Counters"]


class Counters:
    """The counter variables of one exchange (``label``: its variables' process-local name);
    ``dynamic``: DQSGD, which also sums the decoded aggregate's squares."""

    def __init__(self, label: str, dynamic: bool) -> None:
        self.calls = state_variable(np.int64(0), name=f"aq_calls_{label}")
        self.plan_id = state_variable(np.int64(-1), name=f"aq_plan_{label}")
        self.skipped = state_variable(np.int64(0), name=f"aq_skipped_{label}")
        #: (payload bytes, bytes sent to other ranks), summed over the exchanges.
        self.sent = state_variable(np.zeros(2, np.int64), name=f"aq_sent_{label}")
        #: DQSGD: float64 Σ‖decoded aggregate‖² of the exchanges since the last refit.
        self.aggregate_sq = (state_variable(np.float64(0.0), name=f"aq_aggregate_sq_{label}")
                             if dynamic else None)
        self._calls_seen = 0
        self._skipped_seen = 0
        self._sent_seen = np.zeros(2, np.int64)

    def in_graph(self, plan_index: int, any_skipped: tf.Tensor,
                 sent: list[tuple[tf.Tensor, tf.Tensor]],
                 decoded: list[tuple[tf.Tensor, tf.Tensor]]) -> list[tf.Tensor]:
        """The ops adding one exchange of layout ``plan_index``: whether a rank sent markers,
        the (payload, sent) byte pairs of its sends and (DQSGD) the (values, skipped) pairs of
        everything it decoded (``stats.aggregate_sum_sq``)."""
        total = (tf.reduce_sum(tf.stack([tf.stack(pair) for pair in sent]), axis=0) if sent
                 else tf.zeros([2], tf.int64))
        ops = [self.calls.assign_add(1), self.plan_id.assign(plan_index),
               self.skipped.assign_add(tf.cast(any_skipped, tf.int64)),
               self.sent.assign_add(total)]
        if self.aggregate_sq is not None:
            ops.append(self.aggregate_sq.assign_add(aggregate_sum_sq(decoded)))
        return ops

    def take_aggregate(self) -> float:
        """DQSGD: Σ‖decoded aggregate‖² since the last call, then reset to 0 (eager); 0.0
        for other compressors."""
        if self.aggregate_sq is None:
            return 0.0
        value = float(self.aggregate_sq.numpy())
        self.aggregate_sq.assign(0.0)
        return value

    def take_calls(self) -> tuple[int, int]:
        """(exchanges run, of which skipped for non-finite input) since the last call (eager)."""
        calls, skipped = int(self.calls.numpy()), int(self.skipped.numpy())
        delta = (calls - self._calls_seen, skipped - self._skipped_seen)
        self._calls_seen, self._skipped_seen = calls, skipped
        return delta

    def take_sent(self) -> dict[str, int]:
        """``payload_bytes`` and ``bytes_sent`` (quantized buckets only) since the last call
        (eager)."""
        total = self.sent.numpy().astype(np.int64)
        delta, self._sent_seen = total - self._sent_seen, total
        return {"payload_bytes": int(delta[0]), "bytes_sent": int(delta[1])}
