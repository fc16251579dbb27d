"""The public ALQ fitters: ``fit_alq`` (ALQ / ALQ-N), ``fit_alq_gd`` (ALQ-G), ``alq_descent``.

Spec: ``docs/quantizers.md`` §7 (paper arXiv 2010.12460). ``fit_alq`` runs the exact coordinate
descent (``descent``) from every start (``starts``), keeps the lowest V and optionally tries
relocation moves (``relocation``). ALQ-G (§7.3) runs ``sweeps`` clipped gradient sweeps
(``sweeps.gd_sweep``) from the same starts, symmetric by default (the reference hard-codes it;
there the left gap of x_1 is x_1 itself), 30 sweeps, the same selection.
"""

from __future__ import annotations

import logging

import numpy as np

from horovod_aq.levels.alq.descent import descend
from horovod_aq.levels.alq.problem import Problem, variance
from horovod_aq.levels.alq.relocation import relocate as relocate_moves
from horovod_aq.levels.alq.starts import starts
from horovod_aq.levels.alq.sweeps import gd_sweep
from horovod_aq.levels.families import check_bits, separate_levels
from horovod_aq.levels.model import Distribution, check_distribution
from horovod_aq.levels.table import validate_levels

__all__ = ["alq_descent", "fit_alq", "fit_alq_gd"]

logger = logging.getLogger("horovod_aq.levels.alq")  # one logger for the package


def _finish(prob: Problem, X: np.ndarray) -> np.ndarray:
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
    F = check_distribution(dist)
    L = validate_levels(levels)
    if symmetric and L.size % 2:
        raise ValueError("the symmetric (zero-free) fit needs an even number of levels")
    _check_sweep_args(max_sweeps, tol, sweeps)
    prob = Problem(F, bool(symmetric), int(L.size))
    X0 = prob.free(L)[None, :]
    if symmetric:
        X0 = prob.free(separate_levels(prob.tables(X0)[0]))[None, :]
    X, _, _ = descend(
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

    Runs the exact coordinate descent (``descent``) from the quantile, U-ref and E-ref
    starts, the companding start (unless ``companding_start=False``; see
    ``alq_initializations``) and ``initial`` (e.g. the previous table) if given, and returns
    the table of lowest V as a valid read-only float64 array. ``sweeps=n`` does exactly n
    plain sweeps per start (the reference's 30); otherwise sweeps run until the
    ``tol``/``MOVE_TOL`` stop or ``max_sweeps``. ``dist`` may be a ``TruncatedNormalMixture``
    or a ``HistogramDistribution``. ``relocate=True`` (package extension, off by default: it
    costs one to a few more descents) then tries moving single levels to other gaps
    (``relocation``), which helps on multimodal laws such as sparse or irregular histograms.
    Deterministic.
    """
    F = check_distribution(dist)
    b = check_bits(bits)
    _check_sweep_args(max_sweeps, tol, sweeps)
    prob = Problem(F, bool(symmetric), 2**b)
    names, X0 = starts(prob, b, initial, companding_start)
    X, V, used = descend(
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
        x, v, rounds = relocate_moves(
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
    F = check_distribution(dist)
    b = check_bits(bits)
    if not (np.isfinite(lr) and lr > 0.0):
        raise ValueError(f"lr must be a positive finite number, got {lr!r}")
    if int(sweeps) != sweeps or sweeps < 0:
        raise ValueError(f"sweeps must be a non-negative integer, got {sweeps!r}")
    prob = Problem(F, bool(symmetric), 2**b)
    names, X = starts(prob, b, initial, companding_start)
    if prob.n_free > 0:
        for _ in range(int(sweeps)):
            X = gd_sweep(prob, X, float(lr))
    V = variance(prob, X)
    best = int(np.argmin(V))
    logger.debug("fit_alq_gd bits=%d: V=%s, chose %s start", b, V.tolist(), names[best])
    return _finish(prob, X[best])
