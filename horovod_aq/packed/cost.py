"""Which wire a fused gradient bucket takes: allgather or the two-phase exchange.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from horovod_aq.codec import payload_size as payload_bytes

#: Exchange modes a packed optimizer accepts.
EXCHANGES = ("auto", "allgather", "two_phase")
#: From this many ranks on, "auto" always picks the two-phase exchange (docs/protocol.md §5.3).
TWO_PHASE_MIN_RANKS = 16


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


def chunk_numel(numel: int, ranks: int, bucket_size: int) -> int:
    """Coordinates per two-phase chunk: n padded to P equal chunks made of whole buckets."""
    buckets = math.ceil(numel / bucket_size)
    return math.ceil(buckets / ranks) * bucket_size


def bytes_sent(mode: str, numel: int, bits: int, bucket_size: int, ranks: int) -> int:
    """Bytes one rank sends in one exchange of ``numel`` coordinates (ring algorithms)."""
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
    raise ValueError(f"unknown exchange mode {mode!r}")


def payload_bytes_of(mode: str, numel: int, bits: int, bucket_size: int, ranks: int) -> int:
    """Bytes of this rank's encoded payloads for one bucket: one payload (allgather), or P
    chunk payloads (two-phase)."""
    if mode == "two_phase":
        return ranks * payload_bytes(chunk_numel(numel, ranks, bucket_size), bits, bucket_size)
    return payload_bytes(numel, bits, bucket_size)


def estimate_seconds(
    mode: str, numel: int, bits: int, bucket_size: int, ranks: int,
    model: NetworkModel = NetworkModel(),
) -> float:
    """The model's step time for exchanging one bucket of ``numel`` coordinates
    (module docstring)."""
    p, n, c = ranks, numel, model.codec_cost
    if p <= 1:
        return 0.0
    if mode == "allgather":
        s = payload_bytes(n, bits, bucket_size)
        return (p - 1) * (model.latency + s / model.bandwidth) + c * (n + p * n)
    if mode == "two_phase":
        m = chunk_numel(n, p, bucket_size)
        s_p = payload_bytes(m, bits, bucket_size)
        return 2 * (p - 1) * (model.latency + s_p / model.bandwidth) + c * (3 * p * m + m)
    raise ValueError(f"unknown exchange mode {mode!r}; expected 'allgather' or 'two_phase'")


def choose_exchange(
    numel: int, bits: int, bucket_size: int, ranks: int, model: NetworkModel = NetworkModel()
) -> str:
    """Pick "allgather" or "two_phase" for one fused bucket (the rule of the module docstring)."""
    if ranks <= 2:
        return "allgather"
    if ranks >= TWO_PHASE_MIN_RANKS:
        return "two_phase"
    t_ag = estimate_seconds("allgather", numel, bits, bucket_size, ranks, model)
    t_tp = estimate_seconds("two_phase", numel, bits, bucket_size, ranks, model)
    return "two_phase" if t_tp < t_ag else "allgather"


def resolve_exchange(requested: str, numel: int, bits: int, bucket_size: int, ranks: int,
                     model: NetworkModel = NetworkModel()) -> str:
    """Validate a user's ``exchange=`` choice and resolve "auto" with :func:`choose_exchange`."""
    if requested not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {requested!r}")
    if requested == "auto":
        return choose_exchange(numel, bits, bucket_size, ranks, model)
    return requested
