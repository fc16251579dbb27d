"""The truncated-normal mixture model (spec docs/quantizers.md §5, §6 closed forms)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import integrate, stats

from horovod_aq.levels import STD_FLOOR, TruncatedNormalMixture

# (means, stds, weights): narrow (σ = 1/128, the §13 model), wide, asymmetric multi-component
MIXTURES = {
    "narrow": ([0.0], [1 / 128], [1.0]),
    "wide": ([0.05], [0.3], [1.0]),
    "multi": ([-0.3, 0.0, 0.4], [0.02, 0.1, 0.25], [0.2, 0.5, 0.3]),
    "edge": ([0.9, -0.95], [0.05, 0.2], [1.0, 3.0]),
}


def _scipy_mixture(means, stds, weights):
    """Reference: weighted scipy.stats.truncnorm components on [−1, 1]."""
    w = np.asarray(weights, float) / np.sum(weights)
    comps = [
        stats.truncnorm((-1 - m) / s, (1 - m) / s, loc=m, scale=s) for m, s in zip(means, stds)
    ]
    return w, comps


@pytest.mark.parametrize("name", MIXTURES)
def test_pdf_cdf_sf_match_scipy(name: str) -> None:
    means, stds, weights = MIXTURES[name]
    F = TruncatedNormalMixture(means, stds, weights)
    w, comps = _scipy_mixture(means, stds, weights)
    x = np.linspace(-1, 1, 401)
    ref_pdf = sum(wk * c.pdf(x) for wk, c in zip(w, comps))
    ref_cdf = sum(wk * c.cdf(x) for wk, c in zip(w, comps))
    ref_sf = sum(wk * c.sf(x) for wk, c in zip(w, comps))
    # tolerances: scipy's truncnorm is accurate to ~1e-13 relative in these ranges
    np.testing.assert_allclose(F.pdf(x), ref_pdf, rtol=1e-10, atol=1e-300)
    np.testing.assert_allclose(F.cdf(x), ref_cdf, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(F.sf(x), ref_sf, rtol=1e-10, atol=1e-14)
    assert F.cdf(-1.0) == 0.0 and abs(F.cdf(1.0) - 1.0) < 1e-14
    assert F.pdf(1.5) == 0.0 and F.cdf(2.0) == 1.0


def test_upper_tail_uses_survival_functions() -> None:
    # 10 and 20 standard deviations out: 1 − cdf would cancel to 0; sf must keep full precision
    F = TruncatedNormalMixture([0.0], [0.01])
    ref = stats.truncnorm(-100, 100, scale=0.01)
    for x in (0.1, 0.2):
        assert F.sf(x) > 0
        np.testing.assert_allclose(F.sf(x), ref.sf(x), rtol=1e-10)
        M0, _, _ = F.partial_moments(x, 1.0)
        np.testing.assert_allclose(M0, ref.sf(x), rtol=1e-10)
    # tail interval mass, relative accuracy (a cdf difference would give 0 here)
    M0, _, _ = F.partial_moments(0.1, 0.11)
    np.testing.assert_allclose(M0, ref.sf(0.1) - ref.sf(0.11), rtol=1e-9)


@pytest.mark.parametrize("name", MIXTURES)
def test_ppf_inverts_cdf(name: str) -> None:
    F = TruncatedNormalMixture(*MIXTURES[name])
    q = np.array([0.0, 1e-9, 0.01, 0.25, 0.5, 0.75, 0.99, 1 - 1e-9, 1.0])
    x = F.ppf(q)
    assert np.all(np.diff(x) >= 0)
    assert x[0] == -1.0 and x[-1] == 1.0
    np.testing.assert_allclose(F.cdf(x[1:-1]), q[1:-1], rtol=1e-10, atol=1e-15)
    with pytest.raises(ValueError):
        F.ppf([1.5])


@pytest.mark.filterwarnings("ignore::scipy.integrate.IntegrationWarning")
@pytest.mark.parametrize("name", MIXTURES)
def test_partial_moments_and_segment_cost_match_quadrature(name: str) -> None:
    F = TruncatedNormalMixture(*MIXTURES[name])
    rng = np.random.default_rng(3)
    edges = np.sort(rng.uniform(-1, 1, size=(12, 2)), axis=1)
    edges = np.vstack([edges, [[-1.0, 1.0], [-0.02, 0.03], [0.3, 0.3000001]]])
    c, d = edges[:, 0], edges[:, 1]
    M0, M1, M2 = F.partial_moments(c, d)
    S = F.segment_cost(c, d)
    means = np.asarray(MIXTURES[name][0])
    for i in range(c.size):
        pts = [m for m in means if c[i] < m < d[i]] or None

        def q(fn, lo=c[i], hi=d[i], pts=pts):
            return integrate.quad(
                lambda r: fn(r) * F.pdf(r), lo, hi, points=pts, epsabs=0, epsrel=1e-12, limit=400
            )[0]

        # 1e-9 relative; the absolute floor only matters for intervals far in a tail, where
        # quad itself is not accurate below ~1e-15 of the total mass
        np.testing.assert_allclose(M0[i], q(lambda r: 1.0), rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(M1[i], q(lambda r: r), rtol=1e-9, atol=1e-15)
        np.testing.assert_allclose(M2[i], q(lambda r: r * r), rtol=1e-9, atol=1e-15)
        ref_S = q(lambda r, lo=c[i], hi=d[i]: (r - lo) * (hi - r))
        np.testing.assert_allclose(S[i], ref_S, rtol=1e-9, atol=1e-15 * (d[i] - c[i]) ** 2)
        # the spec's formula S = −cd·M0 + (c + d)·M1 − M2 agrees up to its own cancellation
        # (a few ulps of M0, the size of its terms; on very narrow intervals M1 and M2 carry
        # relative errors ~ε·σ/(d − c) from φ(a) − φ(b), so those are left to quad above)
        if d[i] - c[i] > 1e-3:
            spec_S = -c[i] * d[i] * M0[i] + (c[i] + d[i]) * M1[i] - M2[i]
            assert abs(spec_S - S[i]) <= 1e-14 * M0[i] + 1e-300


def test_mean_and_second_moment_match_scipy() -> None:
    means, stds, weights = MIXTURES["multi"]
    F = TruncatedNormalMixture(means, stds, weights)
    w, comps = _scipy_mixture(means, stds, weights)
    np.testing.assert_allclose(F.mean(), sum(wk * c.mean() for wk, c in zip(w, comps)), rtol=1e-10)
    np.testing.assert_allclose(
        F.second_moment(), sum(wk * c.moment(2) for wk, c in zip(w, comps)), rtol=1e-10
    )


def test_folded_law() -> None:
    F = TruncatedNormalMixture(*MIXTURES["multi"])
    G = F.folded()
    x = np.linspace(0, 1, 51)
    np.testing.assert_allclose(G.cdf(x), F.cdf(x) - F.cdf(-x), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(G.pdf(x[1:]), F.pdf(x[1:]) + F.pdf(-x[1:]), rtol=1e-12)
    # ∫_c^d u² dG = ∫_c^d r² dF + ∫_{−d}^{−c} r² dF
    _, _, M2G = G.partial_moments(0.1, 0.5)
    _, _, M2a = F.partial_moments(0.1, 0.5)
    _, _, M2b = F.partial_moments(-0.5, -0.1)
    np.testing.assert_allclose(M2G, M2a + M2b, rtol=1e-12)
    assert G.lower == 0.0 and G.upper == 1.0
    assert F.folded() is G  # cached


def test_sampling_matches_cdf() -> None:
    F = TruncatedNormalMixture(*MIXTURES["multi"])
    r = F.sample(20000, np.random.default_rng(7))
    assert np.all(np.abs(r) <= 1)
    # Kolmogorov–Smirnov with a fixed seed; p > 1e-3 would fail for a wrong sampler
    assert stats.kstest(r, F.cdf).pvalue > 1e-3


def test_degenerate_std_is_a_point_mass_without_nan() -> None:
    F = TruncatedNormalMixture([0.3], [0.0])
    assert F.stds[0] == STD_FLOOR
    x = np.array([-1.0, 0.0, 0.2999, 0.3001, 1.0])
    assert np.all(np.isfinite(F.pdf(x)))
    np.testing.assert_allclose(F.cdf(x), [0, 0, 0, 1, 1], atol=1e-15)
    # S(0, 0.5) of a point mass at 0.3 is (0.3 − 0)(0.5 − 0.3)
    np.testing.assert_allclose(F.segment_cost(0.0, 0.5), 0.3 * 0.2, rtol=1e-10)
    M0, M1, M2 = F.partial_moments(-1.0, 1.0)
    np.testing.assert_allclose([M0, M1, M2], [1.0, 0.3, 0.09], rtol=1e-10)
    assert np.isfinite(F.ppf(0.5)) and abs(F.ppf(0.5) - 0.3) < 1e-9


def test_wide_std_is_nearly_uniform() -> None:
    F = TruncatedNormalMixture([0.0], [1e9])
    np.testing.assert_allclose(F.cdf([-0.5, 0.0, 0.5]), [0.25, 0.5, 0.75], rtol=1e-7)
    np.testing.assert_allclose(F.segment_cost(-1.0, 1.0), 2.0 / 3.0, rtol=1e-7)  # ∫(1 − r²)/2


def test_from_bucket_stats_weighting() -> None:
    norms = np.array([1.0, 2.0, 0.0, 4.0])
    means = np.array([0.01, -0.02, 0.5, 0.0])
    stds = np.array([0.1, 0.1, 0.1, 0.1])
    F2 = TruncatedNormalMixture.from_bucket_stats(norms, means, stds)
    np.testing.assert_allclose(F2.weights, np.array([1, 4, 16]) / 21, rtol=1e-15)
    F1 = TruncatedNormalMixture.from_bucket_stats(norms, means, stds, weighting="norm")
    np.testing.assert_allclose(F1.weights, np.array([1, 2, 4]) / 7, rtol=1e-15)
    np.testing.assert_array_equal(F2.means, [0.01, -0.02, 0.0])  # the zero-norm bucket is dropped
    with pytest.raises(ValueError, match="weighting"):
        TruncatedNormalMixture.from_bucket_stats(norms, means, stds, weighting="cube")


@pytest.mark.parametrize(
    "norms, means, stds, match",
    [
        ([], [], [], "empty"),
        ([0.0, 0.0], [0.0, 0.0], [0.1, 0.1], "sum to zero"),
        ([1.0, np.nan], [0.0, 0.0], [0.1, 0.1], "finite"),
        ([1.0, np.inf], [0.0, 0.0], [0.1, 0.1], "finite"),
        ([1.0, -1.0], [0.0, 0.0], [0.1, 0.1], "non-negative"),
        ([1.0, 1.0], [0.0, 0.0], [0.1, -0.1], "non-negative"),
        ([1.0, 1.0], [0.0, 0.0], [0.1], "differ in length"),
        ([1.0], [1.5], [0.1], r"\[-1, 1\]"),
    ],
)
def test_from_bucket_stats_rejects_bad_input(norms, means, stds, match) -> None:
    with pytest.raises(ValueError, match=match):
        TruncatedNormalMixture.from_bucket_stats(norms, means, stds)


def test_constructor_rejects_bad_weights() -> None:
    with pytest.raises(ValueError, match="sum to zero"):
        TruncatedNormalMixture([0.0], [0.1], [0.0])
    with pytest.raises(ValueError, match="non-negative"):
        TruncatedNormalMixture([0.0, 0.1], [0.1, 0.1], [1.0, -1.0])
    with pytest.raises(ValueError, match="at least one"):
        TruncatedNormalMixture([], [])


def test_pooled_normal_matches_raw_coordinates() -> None:
    rng = np.random.default_rng(11)
    B = 64
    u = rng.normal(size=(5, B)) + rng.normal(size=(5, 1))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    m, s = u.mean(axis=1), u.std(axis=1, ddof=1)
    F = TruncatedNormalMixture.pooled(m, s, np.full(5, B))
    np.testing.assert_allclose(F.means[0], u.mean(), rtol=1e-12)
    pooled_var = ((u - m[:, None]) ** 2).sum() / u.size
    np.testing.assert_allclose(F.stds[0], np.sqrt(pooled_var), rtol=1e-12)
    G = TruncatedNormalMixture.from_pooled_sums(u.size, u.sum(), ((u - m[:, None]) ** 2).sum())
    np.testing.assert_allclose([G.means[0], G.stds[0]], [F.means[0], F.stds[0]], rtol=1e-12)
    with pytest.raises(ValueError, match="count = 0"):
        TruncatedNormalMixture.from_pooled_sums(0, 0.0, 0.0)
    with pytest.raises(ValueError, match="finite"):
        TruncatedNormalMixture.from_pooled_sums(10, np.nan, 0.0)


def test_both_families_implement_the_distribution_protocol() -> None:
    from horovod_aq.levels import Distribution, HistogramDistribution, Law

    mixture = TruncatedNormalMixture(*MIXTURES["multi"])
    histogram = HistogramDistribution([-1.0, -0.2, 0.3, 1.0], [1.0, 0.0, 2.0])
    L = np.array([[-1.0, -0.5, 0.1, 0.6, 1.0], [-1.0, -0.9, 0.0, 0.2, 1.0]])
    c, d = L[:, :-1], L[:, 1:]
    for F in (mixture, histogram):
        assert isinstance(F, Distribution) and isinstance(F, Law)
        G = F.folded()
        assert isinstance(G, Law) and not isinstance(G, Distribution)
        M0, U, S, f = F.table_terms(L)
        m0, m1, _ = F.partial_moments(c, d)
        np.testing.assert_allclose(M0, m0, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(U, m1 - c * m0, rtol=1e-10, atol=1e-13)
        np.testing.assert_allclose(S, F.segment_cost(c, d), rtol=1e-12, atol=1e-16)
        np.testing.assert_allclose(f, F.pdf(L), rtol=1e-14)
        np.testing.assert_allclose(F.table_variance(L), S.sum(axis=1), rtol=1e-14)
        x = F.companding_positions(np.array([0.25, 0.5, 0.75]))
        assert np.all(np.diff(x) > 0) and np.all((x > -1.0) & (x < 1.0))
    assert not isinstance([0.0, 0.1], Distribution)
