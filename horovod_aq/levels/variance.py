"""Expected variance of stochastic rounding, symbol probabilities, entropy and Huffman lengths.

Spec: ``docs/quantizers.md`` §3 (rounding), §6 (objective), §10 (symbols). For a table
ℓ_0 = −1 < … < ℓ_{N−1} = 1 and a law F of normalized coordinates r ∈ [−1, 1]:

    V(ℓ; F) = Σ_{j=0}^{N−2} S(ℓ_j, ℓ_{j+1}),   S(c, d) = ∫_c^d (r − c)(d − r) dF(r)      (§6)

so that a bucket of B coordinates following F has E‖Q(v) − v‖²/‖v‖² ≈ B·V. S is evaluated in
closed form (``distribution`` module docstring); no quadrature is involved. The symbol J sent
for a coordinate has (§10)

    P(J = j) = ∫_{ℓ_{j−1}}^{ℓ_j} (r − ℓ_{j−1})/(ℓ_j − ℓ_{j−1}) dF
               + ∫_{ℓ_j}^{ℓ_{j+1}} (ℓ_{j+1} − r)/(ℓ_{j+1} − ℓ_j) dF.

Interval by interval, U_j = ∫_{ℓ_j}^{ℓ_{j+1}} (r − ℓ_j) dF / (ℓ_{j+1} − ℓ_j) is the probability
of rounding up and M0_j − U_j that of rounding down, so P_j = U_{j−1} + (M0_j − U_j).

Every function here accepts any ``model.Distribution`` on [−1, 1] — the truncated-normal
mixture (``distribution``) or the empirical histogram (``histogram.HistogramDistribution``; there
M0, U and S are piecewise polynomials evaluated from prefix sums over the bins) — and gets M0, U
and S from its ``table_terms`` / ``table_variance``.

Relative variance (§6.1) — the γ of error feedback (docs/dynamic.md §2.3):

    γ(ℓ; F) = V(ℓ; F) / E_F[r²],   E_F[r²] = 1 − V({−1, 1}; F)

is E‖Q(v) − v‖²/‖v‖² for a bucket whose coordinates follow F, whatever the norm (L2: E[r²] = 1/B;
L∞: ‖v‖² = ‖v‖∞²·B·E[r²]). ``worst_relative_variance`` is its supremum over every bucket,
γ_sup = sup_v E‖Q(v) − v‖²/‖v‖². ``gaussian_prior`` is F for i.i.d. normal coordinates and
``linf_law`` turns a law of v/‖v‖₂ into one of v/‖v‖∞ (§5.6).
"""

from __future__ import annotations

import heapq
import math

import numpy as np
from scipy.special import ndtr, ndtri

from horovod_aq.levels.distribution import TruncatedNormalMixture
from horovod_aq.levels.histogram import HistogramDistribution
from horovod_aq.levels.model import Distribution
from horovod_aq.levels.table import validate_levels

__all__ = [
    "NORMS",
    "canonical_huffman_codes",
    "entropy",
    "expected_variance",
    "gaussian_prior",
    "huffman_code_lengths",
    "huffman_expected_length",
    "linf_law",
    "relative_variance",
    "second_moment",
    "stochastic_rounding_variance",
    "symbol_probabilities",
    "worst_relative_variance",
]

#: The bucket norms a law of normalized coordinates can refer to (§1).
NORMS = ("l2", "linf")


def expected_variance(levels: object, dist: Distribution) -> float:
    """V(ℓ; F) = Σ_j S(ℓ_j, ℓ_{j+1}) in closed form (§6).

    ``levels`` must be a valid table (``validate_levels``); ``dist`` a ``TruncatedNormalMixture``
    or a ``HistogramDistribution``. For a mixture, multiply by the bucket size B for the
    expected normalized error E‖Q(v) − v‖²/‖v‖²; for the n_b²-weighted histogram of a gradient
    g (``stats.normalized_histogram``), V·Σ(weights) is the expected error E‖Q(g) − g‖² itself
    (up to the binning).
    """
    L = validate_levels(levels)
    _check_dist(dist)
    return float(dist.table_variance(L))


def _check_dist(dist: object) -> None:
    """A ``model.Distribution`` on [−1, 1] (the folded laws of the symmetric fits are not)."""
    if not isinstance(dist, Distribution) or dist.lower != -1.0 or dist.upper != 1.0:
        raise ValueError(
            "dist must be a TruncatedNormalMixture or a HistogramDistribution on [-1, 1] "
            f"(got {type(dist).__name__}); use the law itself, not its folded law"
        )


def _symbol_probabilities_unchecked(dist: Distribution, L: np.ndarray) -> np.ndarray:
    """P_j = U_{j−1}/(ℓ_j − ℓ_{j−1}) + (M0_j − U_j/(ℓ_{j+1} − ℓ_j)) (module docstring)."""
    M0, U, _, _ = dist.table_terms(L)
    gaps = np.diff(L, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        up = np.where(gaps > 0.0, U / gaps, 0.0)
    up = np.clip(up, 0.0, M0)
    down = M0 - up
    P = np.zeros(L.shape, dtype=np.float64)
    P[..., 1:] += up
    P[..., :-1] += down
    return np.clip(P, 0.0, 1.0)


def symbol_probabilities(levels: object, dist: Distribution) -> np.ndarray:
    """P(J = j) for each level j under F (§10); non-negative, sums to 1 up to rounding."""
    L = validate_levels(levels)
    _check_dist(dist)
    return _symbol_probabilities_unchecked(dist, L)


def _entropy_bits(P: np.ndarray) -> float:
    P = P[P > 0.0]
    return float(-(P * np.log2(P)).sum())


def entropy(levels: object, dist: Distribution) -> float:
    """H(J) = −Σ_j P_j log₂ P_j in bits per coordinate (sign included in the signed alphabet)."""
    return _entropy_bits(symbol_probabilities(levels, dist))


def huffman_code_lengths(probs: object) -> np.ndarray:
    """Code lengths of a deterministic Huffman code for ``probs`` (int64 array, same order).

    Tie-breaking is fixed: the two nodes merged at each step are the lightest, ties going to the
    node created first (leaves in symbol order are created before every internal node). The same
    probabilities therefore give the same lengths on every rank. Zero-probability symbols get
    (long) codes too, so any symbol stays encodable. A single symbol gets length 1.
    """
    p = np.asarray(probs, dtype=np.float64).reshape(-1)
    if p.size == 0:
        raise ValueError("huffman_code_lengths needs at least one probability")
    if not np.all(np.isfinite(p)) or np.any(p < 0.0):
        raise ValueError("probabilities must be finite and non-negative")
    n = p.size
    if n == 1:
        return np.ones(1, dtype=np.int64)
    heap: list[tuple[float, int]] = [(float(p[i]), i) for i in range(n)]
    heapq.heapify(heap)
    parent = np.full(2 * n - 1, -1, dtype=np.int64)
    next_id = n
    while len(heap) > 1:
        w1, i1 = heapq.heappop(heap)
        w2, i2 = heapq.heappop(heap)
        parent[i1] = parent[i2] = next_id
        heapq.heappush(heap, (w1 + w2, next_id))
        next_id += 1
    depth = np.zeros(2 * n - 1, dtype=np.int64)
    for node in range(2 * n - 3, -1, -1):  # parents have larger ids than their children
        depth[node] = depth[parent[node]] + 1
    return depth[:n]


def canonical_huffman_codes(lengths: object) -> np.ndarray:
    """Canonical code words (as integers, MSB first) for code ``lengths``.

    Symbols are ordered by (length, symbol index) and numbered consecutively, shifting left when
    the length grows — the standard canonical construction, so the lengths alone define the code.
    """
    ln = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if ln.size == 0 or np.any(ln < 1):
        raise ValueError("code lengths must be positive")
    if sum(2.0 ** (-int(x)) for x in ln) > 1.0 + 1e-12:
        raise ValueError("code lengths violate the Kraft inequality")
    order = np.lexsort((np.arange(ln.size), ln))
    codes = np.zeros(ln.size, dtype=object)
    code = 0
    prev_len = int(ln[order[0]])
    for rank, sym in enumerate(order):
        cur = int(ln[sym])
        if rank > 0:
            code = (code + 1) << (cur - prev_len)
        codes[sym] = code
        prev_len = cur
    return codes


def huffman_expected_length(levels: object, dist: Distribution) -> float:
    """Σ_j P_j·len_j: expected bits per coordinate of the Huffman code built on P (§10).

    Satisfies H ≤ L̄ < H + 1 and L̄ ≤ ⌈log₂ N⌉.
    """
    P = symbol_probabilities(levels, dist)
    return float((P * huffman_code_lengths(P)).sum())


def stochastic_rounding_variance(r: object, levels: object) -> np.ndarray:
    """Per-coordinate variance (ℓ_{j+1} − r)(r − ℓ_j) of unbiased rounding of r (§3).

    ``r`` is clipped to [−1, 1]; j is the interval containing r (either neighbour at a level,
    both giving 0).
    """
    L = validate_levels(levels)
    r = np.clip(np.asarray(r, dtype=np.float64), -1.0, 1.0)
    j = np.clip(np.searchsorted(L, r, side="right") - 1, 0, L.size - 2)
    return np.maximum((L[j + 1] - r) * (r - L[j]), 0.0)


# ----------------------------------------------------------------------------- relative variance
def second_moment(dist: Distribution) -> float:
    """E_F[r²] = 1 − V({−1, 1}; F), since S(−1, 1) = ∫ (r + 1)(1 − r) dF = 1 − E[r²] (§6)."""
    _check_dist(dist)
    return float(1.0 - dist.table_variance(np.array([-1.0, 1.0])))


def relative_variance(levels: object, dist: Distribution) -> float:
    """γ(ℓ; F) = V(ℓ; F)/E_F[r²] (§6.1): E‖Q(v) − v‖²/‖v‖² for a bucket of coordinates ~ F.

    For L2 buckets E[r²] = 1/B and γ = B·V; for L∞ buckets (F = the law of v/‖v‖∞) the same
    ratio holds because ‖v‖² = ‖v‖∞²·B·E[r²].
    """
    m2 = second_moment(dist)
    if not m2 > 0.0:
        raise ValueError("the law has no mass away from 0 (E[r²] = 0)")
    return expected_variance(levels, dist) / m2


def _check_bucket(bucket_size: object, norm: str) -> int:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, (int, np.integer)) \
            or bucket_size < 2:
        raise ValueError(f"bucket_size must be an integer >= 2, got {bucket_size!r}")
    return int(bucket_size)


def _best_penalized(L: np.ndarray, mu: float) -> float:
    """g(μ) = max_{r ∈ [−1, 1]} σ²(r) − μ·r² for μ ≥ −1, σ²(r) = (ℓ_{j+1} − r)(r − ℓ_j) (§3).

    On [c, d] the function −(1 + μ)·r² + (c + d)·r − c·d is concave: its maximum is at
    r* = (c + d)/(2(1 + μ)) clipped to [c, d] (μ = −1: at an end).
    """
    c, d = L[:-1], L[1:]
    if mu > -1.0:
        r = np.clip((c + d) / (2.0 * (1.0 + mu)), c, d)
    else:
        r = np.where(np.abs(c) > np.abs(d), c, d)
    return float(np.max((d - r) * (r - c) - mu * r * r))


def worst_relative_variance(levels: object, bucket_size: int, norm: str = "l2") -> float:
    """γ_sup = sup_v E‖Q(v) − v‖²/‖v‖² over every bucket v of B coordinates (§6.1).

    With g(μ) = max_r σ²(r) − μ·r² (``_best_penalized``):

    * L∞: one coordinate is ±1 (error 0), the others r_i are free, and
      γ = Σ σ²(r_i)/(1 + Σ r_i²). The supremum (all r_i equal) is the root of
      (B − 1)·g(γ) = γ (g decreases, so bisection) — exact.
    * L2: Σ r_i² = 1, so Σ σ²(r_i) = μ + Σ (σ²(r_i) − μ·r_i²) ≤ μ + B·g(μ) for every μ;
      γ_sup ≤ min_μ μ + B·g(μ) (convex in μ; golden-section search on [−1, B·g(0)]). This
      Lagrangian bound exceeds the supremum by at most one coordinate's worth (≤ 1): for the
      zero-free U-ref it gives (B − 1)·ℓ₁² against the exact B·ℓ₁² − 1.
    """
    L = validate_levels(levels)
    b = _check_bucket(bucket_size, norm)
    top = b * _best_penalized(L, 0.0)       # γ_sup ≤ B·max σ² for either norm
    if norm == "linf":
        lo, hi = 0.0, top
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if (b - 1) * _best_penalized(L, mid) > mid:
                lo = mid
            else:
                hi = mid
        return hi
    lo, hi = -1.0, max(top, 0.0)
    inv = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = hi - inv * (hi - lo), lo + inv * (hi - lo)
    f1, f2 = (x + b * _best_penalized(L, x) for x in (x1, x2))
    for _ in range(200):
        if f1 <= f2:
            hi, x2, f2 = x2, x1, f1
            x1 = hi - inv * (hi - lo)
            f1 = x1 + b * _best_penalized(L, x1)
        else:
            lo, x1, f1 = x1, x2, f2
            x2 = lo + inv * (hi - lo)
            f2 = x2 + b * _best_penalized(L, x2)
    return float(min(f1, f2, top))


# ----------------------------------------------------------------------------- L∞ buckets (§5.6)
def _abs_tail(dist: Distribution, t: float) -> float:
    """P(|r| > t) = F(−t) + (1 − F(t))."""
    return float(dist.cdf(-t) + dist.sf(t))


def _component_max(means: np.ndarray, stds: np.ndarray, tail: float) -> np.ndarray:
    """Per component of a truncated-normal mixture: t with P(|r| > t) = tail (bisection)."""
    z = ndtr((1.0 - means) / stds) - ndtr((-1.0 - means) / stds)     # mass on [−1, 1]
    lo, hi = np.zeros_like(means), np.ones_like(means)
    for _ in range(80):
        t = 0.5 * (lo + hi)
        out = (ndtr((-t - means) / stds) - ndtr((-1.0 - means) / stds)
               + ndtr((1.0 - means) / stds) - ndtr((t - means) / stds)) / z
        above = out > tail
        lo, hi = np.where(above, t, lo), np.where(above, hi, t)
    return np.maximum(hi, np.abs(means))


def linf_law(dist: Distribution, bucket_size: int) -> Distribution:
    """The law of v/‖v‖∞ from a law F of v/‖v‖₂ (§5.6): r∞ = r₂/m, clipped to [−1, 1].

    m is the typical bucket maximum of |r₂|: the value exceeded by a fraction 1/B of F's mass,
    P_F(|r₂| > m) = 1/B (on average one of the B coordinates lies above it). A mixture is
    rescaled component by component (each component models one bucket; its L∞ error weight
    ‖v‖∞² = n_b²·m_b² multiplies its weight); a histogram, which pools all buckets, with one m.
    Mass beyond ±1 is the bucket maxima, which the levels ±1 represent exactly, and is dropped.
    """
    b = _check_bucket(bucket_size, "linf")
    tail = 1.0 / b
    if isinstance(dist, TruncatedNormalMixture):
        mu, sd, w = dist.means, dist.stds, dist.weights
        m_b = _component_max(mu, sd, tail)
        return TruncatedNormalMixture(np.clip(mu / m_b, -1.0, 1.0), sd / m_b, w * m_b * m_b)
    if not isinstance(dist, HistogramDistribution):
        raise TypeError(f"linf_law needs a TruncatedNormalMixture or a HistogramDistribution, "
                        f"got {type(dist).__name__}")
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _abs_tail(dist, mid) > tail:
            lo = mid
        else:
            hi = mid
    m = max(hi, 1e-300)
    t = dist.edges / m
    left, right = np.clip(t[:-1], -1.0, 1.0), np.clip(t[1:], -1.0, 1.0)
    keep = right > left
    edges = np.concatenate([left[keep], right[keep][-1:]])
    edges[0], edges[-1] = -1.0, 1.0
    mass = dist.weights[keep] * (right - left)[keep] / (t[1:] - t[:-1])[keep]
    return HistogramDistribution(edges, mass)


def gaussian_prior(bucket_size: int, norm: str = "l2") -> Distribution:
    """F of a bucket of B i.i.d. normal coordinates (§5.1, §5.6): TN(0, 1/B; [−1, 1]) for L2, and
    its ``linf_law`` TN(0, 1/z_B²; [−1, 1]), z_B = Φ⁻¹(1 − 1/(2B)), for L∞."""
    b = _check_bucket(bucket_size, norm)
    if norm == "l2":
        return TruncatedNormalMixture([0.0], [1.0 / math.sqrt(b)], [1.0])
    return TruncatedNormalMixture([0.0], [1.0 / float(ndtri(1.0 - 0.5 / b))], [1.0])
