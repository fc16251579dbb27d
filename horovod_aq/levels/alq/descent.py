"""The ALQ descent from a batch of starts: plain sweeps, accelerated by damped Newton steps.

Spec: ``docs/quantizers.md`` §7.2. Sweeps (``sweeps.cd_sweep``) are Gauss–Seidel, left to right;
V is non-increasing. Stop when a sweep lowers V by less than ``tol``·V or moves no level by more
than ``MOVE_TOL``; ``max_sweeps`` caps the iterations (sweeps or Newton steps, below).
``sweeps=n`` instead runs exactly n plain sweeps (the reference runs 30).

Acceleration (``accelerate=True``, default). Plain coordinate descent converges only linearly,
and slowly when levels must travel far. After one plain sweep, damped Newton steps on the full
stationarity system ∇V = 0 are interleaved, with the tridiagonal Hessian in closed form
(``problem.evaluate``). A step solves (∇²V + λ·diag ∇²V)·s = −∇V (Levenberg–Marquardt: λ = 0
near a minimum, raised where the Hessian is indefinite), is shortened so that no interval loses
more than half its length, and is accepted only if it lowers V. Levels of zero curvature (in
empty regions) are held fixed by the step and get exact per-level updates instead (a partial
sweep over just those levels, forwards then backwards, so stranded levels migrate to the mass).
A rejected step, or one that lowers V by less than ``tol``·V, hands over to a plain sweep, and
only plain sweeps decide convergence. So V is non-increasing and the result is a fixed point of
the exact coordinate descent (a stationary point of V): the acceleration changes the path, not
the stop rule (the tests compare it with unaccelerated descent). On a histogram the Newton steps
use the exact piecewise Hessian (f taken right-continuous at an edge); levels in empty bins have
zero curvature and are moved by the exact updates, as above.
"""

from __future__ import annotations

import numpy as np

from horovod_aq.levels.alq.problem import Evaluation, Problem, evaluate, variance
from horovod_aq.levels.alq.sweeps import cd_sweep

__all__ = ["MOVE_TOL", "descend"]

#: Stop when no level moved by more than this in a sweep (§7.2).
MOVE_TOL = 1e-12
#: Plain sweeps before the first Newton step is tried (accelerated mode).
_WARMUP_SWEEPS = 1
#: Levenberg–Marquardt damping of the Newton steps: λ after a rejected step is at least the
#: floor, shrinks ×1/10 after each accepted step (below the floor: back to plain Newton).
_LM_LAMBDA_FLOOR = 1e-4
_LM_LAMBDA_MAX = 1e8
#: Newton steps hold variables whose curvature is below this fraction of the largest fixed.
_FREEZE_CURVATURE = 1e-12
#: A damped Newton step may shrink each interval to at most this fraction of its length.
_NEWTON_FRACTION = 0.5


def tridiagonal_solve(
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


def newton_step(
    prob: Problem, X: np.ndarray, ev: Evaluation, lam: np.ndarray
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
        s_rows, pd = tridiagonal_solve(d, o[rows], rhs[rows])
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


def descend(
    prob: Problem,
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
        return X, variance(prob, X), used
    if sweeps is not None:
        for _ in range(sweeps):
            X = cd_sweep(prob, X, variance(prob, X))
        used[:] = sweeps
        return X, variance(prob, X), used
    ev = evaluate(prob, X)
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
                ev.store(evaluate(prob, X[stale]), stale)
                have_ev[stale] = True
            X_try, usable, lam[nt], frozen = newton_step(prob, X[nt], ev.take(nt), lam[nt])
            ok = nt[usable]
            acc = ok[:0]
            if ok.size:
                ev_try = evaluate(prob, X_try[usable])
                accept = np.isfinite(ev_try.V) & (ev_try.V < V[ok])
                acc = ok[accept]
                X[acc] = X_try[usable][accept]
                ev.store(ev_try.take(np.nonzero(accept)[0]), acc)
                V[acc] = ev.V[acc]
            lam[acc] = np.where(lam[acc] > _LM_LAMBDA_FLOOR, 0.1 * lam[acc], 0.0)
            # the levels the step held fixed (zero curvature: in an empty region) get exact
            # updates, both directions, so that stranded levels migrate towards the mass
            frozen_acc = frozen[np.searchsorted(nt, acc)]
            mig = acc[np.any(frozen_acc, axis=1)]
            if mig.size:
                only = frozen[np.searchsorted(nt, mig)]
                X_m = cd_sweep(prob, X[mig], V[mig], only=only, order="both")
                moved = np.any(X_m != X[mig], axis=1)
                if np.any(moved):
                    rows = mig[moved]
                    X[rows] = X_m[moved]
                    V[rows] = variance(prob, X[rows])
                    have_ev[rows] = False
            # a Newton step never ends the descent: a rejected or negligible one hands over
            # to a plain sweep in the same iteration, which decides convergence
            small = (V_prev[acc] - V[acc]) <= tol * np.abs(V_prev[acc])
            newton_ok[acc[small]] = False
            rejected = np.setdiff1d(nt, acc)
            lam[rejected] = np.maximum(4.0 * lam[rejected], _LM_LAMBDA_FLOOR)
            cd = np.union1d(cd, rejected)
        if cd.size:
            X_cd = cd_sweep(prob, X[cd], V[cd])
            V_cd = variance(prob, X_cd)
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
