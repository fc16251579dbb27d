"""The empirical (histogram) model of normalized coordinates: a piecewise-uniform law on [−1, 1].

Spec: ``docs/quantizers.md`` §5.1 ("an empirical or histogram CDF model captures heavy tails better;
an optional extension"), §6 (the objective), §7/§8 (the fitters, which accept this model as well
as the truncated-normal mixture of ``distribution``).

Why. The mixture F = Σ_b w_b·TN(m_b, s_b²) has s_b² ≤ 1/(B − 1) for every bucket (§5.1), so it
cannot represent heavy tails or the point mass at 0 of real gradients. The quantity the levels
should minimize is the exact expected error (§3, §5.3)

    E‖Q(g) − g‖² = Σ_b n_b² Σ_{i∈b} σ²(r_i),   σ²(r) = (ℓ_{j+1} − r)(r − ℓ_j),   r_i = v_i/n_b,

i.e. (Σ_i n_{b(i)}²)·V(ℓ; F_emp) for the empirical law F_emp of all normalized coordinates, each
weighted by its bucket's n_b². This module models F_emp by a histogram (``stats`` builds it).

Model. Edges −1 = e_0 < e_1 < … < e_H = 1 and bin masses p_k ≥ 0 (Σ p_k = 1): bin k spreads p_k
uniformly over [e_k, e_{k+1}] with density ρ_k = p_k/w_k, w_k = e_{k+1} − e_k. With the bin
centre μ_k = (e_k + e_{k+1})/2 the full-bin moments are

    ∫_bin dF = p_k,   ∫_bin r dF = p_k·μ_k,   ∫_bin r² dF = p_k·(μ_k² + w_k²/12).

Closed forms (§6). For an interval [c, d] with c in bin i and d in bin k (bin(x) is the k with
e_k ≤ x < e_{k+1}, the last bin closed on the right), D = d − c:

* i = k:  M0 = ρ_i·D,  ∫(r − c) dF = ρ_i·D²/2,  S = ρ_i·D³/6  (no cancellation at all);
* i < k:  the partial bins [c, e_{i+1}] (a = e_{i+1} − c) and [e_k, d] (b = d − e_k) in local
  coordinates, S_left = ρ_i·a²·(D/2 − a/3), S_right = ρ_k·b²·(D/2 − b/3), plus the full bins
  i+1 … k−1 through range sums R_q of the per-bin moments:
  M0_mid = R_0,  ∫(r − c) dF_mid = R_1 − c·R_0,  S_mid = −cd·R_0 + (c + d)·R_1 − R_2.

Range sums are differences of prefix sums stored in double-double (``_dd_cumsum``: the float64
cumulative sum plus the running sum of its exact rounding errors), so a range sum is accurate to
a few ulps of the range itself, however large the prefix: near r = 1 this is the survival-sum
accuracy the spec asks for (§6 numerics), and it also holds for a light interval between heavy
ones. The only cancellation left is in S_mid, where terms of size c²·R_0 combine into
S_mid ≈ R_0·(d − c)²/6; since a full bin lies inside [c, d], d − c is at least one bin width, so
the relative error is below ~ε·6·max(c², d²)/w_min² — about 1e-12 on the default grid (bins are
at least 1.9 % of |r| wide, or 1.9e-6 near 0).

Fitting-specific pieces (used by ``ppf`` and by ALQ's exact updates, ``alq.histogram_updates``):
the root set of F(x) − F(c) = t is located with a binary search on the prefix (or, in the upper
half, suffix) sums and solved exactly inside its bin (F is linear there); where F is flat (empty
bins) the root is a whole interval, returned as (x_lo, x_hi). The density is discontinuous and
may vanish on whole intervals: the objective of one level is still convex (J″ = (d − c)·f ≥ 0)
but may be flat, which the fitters handle.

Default binning (``histogram_edges``): r_k = s0·sinh(t_k·asinh(1/s0)), t_k uniform on [−1, 1]
with ``HISTOGRAM_BINS`` bins and s0 = ``HISTOGRAM_SCALE`` — fine near 0, relatively uniform
(constant Δr/r) for |r| ≫ s0. Binning rule: ``histogram_bin_index``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from horovod_aq.levels.model import TableTerms

__all__ = [
    "HISTOGRAM_BINS",
    "HISTOGRAM_SCALE",
    "FoldedHistogramDistribution",
    "HistogramDistribution",
    "histogram_bin_index",
    "histogram_edges",
]

#: Number of bins H of the default grid. Odd, so that r = 0 (the exact zeros of sparse
#: gradients, often a quarter of all coordinates) sits in the MIDDLE of the central bin
#: [−9.7e-7, 9.7e-7] rather than on an edge: the model of a point mass at 0 stays symmetric and
#: has mean 0. With s0 = 1e-4 the relative bin width for |r| ≫ s0 is 2·asinh(1/s0)/H = 1.93 %
#: (levels and the tail mass are resolved to ~2 %), and the absolute width near 0 is
#: 2·s0·asinh(1/s0)/H = 1.93e-6 (the typical |r| of a bucket of B coordinates is 1/√B ≥ 1e-3 for
#: B ≤ 2^20). H is also not a multiple of 3, which keeps the length 3·top_k + 4 + H of a stats
#: vector with a histogram distinct from every length 3·top_k + 4 without one (``stats``).
#: 1025 float64 weights are 8 KiB per rank in the statistics allgather.
HISTOGRAM_BINS = 1025
#: The scale s0 of the sinh grid: bins are ~uniform (width ≈ 2·s0·asinh(1/s0)/H) for |r| ≲ s0
#: and ~geometric beyond. 1e-4 is well below 1/√B for any practical bucket size.
HISTOGRAM_SCALE = 1e-4


# ----------------------------------------------------------------------------------------------
# edges and the binning rule
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _sinh_edges(num_bins: int, scale: float) -> np.ndarray:
    a = math.asinh(1.0 / scale)
    k = np.arange(num_bins + 1, dtype=np.float64)
    # t_k = (2k − H)/H: |t_k| = |t_{H−k}| exactly (an exact integer over H), so the grid is
    # exactly antisymmetric
    num = 2.0 * k - num_bins
    e = scale * np.sinh((np.abs(num) / num_bins) * a)
    e = np.where(num < 0.0, -e, e)
    e[0], e[-1] = -1.0, 1.0
    if num_bins % 2 == 0:
        e[num_bins // 2] = 0.0
    e.setflags(write=False)
    return e


def histogram_edges(num_bins: int = HISTOGRAM_BINS, scale: float = HISTOGRAM_SCALE) -> np.ndarray:
    """Edges e_0 = −1 < … < e_H = 1 of the sinh grid r_k = s0·sinh(t_k·asinh(1/s0)).

    t_k = −1 + 2k/H (k = 0 … H), s0 = ``scale``. The grid is exactly antisymmetric
    (e_{H−k} = −e_k) with e_0 = −1 and e_H = 1 exactly; for odd H there is no edge at 0, for
    even H e_{H/2} = 0. Returns a read-only float64 array of H + 1 values (cached).
    """
    try:
        ok = not isinstance(num_bins, bool) and int(num_bins) == num_bins and int(num_bins) >= 1
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"num_bins must be a positive integer, got {num_bins!r}")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0.0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    e = _sinh_edges(int(num_bins), scale)
    if not np.all(np.diff(e) > 0.0):
        raise ValueError(
            f"num_bins={num_bins}, scale={scale!r} give edges that are not strictly increasing"
        )
    return e


def _check_edges(edges: object, lower: float = -1.0, upper: float = 1.0) -> np.ndarray:
    e = np.array(edges, dtype=np.float64, copy=True)
    if e.ndim != 1 or e.size < 2:
        raise ValueError("histogram edges must be a one-dimensional array of at least 2 values")
    if not np.all(np.isfinite(e)):
        raise ValueError("histogram edges must be finite")
    if not np.all(np.diff(e) > 0.0):
        raise ValueError("histogram edges must be strictly increasing")
    if e[0] != lower or e[-1] != upper:
        raise ValueError(
            f"histogram edges must span [{lower:g}, {upper:g}] exactly (first {lower:g}, last "
            f"{upper:g}), got [{e[0]!r}, …, {e[-1]!r}]"
        )
    e.setflags(write=False)
    return e


def histogram_bin_index(r: object, edges: object | None = None) -> np.ndarray:
    """The bin of each normalized coordinate r (int64 array, same shape): the binning rule.

    r is first clipped to [−1, 1]; then

        k = (number of edges e_m with e_m ≤ r) − 1,  clipped to [0, H − 1]

    i.e. bins are half-open [e_k, e_{k+1}) — a value exactly on an interior edge e_k falls in
    bin k, the bin to its RIGHT — except the last bin, which is closed: r = 1 falls in bin
    H − 1, and r = −1 in bin 0. On the default grid (odd H) r = 0 is not an edge: it falls in
    the central bin (H − 1)/2. This is ``np.searchsorted(edges, r, side="right") − 1``, which
    is ``torch.bucketize(r, edges, right=True) − 1`` and
    ``tf.searchsorted(edges, r, side="right") − 1``, followed by a clamp to [0, H − 1].
    Comparisons are made in the precision of r and edges: for bit-identical assignment a
    kernel must compare the same float64 values (the default edges, and r computed as in
    ``stats.normalized_histogram``); float32 r or edges move values within one float32 ulp of
    an edge to the neighbouring bin.
    """
    x = np.clip(np.asarray(r, dtype=np.float64), -1.0, 1.0)
    if np.any(np.isnan(x)):
        raise ValueError("histogram_bin_index needs non-NaN values")
    e = histogram_edges() if edges is None else _check_edges(edges)
    k = np.searchsorted(e, x, side="right") - 1
    return np.clip(k, 0, e.size - 2).astype(np.int64)


# ----------------------------------------------------------------------------------------------
# double-double prefix sums
# ----------------------------------------------------------------------------------------------
def _dd_cumsum(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Prefix sums P_m = Σ_{j<m} x_j (m = 0 … n) as hi + lo, accurate to ~n·ε² relative.

    hi is numpy's sequential float64 cumsum; lo the cumulative sum of the exact rounding error
    of each addition (Knuth's TwoSum, vectorized since hi is known). A range sum
    (hi[k] − hi[i]) + (lo[k] − lo[i]) is then accurate to a few ulps of the range itself.
    """
    hi = np.concatenate([[0.0], np.cumsum(x)])
    prev, cur = hi[:-1], hi[1:]
    bv = cur - prev
    err = (prev - (cur - bv)) + (x - bv)
    lo = np.concatenate([[0.0], np.cumsum(err)])
    return hi, lo


# ----------------------------------------------------------------------------------------------
# the piecewise-uniform law (shared by F on [−1, 1] and its folded law G on [0, 1])
# ----------------------------------------------------------------------------------------------
class _PiecewiseUniform:
    """Σ_k p_k·U[e_k, e_{k+1}] on [lower, upper] = [e_0, e_H]; p normalized. Not public.

    Shared by F and its folded law G; implements the ``model.Law`` protocol.
    """

    lower: float
    upper: float

    def __init__(self, edges: np.ndarray, p: np.ndarray) -> None:
        e = np.ascontiguousarray(edges, dtype=np.float64)
        p = np.ascontiguousarray(p, dtype=np.float64)
        self._edges = e
        self._p = p
        self.lower = float(e[0])
        self.upper = float(e[-1])
        self._nbins = int(p.size)
        self._width = np.diff(e)
        self._rho = p / self._width
        center = 0.5 * (e[:-1] + e[1:])
        # prefix sums (double-double) of the per-bin moments: mass, ∫r dF, ∫r² dF
        self._c0 = _dd_cumsum(p)
        self._c1 = _dd_cumsum(p * center)
        self._c2 = _dd_cumsum(p * (center * center + self._width**2 / 12.0))
        # suffix sums of the mass (rounded to float64): keys of the upper-half searches
        t_hi, t_lo = _dd_cumsum(p[::-1])
        self._tail = (t_hi + t_lo)[::-1].copy()  # _tail[m] = Σ_{j≥m} p_j
        self._neg_tail = -self._tail  # non-decreasing, for searchsorted
        self._head = self._c0[0] + self._c0[1]  # _head[m] = Σ_{j<m} p_j, rounded
        self._total = float(self._head[-1])
        # _next_mass[m]: the first bin m' ≥ m with mass (H if none) — where a flat stretch of
        # F starting in bin m ends (at edge _next_mass[m])
        nonempty = np.nonzero(p > 0.0)[0]
        pos = np.searchsorted(nonempty, np.arange(self._nbins + 1), side="left")
        self._next_mass = np.append(nonempty, self._nbins)[pos]

    # -- lookups -----------------------------------------------------------------------------------
    @property
    def n_bins(self) -> int:
        return self._nbins

    def _clip(self, x: object) -> np.ndarray:
        return np.clip(np.asarray(x, dtype=np.float64), self.lower, self.upper)

    def _bin(self, x: np.ndarray) -> np.ndarray:
        """bin(x) for x in [lower, upper] (``histogram_bin_index``'s rule; x must be inside)."""
        return np.minimum(np.searchsorted(self._edges, x, side="right") - 1, self._nbins - 1)

    @staticmethod
    def _range(c: tuple[np.ndarray, np.ndarray], i: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Σ over bins i … k−1 (edges i to k, i ≤ k) of a double-double prefix sum."""
        hi, lo = c
        return (hi[k] - hi[i]) + (lo[k] - lo[i])

    # -- pdf / cdf / sf / ppf ----------------------------------------------------------------------
    def pdf(self, x: object) -> np.ndarray:
        """Density f(x) = ρ_bin(x) (right-continuous at interior edges); 0 outside the support."""
        x = np.asarray(x, dtype=np.float64)
        out = self._rho[self._bin(self._clip(x))]
        return np.where((x < self.lower) | (x > self.upper), 0.0, out)

    def cdf(self, x: object) -> np.ndarray:
        """F(x) = M0(lower, x): prefix sum to the bin of x plus the partial bin."""
        x = np.asarray(x, dtype=np.float64)
        xc = self._clip(x)
        k = self._bin(xc)
        hi, lo = self._c0
        out = np.clip(hi[k] + (lo[k] + self._rho[k] * (xc - self._edges[k])), 0.0, 1.0)
        return np.where(x <= self.lower, 0.0, np.where(x >= self.upper, 1.0, out))

    def sf(self, x: object) -> np.ndarray:
        """1 − F(x) = M0(x, upper): a suffix (survival) sum, accurate in the upper tail."""
        x = np.asarray(x, dtype=np.float64)
        xc = self._clip(x)
        k = self._bin(xc)
        n = np.full_like(k, self._nbins)
        mass = self._range(self._c0, k + 1, n) + self._rho[k] * (self._edges[k + 1] - xc)
        out = np.clip(mass, 0.0, 1.0)
        return np.where(x <= self.lower, 1.0, np.where(x >= self.upper, 0.0, out))

    def ppf(self, q: object) -> np.ndarray:
        """Inverse cdf inf{x : F(x) ≥ q}, exact (F is piecewise linear); q = 0 → lower, 1 → upper.

        Searches prefix sums for q ≤ 1/2 and suffix sums of 1 − q above (tail accuracy).
        Raises ValueError for q outside [0, 1] or NaN.
        """
        q = np.asarray(q, dtype=np.float64)
        if not np.all((q >= 0.0) & (q <= 1.0)):
            raise ValueError("ppf needs probabilities in [0, 1]")
        shape = q.shape
        q = q.reshape(-1)
        out = np.where(q <= 0.0, self.lower, self.upper)
        inner = np.nonzero((q > 0.0) & (q < 1.0))[0]
        if inner.size:
            c = np.full(inner.size, self.lower)
            x_lo, _ = self._root_set(c, q[inner])
            out[inner] = x_lo
        return out.reshape(shape)

    # -- partial moments and segment cost ----------------------------------------------------------
    def _interval_parts(
        self, c: np.ndarray, d: np.ndarray, i: np.ndarray, k: np.ndarray
    ) -> tuple[np.ndarray, ...]:
        """Shared pieces for [c, d] (c ≤ d in bins i ≤ k): same, D, a, b, ρ_i, ρ_k, range ends."""
        same = i == k
        D = d - c
        a = self._edges[i + 1] - c
        b = d - self._edges[k]
        j_lo = np.minimum(i + 1, k)
        j_hi = np.where(same, j_lo, k)  # an empty range where c and d share a bin
        return same, D, a, b, self._rho[i], self._rho[k], j_lo, j_hi

    def _mass_and_up(
        self, c: np.ndarray, d: np.ndarray, i: np.ndarray, k: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """M0(c, d) and U(c, d) = ∫_c^d (r − c) dF for c ≤ d in bins i ≤ k."""
        same, D, a, b, ri, rk, j_lo, j_hi = self._interval_parts(c, d, i, k)
        R0 = self._range(self._c0, j_lo, j_hi)
        R1 = self._range(self._c1, j_lo, j_hi)
        M0 = np.where(same, ri * D, (ri * a + R0) + rk * b)
        U = np.where(
            same, 0.5 * ri * D * D, (0.5 * ri * a * a + (R1 - c * R0)) + rk * b * (D - 0.5 * b)
        )
        return M0, U

    def _mass_up_cost(
        self, c: np.ndarray, d: np.ndarray, i: np.ndarray, k: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """M0, U = ∫(r − c) dF and S = ∫(r − c)(d − r) dF over [c, d] (module docstring)."""
        same, D, a, b, ri, rk, j_lo, j_hi = self._interval_parts(c, d, i, k)
        R0 = self._range(self._c0, j_lo, j_hi)
        R1 = self._range(self._c1, j_lo, j_hi)
        R2 = self._range(self._c2, j_lo, j_hi)
        M0 = np.where(same, ri * D, (ri * a + R0) + rk * b)
        U = np.where(
            same, 0.5 * ri * D * D, (0.5 * ri * a * a + (R1 - c * R0)) + rk * b * (D - 0.5 * b)
        )
        s_mid = (c + d) * R1 - c * d * R0 - R2
        S = np.where(
            same,
            ri * D * D * D / 6.0,
            (ri * a * a * (0.5 * D - a / 3.0) + rk * b * b * (0.5 * D - b / 3.0)) + s_mid,
        )
        return M0, U, np.maximum(S, 0.0)

    def _prepare(self, c: object, d: object) -> tuple[np.ndarray, ...]:
        c, d = np.broadcast_arrays(self._clip(c), self._clip(d))
        if np.any(c > d):
            raise ValueError("intervals need c <= d")
        return c, d, self._bin(c), self._bin(d)

    def partial_moments(self, c: object, d: object) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(M0, M1, M2) = (∫dF, ∫r dF, ∫r² dF) over [c, d] (broadcast; c ≤ d; clipped)."""
        c, d, i, k = self._prepare(c, d)
        same, D, a, b, ri, rk, j_lo, j_hi = self._interval_parts(c, d, i, k)
        e_i1, e_k = self._edges[i + 1], self._edges[k]
        R0 = self._range(self._c0, j_lo, j_hi)
        R1 = self._range(self._c1, j_lo, j_hi)
        R2 = self._range(self._c2, j_lo, j_hi)
        # ∫_x^y r dr = (y − x)(x + y)/2 and ∫_x^y r² dr = (y − x)(x² + xy + y²)/3 per piece
        M0 = np.where(same, ri * D, (ri * a + R0) + rk * b)
        M1 = np.where(
            same,
            0.5 * ri * D * (c + d),
            (0.5 * ri * a * (c + e_i1) + R1) + 0.5 * rk * b * (e_k + d),
        )
        M2 = np.where(
            same,
            ri * D * (c * c + c * d + d * d) / 3.0,
            (ri * a * (c * c + c * e_i1 + e_i1 * e_i1) / 3.0 + R2)
            + rk * b * (e_k * e_k + e_k * d + d * d) / 3.0,
        )
        return M0, M1, M2

    def segment_cost(self, c: object, d: object) -> np.ndarray:
        """S(c, d) = ∫_c^d (r − c)(d − r) dF over the intervals [c, d] (broadcast, c ≤ d)."""
        c, d, i, k = self._prepare(c, d)
        return self._mass_up_cost(c, d, i, k)[2]

    def mean(self) -> float:
        """E[r] = M1(lower, upper)."""
        return float(self._c1[0][-1] + self._c1[1][-1])

    def second_moment(self) -> float:
        """E[r²] = M2(lower, upper)."""
        return float(self._c2[0][-1] + self._c2[1][-1])

    # -- tables (used by ``variance`` and ``alq``) -------------------------------------------------
    def _table_costs(self, L: object) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """bin(ℓ) and (M0, U, S) of the consecutive intervals of sorted tables L (..., N)."""
        Lc = self._clip(L)
        k = self._bin(Lc)
        return k, self._mass_up_cost(Lc[..., :-1], Lc[..., 1:], k[..., :-1], k[..., 1:])

    def table_terms(self, L: np.ndarray) -> TableTerms:
        """(M0, U, S, f) of the intervals of sorted tables L (..., N) (``model.TableTerms``):
        the closed forms of the module docstring, each level's bin looked up once."""
        x = np.asarray(L, dtype=np.float64)
        k, (M0, U, S) = self._table_costs(x)
        f = np.where((x < self.lower) | (x > self.upper), 0.0, self._rho[k])  # = pdf(L)
        return TableTerms(M0, U, S, f)

    def table_variance(self, L: np.ndarray, *, series: bool = True) -> np.ndarray:
        """V(ℓ; F) = Σ_j S(ℓ_j, ℓ_{j+1}) for sorted tables L (..., N) (ties allowed).

        ``series`` has no effect (the protocol's flag; this closed form has no series)."""
        _, (_, _, S) = self._table_costs(L)
        return S.sum(axis=-1)

    # -- per-level solves (``ppf`` and the ALQ updates) --------------------------------------------
    def _point_sums(self, x: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, ...]:
        """Cumulative sums at points x in bins k, each as hi + lo (double-double-ish):

        F(x) = Fh + Fl and M1(lower, x) = Mh + Ml, where hi is the exact prefix sum to the bin
        (rounded) and lo its rounding error plus the partial bin. Differences of these give
        M0 and M1 over [c, d] to a few ulps of the larger partial bin — cheaper than
        ``_mass_and_up`` (no case split), used by the coordinate sweeps.
        """
        off = x - self._edges[k]
        rho = self._rho[k]
        Fh = self._c0[0][k]
        Fl = self._c0[1][k] + rho * off
        Mh = self._c1[0][k]
        Ml = self._c1[1][k] + 0.5 * rho * off * (x + self._edges[k])
        return Fh, Fl, Mh, Ml

    def _root_set(
        self,
        c: np.ndarray,
        t: np.ndarray,
        i: np.ndarray | None = None,
        sums: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The interval [x_lo, x_hi] of x ≥ c with M0(c, x) = t (1-D c, t; 0 ≤ t ≤ M0(c, upper)).

        x_lo = inf{x : M0(c, x) ≥ t}, x_hi = sup{x : M0(c, x) ≤ t}; they differ where F is
        flat. The bin β of x_lo is found by binary search on the prefix sums (key F(c) + t) or,
        where that key is in the upper half, on the suffix sums (key 1 − F(c) − t); F is linear
        in bin β, so x_lo = e_β + (t − (F(e_β) − F(c)))/ρ_β, clipped to the bin and ≥ c. If
        the density right of x_lo is zero, x_hi is the start of the next bin with mass.
        ``i`` = bin(c) and ``sums`` = F(c) as (hi, lo) (``_point_sums``) if known.
        """
        e, rho, last = self._edges, self._rho, self._nbins - 1
        if i is None:
            i = self._bin(c)
        if sums is None:
            Fh, Fl, _, _ = self._point_sums(c, i)
        else:
            Fh, Fl = sums
        key_head = Fh + (Fl + t)  # F(c) + t
        key_tail = self._tail[i + 1] + (rho[i] * (e[i + 1] - c) - t)  # 1 − F(c) − t
        # β: the bin before the first edge with F(e) ≥ key (or 1 − F(e) ≤ 1 − key)
        upper = key_head > key_tail
        if not upper.any():
            m = np.searchsorted(self._head, key_head, side="left")
        elif upper.all():
            m = np.searchsorted(self._neg_tail, -key_tail, side="left")
        else:
            m = np.where(
                upper,
                np.searchsorted(self._neg_tail, -key_tail, side="left"),
                np.searchsorted(self._head, key_head, side="left"),
            )
        beta = np.minimum(np.maximum(m - 1, i), last)
        hi, lo = self._c0
        before = (hi[beta] - Fh) + (lo[beta] - Fl)  # F(e_β) − F(c) (negative if β = i)
        rb = rho[beta]
        end = e[beta + 1]
        x_lo = e[beta] + (t - before) / np.where(rb > 0.0, rb, np.inf)
        x_lo = np.minimum(np.maximum(x_lo, np.maximum(e[beta], c)), end)
        # flat continuation: the bin at x_lo (right-continuous) and the next bin with mass
        j = np.minimum(beta + (x_lo >= end), last)
        rj = rho[j]
        if rj.all():
            return x_lo, x_lo
        x_hi = np.where(rj > 0.0, x_lo, e[self._next_mass[j]])
        return x_lo, np.maximum(x_hi, x_lo)

    def companding_positions(self, q: np.ndarray) -> np.ndarray:
        """Positions x with C(x) = q for the normalized cumulative C of f^(1/3) (exact here:
        f^(1/3) is piecewise constant, so C is piecewise linear on the edges)."""
        mass = np.cbrt(self._rho) * self._width
        cum = np.concatenate([[0.0], np.cumsum(mass)])
        if not (np.isfinite(cum[-1]) and cum[-1] > 0.0):
            return self.lower + (self.upper - self.lower) * q
        return np.interp(q, cum / cum[-1], self._edges)


class HistogramDistribution(_PiecewiseUniform):
    """A piecewise-uniform law F on [−1, 1]: bin i has mass weights[i]/Σweights on
    [edges[i], edges[i+1]] (module docstring for the closed forms).

    Implements the ``model.Distribution`` protocol, so it is accepted wherever the
    truncated-normal mixture is: ``fit_alq``, ``fit_alq_gd``, ``alq_descent``, ``fit_amq``,
    ``amq_multiplier``, ``expected_variance``, ``symbol_probabilities``, ``entropy``,
    ``huffman_expected_length``.

    Parameters
    ----------
    edges:
        H + 1 strictly increasing finite values with edges[0] = −1 and edges[H] = 1 exactly
        (``histogram_edges()`` is the package default).
    weights:
        H finite non-negative bin weights, not all zero (normalized to sum 1; the n_b²-weighted
        counts of ``stats.normalized_histogram`` need no rescaling).

    Raises ValueError otherwise.
    """

    def __init__(
        self, edges: Sequence[float] | np.ndarray, weights: Sequence[float] | np.ndarray
    ) -> None:
        e = _check_edges(edges)
        w = np.array(weights, dtype=np.float64, copy=True)
        if w.ndim != 1 or w.size != e.size - 1:
            raise ValueError(
                f"need one weight per bin: {e.size - 1} bins, got weights of shape {w.shape}"
            )
        if not np.all(np.isfinite(w)):
            raise ValueError("histogram weights must be finite")
        if np.any(w < 0.0):
            raise ValueError("histogram weights must be non-negative")
        try:
            total = math.fsum(w.tolist())
        except OverflowError:
            total = math.inf
        if not total > 0.0:
            raise ValueError(
                "the histogram is empty (all weights zero): no nonzero bucket was seen"
            )
        if not math.isfinite(total):
            raise ValueError("histogram weights overflow when summed")
        self._folded: FoldedHistogramDistribution | None = None
        super().__init__(e, w / total)

    @property
    def edges(self) -> np.ndarray:
        return self._edges

    @property
    def weights(self) -> np.ndarray:
        """Normalized bin masses p_k (sum 1)."""
        return self._p.copy()

    def folded(self) -> FoldedHistogramDistribution:
        """The law G of |r| on [0, 1] (used by the symmetric fits, §7.2); built once, cached."""
        if self._folded is None:
            self._folded = FoldedHistogramDistribution(self)
        return self._folded

    def sample(self, size: int, rng: np.random.Generator) -> np.ndarray:
        """Draw ``size`` i.i.d. samples of r ~ F: a bin by its mass, then uniform in it."""
        k = rng.choice(self._nbins, size=size, p=self._p / self._p.sum())
        r = self._edges[k] + rng.random(size) * self._width[k]
        return np.clip(r, self._edges[k], self._edges[k + 1])

    def __repr__(self) -> str:
        return f"HistogramDistribution(n_bins={self._nbins})"


class FoldedHistogramDistribution(_PiecewiseUniform):
    """G = law of |r| for r ~ F, on [0, 1]: density g(u) = f(u) + f(−u).

    Its edges are the union of {|e_k|} ∩ [0, 1] and {0}, so g is constant on each of its bins
    (for antisymmetric edges such as the default grid these are just the non-negative edges,
    plus 0 when H is odd).
    """

    def __init__(self, parent: HistogramDistribution) -> None:
        self.parent = parent
        e = parent._edges
        edges = np.unique(np.concatenate([[0.0], np.abs(e)]))
        mid = 0.5 * (edges[:-1] + edges[1:])
        rho = parent._rho[parent._bin(mid)] + parent._rho[parent._bin(-mid)]
        super().__init__(edges, rho * np.diff(edges))

    def sample(self, size: int, rng: np.random.Generator) -> np.ndarray:
        return np.abs(self.parent.sample(size, rng))

    def __repr__(self) -> str:
        return f"FoldedHistogramDistribution(n_bins={self._nbins})"
