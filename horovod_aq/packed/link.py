"""The link model and the codec costs, fitted from the job's own collectives
(docs/protocol.md §5.5).

**Samples.** The wire records, during the measurement steps, each collective it issued as a
:class:`LinkSample` (kind, the bytes this rank handed to it, ranks P, seconds from issue to
completion) and each encode or decode as a :class:`CodecSample` (coding, operation, coordinates,
seconds).

**Ring model.** A collective of kind k on P ranks runs r_k rounds; each pays the latency α and
moves its bytes at the bandwidth β (bytes handed in: s):

==========  ===========  ======================
kind        rounds r     bytes per round
==========  ===========  ======================
allgather   P − 1        s        (each rank's block)
alltoall    P − 1        s / P    (one chunk)
allreduce   2 (P − 1)    s / P    (ring reduce-scatter + allgather)
==========  ===========  ======================

    T = r·α + v/β,   v = r · (bytes per round)      linear in (α, 1/β)

**Fit** (:func:`fit_link`). Issue-to-completion times are never shorter than the transfer, only
longer (a collective waits for the slowest rank, overlaps the backward pass, queues behind
another), so the fit is made robust from below:

1. samples are grouped into classes of (kind, P, bytes per round within a quarter octave); each
   class is represented by the ``LOW_QUANTILE`` of its seconds;
2. (α, 1/β) ≥ 0 minimise the *relative* squared error Σ_c ((r_c α + v_c/β − t_c)/t_c)², so a
   1 ms latency-bound class weighs as much as a 1 s bandwidth-bound one;
3. classes measured ``OUTLIER_EXCESS`` above the fit (every sample of them overlapped) are
   dropped once and the fit is repeated;
4. α and β are clamped to physical values (``LATENCY_RANGE``, ``BANDWIDTH_RANGE``).

β is identified only when the classes' bytes per round differ by at least ``SIZE_SPREAD``.
Otherwise (every collective moved about the same s̄ per round, at a per-round time τ) the model
keeps the measured point and assumes the latency: α = min(``FALLBACK_LATENCY``, τ/2),
β = s̄/(τ − α); :attr:`LinkModel.identified` is False and :attr:`LinkModel.note` and a log line
say so. Such a model also knows the two extremes the point allows (:meth:`LinkModel.plausible`:
all latency, α = τ; all bandwidth, β = s̄/(τ − α_min)), and the choice leaves the fixed wire only
when it wins under every one of them.

**Codec costs** (:func:`fit_codec`): per (coding, operation) the seconds of one call,
t = κ + c·n (κ per call, c per coordinate), fitted the same way over classes of n; with a
single size, κ = 0 and c = t/n.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

#: Collective kinds the ring model knows (the rows of the module docstring's table).
KINDS = ("allgather", "alltoall", "allreduce")
#: Codings of a payload body (docs/format.md §12) and the timed codec operations.
CODINGS = ("fixed", "entropy")
OPERATIONS = ("encode", "decode")

#: Quantile of a class's seconds that represents it: a collective is never faster than its
#: transfer, only slower (waits, overlap), so a low quantile estimates the transfer; not the
#: minimum, which one lucky clock reading decides.
LOW_QUANTILE = 0.2
#: Size classes per octave of bytes per round: samples within a quarter octave (±9 %) pool
#: (entropy-coded payloads of one bucket differ by a few percent from step to step and rank to
#: rank).
CLASSES_PER_OCTAVE = 4
#: A class measured this much (relative) above the first fit is treated as overlapped and
#: dropped before the second fit.
OUTLIER_EXCESS = 0.5
#: β is identifiable only when the classes' bytes per round span at least this ratio (fixed and
#: entropy-coded payloads of ALQ 3-bit codes differ by about 1.7-2.5x, format.md §12).
SIZE_SPREAD = 1.5
#: Physical range of the per-round latency α, seconds: 1 µs (below any network's software round
#: trip, NVLink included) to 100 ms (longer is a stall, not latency).
LATENCY_RANGE = (1e-6, 0.1)
#: Physical range of the bandwidth β, bytes/s: 125 kB/s (1 Mbit/s) to 1 TB/s (above NVLink 4).
BANDWIDTH_RANGE = (1.25e5, 1e12)
#: Latency assumed when the samples cannot separate α from β: NetworkModel's 50 µs
#: (horovod_aq.packed.cost, a 10 Gbit/s Ethernet round).
FALLBACK_LATENCY = 50e-6


# ---------------------------------------------------------------------------------- samples
@dataclass(frozen=True)
class LinkSample:
    """One collective this rank issued: ``kind`` (one of ``KINDS``), ``nbytes`` handed to it by
    this rank (allgather: its block; alltoall: all its P chunks; allreduce: the tensor),
    ``ranks`` P ≥ 2, ``seconds`` from issue to completion (> 0)."""

    kind: str
    nbytes: float
    ranks: int
    seconds: float

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"collective kind must be one of {KINDS}, got {self.kind!r}")
        if not self.nbytes > 0 or not math.isfinite(self.nbytes):
            raise ValueError(f"a link sample needs bytes > 0, got {self.nbytes!r}: record only "
                             "collectives that moved data")
        if int(self.ranks) != self.ranks or self.ranks < 2:
            raise ValueError(f"a link sample needs ranks >= 2, got {self.ranks!r}: a collective "
                             "of one rank moves nothing over a link, do not record it")
        if not self.seconds > 0 or not math.isfinite(self.seconds):
            raise ValueError(f"a link sample needs finite seconds > 0, got {self.seconds!r}: "
                             "time the collective from issue to completion")

    @property
    def rounds(self) -> int:
        """r: the ring rounds of this collective."""
        return ring_rounds(self.kind, self.ranks)

    @property
    def round_bytes(self) -> float:
        """Bytes moved in one round."""
        return round_bytes(self.kind, self.nbytes, self.ranks)


@dataclass(frozen=True)
class CodecSample:
    """One timed encode or decode call: ``coding`` (``CODINGS``), ``operation``
    (``OPERATIONS``), ``coordinates`` it encoded or decoded (> 0; a decode of P rows of n
    coordinates is P·n), ``seconds`` (> 0)."""

    coding: str
    operation: str
    coordinates: float
    seconds: float

    def __post_init__(self) -> None:
        if self.coding not in CODINGS:
            raise ValueError(f"coding must be one of {CODINGS}, got {self.coding!r}")
        if self.operation not in OPERATIONS:
            raise ValueError(f"operation must be one of {OPERATIONS}, got {self.operation!r}")
        if not self.coordinates > 0 or not math.isfinite(self.coordinates):
            raise ValueError(f"a codec sample needs coordinates > 0, got {self.coordinates!r}")
        if not self.seconds > 0 or not math.isfinite(self.seconds):
            raise ValueError(f"a codec sample needs finite seconds > 0, got {self.seconds!r}")


def ring_rounds(kind: str, ranks: int) -> int:
    """r of the ring model: P − 1, or 2(P − 1) for allreduce."""
    if kind not in KINDS:
        raise ValueError(f"collective kind must be one of {KINDS}, got {kind!r}")
    return 2 * (ranks - 1) if kind == "allreduce" else ranks - 1


def round_bytes(kind: str, nbytes: float, ranks: int) -> float:
    """Bytes per round: s for allgather, s/P for alltoall and allreduce."""
    return float(nbytes) if kind == "allgather" else float(nbytes) / ranks


# ---------------------------------------------------------------------------------- models
@dataclass(frozen=True)
class LinkModel:
    """α (``latency``, s per round) and β (``bandwidth``, bytes/s) of the ring model.

    ``identified``: whether the samples determined β (else α was assumed); ``clamped``: whether
    α or β hit ``LATENCY_RANGE`` / ``BANDWIDTH_RANGE``; ``classes``: size classes used.
    """

    latency: float
    bandwidth: float
    identified: bool = True
    clamped: bool = False
    classes: int = 0
    #: The measured point (s̄ bytes per round, τ seconds per round) of an unidentified model.
    point: tuple[float, float] | None = None

    def plausible(self) -> tuple[LinkModel, ...]:
        """The models the samples allow: this one if identified; else this one and the two
        extremes through the measured point (all latency; all bandwidth)."""
        if self.identified or self.point is None:
            return (self,)
        s_bar, tau = self.point
        lo_a, hi_a = LATENCY_RANGE
        lo_b, hi_b = BANDWIDTH_RANGE
        latency_bound = LinkModel(min(max(tau, lo_a), hi_a), hi_b, False, True, self.classes)
        beta = s_bar / max(tau - lo_a, 1e-300)
        bandwidth_bound = LinkModel(lo_a, min(max(beta, lo_b), hi_b), False, True, self.classes)
        return (self, latency_bound, bandwidth_bound)

    def seconds(self, kind: str, nbytes: float, ranks: int) -> float:
        """T = r·(α + bytes per round/β); 0 on one rank."""
        if ranks <= 1:
            return 0.0
        r = ring_rounds(kind, ranks)
        return r * (self.latency + round_bytes(kind, nbytes, ranks) / self.bandwidth)

    @property
    def note(self) -> str:
        """How the model was obtained, for log lines."""
        parts = [f"fitted on {self.classes} size classes" if self.identified else
                 f"β not identifiable from {self.classes} size class(es) of about one size: "
                 f"assumed α, β reproduces the measured time"]
        if self.clamped:
            parts.append("clamped to physical range")
        return "; ".join(parts)


@dataclass(frozen=True)
class CodecCost:
    """Seconds of one encode or decode call of n coordinates: κ + c·n."""

    per_call: float
    per_coordinate: float

    def seconds(self, coordinates: float) -> float:
        return self.per_call + self.per_coordinate * coordinates


@dataclass(frozen=True)
class CodecCosts:
    """Measured :class:`CodecCost` per coding and operation (None: not measured)."""

    fixed_encode: CodecCost | None = None
    fixed_decode: CodecCost | None = None
    entropy_encode: CodecCost | None = None
    entropy_decode: CodecCost | None = None

    def cost(self, coding: str, operation: str) -> CodecCost | None:
        return getattr(self, f"{coding}_{operation}")

    def measured(self, coding: str) -> bool:
        """Whether both operations of ``coding`` were measured."""
        return all(self.cost(coding, op) is not None for op in OPERATIONS)


# ---------------------------------------------------------------------------------- fitting
def size_class(x: float) -> int:
    """The quarter octave of ``x`` > 0: round(CLASSES_PER_OCTAVE·log₂ x)."""
    return round(CLASSES_PER_OCTAVE * math.log2(x))


def fit_two(u: np.ndarray, v: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """(a, g) ≥ 0 minimising Σ_i ((a·u_i + g·v_i − t_i)/t_i)² (non-negative least squares of
    two unknowns: the normal equations, else the better of the two one-unknown boundaries)."""
    x1, x2, w = u / t, v / t, np.ones_like(t)
    s11, s12, s22 = x1 @ x1, x1 @ x2, x2 @ x2
    b1, b2 = x1 @ w, x2 @ w
    det = s11 * s22 - s12 * s12
    if det > 1e-12 * s11 * s22:
        a, g = (s22 * b1 - s12 * b2) / det, (s11 * b2 - s12 * b1) / det
        if a >= 0 and g >= 0:
            return float(a), float(g)

    def loss(a: float, g: float) -> float:
        return float(np.sum((a * x1 + g * x2 - w) ** 2))

    only_a = (max(b1 / s11, 0.0), 0.0) if s11 > 0 else (0.0, 0.0)
    only_g = (0.0, max(b2 / s22, 0.0)) if s22 > 0 else (0.0, 0.0)
    return min(only_a, only_g, key=lambda p: loss(*p))


def _classes(keys: Sequence[tuple], u: np.ndarray, v: np.ndarray,
             t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One point per class key: the medians of u and v, the ``LOW_QUANTILE`` of t."""
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    rows = [(np.median(u[idx]), np.median(v[idx]), np.quantile(t[idx], LOW_QUANTILE))
            for idx in groups.values()]
    cu, cv, ct = (np.array(col, dtype=np.float64) for col in zip(*rows))
    return cu, cv, ct


def _robust_fit(u: np.ndarray, v: np.ndarray, t: np.ndarray) -> tuple[float, float, int]:
    """:func:`fit_two`, then again without the classes ``OUTLIER_EXCESS`` above the fit."""
    a, g = fit_two(u, v, t)
    keep = t <= (1 + OUTLIER_EXCESS) * (a * u + g * v)
    if 2 <= keep.sum() < t.size and _spread(v[keep] / u[keep]) >= SIZE_SPREAD:
        a, g = fit_two(u[keep], v[keep], t[keep])
        return a, g, int(keep.sum())
    return a, g, t.size


def _spread(x: np.ndarray) -> float:
    return float(x.max() / x.min())


def fit_link(samples: Iterable[LinkSample]) -> LinkModel:
    """Fit α and β of the ring model to ``samples`` (the module docstring's procedure).

    Raises ``ValueError`` without samples. When the samples cannot identify β (their bytes per
    round span less than ``SIZE_SPREAD``) the model is the documented fallback, logged once here.
    """
    samples = list(samples)
    if not samples:
        raise ValueError("no link samples to fit: record the collectives of the measurement "
                         "steps (LinkSample: kind, bytes, ranks, seconds) before fitting")
    r = np.array([s.rounds for s in samples], dtype=np.float64)
    per_round = np.array([s.round_bytes for s in samples], dtype=np.float64)
    t = np.array([s.seconds for s in samples], dtype=np.float64)
    keys = [(s.kind, s.ranks, size_class(b)) for s, b in zip(samples, per_round)]
    cr, cb, ct = _classes(keys, r, per_round, t)
    cv = cr * cb
    lo_a, hi_a = LATENCY_RANGE
    lo_b, hi_b = BANDWIDTH_RANGE
    if len(ct) >= 2 and _spread(cb) >= SIZE_SPREAD:
        alpha, gamma, used = _robust_fit(cr, cv, ct)
        beta = 1.0 / gamma if gamma > 0 else math.inf
        identified = True
    else:
        tau = float(np.median(ct / cr))
        s_bar = float(np.median(cb))
        alpha = min(FALLBACK_LATENCY, tau / 2)
        beta = s_bar / (tau - alpha)
        identified, used = False, len(ct)
    a_c, b_c = min(max(alpha, lo_a), hi_a), min(max(beta, lo_b), hi_b)
    model = LinkModel(a_c, b_c, identified, (a_c, b_c) != (alpha, beta), used,
                      None if identified else (s_bar, tau))
    if not identified:
        logger.info("horovod_aq: link model: %s (%.0f bytes per round, %.3g s per round); "
                    "α = %.3g s, β = %.3g bytes/s", model.note, s_bar, tau, a_c, b_c)
    return model


def fit_codec(samples: Iterable[CodecSample]) -> CodecCosts:
    """Fit κ and c of every measured (coding, operation); unmeasured ones stay None."""
    samples = list(samples)
    fitted: dict[str, CodecCost] = {}
    for coding in CODINGS:
        for op in OPERATIONS:
            mine = [s for s in samples if s.coding == coding and s.operation == op]
            if mine:
                fitted[f"{coding}_{op}"] = _fit_codec_one(mine)
    return CodecCosts(**fitted)


def _fit_codec_one(samples: list[CodecSample]) -> CodecCost:
    n = np.array([s.coordinates for s in samples], dtype=np.float64)
    t = np.array([s.seconds for s in samples], dtype=np.float64)
    cu, cn, ct = _classes([(size_class(x),) for x in n], np.ones_like(n), n, t)
    if len(ct) >= 2 and _spread(cn) >= SIZE_SPREAD:
        kappa, c, _ = _robust_fit(cu, cn, ct)
        return CodecCost(kappa, c)
    return CodecCost(0.0, float(np.median(ct / cn)))
