"""Vectorized safeguarded Newton (rtsafe) for roots of increasing functions on brackets.

Used by ``TruncatedNormalMixture.ppf`` (F(x) = q) and by ALQ's exact per-level updates on the
mixture (``alq.normal_updates``: F(x) − F(c) = t, and the symmetric x_1 equation,
``docs/quantizers.md`` §7.1).
For each element, x ← x − h(x)/h′(x) when that stays inside the current bracket and is at most
half the previous step, otherwise the bracket is bisected; the bracket [lo, hi] is updated
from the sign of h at every iterate.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

__all__ = ["solve_increasing"]

# Iteration cap (bisection alone needs < 1100 halvings to exhaust a double bracket; Newton usually
# converges in a handful) and tolerance in ulps.
_ROOT_MAX_ITER = 200
_ROOT_XTOL_EPS = 4.0
_EPS = float(np.finfo(np.float64).eps)
_TINY = 1e-300


def solve_increasing(
    eval_h: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
    lo: np.ndarray,
    hi: np.ndarray,
    x0: np.ndarray,
) -> np.ndarray:
    """Roots of increasing functions h_i on [lo_i, hi_i]: Newton with bisection fallback (rtsafe).

    ``eval_h(x, idx)`` returns (h(x), h′(x)) for the elements ``idx`` (one vectorized call per
    iteration for the unconverged elements; the bracket logic is scalar). Requires
    h(lo) ≤ 0 ≤ h(hi). Stops when the Newton correction or the bracket is below
    ``_ROOT_XTOL_EPS`` ulps of x. Returns NaN where h was not finite.
    """
    lo_l, hi_l = lo.tolist(), hi.tolist()
    xs = [
        x if lo_i < x < hi_i else 0.5 * (lo_i + hi_i)
        for x, lo_i, hi_i in zip(x0.tolist(), lo_l, hi_l)
    ]
    dx_old = [h_i - l_i for l_i, h_i in zip(lo_l, hi_l)]
    out = list(xs)
    active = list(range(len(xs)))
    for _ in range(_ROOT_MAX_ITER):
        h_arr, dh_arr = eval_h(np.array([xs[i] for i in active]), np.array(active, dtype=np.intp))
        still = []
        for i, h, dh in zip(active, h_arr.tolist(), dh_arr.tolist()):
            x = xs[i]
            if not math.isfinite(h):
                out[i] = math.nan
                continue
            if h == 0.0:
                out[i] = x
                continue
            if h > 0.0:
                hi_l[i] = x
            else:
                lo_l[i] = x
            tol = _ROOT_XTOL_EPS * _EPS * abs(x) + _TINY
            step = h / dh if dh > 0.0 and math.isfinite(dh) else math.inf
            if abs(step) <= tol:  # converged (the correction may be below one ulp of x)
                out[i] = min(max(x - step, lo_l[i]), hi_l[i])
                continue
            x_new = x - step
            if not (lo_l[i] < x_new < hi_l[i] and abs(2.0 * h) <= abs(dx_old[i] * dh)):
                x_new = 0.5 * (lo_l[i] + hi_l[i])
            dx_old[i] = abs(x_new - x)
            out[i] = xs[i] = x_new
            if hi_l[i] - lo_l[i] > tol:
                still.append(i)
        active = still
        if not active:
            break
    return np.array(out, dtype=np.float64)
