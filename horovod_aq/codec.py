"""The payload format and the numpy reference encoder/decoder (the oracle).

A gradient is cut into buckets, each bucket is scaled by its norm and stochastically rounded onto a
level table (``quantizers.md`` §1, §3), and the result is sent as **one contiguous uint8 buffer**
(``horovod.md`` §5: a single dtype, so payloads fuse; a size that depends only on (n, b, B), so a
gathered buffer reshapes to ``[P, size]``). This module is the specification of that buffer and the
reference implementation of every arithmetic step; ``horovod_aq.torch.kernels`` and
``horovod_aq.tensorflow.kernels`` produce the same bytes for the same uniforms.

Payload layout (format version 1)
---------------------------------
::

    HEADER (32 bytes) | NORMS (4·⌈n/B⌉ bytes) | CODES (⌈n·b/8⌉ bytes)

    size = 32 + 4·⌈n/B⌉ + ⌈n·b/8⌉          (``payload_size``)

with n the element count, B the bucket size and b the bits per code. Nothing else is sent; in
particular the level table is *not* in the payload (§4): only its version and a short hash are.

HEADER, little-endian, no padding (``make_header`` / ``parse_header``):

====== ====== ================================================================
offset type   field
====== ====== ================================================================
0      2s     magic ``b"AQ"``
2      u8     format version (``FORMAT_VERSION`` = 1)
3      u8     bits b per code, 1..8 (= ⌈log₂ N⌉ of the table)
4      u8     norm: 0 = l2, 1 = linf (``NORM_CODES``)
5      u8     flags: 0, or ``FLAG_NONFINITE`` (1) — see "Non-finite input" below
6      u16    N, number of levels in the table
8      u32    level-table version
12     u32    level-table hash (CRC-32 of the float64 levels, ``LevelTable.hash``)
16     u32    bucket size B
20     u64    element count n
28     u32    0; with ``FLAG_NONFINITE``: index of the first non-finite input element
====== ====== ================================================================

The header is 32 bytes, a multiple of 4, so NORMS start 4-aligned in a freshly encoded payload.

NORMS: one float32 (little-endian) per bucket, ⌈n/B⌉ of them, including the partial last bucket.

CODES: the level index of every coordinate, b bits each, packed LSB-first: code i occupies stream
bits [i·b, (i+1)·b), and stream bit k is bit (k mod 8) of byte ⌊k/8⌋. The stream is cut after
⌈n·b/8⌉ bytes; unused high bits of the last byte are zero. Equivalently, each group of 8 codes is
exactly b bytes, the low b bytes of the little-endian 64-bit integer Σ_j code_j << (j·b).

Arithmetic (bit-identical in numpy, PyTorch and TensorFlow)
-----------------------------------------------------------
1. x is flattened and cast to float32 (fp16 / bf16 / fp64 accepted; the cast rounds to nearest).
   Every element must be finite.
2. Bucket k holds x[kB : (k+1)B]; the last bucket may be partial (B' < B) and is quantized with
   its own norm (§1 tail policy (a): no zeros, no silent full precision).
   Its norm n_k is

   * l2:   float32( sqrt( S_k ) ), S_k = Σ_i float64(x_i)² accumulated in float64 in the
     canonical *pairwise order* below, sqrt in float64, one rounding to float32;
   * linf: max_i |x_i| (exact in float32).

   Canonical pairwise order: zero-pad the bucket's squares q_0, …, q_{L−1} to a power of two
   W ≥ L and halve repeatedly, q_k ← q_k + q_{k+W/2} for k < W/2, until one value is left.
   Every float64 square of a float32 is exact and adding a zero is exact, so the result does not
   depend on which power of two W ≥ L is used; a fixed order makes the float64 sum, and hence the
   float32 norm, identical in every framework (a library's ``sum`` has no specified order).
   A norm that overflows float32 (finite values, ‖v‖ > 3.4e38) is rejected.
3. r_i = clip(x_i / n_k, −1, 1) in float32 (IEEE division); r_i = 0 when n_k = 0.
4. With L the levels rounded to float32, values below the float32 normal range (|ℓ| < 2^−126)
   flushed to 0 (``float32_levels``; N values), and D_j = L_{j+1} − L_j in float32:
   j_i = clip(searchsorted(L, r_i, side="right") − 1, 0, N − 2),
   ξ_i = (r_i − L_{j_i}) / D_{j_i} in float32, and code_i = j_i + [u_i < ξ_i] with u_i a float32
   uniform in [0, 1). Since P(code = j+1) = ξ, E[L_code] = r (unbiased, §3), and the
   per-coordinate variance is n²·(L_{j+1} − r)(r − L_j) (``rounding_variance``).
5. Codes are packed as above.
6. Decoding: x̂_i = n_k · L_{code_i} in float32. A zero bucket decodes to zeros (±0.0).
7. Averaging P gathered payloads (rows in rank order): acc = x̂⁽⁰⁾, then acc = acc + x̂⁽ᵖ⁾ for
   p = 1, …, P−1 in float32, *sequentially* (a tree sum over ranks has no specified order), then
   avg = acc / P (float32 division), then a cast to the requested dtype. Every rank and every
   framework obtains the same bits.
8. Uniforms: pass ``uniforms`` (n float32 values in [0, 1)) for reproducible bytes across
   frameworks; otherwise they are drawn from ``seed`` with
   ``np.random.default_rng(seed).random(n, dtype=np.float32)``. Framework random streams differ.

Subnormals. TensorFlow runs its CPU kernels with denormals flushed to zero (FTZ/DAZ), numpy and
PyTorch do not. The format therefore flushes subnormal *levels* (exponential tables reach 2^−127
at 8 bits, and every exact zero of a gradient would round against them), and rejects tables whose
float32 gaps are subnormal. Subnormal *data* is not flushed (that would cost a pass over every
gradient): for elements with |x| < 1.2e-38, or whose normalized or decoded values underflow,
TensorFlow's bytes may differ from numpy's and PyTorch's in those coordinates.

Non-finite input. ``encode`` refuses non-finite values. An integration whose rank meets one sends,
in place of the payload, a *non-finite marker* of the same size (``nonfinite_payload``): the
header with ``FLAG_NONFINITE`` set and the index of the first bad element in the last field, and
zeros elsewhere. Every rank receives the same gathered rows, so every rank learns of it at the
same point and can raise (``NonFiniteGradientError``, what decoding a marker does) or skip the
step consistently; no NaN norm is ever encoded.

Errors: invalid input raises ``ValueError`` (payload problems: ``PayloadError``, a subclass) before
anything is drawn or written, with a message naming the field, both values and what to do.

This module imports numpy only, never torch or tensorflow.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from horovod_aq.levels.table import MAX_BITS, LevelTable

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "NORM_CODES",
    "NORM_NAMES",
    "Header",
    "PayloadError",
    "NonFiniteGradientError",
    "FLAG_NONFINITE",
    "nonfinite_payload",
    "nonfinite_rows",
    "as_table",
    "bucket_norms",
    "bucket_stats",
    "check_header",
    "decode",
    "decode_average",
    "encode",
    "float32_levels",
    "make_header",
    "num_buckets",
    "pack_bits",
    "packed_size",
    "parse_header",
    "payload_size",
    "quantize",
    "quantize_codes",
    "rounding_variance",
    "unpack_bits",
]

MAGIC = b"AQ"
FORMAT_VERSION = 1
#: Header flag: the sender's input had non-finite values; the payload carries no data.
FLAG_NONFINITE = 1
FLAGS_OFFSET = 5
HEADER_FORMAT = "<2sBBBBHIIIQI"  # magic, version, bits, norm, flags, N, tver, thash, B, n, reserved
HEADER_SIZE = struct.calcsize(HEADER_FORMAT)
NORM_BYTES = 4  # one float32 per bucket
NORM_CODES: Mapping[str, int] = {"l2": 0, "linf": 1}
NORM_NAMES: Mapping[int, str] = {code: name for name, code in NORM_CODES.items()}
MAX_BUCKET_SIZE = 2**32 - 1
MAX_NUMEL = 2**64 - 1
CODES_PER_GROUP = 8  # 8 codes of b bits are exactly b bytes
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # 2^−126, smallest normal float32

assert HEADER_SIZE == 32 and HEADER_SIZE % NORM_BYTES == 0


class NonFiniteGradientError(ValueError):
    """A rank's gradient had NaN or Inf values (``first`` = first bad element, if known)."""

    def __init__(self, message: str, first: int | None = None) -> None:
        super().__init__(message)
        self.first = first


class PayloadError(ValueError):
    """A payload is malformed, truncated, or was encoded with other settings or another table."""


# --------------------------------------------------------------------------------------- sizes


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")  # noqa: TRY004 (a setting)
    value = int(value)
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi}, got {value}")
    return value


def _check_bits(bits: Any) -> int:
    return _check_int("bits", bits, 1, MAX_BITS)


def _check_bucket_size(bucket_size: Any) -> int:
    return _check_int("bucket_size", bucket_size, 1, MAX_BUCKET_SIZE)


def _check_norm(norm: Any) -> str:
    if norm not in NORM_CODES:
        raise ValueError(f"unknown norm {norm!r}; use one of {sorted(NORM_CODES)}")
    return str(norm)


def num_buckets(numel: int, bucket_size: int) -> int:
    """⌈n/B⌉: the number of buckets, the partial last one included."""
    numel = _check_int("numel", numel, 0, MAX_NUMEL)
    bucket_size = _check_bucket_size(bucket_size)
    return -(-numel // bucket_size)


def packed_size(numel: int, bits: int) -> int:
    """⌈n·b/8⌉: bytes of the bit-packed codes."""
    numel = _check_int("numel", numel, 0, MAX_NUMEL)
    return -(-numel * _check_bits(bits) // 8)


def payload_size(numel: int, bits: int, bucket_size: int) -> int:
    """Exact payload size in bytes: 32 + 4·⌈n/B⌉ + ⌈n·b/8⌉."""
    return HEADER_SIZE + NORM_BYTES * num_buckets(numel, bucket_size) + packed_size(numel, bits)


# -------------------------------------------------------------------------------------- header


@dataclass(frozen=True)
class Header:
    """The 32-byte payload header, decoded (see the module docstring for the layout)."""

    format_version: int
    bits: int
    norm: str
    flags: int
    num_levels: int
    table_version: int
    table_hash: int
    bucket_size: int
    numel: int
    first_nonfinite: int | None = None  #: set on a non-finite marker

    @property
    def nonfinite(self) -> bool:
        return bool(self.flags & FLAG_NONFINITE)

    @property
    def num_buckets(self) -> int:
        return num_buckets(self.numel, self.bucket_size)

    @property
    def payload_size(self) -> int:
        return payload_size(self.numel, self.bits, self.bucket_size)

    @property
    def norms_offset(self) -> int:
        return HEADER_SIZE

    @property
    def codes_offset(self) -> int:
        return HEADER_SIZE + NORM_BYTES * self.num_buckets


def as_table(levels: LevelTable | Any) -> LevelTable:
    """``levels`` as a ``LevelTable``; a plain array becomes ``LevelTable(levels, version=0)``."""
    return levels if isinstance(levels, LevelTable) else LevelTable(levels, 0)


def make_header(numel: int, table: LevelTable, bucket_size: int, norm: str, *,
                first_nonfinite: int | None = None) -> bytes:
    """The 32 header bytes of a payload of ``numel`` elements encoded with ``table``
    (of a non-finite marker when ``first_nonfinite`` is given)."""
    table = as_table(table)
    marker = first_nonfinite is not None
    return struct.pack(
        HEADER_FORMAT,
        MAGIC,
        FORMAT_VERSION,
        table.bits,
        NORM_CODES[_check_norm(norm)],
        FLAG_NONFINITE if marker else 0,
        table.num_levels,
        table.version,
        table.hash,
        _check_bucket_size(bucket_size),
        _check_int("numel", numel, 0, MAX_NUMEL),
        min(int(first_nonfinite), 2**32 - 1) if marker else 0,
    )


def nonfinite_payload(numel: int, table: LevelTable, bucket_size: int, norm: str,
                      first_nonfinite: int) -> np.ndarray:
    """A non-finite marker: the size of a real payload, header flagged, zeros elsewhere."""
    table = as_table(table)
    out = np.zeros(payload_size(numel, table.bits, bucket_size), dtype=np.uint8)
    out[:HEADER_SIZE] = np.frombuffer(
        make_header(numel, table, bucket_size, norm, first_nonfinite=first_nonfinite), np.uint8)
    return out


def nonfinite_rows(flags: Any) -> list[int]:
    """Indices of the gathered rows whose flags byte (``FLAGS_OFFSET``) marks non-finite input."""
    return [i for i, f in enumerate(np.asarray(flags).reshape(-1)) if int(f) & FLAG_NONFINITE]


def _as_bytes(buf: Any) -> np.ndarray:
    """A payload (bytes, bytearray, memoryview or 1-D uint8 array) as a 1-D uint8 array."""
    if isinstance(buf, (bytes, bytearray, memoryview)):
        return np.frombuffer(buf, dtype=np.uint8)
    arr = np.asarray(buf)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise PayloadError(
            f"a payload must be a 1-D uint8 buffer, got dtype {arr.dtype} and shape {arr.shape}"
        )
    return arr


def parse_header(buf: Any) -> Header:
    """Decode and check the first 32 bytes of a payload.

    Raises ``PayloadError`` for a buffer shorter than the header, a wrong magic, an unsupported
    format version, bits outside 1..8, an unknown norm code or non-zero reserved fields.
    """
    data = _as_bytes(buf)
    if data.size < HEADER_SIZE:
        raise PayloadError(
            f"payload is truncated: {data.size} bytes, shorter than the {HEADER_SIZE}-byte header"
        )
    magic, version, bits, norm, flags, nlev, tver, thash, bsize, numel, reserved = struct.unpack(
        HEADER_FORMAT, data[:HEADER_SIZE].tobytes()
    )
    if magic != MAGIC:
        raise PayloadError(
            f"not a horovod_aq payload: magic {magic!r}, expected {MAGIC!r} (wrong buffer or "
            "corrupted data)"
        )
    if version != FORMAT_VERSION:
        raise PayloadError(
            f"unsupported payload format version {version}; this build reads version "
            f"{FORMAT_VERSION} (ranks run different horovod_aq versions)"
        )
    if not 1 <= bits <= MAX_BITS:
        raise PayloadError(f"payload header has bits {bits}, outside 1..{MAX_BITS}")
    if norm not in NORM_NAMES:
        raise PayloadError(f"payload header has unknown norm code {norm}; "
                           f"known: {dict(NORM_NAMES)}")
    if flags not in (0, FLAG_NONFINITE) or (reserved != 0 and flags != FLAG_NONFINITE):
        raise PayloadError(
            f"payload header has reserved fields set (flags {flags}, reserved {reserved}); it was "
            "written by a newer format revision"
        )
    if bsize < 1:
        raise PayloadError("payload header has bucket size 0")
    if not 2 <= nlev <= 1 << bits:
        raise PayloadError(f"payload header has {nlev} levels, impossible with {bits} bits")
    return Header(version, bits, NORM_NAMES[norm], flags, nlev, tver, thash, bsize, numel,
                  reserved if flags == FLAG_NONFINITE else None)


def check_header(
    header: Header,
    table: LevelTable,
    *,
    numel: int | None = None,
    bucket_size: int | None = None,
    norm: str | None = None,
) -> None:
    """Check that a payload header matches this rank's table and, if given, settings.

    Raises ``PayloadError`` naming the first field that differs and both values.
    """
    table = as_table(table)
    if header.nonfinite:
        raise NonFiniteGradientError(
            f"the sender's gradient had non-finite values (first at element "
            f"{header.first_nonfinite} of {header.numel}); it sent a marker instead of data. "
            "Lower the learning rate or use loss scaling, or pass nonfinite='skip' to the "
            "compressor to skip such steps on every rank", header.first_nonfinite)
    if header.table_version != table.version or header.table_hash != table.hash:
        raise PayloadError(
            f"payload was encoded with level-table version {header.table_version} "
            f"(hash {header.table_hash:08x}) but this rank holds version {table.version} "
            f"(hash {table.hash:08x}): ranks disagree on the level table; make every rank "
            "install a new table at the same step"
        )
    if header.num_levels != table.num_levels:
        raise PayloadError(
            f"payload has {header.num_levels} levels but this rank's table has "
            f"{table.num_levels}: ranks disagree on the level table"
        )
    if header.bits != table.bits:
        raise PayloadError(
            f"payload has {header.bits} bits per code but this rank's table needs {table.bits}"
        )
    expected = {"numel": numel, "bucket_size": bucket_size, "norm": norm}
    for field, want in expected.items():
        got = getattr(header, field)
        if want is not None and got != want:
            raise PayloadError(
                f"payload has {field} {got!r} but the caller expects {want!r}: ranks disagree "
                "on the tensor or the compressor settings"
            )


def _check_size(header: Header, actual: int, what: str = "payload") -> None:
    expected = header.payload_size
    if actual != expected:
        kind = "truncated" if actual < expected else "too long"
        raise PayloadError(
            f"{what} is {kind}: {actual} bytes, but its header (n={header.numel}, "
            f"bits={header.bits}, bucket_size={header.bucket_size}) requires {expected}"
        )


# ------------------------------------------------------------------------------- input checks


def _is_float_dtype(dtype: np.dtype) -> bool:
    # ml_dtypes' bfloat16 / float8 register as kind "V"; accept them by name.
    return dtype.kind == "f" or dtype.name.startswith(("bfloat16", "float8"))


def _as_float32_flat(x: Any) -> np.ndarray:
    """x flattened and cast to float32, after checking it is floating point and finite."""
    arr = np.asarray(x)
    if not _is_float_dtype(arr.dtype):
        raise ValueError(f"expected a floating-point gradient, got dtype {arr.dtype}")
    with np.errstate(over="ignore"):  # values beyond float32 become ±Inf and are reported
        flat = arr.reshape(-1).astype(np.float32, copy=False)
    bad = ~np.isfinite(flat)
    if bad.any():
        raise ValueError(non_finite_message(int(bad.sum()), int(np.argmax(bad)), flat.size))
    return flat


def non_finite_message(count: int, first: int, numel: int) -> str:
    """The error message for a gradient with non-finite values (shared by every framework)."""
    return (
        f"cannot quantize a gradient with non-finite values: {count} of {numel} elements are "
        f"NaN or ±Inf in float32 (first at flat index {first}); check the loss scale or clip "
        "the gradients before compressing"
    )


def norm_overflow_message(bucket: int) -> str:
    """The error message for a bucket whose norm does not fit in float32."""
    return (
        f"bucket {bucket} has a norm that overflows float32 (all values finite but too large); "
        "scale the gradient down before compressing"
    )


def _check_norms(norms: np.ndarray) -> None:
    bad = ~np.isfinite(norms)
    if bad.any():
        raise ValueError(norm_overflow_message(int(np.argmax(bad))))


def _uniforms(n: int, seed: Any, uniforms: Any) -> np.ndarray:
    if uniforms is not None:
        u = np.asarray(uniforms)
        if u.shape != (n,):
            raise ValueError(f"uniforms must have shape ({n},), got {u.shape}")
        u = u.astype(np.float32, copy=False)
        if n and not (u.min() >= 0.0 and u.max() < 1.0):
            raise ValueError("uniforms must lie in [0, 1) after rounding to float32")
        return u
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    return rng.random(n, dtype=np.float32)


# ----------------------------------------------------------------------------------- buckets


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _bucket_matrix(flat: np.ndarray, bucket_size: int, width: int, dtype: Any) -> np.ndarray:
    """[⌈n/B⌉, width] matrix of the buckets (rows), zero-padded on the right."""
    n = flat.size
    nb = -(-n // bucket_size)
    rows = np.zeros((nb, width), dtype=dtype)
    full = (n // bucket_size) * bucket_size
    length = min(bucket_size, width)
    rows[: n // bucket_size, :length] = flat[:full].reshape(-1, bucket_size)[:, :length]
    if full < n:
        rows[-1, : n - full] = flat[full:]
    return rows


def pairwise_sum_rows(rows: np.ndarray) -> np.ndarray:
    """Row sums in the canonical pairwise order (module docstring, step 2). Width: power of 2."""
    width = rows.shape[1]
    assert width & (width - 1) == 0, "width must be a power of two"
    while width > 1:
        width //= 2
        rows = rows[:, :width] + rows[:, width:]
    return rows[:, 0]


def bucket_norms(x: Any, bucket_size: int, norm: str = "l2") -> np.ndarray:
    """float32 norm of every bucket of the flattened float32 x (step 2), the partial one included.

    l2 accumulates the squares in float64 in the canonical pairwise order; linf is max |x_i|.
    """
    flat = _as_float32_flat(x)
    bucket_size = _check_bucket_size(bucket_size)
    norm = _check_norm(norm)
    if flat.size == 0:
        return np.zeros(0, dtype=np.float32)
    length = min(bucket_size, flat.size)
    if norm == "linf":
        return np.abs(_bucket_matrix(flat, bucket_size, length, np.float32)).max(axis=1)
    rows = _bucket_matrix(flat, bucket_size, _next_pow2(length), np.float64)
    with np.errstate(over="ignore"):  # an overflowing norm becomes Inf; callers reject it
        return np.sqrt(pairwise_sum_rows(rows * rows)).astype(np.float32)


# -------------------------------------------------------------------------------- quantizing


def float32_levels(table: LevelTable) -> np.ndarray:
    """The float32 table L of step 4 (what every framework computes with).

    The levels rounded to float32, with values below the float32 normal range (|ℓ| < 2^−126)
    flushed to +0.0 so that TensorFlow's flush-to-zero kernels see the same table. Raises
    ``ValueError`` if two distinct levels are closer than 2^−126 in float32 (their difference
    would itself be flushed).
    """
    levels = as_table(table).levels.astype(np.float32)
    levels[np.abs(levels) < FLOAT32_TINY] = 0.0
    gaps = levels[1:] - levels[:-1]
    if np.any((gaps > 0) & (gaps < FLOAT32_TINY)):
        raise ValueError(
            "two levels of the table are closer than 1.2e-38 in float32, the smallest normal "
            "float32; spread the levels apart (e.g. horovod_aq.levels.families.separate_levels)"
        )
    return levels


def _levels_f32(table: LevelTable) -> tuple[np.ndarray, np.ndarray]:
    levels = float32_levels(table)
    return levels, levels[1:] - levels[:-1]


def _normalized(flat: np.ndarray, norms: np.ndarray, bucket_size: int) -> np.ndarray:
    """r = clip(x / n_bucket, −1, 1) in float32, 0 in zero buckets (step 3)."""
    safe = np.where(norms == 0, np.float32(1), norms)  # x is all zeros there: 0 / 1 = 0
    per_elem = np.repeat(safe, bucket_size)[: flat.size]
    return np.clip(flat / per_elem, np.float32(-1), np.float32(1))


def _round(r: np.ndarray, table: LevelTable, u: np.ndarray) -> np.ndarray:
    """Unbiased stochastic rounding of r onto the table (step 4): uint8 codes."""
    levels, widths = _levels_f32(table)
    j = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, levels.size - 2)
    xi = (r - levels[j]) / widths[j]
    return (j + (u < xi)).astype(np.uint8)


def quantize_codes(
    x: Any, table: LevelTable, *, bucket_size: int, norm: str = "l2", uniforms: Any
) -> tuple[np.ndarray, np.ndarray]:
    """Level indices (uint8, one per element) and bucket norms (float32) of x; steps 1–4."""
    table = as_table(table)
    bucket_size = _check_bucket_size(bucket_size)
    norm = _check_norm(norm)
    flat = _as_float32_flat(x)
    norms = bucket_norms(flat, bucket_size, norm)
    _check_norms(norms)
    u = _uniforms(flat.size, None, uniforms)
    return _round(_normalized(flat, norms, bucket_size), table, u), norms


def _prepare(
    x: Any, levels: Any, bucket_size: Any, norm: Any, seed: Any, uniforms: Any
) -> tuple[LevelTable, int, np.ndarray, np.ndarray, np.ndarray]:
    """Validate everything, then draw the uniforms (so bad input leaves ``seed`` untouched)."""
    table = as_table(levels)
    bucket_size = _check_bucket_size(bucket_size)
    norm = _check_norm(norm)
    flat = _as_float32_flat(x)
    norms = bucket_norms(flat, bucket_size, norm)
    _check_norms(norms)
    u = _uniforms(flat.size, seed, uniforms)
    return table, bucket_size, flat, norms, u


# ----------------------------------------------------------------------------------- packing


def pack_bits(codes: Any, bits: int) -> np.ndarray:
    """Pack codes (each < 2^bits) LSB-first into ⌈n·bits/8⌉ bytes (step 5)."""
    bits = _check_bits(bits)
    codes = np.asarray(codes)
    if codes.ndim != 1:
        raise ValueError(f"codes must be 1-D, got shape {codes.shape}")
    n = codes.size
    if n and int(codes.max()) >= 1 << bits:
        raise ValueError(f"a code does not fit in {bits} bits (max {int(codes.max())})")
    groups = -(-n // CODES_PER_GROUP)
    padded = np.zeros(groups * CODES_PER_GROUP, dtype=np.uint64)
    padded[:n] = codes
    shifts = np.arange(CODES_PER_GROUP, dtype=np.uint64) * np.uint64(bits)
    words = (padded.reshape(groups, CODES_PER_GROUP) << shifts).sum(axis=1, dtype=np.uint64)
    stream = words.astype("<u8").view(np.uint8).reshape(groups, 8)[:, :bits].reshape(-1)
    return stream[: packed_size(n, bits)].copy()


def unpack_bits(buf: Any, bits: int, count: int) -> np.ndarray:
    """The first ``count`` codes of a bit stream written by ``pack_bits`` (uint8)."""
    bits = _check_bits(bits)
    count = _check_int("count", count, 0, MAX_NUMEL)
    data = _as_bytes(buf)
    nbytes = packed_size(count, bits)
    if data.size < nbytes:
        raise PayloadError(f"code stream is truncated: {data.size} bytes, {nbytes} needed")
    groups = -(-count // CODES_PER_GROUP)
    stream = np.zeros(groups * bits, dtype=np.uint8)
    stream[:nbytes] = data[:nbytes]
    words8 = np.zeros((groups, 8), dtype=np.uint8)
    words8[:, :bits] = stream.reshape(groups, bits)
    words = words8.view("<u8").reshape(groups, 1)
    shifts = np.arange(CODES_PER_GROUP, dtype=np.uint64) * np.uint64(bits)
    codes = (words >> shifts) & np.uint64((1 << bits) - 1)
    return codes.reshape(-1)[:count].astype(np.uint8)


# ---------------------------------------------------------------------------- encode / decode


def encode(
    x: Any,
    levels: LevelTable | Any,
    *,
    bucket_size: int,
    norm: str = "l2",
    seed: Any = None,
    uniforms: Any = None,
) -> np.ndarray:
    """Quantize and pack x into one uint8 payload of ``payload_size(x.size, bits, bucket_size)``.

    Args:
        x: gradient of any shape, floating point (cast to float32), finite.
        levels: a ``LevelTable``, or an array of levels (taken as table version 0).
        bucket_size: B, coordinates per bucket (≥ 1).
        norm: ``"l2"`` or ``"linf"``.
        seed: int or ``np.random.Generator`` for the uniforms (None: fresh entropy).
        uniforms: n float32 values in [0, 1); overrides ``seed``. Same uniforms ⇒ same bytes in
            every framework.
    """
    table, bucket_size, flat, norms, u = _prepare(x, levels, bucket_size, norm, seed, uniforms)
    codes = _round(_normalized(flat, norms, bucket_size), table, u)
    return np.concatenate(
        [
            np.frombuffer(make_header(flat.size, table, bucket_size, norm), dtype=np.uint8),
            norms.astype("<f4").view(np.uint8),
            pack_bits(codes, table.bits),
        ]
    )


def _dequantize(codes: np.ndarray, norms: np.ndarray, table: LevelTable, bucket_size: int):
    """x̂ = n_bucket · L[code] in float32 (step 6)."""
    levels, _ = _levels_f32(table)
    return np.repeat(norms, bucket_size)[: codes.size] * levels[codes]


def _read_payload(data: np.ndarray, header: Header, table: LevelTable) -> np.ndarray:
    """float32 values of one size-checked payload."""
    nb = header.num_buckets
    norms = np.frombuffer(data[HEADER_SIZE : header.codes_offset].tobytes(), dtype="<f4")
    if not np.all(np.isfinite(norms) & (norms >= 0)):
        raise PayloadError("payload holds a negative or non-finite bucket norm (corrupted data)")
    codes = unpack_bits(data[header.codes_offset :], header.bits, header.numel)
    if header.numel and int(codes.max()) >= table.num_levels:
        raise PayloadError(
            f"payload holds code {int(codes.max())} but the table has {table.num_levels} levels "
            "(corrupted data)"
        )
    assert norms.size == nb
    return _dequantize(codes, norms.astype(np.float32), table, header.bucket_size)


def decode(
    payload: Any,
    levels: LevelTable | Any,
    *,
    dtype: Any = np.float32,
    numel: int | None = None,
    bucket_size: int | None = None,
    norm: str | None = None,
) -> np.ndarray:
    """Decode one payload into a flat array of ``dtype`` (reshape it yourself).

    The header must match ``levels`` (version and hash) and, when given, ``numel``,
    ``bucket_size`` and ``norm``; the size must match the header exactly.
    """
    table = as_table(levels)
    data = _as_bytes(payload)
    header = parse_header(data)
    check_header(header, table, numel=numel, bucket_size=bucket_size, norm=norm)
    _check_size(header, data.size)
    return _read_payload(data, header, table).astype(dtype, copy=False)


def check_rows(
    headers: list[Header],
    table: LevelTable,
    size: int,
    *,
    numel: int | None = None,
    bucket_size: int | None = None,
    norm: str | None = None,
    name_rank: bool = True,
) -> Header:
    """Check the headers of the P rows (``size`` bytes each) of a gathered buffer, in rank order.

    Settings left as None are taken from row 0; every row must match them, ``table`` and the
    row size (``check_header``, ``_check_size``). With ``name_rank`` an error's message starts
    with "rank r:" and the error gets a ``rank`` attribute. Returns row 0's header.
    """
    first = headers[0]
    numel = first.numel if numel is None else numel
    bucket_size = first.bucket_size if bucket_size is None else bucket_size
    norm = first.norm if norm is None else norm
    for rank, header in enumerate(headers):
        try:
            check_header(header, table, numel=numel, bucket_size=bucket_size, norm=norm)
            _check_size(header, size)
        except (PayloadError, NonFiniteGradientError) as err:
            if name_rank:
                err.args = (f"rank {rank}: {err}",) + err.args[1:]
                err.rank = rank
            raise
    return first


def decode_average(
    payloads: Any,
    levels: LevelTable | Any,
    *,
    dtype: Any = np.float32,
    numel: int | None = None,
    bucket_size: int | None = None,
    norm: str | None = None,
) -> np.ndarray:
    """Average of the decoded rows of a gathered ``[P, size]`` uint8 buffer (step 7).

    Rows are summed sequentially in rank order in float32 and divided by P, so the result is
    bitwise the same on every rank and in every framework. All rows must carry the same header
    settings; a list of 1-D payloads is accepted too.
    """
    table = as_table(levels)
    if isinstance(payloads, (list, tuple)):
        payloads = np.stack([_as_bytes(p) for p in payloads]) if payloads else np.zeros((0, 0))
    rows = np.asarray(payloads)
    if rows.ndim != 2 or rows.dtype != np.uint8 or rows.shape[0] == 0:
        raise PayloadError(
            f"gathered payloads must be a non-empty [P, size] uint8 array, got dtype {rows.dtype} "
            f"and shape {rows.shape}"
        )
    headers = [parse_header(row) for row in rows]
    first = check_rows(headers, table, rows.shape[1], numel=numel, bucket_size=bucket_size,
                       norm=norm)
    acc = _read_payload(rows[0], first, table)
    for rank in range(1, rows.shape[0]):
        acc = acc + _read_payload(rows[rank], headers[rank], table)
    return (acc / np.float32(rows.shape[0])).astype(dtype, copy=False)


def quantize(
    x: Any,
    levels: LevelTable | Any,
    *,
    bucket_size: int,
    norm: str = "l2",
    seed: Any = None,
    uniforms: Any = None,
    dtype: Any = np.float32,
) -> np.ndarray:
    """``decode(encode(x))`` without packing: the flat quantized values, bitwise the same."""
    table, bucket_size, flat, norms, u = _prepare(x, levels, bucket_size, norm, seed, uniforms)
    codes = _round(_normalized(flat, norms, bucket_size), table, u)
    return _dequantize(codes, norms, table, bucket_size).astype(dtype, copy=False)


# ------------------------------------------------------------------------------- statistics


def rounding_variance(
    x: Any, levels: LevelTable | Any, *, bucket_size: int, norm: str = "l2"
) -> np.ndarray:
    """Per-bucket expected squared error E‖Q(v) − v‖² = n²·Σ_i (L_{j+1} − r_i)(r_i − L_j) (§3).

    Computed in float64 from the same float32 r, L_j, L_{j+1} the encoder uses.
    """
    table = as_table(levels)
    bucket_size = _check_bucket_size(bucket_size)
    flat = _as_float32_flat(x)
    norms = bucket_norms(flat, bucket_size, norm)
    _check_norms(norms)
    levels32, _ = _levels_f32(table)
    r = _normalized(flat, norms, bucket_size)
    j = np.clip(np.searchsorted(levels32, r, side="right") - 1, 0, levels32.size - 2)
    r64 = r.astype(np.float64)
    per_coord = (levels32[j + 1].astype(np.float64) - r64) * (r64 - levels32[j])
    sums = np.bincount(np.arange(flat.size) // bucket_size, per_coord, minlength=norms.size)
    return norms.astype(np.float64) ** 2 * sums


def bucket_stats(x: Any, bucket_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Statistics of the full buckets with a non-zero norm, for level fitting (§5.1).

    Returns float64 arrays (norms n_b = ‖v_b‖₂, means m_b = mean(u), stds s_b = std(u, ddof=1))
    with u = v_b / n_b, computed in float64. The partial tail bucket and zero buckets are skipped.
    """
    bucket_size = _check_int("bucket_size", bucket_size, 2, MAX_BUCKET_SIZE)
    flat = _as_float32_flat(x).astype(np.float64)
    full = flat.size // bucket_size
    rows = flat[: full * bucket_size].reshape(full, bucket_size)
    norms = np.sqrt(np.sum(rows * rows, axis=1))
    keep = norms > 0
    u = rows[keep] / norms[keep, None]
    return norms[keep], u.mean(axis=1), u.std(axis=1, ddof=1)
