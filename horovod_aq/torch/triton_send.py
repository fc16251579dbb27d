"""The one-pass send on CUDA (Triton): compensate, encode and update the error memory in one
kernel, bit for bit ``codec.reference.encode_compensated`` (docs/dynamic.md §2.6) — or, without
memory, the plain encode, bit for bit ``codec.encode`` (:func:`encode`).

For the coordinates i of a part (the bucket, or a two-phase chunk of n coordinates whose first
n_g hold g and h, the rest zero padding), in float32 with α and β rounded to float32::

    x_i  = fl(g_i + fl(α·h_i))            (x_i = g_i without memory, +0.0 in the padding)
    n_k  = the bucket norm of x           (docs/format.md §5 step 2; l2: float64, pairwise)
    code_i, payload                       (§5 steps 3–5, the format's stream §6)
    h'_i = fl(fl(β·h_i) + fl(g_i − n_k·L_{code_i}))       (h'_i = g_i − n_k·L_code: first use)

``_send_kernel`` computes x from g and h as it reads them and h' from the code it chose
(the decoder's product n_k·L_code, no decode), with the plain encoder's device helpers
(``triton_kernels._codes``, ``_store_packed``): the same bytes. Where one program holds whole
buckets — a power-of-two span min(B, n) of at most ``LOCAL_MAX`` — it also computes the bucket
norms (of x in registers) and S_k = Σ float64(h'_i)² in the l2 norm's pairwise order: **one
pass**, g and h read once, payload and h' written once. Other bucket shapes take three passes:
x into the output buffer (torch ops: the product, then the sum), the norm kernels of
``triton_kernels`` on it, the send kernel (which overwrites x with h'), and S_k by the norm
kernels on h' (without memory: the norm kernels on g, then the send kernel).

Nothing waits for the host while a bucket's parts are encoded (:class:`Send`). Each program
raises two device flags by atomic max — a bucket norm not finite (x holds a NaN/±Inf, or the
norm overflows float32: the bucket cannot travel) and an h'_i not finite — and keeps three
atomic minima: the first non-finite g_i, x_i, and the first element of a bucket whose norm is
not finite. They lie beside the S_k of every part, in one float64 buffer that
:meth:`Send.outcome` copies to the host once: the one host synchronisation of the send, where
the wire's choice between payloads and markers is made on the host (docs/protocol.md §4).
‖h'‖² (``reference.memory_sum_of_squares``: the S_k added in bucket order, sequentially) is
then added up on the host, bitwise the oracle's. Or :meth:`Send.decide` makes that choice on
the device: ``_marker_kernel``, one launch over the buffer that holds every part's payload,
writes the marker naming the first of the three minima over each payload, in place, where
there is one. h is never written; h' goes to a buffer of the caller's, installed only after a
successful send.

Without memory (``Send(memory=False)``) the same kernel is the plain encode, x = g (float16,
bfloat16 or float32), with no h', S_k or h' flag: :func:`encode` and the torch wire's
sends without error feedback run it, so an encode whose buckets one program holds reads g once.

Checksums (on the host) and the entropy-coded body (``triton_compensated.finish``,
``entropy.entropy_of_fixed``) start from the fixed-width payload. Tested under
``TRITON_INTERPRET=1`` on CPU tensors (``tests/test_triton_compensated.py``,
``tests/test_triton_kernels.py``); ``import triton`` happens at the first call.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from horovod_aq import codec
from horovod_aq.codec import HEADER_SIZE, MARKER_INDEX_OFFSET, NORM_BYTES
from horovod_aq.codec.stream import MAX_STREAM_NUMEL, StreamKey
from horovod_aq.levels.table import LevelTable
from horovod_aq.packed.marker import MAX_MARKER_INDEX
from horovod_aq.torch import payload as common
from horovod_aq.torch import triton_kernels as tk

__all__ = ["LOCAL_MAX", "Send", "encode"]

#: The widest bucket (a power of two) whose norm one program computes itself (one pass).
LOCAL_MAX = tk.NORM_BLOCK
#: Coordinates of one program: 8·``triton_kernels.ENCODE_GROUPS``, or one whole bucket if wider.
TILE = 8 * tk.ENCODE_GROUPS
#: Warps per ``TILE`` coordinates (wider programs get proportionally more).
WARPS_PER_TILE = tk.NUM_WARPS

tl: Any = None  # triton.language, bound by _kernels()
# triton_kernels' jitted device helpers (the plain encoder's arithmetic), bound by _kernels()
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


def _send_kernel(g_ptr, h_ptr, norms_ptr, lev_ptr, gap_ptr, codes_ptr, out_ptr, sq_ptr,
                        status_ptr, first_ptr, base, n, n_g, bucket_size, log_bucket,
                        num_buckets, nlev, nbytes, alpha, beta, k0, k1, c1, c2, c3,
                        BITS: tl.constexpr, GROUPS: tl.constexpr, ROWS: tl.constexpr,
                        W: tl.constexpr, LOG_W: tl.constexpr, LOCAL: tl.constexpr,
                        L2: tl.constexpr, HAS_H: tl.constexpr, POW2_BUCKET: tl.constexpr,
                        WIDE: tl.constexpr, NEVER: tl.constexpr, MEMORY: tl.constexpr):
    """x = g + α·h, its codes (packed) and h' = β·h + (g − n_k·L_code) of 8·GROUPS coordinates
    (module docstring; without MEMORY no h', S_k or its flag: the plain encode). LOCAL: the
    program holds ROWS whole buckets of W coordinates and writes their norms and S_k; otherwise
    it reads the norms. status[0], status[1] ← 1 where a norm, an h'_i is not finite; first[0],
    first[1], first[2] ← the least base + i of a g_i, an x_i not finite, the least base + k·B
    of a bucket k whose norm is not finite (atomic minima: ``packed.send`` step 2's elements,
    bucket order)."""
    pid = tl.program_id(0)
    if WIDE:
        pid = pid.to(tl.int64)
    first = pid * (GROUPS * 8)
    ctr = tl.arange(0, 2 * GROUPS)  # Philox counters of this block: 4 coordinates each
    word = tl.arange(0, 4)
    i = first + ctr[:, None] * 4 + word[None, :]
    live = i < n
    real = i < n_g  # g and h; the rest of the part is zero padding
    g = tl.load(g_ptr + i, mask=real, other=0.0).to(tl.float32)   # fp16/bf16: the plain encode
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
        unsendable = held & ~(tl.abs(nrm_rows) < float("inf"))
        k_at = tl.min(tl.where(unsendable, base + rows.to(tl.int64) * W, NEVER))
        nrm = tl.reshape(tl.broadcast_to(nrm_rows[:, None], (ROWS, W)), (2 * GROUPS, 4))
    else:
        bucket = _bucket_of(i, bucket_size, log_bucket, POW2_BUCKET)
        nrm = tl.load(norms_ptr + bucket, mask=live, other=1.0)
        unsendable = live & ~(tl.abs(nrm) < float("inf"))
        k_at = tl.min(tl.where(unsendable, base + bucket.to(tl.int64) * bucket_size, NEVER))
    tl.atomic_max(status_ptr, 1, mask=k_at < NEVER)
    tl.atomic_min(first_ptr + 2, k_at, mask=k_at < NEVER)
    code = _codes(x, nrm, live, first, ctr, word, lev_ptr, gap_ptr, nlev, k0, k1, c1, c2, c3,
                  BITS)
    _store_packed(code, codes_ptr, first, nbytes, BITS, GROUPS)
    if MEMORY:
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


def _marker_kernel(pay_ptr, first_ptr, head_ptr, size, stride, total, offset,
                   NEVER: tl.constexpr, MAX_INDEX: tl.constexpr, HEADER: tl.constexpr,
                   INDEX_AT: tl.constexpr, BLOCK: tl.constexpr):
    """Byte p < ``size`` of each part's payload (one every ``stride`` bytes, ``total`` in all)
    ← the marker's where bad < NEVER: the marker header (``head``, naming element 0) with the
    index field min(offset + bad, MAX_INDEX) written little-endian, then zeros. bad = first[0],
    else first[1], else first[2]: the first below NEVER (:meth:`Send.decide`)."""
    f0 = tl.load(first_ptr)
    f1 = tl.load(first_ptr + 1)
    f2 = tl.load(first_ptr + 2)
    bad = tl.where(f0 < NEVER, f0, tl.where(f1 < NEVER, f1, f2))
    index = tl.minimum(bad + offset, MAX_INDEX)
    b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    p = b % stride
    in_field = (p >= INDEX_AT) & (p < INDEX_AT + 4)
    shift = tl.where(in_field, (p - INDEX_AT) * 8, 0)
    field = (index >> shift) & 0xFF
    head = tl.load(head_ptr + p, mask=p < HEADER, other=0)
    byte = tl.where(in_field, field.to(tl.uint8), head)
    refused = tl.zeros_like(b) + bad < NEVER   # a block: the interpreter takes no 0-d mask
    tl.store(pay_ptr + b, byte, mask=(b < total) & (p < size) & refused)


#: What ``first`` holds where no element is bad (above every element index).
NEVER = 2**62

#: Runtime scalars that must not be specialized (one compiled variant per set of constexprs).
_NO_SPECIALIZE = ["base", "n", "n_g", "bucket_size", "log_bucket", "num_buckets", "nlev", "nbytes",
                  "k0", "k1", "c1", "c2", "c3"]


#: Bytes of one program of the marker kernel.
MARKER_BLOCK = 4096
#: Where a send's parts start in its payload buffer: multiples of these bytes.
PART_ALIGN = 16


def _kernels() -> dict[str, Any]:
    """Jit the kernels (once, at the first call) beside ``triton_kernels``' helpers."""
    if "kernels" in _STATE:
        return _STATE["kernels"]
    with _LOCK:
        if "kernels" not in _STATE:
            tk._kernels()  # imports triton (or raises) and jits the shared helpers
            import triton

            g = globals()
            g["tl"] = triton.language
            for name in _SHARED:
                g[name] = getattr(tk, name)
            g["_pairwise_rows"] = triton.jit(_pairwise_rows)
            _STATE["kernels"] = {
                "send": tk.launched(triton.jit(_send_kernel, do_not_specialize=_NO_SPECIALIZE)),
                "markers": tk.launched(triton.jit(
                    _marker_kernel, do_not_specialize=["size", "stride", "total", "offset"]))}
    return _STATE["kernels"]


def _tail(device) -> torch.Tensor:
    """The initial status and minima of a send's result buffer (int64: the two int32 flags
    zero, first[0..2] = ``NEVER``), cached on the device: one copy per send."""
    return _TAILS.get(("tail", str(device)), lambda: torch.tensor(
        [0, NEVER, NEVER, NEVER], dtype=torch.int64).to(device))


_TAILS = common.DeviceCache(4)


def local_width(span: int) -> int | None:
    """W = ``span`` when one program can hold whole buckets of it (a power of two in
    [2, LOCAL_MAX]: the one-pass kernel), else None (three passes)."""
    return span if 2 <= span <= LOCAL_MAX and span & (span - 1) == 0 else None


# ------------------------------------------------------------------------------------- host

#: The dtypes the plain encode takes (float64 is cast first; the kernel casts the others).
_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _flat_input(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype == torch.float64:
        return x.detach().reshape(-1).to(torch.float32).contiguous()  # rounds to nearest
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"expected a floating-point gradient, got dtype {x.dtype}")
    return x.detach().reshape(-1).contiguous()  # fp16/bf16 are cast inside the kernels


def _output(out: torch.Tensor | None, size: int, device) -> torch.Tensor:
    if out is None:
        return torch.empty(size, dtype=torch.uint8, device=device)
    if (not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 1
            or out.numel() != size or out.device != device or not out.is_contiguous()):
        raise ValueError(
            f"out must be a contiguous 1-D uint8 tensor of {size} bytes on {device}, got "
            f"{getattr(out, 'dtype', type(out))} of shape {tuple(getattr(out, 'shape', ()))}")
    return out


def _flat(t: torch.Tensor, name: str, numel: int, device,
          dtypes: tuple = (torch.float32,)) -> torch.Tensor:
    if (not isinstance(t, torch.Tensor) or t.dtype not in dtypes or t.numel() != numel
            or t.device != device):
        kinds = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} must be a {kinds} tensor of {numel} values on {device}, got "
                         f"{getattr(t, 'dtype', type(t))} of shape "
                         f"{tuple(getattr(t, 'shape', ()))}")
    return t.detach().reshape(-1)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a.numel() > 0 and b.numel() > 0 and a0 < b0 + 4 * b.numel() and b0 < a0 + 4 * a.numel()


class Send:
    """The fused send of one bucket's parts (allgather: one; two-phase: the P chunks), launched
    without a host sync; :meth:`outcome` reads every part's flags and S_k at once, or
    :meth:`decide` puts markers in place of the payloads on the device.

    Args:
        table, bucket_size, norm: the quantizer's (``codec.encode``).
        alpha, beta: α, β (rounded to float32).
        sizes: coordinates of each part's payload, in part order.
        device: where g, h and h' live (CUDA; CPU under ``TRITON_INTERPRET=1``).
        memory: False for a send without error memory (x = g, no h' and no S_k: the plain
            encode in the same pass, for :meth:`decide`).
    """

    def __init__(self, table: LevelTable | Any, *, bucket_size: int, norm: str, alpha: float,
                 beta: float, sizes: Sequence[int], device: Any, memory: bool = True) -> None:
        self.table = codec.as_table(table)
        self.bucket_size = codec.check_bucket_size(bucket_size)
        self.norm = codec.check_norm(norm)
        self.alpha, self.beta = float(np.float32(alpha)), float(np.float32(beta))
        self.sizes = [int(s) for s in sizes]
        self.memory = bool(memory)
        if any(s > MAX_STREAM_NUMEL for s in self.sizes):
            raise ValueError(f"the random stream indexes at most {MAX_STREAM_NUMEL} coordinates, "
                             f"got {max(self.sizes)}")
        self.buckets = [codec.num_buckets(s, self.bucket_size) for s in self.sizes]
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        total = sum(self.buckets) if self.memory else 0
        #: Each part's payload size, and where it starts in the one buffer of them all (at
        #: multiples of ``PART_ALIGN`` bytes, so that its norms are aligned float32).
        self._bytes = [codec.payload_size(s, self.table.bits, self.bucket_size)
                       for s in self.sizes]
        self._starts = np.concatenate([[0], np.cumsum(
            [-(-b // PART_ALIGN) * PART_ALIGN for b in self._bytes])]).astype(int).tolist()
        with tk._prepare_device(device):
            self._levels = tk._levels(self.table, device)
            self._payloads = torch.empty(self._starts[-1], dtype=torch.uint8, device=device)
            #: S_k of every part's buckets (with memory), two int32 flags (bad norm, h' not
            #: finite), then first[0..2] (int64, ``NEVER`` where none): the first bad g_i,
            #: x_i, and bucket start of the send (:meth:`decide`). One buffer, copied to the
            #: host at once (:meth:`outcome`, or with others: :attr:`result`).
            self._result = torch.empty(total + 4, dtype=torch.float64, device=device)
            self._result[total:].view(torch.int64).copy_(_tail(device))
        self._status = self._result[total:total + 1].view(torch.int32)
        self._first = self._result[total + 1:].view(torch.int64)
        self._parts = 0

    def encode(self, g: torch.Tensor, h: torch.Tensor | None, out: torch.Tensor | None,
               key: StreamKey) -> torch.Tensor:
        """Launch the next part: x = g + α·h (g, h: its n_g ≤ n real coordinates, float32 — g
        also float16/bfloat16 without memory —, flat and contiguous on the device; h None:
        first use) zero-padded to the part's n, encoded
        with ``key``; h' into ``out`` (n_g float32, not overlapping h; None without memory).
        Returns the fixed-width payload (valid only if :meth:`outcome` says the bucket
        travels, or after :meth:`decide`)."""
        k = self._parts
        if k >= len(self.sizes):
            raise ValueError(f"this send has {len(self.sizes)} parts")
        if not isinstance(key, StreamKey):
            raise TypeError(f"key must be a horovod_aq.codec.stream.StreamKey, got {key!r}")
        n, nb, B, device = self.sizes[k], self.buckets[k], self.bucket_size, self.device
        n_g = g.numel()
        if n_g > n:
            raise ValueError(f"part {k} has {n} coordinates, g has {n_g}")
        if not self.memory and (h is not None or out is not None):
            raise ValueError("a send without memory takes neither h nor memory_out")
        g = _flat(g, "g", n_g, device, (torch.float32,) if self.memory else _INPUT_DTYPES)
        h = None if h is None else _flat(h, "h", n_g, device)
        if self.memory:
            out = _flat(out, "memory_out", n_g, device)
        if not (g.is_contiguous() and (out is None or out.is_contiguous())
                and (h is None or h.is_contiguous())):
            raise ValueError("g, h and memory_out must be contiguous")
        if h is not None and _overlap(out, h):
            raise ValueError("memory_out must not overlap h (h is kept until the send succeeded)")
        self._parts += 1
        table, bits = self.table, self.table.bits
        start = sum(self.buckets[:k])
        squares = self._result[start:start + nb] if self.memory else self._result[:0]
        payload = self._payload(k)
        with tk._prepare_device(device):
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
            _kernels()["send"][(-(-n // tile),)](
                g, g if h is None else h, norms, tab.search, tab.gaps, payload[codes_at:],
                g if out is None else out, squares, self._status, self._first,
                sum(self.sizes[:k]), n, n_g, span, tk._log2(span), nb, tab.num_levels,
                codec.packed_size(n, bits), self.alpha, self.beta, k0, k1, c1, c2, c3,
                BITS=bits, GROUPS=tile // 8, ROWS=tile // (width or tile), W=width or tile,
                LOG_W=tk._log2(width or tile), LOCAL=width is not None, L2=self.norm == "l2",
                HAS_H=h is not None, POW2_BUCKET=span & (span - 1) == 0, WIDE=tk._wide(n),
                NEVER=NEVER, MEMORY=self.memory,
                num_warps=WARPS_PER_TILE * tile // TILE, enable_fp_fusion=False)
            if width is None and self.memory:  # S_k of h' (the padding of a chunk holds no h')
                if n_g == 0:
                    squares.zero_()
                else:
                    tk._bucket_norms(out, squares, span, "l2", squares=True)
        return payload

    def _payload(self, k: int) -> torch.Tensor:
        """Part k's payload: its bytes of the one buffer."""
        return self._payloads[self._starts[k]:self._starts[k] + self._bytes[k]]

    def outcome(self) -> tuple[bool, float] | None:
        """None when a bucket of some part cannot travel; else (whether every h'_i is finite,
        ‖h'‖²: each part's S_k added in bucket order — ``reference.memory_sum_of_squares`` of
        its h' — then the parts' in part order). The send's one device→host copy."""
        return self.outcome_of(self._result.cpu().numpy())

    @property
    def result(self) -> torch.Tensor:
        """The float64 device buffer that :meth:`outcome_of` reads (to copy with others)."""
        self._check_encoded()
        return self._result

    def _check_encoded(self) -> None:
        if self._parts != len(self.sizes):
            raise RuntimeError(f"{self._parts} of {len(self.sizes)} parts were encoded")

    def outcome_of(self, host: np.ndarray) -> tuple[bool, float] | None:
        """:meth:`outcome` from a host copy of :attr:`result`."""
        self._check_encoded()
        total = sum(self.buckets) if self.memory else 0
        bad, lost = host[total:total + 1].view(np.int32)
        if bad:
            return None
        squares, start = 0.0, 0
        for nb in self.buckets if self.memory else ():
            if nb:
                squares += float(np.cumsum(host[start:start + nb])[-1])
            start += nb
        return not lost, squares

    def first_bad_of(self, host: np.ndarray) -> int | None:
        """The element :meth:`decide` names (without its offset), from a host copy of
        :attr:`result`: the first bad g_i, else x_i, else the first element of the first bucket
        whose norm is not finite; None where every element travels."""
        first = host[-3:].view(np.int64)
        return next((int(f) for f in first if f < NEVER), None)

    def refuse(self, flag: torch.Tensor) -> None:
        """Where the 0-dim bool device tensor ``flag`` is True, :meth:`decide` names element 0
        of the send whatever x holds (two-phase's averaged chunk of rows that were not plain,
        docs/protocol.md §5.8)."""
        self._first[:1].masked_fill_(flag, 0)

    def decide(self, *, offset: int = 0) -> list[torch.Tensor]:
        """``packed.send`` step 2 on the device, after every part was encoded: each part's
        payload, replaced in place by the marker of its size naming element ``offset`` + bad
        where the send found one (bad: the first NaN/±Inf of g, else of x = g + α·h, else the
        first element of the first bucket whose norm is not finite; the kernel's atomic
        minima). One launch for all parts (they must have the same size); nothing is read on
        the host."""
        self._check_encoded()
        if len(set(self.sizes)) > 1:
            raise ValueError(f"decide needs parts of one size, got {self.sizes}")
        payloads = [self._payload(k) for k in range(len(self.sizes))]
        total = self._starts[-1]
        if not total:
            return payloads
        head = common.header_tensor(self.sizes[0], self.table, self.bucket_size, self.norm,
                                    self.device, marker=True)
        with tk._prepare_device(self.device):
            _kernels()["markers"][(-(-total // MARKER_BLOCK),)](
                self._payloads, self._first, head, self._bytes[0],
                self._starts[1] - self._starts[0], total, int(offset),
                NEVER=NEVER, MAX_INDEX=MAX_MARKER_INDEX, HEADER=HEADER_SIZE,
                INDEX_AT=MARKER_INDEX_OFFSET, BLOCK=MARKER_BLOCK, num_warps=tk.NUM_WARPS)
        return payloads


def encode(
    x: torch.Tensor,
    levels: LevelTable | Any,
    *,
    bucket_size: int,
    norm: str = "l2",
    key: StreamKey,
    out: torch.Tensor | None = None,
    checksum: bool = False,
    checked: bool = False,
) -> torch.Tensor:
    """Quantize and pack x into a uint8 payload on x's device: ``codec.encode(x, levels,
    bucket_size=, norm=, key=key, checksum=checksum)`` byte for byte.

    Args:
        x: gradient of any shape; float16/bfloat16/float32 (float64 is cast first), finite.
        levels: a ``LevelTable`` (or an array, taken as version 0).
        bucket_size, norm: as in ``codec.encode``.
        key: the random stream (``codec.stream.StreamKey``: seed, rank, step, bucket, part).
        out: optional contiguous uint8 tensor of ``payload_size`` bytes to write into; nothing
            is written to it when the input is rejected.
        checksum: write ``FLAG_CHECKSUM`` and the CRC-32 (computed on the host).
        checked: x is known to be finite with norms within float32 (``kernels.encode``): no
            check, no host sync.

    Raises ``ValueError`` with the messages of ``horovod_aq.torch.kernels.encode`` for
    non-finite input or an overflowing norm (found on the device, one host sync), unless
    ``checked``.
    """
    checksum = codec.check_bool("checksum", checksum)
    checked = codec.check_bool("checked", checked)
    table = codec.as_table(levels)
    bucket_size = codec.check_bucket_size(bucket_size)
    norm = codec.check_norm(norm)
    if not isinstance(key, StreamKey):
        raise TypeError(f"key must be a horovod_aq.codec.stream.StreamKey, got {key!r}")
    flat = _flat_input(x)
    device = flat.device
    n, bits = flat.numel(), table.bits
    with tk._prepare_device(device):
        codes_at = HEADER_SIZE + NORM_BYTES * codec.num_buckets(n, bucket_size)
        size = codec.payload_size(n, bits, bucket_size)
        target = None if out is None else _output(out, size, device)
        if n == 0:
            payload = _output(out, size, device)
            payload[:HEADER_SIZE] = common.header_tensor(n, table, bucket_size, norm, device)
            return common.seal_checksum(payload) if checksum else payload
        send = Send(table, bucket_size=bucket_size, norm=norm, alpha=0.0, beta=0.0, sizes=[n],
                    device=device, memory=False)   # refuses n past the random stream
        encoded = send.encode(flat, None, None, key)
        if not checked and send.outcome() is None:   # one sync; raises the torch kernels' errors
            common.check_finite(flat, encoded[HEADER_SIZE:codes_at].view(torch.float32))
            raise RuntimeError("horovod_aq.torch.triton_send: the encode refused input that "
                               "the check accepts (please report this bug)")
        payload = encoded if target is None else target.copy_(encoded)
    return common.seal_checksum(payload) if checksum else payload
