"""The ALQ problem: free variables ↔ level tables, V with its gradient and tridiagonal Hessian.

Spec: ``docs/quantizers.md`` §7 (paper arXiv 2010.12460). The objective is the closed-form expected
variance V(ℓ; F) = Σ_j S(ℓ_j, ℓ_{j+1}) of §6 with ℓ_0 = −1 and ℓ_{N−1} = 1 fixed; the free
variables are the interior levels ℓ_1 … ℓ_{N−2}.

Per-level problem (§7.1). With c = ℓ_{j−1}, d = ℓ_{j+1} fixed, J(x) = S(c, x) + S(x, d) has

    J′(x) = ∫_c^x (r − c) dF − ∫_x^d (d − r) dF = (d − c)·[F(x) − F(c) − t],
    t = M0(c, d) − (1/(d − c))·∫_c^d (r − c) dF,       J″(x) = (d − c)·f(x) ≥ 0,

so the exact minimizer solves F(x) − F(c) = t on (c, d) (the inverse-cdf update; solved per
family in ``normal_updates`` and ``histogram_updates``). NaN guard: the old level is kept when
M0(c, d) < ``MIN_INTERVAL_MASS``, when the root is not strictly inside (c, d), or when anything
is non-finite. The whole Hessian is tridiagonal, in closed form:

    ∂V/∂ℓ_j = J′_j(ℓ_j),   ∂²V/∂ℓ_j² = (ℓ_{j+1} − ℓ_{j−1})·f(ℓ_j),
    ∂²V/∂ℓ_j∂ℓ_{j+1} = −M0(ℓ_j, ℓ_{j+1}).

Symmetric option (§7.2, exact folded method). For a symmetric zero-free table with positive
levels 0 < x_1 < … < x_K = 1, V(ℓ; F) = V⁺(x; G) with G the law of |r|:

    V⁺ = ∫_0^{x_1} (x_1² − u²) dG + Σ_{j≥1} S_G(x_j, x_{j+1}).

The free variables are x_1 … x_{K−1}; x_j (j ≥ 2) takes the §7.1 update on G; x_1 solves
2x_1·G(x_1) = ∫_{x_1}^{x_2} (x_2 − u) dG(u) (strictly increasing left minus right side).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from horovod_aq.levels.model import Distribution, Law

__all__ = [
    "MIN_INTERVAL_MASS",
    "NEGLIGIBLE_GAIN",
    "Evaluation",
    "Problem",
    "evaluate",
    "variance",
]

#: NaN guard: an interval with less probability than this keeps its level (§7.1).
MIN_INTERVAL_MASS = 1e-200
#: Skip a level update that cannot lower V by more than this fraction of V: M0(c, d)·(d − c)²
#: bounds the whole cost J = S(c, x) + S(x, d) the update could remove.
NEGLIGIBLE_GAIN = 1e-18


@dataclass(frozen=True)
class Problem:
    """F (the fitting law), the law the coordinate updates work on (F, or G if symmetric)."""

    F: Distribution
    symmetric: bool
    num_levels: int

    @property
    def law(self) -> Law:
        return self.F.folded() if self.symmetric else self.F

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


@dataclass
class Evaluation:
    """V, ∇V and the tridiagonal ∇²V (diagonal, off-diagonal) per start (row)."""

    V: np.ndarray  # (S,)
    grad: np.ndarray  # (S, n)
    hess_diag: np.ndarray  # (S, n)
    hess_off: np.ndarray  # (S, n − 1)

    def take(self, rows: np.ndarray) -> Evaluation:
        return Evaluation(self.V[rows], self.grad[rows], self.hess_diag[rows], self.hess_off[rows])

    def store(self, new: Evaluation, rows: np.ndarray) -> None:
        self.V[rows], self.grad[rows] = new.V, new.grad
        self.hess_diag[rows], self.hess_off[rows] = new.hess_diag, new.hess_off


def evaluate(prob: Problem, X: np.ndarray) -> Evaluation:
    """V, ∇V and the tridiagonal ∇²V with respect to the free variables (module docstring).

    On a histogram f is piecewise constant: V is piecewise cubic in each level and the Hessian
    below is exact inside the bins (f right-continuous at an edge).
    """
    L = prob.tables(X)
    h = np.diff(L, axis=1)
    M0, U, S, f = prob.F.table_terms(L)  # U = ∫ (r − ℓ_j) dF on [ℓ_j, ℓ_{j+1}]
    V = S.sum(axis=1)
    # full-table derivatives at the interior levels 1..N−2
    g = U[:, :-1] - (h[:, 1:] * M0[:, 1:] - U[:, 1:])
    hd = (L[:, 2:] - L[:, :-2]) * f[:, 1:-1]
    ho = -M0[:, 1:-1]
    if not prob.symmetric:
        return Evaluation(V, g, hd, ho)
    # chain rule for ℓ = (−x_K, …, −x_1, x_1, …, x_K): x_i sits at K−1+i and −x_i at K−i
    K = prob.num_levels // 2
    n = K - 1
    i = np.arange(1, n + 1)
    pos, neg = K - 1 + i - 1, K - i - 1  # indices into the interior arrays (level index − 1)
    gx = g[:, pos] - g[:, neg]
    hdx = hd[:, pos] + hd[:, neg]
    hdx[:, 0] += 2.0 * M0[:, K - 1]  # −∂²V/∂ℓ_{K−1}∂ℓ_K counted twice: the interval [−x_1, x_1]
    hox = -(M0[:, K : K + n - 1] + M0[:, K - 2 - np.arange(n - 1)])
    return Evaluation(V, gx, hdx, hox)


def variance(prob: Problem, X: np.ndarray) -> np.ndarray:
    """V(ℓ(X); F) per row of free variables X."""
    return prob.F.table_variance(prob.tables(X))
