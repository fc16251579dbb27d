"""Closed-form expected variance, symbol probabilities, entropy and Huffman lengths
(spec docs/quantizers.md §3, §6, §10, §13)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import integrate, stats

from horovod_aq.levels import (
    TruncatedNormalMixture,
    canonical_huffman_codes,
    entropy,
    expected_variance,
    exponential,
    huffman_code_lengths,
    huffman_expected_length,
    natural,
    stochastic_rounding_variance,
    symbol_probabilities,
    ternary,
    uniform,
    uniform_with_zero,
)

SIGMA_13 = 1.0 / 128.0  # §13: L2-normalized buckets of B = 16384 i.i.d. normal coordinates
B_13 = 16384
ALQ_13 = np.array([0.003471, 0.011476, 0.027206, 1.0])  # §13 item 3, positive half
F_13 = TruncatedNormalMixture([0.0], [SIGMA_13])

MIXTURES = {
    "narrow": TruncatedNormalMixture([0.0], [1 / 128]),
    "wide": TruncatedNormalMixture([0.0], [0.3]),
    "shifted": TruncatedNormalMixture([0.2], [0.05]),
    "multi_asym": TruncatedNormalMixture([-0.4, 0.01, 0.3], [0.03, 0.2, 0.1], [0.3, 0.5, 0.2]),
    "buckets": TruncatedNormalMixture(
        np.linspace(-0.02, 0.03, 7), np.full(7, 1 / 90), np.linspace(1, 3, 7) ** 2
    ),
}


def _mirror(pos: np.ndarray) -> np.ndarray:
    return np.concatenate([-pos[::-1], pos])


def _tables() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    rand = np.concatenate([[-1.0], np.sort(rng.uniform(-1, 1, 14)), [1.0]])
    return {
        "uniform2": uniform(2),
        "uniform4": uniform(4),
        "uniform8": uniform(8),
        "exp3": exponential(3),
        "exp5_p0.2": exponential(5, 0.2),
        "natural3": natural(3),
        "ternary": ternary(),
        "paper_s5": uniform_with_zero(5),
        "random16": rand,
        "alq13": _mirror(ALQ_13),
    }


def _quad_variance(levels: np.ndarray, F: TruncatedNormalMixture) -> float:
    """Adaptive quadrature of V = Σ ∫ (r − ℓ_j)(ℓ_{j+1} − r) dF, breakpoints at the means."""
    total = 0.0
    for c, d in zip(levels[:-1], levels[1:]):
        pts = [m for m in F.means if c < m < d] or None
        total += integrate.quad(
            lambda r, c=c, d=d: (r - c) * (d - r) * F.pdf(r),
            c,
            d,
            points=pts,
            epsabs=0,
            epsrel=1e-12,
            limit=500,
        )[0]
    return total


@pytest.mark.filterwarnings("ignore::scipy.integrate.IntegrationWarning")
@pytest.mark.parametrize("table", list(_tables()))
@pytest.mark.parametrize("mix", list(MIXTURES))
def test_closed_form_matches_quadrature(mix: str, table: str) -> None:
    F, L = MIXTURES[mix], _tables()[table]
    # the acceptance bound: 1e-9 relative (observed: ~1e-13)
    np.testing.assert_allclose(expected_variance(L, F), _quad_variance(L, F), rtol=1e-9)


def test_section_13_numbers() -> None:
    # docs/quantizers.md §13, F = TN(0, 1/128), 3 bits; the spec quotes 5 significant digits
    v_uni = expected_variance(uniform(3), F_13)
    v_exp = expected_variance(exponential(3), F_13)
    v_alq = expected_variance(_mirror(ALQ_13), F_13)
    np.testing.assert_allclose(v_uni, 2.0347e-2, rtol=5e-5)
    np.testing.assert_allclose(v_exp, 1.5564e-2, rtol=5e-5)
    np.testing.assert_allclose(v_alq, 1.3982e-5, rtol=5e-5)
    # sanity (§6): F well inside the innermost interval [−a, a] gives V ≈ a² − E[r²]
    a = 1.0 / 7.0
    np.testing.assert_allclose(v_uni, a * a - F_13.second_moment(), rtol=1e-12)


def _bucket_error_ratio(levels: np.ndarray, v: np.ndarray) -> np.ndarray:
    """E_Q‖Q(v) − v‖²/‖v‖² per bucket (exact expectation over the rounding, §3)."""
    r = v / np.linalg.norm(v, axis=1, keepdims=True)
    return stochastic_rounding_variance(r, levels).sum(axis=1)


@pytest.mark.parametrize(
    "levels", [uniform(3), exponential(3), _mirror(ALQ_13), exponential(3, 0.1328)]
)
def test_bucket_monte_carlo_matches_B_times_V(levels: np.ndarray) -> None:
    # §13 check: buckets of 16384 i.i.d. N(0, 1) coordinates; 16384·V within 2 %
    v = np.random.default_rng(2024).normal(size=(8, B_13))
    ratio = _bucket_error_ratio(levels, v).mean()
    np.testing.assert_allclose(ratio, B_13 * expected_variance(levels, F_13), rtol=0.02)


def _stochastic_round(r: np.ndarray, levels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Reference rounding (§3): up with probability ξ = (r − ℓ_j)/(ℓ_{j+1} − ℓ_j), u ∈ [0, 1)."""
    j = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, levels.size - 2)
    xi = (r - levels[j]) / (levels[j + 1] - levels[j])
    return j + (rng.random(r.shape) < xi)


def test_random_rounding_matches_per_coordinate_variance() -> None:
    rng = np.random.default_rng(99)
    levels = _mirror(ALQ_13)
    v = rng.normal(size=B_13)
    r = v / np.linalg.norm(v)
    n_draws = 1000
    total = np.zeros(B_13)
    err = np.empty(n_draws)
    for k in range(n_draws):
        q = levels[_stochastic_round(r, levels, rng)]
        total += q
        err[k] = ((q - r) ** 2).sum()
    # unbiased: the mean of the draws stays within 6 standard errors of r, coordinate-wise
    se = np.sqrt(stochastic_rounding_variance(r, levels) / n_draws)
    assert np.all(np.abs(total / n_draws - r) <= 6 * se + 1e-12)
    # E‖Q − r‖² = Σ (ℓ_{j+1} − r)(r − ℓ_j): CLT bound, 5 standard errors. A few tail
    # coordinates rarely round up to 1 and carry ~5 % of the expectation, hence many draws.
    bound = 5 * err.std(ddof=1) / np.sqrt(n_draws)
    assert abs(err.mean() - stochastic_rounding_variance(r, levels).sum()) <= bound


@pytest.mark.parametrize("mix", ["multi_asym", "shifted", "wide"])
def test_direct_sampling_clt(mix: str) -> None:
    F = MIXTURES[mix]
    levels = uniform(3) if mix == "wide" else _tables()["random16"]
    r = F.sample(200_000, np.random.default_rng(17))
    per = stochastic_rounding_variance(r, levels)
    se = per.std(ddof=1) / np.sqrt(per.size)
    # CLT: the sample mean lies within 5 standard errors of V (fails w.p. < 1e-6)
    assert abs(per.mean() - expected_variance(levels, F)) <= 5 * se


@pytest.mark.parametrize("mix", list(MIXTURES))
@pytest.mark.parametrize("table", ["uniform4", "exp3", "natural3", "random16", "alq13"])
def test_symbol_probabilities_sum_and_quadrature(mix: str, table: str) -> None:
    F, L = MIXTURES[mix], _tables()[table]
    P = symbol_probabilities(L, F)
    assert P.shape == L.shape and np.all(P >= 0)
    np.testing.assert_allclose(P.sum(), 1.0, rtol=0, atol=1e-12)
    # quadrature of the §10 definition for a few symbols
    for j in (0, L.size // 2, L.size - 1):
        ref = 0.0
        if j > 0:
            c, d = L[j - 1], L[j]
            ref += integrate.quad(
                lambda r, c=c, d=d: (r - c) / (d - c) * F.pdf(r), c, d, epsabs=1e-14, limit=400
            )[0]
        if j < L.size - 1:
            c, d = L[j], L[j + 1]
            ref += integrate.quad(
                lambda r, c=c, d=d: (d - r) / (d - c) * F.pdf(r), c, d, epsabs=1e-14, limit=400
            )[0]
        np.testing.assert_allclose(P[j], ref, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("mix", ["multi_asym", "buckets"])
def test_symbol_probabilities_match_monte_carlo(mix: str) -> None:
    F, L = MIXTURES[mix], _tables()["random16"] if mix == "multi_asym" else uniform(3)
    rng = np.random.default_rng(31)
    n = 200_000
    sym = _stochastic_round(F.sample(n, rng), L, rng)
    counts = np.bincount(sym, minlength=L.size)
    P = symbol_probabilities(L, F)
    # per-symbol CLT bound (5 standard deviations) and a chi-square test on the populated bins
    assert np.all(np.abs(counts - n * P) <= 5 * np.sqrt(n * P * (1 - P)) + 5)
    pop = n * P >= 5
    chi2 = (((counts[pop] - n * P[pop]) ** 2) / (n * P[pop])).sum()
    assert stats.chi2.sf(chi2, pop.sum() - 1) > 1e-4


def test_entropy_and_huffman_bounds() -> None:
    for F in MIXTURES.values():
        for L in (uniform(3), exponential(4), _mirror(ALQ_13)):
            H = entropy(L, F)
            Lbar = huffman_expected_length(L, F)
            assert 0.0 <= H <= np.log2(L.size) + 1e-12
            assert H - 1e-12 <= Lbar < H + 1.0  # Huffman: H ≤ L̄ < H + 1
            assert Lbar <= np.ceil(np.log2(L.size)) + 1e-12  # never worse than fixed length
    # §10: with fitted levels most mass sits on a few inner symbols, so H is well below b
    assert entropy(_mirror(ALQ_13), F_13) < 2.5


def test_huffman_code_lengths_known_cases() -> None:
    np.testing.assert_array_equal(huffman_code_lengths([0.5, 0.25, 0.125, 0.125]), [1, 2, 3, 3])
    np.testing.assert_array_equal(huffman_code_lengths([0.25] * 4), [2, 2, 2, 2])
    np.testing.assert_array_equal(huffman_code_lengths([1.0]), [1])
    # zero-probability symbols still get a code; Kraft equality holds for a full tree
    lengths = huffman_code_lengths([0.6, 0.4, 0.0, 0.0])
    assert np.all(lengths >= 1)
    assert sum(2.0**-lengths) == 1.0
    with pytest.raises(ValueError):
        huffman_code_lengths([0.5, -0.1])
    with pytest.raises(ValueError):
        huffman_code_lengths([])


def test_huffman_is_deterministic_with_ties() -> None:
    p = np.array([0.2, 0.2, 0.2, 0.2, 0.1, 0.1])
    first = huffman_code_lengths(p)
    for _ in range(3):
        np.testing.assert_array_equal(huffman_code_lengths(p.copy()), first)
    # optimal: the expected length is the sum of the merged weights 0.2+0.4+0.4+0.6+1 = 2.6
    assert (p * first).sum() == pytest.approx(2.6)
    assert sum(2.0**-first) == 1.0


def test_canonical_codes_are_prefix_free() -> None:
    P = symbol_probabilities(_mirror(ALQ_13), F_13)
    lengths = huffman_code_lengths(P)
    codes = canonical_huffman_codes(lengths)
    words = [format(int(c), f"0{int(n)}b") for c, n in zip(codes, lengths)]
    for i, a in enumerate(words):
        for k, b in enumerate(words):
            if i != k:
                assert not b.startswith(a)
    with pytest.raises(ValueError, match="Kraft"):
        canonical_huffman_codes([1, 1, 1])


def test_stochastic_rounding_variance_formula() -> None:
    L = np.array([-1.0, -0.25, 0.5, 1.0])
    r = np.array([-1.0, -0.25, 0.0, 0.5, 0.75, 2.0, -3.0])
    expected = [0.0, 0.0, 0.5 * 0.25, 0.0, 0.25 * 0.25, 0.0, 0.0]
    np.testing.assert_allclose(stochastic_rounding_variance(r, L), expected, atol=1e-16)


def test_bad_tables_and_distributions_raise() -> None:
    F = MIXTURES["narrow"]
    with pytest.raises(ValueError):
        expected_variance([-1.0, 0.5, 0.2, 1.0], F)  # not increasing
    with pytest.raises(ValueError):
        expected_variance([-0.9, 1.0], F)  # endpoint
    with pytest.raises(ValueError, match="TruncatedNormalMixture"):
        expected_variance(uniform(2), F.folded())
