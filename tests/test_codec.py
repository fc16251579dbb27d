"""The numpy reference codec (horovod_aq.codec): format, sizes, packing, statistics, bad input."""

from __future__ import annotations

import math
import struct
import subprocess
import sys

import numpy as np
import pytest

from horovod_aq import codec
from horovod_aq.codec import HEADER_SIZE, PayloadError
from horovod_aq.levels.table import LevelTable


def uniform_table(bits: int, version: int = 0) -> LevelTable:
    return LevelTable(np.linspace(-1.0, 1.0, 2**bits), version)


def exp_table(bits: int) -> LevelTable:
    k = 2 ** (bits - 1)
    mags = 0.5 ** np.arange(k - 1, -1, -1)
    return LevelTable(np.concatenate([-mags[::-1], mags]), 0)


TERNARY = LevelTable([-1.0, 0.0, 1.0], 0)


def gradient(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * rng.lognormal(0, 1, n)).astype(np.float32)


def bits_of(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)


# ------------------------------------------------------------------------------ header, sizes


def test_header_layout_matches_the_documented_offsets():
    table = exp_table(3).with_version(7)
    raw = codec.make_header(1_000_003, table, 512, "linf")
    assert len(raw) == HEADER_SIZE == 32
    assert raw[0:2] == b"AQ"
    assert raw[2] == codec.FORMAT_VERSION == 2
    assert raw[3] == 3 and raw[4] == codec.NORM_CODES["linf"] == 1 and raw[5] == 0
    assert struct.unpack_from("<H", raw, 6)[0] == 8
    assert struct.unpack_from("<I", raw, 8)[0] == 7
    assert struct.unpack_from("<I", raw, 12)[0] == table.hash
    assert struct.unpack_from("<I", raw, 16)[0] == 512
    assert struct.unpack_from("<Q", raw, 20)[0] == 1_000_003
    assert struct.unpack_from("<I", raw, 28)[0] == 0
    header = codec.parse_header(np.frombuffer(raw, np.uint8))
    assert header == codec.Header(2, 3, "linf", 0, 8, 7, table.hash, 512, 1_000_003)
    assert header.num_buckets == 1954 and header.codes_offset == 32 + 4 * 1954


def test_format_constants_agree_with_the_header_struct():
    from horovod_aq.codec import format as fmt

    assert fmt.HEADER_SIZE == struct.calcsize(fmt.HEADER_FORMAT) == 32
    codes = ["2s", "B", "B", "B", "B", "H", "I", "I", "I", "Q", "I"]
    assert fmt.HEADER_FORMAT == "<" + "".join(codes) and len(fmt.HEADER_FIELDS) == len(codes)
    for i, (field, code) in enumerate(zip(fmt.HEADER_FIELDS.values(), codes)):
        assert field.start == struct.calcsize("<" + "".join(codes[:i]))
        assert field.stop - field.start == struct.calcsize("<" + code)
    assert fmt.HEADER_FIELDS["magic"].stop - fmt.HEADER_FIELDS["magic"].start == len(fmt.MAGIC)
    assert fmt.FLAGS_OFFSET == fmt.HEADER_FIELDS["flags"].start == 5
    # TABLE_ID_SLICE: exactly the level-table version and hash (the bytes a refit changes).
    assert fmt.TABLE_ID_SLICE == slice(8, 16)
    assert (fmt.HEADER_FIELDS["level-table version"].start, fmt.HEADER_FIELDS[
        "level-table hash"].stop) == (fmt.TABLE_ID_SLICE.start, fmt.TABLE_ID_SLICE.stop)
    # MARKER_INDEX_OFFSET: the last u32, a marker's first bad element.
    assert fmt.MARKER_INDEX_OFFSET == fmt.HEADER_SIZE - struct.calcsize("<I") == 28
    table = exp_table(3).with_version(7)
    raw = codec.make_header(10, table, 4, "l2")
    assert struct.unpack("<II", raw[fmt.TABLE_ID_SLICE]) == (7, table.hash)
    marker = codec.nonfinite_payload(10, table, 4, "l2", 6)
    assert marker[fmt.FLAGS_OFFSET] == codec.FLAG_NONFINITE
    assert struct.unpack_from("<I", marker, fmt.MARKER_INDEX_OFFSET)[0] == 6
    assert codec.NORM_BYTES == struct.calcsize("<f")


def test_the_package_reexports_its_modules():
    from horovod_aq.codec import bits, reference
    from horovod_aq.codec import format as fmt

    for module in (bits, fmt, reference):
        for name in module.__all__:
            assert name in codec.__all__ and getattr(codec, name) is getattr(module, name)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n, bucket", [(0, 4), (1, 1), (1, 512), (7, 3), (64, 64), (1000, 64),
                                       (1001, 7), (4097, 4096)])
def test_payload_size_is_the_documented_formula(n, bucket, bits):
    expected = 32 + 4 * math.ceil(n / bucket) + math.ceil(n * bits / 8)
    assert codec.payload_size(n, bits, bucket) == expected
    table = LevelTable(np.linspace(-1, 1, 2**bits))
    payload = codec.encode(gradient(n), table, bucket_size=bucket, seed=0)
    assert payload.dtype == np.uint8 and payload.shape == (expected,)


def test_payload_sections_hold_norms_then_codes():
    x, table, bucket = gradient(1001), uniform_table(3), 64
    u = np.random.default_rng(1).random(x.size, dtype=np.float32)
    payload = codec.encode(x, table, bucket_size=bucket, uniforms=u)
    codes, norms = codec.quantize_codes(x, table, bucket_size=bucket, uniforms=u)
    nb = math.ceil(x.size / bucket)
    assert np.array_equal(payload[32 : 32 + 4 * nb].view("<f4"), norms)
    assert np.array_equal(payload[32 + 4 * nb :], codec.pack_bits(codes, 3))


# ------------------------------------------------------------------------------------ packing


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 1003])
def test_packing_round_trips_and_is_lsb_first(bits, count):
    codes = np.random.default_rng(bits * 100 + count).integers(0, 2**bits, count).astype(np.uint8)
    packed = codec.pack_bits(codes, bits)
    assert packed.size == math.ceil(count * bits / 8)
    # Independent reference: expand each code to its bits, LSB first, and pack little-endian.
    stream = ((codes[:, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1)
    assert np.array_equal(packed, np.packbits(stream, bitorder="little"))
    assert np.array_equal(codec.unpack_bits(packed, bits, count), codes)


def test_pack_bits_rejects_codes_that_do_not_fit():
    with pytest.raises(ValueError, match="does not fit in 2 bits"):
        codec.pack_bits(np.array([0, 4], np.uint8), 2)
    with pytest.raises(ValueError, match="bits must be in 1..8"):
        codec.pack_bits(np.array([0], np.uint8), 9)
    with pytest.raises(ValueError, match="bits must be in 1..8"):
        codec.unpack_bits(np.zeros(4, np.uint8), 0, 1)


# -------------------------------------------------------------------------------------- norms


def pairwise_reference(values: np.ndarray) -> float:
    """Recursive statement of the canonical order: halves of the zero-padded power of two."""
    sq = [float(v) * float(v) for v in values]
    width = 1 << max(0, len(sq) - 1).bit_length()
    sq += [0.0] * (width - len(sq))
    while len(sq) > 1:
        half = len(sq) // 2
        sq = [sq[k] + sq[k + half] for k in range(half)]
    return sq[0]


@pytest.mark.parametrize("n, bucket", [(1, 8), (5, 8), (100, 7), (1000, 64), (333, 100)])
def test_l2_norms_follow_the_canonical_pairwise_order(n, bucket):
    x = gradient(n, seed=n)
    norms = codec.bucket_norms(x, bucket, "l2")
    assert norms.dtype == np.float32 and norms.size == math.ceil(n / bucket)
    for k, got in enumerate(norms):
        v = x[k * bucket : (k + 1) * bucket]
        assert got == np.float32(math.sqrt(pairwise_reference(v)))
        exact = math.sqrt(math.fsum(float(t) ** 2 for t in v))
        assert abs(float(got) - exact) <= 2**-23 * exact  # within float32 rounding


def test_pairwise_sum_does_not_depend_on_the_padded_width():
    rows = np.random.default_rng(3).random((5, 37)) ** 7
    sums = [codec.pairwise_sum_rows(np.pad(rows, ((0, 0), (0, w - 37)))) for w in (64, 128, 1024)]
    assert all(np.array_equal(sums[0].view(np.uint64), s.view(np.uint64)) for s in sums)


def test_linf_norms_and_tail_bucket_has_its_own_norm():
    x = np.array([1, -4, 2, 0.5, 0.25, -0.125, 0.0], np.float32)
    assert np.array_equal(codec.bucket_norms(x, 3, "linf"), [4, 0.5, 0])
    assert codec.bucket_norms(x, 3, "l2")[2] == 0
    # The tail [-0.125, 0] decodes on its own scale, not zeros, not full precision.
    y = np.array([3.0, 4.0, 0.0, 0.0, -0.125, 0.0625], np.float32)
    table = uniform_table(2)
    q = codec.quantize(y, table, bucket_size=4, norm="linf", seed=0)
    assert set(np.abs(q[4:])) <= {np.float32(0.125) / 3, np.float32(0.125)}


# --------------------------------------------------------------------------------- rounding


def test_values_on_levels_decode_exactly_whatever_the_uniforms():
    table = exp_table(3)
    x = (np.resize(table.levels, 40) * 4.0).astype(np.float32)  # linf norm 4: r on the levels
    for u in (np.zeros(40, np.float32), np.full(40, np.nextafter(np.float32(1), 0))):
        q = codec.quantize(x, table, bucket_size=8, norm="linf", uniforms=u)
        assert np.array_equal(q, x)


def test_uniforms_at_the_ends_round_up_or_down():
    x, table, bucket = gradient(256), uniform_table(2), 32
    ones = np.full(x.size, np.nextafter(np.float32(1), 0), np.float32)
    norms = np.repeat(codec.bucket_norms(x, bucket), bucket)
    down = codec.quantize(x, table, bucket_size=bucket, uniforms=ones)
    up = codec.quantize(x, table, bucket_size=bucket, uniforms=np.zeros(x.size, np.float32))
    assert np.all(down <= x + 1e-6 * norms) and np.all(up >= x - 1e-6 * norms)
    assert np.all(up - down <= norms * (2 / 3) * (1 + 1e-6))  # neighbouring levels


def test_zero_buckets_are_encoded_exactly():
    x = gradient(100)
    x[20:40] = 0.0
    x[-3:] = 0.0  # the whole partial tail (bucket 4 covers 80..99 with B = 20; tail is 97..99)
    table = uniform_table(2)
    payload = codec.encode(x, table, bucket_size=20, seed=5)
    norms = payload[32 : 32 + 4 * 5].view("<f4")
    assert norms[1] == 0.0
    y = codec.decode(payload, table)
    assert np.all(y[20:40] == 0.0)
    assert np.all(codec.decode(codec.encode(np.zeros(13, np.float32), table, bucket_size=4,
                                            seed=1), table) == 0.0)


def test_quantize_equals_decode_of_encode_bitwise():
    for bits, n, bucket in [(1, 1, 8), (2, 777, 64), (3, 4096, 512), (8, 1000, 33)]:
        x, table = gradient(n, seed=bits), uniform_table(bits)
        for norm in ("l2", "linf"):
            u = np.random.default_rng(n).random(n, dtype=np.float32)
            q = codec.quantize(x, table, bucket_size=bucket, norm=norm, uniforms=u)
            d = codec.decode(codec.encode(x, table, bucket_size=bucket, norm=norm, uniforms=u),
                             table)
            assert np.array_equal(bits_of(q), bits_of(d))


def test_seed_determinism_and_generator_seed():
    x, table = gradient(300), uniform_table(3)
    a = codec.encode(x, table, bucket_size=64, seed=11)
    assert np.array_equal(a, codec.encode(x, table, bucket_size=64, seed=11))
    assert not np.array_equal(a, codec.encode(x, table, bucket_size=64, seed=12))
    u = np.random.default_rng(11).random(x.size, dtype=np.float32)
    assert np.array_equal(a, codec.encode(x, table, bucket_size=64, uniforms=u))
    assert np.array_equal(a, codec.encode(x, table, bucket_size=64,
                                          seed=np.random.default_rng(11)))


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_other_input_dtypes_are_cast_to_float32(dtype):
    x = gradient(500).astype(dtype)
    table = uniform_table(4)
    a = codec.encode(x, table, bucket_size=128, seed=1)
    assert np.array_equal(a, codec.encode(x.astype(np.float32), table, bucket_size=128, seed=1))
    assert codec.decode(a, table, dtype=dtype).dtype == dtype


def test_bfloat16_input_via_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = gradient(300).astype(ml_dtypes.bfloat16)
    table = uniform_table(2)
    assert np.array_equal(codec.encode(x, table, bucket_size=64, seed=2),
                          codec.encode(x.astype(np.float32), table, bucket_size=64, seed=2))


def test_empty_gradient_is_a_header_only_payload():
    table = uniform_table(2)
    payload = codec.encode(np.zeros((0, 3), np.float32), table, bucket_size=16, seed=0)
    assert payload.size == 32 and codec.parse_header(payload).numel == 0
    assert codec.decode(payload, table).shape == (0,)


def test_levels_as_plain_array_mean_version_zero():
    levels = np.linspace(-1, 1, 4)
    payload = codec.encode(gradient(10), levels, bucket_size=4, seed=0)
    assert codec.parse_header(payload).table_version == 0
    assert codec.decode(payload, levels).shape == (10,)


# ------------------------------------------------------------------------- decode_average


def test_decode_average_sums_sequentially_in_rank_order():
    table, n, bucket = uniform_table(3), 999, 100
    payloads = np.stack([codec.encode(gradient(n, seed=p), table, bucket_size=bucket, seed=p)
                         for p in range(5)])
    acc = codec.decode(payloads[0], table) / np.float32(5)
    for p in range(1, 5):   # each row divided by P before it is added (no overflow)
        acc = acc + codec.decode(payloads[p], table) / np.float32(5)
    expected = acc
    got = codec.decode_average(payloads, table)
    assert np.array_equal(bits_of(got), bits_of(expected))
    assert np.array_equal(codec.decode_average(payloads[:1], table), codec.decode(payloads[0],
                                                                                  table))
    assert codec.decode_average(list(payloads), table, dtype=np.float64).dtype == np.float64


def test_decode_average_of_huge_rows_stays_finite():
    """Rows near the float32 maximum: a float32 sum would overflow before the division."""
    table = uniform_table(3)
    payloads = np.stack([codec.encode(np.full(8, 3e38, np.float32), table, bucket_size=1, seed=p)
                         for p in range(2)])
    got = codec.decode_average(payloads, table)
    assert np.isfinite(got).all()
    assert np.array_equal(got, codec.decode(payloads[0], table))


def test_decode_average_names_the_bad_rank():
    table = uniform_table(3)
    good = codec.encode(gradient(50), table, bucket_size=16, seed=0)
    other = codec.encode(gradient(50), table.with_version(1), bucket_size=16, seed=0)
    with pytest.raises(PayloadError, match="rank 2: .*level-table version 1"):
        codec.decode_average(np.stack([good, good, other]), table)


# ------------------------------------------------------------------- unbiasedness, variance

DRAWS = 4000
SIGMAS = 5.0  # per-coordinate bound; with fixed seeds the test is deterministic


@pytest.mark.parametrize("table, norm, n, bucket", [
    (uniform_table(2), "l2", 90, 32),     # partial tail bucket, zero-free table
    (exp_table(3), "linf", 50, 50),
    (TERNARY, "linf", 37, 64),            # numel < bucket
])
def test_unbiased_and_variance_matches_the_per_bucket_formula(table, norm, n, bucket):
    x = gradient(n, seed=42)
    x[:3] = 0.0
    draws = np.stack([codec.quantize(x, table, bucket_size=bucket, norm=norm, seed=s)
                      for s in range(DRAWS)]).astype(np.float64)

    # Exact per-coordinate moments of the rounding, from the float32 quantities the encoder uses.
    norms32 = np.repeat(codec.bucket_norms(x, bucket, norm), bucket)[:n]
    norms = norms32.astype(np.float64)
    levels = table.levels.astype(np.float32)
    r = np.clip(x / np.where(norms32 == 0, np.float32(1), norms32), -1, 1)
    j = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, levels.size - 2)
    lo, hi, r64 = levels[j].astype(np.float64), levels[j + 1].astype(np.float64), r.astype(float)
    var = norms**2 * (hi - r64) * (r64 - lo)

    # Unbiased: |mean − x| ≤ 5 standard errors per coordinate (+ float32 rounding slack).
    slack = 1e-6 * norms + 1e-12
    assert np.all(np.abs(draws.mean(0) - x) <= SIGMAS * np.sqrt(var / DRAWS) + slack)

    # Per-bucket squared error: E‖Q(v) − v‖² = n²·Σ (ℓ_{j+1} − r)(r − ℓ_j) = rounding_variance,
    # and the empirical mean over DRAWS is within 5 standard errors of it (exact Var of the sum).
    expected = codec.rounding_variance(x, table, bucket_size=bucket, norm=norm)
    buckets = np.arange(n) // bucket
    assert np.allclose(expected, np.bincount(buckets, var), rtol=1e-9, atol=1e-30)
    sq_err = (draws - x) ** 2
    empirical = np.stack([np.bincount(buckets, row) for row in sq_err]).mean(0)
    xi = np.where(hi > lo, (r64 - lo) / (hi - lo), 0)
    e_down, e_up = (norms * (r64 - lo)) ** 2, (norms * (hi - r64)) ** 2
    var_of_sum = np.bincount(buckets, xi * (1 - xi) * (e_up - e_down) ** 2)
    assert np.all(np.abs(empirical - expected) <= SIGMAS * np.sqrt(var_of_sum / DRAWS) + 1e-9)
    # §3 upper bound: per coordinate at most n²·(ℓ_{j+1} − ℓ_j)²/4.
    assert np.all(expected <= np.bincount(buckets, norms**2 * (hi - lo) ** 2 / 4) * (1 + 1e-9))


# ------------------------------------------------------------------------------- bucket stats


def test_bucket_moments_skip_tail_and_zero_buckets():
    x = gradient(1030)
    x[100:200] = 0
    norms, means, stds = codec.bucket_moments(x, 100)
    rows = [x[k * 100 : (k + 1) * 100].astype(np.float64) for k in range(10) if k != 1]
    assert norms.size == 9
    for k, v in enumerate(rows):
        u = v / np.linalg.norm(v)
        assert np.isclose(norms[k], np.linalg.norm(v), rtol=1e-12)
        assert np.isclose(means[k], u.mean(), rtol=1e-9, atol=1e-15)
        assert np.isclose(stds[k], u.std(ddof=1), rtol=1e-9)
    with pytest.raises(ValueError, match="bucket_size must be an integer >= 2"):
        codec.bucket_moments(x, 1)


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad, count, first", [
    (np.array([1, np.nan, 2, np.inf], np.float32), 2, 1),
    (np.array([0, 0, 0, -np.inf], np.float32), 1, 3),
    (np.array([1.0, 1e39], np.float64), 1, 1),  # finite in fp64, ±Inf in float32
])
def test_non_finite_gradients_are_rejected_and_nothing_is_drawn(bad, count, first):
    rng = np.random.default_rng(0)
    state = rng.bit_generator.state
    before = bad.copy()
    with pytest.raises(ValueError, match=rf"{count} of {bad.size} .*first at flat index {first}"):
        codec.encode(bad, uniform_table(2), bucket_size=2, seed=rng)
    assert rng.bit_generator.state == state
    assert np.array_equal(bad, before, equal_nan=True)


def test_norm_overflow_is_rejected():
    with pytest.raises(ValueError, match="bucket 1 has a norm that overflows float32"):
        codec.encode(np.array([1, 1, 3e38, 3e38], np.float32), uniform_table(2), bucket_size=2)


@pytest.mark.parametrize("levels, match", [
    (np.linspace(-1, 1, 257), "2..256 levels"),
    ([-1.0], "2..256 levels"),
    ([-1.0, 0.5, 0.0, 1.0], "strictly increasing"),
    ([-1.0, 0.0, 0.9], "end at \\+1"),
    ([-0.5, 0.0, 1.0], "start at -1"),
])
def test_invalid_tables_are_rejected(levels, match):
    with pytest.raises(ValueError, match=match):
        codec.encode(gradient(8), levels, bucket_size=4, seed=0)


@pytest.mark.parametrize("kwargs, match", [
    ({"bucket_size": 0}, "bucket_size must be in 1"),
    ({"bucket_size": 2.5}, "bucket_size must be an integer"),
    ({"bucket_size": 4, "norm": "l1"}, "unknown norm 'l1'"),
    ({"bucket_size": 4, "uniforms": np.zeros(3, np.float32)}, r"shape \(8,\)"),
    ({"bucket_size": 4, "uniforms": np.ones(8, np.float32)}, r"\[0, 1\)"),
])
def test_invalid_settings_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        codec.encode(gradient(8), uniform_table(2), **kwargs)


def test_integer_gradients_are_rejected():
    with pytest.raises(ValueError, match="floating-point"):
        codec.encode(np.arange(8), uniform_table(2), bucket_size=4)


@pytest.fixture
def payload_and_table():
    table = uniform_table(3, version=3)
    return codec.encode(gradient(100), table, bucket_size=16, seed=0), table


def test_truncated_and_oversized_payloads(payload_and_table):
    payload, table = payload_and_table
    assert payload.size == 32 + 4 * 7 + 38
    with pytest.raises(PayloadError, match=r"truncated: 97 bytes.*requires 98"):
        codec.decode(payload[:97], table)
    with pytest.raises(PayloadError, match="shorter than the 32-byte header"):
        codec.decode(payload[:10], table)
    with pytest.raises(PayloadError, match="too long: 99 bytes"):
        codec.decode(np.concatenate([payload, [0]]).astype(np.uint8), table)


def test_wrong_magic_version_and_reserved_fields(payload_and_table):
    payload, table = payload_and_table
    for offset, value, match in [(0, ord("X"), "magic"), (2, 3, "format version 3"),
                                 (3, 9, "bits 9"), (4, 7, "norm code 7"), (5, 8, "reserved"),
                                 (5, 3, "reserved"), (30, 1, "reserved")]:
        bad = payload.copy()
        bad[offset] = value
        with pytest.raises(PayloadError, match=match):
            codec.decode(bad, table)


def test_a_nonfinite_marker_is_refused_with_its_element(payload_and_table):
    payload, table = payload_and_table
    header = codec.parse_header(payload)
    marker = codec.nonfinite_payload(header.numel, table, header.bucket_size, header.norm, 42)
    assert marker.size == payload.size
    with pytest.raises(codec.NonFiniteGradientError, match="first at element 42") as info:
        codec.decode(marker, table)
    assert info.value.first == 42
    with pytest.raises(codec.NonFiniteGradientError, match="rank 1: ") as info:
        codec.decode_average(np.stack([payload, marker]), table)
    assert info.value.rank == 1
    assert codec.nonfinite_rows(np.stack([payload, marker])[:, codec.FLAGS_OFFSET]) == [1]


def test_another_table_version_or_values_is_refused(payload_and_table):
    payload, table = payload_and_table
    with pytest.raises(PayloadError, match=r"level-table version 3 \(hash [0-9a-f]{8}\) but this "
                                           r"rank holds version 4.*ranks disagree"):
        codec.decode(payload, table.with_version(4))
    other = LevelTable(np.concatenate([[-1], np.linspace(-0.9, 0.9, 6), [1]]), 3)
    with pytest.raises(PayloadError, match="ranks disagree on the level table"):
        codec.decode(payload, other)


def test_caller_expectations_are_checked(payload_and_table):
    payload, table = payload_and_table
    codec.decode(payload, table, numel=100, bucket_size=16, norm="l2")
    for kwargs, match in [({"numel": 101}, "numel 100 but the caller expects 101"),
                          ({"bucket_size": 32}, "bucket_size 16"),
                          ({"norm": "linf"}, "norm 'l2'")]:
        with pytest.raises(PayloadError, match=match):
            codec.decode(payload, table, **kwargs)


def test_corrupted_codes_and_norms_are_refused():
    payload = codec.encode(gradient(10), TERNARY, bucket_size=4, seed=0)
    bad = payload.copy()
    bad[-1] = 0xFF  # code 3 does not exist in a 3-level table
    with pytest.raises(PayloadError, match="code 3 but the table has 3 levels"):
        codec.decode(bad, TERNARY)
    bad = payload.copy()
    bad[32:36] = np.frombuffer(np.float32(-1).tobytes(), np.uint8)
    with pytest.raises(PayloadError, match="negative or non-finite bucket norm"):
        codec.decode(bad, TERNARY)
    with pytest.raises(PayloadError, match="1-D uint8"):
        codec.decode(payload.astype(np.int16), TERNARY)


def test_codec_imports_no_framework():
    code = ("import sys, horovod_aq.codec; "
            "assert not {'torch', 'tensorflow'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_subnormal_levels_are_flushed_and_subnormal_gaps_rejected():
    mags = 0.5 ** np.arange(127, -1, -1)  # 8-bit exponential table: ±2^-127 is subnormal
    table = LevelTable(np.concatenate([-mags[::-1], mags]))
    levels = codec.float32_levels(table)
    assert np.count_nonzero(levels == 0) == 2 and levels[129] == np.float32(2.0**-126)
    x = np.array([0.0, 0.0, -0.0, 1.0, -0.5], np.float32)
    q = codec.quantize(x, table, bucket_size=5, seed=0)
    assert np.array_equal(q[:3].view(np.uint32), np.zeros(3, np.uint32))  # exact +0.0
    close = LevelTable([-1.0, 2.0**-126, 2.0**-126 + 2.0**-149, 1.0])
    with pytest.raises(ValueError, match="closer than 1.2e-38"):
        codec.encode(np.ones(4, np.float32), close, bucket_size=4)


# ------------------------------------------------------------------------------ checksum (§11)
def test_the_worked_example_of_the_format_document():
    table = LevelTable([-1.0, -1 / 3, 1 / 3, 1.0], 0)
    x = np.float32([0.5, -0.25, 1.0, 0.0, 0.1])
    u = np.full(5, 0.5, np.float32)
    plain = codec.encode(x, table, bucket_size=4, uniforms=u)
    assert plain.tobytes().hex() == (
        "41510202000004000000000056 06b0c3".replace(" ", "")
        + "0400000005000000" + "0" * 16 + "76a4923fcdcccc3d7603")
    sealed = codec.encode(x, table, bucket_size=4, uniforms=u, checksum=True)
    assert sealed[5] == codec.FLAG_CHECKSUM and sealed[28:32].tobytes().hex() == "a3daf880"
    assert np.array_equal(np.delete(sealed, [5, 28, 29, 30, 31]),
                          np.delete(plain, [5, 28, 29, 30, 31]))


def test_checksum_definition():
    import zlib

    payload = codec.encode(gradient(100), uniform_table(3), bucket_size=16, seed=0)
    raw = payload.tobytes()
    assert codec.payload_checksum(payload) == zlib.crc32(raw[:28] + raw[32:])
    sealed = codec.seal_checksum(payload.copy())
    header = codec.parse_header(sealed)
    assert header.checksummed and not header.nonfinite and header.first_nonfinite is None
    assert header.checksum == struct.unpack("<I", sealed[28:32].tobytes())[0]
    assert header.checksum == codec.payload_checksum(sealed)  # the CRC field is not covered
    assert np.array_equal(codec.seal_checksum(sealed.copy()), sealed)  # idempotent
    assert not codec.parse_header(payload).checksummed and codec.parse_header(payload).checksum \
        is None
    marker = codec.nonfinite_payload(100, uniform_table(3), 16, "l2", 4)
    with pytest.raises(PayloadError, match="carries no data"):
        codec.seal_checksum(marker)
    with pytest.raises(ValueError, match="carries no checksum"):
        codec.make_header(100, uniform_table(3), 16, "l2", first_nonfinite=3, checksum=True)
    assert codec.make_header(100, uniform_table(3), 16, "l2", checksum=True)[5] == 2
    with pytest.raises(TypeError, match="checksum must be True or False, got 'yes'"):
        codec.encode(gradient(4), uniform_table(3), bucket_size=2, seed=0, checksum="yes")


@pytest.mark.parametrize("bits, n, bucket", [(3, 100, 16), (1, 9, 4), (8, 5, 1 << 20)])
def test_every_single_bit_flip_of_a_checksummed_payload_is_refused(bits, n, bucket):
    table = uniform_table(bits, version=2)
    sealed = codec.encode(gradient(n, seed=bits), table, bucket_size=bucket, seed=1,
                          checksum=True)
    plain = codec.encode(gradient(n, seed=bits), table, bucket_size=bucket, seed=1)
    expected = codec.decode(plain, table)
    assert np.array_equal(bits_of(codec.decode(sealed, table)), bits_of(expected))
    silent = 0
    for byte in range(sealed.size):
        for bit in range(8):
            for payload, checked in ((sealed, True), (plain, False)):
                bad = payload.copy()
                bad[byte] ^= np.uint8(1 << bit)
                try:
                    got = codec.decode(bad, table)
                except PayloadError:
                    continue
                except codec.NonFiniteGradientError:  # flags 0 → 1 makes a marker
                    assert not checked
                    continue
                assert not checked, (byte, bit)  # with the checksum: always refused
                silent += not np.array_equal(bits_of(got), bits_of(expected))
    assert silent > 0  # without it, some flips of norms and codes decode to other values


def test_checksums_are_verified_before_the_data_and_name_the_rank():
    table = TERNARY
    good = codec.encode(gradient(10), table, bucket_size=4, seed=0, checksum=True)
    bad_norm = good.copy()
    bad_norm[32:36] = np.frombuffer(np.float32(-1).tobytes(), np.uint8)  # crc no longer fits
    with pytest.raises(PayloadError, match="^payload checksum mismatch"):
        codec.decode(bad_norm, table)
    plain_bad = codec.encode(gradient(10), table, bucket_size=4, seed=0)
    plain_bad[32:36] = bad_norm[32:36]
    rows = np.stack([good, plain_bad, bad_norm])  # rank 1: bad data, rank 2: bad checksum
    with pytest.raises(PayloadError, match="^rank 2: payload checksum mismatch") as info:
        codec.decode_average(rows, table)
    assert info.value.rank == 2
    with pytest.raises(PayloadError, match=r"^rank 1: payload holds a negative or non-finite "
                                           r"bucket norm: -1.0 in bucket 0 of 3 \(corrupted"):
        codec.decode_average(rows[:2], table)
    with pytest.raises(PayloadError, match="^rank 1: payload header has reserved fields set"):
        codec.decode_average(np.stack([good, _with_flags(good, 3)]), table)


def _with_flags(payload, flags):
    bad = payload.copy()
    bad[5] = flags
    return bad


def test_a_header_may_state_a_bucket_size_beyond_numel():
    table = uniform_table(2)
    for n, bucket in [(1, 2**32 - 1), (7, 2**31), (0, 2**32 - 1)]:
        payload = codec.encode(gradient(n), table, bucket_size=bucket, seed=0)
        header = codec.parse_header(payload)
        assert header.bucket_size == bucket and header.span == max(1, n)
        assert header.num_buckets == (1 if n else 0)
        assert codec.decode(payload, table).shape == (n,)
        q = codec.quantize(gradient(n), table, bucket_size=bucket, seed=0)
        assert np.array_equal(bits_of(q), bits_of(codec.decode(payload, table)))
