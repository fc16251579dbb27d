"""Interleaved rANS of the entropy-coded body, in numpy: the oracle (docs/format.md §12).

With M = 2^PRECISION, frequencies f_s and starts c_s (``entropy_format.symbol_model``), a state
x ∈ [L, 2^32), L = 2^16, and 16-bit words (Duda, "Asymmetric numeral systems", 2013; the word
variant of Giesen's ryg_rans):

    encode s:  if x ≥ f_s · 2^(32 − PRECISION): emit x mod 2^16, x ← ⌊x / 2^16⌋
               x ← ⌊x / f_s⌋ · M + (x mod f_s) + c_s
    decode:    slot = x mod M, s = the symbol with c_s ≤ slot < c_s + f_s,
               x ← f_s · ⌊x / M⌋ + slot − c_s;  if x < L: x ← x · 2^16 + next word

One word at most moves per symbol either way (PRECISION ≤ 16). A block of K·T symbols gives
symbol i to lane i mod K at step ⌊i/K⌋. The encoder starts every lane at x = L and runs from
the last step to the first, in each step from the last lane to the first; the decoder starts
from the encoder's final states (STATES) and runs forward, each step reading the words of the
lanes that need one in lane order from its block's stream. So the stream is the emitted words in
reverse order, and a decoder that ends a block with every lane back at L and every word read
has decoded what was encoded (a corrupted or forged stream is refused, ``PayloadError``).

Here every step is one vectorized operation over all blocks and lanes (T iterations at most).
"""

from __future__ import annotations

import numpy as np

from horovod_aq.codec.entropy_format import (
    BLOCK_SYMBOLS,
    LANES,
    PRECISION,
    STATE_LOW,
    STEPS,
    WORD_BITS,
    Body,
)
from horovod_aq.codec.format import PayloadError

__all__ = ["decode_symbols", "encode_symbols", "slot_symbols"]

_MASK = (1 << PRECISION) - 1
_WORD_MASK = (1 << WORD_BITS) - 1


def _grid(nsym: int) -> tuple[int, int, np.ndarray]:
    """(blocks, steps in use, valid [nblk, steps, K]) for nsym symbols."""
    nblk = -(-nsym // BLOCK_SYMBOLS)
    steps = STEPS if nblk > 1 else -(-nsym // LANES)
    index = np.arange(nblk * STEPS * LANES, dtype=np.int64).reshape(nblk, STEPS, LANES)
    return nblk, steps, index[:, :steps] < nsym


def encode_symbols(symbols: np.ndarray, f: np.ndarray, c: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(states [nblk, K] uint32, counts [nblk] int64, words uint16) of the nsym ≥ 1 symbols."""
    nsym = symbols.size
    nblk, steps, valid = _grid(nsym)
    padded = np.zeros(nblk * BLOCK_SYMBOLS, np.int64)
    padded[:nsym] = symbols
    sym = padded.reshape(nblk, STEPS, LANES)
    f = np.asarray(f, np.uint64)
    c = np.asarray(c, np.uint64)
    x = np.full((nblk, LANES), STATE_LOW, np.uint64)
    emitted = np.zeros((steps, nblk, LANES), bool)
    values = np.zeros((steps, nblk, LANES), np.uint16)
    for t in range(steps - 1, -1, -1):
        s, v = sym[:, t], valid[:, t]
        fs = f[s]
        emit = v & (x >= fs << np.uint64(32 - PRECISION))
        emitted[t] = emit
        values[t] = (x & np.uint64(_WORD_MASK)).astype(np.uint16)
        x = np.where(emit, x >> np.uint64(WORD_BITS), x)
        q = x // np.maximum(fs, np.uint64(1))
        coded = (q << np.uint64(PRECISION)) + (x - q * fs) + c[s]
        x = np.where(v, coded, x)
    order = emitted.transpose(1, 0, 2)                     # [nblk, steps, K]: decoder order
    words = values.transpose(1, 0, 2)[order]
    return x.astype(np.uint32), order.sum(axis=(1, 2)).astype(np.int64), words


def slot_symbols(f: np.ndarray) -> np.ndarray:
    """[M] uint8: the symbol of every slot (c_s ≤ slot < c_s + f_s)."""
    return np.repeat(np.arange(f.size, dtype=np.uint8), f)


def decode_symbols(body: Body, f: np.ndarray, c: np.ndarray) -> np.ndarray:
    """The nsym symbols of a checked body (``entropy_format.parse_body``) as uint8.

    Raises ``PayloadError`` if a block's stream ends before its lanes do ("decodes past its
    end"), leaves words unread, or a lane does not end at L (a corrupted coder state)."""
    nblk, steps, valid = _grid(body.nsym)
    lookup = slot_symbols(f)
    f = np.asarray(f, np.uint64)
    c = np.asarray(c, np.uint64)
    words = body.words.astype(np.uint64)
    end = np.cumsum(body.counts)
    ptr = end - body.counts
    x = body.states.astype(np.uint64)
    out = np.zeros((nblk, steps, LANES), np.uint8)
    for t in range(steps):
        v = valid[:, t]
        slot = x & np.uint64(_MASK)
        s = lookup[slot]
        decoded = f[s] * (x >> np.uint64(PRECISION)) + slot - c[s]
        x = np.where(v, decoded, x)
        need = v & (x < np.uint64(STATE_LOW))
        at = ptr[:, None] + np.cumsum(need, axis=1) - need
        past = need & (at >= end[:, None])
        if past.any():
            b = int(np.argmax(past.any(axis=1)))
            raise PayloadError(
                f"entropy-coded payload decodes past its end: block {b} of {nblk} needs more "
                f"than its {int(body.counts[b])} words (corrupted data or a forged length)")
        if words.size:
            got = words[np.minimum(at, words.size - 1)]
            x = np.where(need, (x << np.uint64(WORD_BITS)) | got, x)
        ptr = ptr + need.sum(axis=1)
        out[:, t] = s
    left = end - ptr
    if left.any():
        b = int(np.argmax(left != 0))
        raise PayloadError(
            f"entropy-coded payload leaves {int(left[b])} of the {int(body.counts[b])} words of "
            f"block {b} unread (corrupted data or a forged length)")
    bad = x != np.uint64(STATE_LOW)
    if bad.any():
        b, lane = (int(i) for i in np.argwhere(bad)[0])
        raise PayloadError(
            f"entropy-coded payload's block {b} lane {lane} ends in coder state {int(x[b, lane])}"
            ", not 2^16 (corrupted coder state)")
    return out.reshape(-1)[:body.nsym]  # [nblk, steps, K] is payload order (block, step, lane)
