"""AMQ: the exponential table ±{p^s, …, p, 1} with the multiplier p fitted to F (spec §8).

Spec: ``docs/quantizers.md`` §8 (paper arXiv 2010.12460). With s = 2^(b−1) − 1 the table E(p) has
2^b levels, no zero, and p ∈ (0, 1). The objective is the full expected variance

    V(p) = V(E(p); F) = ∫_0^{p^s} (p^{2s} − u²) dG
                        + Σ_{j=0}^{s−1} ∫_{p^{j+1}}^{p^j} (p^j − u)(u − p^{j+1}) dG

(G the law of |r|; evaluated here on F with the signed table, which is the same number).
V(p) is multimodal (e.g. two local minima at 3 bits for TN(0, 1/128)), and p is a scalar whose
V is cheap in closed form, so the package method is a global search:

1. evaluate V on ``GRID_POINTS`` values of p log-spaced on [``GRID_LOW``, ``GRID_HIGH``]
   (closed form without the narrow-interval series: accurate to a few ulps of V's scale, which
   is all the ranking needs);
2. refine each of the ``REFINE_MINIMA`` lowest local minima of the grid with bounded Brent in
   log p between its grid neighbours;
3. clamp p to [``P_MIN``, ``P_MAX``];
4. select by the full V (ties: smaller p first). ``initial_p`` (the previous p, a warm start)
   joins the candidates.

AMQ-N is the same on the single pooled truncated normal; AMQ on the empirical histogram
(``histogram.HistogramDistribution``) is the same search on its piecewise-polynomial V(p): any
``model.Distribution`` is searched through its ``table_variance``.
The reference's gradient descent (η = 0.7, positive-levels-only selection; pitfall P4) is not
reproduced here.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from horovod_aq.levels.families import check_bits, exponential
from horovod_aq.levels.model import Distribution, check_distribution

__all__ = [
    "GRID_HIGH",
    "GRID_LOW",
    "GRID_POINTS",
    "P_MAX",
    "P_MIN",
    "amq_multiplier",
    "amq_variance",
    "fit_amq",
]

logger = logging.getLogger(__name__)

#: The global grid over p (log-spaced) and the clamp on the result (§8).
GRID_POINTS = 256
GRID_LOW = 1e-3
GRID_HIGH = 0.999
P_MIN = 1e-4
P_MAX = 1.0 - 1e-4
#: Number of grid local minima refined by Brent.
REFINE_MINIMA = 3
#: Brent tolerance on log p.
_BRENT_XATOL = 1e-10
#: Tables evaluated per vectorized batch on the grid (bounds the temporary arrays).
_GRID_BATCH = 32


def _tables(p: np.ndarray, bits: int) -> np.ndarray:
    """Rows E(p) = (−1, …, −p^s, p^s, …, p, 1) for each p (no validation; may underflow to ±0)."""
    s = 2 ** (bits - 1) - 1
    pos = np.asarray(p, dtype=np.float64)[:, None] ** np.arange(s, -1, -1, dtype=np.float64)
    return np.concatenate([-pos[:, ::-1], pos], axis=1)


def _v_of_p(dist: Distribution, p: np.ndarray, bits: int, *, series: bool = True) -> np.ndarray:
    """V(p) = V(E(p); F) for each p, ``_GRID_BATCH`` tables at a time (``series``: see
    ``Distribution.table_variance``)."""
    p = np.asarray(p, dtype=np.float64).reshape(-1)
    out = np.empty(p.size)
    for start in range(0, p.size, _GRID_BATCH):
        sl = slice(start, start + _GRID_BATCH)
        out[sl] = dist.table_variance(_tables(p[sl], bits), series=series)
    return out


def amq_variance(dist: Distribution, bits: int, p: object) -> np.ndarray:
    """V(E(p); F) for an array of multipliers p ∈ (0, 1) (closed form, vectorized)."""
    check_distribution(dist)
    b = check_bits(bits)
    p_arr = np.asarray(p, dtype=np.float64)
    if not np.all((p_arr > 0.0) & (p_arr < 1.0)):
        raise ValueError("the multiplier p must lie in (0, 1)")
    return _v_of_p(dist, p_arr, b).reshape(p_arr.shape)


def amq_multiplier(
    dist: Distribution,
    bits: int,
    *,
    initial_p: float | None = None,
    method: str = "grid",
) -> float:
    """The multiplier p* ∈ [P_MIN, P_MAX] minimizing V(E(p); F) (module docstring).

    ``bits = 1`` has no free level (the table is {−1, 1}); it returns ``initial_p`` clamped, or
    1/2. Deterministic.
    """
    F = check_distribution(dist)
    b = check_bits(bits)
    if method != "grid":
        raise ValueError(
            f"method must be 'grid' (the reference mode is not provided), got {method!r}"
        )
    if initial_p is not None:
        initial_p = float(initial_p)
        if not (math.isfinite(initial_p) and 0.0 < initial_p < 1.0):
            raise ValueError(f"initial_p must lie in (0, 1), got {initial_p!r}")
        initial_p = min(max(initial_p, P_MIN), P_MAX)
    if b == 1:
        return 0.5 if initial_p is None else initial_p

    log_grid = np.linspace(math.log(GRID_LOW), math.log(GRID_HIGH), GRID_POINTS)
    grid = np.exp(log_grid)
    # the grid only ranks candidates: no narrow-interval series (absolute error ~ulps of V)
    v_grid = _v_of_p(F, grid, b, series=False)
    # local minima of the grid (ends included), lowest first; ties by position
    left = np.concatenate([[np.inf], v_grid[:-1]])
    right = np.concatenate([v_grid[1:], [np.inf]])
    minima = np.nonzero((v_grid <= left) & (v_grid <= right))[0]
    minima = minima[np.lexsort((minima, v_grid[minima]))][:REFINE_MINIMA]

    # scipy.optimize is imported here, not with the package: it would add about 0.25 s (a third)
    # to `import horovod_aq` in every rank of the jobs that never fit AMQ
    # (tests/test_import_isolation.py)
    from scipy.optimize import minimize_scalar

    candidates = [float(grid[i]) for i in minima]
    for i in minima.tolist():
        lo = float(log_grid[max(i - 1, 0)])
        hi = float(log_grid[min(i + 1, GRID_POINTS - 1)])
        res = minimize_scalar(
            lambda lp: float(_v_of_p(F, np.array([math.exp(lp)]), b)[0]),
            bounds=(lo, hi),
            method="bounded",
            options={"xatol": _BRENT_XATOL},
        )
        if np.isfinite(res.fun):
            candidates.append(float(math.exp(res.x)))
    if initial_p is not None:
        candidates.append(initial_p)
    cand = np.clip(np.array(candidates), P_MIN, P_MAX)
    v_cand = _v_of_p(F, cand, b)
    order = np.lexsort((cand, v_cand))
    p_star = float(cand[order[0]])
    logger.debug("amq_multiplier bits=%d: p*=%.6g, V=%.6g", b, p_star, v_cand[order[0]])
    return p_star


def fit_amq(
    dist: Distribution,
    bits: int,
    *,
    initial_p: float | None = None,
    method: str = "grid",
) -> np.ndarray:
    """AMQ (or AMQ-N on a single-component ``dist``): the table E(p*) as a valid float64 array."""
    p = amq_multiplier(dist, bits, initial_p=initial_p, method=method)
    return exponential(bits, p)
