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
"""

from __future__ import annotations

import heapq

import numpy as np

from horovod_aq.levels.model import Distribution
from horovod_aq.levels.table import validate_levels

__all__ = [
    "canonical_huffman_codes",
    "entropy",
    "expected_variance",
    "huffman_code_lengths",
    "huffman_expected_length",
    "stochastic_rounding_variance",
    "symbol_probabilities",
]


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
