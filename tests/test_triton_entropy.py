"""The Triton rANS kernels (``horovod_aq.torch.triton_entropy``) against the numpy oracle
(``horovod_aq.codec.rans``), under Triton's interpreter on CPU (tests/conftest.py sets
TRITON_INTERPRET=1): the same states, counts and words, the same symbols back, and a corrupted
stream refused (docs/format.md §12)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from horovod_aq.codec import entropy_format as ef
from horovod_aq.codec import rans

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
te = pytest.importorskip("horovod_aq.torch.triton_entropy")

#: Under the interpreter (no CUDA) the kernels run on CPU tensors; compiled, on the GPU
#: (benchmarks/gpu_check.sh).
DEVICE = torch.device("cuda" if os.environ.get("TRITON_INTERPRET", "") in ("", "0")
                      and torch.cuda.is_available() else "cpu")


def _symbols(bits, n, seed):
    rng = np.random.default_rng(seed)
    p = np.exp(-np.abs(np.arange(1 << bits) - (1 << bits) / 2.0))
    codes = rng.choice(1 << bits, size=n, p=p / p.sum()).astype(np.uint8)
    table = ef.code_table(codes, 1 << bits)
    f, c = ef.symbol_model(table, bits)
    return ef.group_symbols(codes, bits), f, c


#: (bins, n): no code; a partial program; one program exactly and one code more; bins that are
#: not a power of two; 8-bit codes.
@pytest.mark.parametrize("bins, n", [(8, 0), (4, 1), (8, 4096), (8, 4097), (3, 10000),
                                     (13, 5000), (256, 9000)])
def test_histogram_is_bincount(bins, n):
    codes = np.random.default_rng(n + bins).integers(0, bins, n).astype(np.uint8)
    if n:
        codes[-1] = 0    # a code 0 in the last, partial block beside the lanes past n
    got = te.histogram(torch.from_numpy(codes).to(DEVICE), bins)
    assert got.dtype == torch.int64 and got.device == DEVICE
    np.testing.assert_array_equal(got.cpu().numpy(), np.bincount(codes, minlength=bins))


@pytest.mark.parametrize("counts", [[0], [5, 0, 3], [0, 0, 7, 1, 0], [9, 9]])
def test_compact_gathers_what_the_boolean_mask_selects(counts):
    # the last counts[b] words of each scratch row, in row order, without reading counts
    width = 9
    scratch = np.random.default_rng(len(counts)).integers(
        0, 1 << 16, (len(counts), width)).astype(np.uint16)
    keep = np.arange(width)[None, :] >= width - np.asarray(counts)[:, None]
    got = te.compact(torch.from_numpy(scratch).to(DEVICE),
                     torch.tensor(counts, dtype=torch.int64, device=DEVICE), sum(counts))
    assert got.dtype == torch.uint16
    np.testing.assert_array_equal(got.cpu().numpy(), scratch[keep])


#: (bits, n): one symbol; a partial block at 3, 2 and 8 bits. Two blocks (n = BLOCK_SYMBOLS + 40
#: at 8 bits) pass too but take 1.5 min in the interpreter; benchmarks/gpu_check.py runs them.
@pytest.mark.parametrize("bits, n", [(3, 1), (3, 2000), (2, 4000), (8, 700)])
def test_same_words_states_and_counts_as_the_oracle(bits, n):
    symbols, f, c = _symbols(bits, n, bits * n)
    want = rans.encode_symbols(symbols, f, c)
    words, states, counts = te.encode_symbols(torch.from_numpy(symbols).to(DEVICE), f, c)
    assert np.array_equal(states.cpu().numpy(), want[0])
    assert np.array_equal(counts.cpu().numpy(), want[1])
    assert np.array_equal(words.cpu().numpy(), want[2])
    back = te.decode_symbols(states, counts, words, f, c, symbols.size)
    assert back is not None and np.array_equal(back.cpu().numpy(), symbols)


def test_a_corrupted_stream_is_refused():
    symbols, f, c = _symbols(3, 3000, 1)
    words, states, counts = te.encode_symbols(torch.from_numpy(symbols).to(DEVICE), f, c)
    for bad_words, bad_states, bad_counts in (
            (words[:-1], states, counts - 1),            # a word short: state off 2^16
            (words, states, counts + 1),                 # a forged count: reads past its end
            ((words.to(torch.int32) ^ 1).to(torch.uint16), states, counts),  # flipped bits
            (words, (states.to(torch.int64) + 1).to(torch.uint32), counts)):  # a bad state
        assert te.decode_symbols(bad_states, bad_counts, bad_words, f, c,
                                 symbols.size) is None


# ------------------------------------------------ the torch encoder of entropy-coded payloads
#: (bits, n, bucket size): entropy-coded at 3 and 2 bits; a tensor so small that the fixed-width
#: payload is smaller (the fallback); one whose last symbol is padded (n not a multiple of g).
@pytest.mark.parametrize("bits, n, bucket, checksum", [(3, 3001, 64, False), (2, 4000, 128, True),
                                                       (3, 12, 64, False)])
def test_the_triton_entropy_encoder_writes_the_oracles_payload(bits, n, bucket, checksum):
    import horovod_aq
    from horovod_aq import codec
    from horovod_aq.codec.stream import StreamKey
    from horovod_aq.torch import entropy

    table = horovod_aq.QSGD(bits=bits, bucket_size=bucket).table
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    key = StreamKey(3, 1, 5, 2, 0)
    want = codec.encode_entropy(x, table, bucket_size=bucket, key=key, checksum=checksum)
    got = entropy.encode_entropy_triton(torch.from_numpy(x).to(DEVICE), table,
                                        bucket_size=bucket, key=key, checksum=checksum)
    assert got.device.type == DEVICE.type and np.array_equal(got.cpu().numpy(), want)
    assert bool(want[codec.FLAGS_OFFSET] & codec.FLAG_ENTROPY) == (n > 100)
    # the default path (the compiled CPU kernel for a CPU tensor) writes the same bytes
    cpu = entropy.encode_entropy(torch.from_numpy(x), table, bucket_size=bucket, key=key,
                                 checksum=checksum)
    assert np.array_equal(cpu.numpy(), want)
    np.testing.assert_array_equal(entropy.decode(got, table).cpu().numpy(),
                                  codec.decode(want, table))


# ------------------------------------------------ the torch decoder of entropy-coded payloads
def _wire_rows(n=3001, bucket=64, bits=3):
    """Three rows of the entropy-coded wire: two entropy-coded, one fixed-width; the table."""
    import horovod_aq
    from horovod_aq import codec
    from horovod_aq.codec.stream import StreamKey

    table = horovod_aq.QSGD(bits=bits, bucket_size=bucket).table
    xs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(3)]
    rows = [codec.encode_entropy(x, table, bucket_size=bucket, key=StreamKey(3, r, 0, 0, 0))
            for r, x in enumerate(xs[:2])]
    rows.append(codec.encode(xs[2], table, bucket_size=bucket, key=StreamKey(3, 2, 0, 0, 0)))
    assert [bool(r[codec.FLAGS_OFFSET] & codec.FLAG_ENTROPY) for r in rows] == [1, 1, 0]
    return rows, table


def test_device_values_are_the_oracles_and_average_like_it(monkeypatch):
    """``entropy.device_values``: every row's values bitwise the oracle's, with a True flag;
    ``entropy.decode_average`` / ``decode`` with Triton take it and give ``codec``'s bits."""
    from horovod_aq import codec
    from horovod_aq.torch import entropy, kernels

    rows, table = _wire_rows()
    tensors = [torch.from_numpy(r).to(DEVICE) for r in rows]
    values, ok = entropy.device_values(tensors, table, numel=3001, bucket_size=64, norm="l2")
    assert bool(ok)
    for got, row in zip(values, rows):
        np.testing.assert_array_equal(got.cpu().numpy().view(np.uint32),
                                      codec.decode(row, table).view(np.uint32))
    # the rows' headers and models read from a host copy of the rows (Horovod's delimiting
    # copy) instead of the device: the same values; a code table spoilt in that copy alone is
    # refused, so the copy is what was read
    kw = {"numel": 3001, "bucket_size": 64, "norm": "l2"}
    again, ok = entropy.device_values(tensors, table, **kw,
                                      host=[torch.from_numpy(r) for r in rows])
    assert bool(ok) and all(torch.equal(a, b) for a, b in zip(again, values))
    spoilt = [torch.from_numpy(r) for r in _spoil(rows, table, "table")]
    assert entropy.device_values(tensors, table, **kw, host=spoilt) is None
    monkeypatch.setattr(kernels, "implementation_for", lambda device: "triton")
    np.testing.assert_array_equal(
        entropy.decode_average(tensors, table, **kw).cpu().numpy().view(np.uint32),
        codec.decode_average(rows, table).view(np.uint32))
    np.testing.assert_array_equal(entropy.decode(tensors[0], table, **kw).cpu().numpy(),
                                  codec.decode(rows[0], table))


def _spoil(rows, table, how):
    """rows with row 1 (entropy-coded) spoilt as ``how`` says; the rows' decoder settings."""
    import struct

    from horovod_aq import codec
    from horovod_aq.codec import entropy_format as ef

    row = rows[1].copy()
    start = codec.HEADER_SIZE + 4 * codec.num_buckets(3001, 64)
    states_at = start + ef.CODER_HEADER_SIZE
    table_at = states_at + 4 * ef.LANES * ef.num_blocks(3001, 3) + 2 * ef.num_blocks(3001, 3)
    if how == "length":
        row[start:start + 8] = np.frombuffer(struct.pack("<Q", row.size + 2), np.uint8)
    elif how == "table":
        row[table_at] ^= 1
    elif how == "state":
        row[states_at:states_at + 4] = np.frombuffer(np.uint32(5).tobytes(), np.uint8)
    elif how == "norm":
        row[codec.HEADER_SIZE:codec.HEADER_SIZE + 4] = np.frombuffer(
            np.float32(-1).tobytes(), np.uint8)
    elif how == "word":
        row[-1] ^= 0x40
    elif how == "marker":
        row = codec.nonfinite_payload(3001, table, 64, "l2", 7)
    return [rows[0], row, rows[2]]


@pytest.mark.parametrize("how", ["length", "table", "state", "norm", "word", "marker"])
def test_device_values_refuse_what_the_oracle_refuses(monkeypatch, how):
    """A spoilt row: None (a header, coder header, length or code table a decoder refuses,
    found on the host) or a False flag (a state, norm or stream found on the device); then
    ``entropy.decode_average`` raises the oracle's own error (or, for a word that still
    decodes, gives the oracle's values)."""
    from horovod_aq import codec
    from horovod_aq.torch import entropy, kernels

    rows, table = _wire_rows()
    rows = _spoil(rows, table, how)
    tensors = [torch.from_numpy(r).to(DEVICE) for r in rows]
    kw = {"numel": 3001, "bucket_size": 64, "norm": "l2"}
    got = entropy.device_values(tensors, table, **kw)
    if how in ("length", "table", "marker"):
        assert got is None
    elif how in ("state", "norm"):
        assert got is not None and not bool(got[1])
    monkeypatch.setattr(kernels, "implementation_for", lambda device: "triton")
    try:
        want = codec.decode_average(rows, table)
    except (codec.PayloadError, codec.NonFiniteGradientError) as err:
        with pytest.raises(type(err)) as raised:
            entropy.decode_average(tensors, table, **kw)
        assert str(raised.value) == str(err)
    else:
        assert how == "word" and bool(got[1])
        np.testing.assert_array_equal(entropy.decode_average(tensors, table, **kw).cpu().numpy(),
                                      want)
