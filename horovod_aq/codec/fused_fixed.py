"""The fixed-width fused CPU kernels' host side (numba): ``encode``, the decoder runner, and the
wrappers every fused kernel shares (input cast, output buffers, level search tables, the
oracle's errors).

A leaf of the fused kernels: ``horovod_aq.codec.fused`` (the public entry points, which hand
entropy-coded payloads on) and ``horovod_aq.codec.fused_entropy`` (which writes the fixed-width
payload of ``encode`` when entropy coding does not pay) both use it. The compiled loops are
``horovod_aq.codec.fused_kernels``; why numba, caching, threads and zero copy are the docstring of
``horovod_aq.codec.fused``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from horovod_aq.codec import reference
from horovod_aq.codec.format import (
    HEADER_SIZE,
    NORM_BYTES,
    as_table,
    check_bool,
    check_bucket_size,
    check_norm,
    float32_levels,
    make_header,
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
from horovod_aq.codec.quantize import is_float_dtype
from horovod_aq.codec.stream import MAX_STREAM_NUMEL, StreamKey, stream_uniforms
from horovod_aq.levels.table import LevelTable

__all__ = ["check_out", "decode_rows", "encode", "flat_float32", "raise_like_oracle",
           "run_decoder", "run_encoder", "search_tables"]


def flat_float32(x: Any) -> np.ndarray:
    """x flattened, cast to float32 (once, as the oracle does), C-contiguous; not yet checked
    for finiteness (the kernel does that on the way)."""
    arr = np.asarray(x)
    if not is_float_dtype(arr.dtype):
        raise ValueError(f"expected a floating-point gradient, got dtype {arr.dtype}")
    flat = arr.reshape(-1)
    if flat.dtype != np.float32:
        with np.errstate(over="ignore"):  # values beyond float32 become ±Inf and are reported
            flat = flat.astype(np.float32)
    return np.ascontiguousarray(flat)


def raise_like_oracle(oracle, *args: Any, **kwargs: Any) -> None:
    """Run the oracle on input the kernel refused, so that its exception propagates."""
    oracle(*args, **kwargs)
    raise RuntimeError("horovod_aq.codec.fused: the kernel refused input that the reference "
                       "codec accepts (please report this bug)")


_TABLES: dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def search_tables(levels: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def check_out(out: Any, size: int, dtype: Any, what: str) -> np.ndarray:
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
    flat = flat_float32(x)
    n = flat.size
    if not isinstance(key, StreamKey):
        raise TypeError(f"key must be a horovod_aq.codec.stream.StreamKey, got {key!r}")
    if n > MAX_STREAM_NUMEL:
        stream_uniforms(n, key)  # raises the stream's own error
    size = payload_size(n, table.bits, bucket_size)
    nb = -(-n // bucket_size)
    codes_offset = HEADER_SIZE + NORM_BYTES * nb

    def fail() -> None:  # the oracle validates in its own order and raises its own message
        raise_like_oracle(reference.encode, flat, table, bucket_size=bucket_size, norm=norm,
                           uniforms=np.zeros(n, np.float32))

    try:
        levels = float32_levels(table)
    except ValueError:
        fail()
    buf = np.empty(size, np.uint8) if out is None else check_out(out, size, np.uint8, "payload")
    section = buf[HEADER_SIZE:codes_offset]
    aligned = _LITTLE and section.ctypes.data % NORM_BYTES == 0
    norms = section.view(np.float32) if aligned else np.empty(nb, np.float32)
    status = run_encoder(flat, levels, table.bits, bucket_size, norm, key.scalars(), norms,
                          buf[codes_offset:])
    if status >= 0:
        buf[:HEADER_SIZE] = 0  # never leave a valid-looking header over partial data
        fail()
    if not aligned:
        section[:] = norms.astype("<f4").view(np.uint8)
    buf[:HEADER_SIZE] = np.frombuffer(make_header(n, table, bucket_size, norm), np.uint8)
    return seal_checksum(buf) if checksum else buf


def run_encoder(flat: np.ndarray, levels: np.ndarray, bits: int, bucket_size: int, norm: str,
                 scalars: tuple, norms: np.ndarray, codes: np.ndarray) -> int:
    """Run the compiled encoder (norms and codes written in place); -1, or the first element
    of a non-finite value or an overflowing bucket norm."""
    if not flat.size:
        return -1
    k0, k1, c1, c2, c3 = scalars
    interior, padded, cells = search_tables(levels, bits)
    return _encoder(bits)(flat, flat.view(np.uint32), bucket_size, norm == "linf", interior,
                          padded, cells, k0, k1, c1, c2, c3, norms, codes)


def run_decoder(rows: np.ndarray, levels: np.ndarray, numel: int, bits: int, bucket_size: int,
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


def decode_rows(rows: np.ndarray, header: Any, table: LevelTable, divide: bool,
                 out: Any, dtype: Any) -> np.ndarray | None:
    """Run the decode kernel on checked rows; None if a norm or a code is invalid."""
    n = header.numel
    result = np.empty(n, np.float32) if out is None else check_out(out, n, np.float32, "decode")
    try:
        levels = float32_levels(table)
    except ValueError:
        return None  # the oracle raises it, after its own checks of the codes
    if not run_decoder(rows, levels, n, header.bits, header.bucket_size, divide, result):
        return None
    if out is None:
        return result.astype(dtype, copy=False)
    return result
