"""Fixed level families (spec docs/quantizers.md §2) and the table-repair helper."""

from __future__ import annotations

import numpy as np
import pytest

from horovod_aq.levels import (
    exponential,
    natural,
    separate_levels,
    ternary,
    uniform,
    uniform_with_zero,
    validate_levels,
)

ALL_BITS = range(1, 9)
BAD_BITS = [0, 9, -1, 2.5, True, "3", None]


def _assert_valid(levels: np.ndarray) -> None:
    validate_levels(levels)  # raises on any violation
    assert levels.dtype == np.float64
    assert np.all(np.diff(levels.astype(np.float32)) > 0)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_uniform_is_u_ref(bits: int) -> None:
    L = uniform(bits)
    _assert_valid(L)
    n = 2**bits
    assert L.size == n
    np.testing.assert_allclose(L, -1.0 + 2.0 * np.arange(n) / (n - 1), rtol=0, atol=1e-15)
    assert np.array_equal(L, -L[::-1])  # exactly antisymmetric
    assert not np.any(L == 0.0)  # zero-free for even N


def test_uniform_small_cases() -> None:
    np.testing.assert_array_equal(uniform(1), [-1.0, 1.0])
    np.testing.assert_allclose(uniform(2), [-1, -1 / 3, 1 / 3, 1], rtol=1e-15)
    np.testing.assert_allclose(uniform(3)[4:], [1 / 7, 3 / 7, 5 / 7, 1], rtol=1e-15)


@pytest.mark.parametrize("s", [1, 2, 3, 7, 127])
def test_uniform_with_zero(s: int) -> None:
    L = uniform_with_zero(s)
    _assert_valid(L)
    assert L.size == 2 * s + 1
    assert L[s] == 0.0
    np.testing.assert_allclose(L[s:], np.arange(s + 1) / s, rtol=1e-15)


@pytest.mark.parametrize("bad", [0, 128, -3, 1.5, True])
def test_uniform_with_zero_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        uniform_with_zero(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bits", ALL_BITS)
def test_exponential_is_e_ref(bits: int) -> None:
    L = exponential(bits)
    _assert_valid(L)
    assert L.size == 2**bits
    k = 2 ** (bits - 1)
    np.testing.assert_array_equal(L[k:], 0.5 ** np.arange(k - 1, -1, -1))
    assert np.array_equal(L, -L[::-1])


def test_exponential_small_cases() -> None:
    np.testing.assert_array_equal(exponential(1), [-1.0, 1.0])
    np.testing.assert_array_equal(exponential(3)[4:], [1 / 8, 1 / 4, 1 / 2, 1])
    np.testing.assert_allclose(exponential(3, 0.1)[4:], [1e-3, 1e-2, 0.1, 1], rtol=1e-15)


def test_exponential_underflow_is_repaired() -> None:
    # p = 1e-4 at 8 bits: p^127 underflows float64 (and float32 far earlier); the table must
    # still be valid, symmetric, and keep the well-separated outer levels exactly
    L = exponential(8, 1e-4)
    _assert_valid(L)
    assert np.array_equal(L, -L[::-1])
    np.testing.assert_allclose(L[-4:], [1e-12, 1e-8, 1e-4, 1.0], rtol=1e-12)


@pytest.mark.parametrize("p", [0.0, 1.0, -0.5, 1.5, float("nan"), float("inf")])
def test_exponential_rejects_bad_p(p: float) -> None:
    with pytest.raises(ValueError, match="p must lie in"):
        exponential(3, p)


def test_ternary() -> None:
    np.testing.assert_array_equal(ternary(), [-1.0, 0.0, 1.0])


@pytest.mark.parametrize("bits", range(2, 9))
def test_natural(bits: int) -> None:
    L = natural(bits)
    _assert_valid(L)
    s = 2 ** (bits - 1) - 1
    assert L.size == 2 * s + 1 == 2**bits - 1
    np.testing.assert_array_equal(L[s:], np.concatenate([[0.0], 2.0 ** np.arange(1 - s, 1)]))


def test_natural_small_cases() -> None:
    np.testing.assert_array_equal(natural(2), [-1.0, 0.0, 1.0])
    np.testing.assert_array_equal(natural(3), [-1, -0.5, -0.25, 0, 0.25, 0.5, 1])
    with pytest.raises(ValueError):
        natural(1)


@pytest.mark.parametrize("bad", BAD_BITS)
@pytest.mark.parametrize("family", [uniform, exponential, natural])
def test_bits_out_of_range(family, bad: object) -> None:
    with pytest.raises(ValueError, match="bits"):
        family(bad)


def test_separate_levels_keeps_valid_tables_bit_for_bit() -> None:
    for L in (uniform(5), exponential(6, 0.3), natural(4), uniform_with_zero(5)):
        out = separate_levels(L)
        assert np.array_equal(out, L)


def test_separate_levels_repairs_collisions() -> None:
    raw = np.array([-1.0, -0.3, 0.2, 0.2, 0.2 + 1e-12, 1.0])
    out = separate_levels(raw)
    _assert_valid(out)
    # untouched levels keep their exact values; the collided ones move by a tiny amount
    assert out[1] == -0.3 and out[2] == 0.2
    assert np.max(np.abs(out - raw)) < 1e-5


def test_separate_levels_symmetric_and_zero_cluster() -> None:
    out = separate_levels([-1.0, -1e-300, 0.0, 1e-300, 1.0])
    _assert_valid(out)
    assert np.array_equal(out, -out[::-1])
    out = separate_levels([-1.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    _assert_valid(out)
    assert np.array_equal(out, -out[::-1])


def test_separate_levels_rejects_non_finite() -> None:
    with pytest.raises(ValueError):
        separate_levels([-1.0, float("nan"), 1.0])
    with pytest.raises(ValueError):
        separate_levels([1.0])
