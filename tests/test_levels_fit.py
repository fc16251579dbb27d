"""Level fitting: ALQ, ALQ-N, ALQ-G, AMQ, AMQ-N (spec docs/quantizers.md §7, §8, §13)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import minimize

from horovod_aq.levels import (
    BucketStats,
    LevelTable,
    TruncatedNormalMixture,
    alq_descent,
    alq_initializations,
    amq_multiplier,
    amq_variance,
    expected_variance,
    exponential,
    fit_alq,
    fit_alq_gd,
    fit_amq,
    uniform,
    validate_levels,
)

F_13 = TruncatedNormalMixture([0.0], [1 / 128])
ALQ_13 = np.array([0.003471, 0.011476, 0.027206])


def _bucket_mixture() -> TruncatedNormalMixture:
    """A mixture as the package builds it: 30 buckets of 512 heavy-tailed coordinates."""
    rng = np.random.default_rng(8)
    g = rng.standard_t(3, size=(30, 512)) * np.exp(rng.normal(size=(30, 1))) + 0.2
    return BucketStats.from_gradient(g.ravel(), 512).mixture()


DISTRIBUTIONS = {
    "narrow": F_13,
    "wide_shifted": TruncatedNormalMixture([0.05], [0.3]),
    "asymmetric3": TruncatedNormalMixture([-0.3, 0.0, 0.4], [0.02, 0.1, 0.25], [0.2, 0.5, 0.3]),
    "bimodal": TruncatedNormalMixture([-0.5, 0.45], [0.03, 0.05], [1.0, 2.0]),
    "scale_mixture": TruncatedNormalMixture([0.0, 0.0, 0.0], [0.01, 0.05, 0.2], [0.6, 0.3, 0.1]),
    "buckets": _bucket_mixture(),
}


def _mirror(pos: np.ndarray) -> np.ndarray:
    return np.concatenate([-pos[::-1], pos])


# --------------------------------------------------------------------------------------------
# a generic optimizer to compare against: scipy L-BFGS-B from many starts, on V and its exact
# gradient built from the public closed forms (quadrature-checked in the distribution tests)
# --------------------------------------------------------------------------------------------
def _v_and_grad(x: np.ndarray, F: TruncatedNormalMixture) -> tuple[float, np.ndarray]:
    order = np.argsort(x)
    L = np.concatenate([[-1.0], np.clip(x[order], -1, 1), [1.0]])
    c, d = L[:-1], L[1:]
    S = F.segment_cost(c, d)
    M0, M1, _ = F.partial_moments(c, d)
    up = M1 - c * M0  # ∫_{ℓ_j}^{ℓ_{j+1}} (r − ℓ_j) dF
    down = d * M0 - M1  # ∫_{ℓ_j}^{ℓ_{j+1}} (ℓ_{j+1} − r) dF
    g_sorted = (
        up[:-1] - down[1:]
    )  # ∂V/∂ℓ_j = ∫_{ℓ_{j−1}}^{ℓ_j}(r − ℓ_{j−1}) dF − ∫_{ℓ_j}^{ℓ_{j+1}}(ℓ_{j+1} − r) dF
    g = np.empty_like(x)
    g[order] = g_sorted
    return float(S.sum()), g


def _v_and_grad_symmetric(x: np.ndarray, F: TruncatedNormalMixture) -> tuple[float, np.ndarray]:
    # table (−1, …, −|x|, |x|, …, 1); dV/dx_i = g(x_i) − g(−x_i)
    full = np.concatenate([-x, x])
    v, g = _v_and_grad(full, F)
    return v, g[x.size :] - g[: x.size]


def _scipy_best(
    F: TruncatedNormalMixture, n_free: int, *, symmetric: bool, starts: int, seed: int
) -> float:
    rng = np.random.default_rng(seed)
    fun = _v_and_grad_symmetric if symmetric else _v_and_grad
    lo = 1e-9 if symmetric else -1.0
    best = np.inf
    samples = F.sample(4000, rng)
    for k in range(starts):
        if k % 4 == 0:  # uniform random levels
            x0 = np.sort(rng.uniform(lo, 1.0, n_free))
        else:  # random data points (concentrates the levels where the mass is)
            x0 = np.sort(rng.choice(np.abs(samples) if symmetric else samples, n_free))
        res = minimize(
            fun,
            x0,
            args=(F,),
            jac=True,
            method="L-BFGS-B",
            bounds=[(lo, 1.0)] * n_free,
            options={"ftol": 1e-13, "gtol": 1e-12, "maxiter": 500},
        )
        best = min(best, res.fun)
    return best


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_alq_within_half_percent_of_generic_optimizer(name: str, bits: int) -> None:
    F = DISTRIBUTIONS[name]
    v_alq = expected_variance(fit_alq(F, bits), F)
    v_ref = _scipy_best(F, 2**bits - 2, symmetric=False, starts=12, seed=bits)
    # the acceptance bound: ALQ at most 0.5 % above the best of 12 L-BFGS-B runs
    assert v_alq <= v_ref * 1.005


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("name", ["asymmetric3", "buckets", "narrow"])
def test_symmetric_alq_within_half_percent_of_generic_optimizer(name: str, bits: int) -> None:
    F = DISTRIBUTIONS[name]
    L = fit_alq(F, bits, symmetric=True)
    assert np.array_equal(L, -L[::-1])
    v_ref = _scipy_best(F, 2 ** (bits - 1) - 1, symmetric=True, starts=10, seed=10 + bits)
    assert expected_variance(L, F) <= v_ref * 1.005


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_alq_never_worse_than_its_initializations(name: str, bits: int, symmetric: bool) -> None:
    F = DISTRIBUTIONS[name]
    L = fit_alq(F, bits, symmetric=symmetric)
    validate_levels(L)
    v = expected_variance(L, F)
    for start in alq_initializations(F, bits, symmetric=symmetric):
        validate_levels(start)
        assert v <= expected_variance(start, F) * (1 + 1e-12)
        # and not worse than the descent from that start alone (selection keeps the best)
        assert v <= expected_variance(alq_descent(F, start, symmetric=symmetric), F) * (1 + 1e-12)


def test_section_13_alq_levels() -> None:
    for symmetric in (False, True):  # §13: the symmetric exact method gives the same
        L = fit_alq(F_13, 3, symmetric=symmetric)
        np.testing.assert_allclose(L[4:7], ALQ_13, atol=1e-6)  # the spec's 6 decimals
        np.testing.assert_allclose(L[1:4], -ALQ_13[::-1], atol=1e-6)
        np.testing.assert_allclose(expected_variance(L, F_13), 1.3982e-5, rtol=5e-5)


def test_section_13_amq_and_ordering() -> None:
    p = amq_multiplier(F_13, 3)
    np.testing.assert_allclose(p, 0.1328, atol=5e-5)
    v_amq = expected_variance(fit_amq(F_13, 3), F_13)
    np.testing.assert_allclose(v_amq, 3.6196e-5, rtol=5e-5)
    v_alq = expected_variance(fit_alq(F_13, 3), F_13)
    v_exp = expected_variance(exponential(3), F_13)
    v_uni = expected_variance(uniform(3), F_13)
    assert v_alq < v_amq < v_exp < v_uni


def test_alq_n_uses_the_pooled_normal() -> None:
    rng = np.random.default_rng(12)
    st = BucketStats.from_gradient(rng.normal(size=64 * 256), 256)
    N = st.pooled_normal()
    L = fit_alq(N, 3)
    # buckets of i.i.d. normals: the pooled normal is ≈ TN(0, 1/16), and ALQ-N beats E-ref on it
    assert abs(N.stds[0] - 1 / 16) < 2e-3
    assert expected_variance(L, N) < expected_variance(exponential(3), N)


@pytest.mark.parametrize("name", ["narrow", "asymmetric3", "buckets"])
def test_acceleration_does_not_change_the_answer(name: str) -> None:
    F = DISTRIBUTIONS[name]
    for bits in (3, 4):
        fast = fit_alq(F, bits)
        plain = fit_alq(F, bits, accelerate=False, tol=1e-13, max_sweeps=5000)
        v_fast, v_plain = expected_variance(fast, F), expected_variance(plain, F)
        # the same minimum: V within 1e-7 relative (plain descent converges only linearly)
        assert v_fast <= v_plain * (1 + 1e-7)
        assert abs(v_fast - v_plain) <= 1e-7 * v_plain


def test_fixed_sweeps_are_monotone() -> None:
    F = DISTRIBUTIONS["asymmetric3"]
    values = [expected_variance(alq_descent(F, uniform(4), sweeps=k), F) for k in range(12)]
    assert values[0] == expected_variance(uniform(4), F)
    assert all(b <= a * (1 + 1e-14) for a, b in zip(values, values[1:]))
    assert values[-1] < 0.5 * values[0]
    # the reference's 30 sweeps are close to, and never better than, the converged result
    v30 = expected_variance(fit_alq(F, 4, sweeps=30), F)
    assert expected_variance(fit_alq(F, 4), F) <= v30 * (1 + 1e-12)


def test_initial_table_is_used_as_fourth_start() -> None:
    F = DISTRIBUTIONS["bimodal"]
    best = fit_alq(F, 3)
    # starting from the optimum itself must return (essentially) the optimum
    again = fit_alq(F, 3, initial=best)
    assert expected_variance(again, F) <= expected_variance(best, F) * (1 + 1e-12)
    with pytest.raises(ValueError, match="levels"):
        fit_alq(F, 3, initial=uniform(2))
    with pytest.raises(ValueError):
        fit_alq(F, 3, initial=[-1.0, 0.5, 0.2, 1.0, 1.0, 1.0, 1.0, 1.0])


def test_alq_g() -> None:
    for name in ("narrow", "asymmetric3", "buckets"):
        F = DISTRIBUTIONS[name]
        for bits in (2, 3, 4):
            L = fit_alq_gd(F, bits)
            validate_levels(L)
            assert np.array_equal(L, -L[::-1])  # symmetric by default, like the reference
            v = expected_variance(L, F)
            starts = alq_initializations(F, bits, symmetric=True)
            assert v <= min(expected_variance(s, F) for s in starts) * (1 + 1e-12)
            assert expected_variance(fit_alq(F, bits, symmetric=True), F) <= v * (1 + 1e-12)
    # large steps stay ordered thanks to the δ/2 clip
    L = fit_alq_gd(DISTRIBUTIONS["wide_shifted"], 4, lr=1e6, sweeps=50, symmetric=False)
    validate_levels(L)
    with pytest.raises(ValueError, match="lr"):
        fit_alq_gd(F_13, 3, lr=0.0)


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_amq_agrees_with_fine_grid(name: str, bits: int) -> None:
    F = DISTRIBUTIONS[name]
    p = amq_multiplier(F, bits)
    assert 1e-4 <= p <= 1 - 1e-4
    v = expected_variance(fit_amq(F, bits), F)
    np.testing.assert_allclose(v, amq_variance(F, bits, p), rtol=1e-12)
    grid = np.exp(np.linspace(np.log(1e-4), np.log(1 - 1e-4), 20001))
    v_grid = amq_variance(F, bits, grid)
    # never worse than the best of 20001 grid points (up to rounding), and close to its argmin
    assert v <= v_grid.min() * (1 + 1e-9)
    assert abs(np.log(p) - np.log(grid[np.argmin(v_grid)])) < 1e-3


def test_amq_multimodal_and_warm_start() -> None:
    # §8: V(p) has two local minima at 3 bits for TN(0, 1/128); the global one is p ≈ 0.1328
    grid = np.exp(np.linspace(np.log(1e-3), np.log(0.999), 4001))
    v = amq_variance(F_13, 3, grid)
    local_minima = np.sum((v[1:-1] < v[:-2]) & (v[1:-1] < v[2:]))
    assert local_minima >= 2
    p_cold = amq_multiplier(F_13, 3)
    p_warm = amq_multiplier(F_13, 3, initial_p=0.6)  # a bad warm start does not win
    assert p_warm == p_cold
    assert amq_multiplier(F_13, 1) == 0.5
    np.testing.assert_array_equal(fit_amq(F_13, 1), [-1.0, 1.0])
    with pytest.raises(ValueError, match="initial_p"):
        amq_multiplier(F_13, 3, initial_p=1.5)
    with pytest.raises(ValueError, match="method"):
        amq_multiplier(F_13, 3, method="reference")


def test_fits_are_deterministic() -> None:
    F = DISTRIBUTIONS["buckets"]
    G = TruncatedNormalMixture(F.means, F.stds, F.weights)
    for fit in (
        lambda d: fit_alq(d, 3),
        lambda d: fit_alq(d, 4, symmetric=True),
        lambda d: fit_alq_gd(d, 3),
        lambda d: fit_amq(d, 3),
    ):
        a, b, c = fit(F), fit(F), fit(G)
        assert np.array_equal(a, b) and np.array_equal(a, c)
        assert LevelTable(a).hash == LevelTable(c).hash


@pytest.mark.parametrize("bad", [0, 9, -2, 3.5, True, None])
def test_bad_bits_raise(bad: object) -> None:
    for fn in (fit_alq, fit_alq_gd, fit_amq, amq_multiplier, alq_initializations):
        with pytest.raises(ValueError, match="bits"):
            fn(F_13, bad)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="TruncatedNormalMixture"):
        fit_alq([0.0, 0.1], 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="TruncatedNormalMixture"):
        fit_amq(F_13.folded(), 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tol"):
        fit_alq(F_13, 3, tol=-1.0)
    with pytest.raises(ValueError, match="max_sweeps"):
        fit_alq(F_13, 3, max_sweeps=0)
    with pytest.raises(ValueError, match="sweeps"):
        fit_alq(F_13, 3, sweeps=-1)


def test_one_bit_has_nothing_to_fit() -> None:
    for symmetric in (False, True):
        np.testing.assert_array_equal(fit_alq(F_13, 1, symmetric=symmetric), [-1.0, 1.0])
    np.testing.assert_array_equal(fit_alq_gd(F_13, 1), [-1.0, 1.0])


@pytest.mark.parametrize(
    "F",
    [
        TruncatedNormalMixture([0.0], [0.0]),  # point mass at 0
        TruncatedNormalMixture([0.3], [0.0]),  # point mass off-centre
        TruncatedNormalMixture([-0.2, 0.5], [0.0, 0.0], [1.0, 1.0]),  # two point masses
        TruncatedNormalMixture([1.0, -1.0], [1e-6, 1e-3]),  # mass at the ends
        TruncatedNormalMixture([0.0], [1e6]),  # ~uniform
    ],
    ids=["point0", "point03", "two_points", "ends", "uniform"],
)
def test_degenerate_distributions_give_valid_tables(F: TruncatedNormalMixture) -> None:
    for bits in (1, 2, 3, 4):
        for table in (
            fit_alq(F, bits),
            fit_alq(F, bits, symmetric=True),
            fit_alq_gd(F, bits),
            fit_amq(F, bits),
        ):
            validate_levels(table)
            assert np.isfinite(expected_variance(table, F))


def test_uniform_law_gives_uniform_levels() -> None:
    # for a uniform density the optimal levels are equally spaced: ALQ recovers U-ref
    F = TruncatedNormalMixture([0.0], [1e6])
    np.testing.assert_allclose(fit_alq(F, 3), uniform(3), atol=1e-6)


def test_random_mixtures_always_give_valid_tables() -> None:
    rng = np.random.default_rng(2718)
    for _ in range(12):
        k = int(rng.integers(1, 5))
        F = TruncatedNormalMixture(
            rng.uniform(-1, 1, k), 10 ** rng.uniform(-4, 0, k), rng.uniform(0.01, 1, k)
        )
        for bits in (2, 3, 5):
            for symmetric in (False, True):
                L = fit_alq(F, bits, symmetric=symmetric)
                validate_levels(L)
                v = expected_variance(L, F)
                assert v <= expected_variance(uniform(bits), F) * (1 + 1e-12)
            validate_levels(fit_amq(F, bits))


def test_many_bits() -> None:
    F = DISTRIBUTIONS["wide_shifted"]
    L = fit_alq(F, 8, symmetric=True)
    validate_levels(L)
    assert L.size == 256
    assert expected_variance(L, F) < expected_variance(uniform(8), F)
    validate_levels(fit_amq(F, 8))
    validate_levels(fit_amq(F_13, 8))


def test_nan_guard_on_empty_tail_intervals() -> None:
    # §7.1: from U-ref at 4 bits on TN(0, 1/128) the outer intervals hold no mass; without the
    # guard F⁻¹(≈1) = 1 makes levels collide and NaNs follow (seen in the reference)
    for symmetric in (False, True):
        for sweeps in (1, 30, None):
            L = alq_descent(F_13, uniform(4), symmetric=symmetric, sweeps=sweeps)
            validate_levels(L)
            assert np.isfinite(expected_variance(L, F_13))
            assert expected_variance(L, F_13) < expected_variance(uniform(4), F_13)
