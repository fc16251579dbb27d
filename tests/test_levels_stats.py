"""Per-bucket statistics, their exchange format and merge (docs/quantizers.md §5.1, §5.2, §5.4)."""

from __future__ import annotations

import numpy as np
import pytest

from horovod_aq.levels import (
    BucketStats,
    TruncatedNormalMixture,
    bucket_moments,
    fit_alq,
    validate_levels,
)


def _gradient(rng: np.random.Generator, n_buckets: int, B: int, tail: int = 0) -> np.ndarray:
    scale = np.exp(rng.normal(size=(n_buckets, 1)))
    g = (rng.standard_t(5, size=(n_buckets, B)) + 0.3 * rng.normal(size=(n_buckets, 1))) * scale
    return np.concatenate([g.ravel(), rng.normal(size=tail)])


def test_bucket_stats_definition() -> None:
    rng = np.random.default_rng(0)
    B = 64
    x = _gradient(rng, 6, B, tail=17)
    x[2 * B : 3 * B] = 0.0  # a zero bucket is skipped
    st = BucketStats.from_gradient(x, B)
    full = x[: 6 * B].reshape(6, B)
    keep = np.array([0, 1, 3, 4, 5])
    v = full[keep]
    n = np.linalg.norm(v, axis=1)
    u = v / n[:, None]
    order = np.argsort(-n, kind="stable")
    np.testing.assert_allclose(st.norms, n[order], rtol=1e-14)
    np.testing.assert_allclose(st.means, u.mean(axis=1)[order], rtol=1e-12, atol=1e-17)
    np.testing.assert_allclose(st.stds, u.std(axis=1, ddof=1)[order], rtol=1e-12)
    assert st.bucket_size == B and len(st) == 5 and st.num_buckets == 5
    assert st.count == 5 * B
    np.testing.assert_allclose(st.sum_u, u.sum(), rtol=1e-12)
    np.testing.assert_allclose(
        st.sum_sq_dev, ((u - u.mean(axis=1, keepdims=True)) ** 2).sum(), rtol=1e-12
    )
    # identity of §5.1: s_b² = (1 − B·m_b²)/(B − 1)
    np.testing.assert_allclose(st.stds**2, (1 - B * st.means**2) / (B - 1), rtol=1e-10)


def test_bucket_moments_is_the_definition_behind_from_gradient() -> None:
    rng = np.random.default_rng(5)
    B = 48
    x = _gradient(rng, 9, B, tail=11).astype(np.float32)
    x[4 * B : 5 * B] = 0.0
    norms, means, stds = bucket_moments(x, B)
    assert all(a.dtype == np.float64 and a.shape == (8,) for a in (norms, means, stds))
    v = np.delete(x[: 9 * B].astype(np.float64).reshape(9, B), 4, axis=0)  # bucket order
    u = v / np.linalg.norm(v, axis=1, keepdims=True)
    np.testing.assert_allclose(norms, np.linalg.norm(v, axis=1), rtol=1e-14)
    np.testing.assert_allclose(means, u.mean(axis=1), rtol=1e-12, atol=1e-17)
    np.testing.assert_allclose(stds, u.std(axis=1, ddof=1), rtol=1e-12)
    st = BucketStats.from_gradient(x, B, top_k=5)
    ref = BucketStats.from_buckets(norms, means, stds, B, top_k=5)
    for name in ("norms", "means", "stds"):
        assert np.array_equal(getattr(st, name), getattr(ref, name))
    assert (st.count, st.sum_u, st.sum_sq_dev) == (ref.count, ref.sum_u, ref.sum_sq_dev)
    empty = bucket_moments(np.zeros(3 * B), B)
    assert all(a.shape == (0,) for a in empty)
    with pytest.raises(ValueError, match="non-finite"):
        bucket_moments(np.array([1.0, np.nan]), 2)
    with pytest.raises(ValueError, match="bucket_size"):
        bucket_moments(np.ones(4), 1)


def test_top_k_and_canonical_order() -> None:
    rng = np.random.default_rng(1)
    x = _gradient(rng, 40, 32)
    all_stats = BucketStats.from_gradient(x, 32)
    top = BucketStats.from_gradient(x, 32, top_k=10)
    np.testing.assert_array_equal(top.norms, all_stats.norms[:10])
    assert np.all(np.diff(all_stats.norms) <= 0)
    # the pooled sums still use every nonzero bucket
    assert top.count == all_stats.count == 40 * 32
    assert top.sum_sq_dev == all_stats.sum_sq_dev
    # ties in norm are broken by (mean, std)
    st = BucketStats.from_buckets([2.0, 2.0, 2.0], [0.1, -0.1, 0.1], [0.2, 0.3, 0.1], 8)
    np.testing.assert_array_equal(st.means, [-0.1, 0.1, 0.1])
    np.testing.assert_array_equal(st.stds, [0.3, 0.1, 0.2])


def test_from_buckets_skips_zero_rows_and_validates() -> None:
    st = BucketStats.from_buckets([1.0, 0.0, 2.0], [0.01, np.nan, 0.02], [0.1, np.nan, 0.1], 16)
    assert len(st) == 2 and st.count == 32
    for bad, match in [
        ({"norms": [1.0, np.inf]}, "finite"),
        ({"norms": [1.0, -1.0]}, "non-negative"),
        ({"stds": [0.1, -0.1]}, "non-negative"),
        ({"means": [0.0, np.nan]}, "finite"),
    ]:
        kw = {"norms": [1.0, 1.0], "means": [0.0, 0.0], "stds": [0.1, 0.1], "bucket_size": 16} | bad
        with pytest.raises(ValueError, match=match):
            BucketStats.from_buckets(**kw)
    with pytest.raises(ValueError, match="bucket_size"):
        BucketStats.from_buckets([1.0], [0.0], [0.1], 1)
    with pytest.raises(ValueError, match="differ in length"):
        BucketStats.from_buckets([1.0], [0.0, 0.1], [0.1], 8)


def test_chunking_does_not_change_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    import horovod_aq.levels.stats as stats_module

    x = _gradient(np.random.default_rng(9), 25, 32, tail=5)
    whole = BucketStats.from_gradient(x, 32)
    monkeypatch.setattr(stats_module, "_STATS_CHUNK", 100)  # 3 buckets per chunk
    chunked = BucketStats.from_gradient(x, 32)
    for name in ("norms", "means", "stds"):
        assert np.array_equal(getattr(chunked, name), getattr(whole, name))
    assert (chunked.count, chunked.sum_u, chunked.sum_sq_dev) == (
        whole.count,
        whole.sum_u,
        whole.sum_sq_dev,
    )


def test_bucket_stats_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        BucketStats.from_gradient(np.array([1.0, np.nan, 2.0, 3.0]), 2)
    with pytest.raises(ValueError, match="non-finite"):  # also in the skipped partial tail
        BucketStats.from_gradient(np.array([1.0, 2.0, 3.0, np.inf]), 3)
    with pytest.raises(ValueError, match="numeric"):
        BucketStats.from_gradient(np.array(["a", "b"]), 2)
    with pytest.raises(ValueError, match="bucket_size"):
        BucketStats.from_gradient(np.ones(8), 1)
    with pytest.raises(ValueError, match="bucket_size"):
        BucketStats.from_gradient(np.ones(8), 2.5)


def test_empty_statistics_raise_with_a_hint() -> None:
    for st in (
        BucketStats.from_gradient(np.zeros(64), 16),
        BucketStats.from_gradient(np.ones(10), 16),
    ):
        assert len(st) == 0 and st.count == 0
        with pytest.raises(ValueError, match="no nonzero full bucket"):
            st.mixture()
        with pytest.raises(ValueError, match="no nonzero full bucket"):
            st.pooled_normal()


def test_merge_equals_global_statistics_and_ignores_order() -> None:
    rng = np.random.default_rng(2)
    B = 32
    ranks = [_gradient(rng, n, B) for n in (7, 12, 5, 9)]
    parts = [BucketStats.from_gradient(g, B, top_k=6) for g in ranks]
    merged = BucketStats.merge(parts, top_k=6)
    whole = BucketStats.from_gradient(np.concatenate(ranks), B, top_k=6)
    np.testing.assert_array_equal(merged.norms, whole.norms)
    np.testing.assert_array_equal(merged.means, whole.means)
    assert merged.count == whole.count
    np.testing.assert_allclose(merged.sum_u, whole.sum_u, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(merged.sum_sq_dev, whole.sum_sq_dev, rtol=1e-12)
    for perm in ([3, 2, 1, 0], [1, 3, 0, 2]):
        other = BucketStats.merge([parts[i] for i in perm], top_k=6)
        for name in ("norms", "means", "stds"):
            assert np.array_equal(getattr(other, name), getattr(merged, name))
        assert (other.count, other.sum_u, other.sum_sq_dev) == (
            merged.count,
            merged.sum_u,
            merged.sum_sq_dev,
        )
    with pytest.raises(ValueError, match="bucket sizes"):
        BucketStats.merge([parts[0], BucketStats.from_gradient(ranks[1], 16)])
    with pytest.raises(ValueError):
        BucketStats.merge([])


def test_fixed_size_array_roundtrip() -> None:
    rng = np.random.default_rng(3)
    st = BucketStats.from_gradient(_gradient(rng, 5, 16), 16)
    arr = st.to_array(8)  # more slots than rows: padded with zero-norm rows
    assert arr.shape == (3 * 8 + 4,) and arr.dtype == np.float64
    back = BucketStats.from_array(arr)
    for name in ("norms", "means", "stds"):
        assert np.array_equal(getattr(back, name), getattr(st, name))
    assert (back.bucket_size, back.count, back.sum_u, back.sum_sq_dev) == (
        st.bucket_size,
        st.count,
        st.sum_u,
        st.sum_sq_dev,
    )
    short = BucketStats.from_array(st.to_array(2))  # fewer slots: the largest norms survive
    np.testing.assert_array_equal(short.norms, st.norms[:2])
    assert short.count == st.count
    empty = BucketStats.from_array(BucketStats.from_gradient(np.zeros(32), 16).to_array(4))
    assert len(empty) == 0
    with pytest.raises(ValueError, match="length"):
        BucketStats.from_array(np.zeros(9))
    with pytest.raises(ValueError, match="non-finite"):
        BucketStats.from_array(np.full(7, np.nan))


def test_mixture_and_pooled_normal() -> None:
    rng = np.random.default_rng(4)
    st = BucketStats.from_gradient(_gradient(rng, 20, 128), 128, top_k=8)
    F = st.mixture()
    assert isinstance(F, TruncatedNormalMixture) and F.n_components == 8
    np.testing.assert_allclose(F.weights, st.norms**2 / np.sum(st.norms**2), rtol=1e-14)
    np.testing.assert_allclose(st.mixture("norm").weights, st.norms / st.norms.sum(), rtol=1e-14)
    N = st.pooled_normal()
    np.testing.assert_allclose(N.means[0], st.sum_u / st.count, rtol=1e-14)
    np.testing.assert_allclose(N.stds[0], np.sqrt(st.sum_sq_dev / st.count), rtol=1e-14)


def test_degenerate_buckets_give_valid_tables() -> None:
    B = 16
    # a constant bucket (std = 0 exactly), a single bucket, and a bucket with one nonzero entry
    cases = [np.full(B, 3.0), np.concatenate([np.zeros(B), np.linspace(-1, 2, B)])]
    one_hot = np.zeros(B)
    one_hot[5] = -2.0
    cases.append(one_hot)
    for x in cases:
        st = BucketStats.from_gradient(x, B)
        assert len(st) == 1
        for F in (st.mixture(), st.pooled_normal()):
            for bits in (2, 3):
                L = fit_alq(F, bits)
                validate_levels(L)
                assert np.all(np.isfinite(L))
