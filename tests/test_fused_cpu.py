"""The fused numba kernels (horovod_aq.codec.fused) against the numpy oracle: the same bytes, the
same decoded bits and the same errors, for every code width, norm and bucket shape."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from horovod_aq import codec
from horovod_aq.codec import PayloadError, fused
from horovod_aq.codec.stream import StreamKey, stream_uniforms
from horovod_aq.levels import LevelTable, exponential, natural, ternary, uniform, uniform_with_zero


def oracle_encode(x, table, bucket_size, norm, key):
    """The oracle's payload for ``key``'s stream (its definition: the stream's uniforms)."""
    n = np.asarray(x).size
    return codec.encode(x, table, bucket_size=bucket_size, norm=norm,
                        uniforms=stream_uniforms(n, key))


def gradient(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * rng.lognormal(0, 1, n)).astype(np.float32)


def same_error(fn_a, fn_b):
    """Both calls raise the same exception type with the same message; returns it."""
    with pytest.raises(Exception) as a:  # noqa: PT011 (any error; compared below)
        fn_a()
    with pytest.raises(Exception) as b:  # noqa: PT011
        fn_b()
    assert type(a.value) is type(b.value)
    assert str(a.value) == str(b.value)
    return a.value


def check_encode(x, table, bucket_size, norm="l2", key=StreamKey(7, rank=1, step=3)):
    got = fused.encode(x, table, bucket_size=bucket_size, norm=norm, key=key)
    want = oracle_encode(x, table, bucket_size, norm, key)
    assert got.dtype == np.uint8
    assert got.tobytes() == want.tobytes()
    return got


# ------------------------------------------------------------------------------------ encode


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("norm", ["l2", "linf"])
@pytest.mark.parametrize("bucket_size", [2, 7, 64, 1000, 1024])
def test_encode_is_byte_identical_to_the_oracle(bits, norm, bucket_size):
    n = 3 * bucket_size + 5 if bucket_size > 8 else 203  # a partial last bucket, n % 8 != 0
    x = gradient(n, seed=bits)
    x[bucket_size:2 * bucket_size] = 0.0  # an all-zero bucket
    check_encode(x, LevelTable(uniform(bits)), bucket_size, norm)


@pytest.mark.parametrize("levels", [
    ternary(),                        # TernGrad: a zero level
    uniform_with_zero(1),             # QSGD(s=1), 3 levels in 2 bits
    uniform_with_zero(3),             # QSGD(s=3)
    uniform_with_zero(100),           # QSGD(s=100): 201 levels in 8 bits
    natural(4),                       # natural dithering: zero and powers of two
    exponential(3),                   # zero-free
    exponential(8, 0.5),              # subnormal levels flushed to 0 in float32
    exponential(6, 0.9),
    np.concatenate([[-1.0], np.sort(np.random.default_rng(3).uniform(-1, 1, 40)), [1.0]]),
], ids=["ternary", "qsgd1", "qsgd3", "qsgd100", "natural4", "exp3", "exp8", "exp6", "random42"])
@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_tables_with_and_without_a_zero_level(levels, norm):
    x = gradient(2000, seed=1)
    x[::7] = 0.0
    x[5:9] = -0.0
    for bucket_size in (7, 512, 1000):
        check_encode(x, LevelTable(levels, 5), bucket_size, norm)


def test_levels_closer_than_a_lookup_cell_are_searched():
    # 6 bits: above 4 bits a level is found through a table of r's top float bits; these three
    # levels share one cell, so values around them take the binary-search fallback
    inner = np.concatenate([np.linspace(-0.9, 0.4, 58), [0.5, 0.5 + 1e-6, 0.5 + 2e-6]])
    table = LevelTable(np.concatenate([[-1.0], inner, [1.0]]))
    rng = np.random.default_rng(0)
    x = np.concatenate([[1.0], 0.5 + rng.uniform(-3e-6, 5e-6, 999)]).astype(np.float32)
    check_encode(x, table, 1000, "linf")
    check_encode(np.tile(x, 3), table, 1000, "linf")


@pytest.mark.parametrize("n, bucket_size", [(0, 4), (1, 1), (1, 1024), (9, 1), (5, 2),
                                            (3000, 3000), (5000, 4096), (12000, 5000)])
def test_sizes_small_and_large_buckets(n, bucket_size):
    # buckets above 1024 values take the l2 path that streams rows in bit-reversed order
    x = gradient(n, seed=n)
    for norm in ("l2", "linf"):
        payload = check_encode(x, LevelTable(uniform(3)), bucket_size, norm)
        assert payload.size == codec.payload_size(n, 3, bucket_size)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_other_float_dtypes_are_cast_once_like_the_oracle(dtype):
    x = gradient(777, seed=2).astype(dtype)
    check_encode(x, LevelTable(uniform(4)), 64)
    check_encode(x.reshape(7, 111), LevelTable(uniform(4)), 64)  # any shape, flattened


def test_bfloat16_input():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    check_encode(gradient(300).astype(ml_dtypes.bfloat16), LevelTable(uniform(3)), 32)


def test_subnormal_and_huge_values():
    x = gradient(1000, seed=4)
    x[:300] *= np.float32(1e-41)       # float32 subnormals (whole buckets and mixed)
    x[600:700] *= np.float32(1e36)     # large but finite norms
    for norm in ("l2", "linf"):
        check_encode(x, LevelTable(exponential(5)), 100, norm)


def test_every_stream_key_field_changes_the_bytes():
    x, table = gradient(100), LevelTable(uniform(2))
    base = StreamKey(1, rank=2, step=3, bucket=4, part=5)
    payloads = {check_encode(x, table, 16, key=key).tobytes()
                for key in [base, StreamKey(9, 2, 3, 4, 5), StreamKey(1, 9, 3, 4, 5),
                            StreamKey(1, 2, 9, 4, 5), StreamKey(1, 2, 3, 9, 5),
                            StreamKey(1, 2, 3, 4, 9), StreamKey(1, 2, 2**32 + 3, 4, 5)]}
    assert len(payloads) == 6  # step 2^32 + 3 is step 3 (c1 = step mod 2^32)


def test_oracle_key_argument():
    x, table, key = gradient(999), LevelTable(uniform(3)), StreamKey(11, rank=3)
    got = fused.encode(x, table, bucket_size=100, key=key)
    assert got.tobytes() == codec.encode(x, table, bucket_size=100, key=key).tobytes()


# ------------------------------------------------------------------------------------ decode


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("bucket_size", [7, 1000])
def test_decode_and_average_are_bitwise_the_oracle(bits, bucket_size):
    table = LevelTable(uniform(bits))
    n = 2 * bucket_size + 3
    rows = np.stack([oracle_encode(gradient(n, seed=r) * np.float32(r + 1), table, bucket_size,
                                   "l2", StreamKey(5, rank=r)) for r in range(4)])
    for r in range(4):
        got = fused.decode(rows[r], table)
        assert got.tobytes() == codec.decode(rows[r], table).tobytes()
    for p in range(1, 5):  # P = 3 divides, powers of two multiply: both exact
        got = fused.decode_average(rows[:p], table)
        assert got.dtype == np.float32
        assert got.tobytes() == codec.decode_average(rows[:p], table).tobytes()
        listed = fused.decode_average(list(rows[:p]), table, numel=n, bucket_size=bucket_size,
                                      norm="l2")
        assert listed.tobytes() == got.tobytes()


def test_decode_of_empty_and_tiny_payloads_and_dtype():
    table = LevelTable(ternary())
    for n in (0, 1, 3):
        payload = check_encode(gradient(n), table, 2)
        assert fused.decode(payload, table).tobytes() == codec.decode(payload, table).tobytes()
        rows = np.stack([payload, payload, payload])
        assert (fused.decode_average(rows, table).tobytes()
                == codec.decode_average(rows, table).tobytes())
    payload = check_encode(gradient(50), table, 8)
    got = fused.decode(bytes(payload), table, dtype=np.float64)
    assert got.dtype == np.float64
    assert np.array_equal(got, codec.decode(payload, table, dtype=np.float64))


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("bad", [
    np.array([1, np.nan, 2, np.inf], np.float32),
    np.array([0, 0, 0, -np.inf], np.float32),
    np.array([1.0, 1e39], np.float64),       # finite in fp64, ±Inf in float32
    np.array([1.0] * 9 + [np.nan], np.float32),
])
@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_non_finite_input_raises_the_oracles_error(bad, norm):
    table = LevelTable(uniform(2))
    err = same_error(
        lambda: fused.encode(bad, table, bucket_size=2, norm=norm, key=StreamKey(0)),
        lambda: oracle_encode(bad, table, 2, norm, StreamKey(0)))
    assert "non-finite" in str(err)


def test_norm_overflow_raises_the_oracles_error():
    x = np.array([1, 1, 3e38, 3e38, np.nan], np.float32)  # the NaN is reported first
    table = LevelTable(uniform(2))
    for arr in (x, x[:4]):
        same_error(lambda: fused.encode(arr, table, bucket_size=2, key=StreamKey(0)),
                   lambda: oracle_encode(arr, table, 2, "l2", StreamKey(0)))


@pytest.mark.parametrize("kwargs", [
    {"bucket_size": 0}, {"bucket_size": 2.5}, {"bucket_size": 2**32},
    {"bucket_size": 4, "norm": "l1"},
])
def test_bad_settings_raise_the_oracles_error(kwargs):
    table = LevelTable(uniform(2))
    same_error(lambda: fused.encode(gradient(8), table, key=StreamKey(0), **kwargs),
               lambda: codec.encode(gradient(8), table, uniforms=np.zeros(8, np.float32),
                                    **kwargs))


@pytest.mark.parametrize("x, levels", [
    (np.arange(8), uniform(2)),                          # integer gradient
    (gradient(8), np.linspace(-1, 1, 257)),              # 9 bits
    (gradient(8), [-1.0, 0.5, 0.0, 1.0]),                # not increasing
])
def test_bad_input_or_table_raises_the_oracles_error(x, levels):
    same_error(lambda: fused.encode(x, levels, bucket_size=4, key=StreamKey(0)),
               lambda: codec.encode(x, levels, bucket_size=4, uniforms=np.zeros(8, np.float32)))


def test_key_must_be_a_stream_key():
    with pytest.raises(TypeError, match="StreamKey"):
        fused.encode(gradient(8), uniform(2), bucket_size=4, key=5)


@pytest.fixture
def payload_and_table():
    table = LevelTable(uniform(3), version=3)
    payload = oracle_encode(gradient(100), table, 16, "l2", StreamKey(0))
    assert payload.size == 32 + 4 * 7 + 38
    return payload, table


def corruptions(payload, table):
    """(name, bytes) of broken payloads."""
    header = codec.parse_header(payload)
    out = [("truncated", payload[:97]), ("short", payload[:10]),
           ("long", np.concatenate([payload, [0]]).astype(np.uint8))]
    for offset, value in [(0, ord("X")), (2, 99), (3, 9), (4, 7), (5, 4), (5, 2)]:
        bad = payload.copy()
        bad[offset] = value
        out.append((f"byte{offset}", bad))
    bad = payload.copy()
    bad[32:36] = np.frombuffer(np.float32(-1).tobytes(), np.uint8)
    out.append(("negative-norm", bad))
    bad = payload.copy()
    bad[36:40] = np.frombuffer(np.float32(np.inf).tobytes(), np.uint8)
    out.append(("inf-norm", bad))
    out.append(("marker", codec.nonfinite_payload(header.numel, table, 16, "l2", 42)))
    return out


def test_foreign_and_truncated_payloads_raise_the_oracles_errors(payload_and_table):
    payload, table = payload_and_table
    for _, bad in corruptions(payload, table):
        same_error(lambda: fused.decode(bad, table), lambda: codec.decode(bad, table))
    for other in (table.with_version(4), LevelTable(ternary(), 3),
                  LevelTable(np.concatenate([[-1], np.linspace(-0.9, 0.9, 6), [1]]), 3)):
        same_error(lambda: fused.decode(payload, other), lambda: codec.decode(payload, other))
    for kwargs in ({"numel": 101}, {"bucket_size": 32}, {"norm": "linf"}):
        same_error(lambda: fused.decode(payload, table, **kwargs),
                   lambda: codec.decode(payload, table, **kwargs))
    same_error(lambda: fused.decode(payload.astype(np.int16), table),
               lambda: codec.decode(payload.astype(np.int16), table))


def test_decode_average_names_the_bad_rank(payload_and_table):
    payload, table = payload_and_table
    for name, bad in corruptions(payload, table):
        if bad.size != payload.size:
            continue
        rows = np.stack([payload, payload, bad])
        err = same_error(lambda: fused.decode_average(rows, table),
                         lambda: codec.decode_average(rows, table))
        if name == "marker":  # header checks (check_rows) name the rank
            assert err.rank == 2
    for bad_rows in (np.zeros((0, 10), np.uint8), payload.astype(np.int16)[None],
                     payload[None, None], []):
        same_error(lambda: fused.decode_average(bad_rows, table),
                   lambda: codec.decode_average(bad_rows, table))


def test_codes_outside_the_table_are_refused():
    table = LevelTable(ternary())  # 3 levels in 2 bits: code 3 does not exist
    payload = oracle_encode(gradient(10), table, 4, "l2", StreamKey(0))
    bad = payload.copy()
    bad[-1] = 0xFF
    err = same_error(lambda: fused.decode(bad, table), lambda: codec.decode(bad, table))
    assert "code 3" in str(err)
    rows = np.stack([payload, bad])
    same_error(lambda: fused.decode_average(rows, table),
               lambda: codec.decode_average(rows, table))


# ------------------------------------------------------------------------------ out= and views


def test_out_buffers_are_reused():
    table, key = LevelTable(uniform(3)), StreamKey(2)
    n, bucket = 1003, 100
    buf = np.full(codec.payload_size(n, 3, bucket), 0xAB, np.uint8)
    for seed in range(3):
        x = gradient(n, seed)
        got = fused.encode(x, table, bucket_size=bucket, key=key, out=buf)
        assert got is buf
        assert buf.tobytes() == oracle_encode(x, table, bucket, "l2", key).tobytes()
    unaligned = np.zeros(buf.size + 1, np.uint8)[1:]  # norms section not 4-aligned
    fused.encode(x, table, bucket_size=bucket, key=key, out=unaligned)
    assert unaligned.tobytes() == buf.tobytes()
    res = np.full(n, np.nan, np.float32)
    rows = np.stack([buf, buf, buf])
    assert fused.decode_average(rows, table, out=res) is res
    assert res.tobytes() == codec.decode_average(rows, table).tobytes()
    assert fused.decode(buf, table, out=res) is res
    assert res.tobytes() == codec.decode(buf, table).tobytes()
    with pytest.raises(ValueError, match="out must be"):
        fused.encode(x, table, bucket_size=bucket, key=key, out=buf[:-1])
    with pytest.raises(ValueError, match="out must be"):
        fused.decode(buf, table, out=np.empty(n, np.float64))


def test_a_failed_encode_leaves_no_valid_header_in_out():
    table = LevelTable(uniform(2))
    x = gradient(64)
    buf = fused.encode(x, table, bucket_size=8, key=StreamKey(0))
    x[40] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        fused.encode(x, table, bucket_size=8, key=StreamKey(0), out=buf)
    with pytest.raises(PayloadError, match="magic"):
        codec.decode(buf, table)


def test_torch_tensors_are_used_without_copies():
    torch = pytest.importorskip("torch")
    table, key = LevelTable(uniform(3)), StreamKey(4)
    grad = torch.from_numpy(gradient(3001))
    payload = torch.empty(codec.payload_size(3001, 3, 256), dtype=torch.uint8)
    fused.encode(grad.numpy(), table, bucket_size=256, key=key, out=payload.numpy())
    assert payload.numpy().tobytes() == oracle_encode(grad.numpy(), table, 256, "l2",
                                                      key).tobytes()
    avg = torch.empty(3001)
    rows = torch.stack([payload, payload])
    fused.decode_average(rows.numpy(), table, out=avg.numpy())
    assert avg.numpy().tobytes() == codec.decode_average(rows.numpy(), table).tobytes()


def test_read_only_inputs():
    table = LevelTable(uniform(2))
    x = gradient(500)
    x.setflags(write=False)
    payload = check_encode(x, table, 64)
    want = codec.decode(payload, table).tobytes()
    assert fused.decode(payload.tobytes(), table).tobytes() == want


# ---------------------------------------------------------------------------------- property


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 2500), bucket_size=st.integers(1, 1500), bits=st.integers(1, 8),
       norm=st.sampled_from(["l2", "linf"]), seed=st.integers(0, 2**32 - 1),
       sparse=st.booleans(), ranks=st.integers(1, 4))
def test_random_payloads_match_the_oracle(n, bucket_size, bits, norm, seed, sparse, ranks):
    rng = np.random.default_rng(seed)
    table = LevelTable(uniform(bits))
    rows = []
    for rank in range(ranks):
        x = (rng.standard_normal(n) * 10.0 ** rng.integers(-20, 20)).astype(np.float32)
        if sparse:
            x[rng.random(n) < 0.6] = 0.0
        rows.append(check_encode(x, table, bucket_size, norm,
                                 StreamKey(seed, rank=rank, step=seed % 97)))
    rows = np.stack(rows)
    assert (fused.decode_average(rows, table).tobytes()
            == codec.decode_average(rows, table).tobytes())


# ------------------------------------------------------------------------------------ checksum
@pytest.mark.parametrize("n, bucket_size", [(0, 4), (1, 2**32 - 1), (100, 16), (4097, 1024)])
def test_checksummed_payloads_are_the_oracles(n, bucket_size):
    table, key = LevelTable(uniform(3), 5), StreamKey(3, rank=2, step=9)
    x = gradient(n)
    want = codec.encode(x, table, bucket_size=bucket_size, key=key, checksum=True)
    got = fused.encode(x, table, bucket_size=bucket_size, key=key, checksum=True)
    assert got.tobytes() == want.tobytes() and codec.parse_header(got).checksummed
    out = np.empty(want.size, np.uint8)
    assert fused.encode(x, table, bucket_size=bucket_size, key=key, checksum=True,
                        out=out) is out and out.tobytes() == want.tobytes()
    rows = np.stack([want, codec.encode(x, table, bucket_size=bucket_size, key=key)])
    assert fused.decode_average(rows, table).tobytes() == codec.decode_average(
        rows, table).tobytes()
    with pytest.raises(TypeError, match="checksum must be True or False"):
        fused.encode(x, table, bucket_size=bucket_size, key=key, checksum=None)


def test_a_checksum_mismatch_raises_the_oracles_error():
    table, key = LevelTable(uniform(3), 5), StreamKey(3)
    sealed = fused.encode(gradient(100), table, bucket_size=16, key=key, checksum=True)
    for byte in (29, 40, 97):  # the CRC field, a norm, the last code byte
        bad = sealed.copy()
        bad[byte] ^= 0x10
        err = same_error(lambda: fused.decode(bad, table), lambda: codec.decode(bad, table))
        assert "checksum mismatch" in str(err)
        rows = np.stack([sealed, bad])
        err = same_error(lambda: fused.decode_average(rows, table),
                         lambda: codec.decode_average(rows, table))
        assert err.rank == 1


def test_the_traced_graph_entry_points_check_like_the_oracle():
    """encode_with / decode_average_with (TensorFlow's fused path): the same checksum and the
    oracle's errors for bad checksums, norms and codes."""
    table, key = LevelTable([-1.0, -0.3, 0.2, 0.6, 1.0], 1), StreamKey(1, rank=1)
    x = gradient(100)
    levels = codec.float32_levels(table)
    header = np.frombuffer(codec.make_header(100, table, 16, "l2"), np.uint8)
    sealed = fused.encode_with(x, levels, header, bits=3, bucket_size=16, norm="l2",
                               key=key.scalars(), checksum=True)
    assert sealed.tobytes() == codec.encode(x, table, bucket_size=16, key=key,
                                            checksum=True).tobytes()
    plain = fused.encode_with(x, levels, header, bits=3, bucket_size=16, norm="l2",
                              key=key.scalars())
    bad_norm = plain.copy()
    bad_norm[36:40] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    bad_code = plain.copy()
    bad_code[-1] = 0xFF
    bad_crc = sealed.copy()
    bad_crc[50] ^= 1
    for bad in (bad_norm, bad_code, bad_crc):
        rows = np.stack([plain, sealed, bad])
        err = same_error(lambda: fused.decode_average_with(rows, levels, numel=100, bits=3,
                                                           bucket_size=16),
                         lambda: codec.decode_average(rows, table))
        assert err.rank == 2
    rows = np.stack([plain, sealed])
    assert fused.decode_average_with(rows, levels, numel=100, bits=3, bucket_size=16).tobytes() \
        == codec.decode_average(rows, table).tobytes()
