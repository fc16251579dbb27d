"""Relocation moves after the ALQ descent (``fit_alq(..., relocate=True)``, package extension).

Coordinate descent never moves a level past its neighbours, so on multimodal laws — irregular
or sparse histograms — it can stop with one level too many on one side of a gap. After the
descent, each round scores every "remove ℓ_i, insert a level at the probability midpoint
law⁻¹((law(a) + law(b))/2) of another gap [a, b]" move by its exact V, descends the best few
and keeps the result if V drops; V never increases and the result is again a fixed point of
the descent (``docs/quantizers.md`` §7.2).
"""

from __future__ import annotations

import math

import numpy as np

from horovod_aq.levels.alq.descent import descend
from horovod_aq.levels.alq.problem import Problem, variance

__all__ = ["RELOCATE_CANDIDATES", "RELOCATE_ROUNDS", "relocate"]

#: At most RELOCATE_ROUNDS rounds; each scores up to _RELOCATE_MAX_SCORED one-level moves by
#: their exact V, descends the RELOCATE_CANDIDATES best, and keeps the result if it lowers V by
#: more than _RELOCATE_GAIN.
RELOCATE_ROUNDS = 4
RELOCATE_CANDIDATES = 6
_RELOCATE_MAX_SCORED = 1024
_RELOCATE_GAIN = 1e-9


def _relocation_candidates(prob: Problem, x: np.ndarray) -> np.ndarray:
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


def relocate(
    prob: Problem,
    x: np.ndarray,
    v: float,
    *,
    max_sweeps: int,
    tol: float,
    sweeps: int | None,
    accelerate: bool,
) -> tuple[np.ndarray, float, int]:
    """Relocation rounds from the descended free variables x (of V = v).

    Each round scores all one-level moves (``_relocation_candidates``) by their exact V,
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
        Vc = variance(prob, cand)
        order = np.lexsort((np.arange(Vc.size), Vc))[:RELOCATE_CANDIDATES]
        X, V, _ = descend(
            prob, cand[order], max_sweeps=max_sweeps, tol=tol, sweeps=sweeps, accelerate=accelerate
        )
        best = int(np.argmin(V))
        if not V[best] < v * (1.0 - _RELOCATE_GAIN):
            break
        x, v = X[best], float(V[best])
        improved += 1
    return x, v, improved
