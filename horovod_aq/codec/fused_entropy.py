"""Fused CPU kernels of the entropy-coded wire (numba): byte-identical to ``codec.entropy``.

``encode_entropy`` runs the fused quantizer of ``horovod_aq.codec.fused_fixed`` with one code per
byte (same norms, Philox stream and rounding: the same codes), counts the codes, builds the
model on the host (``entropy_format.code_table`` / ``symbol_model``: 2^(g·b) ≤ 256 entries) and
codes the symbols with the compiled interleaved rANS; the payload is the oracle's
(``entropy.assemble``), and the fixed-width one of ``fused_fixed.encode`` when that is not larger.

``decode_average`` decodes P payloads of any lengths and kinds in one compiled pass per coder
block (each row's block decoded, scaled and added in rank order while the block's output stays
in cache), bitwise ``codec.decode_average``. The host checks every header, length and checksum
and each row's norms, code table and states first; a stream the kernel refuses is handed to the
oracle, which raises its own ``PayloadError`` ("rank r: …").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from horovod_aq.codec import entropy, reference
from horovod_aq.codec.entropy_format import (
    CODE_TABLE_BITS,
    LANES,
    PRECISION,
    STATE_LOW,
    check_body,
    entropy_payload_size,
    normalize_frequencies,
    num_blocks,
    num_symbols,
    symbol_codes,
    symbol_model,
)
from horovod_aq.codec.entropy_kernels import (
    _rans_decoder,
    _rans_encoder,
    encoder_tables,
    histogram,
)
from horovod_aq.codec.format import (
    HEADER_SIZE,
    NORM_BYTES,
    NonFiniteGradientError,
    PayloadError,
    as_bytes,
    as_table,
    check_bool,
    check_bucket_size,
    check_checksum,
    check_norm,
    check_payload_norms,
    float32_levels,
    payload_size,
)
from horovod_aq.codec.fused_fixed import (
    check_out,
    encode,
    flat_float32,
    raise_like_oracle,
    search_tables,
)
from horovod_aq.codec.fused_kernels import _code_encoder
from horovod_aq.codec.rans import slot_symbols
from horovod_aq.codec.rows import parse_rows
from horovod_aq.codec.stream import StreamKey
from horovod_aq.levels.table import LevelTable

__all__ = ["decode", "decode_average", "encode_entropy", "payload_of_codes"]


def encode_entropy(x: Any, table: LevelTable | Any, *, bucket_size: int, norm: str = "l2",
                   key: StreamKey, checksum: bool = False) -> np.ndarray:
    """Byte-identical to ``codec.encode_entropy(x, table, bucket_size=, norm=, key=key,
    checksum=)``: the smaller of the entropy-coded and the fixed-width payload."""
    checksum = check_bool("checksum", checksum)
    table = as_table(table)
    bucket_size = check_bucket_size(bucket_size)
    norm = check_norm(norm)
    if not isinstance(key, StreamKey):
        raise TypeError(f"key must be a horovod_aq.codec.stream.StreamKey, got {key!r}")
    flat = flat_float32(x)
    n, bits = flat.size, table.bits
    if n == 0:
        return encode(flat, table, bucket_size=bucket_size, norm=norm, key=key,
                            checksum=checksum)
    try:
        levels = float32_levels(table)
    except ValueError:
        levels = None
    codes = np.empty(n, np.uint8)
    norms = np.empty(-(-n // bucket_size), np.float32)
    status = -1 if levels is None else _run_codes(flat, levels, bits, bucket_size, norm, key,
                                                  norms, codes)
    if levels is None or status >= 0:   # the oracle's own error (non-finite, overflow, table)
        raise_like_oracle(reference.encode, flat, table, bucket_size=bucket_size, norm=norm,
                          uniforms=np.zeros(n, np.float32))
    return payload_of_codes(codes, norms, table, bucket_size, norm, checksum=checksum,
                            fixed=lambda: encode(flat, table, bucket_size=bucket_size,
                                                 norm=norm, key=key, checksum=checksum))


def payload_of_codes(codes: np.ndarray, norms: np.ndarray, table: LevelTable, bucket_size: int,
                     norm: str, *, checksum: bool,
                     fixed: Callable[[], np.ndarray]) -> np.ndarray:
    """The entropy-coded payload of n > 0 ``codes`` (one per byte) and their bucket ``norms``
    (``entropy.assemble``'s bytes), or ``fixed()`` — the fixed-width payload of the same
    codes — when the entropy-coded one would not be smaller."""
    n, bits = codes.size, table.bits
    t = code_table_of(codes, table.num_levels)
    f, c = symbol_model(t, bits)
    states = np.empty(num_blocks(n, bits) * LANES, np.uint32)
    counts = np.empty(num_blocks(n, bits), np.int64)
    words = np.empty(num_symbols(n, bits), np.uint16)
    total = _rans_encoder(bits)(codes, *encoder_tables(f, c), states, counts, words)
    size = entropy_payload_size(n, bits, bucket_size, table.num_levels, total)
    if size >= payload_size(n, bits, bucket_size):
        return fixed()
    return entropy.assemble(codes, norms, table, bucket_size, norm, checksum=checksum,
                            coded=(t, states.reshape(-1, LANES), counts, words[:total]))


def code_table_of(codes: np.ndarray, num_levels: int) -> np.ndarray:
    """``entropy_format.code_table`` from the compiled histogram (the same counts)."""
    return normalize_frequencies(histogram(codes, num_levels), CODE_TABLE_BITS).astype(np.uint16)


def _run_codes(flat, levels, bits, bucket_size, norm, key, norms, codes) -> int:
    """The fused quantizer writing one code per byte (``fused_fixed.run_encoder``'s arguments)."""
    k0, k1, c1, c2, c3 = key.scalars()
    interior, padded, cells = search_tables(levels, bits)
    return _code_encoder(bits)(flat, flat.view(np.uint32), bucket_size, norm == "linf",
                               interior, padded, cells, k0, k1, c1, c2, c3, norms, codes)


# ------------------------------------------------------------------------------------ decoding


def decode(payload: Any, table: LevelTable | Any, *, dtype: Any = np.float32,
           numel: int | None = None, bucket_size: int | None = None,
           norm: str | None = None) -> np.ndarray:
    """``codec.decode`` of one payload of either kind (bitwise, the same errors)."""
    data = as_bytes(payload)
    try:
        return decode_average([data], table, dtype=dtype, numel=numel,
                              bucket_size=bucket_size, norm=norm)
    except (PayloadError, NonFiniteGradientError):  # the oracle's message, without "rank 0:"
        reference.decode(data, table, numel=numel, bucket_size=bucket_size, norm=norm)
        raise


def decode_average(payloads: Any, table: LevelTable | Any, *, dtype: Any = np.float32,
                   numel: int | None = None, bucket_size: int | None = None,
                   norm: str | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """Average of P payloads of any lengths and kinds (a list of 1-D uint8 arrays, or a
    [P, size] array), bitwise ``codec.decode_average``; into ``out`` (float32, (n,)) if given."""
    table = as_table(table)
    rows = entropy.payload_rows(payloads)

    def oracle() -> None:
        raise_like_oracle(entropy.decode_rows_average, rows, table, numel=numel,
                          bucket_size=bucket_size, norm=norm)

    try:
        headers = parse_rows(rows)
        first = headers[0]
        bodies = entropy.row_bodies(rows, headers, table, numel=numel, bucket_size=bucket_size,
                                    norm=norm)
        for row, header in zip(rows, headers):
            check_checksum(row, header)
        levels = float32_levels(table)
        n, bits, bsize = first.numel, first.bits, first.bucket_size
        nb = first.num_buckets
        norms = np.stack([np.frombuffer(row[HEADER_SIZE:HEADER_SIZE + NORM_BYTES * nb]
                                        .tobytes(), "<f4") for row in rows]).astype(np.float32)
        for p, body in enumerate(bodies):
            check_payload_norms(norms[p])
            if body is not None:
                check_body(body)
    except (PayloadError, ValueError):
        oracle()
    result = np.empty(n, np.float32) if out is None else check_out(out, n, np.float32, "decode")
    if n == 0:
        return result.astype(dtype, copy=False) if out is None else result
    P = len(rows)
    nblk = num_blocks(n, bits)
    kinds = np.array([b is not None for b in bodies], np.int64)
    states = np.full((P, nblk, LANES), STATE_LOW, np.uint32)
    counts = np.zeros((P, nblk), np.int64)
    slots = np.zeros((P, 1 << PRECISION), np.uint8)
    f_all = np.zeros((P, 256), np.int64)
    c_all = np.zeros((P, 256), np.int64)
    for p, body in enumerate(bodies):
        if body is not None:
            states[p], counts[p] = body.states, body.counts
            f, c = _model(body.table.tobytes(), bits)
            f_all[p, :f.size], c_all[p, :c.size] = f, c
            slots[p] = slot_symbols(f)
    word_rows = [b.words for b in bodies if b is not None]
    words = np.concatenate(word_rows + [np.zeros(1, np.uint16)])
    sizes = [b.words.size if b is not None else 0 for b in bodies]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    fixed_rows = [row for row, b in zip(rows, bodies) if b is None]
    fixed = np.concatenate(fixed_rows) if fixed_rows else np.zeros(1, np.uint8)
    fixed_at = np.cumsum([0] + [r.size for r in fixed_rows])[:-1]
    codes_at = np.zeros(P, np.int64)
    codes_at[kinds == 0] = fixed_at + HEADER_SIZE + NORM_BYTES * nb
    lut = np.zeros(256, np.float32)
    lut[:levels.size] = levels
    bad = _rans_decoder(bits)(kinds, states, counts, words, starts, fixed, codes_at, slots,
                              f_all, c_all, symbol_codes(bits), lut, norms, n, bsize,
                              table.num_levels, result)
    if bad >= 0:
        oracle()
    return result.astype(dtype, copy=False) if out is None else result


_MODELS: dict[tuple[bytes, int], tuple[np.ndarray, np.ndarray]] = {}


def _model(table_bytes: bytes, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """``symbol_model`` of a code table, cached by its bytes (ranks often send the same one)."""
    found = _MODELS.get((table_bytes, bits))
    if found is None:
        if len(_MODELS) >= 64:
            _MODELS.clear()
        found = _MODELS[(table_bytes, bits)] = symbol_model(
            np.frombuffer(table_bytes, "<u2"), bits)
    return found
