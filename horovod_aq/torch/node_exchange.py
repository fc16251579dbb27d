"""The node-aware exchange of a bucket (docs/protocol.md §5.7): full precision inside the node,
compressed only between nodes.

On a :class:`~horovod_aq.packed.topology.Topology` of M nodes of L ranks, a bucket of n
coordinates in mode "node_<inner>" (``packed.cost.NODE_MODES``) goes through three stages; shard
j is ``packed.cost.shard_span(n, L, B, j)`` (n_L = ⌈n/B/L⌉·B coordinates, the last ones shorter
or empty):

A. **reduce-scatter inside the node** ("aq.rs.<bucket>"): every rank sends shard j of its
   float32 gradient to local rank j; local rank l sums the L shards it receives in local-rank
   order and divides by L (the node's average of shard l; with the presence masks OR-ed);
B. **the compressed exchange among the M ranks of local rank l** (one per node): the node's
   shard l is an ordinary :class:`~horovod_aq.torch.wire.Bucket` of n_l coordinates with the
   inner mode, on an inner :class:`~horovod_aq.torch.wire.Wire` whose collectives reach those M
   ranks — markers, stall deadlines, error feedback (memory keyed
   "<bucket>.<M>x<L>.s<l>", so a checkpoint taken on another shape restores nothing for it) and
   the refit statistics of the averaged shard, all as in §5.1/§5.2;
C. **allgather inside the node** ("aq.ig.<bucket>"): every rank sends its averaged shard in
   float32 to the L ranks of its node, with a trailer: its status (ok, skipped, failed) and the
   presence seen by its exchange. Every rank then holds the same bits (each shard decoded from
   the same rows on all M ranks that exchanged it, then copied), and the same outcome: a bucket
   that one shard's exchange skipped or failed is skipped or fails on every rank of the job.

The collectives reach a subset of ranks as :class:`PeerCollectives`: alltoalls of the whole
process set (Horovod's ``alltoall`` with splits, ``torch.distributed``'s ``all_to_all_single``)
that send nothing to the other ranks, so they need no sub-group of their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from horovod_aq import codec
from horovod_aq.packed.cost import inner_mode, shard_span
from horovod_aq.packed.plan import BucketPlan, allgather_name, alltoall_name
from horovod_aq.packed.protocol import nonfinite_message
from horovod_aq.packed.topology import Topology
from horovod_aq.packed.waiting import Deadline, wait_until
from horovod_aq.torch.wire import EXCHANGING, Bucket, Collectives, Received, Wire

#: Stage C's status of a shard: exchanged, skipped (``nonfinite="skip"``), failed (non-finite
#: with ``nonfinite="raise"``), failed (anything else).
OK, SKIPPED, NONFINITE, FAILED = 0, 1, 2, 3
#: Stage C's trailer before the presence bits: status (uint8, 3 bytes padding), the node whose
#: marker stopped the shard (int32), the bucket element it names (int64; −1: none).
TRAILER = np.dtype([("status", "u1"), ("pad", "u1", 3), ("node", "<i4"), ("element", "<i8")])


def reduce_scatter_name(bucket: str) -> str:
    return f"aq.rs.{bucket}"


def node_gather_name(bucket: str) -> str:
    return f"aq.ig.{bucket}"


def _aligned(nbytes: int) -> int:
    """Bytes rounded up to whole float32 (so every received row views as float32)."""
    return -(-nbytes // 4) * 4


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def _floats(row: torch.Tensor, count: int) -> torch.Tensor:
    return row[:4 * count].view(torch.float32)


class _Then:
    """A pending alltoall whose outcome goes through ``then``."""

    __slots__ = ("pending", "then")

    def __init__(self, pending: Any, then: Callable[[Any], Any]) -> None:
        self.pending, self.then = pending, then

    def done(self) -> bool:
        return self.pending.done()

    def wait(self) -> Any:
        return self.then(self.pending.wait())


class PeerCollectives:
    """:class:`~horovod_aq.torch.wire.Collectives` among ``peers`` (ranks of ``base``,
    ascending) over ``base``'s alltoall, sending nothing to the other ranks: every rank of
    ``base`` takes part in every collective (with its own peers)."""

    def __init__(self, base: Collectives, peers: Sequence[int]) -> None:
        self.base, self.peers = base, list(peers)
        if self.peers != sorted(self.peers) or base.rank not in self.peers:
            raise ValueError(f"peers must be ascending ranks including this one ({base.rank}), "
                             f"got {self.peers}")
        self.rank, self.size = self.peers.index(base.rank), len(self.peers)
        self.zero_fills_joined = base.zero_fills_joined

    def alltoall(self, payloads: list[torch.Tensor], name: str, *, variable: bool = False,
                 received: Sequence[int] | None = None) -> _Then:
        """Send ``payloads[i]`` to peer i; ``wait()`` gives the peers' payloads to this rank.
        ``received``: the sizes coming from each peer when known (None and not ``variable``:
        each peer sends what this rank sends it)."""
        empty = payloads[0].new_empty(0)
        spread = [empty] * self.base.size
        for i, r in enumerate(self.peers):
            spread[r] = payloads[i]
        sizes = None
        if not variable:
            mine = received if received is not None else [p.numel() for p in payloads]
            sizes = [0] * self.base.size
            for i, r in enumerate(self.peers):
                sizes[r] = int(mine[i])
        pending = self.base.alltoall(spread, name, variable=variable, received=sizes)
        return _Then(pending, lambda got: Received(got.flat, [got.sizes[r] for r in self.peers]))

    def allgather(self, payload: torch.Tensor, name: str, then: Callable[[Received], Any], *,
                  delimit: Callable[[np.ndarray, int], list[int]] | None = None) -> _Then:
        """Every peer's ``payload`` (an alltoall of copies); ``then(received)`` when collected.
        Variable sizes (``delimit`` given) travel as the alltoall's splits."""
        pending = self.alltoall([payload] * self.size, name, variable=delimit is not None)
        return _Then(pending, then)


class _Shard:
    """This rank's shard of one bucket: the inner bucket and the step's outcome."""

    __slots__ = ("inner", "span", "status", "error", "device", "placeholder")

    def __init__(self, inner: Bucket, span: tuple[int, int]) -> None:
        self.inner, self.span = inner, span
        self.status: int = OK
        self.error: BaseException | None = None
        #: The empty stand-in for an inner allgather this shard's exchange did not start.
        self.placeholder: Any = None
        #: Where the bucket's gradient lives (set at each submission).
        self.device = torch.device("cpu")


class NodeExchange:
    """The node-aware stages (module docstring) of the buckets of ``wire`` (the outer, flat
    wire: its compressor, collectives, tap, seconds and byte counts)."""

    __slots__ = ("wire", "topology", "node", "cross", "deadline", "_shards")

    def __init__(self, wire: Wire, topology: Topology, *, deadline: Deadline) -> None:
        if topology.ranks != wire.comm.size or topology.rank != wire.comm.rank:
            raise ValueError(f"topology {topology} does not match the process set "
                             f"(rank {wire.comm.rank} of {wire.comm.size})")
        self.wire, self.topology, self.deadline = wire, topology, deadline
        self.node = PeerCollectives(wire.comm, topology.node_peers())
        self.cross = Wire(wire.compression, PeerCollectives(wire.comm, topology.cross_peers()),
                          stream_rank=wire.stream_rank, deadline=deadline)
        self.cross.seconds, self.cross.sent = wire.seconds, wire.sent   # one set of counts
        self._shards: dict[str, _Shard] = {}

    # ------------------------------------------------------------------ the shard
    def _shard(self, bucket: Bucket) -> _Shard:
        """This rank's shard of ``bucket`` in its current mode and coding (cached)."""
        t, B = self.topology, self.wire.q.bucket_size
        inner = inner_mode(bucket.mode)
        shard = self._shards.get(bucket.name)
        if shard is None or shard.inner.mode != inner or shard.inner.numel != (
                shard_span(bucket.numel, t.per_node, B, t.local)[1]):
            lo, n = shard_span(bucket.numel, t.per_node, B, t.local)
            ends = np.cumsum((0,) + bucket.numels)
            clipped = [int(max(0, min(e, lo + n) - max(s, lo))) for s, e in zip(ends, ends[1:])]
            plan = BucketPlan(bucket.index, bucket.name, (), n, inner)
            inner_bucket = Bucket(plan, bucket.names, clipped, masked=bucket.masked,
                                  key=self.memory_key(bucket))
            shard = self._shards[bucket.name] = _Shard(inner_bucket, (lo, n))
        shard.inner.coding = bucket.coding
        return shard

    def memory_key(self, bucket: Bucket) -> str:
        """The error memory's key of this rank's shard of ``bucket``."""
        t = self.topology
        return f"{bucket.name}.{t.nodes}x{t.per_node}.s{t.local}"

    def _mask_bytes(self, bucket: Bucket) -> int:
        return _aligned(bucket.mask_bytes)

    def _count(self, sizes: Sequence[int]) -> None:
        """Bytes to the other ranks of the node (``Wire.sent``'s ``bytes_sent`` and
        ``node_bytes``)."""
        out = sum(n for i, n in enumerate(sizes) if i != self.topology.local)
        self.wire.sent["bytes_sent"] += out
        self.wire.sent["node_bytes"] += out

    def _wait(self, bucket: Bucket, collective: str) -> Received:
        pending, bucket.pending = bucket.pending, None
        started = time.perf_counter()
        wait_until(pending.done, self.deadline, collective, bucket.name, EXCHANGING)
        self.wire.seconds["wait"] += time.perf_counter() - started
        return pending.wait()

    # ------------------------------------------------------------------ A. reduce-scatter
    def submit(self, bucket: Bucket, raw: torch.Tensor,
               present: Sequence[bool] | None = None) -> None:
        """Stage A: shard j of ``raw`` (with this rank's presence mask) to local rank j."""
        t, q = self.topology, self.wire.q
        bucket.table, bucket.step = q.table, q.step
        k = self._mask_bytes(bucket)
        mask = None
        if k:
            mask = torch.zeros(k, dtype=torch.uint8, device=raw.device)
            mask[:bucket.mask_bytes] = Wire.presence_mask(bucket, present, raw.device)
        payloads = []
        for j in range(t.per_node):
            lo, n = shard_span(bucket.numel, t.per_node, q.bucket_size, j)
            part = _bytes(raw[lo:lo + n])
            payloads.append(part if mask is None else torch.cat([part, mask]))
        shard = self._shard(bucket)
        shard.device, n_l = raw.device, shard.span[1]
        self._count([p.numel() for p in payloads])
        bucket.stage = "rs"
        bucket.pending = self.node.alltoall(payloads, reduce_scatter_name(bucket.name),
                                            received=[4 * n_l + k] * t.per_node)

    # ------------------------------------------------------------------ B. between nodes
    def advanceable(self, bucket: Bucket) -> bool:
        """Whether :meth:`advance` would move the bucket on without waiting."""
        if bucket.stage == "rs":
            return bucket.pending is not None and bucket.pending.done()
        if bucket.stage == "cross":
            shard = self._shard(bucket)
            if shard.placeholder is not None:
                return shard.placeholder.done()
            return (shard.status != OK or shard.inner.stage == "done"
                    or self.cross.ready(shard.inner))
        return False

    def advance(self, bucket: Bucket) -> None:
        """One stage on: A → B (the node's average of this rank's shard into the inner
        exchange), the inner two-phase exchange's stage 2, or B → C. Each call issues the same
        collectives on every rank (``torch.distributed`` pairs them by issue order)."""
        if bucket.stage == "rs":
            self._average_shard(bucket)
        elif bucket.stage == "cross":
            shard = self._shard(bucket)
            inner = shard.inner
            if inner.stage == "a2a" and shard.placeholder is None:
                if shard.span[1] == 0:   # the stand-in alltoall of an empty shard
                    self._wait_stand_in(bucket, inner.pending, alltoall_name(bucket.name))
                    inner.pending, inner.stage = None, "done"
                elif shard.status == OK:
                    self._inner(bucket, lambda: self.cross.advance(inner))
                if inner.stage != "ag2":
                    shard.placeholder = self._stand_in(bucket, "ag", shard.device)
            else:
                self._node_gather(bucket)

    def _stand_in(self, bucket: Bucket, collective: str, device: torch.device) -> Any:
        """An inner collective with nothing to send. Every inner collective is one of the whole
        process set (:class:`PeerCollectives`), so the M ranks of a shard whose exchange has
        nothing to do — an empty shard, or an exchange skipped or failed after its alltoall
        (the same on those M ranks) — still join the ones the other local ranks' exchanges
        issue: "a2a" (the alltoall) or "ag" (the allgather)."""
        empty = torch.zeros(0, dtype=torch.uint8, device=device)
        comm = self.cross.comm
        if collective == "a2a":
            return comm.alltoall([empty] * comm.size, alltoall_name(bucket.name),
                                 variable=bucket.variable)
        return comm.allgather(empty, allgather_name(bucket.name), lambda _: None,
                              delimit=(lambda flat, count: [0] * count) if bucket.variable
                              else None)

    def _wait_stand_in(self, bucket: Bucket, pending: Any, collective: str) -> None:
        wait_until(pending.done, self.deadline, collective, bucket.name, EXCHANGING)
        pending.wait()

    def _average_shard(self, bucket: Bucket) -> None:
        t, shard = self.topology, self._shard(bucket)
        received = self._wait(bucket, reduce_scatter_name(bucket.name))
        rows = received.row_list()
        n = shard.span[1]
        started = time.perf_counter()
        total = _floats(rows[0], n).clone()
        for row in rows[1:]:   # in local-rank order: the same sum wherever it is computed
            total += _floats(row, n)
        total /= t.per_node
        present = None
        if bucket.masked:
            seen = np.bitwise_or.reduce(np.stack(
                [r[4 * n:4 * n + bucket.mask_bytes].cpu().numpy() for r in rows]), axis=0)
            present = np.unpackbits(seen)[:len(bucket.names)].astype(bool).tolist()
        self.wire.seconds["decode"] += time.perf_counter() - started
        bucket.stage = "cross"
        shard.status, shard.error, shard.placeholder = OK, None, None
        inner = shard.inner
        inner.reset()
        if n == 0:   # an empty shard: its M ranks stand in for the inner exchange alike
            inner.result = total
            inner.gone = [] if present is None else [i for i, s in enumerate(present) if not s]
            if inner.mode == "two_phase":
                inner.stage = "a2a"
                inner.pending = self._stand_in(bucket, "a2a", shard.device)
            else:
                inner.stage = "done"
                shard.placeholder = self._stand_in(bucket, "ag", shard.device)
            return
        self.cross.tap = self.wire.tap
        self._inner(bucket, lambda: self.cross.submit(inner, total, present))

    def _inner(self, bucket: Bucket, run: Callable[[], Any]) -> None:
        """Run an inner stage; its error is kept for stage C (the node must meet there)."""
        shard = self._shard(bucket)
        if shard.status != OK:
            return
        try:
            run()
        except codec.NonFiniteGradientError as exc:
            shard.status, shard.error = NONFINITE, exc
        except Exception as exc:  # noqa: BLE001 - raised again after stage C, on every rank
            shard.status, shard.error = FAILED, exc

    # ------------------------------------------------------------------ C. allgather
    def _node_gather(self, bucket: Bucket) -> None:
        """Finish the inner exchange, start stage C: the averaged shard and its trailer."""
        t, shard = self.topology, self._shard(bucket)
        inner = shard.inner
        result = None
        if shard.placeholder is not None:
            placeholder, shard.placeholder = shard.placeholder, None
            self._wait_stand_in(bucket, placeholder, allgather_name(bucket.name))
        if shard.status == OK and inner.stage != "done":
            self._inner(bucket, lambda: self.cross.finish(inner))
        if shard.status == OK:
            result = inner.result
            if inner.skipped:
                shard.status = SKIPPED
        n, k = shard.span[1], self._mask_bytes(bucket)
        head = np.zeros(1, dtype=TRAILER)
        head["status"], head["node"], head["element"] = shard.status, -1, -1
        if shard.status == NONFINITE:
            first = getattr(shard.error, "first", None)
            head["node"] = getattr(shard.error, "rank", None) or 0
            head["element"] = -1 if first is None else shard.span[0] + first
        trailer = torch.zeros(_aligned(TRAILER.itemsize + k), dtype=torch.uint8)
        trailer[:TRAILER.itemsize] = torch.from_numpy(head.view(np.uint8).copy())
        if k:   # the parameters this shard's exchange saw a gradient for (all: none gone)
            seen = np.ones(len(bucket.names), dtype=bool)
            if shard.status == OK:
                seen[list(inner.gone)] = False
            trailer[TRAILER.itemsize:TRAILER.itemsize + bucket.mask_bytes] = torch.from_numpy(
                np.packbits(seen))
        values = result if shard.status == OK else torch.zeros(n, device=shard.device)
        payload = torch.cat([_bytes(values), trailer.to(values.device)])
        sizes = [4 * shard_span(bucket.numel, t.per_node, self.wire.q.bucket_size, j)[1]
                 + trailer.numel() for j in range(t.per_node)]
        self._count([payload.numel()] * t.per_node)
        bucket.stage = "ig"
        bucket.pending = self.node.alltoall([payload] * t.per_node,
                                            node_gather_name(bucket.name), received=sizes)

    def finish(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's average: the stages still to go, then the L shards of stage C."""
        while bucket.stage in ("rs", "cross"):
            self.advance(bucket)
        if bucket.stage == "done":
            return bucket.result
        t, q = self.topology, self.wire.q
        rows = self._wait(bucket, node_gather_name(bucket.name)).row_list()
        result = torch.empty(bucket.numel, dtype=torch.float32, device=rows[0].device)
        heads, gone_seen = [], None
        for j, row in enumerate(rows):
            lo, n = shard_span(bucket.numel, t.per_node, q.bucket_size, j)
            result[lo:lo + n] = _floats(row, n)
            tail = row[4 * n:].cpu().numpy()
            heads.append(tail[:TRAILER.itemsize].view(TRAILER)[0])
            if bucket.mask_bytes:
                bits = np.unpackbits(tail[TRAILER.itemsize:TRAILER.itemsize + bucket.mask_bytes])
                seen = bits[:len(bucket.names)].astype(bool)   # the set's, or a node's (fewer)
                gone_seen = seen if gone_seen is None else gone_seen | seen
        bucket.gone = [] if gone_seen is None else [i for i, s in enumerate(gone_seen) if not s]
        statuses = [int(h["status"]) for h in heads]
        worst = max(statuses)
        if worst in (NONFINITE, FAILED):
            bucket.stage = "done"
            self._raise(bucket, worst, heads[statuses.index(worst)], statuses.index(worst))
        if worst == SKIPPED:
            result.fill_(float("nan"))
            bucket.skipped = True
        bucket.result, bucket.stage = result, "done"
        return result


    def _raise(self, bucket: Bucket, status: int, head: Any, j: int) -> None:
        """The same error on every rank of the job: a non-finite marker names the ranks of the
        node it came from (their average carried it) and the parameter; another failure is
        raised as it was where it happened, and named elsewhere."""
        error = self._shard(bucket).error
        if status == NONFINITE:
            node, element = int(head["node"]), int(head["element"])
            L = self.topology.per_node
            ranks = f"{node * L}–{node * L + L - 1} (node {node}, whose average carried it)"
            raise codec.NonFiniteGradientError(nonfinite_message(
                ranks, bucket.param_at(None if element < 0 else element), bucket.name),
                None if element < 0 else element)
        if error is not None:
            raise error
        raise RuntimeError(f"horovod_aq: bucket {bucket.name}: the exchange of its shard {j} "
                           f"between nodes failed on local rank {j} of every node (that rank's "
                           "error names the cause; docs/protocol.md §5.7)")


def build_wire(compression: Any, comm: Collectives, *, stream_rank: int, deadline: Deadline,
               topology: Topology | None, defer: bool = False) -> Wire:
    """The engine of a packed exchange: a :class:`~horovod_aq.torch.wire.Wire` over ``comm``,
    with the node-aware stages attached on a ``topology`` (None: flat modes only). ``defer``:
    the flat buckets' final flags wait for ``Wire.settle`` (the node-aware stages decide theirs
    at once: their results travel on)."""
    wire = Wire(compression, comm, stream_rank=stream_rank, deadline=deadline, defer=defer)
    if topology is not None:
        wire.node = NodeExchange(wire, topology, deadline=deadline)
    return wire


__all__ = ["NodeExchange", "PeerCollectives", "build_wire", "node_gather_name",
           "reduce_scatter_name"]
