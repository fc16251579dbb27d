"""Exact per-level ALQ updates on the histogram law: closed-form solves in one bin.

Spec: ``docs/quantizers.md`` §7.1 (the per-level problem, ``problem`` module docstring) on the
empirical model of ``histogram`` (§5.1 extension). F is piecewise linear, so each exact update
is a closed-form solve in one bin, found by binary search on prefix sums, and needs no
iteration; the symmetric x_1 equation 2x·G(x) = ∫_x^d (d − u) dG is a quadratic in its bin.
The density is discontinuous and may vanish on whole intervals: J stays convex
(J″ = (d − c)·f ≥ 0) but can be flat, and then its minimizers form an interval
[x_lo, x_hi] (``_PiecewiseUniform._root_set``) of which the update takes the point nearest to
the old level (a level already in it stays).

``HistogramPoints`` keeps, per point, its bin and F(x), M1(lower, x) as hi + lo sums
(``_PiecewiseUniform._point_sums``), refreshed as levels move.
"""

from __future__ import annotations

import numpy as np

from horovod_aq.levels.alq.problem import MIN_INTERVAL_MASS
from horovod_aq.levels.histogram import _PiecewiseUniform

__all__ = ["HistogramPoints", "first_level_root"]


def first_level_root(
    law: _PiecewiseUniform, d: np.ndarray, A: np.ndarray, kd: np.ndarray | None = None
) -> np.ndarray:
    """Root of h(x) = (2x + d)·G(x) − M1(0, x) − A on [0, d] (``law`` = G, lower must be 0).

    h(0) = −A ≤ 0 ≤ h(d) = 2d·G(d) and h′ = 2G + (x + d)·g ≥ 0. The bin is found by a
    vectorized binary search over the edges below d (h at an edge is a prefix sum); inside
    bin β, with x = e_β + a, h is the quadratic h(e_β) + (2G(e_β) + ρ(e_β + d))·a + 1.5ρ·a²,
    solved in the cancellation-free form a = 2|h(e_β)| / (β1 + √(β1² + 6ρ|h(e_β)|)).
    ``kd`` is bin(d) if known.
    """
    e, rho = law._edges, law._rho
    g_hi, g_lo = law._c0
    m_hi, m_lo = law._c1

    def h_at(m: np.ndarray, rows: np.ndarray) -> np.ndarray:
        G = g_hi[m] + g_lo[m]
        M1 = m_hi[m] + m_lo[m]
        return (2.0 * e[m] + d[rows]) * G - M1 - A[rows]

    if kd is None:
        kd = law._bin(d)
    lo_m = np.zeros(d.size, dtype=np.intp)  # h(e_lo) ≤ 0
    hi_m = kd + 1  # "edge" kd + 1 stands for d itself, where h ≥ 0
    while True:
        open_ = (hi_m - lo_m > 1).nonzero()[0]
        if open_.size == 0:
            break
        mid = (lo_m[open_] + hi_m[open_]) // 2
        neg = h_at(mid, open_) <= 0.0
        lo_m[open_[neg]] = mid[neg]
        hi_m[open_[~neg]] = mid[~neg]
    beta = lo_m
    rows = np.arange(d.size)
    h0 = np.minimum(h_at(beta, rows), 0.0)
    G0 = g_hi[beta] + g_lo[beta]
    rb = rho[beta]
    b1 = 2.0 * G0 + rb * (e[beta] + d)
    den = b1 + np.sqrt(b1 * b1 - 6.0 * rb * h0)
    a = -2.0 * h0 / np.where(den > 0.0, den, np.inf)  # den = 0 only where h0 = 0
    return np.minimum(np.maximum(e[beta] + a, e[beta]), np.minimum(e[beta + 1], d))


class HistogramPoints:
    """The points P = [lo, X, 1] (S, n + 2) of a sweep on a histogram law, with bins and sums."""

    def __init__(self, law: _PiecewiseUniform, P: np.ndarray) -> None:
        self.law, self.P = law, P
        # per point, kept current as levels move: bin, F(x) and M1(lower, x) as hi + lo
        self._K = law._bin(P)
        self._Fh, self._Fl, self._Mh, self._Ml = law._point_sums(P, self._K)

    def move(self, j: int, rows: np.ndarray | slice, x: np.ndarray) -> None:
        """Set point j of ``rows`` to x and refresh its bin and sums."""
        self.P[rows, j] = x
        k = self.law._bin(x)
        self._K[rows, j] = k
        self._Fh[rows, j], self._Fl[rows, j], self._Mh[rows, j], self._Ml[rows, j] = (
            self.law._point_sums(x, k)
        )

    def mass_and_up(self, i: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """M0 = ∫ dF and U = ∫ (r − P_i) dF over [P_i, P_k], every row (exact closed form)."""
        P, K = self.P, self._K
        return self.law._mass_and_up(P[:, i], P[:, k], K[:, i], K[:, k])

    def exact_update(
        self, j: int, threshold: np.ndarray, allowed: np.ndarray | None, first_level: bool
    ) -> None:
        """The §7.1 update of point j in every row (where ``allowed``) that is worth it.

        Guards as on the mixture (``normal_updates``); M0 and U over [c, d] are differences
        of the cached point sums, the root is the point of the minimizer set [x_lo, x_hi]
        nearest to the old level, and "strictly inside (c, d)" is tested as 0 < x − c < d − c.
        """
        law, P, K = self.law, self.P, self._K
        Fh, Fl, Mh, Ml = self._Fh, self._Fl, self._Mh, self._Ml
        with np.errstate(all="ignore"):
            c, d = P[:, j - 1], P[:, j + 1]
            M0 = (Fh[:, j + 1] - Fh[:, j - 1]) + (Fl[:, j + 1] - Fl[:, j - 1])
            D = d - c
            todo = (M0 >= MIN_INTERVAL_MASS) & (M0 * D * D > threshold)
            if allowed is not None:
                todo &= allowed
            # all rows (the usual case): slices, no gathers
            rows: np.ndarray | slice = slice(None) if todo.all() else todo.nonzero()[0]
            if not isinstance(rows, slice) and rows.size == 0:
                return
            cr, Dr, M0r, kc = c[rows], D[rows], M0[rows], K[rows, j - 1]
            M1 = (Mh[rows, j + 1] - Mh[rows, j - 1]) + (Ml[rows, j + 1] - Ml[rows, j - 1])
            U = M1 - cr * M0r  # ∫_c^d (r − c) dF
            if first_level:
                # 2x·G(x) = ∫_x^d (d − u) dG; c = 0, so A = ∫_0^d (d − u) dG = d·M0 − U
                dr = d[rows]
                root = first_level_root(law, dr, dr * M0r - U, K[rows, j + 1])
            else:
                t = np.minimum(np.maximum(M0r - U / Dr, 0.0), M0r)
                x_lo, x_hi = law._root_set(cr, t, kc, (Fh[rows, j - 1], Fl[rows, j - 1]))
                root = np.minimum(np.maximum(P[rows, j], x_lo), x_hi)
            # NaN guard (§7.1): strictly inside (c, d), finite, and a move
            off = root - cr
            good = (off > 0.0) & (off < Dr) & (root != P[rows, j])
            if good.any():
                upd = good.nonzero()[0] if isinstance(rows, slice) else rows[good]
                self.move(j, upd, root[good])
