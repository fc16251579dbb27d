"""PyTorch kernels for the horovod_aq payload: the same bytes as the numpy oracle.

``encode`` / ``decode`` / ``decode_average`` / ``quantize`` implement ``horovod_aq.codec`` (the
payload layout is ``codec.format``, the eight arithmetic steps ``codec.reference``) with torch ops
only, on whatever device the input lives (CPU or CUDA). Given the same uniforms they produce the
same bytes as ``codec.encode`` and the TensorFlow kernels, and each decodes the others' payloads::

    payload = encode(grad, table, bucket_size=512, generator=gen)     # uint8, same device
    gathered = hvd.allgather(payload, name="aq.ag.w").view(world, -1) # [P, size]
    avg = decode_average(gathered, table).view_as(grad)               # bitwise equal on all ranks

Bit-exactness rules followed here (each one matters on some backend):

* the l2 norm sums float64 squares in the canonical pairwise order of ``codec`` (step 2) with
  explicit tensor halving, never ``torch.sum`` (whose order is unspecified);
* every division is tensor / tensor on the input's device (CUDA turns division by a *CPU scalar*
  into multiplication by its reciprocal, which is not IEEE division);
* decoded payloads are summed one rank at a time with ``add_`` (step 7), never ``sum(dim=0)``;
* products and sums are separate ops (no ``addcmul`` where an FMA would change the rounding; the
  one ``addcmul`` left adds an exact float64 square, so fusing cannot change it).

Host synchronisation: ``encode`` makes one host sync, ``bool(torch.isfinite(norms).all())`` on
the ⌈n/B⌉ bucket norms (a non-finite input makes its bucket's norm non-finite, so this checks the
whole gradient without a pass over it); explicit ``uniforms`` add a range check. ``decode`` and
``decode_average`` copy the 32-byte headers to the host once to validate them, and sync once at
the end on one flag (every norm finite and ≥ 0, every code < N — the codes are checked only for
tables with N < 2^b levels, the only ones where a code can be invalid); on a bad payload they
rerun the numpy oracle on a host copy, so they raise its ``PayloadError`` and message.
``decode_flagged`` (the wire's) does neither: it compares the headers with the expected one on
the device and returns the values with one device flag for the caller to read. Nothing
else leaves the device, except with ``checksum``: a checksummed payload (``FLAG_CHECKSUM``) is
CRC-32'd on the host (zero-copy for CPU tensors, a device-to-host copy otherwise), at encode and
at decode.

Performance (CPU): no Python loops over buckets or coordinates. The only Python loops are over the
⌈log₂ B⌉ halving steps of the norm, the ranks in ``decode_average`` and, to stay in cache, over
chunks of whole buckets (``CHUNK_ELEMENTS``).
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import numpy as np
import torch

from horovod_aq import codec
from horovod_aq.codec import HEADER_SIZE, NORM_BYTES, PayloadError
from horovod_aq.codec.stream import (
    UNIFORM_BITS,
    WORDS_PER_COUNTER,
    StreamKey,
    key_scalars,
    philox4x32,
)
from horovod_aq.levels.table import LevelTable
from horovod_aq.torch import triton_kernels, triton_send
from horovod_aq.torch.level_cells import DeviceTable, device_table
from horovod_aq.torch.payload import (
    CACHE_ENTRIES,
    DeviceCache,
    as_float32_flat,
    check_finite,
    check_payload_tensor,
    check_valid,
    checked_headers,
    header_tensor,
    seal_checksum,
)
from horovod_aq.torch.stats import bucket_moments, normalized_histogram

__all__ = ["bucket_moments", "bucket_norms", "decode", "decode_average", "decode_flagged",
           "dequantize", "encode", "first_nonfinite", "normalized_histogram", "pack_bits",
           "quantize", "stream_uniforms", "unpack_bits"]

#: Work on about this many elements at a time (rounded to whole buckets and groups of 8 codes),
#: so that the float64 and index temporaries of one chunk stay in the CPU caches.
CHUNK_ELEMENTS = 1 << 18
ACCELERATOR_CHUNK_ELEMENTS = 1 << 24

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("horovod_aq.torch.kernels assumes a little-endian host (the wire is LE)")


# ------------------------------------------------------------------------------------ caches


_CACHE = DeviceCache(CACHE_ENTRIES)


def _shifts(bits: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[0, b, 2b, …, 7b]: the bit offset of each code inside its group of 8."""
    return _CACHE.get(("shifts", bits, dtype, str(device)),
                      lambda: torch.arange(8, dtype=dtype, device=device) * bits)


# ------------------------------------------------------------------------------------ helpers


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _per_bucket(op, values: torch.Tensor, per_bucket: torch.Tensor, bucket_size: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """op(values_i, per_bucket[bucket(i)]) elementwise into ``out`` (new if None), without
    materialising a per-element copy of ``per_bucket``. ``values`` starts at a bucket boundary."""
    n = values.numel()
    full_buckets = n // bucket_size
    full = full_buckets * bucket_size
    if out is None:
        out = torch.empty_like(values)
    if full_buckets:
        op(values[:full].view(full_buckets, bucket_size), per_bucket[:full_buckets, None],
           out=out[:full].view(full_buckets, bucket_size))
    if full < n:
        op(values[full:], per_bucket[full_buckets:], out=out[full:])
    return out


def _chunks(n: int, bucket_size: int, device: torch.device) -> list[tuple[int, int]]:
    """(start, stop) ranges of whole buckets and whole groups of 8 codes.

    About ``CHUNK_ELEMENTS`` on CPU (cache blocking), ``ACCELERATOR_CHUNK_ELEMENTS`` elsewhere
    (only to bound temporary memory; kernel launches are what costs there).
    """
    target = CHUNK_ELEMENTS if device.type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
    unit = bucket_size * 8 // math.gcd(bucket_size, 8)
    step = max(unit, target // unit * unit)
    return [(s, min(s + step, n)) for s in range(0, n, step)]


# -------------------------------------------------------------------------------------- norms


def _l2_rows(rows: torch.Tensor) -> torch.Tensor:
    """float32(sqrt(pairwise float64 sum of squares)) of each row of a float32 matrix."""
    width = _next_pow2(rows.shape[1])
    if width != rows.shape[1]:
        rows = torch.nn.functional.pad(rows, (0, width - rows.shape[1]))
    if width == 1:
        return rows[:, 0].abs()  # sqrt(x²) = |x| exactly
    half = width // 2
    acc = rows[:, :half].to(torch.float64)
    acc.mul_(acc)
    upper = rows[:, half:].to(torch.float64)
    acc.addcmul_(upper, upper)  # upper² is exact in float64, so a fused multiply-add is too
    while half > 1:
        half //= 2
        acc = acc[:, :half] + acc[:, half:]
    return acc[:, 0].sqrt().to(torch.float32)


def _norms(flat: torch.Tensor, bucket_size: int, norm: str) -> torch.Tensor:
    """float32 norms of all buckets (codec step 2), chunk by chunk."""
    out = torch.empty(-(-flat.numel() // bucket_size), dtype=torch.float32, device=flat.device)
    for start, stop in _chunks(flat.numel(), bucket_size, flat.device):
        part = flat[start:stop]
        full_buckets = part.numel() // bucket_size
        full = full_buckets * bucket_size
        b0 = start // bucket_size
        pieces = []
        if full_buckets:
            pieces.append((part[:full].view(full_buckets, bucket_size), b0, b0 + full_buckets))
        if full < part.numel():
            pieces.append((part[full:].view(1, -1), b0 + full_buckets, b0 + full_buckets + 1))
        for rows, lo, hi in pieces:
            out[lo:hi] = rows.abs().amax(dim=1) if norm == "linf" else _l2_rows(rows)
    return out


def bucket_norms(x: torch.Tensor, bucket_size: int, norm: str = "l2") -> torch.Tensor:
    """float32 norm of every bucket (``codec.bucket_norms``), on x's device. No validation."""
    bucket_size = codec.check_bucket_size(bucket_size)
    return _norms(as_float32_flat(x), bucket_size, codec.check_norm(norm))


def first_nonfinite(x: torch.Tensor) -> int | None:
    """Index of the first NaN/±inf element of x (flattened), or None when all are finite.

    The common all-finite case costs one read-only pass: a non-finite element makes the float32
    sum non-finite (``torch.isfinite`` writes a mask and is ~30× slower on CPU). Only a
    non-finite sum — a non-finite element, or finite values whose sum overflows — pays for
    the exact elementwise check.
    """
    flat = x.detach().reshape(-1)
    if flat.numel() == 0 or bool(torch.isfinite(flat.sum(dtype=torch.float32))):
        return None
    bad = ~torch.isfinite(flat)
    return int(bad.int().argmax()) if bool(bad.any()) else None


# ----------------------------------------------------------------------------------- rounding


def _round(r: torch.Tensor, u: torch.Tensor, tab: DeviceTable) -> torch.Tensor:
    """Codes (int32) of normalized r by unbiased stochastic rounding (codec step 4). Consumes r."""
    j = tab.locate(r)
    r.sub_(tab.levels.index_select(0, j)).div_(tab.gaps.index_select(0, j))  # ξ, in place
    return j.add_(torch.lt(u, r).view(torch.uint8))  # += 1 where u < ξ (uint8: 2.5× bool's speed)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """LSB-first packing of a multiple-of-8 number of int codes into codes·bits/8 bytes."""
    if bits == 8:
        return codes.to(torch.uint8)
    groups = codes.numel() // 8
    word = torch.int32 if bits <= 4 else torch.int64
    word_bytes = 4 if bits <= 4 else 8
    grouped = codes.view(groups, 8).to(word) << _shifts(bits, word, codes.device)
    words = grouped.sum(dim=1, dtype=word)  # disjoint bit fields: the sum is a bitwise OR
    return words.view(torch.uint8).view(groups, word_bytes)[:, :bits].reshape(-1)


def _unpack(stream: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``_pack`` for a multiple-of-8 number of codes: int32 or int64 codes."""
    if bits == 8:
        return stream.to(torch.int32)
    groups = stream.numel() // bits
    word = torch.int32 if bits <= 4 else torch.int64
    word_bytes = 4 if bits <= 4 else 8
    if bits == word_bytes and stream.storage_offset() % word_bytes == 0:
        words = stream.view(word).view(groups, 1)  # 4 bits: 8 codes are one aligned int32
    else:
        buf = torch.empty(groups, word_bytes, dtype=torch.uint8, device=stream.device)
        buf[:, bits:] = 0
        buf[:, :bits] = stream.view(groups, bits)
        words = buf.view(word).view(groups, 1)
    codes = (words >> _shifts(bits, word, stream.device)).bitwise_and_((1 << bits) - 1)
    return codes.view(-1)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codec.pack_bits`` in torch: codes (< 2^bits) → ⌈n·bits/8⌉ uint8."""
    bits = codec.check_bits(bits)
    n = codes.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.int32, device=codes.device)
    padded[:n] = codes.reshape(-1)
    return _pack(padded, bits)[: codec.packed_size(n, bits)]


def unpack_bits(stream: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """``codec.unpack_bits`` in torch: the first ``count`` codes, as uint8."""
    bits = codec.check_bits(bits)
    nbytes = codec.packed_size(count, bits)
    if stream.numel() < nbytes:
        raise PayloadError(f"code stream is truncated: {stream.numel()} bytes, {nbytes} needed")
    padded = torch.zeros(-(-count // 8) * bits, dtype=torch.uint8, device=stream.device)
    padded[:nbytes] = stream.reshape(-1)[:nbytes]
    return _unpack(padded, bits)[:count].to(torch.uint8)


# --------------------------------------------------------------------------- implementations
#: Which implementation runs a keyed encode and every decode: "auto" (the compiled CPU kernel of
#: ``horovod_aq.codec.fused`` for CPU tensors, Triton for CUDA tensors when it is installed,
#: these torch ops otherwise), "ops" (always these ops) or "triton" (Triton's kernels for CPU
#: tensors too, in Triton's interpreter, ``TRITON_INTERPRET=1``: the GPU's code path, slowly,
#: on a machine without one — the GPU checks' dry runs). Set by ``HOROVOD_AQ_KERNELS``.
IMPLEMENTATIONS = ("auto", "ops", "triton")
IMPLEMENTATION = os.environ.get("HOROVOD_AQ_KERNELS", "auto")
if IMPLEMENTATION not in IMPLEMENTATIONS:
    raise ValueError(f"HOROVOD_AQ_KERNELS must be one of {IMPLEMENTATIONS}, got "
                     f"{IMPLEMENTATION!r}")


def implementation_for(device: torch.device) -> str:
    """"fused" (CPU), "triton" (CUDA with Triton) or "torch" (these ops): what runs on
    ``device``."""
    if IMPLEMENTATION == "ops":
        return "torch"
    if IMPLEMENTATION == "triton" and device.type == "cpu":
        if not (triton_kernels.available() and triton_kernels.interpreting()):
            raise RuntimeError("HOROVOD_AQ_KERNELS=triton runs CPU tensors in Triton's "
                               "interpreter: install triton and set TRITON_INTERPRET=1")
        return "triton"
    if device.type == "cpu":
        return "fused"
    if device.type == "cuda":
        if triton_kernels.available():
            return "triton"
    return "torch"


def _fused_input(x: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU gradient as float32 (one cast for other dtypes)."""
    return as_float32_flat(x).detach().numpy()


# ------------------------------------------------------------------------------------- encode


def _explicit_uniforms(n: int, device, uniforms) -> torch.Tensor | None:
    if uniforms is None:
        return None
    if not isinstance(uniforms, torch.Tensor):
        uniforms = torch.as_tensor(np.asarray(uniforms, dtype=np.float32))
    if uniforms.numel() != n:
        raise ValueError(f"uniforms must have shape ({n},), got {tuple(uniforms.shape)}")
    u = uniforms.detach().reshape(-1).to(device=device, dtype=torch.float32)
    if n and not bool(((u >= 0) & (u < 1)).all()):  # a second sync, explicit uniforms only
        raise ValueError("uniforms must lie in [0, 1) after rounding to float32")
    return u


def _prepare(x, levels, bucket_size, norm, uniforms):
    """Validate everything (one sync) before any uniform is drawn: bad input touches nothing."""
    table = codec.as_table(levels)
    bucket_size = codec.check_bucket_size(bucket_size)
    norm = codec.check_norm(norm)
    flat = as_float32_flat(x)
    device_table(table, flat.device)  # validates the float32 table (float32_levels), cached
    norms = _norms(flat, bucket_size, norm)
    check_finite(flat, norms)
    u = _explicit_uniforms(flat.numel(), flat.device, uniforms)
    return table, bucket_size, norm, flat, norms, u


def stream_uniforms(n: int, key: StreamKey, device: Any = "cpu", start: int = 0) -> torch.Tensor:
    """``codec.stream_uniforms`` in torch ops on ``device``: coordinates start … start+n−1 of
    ``key``'s Philox stream (the format's, docs/format.md §6), bitwise the same floats."""
    if n == 0:
        return torch.zeros(0, dtype=torch.float32, device=device)
    k0, k1, c1, c2, c3 = key_scalars(key)
    first, last = start // WORDS_PER_COUNTER, (start + n - 1) // WORDS_PER_COUNTER
    c0 = torch.arange(first, last + 1, dtype=torch.int64, device=device)
    fill = [torch.full_like(c0, c) for c in (c1, c2, c3)]
    words = torch.stack(philox4x32((c0, *fill), (k0, k1)), dim=1).reshape(-1)
    offset = start - first * WORDS_PER_COUNTER
    top = words[offset:offset + n] >> (32 - UNIFORM_BITS)
    return top.to(torch.float32) * (2.0 ** -UNIFORM_BITS)


def _quantize_chunks(flat, norms, u, generator, table, bucket_size, emit, key=None) -> None:
    """Normalize and round chunk by chunk; hand each chunk's int32 codes (zero-padded to a
    multiple of 8) to ``emit(start, stop, codes)``.

    Uniforms: explicit ``u``; else the chunk's part of ``key``'s stream (the format's); else
    each chunk draws ``torch.rand(stop − start, generator=…)`` in order (on CPU the same stream
    as one ``torch.rand(n, generator=…)``).
    """
    tab = device_table(table, flat.device)
    safe = torch.where(norms == 0, torch.ones_like(norms), norms)  # zero bucket: 0 / 1 = 0
    for start, stop in _chunks(flat.numel(), bucket_size, flat.device):
        size = stop - start
        b0, b1 = start // bucket_size, -(-stop // bucket_size)
        r = _per_bucket(torch.div, flat[start:stop], safe[b0:b1], bucket_size)
        r.clamp_(-1.0, 1.0)
        if u is not None:
            uc = u[start:stop]
        elif key is not None:
            uc = stream_uniforms(size, key, flat.device, start)
        else:
            uc = torch.rand(size, generator=generator, device=flat.device, dtype=torch.float32)
        codes = _round(r, uc, tab)
        if size % 8:
            codes = torch.nn.functional.pad(codes, (0, 8 - size % 8))
        emit(start, stop, codes)


def encode(
    x: torch.Tensor,
    levels: LevelTable | Any,
    *,
    bucket_size: int,
    norm: str = "l2",
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    key: StreamKey | None = None,
    checksum: bool = False,
    checked: bool = False,
) -> torch.Tensor:
    """Quantize and pack x into a uint8 payload on x's device (``codec.encode``).

    Args:
        x: gradient of any shape; float16/bfloat16/float32/float64, finite.
        levels: a ``LevelTable`` (or an array, taken as version 0).
        bucket_size, norm: as in ``codec.encode``.
        generator: ``torch.Generator`` on x's device for the uniforms (default: torch's global).
        uniforms: n float32 values in [0, 1) (tensor or array); overrides ``key``/``generator``.
        key: the format's random stream (``codec.StreamKey``): the same bytes as
            ``codec.encode(..., key=key)``; overrides ``generator``.
        checksum: write ``FLAG_CHECKSUM`` and the payload's CRC-32 (``codec.encode``'s
            ``checksum``; computed on the host).
        checked: the caller has found x finite with every bucket norm within float32
            (``packed.send`` step 2), so the Triton kernel skips the check and its host sync
            (a payload of an x that is not is then refused by every decoder); the torch ops,
            whose rounding indexes the table by value, and the fused CPU kernel, where the
            check costs nothing, check anyway.
    """
    checksum = codec.check_bool("checksum", checksum)
    checked = codec.check_bool("checked", checked)
    if key is not None and uniforms is None and isinstance(x, torch.Tensor):
        impl = implementation_for(x.device)
        if impl == "fused":
            from horovod_aq.codec import fused

            return torch.from_numpy(fused.encode(_fused_input(x), levels,
                                                 bucket_size=bucket_size, norm=norm, key=key,
                                                 checksum=checksum))
        if impl == "triton":
            return triton_send.encode(x, levels, bucket_size=bucket_size, norm=norm, key=key,
                                         checksum=checksum, checked=checked)
    table, bucket_size, norm, flat, norms, u = _prepare(x, levels, bucket_size, norm, uniforms)
    n, bits = flat.numel(), table.bits
    nb = norms.numel()
    codes_at = HEADER_SIZE + NORM_BYTES * nb
    payload = torch.empty(codec.payload_size(n, bits, bucket_size), dtype=torch.uint8,
                          device=flat.device)
    payload[:HEADER_SIZE] = header_tensor(n, table, bucket_size, norm, flat.device)
    payload[HEADER_SIZE:codes_at] = norms.view(torch.uint8)
    stream = payload[codes_at:]

    def emit(start, stop, codes):
        packed = _pack(codes, bits)  # start is a multiple of 8: whole bytes
        lo = start * bits // 8
        hi = codec.packed_size(stop, bits)
        stream[lo:hi] = packed[: hi - lo]

    _quantize_chunks(flat, norms, u, generator, table, bucket_size, emit, key)
    return seal_checksum(payload) if checksum else payload


def quantize(
    x: torch.Tensor,
    levels: LevelTable | Any,
    *,
    bucket_size: int,
    norm: str = "l2",
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    key: StreamKey | None = None,
) -> torch.Tensor:
    """``decode(encode(x))`` without packing: flat quantized values, bitwise the same."""
    table, bucket_size, norm, flat, norms, u = _prepare(x, levels, bucket_size, norm, uniforms)
    lookup = device_table(table, flat.device).lookup
    out = torch.empty_like(flat)

    def emit(start, stop, codes):
        b0 = start // bucket_size
        b1 = -(-stop // bucket_size)
        values = lookup.index_select(0, codes[: stop - start])
        _per_bucket(torch.mul, values, norms[b0:b1], bucket_size, out=out[start:stop])

    _quantize_chunks(flat, norms, u, generator, table, bucket_size, emit, key)
    return out.to(dtype)


# ------------------------------------------------------------------------------------- decode


def _decode_checked(row: torch.Tensor, header: codec.Header, table: LevelTable,
                    valid: list[torch.Tensor]) -> torch.Tensor:
    """float32 values of one validated payload row (1-D uint8, exact size); appends to
    ``valid`` 0-dim bool device tensors that are all True iff every norm is finite and ≥ 0 and
    every code < N (checked only where N < 2^b)."""
    n, bits = header.numel, header.bits
    bucket_size = header.span  # min(B, n): the same buckets, chunks bounded by n (not by B)
    codes_at = header.codes_offset
    norm_bytes = row[HEADER_SIZE:codes_at]
    if norm_bytes.storage_offset() % NORM_BYTES or not norm_bytes.is_contiguous():
        norm_bytes = norm_bytes.clone()  # e.g. a row of a gathered buffer with an odd size
    norms = norm_bytes.view(torch.float32)
    if norms.numel():
        valid.append((torch.isfinite(norms) & (norms >= 0)).all())
    check_codes = table.num_levels < (1 << bits)
    lookup = device_table(table, row.device).lookup
    out = torch.empty(n, dtype=torch.float32, device=row.device)
    stream = row[codes_at:]
    for start, stop in _chunks(n, bucket_size, row.device):
        lo, hi = start * bits // 8, codec.packed_size(stop, bits)
        chunk = stream[lo:hi]
        full_bytes = -(-(stop - start) // 8) * bits
        if hi - lo < full_bytes:
            chunk = torch.nn.functional.pad(chunk, (0, full_bytes - (hi - lo)))
        codes = _unpack(chunk, bits)[: stop - start]
        if check_codes:
            valid.append(codes.amax() < table.num_levels)
        _dequantize_into(out[start:stop], codes, norms[start // bucket_size:
                                                       -(-stop // bucket_size)],
                         lookup, bucket_size)
    return out


def _dequantize_into(out: torch.Tensor, codes: torch.Tensor, norms: torch.Tensor,
                     lookup: torch.Tensor, bucket_size: int) -> None:
    """out_i = q[code_i] · norm of i's bucket (codec step 6, float32); ``codes`` start at a
    bucket boundary."""
    _per_bucket(torch.mul, lookup.index_select(0, codes), norms, bucket_size, out=out)


def dequantize(codes: torch.Tensor, norms: torch.Tensor, levels: LevelTable | Any,
               bucket_size: int) -> torch.Tensor:
    """float32 values q[code_i] · ‖bucket(i)‖ of n codes (integer tensor, all < N) and their
    ⌈n/B⌉ float32 norms, on their device: what the decoders compute from a payload's codes
    (codec step 6, bitwise ``codec.dequantize``)."""
    table = codec.as_table(levels)
    n = codes.numel()
    span = max(1, min(codec.check_bucket_size(bucket_size), n))   # Header.span
    lookup = device_table(table, codes.device).lookup
    out = torch.empty(n, dtype=torch.float32, device=codes.device)
    codes = codes.to(torch.int64)
    for start, stop in _chunks(n, span, codes.device):
        _dequantize_into(out[start:stop], codes[start:stop],
                         norms[start // span:-(-stop // span)], lookup, span)
    return out


def decode(
    payload: torch.Tensor,
    levels: LevelTable | Any,
    *,
    dtype: torch.dtype = torch.float32,
    numel: int | None = None,
    bucket_size: int | None = None,
    norm: str | None = None,
) -> torch.Tensor:
    """Decode one uint8 payload (any framework's) into a flat tensor of ``dtype``, same device."""
    impl = implementation_for(payload.device) if isinstance(payload, torch.Tensor) else "torch"
    if impl != "torch" and payload.dtype == torch.uint8 and payload.dim() == 1:
        return _decode_with(impl, "decode", payload, levels, dtype, numel, bucket_size, norm)
    table = codec.as_table(levels)
    check_payload_tensor(payload, 1)
    _, header = checked_headers(payload[None], table, numel, bucket_size, norm, single=True)
    valid: list[torch.Tensor] = []
    out = _decode_checked(payload, header, table, valid)
    check_valid(valid, lambda: codec.decode(payload.detach().cpu().numpy(), table))
    return out.to(dtype)


def decode_average(
    payloads: torch.Tensor,
    levels: LevelTable | Any,
    *,
    dtype: torch.dtype = torch.float32,
    numel: int | None = None,
    bucket_size: int | None = None,
    norm: str | None = None,
) -> torch.Tensor:
    """Decode the P rows of a gathered [P, size] buffer and average them (codec step 7).

    Each row is divided by P (a device tensor, so CUDA performs a true division) and added in
    rank order in float32 (dividing first, no overflow): bitwise equal on every rank and to
    ``codec.decode_average``. Only one decoded row is alive besides the accumulator.
    """
    impl = implementation_for(payloads.device) if isinstance(payloads, torch.Tensor) else "torch"
    if (impl != "torch" and payloads.dtype == torch.uint8 and payloads.dim() == 2
            and payloads.shape[0] > 0):
        return _decode_with(impl, "decode_average", payloads, levels, dtype, numel, bucket_size,
                            norm)
    table = codec.as_table(levels)
    headers, _ = checked_headers(payloads, table, numel, bucket_size, norm)
    valid: list[torch.Tensor] = []
    acc = _average_checked(payloads, headers, table, valid)
    check_valid(valid, lambda: codec.decode_average(payloads.detach().cpu().numpy(), table))
    return acc.to(dtype)


def _average_checked(payloads: torch.Tensor, headers: list[codec.Header], table: LevelTable,
                     valid: list[torch.Tensor]) -> torch.Tensor:
    """The average of the rows (each divided by P, added in rank order: codec step 7)."""
    world = len(headers)
    acc = _decode_checked(payloads[0], headers[0], table, valid)
    divisor = torch.full((), world, dtype=torch.float32, device=acc.device)
    acc.div_(divisor)
    for rank in range(1, world):
        acc.add_(_decode_checked(payloads[rank], headers[rank], table, valid).div_(divisor))
    return acc


def decode_flagged(rows: torch.Tensor, levels: LevelTable | Any, *, numel: int,
                   bucket_size: int, norm: str, average: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Decode payload rows [P, size] that should be exactly what ``encode(·, levels,
    bucket_size=, norm=)`` writes for ``numel`` elements, with no host synchronisation:
    (values, ok), ``ok`` a 0-dim bool tensor on the rows' device that is True iff every row's
    header is that encode's (so no non-finite marker, joined rank, checksum, other table or
    settings) and every norm is finite and ≥ 0 and every code < N.

    ``average``: the values are ``decode_average`` of the rows, bit for bit; otherwise the rows
    decoded one after another, concatenated (P·numel values). Where ``ok`` is False the values
    mean nothing: the caller decodes the same rows with the checked decoders, which raise the
    oracle's errors (docs/protocol.md §5.8). None where that is known without a synchronisation:
    the rows' size differs, or on CPU (host memory, read at no cost) a check failed."""
    table = codec.as_table(levels)
    check_payload_tensor(rows, 2)
    if rows.shape[0] == 0 or rows.shape[1] != codec.payload_size(numel, table.bits,
                                                                  bucket_size):
        return None
    expected = header_tensor(numel, table, bucket_size, norm, rows.device)
    impl = implementation_for(rows.device)
    header = None if impl == "fused" else codec.parse_header(
        codec.make_header(numel, table, bucket_size, norm))
    if impl == "triton" and numel:   # one flag the kernel raises, the headers' check included
        out, flag = triton_kernels.decode_rows_flagged(rows, header, table, average,
                                                       head=expected)
        return out, flag[0] == 0
    same = (rows[:, :HEADER_SIZE] == expected).all()
    if impl == "fused":
        if not bool(same):   # host memory: no synchronisation
            return None
        kwargs = {"numel": numel, "bucket_size": bucket_size, "norm": norm}
        try:   # the fused decoders check norms and codes as they go
            out = (_decode_with(impl, "decode_average", rows, table, torch.float32, **kwargs)
                   if average else torch.cat([_decode_with(impl, "decode", row, table,
                                                           torch.float32, **kwargs)
                                              for row in rows]))
        except PayloadError:
            return None
        return out, same
    valid = [same]
    if average:   # (torch ops; with Triton only for no coordinates)
        out = _average_checked(rows, [header] * rows.shape[0], table, valid)
    else:
        out = torch.cat([_decode_checked(row, header, table, valid) for row in rows])
    return out, torch.stack(valid).all()


def _decode_with(impl: str, op: str, payload: torch.Tensor, levels: Any, dtype: torch.dtype,
                 numel: int | None, bucket_size: int | None, norm: str | None) -> torch.Tensor:
    """``op`` ("decode" / "decode_average") by the compiled CPU kernel or Triton."""
    kwargs = {"numel": numel, "bucket_size": bucket_size, "norm": norm}
    if impl == "triton":
        return getattr(triton_kernels, op)(payload, levels, dtype=dtype, **kwargs)
    from horovod_aq.codec import fused

    rows = payload.detach().contiguous().numpy()
    return torch.from_numpy(getattr(fused, op)(rows, levels, **kwargs)).to(dtype)

