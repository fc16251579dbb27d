"""The packed optimizer's per-step agreement on what trains (docs/protocol.md §3.1), over
Horovod: one allreduce (sum) of ``packed.trainable.agreement_terms`` named
``aq.trainable.<key>``, submitted with the step's first gradient and collected before the step's
first bucket goes out — the one collective ``hvd.join()`` supports, so its sums also count the
ranks that still train (:mod:`horovod_aq.torch.uneven`). When the rows differ, every rank
allgathers them (``aq.trainable.<key>.rows``) for ``packed.trainable.check_agreement``'s
message.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from horovod.torch.mpi_ops import Sum, allgather_async, allreduce_async

from horovod_aq.packed.trainable import agreement_terms, check_agreement_sums
from horovod_aq.packed.waiting import Deadline
from horovod_aq.torch.comm import wait


class StepAgreement:
    """One step's agreement of one optimizer: :meth:`submit` (once per step), :meth:`collect`
    (idempotent), :meth:`reset` at the step's end or a change of world."""

    __slots__ = ("name", "process_set", "deadline", "_row", "_handle", "_collected")

    def __init__(self, name: str, process_set: Any, deadline: Deadline) -> None:
        self.name, self.process_set, self.deadline = name, process_set, deadline
        self.reset()

    def reset(self) -> None:
        self._row: np.ndarray | None = None
        self._handle: Any = None
        self._collected = False

    def submit(self, row: np.ndarray) -> None:
        """This rank's ``packed.trainable.agreement_row`` for the step (nothing when already
        submitted)."""
        if self._handle is not None or self._collected:
            return
        self._row = row
        self._handle = allreduce_async(torch.from_numpy(agreement_terms(row)), name=self.name,
                                       op=Sum, process_set=self.process_set)

    def collect(self, ranks: int) -> int | None:
        """The number of ranks that still train (``packed.trainable.check_agreement_sums``,
        which raises the same ConfigMismatchError on every rank when rows differ); None when
        nothing is pending (not submitted, or collected already)."""
        if self._handle is None:
            return None
        handle, self._handle, self._collected = self._handle, None, True
        sums = wait(handle, self.deadline, self.name).numpy()
        return check_agreement_sums(sums, ranks, self._rows)

    def _rows(self) -> np.ndarray:
        """Every rank's row, for the message of a disagreement (every rank calls it)."""
        name = f"{self.name}.rows"
        handle = allgather_async(torch.from_numpy(self._row).view(1, -1), name=name,
                                 process_set=self.process_set)
        return wait(handle, self.deadline, name).numpy()


__all__ = ["StepAgreement"]
