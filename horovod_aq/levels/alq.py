"""ALQ: adaptive levels by exact coordinate descent on V(ℓ; F); ALQ-G by clipped gradient steps.

Spec: ``quantizers.md`` §7 (paper arXiv 2010.12460). The objective is the closed-form expected
variance V(ℓ; F) = Σ_j S(ℓ_j, ℓ_{j+1}) of §6 with ℓ_0 = −1 and ℓ_{N−1} = 1 fixed.

Per-level problem (§7.1). With c = ℓ_{j−1}, d = ℓ_{j+1} fixed, J(x) = S(c, x) + S(x, d) has

    J′(x) = ∫_c^x (r − c) dF − ∫_x^d (d − r) dF = (d − c)·[F(x) − F(c) − t],
    t = M0(c, d) − (1/(d − c))·∫_c^d (r − c) dF,       J″(x) = (d − c)·f(x) ≥ 0,

so the exact minimizer solves F(x) − F(c) = t on (c, d) (the inverse-cdf update). It is found by
safeguarded Newton (bisection fallback) on the monotone left side. NaN guard: the old level is kept
when M0(c, d) < ``MIN_INTERVAL_MASS``, when the root is not strictly inside (c, d), or when
anything is non-finite.

Sweeps (§7.2): Gauss–Seidel, left to right, each update using the fresh left neighbour; V is
non-increasing. Stop when a sweep lowers V by less than ``tol``·V or moves no level by more
than ``MOVE_TOL``; ``max_sweeps`` caps the iterations (sweeps or Newton steps, below).
``sweeps=n`` instead runs exactly n plain sweeps (the reference runs 30).

Acceleration (``accelerate=True``, default). Plain coordinate descent converges only linearly,
and slowly when levels must travel far. After one plain sweep, damped Newton steps on the full
stationarity system ∇V = 0 are interleaved, with the tridiagonal Hessian in closed form:

    ∂V/∂ℓ_j = J′_j(ℓ_j),   ∂²V/∂ℓ_j² = (ℓ_{j+1} − ℓ_{j−1})·f(ℓ_j),
    ∂²V/∂ℓ_j∂ℓ_{j+1} = −M0(ℓ_j, ℓ_{j+1}).

A step solves (∇²V + λ·diag ∇²V)·s = −∇V (Levenberg–Marquardt: λ = 0 near a minimum, raised
where the Hessian is indefinite), is shortened so that no interval loses more than half its
length, and is accepted only if it lowers V. Levels of zero curvature (in empty regions) are
held fixed by the step and get exact per-level updates instead (a partial sweep over just those
levels, forwards then backwards, so stranded levels migrate to the mass). A rejected step, or
one that lowers V by less than ``tol``·V, hands over to a plain sweep, and only plain sweeps
decide convergence. So V is non-increasing and the result is a fixed point of the exact
coordinate descent (a stationary point of V): the acceleration changes the path, not the stop
rule (the tests compare it with unaccelerated descent).

Initializations (§7.2), all run, lowest final V kept (ties: first in this order): quantiles
ℓ_k = F⁻¹(k/(N − 1)); U-ref; E-ref with p = 1/2; then two package extensions: the companding
start (quantiles of the density ∝ f^(1/3), see ``alq_initializations``; can be switched off)
and the caller's ``initial`` table if given. Extra starts can only lower the selected V.

Symmetric option (§7.2, exact folded method). For a symmetric zero-free table with positive
levels 0 < x_1 < … < x_K = 1, V(ℓ; F) = V⁺(x; G) with G the law of |r|:

    V⁺ = ∫_0^{x_1} (x_1² − u²) dG + Σ_{j≥1} S_G(x_j, x_{j+1}).

x_j (j ≥ 2) takes the §7.1 update on G; x_1 solves 2x_1·G(x_1) = ∫_{x_1}^{x_2} (x_2 − u) dG(u)
(strictly increasing left minus right side). Quantile start: x_i = G⁻¹((2i − 1)/(2K − 1)),
which is F's quantile start when F is symmetric.

Histogram laws (``histogram.HistogramDistribution``, the empirical model). Everything above
holds with piecewise-polynomial moments: F is piecewise linear, so each exact update is a
closed-form solve in one bin (found by binary search on prefix sums) and needs no iteration;
the symmetric x_1 equation is a quadratic in its bin. The density is discontinuous and may
vanish on whole intervals: J stays convex (J″ = (d − c)·f ≥ 0) but can be flat, and then
its minimizers form an interval of which the update takes the point nearest to the old level
(a level already in it stays). The Newton steps use the exact piecewise Hessian (f taken
right-continuous at an edge); levels in empty bins have zero curvature and are moved by the
exact updates, as above.

Relocation moves (``relocate=True``, package extension, off by default). Coordinate descent
never moves a level past its neighbours, so on multimodal laws — irregular or sparse
histograms — it can stop with one level too many on one side of a gap. After the descent,
each round scores every "remove ℓ_i, insert a level at the probability midpoint of another
gap" move by its exact V, descends the best few and keeps the result if V drops; V never
increases and the result is again a fixed point of the descent.

ALQ-G (§7.3): for each interior level in Gauss–Seidel order, g_j = J′(ℓ_j),
δ = min(ℓ_j − ℓ_{j−1}, ℓ_{j+1} − ℓ_j), ℓ_j ← ℓ_j − sign(g_j)·min(η|g_j|, δ/2); symmetric by
default (the reference hard-codes it; there the left gap of x_1 is x_1 itself), 30 sweeps, the
same starts and selection.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.special import ndtr

from horovod_aq.levels.distribution import (
    INV_SQRT_2PI,
    FoldedTruncatedNormalMixture,
    TruncatedNormalMixture,
    _mass,
    _PointTerms,
    _segment_bracket,
    _solve_increasing,
    _TruncatedNormalSum,
)
from horovod_aq.levels.families import check_bits, exponential, separate_levels, uniform
from horovod_aq.levels.histogram import HistogramDistribution, _PiecewiseUniform
from horovod_aq.levels.table import validate_levels

__all__ = [
    "MIN_INTERVAL_MASS",
    "MOVE_TOL",
    "alq_descent",
    "alq_initializations",
    "fit_alq",
    "fit_alq_gd",
]

logger = logging.getLogger(__name__)

#: The laws the fitters accept: the paper's truncated-normal mixture (§5.3, §5.4) or the
#: empirical histogram (``histogram``).
Distribution = TruncatedNormalMixture | HistogramDistribution
#: The law a coordinate update works on: F, or its folded law G for the symmetric fits.
Law = _TruncatedNormalSum | _PiecewiseUniform

#: NaN guard: an interval with less probability than this keeps its level (§7.1).
MIN_INTERVAL_MASS = 1e-200
#: Stop when no level moved by more than this in a sweep (§7.2).
MOVE_TOL = 1e-12
#: Plain sweeps before the first Newton step is tried (accelerated mode).
_WARMUP_SWEEPS = 1
#: Levenberg–Marquardt damping of the Newton steps: λ after a rejected step is at least the
#: floor, shrinks ×1/10 after each accepted step (below the floor: back to plain Newton).
_LM_LAMBDA_FLOOR = 1e-4
_LM_LAMBDA_MAX = 1e8
#: The companding start: grid size, and local refinement (points over ±Z σ) around at most
#: _COMPANDING_LOCAL components whose f^(1/3) is narrower than two grid steps.
_COMPANDING_GRID = 513
_COMPANDING_LOCAL = 64
_COMPANDING_LOCAL_POINTS = 33
_COMPANDING_Z = 8.0
#: Skip a level update that cannot lower V by more than this fraction of V: M0(c, d)·(d − c)²
#: bounds the whole cost J = S(c, x) + S(x, d) the update could remove.
NEGLIGIBLE_GAIN = 1e-18
#: Newton steps hold variables whose curvature is below this fraction of the largest fixed.
_FREEZE_CURVATURE = 1e-12
#: A damped Newton step may shrink each interval to at most this fraction of its length.
_NEWTON_FRACTION = 0.5
#: Relocation moves (``fit_alq(..., relocate=True)``): at most RELOCATE_ROUNDS rounds; each
#: scores up to _RELOCATE_MAX_SCORED one-level moves by their exact V, descends the
#: RELOCATE_CANDIDATES best, and keeps the result if it lowers V by more than _RELOCATE_GAIN.
RELOCATE_ROUNDS = 4
RELOCATE_CANDIDATES = 6
_RELOCATE_MAX_SCORED = 1024
_RELOCATE_GAIN = 1e-9


# ----------------------------------------------------------------------------------------------
# problem description: free variables X ↔ level table
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Problem:
    """F (the fitting law), the law the coordinate updates work on (F, or G if symmetric)."""

    F: Distribution
    symmetric: bool
    num_levels: int

    @property
    def histogram(self) -> bool:
        """Is F the histogram model (the piecewise-polynomial code paths)?"""
        return isinstance(self.F, HistogramDistribution)

    @property
    def law(self) -> Law:
        return _folded(self.F) if self.symmetric else self.F

    @property
    def n_free(self) -> int:
        return self.num_levels // 2 - 1 if self.symmetric else self.num_levels - 2

    def points(self, X: np.ndarray) -> np.ndarray:
        """[lo, X, 1]: lo = −1 on F, lo = 0 on G (a pseudo-level used by the x_1 update)."""
        lo = 0.0 if self.symmetric else -1.0
        S = X.shape[0]
        return np.concatenate([np.full((S, 1), lo), X, np.ones((S, 1))], axis=1)

    def tables(self, X: np.ndarray) -> np.ndarray:
        S = X.shape[0]
        if self.symmetric:
            pos = np.concatenate([X, np.ones((S, 1))], axis=1)
            return np.concatenate([-pos[:, ::-1], pos], axis=1)
        return np.concatenate([-np.ones((S, 1)), X, np.ones((S, 1))], axis=1)

    def free(self, table: np.ndarray) -> np.ndarray:
        """Free variables of one (valid) table; a non-symmetric table is symmetrized."""
        L = np.asarray(table, dtype=np.float64)
        if self.symmetric:
            k = self.num_levels // 2
            return 0.5 * (L[k:-1] - L[1:k][::-1])
        return L[1:-1].copy()


def _folded(F: Distribution) -> FoldedTruncatedNormalMixture | _PiecewiseUniform:
    return F.folded()


# ----------------------------------------------------------------------------------------------
# objective, gradient and tridiagonal Hessian (closed form)
# ----------------------------------------------------------------------------------------------
@dataclass
class _Eval:
    V: np.ndarray  # (S,)
    grad: np.ndarray  # (S, n)
    hess_diag: np.ndarray  # (S, n)
    hess_off: np.ndarray  # (S, n − 1)


def _evaluate(prob: _Problem, X: np.ndarray) -> _Eval:
    """V, ∇V and the tridiagonal ∇²V with respect to the free variables (module docstring).

    On a histogram f is piecewise constant: V is piecewise cubic in each level and the Hessian
    below is exact inside the bins (f right-continuous at an edge).
    """
    F = prob.F
    L = prob.tables(X)
    h = np.diff(L, axis=1)
    if isinstance(F, HistogramDistribution):
        M0, U, S = F._table_terms(L)  # U = ∫ (r − ℓ_j) dF on [ℓ_j, ℓ_{j+1}]
        V = S.sum(axis=1)
        f = F.pdf(L)
    else:
        t = F._terms(L)
        a, b = t[:, :-1], t[:, 1:]
        delta = _mass(a, b)
        M0 = delta @ F._coef
        U = ((a.phi - b.phi) - a.z * delta) @ F._coef_sigma  # ∫ (r − ℓ_j) dF on [ℓ_j, ℓ_{j+1}]
        V = (_segment_bracket(a, b, delta, h, F._sigma) @ F._coef_sigma2).sum(axis=1)
        f = t.phi @ F._coef_pdf
    # full-table derivatives at the interior levels 1..N−2
    g = U[:, :-1] - (h[:, 1:] * M0[:, 1:] - U[:, 1:])
    hd = (L[:, 2:] - L[:, :-2]) * f[:, 1:-1]
    ho = -M0[:, 1:-1]
    if not prob.symmetric:
        return _Eval(V, g, hd, ho)
    # chain rule for ℓ = (−x_K, …, −x_1, x_1, …, x_K): x_i sits at K−1+i and −x_i at K−i
    K = prob.num_levels // 2
    n = K - 1
    i = np.arange(1, n + 1)
    pos, neg = K - 1 + i - 1, K - i - 1  # indices into the interior arrays (level index − 1)
    gx = g[:, pos] - g[:, neg]
    hdx = hd[:, pos] + hd[:, neg]
    hdx[:, 0] += 2.0 * M0[:, K - 1]  # −∂²V/∂ℓ_{K−1}∂ℓ_K counted twice: the interval [−x_1, x_1]
    hox = -(M0[:, K : K + n - 1] + M0[:, K - 2 - np.arange(n - 1)])
    return _Eval(V, gx, hdx, hox)


def _take(ev: _Eval, rows: np.ndarray) -> _Eval:
    return _Eval(ev.V[rows], ev.grad[rows], ev.hess_diag[rows], ev.hess_off[rows])


def _store(ev: _Eval, new: _Eval, rows: np.ndarray) -> None:
    ev.V[rows], ev.grad[rows] = new.V, new.grad
    ev.hess_diag[rows], ev.hess_off[rows] = new.hess_diag, new.hess_off


def _tridiagonal_solve(
    d: np.ndarray, o: np.ndarray, rhs: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Solve the symmetric tridiagonal systems (diag d, off-diag o) · s = rhs row by row.

    LDLᵀ (Thomas) elimination vectorized over rows; returns (s, positive definite?).
    """
    d, rhs = d.copy(), rhs.copy()
    n = d.shape[1]
    with np.errstate(all="ignore"):
        for j in range(1, n):
            m = o[:, j - 1] / d[:, j - 1]
            d[:, j] = d[:, j] - m * o[:, j - 1]
            rhs[:, j] = rhs[:, j] - m * rhs[:, j - 1]
        s = np.empty_like(rhs)
        s[:, n - 1] = rhs[:, n - 1] / d[:, n - 1]
        for j in range(n - 2, -1, -1):
            s[:, j] = (rhs[:, j] - o[:, j] * s[:, j + 1]) / d[:, j]
    pd = np.all(d > 0.0, axis=1) & np.all(np.isfinite(s), axis=1)
    return s, pd


def _newton_step(
    prob: _Problem, X: np.ndarray, ev: _Eval, lam: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Damped Newton step (∇²V + λ·diag ∇²V)·s = −∇V; returns (X_new, usable, λ used, frozen).

    λ = 0 is the plain Newton step. Where the damped Hessian is not positive definite, λ is
    raised (×10, from at least ``_LM_LAMBDA_FLOOR``) until it is; beyond ``_LM_LAMBDA_MAX`` the
    step is not usable. Variables with (numerically) zero curvature — levels in empty regions,
    where V is flat — are held fixed (the plain sweeps move them). The step is shortened so
    that every interval between consecutive points (symmetric: including [0, x_1]) keeps at
    least 1 − ``_NEWTON_FRACTION`` of its length, which keeps the levels ordered.
    """
    S, n = X.shape
    hd = ev.hess_diag
    finite = (
        np.all(np.isfinite(hd), axis=1)
        & np.all(np.isfinite(ev.grad), axis=1)
        & np.all(np.isfinite(ev.hess_off), axis=1)
    )
    scale = np.max(np.abs(np.where(np.isfinite(hd), hd, 0.0)), axis=1, keepdims=True)
    frozen = ~(hd > _FREEZE_CURVATURE * scale)
    rhs = np.where(frozen, 0.0, -ev.grad)
    o = ev.hess_off
    if n > 1:
        o = np.where(frozen[:, :-1] | frozen[:, 1:], 0.0, o)
    lam = lam.copy()
    s = np.zeros_like(X)
    usable = np.zeros(S, dtype=bool)
    todo = finite.copy()
    while np.any(todo):
        rows = np.nonzero(todo)[0]
        d = np.where(frozen[rows], 1.0, hd[rows] * (1.0 + lam[rows, None]))
        s_rows, pd = _tridiagonal_solve(d, o[rows], rhs[rows])
        s[rows[pd]] = s_rows[pd]
        usable[rows[pd]] = True
        todo[rows[pd]] = False
        lam[rows[~pd]] = np.maximum(10.0 * lam[rows[~pd]], _LM_LAMBDA_FLOOR)
        todo &= lam <= _LM_LAMBDA_MAX
    s = np.where(usable[:, None], s, 0.0)
    P = prob.points(X)
    ds = np.diff(np.concatenate([np.zeros((S, 1)), s, np.zeros((S, 1))], axis=1), axis=1)
    gaps = np.diff(P, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        limit = np.where(ds < 0.0, _NEWTON_FRACTION * gaps / -ds, np.inf)
    alpha = np.minimum(1.0, limit.min(axis=1))
    usable &= (alpha > 0.0) & np.any(s != 0.0, axis=1)
    return X + alpha[:, None] * s, usable, lam, frozen


# ----------------------------------------------------------------------------------------------
# exact coordinate update and Gauss–Seidel sweeps
# ----------------------------------------------------------------------------------------------
Residual = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def _inverse_cdf_residual(
    law: _TruncatedNormalSum, sgn: np.ndarray, Pc: np.ndarray, t: np.ndarray
) -> Residual:
    """h(x) = F(x) − F(c) − t and h′(x) = f(x) for the rows of a §7.1 update.

    F(x) − F(c) = Σ_k c_k·(s_k·Φ(s_k·z_k(x)) − P_k(c)) with s_k = ±1 the side of component k's
    mean that c lies on (``sgn``) and P_k(c) = Φ(z_k(c)) − H(z_k(c)) (``Pc``): the tail-accurate
    mass of the distribution module at the cost of one ndtr per component.
    """
    mu = law._mu
    inv_s = sgn / law._sigma
    sc = law._coef * sgn
    const = Pc @ law._coef + t
    coef_pdf = law._coef_pdf * INV_SQRT_2PI

    def eval_h(x: np.ndarray, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w = (x[:, None] - mu) * inv_s[i]
        h = np.einsum("ij,ij->i", ndtr(w), sc[i]) - const[i]
        return h, np.exp(-0.5 * w * w) @ coef_pdf

    return eval_h


def _first_level_residual(
    law: _TruncatedNormalSum,
    sgn: np.ndarray,
    Pc: np.ndarray,
    phi_c: np.ndarray,
    d: np.ndarray,
    A: np.ndarray,
) -> Residual:
    """h(x) = (2x + d)·G(x) − M1_G(0, x) − A and h′(x) = 2G(x) + (x + d)·g(x) (symmetric x_1)."""
    mu = law._mu
    inv_s = sgn / law._sigma

    def eval_h(x: np.ndarray, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w = (x[:, None] - mu) * inv_s[i]
        mass = sgn[i] * ndtr(w) - Pc[i]
        phi_x = np.exp(-0.5 * w * w) * INV_SQRT_2PI
        Gx = mass @ law._coef
        M1 = mass @ law._coef_mu + (phi_c[i] - phi_x) @ law._coef_sigma
        gx = phi_x @ law._coef_pdf
        return (2.0 * x + d[i]) * Gx - M1 - A[i], 2.0 * Gx + (x + d[i]) * gx

    return eval_h


def _cd_sweep(
    prob: _Problem,
    X: np.ndarray,
    V: np.ndarray,
    *,
    only: np.ndarray | None = None,
    order: str = "forward",
) -> np.ndarray:
    """One Gauss–Seidel sweep of exact per-level updates (left to right); returns new X.

    ``V`` (the current objective per start) sets the ``NEGLIGIBLE_GAIN`` threshold. ``only``
    (a boolean mask like X) restricts the sweep to some variables and ``order`` may be
    "forward", "backward" or "both" (forward then backward) — used by the accelerated
    descent for the levels a Newton step holds fixed. Each update is solved by
    ``_solve_increasing`` on ``_inverse_cdf_residual`` (or ``_first_level_residual`` for x_1 of
    a symmetric table), with the NaN guard of §7.1. A histogram law goes to ``_cd_sweep_hist``.
    """
    if prob.histogram:
        return _cd_sweep_hist(prob, X, V, only=only, order=order)
    law = prob.law
    assert isinstance(law, _TruncatedNormalSum)
    P = prob.points(X)
    t_all = law._terms(P)  # (S, n+2, K) cache, refreshed as levels change
    z, Pm, H, phi = t_all.z.copy(), t_all.P.copy(), t_all.H.copy(), t_all.phi.copy()
    coef, coef_mu, coef_sigma = law._coef, law._coef_mu, law._coef_sigma
    threshold = NEGLIGIBLE_GAIN * np.abs(V)
    for j in _sweep_sequence(P.shape[1], order):
        allowed = np.ones(P.shape[0], dtype=bool) if only is None else only[:, j - 1]
        if not np.any(allowed):
            continue
        c, d, x_old = P[:, j - 1], P[:, j + 1], P[:, j]
        tc = _PointTerms(z[:, j - 1], Pm[:, j - 1], H[:, j - 1], phi[:, j - 1])
        td = _PointTerms(z[:, j + 1], Pm[:, j + 1], H[:, j + 1], phi[:, j + 1])
        delta_cd = _mass(tc, td)
        M0 = delta_cd @ coef
        todo = allowed & (M0 >= MIN_INTERVAL_MASS) & (M0 * (d - c) ** 2 > threshold)
        if not np.any(todo):
            continue
        rows = np.nonzero(todo)[0]
        sgn = 1.0 - 2.0 * tc.H[rows]  # +1 where c is below the component mean
        if prob.symmetric and j == 1:
            # 2x·G(x) = ∫_x^d (d − u) dG  ⇔  h(x) = (2x + d)·G(x) − M1_G(0, x) − A = 0 with
            # A = ∫_0^d (d − u) dG = d·G(d) − M1_G(0, d)
            M1_0d = delta_cd[rows] @ coef_mu + (tc.phi[rows] - td.phi[rows]) @ coef_sigma
            A = d[rows] * M0[rows] - M1_0d
            eval_h = _first_level_residual(law, sgn, tc.P[rows], tc.phi[rows], d[rows], A)
        else:
            # F(x) − F(c) = t,  t = M0(c, d) − ∫_c^d (r − c) dF / (d − c)
            Ucd = ((tc.phi[rows] - td.phi[rows]) - tc.z[rows] * delta_cd[rows]) @ coef_sigma
            M0r = M0[rows]
            t = np.clip(M0r - Ucd / (d[rows] - c[rows]), 0.0, M0r)
            eval_h = _inverse_cdf_residual(law, sgn, tc.P[rows], t)
        with np.errstate(all="ignore"):
            root = _solve_increasing(eval_h, c[rows], d[rows], x_old[rows])
        good = np.isfinite(root) & (root > c[rows]) & (root < d[rows]) & (root != x_old[rows])
        if not np.any(good):
            continue
        upd = rows[good]
        P[upd, j] = root[good]
        tx = law._terms(P[upd, j])
        z[upd, j], Pm[upd, j], H[upd, j], phi[upd, j] = tx.z, tx.P, tx.H, tx.phi
    return P[:, 1:-1].copy()


def _sweep_sequence(n_pts: int, order: str) -> list[int]:
    """Point indices 1 … n_pts − 2 of a sweep: "forward", "backward" or "both" (there and back)."""
    forward = list(range(1, n_pts - 1))
    if order == "forward":
        return forward
    if order == "backward":
        return forward[::-1]
    return forward + forward[::-1]


def _cd_sweep_hist(
    prob: _Problem,
    X: np.ndarray,
    V: np.ndarray,
    *,
    only: np.ndarray | None = None,
    order: str = "forward",
) -> np.ndarray:
    """``_cd_sweep`` on a histogram law: each exact update in closed form, no iteration.

    F is piecewise linear, so F(x) − F(c) = t is solved exactly in its bin (``_root_set``).
    Where F is flat (empty bins) the minimizers of the convex J form an interval
    [x_lo, x_hi] on which J is constant; the update is the point of it nearest to the old
    level (a level already in it does not move). The symmetric x_1 solves its quadratic in its
    bin (``_first_level_root``). NaN guard as in §7.1.
    """
    law = prob.law
    assert isinstance(law, _PiecewiseUniform)
    P = prob.points(X)
    # per point, kept current as levels move: bin, F(x) and M1(lower, x) as hi + lo
    K = law._bin(P)
    Fh, Fl, Mh, Ml = law._point_sums(P, K)
    threshold = NEGLIGIBLE_GAIN * np.abs(V)
    with np.errstate(all="ignore"):
        for j in _sweep_sequence(P.shape[1], order):
            allowed = None if only is None else only[:, j - 1]
            if allowed is not None and not allowed.any():
                continue
            c, d = P[:, j - 1], P[:, j + 1]
            M0 = (Fh[:, j + 1] - Fh[:, j - 1]) + (Fl[:, j + 1] - Fl[:, j - 1])
            D = d - c
            todo = (M0 >= MIN_INTERVAL_MASS) & (M0 * D * D > threshold)
            if allowed is not None:
                todo &= allowed
            # all rows (the usual case): slices, no gathers
            rows: np.ndarray | slice = slice(None) if todo.all() else todo.nonzero()[0]
            if not isinstance(rows, slice) and rows.size == 0:
                continue
            cr, Dr, M0r, kc = c[rows], D[rows], M0[rows], K[rows, j - 1]
            M1 = (Mh[rows, j + 1] - Mh[rows, j - 1]) + (Ml[rows, j + 1] - Ml[rows, j - 1])
            U = M1 - cr * M0r  # ∫_c^d (r − c) dF
            if prob.symmetric and j == 1:
                # 2x·G(x) = ∫_x^d (d − u) dG; c = 0, so A = ∫_0^d (d − u) dG = d·M0 − U
                dr = d[rows]
                root = law._first_level_root(dr, dr * M0r - U, K[rows, j + 1])
            else:
                t = np.minimum(np.maximum(M0r - U / Dr, 0.0), M0r)
                x_lo, x_hi = law._root_set(cr, t, kc, (Fh[rows, j - 1], Fl[rows, j - 1]))
                root = np.minimum(np.maximum(P[rows, j], x_lo), x_hi)
            # NaN guard (§7.1): strictly inside (c, d), finite, and a move
            off = root - cr
            good = (off > 0.0) & (off < Dr) & (root != P[rows, j])
            if good.any():
                upd = good.nonzero()[0] if isinstance(rows, slice) else rows[good]
                x_new = root[good]
                P[upd, j] = x_new
                k_new = law._bin(x_new)
                K[upd, j] = k_new
                Fh[upd, j], Fl[upd, j], Mh[upd, j], Ml[upd, j] = law._point_sums(x_new, k_new)
    return P[:, 1:-1].copy()


def _gd_sweep_hist(prob: _Problem, X: np.ndarray, lr: float) -> np.ndarray:
    """``_gd_sweep`` on a histogram law (the same step rule, piecewise-polynomial moments)."""
    law = prob.law
    assert isinstance(law, _PiecewiseUniform)
    P = prob.points(X)
    for j in range(1, P.shape[1] - 1):
        c, x, d = P[:, j - 1], P[:, j], P[:, j + 1]
        bc, bx, bd = law._bin(c), law._bin(x), law._bin(d)
        m_xd, u_xd = law._mass_and_up(x, d, bx, bd)
        down = (d - x) * m_xd - u_xd  # ∫_x^d (d − r) dF
        m_cx, up = law._mass_and_up(c, x, bc, bx)  # up = ∫_c^x (r − c) dF
        if prob.symmetric and j == 1:
            g = 2.0 * x * m_cx - down  # c = 0: G(x) = M0_G(0, x)
            delta = np.minimum(x, d - x)
        else:
            g = up - down
            delta = np.minimum(x - c, d - x)
        step = np.minimum(lr * np.abs(g), 0.5 * delta)
        P[:, j] = np.where(np.isfinite(g), x - np.sign(g) * step, x)
    return P[:, 1:-1].copy()


def _gd_sweep(prob: _Problem, X: np.ndarray, lr: float) -> np.ndarray:
    """One ALQ-G sweep: ℓ_j ← ℓ_j − sign(g_j)·min(η|g_j|, δ/2), Gauss–Seidel order (§7.3)."""
    if prob.histogram:
        return _gd_sweep_hist(prob, X, lr)
    law = prob.law
    assert isinstance(law, _TruncatedNormalSum)
    P = prob.points(X)
    terms = law._terms(P)
    z, Pm, H, phi = terms.z.copy(), terms.P.copy(), terms.H.copy(), terms.phi.copy()
    for j in range(1, P.shape[1] - 1):
        c, x, d = P[:, j - 1], P[:, j], P[:, j + 1]
        tc = _PointTerms(z[:, j - 1], Pm[:, j - 1], H[:, j - 1], phi[:, j - 1])
        tx = _PointTerms(z[:, j], Pm[:, j], H[:, j], phi[:, j])
        td = _PointTerms(z[:, j + 1], Pm[:, j + 1], H[:, j + 1], phi[:, j + 1])
        d_xd = _mass(tx, td)
        U_xd = ((tx.phi - td.phi) - tx.z * d_xd) @ law._coef_sigma
        down = (d - x) * (d_xd @ law._coef) - U_xd  # ∫_x^d (d − r) dF
        d_cx = _mass(tc, tx)
        if prob.symmetric and j == 1:
            g = 2.0 * x * (d_cx @ law._coef) - down  # c = 0: G(x) = M0_G(0, x)
            delta = np.minimum(x, d - x)
        else:
            up = ((tc.phi - tx.phi) - tc.z * d_cx) @ law._coef_sigma  # ∫_c^x (r − c) dF
            g = up - down
            delta = np.minimum(x - c, d - x)
        step = np.minimum(lr * np.abs(g), 0.5 * delta)
        x_new = np.where(np.isfinite(g), x - np.sign(g) * step, x)
        changed = x_new != x
        if np.any(changed):
            P[:, j] = x_new
            t_new = law._terms(x_new)
            z[:, j], Pm[:, j], H[:, j], phi[:, j] = t_new.z, t_new.P, t_new.H, t_new.phi
    return P[:, 1:-1].copy()


def _variance(prob: _Problem, X: np.ndarray) -> np.ndarray:
    F = prob.F
    L = prob.tables(X)
    if isinstance(F, HistogramDistribution):
        return F._table_variance(L)
    t = F._terms(L)
    a, b = t[:, :-1], t[:, 1:]
    S = _segment_bracket(a, b, _mass(a, b), np.diff(L, axis=1), F._sigma)
    return (S @ F._coef_sigma2).sum(axis=1)


def _descend(
    prob: _Problem,
    X: np.ndarray,
    *,
    max_sweeps: int,
    tol: float,
    sweeps: int | None,
    accelerate: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Coordinate descent from each row of X; returns (X, V, sweeps used) per start."""
    S = X.shape[0]
    used = np.zeros(S, dtype=np.int64)
    if prob.n_free == 0:
        return X, _variance(prob, X), used
    if sweeps is not None:
        for _ in range(sweeps):
            X = _cd_sweep(prob, X, _variance(prob, X))
        used[:] = sweeps
        return X, _variance(prob, X), used
    ev = _evaluate(prob, X)
    V = ev.V.copy()
    lam = np.zeros(S)
    active = np.ones(S, dtype=bool)
    have_ev = np.ones(S, dtype=bool)  # per start: is ``ev`` current for X
    newton_ok = np.zeros(S, dtype=bool)  # per start: may the next step be a Newton step
    for it in range(max_sweeps):
        idx = np.nonzero(active)[0]
        if idx.size == 0:
            break
        X_prev, V_prev = X.copy(), V.copy()
        ended = np.zeros(S, dtype=bool)
        nt = idx[newton_ok[idx]]
        cd = idx[~newton_ok[idx]]
        if nt.size:
            stale = nt[~have_ev[nt]]
            if stale.size:
                _store(ev, _evaluate(prob, X[stale]), stale)
                have_ev[stale] = True
            X_try, usable, lam[nt], frozen = _newton_step(prob, X[nt], _take(ev, nt), lam[nt])
            ok = nt[usable]
            acc = ok[:0]
            if ok.size:
                ev_try = _evaluate(prob, X_try[usable])
                accept = np.isfinite(ev_try.V) & (ev_try.V < V[ok])
                acc = ok[accept]
                X[acc] = X_try[usable][accept]
                _store(ev, _take(ev_try, np.nonzero(accept)[0]), acc)
                V[acc] = ev.V[acc]
            lam[acc] = np.where(lam[acc] > _LM_LAMBDA_FLOOR, 0.1 * lam[acc], 0.0)
            # the levels the step held fixed (zero curvature: in an empty region) get exact
            # updates, both directions, so that stranded levels migrate towards the mass
            frozen_acc = frozen[np.searchsorted(nt, acc)]
            mig = acc[np.any(frozen_acc, axis=1)]
            if mig.size:
                only = frozen[np.searchsorted(nt, mig)]
                X_m = _cd_sweep(prob, X[mig], V[mig], only=only, order="both")
                moved = np.any(X_m != X[mig], axis=1)
                if np.any(moved):
                    rows = mig[moved]
                    X[rows] = X_m[moved]
                    V[rows] = _variance(prob, X[rows])
                    have_ev[rows] = False
            # a Newton step never ends the descent: a rejected or negligible one hands over
            # to a plain sweep in the same iteration, which decides convergence
            small = (V_prev[acc] - V[acc]) <= tol * np.abs(V_prev[acc])
            newton_ok[acc[small]] = False
            rejected = np.setdiff1d(nt, acc)
            lam[rejected] = np.maximum(4.0 * lam[rejected], _LM_LAMBDA_FLOOR)
            cd = np.union1d(cd, rejected)
        if cd.size:
            X_cd = _cd_sweep(prob, X[cd], V[cd])
            V_cd = _variance(prob, X_cd)
            # the exact updates never raise V; guard against rounding anyway
            keep = V_cd <= V[cd]
            X[cd[keep]], V[cd[keep]] = X_cd[keep], V_cd[keep]
            have_ev[cd[keep]] = False
            decrease = V_prev[cd] - V[cd]
            move = np.max(np.abs(X[cd] - X_prev[cd]), axis=1)
            ended[cd] = (decrease <= tol * np.abs(V_prev[cd])) | (move <= MOVE_TOL)
            newton_ok[cd] = accelerate and it + 1 >= _WARMUP_SWEEPS
        used[idx] += 1
        active &= ~ended
    return X, V, used


# ----------------------------------------------------------------------------------------------
# starts and public API
# ----------------------------------------------------------------------------------------------
def _check_dist(dist: object) -> Distribution:
    if not isinstance(dist, (TruncatedNormalMixture, HistogramDistribution)):
        raise ValueError(  # noqa: TRY004 -- the package reports every bad argument as ValueError
            "dist must be a TruncatedNormalMixture or a HistogramDistribution, "
            f"got {type(dist).__name__}"
        )
    return dist


def _check_initial(initial: object, num_levels: int) -> np.ndarray:
    L = validate_levels(initial)
    if L.size != num_levels:
        raise ValueError(
            f"the initial table has {L.size} levels, expected {num_levels} for these bits"
        )
    return L


def _companding_positions(law: Law, q: np.ndarray) -> np.ndarray:
    """Positions x with C(x) = q for the normalized cumulative C of f^(1/3) on the support.

    f^(1/3) is the high-resolution optimal density of levels for a cost ∫ f·h³ per interval,
    which V is (S(c, d) ≈ f·(d − c)³/6). The integral is a trapezoid rule on a uniform grid,
    refined around the heaviest components whose f^(1/3) (a normal of width σ√3) is narrower
    than two grid steps; this only builds a starting point, so that accuracy is ample. On a
    histogram f^(1/3) is piecewise constant and C is exact.
    """
    if isinstance(law, _PiecewiseUniform):
        return law._companding_positions(q)
    lo, hi = law.lower, law.upper
    grid = np.linspace(lo, hi, _COMPANDING_GRID)
    step = (hi - lo) / (_COMPANDING_GRID - 1)
    narrow = np.nonzero(law._sigma * math.sqrt(3.0) < 2.0 * step)[0]
    if narrow.size:
        heavy = narrow[np.argsort(-law._coef[narrow], kind="stable")][:_COMPANDING_LOCAL]
        z = np.linspace(-_COMPANDING_Z, _COMPANDING_Z, _COMPANDING_LOCAL_POINTS)
        local = (law._mu[heavy, None] + law._sigma[heavy, None] * z).ravel()
        grid = np.unique(np.clip(np.concatenate([grid, local]), lo, hi))
    g = np.cbrt(np.maximum(law.pdf(grid), 0.0))
    cum = np.concatenate([[0.0], np.cumsum(0.5 * (g[1:] + g[:-1]) * np.diff(grid))])
    if not (np.isfinite(cum[-1]) and cum[-1] > 0.0):
        return lo + (hi - lo) * q
    return np.interp(q, cum / cum[-1], grid)


def alq_initializations(
    dist: Distribution,
    bits: int,
    *,
    symmetric: bool = False,
    companding_start: bool = True,
) -> list[np.ndarray]:
    """The §7.2 starts as valid tables: [quantiles, U-ref, E-ref(p = 1/2)] (+ companding).

    Quantiles are F⁻¹(k/(N − 1)) (interior k), or for ``symmetric`` the mirrored
    x_i = G⁻¹((2i − 1)/(2K − 1)). ``companding_start`` (package extension, default on) adds the
    same construction for the density ∝ f^(1/3) (the asymptotically optimal level density):
    unlike the three reference starts it spreads levels over separated modes in the right
    proportion, which coordinate descent cannot fix afterwards (levels do not cross empty
    gaps). Collapsed positions (a near point mass) are pushed apart by ``separate_levels``.
    """
    F = _check_dist(dist)
    b = check_bits(bits)
    n = 2**b
    if symmetric:
        K = n // 2
        q = (2.0 * np.arange(1, K) - 1.0) / (2.0 * K - 1.0)
        G = _folded(F)
        inner = [G.ppf(q)] + ([_companding_positions(G, q)] if companding_start else [])
        tables = []
        for x in inner:
            pos = np.concatenate([x, [1.0]])
            tables.append(np.concatenate([-pos[::-1], pos]))
    else:
        q = np.arange(1, n - 1) / (n - 1.0)
        inner = [F.ppf(q)] + ([_companding_positions(F, q)] if companding_start else [])
        tables = [np.concatenate([[-1.0], x, [1.0]]) for x in inner]
    out = [separate_levels(tables[0]), uniform(b), exponential(b, 0.5)]
    out.extend(separate_levels(t) for t in tables[1:])
    return out


def _starts(
    prob: _Problem, bits: int, initial: object | None, companding_start: bool
) -> tuple[list[str], np.ndarray]:
    tables = alq_initializations(
        prob.F, bits, symmetric=prob.symmetric, companding_start=companding_start
    )
    names = ["quantile", "uniform", "exponential", "companding"][: len(tables)]
    if initial is not None:
        L = _check_initial(initial, prob.num_levels)
        if prob.symmetric:
            L = separate_levels(prob.tables(prob.free(L)[None, :])[0])
        tables.append(L)
        names.append("initial")
    X = np.stack([prob.free(t) for t in tables])
    return names, X


def _relocation_candidates(prob: _Problem, x: np.ndarray) -> np.ndarray:
    """Free-variable vectors with one level moved to another gap (rows, sorted).

    Level i (of the free variables x) is removed and a level inserted at the probability
    midpoint law⁻¹((law(a) + law(b))/2) of a gap [a, b] not adjacent to it (adjacent gaps are
    local moves the descent already explores). With more than ``_RELOCATE_MAX_SCORED`` pairs,
    only the levels of smallest and the gaps of largest local cost S are paired.
    """
    law = prob.law
    P = prob.points(x[None, :])[0]
    n = x.size
    cdf = law.cdf(P)
    mids = law.ppf(np.clip(0.5 * (cdf[:-1] + cdf[1:]), 0.0, 1.0))
    gap_ok = (mids > P[:-1]) & (mids < P[1:])
    remove = np.arange(n)
    gaps = np.arange(n + 1)
    per_side = math.isqrt(_RELOCATE_MAX_SCORED)
    if n * (n + 1) > _RELOCATE_MAX_SCORED:
        S = law.segment_cost(P[:-1], P[1:])
        remove = np.sort(np.argsort(S[:-1] + S[1:], kind="stable")[:per_side])
        gaps = np.sort(np.argsort(-S, kind="stable")[:per_side])
    grid_i, grid_m = np.meshgrid(remove, gaps, indexing="ij")
    i, m = grid_i.ravel(), grid_m.ravel()
    keep = (m != i) & (m != i + 1) & gap_ok[m]
    i, m = i[keep], m[keep]
    if i.size == 0:
        return np.empty((0, n))
    rows = np.repeat(x[None, :], i.size, axis=0)
    rows[np.arange(i.size), i] = mids[m]
    return np.sort(rows, axis=1)


def _relocate(
    prob: _Problem,
    x: np.ndarray,
    v: float,
    *,
    max_sweeps: int,
    tol: float,
    sweeps: int | None,
    accelerate: bool,
) -> tuple[np.ndarray, float, int]:
    """Relocation moves after the descent (``fit_alq(..., relocate=True)``).

    Coordinate descent cannot move a level across the others, so on multimodal laws
    (histograms with empty bins, separated modes) it can stop with one level too many on one
    side. Each round scores all one-level moves (``_relocation_candidates``) by their exact V,
    descends the ``RELOCATE_CANDIDATES`` best and keeps the best result if it lowers V by more
    than a fraction ``_RELOCATE_GAIN``; rounds stop when none does (at most
    ``RELOCATE_ROUNDS``). V never increases; the result is again a fixed point of the descent.
    Returns (x, V, rounds that improved).
    """
    improved = 0
    for _ in range(RELOCATE_ROUNDS):
        cand = _relocation_candidates(prob, x)
        if cand.shape[0] == 0:
            break
        Vc = _variance(prob, cand)
        order = np.lexsort((np.arange(Vc.size), Vc))[:RELOCATE_CANDIDATES]
        X, V, _ = _descend(
            prob, cand[order], max_sweeps=max_sweeps, tol=tol, sweeps=sweeps, accelerate=accelerate
        )
        best = int(np.argmin(V))
        if not V[best] < v * (1.0 - _RELOCATE_GAIN):
            break
        x, v = X[best], float(V[best])
        improved += 1
    return x, v, improved


def _finish(prob: _Problem, X: np.ndarray) -> np.ndarray:
    return separate_levels(prob.tables(X[None, :])[0])


def alq_descent(
    dist: Distribution,
    levels: object,
    *,
    symmetric: bool = False,
    max_sweeps: int = 1000,
    tol: float = 1e-10,
    sweeps: int | None = None,
    accelerate: bool = True,
) -> np.ndarray:
    """Exact coordinate descent from one start table ``levels``; returns the valid result table.

    With ``symmetric`` the start is symmetrized first (x = (ℓ⁺ − reversed ℓ⁻)/2). V of the
    result is never above V of the (symmetrized) start.
    """
    F = _check_dist(dist)
    L = validate_levels(levels)
    if symmetric and L.size % 2:
        raise ValueError("the symmetric (zero-free) fit needs an even number of levels")
    _check_sweep_args(max_sweeps, tol, sweeps)
    prob = _Problem(F, bool(symmetric), int(L.size))
    X0 = prob.free(L)[None, :]
    if symmetric:
        X0 = prob.free(separate_levels(prob.tables(X0)[0]))[None, :]
    X, _, _ = _descend(
        prob, X0, max_sweeps=max_sweeps, tol=tol, sweeps=sweeps, accelerate=accelerate
    )
    return _finish(prob, X[0])


def _check_sweep_args(max_sweeps: int, tol: float, sweeps: int | None) -> None:
    if int(max_sweeps) != max_sweeps or max_sweeps < 1:
        raise ValueError(f"max_sweeps must be a positive integer, got {max_sweeps!r}")
    if not (np.isfinite(tol) and tol >= 0.0):
        raise ValueError(f"tol must be a finite non-negative number, got {tol!r}")
    if sweeps is not None and (int(sweeps) != sweeps or sweeps < 0):
        raise ValueError(f"sweeps must be a non-negative integer or None, got {sweeps!r}")


def fit_alq(
    dist: Distribution,
    bits: int,
    *,
    symmetric: bool = False,
    initial: object | None = None,
    max_sweeps: int = 1000,
    tol: float = 1e-10,
    sweeps: int | None = None,
    accelerate: bool = True,
    companding_start: bool = True,
    relocate: bool = False,
) -> np.ndarray:
    """ALQ (or ALQ-N on a single-component ``dist``): the 2^bits-level table minimizing V.

    Runs the exact coordinate descent (module docstring) from the quantile, U-ref and E-ref
    starts, the companding start (unless ``companding_start=False``; see
    ``alq_initializations``) and ``initial`` (e.g. the previous table) if given, and returns
    the table of lowest V as a valid read-only float64 array. ``sweeps=n`` does exactly n
    plain sweeps per start (the reference's 30); otherwise sweeps run until the
    ``tol``/``MOVE_TOL`` stop or ``max_sweeps``. ``dist`` may be a ``TruncatedNormalMixture``
    or a ``HistogramDistribution``. ``relocate=True`` (package extension, off by default: it
    costs one to a few more descents) then tries moving single levels to other gaps
    (``_relocate``), which helps on multimodal laws such as sparse or irregular histograms.
    Deterministic.
    """
    F = _check_dist(dist)
    b = check_bits(bits)
    _check_sweep_args(max_sweeps, tol, sweeps)
    prob = _Problem(F, bool(symmetric), 2**b)
    names, X0 = _starts(prob, b, initial, companding_start)
    X, V, used = _descend(
        prob, X0, max_sweeps=max_sweeps, tol=tol, sweeps=sweeps, accelerate=accelerate
    )
    best = int(np.argmin(V))  # first minimum on ties
    logger.debug(
        "fit_alq bits=%d symmetric=%s: V=%s, sweeps=%s, chose %s start",
        b,
        symmetric,
        V.tolist(),
        used.tolist(),
        names[best],
    )
    x = X[best]
    if relocate and prob.n_free > 1:
        x, v, rounds = _relocate(
            prob,
            x,
            float(V[best]),
            max_sweeps=max_sweeps,
            tol=tol,
            sweeps=sweeps,
            accelerate=accelerate,
        )
        logger.debug("fit_alq relocation: %d improving rounds, V=%.10g", rounds, v)
    return _finish(prob, x)


def fit_alq_gd(
    dist: Distribution,
    bits: int,
    *,
    lr: float = 0.1,
    sweeps: int = 30,
    symmetric: bool = True,
    initial: object | None = None,
    companding_start: bool = True,
) -> np.ndarray:
    """ALQ-G (§7.3): ``sweeps`` Gauss–Seidel sweeps of clipped gradient steps from each start
    (those of ``fit_alq``), lowest V kept. The step bound δ/2 keeps the levels ordered.
    Deterministic.
    """
    F = _check_dist(dist)
    b = check_bits(bits)
    if not (np.isfinite(lr) and lr > 0.0):
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    if int(sweeps) != sweeps or sweeps < 0:
        raise ValueError(f"sweeps must be a non-negative integer, got {sweeps!r}")
    prob = _Problem(F, bool(symmetric), 2**b)
    names, X = _starts(prob, b, initial, companding_start)
    if prob.n_free > 0:
        for _ in range(int(sweeps)):
            X = _gd_sweep(prob, X, float(lr))
    V = _variance(prob, X)
    best = int(np.argmin(V))
    logger.debug("fit_alq_gd bits=%d: V=%s, chose %s start", b, V.tolist(), names[best])
    return _finish(prob, X[best])
