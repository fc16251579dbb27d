"""TensorFlow kernels for the horovod_aq payload: the same bytes as the numpy oracle.

Implements ``horovod_aq.codec`` (read its module docstring for the layout and the eight arithmetic
steps) with TensorFlow ops. Given the same uniforms the bytes equal ``codec.encode`` and the PyTorch
kernels, and each decodes the others' payloads. Everything works eagerly and inside
``tf.function`` (static shapes, no Python branching on tensor values).

Two layers:

* ``encode_with`` / ``decode_with`` / ``decode_average_with`` take the float32 levels and the 32
  header bytes as *tensors*, so an integration can keep them in ``tf.Variable``s and assign a new
  table at each refit without retracing. Settings that fix shapes (``numel``, ``bits``,
  ``bucket_size``, ``norm``) are Python values. Invalid values fail through ``tf.debugging``
  assertions (``tf.errors.InvalidArgumentError``) whose messages name the field.
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

TensorFlow's CPU kernels flush float32 subnormals to zero. The level table is flushed the same
way in every framework (``codec.float32_levels``), so this matters only for gradients holding
values below 1.2e-38 (see the ``codec`` docstring): there the bytes may differ from numpy's and
PyTorch's, and the payload still decodes everywhere.

Importing this module imports TensorFlow; ``horovod_aq.codec`` never does.
"""

from __future__ import annotations

import struct
import sys
from typing import Any

import numpy as np
import tensorflow as tf

from horovod_aq import codec
from horovod_aq.codec import HEADER_SIZE, NORM_BYTES, PayloadError
from horovod_aq.levels.table import LevelTable

__all__ = ["bucket_norms", "bucket_stats", "decode", "decode_average", "decode_average_with",
           "decode_with", "encode", "encode_with", "header_tensor", "levels_tensor", "quantize"]

if sys.byteorder != "little":  # pragma: no cover - tf.bitcast uses the host byte order
    raise ImportError("horovod_aq.tensorflow.kernels assumes a little-endian host")

_FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
# Header fields compared by the decoder's graph assertions: (name, first byte, stop byte).
_HEADER_FIELDS = (
    ("magic", 0, 2),
    ("format version", 2, 3),
    ("bits", 3, 4),
    ("norm", 4, 5),
    ("flags", 5, 6),
    ("number of levels", 6, 8),
    ("level-table version", 8, 12),
    ("level-table hash", 12, 16),
    ("bucket size", 16, 20),
    ("numel", 20, 28),
    ("reserved", 28, 32),
)


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


def _static_numel(x: tf.Tensor, what: str = "x") -> int:
    n = x.shape.num_elements()
    if n is None:
        raise ValueError(f"{what} needs a fully defined static shape, got {x.shape}; give the "
                         "tf.function an input_signature with static shapes")
    return int(n)


def _as_float32_flat(x: Any) -> tf.Tensor:
    x = tf.convert_to_tensor(x)
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"expected a floating-point gradient, got dtype {x.dtype.name}")
    _static_numel(x)
    return tf.cast(tf.reshape(x, [-1]), tf.float32)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _split_buckets(flat: tf.Tensor, n: int, bucket_size: int) -> list[tuple[tf.Tensor, int]]:
    """[(rows, first bucket)]: the full buckets as a [k, B] matrix, the partial tail as [1, B']."""
    full_buckets = n // bucket_size
    full = full_buckets * bucket_size
    parts = []
    if full_buckets:
        parts.append((tf.reshape(flat[:full], [full_buckets, bucket_size]), 0))
    if full < n:
        parts.append((tf.reshape(flat[full:], [1, n - full]), full_buckets))
    return parts


def _per_bucket(op, flat: tf.Tensor, per_bucket: tf.Tensor, n: int, bucket_size: int):
    """op(flat_i, per_bucket[bucket(i)]) with static shapes, flattened."""
    outs = [tf.reshape(op(rows, per_bucket[first : first + rows.shape[0], None]), [-1])
            for rows, first in _split_buckets(flat, n, bucket_size)]
    return outs[0] if len(outs) == 1 else tf.concat(outs, axis=0)


# ---------------------------------------------------------------------------------- norms


def _l2_rows(rows: tf.Tensor) -> tf.Tensor:
    """float32(sqrt(pairwise float64 sum of squares)) per row (codec step 2)."""
    width = _next_pow2(rows.shape[1])
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
        for rows, _ in _split_buckets(flat, n, bucket_size)
    ]
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def bucket_norms(x: Any, bucket_size: int, norm: str = "l2") -> tf.Tensor:
    """float32 norm of every bucket (``codec.bucket_norms``). No validation."""
    flat = _as_float32_flat(x)
    return _norms(flat, _static_numel(flat), codec._check_bucket_size(bucket_size),
                  codec._check_norm(norm))


# ------------------------------------------------------------------------------- validation


def _values_check(flat: tf.Tensor, norms: tf.Tensor, n: int) -> list:
    """Graph assertions: every element finite, every norm finite. The diagnostics (count, first
    index) are computed only on the failing branch."""
    if n == 0:
        return []

    def fail_values():
        bad = tf.logical_not(tf.math.is_finite(flat))
        count = tf.reduce_sum(tf.cast(bad, tf.int64))
        first = tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int64)
        with tf.control_dependencies([tf.debugging.Assert(
                False, ["cannot quantize a gradient with non-finite values:", count, "of", n,
                        "elements are NaN or ±Inf in float32, first at flat index", first,
                        "; check the loss scale or clip the gradients before compressing"])]):
            return tf.constant(True)

    def fail_norms():
        first = tf.argmax(tf.cast(tf.logical_not(tf.math.is_finite(norms)), tf.int32))
        with tf.control_dependencies([tf.debugging.Assert(
                False, ["bucket", first, ("has a norm that overflows float32; scale the "
                                          "gradient down before compressing")])]):
            return tf.constant(True)

    values_ok = tf.cond(tf.reduce_all(tf.math.is_finite(flat)), lambda: tf.constant(True),
                        fail_values)
    with tf.control_dependencies([values_ok]):
        norms_ok = tf.cond(tf.reduce_all(tf.math.is_finite(norms)), lambda: tf.constant(True),
                           fail_norms)
    return [values_ok, norms_ok]


def _field_value(raw: tf.Tensor, width: int) -> tf.Tensor:
    """The integer value of one little-endian header field given as ``width`` bytes."""
    raw = tf.reshape(raw, [width])
    if width == 1:
        return tf.cast(raw[0], tf.int64)
    return tf.bitcast(raw, {2: tf.uint16, 4: tf.uint32, 8: tf.uint64}[width])


def _encoder_header_check(header_u8: tf.Tensor, levels: tf.Tensor, n: int, bits: int,
                          bucket_size: int, norm: str) -> list:
    """Assert that the header tensor describes this encode and this levels tensor."""
    if header_u8.shape.rank != 1 or header_u8.shape[0] not in (None, HEADER_SIZE):
        raise ValueError(f"header_u8 must be {HEADER_SIZE} uint8 bytes, "
                         f"got shape {header_u8.shape}")
    want = np.frombuffer(struct.pack(codec.HEADER_FORMAT, codec.MAGIC, codec.FORMAT_VERSION, bits,
                                     codec.NORM_CODES[norm], 0, 0, 0, 0, bucket_size, n, 0),
                         dtype=np.uint8)
    checks = []
    for name, lo, hi in (("magic", 0, 2), ("format version", 2, 3), ("bits", 3, 4),
                         ("norm", 4, 5), ("bucket size", 16, 20), ("numel", 20, 28)):
        checks.append(tf.debugging.assert_equal(
            header_u8[lo:hi], tf.constant(want[lo:hi]),
            message=f"encode_with: header_u8 has another {name} than this call "
                    f"(numel={n}, bits={bits}, bucket_size={bucket_size}, norm={norm}); "
                    "rebuild it with header_tensor()"))
    num_levels = tf.size(levels, out_type=tf.int64)
    checks.append(tf.debugging.assert_equal(
        _field_value(header_u8[6:8], 2), tf.cast(num_levels, tf.uint16),
        message="encode_with: header_u8 and levels_f32 disagree on the number of levels; "
                "update both at a refit"))
    checks.append(tf.debugging.Assert(
        (num_levels >= 2) & (num_levels <= 1 << bits),
        [f"encode_with: levels_f32 must hold 2..{1 << bits} levels for bits={bits}, got",
         num_levels]))
    return checks


def _decoder_header_check(headers: tf.Tensor, expected_u8: tf.Tensor) -> list:
    """Assert that every row of ``headers`` [P, 32] equals the expected header; the message
    names the first differing field, the first rank that differs and both values."""
    if expected_u8.shape.rank != 1 or expected_u8.shape[0] not in (None, HEADER_SIZE):
        raise ValueError(f"expected_header_u8 must be {HEADER_SIZE} uint8 bytes, got shape "
                         f"{expected_u8.shape}")
    checks: list = []
    for name, lo, hi in _HEADER_FIELDS:
        got, want = headers[:, lo:hi], expected_u8[None, lo:hi]
        same = tf.reduce_all(tf.equal(got, want), axis=1)
        rank = tf.argmin(tf.cast(same, tf.int32))
        if name == "magic":
            advice = "not a horovod_aq payload (wrong buffer or corrupted data)"
        elif name == "format version":
            advice = "ranks run different horovod_aq versions"
        elif name.startswith("level-table"):
            advice = "ranks disagree on the level table"
        else:
            advice = "ranks disagree on the tensor or the compressor settings"
        if name == "magic":
            shown, expected = tf.reshape(got[rank], [hi - lo]), want[0]
        else:
            shown, expected = _field_value(got[rank], hi - lo), _field_value(want[0], hi - lo)
        with tf.control_dependencies(checks[-1:]):  # report the first differing field
            checks.append(tf.debugging.Assert(
                tf.reduce_all(same),
                [f"payload {name} differs: the payload of rank", rank, "has", shown,
                 "but this rank expects", expected, f"; {advice}"],
                summarize=HEADER_SIZE))
    return checks


# ----------------------------------------------------------------------------------- encode


def _uniforms(n: int, uniforms: Any, seed: Any, deps: list) -> tuple[tf.Tensor, list]:
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


def _word(bits: int):
    return (tf.int32, 4) if bits <= 4 else (tf.int64, 8)


def _pack(codes: tf.Tensor, n: int, bits: int) -> tf.Tensor:
    """LSB-first bit packing of n int32 codes into ⌈n·bits/8⌉ bytes (codec step 5)."""
    nbytes = codec.packed_size(n, bits)
    if bits == 8:
        return tf.cast(codes, tf.uint8)
    groups = -(-n // 8)
    dtype, _ = _word(bits)
    grouped = tf.reshape(tf.pad(codes, [[0, groups * 8 - n]]), [groups, 8])
    shifts = tf.constant(np.arange(8) * bits, dtype=dtype)
    words = tf.reduce_sum(tf.bitwise.left_shift(tf.cast(grouped, dtype), shifts), axis=1)
    stream = tf.reshape(tf.bitcast(words, tf.uint8)[:, :bits], [-1])
    return stream[:nbytes]


def _unpack(stream: tf.Tensor, n: int, bits: int) -> tf.Tensor:
    """The n int32 codes of a packed stream of ⌈n·bits/8⌉ bytes."""
    if bits == 8:
        return tf.cast(stream, tf.int32)
    groups = -(-n // 8)
    dtype, word_bytes = _word(bits)
    padded = tf.pad(stream, [[0, groups * bits - codec.packed_size(n, bits)]])
    padded = tf.pad(tf.reshape(padded, [groups, bits]), [[0, 0], [0, word_bytes - bits]])
    words = tf.bitcast(padded, dtype)[:, None]
    shifts = tf.constant(np.arange(8) * bits, dtype=dtype)
    codes = tf.bitwise.bitwise_and(tf.bitwise.right_shift(words, shifts),
                                   tf.constant((1 << bits) - 1, dtype=dtype))
    return tf.cast(tf.reshape(codes, [-1])[:n], tf.int32)


def _quantize_codes(x, levels_f32, *, bucket_size, norm, uniforms, seed, check, extra_deps):
    flat = _as_float32_flat(x)
    n = _static_numel(flat)
    bucket_size = codec._check_bucket_size(bucket_size)
    norm = codec._check_norm(norm)
    levels = tf.cast(tf.convert_to_tensor(levels_f32), tf.float32)
    norms = _norms(flat, n, bucket_size, norm)
    deps = list(extra_deps) + (_values_check(flat, norms, n) if check else [])
    u, u_checks = _uniforms(n, uniforms, seed, deps)
    with tf.control_dependencies(deps + u_checks):
        if n == 0:
            return tf.zeros([0], tf.int32), norms, n
        safe = tf.where(norms == 0, tf.ones_like(norms), norms)  # zero bucket: 0 / 1 = 0
        r = tf.clip_by_value(_per_bucket(tf.math.truediv, flat, safe, n, bucket_size), -1.0, 1.0)
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
) -> tf.Tensor:
    """Encode x into a uint8 payload of ``codec.payload_size(n, bits, bucket_size)`` bytes.

    Args:
        x: gradient with a static shape; float16/bfloat16/float32/float64.
        levels_f32: float32 levels tensor (e.g. a ``tf.Variable``), N ≤ 2^bits values.
        header_u8: the 32 header bytes (``header_tensor``) for this table and these settings.
        bits, bucket_size, norm: Python values (they fix the payload shape).
        uniforms: n float32 values in [0, 1); else drawn from ``seed``: None (global TF RNG),
            an int or a shape-[2] tensor (stateless), or a ``tf.random.Generator``.
        check: add the graph assertions (finite values, header fields). ``encode`` turns them off
            when it has already checked eagerly.
    """
    bits = codec._check_bits(bits)
    bucket_size = codec._check_bucket_size(bucket_size)
    norm = codec._check_norm(norm)
    header_u8 = tf.convert_to_tensor(header_u8, dtype=tf.uint8)
    levels = tf.cast(tf.convert_to_tensor(levels_f32), tf.float32)
    flat = _as_float32_flat(x)
    n = _static_numel(flat)
    header_checks = (_encoder_header_check(header_u8, levels, n, bits, bucket_size, norm)
                     if check else [])
    codes, norms, n = _quantize_codes(flat, levels, bucket_size=bucket_size, norm=norm,
                                      uniforms=uniforms, seed=seed, check=check,
                                      extra_deps=header_checks)
    return tf.concat([header_u8, tf.reshape(tf.bitcast(norms, tf.uint8), [-1]),
                      _pack(codes, n, bits)], axis=0)


# ----------------------------------------------------------------------------------- decode


def _dequantize(row: tf.Tensor, lookup: tf.Tensor, n: int, bits: int, bucket_size: int):
    """float32 values of one payload row of exact size (codec step 6)."""
    if n == 0:
        return tf.zeros([0], tf.float32)
    nb = codec.num_buckets(n, bucket_size)
    codes_at = HEADER_SIZE + NORM_BYTES * nb
    norms = tf.bitcast(tf.reshape(row[HEADER_SIZE:codes_at], [nb, NORM_BYTES]), tf.float32)
    values = tf.gather(lookup, _unpack(row[codes_at:], n, bits))
    return _per_bucket(tf.math.multiply, values, norms, n, bucket_size)


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
            checks += _decoder_header_check(payloads[:, :HEADER_SIZE],
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
) -> tf.Tensor:
    """Decode one uint8 payload into a flat tensor of ``dtype``.

    The payload's header must equal ``expected_header_u8`` byte for byte (graph assertions name
    the first differing field) and its size must be ``payload_size(numel, bits, bucket_size)``.
    """
    bits = codec._check_bits(bits)
    payload = tf.convert_to_tensor(payload, dtype=tf.uint8)
    if payload.shape.rank != 1:
        raise PayloadError(f"a payload must be 1-D uint8, got shape {payload.shape}")
    size = codec.payload_size(numel, bits, bucket_size)
    checks = _check_rows(payload[None], size, expected_header_u8, check)
    with tf.control_dependencies(checks):
        values = _dequantize(payload, _lookup(levels_f32, bits), numel, bits, bucket_size)
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
) -> tf.Tensor:
    """Decode the P rows of a gathered [P, size] buffer and average them (codec step 7).

    Rows are added in rank order inside a ``tf.while_loop`` and the sum is divided by P with
    ``divide_no_nan`` (a true division even when P is a graph constant). P may be dynamic.
    """
    bits = codec._check_bits(bits)
    payloads = tf.convert_to_tensor(payloads, dtype=tf.uint8)
    if payloads.shape.rank != 2:
        raise PayloadError(f"gathered payloads must be [P, size] uint8, got shape {payloads.shape}")
    size = codec.payload_size(numel, bits, bucket_size)
    checks = _check_rows(payloads, size, expected_header_u8, check)
    world = tf.shape(payloads)[0]
    checks.append(tf.debugging.assert_positive(world, message="decode_average needs P ≥ 1"))
    with tf.control_dependencies(checks):
        lookup = _lookup(levels_f32, bits)
        acc = _dequantize(payloads[0], lookup, numel, bits, bucket_size)

        def body(rank, total):
            return rank + 1, total + _dequantize(payloads[rank], lookup, numel, bits, bucket_size)

        _, acc = tf.while_loop(lambda rank, total: rank < world, body, (tf.constant(1), acc))
        avg = tf.math.divide_no_nan(acc, tf.cast(world, tf.float32))
    return tf.cast(avg, dtype)


# ---------------------------------------------------------------------- LevelTable wrappers


def _eager_check_values(flat: tf.Tensor, bucket_size: int, norm: str) -> tf.Tensor:
    """Host-side validation in eager mode, with the numpy codec's messages."""
    norms = _norms(flat, _static_numel(flat), bucket_size, norm)
    if not bool(tf.reduce_all(tf.math.is_finite(flat))):
        codec._as_float32_flat(flat.numpy())  # raises the non-finite message
    if not bool(tf.reduce_all(tf.math.is_finite(norms))):
        codec._check_norms(norms.numpy())
    return norms


def encode(
    x: Any,
    levels: LevelTable | Any,
    *,
    bucket_size: int,
    norm: str = "l2",
    seed: Any = None,
    uniforms: Any = None,
) -> tf.Tensor:
    """``codec.encode`` in TensorFlow (see ``encode_with`` for ``seed`` / ``uniforms``)."""
    table = codec.as_table(levels)
    bucket_size = codec._check_bucket_size(bucket_size)
    norm = codec._check_norm(norm)
    flat = _as_float32_flat(x)
    n = _static_numel(flat)
    eager = tf.executing_eagerly()
    if eager:
        _eager_check_values(flat, bucket_size, norm)
        if uniforms is not None:
            codec._uniforms(n, None, np.asarray(uniforms))
    return encode_with(flat, levels_tensor(table), header_tensor(n, table, bucket_size, norm),
                       bits=table.bits, bucket_size=bucket_size, norm=norm, uniforms=uniforms,
                       seed=seed, check=not eager)


def quantize(
    x: Any,
    levels: LevelTable | Any,
    *,
    bucket_size: int,
    norm: str = "l2",
    seed: Any = None,
    uniforms: Any = None,
    dtype: tf.DType = tf.float32,
) -> tf.Tensor:
    """``decode(encode(x))`` without packing: the flat quantized values, bitwise the same."""
    table = codec.as_table(levels)
    bucket_size = codec._check_bucket_size(bucket_size)
    norm = codec._check_norm(norm)
    flat = _as_float32_flat(x)
    n = _static_numel(flat)
    eager = tf.executing_eagerly()
    if eager:
        _eager_check_values(flat, bucket_size, norm)
        if uniforms is not None:
            codec._uniforms(n, None, np.asarray(uniforms))
    codes, norms, n = _quantize_codes(flat, levels_tensor(table), bucket_size=bucket_size,
                                      norm=norm, uniforms=uniforms, seed=seed, check=not eager,
                                      extra_deps=[])
    if n == 0:
        return tf.zeros([0], dtype)
    values = tf.gather(_lookup(levels_tensor(table), table.bits), codes)
    return tf.cast(_per_bucket(tf.math.multiply, values, norms, n, bucket_size), dtype)


def _eager_headers(rows: tf.Tensor, table, numel, bucket_size, norm) -> codec.Header:
    """Validate payload headers on the host with the numpy codec's messages; returns row 0's."""
    if rows.shape[1] < HEADER_SIZE:
        codec.parse_header(rows[0].numpy())  # raises "truncated"
    headers = [codec.parse_header(h) for h in rows[:, :HEADER_SIZE].numpy()]
    return codec.check_rows(headers, table, int(rows.shape[1]), numel=numel,
                            bucket_size=bucket_size, norm=norm, name_rank=len(headers) > 1)


def _graph_settings(table, numel, bucket_size, norm) -> tuple[int, int, str]:
    if numel is None or bucket_size is None or norm is None:
        raise ValueError("inside tf.function, decode needs numel=, bucket_size= and norm= (the "
                         "payload's header cannot fix static shapes); or use decode_with")
    return numel, codec._check_bucket_size(bucket_size), codec._check_norm(norm)


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
        header = _eager_headers(payload[None], table, numel, bucket_size, norm)
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
    """``codec.decode_average`` in TensorFlow (rank-order float32 sum, then / P)."""
    table = codec.as_table(levels)
    payloads = tf.convert_to_tensor(payloads, dtype=tf.uint8)
    if payloads.shape.rank != 2 or (payloads.shape[0] is not None and payloads.shape[0] == 0):
        raise PayloadError(
            f"gathered payloads must be a non-empty [P, size] uint8 tensor, got {payloads.shape}")
    if tf.executing_eagerly():
        header = _eager_headers(payloads, table, numel, bucket_size, norm)
        numel, bucket_size, norm = header.numel, header.bucket_size, header.norm
        check = False
    else:
        numel, bucket_size, norm = _graph_settings(table, numel, bucket_size, norm)
        check = True
    return decode_average_with(payloads, levels_tensor(table),
                               header_tensor(numel, table, bucket_size, norm), numel=numel,
                               bits=table.bits, bucket_size=bucket_size, dtype=dtype, check=check)


# ------------------------------------------------------------------------------- statistics


def bucket_stats(x: Any, bucket_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(norms, means, stds) of the full non-zero buckets as float64 numpy arrays (eager only).

    Same definition as ``codec.bucket_stats`` (u = v/‖v‖₂, std with ddof = 1), computed with TF
    ops; only the three result vectors are copied to the host.
    """
    bucket_size = codec._check_int("bucket_size", bucket_size, 2, codec.MAX_BUCKET_SIZE)
    flat = tf.cast(_as_float32_flat(x), tf.float64)
    full_buckets = _static_numel(flat) // bucket_size
    rows = tf.reshape(flat[: full_buckets * bucket_size], [full_buckets, bucket_size])
    norms = tf.sqrt(tf.reduce_sum(tf.square(rows), axis=1))
    keep = norms > 0
    u = tf.boolean_mask(rows, keep) / tf.boolean_mask(norms, keep)[:, None]
    means = tf.reduce_mean(u, axis=1)
    var = tf.reduce_sum(tf.square(u - means[:, None]), axis=1) / (bucket_size - 1)
    return tf.boolean_mask(norms, keep).numpy(), means.numpy(), tf.sqrt(var).numpy()
