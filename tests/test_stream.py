"""The random stream of stochastic rounding, part of the format (docs/format.md §6).

Known answers of Philox4x32-10, the same floats from numpy, torch and TensorFlow, and the
stream's statistics: uniformity (chi-square), independence across ranks, steps, buckets and
parts, and unbiased rounding (the mean of many decodes converges to the gradient at the rate
the closed-form variance predicts).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

import horovod_aq
from horovod_aq import codec
from horovod_aq.codec import PayloadError, StreamKey, philox4x32, stream_uniforms

#: Random123's published known-answer vectors: (counter, key, output).
PHILOX_KATS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
#: Significance of each statistical test: the keys are fixed, so every test is deterministic; a
#: threshold this low only rejects a broken stream.
ALPHA = 1e-4


@pytest.mark.parametrize("counter, key, expected", PHILOX_KATS)
def test_philox_known_answers(counter, key, expected):
    words = philox4x32(tuple(np.array([c], np.int64) for c in counter), key)
    assert tuple(int(w[0]) for w in words) == expected


def test_stream_is_indexed_by_the_coordinate():
    key = StreamKey(seed=3, rank=1, step=9, bucket=2, part=0)
    whole = stream_uniforms(1001, key)
    for start, n in [(0, 1), (1, 3), (5, 100), (998, 3), (4, 997)]:
        np.testing.assert_array_equal(stream_uniforms(n, key, start=start), whole[start:start + n])
    assert whole.dtype == np.float32 and whole.min() >= 0 and whole.max() < 1
    # 24 significant bits: every value is a multiple of 2^-24
    assert np.all(np.mod(whole.astype(np.float64) * 2**24, 1) == 0)
    with pytest.raises(ValueError, match="indexes coordinates"):
        stream_uniforms(8, key, start=codec.stream.MAX_STREAM_NUMEL - 4)


def test_torch_and_tensorflow_draw_the_same_floats():
    key = StreamKey(seed=11, rank=3, step=2**33 + 5, bucket=7, part=4)
    want = stream_uniforms(777, key)
    torch = pytest.importorskip("torch")
    from horovod_aq.torch import kernels as torch_kernels

    np.testing.assert_array_equal(torch_kernels.stream_uniforms(777, key).numpy(), want)
    np.testing.assert_array_equal(torch_kernels.stream_uniforms(7, key, start=3).numpy(),
                                  want[3:10])
    del torch
    tf = pytest.importorskip("tensorflow")
    from horovod_aq.tensorflow import kernels as tf_kernels

    np.testing.assert_array_equal(tf_kernels.stream_uniforms(777, key).numpy(), want)
    step = tf.Variable(np.int64(key.step))   # the packed exchange reads the step in-graph
    k0, k1 = key.philox_key()
    traced = tf.function(lambda: tf_kernels.stream_uniforms(
        777, (k0, k1, step.read_value(), key.bucket, key.part)))
    np.testing.assert_array_equal(traced().numpy(), want)


def test_uniformity_chi_square():
    u = stream_uniforms(1 << 20, StreamKey(seed=0))
    counts = np.bincount((u * 256).astype(np.int64), minlength=256)
    assert stats.chisquare(counts).pvalue > ALPHA
    assert abs(float(u.mean()) - 0.5) < 4 * np.sqrt(1 / 12 / u.size)


@pytest.mark.parametrize("field", ["seed", "rank", "step", "bucket", "part"])
def test_streams_of_different_keys_are_independent(field):
    base = StreamKey(seed=5, rank=1, step=10, bucket=3, part=0)
    other = StreamKey(**{**base.__dict__, field: getattr(base, field) + 1})
    n = 1 << 16
    a, b = stream_uniforms(n, base), stream_uniforms(n, other)
    assert not np.array_equal(a, b)
    assert abs(np.corrcoef(a, b)[0, 1]) < 4 / np.sqrt(n)
    pairs = np.bincount((a * 16).astype(np.int64) * 16 + (b * 16).astype(np.int64),
                        minlength=256)
    assert stats.chisquare(pairs).pvalue > ALPHA   # the joint histogram is uniform


def test_neighbouring_coordinates_are_independent():
    u = stream_uniforms(1 << 16, StreamKey(seed=2))
    for lag in (1, 2, 3, 4, 5):
        assert abs(np.corrcoef(u[:-lag], u[lag:])[0, 1]) < 4 / np.sqrt(u.size)


def test_mean_of_many_decodes_is_unbiased():
    """E[decode(encode(x))] = x: over K keys the mean's squared error is Σ Var / K, with Var the
    closed-form rounding variance; the ratio's standard error is small for n·K large."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(4096).astype(np.float32)
    comp = horovod_aq.QSGD(bits=2, bucket_size=256)
    table, K = comp.table, 400
    total = np.zeros(x.size, np.float64)
    for step in range(K):
        key = StreamKey(seed=1, rank=0, step=step)
        total += codec.quantize(x, table, bucket_size=256, key=key).astype(np.float64)
    mean = total / K
    expected = codec.rounding_variance(x, table, bucket_size=256).sum() / K
    ratio = float(np.sum((mean - x.astype(np.float64)) ** 2) / expected)
    assert 0.9 < ratio < 1.1, ratio


def test_encoding_is_a_pure_function_of_gradient_table_and_key():
    x = np.random.default_rng(1).standard_normal(3000).astype(np.float32)
    table = horovod_aq.ALQ(bits=3).table
    key = StreamKey(seed=4, rank=2, step=7, bucket=1, part=0)
    a = codec.encode(x, table, bucket_size=1024, key=key)
    np.testing.assert_array_equal(a, codec.encode(x, table, bucket_size=1024, key=key))
    np.testing.assert_array_equal(
        a, codec.encode(x, table, bucket_size=1024, uniforms=stream_uniforms(x.size, key)))
    assert not np.array_equal(a, codec.encode(x, table, bucket_size=1024,
                                              key=StreamKey(seed=4, rank=2, step=8, bucket=1)))


def test_a_version_1_payload_is_refused_naming_both_versions():
    x = np.ones(100, np.float32)
    table = horovod_aq.QSGD(bits=3).table
    payload = codec.encode(x, table, bucket_size=64, key=StreamKey(seed=0))
    assert payload[2] == codec.FORMAT_VERSION == 2
    old = payload.copy()
    old[2] = 1
    with pytest.raises(PayloadError, match="format version 1; this build reads version 2"):
        codec.decode(old, table)


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_framework_ops_encode_the_oracles_bytes_from_a_key(bits, monkeypatch):
    """The torch and TensorFlow ops (what CUDA without Triton and TensorFlow with a GPU run)
    draw the stream themselves: the same bytes as the oracle for the same key."""
    x = np.random.default_rng(bits).standard_normal(2500).astype(np.float32)
    table = horovod_aq.QSGD(bits=bits).table
    key = StreamKey(seed=9, rank=1, step=4, bucket=2, part=1)
    want = codec.encode(x, table, bucket_size=1000, key=key)
    torch = pytest.importorskip("torch")
    from horovod_aq.torch import kernels as torch_kernels

    monkeypatch.setattr(torch_kernels, "IMPLEMENTATION", "ops")
    got = torch_kernels.encode(torch.from_numpy(x), table, bucket_size=1000, key=key)
    np.testing.assert_array_equal(got.numpy(), want)
    pytest.importorskip("tensorflow")
    from horovod_aq.tensorflow import kernels as tf_kernels

    monkeypatch.setattr(tf_kernels, "IMPLEMENTATION", "ops")
    np.testing.assert_array_equal(tf_kernels.encode(x, table, bucket_size=1000, key=key).numpy(),
                                  want)
