"""Fused CPU kernels of the payload codec: one compiled pass per bucket (numba).

``encode`` computes each bucket's norm, normalizes, finds the level, draws the Philox uniform of
the format's random stream (``horovod_aq.codec.stream``) and packs the codes straight into the
output bytes; ``decode`` / ``decode_average`` unpack, look up, scale and accumulate the rows in
rank order in one pass. Bytes and values are identical, bit for bit, to the numpy oracle
``horovod_aq.codec.reference`` (``encode(..., uniforms=stream_uniforms(n, key))``, ``decode``,
``decode_average``), and bad input raises the oracle's own errors and messages (the wrapper
runs the oracle on input the kernel refuses). The format is ``docs/format.md``. With
``checksum=True`` the encoders write the payload's CRC-32 (``codec.seal_checksum``, zlib on the
output buffer) and the decoders verify every checksummed row before the kernel runs.

Why numba: one ~60 MB wheel from PyPI (numba + llvmlite), no C compiler on a fresh machine, and
the arithmetic stays readable Python. Kernels are specialized per code width b (constant loop
bounds unroll and the loops over coordinates vectorize); the first call for a b compiles for
about 2 s (encode) and 0.6 s (decode_average) on a 2-core EPYC (Zen 4), and ``cache=True``
stores the machine code next to this file (``__pycache__``, or ``NUMBA_CACHE_DIR``), so later
processes load it in about 0.15 s. Threads: single-threaded, one per rank; ``nogil=True`` lets
ranks or a communication thread run alongside. Little-endian CPUs only.

Zero copy: inputs may be numpy views of torch CPU tensors (``t.numpy()``), and every function
writes into a caller-provided ``out`` when given (on an error, ``out`` may be partly written; an
encode then zeroes its header so that no valid-looking payload is left behind).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from horovod_aq.codec import reference
from horovod_aq.codec.format import (
    FLAG_CHECKSUM,
    FLAGS_OFFSET,
    HEADER_SIZE,
    NORM_BYTES,
    PayloadError,
    as_bytes,
    as_table,
    check_bool,
    check_bucket_size,
    check_checksum,
    check_header,
    check_norm,
    check_size,
    float32_levels,
    make_header,
    parse_header,
    payload_size,
    seal_checksum,
)
from horovod_aq.codec.fused_kernels import (
    _CELL_SHIFT,
    _LINEAR_MAX_BITS,
    _LITTLE,
    _SEVERAL,
    _decoder,
    _encoder,
)
from horovod_aq.codec.stream import MAX_STREAM_NUMEL, StreamKey, key_scalars, stream_uniforms
from horovod_aq.levels.table import LevelTable

__all__ = ["decode", "decode_average", "encode"]

# ----------------------------------------------------------------------------------- wrappers


def _flat_float32(x: Any) -> np.ndarray:
    """x flattened, cast to float32 (once, as the oracle does), C-contiguous; not yet checked
    for finiteness (the kernel does that on the way)."""
    arr = np.asarray(x)
    if not reference._is_float_dtype(arr.dtype):
        raise ValueError(f"expected a floating-point gradient, got dtype {arr.dtype}")
    flat = arr.reshape(-1)
    if flat.dtype != np.float32:
        with np.errstate(over="ignore"):  # values beyond float32 become ±Inf and are reported
            flat = flat.astype(np.float32)
    return np.ascontiguousarray(flat)


def _raise_like_oracle(oracle, *args: Any, **kwargs: Any) -> None:
    """Run the oracle on input the kernel refused, so that its exception propagates."""
    oracle(*args, **kwargs)
    raise RuntimeError("horovod_aq.codec.fused: the kernel refused input that the reference "
                       "codec accepts (please report this bug)")


_TABLES: dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _search_tables(levels: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(interior, levels, cells) of the float32 levels L, cached per table.

    interior: L_1 … L_{N−2} padded with +Inf to 2^bits − 1 entries (a complete binary search
    tree); levels: L padded to 257 entries; cells (more than ``_LINEAR_MAX_BITS`` bits only):
    for every key k = float32 bits >> _CELL_SHIFT of an r in [−1, 1], #{L_1..L_{N−2} ≤ the
    smallest float of the cell}, or ``_SEVERAL`` if the cell holds more than one such level.
    """
    tag = levels.tobytes()
    found = _TABLES.get(tag)
    if found is not None:
        return found
    inner = levels[1:-1]
    interior = np.full((1 << bits) - 1, np.inf, dtype=np.float32)
    interior[: inner.size] = inner
    padded = np.zeros(257, dtype=np.float32)
    padded[: levels.size] = levels
    cells = np.zeros(1, dtype=np.uint8)
    if bits > _LINEAR_MAX_BITS:
        keys = np.arange((0xBF800000 >> _CELL_SHIFT) + 1, dtype=np.uint64)  # up to r = −1
        first = (keys << np.uint64(_CELL_SHIFT)).astype(np.uint32).view(np.float32)
        last = (((keys + np.uint64(1)) << np.uint64(_CELL_SHIFT)) - np.uint64(1)).astype(
            np.uint32).view(np.float32)
        with np.errstate(invalid="ignore"):  # keys of NaN patterns: never looked up
            low, high = np.minimum(first, last), np.maximum(first, last)
        j_low = np.searchsorted(inner, low, side="right")
        j_high = np.searchsorted(inner, high, side="right")
        cells = np.where(j_high - j_low <= 1, j_low, _SEVERAL).astype(np.uint8)
    if len(_TABLES) >= 16:
        _TABLES.clear()
    _TABLES[tag] = found = (interior, padded, cells)
    return found


def _check_out(out: Any, size: int, dtype: Any, what: str) -> np.ndarray:
    arr = np.asarray(out)
    if arr.dtype != dtype or arr.shape != (size,) or not arr.flags.c_contiguous \
            or not arr.flags.writeable:
        raise ValueError(
            f"out must be a writeable C-contiguous {np.dtype(dtype)} array of shape ({size},) "
            f"for this {what}, got dtype {arr.dtype} and shape {arr.shape}")
    return arr


def encode(
    x: Any,
    table: LevelTable | Any,
    *,
    bucket_size: int,
    norm: str = "l2",
    key: StreamKey,
    out: np.ndarray | None = None,
    checksum: bool = False,
) -> np.ndarray:
    """Quantize and pack x into one payload, byte-identical to the oracle's
    ``encode(x, table, bucket_size=, norm=, uniforms=stream_uniforms(x.size, key),
    checksum=checksum)``.

    Args:
        x: gradient of any shape, floating point (cast once to float32), finite.
        table: a ``LevelTable``, or an array of levels (table version 0).
        bucket_size: B, coordinates per bucket (≥ 1).
        norm: ``"l2"`` or ``"linf"``.
        key: the ``StreamKey`` whose Philox stream draws the uniforms.
        out: optional uint8 buffer of exactly ``payload_size(n, bits, B)`` bytes to write into.
        checksum: write ``FLAG_CHECKSUM`` and the CRC-32 (``codec.payload_checksum``).
    """
    checksum = check_bool("checksum", checksum)
    table = as_table(table)
    bucket_size = check_bucket_size(bucket_size)
    norm = check_norm(norm)
    flat = _flat_float32(x)
    n = flat.size
    if not isinstance(key, StreamKey):
        raise TypeError(f"key must be a horovod_aq.codec.stream.StreamKey, got {key!r}")
    if n > MAX_STREAM_NUMEL:
        stream_uniforms(n, key)  # raises the stream's own error
    size = payload_size(n, table.bits, bucket_size)
    nb = -(-n // bucket_size)
    codes_offset = HEADER_SIZE + NORM_BYTES * nb

    def fail() -> None:  # the oracle validates in its own order and raises its own message
        _raise_like_oracle(reference.encode, flat, table, bucket_size=bucket_size, norm=norm,
                           uniforms=np.zeros(n, np.float32))

    try:
        levels = float32_levels(table)
    except ValueError:
        fail()
    buf = np.empty(size, np.uint8) if out is None else _check_out(out, size, np.uint8, "payload")
    section = buf[HEADER_SIZE:codes_offset]
    aligned = _LITTLE and section.ctypes.data % NORM_BYTES == 0
    norms = section.view(np.float32) if aligned else np.empty(nb, np.float32)
    status = _run_encoder(flat, levels, table.bits, bucket_size, norm, key.scalars(), norms,
                          buf[codes_offset:])
    if status >= 0:
        buf[:HEADER_SIZE] = 0  # never leave a valid-looking header over partial data
        fail()
    if not aligned:
        section[:] = norms.astype("<f4").view(np.uint8)
    buf[:HEADER_SIZE] = np.frombuffer(make_header(n, table, bucket_size, norm), np.uint8)
    return seal_checksum(buf) if checksum else buf


def _run_encoder(flat: np.ndarray, levels: np.ndarray, bits: int, bucket_size: int, norm: str,
                 scalars: tuple, norms: np.ndarray, codes: np.ndarray) -> int:
    """Run the compiled encoder (norms and codes written in place); -1, or the first element
    of a non-finite value or an overflowing bucket norm."""
    if not flat.size:
        return -1
    k0, k1, c1, c2, c3 = scalars
    interior, padded, cells = _search_tables(levels, bits)
    return _encoder(bits)(flat, flat.view(np.uint32), bucket_size, norm == "linf", interior,
                          padded, cells, k0, k1, c1, c2, c3, norms, codes)


def _run_decoder(rows: np.ndarray, levels: np.ndarray, numel: int, bits: int, bucket_size: int,
                 divide: bool, result: np.ndarray) -> bool:
    """Run the compiled decoder over rows [P, size] into ``result``; False if a norm is
    negative or non-finite or a code lies beyond the table."""
    codes_offset = HEADER_SIZE + NORM_BYTES * -(-numel // bucket_size)
    norms = np.ascontiguousarray(rows[:, HEADER_SIZE:codes_offset])
    norms = norms.view("<f4").astype(np.float32, copy=False)
    if not np.all(np.isfinite(norms) & (norms >= 0)):
        return False
    lut = np.zeros(256, np.float32)
    lut[: levels.size] = levels
    rows = np.ascontiguousarray(rows)
    return not numel or bool(_decoder(bits)(rows.reshape(-1), rows.shape[1], codes_offset, numel,
                                            bucket_size, lut, levels.size, norms, divide,
                                            result))


def _decode_rows(rows: np.ndarray, header: Any, table: LevelTable, divide: bool,
                 out: Any, dtype: Any) -> np.ndarray | None:
    """Run the decode kernel on checked rows; None if a norm or a code is invalid."""
    n = header.numel
    result = np.empty(n, np.float32) if out is None else _check_out(out, n, np.float32, "decode")
    try:
        levels = float32_levels(table)
    except ValueError:
        return None  # the oracle raises it, after its own checks of the codes
    if not _run_decoder(rows, levels, n, header.bits, header.bucket_size, divide, result):
        return None
    if out is None:
        return result.astype(dtype, copy=False)
    return result


def decode(
    payload: Any,
    table: LevelTable | Any,
    *,
    dtype: Any = np.float32,
    numel: int | None = None,
    bucket_size: int | None = None,
    norm: str | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Decode one payload (bitwise ``codec.decode``); into ``out`` (float32, shape (n,)) if given.

    The header must match ``table`` and, when given, ``numel``, ``bucket_size`` and ``norm``.
    """
    table = as_table(table)
    data = as_bytes(payload)
    header = parse_header(data)
    check_header(header, table, numel=numel, bucket_size=bucket_size, norm=norm)
    if header.entropy:  # docs/format.md §12
        from horovod_aq.codec import fused_entropy

        return fused_entropy.decode(data, table, dtype=dtype)
    check_size(header, data.size)
    check_checksum(data, header)
    result = _decode_rows(data.reshape(1, -1), header, table, False, out, dtype)
    if result is None:
        _raise_like_oracle(reference.decode, data, table)
    return result


def decode_average(
    rows: Any,
    table: LevelTable | Any,
    *,
    dtype: Any = np.float32,
    numel: int | None = None,
    bucket_size: int | None = None,
    norm: str | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Average of the decoded rows of a gathered ``[P, size]`` uint8 buffer, bitwise
    ``codec.decode_average``: each row / P, then summed sequentially in rank order in float32.

    Headers are checked with ``codec.check_rows`` (errors name the rank). ``out``: float32 (n,).
    """
    table = as_table(table)
    if reference.variable_rows(rows):  # entropy-coded or different lengths: docs/format.md §12
        from horovod_aq.codec import fused_entropy

        return fused_entropy.decode_average(rows, table, dtype=dtype, numel=numel,
                                            bucket_size=bucket_size, norm=norm, out=out)
    if isinstance(rows, (list, tuple)):
        rows = np.stack([as_bytes(p) for p in rows]) if rows else np.zeros((0, 0))
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.dtype != np.uint8 or rows.shape[0] == 0:
        raise PayloadError(
            f"gathered payloads must be a non-empty [P, size] uint8 array, got dtype {rows.dtype} "
            f"and shape {rows.shape}"
        )
    headers = reference.parse_rows(rows)
    first = reference.check_rows(headers, table, rows.shape[1], numel=numel,
                                 bucket_size=bucket_size, norm=norm)
    reference.check_checksums(rows, headers)
    result = _decode_rows(rows, first, table, True, out, dtype)
    if result is None:
        _raise_like_oracle(reference.decode_average, rows, table)
    return result


# ------------------------------------------------------------------ for traced graphs
def encode_with(x: Any, levels_f32: Any, header_u8: Any, *, bits: int, bucket_size: int,
                norm: str, key: Any, checksum: bool = False) -> np.ndarray:
    """``encode`` with the table as a traced graph holds it: float32 levels and the 32 header
    bytes (TensorFlow variables, read per step), and the key as ``StreamKey.scalars()`` (the
    step read in-graph). The caller has checked the input (finite values); a non-finite value
    or an overflowing norm raises ValueError here. ``checksum``: seal the payload
    (``codec.seal_checksum``: the flag is set in the copied header bytes)."""
    flat = _flat_float32(x)
    levels = np.ascontiguousarray(levels_f32, dtype=np.float32)
    n = flat.size
    nb = -(-n // bucket_size)
    codes_offset = HEADER_SIZE + NORM_BYTES * nb
    buf = np.empty(payload_size(n, bits, bucket_size), np.uint8)
    norms = np.empty(nb, np.float32)
    status = _run_encoder(flat, levels, bits, bucket_size, norm, key_scalars(key), norms,
                          buf[codes_offset:])
    if status >= 0:
        raise ValueError("horovod_aq: the fused encoder met a non-finite value or a bucket "
                         f"norm beyond float32 at element {status}")
    buf[:HEADER_SIZE] = np.asarray(header_u8, dtype=np.uint8)
    buf[HEADER_SIZE:codes_offset] = norms.astype("<f4").view(np.uint8)
    return seal_checksum(buf) if checksum else buf


def decode_average_with(rows: Any, levels_f32: Any, *, numel: int, bits: int,
                        bucket_size: int) -> np.ndarray:
    """``decode_average`` of rows whose headers the traced graph has checked against its own
    (``horovod_aq.tensorflow.checks``), with the float32 levels of a graph variable. Rows with
    ``FLAG_CHECKSUM`` are verified first; a bad checksum, norm or code raises the oracle's
    ``PayloadError`` ("rank r: …", as ``codec.decode_average``)."""
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    levels = np.asarray(levels_f32, dtype=np.float32)
    if rows.size and np.any(rows[:, FLAGS_OFFSET] & FLAG_CHECKSUM):
        reference.check_checksums(rows, [parse_header(row) for row in rows])
    result = np.empty(numel, np.float32)
    if not _run_decoder(rows, levels, numel, bits, bucket_size, True, result):
        for rank, row in enumerate(rows):  # the error path: the oracle's checks and messages
            try:
                reference.check_data(row, parse_header(row), levels.size)
            except PayloadError as err:
                reference._name_rank(err, rank)
                raise
        raise PayloadError("horovod_aq: a gathered payload holds a negative or non-finite norm "
                           "or a code beyond the level table")
    return result

