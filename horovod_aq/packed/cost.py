"""Which wire a fused gradient bucket takes: allgather or the two-phase exchange, flat or
node-aware.

Traffic per rank (docs/protocol.md §5.3), for n coordinates at b bits with quantization buckets of
B coordinates, P ranks, and a payload of s = 32 + 4⌈n/B⌉ + ⌈n·b/8⌉ bytes:

=====================  ===============================================
ring allreduce, fp32   2(P−1)/P · 4n
ring allreduce, fp16   2(P−1)/P · 2n
allgather              (P−1) · s
two-phase              (P−1) · s_P  +  (P−1) · s_P,   s_P = payload of n/P
=====================  ===============================================

Step-time model (a ring collective of P−1 rounds, each paying a latency α and moving its bytes
at bandwidth β; decoding or encoding one coordinate costs c):

    T_allgather = (P−1)(α + s/β)        + c·(n + P·n)          encode once, decode P payloads
    T_two_phase = 2(P−1)(α + s_P/β)     + c·(n + n + n/P + n)  encode P chunks, decode P chunks
                                                                of n/P, re-encode, decode all

Two-phase quantizes twice (the averaged chunk is re-encoded: unbiased, its variance adds), so it
is used only when the model says it is faster, and always from ``TWO_PHASE_MIN_RANKS`` ranks on
(where allgather's bytes grow like P). With two ranks both send the same bytes and allgather
quantizes once, so allgather always wins there.

**Node-aware modes** (docs/protocol.md §5.7), for P = M·L ranks on M nodes of L
(:mod:`.topology`): "node_allgather" and "node_two_phase" reduce-scatter the bucket in fp32
inside the node (shard j: :func:`shard_span`, n_L = ⌈n/B/L⌉·B coordinates), exchange each shard
compressed among the M ranks of its local rank (the inner mode), and allgather the averaged
shards in fp32 inside the node. Per rank, with s_L the inner mode's bytes for n_L coordinates
over M ranks:

    bytes sent    = 2(L−1)/L · 4n (inside the node)  +  s_L (to the other nodes)
    bytes per NIC = L · s_L = 2(M−1)/M · n·b/8 for the two-phase inner mode (norms aside)

    T_node = 2(L−1)(α + 4n_L/β_node) + T_inner(n_L, M; β/L)

where the L ranks of a node share its NIC (bandwidth β/L each, as for a flat exchange on a
topology, whose time is T(n, P; β/L)).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from horovod_aq.codec import payload_size as payload_bytes

#: The flat exchange modes (every rank sends to every other).
FLAT_MODES = ("allgather", "two_phase")
#: The node-aware modes: "node_<inner mode>" (module docstring; they need a topology).
NODE_PREFIX = "node_"
NODE_MODES = tuple(NODE_PREFIX + m for m in FLAT_MODES)
#: Every exchange mode of a bucket.
MODES = FLAT_MODES + NODE_MODES
#: Exchange modes a packed optimizer accepts.
EXCHANGES = ("auto",) + MODES
#: From this many ranks on, "auto" always picks the two-phase exchange (docs/protocol.md §5.3).
TWO_PHASE_MIN_RANKS = 16
#: Bytes per second of a link of one Mbit/s (link rates are quoted in Mbit/s).
BYTES_PER_MBIT = 1e6 / 8


@dataclass(frozen=True)
class NetworkModel:
    """Parameters of the step-time model; defaults describe a 10 Gbit/s Ethernet cluster.

    ``bandwidth`` in bytes/s per link, ``latency`` in seconds per collective round, ``codec_cost``
    in seconds per coordinate encoded or decoded (the order of the CPU kernel throughput
    measured by ``benchmarks/kernels.py``).
    """

    bandwidth: float = 1.25e9
    latency: float = 50e-6
    codec_cost: float = 2e-9
    #: Bytes/s between two ranks of one node (node-aware modes; NVLink-class by default).
    node_bandwidth: float = 1e11


def chunk_numel(numel: int, ranks: int, bucket_size: int) -> int:
    """Coordinates per two-phase chunk: n padded to P equal chunks made of whole buckets."""
    buckets = math.ceil(numel / bucket_size)
    return math.ceil(buckets / ranks) * bucket_size


def inner_mode(mode: str) -> str | None:
    """The inner (cross-node) mode of a node-aware ``mode``; None for a flat one."""
    return mode[len(NODE_PREFIX):] if mode.startswith(NODE_PREFIX) else None


def shard_span(numel: int, per_node: int, bucket_size: int, local: int) -> tuple[int, int]:
    """(start, length) of shard ``local`` of a bucket of ``numel`` coordinates split among the
    L = ``per_node`` ranks of a node: n_L = chunk_numel(n, L, B) coordinates each, the last ones
    shorter or empty (whole quantization buckets, so a shard's norms are the bucket's)."""
    m = chunk_numel(numel, per_node, bucket_size)
    lo = min(local * m, numel)
    return lo, min(lo + m, numel) - lo


def _shards(numel: int, per_node: int, bucket_size: int) -> list[int]:
    return [shard_span(numel, per_node, bucket_size, j)[1] for j in range(per_node)]


def _check_node(mode: str, ranks: int, per_node: int) -> tuple[str, int]:
    inner = inner_mode(mode)
    if inner is None:
        return mode, ranks
    if per_node < 2 or ranks % per_node or ranks == per_node:
        raise ValueError(f"exchange mode {mode!r} needs several nodes of several ranks "
                         f"(P = {ranks} ranks, {per_node} per node)")
    return inner, ranks // per_node


def bytes_sent(mode: str, numel: int, bits: int, bucket_size: int, ranks: int,
               per_node: int = 1) -> int:
    """Bytes one rank sends in one exchange of ``numel`` coordinates (ring algorithms; the
    node-aware modes: the largest shard's, module docstring)."""
    p = ranks
    if p <= 1:
        return 0
    if mode == "allreduce_fp32":
        return math.ceil(2 * (p - 1) / p * 4 * numel)
    if mode == "allreduce_fp16":
        return math.ceil(2 * (p - 1) / p * 2 * numel)
    if mode == "allgather":
        return (p - 1) * payload_bytes(numel, bits, bucket_size)
    if mode == "two_phase":
        return 2 * (p - 1) * payload_bytes(chunk_numel(numel, p, bucket_size), bits, bucket_size)
    if mode in NODE_MODES:
        inner, nodes = _check_node(mode, ranks, per_node)
        n_l = _shards(numel, per_node, bucket_size)[0]
        inside = 2 * 4 * (numel - n_l)   # (L − 1) shards out, its shard to L − 1 peers
        return inside + bytes_sent(inner, n_l, bits, bucket_size, nodes)
    raise ValueError(f"unknown exchange mode {mode!r}")


def nic_bytes(mode: str, numel: int, bits: int, bucket_size: int, ranks: int,
              per_node: int = 1) -> int:
    """Bytes out of one node's network interface in one exchange (every rank of the node,
    whatever goes to a rank of another node): the quantity node-awareness shrinks."""
    nodes = ranks // per_node
    if nodes <= 1:
        return 0
    inner = inner_mode(mode)
    if inner is not None:
        _check_node(mode, ranks, per_node)
        return sum(bytes_sent(inner, n, bits, bucket_size, nodes)
                   for n in _shards(numel, per_node, bucket_size) if n)
    # flat: the share of each rank's bytes that goes to the P − L ranks of other nodes
    return math.ceil(per_node * bytes_sent(mode, numel, bits, bucket_size, ranks)
                     * (ranks - per_node) / (ranks - 1))


def payload_bytes_of(mode: str, numel: int, bits: int, bucket_size: int, ranks: int,
                     per_node: int = 1) -> int:
    """Bytes of this rank's encoded payloads for one bucket: one payload (allgather), or P
    chunk payloads (two-phase); of its shard in the node-aware modes."""
    inner = inner_mode(mode)
    if inner is not None:
        _, nodes = _check_node(mode, ranks, per_node)
        return payload_bytes_of(inner, _shards(numel, per_node, bucket_size)[0], bits,
                                bucket_size, nodes)
    if mode == "two_phase":
        return ranks * payload_bytes(chunk_numel(numel, ranks, bucket_size), bits, bucket_size)
    return payload_bytes(numel, bits, bucket_size)


def transfer_seconds(nbytes: float, mbit_per_s: float) -> float:
    """The bandwidth term of the step-time model (module docstring): seconds for ``nbytes`` to
    cross a link of ``mbit_per_s``, without latency, codec cost or overlap with compute. What
    ``horovod-aq demo`` shows where it cannot time an emulated cluster."""
    if mbit_per_s <= 0:
        raise ValueError(f"mbit_per_s must be positive, got {mbit_per_s}")
    return nbytes / (mbit_per_s * BYTES_PER_MBIT)


def estimate_seconds(
    mode: str, numel: int, bits: int, bucket_size: int, ranks: int,
    model: NetworkModel = NetworkModel(), per_node: int = 1,
) -> float:
    """The model's step time for exchanging one bucket of ``numel`` coordinates
    (module docstring): on a topology (``per_node`` > 1) the L ranks of a node share its
    network link."""
    p, n, c = ranks, numel, model.codec_cost
    if p <= 1:
        return 0.0
    shared = dataclasses.replace(model, bandwidth=model.bandwidth / per_node)
    inner = inner_mode(mode)
    if inner is not None:
        _, nodes = _check_node(mode, ranks, per_node)
        n_l = _shards(numel, per_node, bucket_size)[0]
        inside = 2 * (per_node - 1) * (model.latency + 4 * n_l / model.node_bandwidth)
        return inside + c * n + estimate_seconds(inner, n_l, bits, bucket_size, nodes, shared)
    if mode == "allgather":
        s = payload_bytes(n, bits, bucket_size)
        return (p - 1) * (model.latency + s / shared.bandwidth) + c * (n + p * n)
    if mode == "two_phase":
        m = chunk_numel(n, p, bucket_size)
        s_p = payload_bytes(m, bits, bucket_size)
        return 2 * (p - 1) * (model.latency + s_p / shared.bandwidth) + c * (3 * p * m + m)
    raise ValueError(f"unknown exchange mode {mode!r}; expected one of {MODES}")


def choose_exchange(
    numel: int, bits: int, bucket_size: int, ranks: int, model: NetworkModel = NetworkModel(),
    per_node: int = 1,
) -> str:
    """Pick the mode of one fused bucket: flat "allgather" or "two_phase" by the rule of the
    module docstring; on a topology (``per_node`` L > 1 ranks on each of M > 1 nodes) the
    node-aware mode whose inner mode that rule picks for M ranks, when the model says it is
    faster than the flat one."""
    if ranks <= 2:
        flat = "allgather"
    elif ranks >= TWO_PHASE_MIN_RANKS:
        flat = "two_phase"
    else:
        t_ag = estimate_seconds("allgather", numel, bits, bucket_size, ranks, model, per_node)
        t_tp = estimate_seconds("two_phase", numel, bits, bucket_size, ranks, model, per_node)
        flat = "two_phase" if t_tp < t_ag else "allgather"
    if per_node < 2 or ranks % per_node or ranks == per_node:
        return flat
    nodes = ranks // per_node
    node = NODE_PREFIX + choose_exchange(_shards(numel, per_node, bucket_size)[0], bits,
                                         bucket_size, nodes, model)
    t_node = estimate_seconds(node, numel, bits, bucket_size, ranks, model, per_node)
    t_flat = estimate_seconds(flat, numel, bits, bucket_size, ranks, model, per_node)
    return node if t_node < t_flat else flat


def resolve_exchange(requested: str, numel: int, bits: int, bucket_size: int, ranks: int,
                     model: NetworkModel = NetworkModel(), per_node: int = 1) -> str:
    """Validate a user's ``exchange=`` choice and resolve "auto" with :func:`choose_exchange`."""
    if requested not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {requested!r}")
    if requested == "auto":
        return choose_exchange(numel, bits, bucket_size, ranks, model, per_node)
    if inner_mode(requested) is not None and (per_node < 2 or ranks == per_node):
        raise ValueError(f"exchange={requested!r} needs several nodes of several ranks, and "
                         f"this job of {ranks} ranks has no such topology: declare it with "
                         "HOROVOD_AQ_TOPOLOGY=MxL (docs/protocol.md §5.7), or use a flat "
                         "exchange")
    return requested
