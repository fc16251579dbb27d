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

The transport is a :class:`Comm`, the one collective seam of each integration (handshake,
refits, error-memory checkpoints): the framework integrations provide Horovod-backed ones
(named collectives on the user's process set) and a ``torch.distributed`` one
(:class:`horovod_aq.torch.dist_comm.DistComm`), and :class:`MPIComm` uses mpi4py on a duplicate
of the world communicator (restricted to the process set) under the MPI controller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from horovod_aq.levels.table import LevelTable
from horovod_aq.packed.waiting import FOREVER, Deadline, wait_until

logger = logging.getLogger(__name__)

#: Status codes carried in the first slot of the broadcast table message.
FIT_OK = 1.0
FIT_FAILED = 0.0


class Comm(Protocol):
    """The two collectives every integration provides on one process set.

    One ``Comm`` per integration carries everything the package agrees on outside the gradient
    payloads: the first-exchange handshake (int64), the refit protocol (float64), the error
    memory of a checkpoint (float32). Both collectives keep the array's dtype.
    """

    rank: int
    size: int

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        """Gather an array of the same size and dtype from every rank (flattened: a 1-D array
        or [1, L] rows) → [size, length], same dtype."""
        ...

    def broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        """Return the root's array (same size and dtype on every rank); ``root`` is the rank
        within the set."""
        ...


def _row(array: np.ndarray) -> np.ndarray:
    """``array`` as one contiguous [1, L] row of its own dtype."""
    return np.ascontiguousarray(array).reshape(1, -1)


class LocalComm:
    """A single-rank :class:`Comm` (no communication); used with one process and in tests."""

    rank = 0
    size = 1

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        return _row(array).copy()

    def broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        return np.array(array, copy=True)


#: mpi4py communicators by the global ranks they span (created once, collectively).
_mpi_comms: dict[tuple[int, ...], Any] = {}


def _mpi_communicator(ranks: Sequence[int] | None) -> Any:
    """A duplicate of ``MPI.COMM_WORLD`` restricted to ``ranks`` (None: all), created on first use
    — collectively over the members only (``Create_group``) — and kept."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    key = tuple(range(world.Get_size())) if ranks is None else tuple(int(r) for r in ranks)
    found = _mpi_comms.get(key)
    if found is not None:
        return found
    if list(key) == list(range(world.Get_size())):
        comm = world.Dup()
    else:
        group = world.Get_group().Incl(sorted(key))
        comm = world.Create_group(group)
        group.Free()
    if comm == MPI.COMM_NULL:
        raise ValueError("this rank is not a member of the process set given to MPIComm")
    _mpi_comms[key] = comm
    return comm


class MPIComm:
    """mpi4py transport on a duplicate of ``MPI.COMM_WORLD`` restricted to ``ranks``.

    ``ranks`` are global ranks (a Horovod process set's ``ranks``; ``None`` = all). Collectives are
    non-blocking requests waited for with ``deadline``
    (:func:`~horovod_aq.packed.waiting.wait_until`: no spinning, and an
    ``ExchangeStalledError`` past the stall timeout).
    """

    def __init__(self, ranks: Sequence[int] | None = None, deadline: Deadline = FOREVER) -> None:
        self._comm = _mpi_communicator(ranks)
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()
        self.deadline = deadline

    def _wait(self, request: Any, name: str) -> None:
        wait_until(request.Test, self.deadline, name)

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        send = _row(array)
        recv = np.empty((self.size, send.size), dtype=send.dtype)
        self._wait(self._comm.Iallgather(send, recv), name)
        return recv

    def broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        buf = np.array(array, copy=True, order="C")
        self._wait(self._comm.Ibcast(buf, root=root), name)
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
    ``_allgather(rows [1, L], name) -> [size, L]`` and ``_broadcast(array, global_root, name)``,
    both keeping the dtype, and may honour :attr:`deadline` (stall timeout). ``root`` in
    :meth:`broadcast` is relative to the set; Horovod wants a global rank, so it is mapped
    through ``process_set.ranks``.
    """

    hvd: Any = None  #: the framework's horovod module (set by subclasses)

    def __init__(self, process_set: Any = None, deadline: Deadline = FOREVER) -> None:
        self.process_set = process_set if process_set is not None else self.hvd.global_process_set
        self.rank = self.process_set.rank()
        self.size = self.process_set.size()
        self.deadline = deadline
        self._ranks = set_ranks(self.hvd, self.process_set)

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        return self._allgather(_row(array), name)

    def broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        return self._broadcast(np.array(array, copy=True, order="C"), self._ranks[root], name)

    def _allgather(self, rows: np.ndarray, name: str) -> np.ndarray:
        raise NotImplementedError

    def _broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        raise NotImplementedError


def comm_for(horovod_comm: type[HorovodComm], process_set: Any = None,
             deadline: Deadline = FOREVER) -> Comm:
    """The transport of ``process_set``: mpi4py (a communicator per set, created on first use —
    collectively) under the MPI controller when mpi4py initialized MPI (see
    :mod:`horovod_aq.mpi`), else ``horovod_comm`` (Horovod's own collectives). ``deadline``:
    the stall timeout of its waits."""
    from horovod_aq import mpi

    hvd = horovod_comm.hvd
    process_set = process_set if process_set is not None else hvd.global_process_set
    if hvd.mpi_enabled() and mpi.mpi4py_owns_mpi():
        return MPIComm(set_ranks(hvd, process_set), deadline)
    return horovod_comm(process_set, deadline)
