"""Horovod-backed transports for the refit protocol (:mod:`horovod_aq.sync`) in TensorFlow.

Under the MPI controller the level-table agreement runs over mpi4py on a duplicate of the world
communicator restricted to the process set (DESIGN.md) — when mpi4py initialized MPI, see
:mod:`horovod_aq.mpi`; otherwise, and under Gloo, it uses Horovod's own named allgather and
broadcast on the process set. Both are eager: the refit runs between steps, never inside a
traced graph.
"""

from __future__ import annotations

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_aq import mpi
from horovod_aq.sync import Comm, MPIComm


def set_ranks(process_set: hvd.ProcessSet) -> list[int]:
    """Global ranks of ``process_set`` (Horovod fills ``ranks`` at init)."""
    ranks = process_set.ranks
    return list(ranks) if ranks else list(range(hvd.size()))


def _require_eager(what: str) -> None:
    if not tf.executing_eagerly():
        raise RuntimeError(f"horovod_aq: {what} runs eagerly between training steps; call it "
                           "outside tf.function (after the step function returned)")


class HorovodComm:
    """:class:`~horovod_aq.sync.Comm` over Horovod TensorFlow collectives on one process set.

    ``root`` in :meth:`broadcast` is relative to the set; Horovod wants a global rank, so it is
    mapped through ``process_set.ranks``.
    """

    def __init__(self, process_set: hvd.ProcessSet = hvd.global_process_set) -> None:
        self.process_set = process_set
        self.rank = process_set.rank()
        self.size = process_set.size()
        self._ranks = set_ranks(process_set)

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        _require_eager("the refit protocol")
        tensor = tf.constant(np.ascontiguousarray(array, dtype=np.float64).reshape(1, -1))
        return hvd.allgather(tensor, name=name, process_set=self.process_set).numpy()

    def broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        _require_eager("the refit protocol")
        tensor = tf.constant(np.array(array, dtype=np.float64, copy=True))
        return hvd.broadcast(tensor, root_rank=self._ranks[root], name=name,
                             process_set=self.process_set).numpy()


_mpi_comms: dict[tuple[int, ...], MPIComm] = {}


def comm_for(process_set: hvd.ProcessSet = hvd.global_process_set) -> Comm:
    """The transport for ``process_set``: mpi4py under the MPI controller, Horovod under Gloo.

    Collective on first use per process set (the MPI communicator is created then).
    """
    if hvd.mpi_enabled() and mpi.mpi4py_owns_mpi():
        key = tuple(set_ranks(process_set))
        if key not in _mpi_comms:
            _mpi_comms[key] = MPIComm(key)
        return _mpi_comms[key]
    return HorovodComm(process_set)
