"""``torch.distributed`` as the two transports of the DDP hook.

* :class:`DistComm` is the :class:`~horovod_aq.refit.Comm` (numpy arrays of any dtype: the
  handshake, refits, error-memory checkpoints);
* :class:`DistCollectives` carries the gradient payloads of
  :class:`~horovod_aq.torch.wire.Wire`: one async ``all_gather`` or ``all_to_all_single`` per
  stage; an allgather's ``then`` runs in the work's future callback, so decoding overlaps the
  rest of the backward pass; :meth:`DistCollectives.allreduce_mean` averages the buckets of
  compressors that do not quantize.

``torch.distributed`` matches collectives by the order in which a process group issues them, not
by name: names are accepted and ignored (and only named in errors). Every caller issues them at
the same point on every rank (the hook, in bucket order; ``Compressor.end_step``; the
checkpoint), so the order is the same everywhere. Waits poll the work with the deadline given
(:mod:`horovod_aq.packed.waiting`) instead of blocking in it.

Tensors live where the group's backend wants them: on the current CUDA device for NCCL, on the
CPU otherwise (Gloo, and Gloo supports float64 and int64).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from horovod_aq.packed.topology import Topology, topology_for
from horovod_aq.packed.waiting import FOREVER, Deadline, wait_until
from horovod_aq.torch.wire import Received


def group_or_world(group: Any) -> Any:
    """``group``, or the default (world) group for None."""
    return group if group is not None else dist.group.WORLD


def comm_device(group: Any = None) -> torch.device:
    """Where ``group``'s collectives take tensors: the current CUDA device for NCCL, else CPU."""
    if dist.get_backend(group_or_world(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def topology_of(group: Any = None) -> Topology | None:
    """The nodes of ``group`` (``packed.topology``): the declared shape, or torchrun's
    ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``; for the whole world only (None otherwise)."""
    group = group_or_world(group)
    size = dist.get_world_size()
    if dist.get_world_size(group) != size:
        return None
    local = {k: int(os.environ[v]) for k, v in (("local_rank", "LOCAL_RANK"),
                                                 ("local_size", "LOCAL_WORLD_SIZE"))
             if os.environ.get(v, "").isdigit()}
    return topology_for(dist.get_rank(), size, **local)


def all_gather_flat(output: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                    async_op: bool = False) -> Any:
    """Gather equal-size 1-D ``tensor`` s into ``output`` (P·size, rank order).

    ``dist.all_gather_single`` where it exists (torch ≥ 2.10 deprecates the old name),
    else ``dist.all_gather_into_tensor``.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group_or_world(group), async_op=async_op)


class DistComm:
    """:class:`~horovod_aq.refit.Comm` over a ``torch.distributed`` process group."""

    def __init__(self, group: Any = None, deadline: Deadline = FOREVER) -> None:
        self.group = group_or_world(group)
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.device = comm_device(self.group)
        self.deadline = deadline

    def _wait(self, work: Any, name: str) -> None:
        wait_until(work.is_completed, self.deadline, name)
        work.wait()

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        mine = torch.from_numpy(np.ascontiguousarray(array).reshape(-1)).to(self.device)
        out = torch.empty(self.size * mine.numel(), dtype=mine.dtype, device=self.device)
        self._wait(all_gather_flat(out, mine, self.group, async_op=True), name)
        return out.view(self.size, -1).cpu().numpy()

    def broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        buf = torch.from_numpy(np.array(array, copy=True, order="C")).to(self.device)
        self._wait(dist.broadcast(buf, src=dist.get_global_rank(self.group, root),
                                  group=self.group, async_op=True), name)
        return buf.cpu().numpy()


class _Work:
    """A work (or the future of its callback) as the wire's pending collective."""

    __slots__ = ("poll", "collect")

    def __init__(self, poll: Callable[[], bool], collect: Callable[[], Any]) -> None:
        self.poll, self.collect = poll, collect

    def done(self) -> bool:
        return self.poll()

    def wait(self) -> Any:
        return self.collect()


def _then(work: Any, then: Callable[[], Any]) -> _Work:
    """``work`` with ``then()`` run in its future callback; an error there is kept and raised by
    ``wait()`` in the caller's thread (the hook), at the same point on every rank."""
    kept: list[BaseException] = []

    def callback(_: Any) -> None:
        try:
            then()
        except BaseException as exc:  # noqa: BLE001 - raised again by wait(), in the hook
            kept.append(exc)
    future = work.get_future().then(callback)

    def collect() -> None:
        future.wait()
        if kept:
            raise kept[0]
    return _Work(future.done, collect)


class DistCollectives:
    """The wire's payload collectives over a ``torch.distributed`` process group.

    Variable sizes (the entropy-coded wire, docs/protocol.md §5.4): ``all_gather`` and
    ``all_to_all_single`` need the sizes before the data, so every rank first exchanges its sizes
    in one small int64 collective issued at the same point (the same call) on every rank, waits
    for it (``deadline``), then issues the payload collective: allgather pads every payload to
    the largest and trims on receipt; alltoall passes the exchanged split sizes.
    """

    #: ``torch.distributed`` does not stand in for ranks that left.
    zero_fills_joined = False

    def __init__(self, group: Any = None, deadline: Deadline = FOREVER) -> None:
        self.group = group_or_world(group)
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.device = comm_device(self.group)
        self.deadline = deadline

    def _exchange_sizes(self, mine: list[int], name: str, *, gather: bool) -> list[int]:
        """Every rank's size (``gather``: all_gather of one int64) or the sizes every rank
        sends this one (all_to_all_single of P int64), waited for with the deadline."""
        send = torch.tensor(mine, dtype=torch.int64, device=self.device)
        if gather:
            got = torch.empty(self.size, dtype=torch.int64, device=self.device)
            work = all_gather_flat(got, send, self.group, async_op=True)
        else:
            got = torch.empty_like(send)
            work = dist.all_to_all_single(got, send, group=self.group, async_op=True)
        wait_until(work.is_completed, self.deadline, f"{name} (sizes)")
        work.wait()
        return [int(n) for n in got.cpu().tolist()]

    def allgather(self, payload: torch.Tensor, name: str, then: Callable[[Received], Any], *,
                  delimit: Callable[[np.ndarray, int], list[int]] | None = None) -> _Work:
        """Gather every rank's ``payload``; ``then`` runs in the work's future callback (its
        error is kept and raised by ``wait()``, in the caller's thread). ``delimit`` not None:
        sizes may differ by rank; they are gathered first (``delimit`` is not needed)."""
        if delimit is None:
            out = torch.empty(self.size * payload.numel(), dtype=torch.uint8,
                              device=payload.device)
            work = all_gather_flat(out, payload, self.group, async_op=True)
            return _then(work, lambda: then(Received(out, [payload.numel()] * self.size)))
        sizes = self._exchange_sizes([payload.numel()], name, gather=True)
        width = max(sizes)
        padded = torch.zeros(width, dtype=torch.uint8, device=payload.device)
        padded[:payload.numel()] = payload
        out = torch.empty(self.size * width, dtype=torch.uint8, device=payload.device)
        work = all_gather_flat(out, padded, self.group, async_op=True)

        def trimmed() -> Received:
            rows = out.view(self.size, width)
            return Received(torch.cat([rows[r, :n] for r, n in enumerate(sizes)]), sizes)
        return _then(work, lambda: then(trimmed()))

    def allreduce_mean(self, tensor: torch.Tensor, name: str,
                       then: Callable[[torch.Tensor], Any]) -> _Work:
        """Average ``tensor`` over the group in place (divided by P first, then summed);
        ``then(tensor)`` runs in the work's future callback."""
        tensor.div_(self.size)
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return _then(work, lambda: then(tensor))

    def alltoall(self, payloads: list[torch.Tensor], name: str, *, variable: bool = False,
                 received: Sequence[int] | None = None) -> _Work:
        """Send ``payloads[r]`` to rank r; ``wait()`` gives the received ones. One size
        everywhere; or the sizes every rank sends this one, ``received`` (known ahead) or
        (``variable``) exchanged first; passed as split sizes."""
        send = torch.cat(payloads)
        splits = [p.numel() for p in payloads]
        if variable:
            received = self._exchange_sizes(splits, name, gather=False)
        if received is None:
            out = torch.empty_like(send)
            work = dist.all_to_all_single(out, send, group=self.group, async_op=True)
            sizes = splits
        else:
            sizes = [int(n) for n in received]
            out = torch.empty(sum(sizes), dtype=send.dtype, device=send.device)
            work = dist.all_to_all_single(out, send, output_split_sizes=sizes,
                                          input_split_sizes=splits, group=self.group,
                                          async_op=True)

        def collect() -> Received:
            work.wait()
            return Received(out, sizes)
        return _Work(work.is_completed, collect)


__all__ = ["DistCollectives", "DistComm", "all_gather_flat", "comm_device", "group_or_world",
           "topology_of"]
