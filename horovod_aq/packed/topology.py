"""Which ranks share a node (docs/protocol.md §5.7): the shape a node-aware exchange follows.

GPU clusters put L ranks on each of M nodes: fast links inside a node (NVLink, PCIe, shared
memory), one NIC between nodes. A :class:`Topology` says, for this rank, how many nodes and
ranks per node there are and where it sits. Ranks are numbered node-major, as ``horovodrun``
and ``torchrun`` number them (the L slots of the first host, then the next host's):

    rank = node · L + local          node = rank // L,  local = rank mod L

**Where it comes from** (:func:`topology_for`), the first that applies:

1. a declared shape — the ``topology=`` argument or ``$HOROVOD_AQ_TOPOLOGY`` — "MxL" (M nodes
   of L ranks, e.g. "2x2"), for tests on one machine and for clusters whose launcher does not
   tell; "flat" (or "1x<P>" / "<P>x1") switches node-awareness off;
2. the launcher's local size: Horovod's ``hvd.local_size()``, torchrun's ``LOCAL_WORLD_SIZE``;
   only when every node has as many ranks (``P`` a multiple of ``L``) and this rank's own
   local rank and node fit the node-major numbering — otherwise there is no topology, with a
   log line saying why.

One node (M = 1) or one rank per node (L = 1) has nothing to gain: :func:`topology_for` returns
None and the exchange stays flat. Every rank must see the same shape; the handshake compares
it (its layout digest holds the plan's modes, which follow the shape).

This module imports no framework.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: The environment override of the shape: "MxL", or "flat".
TOPOLOGY_ENV = "HOROVOD_AQ_TOPOLOGY"
_SHAPE = re.compile(r"^\s*(\d+)\s*[xX×]\s*(\d+)\s*$")


@dataclass(frozen=True)
class Topology:
    """M = ``nodes`` nodes of L = ``per_node`` ranks; this rank is ``local`` on ``node``."""

    nodes: int
    per_node: int
    node: int
    local: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.per_node < 1:
            raise ValueError(f"a topology has at least one node of one rank, got {self}")
        if not (0 <= self.node < self.nodes and 0 <= self.local < self.per_node):
            raise ValueError(f"node {self.node} / local rank {self.local} outside "
                             f"{self.nodes} nodes of {self.per_node}")

    @property
    def ranks(self) -> int:
        """P = M·L."""
        return self.nodes * self.per_node

    @property
    def rank(self) -> int:
        """This rank: node·L + local."""
        return self.node * self.per_node + self.local

    def node_peers(self) -> list[int]:
        """The L ranks of this node, in local-rank order."""
        return [self.node * self.per_node + k for k in range(self.per_node)]

    def cross_peers(self) -> list[int]:
        """The M ranks with this rank's local rank, one per node, in node order."""
        return [i * self.per_node + self.local for i in range(self.nodes)]

    def __str__(self) -> str:
        return (f"{self.nodes} nodes × {self.per_node} ranks (node {self.node}, local rank "
                f"{self.local})")


def parse_shape(text: str) -> tuple[int, int] | None:
    """(M, L) of "MxL"; None for "flat". ValueError for anything else."""
    if text.strip().lower() == "flat":
        return None
    found = _SHAPE.match(text)
    if found is None:
        raise ValueError(f"a topology is 'MxL' (M nodes of L ranks, e.g. '2x4') or 'flat', "
                         f"got {text!r}")
    nodes, per_node = int(found.group(1)), int(found.group(2))
    if nodes < 1 or per_node < 1:
        raise ValueError(f"a topology 'MxL' has M >= 1 nodes of L >= 1 ranks, got {text!r}")
    return nodes, per_node


def topology_for(rank: int, size: int, *, local_rank: int | None = None,
                 local_size: int | None = None,
                 declared: str | None = None) -> Topology | None:
    """This rank's :class:`Topology` (module docstring), or None: flat. ``declared``: the
    ``topology=`` argument (None: ``$HOROVOD_AQ_TOPOLOGY``, then the launcher's
    ``local_rank`` / ``local_size``)."""
    text = declared if declared is not None else os.environ.get(TOPOLOGY_ENV, "").strip()
    if text:
        shape = parse_shape(text)
        if shape is None:
            return None
        nodes, per_node = shape
        if nodes * per_node != size:
            raise ValueError(f"topology {text!r} declares {nodes * per_node} ranks, but the job "
                             f"has {size}: declare M nodes of L ranks with M·L = {size} (or "
                             f"'flat'; ${TOPOLOGY_ENV} / topology=)")
    else:
        if local_size is None or local_rank is None or local_size <= 1 or local_size >= size:
            return None
        if size % local_size or rank % local_size != local_rank:
            logger.info("horovod_aq: the launcher's %d local ranks do not number the %d ranks "
                        "node by node (rank %d is local rank %d): the exchange stays flat; "
                        "declare the shape with %s=MxL to change that", local_size, size, rank,
                        local_rank, TOPOLOGY_ENV)
            return None
        nodes, per_node = size // local_size, local_size
    if nodes == 1 or per_node == 1:
        return None
    return Topology(nodes, per_node, rank // per_node, rank % per_node)


__all__ = ["TOPOLOGY_ENV", "Topology", "parse_shape", "topology_for"]
