"""The compiled loop of ECQ-SGD's fused send (numba): compensate, encode and update the error
memory in one pass per bucket (docs/dynamic.md §2.6). The oracle is
``codec.reference.encode_compensated``; ``horovod_aq.codec.fused_compensated`` wraps this loop.

For bucket k of the payload's n coordinates (g and h hold the first n_g ≤ n of them; the rest is
a two-phase chunk's zero padding), in float32:

1. x_i = fl(g_i + fl(α·h_i)) into a scratch row of one bucket (x_i = g_i without memory,
   +0.0 in the padding), prefetching g and h ahead;
2. the bucket norm n_k of that row, then the level choice, stochastic rounding and packing of
   docs/format.md §5, with the helpers of ``fused_kernels._make_encoder`` (the same bytes);
3. h'_i = fl(fl(β·h_i) + fl(g_i − g̃_i)), g̃_i = n_k·L_{code_i} from the code just chosen (the
   decoder's product, docs/format.md §5 step 6: no decode), into ``h_out``; while it is in
   cache, the largest |h'_i| (float32 bits: whether h' is finite) and the bucket's S_k =
   Σ float64(h'_i)² in the canonical pairwise order of the l2 norm (docs/format.md §3), added
   bucket after bucket into ‖h'‖² (telemetry; ``reference.memory_sum_of_squares``).

A bucket whose x is not finite or whose norm overflows float32 stops the loop (the caller then
sends markers): h is never written, and ``h_out`` is a separate buffer the caller discards.
One kernel per code width b (``_compensated_encoder(bits)``), as the plain encoder; with
``pack`` = 8 (``_compensated_code_encoder``) it writes one code per byte, the codes of the
entropy-coded body (``horovod_aq.codec.fused_entropy``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from horovod_aq.codec.fused_kernels import (
    _AHEAD,
    _BYTE,
    _CHUNK,
    _F32_ONE,
    _F32_ZERO,
    _JIT,
    _LINEAR_MAX_BITS,
    _ROW,
    _U0,
    _abs_max_bits,
    _l2_sum,
    _pack,
    _philox_uniforms,
    _prefetch,
    _quantize,
    _specialized,
)

#: float32 bits of +Inf: |v| (bits without the sign) at or above it is not finite.
_F32_INF_BITS = np.uint32(0x7F800000)


@njit(inline="always", **_JIT)
def _level(scaled, code, bits, linear):
    """g̃ = scaled[code] (scaled = n_k·L): with few levels a chain of selects, which
    vectorizes where a table lookup would not."""
    if linear:
        v = scaled[0]
        for q in range(1, 1 << bits):
            v = scaled[q] if code >= q else v
        return v
    return scaled[code]


def _make_compensated_encoder(bits: int, pack: int = 0):
    """The fused ECQ-SGD encoder of b-bit codes (module docstring); ``pack`` = 8 writes one
    code per byte instead of packing them."""
    linear = bits <= _LINEAR_MAX_BITS
    pack = pack or bits

    @njit(**_JIT)
    def kernel(g, h, has_h, alpha, beta, n, bucket_size, linf, interior, levels, cells, k0, k1,
               c1, c2, c3, norms, codes, h_out):
        """Encode x = g + α·h (zero-padded to n) into ``norms`` and ``codes`` and write
        h' = β·h + (g − g̃) into ``h_out`` (g and h alike without memory: h' = g − g̃).
        Returns (−1, whether h' is finite, Σh'²), or (k, False, 0) for the first bucket k
        whose values are not finite or whose norm overflows float32 (nothing valid written)."""
        n_g = g.size
        uk0 = np.uint64(k0)
        uk1 = np.uint64(k1)
        uc1 = np.uint64(c1)
        uc2 = np.uint64(c2)
        uc3 = np.uint64(c3)
        ubuf = np.empty(_CHUNK + 8, dtype=np.float32)
        cbuf = np.zeros(_CHUNK + 16, dtype=np.uint8)
        rbuf = np.zeros(_CHUNK, dtype=np.float32)
        flags = np.zeros(_CHUNK, dtype=np.bool_)
        span = min(bucket_size, n)
        xrow = np.empty(span, dtype=np.float32)
        xbits = xrow.view(np.uint32)
        hbits = h_out.view(np.uint32)
        width = 1
        while width < span:
            width <<= 1
        cols = min(width, _ROW)
        depth = 2
        while (cols << (depth - 2)) < width:
            depth += 1
        stack = np.empty((depth, cols), dtype=np.float64)
        nbits = np.zeros(1, dtype=np.uint32)
        nval = nbits.view(np.float32)
        hmax = np.uint32(0)
        hsum = 0.0
        scaled = np.empty(1 << bits, dtype=np.float32)
        pend = 0
        out_byte = 0
        fetched = 0
        nb = (n + bucket_size - 1) // bucket_size
        for k in range(nb):
            start = k * bucket_size
            length = min(bucket_size, n - start)
            real = min(length, max(n_g - start, 0))
            # 1. x of the bucket (g and h of the next coordinates are fetched meanwhile)
            upto = min(n_g, start + length + _AHEAD)
            while fetched < upto:
                _prefetch(g, fetched)
                if has_h:
                    _prefetch(h, fetched)
                fetched += 16
            x = xrow[:length]
            gb = g[start:start + real]
            if has_h:
                hb = h[start:start + real]
                for t in range(real):
                    x[t] = gb[t] + alpha * hb[t]
            else:
                for t in range(real):
                    x[t] = gb[t]
            for t in range(real, length):
                x[t] = _F32_ZERO
            # 2. its norm, then codes chunk by chunk
            if linf:
                m = _abs_max_bits(xbits[:length])
                if m >= _F32_INF_BITS:
                    return k, False, 0.0
                nbits[0] = m
                nrm = nval[0]
            else:
                s = _l2_sum(x, stack)
                if not np.isfinite(s):
                    return k, False, 0.0
                nrm = np.float32(np.sqrt(s))
                if not np.isfinite(nrm):
                    return k, False, 0.0
            norms[k] = nrm
            div = nrm if nrm != _F32_ZERO else _F32_ONE
            for q in range(1 << bits):
                scaled[q] = nrm * levels[q]
            a0 = start
            end = start + length
            while a0 < end:
                cnt = min(_CHUNK, end - a0)
                first = a0 >> 2
                _philox_uniforms(first, ((a0 + cnt - 1) >> 2) - first + 1, uk0, uk1, uc1, uc2,
                                 uc3, ubuf)
                _quantize(x[a0 - start:], cnt, div, interior, levels, cells, ubuf[a0 & 3:],
                          cbuf[pend:], rbuf, flags, bits, linear)
                # 3. h' = β·h + (g − n_k·L[code]) of the chunk's real coordinates (n_k·L: scaled)
                real_cnt = min(cnt, max(n_g - a0, 0))
                cb = cbuf[pend:pend + real_cnt]
                gc = g[a0:a0 + real_cnt]
                oc = h_out[a0:a0 + real_cnt]
                if has_h:
                    hc = h[a0:a0 + real_cnt]
                    for t in range(real_cnt):
                        oc[t] = beta * hc[t] + (gc[t] - _level(scaled, cb[t], bits, linear))
                else:
                    for t in range(real_cnt):
                        oc[t] = gc[t] - _level(scaled, cb[t], bits, linear)
                a = _abs_max_bits(hbits[a0:a0 + real_cnt])
                hmax = a if a > hmax else hmax
                pend += cnt
                ng = pend >> 3
                _pack(cbuf, ng, codes[out_byte:], pack)
                out_byte += ng * pack
                for q in range(pend - 8 * ng):
                    cbuf[q] = cbuf[8 * ng + q]
                pend -= 8 * ng
                a0 += cnt
            if real:
                hsum += _l2_sum(h_out[start:start + real], stack)
        if pend:  # the last, partial group: only ⌈pend·b/8⌉ bytes remain in the stream
            w = _U0
            for q in range(pend):
                w |= np.uint64(cbuf[q]) << np.uint64(q * pack)
            for b in range(codes.size - out_byte):
                codes[out_byte + b] = np.uint8((w >> np.uint64(8 * b)) & _BYTE)
        return -1, hmax < _F32_INF_BITS, hsum

    return kernel


def _make_code_packer(bits: int):
    @njit(**_JIT)
    def kernel(codes, out):
        """Pack n codes (one per byte) into the ⌈n·b/8⌉ bytes of ``out`` (docs/format.md §4)."""
        n = codes.size
        ng = n >> 3
        _pack(codes, ng, out, bits)
        rest = n - 8 * ng
        if rest:  # the last, partial group: only ⌈rest·b/8⌉ bytes remain in the stream
            w = _U0
            for q in range(rest):
                w |= np.uint64(codes[8 * ng + q]) << np.uint64(q * bits)
            for b in range(out.size - ng * bits):
                out[ng * bits + b] = np.uint8((w >> np.uint64(8 * b)) & _BYTE)

    return kernel


_compensated_encoder = _specialized(_make_compensated_encoder)
_compensated_code_encoder = _specialized(lambda bits: _make_compensated_encoder(bits, 8))
_code_packer = _specialized(_make_code_packer)
