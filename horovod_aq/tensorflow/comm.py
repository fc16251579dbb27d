"""The refit protocol's transport (:mod:`horovod_aq.refit`) over Horovod's TensorFlow collectives.

Under the MPI controller the level-table agreement runs over mpi4py on a duplicate of the world
communicator restricted to the process set (docs/protocol.md §11) — when mpi4py initialized MPI, see
:mod:`horovod_aq.mpi`; otherwise, and under Gloo, it uses Horovod's own named allgather and
broadcast on the process set. Both are eager: the refit runs between steps, never inside a
traced graph. Both keep the stall deadline (docs/protocol.md §15): mpi4py's requests are
polled, Horovod's blocking ops are watched (:mod:`horovod_aq.tensorflow.stall`).
"""

from __future__ import annotations

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_aq import refit
from horovod_aq.refit import Comm
from horovod_aq.tensorflow.stall import armed, default_deadline


def _require_eager(what: str) -> None:
    if not tf.executing_eagerly():
        raise RuntimeError(f"horovod_aq: {what} runs eagerly between training steps; call it "
                           "outside tf.function (after the step function returned)")


class HorovodComm(refit.HorovodComm):
    """:class:`~horovod_aq.refit.Comm` over Horovod TensorFlow collectives on one process set."""

    hvd = hvd

    def _allgather(self, rows: np.ndarray, name: str) -> np.ndarray:
        _require_eager("the refit protocol")
        with armed(self.deadline, name):
            return hvd.allgather(tf.constant(rows), name=name,
                                 process_set=self.process_set).numpy()

    def _broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        _require_eager("the refit protocol")
        with armed(self.deadline, name):
            return hvd.broadcast(tf.constant(array), root_rank=root, name=name,
                                 process_set=self.process_set).numpy()


def comm_for(process_set: hvd.ProcessSet = hvd.global_process_set) -> Comm:
    """mpi4py under the MPI controller (when it initialized MPI), else :class:`HorovodComm`;
    either with the stall deadline of ``$HOROVOD_AQ_STALL_TIMEOUT_S`` (default 300 s)."""
    return refit.comm_for(HorovodComm, process_set, default_deadline())
