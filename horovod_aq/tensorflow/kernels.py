"""TensorFlow kernels for the horovod_aq payload: the same bytes as the numpy oracle.

Implements ``horovod_aq.codec`` (the layout is ``codec.format``, the eight arithmetic steps
``codec.reference``) with TensorFlow ops. Given the same uniforms the bytes equal ``codec.encode``
and the PyTorch kernels, and each decodes the others' payloads. Everything works eagerly and inside
``tf.function`` (static shapes, no Python branching on tensor values).
Bit packing is :mod:`horovod_aq.tensorflow.bits`, the random stream
:mod:`horovod_aq.tensorflow.stream`, the shape helpers :mod:`horovod_aq.tensorflow.tensors`.

Two layers:

* ``encode_with`` / ``decode_with`` / ``decode_average_with`` take the float32 levels and the 32
  header bytes as *tensors*, so an integration can keep them in ``tf.Variable``s and assign a new
  table at each refit without retracing. Settings that fix shapes (``numel``, ``bits``,
  ``bucket_size``, ``norm``) are Python values. Invalid values fail through ``tf.debugging``
  assertions (``tf.errors.InvalidArgumentError``, ``horovod_aq.tensorflow.checks``) whose
  messages name the field.
* ``encode`` / ``decode`` / ``decode_average`` / ``quantize`` take a ``LevelTable``. Executed
  eagerly they validate on the host first and raise the same ``ValueError`` / ``PayloadError``
  messages as the numpy codec; inside ``tf.function`` the table becomes a constant.

Bit-exactness rules followed here:

* the l2 norm sums float64 squares in the canonical pairwise order (explicit halving slices);
* decoded payloads are added in rank order in a ``tf.while_loop`` (a chain of adds could be
  rewritten into ``AddN``, whose order is unspecified);
* the final division by P uses ``tf.math.divide_no_nan``: Grappler rewrites ``x / constant``
  into ``x * (1 / constant)``, which is not IEEE division, and P is a constant once shapes are
  static. Every other divisor is computed from the data.

Decoders refuse what the numpy oracle refuses: besides the header checks, every norm must be
finite and ≥ 0 and every code < N (checked in the graph; a failing payload is handed to the
oracle's checks on the host, which raise its ``PayloadError``), and a checksummed payload
(``FLAG_CHECKSUM``) must match its CRC-32 (verified on the host, ``tf.numpy_function``).
``checksum=True`` on the encoders writes it (computed on the host as well).

TensorFlow's CPU kernels flush float32 subnormals to zero. The level table is flushed the same
way in every framework (``codec.float32_levels``), so this matters only for gradients holding
values below 1.2e-38 (see the ``codec.reference`` docstring): there the bytes may differ from
numpy's and PyTorch's, and the payload still decodes everywhere. Inside a traced graph the
compiled CPU kernel's host call runs on TensorFlow's threads, under the same flush.

Importing this module imports TensorFlow; ``horovod_aq.codec`` never does.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import tensorflow as tf

from horovod_aq import codec
from horovod_aq.codec import HEADER_SIZE, NORM_BYTES, PayloadError
from horovod_aq.codec.stream import StreamKey
from horovod_aq.levels.table import LevelTable
from horovod_aq.tensorflow.bits import pack_bits, unpack_bits
from horovod_aq.tensorflow.checks import (
    checksum_check,
    data_check,
    decoder_header_check,
    encoder_header_check,
    values_check,
)
from horovod_aq.tensorflow.stats import bucket_moments
from horovod_aq.tensorflow.stream import stream_uniforms
from horovod_aq.tensorflow.tensors import (
    as_float32_flat,
    next_pow2,
    per_bucket,
    split_buckets,
    static_numel,
)

__all__ = ["bucket_moments", "bucket_norms", "decode", "decode_average",
           "decode_average_with", "decode_with", "decoder_header_check", "encode", "encode_with",
           "header_tensor", "levels_tensor", "quantize", "stream_uniforms"]

if sys.byteorder != "little":  # pragma: no cover - tf.bitcast uses the host byte order
    raise ImportError("horovod_aq.tensorflow.kernels assumes a little-endian host")

# ---------------------------------------------------------------------------- small helpers


def levels_tensor(table: LevelTable) -> tf.Tensor:
    """The table's float32 levels (``codec.float32_levels``: subnormals flushed) as a constant.

    Wrap it in a ``tf.Variable`` and ``assign`` a new one at each refit; always build the values
    with this function so that they match the other frameworks."""
    return tf.constant(codec.float32_levels(table))


def header_tensor(numel: int, table: LevelTable, bucket_size: int, norm: str) -> tf.Tensor:
    """The 32 header bytes (``codec.make_header``) as a uint8 constant."""
    raw = codec.make_header(numel, table, bucket_size, norm)
    return tf.constant(np.frombuffer(raw, dtype=np.uint8))


# ---------------------------------------------------------------------------------- norms


def _l2_rows(rows: tf.Tensor) -> tf.Tensor:
    """float32(sqrt(pairwise float64 sum of squares)) per row (codec step 2)."""
    width = next_pow2(rows.shape[1])
    if width != rows.shape[1]:
        rows = tf.pad(rows, [[0, 0], [0, width - rows.shape[1]]])
    acc = tf.square(tf.cast(rows, tf.float64))
    while width > 1:
        width //= 2
        acc = acc[:, :width] + acc[:, width:]
    return tf.cast(tf.sqrt(acc[:, 0]), tf.float32)


def _norms(flat: tf.Tensor, n: int, bucket_size: int, norm: str) -> tf.Tensor:
    if n == 0:
        return tf.zeros([0], tf.float32)
    parts = [
        tf.reduce_max(tf.abs(rows), axis=1) if norm == "linf" else _l2_rows(rows)
        for rows, _ in split_buckets(flat, n, bucket_size)
    ]
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def bucket_norms(x: Any, bucket_size: int, norm: str = "l2") -> tf.Tensor:
    """float32 norm of every bucket (``codec.bucket_norms``). No validation."""
    flat = as_float32_flat(x)
    return _norms(flat, static_numel(flat), codec.check_bucket_size(bucket_size),
                  codec.check_norm(norm))


# ----------------------------------------------------------------------------------- encode


#: "auto": on a machine without a GPU, keyed encodes and decode_average run the compiled CPU
#: kernel of ``horovod_aq.codec.fused`` (through ``tf.numpy_function``, eager and traced);
#: "ops": always the TensorFlow ops below; "triton" (PyTorch's Triton kernels on CPU tensors)
#: is "auto" here. Set by ``HOROVOD_AQ_KERNELS``.
IMPLEMENTATION = os.environ.get("HOROVOD_AQ_KERNELS", "auto")
if IMPLEMENTATION not in ("auto", "ops", "triton"):
    raise ValueError(f"HOROVOD_AQ_KERNELS must be 'auto', 'ops' or 'triton', got "
                     f"{IMPLEMENTATION!r}")
IMPLEMENTATION = "auto" if IMPLEMENTATION == "triton" else IMPLEMENTATION


def use_fused() -> bool:
    """Whether the compiled CPU kernel runs (see ``IMPLEMENTATION``): no GPU is visible."""
    if IMPLEMENTATION != "auto":
        return False
    if "gpu" not in _DEVICES:
        _DEVICES["gpu"] = bool(tf.config.list_physical_devices("GPU"))
    return not _DEVICES["gpu"]


_DEVICES: dict[str, bool] = {}


def _fused_encode(flat: tf.Tensor, levels: tf.Tensor, header_u8: tf.Tensor, *, n: int, bits: int,
                  bucket_size: int, norm: str, key: Any, deps: list,
                  checksum: bool = False) -> tf.Tensor:
    """The fused CPU encode of ``horovod_aq.codec.fused.encode_with`` as a graph op."""
    from horovod_aq.codec import fused

    k0, k1, step, bucket, part = key.scalars() if isinstance(key, StreamKey) else key
    scalars = tf.stack([tf.cast(v, tf.int64) for v in (k0, k1, step, bucket, part)])

    def run(x, lv, hd, sc):
        return fused.encode_with(x, lv, hd, bits=bits, bucket_size=bucket_size, norm=norm,
                                 key=tuple(int(v) for v in sc), checksum=checksum)

    with tf.control_dependencies(deps):
        out = tf.numpy_function(run, [flat, levels, header_u8, scalars], tf.uint8,
                                stateful=False, name="aq_fused_encode")
    out.set_shape([codec.payload_size(n, bits, bucket_size)])
    return out


def _uniforms(n: int, uniforms: Any, seed: Any, deps: list,
              key: Any = None) -> tuple[tf.Tensor, list]:
    if key is not None and uniforms is None:
        with tf.control_dependencies(deps):
            return stream_uniforms(n, key), []
    if uniforms is not None:
        u = tf.cast(tf.convert_to_tensor(uniforms), tf.float32)
        if u.shape.num_elements() is not None and u.shape.num_elements() != n:
            raise ValueError(f"uniforms must have shape ({n},), got {u.shape}")
        u = tf.reshape(u, [n])
        check = tf.debugging.Assert(
            tf.reduce_all((u >= 0) & (u < 1)),
            ["uniforms must lie in [0, 1) after rounding to float32"])
        return u, [check]
    with tf.control_dependencies(deps):  # draw only after the input passed its checks
        if seed is None:
            return tf.random.uniform([n], dtype=tf.float32), []
        if isinstance(seed, tf.random.Generator):
            return seed.uniform([n], dtype=tf.float32), []
        if isinstance(seed, (int, np.integer)):
            seed = tf.constant([int(seed) & 0x7FFFFFFFFFFFFFFF, 0], dtype=tf.int64)
        return tf.random.stateless_uniform([n], seed=seed, dtype=tf.float32), []


def _round(r: tf.Tensor, u: tf.Tensor, levels: tf.Tensor) -> tf.Tensor:
    """int32 codes by unbiased stochastic rounding (codec step 4)."""
    top = tf.size(levels, out_type=tf.int32) - 2
    j = tf.searchsorted(levels, r, side="right", out_type=tf.int32) - 1
    j = tf.clip_by_value(j, 0, top)
    gaps = levels[1:] - levels[:-1]
    xi = (r - tf.gather(levels, j)) / tf.gather(gaps, j)
    return j + tf.cast(u < xi, tf.int32)


def _quantize_codes(x, levels_f32, *, bucket_size, norm, uniforms, seed, check, extra_deps,
                    key=None):
    flat = as_float32_flat(x)
    n = static_numel(flat)
    bucket_size = codec.check_bucket_size(bucket_size)
    norm = codec.check_norm(norm)
    levels = tf.cast(tf.convert_to_tensor(levels_f32), tf.float32)
    norms = _norms(flat, n, bucket_size, norm)
    deps = list(extra_deps) + (values_check(flat, norms, n) if check else [])
    u, u_checks = _uniforms(n, uniforms, seed, deps, key)
    with tf.control_dependencies(deps + u_checks):
        if n == 0:
            return tf.zeros([0], tf.int32), norms, n
        safe = tf.where(norms == 0, tf.ones_like(norms), norms)  # zero bucket: 0 / 1 = 0
        r = tf.clip_by_value(per_bucket(tf.math.truediv, flat, safe, n, bucket_size), -1.0, 1.0)
        return _round(r, u, levels), tf.identity(norms), n


def encode_with(
    x: Any,
    levels_f32: Any,
    header_u8: Any,
    *,
    bits: int,
    bucket_size: int,
    norm: str = "l2",
    uniforms: Any = None,
    seed: Any = None,
    check: bool = True,
    key: Any = None,
    checksum: bool = False,
) -> tf.Tensor:
    """Encode x into a uint8 payload of ``codec.payload_size(n, bits, bucket_size)`` bytes.

    Args:
        x: gradient with a static shape; float16/bfloat16/float32/float64.
        levels_f32: float32 levels tensor (e.g. a ``tf.Variable``), N ≤ 2^bits values.
        header_u8: the 32 header bytes (``header_tensor``) for this table and these settings.
        bits, bucket_size, norm: Python values (they fix the payload shape).
        uniforms: n float32 values in [0, 1); else the format's stream of ``key`` (a
            ``codec.StreamKey`` or its scalars, see ``stream_uniforms``: the same bytes as
            ``codec.encode(..., key=...)``); else drawn from ``seed``: None (global TF RNG),
            an int or a shape-[2] tensor (stateless), or a ``tf.random.Generator``.
        check: add the graph assertions (finite values, header fields). ``encode`` turns them off
            when it has already checked eagerly.
        checksum: set ``FLAG_CHECKSUM`` and write the CRC-32 (``codec.encode``'s ``checksum``;
            computed on the host, ``tf.numpy_function``). ``header_u8`` stays as it is.
    """
    checksum = codec.check_bool("checksum", checksum)
    bits = codec.check_bits(bits)
    bucket_size = codec.check_bucket_size(bucket_size)
    norm = codec.check_norm(norm)
    header_u8 = tf.convert_to_tensor(header_u8, dtype=tf.uint8)
    levels = tf.cast(tf.convert_to_tensor(levels_f32), tf.float32)
    flat = as_float32_flat(x)
    n = static_numel(flat)
    header_checks = (encoder_header_check(header_u8, levels, n, bits, bucket_size, norm)
                     if check else [])
    if key is not None and uniforms is None and use_fused():
        deps = header_checks + (values_check(flat, _norms(flat, n, bucket_size, norm), n)
                                if check else [])
        return _fused_encode(flat, levels, header_u8, n=n, bits=bits, bucket_size=bucket_size,
                             norm=norm, key=key, deps=deps, checksum=checksum)
    codes, norms, n = _quantize_codes(flat, levels, bucket_size=bucket_size, norm=norm,
                                      uniforms=uniforms, seed=seed, check=check,
                                      extra_deps=header_checks, key=key)
    payload = tf.concat([header_u8, tf.reshape(tf.bitcast(norms, tf.uint8), [-1]),
                         pack_bits(codes, n, bits)], axis=0)
    return _seal(payload) if checksum else payload


def _seal(payload: tf.Tensor) -> tf.Tensor:
    """``codec.seal_checksum`` of a payload tensor (on the host)."""
    sealed = tf.numpy_function(lambda p: codec.seal_checksum(np.array(p, dtype=np.uint8)),
                               [payload], tf.uint8, stateful=False, name="aq_seal_checksum")
    sealed.set_shape(payload.shape)
    return sealed


# ----------------------------------------------------------------------------------- decode


def _dequantize(row: tf.Tensor, lookup: tf.Tensor, n: int, bits: int, bucket_size: int,
                num_levels: tf.Tensor | None = None) -> tuple[tf.Tensor, tf.Tensor]:
    """float32 values of one payload row of exact size (codec step 6), and a bool scalar: every
    norm finite and ≥ 0 and (``num_levels`` given: tables with N < 2^b) every code < N."""
    if n == 0:
        return tf.zeros([0], tf.float32), tf.constant(True)
    nb = codec.num_buckets(n, bucket_size)
    codes_at = HEADER_SIZE + NORM_BYTES * nb
    norms = tf.bitcast(tf.reshape(row[HEADER_SIZE:codes_at], [nb, NORM_BYTES]), tf.float32)
    codes = unpack_bits(row[codes_at:], n, bits)
    ok = tf.reduce_all(tf.math.is_finite(norms) & (norms >= 0))
    if num_levels is not None:
        ok = ok & (tf.reduce_max(codes) < num_levels)
    values = tf.gather(lookup, codes)
    # min(B, n): the same buckets (B > n is one bucket of n elements)
    return per_bucket(tf.math.multiply, values, norms, n, min(bucket_size, n)), ok


def _code_limit(levels_f32: Any, bits: int) -> tf.Tensor | None:
    """N as an int32 tensor when a code can exceed the table (N < 2^b, or N unknown while
    tracing); None when the static table has all 2^b levels."""
    levels = tf.convert_to_tensor(levels_f32)
    static = levels.shape.num_elements()
    if static is not None and static >= 1 << bits:
        return None
    return tf.size(levels, out_type=tf.int32)


def _lookup(levels_f32: Any, bits: int) -> tf.Tensor:
    """Levels padded with NaN to 2^bits entries: a corrupted code decodes to NaN."""
    levels = tf.cast(tf.convert_to_tensor(levels_f32), tf.float32)
    return tf.pad(levels, [[0, (1 << bits) - tf.size(levels)]], constant_values=float("nan"))


def _check_rows(payloads: tf.Tensor, size: int, expected_header_u8, check: bool) -> list:
    width = payloads.shape[1]
    if width is not None and width != size:
        kind = "truncated" if width < size else "too long"
        raise PayloadError(f"payload is {kind}: {width} bytes, but numel/bits/bucket_size "
                           f"require {size}")
    checks = []
    if width is None:
        checks.append(tf.debugging.assert_equal(
            tf.shape(payloads)[1], size, message=f"payload size differs from the {size} bytes "
                                                 "that numel/bits/bucket_size require"))
    if check:
        with tf.control_dependencies(checks):
            checks += decoder_header_check(payloads[:, :HEADER_SIZE],
                                            tf.convert_to_tensor(expected_header_u8, tf.uint8))
    return checks


def decode_with(
    payload: Any,
    levels_f32: Any,
    expected_header_u8: Any,
    *,
    numel: int,
    bits: int,
    bucket_size: int,
    dtype: tf.DType = tf.float32,
    check: bool = True,
    verify: bool = True,
) -> tf.Tensor:
    """Decode one uint8 payload into a flat tensor of ``dtype``.

    The payload's header must equal ``expected_header_u8`` byte for byte (graph assertions name
    the first differing field; ``check``), except for ``FLAG_CHECKSUM`` and the CRC field, and
    its size must be ``payload_size(numel, bits, bucket_size)``. ``verify`` (default): the CRC-32
    of a checksummed payload, every norm finite and ≥ 0, every code < N (the oracle's data
    checks and errors); turn it off only for a payload this process has just encoded.
    """
    bits = codec.check_bits(bits)
    payload = tf.convert_to_tensor(payload, dtype=tf.uint8)
    if payload.shape.rank != 1:
        raise PayloadError(f"a payload must be 1-D uint8, got shape {payload.shape}")
    size = codec.payload_size(numel, bits, bucket_size)
    checks = _check_rows(payload[None], size, expected_header_u8, check)
    if verify:
        with tf.control_dependencies(checks):
            checks = checks + checksum_check(payload[None], average=False)
    with tf.control_dependencies(checks):
        limit = _code_limit(levels_f32, bits) if verify else None
        values, ok = _dequantize(payload, _lookup(levels_f32, bits), numel, bits, bucket_size,
                                 limit)
    if verify:
        with tf.control_dependencies(data_check(payload[None], tf.cast(levels_f32, tf.float32),
                                                ok, average=False)):
            values = tf.identity(values)
    return tf.cast(values, dtype)


def decode_average_with(
    payloads: Any,
    levels_f32: Any,
    expected_header_u8: Any,
    *,
    numel: int,
    bits: int,
    bucket_size: int,
    dtype: tf.DType = tf.float32,
    check: bool = True,
    verify: bool = True,
) -> tf.Tensor:
    """Decode the P rows of a gathered [P, size] buffer and average them (codec step 7).

    Rows are added in rank order inside a ``tf.while_loop`` and the sum is divided by P with
    ``divide_no_nan`` (a true division even when P is a graph constant). P may be dynamic.
    ``check`` and ``verify`` as in ``decode_with``; errors name the rank ("rank r: …").
    """
    bits = codec.check_bits(bits)
    payloads = tf.convert_to_tensor(payloads, dtype=tf.uint8)
    if payloads.shape.rank != 2:
        raise PayloadError(f"gathered payloads must be [P, size] uint8, got shape {payloads.shape}")
    size = codec.payload_size(numel, bits, bucket_size)
    checks = _check_rows(payloads, size, expected_header_u8, check)
    world = tf.shape(payloads)[0]
    checks.append(tf.debugging.assert_positive(world, message="decode_average needs P ≥ 1"))
    if use_fused():
        from horovod_aq.codec import fused

        def run(rows, lv):  # verifies checksums, norms and codes itself (the oracle's errors)
            return fused.decode_average_with(rows, lv, numel=numel, bits=bits,
                                             bucket_size=bucket_size)

        with tf.control_dependencies(checks):
            avg = tf.numpy_function(run, [payloads, tf.cast(levels_f32, tf.float32)], tf.float32,
                                    stateful=False, name="aq_fused_decode_average")
        avg.set_shape([numel])
        return tf.cast(avg, dtype)
    if verify:
        with tf.control_dependencies(checks):
            checks = checks + checksum_check(payloads, average=True)
    with tf.control_dependencies(checks):
        lookup = _lookup(levels_f32, bits)
        limit = _code_limit(levels_f32, bits) if verify else None
        divisor = tf.cast(world, tf.float32)
        acc, ok = _dequantize(payloads[0], lookup, numel, bits, bucket_size, limit)
        acc = tf.math.divide_no_nan(acc, divisor)   # each row / P before the sum (no overflow)

        def body(rank, total, valid):
            values, row_ok = _dequantize(payloads[rank], lookup, numel, bits, bucket_size, limit)
            return rank + 1, total + tf.math.divide_no_nan(values, divisor), valid & row_ok

        _, acc, ok = tf.while_loop(lambda rank, total, valid: rank < world, body,
                                   (tf.constant(1), acc, ok))
        avg = acc
    if verify:
        with tf.control_dependencies(data_check(payloads, tf.cast(levels_f32, tf.float32), ok,
                                                average=True)):
            avg = tf.identity(avg)
    return tf.cast(avg, dtype)


# ---------------------------------------------------------------------- LevelTable wrappers


def _eager_check_values(flat: tf.Tensor, bucket_size: int, norm: str) -> tf.Tensor:
    """Host-side validation in eager mode, with the numpy codec's messages."""
    norms = _norms(flat, static_numel(flat), bucket_size, norm)
    if not bool(tf.reduce_all(tf.math.is_finite(flat))):
        codec.check_finite(flat.numpy())  # raises the non-finite message
    if not bool(tf.reduce_all(tf.math.is_finite(norms))):
        codec.check_norms(norms.numpy())
    return norms


def encode(
    x: Any,
    levels: LevelTable | Any,
    *,
    bucket_size: int,
    norm: str = "l2",
    seed: Any = None,
    uniforms: Any = None,
    key: Any = None,
    checksum: bool = False,
) -> tf.Tensor:
    """``codec.encode`` in TensorFlow (see ``encode_with`` for ``key`` / ``seed`` /
    ``uniforms`` / ``checksum``)."""
    table = codec.as_table(levels)
    bucket_size = codec.check_bucket_size(bucket_size)
    norm = codec.check_norm(norm)
    flat = as_float32_flat(x)
    n = static_numel(flat)
    eager = tf.executing_eagerly()
    if eager:
        _eager_check_values(flat, bucket_size, norm)
        if uniforms is not None:
            codec.draw_uniforms(n, uniforms=np.asarray(uniforms))
    return encode_with(flat, levels_tensor(table), header_tensor(n, table, bucket_size, norm),
                       bits=table.bits, bucket_size=bucket_size, norm=norm, uniforms=uniforms,
                       seed=seed, check=not eager, key=key, checksum=checksum)


def quantize(
    x: Any,
    levels: LevelTable | Any,
    *,
    bucket_size: int,
    norm: str = "l2",
    seed: Any = None,
    uniforms: Any = None,
    dtype: tf.DType = tf.float32,
    key: Any = None,
) -> tf.Tensor:
    """``decode(encode(x))`` without packing: the flat quantized values, bitwise the same."""
    table = codec.as_table(levels)
    bucket_size = codec.check_bucket_size(bucket_size)
    norm = codec.check_norm(norm)
    flat = as_float32_flat(x)
    n = static_numel(flat)
    eager = tf.executing_eagerly()
    if eager:
        _eager_check_values(flat, bucket_size, norm)
        if uniforms is not None:
            codec.draw_uniforms(n, uniforms=np.asarray(uniforms))
    codes, norms, n = _quantize_codes(flat, levels_tensor(table), bucket_size=bucket_size,
                                      norm=norm, uniforms=uniforms, seed=seed, check=not eager,
                                      extra_deps=[], key=key)
    if n == 0:
        return tf.zeros([0], dtype)
    values = tf.gather(_lookup(levels_tensor(table), table.bits), codes)
    return tf.cast(per_bucket(tf.math.multiply, values, norms, n, bucket_size), dtype)


def _eager_headers(rows: tf.Tensor, table, numel, bucket_size, norm,
                   average: bool) -> codec.Header:
    """Validate payload headers on the host with the numpy codec's messages; returns row 0's.
    ``average``: errors name the rank, as ``codec.decode_average``'s."""
    if rows.shape[1] < HEADER_SIZE:
        codec.parse_rows(rows[:1].numpy(), name_rank=average)  # raises "truncated"
    headers = codec.parse_rows(rows[:, :HEADER_SIZE].numpy(), name_rank=average)
    return codec.check_rows(headers, table, int(rows.shape[1]), numel=numel,
                            bucket_size=bucket_size, norm=norm, name_rank=average)


def _graph_settings(table, numel, bucket_size, norm) -> tuple[int, int, str]:
    if numel is None or bucket_size is None or norm is None:
        raise ValueError("inside tf.function, decode needs numel=, bucket_size= and norm= (the "
                         "payload's header cannot fix static shapes); or use decode_with")
    return numel, codec.check_bucket_size(bucket_size), codec.check_norm(norm)


def decode(
    payload: Any,
    levels: LevelTable | Any,
    *,
    dtype: tf.DType = tf.float32,
    numel: int | None = None,
    bucket_size: int | None = None,
    norm: str | None = None,
) -> tf.Tensor:
    """``codec.decode`` in TensorFlow. Eagerly, missing settings are read from the header."""
    table = codec.as_table(levels)
    payload = tf.convert_to_tensor(payload, dtype=tf.uint8)
    if payload.shape.rank != 1:
        raise PayloadError(f"a payload must be 1-D uint8, got shape {payload.shape}")
    if tf.executing_eagerly():
        header = _eager_headers(payload[None], table, numel, bucket_size, norm, average=False)
        numel, bucket_size, norm = header.numel, header.bucket_size, header.norm
        check = False
    else:
        numel, bucket_size, norm = _graph_settings(table, numel, bucket_size, norm)
        check = True
    return decode_with(payload, levels_tensor(table),
                       header_tensor(numel, table, bucket_size, norm), numel=numel,
                       bits=table.bits, bucket_size=bucket_size, dtype=dtype, check=check)


def decode_average(
    payloads: Any,
    levels: LevelTable | Any,
    *,
    dtype: tf.DType = tf.float32,
    numel: int | None = None,
    bucket_size: int | None = None,
    norm: str | None = None,
) -> tf.Tensor:
    """``codec.decode_average`` in TensorFlow (each row / P, then a rank-order float32 sum)."""
    table = codec.as_table(levels)
    payloads = tf.convert_to_tensor(payloads, dtype=tf.uint8)
    if payloads.shape.rank != 2 or (payloads.shape[0] is not None and payloads.shape[0] == 0):
        raise PayloadError(
            f"gathered payloads must be a non-empty [P, size] uint8 tensor, got {payloads.shape}")
    if tf.executing_eagerly():
        header = _eager_headers(payloads, table, numel, bucket_size, norm, average=True)
        numel, bucket_size, norm = header.numel, header.bucket_size, header.norm
        check = False
    else:
        numel, bucket_size, norm = _graph_settings(table, numel, bucket_size, norm)
        check = True
    return decode_average_with(payloads, levels_tensor(table),
                               header_tensor(numel, table, bucket_size, norm), numel=numel,
                               bits=table.bits, bucket_size=bucket_size, dtype=dtype, check=check)
