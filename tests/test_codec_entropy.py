"""The entropy-coded body (docs/format.md §12): the oracle's layout, sizes and model, the fused
CPU kernel byte for byte against it, variable-length decode_average, and what decoders refuse."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from horovod_aq import codec
from horovod_aq.codec import entropy_format as ef
from horovod_aq.codec import fused, fused_entropy
from horovod_aq.codec.stream import StreamKey
from horovod_aq.levels import LevelTable, uniform

KEY = StreamKey(seed=7, rank=1, step=3)
#: an ALQ-like 3-bit table: the outer levels are rarely used, the inner ones often
SKEWED = LevelTable(np.array([-1.0, -0.4, -0.12, -0.03, 0.03, 0.12, 0.4, 1.0]), 2)


def _gradient(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * rng.lognormal(size=n)).astype(np.float32)


def _table(bits):
    return SKEWED if bits == 3 else LevelTable(uniform(bits), 0)


#: (bits, n, bucket): tiny (fixed fallback), partial blocks, a block boundary at 2 and 8 bits
CASES = [(3, 1, 16), (1, 5000, 64), (2, 9000, 1024), (3, 70001, 1000), (4, 3000, 2**32 - 1),
         (5, 4000, 512), (8, 2500, 100), (2, 4 * ef.BLOCK_SYMBOLS + 3, 4096),
         (8, ef.BLOCK_SYMBOLS + 1, 4096)]


@pytest.mark.parametrize("bits, n, bucket", CASES)
def test_fused_bytes_equal_the_oracle_and_values_equal_the_fixed_wire(bits, n, bucket):
    table, x = _table(bits), _gradient(n, bits)
    want = codec.encode_entropy(x, table, bucket_size=bucket, key=KEY)
    got = fused_entropy.encode_entropy(x, table, bucket_size=bucket, key=KEY)
    assert np.array_equal(want, got)
    fixed = codec.encode(x, table, bucket_size=bucket, key=KEY)
    assert want.size <= fixed.size and codec.payload_length(want) == want.size
    if not want[codec.FLAGS_OFFSET] & codec.FLAG_ENTROPY:
        assert np.array_equal(want, fixed)   # not smaller: the fixed-width payload itself
    plain = codec.decode(fixed, table)
    for decode in (codec.decode, fused.decode, fused_entropy.decode):
        assert np.array_equal(decode(want, table).view(np.uint32), plain.view(np.uint32))
    rows = [want, fixed, want]
    avg = codec.decode_average(np.stack([fixed] * 3), table)
    for decode_average in (codec.decode_average, fused.decode_average,
                           fused_entropy.decode_average):
        assert np.array_equal(decode_average(rows, table).view(np.uint32), avg.view(np.uint32))


def test_layout_and_size_accounting():
    x = _gradient(70001)
    payload = codec.encode_entropy(x, SKEWED, bucket_size=1000, key=KEY, checksum=True)
    header = codec.parse_header(payload)
    assert header.entropy and header.checksummed
    assert payload[5] == codec.FLAG_ENTROPY | codec.FLAG_CHECKSUM
    start = 32 + 4 * 71
    size, prec, group, lanes, steps, reserved = struct.unpack_from(
        ef.CODER_HEADER_FORMAT, payload[start:start + 16].tobytes())
    assert (size, prec, group, lanes, steps, reserved) == (payload.size, 14, 2, 5, 10, 0)
    body = ef.parse_body(payload, header)
    assert body.nsym == 35001 and body.states.shape == (2, 32)
    assert payload.size == codec.entropy_payload_size(70001, 3, 1000, 8, body.words.size)
    assert codec.payload_checksum(payload) == header.checksum
    codes, _ = codec.quantize_codes(x, SKEWED, bucket_size=1000,
                                    uniforms=codec.stream_uniforms(70001, KEY))
    entropy = codec.empirical_entropy(codes, 8)
    norms = 32 * 71 / 70001
    # the wire target of issue 25: ≤ 1.1 × (entropy + per-bucket overhead)
    assert 8 * payload.size / 70001 <= 1.1 * (entropy + norms)


def test_normalized_frequencies_sum_exactly_and_keep_every_present_symbol():
    rng = np.random.default_rng(1)
    for _ in range(200):
        w = rng.random(256) ** rng.integers(1, 40)
        w[rng.random(256) < 0.5] = 0
        w[rng.integers(256)] = 1.0
        f = ef.normalize_frequencies(w, 14)
        assert f.sum() == 1 << 14 and np.array_equal(f > 0, w > 0)
    assert list(ef.normalize_frequencies([0, 5, 0], 15)) == [0, 1 << 15, 0]


def test_every_symbol_of_one_code_costs_nothing():
    x = np.full(50000, 0.25, np.float32)    # r = 1 everywhere: one code, f = M, no words
    table = LevelTable(np.array([-1.0, -0.5, 0.25, 1.0]), 0)
    payload = codec.encode_entropy(x, table, bucket_size=50000, norm="linf", key=KEY)
    body = ef.parse_body(payload, codec.parse_header(payload))
    assert body.words.size == 0
    assert np.array_equal(codec.decode(payload, table), x)


def _entropy_payload():
    return codec.encode_entropy(_gradient(3000, 5), SKEWED, bucket_size=256, key=KEY)


def _at(payload, name):
    """Byte offset of a section of the 3000-element test payload."""
    start = 32 + 4 * 12
    return {"coder": start, "states": start + 16, "counts": start + 16 + 128,
            "table": start + 16 + 130, "words": start + 16 + 130 + 16}[name]


def _put(payload, at, fmt, value):
    bad = payload.copy()
    bad[at:at + struct.calcsize(fmt)] = np.frombuffer(struct.pack(fmt, value), np.uint8)
    return bad


def _recount(payload, delta):
    """A consistent forgery: block 0 holds ``delta`` words more (zeros) or fewer, and the
    coder header's size says so."""
    at = _at(payload, "counts")
    count = int(payload[at]) | int(payload[at + 1]) << 8
    body = payload[:-2] if delta < 0 else np.concatenate([payload, np.zeros(2, np.uint8)])
    body = _put(body, at, "<H", count + delta)
    return _put(body, _at(payload, "coder"), "<Q", body.size)


#: (name, corrupt(payload) -> bad payload, message fragment), refused by every decoder alike
ENTROPY_CORRUPTIONS = [
    ("truncated", lambda p: p[:-2], "length mismatch"),
    ("too-long", lambda p: np.concatenate([p, np.zeros(2, np.uint8)]), "length mismatch"),
    ("forged-length", lambda p: _put(p, _at(p, "coder"), "<Q", p.size + 2), "length mismatch"),
    ("forged-count", lambda p: _put(p, _at(p, "counts"), "<H",
                                    int(p[_at(p, "counts")]) + 1), "length mismatch"),
    ("stream-short", lambda p: _recount(p, -1), "past its end"),
    ("stream-long", lambda p: _recount(p, +1), "unread"),
    ("coder-precision", lambda p: _put(p, _at(p, "coder") + 8, "<B", 12), "coder header"),
    ("coder-reserved", lambda p: _put(p, _at(p, "coder") + 12, "<I", 1), "coder header"),
    ("table-sum", lambda p: _put(p, _at(p, "table"), "<H", 1), "code table sums"),
    ("state-below-range", lambda p: _put(p, _at(p, "states"), "<I", 5), "below 2^16"),
    ("state-flip", lambda p: _put(p, _at(p, "states") + 4, "<I", (1 << 31) + 12345),
     "entropy-coded payload"),   # the stream then runs past its end or ends off 2^16
    ("word-flip", lambda p: _put(p, _at(p, "words") + 10, "<H", 0xBEEF),
     "entropy-coded payload"),
    ("header-only", lambda p: p[:40], "truncated"),
]


@pytest.mark.parametrize("name, corrupt, fragment", ENTROPY_CORRUPTIONS,
                         ids=[c[0] for c in ENTROPY_CORRUPTIONS])
def test_every_entropy_decoder_refuses_alike(name, corrupt, fragment):
    good = _entropy_payload()
    assert good[5] == codec.FLAG_ENTROPY
    bad = corrupt(good)
    errors = []
    for decode in (codec.decode, fused.decode, fused_entropy.decode):
        with pytest.raises(codec.PayloadError) as err:
            decode(bad, SKEWED)
        errors.append(str(err.value))
    for decode_average in (codec.decode_average, fused.decode_average,
                           fused_entropy.decode_average):
        with pytest.raises(codec.PayloadError) as err:
            decode_average([good, bad], SKEWED)
        assert err.value.rank == 1
        errors.append(str(err.value).removeprefix("rank 1: "))
    assert fragment in errors[0] and len(set(errors)) == 1, errors


def test_fixed_width_decoders_refuse_an_entropy_payload_by_name():
    good = _entropy_payload()
    with pytest.raises(codec.PayloadError, match="entropy-coded body"):
        codec.check_size(codec.parse_header(good), good.size)
    with pytest.raises(codec.PayloadError, match="reserved fields set"):
        codec.parse_header(_put(good, 5, "<B", 8))
