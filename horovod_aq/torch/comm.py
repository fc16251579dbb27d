"""Horovod's PyTorch collectives, as the two transports of the packed exchange.

* :class:`HorovodComm` is the :class:`~horovod_aq.refit.Comm` (numpy arrays of any dtype: the
  handshake, refits, error-memory checkpoints). Under the MPI controller, when mpi4py
  initialized MPI (:mod:`horovod_aq.mpi`), :func:`comm_for` gives mpi4py's
  :class:`~horovod_aq.refit.MPIComm` on a duplicate of the world communicator restricted to the
  process set instead (docs/protocol.md §11); otherwise, and under Gloo, Horovod's own named
  allgather and broadcast on the process set.
* :class:`HorovodCollectives` carries the gradient payloads of
  :class:`~horovod_aq.torch.wire.Wire`: named ``allgather_async`` / ``alltoall_async`` on the
  process set, polled with ``poll`` and collected with ``synchronize``. Horovod fills a joined
  rank's part of a collective with zeros, so the wire looks for rows without the magic.

Every wait polls with the deadline it was given (:mod:`horovod_aq.packed.waiting`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch
from horovod.torch.mpi_ops import (
    allgather_async,
    alltoall_async,
    broadcast_async_,
    poll,
    synchronize,
)

from horovod_aq import refit
from horovod_aq.packed.topology import topology_for
from horovod_aq.packed.waiting import FOREVER, Deadline, wait_until
from horovod_aq.packed.world import World
from horovod_aq.refit import Comm
from horovod_aq.torch.wire import Received


def wait(handle: Any, deadline: Deadline = FOREVER, collective: str = "") -> Any:
    """``synchronize(handle)`` after polling it with ``deadline`` (no spinning on a core)."""
    wait_until(lambda: poll(handle), deadline, collective)
    return synchronize(handle)


class HorovodComm(refit.HorovodComm):
    """:class:`~horovod_aq.refit.Comm` over Horovod torch collectives on one process set."""

    hvd = hvd

    def _allgather(self, rows: np.ndarray, name: str) -> np.ndarray:
        handle = allgather_async(torch.from_numpy(rows), name=name, process_set=self.process_set)
        return wait(handle, self.deadline, name).numpy()

    def _broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        handle = broadcast_async_(torch.from_numpy(array), root, name=name,
                                  process_set=self.process_set)
        return wait(handle, self.deadline, name).numpy()


def world_of(process_set: hvd.ProcessSet = hvd.global_process_set) -> World:
    """This rank's place in Horovod's world now (``packed.world``): its nodes from
    ``packed.topology`` (Horovod's local rank and size, or the declared shape), for a process
    set of the whole job only."""
    inside = bool(process_set.included())
    whole = inside and process_set.size() == hvd.size()
    return World(size=process_set.size() if inside else 1,
                 rank=process_set.rank() if inside else 0, global_rank=hvd.rank(),
                 topology=topology_for(hvd.rank(), hvd.size(), local_rank=hvd.local_rank(),
                                       local_size=hvd.local_size()) if whole else None)


def comm_for(process_set: hvd.ProcessSet = hvd.global_process_set,
             deadline: Deadline = FOREVER) -> Comm:
    """mpi4py under the MPI controller (when it initialized MPI), else :class:`HorovodComm`."""
    return refit.comm_for(HorovodComm, process_set, deadline)


class _Handle:
    """A Horovod handle as the wire's pending collective: ``done`` polls, ``wait`` collects."""

    __slots__ = ("handle", "collect")

    def __init__(self, handle: Any, collect: Callable[[Any], Any]) -> None:
        self.handle, self.collect = handle, collect

    def done(self) -> bool:
        return poll(self.handle)

    def wait(self) -> Any:
        return self.collect(synchronize(self.handle))


class HorovodCollectives:
    """The wire's payload collectives over Horovod's named ops on ``process_set``."""

    #: Horovod sends zeros in the place of a rank that called ``hvd.join()``.
    zero_fills_joined = True

    def __init__(self, process_set: hvd.ProcessSet) -> None:
        self.process_set = process_set
        self.rank = process_set.rank()
        self.size = process_set.size()

    def allgather(self, payload: torch.Tensor, name: str, then: Callable[[Received], Any], *,
                  delimit: Callable[[np.ndarray, int], list[int]] | None = None) -> _Handle:
        """Gather every rank's ``payload``; ``then(received)`` runs when it is collected.

        Horovod's allgather takes a different length on every rank but returns only the
        concatenation: with ``delimit`` (variable sizes) the per-rank sizes are read from the
        received bytes, ``delimit(host bytes, P)`` — the payloads delimit themselves
        (``packed.delimit``), so no size travels separately (docs/protocol.md §5.4)."""
        handle = allgather_async(payload, name=name, process_set=self.process_set)
        if delimit is None:
            sizes = [payload.numel()] * self.size
            return _Handle(handle, lambda out: then(Received(out, sizes)))

        def delimited(out: torch.Tensor) -> Received:
            host = out.detach().cpu().numpy()   # the one copy: the decoder reads it too
            return Received(out, delimit(host, self.size), host)
        return _Handle(handle, lambda out: then(delimited(out)))

    def alltoall(self, payloads: list[torch.Tensor], name: str, *, variable: bool = False,
                 received: Any = None) -> _Handle:
        """Send ``payloads[r]`` to rank r (any sizes, 0 included); ``wait()`` gives what every
        rank sent this one. Horovod's alltoall returns the received splits, so ``variable``
        and ``received`` need no work here."""
        splits = [p.numel() for p in payloads]
        handle = alltoall_async(torch.cat(payloads), splits=splits, name=name,
                                process_set=self.process_set)

        def collect(out: Any) -> Received:
            received, sizes = out
            return Received(received, [int(n) for n in sizes.tolist()])
        return _Handle(handle, collect)


__all__ = ["HorovodCollectives", "HorovodComm", "comm_for", "wait", "world_of"]
