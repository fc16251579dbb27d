"""ECQ-SGD's fused send in Triton (``horovod_aq.torch.triton_send``, ``triton_compensated``)
against the numpy oracle ``codec.encode_compensated``: the same payload bytes and, bit for bit,
the same new memory h' = β·h + (g − g̃), its finiteness and ‖h'‖², for every code width, norm,
bucket shape (the one-pass kernel and the three-pass one), two-phase chunk and coding; the
markers it puts in place; the torch wire with it bitwise the unfused steps, and its launches
per bucket.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1`` is
set below, before triton is imported); on a CUDA machine with ``TRITON_INTERPRET`` unset
(``benchmarks/gpu_check.sh``) the same tests run the compiled kernels, and the ``cuda_only``
ones check large inputs and that the send waits for the host once.
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

import horovod_aq  # noqa: E402
from horovod_aq import codec  # noqa: E402
from horovod_aq.codec import format as fmt  # noqa: E402
from horovod_aq.codec.stream import StreamKey, stream_uniforms  # noqa: E402
from horovod_aq.levels import (  # noqa: E402
    LevelTable,
    exponential,
    ternary,
    uniform,
    uniform_with_zero,
)
from horovod_aq.torch import compensated, kernels  # noqa: E402
from horovod_aq.torch import triton_compensated as tc  # noqa: E402
from horovod_aq.torch import triton_send as ts  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
ROOT = Path(__file__).resolve().parents[1]
cuda_only = pytest.mark.skipif(INTERPRET, reason="needs CUDA and TRITON_INTERPRET unset")
interpreter_only = pytest.mark.skipif(not INTERPRET, reason="CPU tensors stand in for CUDA ones")
KEY = StreamKey(7, rank=1, step=3, bucket=2, part=0)
_FUSABLE = compensated.fusable
ALPHA, BETA = 0.5103, 0.9   # ALQ 3-bit's default pair (docs/dynamic.md §2.4)


def gradient(n: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * rng.lognormal(0, 1, n) * scale).astype(np.float32)


def bits_of(a) -> bytes:
    """The float32 bit patterns (−0.0 ≠ +0.0)."""
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().numpy()
    return np.ascontiguousarray(a, np.float32).view(np.uint32).tobytes()


def on_device(a: np.ndarray | None) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(a.copy()).to(DEVICE)


def oracle(g, h, table, bucket_size, norm, *, numel=None, key=KEY, alpha=ALPHA, beta=BETA,
           **kwargs):
    n = g.size if numel is None else numel
    return codec.encode_compensated(g, h, alpha, beta, table, bucket_size=bucket_size,
                                    norm=norm, numel=numel, uniforms=stream_uniforms(n, key),
                                    **kwargs)


def check(g, h, table, bucket_size, norm="l2", *, alpha=ALPHA, beta=BETA, key=KEY, **kwargs):
    """The Triton send equals the oracle: payload bytes, h' bits, h' finiteness, ‖h'‖² bits."""
    got = tc.encode_compensated(on_device(g), on_device(h), alpha, beta, table,
                                bucket_size=bucket_size, norm=norm, key=key, **kwargs)
    want = oracle(g, h, table, bucket_size, norm, alpha=alpha, beta=beta, key=key, **kwargs)
    assert got.payload.dtype == torch.uint8 and got.payload.device.type == DEVICE.type
    assert got.payload.cpu().numpy().tobytes() == want.payload.tobytes()
    assert bits_of(got.memory) == bits_of(want.memory)
    assert got.memory_finite == want.memory_finite
    assert np.float64(got.memory_sum_of_squares).tobytes() == \
        np.float64(want.memory_sum_of_squares).tobytes()
    return got


def sample(n: int, bucket_size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """g and h with a zero bucket of x (where both are zero) and signed zeros in g."""
    g, h = gradient(n, seed=seed), gradient(n, seed=100 + seed, scale=0.1)
    g[bucket_size:2 * bucket_size] = 0.0
    h[bucket_size:2 * bucket_size] = 0.0
    g[5:9] = -0.0                                         # h' = β·h + (−0 − g̃): signed zeros
    return g, h


# ------------------------------------------------------------------------ against the oracle


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("norm", ["l2", "linf"])
@pytest.mark.parametrize("bucket_size", [256, 1000], ids=["one-pass", "three-pass"])
def test_payload_and_memory_are_bitwise_the_oracles(bits, norm, bucket_size):
    n = 3 * bucket_size + 5                               # a partial last bucket, n % 8 != 0
    g, h = sample(n, bucket_size, seed=bits)
    got = check(g, h, LevelTable(uniform(bits)), bucket_size, norm)
    assert got.memory_finite
    assert ts.local_width(bucket_size) == (bucket_size if bucket_size == 256 else None)


@pytest.mark.parametrize("bits, bucket_size", [(1, 256), (8, 256), (3, 2), (3, 7), (3, 256),
                                              (3, 2048)])
@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_first_use_without_memory(bits, norm, bucket_size):
    # h = None: x = g and h' = g − g̃ (no β·0 term: a −0.0 of g − g̃ stays −0.0)
    n = 3 * bucket_size + 5 if bucket_size > 8 else 203
    g, _ = sample(n, bucket_size, seed=bits + 10)
    check(g, None, LevelTable(uniform(bits)), bucket_size, norm)


@pytest.mark.parametrize("bucket_size", [2, 64, 256])
@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_the_three_pass_kernel_on_power_of_two_buckets(monkeypatch, bucket_size, norm):
    # the shapes the one-pass kernel takes, forced through the three passes: the same bits
    g, h = sample(3 * bucket_size + 5, bucket_size, seed=bucket_size)
    table = LevelTable(uniform(3))
    one = check(g, h, table, bucket_size, norm)
    monkeypatch.setattr(ts, "LOCAL_MAX", 1)
    assert ts.local_width(bucket_size) is None
    three = check(g, h, table, bucket_size, norm)
    assert bits_of(one.memory) == bits_of(three.memory)


@pytest.mark.parametrize("levels", [ternary(), uniform_with_zero(3), exponential(6, 0.9)],
                         ids=["ternary", "qsgd3", "exp6"])
@pytest.mark.parametrize("alpha, beta", [(1.0, 1.0), (0.0, 0.9), (1 / 3, 0.7)])
def test_tables_and_coefficients(levels, alpha, beta):
    g, h = gradient(1500, seed=2), gradient(1500, seed=3, scale=0.5)
    for norm, bucket_size in (("l2", 256), ("linf", 1000)):
        check(g, h, LevelTable(levels, 4), bucket_size, norm, alpha=alpha, beta=beta)


@pytest.mark.parametrize("n, numel, bucket_size", [
    (0, 0, 4), (1, 1, 1), (9, 9, 1), (5, 8, 2), (37, 48, 16), (0, 48, 16), (1, 64, 16),
    (3000, 3072, 1024), (2500, 6144, 4096), (9000, 16384, 8192)])
@pytest.mark.parametrize("norm", ["l2", "linf"])
def test_sizes_and_two_phase_padding(n, numel, bucket_size, norm):
    # numel > n: a two-phase chunk zero-padded past the bucket's end (docs/protocol.md §5.2);
    # n = 0 < numel: a chunk wholly in the padding; 8192: norms and S_k in several passes
    g, h = gradient(n, seed=n), gradient(n, seed=n + 1)
    got = check(g, h, LevelTable(uniform(3)), bucket_size, norm, numel=numel)
    assert got.memory.numel() == n
    assert got.payload.numel() == codec.payload_size(numel, 3, bucket_size)


@pytest.mark.parametrize("mode", ["one-pass", "three-pass"])
def test_a_send_of_two_phase_chunks_reads_the_device_once_for_all_parts(monkeypatch, mode):
    # the P chunks of a bucket, part k each: every payload and h' slice is the oracle's, and
    # ‖h'‖² is the parts' oracle sums added in part order (what the CPU glue adds)
    if mode == "three-pass":
        monkeypatch.setattr(ts, "LOCAL_MAX", 1)
    P, B, n = 4, 16, 150
    m = 48                                                 # chunk_numel(150, 4, 16)
    g, h = gradient(n, seed=5), gradient(n, seed=6, scale=0.2)
    table = LevelTable(uniform(2))
    send = ts.Send(table, bucket_size=B, norm="l2", alpha=ALPHA, beta=BETA, sizes=[m] * P,
                   device=DEVICE)
    gd, hd = on_device(g), on_device(h)
    out = torch.full((n,), float("nan"), device=DEVICE)
    payloads, squares = [], 0.0
    for k in range(P):
        lo, hi = min(k * m, n), min((k + 1) * m, n)
        key = StreamKey(7, rank=1, step=3, bucket=2, part=k)
        payloads.append(send.encode(gd[lo:hi], hd[lo:hi], out[lo:hi], key))
        want = oracle(g[lo:hi], h[lo:hi], table, B, "l2", numel=m, key=key)
        squares += want.memory_sum_of_squares
        assert bits_of(out[lo:hi]) == bits_of(want.memory)
        assert payloads[k].cpu().numpy().tobytes() == want.payload.tobytes()
    with pytest.raises(ValueError, match="4 parts"):
        send.encode(gd[:1], hd[:1], out[:1], KEY)
    finite, got = send.outcome()
    assert finite and np.float64(got).tobytes() == np.float64(squares).tobytes()
    assert bits_of(h) == bits_of(hd)                       # h read, never written


def test_the_entropy_coded_wire_and_checksums():
    # the codes of the fixed wire, so the same h'; the payload is codec.encode_entropy's
    table = LevelTable(uniform(3))
    n = 8000
    g, h = gradient(n, seed=3), gradient(n, seed=9, scale=0.1)
    for bucket_size, norm in ((256, "l2"), (250, "linf")):
        got = check(g, h, table, bucket_size, norm, coding="entropy")
        assert got.payload[codec.FLAGS_OFFSET] & codec.FLAG_ENTROPY
        fixed = check(g, h, table, bucket_size, norm, checksum=True)
        assert bits_of(fixed.memory) == bits_of(got.memory)
    check(g[:3000], None, table, 256, "l2", coding="entropy", checksum=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # numpy in the interpreter: inf
def test_huge_values_near_overflow():
    # x stays finite while g − g̃ overflows: h' holds ±Inf and says so (ErrorMemory resets it)
    # (buckets of 2: x = (−4e37, −3.4e38), n_k = 3.4e38, g̃_0 = ±n_k, g_0 − g̃_0 = 6.4e38 for −n_k)
    g = np.tile(np.array([3e38, -3.4e38], np.float32), 50)
    h = np.tile(np.array([-3.4e38, 0.0], np.float32), 50)
    for bucket_size in (2, 10):                           # one-pass, three-pass
        got = check(g, h, LevelTable(uniform(1)), bucket_size, "linf", alpha=1.0, beta=1.0)
        assert not got.memory_finite and torch.isinf(got.memory).any()
    big = gradient(1000, seed=4)
    big[600:700] *= np.float32(1e36)                      # large but finite norms
    big[:300] *= np.float32(1e-41)                        # float32 subnormals
    for norm in ("l2", "linf"):
        for bucket_size in (256, 1000):
            assert check(big, gradient(1000, seed=5), LevelTable(exponential(5)), bucket_size,
                         norm).memory_finite


# -------------------------------------------------------------------------- what cannot travel


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # numpy in the interpreter: inf, NaN
@pytest.mark.parametrize("g, h, travels", [
    (np.array([1, np.nan, 2, 3], np.float32), None, ()),                        # g not finite
    (np.array([1, 2, 3, 4], np.float32), np.array([0, 0, np.inf, 0], np.float32), ()),  # h
    (np.array([3e38, 1, 1, 1], np.float32), np.array([3e38, 0, 0, 0], np.float32), ()),  # x
    (np.array([3e38, 3e38, 1, 1], np.float32), np.zeros(4, np.float32), ("linf",)),  # l2 norm
], ids=["g-nan", "h-inf", "x-overflows", "l2-norm-overflows"])
@pytest.mark.parametrize("norm", ["l2", "linf"])
@pytest.mark.parametrize("bucket_size", [2, 3])
def test_a_bucket_that_cannot_travel(g, h, travels, norm, bucket_size):
    table = LevelTable(uniform(2))
    hd = on_device(h)
    kwargs = {"bucket_size": bucket_size, "norm": norm, "key": KEY}
    found = tc.try_encode_compensated(on_device(g), hd, 1.0, 1.0, table, **kwargs)
    if norm in travels:                                   # the L∞ norm of finite x is finite
        assert found is not None
        return
    assert found is None
    if h is not None:
        assert bits_of(hd) == bits_of(h)                   # h is never written
    with pytest.raises(ValueError) as fused_err:
        tc.encode_compensated(on_device(g), hd, 1.0, 1.0, table, **kwargs)
    with pytest.raises(ValueError) as oracle_err:
        codec.encode_compensated(g, h, 1.0, 1.0, table, bucket_size=bucket_size, norm=norm,
                                 uniforms=np.zeros(4, np.float32))
    assert str(fused_err.value) == str(oracle_err.value)


def test_one_bad_part_stops_the_whole_send():
    g = gradient(64, seed=1)
    g[40] = np.inf                                        # in part 1 of 2
    send = ts.Send(LevelTable(uniform(2)), bucket_size=16, norm="linf", alpha=ALPHA,
                   beta=BETA, sizes=[32, 32], device=DEVICE)
    gd, out = on_device(g), torch.empty(64, device=DEVICE)
    for k in range(2):
        send.encode(gd[32 * k:32 * (k + 1)], None, out[32 * k:32 * (k + 1)], KEY)
    assert send.outcome() is None


def test_arguments_are_checked():
    g, table = on_device(gradient(8)), LevelTable(uniform(2))
    kwargs = {"bucket_size": 4, "key": KEY}
    h = g.clone()
    with pytest.raises(ValueError, match="overlap"):
        tc.encode_compensated(g, h, 0.5, 0.9, table, memory_out=h, **kwargs)
    with pytest.raises(ValueError, match="at least"):
        tc.encode_compensated(g, None, 0.5, 0.9, table, numel=7, **kwargs)
    with pytest.raises(ValueError, match="h must be"):
        tc.encode_compensated(g, g[:4], 0.5, 0.9, table, **kwargs)
    with pytest.raises(ValueError, match="coding"):
        tc.encode_compensated(g, None, 0.5, 0.9, table, coding="x", **kwargs)
    with pytest.raises(TypeError, match="StreamKey"):
        tc.encode_compensated(g, None, 0.5, 0.9, table, bucket_size=4, key=3)
    send = ts.Send(table, bucket_size=4, norm="l2", alpha=0.5, beta=0.9, sizes=[8, 8],
                   device=DEVICE)
    send.encode(g, None, torch.empty_like(g), KEY)
    with pytest.raises(RuntimeError, match="1 of 2 parts"):
        send.outcome()
    out = torch.full((8,), float("nan"), device=DEVICE)
    got = tc.encode_compensated(g, g * 0.5, 0.5, 0.9, table, memory_out=out, **kwargs)
    assert got.memory is out and bool(torch.isfinite(out).all())


# ------------------------------------------------------------------------- the torch wire


def test_fusable_takes_the_triton_implementation(monkeypatch):
    class Wire:
        memory = object()

    raw = torch.zeros(8)
    for impl, fused in (("fused", True), ("triton", True), ("torch", False)):
        monkeypatch.setattr(kernels, "implementation_for", lambda device, impl=impl: impl)
        assert compensated.fusable(Wire, raw) is fused
    assert not compensated.fusable(Wire, raw.double())
    Wire.memory = None
    assert not compensated.fusable(Wire, raw)


#: wire_tests.BIG's layout, smaller: the Triton interpreter runs every program in Python.
WIRE_NUMELS = (1200, 7, 793)


@interpreter_only
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the NaN
@pytest.mark.parametrize("mode, P, coding, defer", [("allgather", 2, "fixed", False),
                                                    ("two_phase", 2, "entropy", False),
                                                    ("allgather", 2, "fixed", True),
                                                    ("two_phase", 2, "fixed", True),
                                                    ("allgather", 2, "entropy", True)])
def test_the_wire_with_the_triton_pass_is_bitwise_the_unfused_steps(monkeypatch, mode, P,
                                                                    coding, defer):
    # the torch wire's fused error feedback through Triton (CPU tensors under the interpreter
    # stand in for CUDA ones): results, memories, ‖h‖, statistics, taps and byte counts of three
    # steps are the unfused steps', and a NaN sends markers and leaves that rank's memory. With
    # a deferring wire, steps 1 and 2 (nothing recorded) keep each fixed-coded send's outcome on
    # the device until Wire.settle (markers chosen there, h' swapped in, h given back where
    # refused); entropy-coded rows are decoded on the device, their flag read at the settle
    from tests import test_torch_wire as wire_tests

    monkeypatch.setattr(kernels, "implementation_for", lambda device: "triton")
    calls, held = [], []
    parts = compensated._triton_parts
    monkeypatch.setattr(compensated, "_triton_parts", lambda *a: calls.append(1) or parts(*a))
    hold = wire_tests.wire_mod.Wire.hold_send
    monkeypatch.setattr(wire_tests.wire_mod.Wire, "hold_send",
                        lambda self, *a: held.append(a[0]) or hold(self, *a))
    grads = [wire_tests._grads(P, seed=s, numels=WIRE_NUMELS) for s in range(3)]
    if coding == "entropy":   # 3 coordinates in 4 zero: rows whose entropy-coded form is smaller
        for g in (g for ranks in grads for g in ranks):
            g[np.arange(g.size) % 4 != 0] = 0.0
    grads[1][0][100:300] = 0.0
    grads[1][1][5:9] = -0.0
    grads[2][1][WIRE_NUMELS[0] + 1] = np.nan

    def factory():
        return horovod_aq.ErrorFeedback(horovod_aq.ALQ(
            bits=3, bucket_size=wire_tests.B, seed=wire_tests.SEED, nonfinite="skip"),
            alpha=0.5103, beta=0.9)
    fused = wire_tests._ef_steps(monkeypatch, True, mode, P, coding, grads, factory=factory,
                                 defer=defer, numels=WIRE_NUMELS)
    assert calls
    coded = [fmt.parse_header(p.numpy()).flags & fmt.FLAG_ENTROPY
             for step in fused for taps in step["tapped"].values() for _, _, p in taps]
    # the allgather rows are entropy-coded; two-phase chunks of 1008 coordinates stay
    # fixed-width, their entropy-coded form being no smaller (docs/protocol.md §5.4)
    assert any(coded) == (coding == "entropy" and mode == "allgather"), coded
    holds = defer and coding == "fixed"   # an entropy-coded send is decided at once
    assert len(held) == (2 * P if holds else 0)
    unfused = wire_tests._ef_steps(monkeypatch, False, mode, P, coding, grads, factory=factory,
                                   defer=defer, numels=WIRE_NUMELS)
    if holds:   # the tap also saw the payload that rank 1's marker replaced at step 2 (its
        # re-encoded chunk, whose marker is put in place at the settle, both runs tap)
        kept = [e for e in fused[2]["tapped"][1] if e[0] == P and mode == "two_phase"]
        fused[2]["tapped"][1] = kept
        if not kept:
            del fused[2]["tapped"][1]
    wire_tests._assert_same_steps(fused, unfused)
    assert all(np.isnan(r).all() for r in fused[2]["results"])
    wire_tests._same_bits(fused[2]["memory"][1], fused[1]["memory"][1])


#: (first, last + 1) of g → value; where h is 3e38 (x = g + α·h overflows there, g finite).
FIRST_BAD = {
    "none": ([], None),
    "nan in g, late": ([((150, 151), np.nan)], None),
    "inf in x before a nan in g": ([((170, 171), np.nan)], (40, 41)),
    "x overflows mid-bucket": ([], (37, 38)),
    "a bucket's norm overflows": ([((64, 96), 2e38)], None),
    "inf in g of the last chunk": ([((199, 200), -np.inf)], None),
}


@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")
@pytest.mark.parametrize("case", list(FIRST_BAD))
@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("memory", [True, False], ids=["memory", "plain"])
def test_the_send_puts_the_hosts_markers_in_place(case, parts, memory):
    # Send.decide (the kernel's atomic minima of g, x and the bucket norms, then one marker
    # launch) is packed.send step 2 on the host for g and x = g + α·h (x = g without memory),
    # over one part or three chunks: the payloads unchanged, or the host's markers naming
    # offset + the host's element, byte for byte
    from horovod_aq.packed.marker import MAX_MARKER_INDEX
    from horovod_aq.packed.send import first_bad_element

    B, n, offset = 16, 200, 2**32 - 120
    g, h = gradient(n, seed=5), gradient(n, seed=6, scale=0.3)
    g_at, h_at = FIRST_BAD[case]
    for (lo, hi), value in g_at:
        g[lo:hi] = value
    if h_at is not None:
        h[h_at[0]:h_at[1]] = 3e38
        g[h_at[0]:h_at[1]] = 3e38
    alpha = np.float32(ALPHA)
    with np.errstate(over="ignore", invalid="ignore"):
        x = (g + alpha * h).astype(np.float32) if memory else g
    m = n if parts == 1 else 80   # three chunks of five buckets, the last one padded
    table = LevelTable(uniform(3))
    send = ts.Send(table, bucket_size=B, norm="l2", alpha=ALPHA, beta=BETA, sizes=[m] * parts,
                   device=DEVICE, memory=memory)
    gt, ht = on_device(g), on_device(h)
    out = torch.empty_like(gt)
    span = [slice(k * m, min(n, (k + 1) * m)) for k in range(parts)]
    payloads = [send.encode(gt[s], ht[s] if memory else None, out[s] if memory else None, KEY)
                for s in span]
    kept = [p.cpu().numpy().copy() for p in payloads]

    def first_nonfinite(v):
        bad = ~np.isfinite(v)
        return int(np.argmax(bad)) if bad.any() else None

    def norms(v):
        with np.errstate(over="ignore"):
            return np.sqrt(np.square(np.concatenate(
                [v, np.zeros(-v.size % B, np.float32)]).astype(np.float64).reshape(-1, B)
                ).sum(axis=1)).astype(np.float32)

    want = first_bad_element(g, x, first_nonfinite=first_nonfinite,
                             peak=lambda v: float(np.max(np.abs(v))), norms=norms,
                             bucket_size=B)
    outcome = send.outcome()
    sent = send.decide(offset=offset)
    assert len(sent) == parts
    for k, got in enumerate(sent):
        expected = kept[k] if want is None else codec.nonfinite_payload(
            m, table, B, "l2", min(offset + want, MAX_MARKER_INDEX))
        assert got.cpu().numpy().tobytes() == expected.tobytes()
    if want is None and not memory:   # the plain encode's payloads are the oracle's
        for k, s in enumerate(span):
            chunk = np.zeros(m, np.float32)
            chunk[:s.stop - s.start] = g[s]
            want_k = codec.encode(chunk, table, bucket_size=B, norm="l2", key=KEY)
            assert kept[k].tobytes() == want_k.tobytes()
    assert (outcome is None) == (want is not None)


#: Device work per bucket on one rank of a settling wire with Triton's kernels, fixed codes and
#: nothing recorded (P = 2): the send (submit) and the rest (advance, finish, settle), in
#: kernels and torch operations that launch one (docs/gpu.md §1, "Launches per bucket"). Views,
#: allocations and the collectives themselves are not counted; settle's three are per step.
LAUNCHES = {("allgather", True, False): (4, 7), ("allgather", False, False): (4, 7),
            ("two_phase", True, False): (6, 17), ("two_phase", False, False): (6, 17),
            # the optimizer's buckets, with presence masks: their union stays on the device
            ("allgather", False, True): (5, 12), ("two_phase", False, True): (8, 26)}


@interpreter_only
@pytest.mark.parametrize("mode, feedback, masked", list(LAUNCHES))
def test_a_settled_bucket_launches_a_handful_of_kernels(monkeypatch, mode, feedback, masked):
    # counted under the interpreter: every aten operation that is not a view or an allocation,
    # and every Triton kernel (the interpreter's run), while rank 0's wire works on the bucket;
    # the loopback's own concatenations stand for the collectives and are not counted
    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests import test_torch_wire as wire_tests

    free = {"empty", "empty_like", "empty_strided", "view", "_unsafe_view", "slice", "select",
            "as_strided", "alias", "detach", "lift_fresh", "unsqueeze", "expand", "t",
            "reshape", "split", "split_with_sizes", "unbind", "squeeze", "narrow"}
    counted: list[str] = []
    state = {"on": False}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._overloadpacket.__name__
            if state["on"] and name not in free:
                counted.append(name)
            return func(*args, **(kwargs or {}))

    def uncounted(fn):
        def run(*args, **kwargs):
            was, state["on"] = state["on"], False
            try:
                return fn(*args, **kwargs)
            finally:
                state["on"] = was
        return run

    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        if state["on"]:
            counted.append(self.fn.__name__)
        return uncounted(run)(self, *args, **kwargs)
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted_run)
    monkeypatch.setattr(wire_tests, "_concat", uncounted(torch.cat))
    monkeypatch.setattr(kernels, "implementation_for", lambda device: "triton")

    def factory():
        q = horovod_aq.QSGD(bits=3, bucket_size=wire_tests.B, seed=wire_tests.SEED)
        return horovod_aq.ErrorFeedback(q, alpha=ALPHA, beta=BETA) if feedback else q

    P = 2
    _, ranks = wire_tests._ranks(P, mode, factory, defer=True, masked=masked)
    seen: dict[str, list[str]] = {}
    with Count():
        for step in range(2):   # the second step: memories exist, caches are warm
            net = wire_tests.Network(P)
            for comp, wire, bucket in ranks:
                comp.step, wire.comm.net = step, net
                bucket.reset()
            grads = wire_tests._grads(P, seed=step)
            seen = {"send": [], "rest": []}
            for stage, work in (("send", [lambda w, b, g=g: w.submit(b, torch.from_numpy(g))
                                          for g in grads]),
                                ("rest", [lambda w, b: w.advance(b)] * P),
                                ("rest", [lambda w, b: (w.finish(b), w.settle([b]))] * P)):
                for r, ((_, wire, bucket), do) in enumerate(zip(ranks, work)):
                    counted.clear()
                    state["on"] = r == 0
                    do(wire, bucket)
                    state["on"] = False
                    if r == 0:
                        seen[stage] += counted
    # no host read: an item() (a 0-dim tensor used as an index, say) would show here
    assert "_local_scalar_dense" not in seen["send"] + seen["rest"]
    got = (len(seen["send"]), len(seen["rest"]))
    assert got == LAUNCHES[(mode, feedback, masked)], " ".join(f"{k}: {v}" for k, v in seen.items())


#: Host reads of rank 0 per entropy-coded bucket (the optimizer's: masked, P = 2) on a settling
#: wire with Triton's kernels, by stage (docs/gpu.md §1): the send reads every part's histogram
#: with its outcome in one copy, then every part's words' number in another
#: (``entropy.entropy_of_parts``); two-phase's advance reads its alltoall rows' headers, then
#: their flag with the re-encode's histogram and outcome, then the words' number; the
#: allgathers' rows are checked from the host copy the collective made to delimit them.
#: Before: 3 + 0 (allgather), 5 + 5 (two-phase, P = 2).
ENTROPY_READS = {"allgather": {"send": 2, "advance": 0, "finish": 0, "settle": 1},
                 "two_phase": {"send": 2, "advance": 3, "finish": 0, "settle": 1}}


@interpreter_only
@pytest.mark.parametrize("mode", list(ENTROPY_READS))
def test_an_entropy_coded_bucket_reads_the_host_this_often(monkeypatch, mode):
    # what would wait for a CUDA device, counted on CPU tensors: copies to the host (cpu(),
    # tolist()), item() and bool() (_local_scalar_dense), boolean indexing (its output's size)
    # and torch.bincount (its input's minimum and maximum); the host-to-device copies, which a
    # CPU tensor cannot show, go through payload.host_to_device and device_constant
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests import test_torch_wire as wire_tests

    reads: dict[str, int] = {}
    state = {"stage": None}

    def counted(method):
        def run(self, *args, **kwargs):
            if state["stage"]:
                reads[state["stage"]] = reads.get(state["stage"], 0) + 1
            return method(self, *args, **kwargs)
        return run

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._overloadpacket.__name__
            bool_index = name == "index" and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
            if state["stage"] and (name in ("_local_scalar_dense", "bincount") or bool_index):
                reads[state["stage"]] = reads.get(state["stage"], 0) + (
                    2 if name == "bincount" else 1)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(torch.Tensor, "cpu", counted(torch.Tensor.cpu))
    monkeypatch.setattr(torch.Tensor, "tolist", counted(torch.Tensor.tolist))
    monkeypatch.setattr(kernels, "implementation_for", lambda device: "triton")
    P = 2
    _, ranks = wire_tests._ranks(P, mode, wire_tests._qsgd, coding="entropy",
                                 numels=wire_tests.BIG, masked=True, defer=True)
    grads = wire_tests._grads(P, numels=wire_tests.BIG)
    with Reads():
        for stage, do in (("send", lambda w, b, g: w.submit(b, torch.from_numpy(g))),
                          ("advance", lambda w, b, g: w.advance(b)),
                          ("finish", lambda w, b, g: w.finish(b)),
                          ("settle", lambda w, b, g: w.settle([b]))):
            for r, ((_, wire, bucket), g) in enumerate(zip(ranks, grads)):
                state["stage"] = stage if r == 0 else None
                do(wire, bucket, g)
                state["stage"] = None
    assert {stage: reads.get(stage, 0) for stage in ENTROPY_READS[mode]} == ENTROPY_READS[mode]
    assert all(bucket.result is not None for _, _, bucket in ranks)


@cuda_only
@pytest.mark.parametrize("mode", ["allgather", "two_phase"])
def test_cuda_wire_fused_is_bitwise_the_unfused_steps(monkeypatch, mode):
    # CUDA gradients on the loopback wire: three steps through the Triton pass (the real
    # implementation_for) and through the unfused steps give the same averages and memories
    from tests import test_torch_wire as wire_tests

    P, fusable = 3, _FUSABLE
    calls = []
    parts = compensated._triton_parts
    monkeypatch.setattr(compensated, "_triton_parts", lambda *a: calls.append(1) or parts(*a))

    def steps(fused):
        monkeypatch.setattr(compensated, "fusable", fusable if fused else lambda w, r: False)
        _, ranks = wire_tests._ranks(P, mode, lambda: horovod_aq.ErrorFeedback(horovod_aq.ALQ(
            bits=3, bucket_size=wire_tests.B, seed=wire_tests.SEED)), numels=wire_tests.BIG)
        seen = []
        for step in range(3):
            net = wire_tests.Network(P)
            for comp, wire, bucket in ranks:
                comp.step, wire.comm.net = step, net
                bucket.reset()
            grads = wire_tests._grads(P, seed=step, numels=wire_tests.BIG)
            for (comp, wire, bucket), g in zip(ranks, grads):
                wire.submit(bucket, torch.from_numpy(g).to(DEVICE))
            for comp, wire, bucket in ranks:
                wire.advance(bucket)
            seen.append([wire.finish(bucket) for _, wire, bucket in ranks]
                        + [comp.error_memory.memory[bucket.name].clone()
                           for comp, _, bucket in ranks])
        return seen

    fused, unfused = steps(True), steps(False)
    assert len(calls) == 3 * P, len(calls)
    for got, want in zip(fused, unfused, strict=True):
        for a, b in zip(got, want, strict=True):
            assert a.device.type == DEVICE.type and bits_of(a) == bits_of(b)


# ---------------------------------------------------------------------------- compiled (GPU)


@pytest.mark.parametrize("arch", [80, 90])
def test_the_kernel_compiles_for_the_gpu_without_fma(arch):
    # PTX and cubin for sm_80 / sm_90 without a GPU (benchmarks/gpu_check.py's instruction
    # check: IEEE division, float64 sqrt, no fused multiply-add, no flush-to-zero)
    import triton.backends
    if "nvidia" not in getattr(triton.backends, "backends", {"nvidia": None}):
        pytest.skip("this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--ptx-only", "--arch", str(arch), "--ptx-kernels",
                           "_send_kernel,_marker_kernel,_histogram_kernel"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("\t") for line in proc.stdout.strip().splitlines()]
    assert sorted({row[0] for row in rows}) == ["_histogram_kernel", "_marker_kernel",
                                                "_send_kernel"]
    assert len(rows) >= 4
    assert all(row[-1] == "ok" for row in rows), rows


@cuda_only
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("bucket_size", [256, 1000])
def test_cuda_large_inputs_are_the_oracle(bits, bucket_size):
    n = (1 << 22) + 3
    g, h = gradient(n, seed=bits), gradient(n, seed=bits + 1, scale=0.3)
    for norm in ("l2", "linf"):
        check(g, h, LevelTable(uniform(bits)), bucket_size, norm, numel=n + 1000)


@cuda_only
@pytest.mark.parametrize("bucket_size", [256, 1000])
def test_cuda_send_waits_for_the_host_once(bucket_size):
    # launching every part of a two-phase bucket makes no host synchronisation; outcome() one
    n, P = 1 << 20, 4
    m = n // P
    g, h = on_device(gradient(n, seed=1)), on_device(gradient(n, seed=2, scale=0.1))
    out = torch.empty_like(g)
    send = ts.Send(LevelTable(uniform(3)), bucket_size=bucket_size, norm="l2", alpha=ALPHA,
                   beta=BETA, sizes=[m] * P, device=DEVICE)
    tc.try_encode_compensated(g[:m], h[:m], ALPHA, BETA, LevelTable(uniform(3)),
                              bucket_size=bucket_size, key=KEY)   # compiled before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k in range(P):
            send.encode(g[k * m:(k + 1) * m], h[k * m:(k + 1) * m], out[k * m:(k + 1) * m],
                        StreamKey(1, rank=0, step=0, bucket=0, part=k))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert send.outcome() is not None
