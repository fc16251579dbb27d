"""ECQ-SGD's fused send on the CPU (numba): compensate, encode and update the error memory in one
pass per bucket, bit for bit ``codec.reference.encode_compensated`` (docs/dynamic.md §2.6).

``try_encode_compensated`` runs the compiled loop of ``horovod_aq.codec.compensated_kernels``
and returns None when a bucket of x = g + α·h cannot travel (a NaN/±Inf, or a bucket norm
beyond float32), so that the caller sends non-finite markers (docs/protocol.md §4) without
paying for an exception; ``encode_compensated`` raises the oracle's error instead. The new
memory h' is written into a buffer of its own (``memory_out``), never into h: a bucket found bad
half-way leaves h as it was, and the caller installs h' only after a successful send.

The entropy-coded wire (``coding="entropy"``, docs/format.md §12) quantizes with the same loop
writing one code per byte, then codes them as ``fused_entropy.encode_entropy`` does: the same
codes, so the same g̃ and h', and the oracle's payload bytes.

``encode_compensated_with`` is the fixed wire's entry point for traced graphs (the TensorFlow
exchange, ``horovod_aq.tensorflow.compensated``): the table as float32 levels and header bytes
read from graph variables, as ``fused.encode_with`` takes them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from horovod_aq.codec import reference
from horovod_aq.codec.compensated_kernels import (
    _code_packer,
    _compensated_code_encoder,
    _compensated_encoder,
)
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
from horovod_aq.codec.fused_entropy import payload_of_codes
from horovod_aq.codec.fused_fixed import (
    check_out,
    flat_float32,
    raise_like_oracle,
    search_tables,
)
from horovod_aq.codec.fused_kernels import _LITTLE
from horovod_aq.codec.reference import Compensated
from horovod_aq.codec.stream import (
    MAX_STREAM_NUMEL,
    StreamKey,
    key_scalars,
    stream_uniforms,
)
from horovod_aq.levels.table import LevelTable

__all__ = ["encode_compensated", "encode_compensated_with", "try_encode_compensated"]

CODINGS = ("fixed", "entropy")


def encode_compensated(g: Any, h: Any, alpha: float, beta: float, table: LevelTable | Any, *,
                       bucket_size: int, norm: str = "l2", key: StreamKey,
                       numel: int | None = None, coding: str = "fixed", checksum: bool = False,
                       memory_out: np.ndarray | None = None) -> Compensated:
    """``codec.reference.encode_compensated(g, h, alpha, beta, table, bucket_size=, norm=,
    numel=, key=key, checksum=, coding=)`` bit for bit: the payload, h' and whether h' is
    finite. Raises the oracle's error where x cannot be encoded. Arguments: as
    :func:`try_encode_compensated`."""
    found = try_encode_compensated(g, h, alpha, beta, table, bucket_size=bucket_size, norm=norm,
                                   key=key, numel=numel, coding=coding, checksum=checksum,
                                   memory_out=memory_out)
    if found is None:
        raise_like_oracle(reference.encode_compensated, g, h, alpha, beta, table,
                          bucket_size=bucket_size, norm=norm, numel=numel,
                          uniforms=np.zeros(_numel(g, numel), np.float32))
    return found


def _numel(g: Any, numel: int | None) -> int:
    return int(np.asarray(g).size if numel is None else numel)


def try_encode_compensated(g: Any, h: Any, alpha: float, beta: float,
                           table: LevelTable | Any, *, bucket_size: int, norm: str = "l2",
                           key: StreamKey, numel: int | None = None, coding: str = "fixed",
                           checksum: bool = False,
                           memory_out: np.ndarray | None = None) -> Compensated | None:
    """x = g + α·h encoded with ``key``'s stream and h' = β·h + (g − g̃) (module docstring), or
    None when a bucket of x holds a NaN/±Inf or has a norm beyond float32 (nothing valid
    written; h untouched).

    Args:
        g: the raw gradient (flattened, cast once to float32); h: its memory, float32 with g's
            size, or None (first use: x = g, h' = g − g̃).
        alpha, beta: α, β (rounded to float32).
        numel: coordinates of the payload, ≥ g.size (a two-phase chunk's zero padding).
        coding: "fixed" or "entropy" (the payload of ``codec.encode_entropy``).
        memory_out: float32 buffer of g's size for h' (allocated if None); must not overlap h.
    """
    checksum = check_bool("checksum", checksum)
    if coding not in CODINGS:
        raise ValueError(f"coding must be one of {CODINGS}, got {coding!r}")
    if not isinstance(key, StreamKey):
        raise TypeError(f"key must be a horovod_aq.codec.stream.StreamKey, got {key!r}")
    table = as_table(table)
    bucket_size = check_bucket_size(bucket_size)
    norm = check_norm(norm)
    gf = flat_float32(g)
    n_g = gf.size
    n = n_g if numel is None else int(numel)
    if n < n_g:
        raise ValueError(f"numel must be at least the {n_g} coordinates of g, got {n}")
    hf = gf if h is None else np.ascontiguousarray(h, dtype=np.float32).reshape(-1)
    if hf.size != n_g:
        raise ValueError(f"h must have the {n_g} coordinates of g, got {hf.size}")
    out = (np.empty(n_g, np.float32) if memory_out is None
           else check_out(memory_out, n_g, np.float32, "memory"))
    if h is not None and np.may_share_memory(out, hf):
        raise ValueError("memory_out must not overlap h (h is kept until the send succeeded)")
    if n > MAX_STREAM_NUMEL:
        stream_uniforms(n, key)  # raises the stream's own error
    try:
        levels = float32_levels(table)
    except ValueError:  # a table float32 cannot hold: the oracle's error (or x's, raised first)
        raise_like_oracle(reference.encode_compensated, gf, None if h is None else hf, alpha,
                          beta, table, bucket_size=bucket_size, norm=norm, numel=n,
                          uniforms=np.zeros(n, np.float32))
    if n == 0:
        payload = np.frombuffer(make_header(0, table, bucket_size, norm), np.uint8).copy()
        return Compensated(seal_checksum(payload) if checksum else payload, out, True, 0.0)
    found = _run_kernel(gf, None if h is None else hf, alpha, beta, levels, table.bits, n,
                        bucket_size, norm, key.scalars(), out, coding)
    if found is None:
        return None
    body, norms, finite, squares = found
    if coding == "entropy":
        payload = payload_of_codes(body, norms, table, bucket_size, norm, checksum=checksum,
                                   fixed=lambda: _fixed_payload(body, norms, table,
                                                                bucket_size, norm, checksum))
        return Compensated(payload, out, finite, squares)
    body[:HEADER_SIZE] = np.frombuffer(make_header(n, table, bucket_size, norm), np.uint8)
    return Compensated(seal_checksum(body) if checksum else body, out, finite, squares)


def encode_compensated_with(g: Any, h: Any, alpha: float, beta: float, levels_f32: Any,
                            header_u8: Any, *, bits: int, bucket_size: int, norm: str,
                            key: Any, numel: int | None = None, checksum: bool = False,
                            memory_out: np.ndarray | None = None) -> Compensated | None:
    """:func:`try_encode_compensated` on the fixed wire with the table as a traced graph holds
    it (as ``fused.encode_with`` for the plain encoder): float32 levels and the 32 header bytes
    (TensorFlow variables, read per step), the key as ``StreamKey.scalars()`` (the step read
    in-graph). g and h are float32 of one size (h is never None: a graph's memory starts at
    zero); ``memory_out`` as :func:`try_encode_compensated`'s. None where a bucket of x cannot
    travel. ``checksum``: seal the payload (the flag is set in the copied header bytes)."""
    gf = flat_float32(g)
    hf = np.ascontiguousarray(h, dtype=np.float32).reshape(-1)
    n = gf.size if numel is None else int(numel)
    if hf.size != gf.size or n < gf.size:
        raise ValueError(f"g ({gf.size}), h ({hf.size}) and numel ({n}) do not fit together")
    out = (np.empty(gf.size, np.float32) if memory_out is None
           else check_out(memory_out, gf.size, np.float32, "memory"))
    header = np.asarray(header_u8, dtype=np.uint8)
    if n == 0:
        payload = header.copy()
        return Compensated(seal_checksum(payload) if checksum else payload, out, True, 0.0)
    found = _run_kernel(gf, hf, alpha, beta, np.ascontiguousarray(levels_f32, np.float32),
                        bits, n, bucket_size, norm, key_scalars(key), out, "fixed")
    if found is None:
        return None
    body, _, finite, squares = found
    body[:HEADER_SIZE] = header
    return Compensated(seal_checksum(body) if checksum else body, out, finite, squares)


def _run_kernel(g: np.ndarray, h: np.ndarray | None, alpha: float, beta: float,
                levels: np.ndarray, bits: int, n: int, bucket_size: int, norm: str,
                scalars: tuple, out: np.ndarray,
                coding: str) -> tuple[np.ndarray, np.ndarray, bool, float] | None:
    """The compiled pass over n > 0 coordinates (module docstring): (body, norms, whether h'
    is finite, Σh'²), h' written into ``out``; or None where a bucket of x cannot travel. The
    body is the fixed-width payload without its header bytes (``coding`` "fixed"), or the codes
    one per byte ("entropy")."""
    nb = -(-n // bucket_size)
    codes_offset = HEADER_SIZE + NORM_BYTES * nb
    if coding == "fixed":
        body = np.empty(payload_size(n, bits, bucket_size), np.uint8)
        section = body[HEADER_SIZE:codes_offset]
        aligned = _LITTLE and section.ctypes.data % NORM_BYTES == 0
        norms = section.view(np.float32) if aligned else np.empty(nb, np.float32)
        codes = body[codes_offset:]
        kernel = _compensated_encoder(bits)
    else:
        norms = np.empty(nb, np.float32)
        body = codes = np.empty(n, np.uint8)
        kernel = _compensated_code_encoder(bits)
    interior, padded, cells = search_tables(levels, bits)
    k0, k1, c1, c2, c3 = scalars
    bad, finite, squares = kernel(g, g if h is None else h, h is not None, np.float32(alpha),
                                  np.float32(beta), n, bucket_size, norm == "linf", interior,
                                  padded, cells, k0, k1, c1, c2, c3, norms, codes, out)
    if bad >= 0:
        return None
    if coding == "fixed" and not aligned:
        section[:] = norms.astype("<f4").view(np.uint8)
    return body, norms, bool(finite), float(squares)


def _fixed_payload(codes: np.ndarray, norms: np.ndarray, table: LevelTable, bucket_size: int,
                   norm: str, checksum: bool) -> np.ndarray:
    """The fixed-width payload of quantized ``codes`` (one per byte) and bucket ``norms``
    (docs/format.md §1): header, norms, the codes packed by the compiled packer."""
    n, bits = codes.size, table.bits
    codes_offset = HEADER_SIZE + NORM_BYTES * norms.size
    buf = np.empty(payload_size(n, bits, bucket_size), np.uint8)
    buf[:HEADER_SIZE] = np.frombuffer(make_header(n, table, bucket_size, norm), np.uint8)
    buf[HEADER_SIZE:codes_offset] = norms.astype("<f4").view(np.uint8)
    _code_packer(bits)(codes, buf[codes_offset:])
    return seal_checksum(buf) if checksum else buf
