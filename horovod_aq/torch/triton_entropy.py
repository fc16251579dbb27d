"""Triton kernels of the entropy-coded body: interleaved rANS encode and decode on the GPU.

Byte-identical to the numpy oracle (``horovod_aq.codec.rans``, docs/format.md §12). One
program codes one block; its K = 32 lanes are the vector (DietGPU's layout: a warp's threads
are the lanes), and a step's words are placed with a prefix sum over the lanes that emit (or
read) one: encoding writes them backwards into a per-block scratch row (:func:`encode_blocks`),
and :func:`compact` gathers the rows' words into the payload's WORDS once their total is known
on the host. Decoding gives each lane its word by an
exclusive prefix sum of the lanes that need one, and flags a block whose stream runs past its
end, leaves words unread or ends a lane off 2^16; the caller then hands the payload to the
oracle, which raises its ``PayloadError``.

The model (code table, f, c: 2^(g·b) ≤ 256 entries) is built on the host by
``horovod_aq.codec.entropy_format`` from the histogram of the codes (:func:`histogram`, one
atomic add per bin and block of codes): one host round trip, for all the parts of a send
(``torch.entropy.entropy_of_parts``), which a variable-length payload needs anyway to learn its
size; the tables go back in one copy that does not wait for the device
(``payload.host_to_device``).

    words, states, counts = encode_symbols(symbols, f, c)      # symbols: uint8 CUDA tensor
    symbols = decode_symbols(states, counts, words, f, c, nsym)  # None if the stream is bad

Imports only ``horovod_aq.codec``, ``horovod_aq.torch.payload`` and
``triton_kernels`` (for ``launched``), torch and triton;
tested under ``TRITON_INTERPRET=1`` (``tests/test_triton_entropy.py``).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from horovod_aq.codec.entropy_format import (
    BLOCK_SYMBOLS,
    LANES,
    PRECISION,
    STATE_LOW,
    STEPS,
)
from horovod_aq.codec.rans import slot_symbols
from horovod_aq.torch.payload import host_to_device
from horovod_aq.torch.triton_kernels import launched

__all__ = ["compact", "decode_symbols", "decode_symbols_flagged", "encode_blocks",
           "encode_symbols", "histogram", "model_array"]

#: Codes counted by one program of :func:`histogram` (each program adds its counts to the
#: result with one atomic add per bin).
HISTOGRAM_BLOCK = 4096


@triton.jit
def _histogram_kernel(codes_ptr, counts_ptr, n, BINS: tl.constexpr, BLOCK: tl.constexpr):
    """counts[j] += #{i in this program's block : codes[i] = j}, for codes < BINS."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    codes = tl.load(codes_ptr + offs, mask=valid, other=0).to(tl.int32)
    bins = tl.arange(0, BINS)
    missing = BLOCK - tl.sum(valid.to(tl.int32), axis=0)   # past n: counted as code 0
    found = tl.histogram(codes, BINS) - tl.where(bins == 0, missing, 0)
    tl.atomic_add(counts_ptr + bins, found)


@triton.jit
def _encode_kernel(sym_ptr, f_ptr, c_ptr, cmpl_ptr, scratch_ptr, states_ptr, counts_ptr, nsym,
                   LANES_C: tl.constexpr, STEPS_C: tl.constexpr, PREC: tl.constexpr,
                   LOW: tl.constexpr):
    b = tl.program_id(0)
    lanes = tl.arange(0, LANES_C)
    first = b.to(tl.int64) * (LANES_C * STEPS_C)
    m = tl.minimum(nsym - first, LANES_C * STEPS_C)
    steps = (m + LANES_C - 1) // LANES_C
    x = tl.full((LANES_C,), LOW, tl.int64)
    emitted = tl.zeros((), tl.int64)
    top = LANES_C * STEPS_C
    row = scratch_ptr + b.to(tl.int64) * (top + 1)
    for j in range(0, steps):
        t = steps - 1 - j
        i = t * LANES_C + lanes
        valid = i < m
        s = tl.load(sym_ptr + first + i, mask=valid, other=0).to(tl.int32)
        fs = tl.load(f_ptr + s).to(tl.int64)
        emit = valid & (x >= (fs << (32 - PREC)))
        e = emit.to(tl.int64)
        inclusive = tl.cumsum(e, 0)
        total = tl.sum(e, 0)
        pos = top - emitted - (total - inclusive)
        tl.store(row + pos, (x & 0xFFFF).to(tl.uint16), mask=emit)
        emitted += total
        x = tl.where(emit, x >> 16, x)
        q = x // tl.maximum(fs, 1)
        coded = x + tl.load(c_ptr + s).to(tl.int64) + q * tl.load(cmpl_ptr + s).to(tl.int64)
        x = tl.where(valid, coded, x)
    tl.store(states_ptr + b.to(tl.int64) * LANES_C + lanes, x.to(tl.uint32))
    tl.store(counts_ptr + b, emitted)


@triton.jit
def _decode_kernel(states_ptr, counts_ptr, starts_ptr, words_ptr, nwords, slots_ptr, f_ptr,
                   c_ptr, out_ptr, status_ptr, nsym, LANES_C: tl.constexpr,
                   STEPS_C: tl.constexpr, PREC: tl.constexpr, LOW: tl.constexpr):
    b = tl.program_id(0)
    lanes = tl.arange(0, LANES_C)
    first = b.to(tl.int64) * (LANES_C * STEPS_C)
    m = tl.minimum(nsym - first, LANES_C * STEPS_C)
    steps = (m + LANES_C - 1) // LANES_C
    x = tl.load(states_ptr + b.to(tl.int64) * LANES_C + lanes).to(tl.int64)
    ptr = tl.load(starts_ptr + b)
    end = ptr + tl.load(counts_ptr + b)
    over = tl.zeros((), tl.int32)
    for t in range(0, steps):
        i = t * LANES_C + lanes
        valid = i < m
        slot = x & ((1 << PREC) - 1)
        s = tl.load(slots_ptr + slot).to(tl.int32)
        decoded = tl.load(f_ptr + s).to(tl.int64) * (x >> PREC) + slot \
            - tl.load(c_ptr + s).to(tl.int64)
        x = tl.where(valid, decoded, x)
        need = valid & (x < LOW)
        n = need.to(tl.int64)
        at = ptr + tl.cumsum(n, 0) - n
        over = over | tl.max((need & (at >= end)).to(tl.int32), 0)
        w = tl.load(words_ptr + tl.minimum(at, nwords), mask=need, other=0).to(tl.int64)
        x = tl.where(need, (x << 16) | w, x)
        ptr += tl.sum(n, 0)
        tl.store(out_ptr + first + i, s.to(tl.uint8), mask=valid)
    bad = over | (ptr != end).to(tl.int32) | tl.max((x != LOW).to(tl.int32), 0)
    tl.store(status_ptr + b, bad)


def _tables(f: np.ndarray, c: np.ndarray, device) -> tuple[torch.Tensor, ...]:
    """f, c and 2^PRECISION − f on the device, in one copy that does not wait for it."""
    f = np.asarray(f, np.int64)
    return torch.split(host_to_device(np.concatenate([f, np.asarray(c, np.int64),
                                                      (1 << PRECISION) - f]), device), len(f))


def histogram(codes: torch.Tensor, num_bins: int) -> torch.Tensor:
    """The counts of the values 0 … num_bins − 1 in the uint8 ``codes`` (each < num_bins), int64
    on their device: ``np.bincount(codes, minlength=num_bins)``, read nowhere (``torch.
    bincount`` reads its input's maximum on the host first, on CUDA)."""
    n = codes.numel()
    if n >= 1 << 31:
        raise ValueError(f"histogram counts fewer than 2^31 codes, got {n}")
    bins = triton.next_power_of_2(max(num_bins, 2))
    counts = torch.zeros(bins, dtype=torch.int32, device=codes.device)
    if n:
        launched(_histogram_kernel)[(-(-n // HISTOGRAM_BLOCK),)](
            codes, counts, n, BINS=bins, BLOCK=HISTOGRAM_BLOCK)
    return counts[:num_bins].to(torch.int64)


def encode_symbols(symbols: torch.Tensor, f: np.ndarray, c: np.ndarray
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(words uint16 [W], states uint32 [nblk, K], counts int64 [nblk]) of the nsym ≥ 1 uint8
    ``symbols`` (a 1-D tensor on the kernel's device), as ``rans.encode_symbols``: the blocks
    (:func:`encode_blocks`), then their words compacted (:func:`compact`) after one read of
    their number."""
    scratch, states, counts = encode_blocks(symbols, f, c)
    return compact(scratch, counts, int(counts.sum())), states, counts


def encode_blocks(symbols: torch.Tensor, f: np.ndarray, c: np.ndarray
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scratch uint16 [nblk, BLOCK_SYMBOLS + 1], states, counts) of ``symbols``, launched
    without a host sync: block b's counts[b] words are the last ones of its scratch row."""
    nsym = symbols.numel()
    nblk = -(-nsym // BLOCK_SYMBOLS)
    device = symbols.device
    ft, ct, cmpl = _tables(f, c, device)
    scratch = torch.zeros((nblk, BLOCK_SYMBOLS + 1), dtype=torch.uint16, device=device)
    states = torch.empty((nblk, LANES), dtype=torch.uint32, device=device)
    counts = torch.empty(nblk, dtype=torch.int64, device=device)
    launched(_encode_kernel)[(nblk,)](symbols, ft, ct, cmpl, scratch, states, counts, nsym,
                                      LANES_C=LANES, STEPS_C=STEPS, PREC=PRECISION,
                                      LOW=STATE_LOW)
    return scratch, states, counts


def compact(scratch: torch.Tensor, counts: torch.Tensor, total: int) -> torch.Tensor:
    """The words of every block in block order — the last counts[b] of scratch row b — given
    their ``total`` = Σ counts (known on the host): gathered on the device, nothing read.
    Word j of the result is row b_j's column width − counts[b_j] + (j − start_{b_j}), b_j its
    block and start_b = Σ_{b' < b} counts[b']."""
    nblk, width = scratch.shape
    device = scratch.device
    if total == 0:
        return torch.empty(0, dtype=torch.uint16, device=device)
    block = torch.repeat_interleave(torch.arange(nblk, device=device), counts,
                                    output_size=total)
    start = torch.cumsum(counts, 0) - counts
    column = width - counts[block] + (torch.arange(total, device=device) - start[block])
    # (advanced indexing has no uint16 kernel on CUDA: gather the same 16-bit words as int16)
    return scratch.view(torch.int16)[block, column].view(torch.uint16)


def decode_symbols(states: torch.Tensor, counts: torch.Tensor, words: torch.Tensor,
                   f: np.ndarray, c: np.ndarray, nsym: int) -> torch.Tensor | None:
    """The nsym uint8 symbols of a body (``rans.decode_symbols``), or None if a block's stream
    is refused (past its end, words left unread, a lane not back at 2^16)."""
    alphabet = len(f)
    model = host_to_device(model_array(f, c), words.device)   # one copy
    ft, ct, slots = torch.split(model, [alphabet, alphabet, model.numel() - 2 * alphabet])
    out, ok = decode_symbols_flagged(states, counts, words, ft, ct, slots, nsym)
    return out if bool(ok) else None


def model_array(f: np.ndarray, c: np.ndarray) -> np.ndarray:
    """f, c and the decoder's slot → symbol table of a model, as one int64 host array (one
    copy to the device): [f (A) | c (A) | slots (2^PRECISION)]."""
    f = np.asarray(f, np.int64)
    return np.concatenate([f, np.asarray(c, np.int64), slot_symbols(f).astype(np.int64)])


def decode_symbols_flagged(states: torch.Tensor, counts: torch.Tensor, words: torch.Tensor,
                           f: torch.Tensor, c: torch.Tensor, slots: torch.Tensor, nsym: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_symbols` with the model (f, c, slots: int64 tensors on the words' device)
    given, and no host synchronisation: (symbols, ok), ``ok`` a 0-dim bool device tensor,
    False where a block's stream is refused (the symbols then mean nothing)."""
    device = words.device
    nblk = states.shape[0]
    counts = counts.to(device=device, dtype=torch.int64)
    starts = torch.cumsum(counts, 0) - counts
    out = torch.empty(nsym, dtype=torch.uint8, device=device)
    status = torch.zeros(nblk, dtype=torch.int32, device=device)
    padded = torch.cat([words.reshape(-1), words.new_zeros(1)])  # index nwords: always valid
    launched(_decode_kernel)[(nblk,)](
        states.to(device=device, dtype=torch.int64).contiguous(), counts, starts, padded,
        words.numel(), slots, f, c, out, status, nsym, LANES_C=LANES, STEPS_C=STEPS,
        PREC=PRECISION, LOW=STATE_LOW)
    return out, ~status.any()
