"""Which wire each fused bucket takes: fixed or entropy-coded codes, allgather or two-phase
(docs/protocol.md §5.5), from the measured link model and codec costs (:mod:`.link`).

**Payload sizes.** For n coordinates at b bits in quantization buckets of B, with N levels:

    s_fixed(n)   = 32 + 4⌈n/B⌉ + ⌈n·b/8⌉                                   (format.md §1)
    s_entropy(n) = min(s_fixed(n), o(n) + 2⌈h·n/16⌉)                       (format.md §12)
    o(n)         = 32 + 4⌈n/B⌉ + 16 + (4K + 2)·nblk(n) + 2N                (everything but WORDS)

where h is the bucket's measured body bits per coordinate, h = 8·(bytes − o(n))/n of the
entropy payloads seen in the measurement steps (:func:`body_bits`). The min is the format's
rule: an entropy-coded payload is never larger than the fixed one.

**Step time of one bucket** (ring model T_k(s) of :class:`~.link.LinkModel`; encode/decode
costs E, D of the coding, one call each as the wire times them; m = two-phase chunk numel):

    T_allgather = T_allgather(s(n))                + E(n)   + D(P·n)
    T_two_phase = T_alltoall(P·s(m)) + T_allgather(s(m))
                                                   + E(P·m) + D(P·m) + E(m) + D(P·m)

With the constant α, β, c of ``NetworkModel`` these are cost.py's T_allgather and T_two_phase.

**Rule** (:func:`choose_wire`). The allowed modes are cost.py's: allgather alone for P ≤ 2,
two-phase alone from ``TWO_PHASE_MIN_RANKS``, both in between (or the user's forced mode).
Entropy is a candidate only when both of its codec operations and the bucket's h were measured.
Candidates are visited in ``PREFERENCE`` order — fixed before entropy (cheaper to compute, no
size uncertainty), allgather before two-phase (quantizes once) — and a candidate replaces the
current choice only when its modelled time is at most (1 − ``MARGIN``)·T_current — under every
link model the samples allow (:meth:`~.link.LinkModel.plausible`: the fit, or when β was not
identifiable, also the all-latency and all-bandwidth extremes). So a choice other than the first
(fixed) candidate is modelled at least ``MARGIN`` faster than every candidate it displaced, and
with an identified link the choice is within 1/(1 − ``MARGIN``) of the fastest candidate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from horovod_aq.codec.entropy_format import entropy_payload_size
from horovod_aq.codec.format import payload_size
from horovod_aq.packed.cost import TWO_PHASE_MIN_RANKS, NetworkModel, chunk_numel
from horovod_aq.packed.link import CODINGS, CodecCost, CodecCosts, LinkModel

#: What a ``wire=`` setting accepts: "auto" (this module's choice), or a forced coding.
WIRES = ("auto",) + CODINGS
#: Exchange modes of a bucket (cost.py).
MODES = ("allgather", "two_phase")
#: Order in which candidates are considered; an earlier one wins ties (module docstring).
PREFERENCE = (("fixed", "allgather"), ("entropy", "allgather"),
              ("fixed", "two_phase"), ("entropy", "two_phase"))
#: Least modelled gain (relative) for leaving a more preferred wire: larger than the fit's
#: error (tests/test_link_choice.py recovers β within 10 % and α within 25 % of a latency that
#: is a small part of a bucket's time), so model error alone does not pick a loss.
MARGIN = 0.15


@dataclass(frozen=True)
class WireChoice:
    """One bucket's wire: ``coding`` (``CODINGS``), ``mode`` (``MODES``), the modelled
    ``seconds`` of the choice and of the fixed wire in the same mode allowed first
    (``fixed_seconds``), the payload's modelled ``bits_per_coordinate`` (header and norms
    included; entropy: from the measured h)."""

    coding: str
    mode: str
    seconds: float = 0.0
    fixed_seconds: float = 0.0
    bits_per_coordinate: float = 0.0


# ---------------------------------------------------------------------------------- sizes
def entropy_overhead(numel: int, bits: int, bucket_size: int, num_levels: int) -> int:
    """o(n): the bytes of an entropy-coded payload that are not WORDS."""
    return entropy_payload_size(numel, bits, bucket_size, num_levels, 0)


def body_bits(numel: int, nbytes: int, bits: int, bucket_size: int, num_levels: int) -> float:
    """h = 8·(bytes − o(n))/n: body bits per coordinate of one payload of ``numel`` coordinates
    that had ``nbytes`` bytes on the wire (a payload the encoder wrote fixed because entropy
    did not pay counts too: its h is about b). Raises ``ValueError`` for a size no payload of
    this bucket can have."""
    if numel <= 0:
        raise ValueError(f"a payload holds at least one coordinate, got numel={numel}")
    fixed = payload_size(numel, bits, bucket_size)
    if not 0 < nbytes <= fixed:
        raise ValueError(f"a payload of {numel} coordinates at {bits} bits has 1..{fixed} bytes "
                         f"(an entropy-coded one is never larger than the fixed one, format.md "
                         f"§12), got {nbytes}")
    return max(0.0, 8.0 * (nbytes - entropy_overhead(numel, bits, bucket_size, num_levels))
               / numel)


def payload_bytes(coding: str, numel: int, bits: int, bucket_size: int, num_levels: int,
                  h: float | None) -> int:
    """s_fixed(n), or s_entropy(n) from the body bits per coordinate ``h``."""
    fixed = payload_size(numel, bits, bucket_size)
    if coding == "fixed":
        return fixed
    if h is None:
        raise ValueError("the entropy-coded size needs the measured body bits per coordinate")
    words = math.ceil(h * numel / 16)
    return min(fixed, entropy_payload_size(numel, bits, bucket_size, num_levels, words))


# ---------------------------------------------------------------------------------- time
def _codec(costs: CodecCosts, coding: str, fallback: float) -> tuple[CodecCost, CodecCost]:
    """(E, D) of ``coding``; unmeasured fixed costs fall back to NetworkModel's c."""
    e, d = costs.cost(coding, "encode"), costs.cost(coding, "decode")
    if coding == "fixed":
        e = e or CodecCost(0.0, fallback)
        d = d or CodecCost(0.0, fallback)
    if e is None or d is None:
        raise ValueError(f"the {coding} codec was not measured")
    return e, d


def bucket_seconds(coding: str, mode: str, numel: int, *, bits: int, bucket_size: int,
                   num_levels: int, ranks: int, link: LinkModel, codec: CodecCosts,
                   h: float | None = None) -> float:
    """The modelled step time of one bucket on one wire (module docstring)."""
    p, n = ranks, numel
    if p <= 1:
        return 0.0
    enc, dec = _codec(codec, coding, NetworkModel().codec_cost)
    if mode == "allgather":
        s = payload_bytes(coding, n, bits, bucket_size, num_levels, h)
        return link.seconds("allgather", s, p) + enc.seconds(n) + dec.seconds(p * n)
    if mode == "two_phase":
        m = chunk_numel(n, p, bucket_size)
        s_p = payload_bytes(coding, m, bits, bucket_size, num_levels, h)
        return (link.seconds("alltoall", p * s_p, p) + link.seconds("allgather", s_p, p)
                + enc.seconds(p * m) + dec.seconds(p * m) + enc.seconds(m) + dec.seconds(p * m))
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def allowed_modes(ranks: int, exchange: str = "auto") -> tuple[str, ...]:
    """cost.py's rule: allgather for P ≤ 2, two-phase from TWO_PHASE_MIN_RANKS, else both;
    a forced ``exchange`` is the only one."""
    if exchange in MODES:
        return (exchange,)
    if exchange != "auto":
        raise ValueError(f"exchange must be 'auto' or one of {MODES}, got {exchange!r}")
    if ranks <= 2:
        return ("allgather",)
    if ranks >= TWO_PHASE_MIN_RANKS:
        return ("two_phase",)
    return MODES


def choose_wire(numel: int, *, bits: int, bucket_size: int, num_levels: int, ranks: int,
                link: LinkModel, codec: CodecCosts, h: float | None,
                wire: str = "auto", exchange: str = "auto",
                margin: float = MARGIN) -> WireChoice:
    """One bucket's :class:`WireChoice` by the rule of the module docstring. ``h``: the bucket's
    measured body bits per coordinate (None: entropy not measured, so fixed); ``wire``:
    ``WIRES`` ("fixed"/"entropy" force the coding); ``exchange``: "auto" or a forced mode."""
    if wire not in WIRES:
        raise ValueError(f"wire must be one of {WIRES}, got {wire!r}")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    if wire == "entropy" and h is None:
        raise ValueError("wire='entropy' needs the bucket's measured body bits per coordinate "
                         "h to model its payload sizes; measure entropy payloads or use 'auto'")
    modes = allowed_modes(ranks, exchange)
    codings = CODINGS if wire == "auto" else (wire,)
    if wire == "auto" and (h is None or not codec.measured("entropy")):
        codings = ("fixed",)
    kw = dict(bits=bits, bucket_size=bucket_size, num_levels=num_levels, ranks=ranks,
              link=link, codec=codec, h=h)
    models = link.plausible()
    current: WireChoice | None = None
    current_ts: list[float] = []
    first_fixed: float | None = None
    for coding, mode in PREFERENCE:
        if coding not in codings or mode not in modes:
            continue
        ts = [bucket_seconds(coding, mode, numel, **{**kw, "link": m}) for m in models]
        if coding == "fixed" and first_fixed is None:
            first_fixed = ts[0]
        if current is None or all(t <= (1 - margin) * c for t, c in zip(ts, current_ts)):
            size = payload_bytes(coding, numel, bits, bucket_size, num_levels, h)
            current, current_ts = WireChoice(coding, mode, ts[0], 0.0, 8.0 * size / numel), ts
    assert current is not None  # modes and codings are never empty
    fixed = first_fixed if first_fixed is not None else current.seconds
    return WireChoice(current.coding, current.mode, current.seconds, fixed,
                      current.bits_per_coordinate)


def choose_wires(numels: Sequence[int], hs: Sequence[float | None], **kw) -> list[WireChoice]:
    """:func:`choose_wire` for every bucket (``numels[i]`` with measured ``hs[i]``)."""
    if len(numels) != len(hs):
        raise ValueError(f"{len(numels)} buckets but {len(hs)} measured entropy sizes")
    return [choose_wire(n, h=h, **kw) for n, h in zip(numels, hs)]
