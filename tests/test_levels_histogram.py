"""The empirical (histogram) model of normalized coordinates and its use by the fitters
(spec docs/quantizers.md §3, §5.1 extension, §6, §7, §8, §10)."""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np
import pytest
from scipy import integrate
from scipy.optimize import minimize

from horovod_aq.levels import (
    HISTOGRAM_BINS,
    BucketStats,
    HistogramDistribution,
    TruncatedNormalMixture,
    alq_descent,
    alq_initializations,
    amq_multiplier,
    amq_variance,
    entropy,
    expected_variance,
    exponential,
    fit_alq,
    fit_alq_gd,
    fit_amq,
    histogram_bin_index,
    histogram_edges,
    huffman_expected_length,
    normalized_histogram,
    stochastic_rounding_variance,
    symbol_probabilities,
    uniform,
    validate_levels,
)


# --------------------------------------------------------------------------------------------
# test histograms
# --------------------------------------------------------------------------------------------
def _sparse_heavy(rng: np.random.Generator, n: int, df: float, zeros: float) -> np.ndarray:
    """Student-t coordinates with a fraction ``zeros`` of exact zeros (a sparse gradient)."""
    x = rng.standard_t(df, size=n) if math.isfinite(df) else rng.normal(size=n)
    x[rng.random(n) < zeros] = 0.0
    return x


def _random_edges_hist() -> HistogramDistribution:
    """30 random bins, some empty, one heavy."""
    rng = np.random.default_rng(0)
    e = np.concatenate([[-1.0], np.sort(rng.uniform(-1, 1, 29)), [1.0]])
    w = rng.uniform(0, 1, 30)
    w[[3, 4, 5, 20]] = 0.0
    w[15] = 20.0
    return HistogramDistribution(e, w)


def _sparse_heavy_hist() -> HistogramDistribution:
    """A big point mass at 0 (40 % zeros) and heavy tails (t, 1.5 d.o.f.), B = 512."""
    x = _sparse_heavy(np.random.default_rng(1), 60_000, 1.5, 0.4)
    return HistogramDistribution(histogram_edges(), normalized_histogram(x, 512))


def _clusters_hist() -> HistogramDistribution:
    """Two narrow clusters and a thin background, with long empty stretches (flat F)."""
    e = histogram_edges()
    centre = 0.5 * (e[:-1] + e[1:])
    w = np.where(np.abs(centre + 0.3) < 0.01, 3.0, 0.0) + np.where(
        np.abs(centre - 0.5) < 0.02, 1.0, 0.0
    )
    w[np.abs(centre) < 1e-4] = 0.5
    return HistogramDistribution(e, w)


def _normal_hist() -> HistogramDistribution:
    """Buckets of i.i.d. normals (what the TN model describes well), 25 % zeros, B = 4096."""
    x = _sparse_heavy(np.random.default_rng(2), 80_000, np.inf, 0.25)
    return HistogramDistribution(histogram_edges(), normalized_histogram(x, 4096))


HISTS = {
    "random_edges": _random_edges_hist(),
    "sparse_heavy": _sparse_heavy_hist(),
    "clusters": _clusters_hist(),
    "normal": _normal_hist(),
}


# --------------------------------------------------------------------------------------------
# references by quadrature: bin by bin (the density is constant on each bin)
# --------------------------------------------------------------------------------------------
def _quad(F: HistogramDistribution, fn, c: float, d: float) -> float:
    """∫_c^d fn(r) dF by scipy quad on each bin piece (exact for polynomials), fsum'ed."""
    e = F.edges
    rho = F.weights / np.diff(e)
    parts = []
    for k in range(e.size - 1):
        a, b = max(c, e[k]), min(d, e[k + 1])
        if b > a and rho[k] > 0.0:
            val, _ = integrate.quad(fn, a, b, epsabs=0.0, epsrel=1e-13)
            parts.append(rho[k] * val)
    return math.fsum(parts)


def _intervals(F: HistogramDistribution, rng: np.random.Generator, n: int) -> list:
    e = F.edges
    out = [(-1.0, 1.0), (0.0, 1.0), (-1.0, 0.0)]
    for _ in range(n):
        kind = rng.integers(4)
        if kind == 0:  # random
            c, d = np.sort(rng.uniform(-1, 1, 2))
        elif kind == 1:  # both ends on edges
            c, d = np.sort(rng.choice(e, 2))
        elif kind == 2:  # inside one bin
            k = int(rng.integers(e.size - 1))
            c, d = np.sort(rng.uniform(e[k], e[k + 1], 2))
        else:  # short, spanning a few bins near zero (where the default grid is fine)
            c = rng.uniform(-2e-5, 2e-5)
            d = c + rng.uniform(0, 3e-5)
        out.append((float(c), float(d)))
    return out


@pytest.mark.filterwarnings("ignore::scipy.integrate.IntegrationWarning")
@pytest.mark.parametrize("name", ["random_edges", "clusters", "sparse_heavy"])
def test_partial_moments_and_segment_cost_match_quadrature(name: str) -> None:
    F = HISTS[name]
    rng = np.random.default_rng(3)
    n = 40 if name == "random_edges" else 8  # the default grid has 1025 pieces per quad
    for c, d in _intervals(F, rng, n):
        M0, M1, M2 = (float(v) for v in F.partial_moments(c, d))
        S = float(F.segment_cost(c, d))
        refs = (
            _quad(F, lambda r: 1.0, c, d),
            _quad(F, lambda r: r, c, d),
            _quad(F, lambda r: r * r, c, d),
            _quad(F, lambda r, c=c, d=d: (r - c) * (d - r), c, d),
        )
        for got, ref in zip((M0, M1, M2, S), refs):
            # 1e-9 relative (the closed forms reach ~1e-13); an absolute floor of 1e-300
            assert abs(got - ref) <= 1e-9 * abs(ref) + 1e-300, (c, d, got, ref)


def test_cdf_sf_pdf_ppf() -> None:
    F = HISTS["random_edges"]
    e = F.edges
    rho = F.weights / np.diff(e)
    x = np.concatenate([np.linspace(-1, 1, 301), e, [-2.0, 2.0]])
    cdf = np.array([_quad(F, lambda r: 1.0, -1.0, min(max(v, -1.0), 1.0)) for v in x])
    np.testing.assert_allclose(F.cdf(x), cdf, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(F.sf(x), 1.0 - cdf, rtol=1e-12, atol=1e-15)
    # pdf: ρ of the bin (right-continuous at interior edges), 0 outside
    k = np.clip(np.searchsorted(e, x, side="right") - 1, 0, e.size - 2)
    np.testing.assert_array_equal(F.pdf(x), np.where(np.abs(x) > 1, 0.0, rho[k]))
    assert F.cdf(-1.0) == 0.0 and F.cdf(1.0) == 1.0 and F.sf(1.0) == 0.0
    # ppf is the exact left inverse inf{x: F(x) ≥ q}, also across empty bins
    q = np.linspace(0, 1, 2001)
    xq = F.ppf(q)
    np.testing.assert_allclose(F.cdf(xq), q, atol=1e-15)
    assert xq[0] == -1.0 and xq[-1] == 1.0
    for i in (3, 4, 5):  # the empty bins 3..5: F is flat there, ppf returns the left end
        assert not np.any((xq > e[i]) & (xq < e[i + 1]))
    with pytest.raises(ValueError):
        F.ppf([1.5])
    # mean and second moment
    np.testing.assert_allclose(F.mean(), _quad(F, lambda r: r, -1, 1), rtol=1e-13)
    np.testing.assert_allclose(F.second_moment(), _quad(F, lambda r: r * r, -1, 1), rtol=1e-13)


def test_upper_tail_uses_survival_sums() -> None:
    # a tiny mass in the last bins under a heavy bulk: 1 − cdf cancels, sf and M0 must not
    e = histogram_edges()
    w = np.zeros(e.size - 1)
    w[HISTOGRAM_BINS // 2] = 1.0
    w[-3:] = [1e-13, 2e-14, 3e-15]
    F = HistogramDistribution(e, w)
    total = math.fsum(w)
    x = 0.5 * (e[-2] + e[-1])
    ref = 3e-15 / total * (e[-1] - x) / (e[-1] - e[-2])
    np.testing.assert_allclose(F.sf(x), ref, rtol=1e-12)
    np.testing.assert_allclose(F.partial_moments(e[-4], 1.0)[0], 1.23e-13 / total, rtol=1e-12)
    np.testing.assert_allclose(F.partial_moments(e[-3], e[-2])[0], 2e-14 / total, rtol=1e-12)
    # and the quantiles there are resolved: ppf(1 − sf(x)) = x to bin precision
    q = 1.0 - 1e-14 / total
    assert e[-3] <= F.ppf(q) <= e[-1]


def test_folded_law() -> None:
    for name in ("random_edges", "sparse_heavy"):
        F = HISTS[name]
        G = F.folded()
        assert G is F.folded() and G.lower == 0.0 and G.upper == 1.0
        u = np.linspace(0, 1, 501)
        # G(u) = F(u) − F(−u) away from the edge-at-±u subtleties (F is continuous)
        np.testing.assert_allclose(G.cdf(u), F.cdf(u) - F.cdf(-u), atol=1e-14)
        c, d = 0.013, 0.61
        for got, ref in zip(
            G.partial_moments(c, d),
            (
                F.partial_moments(c, d)[0] + F.partial_moments(-d, -c)[0],
                F.partial_moments(c, d)[1] - F.partial_moments(-d, -c)[1],
                F.partial_moments(c, d)[2] + F.partial_moments(-d, -c)[2],
            ),
        ):
            np.testing.assert_allclose(got, ref, rtol=1e-12)


# --------------------------------------------------------------------------------------------
# variance, symbols
# --------------------------------------------------------------------------------------------
def _tables() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {
        "uniform3": uniform(3),
        "exp4": exponential(4, 0.3),
        "random8": np.concatenate([[-1.0], np.sort(rng.uniform(-1, 1, 6)), [1.0]]),
        "fitted": fit_alq(HISTS["sparse_heavy"], 3),
    }


@pytest.mark.parametrize("name", ["random_edges", "sparse_heavy", "clusters"])
def test_expected_variance_and_symbols_match_quadrature(name: str) -> None:
    F = HISTS[name]
    for L in _tables().values():
        pieces = [_quad(F, lambda r, c=c, d=d: (r - c) * (d - r), c, d) for c, d in pairwise(L)]
        ref = math.fsum(pieces)
        assert abs(expected_variance(L, F) - ref) <= 1e-9 * ref
        P = symbol_probabilities(L, F)
        up = [_quad(F, lambda r, c=c, d=d: (r - c) / (d - c), c, d) for c, d in pairwise(L)]
        m0 = [_quad(F, lambda r: 1.0, c, d) for c, d in pairwise(L)]
        P_ref = np.zeros(L.size)
        P_ref[1:] += up
        P_ref[:-1] += np.array(m0) - np.array(up)
        np.testing.assert_allclose(P, P_ref, rtol=1e-9, atol=1e-15)
        assert abs(P.sum() - 1.0) < 1e-12
        H = entropy(L, F)
        assert 0.0 <= H <= huffman_expected_length(L, F) < H + 1.0


def test_monte_carlo_stochastic_rounding_matches_v() -> None:
    """Samples r ~ F, unbiased stochastic rounding (§3): mean squared error ≈ V, symbol
    frequencies ≈ P(J = j). Tolerance: 5 standard errors (fixed seed)."""
    rng = np.random.default_rng(7)
    n = 400_000
    for name in ("sparse_heavy", "random_edges"):
        F = HISTS[name]
        r = F.sample(n, rng)
        for L in (_tables()["fitted"], uniform(3)):
            j = np.clip(np.searchsorted(L, r, side="right") - 1, 0, L.size - 2)
            xi = (r - L[j]) / (L[j + 1] - L[j])
            up = rng.random(n) < xi
            q = np.where(up, L[j + 1], L[j])
            err = (q - r) ** 2
            V = expected_variance(L, F)
            assert abs(err.mean() - V) <= 5.0 * err.std() / math.sqrt(n)
            # the conditional variance is stochastic_rounding_variance (sanity of the reference)
            np.testing.assert_allclose(
                stochastic_rounding_variance(r, L), (L[j + 1] - r) * (r - L[j]), atol=1e-15
            )
            J = j + up
            freq = np.bincount(J, minlength=L.size) / n
            P = symbol_probabilities(L, F)
            assert np.all(np.abs(freq - P) <= 5.0 * np.sqrt(P * (1 - P) / n) + 1e-12)


# --------------------------------------------------------------------------------------------
# fitting
# --------------------------------------------------------------------------------------------
def _v_and_grad(x: np.ndarray, F: HistogramDistribution) -> tuple[float, np.ndarray]:
    order = np.argsort(x)
    L = np.concatenate([[-1.0], np.clip(x[order], -1, 1), [1.0]])
    c, d = L[:-1], L[1:]
    S = F.segment_cost(c, d)
    M0, M1, _ = F.partial_moments(c, d)
    up = M1 - c * M0
    down = d * M0 - M1
    g = np.empty_like(x)
    g[order] = up[:-1] - down[1:]
    return float(S.sum()), g


def _v_and_grad_symmetric(x: np.ndarray, F: HistogramDistribution) -> tuple[float, np.ndarray]:
    v, g = _v_and_grad(np.concatenate([-x, x]), F)
    return v, g[x.size :] - g[: x.size]


# L-BFGS-B iterations per start: the histogram V is piecewise cubic with a Hessian that jumps
# at every edge (and by 1e5 at a point mass), so runs often stop at this cap rather than at
# ftol; every run still gives an upper bound on the minimum, and the best of many is the
# reference.
_SCIPY_MAXITER = 100


def _scipy_best(
    F: HistogramDistribution, n_free: int, *, symmetric: bool, starts: int, seed: int
) -> float:
    """Best V of L-BFGS-B from ``starts`` random starts (uniform levels, or data points)."""
    rng = np.random.default_rng(seed)
    fun = _v_and_grad_symmetric if symmetric else _v_and_grad
    lo = 1e-9 if symmetric else -1.0
    samples = F.sample(4000, rng)
    best = np.inf
    for k in range(starts):
        if k % 4 == 0:
            x0 = np.sort(rng.uniform(lo, 1.0, n_free))
        else:
            x0 = np.sort(rng.choice(np.abs(samples) if symmetric else samples, n_free))
        res = minimize(
            fun,
            x0,
            args=(F,),
            jac=True,
            method="L-BFGS-B",
            bounds=[(lo, 1.0)] * n_free,
            options={"ftol": 1e-13, "gtol": 1e-12, "maxiter": _SCIPY_MAXITER},
        )
        best = min(best, res.fun)
    return best


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("name", ["sparse_heavy", "clusters", "normal", "random_edges"])
def test_alq_within_half_percent_of_generic_optimizer(name: str, bits: int) -> None:
    F = HISTS[name]
    v_alq = expected_variance(fit_alq(F, bits), F)
    v_moves = expected_variance(fit_alq(F, bits, relocate=True), F)
    assert v_moves <= v_alq * (1 + 1e-12)  # relocation moves never hurt
    v_ref = _scipy_best(F, 2**bits - 2, symmetric=False, starts=12, seed=bits)
    # the acceptance bound of the TN fitter: at most 0.5 % above the best of 12 L-BFGS-B runs.
    # The irregular random histogram is multimodal enough at 4 bits that the default starts
    # stop in a basin 2.7 % above scipy's best; the relocation moves reach it.
    v = v_moves if name == "random_edges" else v_alq
    assert v <= v_ref * 1.005


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("name", ["sparse_heavy", "clusters"])
def test_symmetric_alq_within_half_percent_of_generic_optimizer(name: str, bits: int) -> None:
    F = HISTS[name]
    L = fit_alq(F, bits, symmetric=True)
    assert np.array_equal(L, -L[::-1])
    v_ref = _scipy_best(F, 2 ** (bits - 1) - 1, symmetric=True, starts=10, seed=10 + bits)
    assert expected_variance(L, F) <= v_ref * 1.005


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("name", list(HISTS))
def test_alq_never_worse_than_its_initializations(name: str, bits: int, symmetric: bool) -> None:
    F = HISTS[name]
    L = fit_alq(F, bits, symmetric=symmetric)
    validate_levels(L)
    v = expected_variance(L, F)
    for start in alq_initializations(F, bits, symmetric=symmetric):
        validate_levels(start)
        assert v <= expected_variance(start, F) * (1 + 1e-12)
        assert v <= expected_variance(alq_descent(F, start, symmetric=symmetric), F) * (1 + 1e-12)
    # the caller's table as an extra start can only help
    prev = exponential(bits, 0.4)
    assert expected_variance(fit_alq(F, bits, symmetric=symmetric, initial=prev), F) <= (
        expected_variance(prev, F) * (1 + 1e-12)
    )


def test_plain_and_fixed_sweeps_are_monotone_and_agree() -> None:
    F = HISTS["sparse_heavy"]
    values = [expected_variance(alq_descent(F, uniform(4), sweeps=k), F) for k in range(10)]
    assert all(b <= a * (1 + 1e-14) for a, b in pairwise(values))
    assert values[-1] < 0.5 * values[0]
    for bits in (3, 4):
        fast = fit_alq(F, bits)
        plain = fit_alq(F, bits, accelerate=False, tol=1e-13, max_sweeps=5000)
        # the accelerated descent reaches the (same or a better) fixed point
        assert expected_variance(fast, F) <= expected_variance(plain, F) * (1 + 1e-7)


def test_alq_g_and_amq_on_histograms() -> None:
    for name in ("sparse_heavy", "clusters", "random_edges"):
        F = HISTS[name]
        for bits in (2, 3, 4):
            L = fit_alq_gd(F, bits)
            validate_levels(L)
            assert np.array_equal(L, -L[::-1])
            v = expected_variance(L, F)
            starts = alq_initializations(F, bits, symmetric=True)
            assert v <= min(expected_variance(s, F) for s in starts) * (1 + 1e-12)
            assert expected_variance(fit_alq(F, bits, symmetric=True), F) <= v * (1 + 1e-12)
    L = fit_alq_gd(HISTS["normal"], 4, lr=1e6, sweeps=50, symmetric=False)
    validate_levels(L)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("name", list(HISTS))
def test_amq_agrees_with_fine_grid(name: str, bits: int) -> None:
    F = HISTS[name]
    p = amq_multiplier(F, bits)
    assert 1e-4 <= p <= 1 - 1e-4
    v = expected_variance(fit_amq(F, bits), F)
    np.testing.assert_allclose(v, amq_variance(F, bits, p), rtol=1e-12)
    grid = np.exp(np.linspace(np.log(1e-4), np.log(1 - 1e-4), 20001))
    v_grid = amq_variance(F, bits, grid)
    # never worse than the best of 20001 grid points (up to rounding)
    assert v <= v_grid.min() * (1 + 1e-9)


def test_fits_are_deterministic() -> None:
    x = _sparse_heavy(np.random.default_rng(1), 60_000, 1.5, 0.4)
    F = HISTS["sparse_heavy"]
    G = HistogramDistribution(histogram_edges(), normalized_histogram(x, 512))
    for fit in (
        lambda d: fit_alq(d, 3),
        lambda d: fit_alq(d, 4, symmetric=True),
        lambda d: fit_alq(d, 4, relocate=True),
        lambda d: fit_alq_gd(d, 3),
        lambda d: fit_amq(d, 3),
    ):
        a, b, c = fit(F), fit(F), fit(G)
        assert np.array_equal(a, b) and np.array_equal(a, c)


def test_relocation_moves() -> None:
    """``relocate=True`` never raises V, works on both models and in the symmetric fit, and
    finds the better basin of a bimodal law where plain coordinate descent cannot."""
    bimodal = TruncatedNormalMixture([-0.5, 0.45], [0.03, 0.05], [1.0, 2.0])
    for F, all_bits in (
        (bimodal, (2, 4, 6)),
        (HISTS["random_edges"], (2, 4)),
        (HISTS["clusters"], (3,)),
    ):
        for bits in all_bits:
            for symmetric in (False, True):
                plain = expected_variance(fit_alq(F, bits, symmetric=symmetric), F)
                moved = fit_alq(F, bits, symmetric=symmetric, relocate=True)
                validate_levels(moved)
                assert expected_variance(moved, F) <= plain * (1 + 1e-12)
    F = HISTS["random_edges"]
    assert expected_variance(fit_alq(F, 4, relocate=True), F) < 0.97 * expected_variance(
        fit_alq(F, 4), F
    )


@pytest.mark.parametrize(
    "weights",
    [
        {HISTOGRAM_BINS // 2: 1.0},  # everything in the central bin (a point mass at 0)
        {0: 1.0, HISTOGRAM_BINS - 1: 2.0},  # one-hot buckets: mass only at ±1
        {700: 1.0},  # a single off-centre bin
        {300: 1.0, 301: 1e-300, 900: 1e-12},  # extreme dynamic range
    ],
    ids=["centre", "ends", "single", "dynamic_range"],
)
def test_degenerate_histograms_give_valid_tables(weights: dict) -> None:
    w = np.zeros(HISTOGRAM_BINS)
    for k, v in weights.items():
        w[k] = v
    F = HistogramDistribution(histogram_edges(), w)
    for bits in (1, 2, 3, 4):
        for table in (
            fit_alq(F, bits),
            fit_alq(F, bits, symmetric=True),
            fit_alq_gd(F, bits),
            fit_amq(F, bits),
        ):
            validate_levels(table)
            v = expected_variance(table, F)
            assert np.isfinite(v) and v >= 0.0
        assert expected_variance(fit_alq(F, bits), F) <= expected_variance(uniform(bits), F)


def test_uniform_histogram_gives_uniform_levels() -> None:
    F = HistogramDistribution(np.linspace(-1, 1, 65), np.ones(64))
    np.testing.assert_allclose(fit_alq(F, 3), uniform(3), atol=1e-9)


# --------------------------------------------------------------------------------------------
# the empirical objective
# --------------------------------------------------------------------------------------------
def _exact_error(x: np.ndarray, B: int, L: np.ndarray) -> float:
    """Σ_b n_b² Σ_i (ℓ_{j+1} − r_i)(r_i − ℓ_j) over all buckets (partial tail included)."""
    total = []
    for s in range(0, x.size, B):
        v = x[s : s + B]
        n = np.linalg.norm(v)
        if n > 0.0:
            total.append(n * n * stochastic_rounding_variance(v / n, L).sum())
    return math.fsum(total)


@pytest.mark.parametrize("B", [1024, 8192])
def test_empirical_objective_identity(B: int) -> None:
    """V(ℓ; histogram)·Σweights = E‖Q(x) − x‖² up to the binning, and the histogram fit beats
    the TN-mixture fit on the real objective.

    Tolerance: 0.5 % relative for every table. Within a bin the model spreads the data
    uniformly, while σ²(r) = (ℓ_{j+1} − r)(r − ℓ_j) varies across the bin (1.9 % of |r| wide on
    the default grid): the error of one bin is about |σ²′|·|mean of its data − bin centre|, of
    either sign, and largely cancels over the occupied bins. Measured for these tables: 0.0002
    to 0.34 % (the largest for the 4-bit histogram fit at B = 8192, six buckets only).
    """
    x = _sparse_heavy(np.random.default_rng(11), 50_000 + 123, 3.0, 0.4)  # + a partial bucket
    h = normalized_histogram(x, B)
    total = math.fsum(h)
    F = HistogramDistribution(histogram_edges(), h)
    mixture = BucketStats.from_gradient(x, B).mixture()
    tables = {
        "alq_hist": fit_alq(F, 3),
        "alq_hist_sym": fit_alq(F, 3, symmetric=True),
        "alq_tn": fit_alq(mixture, 3),
        "amq_hist": fit_amq(F, 3),
        "uniform": uniform(3),
        "exponential": exponential(4),
        "alq_hist4": fit_alq(F, 4),
    }
    exact = {k: _exact_error(x, B, L) for k, L in tables.items()}
    for k, L in tables.items():
        model = expected_variance(L, F) * total
        assert abs(model - exact[k]) <= 5e-3 * exact[k], (k, model, exact[k])
    # the point of the histogram model: a lower exact error than the TN-mixture fit
    assert exact["alq_hist"] < exact["alq_tn"]
    # Σweights = Σ_b |b|·n_b²
    sizes = np.diff(np.append(np.arange(0, x.size, B), x.size))
    norms = np.array([np.linalg.norm(x[s : s + B]) for s in range(0, x.size, B)])
    np.testing.assert_allclose(total, np.sum(sizes * norms**2), rtol=1e-12)


# --------------------------------------------------------------------------------------------
# edges, binning rule, statistics
# --------------------------------------------------------------------------------------------
def test_default_edges() -> None:
    e = histogram_edges()
    assert e.size == HISTOGRAM_BINS + 1 and e[0] == -1.0 and e[-1] == 1.0
    assert np.array_equal(e, -e[::-1]) and np.all(np.diff(e) > 0)
    assert not np.any(e == 0.0)  # odd H: 0 is the centre of the central bin
    w = np.diff(e)
    # the docstring's resolution: ~1.93e-6 near 0, ~1.9 % of |r| near 1
    assert 1.9e-6 < w.min() < 2.0e-6
    np.testing.assert_allclose(w[-1] / e[-2], 0.0195, rtol=0.02)
    assert histogram_edges() is e  # cached
    even = histogram_edges(8, 0.1)
    assert even[4] == 0.0 and np.array_equal(even, -even[::-1])
    for bad in ({"num_bins": 0}, {"num_bins": 2.5}, {"scale": 0.0}, {"scale": np.inf}):
        with pytest.raises(ValueError):
            histogram_edges(**bad)


def test_binning_rule() -> None:
    e = histogram_edges()
    H = HISTOGRAM_BINS
    # on an interior edge: the bin to the right; ±1 and 0 as documented
    np.testing.assert_array_equal(histogram_bin_index(e[1:-1]), np.arange(1, H))
    assert histogram_bin_index(1.0) == H - 1 and histogram_bin_index(-1.0) == 0
    assert histogram_bin_index(0.0) == (H - 1) // 2 == histogram_bin_index(-0.0)
    assert histogram_bin_index(2.0) == H - 1 and histogram_bin_index(-3.0) == 0
    below = np.nextafter(e[1:-1], -np.inf)
    np.testing.assert_array_equal(histogram_bin_index(below), np.arange(0, H - 1))
    # the rule is "count of edges ≤ r, minus 1"
    r = np.random.default_rng(0).uniform(-1, 1, 1000)
    ref = np.array([np.count_nonzero(e <= v) - 1 for v in r])
    np.testing.assert_array_equal(histogram_bin_index(r), ref)
    with pytest.raises(ValueError):
        histogram_bin_index([np.nan])


def _brute_histogram(x: np.ndarray, B: int) -> np.ndarray:
    out = np.zeros(HISTOGRAM_BINS)
    for s in range(0, x.size, B):
        v = np.asarray(x[s : s + B], dtype=np.float64)
        n = np.linalg.norm(v)
        if n > 0.0:
            np.add.at(out, histogram_bin_index(v / n), n * n)
    return out


def test_normalized_histogram_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(4)
    B = 64
    x = _sparse_heavy(rng, 20 * B + 17, 2.0, 0.3)
    x[3 * B : 4 * B] = 0.0  # a zero bucket is skipped
    h = normalized_histogram(x, B)
    assert h.dtype == np.float64 and h.shape == (HISTOGRAM_BINS,)
    np.testing.assert_allclose(h, _brute_histogram(x, B), rtol=1e-12, atol=0)
    # exact zeros land in the central bin with weight n_b² each
    zeros_weight = sum(
        np.linalg.norm(x[s : s + B]) ** 2 * np.count_nonzero(x[s : s + B] == 0)
        for s in range(0, x.size, B)
    )
    np.testing.assert_allclose(h[HISTOGRAM_BINS // 2], zeros_weight, rtol=1e-12)
    # float32 input is converted to float64 first; chunking changes only the float rounding
    np.testing.assert_allclose(
        normalized_histogram(x.astype(np.float32), B),
        _brute_histogram(x.astype(np.float32), B),
        rtol=1e-12,
    )
    import horovod_aq.levels.stats as stats_module

    monkeypatch.setattr(stats_module, "_STATS_CHUNK", 3 * B)
    np.testing.assert_allclose(normalized_histogram(x, B), h, rtol=1e-13)
    # custom edges
    e = np.linspace(-1, 1, 11)
    hc = normalized_histogram(x, B, edges=e)
    assert hc.shape == (10,)
    np.testing.assert_allclose(hc.sum(), h.sum(), rtol=1e-12)
    # a gradient shorter than one bucket still has a histogram (the partial bucket)
    short = normalized_histogram(np.array([3.0, 4.0]), 16)
    assert short.sum() == 2 * 25.0


def test_bucket_stats_histogram_roundtrip_and_merge() -> None:
    rng = np.random.default_rng(6)
    B = 32
    ranks = [_sparse_heavy(rng, n * B + t, 2.5, 0.3) for n, t in ((7, 5), (12, 0), (5, 31))]
    parts = [BucketStats.from_gradient(g, B, top_k=6, histogram=True) for g in ranks]
    for g, st in zip(ranks, parts):
        np.testing.assert_array_equal(st.histogram, normalized_histogram(g, B))
        assert not st.histogram.flags.writeable
    merged = BucketStats.merge(parts, top_k=6)
    np.testing.assert_allclose(
        merged.histogram, sum(normalized_histogram(g, B) for g in ranks), rtol=1e-14
    )
    for perm in ([2, 1, 0], [1, 2, 0]):  # exactly rounded sums: bit-identical in any order
        other = BucketStats.merge([parts[i] for i in perm], top_k=6)
        assert np.array_equal(other.histogram, merged.histogram)
    # the fixed-size vector: 3·top_k + 4 + H, and back
    arr = merged.to_array(8)
    assert arr.shape == (3 * 8 + 4 + HISTOGRAM_BINS,)
    back = BucketStats.from_array(arr)
    assert np.array_equal(back.histogram, merged.histogram)
    for name in ("norms", "means", "stds"):
        assert np.array_equal(getattr(back, name), getattr(merged, name))
    assert (back.count, back.sum_u, back.sum_sq_dev) == (
        merged.count,
        merged.sum_u,
        merged.sum_sq_dev,
    )
    # without a histogram: the old length; a zero block on request
    plain = BucketStats.from_gradient(ranks[0], B, top_k=6)
    assert plain.histogram is None and plain.to_array(6).shape == (3 * 6 + 4,)
    padded = plain.to_array(6, include_histogram=True)
    assert padded.shape == (3 * 6 + 4 + HISTOGRAM_BINS,)
    assert np.all(BucketStats.from_array(padded).histogram == 0.0)
    assert merged.to_array(6, include_histogram=False).shape == (3 * 6 + 4,)
    with pytest.raises(ValueError, match="histogram"):
        BucketStats.merge([parts[0], plain])
    with pytest.raises(ValueError, match="length"):  # 3k + 4 + H + 2 fits neither layout
        BucketStats.from_array(np.zeros(3 * 2 + 4 + HISTOGRAM_BINS + 2))
    # the model
    F = merged.histogram_model()
    assert isinstance(F, HistogramDistribution)
    np.testing.assert_allclose(F.weights, merged.histogram / merged.histogram.sum(), rtol=1e-14)
    with pytest.raises(ValueError, match="no histogram"):
        plain.histogram_model()
    empty = BucketStats.from_gradient(np.zeros(4 * B), B, histogram=True)
    assert empty.histogram is not None and not np.any(empty.histogram)
    with pytest.raises(ValueError, match="empty"):
        empty.histogram_model()
    with pytest.raises(ValueError, match="empty"):
        BucketStats.from_array(empty.to_array(3)).histogram_model()


def test_bad_input_raises() -> None:
    e = histogram_edges()
    w = np.ones(HISTOGRAM_BINS)
    bad_weights = [w * -1.0, np.where(np.arange(w.size) == 3, np.nan, w), np.zeros_like(w)]
    bad_weights += [np.where(np.arange(w.size) == 3, np.inf, w), w[:-1], w * 1e308]
    for bw in bad_weights:
        with pytest.raises(ValueError):
            HistogramDistribution(e, bw)
    for be in (
        e[::-1],  # decreasing
        np.concatenate([[-1.0], [0.5, 0.5], np.linspace(0.6, 1, 5)]),  # repeated edge
        np.linspace(-1, 0.99, 11),  # does not reach 1
        np.linspace(-1.01, 1, 11),  # starts below −1
        np.linspace(-0.5, 1, 11),  # does not cover −1
        [0.0],
        np.array([-1.0, np.nan, 1.0]),
    ):
        with pytest.raises(ValueError):
            HistogramDistribution(be, np.ones(max(np.size(be) - 1, 1)))
    with pytest.raises(ValueError, match="non-finite"):
        normalized_histogram(np.array([1.0, np.nan, 2.0]), 2)
    with pytest.raises(ValueError, match="bucket_size"):
        normalized_histogram(np.ones(8), 1)
    with pytest.raises(ValueError):
        normalized_histogram(np.ones(8), 4, edges=[-1.0, 0.0, 0.9])
    with pytest.raises(ValueError, match="overflow"):
        normalized_histogram(np.array([1e200, 1e200]), 2)
    st = BucketStats.from_buckets([1.0], [0.0], [0.1], 8)
    for bad in (np.ones(5), -np.ones(HISTOGRAM_BINS), np.full(HISTOGRAM_BINS, np.nan)):
        with pytest.raises(ValueError, match="histogram"):
            BucketStats(st.norms, st.means, st.stds, 8, 8, 0.0, 0.0, bad)
    F = HISTS["random_edges"]
    with pytest.raises(ValueError, match="HistogramDistribution"):
        expected_variance(uniform(2), F.folded())  # the folded law is not a law on [−1, 1]
    with pytest.raises(ValueError, match="HistogramDistribution"):
        fit_alq(F.folded(), 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        F.partial_moments(0.5, 0.1)
