"""The distribution model of normalized coordinates: a mixture of truncated normals on [−1, 1].

Spec: ``docs/quantizers.md`` §5 (model) and §6 (closed forms). A bucket v with norm n = ‖v‖₂ has
normalized coordinates r = v/n ∈ [−1, 1]; ALQ/AMQ fit levels to

    F = Σ_k w_k · TN(μ_k, σ_k²; [−1, 1])                                   (§5.3)

where TN(μ, σ²; [a, b]) is the normal N(μ, σ²) conditioned on [a, b]. ALQ-N/AMQ-N use a single
component with pooled parameters (§5.4).

Everything is evaluated in closed form in the standardized coordinate z = (r − μ)/σ of each
component. For one component and an interval [c, d] with a = (c − μ)/σ, b = (d − μ)/σ,
Δ = Φ(b) − Φ(a) and Z = Φ(β) − Φ(α) the mass of the parent normal on the support:

    M0(c, d) = ∫_c^d dF       = Δ / Z
    M1(c, d) = ∫_c^d r dF     = [μΔ + σ(φ(a) − φ(b))] / Z
                              = μ·M0 − σ²·[f(d) − f(c)]                    (§6)
    M2(c, d) = ∫_c^d r² dF    = [μ²Δ + 2μσ(φ(a) − φ(b)) + σ²(Δ + aφ(a) − bφ(b))] / Z
    S(c, d)  = ∫_c^d (r − c)(d − r) dF = σ²/Z · [b·φ(a) − a·φ(b) − (1 + ab)·Δ]

The last line is the spec's S = −cd·M0 + (c + d)·M1 − M2 rewritten in standardized coordinates,
which avoids the cancellation of the raw moments when |μ| ≫ σ. For intervals that are narrow
relative to σ (b − a < ``_NARROW_Z``) the bracket cancels like (b − a)²; there S is summed as the
series S = σ²/Z · φ(m) Σ_{n even} He_n(m)/n! · 4w^{n+3}/((n+1)(n+3)) about the midpoint m with
half-width w (He_n the probabilists' Hermite polynomials), which is exact to double precision.

Tails: Δ is never formed as a difference of two cdf values near 1. Each point carries
T(z) = ½·erfc(|z|/√2) (the smaller of Φ(z) and 1 − Φ(z), accurate in both tails) and the
Heaviside H(z) = [z ≥ 0]; with P(z) = Φ(z) − H(z) = ±T(z),

    Δ = (P(b) − P(a)) + (H(b) − H(a)),

which is a difference of survival functions in the upper tail, of cdfs in the lower tail, and a
sum of two tails when [a, b] straddles the mean. f may underflow to 0 far out, which is harmless.

Degenerate components: σ is clamped to [``STD_FLOOR``, ``STD_CEIL``]. σ → 0 (a bucket whose
coordinates are all equal) becomes a point mass at μ to within 1e-12, without NaN; a σ above
``STD_CEIL`` is indistinguishable from the uniform law on [−1, 1] (relative density variation
below 2/STD_CEIL² = 2e-8).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.special import erfc, ndtri

from horovod_aq.levels.model import TableTerms
from horovod_aq.levels.roots import solve_increasing

__all__ = [
    "STD_CEIL",
    "STD_FLOOR",
    "WEIGHTINGS",
    "FoldedTruncatedNormalMixture",
    "TruncatedNormalMixture",
]

#: Smallest component standard deviation; smaller values (including 0) are raised to it. A
#: component with σ = STD_FLOOR is a point mass for every purpose of the fitting (the levels
#: move on scales ≥ 1e-7), but keeps every closed form finite.
STD_FLOOR = 1e-12
#: Largest component standard deviation; larger values are lowered to it (see module docstring).
STD_CEIL = 1e4
#: Mixture weighting w_b ∝ n_b^γ (§5.3): name → γ. "squared_norm" (γ = 2) is the default.
WEIGHTINGS: dict[str, float] = {"squared_norm": 2.0, "norm": 1.0}

SQRT_HALF = math.sqrt(0.5)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

# Below this standardized width b − a (and |m|·(b − a) < _NARROW_MH) S uses the midpoint series.
# Above it the closed form loses at most ~6(1 + m²)/(b − a)² ulps: < 1e-11 relative; where
# |m|·(b − a) ≥ _NARROW_MH the interval lies beyond 10 standard deviations and its share of V is
# below 1e-20.
_NARROW_Z = 0.01
_NARROW_MH = 0.1
# Even orders 0, 2, …, _SERIES_ORDER of the midpoint series at most; inside the region above
# each term is below 1/400 of the previous one, so a few terms reach _SERIES_RTOL.
_SERIES_ORDER = 16
_SERIES_RTOL = 1e-17
# The companding start of ALQ (``companding_positions``): grid size, and local refinement
# (points over ±Z σ) around at most _COMPANDING_LOCAL components whose f^(1/3) is narrower than
# two grid steps.
_COMPANDING_GRID = 513
_COMPANDING_LOCAL = 64
_COMPANDING_LOCAL_POINTS = 33
_COMPANDING_Z = 8.0


def _as_float_array(name: str, values: object) -> np.ndarray:
    arr = np.array(values, dtype=np.float64, copy=True).reshape(-1)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite, got non-finite values")
    return arr


class _PointTerms:
    """Per-point, per-component terms: z = (x − μ)/σ, P = Φ(z) − H(z), H = [z ≥ 0], φ(z).

    Arrays have shape ``x.shape + (K,)``. Slicing along the point axes (``terms[idx]``) is cheap,
    so the terms of a table are computed once and reused for all its intervals.
    """

    __slots__ = ("H", "P", "phi", "z")

    def __init__(self, z: np.ndarray, P: np.ndarray, H: np.ndarray, phi: np.ndarray) -> None:
        self.z, self.P, self.H, self.phi = z, P, H, phi

    @classmethod
    def at(cls, x: np.ndarray | float, mu: np.ndarray, sigma: np.ndarray) -> _PointTerms:
        z = np.asarray(x, dtype=np.float64)[..., None] - mu
        z /= sigma
        T = np.abs(z)
        T *= SQRT_HALF
        T = erfc(T, out=T)
        T *= 0.5
        upper = z >= 0.0
        P = np.where(upper, -T, T)
        phi = np.square(z)
        phi *= -0.5
        np.exp(phi, out=phi)
        phi *= INV_SQRT_2PI
        return cls(z, P, upper.astype(np.float64), phi)

    def __getitem__(self, idx: Any) -> _PointTerms:
        return _PointTerms(self.z[idx], self.P[idx], self.H[idx], self.phi[idx])


def _mass(a: _PointTerms, b: _PointTerms) -> np.ndarray:
    """Δ = Φ(b) − Φ(a) per component, tail-accurate (module docstring)."""
    return (b.P - a.P) + (b.H - a.H)


def _segment_bracket(
    a: _PointTerms,
    b: _PointTerms,
    delta: np.ndarray,
    width: np.ndarray,
    sigma: np.ndarray,
    *,
    series: bool = True,
) -> np.ndarray:
    """s(a, b) = ∫_a^b (z − a)(b − z) φ(z) dz = bφ(a) − aφ(b) − (1 + ab)Δ, series when narrow.

    ``width`` is d − c per interval (shape of the point axes) and ``sigma`` the component σ: the
    series takes its half-width from (d − c)/σ, not from b − a, whose rounding (relative
    ε·|a|/(b − a)) would otherwise dominate the relative error of s ∝ (b − a)³.
    ``series=False`` skips the series: each s then carries an absolute error of a few ulps of
    |b|φ(a) + (1 + |ab|)Δ, harmless for a sum over a table (used to rank tables).
    """
    za, zb = a.z, b.z
    s = zb * a.phi
    s -= za * b.phi
    t = za * zb
    t += 1.0
    t *= delta
    s -= t
    if not series:
        return s
    h = zb - za
    narrow = h < _NARROW_Z
    if np.any(narrow):
        zsum = za[narrow] + zb[narrow]
        hn = np.broadcast_to(np.asarray(width)[..., None], h.shape)[narrow]
        hn = hn / np.broadcast_to(sigma, h.shape)[narrow]
        keep = np.abs(zsum) * hn < 2.0 * _NARROW_MH
        sn = s[narrow]
        sn[keep] = _segment_series(0.5 * zsum[keep], 0.5 * hn[keep])
        s[narrow] = sn
    return s


def _segment_series(m: np.ndarray, w: np.ndarray) -> np.ndarray:
    """∫_{m−w}^{m+w} (w² − t²)·φ(m + t) dt = φ(m) Σ_{n even} He_n(m)/n! · 4w^{n+3}/((n+1)(n+3)).

    Terms are added until the largest relative term is below ``_SERIES_RTOL`` (at most up to
    order ``_SERIES_ORDER``); very narrow intervals need only the first one or two.
    """
    he_prev = np.ones_like(m)  # He_0
    he = m.copy()  # He_1
    total = 4.0 * w**3 / 3.0  # n = 0 term (He_0 = 1)
    w2 = w * w
    wpow = w**3
    fact = 1.0
    for n in range(2, _SERIES_ORDER + 1, 2):
        # advance the recurrence He_{k+1} = m·He_k − k·He_{k−1} twice, to He_n
        he_prev, he = he, m * he - (n - 1) * he_prev  # He_n
        wpow = wpow * w2
        fact *= (n - 1) * n
        term = he * (4.0 / ((n + 1) * (n + 3) * fact)) * wpow
        total = total + term
        if not np.any(np.abs(term) > _SERIES_RTOL * np.abs(total)):
            break
        he_prev, he = he, m * he - n * he_prev  # He_{n+1}
    return np.exp(-0.5 * m * m) * INV_SQRT_2PI * total


class _TruncatedNormalSum:
    """Σ_k c_k · N(μ_k, σ_k²) restricted to [lower, upper]; c_k = w_k / Z_k are fixed coefficients.

    Both the mixture F on [−1, 1] and its folded law G on [0, 1] are of this form; all methods
    below are shared (they implement the ``model.Law`` protocol). Not a public class.
    """

    lower: float
    upper: float

    def __init__(
        self, mu: np.ndarray, sigma: np.ndarray, coef: np.ndarray, lower: float, upper: float
    ) -> None:
        self._mu = np.ascontiguousarray(mu, dtype=np.float64)
        self._sigma = np.ascontiguousarray(sigma, dtype=np.float64)
        self._coef = np.ascontiguousarray(coef, dtype=np.float64)
        self.lower = float(lower)
        self.upper = float(upper)
        # coefficient vectors for the K-sums of the closed forms
        self._coef_mu = self._coef * self._mu
        self._coef_sigma = self._coef * self._sigma
        self._coef_sigma2 = self._coef * self._sigma**2
        self._coef_pdf = self._coef / self._sigma
        self._coef_m2 = self._coef * (self._mu**2 + self._sigma**2)
        self._coef_2musigma = 2.0 * self._coef * self._mu * self._sigma
        self._lo = _PointTerms.at(np.float64(self.lower), self._mu, self._sigma)
        self._hi = _PointTerms.at(np.float64(self.upper), self._mu, self._sigma)

    # -- internal helpers (also used by the fitting code) -----------------------------------------
    def _terms(self, x: np.ndarray) -> _PointTerms:
        return _PointTerms.at(x, self._mu, self._sigma)

    @property
    def n_components(self) -> int:
        return int(self._mu.size)

    def _clip(self, x: object) -> np.ndarray:
        return np.clip(np.asarray(x, dtype=np.float64), self.lower, self.upper)

    # -- pdf / cdf / sf / ppf ----------------------------------------------------------------------
    def pdf(self, x: object) -> np.ndarray:
        """Density f(x); 0 outside the support."""
        x = np.asarray(x, dtype=np.float64)
        z = x[..., None] - self._mu
        z /= self._sigma
        np.square(z, out=z)
        z *= -0.5
        out = np.exp(z, out=z) @ self._coef_pdf * INV_SQRT_2PI
        return np.where((x < self.lower) | (x > self.upper), 0.0, out)

    def cdf(self, x: object) -> np.ndarray:
        """F(x) = M0(lower, x)."""
        x = np.asarray(x, dtype=np.float64)
        t = self._terms(self._clip(x))
        out = np.clip(_mass(self._lo, t) @ self._coef, 0.0, 1.0)
        return np.where(x <= self.lower, 0.0, np.where(x >= self.upper, 1.0, out))

    def sf(self, x: object) -> np.ndarray:
        """1 − F(x) = M0(x, upper), accurate in the upper tail."""
        x = np.asarray(x, dtype=np.float64)
        t = self._terms(self._clip(x))
        out = np.clip(_mass(t, self._hi) @ self._coef, 0.0, 1.0)
        return np.where(x <= self.lower, 1.0, np.where(x >= self.upper, 0.0, out))

    def ppf(self, q: object) -> np.ndarray:
        """Inverse cdf F⁻¹(q), vectorized: safeguarded Newton on the monotone cdf.

        Solves F(x) = q (or 1 − F(x) = 1 − q above the median, for tail accuracy) to double
        precision; q = 0 → lower, q = 1 → upper. Raises ValueError for q outside [0, 1] or NaN.
        """
        q = np.asarray(q, dtype=np.float64)
        if not np.all((q >= 0.0) & (q <= 1.0)):
            raise ValueError("ppf needs probabilities in [0, 1]")
        shape = q.shape
        q = q.reshape(-1)
        out = np.where(q <= 0.0, self.lower, self.upper)
        inner = np.nonzero((q > 0.0) & (q < 1.0))[0]
        if inner.size:
            qi = q[inner]
            upper_tail = qi > 0.5
            target = np.where(upper_tail, 1.0 - qi, qi)

            def eval_h(x: np.ndarray, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
                t = self._terms(x)
                cdf = _mass(self._lo, t) @ self._coef
                sf = _mass(t, self._hi) @ self._coef
                g = np.where(upper_tail[i], target[i] - sf, cdf - target[i])
                return g, t.phi @ self._coef_pdf

            lo = np.full(inner.size, self.lower)
            hi = np.full(inner.size, self.upper)
            out[inner] = solve_increasing(eval_h, lo, hi, 0.5 * (lo + hi))
        return out.reshape(shape)

    # -- partial moments and segment cost ----------------------------------------------------------
    def partial_moments(self, c: object, d: object) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(M0, M1, M2) over the intervals [c, d] (broadcast; c ≤ d; clipped to the support)."""
        c, d = np.broadcast_arrays(self._clip(c), self._clip(d))
        if np.any(c > d):
            raise ValueError("partial_moments needs c <= d")
        a, b = self._terms(c), self._terms(d)
        delta = _mass(a, b)
        dphi = a.phi - b.phi
        M0 = delta @ self._coef
        M1 = delta @ self._coef_mu + dphi @ self._coef_sigma
        M2 = (
            delta @ self._coef_m2
            + dphi @ self._coef_2musigma
            + (a.z * a.phi - b.z * b.phi) @ self._coef_sigma2
        )
        return M0, M1, M2

    def segment_cost(self, c: object, d: object) -> np.ndarray:
        """S(c, d) = ∫_c^d (r − c)(d − r) dF over the intervals [c, d] (broadcast, c ≤ d)."""
        c, d = np.broadcast_arrays(self._clip(c), self._clip(d))
        if np.any(c > d):
            raise ValueError("segment_cost needs c <= d")
        a, b = self._terms(c), self._terms(d)
        return _segment_bracket(a, b, _mass(a, b), d - c, self._sigma) @ self._coef_sigma2

    def mean(self) -> float:
        """E[r] = M1(lower, upper)."""
        return float(self.partial_moments(self.lower, self.upper)[1])

    def second_moment(self) -> float:
        """E[r²] = M2(lower, upper)."""
        return float(self.partial_moments(self.lower, self.upper)[2])

    # -- tables (used by ``variance`` and ``alq``) -------------------------------------------------
    def table_terms(self, L: np.ndarray) -> TableTerms:
        """(M0, U, S, f) of the intervals of sorted tables L (..., N) (``model.TableTerms``).

        Per component, with a, b the standardized ends: M0 = Δ/Z, U = σ/Z·[φ(a) − φ(b) − a·Δ]
        and S = σ²/Z·s(a, b) (module docstring). The special functions are evaluated once per
        level and component (N·K erfc + exp), and every interval reuses its two end points.
        """
        t = self._terms(L)
        a, b = t[..., :-1, :], t[..., 1:, :]
        delta = _mass(a, b)
        M0 = delta @ self._coef
        U = ((a.phi - b.phi) - a.z * delta) @ self._coef_sigma
        S = _segment_bracket(a, b, delta, np.diff(L, axis=-1), self._sigma) @ self._coef_sigma2
        return TableTerms(M0, U, S, t.phi @ self._coef_pdf)

    def table_variance(self, L: np.ndarray, *, series: bool = True) -> np.ndarray:
        """V = Σ_j S(ℓ_j, ℓ_{j+1}) for tables L (..., N) that are sorted (ties allowed).

        ``series=False``: see ``_segment_bracket`` (absolute error ~ulps of V's scale).
        """
        t = self._terms(L)
        a, b = t[..., :-1, :], t[..., 1:, :]
        S = _segment_bracket(a, b, _mass(a, b), np.diff(L, axis=-1), self._sigma, series=series)
        return (S @ self._coef_sigma2).sum(axis=-1)

    def companding_positions(self, q: np.ndarray) -> np.ndarray:
        """Positions x with C(x) = q for the normalized cumulative C of f^(1/3) on the support.

        f^(1/3) is the high-resolution optimal density of levels for a cost ∫ f·h³ per interval,
        which V is (S(c, d) ≈ f·(d − c)³/6). The integral is a trapezoid rule on a uniform grid,
        refined around the heaviest components whose f^(1/3) (a normal of width σ√3) is narrower
        than two grid steps; this only builds a starting point (of ALQ), so that accuracy is
        ample.
        """
        lo, hi = self.lower, self.upper
        grid = np.linspace(lo, hi, _COMPANDING_GRID)
        step = (hi - lo) / (_COMPANDING_GRID - 1)
        narrow = np.nonzero(self._sigma * math.sqrt(3.0) < 2.0 * step)[0]
        if narrow.size:
            heavy = narrow[np.argsort(-self._coef[narrow], kind="stable")][:_COMPANDING_LOCAL]
            z = np.linspace(-_COMPANDING_Z, _COMPANDING_Z, _COMPANDING_LOCAL_POINTS)
            local = (self._mu[heavy, None] + self._sigma[heavy, None] * z).ravel()
            grid = np.unique(np.clip(np.concatenate([grid, local]), lo, hi))
        g = np.cbrt(np.maximum(self.pdf(grid), 0.0))
        cum = np.concatenate([[0.0], np.cumsum(0.5 * (g[1:] + g[:-1]) * np.diff(grid))])
        if not (np.isfinite(cum[-1]) and cum[-1] > 0.0):
            return lo + (hi - lo) * q
        return np.interp(q, cum / cum[-1], grid)


class TruncatedNormalMixture(_TruncatedNormalSum):
    """F = Σ_k w_k · TN(μ_k, σ_k²; [−1, 1]) — the ALQ/AMQ model of normalized coordinates (§5.3).

    Implements the ``model.Distribution`` protocol (``folded()`` gives the law of |r|).

    Parameters
    ----------
    means, stds:
        Parent-normal parameters μ_k ∈ [−1, 1] and σ_k ≥ 0 of each component (σ is clamped to
        [STD_FLOOR, STD_CEIL]; see the module docstring).
    weights:
        Non-negative mixture weights (normalized to sum 1); ``None`` means equal weights.
        Components of zero weight are dropped.

    Raises ValueError on empty, mismatched, non-finite or negative input, means outside [−1, 1]
    and weights summing to zero.
    """

    def __init__(
        self,
        means: Sequence[float] | np.ndarray,
        stds: Sequence[float] | np.ndarray,
        weights: Sequence[float] | np.ndarray | None = None,
    ) -> None:
        mu = _as_float_array("means", means)
        sigma = _as_float_array("stds", stds)
        if mu.size == 0:
            raise ValueError("a mixture needs at least one component (got empty statistics)")
        if sigma.size != mu.size:
            raise ValueError(f"means and stds differ in length ({mu.size} vs {sigma.size})")
        w = np.ones_like(mu) if weights is None else _as_float_array("weights", weights)
        if w.size != mu.size:
            raise ValueError(f"weights and means differ in length ({w.size} vs {mu.size})")
        if np.any(sigma < 0.0):
            raise ValueError("stds must be non-negative")
        if np.any(w < 0.0):
            raise ValueError("weights must be non-negative")
        if np.any(np.abs(mu) > 1.0):
            raise ValueError("component means must lie in [-1, 1] (normalized coordinates)")
        total = math.fsum(w.tolist())
        if not total > 0.0:
            raise ValueError("mixture weights sum to zero (every bucket has zero norm?)")
        keep = w > 0.0
        mu, sigma, w = mu[keep], sigma[keep], w[keep] / total
        sigma = np.clip(sigma, STD_FLOOR, STD_CEIL)
        # Z_k = Φ(β_k) − Φ(α_k), the mass of component k's parent normal on [−1, 1]
        Z = _mass(
            _PointTerms.at(np.float64(-1.0), mu, sigma), _PointTerms.at(np.float64(1.0), mu, sigma)
        )
        self._weights = w
        self._folded: FoldedTruncatedNormalMixture | None = None
        super().__init__(mu, sigma, w / Z, -1.0, 1.0)

    # -- constructors ------------------------------------------------------------------------------
    @classmethod
    def from_bucket_stats(
        cls,
        norms: Sequence[float] | np.ndarray,
        means: Sequence[float] | np.ndarray,
        stds: Sequence[float] | np.ndarray,
        weighting: str = "squared_norm",
    ) -> TruncatedNormalMixture:
        """One component TN(m_b, s_b²) per bucket, weighted w_b ∝ n_b^γ (§5.3).

        ``weighting="squared_norm"`` (γ = 2, the default) is the consistent choice: a bucket's
        quantization error is n_b²·Σ_i σ²(r_i) ≈ B·n_b²·V(ℓ; F_b), so the total error is
        B·(Σ_b n_b²)·V(ℓ; Σ_b (n_b²/Σ n²)·F_b) — minimizing V of the n²-weighted mixture minimizes
        the expected squared error of the whole gradient. ``weighting="norm"`` (γ = 1) is what
        the reference code does (spec pitfall P1). Zero-norm buckets get zero weight and are
        dropped; if all norms are zero this raises ValueError.
        """
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {sorted(WEIGHTINGS)}, got {weighting!r}")
        n = _as_float_array("norms", norms)
        m = _as_float_array("means", means)
        s = _as_float_array("stds", stds)
        if n.size == 0:
            raise ValueError("empty bucket statistics: need at least one nonzero full bucket")
        if not (n.size == m.size == s.size):
            raise ValueError(
                f"norms, means and stds differ in length ({n.size}, {m.size}, {s.size})"
            )
        if np.any(n < 0.0):
            raise ValueError("bucket norms must be non-negative")
        # scale by the largest norm first so that n^γ cannot overflow or underflow
        n_max = float(n.max())
        if not n_max > 0.0:
            raise ValueError(
                "mixture weights sum to zero: every bucket has zero norm (all-zero gradient)"
            )
        w = (n / n_max) ** WEIGHTINGS[weighting]
        return cls(m, s, w)

    @classmethod
    def pooled(
        cls,
        means: Sequence[float] | np.ndarray,
        stds: Sequence[float] | np.ndarray,
        counts: Sequence[float] | np.ndarray,
    ) -> TruncatedNormalMixture:
        """Single TN(μ, σ²) for ALQ-N/AMQ-N from per-bucket (m_b, s_b, B_b) (§5.4).

        μ = Σ_b B_b·m_b / Σ_b B_b (mean over all coordinates) and
        σ² = Σ_b (B_b − 1)·s_b² / Σ_b B_b (pooled within-bucket variance, the spread of bucket
        means excluded).
        """
        m = _as_float_array("means", means)
        s = _as_float_array("stds", stds)
        cnt = _as_float_array("counts", counts)
        if m.size == 0:
            raise ValueError("empty bucket statistics: need at least one nonzero full bucket")
        if not (m.size == s.size == cnt.size):
            raise ValueError("means, stds and counts differ in length")
        if np.any(s < 0.0) or np.any(cnt < 1.0):
            raise ValueError("stds must be non-negative and counts at least 1")
        return cls.from_pooled_sums(
            math.fsum(cnt.tolist()),
            math.fsum((cnt * m).tolist()),
            math.fsum(((cnt - 1.0) * s * s).tolist()),
        )

    @classmethod
    def from_pooled_sums(
        cls, count: float, sum_u: float, sum_sq_dev: float
    ) -> TruncatedNormalMixture:
        """Single TN(μ, σ²) with μ = Σu / N and σ² = Σ(u − m_b)² / N over N coordinates (§5.4)."""
        vals = (float(count), float(sum_u), float(sum_sq_dev))
        if not all(math.isfinite(v) for v in vals):
            raise ValueError("pooled sums must be finite")
        count, sum_u, sum_sq_dev = vals
        if not count > 0.0:
            raise ValueError("pooled statistics are empty (count = 0): no nonzero full bucket")
        if sum_sq_dev < 0.0:
            raise ValueError("the pooled sum of squared deviations must be non-negative")
        mu = min(1.0, max(-1.0, sum_u / count))
        return cls([mu], [math.sqrt(sum_sq_dev / count)], [1.0])

    # -- accessors ---------------------------------------------------------------------------------
    @property
    def means(self) -> np.ndarray:
        return self._mu.copy()

    @property
    def stds(self) -> np.ndarray:
        """Component σ after clamping to [STD_FLOOR, STD_CEIL]."""
        return self._sigma.copy()

    @property
    def weights(self) -> np.ndarray:
        return self._weights.copy()

    def folded(self) -> FoldedTruncatedNormalMixture:
        """The law G of |r| on [0, 1] (used by the symmetric fits, §7.2); built once, cached."""
        if self._folded is None:
            self._folded = FoldedTruncatedNormalMixture(self)
        return self._folded

    def sample(self, size: int, rng: np.random.Generator) -> np.ndarray:
        """Draw ``size`` i.i.d. samples of r ~ F (inverse-cdf per component; for tests)."""
        k = rng.choice(self._mu.size, size=size, p=self._weights)
        lo_cdf = self._lo.P[k] + self._lo.H[k]
        hi_cdf = self._hi.P[k] + self._hi.H[k]
        u = lo_cdf + rng.random(size) * (hi_cdf - lo_cdf)
        r = self._mu[k] + self._sigma[k] * ndtri(u)
        return np.clip(r, -1.0, 1.0)

    def __repr__(self) -> str:
        return f"TruncatedNormalMixture(n_components={self.n_components})"


class FoldedTruncatedNormalMixture(_TruncatedNormalSum):
    """G = law of |r| for r ~ F, on [0, 1]: ∫_c^d h dG = ∫_c^d h dF + ∫_{−d}^{−c} h(−r) dF.

    Each component (μ, σ) of F contributes itself and its reflection (−μ, σ) restricted to
    [0, 1], with F's normalizers, so the total mass on [0, 1] is 1.
    """

    def __init__(self, parent: TruncatedNormalMixture) -> None:
        self.parent = parent
        super().__init__(
            np.concatenate([parent._mu, -parent._mu]),
            np.concatenate([parent._sigma, parent._sigma]),
            np.concatenate([parent._coef, parent._coef]),
            0.0,
            1.0,
        )

    def sample(self, size: int, rng: np.random.Generator) -> np.ndarray:
        return np.abs(self.parent.sample(size, rng))

    def __repr__(self) -> str:
        return f"FoldedTruncatedNormalMixture(n_components={self.parent.n_components})"
