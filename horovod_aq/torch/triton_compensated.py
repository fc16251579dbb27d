"""ECQ-SGD's fused send on CUDA (Triton): compensate, encode and update the error memory in one
kernel, bit for bit ``codec.reference.encode_compensated`` (docs/dynamic.md §2.6).

For the coordinates i of a part (the bucket, or a two-phase chunk of n coordinates whose first
n_g hold g and h, the rest zero padding), in float32 with α and β rounded to float32::

    x_i  = fl(g_i + fl(α·h_i))            (x_i = g_i without memory, +0.0 in the padding)
    n_k  = the bucket norm of x           (docs/format.md §5 step 2; l2: float64, pairwise)
    code_i, payload                       (§5 steps 3–5, the format's stream §6)
    h'_i = fl(fl(β·h_i) + fl(g_i − n_k·L_{code_i}))       (h'_i = g_i − n_k·L_code: first use)

``_compensated_kernel`` computes x from g and h as it reads them and h' from the code it chose
(the decoder's product n_k·L_code, no decode), with the plain encoder's device helpers
(``triton_kernels._codes``, ``_store_packed``): the same bytes. Where one program holds whole
buckets — a power-of-two span min(B, n) of at most ``LOCAL_MAX`` — it also computes the bucket
norms (of x in registers) and S_k = Σ float64(h'_i)² in the l2 norm's pairwise order: **one
pass**, g and h read once, payload and h' written once. Other bucket shapes take three passes:
x into the output buffer (torch ops: the product, then the sum), the norm kernels of
``triton_kernels`` on it, the fused kernel (which overwrites x with h'), and S_k by the norm
kernels on h'.

Nothing waits for the host while a bucket's parts are encoded (:class:`Send`). Each program
raises two device flags by atomic max — a bucket norm not finite (x holds a NaN/±Inf, or the
norm overflows float32: the bucket cannot travel) and an h'_i not finite — beside the S_k of
every part, in one float64 buffer that :meth:`Send.outcome` copies to the host once: the one
host synchronisation of the send, which the wire's choice between payloads and markers needs
(docs/protocol.md §4). ‖h'‖² (``reference.memory_sum_of_squares``: the S_k added in bucket
order, sequentially) is then added up on the host, bitwise the oracle's. h is never written;
h' goes to a buffer of the caller's, installed only after a successful send.

Checksums (on the host) and the entropy-coded body (``entropy.entropy_of_fixed``) start from the
fixed-width payload, as in ``torch.entropy``. Tested under ``TRITON_INTERPRET=1`` on CPU tensors
(``tests/test_triton_compensated.py``); ``import triton`` happens at the first call.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from horovod_aq import codec
from horovod_aq.codec import HEADER_SIZE, NORM_BYTES, reference
from horovod_aq.codec.reference import Compensated
from horovod_aq.codec.stream import MAX_STREAM_NUMEL, StreamKey
from horovod_aq.levels.table import LevelTable
from horovod_aq.torch import payload as common
from horovod_aq.torch import triton_kernels as tk

__all__ = ["LOCAL_MAX", "Send", "encode_compensated", "finish", "try_encode_compensated"]

#: The widest bucket (a power of two) whose norm one program computes itself (one pass).
LOCAL_MAX = tk.NORM_BLOCK
#: Coordinates of one program: 8·``triton_kernels.ENCODE_GROUPS``, or one whole bucket if wider.
TILE = 8 * tk.ENCODE_GROUPS
#: Warps per ``TILE`` coordinates (wider programs get proportionally more).
WARPS_PER_TILE = tk.NUM_WARPS

tl: Any = None  # triton.language, bound by _kernel()
# triton_kernels' jitted device helpers (the plain encoder's arithmetic), bound by _kernel()
_bucket_of: Any = None
_codes: Any = None
_store_packed: Any = None
_STATE: dict[str, Any] = {}
_LOCK = threading.Lock()
_SHARED = ("_bucket_of", "_codes", "_store_packed")


def _pairwise_rows(q, ROWS: tl.constexpr, W: tl.constexpr, LOG_W: tl.constexpr):
    """The canonical pairwise sum of each row of a [ROWS, W] float64 tensor: q_k += q_{k+W/2},
    W halving (docs/format.md §5 step 2)."""
    for k in tl.static_range(LOG_W):
        q = tl.sum(tl.reshape(q, (ROWS, 2, W >> (k + 1))), axis=1)
    return tl.reshape(q, (ROWS,))


def _compensated_kernel(g_ptr, h_ptr, norms_ptr, lev_ptr, gap_ptr, codes_ptr, out_ptr, sq_ptr,
                        status_ptr, first_ptr, base, n, n_g, bucket_size, log_bucket,
                        num_buckets, nlev, nbytes, alpha, beta, k0, k1, c1, c2, c3,
                        BITS: tl.constexpr, GROUPS: tl.constexpr, ROWS: tl.constexpr,
                        W: tl.constexpr, LOG_W: tl.constexpr, LOCAL: tl.constexpr,
                        L2: tl.constexpr, HAS_H: tl.constexpr, POW2_BUCKET: tl.constexpr,
                        WIDE: tl.constexpr, NEVER: tl.constexpr):
    """x = g + α·h, its codes (packed) and h' = β·h + (g − n_k·L_code) of 8·GROUPS coordinates
    (module docstring). LOCAL: the program holds ROWS whole buckets of W coordinates and writes
    their norms and S_k; otherwise it reads the norms. status[0], status[1] ← 1 where a norm,
    an h'_i is not finite; first[0], first[1] ← the least base + i of a g_i, an x_i not finite
    (atomic minima: ``packed.send`` step 2's elements, bucket order)."""
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    first = pid * (GROUPS * 8)
    ctr = tl.arange(0, 2 * GROUPS)  # Philox counters of this block: 4 coordinates each
    word = tl.arange(0, 4)
    i = first + ctr[:, None] * 4 + word[None, :]
    live = i < n
    real = i < n_g  # g and h; the rest of the part is zero padding
    g = tl.load(g_ptr + i, mask=real, other=0.0)
    if HAS_H:
        h = tl.load(h_ptr + i, mask=real, other=0.0)
        x = g + alpha * h
    else:
        x = g
    at = base + i.to(tl.int64)
    g_at = tl.min(tl.where(real & ~(tl.abs(g) < float("inf")), at, NEVER))
    tl.atomic_min(first_ptr, g_at, mask=g_at < NEVER)
    x_at = tl.min(tl.where(real & ~(tl.abs(x) < float("inf")), at, NEVER))
    tl.atomic_min(first_ptr + 1, x_at, mask=x_at < NEVER)
    if LOCAL:
        rows = pid * ROWS + tl.arange(0, ROWS)
        xr = tl.reshape(x, (ROWS, W))
        if L2:
            q = xr.to(tl.float64)
            nrm_rows = tl.sqrt(_pairwise_rows(q * q, ROWS, W, LOG_W)).to(tl.float32)
        else:  # NaN → +inf, so that the norm says the bucket cannot travel
            nrm_rows = tl.max(tl.where(xr == xr, tl.abs(xr), float("inf")), axis=1)
        held = rows < num_buckets
        tl.store(norms_ptr + rows, nrm_rows, mask=held)
        bad = tl.max(tl.where(held & (tl.abs(nrm_rows) < float("inf")), 0, tl.where(held, 1, 0)))
        nrm = tl.reshape(tl.broadcast_to(nrm_rows[:, None], (ROWS, W)), (2 * GROUPS, 4))
    else:
        nrm = tl.load(norms_ptr + _bucket_of(i, bucket_size, log_bucket, POW2_BUCKET),
                      mask=live, other=1.0)
        bad = tl.max(tl.where(live & (tl.abs(nrm) < float("inf")), 0, tl.where(live, 1, 0)))
    tl.atomic_max(status_ptr, bad, mask=bad > 0)
    code = _codes(x, nrm, live, first, ctr, word, lev_ptr, gap_ptr, nlev, k0, k1, c1, c2, c3,
                  BITS)
    _store_packed(code, codes_ptr, first, nbytes, BITS, GROUPS)
    g_hat = nrm * tl.load(lev_ptr + code)  # the decoder's n_k·L_code (format.md §5 step 6)
    if HAS_H:
        hp = beta * h + (g - g_hat)
    else:
        hp = g - g_hat
    tl.store(out_ptr + i, hp, mask=real)
    lost = tl.max(tl.where(real & (tl.abs(hp) < float("inf")), 0, tl.where(real, 1, 0)))
    tl.atomic_max(status_ptr + 1, lost, mask=lost > 0)
    if LOCAL:
        q = tl.reshape(tl.where(real, hp, 0.0).to(tl.float64), (ROWS, W))
        tl.store(sq_ptr + rows, _pairwise_rows(q * q, ROWS, W, LOG_W), mask=held)


#: What ``first`` holds where no element is bad (above every element index).
NEVER = 2**62

#: Runtime scalars that must not be specialized (one compiled variant per set of constexprs).
_NO_SPECIALIZE = ["base", "n", "n_g", "bucket_size", "log_bucket", "num_buckets", "nlev", "nbytes",
                  "k0", "k1", "c1", "c2", "c3"]


def _kernel():
    """Jit the kernel (once, at the first call) beside ``triton_kernels``' helpers."""
    if "kernel" in _STATE:
        return _STATE["kernel"]
    with _LOCK:
        if "kernel" not in _STATE:
            tk._kernels()  # imports triton (or raises) and jits the shared helpers
            import triton

            g = globals()
            g["tl"] = triton.language
            for name in _SHARED:
                g[name] = getattr(tk, name)
            g["_pairwise_rows"] = triton.jit(_pairwise_rows)
            _STATE["kernel"] = triton.jit(_compensated_kernel, do_not_specialize=_NO_SPECIALIZE)
    return _STATE["kernel"]


def local_width(span: int) -> int | None:
    """W = ``span`` when one program can hold whole buckets of it (a power of two in
    [2, LOCAL_MAX]: the one-pass kernel), else None (three passes)."""
    return span if 2 <= span <= LOCAL_MAX and span & (span - 1) == 0 else None


# ------------------------------------------------------------------------------------- host


def _flat(t: torch.Tensor, name: str, numel: int, device) -> torch.Tensor:
    if (not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != numel
            or t.device != device):
        raise ValueError(f"{name} must be a float32 tensor of {numel} values on {device}, got "
                         f"{getattr(t, 'dtype', type(t))} of shape "
                         f"{tuple(getattr(t, 'shape', ()))}")
    return t.detach().reshape(-1)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a.numel() > 0 and b.numel() > 0 and a0 < b0 + 4 * b.numel() and b0 < a0 + 4 * a.numel()


class Send:
    """The fused send of one bucket's parts (allgather: one; two-phase: the P chunks), launched
    without a host sync; :meth:`outcome` reads every part's flags and S_k at once.

    Args:
        table, bucket_size, norm: the quantizer's (``codec.encode``).
        alpha, beta: α, β (rounded to float32).
        sizes: coordinates of each part's payload, in part order.
        device: where g, h and h' live (CUDA; CPU under ``TRITON_INTERPRET=1``).
    """

    def __init__(self, table: LevelTable | Any, *, bucket_size: int, norm: str, alpha: float,
                 beta: float, sizes: Sequence[int], device: Any) -> None:
        self.table = codec.as_table(table)
        self.bucket_size = codec.check_bucket_size(bucket_size)
        self.norm = codec.check_norm(norm)
        self.alpha, self.beta = float(np.float32(alpha)), float(np.float32(beta))
        self.sizes = [int(s) for s in sizes]
        if any(s > MAX_STREAM_NUMEL for s in self.sizes):
            raise ValueError(f"the random stream indexes at most {MAX_STREAM_NUMEL} coordinates, "
                             f"got {max(self.sizes)}")
        self.buckets = [codec.num_buckets(s, self.bucket_size) for s in self.sizes]
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        total = sum(self.buckets)
        with tk._prepare_device(device):
            self._levels = tk._levels(self.table, device)
            #: S_k of every part's buckets, two int32 flags (bad norm, h' not finite), then the
            #: first bad g_i and x_i of the bucket (int64, ``NEVER`` where none): one buffer,
            #: copied to the host at once (:meth:`outcome`, or with others: :attr:`result`).
            self._result = torch.empty(total + 3, dtype=torch.float64, device=device)
            self._result[total:total + 1].zero_()
            self._first = self._result[total + 1:].view(torch.int64)
            self._first.fill_(NEVER)
        self._status = self._result[total:total + 1].view(torch.int32)
        self._parts = 0

    def encode(self, g: torch.Tensor, h: torch.Tensor | None, out: torch.Tensor,
               key: StreamKey) -> torch.Tensor:
        """Launch the next part: x = g + α·h (g, h: its n_g ≤ n real coordinates, float32, flat
        and contiguous on the device; h None: first use) zero-padded to the part's n, encoded
        with ``key``; h' into ``out`` (n_g float32, not overlapping h). Returns the fixed-width
        payload (valid only if :meth:`outcome` says the bucket travels)."""
        k = self._parts
        if k >= len(self.sizes):
            raise ValueError(f"this send has {len(self.sizes)} parts")
        if not isinstance(key, StreamKey):
            raise TypeError(f"key must be a horovod_aq.codec.stream.StreamKey, got {key!r}")
        n, nb, B, device = self.sizes[k], self.buckets[k], self.bucket_size, self.device
        n_g = g.numel()
        if n_g > n:
            raise ValueError(f"part {k} has {n} coordinates, g has {n_g}")
        g = _flat(g, "g", n_g, device)
        h = None if h is None else _flat(h, "h", n_g, device)
        out = _flat(out, "memory_out", n_g, device)
        if not (g.is_contiguous() and out.is_contiguous() and (h is None or h.is_contiguous())):
            raise ValueError("g, h and memory_out must be contiguous")
        if h is not None and _overlap(out, h):
            raise ValueError("memory_out must not overlap h (h is kept until the send succeeded)")
        self._parts += 1
        table, bits = self.table, self.table.bits
        start = sum(self.buckets[:k])
        squares = self._result[start:start + nb]
        with tk._prepare_device(device):
            payload = torch.empty(codec.payload_size(n, bits, B), dtype=torch.uint8,
                                  device=device)
            payload[:HEADER_SIZE] = common.header_tensor(n, table, B, self.norm, device)
            if n == 0:
                return payload
            codes_at = HEADER_SIZE + NORM_BYTES * nb
            norms = payload[HEADER_SIZE:codes_at].view(torch.float32)
            span = min(B, n)  # the same buckets; keeps B in int32
            width = local_width(span)
            if width is None:  # x into out, then its norms (three passes)
                if n_g == 0:
                    norms.zero_()
                else:
                    x = g if h is None else torch.mul(h, self.alpha, out=out).add_(g)
                    tk._bucket_norms(x, norms, span, self.norm)
            tile = max(TILE, width or 0)
            k0, k1, c1, c2, c3 = (v - 2**32 if v >= 2**31 else v for v in key.scalars())
            tab = self._levels
            _kernel()[(-(-n // tile),)](
                g, g if h is None else h, norms, tab.search, tab.gaps, payload[codes_at:], out,
                squares, self._status, self._first, sum(self.sizes[:k]), n, n_g, span,
                tk._log2(span), nb, tab.num_levels,
                codec.packed_size(n, bits), self.alpha, self.beta, k0, k1, c1, c2, c3,
                BITS=bits, GROUPS=tile // 8, ROWS=tile // (width or tile), W=width or tile,
                LOG_W=tk._log2(width or tile), LOCAL=width is not None, L2=self.norm == "l2",
                HAS_H=h is not None, POW2_BUCKET=span & (span - 1) == 0, WIDE=tk._wide(n),
                NEVER=NEVER,
                num_warps=WARPS_PER_TILE * tile // TILE, enable_fp_fusion=False)
            if width is None:  # S_k of h' (the padding of a chunk holds no h')
                if n_g == 0:
                    squares.zero_()
                else:
                    tk._bucket_norms(out, squares, span, "l2", squares=True)
        return payload

    def outcome(self) -> tuple[bool, float] | None:
        """None when a bucket of some part cannot travel; else (whether every h'_i is finite,
        ‖h'‖²: each part's S_k added in bucket order — ``reference.memory_sum_of_squares`` of
        its h' — then the parts' in part order). The send's one device→host copy."""
        return self.outcome_of(self._result.cpu().numpy())

    @property
    def result(self) -> torch.Tensor:
        """The float64 device buffer that :meth:`outcome_of` reads (to copy with others)."""
        if self._parts != len(self.sizes):
            raise RuntimeError(f"{self._parts} of {len(self.sizes)} parts were encoded")
        return self._result

    def outcome_of(self, host: np.ndarray) -> tuple[bool, float] | None:
        """:meth:`outcome` from a host copy of :attr:`result`."""
        if self._parts != len(self.sizes):
            raise RuntimeError(f"{self._parts} of {len(self.sizes)} parts were encoded")
        total = sum(self.buckets)
        bad, lost = host[total:total + 1].view(np.int32)
        if bad:
            return None
        squares, start = 0.0, 0
        for nb in self.buckets:
            if nb:
                squares += float(np.cumsum(host[start:start + nb])[-1])
            start += nb
        return not lost, squares

    def first_bad(self, payloads: Sequence[torch.Tensor]) -> torch.Tensor:
        """``packed.send`` step 2 on the device, from this send's atomic minima and the norms
        in ``payloads`` (its parts' fixed-width payloads): the first NaN/±Inf of g, else of
        x = g + α·h, else the first element of the first bucket whose norm is not finite; −1
        where the bucket travels. A 0-dim int64 tensor; nothing is read on the host."""
        from horovod_aq.torch import markers

        norms = markers.payload_norms(payloads, self.sizes, self.bucket_size)
        g_at, x_at = self._first[0], self._first[1]
        return torch.where(g_at < NEVER, g_at, torch.where(
            x_at < NEVER, x_at, markers.first_unsendable(norms, self.bucket_size)))


def finish(payload: torch.Tensor, table: LevelTable, numel: int, bucket_size: int, *,
           coding: str = "fixed", checksum: bool = False) -> torch.Tensor:
    """The payload that travels, from a part's fixed-width ``payload`` of ``numel``
    coordinates: itself, or ``codec.encode_entropy``'s of the same codes (``coding`` "entropy");
    sealed with its CRC-32 on the host when ``checksum``."""
    if coding == "entropy":
        from horovod_aq.torch.entropy import entropy_of_fixed

        return entropy_of_fixed(payload, table, numel, bucket_size, checksum=checksum)
    if coding != "fixed":
        raise ValueError(f"coding must be 'fixed' or 'entropy', got {coding!r}")
    return common.seal_checksum(payload) if checksum else payload


def try_encode_compensated(g: torch.Tensor, h: torch.Tensor | None, alpha: float, beta: float,
                           levels: LevelTable | Any, *, bucket_size: int, norm: str = "l2",
                           key: StreamKey, numel: int | None = None, coding: str = "fixed",
                           checksum: bool = False,
                           memory_out: torch.Tensor | None = None) -> Compensated | None:
    """``codec.encode_compensated(g, h, alpha, beta, levels, bucket_size=, norm=, numel=,
    key=key, checksum=, coding=)`` bit for bit on g's device — payload and h' as tensors, h'
    in ``memory_out`` (allocated if None) — or None when a bucket of x holds a NaN/±Inf or
    has a norm beyond float32 (h untouched). One part of a :class:`Send`."""
    checksum = codec.check_bool("checksum", checksum)
    if coding not in ("fixed", "entropy"):
        raise ValueError(f"coding must be 'fixed' or 'entropy', got {coding!r}")
    flat = common.as_float32_flat(g)
    n = flat.numel() if numel is None else int(numel)
    if n < flat.numel():
        raise ValueError(f"numel must be at least the {flat.numel()} coordinates of g, got {n}")
    hf = None if h is None else common.as_float32_flat(h)
    out = torch.empty_like(flat) if memory_out is None else memory_out
    send = Send(levels, bucket_size=bucket_size, norm=norm, alpha=alpha, beta=beta, sizes=[n],
                device=flat.device)
    payload = send.encode(flat, hf, out, key)
    found = send.outcome()
    if found is None:
        return None
    payload = finish(payload, send.table, n, send.bucket_size, coding=coding, checksum=checksum)
    return Compensated(payload, out, *found)


def encode_compensated(g: torch.Tensor, h: torch.Tensor | None, alpha: float, beta: float,
                       levels: LevelTable | Any, *, bucket_size: int, norm: str = "l2",
                       key: StreamKey, numel: int | None = None, coding: str = "fixed",
                       checksum: bool = False,
                       memory_out: torch.Tensor | None = None) -> Compensated:
    """:func:`try_encode_compensated`, raising the oracle's error (from host copies) where x
    cannot be encoded."""
    found = try_encode_compensated(g, h, alpha, beta, levels, bucket_size=bucket_size, norm=norm,
                                   key=key, numel=numel, coding=coding, checksum=checksum,
                                   memory_out=memory_out)
    if found is None:
        host_g = common.as_float32_flat(g).cpu().numpy()
        n = host_g.size if numel is None else int(numel)
        reference.encode_compensated(  # raises the oracle's error
            host_g, None if h is None else common.as_float32_flat(h).cpu().numpy(), alpha, beta,
            levels, bucket_size=bucket_size, norm=norm, numel=n, uniforms=np.zeros(n, np.float32))
        raise RuntimeError("horovod_aq.torch.triton_compensated: the kernel refused input that "
                           "the reference codec accepts (please report this bug)")
    return found
