"""Entropy-coded payloads, numpy oracle: encode, decode, decode-average of variable-length rows.

``encode_entropy`` quantizes exactly as ``codec.encode`` (same arithmetic, same key stream:
the codes are identical) and then codes them (docs/format.md §12): it writes an entropy-coded
payload (``FLAG_ENTROPY``) when that is smaller than the fixed-width codes, and the fixed-width
payload of ``codec.encode`` otherwise, so a payload of the entropy-coded wire is never larger
than ``payload_size(n, b, B)``. Every decoder of ``codec`` reads both kinds, row by row.

Steps of the body (``horovod_aq.codec.entropy_format``, ``horovod_aq.codec.rans``):
1. the CODE TABLE t of the payload's codes (``code_table``, Σ t = 2^15);
2. the symbols: g = ⌊8/b⌋ codes each (``group_symbols``);
3. the product model (f, c) of t at 2^14 (``symbol_model``);
4. interleaved rANS of the symbols (``rans.encode_symbols``).

Decoding checks, in this order (docs/format.md §12): every header (``parse_header``,
``check_header``), each row's coder header and length (``parse_body``), every checksum, then
each row's norms, code table and states (``check_body``) and its stream (``decode_symbols``).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from horovod_aq.codec.bits import pack_bits
from horovod_aq.codec.entropy_format import (
    CODER_HEADER_FORMAT,
    Body,
    check_body,
    code_table,
    coder_fields,
    entropy_payload_size,
    group_symbols,
    parse_body,
    symbol_codes,
    symbol_model,
)
from horovod_aq.codec.format import (
    FLAG_ENTROPY,
    FLAGS_OFFSET,
    HEADER_SIZE,
    Header,
    NonFiniteGradientError,
    PayloadError,
    as_bytes,
    as_table,
    check_bool,
    check_checksum,
    check_header,
    check_payload_norms,
    check_size,
    make_header,
    parse_header,
    payload_size,
    seal_checksum,
)
from horovod_aq.codec.quantize import dequantize, normalized, prepare, round_codes
from horovod_aq.codec.rans import decode_symbols, encode_symbols
from horovod_aq.codec.rows import parse_rows, read_fixed_payload, tag_rank
from horovod_aq.codec.stream import StreamKey
from horovod_aq.levels.table import LevelTable

__all__ = ["assemble", "decode_entropy_codes", "decode_rows_average", "encode_entropy",
           "payload_rows", "read_payload", "row_bodies"]


def encode_entropy(
    x: Any,
    levels: LevelTable | Any,
    *,
    bucket_size: int,
    norm: str = "l2",
    seed: Any = None,
    uniforms: Any = None,
    key: StreamKey | None = None,
    checksum: bool = False,
) -> np.ndarray:
    """Quantize x like ``codec.encode`` (same arguments, same codes) and write the smaller of
    the entropy-coded payload (``FLAG_ENTROPY``) and the fixed-width one. Its exact length is
    ``len(result)`` (and, entropy-coded, the coder header's coded size); it is at most
    ``payload_size(x.size, bits, bucket_size)``."""
    checksum = check_bool("checksum", checksum)
    table, bucket_size, flat, norms, u = prepare(x, levels, bucket_size, norm, seed, uniforms,
                                                 key)
    codes = round_codes(normalized(flat, norms, bucket_size), table, u)
    return assemble(codes, norms, table, bucket_size, norm, checksum=checksum)


def _header(numel: int, table: LevelTable, bucket_size: int, norm: str, entropy: bool):
    head = np.frombuffer(make_header(numel, table, bucket_size, norm), np.uint8).copy()
    head[FLAGS_OFFSET] |= FLAG_ENTROPY if entropy else 0
    return head


def assemble(codes: np.ndarray, norms: np.ndarray, table: LevelTable, bucket_size: int,
             norm: str, *, checksum: bool = False, coded: tuple | None = None) -> np.ndarray:
    """The payload of quantized ``codes`` (uint8, one per coordinate) and bucket ``norms``:
    entropy-coded if that is smaller than the fixed-width codes, else fixed-width. ``coded``:
    (code table, states, counts, words) already computed by a kernel (the same values)."""
    table = as_table(table)
    n, bits = codes.size, table.bits
    fixed = payload_size(n, bits, bucket_size)
    body = None
    if n:
        if coded is None:
            t = code_table(codes, table.num_levels)
            f, c = symbol_model(t, bits)
            coded = (t, *encode_symbols(group_symbols(codes, bits), f, c))
        size = entropy_payload_size(n, bits, bucket_size, table.num_levels, coded[3].size)
        body = coded if size < fixed else None
    norm_bytes = norms.astype("<f4").view(np.uint8)
    if body is None:
        parts = [_header(n, table, bucket_size, norm, False), norm_bytes, pack_bits(codes, bits)]
    else:
        t, states, counts, words = body
        coder = struct.pack(CODER_HEADER_FORMAT, size, *coder_fields(bits))
        parts = [_header(n, table, bucket_size, norm, True), norm_bytes,
                 np.frombuffer(coder, np.uint8), states.astype("<u4").reshape(-1).view(np.uint8),
                 counts.astype("<u2").view(np.uint8), t.astype("<u2").view(np.uint8),
                 words.astype("<u2").view(np.uint8)]
    payload = np.concatenate(parts)
    return seal_checksum(payload) if checksum else payload


# ------------------------------------------------------------------------------------ decoding


def decode_entropy_codes(data: np.ndarray, header: Header, body: Body) -> tuple[np.ndarray,
                                                                               np.ndarray]:
    """(float32 norms, uint8 codes) of an entropy-coded payload whose length is checked
    (``parse_body``) and checksum verified: the norms, then ``check_body``, then the stream."""
    norms = np.frombuffer(data[HEADER_SIZE:HEADER_SIZE + 4 * header.num_buckets].tobytes(),
                          "<f4").astype(np.float32)
    check_payload_norms(norms)
    check_body(body)
    f, c = symbol_model(body.table, header.bits)
    symbols = decode_symbols(body, f, c)
    codes = symbol_codes(header.bits)[symbols].reshape(-1)[:header.numel]
    return norms, codes


def read_payload(data: np.ndarray, header: Header, table: LevelTable) -> np.ndarray:
    """float32 values of one header-checked payload of either kind (length, checksum, data)."""
    if not header.entropy:
        check_size(header, data.size)
        check_checksum(data, header)
        return read_fixed_payload(data, header, table)
    body = parse_body(data, header)
    check_checksum(data, header)
    norms, codes = decode_entropy_codes(data, header, body)
    return dequantize(codes, norms, table, header.bucket_size)


def payload_rows(payloads: Any) -> list[np.ndarray]:
    """The gathered payloads as a list of 1-D uint8 rows (a [P, size] array or a list)."""
    if isinstance(payloads, np.ndarray) and payloads.ndim == 2:
        return list(payloads)
    rows = [as_bytes(p) for p in payloads] if isinstance(payloads, (list, tuple)) else []
    if not rows:
        raise PayloadError("decode_average needs a non-empty list of 1-D uint8 payloads or a "
                           f"[P, size] uint8 array, got {type(payloads).__name__}")
    return rows


def row_bodies(rows: list[np.ndarray], headers: list[Any], table: LevelTable, *,
               numel: int | None = None, bucket_size: int | None = None,
               norm: str | None = None) -> list[Body | None]:
    """Every row's header checked against row 0's settings (or the given ones) and its length
    (``check_size`` / ``parse_body``); the parsed entropy body of each row (None: fixed-width).
    Errors name the rank ("rank r: …")."""
    first = headers[0]
    settings = {"numel": first.numel if numel is None else numel,
                "bucket_size": first.bucket_size if bucket_size is None else bucket_size,
                "norm": first.norm if norm is None else norm}
    bodies: list[Body | None] = []
    for rank, (row, header) in enumerate(zip(rows, headers)):
        try:
            check_header(header, table, **settings)
            if header.entropy:
                bodies.append(parse_body(row, header))
            else:
                check_size(header, row.size)
                bodies.append(None)
        except (PayloadError, NonFiniteGradientError) as err:
            tag_rank(err, rank)
            raise
    return bodies


def decode_rows_average(
    payloads: Any,
    levels: LevelTable | Any,
    *,
    dtype: Any = np.float32,
    numel: int | None = None,
    bucket_size: int | None = None,
    norm: str | None = None,
) -> np.ndarray:
    """Average of P payloads of any lengths and kinds (a list of 1-D uint8 arrays), bitwise
    ``codec.decode_average``'s arithmetic (each row / P, summed in rank order in float32).

    Checks, in this order, each naming its rank ("rank r: …"): every header against row 0's
    settings (or the given ones); every row's length (``check_size`` / ``parse_body``); every
    checksum; then each row's data, in rank order."""
    table = as_table(levels)
    rows = payload_rows(payloads)
    headers = parse_rows(rows)
    bodies = row_bodies(rows, headers, table, numel=numel, bucket_size=bucket_size, norm=norm)
    for rank, (row, header) in enumerate(zip(rows, headers)):
        try:
            check_checksum(row, header)
        except PayloadError as err:
            tag_rank(err, rank)
            raise
    world = np.float32(len(rows))
    acc = None
    for rank, (row, header, body) in enumerate(zip(rows, headers, bodies)):
        try:
            if body is None:
                values = read_fixed_payload(row, header, table)
            else:
                norms, codes = decode_entropy_codes(row, header, body)
                values = dequantize(codes, norms, table, header.bucket_size)
        except PayloadError as err:
            tag_rank(err, rank)
            raise
        values = values / world
        acc = values if acc is None else acc + values
    return acc.astype(dtype, copy=False)


def decode_any(payload: Any, levels: LevelTable | Any, *, dtype: Any = np.float32,
               numel: int | None = None, bucket_size: int | None = None,
               norm: str | None = None) -> np.ndarray:
    """``codec.decode`` of one payload of either kind."""
    table = as_table(levels)
    data = as_bytes(payload)
    header = parse_header(data)
    check_header(header, table, numel=numel, bucket_size=bucket_size, norm=norm)
    return read_payload(data, header, table).astype(dtype, copy=False)
