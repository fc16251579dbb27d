"""Triton kernels for the horovod_aq payload: the shared device arithmetic, the bucket norms and
``decode_average`` at memory speed (the encode is ``horovod_aq.torch.triton_send.encode``).

The same bytes as the numpy oracle (``horovod_aq.codec``, arithmetic in ``docs/format.md`` §5,
random stream §6) and as ``horovod_aq.torch.kernels``, on CUDA tensors; CPU tensors run only
under Triton's interpreter (``TRITON_INTERPRET=1``, how CI proves the kernels byte-exact)::

    avg = decode_average(gathered.view(world, -1), table).view_as(grad)

Kernels: bucket norms (one tile of whole buckets per program; buckets wider than ``NORM_BLOCK``
are reduced in several passes that keep the canonical pairwise order), the device helpers of
quantize + pack (groups of 8 codes = ``bits`` bytes; Philox4x32-10 per 4 coordinates) that the
one-pass send kernel of ``triton_send`` uses, and a decode kernel that adds the P rows in rank
order. Divisions use ``tl.div_rn`` (IEEE), kernels are compiled with ``enable_fp_fusion=False``
(no FMA), float64 only in the l2 sums.

The decoders copy the 32-byte headers to the host once (``horovod_aq.torch.payload``) and sync
once at the end on one flag, which the decode kernel raises itself (atomic max): a norm not
finite or < 0, or — for tables with N < 2^b levels, where a corrupt code decodes to NaN through
the padded lookup — a NaN in the result (with valid norms and levels a NaN arises only so). A
bad payload is then decoded by the numpy oracle on a host copy, which raises its
``PayloadError``. ``decode_rows_flagged`` returns that flag instead of reading it, and with
``head`` also raises it where a row's header differs (the wire's ``kernels.decode_flagged``:
markers, joined ranks, another table). Checksummed payloads (``FLAG_CHECKSUM``) are CRC-32'd on
the host (``horovod_aq.torch.payload``: ``seal_checksum``, ``verify_checksums``).

``import triton`` happens at the first call (``available()`` says whether it can), and the
kernels are jitted then, so ``TRITON_INTERPRET`` must be set before the first call.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import numpy as np
import torch

from horovod_aq import codec
from horovod_aq.codec import HEADER_SIZE
from horovod_aq.levels.table import LevelTable
from horovod_aq.torch import payload as common

__all__ = ["available", "decode", "decode_average", "decode_rows_flagged", "interpreting",
           "unavailable_reason"]

#: Elements of one norm tile (float64 in the l2 kernel). Buckets up to this width (rounded up
#: to a power of two) take one pass; wider ones are first reduced to this width (module doc).
NORM_BLOCK = 4096
#: Groups of 8 codes per program of the encode and decode kernels (1024 coordinates).
ENCODE_GROUPS = 128
DECODE_GROUPS = 128
NUM_WARPS = 4

tl: Any = None  # triton.language, bound by _kernels()
_STATE: dict[str, Any] = {}
_LOCK = threading.Lock()
_TABLES = common.DeviceCache(8)


# ----------------------------------------------------------------------------- availability


def _import_triton():
    if "triton" not in _STATE:
        try:
            import triton
            import triton.language
        except Exception as err:  # ImportError, or a broken install
            _STATE["triton"] = None
            _STATE["reason"] = f"triton cannot be imported ({type(err).__name__}: {err})"
        else:
            _STATE["triton"] = triton
            _STATE["reason"] = None
    return _STATE["triton"]


def available() -> bool:
    """Whether Triton can be imported (CUDA tensors then run on the GPU; CPU tensors need
    ``TRITON_INTERPRET=1``)."""
    return _import_triton() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True)."""
    _import_triton()
    return _STATE["reason"]


def interpreting() -> bool:
    """Whether the kernels run (or will run) in Triton's interpreter."""
    if "interpret" in _STATE:
        return _STATE["interpret"]
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class _OneAtATime:
    """A jitted kernel launched under one process-wide lock (``kernel[grid](...)`` as usual)."""

    __slots__ = ("kernel",)

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            with _INTERPRETER_LOCK:
                return self.kernel[grid](*args, **kwargs)
        return launch


_INTERPRETER_LOCK = threading.RLock()


def launched(kernel: Any) -> Any:
    """``kernel`` (jitted) as this package launches it: itself, or in Triton's interpreter one
    launch at a time in the process — the interpreter patches ``triton.language`` for the
    length of a launch, and the DDP hook and its collectives' callbacks launch from two
    threads (``HOROVOD_AQ_KERNELS=triton`` on CPU tensors)."""
    return _OneAtATime(kernel) if interpreting() else kernel


# ---------------------------------------------------------------------------- device helpers
# Plain functions here; _kernels() replaces each by triton.jit(fn) at the first call (so the
# interpreter setting is read then, and this module imports without triton).


def _philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of the counters (c0, c1, c2, c3) under key (k0, k1): uint32 tensors."""
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


def _bucket_of(i, bucket_size, log_bucket, POW2_BUCKET: tl.constexpr):
    if POW2_BUCKET:
        return i >> log_bucket
    else:
        return i // bucket_size


def _locate(r, lev_ptr, nlev, BITS: tl.constexpr):
    """j = clip(searchsorted(L, r, "right") − 1, 0, N − 2); lev_ptr: L padded with +inf to
    2^BITS entries. Branch-free binary search for the count of levels ≤ r."""
    pos = tl.zeros(r.shape, tl.int32)
    for k in tl.static_range(BITS):
        step = (1 << (BITS - 1)) >> k
        probe = tl.load(lev_ptr + (pos + (step - 1)))
        pos = tl.where(probe <= r, pos + step, pos)
    pos = pos + (tl.load(lev_ptr + pos) <= r).to(tl.int32)
    return tl.minimum(tl.maximum(pos - 1, 0), nlev - 2)


def _norm_values(x, L2: tl.constexpr):
    """float64 squares (l2) or |x| with NaN → +inf (linf, so that a NaN makes the norm
    non-finite: tl.max does not propagate NaN)."""
    if L2:
        q = x.to(tl.float64)
        return q * q
    else:
        return tl.where(x == x, tl.abs(x), float("inf"))


# ---------------------------------------------------------------------------------- kernels


def _norm_kernel(src_ptr, norms_ptr, n, bucket_size, num_buckets,
                 W: tl.constexpr, LOG_W: tl.constexpr, ROWS: tl.constexpr,
                 L2: tl.constexpr, FROM_INPUT: tl.constexpr, WIDE: tl.constexpr,
                 SQUARES: tl.constexpr):
    """ROWS whole buckets per program, each zero-padded to W (a power of two ≥ its width):
    l2 = float32(sqrt(canonical pairwise float64 sum of squares)) — or, with SQUARES, that
    float64 sum itself — linf = max |x|. Reads the input (FROM_INPUT) or a [num_buckets, W]
    scratch of partial sums/maxima."""
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    e = tl.arange(0, W)
    live = rows[:, None] < num_buckets
    if FROM_INPUT:
        i = rows[:, None] * bucket_size + e[None, :]
        mask = live & (e[None, :] < bucket_size) & (i < n)
        x = tl.load(src_ptr + i, mask=mask, other=0.0).to(tl.float32)
        q = _norm_values(x, L2)
    else:
        q = tl.load(src_ptr + (rows[:, None] * W + e[None, :]), mask=live, other=0.0)
    if L2:
        for k in tl.static_range(LOG_W):  # q_k += q_{k + W/2}, W halving (codec step 2)
            q = tl.sum(tl.reshape(q, (ROWS, 2, W >> (k + 1))), axis=1)
        total = tl.reshape(q, (ROWS,))
        if SQUARES:
            value = total
        else:
            value = tl.sqrt(total).to(tl.float32)
    else:
        value = tl.max(q, axis=1)
    tl.store(norms_ptr + rows, value, mask=rows < num_buckets)


def _partial_kernel(src_ptr, dst_ptr, n, bucket_size, src_width, dst_width, per_bucket,
                    M: tl.constexpr, LOG_M: tl.constexpr, KT: tl.constexpr,
                    L2: tl.constexpr, FROM_INPUT: tl.constexpr, WIDE: tl.constexpr):
    """One pass of the norms of wide buckets: dst[b, k] = canonical pairwise sum (or max) over
    m < M of src[b, m·dst_width + k], i.e. the first log2(M) halvings of the bucket's row.
    Program (b, c) does columns k of [c·KT, (c+1)·KT)."""
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    bucket = pid // per_bucket
    col = (pid % per_bucket) * KT + tl.arange(0, KT)
    m = tl.arange(0, M)
    e = m[:, None] * dst_width + col[None, :]
    if FROM_INPUT:
        i = bucket * bucket_size + e
        x = tl.load(src_ptr + i, mask=(e < bucket_size) & (i < n), other=0.0).to(tl.float32)
        q = _norm_values(x, L2)
    else:
        q = tl.load(src_ptr + (bucket * src_width + e))
    if L2:
        for k in tl.static_range(LOG_M):
            q = tl.sum(tl.reshape(q, (2, M >> (k + 1), KT)), axis=0)
        part = tl.reshape(q, (KT,))
    else:
        part = tl.max(q, axis=0)
    tl.store(dst_ptr + (bucket * dst_width + col), part)


def _codes(x, nrm, live, first, ctr, word, lev_ptr, gap_ptr, nlev, k0, k1, c1, c2, c3,
           BITS: tl.constexpr):
    """code_i of the [2·GROUPS, 4] coordinates i = first + 4·ctr + word (docs/format.md §5
    steps 3–4): r = clip(x/n_k, −1, 1), j its cell, ξ = (r − L_j)/D_j, code = j + [u_i < ξ];
    0 where not ``live``."""
    r = tl.div_rn(x, tl.where(nrm == 0.0, 1.0, nrm))  # zero bucket: 0 / 1 = 0
    r = tl.minimum(tl.maximum(r, -1.0), 1.0)
    j = _locate(r, lev_ptr, nlev, BITS)
    xi = tl.div_rn(r - tl.load(lev_ptr + j), tl.load(gap_ptr + j))
    # The stream: u_i = (Philox(⌊i/4⌋, c1, c2, c3; k0, k1)[i mod 4] >> 8) · 2^−24.
    c0 = (first // 4 + ctr).to(tl.uint32)
    zero = tl.zeros_like(c0)
    w0, w1, w2, w3 = _philox(
        c0, zero + c1.to(tl.uint32, bitcast=True), zero + c2.to(tl.uint32, bitcast=True),
        zero + c3.to(tl.uint32, bitcast=True), zero + k0.to(tl.uint32, bitcast=True),
        zero + k1.to(tl.uint32, bitcast=True))
    sel = word[None, :]
    w = tl.where(sel == 0, w0[:, None],
                 tl.where(sel == 1, w1[:, None], tl.where(sel == 2, w2[:, None], w3[:, None])))
    u = (w >> 8).to(tl.float32) * 5.9604644775390625e-08
    return tl.where(live, tl.where(u < xi, j + 1, j), 0)  # unused bits of the last byte: 0


def _store_packed(code, out_ptr, first, nbytes, BITS: tl.constexpr, GROUPS: tl.constexpr):
    """Pack the 8·GROUPS codes from coordinate ``first`` (a multiple of 8) into GROUPS·BITS
    bytes of ``out_ptr`` (below ``nbytes``): the 8 codes of a group are the low BITS bytes of
    Σ_t code_t << (t·BITS) (docs/format.md §4)."""
    t = tl.arange(0, 8)
    if BITS <= 4:
        code8 = tl.reshape(code, (GROUPS, 8)).to(tl.uint32)
        packed = tl.sum(code8 << (t * BITS).to(tl.uint32)[None, :], axis=1)
        byte = (packed[:, None] >> ((t * 8) & 31).to(tl.uint32)[None, :]) & 0xFF
    else:
        code8 = tl.reshape(code, (GROUPS, 8)).to(tl.uint64)
        packed = tl.sum(code8 << (t * BITS).to(tl.uint64)[None, :], axis=1)
        byte = (packed[:, None] >> (t * 8).to(tl.uint64)[None, :]) & 0xFF
    g = first // 8 + tl.arange(0, GROUPS)
    dst = g[:, None] * BITS + t[None, :]
    tl.store(out_ptr + dst, byte.to(tl.uint8), mask=(t[None, :] < BITS) & (dst < nbytes))


def _decoded_row(codes_ptr, norms_ptr, lookup_ptr, src, src_mask, bucket, live, t,
                 BITS: tl.constexpr):
    """(x̂ = n_bucket · L[code] (float32) of one row's 8·GROUPS coordinates, 1 where a live
    coordinate's norm is not finite and ≥ 0, else 0)."""
    raw = tl.load(codes_ptr + src, mask=src_mask, other=0)
    if BITS <= 4:
        word = tl.sum(raw.to(tl.uint32) << ((t * 8) & 31).to(tl.uint32)[None, :], axis=1)
        code = (word[:, None] >> (t * BITS).to(tl.uint32)[None, :]) & ((1 << BITS) - 1)
    else:
        word = tl.sum(raw.to(tl.uint64) << (t * 8).to(tl.uint64)[None, :], axis=1)
        code = (word[:, None] >> (t * BITS).to(tl.uint64)[None, :]) & ((1 << BITS) - 1)
    level = tl.load(lookup_ptr + code.to(tl.int32))  # NaN past the table (corrupt codes)
    nrm = tl.load(norms_ptr + bucket, mask=live, other=0.0)
    bad = tl.max(tl.where((nrm >= 0.0) & (nrm < float("inf")), 0, 1))   # NaN fails both
    return nrm * level, bad


def _header_differs(row_ptr, h, want, mine):
    """1 where ``mine`` and the header bytes h at ``row_ptr`` are not ``want``, else 0."""
    got = tl.load(row_ptr + h, mask=mine, other=0)
    return tl.max(tl.where(mine & (got != want), 1, 0))


def _decode_kernel(rows_ptr, row_stride, norms_ptr, norm_stride, lookup_ptr, out_ptr, flag_ptr,
                   head_ptr, n, bucket_size, log_bucket, nbytes, codes_at, world, world_f,
                   BITS: tl.constexpr, GROUPS: tl.constexpr, AVERAGE: tl.constexpr,
                   POW2_BUCKET: tl.constexpr, WIDE: tl.constexpr, CHECK_NAN: tl.constexpr,
                   HEAD: tl.constexpr, HEADER: tl.constexpr):
    """acc = x̂⁽⁰⁾/P; acc += x̂⁽ᵖ⁾/P for p = 1 … P−1 in float32 (divided before the sum, so no
    overflow; no division unless AVERAGE), 8·GROUPS coordinates per program (codec step 7) —
    or, with ``world`` 1 and a second grid axis r, row r alone into out[r·n:(r+1)·n] (the rows
    concatenated). flag ← 1 (atomic max) where a norm is not finite and ≥ 0, or — CHECK_NAN,
    tables of N < 2^b levels — acc holds a NaN (a code past the table), or — HEAD, checked by
    a row's program 0 — a row's 32 header bytes are not ``head``'s."""
    pid = tl.program_id(0)
    r = tl.program_id(1)
    if WIDE:
        pid = pid.to(tl.int64)
        r = r.to(tl.int64)
    rows_ptr += r * row_stride
    norms_ptr += r * norm_stride
    out_ptr += r * n
    first = pid * (GROUPS * 8)
    grp = tl.arange(0, GROUPS)
    t = tl.arange(0, 8)
    i = first + grp[:, None] * 8 + t[None, :]
    live = i < n
    bucket = _bucket_of(i, bucket_size, log_bucket, POW2_BUCKET)
    src = (first // 8 + grp)[:, None] * BITS + t[None, :]
    src_mask = (t[None, :] < BITS) & (src < nbytes)
    row = rows_ptr + codes_at
    acc, bad = _decoded_row(row, norms_ptr, lookup_ptr, src, src_mask, bucket, live, t, BITS)
    if HEAD:
        h = tl.arange(0, HEADER)
        mine = (tl.zeros_like(h) + pid) == 0   # a block: the interpreter takes no 0-d mask
        want = tl.load(head_ptr + h)
        bad = tl.maximum(bad, _header_differs(rows_ptr, h, want, mine))
    if AVERAGE:
        acc = tl.div_rn(acc, world_f)
    nrm_row = norms_ptr
    for _ in range(1, world):
        row += row_stride
        nrm_row += norm_stride
        value, bad_p = _decoded_row(row, nrm_row, lookup_ptr, src, src_mask, bucket, live, t,
                                    BITS)
        if AVERAGE:
            value = tl.div_rn(value, world_f)
        acc = acc + value
        bad = tl.maximum(bad, bad_p)
        if HEAD:
            bad = tl.maximum(bad, _header_differs(row - codes_at, h, want, mine))
    tl.store(out_ptr + i, acc, mask=live)
    if CHECK_NAN:
        bad = tl.maximum(bad, tl.max(tl.where(live & (acc != acc), 1, 0)))
    tl.atomic_max(flag_ptr, bad, mask=bad > 0)


_HELPERS = ("_philox", "_bucket_of", "_locate", "_norm_values", "_codes", "_store_packed",
            "_decoded_row", "_header_differs")
_KERNELS = ("_norm_kernel", "_partial_kernel", "_decode_kernel")
#: Runtime scalars that must not be specialized (a key word equal to 1, a size divisible by
#: 16 …): one compiled variant per set of constexprs, whatever the values.
_NO_SPECIALIZE = {
    "_norm_kernel": ["n", "bucket_size", "num_buckets"],
    "_partial_kernel": ["n", "bucket_size", "src_width", "dst_width", "per_bucket"],
    "_decode_kernel": ["row_stride", "norm_stride", "n", "bucket_size", "log_bucket", "nbytes",
                       "codes_at", "world"],
}


def _kernels() -> dict[str, Any]:
    """Import triton and jit the kernels (once, at the first call)."""
    if "kernels" in _STATE:
        return _STATE["kernels"]
    with _LOCK:
        if "kernels" in _STATE:
            return _STATE["kernels"]
        triton = _import_triton()
        if triton is None:
            raise RuntimeError(f"horovod_aq.torch.triton_kernels is unavailable: "
                               f"{_STATE['reason']}; use horovod_aq.torch.kernels instead")
        from triton import knobs

        g = globals()
        g["tl"] = triton.language
        for name in _HELPERS:
            g[name] = triton.jit(g[name])
        _STATE["interpret"] = bool(knobs.runtime.interpret)   # read by launched
        for name in _KERNELS:
            g[name] = launched(triton.jit(g[name], do_not_specialize=_NO_SPECIALIZE[name]))
        _STATE["kernels"] = {name: g[name] for name in _KERNELS}
    return _STATE["kernels"]


# ------------------------------------------------------------------------------------- host


class _Levels:
    """A level table on one device: ``search`` (L padded with +inf to 2^bits), ``gaps``
    (L[j+1] − L[j]) and ``lookup`` (L padded with NaN to 2^bits), all float32."""

    def __init__(self, table: LevelTable, device) -> None:
        levels = codec.float32_levels(table)  # validates (and flushes subnormal levels)
        size = 1 << table.bits
        search = np.full(size, np.inf, dtype=np.float32)
        search[: levels.size] = levels
        lookup = np.full(size, np.nan, dtype=np.float32)
        lookup[: levels.size] = levels
        gaps = np.zeros(size, dtype=np.float32)
        gaps[: levels.size - 1] = levels[1:] - levels[:-1]
        self.search, self.lookup, self.gaps = (torch.from_numpy(a).to(device)
                                               for a in (search, lookup, gaps))
        self.num_levels = levels.size


def _levels(table: LevelTable, device) -> _Levels:
    key = (table.version, table.hash, table.num_levels, str(device))
    return _TABLES.get(key, lambda: _Levels(table, device))


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _log2(n: int) -> int:
    return int(n).bit_length() - 1


def _wide(n: int) -> bool:
    """Whether int32 offsets could overflow (element, byte, bucket·B and scratch offsets)."""
    return 4 * n + (1 << 22) >= 2**31


def _prepare_device(device: torch.device):
    """The launch context of ``device``; refuses CPU tensors outside the interpreter."""
    _kernels()
    if device.type == "cuda":
        return torch.cuda.device(device)
    if device.type == "cpu" and interpreting():
        return contextlib.nullcontext()
    raise RuntimeError(
        f"the Triton kernels run on CUDA tensors, got a {device.type} tensor (CPU tensors only "
        "under TRITON_INTERPRET=1, for tests); use horovod_aq.torch.kernels on CPU")


def _launch(kernel, grid, *args, **constexprs) -> None:
    kernel[grid](*args, **constexprs, num_warps=NUM_WARPS, enable_fp_fusion=False)


def _bucket_norms(flat: torch.Tensor, norms: torch.Tensor, bucket_size: int, norm: str, *,
                  squares: bool = False) -> None:
    """Fill ``norms`` (float32, ⌈n/B⌉) with the bucket norms of ``flat`` (codec step 2); with
    ``squares`` (l2 only) ``norms`` is float64 and gets each bucket's S_k = Σ float64(x_i)² in
    the canonical pairwise order, before the sqrt."""
    k = _kernels()
    n, nb = flat.numel(), norms.numel()
    l2, wide, block = norm == "l2", _wide(n), NORM_BLOCK
    width = max(2, _next_pow2(min(bucket_size, n)))
    src, from_input = flat, True
    while width > block:  # wide buckets: the first halvings, M rows at a time
        m = min(width // block, block)
        kt = block // m
        dst_width = width // m
        per_bucket = dst_width // kt
        dst = torch.empty(nb * dst_width, dtype=torch.float64 if l2 else torch.float32,
                          device=flat.device)
        _launch(k["_partial_kernel"], (nb * per_bucket,), src, dst, n, bucket_size, width,
                dst_width, per_bucket, M=m, LOG_M=_log2(m), KT=kt, L2=l2, FROM_INPUT=from_input,
                WIDE=wide)
        src, from_input, width = dst, False, dst_width
    rows = max(1, block // width)
    _launch(k["_norm_kernel"], (-(-nb // rows),), src, norms, n, bucket_size, nb, W=width,
            LOG_W=_log2(width), ROWS=rows, L2=l2, FROM_INPUT=from_input, WIDE=wide,
            SQUARES=squares)



def decode_rows_flagged(rows: torch.Tensor, header: codec.Header, table: LevelTable,
                        average: bool, *, head: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 decode of every row, concatenated (``average`` False), or the average of all rows
    of a [P, size] uint8 tensor whose headers are ``header`` — one launch either way — with the
    int32 device flag of one element that stays 0 iff every norm is finite and ≥ 0 and every
    code < N (no host synchronisation) — and, with ``head`` (the expected 32 header bytes on
    the device), every decoded row's header is ``head``; None for no coordinates."""
    n, bits = header.numel, header.bits
    device = rows.device
    P = rows.shape[0]
    with _prepare_device(device):
        out = torch.empty(n if average else P * n, dtype=torch.float32, device=device)
        if n == 0:
            return out, None
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        world = P if average else 1   # rows added in the kernel, or one row per grid row
        codes_at = header.codes_offset
        norms = torch.empty((P, codes_at - HEADER_SIZE), dtype=torch.uint8, device=device)
        norms.copy_(rows[:, HEADER_SIZE:codes_at])  # aligned float32 [P, ⌈n/B⌉]
        norms = norms.view(torch.float32)
        tab = _levels(table, device)
        bucket = header.span  # min(B, n): the same buckets; keeps B in int32
        groups = DECODE_GROUPS
        grid = (-(-n // (8 * groups)), 1 if average else P)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        _launch(_kernels()["_decode_kernel"], grid, rows, rows.stride(0), norms, norms.stride(0),
                tab.lookup, out, flag, rows if head is None else head, n, bucket, _log2(bucket),
                codec.packed_size(n, bits), codes_at, world, float(world), BITS=bits,
                GROUPS=groups, AVERAGE=world > 1, POW2_BUCKET=bucket & (bucket - 1) == 0,
                WIDE=_wide(max(out.numel(), rows.numel())),
                CHECK_NAN=tab.num_levels < (1 << bits),  # a code past the table: NaN
                HEAD=head is not None, HEADER=HEADER_SIZE)
    return out, flag


def _decode_rows(rows: torch.Tensor, header: codec.Header, table: LevelTable,
                 average: bool) -> torch.Tensor:
    """:func:`decode_rows_flagged` of validated rows, refusing bad norms and codes like the
    oracle (one sync)."""
    out, flag = decode_rows_flagged(rows, header, table, average)
    valid = [] if flag is None else [flag[0] == 0]
    host = (lambda: codec.decode_average(rows.cpu().numpy(), table)) if average else (
        lambda: codec.decode(rows[0].cpu().numpy(), table))
    common.check_valid(valid, host)
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
    """Decode one uint8 payload into a flat tensor of ``dtype`` on its device
    (``codec.decode``; validation and errors of ``horovod_aq.torch.kernels.decode``)."""
    table = codec.as_table(levels)
    common.check_payload_tensor(payload, 1)
    _, header = common.checked_headers(payload[None], table, numel, bucket_size, norm, single=True)
    return _decode_rows(payload[None], header, table, average=False).to(dtype)


def decode_average(
    payloads: torch.Tensor,
    levels: LevelTable | Any,
    *,
    dtype: torch.dtype = torch.float32,
    numel: int | None = None,
    bucket_size: int | None = None,
    norm: str | None = None,
) -> torch.Tensor:
    """Average of the decoded rows of a gathered [P, size] uint8 tensor (codec step 7):
    rows divided by P, then added in rank order in float32; ``codec.decode_average`` bit for
    bit. Validation and errors of ``horovod_aq.torch.kernels.decode_average``."""
    table = codec.as_table(levels)
    _, first = common.checked_headers(payloads, table, numel, bucket_size, norm)
    return _decode_rows(payloads, first, table, average=True).to(dtype)
