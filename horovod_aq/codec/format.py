"""The wire format of a horovod_aq payload: layout, header, sizes, validators and errors.

A gradient is cut into buckets, each bucket is scaled by its norm and stochastically rounded onto
a level table (``docs/quantizers.md`` §1, §3), and the result is sent as **one contiguous uint8
buffer** (``docs/protocol.md`` §5: a single dtype, so payloads fuse; a size that depends only on
(n, b, B), so a gathered buffer reshapes to ``[P, size]``). This module is the specification of
that buffer; the full description, with the rationale, is ``docs/format.md``. The arithmetic that
fills it is in ``horovod_aq.codec.reference`` (the numpy oracle), which every kernel matches byte
for byte.

Payload layout (format version 2)
---------------------------------
::

    HEADER (32 bytes) | NORMS (4·⌈n/B⌉ bytes) | CODES (⌈n·b/8⌉ bytes)

    size = 32 + 4·⌈n/B⌉ + ⌈n·b/8⌉          (``payload_size``)

with n the element count, B the bucket size and b the bits per code. Nothing else is sent; in
particular the level table is *not* in the payload (§4): only its version and a short hash are.

HEADER, little-endian, no padding (``HEADER_FORMAT``, ``HEADER_FIELDS``, ``make_header`` /
``parse_header``):

====== ====== ================================================================
offset type   field
====== ====== ================================================================
0      2s     magic ``b"AQ"`` (``MAGIC``)
2      u8     format version (``FORMAT_VERSION`` = 2)
3      u8     bits b per code, 1..8 (= ⌈log₂ N⌉ of the table)
4      u8     norm: 0 = l2, 1 = linf (``NORM_CODES``)
5      u8     flags: 0, ``FLAG_NONFINITE`` (1) — see "Non-finite input" — or
              ``FLAG_CHECKSUM`` (2) — see "Checksum" (``FLAGS_OFFSET``)
6      u16    N, number of levels in the table
8      u32    level-table version (bytes 8..16 = ``TABLE_ID_SLICE``, what a refit changes)
12     u32    level-table hash (CRC-32 of the float64 levels, ``LevelTable.hash``)
16     u32    bucket size B
20     u64    element count n
28     u32    0; with ``FLAG_NONFINITE``: index of the first non-finite input element
              (``MARKER_INDEX_OFFSET``); with ``FLAG_CHECKSUM``: the CRC-32 (``CHECKSUM_OFFSET``)
====== ====== ================================================================

The header is 32 bytes, a multiple of 4, so NORMS start 4-aligned in a freshly encoded payload.
NORMS: one little-endian float32 (``NORM_BYTES``) per bucket, the partial last one included.
CODES: the level index of every coordinate, b bits each, packed LSB-first (code i occupies
stream bits [i·b, (i+1)·b), stream bit k is bit k mod 8 of byte ⌊k/8⌋), cut after ⌈n·b/8⌉ bytes;
unused high bits of the last byte are zero (``horovod_aq.codec.bits``).

Non-finite input. ``encode`` refuses non-finite values. A rank that meets one sends a
*non-finite marker* of the payload's size instead (``nonfinite_payload``: this header with
``FLAG_NONFINITE`` and the first bad index in the last field, zeros elsewhere), so every rank sees
it in the same gathered rows and raises (``NonFiniteGradientError``) or skips the step alike.

Checksum (optional). With ``FLAG_CHECKSUM`` the last header field holds the CRC-32 (IEEE 802.3,
``zlib.crc32``) of every other byte of the payload: bytes 0..27, then bytes 32..size−1 (the norms
and the codes), ``payload_checksum``. Encoders write it when asked (``checksum=True``;
``seal_checksum``), every decoder verifies it before reading the data (``check_checksum``); a
payload without the flag is not verified. The layout and the size do not change.

Bounded decoding. A header may state any bucket size B ≤ 2³² − 1 for any n (B > n is one bucket of
n elements); decoders size per-bucket work by ``Header.span`` = min(B, n), never by B, so the
memory of a decode is bounded by the payload size and n (``check_size`` ties both to the buffer).

Errors: invalid input raises ``ValueError`` (payload problems: ``PayloadError``, a subclass) before
anything is drawn or written, with a message naming the field, both values and what to do. The
validators and messages below (``check_*``, ``*_message``) are shared by every kernel.

This module imports numpy only, never torch or tensorflow.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from horovod_aq.levels.table import MAX_BITS, LevelTable

__all__ = [
    "CHECKSUM_OFFSET", "CODES_PER_GROUP", "FLAGS_OFFSET", "FLAG_CHECKSUM", "FLAG_ENTROPY",
    "FLAG_NONFINITE", "FLOAT32_TINY", "FORMAT_VERSION", "HEADER_FIELDS", "HEADER_FORMAT",
    "HEADER_SIZE", "Header",
    "MAGIC", "MARKER_INDEX_OFFSET", "MAX_BUCKET_SIZE", "MAX_NUMEL", "NORM_BYTES", "NORM_CODES",
    "NORM_NAMES", "NonFiniteGradientError", "PayloadError", "TABLE_ID_SLICE", "as_bytes",
    "as_table", "bad_code_message", "bad_norm_message", "check_bits", "check_bool",
    "check_bucket_size", "check_checksum", "check_finite", "check_header", "check_int",
    "check_norm", "check_norms", "check_payload_norms", "check_size", "float32_levels",
    "make_header", "non_finite_message", "nonfinite_payload", "nonfinite_rows",
    "norm_overflow_message", "num_buckets", "packed_size", "parse_header", "payload_checksum",
    "payload_size", "seal_checksum",
]

MAGIC = b"AQ"
#: 2: the uniforms of stochastic rounding are the counter-based stream of ``codec.stream``
#: (version 1 left them to each framework). The byte layout is unchanged.
FORMAT_VERSION = 2
#: Header flag: the sender's input had non-finite values; the payload carries no data.
FLAG_NONFINITE = 1
#: Header flag: the last header field holds the CRC-32 of the rest of the payload
#: (``payload_checksum``); every decoder verifies it. A marker never carries it.
FLAG_CHECKSUM = 2
#: Header flag: the codes section is replaced by an entropy-coded body (docs/format.md §12,
#: ``horovod_aq.codec.entropy_format``); may be combined with ``FLAG_CHECKSUM``.
FLAG_ENTROPY = 4
#: The flags values a decoder of this build reads.
KNOWN_FLAGS = (0, FLAG_NONFINITE, FLAG_CHECKSUM, FLAG_ENTROPY, FLAG_ENTROPY | FLAG_CHECKSUM)
HEADER_FORMAT = "<2sBBBBHIIIQI"  # magic, version, bits, norm, flags, N, tver, thash, B, n, reserved
HEADER_SIZE = struct.calcsize(HEADER_FORMAT)
#: Every header field: its name (as error messages spell it) → its bytes, in header order.
HEADER_FIELDS: Mapping[str, slice] = {
    "magic": slice(0, 2),
    "format version": slice(2, 3),
    "bits": slice(3, 4),
    "norm": slice(4, 5),
    "flags": slice(5, 6),
    "number of levels": slice(6, 8),
    "level-table version": slice(8, 12),
    "level-table hash": slice(12, 16),
    "bucket size": slice(16, 20),
    "numel": slice(20, 28),
    "reserved": slice(28, 32),
}
#: The flags byte (``FLAG_NONFINITE``).
FLAGS_OFFSET = HEADER_FIELDS["flags"].start
#: The bytes that change at a refit: level-table version (u32) and hash (u32).
TABLE_ID_SLICE = slice(HEADER_FIELDS["level-table version"].start,
                       HEADER_FIELDS["level-table hash"].stop)
#: A non-finite marker's index of the first bad element (u32, the last header field).
MARKER_INDEX_OFFSET = HEADER_FIELDS["reserved"].start
#: With ``FLAG_CHECKSUM``: the payload's CRC-32 (u32, the same last header field).
CHECKSUM_OFFSET = HEADER_FIELDS["reserved"].start
NORM_BYTES = 4  # one float32 per bucket
NORM_CODES: Mapping[str, int] = {"l2": 0, "linf": 1}
NORM_NAMES: Mapping[int, str] = {code: name for name, code in NORM_CODES.items()}
MAX_BUCKET_SIZE = 2**32 - 1
MAX_NUMEL = 2**64 - 1
CODES_PER_GROUP = 8  # 8 codes of b bits are exactly b bytes
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # 2^−126, smallest normal float32

assert HEADER_SIZE == 32 and HEADER_SIZE % NORM_BYTES == 0  # HEADER_FIELDS: tests/test_codec.py


class NonFiniteGradientError(ValueError):
    """A rank's gradient had NaN or Inf values (``first`` = first bad element and ``rank`` = the
    row of the collective that flagged it, where known)."""

    def __init__(self, message: str, first: int | None = None, rank: int | None = None) -> None:
        super().__init__(message)
        self.first, self.rank = first, rank


class PayloadError(ValueError):
    """A payload is malformed, truncated, or was encoded with other settings or another table."""


# ---------------------------------------------------------------------------------- validators


def check_int(name: str, value: Any, lo: int, hi: int) -> int:
    """``value`` as an int, or ``ValueError`` naming ``name`` if it is not an integer in lo..hi."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")  # noqa: TRY004 (a setting)
    value = int(value)
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi}, got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` as a bool, or ``TypeError`` naming ``name`` unless it is True or False."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_bits(bits: Any) -> int:
    """Bits per code, 1..8."""
    return check_int("bits", bits, 1, MAX_BITS)


def check_bucket_size(bucket_size: Any) -> int:
    """Bucket size B, 1..2^32 − 1 (the header field is a u32)."""
    return check_int("bucket_size", bucket_size, 1, MAX_BUCKET_SIZE)


def check_norm(norm: Any) -> str:
    """``"l2"`` or ``"linf"``."""
    if norm not in NORM_CODES:
        raise ValueError(f"unknown norm {norm!r}; use one of {sorted(NORM_CODES)}")
    return str(norm)


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


def check_finite(flat: np.ndarray) -> None:
    """``ValueError`` (``non_finite_message``) if the flat float32 array has NaN or ±Inf."""
    bad = ~np.isfinite(flat)
    if bad.any():
        raise ValueError(non_finite_message(int(bad.sum()), int(np.argmax(bad)), flat.size))


def check_norms(norms: np.ndarray) -> None:
    """``ValueError`` (``norm_overflow_message``) if a bucket norm is not finite."""
    bad = ~np.isfinite(norms)
    if bad.any():
        raise ValueError(norm_overflow_message(int(np.argmax(bad))))


def as_table(levels: LevelTable | Any) -> LevelTable:
    """``levels`` as a ``LevelTable``; a plain array becomes ``LevelTable(levels, version=0)``."""
    return levels if isinstance(levels, LevelTable) else LevelTable(levels, 0)


def float32_levels(table: LevelTable) -> np.ndarray:
    """The float32 table L that every framework computes with (``reference`` step 4).

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


def as_bytes(buf: Any) -> np.ndarray:
    """A payload (bytes, bytearray, memoryview or 1-D uint8 array) as a 1-D uint8 array."""
    if isinstance(buf, (bytes, bytearray, memoryview)):
        return np.frombuffer(buf, dtype=np.uint8)
    arr = np.asarray(buf)
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise PayloadError(
            f"a payload must be a 1-D uint8 buffer, got dtype {arr.dtype} and shape {arr.shape}"
        )
    return arr


# --------------------------------------------------------------------------------------- sizes


def num_buckets(numel: int, bucket_size: int) -> int:
    """⌈n/B⌉: the number of buckets, the partial last one included."""
    numel = check_int("numel", numel, 0, MAX_NUMEL)
    bucket_size = check_bucket_size(bucket_size)
    return -(-numel // bucket_size)


def packed_size(numel: int, bits: int) -> int:
    """⌈n·b/8⌉: bytes of the bit-packed codes."""
    numel = check_int("numel", numel, 0, MAX_NUMEL)
    return -(-numel * check_bits(bits) // 8)


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
    checksum: int | None = None  #: the stored CRC-32, set with ``FLAG_CHECKSUM``

    @property
    def nonfinite(self) -> bool:
        return bool(self.flags & FLAG_NONFINITE)

    @property
    def checksummed(self) -> bool:
        """Whether the payload carries a CRC-32 that decoders verify (``FLAG_CHECKSUM``)."""
        return bool(self.flags & FLAG_CHECKSUM)

    @property
    def entropy(self) -> bool:
        """Whether the codes are entropy-coded (``FLAG_ENTROPY``, docs/format.md §12): the
        payload's size is then in its coder header, not a function of (n, b, B)."""
        return bool(self.flags & FLAG_ENTROPY)

    @property
    def num_buckets(self) -> int:
        return num_buckets(self.numel, self.bucket_size)

    @property
    def span(self) -> int:
        """min(B, n) (1 when n = 0): the length of the longest bucket actually present.

        Decoders size per-bucket work by it, never by B: a header may state B = 2³² − 1 for a
        single element, and a temporary of B elements would then be 16 GiB."""
        return max(1, min(self.bucket_size, self.numel))

    @property
    def payload_size(self) -> int:
        return payload_size(self.numel, self.bits, self.bucket_size)

    @property
    def norms_offset(self) -> int:
        return HEADER_SIZE

    @property
    def codes_offset(self) -> int:
        return HEADER_SIZE + NORM_BYTES * self.num_buckets


def make_header(numel: int, table: LevelTable, bucket_size: int, norm: str, *,
                first_nonfinite: int | None = None, checksum: bool = False) -> bytes:
    """The 32 header bytes of a payload of ``numel`` elements encoded with ``table``
    (of a non-finite marker when ``first_nonfinite`` is given). ``checksum``: set
    ``FLAG_CHECKSUM`` and leave the CRC field 0, for ``seal_checksum`` to fill once the data
    is written."""
    table = as_table(table)
    marker = first_nonfinite is not None
    if marker and checksum:
        raise ValueError("a non-finite marker carries no checksum (it has no data)")
    return struct.pack(
        HEADER_FORMAT,
        MAGIC,
        FORMAT_VERSION,
        table.bits,
        NORM_CODES[check_norm(norm)],
        FLAG_NONFINITE if marker else (FLAG_CHECKSUM if checksum else 0),
        table.num_levels,
        table.version,
        table.hash,
        check_bucket_size(bucket_size),
        check_int("numel", numel, 0, MAX_NUMEL),
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


def parse_header(buf: Any) -> Header:
    """Decode and check the first 32 bytes of a payload.

    Raises ``PayloadError`` for a buffer shorter than the header, a wrong magic, an unsupported
    format version, bits outside 1..8, an unknown norm code, unknown flags, a non-zero reserved
    field without a flag that gives it a meaning, a bucket size 0 or an impossible number of
    levels. Nothing here depends on the size of B: see ``Header.span``.
    """
    data = as_bytes(buf)
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
    if flags not in KNOWN_FLAGS or (reserved != 0
                                    and not flags & (FLAG_NONFINITE | FLAG_CHECKSUM)):
        raise PayloadError(
            f"payload header has reserved fields set (flags {flags}, reserved {reserved}); it was "
            "written by a newer format revision"
        )
    if bsize < 1:
        raise PayloadError("payload header has bucket size 0")
    if not 2 <= nlev <= 1 << bits:
        raise PayloadError(f"payload header has {nlev} levels, impossible with {bits} bits")
    return Header(version, bits, NORM_NAMES[norm], flags, nlev, tver, thash, bsize, numel,
                  reserved if flags == FLAG_NONFINITE else None,
                  reserved if flags & FLAG_CHECKSUM else None)


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


def check_size(header: Header, actual: int, what: str = "payload") -> None:
    """``PayloadError`` unless ``actual`` is exactly the size the header requires. A payload
    with an entropy-coded body (``FLAG_ENTROPY``) is refused here: its size is in its coder
    header, and only the decoders of ``codec.entropy`` read it (docs/format.md §12)."""
    if header.entropy:
        raise PayloadError(
            f"{what} has an entropy-coded body (flags {header.flags}), which this decoder does "
            "not read: decode it with horovod_aq.codec.decode or horovod_aq.codec.fused.decode "
            "(a list of payloads for decode_average)")
    expected = header.payload_size
    if actual != expected:
        kind = "truncated" if actual < expected else "too long"
        raise PayloadError(
            f"{what} is {kind}: {actual} bytes, but its header (n={header.numel}, "
            f"bits={header.bits}, bucket_size={header.bucket_size}) requires {expected}"
        )


# ------------------------------------------------------------------------------------ checksum


def payload_checksum(buf: Any) -> int:
    """CRC-32 (IEEE 802.3, ``zlib.crc32``) of bytes 0..27 and then 32..size−1 of a payload:
    everything but the CRC field itself (the norms and codes, and the header with its flags)."""
    data = np.ascontiguousarray(as_bytes(buf))
    return zlib.crc32(data[HEADER_SIZE:], zlib.crc32(data[:CHECKSUM_OFFSET])) & 0xFFFFFFFF


def seal_checksum(buf: np.ndarray) -> np.ndarray:
    """Set ``FLAG_CHECKSUM`` in a freshly encoded payload (a writeable 1-D uint8 array) and
    write its CRC-32 into bytes 28..31; returns ``buf``. A non-finite marker is refused."""
    if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size < HEADER_SIZE:
        raise PayloadError(f"seal_checksum needs a 1-D uint8 payload, got dtype {buf.dtype} and "
                           f"shape {buf.shape}")
    if buf[FLAGS_OFFSET] & FLAG_NONFINITE or buf[FLAGS_OFFSET] not in KNOWN_FLAGS:
        raise PayloadError(f"cannot checksum a payload with flags {int(buf[FLAGS_OFFSET])} (a "
                           "non-finite marker carries no data)")
    buf[FLAGS_OFFSET] |= FLAG_CHECKSUM
    buf[CHECKSUM_OFFSET:HEADER_SIZE] = np.frombuffer(
        struct.pack("<I", payload_checksum(buf)), np.uint8)
    return buf


def checksum_message(stored: int, actual: int, size: int) -> str:
    """The error message of a payload whose data does not match its CRC-32."""
    return (
        f"payload checksum mismatch: its header holds CRC-32 {stored:08x} but its bytes "
        f"(0..27 and 32..{size - 1}) hash to {actual:08x}; the payload was corrupted in memory "
        "or in transit"
    )


def check_checksum(buf: Any, header: Header) -> None:
    """``PayloadError`` if ``header`` carries ``FLAG_CHECKSUM`` and the size-checked payload's
    bytes do not hash to the stored CRC-32 (``payload_checksum``); no-op without the flag."""
    if not header.checksummed:
        return
    actual = payload_checksum(buf)
    if actual != header.checksum:
        raise PayloadError(checksum_message(header.checksum, actual, as_bytes(buf).size))


# ------------------------------------------------------------------------------------ data


def bad_norm_message(bucket: int, value: float, num_buckets: int) -> str:
    """The error message of a payload whose bucket norm is negative, NaN or ±Inf."""
    return (f"payload holds a negative or non-finite bucket norm: {value!r} in bucket {bucket} "
            f"of {num_buckets} (corrupted data)")


def bad_code_message(code: int, num_levels: int) -> str:
    """The error message of a payload holding a code ≥ N (the largest such code)."""
    return (f"payload holds code {code} but the table has {num_levels} levels "
            "(corrupted data)")


def check_payload_norms(norms: np.ndarray) -> None:
    """``PayloadError`` (``bad_norm_message``) unless every decoded bucket norm is finite and
    ≥ 0 (an encoder never writes another; −0.0 is accepted)."""
    norms = np.asarray(norms, dtype=np.float32)
    bad = ~(np.isfinite(norms) & (norms >= 0))
    if bad.any():
        k = int(np.argmax(bad))
        raise PayloadError(bad_norm_message(k, float(norms[k]), norms.size))
