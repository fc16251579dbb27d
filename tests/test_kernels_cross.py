"""Byte equality numpy ↔ PyTorch ↔ TensorFlow with shared uniforms, and cross-decoding.

The numpy codec is the oracle: every framework must produce its bytes exactly and decode its
payloads (and each other's) to the same float32 bits. Frameworks that are not installed are
skipped; the oracle comparisons still run for the others.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from horovod_aq import codec
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
