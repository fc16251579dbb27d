"""Gauss–Seidel sweeps over the levels: exact coordinate descent (ALQ) and ALQ-G steps.

Spec: ``docs/quantizers.md`` §7.2 (coordinate descent) and §7.3 (ALQ-G). Both visit the interior
points of P = [lo, X, 1] left to right, each update using the fresh left neighbour; the numbers
come from a per-family point cache (``level_points``: ``NormalPoints`` on the mixture,
``HistogramPoints`` on the histogram), so the sweeps themselves are family-free.

* ``cd_sweep``: the exact §7.1 update of each level (``problem`` module docstring); V is
  non-increasing.
* ``gd_sweep`` (ALQ-G, §7.3): g_j = J′(ℓ_j) = ∫_c^x (r − c) dF − ∫_x^d (d − r) dF,
  δ = min(ℓ_j − ℓ_{j−1}, ℓ_{j+1} − ℓ_j), ℓ_j ← ℓ_j − sign(g_j)·min(η|g_j|, δ/2); for x_1 of a
  symmetric table (c = 0) g = 2x·G(x) − ∫_x^d (d − u) dG and the left gap is x_1 itself.
"""

from __future__ import annotations

import numpy as np

from horovod_aq.levels.alq.histogram_updates import HistogramPoints
from horovod_aq.levels.alq.normal_updates import NormalPoints
from horovod_aq.levels.alq.problem import NEGLIGIBLE_GAIN, Problem
from horovod_aq.levels.distribution import _TruncatedNormalSum
from horovod_aq.levels.histogram import _PiecewiseUniform
from horovod_aq.levels.model import Law

__all__ = ["cd_sweep", "gd_sweep", "level_points", "sweep_sequence"]


def level_points(law: Law, P: np.ndarray) -> NormalPoints | HistogramPoints:
    """The point cache and exact update for ``law``'s family (the one place that dispatches).

    The two families solve §7.1 by different algorithms (iterated root finding on a smooth
    cdf; a closed-form solve in one bin with flat stretches), so each has its own class.
    """
    if isinstance(law, _PiecewiseUniform):
        return HistogramPoints(law, P)
    if isinstance(law, _TruncatedNormalSum):
        return NormalPoints(law, P)
    raise ValueError(
        "ALQ's exact updates support the TruncatedNormalMixture and HistogramDistribution "
        f"families, got {type(law).__name__}"
    )


def sweep_sequence(n_pts: int, order: str) -> list[int]:
    """Point indices 1 … n_pts − 2 of a sweep: "forward", "backward" or "both" (there and back)."""
    forward = list(range(1, n_pts - 1))
    if order == "forward":
        return forward
    if order == "backward":
        return forward[::-1]
    return forward + forward[::-1]


def cd_sweep(
    prob: Problem,
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
    descent for the levels a Newton step holds fixed. The NaN guard of §7.1 applies.
    """
    pts = level_points(prob.law, prob.points(X))
    threshold = NEGLIGIBLE_GAIN * np.abs(V)
    for j in sweep_sequence(pts.P.shape[1], order):
        allowed = None if only is None else only[:, j - 1]
        if allowed is not None and not allowed.any():
            continue
        pts.exact_update(j, threshold, allowed, first_level=prob.symmetric and j == 1)
    return pts.P[:, 1:-1].copy()


def gd_sweep(prob: Problem, X: np.ndarray, lr: float) -> np.ndarray:
    """One ALQ-G sweep: ℓ_j ← ℓ_j − sign(g_j)·min(η|g_j|, δ/2), Gauss–Seidel order (§7.3)."""
    pts = level_points(prob.law, prob.points(X))
    P = pts.P
    for j in range(1, P.shape[1] - 1):
        c, x, d = P[:, j - 1], P[:, j], P[:, j + 1]
        m_xd, u_xd = pts.mass_and_up(j, j + 1)
        down = (d - x) * m_xd - u_xd  # ∫_x^d (d − r) dF
        m_cx, up = pts.mass_and_up(j - 1, j)  # up = ∫_c^x (r − c) dF
        if prob.symmetric and j == 1:
            g = 2.0 * x * m_cx - down  # c = 0: G(x) = M0_G(0, x)
            delta = np.minimum(x, d - x)
        else:
            g = up - down
            delta = np.minimum(x - c, d - x)
        step = np.minimum(lr * np.abs(g), 0.5 * delta)
        x_new = np.where(np.isfinite(g), x - np.sign(g) * step, x)
        if np.any(x_new != x):
            pts.move(j, slice(None), x_new)
    return P[:, 1:-1].copy()
