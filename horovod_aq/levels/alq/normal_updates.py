"""Exact per-level ALQ updates on the truncated-normal mixture: safeguarded Newton on F.

Spec: ``docs/quantizers.md`` §7.1 (the per-level problem, ``problem`` module docstring). F is smooth
and strictly increasing on the support, so the update F(x) − F(c) = t has one root in (c, d),
found by ``roots.solve_increasing`` (Newton with bisection fallback) on the residual

    h(x) = F(x) − F(c) − t,   h′(x) = f(x),

and the symmetric x_1 (on the folded law G) solves

    h(x) = (2x + d)·G(x) − M1_G(0, x) − A = 0,   A = ∫_0^d (d − u) dG = d·G(d) − M1_G(0, d),
    h′(x) = 2G(x) + (x + d)·g(x).

``NormalPoints`` keeps the per-point, per-component terms (z, P, H, φ of ``distribution``) of
the current levels, refreshed as levels move, so that a sweep evaluates the special functions
once per moved level.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from scipy.special import ndtr

from horovod_aq.levels.alq.problem import MIN_INTERVAL_MASS
from horovod_aq.levels.distribution import (
    INV_SQRT_2PI,
    _mass,
    _PointTerms,
    _TruncatedNormalSum,
)
from horovod_aq.levels.roots import solve_increasing

__all__ = ["NormalPoints"]

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


class NormalPoints:
    """The points P = [lo, X, 1] (S, n + 2) of a sweep on a mixture law, with their terms."""

    def __init__(self, law: _TruncatedNormalSum, P: np.ndarray) -> None:
        self.law, self.P = law, P
        t = law._terms(P)  # (S, n+2, K) cache, refreshed as levels change
        self._z, self._P, self._H, self._phi = t.z.copy(), t.P.copy(), t.H.copy(), t.phi.copy()

    def _at(self, j: int) -> _PointTerms:
        return _PointTerms(self._z[:, j], self._P[:, j], self._H[:, j], self._phi[:, j])

    def move(self, j: int, rows: np.ndarray | slice, x: np.ndarray) -> None:
        """Set point j of ``rows`` to x and refresh its terms."""
        self.P[rows, j] = x
        t = self.law._terms(x)
        self._z[rows, j], self._P[rows, j], self._H[rows, j], self._phi[rows, j] = (
            t.z,
            t.P,
            t.H,
            t.phi,
        )

    def mass_and_up(self, i: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """M0 = ∫ dF and U = ∫ (r − P_i) dF over [P_i, P_k], every row."""
        a, b = self._at(i), self._at(k)
        delta = _mass(a, b)
        return delta @ self.law._coef, ((a.phi - b.phi) - a.z * delta) @ self.law._coef_sigma

    def exact_update(
        self, j: int, threshold: np.ndarray, allowed: np.ndarray | None, first_level: bool
    ) -> None:
        """The §7.1 update of point j in every row (where ``allowed``) that is worth it.

        Rows whose interval (c, d) has mass below ``MIN_INTERVAL_MASS``, or cannot lower V by
        more than ``threshold`` (M0·(d − c)² bounds the gain), keep their level; so do rows
        whose root is not finite and strictly inside (c, d) (NaN guard).
        """
        law, P = self.law, self.P
        c, d, x_old = P[:, j - 1], P[:, j + 1], P[:, j]
        tc, td = self._at(j - 1), self._at(j + 1)
        delta_cd = _mass(tc, td)
        M0 = delta_cd @ law._coef
        todo = (M0 >= MIN_INTERVAL_MASS) & (M0 * (d - c) ** 2 > threshold)
        if allowed is not None:
            todo &= allowed
        if not np.any(todo):
            return
        rows = np.nonzero(todo)[0]
        sgn = 1.0 - 2.0 * tc.H[rows]  # +1 where c is below the component mean
        if first_level:
            # 2x·G(x) = ∫_x^d (d − u) dG  ⇔  h(x) = (2x + d)·G(x) − M1_G(0, x) − A = 0 with
            # A = ∫_0^d (d − u) dG = d·G(d) − M1_G(0, d)
            M1_0d = delta_cd[rows] @ law._coef_mu + (tc.phi[rows] - td.phi[rows]) @ law._coef_sigma
            A = d[rows] * M0[rows] - M1_0d
            eval_h = _first_level_residual(law, sgn, tc.P[rows], tc.phi[rows], d[rows], A)
        else:
            # F(x) − F(c) = t,  t = M0(c, d) − ∫_c^d (r − c) dF / (d − c)
            Ucd = ((tc.phi[rows] - td.phi[rows]) - tc.z[rows] * delta_cd[rows]) @ law._coef_sigma
            M0r = M0[rows]
            t = np.clip(M0r - Ucd / (d[rows] - c[rows]), 0.0, M0r)
            eval_h = _inverse_cdf_residual(law, sgn, tc.P[rows], t)
        with np.errstate(all="ignore"):
            root = solve_increasing(eval_h, c[rows], d[rows], x_old[rows])
        good = np.isfinite(root) & (root > c[rows]) & (root < d[rows]) & (root != x_old[rows])
        if np.any(good):
            self.move(j, rows[good], root[good])
