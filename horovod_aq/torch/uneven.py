"""Uneven steps under ``hvd.join()`` for the packed PyTorch optimizer (docs/protocol.md §15,
docs/horovod_compat.md § Uneven steps).

Horovod's ``hvd.join()`` lets a rank that ran out of data wait while the others go on: until
every rank has joined, Horovod's background thread answers the others' *allreduces* with zeros
in the joined rank's place (an allreduce with ``op=hvd.Average`` still divides by the set size)
and refuses their allgathers, alltoalls and broadcasts. The packed optimizer keeps Horovod's
semantics with the one collective join supports:

1. **Who still trains.** The per-step agreement is an allreduce of sums
   (:func:`horovod_aq.packed.trainable.agreement_terms`): a joined rank adds zeros, so its
   first term counts the ranks that still train, the same number on every one of them
   (:func:`~horovod_aq.packed.trainable.check_agreement_sums`). A rank collects it before it
   submits its first bucket of the step.
2. **A joined step.** When some rank has joined, every bucket of the step goes out as one named
   float32 allreduce (sum) of this rank's raw gradient, "aq.join.<bucket>", and its result is
   the sum divided by the set size P: the joined ranks count as zeros, as in Horovod. No
   payload is encoded, the error memory keeps its value, and the compressor's step does not
   advance (no refit, no wire measurement), so that when ``hvd.join()`` returns on every rank
   all ranks stand at the same compressor step and table again.
3. **After the join.** As with Horovod's own optimizer, the ranks that trained longer hold other
   weights than the ones that joined early: ``hvd.join()`` returns the rank that joined last,
   and ``hvd.broadcast_parameters`` / ``hvd.broadcast_optimizer_state`` from it make the
   replicas identical again.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from horovod.torch.mpi_ops import Sum, allreduce_async

from horovod_aq.packed.waiting import Deadline
from horovod_aq.torch.comm import wait

logger = logging.getLogger(__name__)


def joined_name(bucket: str) -> str:
    """The name of a bucket's allreduce in a step some rank joined."""
    return f"aq.join.{bucket}"


class JoinedStep:
    """The buckets of one step in which ``joined`` of ``ranks`` ranks had called
    ``hvd.join()``: each a float32 sum over the ranks still training."""

    __slots__ = ("joined", "ranks", "handles")

    def __init__(self, joined: int, ranks: int) -> None:
        self.joined, self.ranks = joined, ranks
        #: Bucket name → the handle of its allreduce.
        self.handles: dict[str, Any] = {}

    def submit(self, name: str, raw: torch.Tensor, process_set: Any) -> None:
        """Step 2: this rank's raw gradient of bucket ``name`` into the sum."""
        self.handles[name] = allreduce_async(raw.clone(), name=joined_name(name), op=Sum,
                                             process_set=process_set)

    def result(self, name: str, deadline: Deadline) -> torch.Tensor:
        """The bucket's average: the sum divided by the set size (joined ranks count as zeros)."""
        total = wait(self.handles.pop(name), deadline, joined_name(name))
        return total.div_(torch.full((), self.ranks, dtype=total.dtype, device=total.device))


def log_joined(name: str, joined: int, ranks: int, step: int) -> None:
    """One INFO line when a step is the first with ranks joined."""
    logger.info("horovod_aq: %s: %d of %d ranks called hvd.join() (step %d): until every rank "
                "has joined, each step is a float32 allreduce with zeros for the joined ranks, "
                "as Horovod's; the compressor's step, table and error memory stay as they are",
                name, joined, ranks, step)


__all__ = ["JoinedStep", "joined_name", "log_joined"]
