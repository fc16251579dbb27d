"""The starting tables of the ALQ fits (§7.2 initializations and the package extensions).

Spec: ``docs/quantizers.md`` §7.2. All starts are run and the lowest final V is kept (ties: first in
this order): quantiles ℓ_k = F⁻¹(k/(N − 1)); U-ref; E-ref with p = 1/2; then two package
extensions: the companding start (quantiles of the density ∝ f^(1/3), see
``alq_initializations``; can be switched off) and the caller's ``initial`` table if given.
Extra starts can only lower the selected V. For the symmetric fits the quantile start is
x_i = G⁻¹((2i − 1)/(2K − 1)) on the law G of |r|, which is F's quantile start when F is
symmetric.
"""

from __future__ import annotations

import numpy as np

from horovod_aq.levels.alq.problem import Problem
from horovod_aq.levels.families import check_bits, exponential, separate_levels, uniform
from horovod_aq.levels.model import Distribution, check_distribution
from horovod_aq.levels.table import validate_levels

__all__ = ["alq_initializations", "check_initial", "starts"]


def check_initial(initial: object, num_levels: int) -> np.ndarray:
    L = validate_levels(initial)
    if L.size != num_levels:
        raise ValueError(
            f"the initial table has {L.size} levels, expected {num_levels} for these bits"
        )
    return L


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
    same construction for the density ∝ f^(1/3) (the asymptotically optimal level density,
    ``Distribution.companding_positions``): unlike the three reference starts it spreads levels
    over separated modes in the right proportion, which coordinate descent cannot fix
    afterwards (levels do not cross empty gaps). Collapsed positions (a near point mass) are
    pushed apart by ``separate_levels``.
    """
    F = check_distribution(dist)
    b = check_bits(bits)
    n = 2**b
    if symmetric:
        K = n // 2
        q = (2.0 * np.arange(1, K) - 1.0) / (2.0 * K - 1.0)
        G = F.folded()
        inner = [G.ppf(q)] + ([G.companding_positions(q)] if companding_start else [])
        tables = []
        for x in inner:
            pos = np.concatenate([x, [1.0]])
            tables.append(np.concatenate([-pos[::-1], pos]))
    else:
        q = np.arange(1, n - 1) / (n - 1.0)
        inner = [F.ppf(q)] + ([F.companding_positions(q)] if companding_start else [])
        tables = [np.concatenate([[-1.0], x, [1.0]]) for x in inner]
    out = [separate_levels(tables[0]), uniform(b), exponential(b, 0.5)]
    out.extend(separate_levels(t) for t in tables[1:])
    return out


def starts(
    prob: Problem, bits: int, initial: object | None, companding_start: bool
) -> tuple[list[str], np.ndarray]:
    """(names, free variables) of every start of a fit, one row per start."""
    tables = alq_initializations(
        prob.F, bits, symmetric=prob.symmetric, companding_start=companding_start
    )
    names = ["quantile", "uniform", "exponential", "companding"][: len(tables)]
    if initial is not None:
        L = check_initial(initial, prob.num_levels)
        if prob.symmetric:
            L = separate_levels(prob.tables(prob.free(L)[None, :])[0])
        tables.append(L)
        names.append("initial")
    X = np.stack([prob.free(t) for t in tables])
    return names, X
