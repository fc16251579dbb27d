"""PyTorch kernels (horovod_aq.torch.kernels) against the numpy oracle; torch-only behaviour."""

from __future__ import annotations

import numpy as np
import pytest

from horovod_aq import codec
from horovod_aq.codec import PayloadError
from horovod_aq.levels.table import LevelTable

torch = pytest.importorskip("torch")
tk = pytest.importorskip("horovod_aq.torch.kernels")
level_cells = pytest.importorskip("horovod_aq.torch.level_cells")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def uniform_table(bits: int, version: int = 0) -> LevelTable:
    return LevelTable(np.linspace(-1.0, 1.0, 2**bits), version)


def exp_table(bits: int, p: float = 0.5) -> LevelTable:
    mags = p ** np.arange(2 ** (bits - 1) - 1, -1, -1)
    return LevelTable(np.concatenate([-mags[::-1], mags]))


def random_table(bits: int, seed: int) -> LevelTable:
    inner = np.sort(np.random.default_rng(seed).uniform(-1, 1, 2**bits - 2))
    return LevelTable(np.concatenate([[-1.0], inner, [1.0]]))


TERNARY = LevelTable([-1.0, 0.0, 1.0])
CLOSE = LevelTable([-1.0, -0.5, 0.3, 0.30001, 1.0])  # two levels in one cell: searchsorted path


def gradient(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * rng.lognormal(0, 1, n)).astype(np.float32)


def f32_bits(t) -> np.ndarray:
    arr = t.cpu().numpy() if isinstance(t, torch.Tensor) else t
    return np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)


# ------------------------------------------------------------------------- interval finder


def adversarial_values(levels: np.ndarray) -> np.ndarray:
    """Levels, their float32 neighbours, ±0, subnormals, cell edges and random values in [−1, 1]."""
    lv = levels.astype(np.float32)
    near = np.concatenate([lv, np.nextafter(lv, np.float32(2)), np.nextafter(lv, np.float32(-2))])
    cell_edges = (np.arange(0, 130050, 97, dtype=np.int64) << level_cells.CELL_SHIFT)
    edges = np.concatenate([cell_edges, cell_edges - 1, cell_edges + 1])
    edges = edges[(edges >= 0) & (edges <= 0x3F800000)].astype(np.int32).view(np.float32)
    special = np.array([0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, -1.1754942e-38, 1.0, -1.0],
                       np.float32)
    rnd = np.random.default_rng(0).uniform(-1, 1, 20000).astype(np.float32)
    tiny = (rnd * np.float32(2.0**-120)).astype(np.float32)
    out = np.concatenate([near, edges, -edges, special, rnd, tiny])
    return out[(out >= -1) & (out <= 1)]


@pytest.mark.parametrize("table", [uniform_table(b) for b in (1, 2, 3, 8)]
                         + [exp_table(b) for b in (2, 5, 8)]
                         + [random_table(6, 1), TERNARY, exp_table(4, 0.7)],
                         ids=lambda t: f"N{t.num_levels}-{t.hash:08x}")
def test_cell_finder_equals_searchsorted(table):
    prepared = level_cells.DeviceTable(table, torch.device("cpu"))
    assert prepared.cells is not None
    r = torch.from_numpy(adversarial_values(table.levels))
    got = prepared.locate(r.clone())
    expected = np.clip(np.searchsorted(codec.float32_levels(table), r.numpy(), side="right")
                       - 1, 0, table.num_levels - 2)
    assert np.array_equal(got.numpy(), expected)


def test_close_levels_fall_back_to_searchsorted():
    prepared = level_cells.DeviceTable(CLOSE, torch.device("cpu"))
    assert prepared.cells is None
    x = gradient(3000)
    u = np.random.default_rng(1).random(x.size, dtype=np.float32)
    assert np.array_equal(
        tk.encode(torch.from_numpy(x), CLOSE, bucket_size=100,
                  uniforms=torch.from_numpy(u)).numpy(),
        codec.encode(x, CLOSE, bucket_size=100, uniforms=u))


# ------------------------------------------------------------------------------ equality


@pytest.mark.parametrize("chunk", [8, 64, 1 << 18])
@pytest.mark.parametrize("bits, n, bucket, norm", [
    (1, 1000, 7, "l2"), (3, 4099, 64, "linf"), (4, 100, 1000, "l2"), (8, 2049, 512, "l2"),
])
def test_encode_matches_codec_across_chunk_sizes(monkeypatch, chunk, bits, n, bucket, norm):
    monkeypatch.setattr(tk, "CHUNK_ELEMENTS", chunk)
    x, table = gradient(n, seed=bits), uniform_table(bits, version=9)
    u = np.random.default_rng(n).random(n, dtype=np.float32)
    payload = tk.encode(torch.from_numpy(x), table, bucket_size=bucket, norm=norm,
                        uniforms=torch.from_numpy(u))
    expected = codec.encode(x, table, bucket_size=bucket, norm=norm, uniforms=u)
    assert payload.dtype == torch.uint8 and np.array_equal(payload.numpy(), expected)
    decoded = tk.decode(payload, table)
    assert np.array_equal(f32_bits(decoded), f32_bits(codec.decode(expected, table)))
    quantized = tk.quantize(torch.from_numpy(x), table, bucket_size=bucket, norm=norm,
                            uniforms=torch.from_numpy(u))
    assert np.array_equal(f32_bits(quantized), f32_bits(decoded))


def test_generator_stream_is_torch_rand_of_n(monkeypatch):
    """On CPU, chunked draws equal one torch.rand(n): seed → bytes is independent of chunking."""
    monkeypatch.setattr(tk, "CHUNK_ELEMENTS", 64)
    x, table = torch.from_numpy(gradient(1000)), uniform_table(3)
    a = tk.encode(x, table, bucket_size=32, generator=torch.Generator().manual_seed(3))
    u = torch.rand(1000, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, tk.encode(x, table, bucket_size=32, uniforms=u))
    b = tk.encode(x, table, bucket_size=32, generator=torch.Generator().manual_seed(4))
    assert not torch.equal(a, b)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_and_unpack_match_codec(bits):
    codes = np.random.default_rng(bits).integers(0, 2**bits, 1003).astype(np.uint8)
    packed = tk.pack_bits(torch.from_numpy(codes), bits)
    assert np.array_equal(packed.numpy(), codec.pack_bits(codes, bits))
    assert np.array_equal(tk.unpack_bits(packed, bits, 1003).numpy(), codes)


@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_bucket_norms_match_codec(norm):
    x = gradient(5001)
    for bucket in (1, 3, 64, 100, 5001, 8192):
        assert np.array_equal(tk.bucket_norms(torch.from_numpy(x), bucket, norm).numpy(),
                              codec.bucket_norms(x, bucket, norm))


def test_non_contiguous_and_other_dtypes():
    base = torch.from_numpy(gradient(600)).view(20, 30)
    table = uniform_table(2)
    u = torch.rand(600, generator=torch.Generator().manual_seed(0))
    x = base.t()  # non-contiguous
    got = tk.encode(x, table, bucket_size=64, uniforms=u)
    assert np.array_equal(got.numpy(), codec.encode(x.numpy(), table, bucket_size=64,
                                                    uniforms=u.numpy()))
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        xd = base.to(dtype)
        got = tk.encode(xd, table, bucket_size=64, uniforms=u)
        ref = codec.encode(xd.to(torch.float32).numpy() if dtype == torch.bfloat16
                           else xd.numpy(), table, bucket_size=64, uniforms=u.numpy())
        assert np.array_equal(got.numpy(), ref), dtype
        assert tk.decode(got, table, dtype=dtype).dtype == dtype


def test_decode_average_matches_codec_and_handles_unaligned_rows():
    table = uniform_table(3)
    n, bucket, world = 3, 2, 5  # size 32 + 8 + 2 = 42: rows start at unaligned offsets
    payloads = torch.stack([tk.encode(torch.from_numpy(gradient(n, seed=p)), table,
                                      bucket_size=bucket,
                                      generator=torch.Generator().manual_seed(p))
                            for p in range(world)])
    assert payloads.shape == (world, 42)
    got = tk.decode_average(payloads, table)
    assert np.array_equal(f32_bits(got), f32_bits(codec.decode_average(payloads.numpy(), table)))
    assert tk.decode_average(payloads, table, dtype=torch.float16).dtype == torch.float16


def test_empty_tensor():
    table = uniform_table(2)
    payload = tk.encode(torch.zeros(0, 4), table, bucket_size=16)
    assert payload.numel() == 32
    assert tk.decode(payload, table).shape == (0,)
    assert tk.decode_average(torch.stack([payload, payload]), table).shape == (0,)


def test_bucket_moments_matches_codec():
    x = gradient(10_250)
    x[512:1024] = 0
    got = tk.bucket_moments(torch.from_numpy(x), 512)
    ref = codec.bucket_moments(x, 512)
    assert got[0].dtype == np.float64 and got[0].size == 19
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-15)


def test_corrupted_code_is_refused_by_every_torch_implementation(monkeypatch):
    payload = tk.encode(torch.from_numpy(gradient(10)), TERNARY, bucket_size=4,
                        generator=torch.Generator().manual_seed(0))
    payload[-1] = 0xFF  # code 3 of a 3-level table
    with pytest.raises(PayloadError, match="code 3 but the table has 3 levels"):
        tk.decode(payload, TERNARY)    # CPU tensors: the fused kernel refuses, as the oracle
    monkeypatch.setattr(tk, "IMPLEMENTATION", "ops")   # the torch ops: one sync at the end
    with pytest.raises(PayloadError, match="code 3 but the table has 3 levels"):
        tk.decode(payload, TERNARY)
    with pytest.raises(PayloadError, match="^rank 1: payload holds code 3") as info:
        good = torch.from_numpy(codec.encode(gradient(10), TERNARY, bucket_size=4, seed=1))
        tk.decode_average(torch.stack([good, payload]), TERNARY)
    assert info.value.rank == 1


def test_unbiased_with_the_generator():
    table, draws = uniform_table(2), 3000
    x = torch.from_numpy(gradient(48, seed=7))
    tiled = x.repeat(draws)  # bucket 16 divides 48: every copy has the same buckets
    q = tk.quantize(tiled, table, bucket_size=16, generator=torch.Generator().manual_seed(1))
    mean = q.view(draws, 48).double().mean(0)
    norms = np.repeat(codec.bucket_norms(x.numpy(), 16), 16).astype(np.float64)
    bound = 5 * norms * (2 / 3) / 2 / np.sqrt(draws)  # 5 σ with σ ≤ n·Δ/2 per coordinate
    assert np.all(np.abs(mean.numpy() - x.numpy()) <= bound)


# ---------------------------------------------------------------------------------- errors


def test_bad_input_raises_and_touches_nothing():
    table = uniform_table(2)
    x = torch.from_numpy(gradient(100))
    x[[3, 50]] = float("nan")
    before = x.clone()
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    with pytest.raises(ValueError, match=r"2 of 100 .*first at flat index 3"):
        tk.encode(x, table, bucket_size=16, generator=gen)
    assert torch.equal(gen.get_state(), state)
    assert torch.equal(torch.isnan(x), torch.isnan(before))
    with pytest.raises(ValueError, match="bucket 1 has a norm that overflows float32"):
        tk.encode(torch.tensor([1.0, 1.0, 3e38, 3e38]), table, bucket_size=2, generator=gen)
    assert torch.equal(gen.get_state(), state)
    with pytest.raises(ValueError, match="floating-point"):
        tk.encode(torch.arange(8), table, bucket_size=4)
    with pytest.raises(ValueError, match="bucket_size must be in 1"):
        tk.encode(torch.ones(8), table, bucket_size=0)
    with pytest.raises(ValueError, match="unknown norm"):
        tk.encode(torch.ones(8), table, bucket_size=4, norm="l1")
    with pytest.raises(ValueError, match=r"shape \(8,\)"):
        tk.encode(torch.ones(8), table, bucket_size=4, uniforms=torch.zeros(7))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        tk.encode(torch.ones(8), table, bucket_size=4, uniforms=torch.ones(8))
    with pytest.raises(ValueError, match="strictly increasing"):
        tk.encode(torch.ones(8), [-1.0, 0.5, 0.0, 1.0], bucket_size=4)


def test_bad_payloads_are_refused():
    table = uniform_table(3, version=3)
    payload = tk.encode(torch.from_numpy(gradient(100)), table, bucket_size=16,
                        generator=torch.Generator().manual_seed(0))
    with pytest.raises(PayloadError, match="truncated"):
        tk.decode(payload[:-1], table)
    with pytest.raises(PayloadError, match="shorter than the 32-byte header"):
        tk.decode(payload[:5], table)
    bad = payload.clone()
    bad[0] = ord("X")
    with pytest.raises(PayloadError, match="magic"):
        tk.decode(bad, table)
    bad = payload.clone()
    bad[2] = 3
    with pytest.raises(PayloadError, match="format version 3"):
        tk.decode(bad, table)
    with pytest.raises(PayloadError, match="level-table version 3 .* holds version 4"):
        tk.decode(payload, table.with_version(4))
    with pytest.raises(PayloadError, match="numel 100 but the caller expects 99"):
        tk.decode(payload, table, numel=99)
    with pytest.raises(PayloadError, match="1-D uint8"):
        tk.decode(payload.to(torch.int32), table)
    other = tk.encode(torch.from_numpy(gradient(100)), table.with_version(4), bucket_size=16)
    with pytest.raises(PayloadError, match="rank 1: .*level-table version 4"):
        tk.decode_average(torch.stack([payload, other]), table)


# -------------------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu_bytes():
    table, n = exp_table(4), 100_003
    x = torch.from_numpy(gradient(n))
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    cpu = tk.encode(x, table, bucket_size=512, uniforms=u)
    gpu = tk.encode(x.cuda(), table, bucket_size=512, uniforms=u.cuda())
    assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu)
    stacked = torch.stack([cpu, cpu])
    assert torch.equal(tk.decode_average(stacked.cuda(), table).cpu(),
                       tk.decode_average(stacked, table))
    gen = torch.Generator(device="cuda").manual_seed(0)
    assert tk.encode(x.cuda(), table, bucket_size=512, generator=gen).is_cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_first_nonfinite(dtype):
    x = torch.zeros(1000, dtype=dtype)
    assert tk.first_nonfinite(x) is None
    assert tk.first_nonfinite(torch.zeros(0, dtype=dtype)) is None
    for value in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[[417, 900]] = value
        assert tk.first_nonfinite(y.view(10, 100)) == 417
    # finite values whose float32 sum overflows are not reported (the exact check decides)
    huge = torch.full((8,), 3e38, dtype=torch.float32)
    assert not torch.isfinite(huge.sum()) and tk.first_nonfinite(huge) is None


# ------------------------------------------------------------------------------------ checksum
@pytest.mark.parametrize("device", DEVICES)
def test_the_ops_write_and_verify_the_checksum(monkeypatch, device):
    monkeypatch.setattr(tk, "IMPLEMENTATION", "ops")
    table, x = uniform_table(3, version=2), gradient(300)
    u = np.random.default_rng(1).random(300, dtype=np.float32)
    want = codec.encode(x, table, bucket_size=64, uniforms=u, checksum=True)
    got = tk.encode(torch.from_numpy(x).to(device), table, bucket_size=64,
                    uniforms=torch.from_numpy(u), checksum=True)
    assert got.device.type == device and np.array_equal(got.cpu().numpy(), want)
    plain = codec.encode(x, table, bucket_size=64, uniforms=u)
    rows = torch.from_numpy(np.stack([want, plain])).to(device)
    assert np.array_equal(tk.decode_average(rows, table).cpu().numpy(),
                          codec.decode_average(rows.cpu().numpy(), table))
    bad = want.copy()
    bad[40] ^= 4
    with pytest.raises(PayloadError, match="^payload checksum mismatch"):
        tk.decode(torch.from_numpy(bad).to(device), table)
    with pytest.raises(PayloadError, match="^rank 1: payload checksum mismatch") as info:
        tk.decode_average(torch.from_numpy(np.stack([plain, bad])).to(device), table)
    assert info.value.rank == 1


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), -float("inf")])
def test_the_ops_refuse_bad_norms_like_the_oracle(monkeypatch, value):
    monkeypatch.setattr(tk, "IMPLEMENTATION", "ops")
    payload = codec.encode(gradient(100), uniform_table(3), bucket_size=16, seed=0)
    payload[44:48] = np.frombuffer(np.float32(value).tobytes(), np.uint8)  # bucket 3
    with pytest.raises(PayloadError) as want:
        codec.decode(payload, uniform_table(3))
    with pytest.raises(PayloadError) as got:
        tk.decode(torch.from_numpy(payload), uniform_table(3))
    assert str(got.value) == str(want.value) and "in bucket 3 of 7" in str(got.value)


# ------------------------------------------------------------------- flagged decode (wire)


def _plain_rows(table: LevelTable, n: int = 40, B: int = 8, world: int = 3) -> torch.Tensor:
    return torch.stack([torch.from_numpy(codec.encode(gradient(n, seed=r), table, bucket_size=B,
                                                      seed=r)) for r in range(world)])


def _spoiled(table: LevelTable) -> dict[str, torch.Tensor]:
    """Rows [P, size] that the flagged decode must not accept, one spoilt row (rank 1) each."""
    n, B = 40, 8

    def with_row(raw: np.ndarray) -> torch.Tensor:
        rows = _plain_rows(table, n, B).clone()
        rows[1] = torch.from_numpy(raw)
        return rows

    good = codec.encode(gradient(n, 1), table, bucket_size=B, seed=1)
    marker = good.copy()
    marker[:codec.HEADER_SIZE] = np.frombuffer(codec.make_header(
        n, table, B, "l2", first_nonfinite=5), np.uint8)
    negative_norm = good.copy()
    negative_norm[codec.HEADER_SIZE:codec.HEADER_SIZE + 4] = np.frombuffer(
        np.float32(-1.0).tobytes(), np.uint8)
    other_table = codec.encode(gradient(n, 1), LevelTable(table.levels, table.version + 1),
                               bucket_size=B, seed=1)
    return {"marker": with_row(marker), "joined": with_row(np.zeros_like(good)),
            "checksum": with_row(codec.encode(gradient(n, 1), table, bucket_size=B, seed=1,
                                              checksum=True)),
            "other table": with_row(other_table), "negative norm": with_row(negative_norm)}


@pytest.mark.parametrize("impl", ["auto", "ops"])
def test_flagged_decode_is_the_checked_decode_of_plain_rows(monkeypatch, impl):
    """On plain payloads: decode_average (average) or the rows' decodes (concatenated), bit
    for bit, with the flag True."""
    monkeypatch.setattr(tk, "IMPLEMENTATION", impl)
    table = uniform_table(3)
    rows = _plain_rows(table)
    values, ok = tk.decode_flagged(rows, table, numel=40, bucket_size=8, norm="l2")
    assert bool(ok)
    np.testing.assert_array_equal(f32_bits(values), f32_bits(codec.decode_average(
        rows.numpy(), table)))
    values, ok = tk.decode_flagged(rows, table, numel=40, bucket_size=8, norm="l2",
                                   average=False)
    assert bool(ok) and values.numel() == 3 * 40
    np.testing.assert_array_equal(f32_bits(values), f32_bits(np.concatenate(
        [codec.decode(r, table) for r in rows.numpy()])))


@pytest.mark.parametrize("impl", ["auto", "ops"])
def test_flagged_decode_refuses_what_the_checked_path_decides(monkeypatch, impl):
    """A marker, a joined rank's zeros, a checksum, another table, a bad norm, a code past the
    table, another size: never a True flag (None on CPU's fused path, where checks are free)."""
    monkeypatch.setattr(tk, "IMPLEMENTATION", impl)
    table = uniform_table(3)
    cases = _spoiled(table)
    short = _plain_rows(table)[:, :-1]
    assert tk.decode_flagged(short, table, numel=40, bucket_size=8, norm="l2") is None
    bad_code = _plain_rows(TERNARY)   # 2 bits, 3 levels: code 3 is invalid
    bad_code[2, -1] = 0xFF
    for name, rows, tab in [*((k, v, table) for k, v in cases.items()),
                            ("code 3", bad_code, TERNARY)]:
        for average in (True, False):
            got = tk.decode_flagged(rows, tab, numel=40, bucket_size=8, norm="l2",
                                    average=average)
            assert got is None or not bool(got[1]), (name, average)
            if impl == "ops":
                assert got is not None, name   # the torch ops flag it on the device


@pytest.mark.parametrize("impl", ["auto", "ops"])
def test_a_checked_encode_is_the_same_encode(monkeypatch, impl):
    """``checked=True`` (the wire after packed.send's step 2): the same bytes; the fused CPU
    kernel and the torch ops still refuse non-finite input (the Triton kernel skips the check:
    tests/test_triton_kernels.py)."""
    monkeypatch.setattr(tk, "IMPLEMENTATION", impl)
    x = torch.from_numpy(gradient(50))
    key = codec.StreamKey(seed=3)
    assert torch.equal(tk.encode(x, TERNARY, bucket_size=8, key=key, checked=True),
                       tk.encode(x, TERNARY, bucket_size=8, key=key))
    x[9] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        tk.encode(x, TERNARY, bucket_size=8, key=key, checked=True)
    with pytest.raises(TypeError, match="checked must be True or False"):
        tk.encode(x, TERNARY, bucket_size=8, key=key, checked="yes")


@pytest.mark.parametrize("n, B", [(0, 8), (1, 8), (50, 8), (50, 64), (1000, 7)])
def test_dequantize_is_the_oracles(n, B):
    from horovod_aq.codec.quantize import dequantize

    table = uniform_table(3)
    rng = np.random.default_rng(n)
    codes = rng.integers(0, 8, n).astype(np.uint8)
    norms = rng.lognormal(0, 1, codec.num_buckets(n, B)).astype(np.float32)
    got = tk.dequantize(torch.from_numpy(codes), torch.from_numpy(norms), table, B)
    np.testing.assert_array_equal(f32_bits(got), f32_bits(dequantize(codes, norms, table, B)))
