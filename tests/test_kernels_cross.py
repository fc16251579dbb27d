"""Byte equality numpy ↔ PyTorch ↔ TensorFlow with shared uniforms, and cross-decoding.

The numpy codec is the oracle: every framework must produce its bytes exactly and decode its
payloads (and each other's) to the same float32 bits. Frameworks that are not installed are
skipped; the oracle comparisons still run for the others.
"""

from __future__ import annotations

import contextlib
import itertools
import struct

import numpy as np
import pytest

from horovod_aq import codec
from horovod_aq.codec import PayloadError, fused
from horovod_aq.codec.stream import StreamKey
from horovod_aq.levels.table import LevelTable

# ------------------------------------------------------------------------------ framework shims


class Numpy:
    name = "numpy"

    def encode(self, x, table, bucket, norm, u):
        return codec.encode(x, table, bucket_size=bucket, norm=norm, uniforms=u)

    def decode(self, payload, table):
        return codec.decode(payload, table)

    def decode_average(self, rows, table):
        return codec.decode_average(rows, table)


class Torch:
    name = "torch"

    def __init__(self):
        import torch

        from horovod_aq.torch import kernels

        self.torch, self.k = torch, kernels

    def tensor(self, x):
        t = self.torch
        if x.dtype.name == "bfloat16" or getattr(x, "_bf16", False):
            return t.from_numpy(np.asarray(x, np.float32)).to(t.bfloat16)
        return t.from_numpy(np.ascontiguousarray(x))

    def encode(self, x, table, bucket, norm, u, bf16=False):
        xt = self.tensor(x)
        if bf16:
            xt = xt.to(self.torch.bfloat16)
        return self.k.encode(xt, table, bucket_size=bucket, norm=norm,
                             uniforms=self.torch.from_numpy(u)).numpy()

    def decode(self, payload, table):
        return self.k.decode(self.torch.from_numpy(payload), table).numpy()

    def decode_average(self, rows, table):
        return self.k.decode_average(self.torch.from_numpy(rows), table).numpy()


class TensorFlow:
    name = "tf"

    def __init__(self, in_function=False):
        import tensorflow as tf

        from horovod_aq.tensorflow import kernels

        self.tf, self.k, self.in_function = tf, kernels, in_function
        if in_function:
            self.name = "tf.function"

    def encode(self, x, table, bucket, norm, u, bf16=False):
        tf, k = self.tf, self.k
        xt = tf.constant(x)
        if bf16:
            xt = tf.cast(xt, tf.bfloat16)
        if not self.in_function:
            return k.encode(xt, table, bucket_size=bucket, norm=norm, uniforms=u).numpy()
        levels = tf.Variable(k.levels_tensor(table))  # as an integration holds them
        header = tf.Variable(k.header_tensor(x.size, table, bucket, norm))
        fn = tf.function(lambda a, b: k.encode_with(a, levels, header, bits=table.bits,
                                                    bucket_size=bucket, norm=norm, uniforms=b))
        return fn(xt, tf.constant(u)).numpy()

    def _settings(self, payload):
        h = codec.parse_header(payload)
        return {"numel": h.numel, "bucket_size": h.bucket_size, "norm": h.norm}

    def decode(self, payload, table):
        tf, k = self.tf, self.k
        if not self.in_function:
            return k.decode(tf.constant(payload), table).numpy()
        kw = self._settings(payload)
        return tf.function(lambda p: k.decode(p, table, **kw))(tf.constant(payload)).numpy()

    def decode_average(self, rows, table):
        tf, k = self.tf, self.k
        if not self.in_function:
            return k.decode_average(tf.constant(rows), table).numpy()
        kw = self._settings(rows[0])
        return tf.function(lambda p: k.decode_average(p, table, **kw))(tf.constant(rows)).numpy()


def make(name):
    if name == "torch":
        pytest.importorskip("torch")
        pytest.importorskip("horovod_aq.torch.kernels")
        return Torch()
    pytest.importorskip("tensorflow")
    pytest.importorskip("horovod_aq.tensorflow.kernels")
    return TensorFlow(in_function=name == "tf.function")


# ------------------------------------------------------------------------------------- cases


def table_for(kind: str, bits: int) -> LevelTable:
    if kind == "ternary":
        return LevelTable([-1.0, 0.0, 1.0], 2)
    if kind == "exp":
        mags = 0.5 ** np.arange(2 ** (bits - 1) - 1, -1, -1)
        return LevelTable(np.concatenate([-mags[::-1], mags]), 7)
    if kind == "random":
        inner = np.sort(np.random.default_rng(bits).uniform(-1, 1, 2**bits - 2))
        return LevelTable(np.concatenate([[-1.0], inner, [1.0]]), 3)
    return LevelTable(np.linspace(-1, 1, 2**bits), 1)


SHAPES = [  # (shape, bucket): n = 1, n < B, n % B != 0, B = 1, B = n, huge B, 2-D
    ((1,), 8), ((7,), 3), ((3, 5), 4), ((1000,), 64), ((33, 31), 100), ((2049,), 512),
    ((10,), 1), ((300,), 300), ((129,), 1 << 20),
]
DTYPES = ["float32", "float16", "bfloat16", "float64"]
KINDS = ["uniform", "random", "exp"]


def cases():
    out = []
    counter = itertools.count()
    for bits in range(1, 9):
        for shape, bucket in SHAPES:
            i = next(counter)
            kind = "ternary" if bits == 2 and i % 3 == 0 else KINDS[i % 3]
            out.append((bits, shape, bucket, ("l2", "linf")[i % 2], DTYPES[i % 4], kind, i))
    return out


CASES = cases()


def case_input(shape, bucket, dtype, seed):
    """(input for numpy, uniforms, bf16 flag); zero buckets and exact zeros included."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    x = (rng.standard_normal(n) * rng.lognormal(0, 2, n)).astype(np.float64)
    if n >= 2 * bucket:
        x[bucket : 2 * bucket] = 0.0  # a whole zero bucket
    x[rng.random(n) < 0.05] = 0.0
    u = rng.random(n, dtype=np.float32)
    u[:3] = 0.0  # extremes of [0, 1)
    if dtype == "float64":
        return x.reshape(shape), u, False  # not representable in float32: tests the rounding
    x32 = x.astype(np.float32)
    if dtype == "float16":
        return x32.astype(np.float16).reshape(shape), u, False
    if dtype == "bfloat16":  # round to bfloat16 (nearest even) in float32, so numpy sees it too
        bits = x32.view(np.uint32)
        bits = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) & np.uint32(0xFFFF0000)
        return bits.view(np.float32).reshape(shape), u, True
    return x32.reshape(shape), u, False


def f32_bits(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# ------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("framework", ["torch", "tf"])
@pytest.mark.parametrize("bits, shape, bucket, norm, dtype, kind, seed", CASES,
                         ids=[f"b{c[0]}-{'x'.join(map(str, c[1]))}-B{c[2]}-{c[3]}-{c[4]}-{c[5]}"
                              for c in CASES])
def test_same_bytes_as_numpy_and_same_decoded_bits(framework, bits, shape, bucket, norm, dtype,
                                                   kind, seed):
    fw = make(framework)
    table = table_for(kind, bits)
    x, u, bf16 = case_input(shape, bucket, dtype, seed)
    expected = codec.encode(x, table, bucket_size=bucket, norm=norm, uniforms=u)
    assert expected.size == codec.payload_size(x.size, table.bits, bucket)
    got = fw.encode(x, table, bucket, norm, u, bf16=bf16)
    assert got.dtype == np.uint8 and np.array_equal(got, expected)
    assert np.array_equal(f32_bits(fw.decode(expected, table)),
                          f32_bits(codec.decode(expected, table)))


@pytest.mark.parametrize("bits", range(1, 9))
def test_tf_function_same_bytes(bits):
    fw = make("tf.function")
    shape, bucket = ((2049,), 100) if bits % 2 else ((33, 31), 64)
    table = table_for(KINDS[bits % 3], bits)
    x, u, bf16 = case_input(shape, bucket, DTYPES[bits % 4], seed=bits)
    norm = ("l2", "linf")[bits % 2]
    expected = codec.encode(x, table, bucket_size=bucket, norm=norm, uniforms=u)
    assert np.array_equal(fw.encode(x, table, bucket, norm, u, bf16=bf16), expected)
    assert np.array_equal(f32_bits(fw.decode(expected, table)),
                          f32_bits(codec.decode(expected, table)))


def available():
    out = [Numpy()]
    for name in ("torch", "tf"):
        try:
            out.append(make(name))
        except pytest.skip.Exception:
            pass
    return out


@pytest.mark.parametrize("bits, n, bucket", [(3, 1001, 64), (1, 3, 2), (8, 4097, 512),
                                             (5, 77, 1000)])
def test_each_framework_decodes_the_others_payloads(bits, n, bucket):
    frameworks = available()
    if len(frameworks) < 2:
        pytest.skip("needs torch or tensorflow")
    table = table_for("random", bits)
    x, u, _ = case_input((n,), bucket, "float32", seed=n)
    payloads = {fw.name: fw.encode(x, table, bucket, "l2", u) for fw in frameworks}
    reference = f32_bits(codec.quantize(x, table, bucket_size=bucket, uniforms=u))
    for producer, consumer in itertools.product(frameworks, frameworks):
        decoded = consumer.decode(payloads[producer.name], table)
        assert np.array_equal(f32_bits(decoded), reference), (producer.name, consumer.name)


@pytest.mark.parametrize("framework", ["torch", "tf", "tf.function"])
@pytest.mark.parametrize("world, bits, n, bucket", [(1, 2, 500, 64), (3, 3, 1001, 100),
                                                    (4, 8, 257, 16), (5, 1, 3, 2)])
def test_decode_average_is_bitwise_identical(framework, world, bits, n, bucket):
    fw = make(framework)
    table = table_for("uniform", bits)
    rows = np.stack([codec.encode(case_input((n,), bucket, "float32", seed=p)[0], table,
                                  bucket_size=bucket, seed=p) for p in range(world)])
    expected = codec.decode_average(rows, table)
    assert np.array_equal(f32_bits(fw.decode_average(rows, table)), f32_bits(expected))


@pytest.mark.parametrize("framework", ["torch", "tf"])
def test_empty_gradient(framework):
    fw = make(framework)
    table = table_for("uniform", 3)
    x = np.zeros(0, np.float32)
    payload = fw.encode(x, table, 16, "l2", np.zeros(0, np.float32))
    assert np.array_equal(payload, codec.encode(x, table, bucket_size=16, uniforms=[]))
    assert fw.decode(payload, table).shape == (0,)


# ------------------------------------------------------- refusal parity, checksums, forged headers
# Every decoder refuses what the numpy oracle refuses, with its exception and message, and
# decodes what it accepts to the same bits: the oracle, the fused CPU kernel, the torch dispatch
# (fused on CPU), the torch ops, Triton (interpreter), TensorFlow eagerly (fused decode_average,
# ops decode) and with the ops forced, and inside tf.function (errors translated back).


PARITY_TABLE = LevelTable([-1.0, -0.2, 0.1, 0.7, 1.0], 4)  # 3 bits, 5 levels: codes 5..7 invalid


@contextlib.contextmanager
def _implementation(module, value):
    old = module.IMPLEMENTATION
    module.IMPLEMENTATION = value
    try:
        yield
    finally:
        module.IMPLEMENTATION = old


def parity_decoders():
    """{name: (decode(payload, table) -> float32 array, decode_average(rows, table), graph)}"""
    out = {"numpy": (codec.decode, codec.decode_average, False),
           "fused": (fused.decode, fused.decode_average, False)}
    try:
        import torch

        from horovod_aq.torch import kernels as tk
    except ImportError:
        tk = None
    if tk is not None:
        def torch_op(op, impl):
            def run(data, table):
                with _implementation(tk, impl):
                    return getattr(tk, op)(torch.from_numpy(data), table).numpy()
            return run

        out["torch"] = (torch_op("decode", "auto"), torch_op("decode_average", "auto"), False)
        out["torch-ops"] = (torch_op("decode", "ops"), torch_op("decode_average", "ops"), False)
        from horovod_aq.torch import triton_kernels

        if triton_kernels.available() and triton_kernels.interpreting():
            out["triton"] = (
                lambda p, t: triton_kernels.decode(torch.from_numpy(p), t).numpy(),
                lambda r, t: triton_kernels.decode_average(torch.from_numpy(r), t).numpy(),
                False)
    try:
        import tensorflow as tf

        from horovod_aq.tensorflow import kernels as tfk
        from horovod_aq.tensorflow.checks import translate_error
    except ImportError:
        tfk = None
    if tfk is not None:
        def tf_op(op, impl, graph):
            def run(data, table):
                fn = getattr(tfk, op)
                with _implementation(tfk, impl):
                    if not graph:
                        return fn(tf.constant(data), table).numpy()
                    h = codec.parse_header(data if data.ndim == 1 else data[0])
                    kw = {"numel": h.numel, "bucket_size": h.bucket_size, "norm": h.norm}
                    try:
                        return tf.function(lambda p: fn(p, table, **kw))(tf.constant(data)).numpy()
                    except tf.errors.InvalidArgumentError as err:
                        raise translate_error(err) from None
            return run

        for impl, suffix in (("auto", ""), ("ops", "-ops")):
            out["tf" + suffix] = (tf_op("decode", impl, False),
                                  tf_op("decode_average", impl, False), False)
            out["tf.function" + suffix] = (tf_op("decode", impl, True),
                                           tf_op("decode_average", impl, True), True)
    return out


def _parity_payloads():
    x = np.random.default_rng(3).standard_normal(100).astype(np.float32)
    plain = codec.encode(x, PARITY_TABLE, bucket_size=16, key=StreamKey(seed=5))
    sealed = codec.encode(x, PARITY_TABLE, bucket_size=16, key=StreamKey(seed=5), checksum=True)
    other = codec.encode(x[::-1].copy(), PARITY_TABLE, bucket_size=16, key=StreamKey(seed=6))
    return plain, sealed, other


def _set_norm(payload, bucket, value):
    bad = payload.copy()
    at = 32 + 4 * bucket
    bad[at:at + 4] = np.frombuffer(np.float32(value).tobytes(), np.uint8)
    return bad


def _flip(payload, byte, bit):
    bad = payload.copy()
    bad[byte] ^= np.uint8(1 << bit)
    return bad


def _with(payload, byte, value):
    bad = payload.copy()
    bad[byte] = value
    return bad


#: (name, kind, make(plain, sealed) -> corrupted payload, message fragment); kind "data" errors
#: are PayloadErrors everywhere (in tf.function too, translated); "header" errors in a graph
#: are the graph's own assertions (only their type is compared there)
CORRUPTIONS = [
    ("negative-norm", "data", lambda p, s: _set_norm(p, 2, -1.0), "negative or non-finite"),
    ("nan-norm", "data", lambda p, s: _set_norm(p, 0, np.nan), "negative or non-finite"),
    ("inf-norm", "data", lambda p, s: _set_norm(p, 6, np.inf), "negative or non-finite"),
    ("code-past-the-table", "data", lambda p, s: _with(p, -1, 0xFF), "holds code 7"),
    ("code-bit-flip-checksummed", "data", lambda p, s: _flip(s, 80, 3), "checksum mismatch"),
    ("norm-exponent-flip-checksummed", "data", lambda p, s: _flip(s, 35, 4),
     "checksum mismatch"),
    ("crc-field-flip", "data", lambda p, s: _flip(s, 29, 0), "checksum mismatch"),
    ("checksum-flag-without-crc", "data", lambda p, s: _with(p, 5, 2), "checksum mismatch"),
    ("flags-3", "header", lambda p, s: _with(p, 5, 3), "reserved fields set"),
    ("flags-8", "header", lambda p, s: _with(p, 5, 8), "reserved fields set"),
    ("reserved-without-flag", "header", lambda p, s: _with(p, 30, 1), "reserved fields set"),
    ("checksummed-marker", "header", lambda p, s: _with(codec.nonfinite_payload(
        100, PARITY_TABLE, 16, "l2", 7), 5, 3), "reserved fields set"),
]


def _raised(call):
    try:
        call()
    except Exception as err:  # noqa: BLE001 - compared below
        return err
    return None


@pytest.mark.parametrize("name, kind, make, fragment", CORRUPTIONS,
                         ids=[c[0] for c in CORRUPTIONS])
def test_every_decoder_refuses_what_the_oracle_refuses(name, kind, make, fragment):
    plain, sealed, other = _parity_payloads()
    bad = make(plain, sealed)
    single = _raised(lambda: codec.decode(bad, PARITY_TABLE))
    average = _raised(lambda: codec.decode_average(np.stack([other, bad]), PARITY_TABLE))
    assert isinstance(single, PayloadError) and fragment in str(single), single
    assert str(average) == f"rank 1: {single}" and average.rank == 1
    for decoder, (decode, decode_average, graph) in parity_decoders().items():
        for call, want in ((lambda: decode(bad, PARITY_TABLE), single),
                           (lambda: decode_average(np.stack([other, bad]), PARITY_TABLE),
                            average)):
            got = _raised(call)
            if graph and kind == "header":
                assert got is not None, decoder
                continue
            assert type(got) is type(want) and str(got) == str(want), (decoder, got, want)
            assert getattr(got, "rank", None) == getattr(want, "rank", None), decoder


def test_every_decoder_accepts_what_the_oracle_accepts():
    """Checksummed payloads, a −0.0 norm, and a forged but valid header: B = 2³² − 1 for one
    element (memory bounded by n, not by B)."""
    plain, sealed, other = _parity_payloads()
    header = bytearray(plain[:32])
    header[16:20] = struct.pack("<I", 2**32 - 1)
    header[20:28] = struct.pack("<Q", 1)
    forged = np.concatenate([np.frombuffer(bytes(header), np.uint8),
                             np.frombuffer(np.float32(2.5).tobytes(), np.uint8),
                             np.array([3], np.uint8)])
    assert forged.size == codec.payload_size(1, 3, 2**32 - 1)
    cases = {"sealed": (sealed, np.stack([other, sealed])),
             "minus-zero-norm": (_set_norm(plain, 1, -0.0), np.stack([plain, plain])),
             "forged-bucket-size": (forged, np.stack([forged, forged]))}
    for case, (payload, rows) in cases.items():
        want = f32_bits(codec.decode(payload, PARITY_TABLE))
        want_avg = f32_bits(codec.decode_average(rows, PARITY_TABLE))
        for decoder, (decode, decode_average, _) in parity_decoders().items():
            assert np.array_equal(f32_bits(decode(payload, PARITY_TABLE)), want), (case, decoder)
            assert np.array_equal(f32_bits(decode_average(rows, PARITY_TABLE)), want_avg), \
                (case, decoder)
    assert float(codec.decode(forged, PARITY_TABLE)[0]) == np.float32(2.5) * np.float32(0.7)


def test_the_oracle_decodes_a_forged_bucket_size_in_bounded_memory():
    import tracemalloc

    table = table_for("uniform", 3)
    x = np.float32([0.25])
    for bucket in (2**32 - 1, 2**31 + 5):
        payload = codec.encode(x, table, bucket_size=bucket, seed=0)  # encoding is bounded too
        tracemalloc.start()
        try:
            codec.decode(payload, table)
            codec.decode_average(np.stack([payload] * 3), table)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, peak


def parity_encoders():
    """{name: encode(x, table, bucket_size, key, checksum) -> uint8 array}"""
    out = {"numpy": lambda x, t, b, k, c: codec.encode(x, t, bucket_size=b, key=k, checksum=c),
           "fused": lambda x, t, b, k, c: fused.encode(x, t, bucket_size=b, key=k, checksum=c)}
    try:
        import torch

        from horovod_aq.torch import kernels as tk
    except ImportError:
        tk = None
    if tk is not None:
        def torch_encode(impl):
            def run(x, t, b, k, c):
                with _implementation(tk, impl):
                    return tk.encode(torch.from_numpy(x), t, bucket_size=b, key=k,
                                     checksum=c).numpy()
            return run

        out["torch"] = torch_encode("auto")
        out["torch-ops"] = torch_encode("ops")
        from horovod_aq.torch import triton_kernels, triton_send

        if triton_kernels.available() and triton_kernels.interpreting():
            out["triton"] = lambda x, t, b, k, c: triton_send.encode(
                torch.from_numpy(x), t, bucket_size=b, key=k, checksum=c).numpy()
    try:
        import tensorflow as tf

        from horovod_aq.tensorflow import kernels as tfk
    except ImportError:
        tfk = None
    if tfk is not None:
        def tf_encode(impl, graph):
            def run(x, t, b, k, c):
                with _implementation(tfk, impl):
                    if not graph:
                        return tfk.encode(tf.constant(x), t, bucket_size=b, key=k,
                                          checksum=c).numpy()
                    levels = tf.Variable(tfk.levels_tensor(t))
                    header = tf.Variable(tfk.header_tensor(x.size, t, b, "l2"))
                    fn = tf.function(lambda a: tfk.encode_with(a, levels, header, bits=t.bits,
                                                               bucket_size=b, key=k, checksum=c))
                    return fn(tf.constant(x)).numpy()
            return run

        for impl, suffix in (("auto", ""), ("ops", "-ops")):
            out["tf" + suffix] = tf_encode(impl, False)
            out["tf.function" + suffix] = tf_encode(impl, True)
    return out


@pytest.mark.parametrize("n, bucket", [(0, 16), (1, 2**32 - 1), (100, 16), (1001, 64)])
def test_every_encoder_writes_the_same_checksum(n, bucket):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    key = StreamKey(seed=2, rank=1, step=3)
    want = codec.encode(x, PARITY_TABLE, bucket_size=bucket, key=key, checksum=True)
    plain = codec.encode(x, PARITY_TABLE, bucket_size=bucket, key=key)
    header = codec.parse_header(want)
    assert header.checksummed and header.checksum == codec.payload_checksum(want)
    assert np.array_equal(want[32:], plain[32:]) and want[5] == codec.FLAG_CHECKSUM
    assert np.array_equal(np.delete(want[:32], [5, 28, 29, 30, 31]),
                          np.delete(plain[:32], [5, 28, 29, 30, 31]))
    for name, encode in parity_encoders().items():
        assert np.array_equal(encode(x, PARITY_TABLE, bucket, key, True), want), name
        assert np.array_equal(encode(x, PARITY_TABLE, bucket, key, False), plain), name


def test_every_decoder_reads_or_refuses_an_entropy_coded_payload():
    """docs/format.md §12: the numpy and fused decoders read an entropy-coded payload (the
    fixed wire's values); every other decoder reads it too or refuses it with PayloadError
    (a graph with its own assertion). tests/test_codec_entropy.py holds the corruptions."""
    x = np.random.default_rng(4).standard_normal(3000).astype(np.float32)
    key = StreamKey(seed=9)
    coded = codec.encode_entropy(x, PARITY_TABLE, bucket_size=16, key=key)
    fixed = codec.encode(x, PARITY_TABLE, bucket_size=16, key=key)
    assert coded[5] & codec.FLAG_ENTROPY and coded.size < fixed.size
    want = codec.decode(fixed, PARITY_TABLE).view(np.uint32)
    for decoder, (decode, _, graph) in parity_decoders().items():
        got = _raised(lambda: decode(coded, PARITY_TABLE))
        if got is None:
            assert np.array_equal(decode(coded, PARITY_TABLE).view(np.uint32), want), decoder
        else:
            assert decoder not in ("numpy", "fused"), (decoder, got)
            assert graph or (isinstance(got, PayloadError)
                             and "entropy-coded body" in str(got)), (decoder, got)
