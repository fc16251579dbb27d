"""The compiled loops of the entropy-coded body (numba): histogram, interleaved rANS encode,
and decode + scale + accumulate of P variable-length rows.

The arithmetic is ``horovod_aq.codec.rans`` (docs/format.md §12), step for step; the numpy
oracle defines the bytes and ``tests/test_fused_entropy.py`` compares them. One kernel per code
width b (``_rans_encoder(bits)``, ``_rans_decoder(bits)``): the symbol width g·b and the loops
over the g codes of a symbol are then constants. Every branch of the coders is written as a
select, so that the unpredictable renormalizations cost no mispredictions; the K = 32 lanes of a
step are independent, which gives the CPU 32 dependency chains to overlap.

Division: ⌊x / f⌋ is ⌊x · fl(1/f)⌋ in float64, corrected by one: for x < 2³², f ≤ 2^14 the
product is within 2⁻²⁰ of x/f, and x/f is an integer or at least 2⁻¹⁴ from the next one, so the
estimate is the quotient or one below it (exactly when the remainder comes out ≥ f).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from horovod_aq.codec.entropy_format import (
    BLOCK_SYMBOLS,
    GROUPS,
    LANES,
    PRECISION,
    STATE_LOW,
    STEPS,
    WORD_BITS,
)
from horovod_aq.codec.fused_kernels import _JIT, _scale_levels, _specialized, _unpack

# states and indices are int64 (every value < 2^33), so that conversions are single
# instructions and no expression mixes signed and unsigned integers
_PREC_I = np.int64(PRECISION)
_SLOT_I = np.int64((1 << PRECISION) - 1)
_LOW_I = np.int64(STATE_LOW)
_WORD_I = np.int64((1 << WORD_BITS) - 1)


@njit(**_JIT)
def histogram(codes, nbins):
    """Counts of each code value (int64), in four interleaved partial histograms so that a run
    of equal codes does not serialize on one counter."""
    h = np.zeros((4, 256), np.int64)
    n4 = codes.size // 4 * 4
    for i in range(0, n4, 4):
        h[0, codes[i]] += 1
        h[1, codes[i + 1]] += 1
        h[2, codes[i + 2]] += 1
        h[3, codes[i + 3]] += 1
    for i in range(n4, codes.size):
        h[0, codes[i]] += 1
    return (h[0] + h[1] + h[2] + h[3])[:nbins]


def _make_rans_encoder(bits: int):
    g = GROUPS[bits]

    @njit(**_JIT)
    def kernel(codes, f, c, xmax, rcp, cmpl, states, counts, words):
        """Encode the n codes (one per byte) as ⌈n/g⌉ symbols into ``states`` [nblk·K] (u32),
        ``counts`` [nblk] and ``words`` (u16, capacity ≥ nsym); returns the words written.
        x ← x + c_s + q·(M − f_s) is ⌊x/f_s⌋·M + (x mod f_s) + c_s with q = ⌊x/f_s⌋."""
        n = codes.size
        nsym = (n + g - 1) // g
        nblk = (nsym + BLOCK_SYMBOLS - 1) // BLOCK_SYMBOLS
        sym = np.empty(BLOCK_SYMBOLS, np.uint8)
        scratch = np.empty(BLOCK_SYMBOLS + 1, np.uint16)
        st = np.empty(LANES, np.int64)
        last = codes[n - 1]
        total = 0
        for b in range(nblk):
            first = b * BLOCK_SYMBOLS
            m = min(BLOCK_SYMBOLS, nsym - first)
            whole = m if (first + m) * g <= n else m - 1
            src = codes[first * g:]
            for i in range(whole):
                s = np.uint32(0)
                for q in range(g):
                    s |= np.uint32(src[i * g + q]) << np.uint32(q * bits)
                sym[i] = s
            if whole < m:  # the last symbol: padded with copies of the last code
                s = np.uint32(0)
                for q in range(g):
                    k = whole * g + q
                    s |= np.uint32(src[k] if first * g + k < n else last) << np.uint32(q * bits)
                sym[whole] = s
            for lane in range(LANES):
                st[lane] = _LOW_I
            pos = BLOCK_SYMBOLS
            steps = (m + LANES - 1) // LANES
            for j in range(steps):
                base = (steps - 1 - j) * LANES
                top = min(LANES, m - base)
                for k in range(top):
                    lane = top - 1 - k
                    s = sym[base + lane]
                    x = st[lane]
                    emit = np.int64(x >= xmax[s])
                    scratch[pos] = np.uint16(x & _WORD_I)
                    pos -= emit
                    x = x >> (emit << 4)
                    q = np.int64(np.float64(x) * rcp[s])
                    q += np.int64(x - q * f[s] >= f[s])
                    st[lane] = x + c[s] + q * cmpl[s]
            cnt = BLOCK_SYMBOLS - pos
            for lane in range(LANES):
                states[b * LANES + lane] = np.uint32(st[lane])
            counts[b] = cnt
            words[total:total + cnt] = scratch[pos + 1:BLOCK_SYMBOLS + 1]
            total += cnt
        return total

    return kernel


def _make_rans_decoder(bits: int):
    g = GROUPS[bits]

    @njit(**_JIT)
    def kernel(kinds, states, counts, words, starts, fixed, codes_at, slots, f, c,
               symbol_codes, lut, norms, n, bucket_size, num_levels, out):
        """out = Σ_p (n_p·L[code_p]) / P in rank order (float32). Row p is entropy-coded
        (kinds[p] = 1: states[p] [nblk, K], counts[p] [nblk], its words from starts[p] in
        ``words``, its model slots[p], f[p], c[p]) or fixed-width (0: its codes at
        codes_at[p] in ``fixed``). Returns −1, or the first row whose stream runs past its
        end, leaves words unread, ends a lane off 2^16 or holds a code ≥ N (the wrapper then
        raises the oracle's error)."""
        nrows = kinds.size
        nsym = (n + g - 1) // g
        nblk = (nsym + BLOCK_SYMBOLS - 1) // BLOCK_SYMBOLS
        span = BLOCK_SYMBOLS * g
        codes = np.zeros(span + 8, np.uint8)
        words64 = codes.view(np.uint64)
        tail = np.zeros(8, np.uint8)
        sym = np.empty(BLOCK_SYMBOLS, np.uint8)
        st = np.empty(LANES, np.int64)
        pf = np.float32(nrows)
        inv = np.float32(1.0) / pf
        pow2 = (nrows & (nrows - 1)) == 0
        div = nrows > 1
        check = num_levels < (1 << bits)
        nbytes = (n * bits + 7) // 8
        wlast = words.size - 1
        ptrs = starts.copy()
        for b in range(nblk):
            a0 = b * span
            cnt = min(span, n - a0)
            m = min(BLOCK_SYMBOLS, nsym - b * BLOCK_SYMBOLS)
            for p in range(nrows):
                if kinds[p] == 1:
                    sl = slots[p]
                    fr = f[p]
                    cr = c[p]
                    for lane in range(LANES):
                        st[lane] = np.int64(states[p, b, lane])
                    ptr = ptrs[p]
                    end = ptr + counts[p, b]
                    over = np.int64(0)
                    steps = (m + LANES - 1) // LANES
                    for t in range(steps):
                        base = t * LANES
                        top = min(LANES, m - base)
                        for lane in range(top):
                            x = st[lane]
                            slot = x & _SLOT_I
                            s = sl[slot]
                            x = fr[s] * (x >> _PREC_I) + slot - cr[s]
                            need = np.int64(x < _LOW_I)
                            w = np.int64(words[min(ptr, wlast)])
                            x = (x << (need << 4)) | (w * need)
                            ptr += need
                            over |= need & np.int64(ptr > end)
                            st[lane] = x
                            sym[base + lane] = s
                    if over or ptr != end:
                        return p
                    for lane in range(LANES):
                        if st[lane] != _LOW_I:
                            return p
                    ptrs[p] = ptr
                    for i in range(m):
                        s = sym[i]
                        for q in range(g):
                            codes[i * g + q] = symbol_codes[s, q]
                else:
                    first_byte = (a0 >> 3) * bits
                    ngroups = (cnt + 7) >> 3
                    full = ngroups if first_byte + ngroups * bits <= nbytes else ngroups - 1
                    src = fixed[codes_at[p] + first_byte:codes_at[p] + nbytes]
                    _unpack(src, full, words64, bits)
                    if full < ngroups:
                        have = nbytes - first_byte - full * bits
                        for q in range(8):
                            tail[q] = src[full * bits + q] if q < have else 0
                        _unpack(tail, 1, words64[full:], bits)
                    if check:
                        for i in range(cnt):
                            if codes[i] >= num_levels:
                                return p
                i = a0
                end_i = a0 + cnt
                k = a0 // bucket_size
                while i < end_i:
                    seg = min(end_i, (k + 1) * bucket_size)
                    _scale_levels(codes[i - a0:seg - a0], lut, norms[p, k], out[i:seg], p == 0,
                                  div, pow2, inv, pf)
                    i = seg
                    k += 1
        return -1

    return kernel


_rans_encoder = _specialized(_make_rans_encoder)
_rans_decoder = _specialized(_make_rans_decoder)


def encoder_tables(f: np.ndarray, c: np.ndarray) -> tuple[Any, ...]:
    """(f, c, x_max = f·2^(32 − PRECISION), fl(1/f), M − f) as the encoder kernel reads them
    (int64, float64)."""
    f64 = np.asarray(f, np.int64)
    rcp = 1.0 / np.maximum(f64, 1).astype(np.float64)
    return (f64, np.asarray(c, np.int64), f64 << np.int64(32 - PRECISION), rcp,
            (1 << PRECISION) - f64)


assert STEPS * LANES == BLOCK_SYMBOLS
