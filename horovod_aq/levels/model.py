"""The ``Distribution`` protocol: what the fitters and the variance code need from a law F.

Spec: ``docs/quantizers.md`` §5 (the model of normalized coordinates), §6 (closed forms), §7.2 (the
folded law of the symmetric fits). Two families implement it: the truncated-normal mixture
(``distribution``) and the empirical histogram (``histogram``). ``alq``, ``amq`` and
``variance`` are written against this protocol, so a law is used only through:

* ``lower``, ``upper``: the support (−1 and 1 for F, 0 and 1 for its folded law G);
* ``pdf``, ``cdf``, ``sf``, ``ppf``: f, F, 1 − F (tail-accurate) and F⁻¹ (quantile starts and
  relocation midpoints);
* ``partial_moments(c, d)`` = (M0, M1, M2) = (∫_c^d dF, ∫_c^d r dF, ∫_c^d r² dF) and
  ``segment_cost(c, d)`` = S(c, d) = ∫_c^d (r − c)(d − r) dF, interval by interval;
* ``table_terms(L)`` and ``table_variance(L)``: the same closed forms for all consecutive
  intervals of tables at once, V(ℓ; F) = Σ_j S(ℓ_j, ℓ_{j+1});
* ``companding_positions(q)``: the ALQ companding start (quantiles of the density ∝ f^(1/3));
* ``folded()`` (F only): the law G of |r| on [0, 1], for the symmetric fits (§7.2).

The exact per-level updates of ALQ (``alq.updates``) are specific to each family (a root
finder on a smooth cdf, or a closed-form solve in one bin) and live with the fitter.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

__all__ = ["Distribution", "Law", "TableTerms", "check_distribution"]


class TableTerms(NamedTuple):
    """Per-interval closed forms of sorted tables L (..., N), each of shape (..., N − 1),
    except ``density`` (..., N):

    mass M0_j = ∫_{ℓ_j}^{ℓ_{j+1}} dF,   up U_j = ∫_{ℓ_j}^{ℓ_{j+1}} (r − ℓ_j) dF,
    cost S_j = ∫_{ℓ_j}^{ℓ_{j+1}} (r − ℓ_j)(ℓ_{j+1} − r) dF,   density f(ℓ_j).
    """

    mass: np.ndarray
    up: np.ndarray
    cost: np.ndarray
    density: np.ndarray


@runtime_checkable
class Law(Protocol):
    """A law on [lower, upper] in closed form: F, or the folded law G of the symmetric fits."""

    lower: float
    upper: float

    def pdf(self, x: object) -> np.ndarray:
        """Density f(x); 0 outside the support."""
        ...

    def cdf(self, x: object) -> np.ndarray:
        """F(x) = M0(lower, x)."""
        ...

    def sf(self, x: object) -> np.ndarray:
        """1 − F(x) = M0(x, upper), accurate in the upper tail."""
        ...

    def ppf(self, q: object) -> np.ndarray:
        """Inverse cdf F⁻¹(q); q = 0 → lower, q = 1 → upper."""
        ...

    def partial_moments(self, c: object, d: object) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(M0, M1, M2) = (∫_c^d dF, ∫_c^d r dF, ∫_c^d r² dF) (broadcast; c ≤ d)."""
        ...

    def segment_cost(self, c: object, d: object) -> np.ndarray:
        """S(c, d) = ∫_c^d (r − c)(d − r) dF (broadcast; c ≤ d)."""
        ...

    def table_terms(self, L: np.ndarray) -> TableTerms:
        """(M0, U, S, f) of the consecutive intervals of sorted tables L (..., N)."""
        ...

    def table_variance(self, L: np.ndarray, *, series: bool = True) -> np.ndarray:
        """V = Σ_j S(ℓ_j, ℓ_{j+1}) of sorted tables L (..., N) (ties allowed) → (...)."""
        ...

    def companding_positions(self, q: np.ndarray) -> np.ndarray:
        """x with C(x) = q, C the normalized cumulative of f^(1/3) on the support."""
        ...


@runtime_checkable
class Distribution(Law, Protocol):
    """A law F of normalized coordinates r ∈ [−1, 1] that the fitters accept (§5).

    Implemented by ``TruncatedNormalMixture`` and ``HistogramDistribution``; their folded laws
    are ``Law``s but not ``Distribution``s (they have no ``folded``).
    """

    def folded(self) -> Law:
        """The law G of |r| on [0, 1] (§7.2)."""
        ...


def check_distribution(dist: object) -> Distribution:
    """``dist`` itself if it is a ``Distribution`` on [−1, 1]; ValueError otherwise."""
    if not isinstance(dist, Distribution) or dist.lower != -1.0 or dist.upper != 1.0:
        raise ValueError(
            "dist must be a TruncatedNormalMixture or a HistogramDistribution, "
            f"got {type(dist).__name__}"
        )
    return dist
