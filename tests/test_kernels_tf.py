"""TensorFlow kernels (horovod_aq.tensorflow.kernels): eager and tf.function behaviour."""

from __future__ import annotations

import numpy as np
import pytest

from horovod_aq import codec
from horovod_aq.codec import PayloadError
from horovod_aq.levels.table import LevelTable

tf = pytest.importorskip("tensorflow")
tk = pytest.importorskip("horovod_aq.tensorflow.kernels")


def uniform_table(bits: int, version: int = 0) -> LevelTable:
    return LevelTable(np.linspace(-1.0, 1.0, 2**bits), version)


def gradient(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * rng.lognormal(0, 1, n)).astype(np.float32)


def f32_bits(t) -> np.ndarray:
    arr = t.numpy() if hasattr(t, "numpy") else t
    return np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)


N, BUCKET, BITS = 1001, 64, 3


@pytest.fixture(scope="module")
def variables():
    """Levels and header as variables, as the integration holds them across refits."""
    table = uniform_table(BITS, version=5)
    levels = tf.Variable(tk.levels_tensor(table), trainable=False)
    header = tf.Variable(tk.header_tensor(N, table, BUCKET, "l2"), trainable=False)
    return table, levels, header


def test_encode_decode_average_in_tf_function_match_codec_and_do_not_retrace(variables):
    table, levels, header = variables

    @tf.function
    def encode(x, u):
        return tk.encode_with(x, levels, header, bits=BITS, bucket_size=BUCKET, uniforms=u)

    @tf.function(input_signature=[tf.TensorSpec([None, codec.payload_size(N, BITS, BUCKET)],
                                                tf.uint8)])
    def average(rows):  # P is dynamic here
        return tk.decode_average_with(rows, levels, header, numel=N, bits=BITS,
                                      bucket_size=BUCKET)

    @tf.function
    def decode(row):
        return tk.decode_with(row, levels, header, numel=N, bits=BITS, bucket_size=BUCKET,
                              dtype=tf.float16)

    xs = [gradient(N, seed=p) for p in range(3)]
    us = [np.random.default_rng(p).random(N, dtype=np.float32) for p in range(3)]
    rows = np.stack([encode(x, u).numpy() for x, u in zip(xs, us)])
    assert np.array_equal(rows, np.stack([codec.encode(x, table, bucket_size=BUCKET, uniforms=u)
                                          for x, u in zip(xs, us)]))
    got = average(rows)
    assert np.array_equal(f32_bits(got), f32_bits(codec.decode_average(rows, table)))
    assert np.array_equal(decode(rows[0]).numpy(), codec.decode(rows[0], table, dtype=np.float16))

    # A refit assigns new values to the variables: same trace, new bytes.
    new_table = LevelTable(np.concatenate([[-1], np.linspace(-0.6, 0.6, 6), [1]]), 6)
    levels.assign(tk.levels_tensor(new_table))
    header.assign(tk.header_tensor(N, new_table, BUCKET, "l2"))
    again = encode(xs[0], us[0]).numpy()
    assert np.array_equal(again, codec.encode(xs[0], new_table, bucket_size=BUCKET,
                                              uniforms=us[0]))
    assert encode.experimental_get_tracing_count() == 1
    with pytest.raises(tf.errors.InvalidArgumentError, match="level-table version differs.*"
                                                             "ranks disagree on the level table"):
        average(rows)  # encoded with version 5, this rank now holds version 6
    levels.assign(tk.levels_tensor(table))
    header.assign(tk.header_tensor(N, table, BUCKET, "l2"))


def test_division_by_p_is_a_true_division_in_graph_mode():
    """Grappler turns x / constant into x * (1 / constant); decode_average must not."""
    table = uniform_table(4)
    rows = np.stack([codec.encode(gradient(4096, seed=p), table, bucket_size=256, seed=p)
                     for p in range(3)])
    acc = codec.decode(rows[0], table) + codec.decode(rows[1], table) + codec.decode(rows[2],
                                                                                      table)
    assert np.any(acc / np.float32(3) != acc * (np.float32(1) / np.float32(3)))  # test has teeth

    @tf.function
    def average(r):
        return tk.decode_average(r, table, numel=4096, bucket_size=256, norm="l2")

    assert np.array_equal(f32_bits(average(tf.constant(rows))),
                          f32_bits(codec.decode_average(rows, table)))


def test_seed_options():
    table, x = uniform_table(2), tf.constant(gradient(500))
    a = tk.encode(x, table, bucket_size=64, seed=7)
    assert np.array_equal(a.numpy(), tk.encode(x, table, bucket_size=64, seed=7).numpy())
    assert not np.array_equal(a.numpy(), tk.encode(x, table, bucket_size=64, seed=8).numpy())
    gen = tf.random.Generator.from_seed(1)
    b = tk.encode(x, table, bucket_size=64, seed=gen)
    assert b.shape == a.shape and not np.array_equal(a.numpy(),
                                                     tk.encode(x, table, bucket_size=64,
                                                               seed=gen).numpy())
    assert tk.encode(x, table, bucket_size=64).shape == a.shape  # global generator
    u = tf.random.stateless_uniform([500], seed=tf.constant([7, 0], tf.int64))
    assert np.array_equal(a.numpy(), tk.encode(x, table, bucket_size=64, uniforms=u).numpy())


def test_unbiased_with_stateless_seeds():
    table, draws = uniform_table(2), 2000
    x = gradient(48, seed=3)
    tiled = tf.constant(np.tile(x, draws))
    q = tk.quantize(tiled, table, bucket_size=16, seed=11).numpy().reshape(draws, 48)
    norms = np.repeat(codec.bucket_norms(x, 16), 16).astype(np.float64)
    bound = 5 * norms * (2 / 3) / 2 / np.sqrt(draws)
    assert np.all(np.abs(q.astype(np.float64).mean(0) - x) <= bound)


def test_bucket_moments_and_norms_match_codec():
    x = gradient(5000)
    x[:500] = 0
    for a, b in zip(tk.bucket_moments(tf.constant(x), 500), codec.bucket_moments(x, 500)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-15)
    for norm in ("l2", "linf"):
        assert np.array_equal(tk.bucket_norms(tf.constant(x), 333, norm).numpy(),
                              codec.bucket_norms(x, 333, norm))


# ---------------------------------------------------------------------------------- errors


def test_eager_errors_match_the_numpy_messages():
    table = uniform_table(3, version=3)
    bad = gradient(100)
    bad[[4, 9]] = [np.nan, np.inf]
    with pytest.raises(ValueError, match=r"2 of 100 .*first at flat index 4"):
        tk.encode(tf.constant(bad), table, bucket_size=16)
    with pytest.raises(ValueError, match="overflows float32"):
        tk.encode(tf.constant([1.0, 1.0, 3e38, 3e38]), table, bucket_size=2)
    with pytest.raises(ValueError, match="floating-point"):
        tk.encode(tf.range(8), table, bucket_size=4)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        tk.encode(tf.ones(8), table, bucket_size=4, uniforms=np.ones(8, np.float32))
    with pytest.raises(ValueError, match="end at \\+1"):
        tk.encode(tf.ones(8), [-1.0, 0.0, 0.5], bucket_size=4)
    payload = tk.encode(tf.constant(gradient(100)), table, bucket_size=16, seed=0)
    with pytest.raises(PayloadError, match="truncated"):
        tk.decode(payload[:-1], table)
    with pytest.raises(PayloadError, match="level-table version 3 .* holds version 4"):
        tk.decode(payload, table.with_version(4))
    with pytest.raises(PayloadError, match="format version 3"):
        tk.decode(tf.concat([payload[:2], [3], payload[3:]], 0), table)
    with pytest.raises(PayloadError, match="rank 1: .*bucket_size 32"):
        other = tk.encode(tf.constant(gradient(100)), table, bucket_size=32, seed=0)
        tk.decode_average(tf.stack([payload, tf.pad(other, [[0, payload.shape[0] -
                                                             other.shape[0]]])]), table)


def test_graph_errors_name_the_field():
    table = uniform_table(3, version=3)
    levels, header = tk.levels_tensor(table), tk.header_tensor(100, table, 16, "l2")
    size = codec.payload_size(100, 3, 16)

    @tf.function
    def encode(x):
        return tk.encode_with(x, levels, header, bits=3, bucket_size=16, seed=1)

    bad = gradient(100)
    bad[7] = np.nan
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"non-finite values:\] \[1\] \[of\] \[100\]"
                             r".*first at flat index\] \[7\]"):
        encode(tf.constant(bad))
    with pytest.raises(tf.errors.InvalidArgumentError, match="header_u8 has another numel"):
        tf.function(lambda x: tk.encode_with(x, levels, header, bits=3, bucket_size=16, seed=1))(
            tf.ones(99))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.uint8)])
    def decode(p):
        return tk.decode_with(p, levels, header, numel=100, bits=3, bucket_size=16)

    payload = encode(tf.constant(gradient(100))).numpy()
    assert decode(payload).shape == (100,)
    with pytest.raises(tf.errors.InvalidArgumentError, match="payload size differs"):
        decode(payload[:-1])
    wrong = payload.copy()
    wrong[0] = ord("X")
    with pytest.raises(tf.errors.InvalidArgumentError, match="payload magic differs"):
        decode(wrong)
    wrong = codec.encode(gradient(100), table, bucket_size=16, norm="linf", seed=0)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="payload norm differs.*has 1 but this rank expects 0"):
        decode(wrong)
    with pytest.raises(PayloadError, match=f"truncated: {size - 1} bytes"):
        tf.function(lambda p: tk.decode_with(p, levels, header, numel=100, bits=3,
                                             bucket_size=16),
                    autograph=False)(tf.constant(payload[:-1]))  # AutoGraph would re-wrap it
    with pytest.raises(ValueError, match="static shape"):
        tf.function(lambda x: tk.encode_with(x, levels, header, bits=3, bucket_size=16),
                    input_signature=[tf.TensorSpec([None], tf.float32)],
                    autograph=False).get_concrete_function()


# ------------------------------------------------------------------------------------ checksum
def test_graph_decoders_accept_checksummed_rows_and_verify_them(variables):
    from horovod_aq.codec.stream import StreamKey
    from horovod_aq.tensorflow.checks import translate_error

    table, levels, header = variables
    n, bucket = N, BUCKET
    x = gradient(n)
    key = StreamKey(seed=4)
    sealed = codec.encode(x, table, bucket_size=bucket, key=key, checksum=True)
    plain = codec.encode(x, table, bucket_size=bucket, key=key)

    @tf.function
    def encode(v):
        return tk.encode_with(v, levels, header, bits=table.bits, bucket_size=bucket, key=key,
                              checksum=True)

    assert np.array_equal(encode(tf.constant(x)).numpy(), sealed)

    @tf.function
    def average(rows):
        return tk.decode_average_with(rows, levels, header, numel=n, bits=table.bits,
                                      bucket_size=bucket)

    @tf.function
    def decode(row):
        return tk.decode_with(row, levels, header, numel=n, bits=table.bits, bucket_size=bucket)

    rows = np.stack([plain, sealed])
    assert np.array_equal(f32_bits(average(tf.constant(rows))),
                          f32_bits(codec.decode_average(rows, table)))
    assert np.array_equal(f32_bits(decode(tf.constant(sealed))),
                          f32_bits(codec.decode(sealed, table)))
    bad = sealed.copy()
    bad[-3] ^= 0x20
    for fn, arg, oracle in ((average, np.stack([plain, bad]), codec.decode_average),
                            (decode, bad, codec.decode)):
        with pytest.raises(PayloadError) as want:
            oracle(arg, table)
        with pytest.raises(tf.errors.InvalidArgumentError) as got:
            fn(tf.constant(arg))
        err = translate_error(got.value)
        assert isinstance(err, PayloadError) and str(err) == str(want.value)
        assert getattr(err, "rank", None) == getattr(want.value, "rank", None)
    other = plain.copy()
    other[5] = 1  # a marker's flag is not the checksum's: still refused by the header check
    with pytest.raises(tf.errors.InvalidArgumentError, match="payload flags differs"):
        decode(tf.constant(other))
