"""ECQ-SGD's fused send (horovod_aq.codec.fused_compensated) against the numpy oracle
``codec.encode_compensated``: the same payload bytes and, bit for bit, the same new memory
h' = β·h + (g − g̃), for every code width, norm, bucket shape, two-phase chunk and coding; and
the oracle against the unfused rules of ``ErrorMemory`` on float32 torch tensors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from horovod_aq import codec
from horovod_aq.codec import fused_compensated
from horovod_aq.codec.stream import StreamKey, stream_uniforms
from horovod_aq.error_feedback import ErrorMemory
from horovod_aq.levels import LevelTable, exponential, ternary, uniform, uniform_with_zero

KEY = StreamKey(7, rank=1, step=3, bucket=2, part=0)
ALPHA, BETA = 0.5103, 0.9   # ALQ 3-bit's default pair (docs/dynamic.md §2.4)


def gradient(n: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * rng.lognormal(0, 1, n) * scale).astype(np.float32)


def bits_of(a: np.ndarray) -> bytes:
    """The float32 bit patterns (−0.0 ≠ +0.0, NaN payloads compared)."""
    return np.ascontiguousarray(a, np.float32).view(np.uint32).tobytes()


def oracle(g, h, table, bucket_size, norm, *, numel=None, coding="fixed", key=KEY,
           alpha=ALPHA, beta=BETA, checksum=False):
    n = g.size if numel is None else numel
    return codec.encode_compensated(g, h, alpha, beta, table, bucket_size=bucket_size,
                                    norm=norm, numel=numel, uniforms=stream_uniforms(n, key),
                                    coding=coding, checksum=checksum)


def check(g, h, table, bucket_size, norm="l2", *, alpha=ALPHA, beta=BETA, key=KEY, **kwargs):
    """The fused send equals the oracle: payload bytes, h' bits, h' finiteness."""
    got = fused_compensated.encode_compensated(g, h, alpha, beta, table, bucket_size=bucket_size,
                                               norm=norm, key=key, **kwargs)
    want = oracle(g, h, table, bucket_size, norm, alpha=alpha, beta=beta, key=key, **kwargs)
    assert got.payload.dtype == np.uint8 and got.memory.dtype == np.float32
    assert got.payload.tobytes() == want.payload.tobytes()
    assert bits_of(got.memory) == bits_of(want.memory)
    assert got.memory_finite == want.memory_finite
    assert np.float64(got.memory_sum_of_squares).tobytes() == \
        np.float64(want.memory_sum_of_squares).tobytes()
    if want.memory_finite:                         # ‖h'‖², in the l2 norm's order
        assert want.memory_sum_of_squares == pytest.approx(
            float(np.sum(want.memory.astype(np.float64) ** 2)), rel=1e-12, abs=0)
    return got


# ------------------------------------------------------------------------ against the oracle


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("norm", ["l2", "linf"])
@pytest.mark.parametrize("bucket_size", [2, 7, 256, 1000, 3000])
def test_payload_and_memory_are_bitwise_the_oracles(bits, norm, bucket_size):
    n = 3 * bucket_size + 5 if bucket_size > 8 else 203   # a partial last bucket, n % 8 != 0
    g, h = gradient(n, seed=bits), gradient(n, seed=100 + bits, scale=0.1)
    g[bucket_size:2 * bucket_size] = 0.0                  # a zero bucket of x where h is zero
    h[bucket_size:2 * bucket_size] = 0.0
    g[5:9] = -0.0                                         # h' = β·h + (−0 − g̃): signed zeros
    table = LevelTable(uniform(bits))
    for memory in (h, None):                              # None: first use, h' = g − g̃
        got = check(g, memory, table, bucket_size, norm)
        assert got.memory_finite
    for checksum in (False, True):
        check(g, h, table, bucket_size, norm, checksum=checksum)


@pytest.mark.parametrize("levels", [ternary(), uniform_with_zero(3), uniform_with_zero(100),
                                    exponential(6, 0.9)],
                         ids=["ternary", "qsgd3", "qsgd100", "exp6"])
@pytest.mark.parametrize("alpha, beta", [(1.0, 1.0), (0.0, 0.9), (0.03164, 0.9), (1 / 3, 0.7)])
def test_tables_and_coefficients(levels, alpha, beta):
    g, h = gradient(1500, seed=2), gradient(1500, seed=3, scale=0.5)
    for norm in ("l2", "linf"):
        check(g, h, LevelTable(levels, 4), 100, norm, alpha=alpha, beta=beta)


@pytest.mark.parametrize("n, numel, bucket_size", [
    (0, 0, 4), (1, 1, 1), (9, 9, 1), (5, 8, 2), (37, 48, 16), (0, 48, 16), (1, 64, 16),
    (3000, 3072, 1024), (2500, 6144, 4096)])
def test_sizes_and_two_phase_padding(n, numel, bucket_size):
    # numel > n: a two-phase chunk zero-padded past the bucket's end (docs/protocol.md §5.2);
    # n = 0 < numel: a chunk wholly in the padding; buckets above 1024 values stream rows
    g, h = gradient(n, seed=n), gradient(n, seed=n + 1)
    for norm in ("l2", "linf"):
        got = check(g, h, LevelTable(uniform(3)), bucket_size, norm, numel=numel)
        assert got.memory.size == n
        assert got.payload.size == codec.payload_size(numel, 3, bucket_size)


def test_two_phase_chunks_are_the_oracle_on_each_zero_padded_chunk():
    # the P chunks of x = g + α·h padded with zeros to P·m are what the oracle encodes chunk by
    # chunk, part k each, and their memories concatenate to h' of the whole bucket
    P, B, n = 4, 16, 150
    m = 48                                                 # chunk_numel(150, 4, 16)
    g, h = gradient(n, seed=5), gradient(n, seed=6, scale=0.2)
    table = LevelTable(uniform(2))
    memories = []
    for k in range(P):
        lo, hi = min(k * m, n), min((k + 1) * m, n)
        key = StreamKey(7, rank=1, step=3, bucket=2, part=k)
        got = check(g[lo:hi], h[lo:hi], table, B, "linf", numel=m, key=key)
        x = np.zeros(P * m, np.float32)
        x[:n] = g + np.float32(ALPHA) * h
        whole = codec.encode(x[k * m:(k + 1) * m], table, bucket_size=B, norm="linf", key=key)
        assert got.payload.tobytes() == whole.tobytes()
        memories.append(got.memory)
    g_hat = np.concatenate([codec.decode(codec.encode(
        (np.concatenate([g + np.float32(ALPHA) * h, np.zeros(P * m - n, np.float32)]))
        [k * m:(k + 1) * m], table, bucket_size=B, norm="linf",
        key=StreamKey(7, rank=1, step=3, bucket=2, part=k)), table) for k in range(P)])[:n]
    assert bits_of(np.concatenate(memories)) == bits_of(np.float32(BETA) * h + (g - g_hat))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_the_entropy_coded_wire_both_kinds_of_payload(bits):
    # peaked values code below b bits (FLAG_ENTROPY); values on the levels, every code equally
    # often, do not (the compiled packer writes the fixed-width payload of the same codes)
    table = LevelTable(uniform(bits))
    n, bucket_size = 20000, 250
    peaked = gradient(n, seed=bits)
    on_levels = np.float32(table.levels)[np.random.default_rng(bits).integers(0, 1 << bits, n)]
    on_levels[::bucket_size] = 1.0                   # every bucket's L∞ norm is 1: r = x
    h = gradient(n, seed=9, scale=0.1)
    kinds = {}
    for name, g, alpha, norm in (("peaked", peaked, ALPHA, "l2"), ("peaked", peaked, ALPHA, "linf"),
                                 ("uniform", on_levels, 0.0, "linf")):
        got = check(g, h, table, bucket_size, norm, alpha=alpha, coding="entropy")
        check(g, None, table, bucket_size, norm, coding="entropy", checksum=True)
        kinds.setdefault(name, set()).add(bool(got.payload[codec.FLAGS_OFFSET]
                                               & codec.FLAG_ENTROPY))
        fixed = check(g, h, table, bucket_size, norm, alpha=alpha)
        assert bits_of(fixed.memory) == bits_of(got.memory)   # the same codes
    assert kinds["uniform"] == {False}
    if bits > 1:
        assert kinds["peaked"] == {True}


def test_huge_values_near_overflow():
    # x stays finite while g − g̃ overflows: h' holds ±Inf and says so (ErrorMemory resets it)
    # (buckets of 2: x = (−4e37, −3.4e38), n_k = 3.4e38, g̃_0 = ±n_k, g_0 − g̃_0 = 6.4e38 for −n_k)
    g = np.tile(np.array([3e38, -3.4e38], np.float32), 50)
    h = np.tile(np.array([-3.4e38, 0.0], np.float32), 50)
    got = check(g, h, LevelTable(uniform(1)), 2, "linf", alpha=1.0, beta=1.0)
    assert not got.memory_finite and np.isinf(got.memory).any()
    assert np.isfinite(got.memory[1::2]).all()
    big = gradient(1000, seed=4)
    big[600:700] *= np.float32(1e36)                      # large but finite norms
    big[:300] *= np.float32(1e-41)                        # float32 subnormals
    for norm in ("l2", "linf"):
        assert check(big, gradient(1000, seed=5), LevelTable(exponential(5)), 100, norm) \
            .memory_finite


# -------------------------------------------------------------------------- what cannot travel


@pytest.mark.parametrize("g, h, travels", [
    (np.array([1, np.nan, 2, 3], np.float32), None, ()),                        # g not finite
    (np.array([1, 2, 3, 4], np.float32), np.array([0, 0, np.inf, 0], np.float32), ()),  # h
    (np.array([3e38, 1, 1, 1], np.float32), np.array([3e38, 0, 0, 0], np.float32), ()),  # x
    (np.array([1, 1, 3e38, 3e38], np.float32), np.zeros(4, np.float32), ("linf",)),  # l2 norm
], ids=["g-nan", "h-inf", "x-overflows", "l2-norm-overflows"])
@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_a_bucket_that_cannot_travel(g, h, travels, norm):
    table = LevelTable(uniform(2))
    h_before = None if h is None else h.copy()
    kwargs = {"bucket_size": 2, "norm": norm, "key": KEY}
    found = fused_compensated.try_encode_compensated(g, h, 1.0, 1.0, table, **kwargs)
    if norm in travels:                                   # the L∞ norm of finite x is finite
        assert found is not None
        return
    assert found is None
    if h is not None:
        assert bits_of(h) == bits_of(h_before)             # h is never written
    with pytest.raises(ValueError) as fused_err:
        fused_compensated.encode_compensated(g, h, 1.0, 1.0, table, **kwargs)
    with pytest.raises(ValueError) as oracle_err:
        codec.encode_compensated(g, h, 1.0, 1.0, table, bucket_size=2, norm=norm,
                                 uniforms=np.zeros(4, np.float32))
    assert str(fused_err.value) == str(oracle_err.value)


def test_arguments_are_checked():
    g, table = gradient(8), LevelTable(uniform(2))
    kwargs = {"bucket_size": 4, "key": KEY}
    h = g.copy()
    with pytest.raises(ValueError, match="overlap"):
        fused_compensated.encode_compensated(g, h, 0.5, 0.9, table, memory_out=h, **kwargs)
    with pytest.raises(ValueError, match="at least"):
        fused_compensated.encode_compensated(g, None, 0.5, 0.9, table, numel=7, **kwargs)
    with pytest.raises(ValueError, match="coordinates of g"):
        fused_compensated.encode_compensated(g, g[:4], 0.5, 0.9, table, **kwargs)
    with pytest.raises(ValueError, match="coding"):
        fused_compensated.encode_compensated(g, None, 0.5, 0.9, table, coding="x", **kwargs)
    with pytest.raises(TypeError, match="StreamKey"):
        fused_compensated.encode_compensated(g, None, 0.5, 0.9, table, bucket_size=4, key=3)
    out = np.full(8, np.nan, np.float32)
    got = fused_compensated.encode_compensated(g, g * 0.5, 0.5, 0.9, table, memory_out=out,
                                               **kwargs)
    assert got.memory is out and np.isfinite(out).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(0, 2000), pad=st.integers(0, 600), bucket_size=st.integers(1, 1500),
       bits=st.integers(1, 8), linf=st.booleans(), memory=st.booleans(),
       seed=st.integers(0, 2**16))
def test_random_shapes(n, pad, bucket_size, bits, linf, memory, seed):
    g = gradient(n, seed=seed)
    h = gradient(n, seed=seed + 1, scale=0.3) if memory else None
    check(g, h, LevelTable(uniform(bits)), bucket_size, "linf" if linf else "l2", numel=n + pad)


# ---------------------------------------------------------- the oracle is the unfused update


def test_the_oracle_is_the_unfused_error_memory_on_float32_torch_tensors():
    # ErrorMemory.compensate / update on torch tensors (what the wire ran before the fusion):
    # x = g + α·h, g̃ = decode(encode(x)), h' = β·h + (g − g̃); the first use stores g − g̃
    torch = pytest.importorskip("torch")
    table = LevelTable(uniform(3))
    mem = ErrorMemory(alpha=ALPHA, beta=BETA)
    h = None
    for step in range(3):
        g = gradient(1000, seed=step, scale=10.0 ** (step - 1))
        g[:4] = -0.0
        key = StreamKey(1, rank=0, step=step)
        want = codec.encode_compensated(g, h, ALPHA, BETA, table, bucket_size=64, key=key)
        x = mem.compensate("b", torch.from_numpy(g))
        payload = codec.encode(x.numpy(), table, bucket_size=64, key=key)
        assert payload.tobytes() == want.payload.tobytes()
        mem.update("b", torch.from_numpy(g), torch.from_numpy(codec.decode(payload, table)))
        assert bits_of(mem.memory["b"].numpy()) == bits_of(want.memory)
        h = want.memory


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_the_graph_entry_point_takes_levels_and_header_as_variables_hold_them(norm, checksum):
    # encode_compensated_with (the TensorFlow graph's host call): the table as float32 levels
    # and 32 header bytes, the key as scalars, a two-phase chunk's padding: the oracle's bytes
    table = LevelTable(uniform(3), version=4)
    g, h = gradient(1000, seed=3), gradient(1000, seed=4, scale=0.1)
    header = np.frombuffer(codec.make_header(1024, table, 64, norm), np.uint8)
    got = fused_compensated.encode_compensated_with(
        g, h, ALPHA, BETA, codec.float32_levels(table), header, bits=3, bucket_size=64,
        norm=norm, key=KEY.scalars(), numel=1024, checksum=checksum)
    want = oracle(g, h, table, 64, norm, numel=1024, checksum=checksum)
    assert got.payload.tobytes() == want.payload.tobytes()
    assert bits_of(got.memory) == bits_of(want.memory) and got.memory_finite
    g[10] = np.nan
    assert fused_compensated.encode_compensated_with(
        g, h, ALPHA, BETA, codec.float32_levels(table), header, bits=3, bucket_size=64,
        norm=norm, key=KEY.scalars(), numel=1024) is None
