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

Modules: ``encode`` and the host-side wrappers every fused kernel shares are
``horovod_aq.codec.fused_fixed`` (``encode`` is re-exported here); this module decodes, hands
entropy-coded payloads to ``horovod_aq.codec.fused_entropy``, and holds the entry points of
traced graphs (``encode_with``, ``decode_average_with``).
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
    check_checksum,
    check_header,
    check_size,
    parse_header,
    payload_size,
    seal_checksum,
)
from horovod_aq.codec.fused_fixed import (
    decode_rows,
    encode,
    flat_float32,
    raise_like_oracle,
    run_decoder,
    run_encoder,
)
from horovod_aq.codec.rows import check_checksums, check_data, check_rows, parse_rows, tag_rank
from horovod_aq.codec.stream import key_scalars
from horovod_aq.levels.table import LevelTable

__all__ = ["decode", "decode_average", "encode"]


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
    result = decode_rows(data.reshape(1, -1), header, table, False, out, dtype)
    if result is None:
        raise_like_oracle(reference.decode, data, table)
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
    headers = parse_rows(rows)
    first = check_rows(headers, table, rows.shape[1], numel=numel,
                                 bucket_size=bucket_size, norm=norm)
    check_checksums(rows, headers)
    result = decode_rows(rows, first, table, True, out, dtype)
    if result is None:
        raise_like_oracle(reference.decode_average, rows, table)
    return result


# ------------------------------------------------------------------ for traced graphs
def encode_with(x: Any, levels_f32: Any, header_u8: Any, *, bits: int, bucket_size: int,
                norm: str, key: Any, checksum: bool = False) -> np.ndarray:
    """``encode`` with the table as a traced graph holds it: float32 levels and the 32 header
    bytes (TensorFlow variables, read per step), and the key as ``StreamKey.scalars()`` (the
    step read in-graph). The caller has checked the input (finite values); a non-finite value
    or an overflowing norm raises ValueError here. ``checksum``: seal the payload
    (``codec.seal_checksum``: the flag is set in the copied header bytes)."""
    flat = flat_float32(x)
    levels = np.ascontiguousarray(levels_f32, dtype=np.float32)
    n = flat.size
    nb = -(-n // bucket_size)
    codes_offset = HEADER_SIZE + NORM_BYTES * nb
    buf = np.empty(payload_size(n, bits, bucket_size), np.uint8)
    norms = np.empty(nb, np.float32)
    status = run_encoder(flat, levels, bits, bucket_size, norm, key_scalars(key), norms,
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
        check_checksums(rows, [parse_header(row) for row in rows])
    result = np.empty(numel, np.float32)
    if not run_decoder(rows, levels, numel, bits, bucket_size, True, result):
        for rank, row in enumerate(rows):  # the error path: the oracle's checks and messages
            try:
                check_data(row, parse_header(row), levels.size)
            except PayloadError as err:
                tag_rank(err, rank)
                raise
        raise PayloadError("horovod_aq: a gathered payload holds a negative or non-finite norm "
                           "or a code beyond the level table")
    return result
