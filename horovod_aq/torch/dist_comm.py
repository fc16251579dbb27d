"""The refit protocol's transport (:mod:`horovod_aq.refit`) over ``torch.distributed``, and the
fixed-length row gather that the DDP hook's handshake and checkpoints share.

``torch.distributed`` matches collectives by the order in which a process group issues them, not
by name: the ``name`` arguments of :class:`~horovod_aq.refit.Comm` are accepted and ignored. The
callers (``Compressor.end_step``, the handshake, the error-memory checkpoint) run at the same
point of the same step on every rank, so the order is the same everywhere.

Tensors live where the group's backend wants them: on the current CUDA device for NCCL, on the
CPU otherwise (Gloo, and Gloo supports float64 and int64).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def group_or_world(group: Any) -> Any:
    """``group``, or the default (world) group for None."""
    return group if group is not None else dist.group.WORLD


def comm_device(group: Any = None) -> torch.device:
    """Where ``group``'s collectives take tensors: the current CUDA device for NCCL, else CPU."""
    if dist.get_backend(group_or_world(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_flat(output: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                    async_op: bool = False) -> Any:
    """Gather equal-size 1-D ``tensor`` s into ``output`` (P·size, rank order).

    ``dist.all_gather_single`` where it exists (torch ≥ 2.10 deprecates the old name),
    else ``dist.all_gather_into_tensor``.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group_or_world(group), async_op=async_op)


def allgather_rows(rows: np.ndarray, group: Any = None) -> np.ndarray:
    """Gather a [1, L] numpy array (any dtype torch knows) from every rank → [P, L] numpy."""
    group = group_or_world(group)
    device = comm_device(group)
    mine = torch.from_numpy(np.ascontiguousarray(rows).reshape(-1)).to(device)
    size = dist.get_world_size(group)
    out = torch.empty(size * mine.numel(), dtype=mine.dtype, device=device)
    all_gather_flat(out, mine, group)
    return out.view(size, -1).cpu().numpy()


class DistComm:
    """:class:`~horovod_aq.refit.Comm` over a ``torch.distributed`` process group (float64)."""

    def __init__(self, group: Any = None) -> None:
        self.group = group_or_world(group)
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        self.device = comm_device(self.group)

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        return allgather_rows(np.asarray(array, dtype=np.float64).reshape(1, -1), self.group)

    def broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        buf = torch.from_numpy(np.array(array, dtype=np.float64, copy=True)).to(self.device)
        dist.broadcast(buf, src=dist.get_global_rank(self.group, root), group=self.group)
        return buf.cpu().numpy()


__all__ = ["DistComm", "all_gather_flat", "allgather_rows", "comm_device", "group_or_world"]
