"""The world a packed exchange is planned for, and when it must be planned again.

Elastic Horovod (docs/horovod_compat.md § Elastic Horovod) changes the number of ranks, and may
renumber them, between two steps, on every rank at the same step boundary. Everything the packed
exchange derived from the world is then stale: the rank count (bucket plan modes, two-phase
chunks, the exchange's content name and so every collective name), this rank's place in the
process set (the chunk it averages) and in its node (the node-aware exchange), the global rank
(which keys its random stream), the transports built for the old set, and the error memory of
the old world's buckets. An engine compares :class:`World` at the first gradient of every step
with the one it planned for and, when :func:`replan_reason` says so, derives all of it again
behind a new handshake.

This module imports no framework.
"""

from __future__ import annotations

import dataclasses

from horovod_aq.packed.topology import Topology


@dataclasses.dataclass(frozen=True)
class World:
    """Where one rank stands: the process set's size (1 for a rank outside it), its rank within
    the set (0 outside it), its global rank, and the set's nodes (``packed.topology``; None:
    no node-aware exchange)."""

    size: int
    rank: int
    global_rank: int
    topology: Topology | None = None

    @property
    def per_node(self) -> int:
        """Ranks per node of the topology (1 without one)."""
        return 1 if self.topology is None else self.topology.per_node

    def __str__(self) -> str:
        where = "" if self.topology is None else f", {self.topology}"
        return f"{self.size} ranks (rank {self.rank}, global rank {self.global_rank}{where})"


def replan_reason(planned: World, now: World) -> str | None:
    """Why an exchange planned for ``planned`` must be planned again in ``now`` (None: it need
    not). The text is the one info line a re-plan logs."""
    if planned == now:
        return None
    return f"the world changed from {planned} to {now}"


__all__ = ["World", "replan_reason"]
