"""LSB-first bit packing of the CODES section (numpy; ``horovod_aq.codec.format``).

Code i occupies stream bits [i·b, (i+1)·b), and stream bit k is bit (k mod 8) of byte ⌊k/8⌋;
the stream is cut after ⌈n·b/8⌉ bytes. Each group of 8 codes is exactly b bytes, the low b bytes
of the little-endian 64-bit integer Σ_j code_j << (j·b), which is how both functions work.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from horovod_aq.codec.format import (
    CODES_PER_GROUP,
    MAX_NUMEL,
    PayloadError,
    as_bytes,
    check_bits,
    check_int,
    packed_size,
)

__all__ = ["pack_bits", "unpack_bits"]


def pack_bits(codes: Any, bits: int) -> np.ndarray:
    """Pack codes (each < 2^bits) LSB-first into ⌈n·bits/8⌉ bytes (step 5)."""
    bits = check_bits(bits)
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
    bits = check_bits(bits)
    count = check_int("count", count, 0, MAX_NUMEL)
    data = as_bytes(buf)
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
