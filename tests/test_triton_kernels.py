"""The Triton kernels (``horovod_aq.torch.triton_kernels``) against the numpy oracle, byte for byte.

Without a GPU the kernels run in Triton's interpreter on CPU tensors: ``TRITON_INTERPRET=1`` is
set below, before triton is imported. On a CUDA machine with ``TRITON_INTERPRET`` unset
(``benchmarks/gpu_check.sh``) the same tests run the compiled kernels on the GPU. The arithmetic
they must match is ``docs/format.md`` §5 and the random stream §6.
"""

from __future__ import annotations

import os

import torch

if os.environ.get("TRITON_INTERPRET", "") not in ("", "0") or not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (it is read at jit time)

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels are untested")

from horovod_aq import codec  # noqa: E402
from horovod_aq.codec import NonFiniteGradientError, PayloadError  # noqa: E402
from horovod_aq.codec.stream import StreamKey, stream_uniforms  # noqa: E402
from horovod_aq.levels import families  # noqa: E402
from horovod_aq.levels.table import LevelTable  # noqa: E402
from horovod_aq.torch import kernels as torch_kernels  # noqa: E402
from horovod_aq.torch import triton_kernels as tk  # noqa: E402
from horovod_aq.torch import triton_send as ts  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
ROOT = Path(__file__).resolve().parents[1]
cuda_only = pytest.mark.skipif(INTERPRET, reason="needs CUDA and TRITON_INTERPRET unset")
BUCKETS = (2, 7, 64, 1000, 1024)


def ragged_n(bucket_size: int) -> int:
    """A size with a partial last bucket, not a multiple of 8, at most 5000 elements."""
    return 205 if bucket_size < 64 else 3 * bucket_size + 5


def sample(n: int, bucket_size: int, seed: int) -> np.ndarray:
    """Gaussian float32 values with an all-zero bucket (when there are three) and a −0.0."""
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    if n >= 3 * bucket_size:
        x[bucket_size : 2 * bucket_size] = 0.0
    if n:
        x[-1] = -0.0
    return x


def oracle(x: np.ndarray, table, bucket_size: int, norm: str, key: StreamKey) -> np.ndarray:
    """``codec.encode(x, key=key)``: by definition, the oracle fed the stream's uniforms."""
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    return codec.encode(flat, table, bucket_size=bucket_size, norm=norm,
                        uniforms=stream_uniforms(flat.size, key))


def encode(x, table, bucket_size, norm, key, **kw) -> torch.Tensor:
    return ts.encode(torch.as_tensor(x).to(DEVICE), table, bucket_size=bucket_size, norm=norm,
                     key=key, **kw)


def as_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def table_for(bits: int, version: int = 1) -> LevelTable:
    return LevelTable(families.uniform(bits), version)


def same_error(call_a, call_b, kind=ValueError) -> str:
    """Both calls raise ``kind`` with the same message; returns it."""
    with pytest.raises(kind) as a:
        call_a()
    with pytest.raises(kind) as b:
        call_b()
    assert type(a.value) is type(b.value)
    assert str(a.value) == str(b.value)
    return str(a.value)


# ------------------------------------------------------------------------------------ encode


@pytest.mark.skipif(not INTERPRET, reason="Triton's interpreter only")
def test_interpreted_launches_from_two_threads_are_the_oracles(monkeypatch):
    # the interpreter patches triton.language for the length of a launch: DDP's hook and its
    # collectives' callbacks launch from two threads, so interpreted launches go one at a time
    # (triton_kernels.launched), and HOROVOD_AQ_KERNELS=triton sends CPU tensors through them
    import threading

    monkeypatch.setattr(torch_kernels, "IMPLEMENTATION", "triton")
    assert torch_kernels.implementation_for(torch.device("cpu")) == "triton"
    table, B = table_for(3), 64
    xs = [sample(4000 + 17 * t, B, seed=t) for t in range(2)]
    want = [oracle(x, table, B, "l2", StreamKey(1, t, 0, 0, 0)) for t, x in enumerate(xs)]
    got: dict[int, list[bytes]] = {0: [], 1: []}

    def run(t: int) -> None:
        for _ in range(4):
            got[t].append(as_bytes(encode(xs[t], table, B, "l2", StreamKey(1, t, 0, 0, 0))))
    threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(g == [want[t].tobytes()] * 4 for t, g in got.items())


@pytest.mark.parametrize("bucket_size", BUCKETS)
@pytest.mark.parametrize("norm", ["l2", "linf"])
@pytest.mark.parametrize("bits", range(1, 9))
def test_encode_is_the_oracle_byte_for_byte(bits, norm, bucket_size):
    table = table_for(bits)
    n = ragged_n(bucket_size)
    x = sample(n, bucket_size, seed=bits * 1000 + bucket_size)
    key = StreamKey(seed=bits * 31 + bucket_size, rank=1, step=5, bucket=2)
    got = encode(x, table, bucket_size, norm, key)
    assert got.dtype == torch.uint8 and got.device.type == DEVICE.type
    assert as_bytes(got) == oracle(x, table, bucket_size, norm, key).tobytes()


@pytest.mark.parametrize("levels", [
    families.uniform(1), families.ternary(), families.uniform_with_zero(2), families.natural(3),
    families.exponential(8),  # flushed subnormal levels: a run of zeros
    [-1.0, -0.2, 0.1, 0.7, 1.0],  # 5 levels, 3 bits: codes 5..7 unused
    np.concatenate([[-1.0], np.sort(np.random.default_rng(4).uniform(-1, 1, 198)), [1.0]]),
], ids=["u1", "ternary", "uniform0", "natural3", "exp8", "five", "random200"])
@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_tables_with_and_without_a_zero_level(levels, norm):
    table = LevelTable(levels, 7)
    x = sample(517, 64, seed=3)
    x[:40] *= np.float32(1e-36)  # near the tiny levels of the exponential table
    key = StreamKey(seed=11, rank=2)
    payload = encode(x, table, 64, norm, key)
    want = oracle(x, table, 64, norm, key)
    assert as_bytes(payload) == want.tobytes()
    assert as_bytes(tk.decode(payload, table)) == codec.decode(want, table).tobytes()


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8, 9, 15, 16, 17, 1023, 1025])
def test_small_and_empty_inputs(n):
    table = table_for(3)
    x = sample(n, 3, seed=n)
    for bucket_size in (1, 3, 4096):
        for norm in ("l2", "linf"):
            key = StreamKey(seed=n, step=bucket_size)
            got = encode(x, table, bucket_size, norm, key)
            want = oracle(x, table, bucket_size, norm, key)
            assert as_bytes(got) == want.tobytes()
            assert as_bytes(tk.decode(got, table)) == codec.decode(want, table).tobytes()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_input_dtypes_cast_to_nearest_float32(dtype, norm):
    table = table_for(4)
    x = torch.from_numpy(sample(1999, 100, seed=5) * np.float32(3)).to(dtype)
    key = StreamKey(seed=8, rank=3, step=1)
    got = ts.encode(x.to(DEVICE), table, bucket_size=100, norm=norm, key=key)
    assert as_bytes(got) == oracle(x.float().numpy(), table, 100, norm, key).tobytes()


def test_any_shape_and_non_contiguous_input():
    table = table_for(2)
    x = torch.from_numpy(sample(60 * 33, 50, seed=6)).view(60, 33).t()  # a transposed view
    key = StreamKey(seed=1)
    got = ts.encode(x.to(DEVICE), table, bucket_size=50, key=key)
    assert as_bytes(got) == oracle(x.contiguous().numpy(), table, 50, "l2", key).tobytes()


@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_all_zero_and_signed_zero_buckets(norm):
    table = LevelTable(families.uniform_with_zero(3), 2)
    x = np.zeros(301, np.float32)
    x[::3] = -0.0
    key = StreamKey(seed=2)
    got = encode(x, table, 64, norm, key)
    want = oracle(x, table, 64, norm, key)
    assert as_bytes(got) == want.tobytes()
    decoded = tk.decode(got, table).cpu().numpy()
    assert decoded.tobytes() == codec.decode(want, table).tobytes()


def test_subnormal_data_is_not_flushed():
    """numpy and PyTorch keep subnormal data; so must the kernels (docs/format.md §5)."""
    table = table_for(3)
    x = (sample(300, 30, seed=9) * np.float32(1e-39)).astype(np.float32)
    key = StreamKey(seed=3)
    for norm in ("l2", "linf"):
        assert as_bytes(encode(x, table, 30, norm, key)) == oracle(x, table, 30, norm,
                                                                    key).tobytes()


@pytest.mark.parametrize("key", [
    StreamKey(seed=0),
    StreamKey(seed=2**62 + 12345, rank=7, step=2**32 - 1, bucket=2**31, part=1),
    StreamKey(seed=99, rank=1, step=2**33 + 3, bucket=5, part=4),  # counters wrap mod 2^32
])
def test_random_stream_keys(key):
    table = table_for(8)
    x = sample(1000, 64, seed=10)
    assert as_bytes(encode(x, table, 64, "l2", key)) == oracle(x, table, 64, "l2",
                                                                 key).tobytes()


def test_the_oracle_with_key_is_the_oracle_with_stream_uniforms():
    table, key = table_for(3), StreamKey(seed=4, rank=1, step=2)
    x = sample(777, 64, seed=11)
    want = codec.encode(x, table, bucket_size=64, key=key)
    assert as_bytes(encode(x, table, 64, "l2", key)) == want.tobytes()


@pytest.mark.parametrize("norm", ["l2", "linf"])
@pytest.mark.parametrize("block", [16, 64])
def test_wide_buckets_reduce_in_several_passes(monkeypatch, norm, block):
    """Buckets wider than NORM_BLOCK keep the canonical pairwise order over several passes."""
    monkeypatch.setattr(tk, "NORM_BLOCK", block)
    table = table_for(3)
    for bucket_size in (1000, 1024, 33):
        x = sample(ragged_n(bucket_size), bucket_size, seed=bucket_size)
        x[5] = np.float32(3e18)  # big squares: the float64 order matters
        key = StreamKey(seed=block)
        got = encode(x, table, bucket_size, norm, key)
        assert as_bytes(got) == oracle(x, table, bucket_size, norm, key).tobytes()


def _l2_other_orders(x: np.ndarray) -> tuple[np.float32, np.float32]:
    """float32 l2 norms of x summed sequentially and by adjacent pairs (not the format's)."""
    q = x.astype(np.float64) ** 2
    sequential = 0.0
    for v in q:
        sequential += v
    width = 1 << max(0, q.size - 1).bit_length()
    q = np.concatenate([q, np.zeros(width - q.size)])
    while q.size > 1:
        q = q[0::2] + q[1::2]
    return np.float32(np.sqrt(sequential)), np.float32(np.sqrt(q[0]))


def order_sensitive(bucket_size: int, count: int, seed: int) -> np.ndarray:
    """``count`` buckets whose float32 l2 norm depends on the order of the float64 sum.

    1 + 2·(2^−12)² + (2^−24)² is (1 + 2^−24)², a float32 tie that rounds to even (1.0); eight
    (2^−27)² = 2^−54 terms add 2^−51 when summed together first, but vanish one by one against
    1, and then the norm rounds up instead. In buckets of more than 64 the values sit in a few
    columns of stride 64 (m·64 + {0, 1}), so that they meet already in the first halvings (the
    passes of a multi-pass reduction). Placements are drawn until the canonical order gives
    another norm than a sequential sum, an adjacent-pairs sum and most permutations of the
    values over the same places."""
    values = np.array([1.0, 2**-12, 2**-12, 2**-24] + [2**-27] * 8, np.float32)
    rng = np.random.default_rng(seed)
    buckets = []
    while len(buckets) < count:
        if bucket_size > 64:
            rows = rng.choice(min(16, -(-bucket_size // 64)), values.size, replace=False)
            places = np.minimum(rows * 64 + rng.integers(0, 2, values.size), bucket_size - 1)
            if np.unique(places).size < values.size:
                continue
        else:
            places = rng.choice(bucket_size, values.size, replace=False)
        sign = rng.choice([-1, 1], values.size).astype(np.float32)
        scale = np.float32(2.0 ** int(rng.integers(-20, 20)))

        def norm(vals):
            x = np.zeros(bucket_size, np.float32)
            x[places] = vals * scale * sign
            return x, codec.bucket_norms(x, bucket_size)[0]

        x, canonical = norm(values)
        permuted = [norm(rng.permutation(values))[1] for _ in range(9)]
        others = (*_l2_other_orders(x), max(set(permuted), key=permuted.count))
        if canonical not in others:
            buckets.append(x)
    return np.concatenate(buckets)


@pytest.mark.parametrize("block", [16, 4096])
@pytest.mark.parametrize("bucket_size", [16, 64, 1000, 1024])
def test_l2_norms_follow_the_canonical_pairwise_order(monkeypatch, block, bucket_size):
    """Buckets whose norm tells the canonical order from others, in one pass and in several."""
    monkeypatch.setattr(tk, "NORM_BLOCK", block)
    x = order_sensitive(bucket_size, 5, seed=bucket_size)
    table, key = table_for(3), StreamKey(seed=bucket_size)
    payload = encode(x, table, bucket_size, "l2", key)
    norms = payload[codec.HEADER_SIZE:codec.HEADER_SIZE + 20].cpu().view(torch.float32).numpy()
    assert norms.tobytes() == codec.bucket_norms(x, bucket_size).tobytes()
    assert as_bytes(payload) == oracle(x, table, bucket_size, "l2", key).tobytes()


def test_buckets_of_a_million_elements():
    table = table_for(2)
    x = sample(5000, 2**20, seed=12)
    key = StreamKey(seed=5)
    for bucket_size in (2**20, 2**20 + 1):  # (the oracle repeats each norm B times)
        got = encode(x, table, bucket_size, "l2", key)
        assert as_bytes(got) == oracle(x, table, bucket_size, "l2", key).tobytes()


def test_out_is_filled_and_untouched_on_error():
    table = table_for(3)
    x = sample(500, 64, seed=13)
    key = StreamKey(seed=6)
    want = oracle(x, table, 64, "l2", key)
    out = torch.full((want.size,), 7, dtype=torch.uint8, device=DEVICE)
    assert encode(x, table, 64, "l2", key, out=out) is out
    assert as_bytes(out) == want.tobytes()
    bad = x.copy()
    bad[100] = np.nan
    out.fill_(7)
    with pytest.raises(ValueError, match="non-finite"):
        encode(bad, table, 64, "l2", key, out=out)
    assert bool((out == 7).all())
    with pytest.raises(ValueError, match="out must be"):
        encode(x, table, 64, "l2", key, out=out[:-1])


# ------------------------------------------------------------------------------------ decode


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_decode_average_is_the_oracle(world, bits):
    table = table_for(bits)
    bucket_size = (7, 64, 1000)[bits % 3]
    n = ragged_n(bucket_size)
    rows_np = np.stack([
        oracle(sample(n, bucket_size, seed=10 * bits + r), table, bucket_size, "l2",
               StreamKey(seed=3, rank=r))
        for r in range(world)])
    rows = torch.from_numpy(rows_np).to(DEVICE)
    got = tk.decode_average(rows, table)
    want = codec.decode_average(rows_np, table)
    assert got.dtype == torch.float32 and as_bytes(got) == want.tobytes()
    assert as_bytes(tk.decode(rows[0], table)) == codec.decode(rows_np[0], table).tobytes()
    for dtype in (torch.float16, torch.bfloat16):
        half = tk.decode_average(rows, table, dtype=dtype)
        assert half.dtype == dtype
        assert as_bytes(half) == as_bytes(torch.from_numpy(want).to(dtype))


def test_decode_average_of_a_gathered_buffer_with_odd_rows():
    """Rows of an odd size (misaligned norms) cut from a larger buffer, P = 3."""
    table = table_for(3)
    n, bucket_size = 203, 7  # 32 + 4·29 + 77 = 225 bytes per row
    rows_np = np.stack([oracle(sample(n, bucket_size, seed=r), table, bucket_size, "linf",
                               StreamKey(seed=r)) for r in range(3)])
    assert rows_np.shape[1] % 2 == 1
    flat = torch.zeros(1 + rows_np.size, dtype=torch.uint8, device=DEVICE)
    flat[1:] = torch.from_numpy(rows_np.reshape(-1)).to(DEVICE)
    rows = flat[1:].view(rows_np.shape)
    want = codec.decode_average(rows_np, table)
    assert as_bytes(tk.decode_average(rows, table)) == want.tobytes()
    assert as_bytes(tk.decode(rows[2], table)) == codec.decode(rows_np[2], table).tobytes()


def test_decode_reads_the_torch_kernels_payloads():
    table = table_for(4)
    x = torch.from_numpy(sample(999, 64, seed=14))
    u = torch.from_numpy(stream_uniforms(999, StreamKey(seed=9)))
    theirs = torch_kernels.encode(x, table, bucket_size=64, uniforms=u)
    ours = ts.encode(x.to(DEVICE), table, bucket_size=64, key=StreamKey(seed=9))
    assert as_bytes(theirs) == as_bytes(ours)
    rows = torch.stack([theirs, theirs]).to(DEVICE)
    assert as_bytes(tk.decode_average(rows, table)) == as_bytes(
        torch_kernels.decode_average(rows.cpu(), table))


@pytest.mark.parametrize("corrupt", ["code", "negative-norm", "nan-norm", "inf-norm"])
def test_corrupt_payloads_are_refused_like_the_oracle(monkeypatch, corrupt):
    table = LevelTable([-1.0, -0.2, 0.1, 0.7, 1.0], 1)  # 3 bits, codes 5..7 are invalid
    payload = oracle(sample(64, 64, seed=15), table, 64, "l2", StreamKey(seed=1))
    if corrupt == "code":
        payload[-1] = 0xFF
    else:
        value = {"negative-norm": -1.0, "nan-norm": np.nan, "inf-norm": np.inf}[corrupt]
        payload[32:36] = np.frombuffer(np.float32(value).tobytes(), np.uint8)
    good = oracle(sample(64, 64, seed=16), table, 64, "l2", StreamKey(seed=2))
    monkeypatch.setattr(torch_kernels, "IMPLEMENTATION", "ops")  # the torch ops, not fused
    for decode, args in ((tk.decode, (payload,)), (tk.decode_average, (good, payload))):
        rows = np.stack(args) if len(args) > 1 else args[0]
        oracle_decode = codec.decode if len(args) == 1 else codec.decode_average
        torch_decode = (torch_kernels.decode if len(args) == 1
                        else torch_kernels.decode_average)
        message = same_error(lambda: decode(torch.from_numpy(rows).to(DEVICE), table),
                             lambda: oracle_decode(rows, table))
        same_error(lambda: torch_decode(torch.from_numpy(rows), table),
                   lambda: oracle_decode(rows, table))
        assert ("code 7" if corrupt == "code" else "negative or non-finite") in message


@pytest.mark.parametrize("corrupt", [None, "code", "negative-norm", "nan-norm", "header",
                                     "marker"])
def test_flagged_rows_decode_without_refusing(corrupt):
    """``decode_rows_flagged`` (the wire's decode, no host sync): the oracle's average with
    the flag 0, and a raised flag instead of an error on a corrupt row — a code past the table,
    a bad norm, or (checked by the kernel against ``head``) another header: a changed byte, a
    non-finite marker in the last row."""
    table = LevelTable([-1.0, -0.2, 0.1, 0.7, 1.0], 1)
    rows_np = np.stack([oracle(sample(200, 64, seed=20 + r), table, 64, "l2", StreamKey(seed=r))
                        for r in range(3)])
    head = torch.from_numpy(rows_np[0, :32].copy()).to(DEVICE)
    if corrupt == "code":
        rows_np[1, -1] = 0xFF
    elif corrupt == "header":
        rows_np[1, 5] ^= 1
    elif corrupt == "marker":
        rows_np[2] = codec.nonfinite_payload(200, table, 64, "l2", 17)
    elif corrupt:
        value = {"negative-norm": -1.0, "nan-norm": np.nan}[corrupt]
        rows_np[2, 32:36] = np.frombuffer(np.float32(value).tobytes(), np.uint8)
    header = codec.parse_header(rows_np[0, :32])
    out, flag = tk.decode_rows_flagged(torch.from_numpy(rows_np).to(DEVICE), header, table, True,
                                       head=head)
    assert (int(flag[0]) == 0) == (corrupt is None)
    if corrupt is None:
        assert as_bytes(out) == codec.decode_average(rows_np, table).tobytes()


@cuda_only
def test_the_wires_flagged_decode_on_cuda():
    """``torch.kernels.decode_flagged`` on CUDA rows takes the Triton decoder: the oracle's
    average and the rows' decodes, with a True flag; a non-finite marker row flags False."""
    table = table_for(3)
    rows_np = np.stack([oracle(sample(300, 64, seed=30 + r), table, 64, "l2", StreamKey(seed=r))
                        for r in range(3)])
    rows = torch.from_numpy(rows_np).to(DEVICE)
    values, ok = torch_kernels.decode_flagged(rows, table, numel=300, bucket_size=64, norm="l2")
    assert bool(ok) and as_bytes(values) == codec.decode_average(rows_np, table).tobytes()
    values, ok = torch_kernels.decode_flagged(rows, table, numel=300, bucket_size=64, norm="l2",
                                              average=False)
    assert bool(ok) and as_bytes(values) == np.concatenate(
        [codec.decode(r, table) for r in rows_np]).tobytes()
    rows[1, :32] = torch.from_numpy(np.frombuffer(codec.make_header(
        300, table, 64, "l2", first_nonfinite=7), np.uint8).copy()).to(DEVICE)
    assert not bool(torch_kernels.decode_flagged(rows, table, numel=300, bucket_size=64,
                                                 norm="l2")[1])


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 3e38])
def test_a_checked_encode_skips_the_check(bad):
    """``checked=True``: the oracle's bytes on finite input, no host sync; an input that was
    not in fact sendable gives a payload that every decoder refuses (its bucket norm is not a
    finite float32), never an exception at the encode."""
    table, key = table_for(3), StreamKey(seed=4)
    x = sample(300, 64, seed=40)
    assert as_bytes(encode(x, table, 64, "l2", key, checked=True)) == oracle(
        x, table, 64, "l2", key).tobytes()
    x[70:80] = bad
    payload = encode(x, table, 64, "l2", key, checked=True)
    with pytest.raises(PayloadError, match="negative or non-finite"):
        codec.decode(payload.cpu().numpy(), table)
    with pytest.raises(PayloadError, match="negative or non-finite"):
        tk.decode(payload, table)


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_non_finite_input_raises_the_torch_kernels_error(dtype, bad, norm):
    x = torch.from_numpy(sample(300, 64, seed=16)).to(dtype)
    x[70] = bad
    x[200] = bad
    table, key = table_for(3), StreamKey(seed=1)
    message = same_error(
        lambda: ts.encode(x.to(DEVICE), table, bucket_size=64, norm=norm, key=key),
        lambda: torch_kernels.encode(x, table, bucket_size=64, norm=norm,
                                     uniforms=torch.zeros(300)))
    assert "2 of 300" in message and "index 70" in message


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # interpreter
def test_norm_overflow_and_bad_input_raise_the_torch_kernels_errors():
    table, key = table_for(3), StreamKey(seed=1)
    big = torch.full((10,), 3e38)
    message = same_error(lambda: ts.encode(big.to(DEVICE), table, bucket_size=4, key=key),
                         lambda: torch_kernels.encode(big, table, bucket_size=4))
    assert "bucket 0" in message
    ints = torch.arange(10)
    same_error(lambda: ts.encode(ints.to(DEVICE), table, bucket_size=4, key=key),
               lambda: torch_kernels.encode(ints, table, bucket_size=4))
    same_error(lambda: ts.encode(np.zeros(3), table, bucket_size=4, key=key),
               lambda: torch_kernels.encode(np.zeros(3), table, bucket_size=4), TypeError)
    x = torch.zeros(10, device=DEVICE)
    with pytest.raises(ValueError, match="bucket_size"):
        ts.encode(x, table, bucket_size=0, key=key)
    with pytest.raises(ValueError, match="unknown norm"):
        ts.encode(x, table, bucket_size=4, norm="l1", key=key)
    with pytest.raises(TypeError, match="StreamKey"):
        ts.encode(x, table, bucket_size=4, key=5)


def _payload(table, n=100, bucket_size=16, norm="l2", rank=0) -> np.ndarray:
    return oracle(sample(n, bucket_size, seed=rank), table, bucket_size, norm,
                  StreamKey(seed=1, rank=rank))


def test_foreign_payloads_raise_the_torch_kernels_errors():
    table = table_for(3)
    other = table_for(3, version=2)
    good = _payload(table)
    cases = {
        "other table": (_payload(other), {}),
        "truncated": (good[:-1], {}),
        "shorter than a header": (good[:20], {}),
        "too long": (np.concatenate([good, good[:3]]), {}),
        "bad magic": (np.concatenate([[0, 0], good[2:]]).astype(np.uint8), {}),
        "other numel": (good, {"numel": 99}),
        "other bucket size": (good, {"bucket_size": 8}),
        "other norm": (good, {"norm": "linf"}),
    }
    for what, (payload, kw) in cases.items():
        t = torch.from_numpy(np.ascontiguousarray(payload))
        same_error(lambda: tk.decode(t.to(DEVICE), table, **kw),
                   lambda: torch_kernels.decode(t, table, **kw), PayloadError)
        rows = torch.stack([torch.from_numpy(good), t]) if t.numel() == good.size else t[None]
        same_error(lambda: tk.decode_average(rows.to(DEVICE), table, **kw),
                   lambda: torch_kernels.decode_average(rows, table, **kw), PayloadError)
    marker = torch.from_numpy(codec.nonfinite_payload(100, table, 16, "l2", 42))
    rows = torch.stack([torch.from_numpy(good), marker])
    message = same_error(lambda: tk.decode_average(rows.to(DEVICE), table),
                         lambda: torch_kernels.decode_average(rows, table),
                         NonFiniteGradientError)
    assert message.startswith("rank 1:")
    mixed = torch.stack([torch.from_numpy(good), torch.from_numpy(_payload(table, norm="linf"))])
    assert same_error(lambda: tk.decode_average(mixed.to(DEVICE), table),
                      lambda: torch_kernels.decode_average(mixed, table),
                      PayloadError).startswith("rank 1:")
    for bad in (torch.zeros(0, 40, dtype=torch.uint8), torch.zeros(2, 40, dtype=torch.int32),
                torch.zeros(40, dtype=torch.uint8)):
        same_error(lambda: tk.decode_average(bad.to(DEVICE), table),
                   lambda: torch_kernels.decode_average(bad, table), PayloadError)
    same_error(lambda: tk.decode(torch.zeros(2, 40, dtype=torch.uint8), table),
               lambda: torch_kernels.decode(torch.zeros(2, 40, dtype=torch.uint8), table),
               PayloadError)


# ------------------------------------------------------------------------------ availability


def test_availability_is_reported():
    assert tk.available() and tk.unavailable_reason() is None
    ts.encode(torch.zeros(3, device=DEVICE), table_for(1), bucket_size=2, key=StreamKey(seed=0))
    assert tk.interpreting() is INTERPRET


@cuda_only
def test_cpu_tensors_are_refused_outside_the_interpreter():
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        ts.encode(torch.zeros(3), table_for(1), bucket_size=2, key=StreamKey(seed=0))


# ------------------------------------------------------------------------------- CUDA sizes


@cuda_only
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_cuda_large_inputs_are_the_oracle(bits, norm):
    """A million coordinates per rank, so that a fused multiply-add would show in the average
    (approximate division or sqrt would rarely show: benchmarks/gpu_check.py reads the PTX)."""
    table = table_for(bits)
    n, bucket_size = 1_000_003, 512
    x = sample(n, bucket_size, seed=bits)
    rows_np = np.stack([oracle(x * np.float32(r + 1), table, bucket_size, norm,
                               StreamKey(seed=bits, rank=r)) for r in range(2)])
    x_cuda = torch.from_numpy(x).to(DEVICE)
    got = torch.stack([ts.encode(x_cuda * (r + 1), table, bucket_size=bucket_size, norm=norm,
                                 key=StreamKey(seed=bits, rank=r)) for r in range(2)])
    assert as_bytes(got) == rows_np.tobytes()
    assert as_bytes(tk.decode_average(got, table)) == codec.decode_average(rows_np,
                                                                          table).tobytes()


@cuda_only
@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_cuda_bucket_of_two_to_the_twenty(norm):
    table = table_for(3)
    n = 2**20 * 2 + 5
    x = sample(n, 2**20, seed=17)
    key = StreamKey(seed=17)
    got = ts.encode(torch.from_numpy(x).to(DEVICE), table, bucket_size=2**20, norm=norm, key=key)
    assert as_bytes(got) == oracle(x, table, 2**20, norm, key).tobytes()


# ------------------------------------------------------------------------------ gpu_check.py


@pytest.mark.slow     # a benchmark's quick run (the GPU script's dry run): the slow matrix
def test_gpu_check_dry_run_writes_a_table(tmp_path):
    out = tmp_path / "gpu.md"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out",
         str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "| op |" in text and "encode" in text and "decode_average" in text
    assert "packed step" in text and "dry run" in text
    assert "Error feedback fused into the encode" in text and "fused, one pass" in text


# ------------------------------------------------------------------------------------ checksum
@pytest.mark.parametrize("n", [0, 1, 700])
def test_checksummed_payloads_are_the_oracles_and_are_verified(n):
    table, key = table_for(3, version=6), StreamKey(seed=8, rank=1, step=2)
    x = sample(n, 64, seed=21) if n else np.zeros(0, np.float32)
    want = codec.encode(x, table, bucket_size=64, key=key, checksum=True)
    got = ts.encode(torch.from_numpy(x).to(DEVICE), table, bucket_size=64, key=key,
                    checksum=True)
    assert as_bytes(got) == want.tobytes()
    out = torch.empty(want.size, dtype=torch.uint8, device=DEVICE)
    ts.encode(torch.from_numpy(x).to(DEVICE), table, bucket_size=64, key=key, checksum=True,
              out=out)
    assert as_bytes(out) == want.tobytes()
    if not n:
        return
    bad = want.copy()
    bad[33] ^= 0x80  # the sign of bucket 0's norm
    rows = np.stack([want, bad])
    same_error(lambda: tk.decode_average(torch.from_numpy(rows).to(DEVICE), table),
               lambda: codec.decode_average(rows, table))
    same_error(lambda: tk.decode(torch.from_numpy(bad).to(DEVICE), table),
               lambda: codec.decode(bad, table))
    assert as_bytes(tk.decode(got, table)) == codec.decode(want, table).tobytes()
