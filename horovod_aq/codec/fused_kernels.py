"""The compiled loops of ``horovod_aq.codec.fused`` (numba): Philox, bucket norms in the
canonical pairwise order, level search and stochastic rounding, bit packing, decoding.

One encoder and one decoder are compiled per code width (``_encoder(bits)``,
``_decoder(bits)``), so that the fixed width lets the inner loops vectorize; ``cache=True``
keeps the machine code on disk for later processes. The arithmetic is docs/format.md §5–§6;
``horovod_aq.codec.fused_fixed`` and ``fused_entropy`` wrap these loops with the validation and
errors of the oracle.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from horovod_aq.codec.stream import PHILOX_M0, PHILOX_M1, PHILOX_ROUNDS, PHILOX_W0, PHILOX_W1

# numba freezes module globals into the machine code; every integer constant is uint64 so that
# no expression mixes signed and unsigned integers (which numba would turn into float64).
_M0 = np.uint64(PHILOX_M0)
_M1 = np.uint64(PHILOX_M1)
_W0 = np.uint64(PHILOX_W0)
_W1 = np.uint64(PHILOX_W1)
_ROUNDS = PHILOX_ROUNDS
_MASK32 = np.uint64(0xFFFFFFFF)
_U8 = np.uint64(8)
_U32 = np.uint64(32)
_U0 = np.uint64(0)
_BYTE = np.uint64(0xFF)
_TWO_M24 = np.float32(2.0**-24)
_F32_ONE = np.float32(1.0)
_F32_MINUS_ONE = np.float32(-1.0)
_F32_ZERO = np.float32(0.0)
_F32_INF = np.float32(np.inf)
#: Coordinates per inner chunk (scratch buffers stay in L1) and width of an l2 stack row.
_CHUNK = 1024
_ROW = 1024
#: Coordinates ahead of the current chunk whose cache lines the encoder prefetches.
_AHEAD = 2048
#: Up to this many bits (14 interior levels) r is compared with every level; above, a table
#: indexed by the sign, exponent and top ``23 − _CELL_SHIFT`` mantissa bits of r finds the level.
_LINEAR_MAX_BITS = 4
_CELL_SHIFT = 17
_SEVERAL = np.uint8(255)  # a cell holding several levels (j ≤ 254 otherwise)
_LITTLE = sys.byteorder == "little"

_JIT = {"cache": True, "nogil": True, "error_model": "numpy"}


# ------------------------------------------------------------------------------------ kernels
#
# Helpers marked inline="always" are inlined into each bits-specialized kernel (``_encoder``,
# ``_decoder``), where ``bits`` is a compile-time constant: the loops over levels, over the codes
# of a group and over the bytes of a group unroll, and LLVM vectorizes the loops over
# coordinates. Indices are kept non-negative and zero-based (slices, not offsets), so that no
# wraparound check stands in the way of vectorization.


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Hint the CPU to fetch the cache line of arr[idx] (``llvm.prefetch``; never faults)."""
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]],
                                       wraparound=False)
        i8p = builder.bitcast(ptr, ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p.type, i32, i32, i32])
        name = "llvm.prefetch.p0" if getattr(i8p.type, "is_opaque", True) else "llvm.prefetch.p0i8"
        fn = cgutils.get_or_insert_function(builder.module, fnty, name)
        # read, high temporal locality, data cache
        builder.call(fn, [i8p, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always", **_JIT)
def _philox_uniforms(first, count, k0, k1, c1, c2, c3, u):
    """u[4t + w] = uniform of word w of counter (first + t, c1, c2, c3) under key (k0, k1).

    The products are of 32-bit values (``& _MASK32``, folded into a 32×32→64 multiply); the
    high halves of the other state words are garbage that only ever reaches those masks or the
    final ones, so no other masking is needed.
    """
    for t in range(count):
        x0 = np.uint64(first + t)
        x1 = c1
        x2 = c2
        x3 = c3
        a = k0
        b = k1
        for _ in range(_ROUNDS):
            p0 = _M0 * (x0 & _MASK32)
            p1 = _M1 * (x2 & _MASK32)
            x0 = (p1 >> _U32) ^ x1 ^ a
            x1 = p1
            x2 = (p0 >> _U32) ^ x3 ^ b
            x3 = p0
            a = (a + _W0) & _MASK32
            b = (b + _W1) & _MASK32
        u[4 * t] = np.float32(np.int32((x0 & _MASK32) >> _U8)) * _TWO_M24
        u[4 * t + 1] = np.float32(np.int32((x1 & _MASK32) >> _U8)) * _TWO_M24
        u[4 * t + 2] = np.float32(np.int32((x2 & _MASK32) >> _U8)) * _TWO_M24
        u[4 * t + 3] = np.float32(np.int32((x3 & _MASK32) >> _U8)) * _TWO_M24


@njit(**_JIT)
def _bitrev(p, nbits):
    r = 0
    for _ in range(nbits):
        r = (r << 1) | (p & 1)
        p >>= 1
    return r


@njit(inline="always", **_JIT)
def _halve(s, width):
    """Canonical pairwise sum of s[:width] (power of two): s[k] += s[k + width/2], repeated."""
    h = width
    while h > 1:
        h >>= 1
        for k in range(h):
            s[k] += s[k + h]
    return s[0]


@njit(**_JIT)
def _l2_sum_rows(xb, width, stack):
    """Σ float64(x_i)² over a bucket longer than a stack row, in the canonical pairwise order.

    With W = ``width`` split into R = W/T rows of T columns (T = stack row width), the first
    log₂R halvings add row m to row m + R/2 (same column): that is the adjacent pairwise tree
    over the rows in bit-reversed order, computed here streaming with a stack of rows (one read
    of the bucket, bounded scratch); the T column sums are then halved as usual.
    """
    length = xb.size
    cols = stack.shape[1]
    nrows = width // cols
    logr = 0
    while (1 << logr) < nrows:
        logr += 1
    depth = 0
    for p in range(nrows):
        base = _bitrev(p, logr) * cols
        cnt = min(max(length - base, 0), cols)
        row = stack[depth]
        src = xb[base:]
        for t in range(cnt):
            v = np.float64(src[t])
            row[t] = v * v
        row[cnt:] = 0.0
        depth += 1
        q = p + 1
        while (q & 1) == 0:
            left = stack[depth - 2]
            right = stack[depth - 1]
            for t in range(cols):
                left[t] += right[t]
            depth -= 1
            q >>= 1
    return _halve(stack[0], cols)


@njit(inline="always", **_JIT)
def _l2_sum(xb, stack):
    """Σ float64(x_i)² over the bucket xb in the canonical pairwise order; the squares and
    the first halving (q_k + q_{k+W/2}, W = next_pow2(length)) are fused."""
    length = xb.size
    width = 1
    while width < length:
        width <<= 1
    if width > stack.shape[1]:
        return _l2_sum_rows(xb, width, stack)
    if width == 1:
        v = np.float64(xb[0])
        return v * v
    h = width >> 1
    row = stack[0]
    hi = xb[h:]
    for k in range(length - h):  # length > h: both halves hold data up to length − h
        v = np.float64(xb[k])
        w = np.float64(hi[k])
        row[k] = v * v + w * w
    rest = xb[length - h:h]
    rest_row = row[length - h:h]
    for k in range(rest.size):
        v = np.float64(rest[k])
        rest_row[k] = v * v
    return _halve(row, h)


@njit(inline="always", **_JIT)
def _abs_max_bits(xbits):
    """max |x_i| of a bucket as float32 bits (|x| bits order like |x|); ≥ 0x7F800000 iff a
    value is not finite."""
    m = np.uint32(0)
    for i in range(xbits.size):
        a = xbits[i] & np.uint32(0x7FFFFFFF)
        m = a if a > m else m
    return m


@njit(inline="always", **_JIT)
def _quantize(x, cnt, div, interior, levels, cells, u, cbuf, rbuf, flags, bits, linear):
    """cbuf[t] = code of x[t] for t < cnt (steps 3–4), u[t] its uniform.

    j = #{interior levels ≤ r} (= clip(searchsorted(L, r, "right") − 1, 0, N − 2)); L_j is the
    last interior level ≤ r (or L_0 = −1), L_{j+1} the first one > r (or L_{N−1} = 1); the
    interior L_1 … L_{N−2} is padded with +Inf.

    ``linear`` (few levels): r is compared with every interior level, branch-free; the loop
    vectorizes. Otherwise a table indexed by the top bits of r's float32 pattern (``_cells``)
    gives j up to one comparison; r whose cell holds several levels are flagged and searched.
    """
    if linear:
        nscan = (1 << bits) - 2
        for t in range(cnt):
            r = x[t] / div
            r = _F32_MINUS_ONE if r < _F32_MINUS_ONE else r
            r = _F32_ONE if r > _F32_ONE else r
            j = np.int32(0)
            lo = _F32_MINUS_ONE
            hi = _F32_INF
            for k in range(nscan):
                c = interior[k]
                p = c <= r
                j = np.int32(k + 1) if p else j
                lo = c if p else lo
            for k in range(nscan - 1, -1, -1):
                c = interior[k]
                hi = hi if c <= r else c
            hi = hi if hi < _F32_ONE else _F32_ONE
            xi = np.float32(r - lo) / np.float32(hi - lo)
            cbuf[t] = j + (u[t] < xi)
    else:
        for t in range(cnt):
            r = x[t] / div
            r = _F32_MINUS_ONE if r < _F32_MINUS_ONE else r
            rbuf[t] = _F32_ONE if r > _F32_ONE else r
        rbits = rbuf.view(np.uint32)
        nflagged = 0
        for t in range(cnt):
            r = rbuf[t]
            j0 = cells[rbits[t] >> _CELL_SHIFT]
            several = j0 == _SEVERAL
            j0 = 0 if several else j0
            j = j0 + (interior[j0] <= r)
            lo = levels[j]
            xi = np.float32(r - lo) / np.float32(levels[j + 1] - lo)
            cbuf[t] = j + (u[t] < xi)
            flags[t] = several
            nflagged += several
        if nflagged:
            for t in range(cnt):
                if flags[t]:
                    cbuf[t] = _search_code(rbuf[t], interior, u[t], bits)


@njit(**_JIT)
def _search_code(r, interior, u, bits):
    """The code of r by a branch-free binary search over the 2^bits − 1 padded entries."""
    j = 0
    lo = _F32_MINUS_ONE
    hi = _F32_INF
    h = 1 << (bits - 1)
    for _ in range(bits):  # a failed candidate is below every earlier one
        c = interior[j + h - 1]
        p = c <= r
        j += h * p
        lo = c if p else lo
        hi = hi if p else c
        h >>= 1
    hi = hi if hi < _F32_ONE else _F32_ONE
    xi = np.float32(r - lo) / np.float32(hi - lo)
    return j + (u < xi)


@njit(inline="always", **_JIT)
def _pack(cbuf, ngroups, codes, bits):
    """Pack ngroups groups of 8 codes (b bytes each, LSB first) from cbuf into codes."""
    for g in range(ngroups):
        w = _U0
        for q in range(8):
            w |= np.uint64(cbuf[8 * g + q]) << np.uint64(q * bits)
        for b in range(bits):
            codes[g * bits + b] = np.uint8((w >> np.uint64(8 * b)) & _BYTE)


def _make_encoder(bits: int, pack: int = 0):
    """The encoder of b-bit codes; ``pack`` = 8 writes one code per byte instead of packing
    them (the codes of the entropy-coded body, ``horovod_aq.codec.fused_entropy``)."""
    linear = bits <= _LINEAR_MAX_BITS
    pack = pack or bits

    @njit(**_JIT)
    def kernel(x, xbits, bucket_size, linf, interior, levels, cells, k0, k1, c1, c2, c3, norms,
               codes):
        """Quantize and pack x; returns −1, or the first bucket whose values are not finite or
        whose norm overflows float32 (the wrapper then raises the oracle's error)."""
        n = x.size
        uk0 = np.uint64(k0)
        uk1 = np.uint64(k1)
        uc1 = np.uint64(c1)
        uc2 = np.uint64(c2)
        uc3 = np.uint64(c3)
        ubuf = np.empty(_CHUNK + 8, dtype=np.float32)
        cbuf = np.zeros(_CHUNK + 16, dtype=np.uint8)
        rbuf = np.zeros(_CHUNK, dtype=np.float32)
        flags = np.zeros(_CHUNK, dtype=np.bool_)
        width = 1
        while width < min(bucket_size, n):
            width <<= 1
        cols = min(width, _ROW)
        depth = 2
        while (cols << (depth - 2)) < width:
            depth += 1
        stack = np.empty((1 if linf else depth, cols), dtype=np.float64)
        nbits = np.zeros(1, dtype=np.uint32)
        nval = nbits.view(np.float32)
        pend = 0
        out_byte = 0
        fetched = 0
        nb = (n + bucket_size - 1) // bucket_size
        for k in range(nb):
            start = k * bucket_size
            length = min(bucket_size, n - start)
            if linf:
                m = _abs_max_bits(xbits[start:start + length])
                if m >= np.uint32(0x7F800000):
                    return k
                nbits[0] = m
                nrm = nval[0]
            else:
                s = _l2_sum(x[start:start + length], stack)
                if not np.isfinite(s):
                    return k
                nrm = np.float32(np.sqrt(s))
                if not np.isfinite(nrm):
                    return k
            norms[k] = nrm
            div = nrm if nrm != _F32_ZERO else _F32_ONE
            a0 = start
            end = start + length
            while a0 < end:
                cnt = min(_CHUNK, end - a0)
                # the next coordinates arrive while this chunk is computed (the norm pass
                # of the next bucket would otherwise wait for memory)
                upto = min(n, a0 + cnt + _AHEAD)
                while fetched < upto:
                    _prefetch(x, fetched)
                    fetched += 16
                first = a0 >> 2
                _philox_uniforms(first, ((a0 + cnt - 1) >> 2) - first + 1, uk0, uk1, uc1, uc2,
                                 uc3, ubuf)
                _quantize(x[a0:], cnt, div, interior, levels, cells, ubuf[a0 & 3:], cbuf[pend:],
                          rbuf, flags, bits, linear)
                pend += cnt
                ng = pend >> 3
                _pack(cbuf, ng, codes[out_byte:], pack)
                out_byte += ng * pack
                for q in range(pend - 8 * ng):
                    cbuf[q] = cbuf[8 * ng + q]
                pend -= 8 * ng
                a0 += cnt
        if pend:  # the last, partial group: only ⌈pend·b/8⌉ bytes remain in the stream
            w = _U0
            for q in range(pend):
                w |= np.uint64(cbuf[q]) << np.uint64(q * pack)
            for b in range(codes.size - out_byte):
                codes[out_byte + b] = np.uint8((w >> np.uint64(8 * b)) & _BYTE)
        return -1

    return kernel


@njit(inline="always", **_JIT)
def _unpack(src, ngroups, words, bits):
    """words[g] = the 8 codes of group g (b bytes of src at g·b) as the 8 bytes of a uint64."""
    mask = np.uint64((1 << bits) - 1)
    for g in range(ngroups):
        w = _U0
        for b in range(bits):
            w |= np.uint64(src[g * bits + b]) << np.uint64(8 * b)
        spread = _U0
        for q in range(8):
            spread |= ((w >> np.uint64(q * bits)) & mask) << np.uint64(8 * q)
        words[g] = spread


@njit(inline="always", **_JIT)
def _scale_levels(codes, lut, nrm, out, first, divide, pow2, inv, pf):
    """out[t] = v_t (``first``) or out[t] + v_t in float32, v_t = nrm · L[codes[t]], divided
    by P first when ``divide`` (x / 2^k == x · 2^−k exactly, so a power of two multiplies)."""
    if not divide:
        if first:
            for t in range(out.size):
                out[t] = nrm * lut[codes[t]]
        else:
            for t in range(out.size):
                out[t] = out[t] + nrm * lut[codes[t]]
    elif pow2:
        if first:
            for t in range(out.size):
                out[t] = (nrm * lut[codes[t]]) * inv
        else:
            for t in range(out.size):
                out[t] = out[t] + (nrm * lut[codes[t]]) * inv
    else:
        if first:
            for t in range(out.size):
                out[t] = (nrm * lut[codes[t]]) / pf
        else:
            for t in range(out.size):
                out[t] = out[t] + (nrm * lut[codes[t]]) / pf


@njit(inline="always", **_JIT)
def _max_code(codes):
    m = np.uint8(0)
    for t in range(codes.size):
        c = codes[t]
        m = c if c > m else m
    return m


def _make_decoder(bits: int):
    @njit(**_JIT)
    def kernel(flat_rows, row_size, codes_offset, n, bucket_size, lut, num_levels, norms,
               divide, out):
        """out = Σ_p (n_p·L[code_p]) / P sequentially in rank order (float32; no division
        unless ``divide``): each row is divided before it is added, so a sum of large values
        cannot overflow. Returns False if a code is not in the table (the wrapper then raises
        the oracle's error)."""
        nrows = flat_rows.size // row_size
        nbytes = (n * bits + 7) // 8
        cbuf = np.zeros(_CHUNK + 8, dtype=np.uint8)
        words = cbuf.view(np.uint64)
        tail = np.zeros(8, dtype=np.uint8)
        check = num_levels < (1 << bits)
        cmax = np.uint8(0)
        pf = np.float32(nrows)
        inv = _F32_ONE / pf
        pow2 = (nrows & (nrows - 1)) == 0  # x / 2^k == x · 2^−k exactly
        div = divide and nrows > 1
        a0 = 0
        while a0 < n:
            cnt = min(_CHUNK, n - a0)
            ngroups = (cnt + 7) >> 3
            first_byte = (a0 >> 3) * bits
            full = ngroups if first_byte + ngroups * bits <= nbytes else ngroups - 1
            for p in range(nrows):
                src = flat_rows[p * row_size + codes_offset + first_byte:
                                p * row_size + codes_offset + nbytes]
                _unpack(src, full, words, bits)
                if full < ngroups:  # the stream's last group is cut after ⌈n·b/8⌉ bytes
                    have = nbytes - first_byte - full * bits
                    for b in range(8):
                        tail[b] = src[full * bits + b] if b < have else 0
                    _unpack(tail, 1, words[full:], bits)
                codes = cbuf[:cnt]
                if check:
                    m = _max_code(codes)
                    cmax = m if m > cmax else cmax
                i = a0
                end = a0 + cnt
                k = a0 // bucket_size
                while i < end:
                    seg = min(end, (k + 1) * bucket_size)
                    _scale_levels(codes[i - a0:seg - a0], lut, norms[p, k], out[i:seg], p == 0,
                                  div, pow2, inv, pf)
                    i = seg
                    k += 1
            a0 += cnt
        return not (check and cmax >= num_levels)

    return kernel


def _specialized(factory):
    """factory(bits) → kernel, built once per bits (numba compiles it at the first call)."""
    made: dict[int, Any] = {}

    def get(bits: int):
        if not _LITTLE:
            raise NotImplementedError("horovod_aq.codec.fused runs on little-endian CPUs only; "
                                      "use horovod_aq.codec.reference")
        kernel = made.get(bits)
        if kernel is None:
            kernel = made[bits] = factory(bits)
        return kernel

    return get


_encoder = _specialized(_make_encoder)
_code_encoder = _specialized(lambda bits: _make_encoder(bits, 8))
_decoder = _specialized(_make_decoder)
