"""Level-table agreement across ranks: stats gather → fit on the root → broadcast.

Protocol (docs/protocol.md §2, docs/quantizers.md §5.2), run at the same step on every rank of
the process set because the refit schedule is a function of the global step:

1. each rank summarizes its gradient as :class:`~horovod_aq.levels.stats.BucketStats` (top-K
   buckets by norm plus pooled sums) and serializes it to a fixed-length float64 vector;
2. one allgather gives every rank all P vectors (fixed length, so no size negotiation);
3. the root (rank 0 of the set) merges them (global top-K), fits the new table and
4. broadcasts ``[status, version, ℓ_0 … ℓ_{N−1}]``; every rank installs exactly those float64
   values, so tables are bitwise identical everywhere — no rank fits on its own.

A failed fit (no usable statistics, a numerical error) is broadcast as a status and every rank
keeps its current table, so the ranks never diverge.

The transport is a :class:`Comm`: the framework integrations provide Horovod-backed ones
(named collectives on the user's process set), and :class:`MPIComm` uses mpi4py on a duplicate
of the world communicator (restricted to the process set) under the MPI controller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from horovod_aq.levels.table import LevelTable

logger = logging.getLogger(__name__)

#: Status codes carried in the first slot of the broadcast table message.
FIT_OK = 1.0
FIT_FAILED = 0.0


class Comm(Protocol):
    """The two collectives the refit protocol needs, on one process set."""

    rank: int
    size: int

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        """Gather a 1-D float64 array of the same length from every rank → [size, length]."""
        ...

    def broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        """Return the root's 1-D float64 array (same length on every rank)."""
        ...


class LocalComm:
    """A single-rank :class:`Comm` (no communication); used with one process and in tests."""

    rank = 0
    size = 1

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        return np.asarray(array, dtype=np.float64)[None, :].copy()

    def broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        return np.asarray(array, dtype=np.float64).copy()


class MPIComm:
    """mpi4py transport on a duplicate of ``MPI.COMM_WORLD`` restricted to ``ranks``.

    ``ranks`` are global ranks (a Horovod process set's ``ranks``; ``None`` = all). The
    communicator is created once, collectively over the members only (``Create_group``).
    """

    def __init__(self, ranks: Sequence[int] | None = None) -> None:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        if ranks is None or list(ranks) == list(range(world.Get_size())):
            self._comm = world.Dup()
        else:
            group = world.Get_group().Incl(sorted(int(r) for r in ranks))
            self._comm = world.Create_group(group)
            group.Free()
        if self._comm == MPI.COMM_NULL:
            raise ValueError("this rank is not a member of the process set given to MPIComm")
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        send = np.ascontiguousarray(array, dtype=np.float64)
        recv = np.empty((self.size, send.size), dtype=np.float64)
        self._comm.Allgather(send, recv)
        return recv

    def broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        buf = np.array(array, dtype=np.float64, copy=True)
        self._comm.Bcast(buf, root=root)
        return buf


def agree_on_table(
    comm: Comm,
    local_stats_array: np.ndarray,
    fit: Callable[[list[np.ndarray]], np.ndarray],
    current: LevelTable,
    *,
    name: str,
) -> tuple[LevelTable, bool]:
    """Run the refit protocol once; return ``(table, refitted)`` identical on every rank.

    ``local_stats_array`` is this rank's fixed-length statistics vector, ``fit`` maps the list of
    every rank's vectors to a new level array (called on the root only; any exception there is a
    failed fit), ``current`` is the table in use, ``name`` makes the collectives' names unique
    and rank-independent (e.g. the compressor's tag).
    """
    gathered = comm.allgather(np.asarray(local_stats_array, dtype=np.float64),
                              name=f"aq.stats.{name}.v{current.version}")
    n_levels = current.num_levels
    message = np.zeros(2 + n_levels, dtype=np.float64)
    if comm.rank == 0:
        try:
            levels = np.asarray(fit(list(gathered)), dtype=np.float64)
            if levels.shape != (n_levels,):
                raise ValueError(f"fit returned {levels.shape[0]} levels, expected {n_levels}")
            LevelTable(levels)  # validate before sending
            message[0], message[1], message[2:] = FIT_OK, current.version + 1, levels
        except Exception as exc:  # noqa: BLE001 - any failure keeps the old table everywhere
            logger.warning("level refit failed on the root, keeping table v%d: %s",
                           current.version, exc)
            message[0], message[1] = FIT_FAILED, current.version
    message = comm.broadcast(message, root=0, name=f"aq.lv.{name}.v{current.version + 1}")
    if message[0] != FIT_OK:
        return current, False
    return LevelTable(message[2:].copy(), int(message[1])), True


# ---------------------------------------------------------------------- Horovod transports
def set_ranks(hvd: Any, process_set: Any) -> list[int]:
    """Global ranks of a Horovod ``process_set`` (Horovod fills ``ranks`` at init)."""
    ranks = process_set.ranks
    return list(ranks) if ranks else list(range(hvd.size()))


class HorovodComm:
    """:class:`Comm` over one framework's Horovod collectives on one process set.

    Subclasses (``horovod_aq.torch.comm``, ``horovod_aq.tensorflow.comm``) implement
    ``_allgather(rows [1, L] float64, name) -> [size, L]`` and
    ``_broadcast(array, global_root, name)``. ``root`` in :meth:`broadcast` is relative to the
    set; Horovod wants a global rank, so it is mapped through ``process_set.ranks``.
    """

    hvd: Any = None  #: the framework's horovod module (set by subclasses)

    def __init__(self, process_set: Any = None) -> None:
        self.process_set = process_set if process_set is not None else self.hvd.global_process_set
        self.rank = self.process_set.rank()
        self.size = self.process_set.size()
        self._ranks = set_ranks(self.hvd, self.process_set)

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        return self._allgather(np.ascontiguousarray(array, dtype=np.float64).reshape(1, -1), name)

    def broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        return self._broadcast(np.array(array, dtype=np.float64, copy=True), self._ranks[root],
                               name)

    def _allgather(self, rows: np.ndarray, name: str) -> np.ndarray:
        raise NotImplementedError

    def _broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        raise NotImplementedError


_mpi_comms: dict[tuple[int, ...], MPIComm] = {}


def comm_for(horovod_comm: type[HorovodComm], process_set: Any = None) -> Comm:
    """The refit transport for ``process_set``: mpi4py (a communicator per set, created on first
    use — collectively) under the MPI controller when mpi4py initialized MPI (see
    :mod:`horovod_aq.mpi`), else ``horovod_comm`` (Horovod's own collectives)."""
    from horovod_aq import mpi

    hvd = horovod_comm.hvd
    process_set = process_set if process_set is not None else hvd.global_process_set
    if hvd.mpi_enabled() and mpi.mpi4py_owns_mpi():
        key = tuple(set_ranks(hvd, process_set))
        if key not in _mpi_comms:
            _mpi_comms[key] = MPIComm(key)
        return _mpi_comms[key]
    return horovod_comm(process_set)
