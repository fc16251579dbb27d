"""The entropy-coded body of a payload (``FLAG_ENTROPY``): layout, symbol model, sizes, checks.

docs/format.md §12 is the full description. A payload with ``FLAG_ENTROPY`` keeps the 32-byte
header and the norms of §1–§3; its codes section is replaced by::

    CODER HEADER (16) | STATES (4·K·nblk) | COUNTS (2·nblk) | CODE TABLE (2·N) | WORDS (2·W)

    size = 32 + 4·⌈n/B⌉ + 16 + (4K + 2)·nblk + 2N + 2W        (``entropy_payload_size``)

* **Symbols.** g = ⌊8/b⌋ consecutive codes form one symbol s = Σ_q code_{g·i+q} << (q·b)
  (``GROUPS``: 8, 4, 2, 2, 1, 1, 1, 1 codes for b = 1 … 8; an alphabet of 2^(g·b) ≤ 256), so
  one coder step carries g codes. The last symbol is padded with copies of the last code.
* **Model** (per payload, sent: no codebook is agreed in advance). CODE TABLE: the codes'
  frequencies t_j (u16, Σ t_j = 2^15, t_j ≥ 1 iff code j occurs; ``code_table``). Symbol
  frequencies: the product model w_s = Π_q t_{code_q(s)}, normalized to f_s with
  Σ f_s = 2^PRECISION (``normalize_frequencies``), c_s = Σ_{s' < s} f_{s'} (``symbol_model``).
* **Coder.** Interleaved rANS (Duda 2013; Giesen's ryg_rans with 16-bit words; the lane layout
  of DietGPU): state x ∈ [2^16, 2^32), K = 32 lanes, blocks of K·T symbols (T = 1024 steps);
  symbol i of a block goes to lane i mod K at step ⌊i/K⌋. Encoding runs backwards; decoding a
  step reads, lane by lane, one 16-bit word for each lane whose state fell below 2^16, from one
  stream per block (``horovod_aq.codec.rans``). STATES are the encoder's final states (the
  decoder's initial ones), COUNTS the words of each block, WORDS the blocks' streams in order.

The size is data-dependent; the coder header holds it (u64, ``coded size``), and a receiver
checks it against the buffer and against the formula above before it reads anything else.

This module imports numpy only, never torch or tensorflow.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from horovod_aq.codec.format import (
    HEADER_SIZE,
    NORM_BYTES,
    Header,
    PayloadError,
    num_buckets,
)

__all__ = [
    "BLOCK_SYMBOLS", "CODER_HEADER_FORMAT", "CODER_HEADER_SIZE", "CODE_TABLE_BITS", "GROUPS",
    "LANES", "PRECISION", "STATE_LOW", "STEPS", "Body", "Sections", "check_body", "code_table",
    "coder_fields", "sections",
    "empirical_entropy",
    "entropy_payload_size", "group_symbols", "normalize_frequencies", "num_blocks",
    "num_symbols", "parse_body", "payload_length", "symbol_codes", "symbol_model",
]

#: Codes per symbol for b = 1 … 8 bits: g = ⌊8/b⌋ (the alphabet 2^(g·b) stays ≤ 256).
GROUPS = {b: 8 // b for b in range(1, 9)}
#: rANS precision: symbol frequencies sum to 2^PRECISION (docs/format.md §12).
PRECISION = 14
#: Precision of the CODE TABLE: code frequencies sum to 2^CODE_TABLE_BITS (u16 entries).
CODE_TABLE_BITS = 15
#: Interleaved lanes per block and steps per lane: a block holds LANES·STEPS symbols.
LANES = 32
STEPS = 1024
BLOCK_SYMBOLS = LANES * STEPS
#: Lower end of the rANS state interval [2^16, 2^32); words are 16 bits.
STATE_LOW = 1 << 16
WORD_BITS = 16
#: Coder header: coded size (u64), precision, codes per symbol, log2 lanes, log2 steps (u8 each),
#: reserved (u32, 0).
CODER_HEADER_FORMAT = "<QBBBBI"
CODER_HEADER_SIZE = struct.calcsize(CODER_HEADER_FORMAT)
STATE_BYTES = 4
COUNT_BYTES = 2
TABLE_BYTES = 2
WORD_BYTES = 2

assert CODER_HEADER_SIZE == 16 and BLOCK_SYMBOLS < 1 << 16  # a block's count fits a u16


# --------------------------------------------------------------------------------------- sizes


def num_symbols(numel: int, bits: int) -> int:
    """⌈n/g⌉: the symbols of n codes of b bits."""
    return -(-numel // GROUPS[bits])


def num_blocks(numel: int, bits: int) -> int:
    """⌈⌈n/g⌉ / (K·T)⌉: the coder blocks of n codes."""
    return -(-num_symbols(numel, bits) // BLOCK_SYMBOLS)


def _body_offset(numel: int, bucket_size: int) -> int:
    return HEADER_SIZE + NORM_BYTES * num_buckets(numel, bucket_size)


def entropy_payload_size(numel: int, bits: int, bucket_size: int, num_levels: int,
                         words: int) -> int:
    """Exact size of an entropy-coded payload holding ``words`` 16-bit words:
    32 + 4·⌈n/B⌉ + 16 + (4K + 2)·nblk + 2N + 2W (the WORDS start after the rest)."""
    return sections(numel, bits, bucket_size, num_levels).words + WORD_BYTES * words


@dataclass(frozen=True)
class Sections:
    """Byte offsets of an entropy-coded payload's sections (docs/format.md §12) for (n, b, B,
    N): CODER HEADER at ``coder``, STATES at ``states``, COUNTS at ``counts``, CODE TABLE at
    ``table``, WORDS from ``words`` on; ``blocks`` = nblk."""

    coder: int
    states: int
    counts: int
    table: int
    words: int
    blocks: int


def sections(numel: int, bits: int, bucket_size: int, num_levels: int) -> Sections:
    """Where the sections of an entropy-coded payload of these settings start."""
    nblk = num_blocks(numel, bits)
    coder = _body_offset(numel, bucket_size)
    states = coder + CODER_HEADER_SIZE
    counts = states + STATE_BYTES * LANES * nblk
    table = counts + COUNT_BYTES * nblk
    return Sections(coder, states, counts, table, table + TABLE_BYTES * num_levels, nblk)


def coder_fields(bits: int) -> tuple[int, int, int, int, int]:
    """(precision, codes per symbol, log2 lanes, log2 steps, reserved): the coder header's
    fields after the coded size that this build reads at ``bits``."""
    return PRECISION, GROUPS[bits], LANES.bit_length() - 1, STEPS.bit_length() - 1, 0


def payload_length(buf: Any) -> int:
    """The exact byte length of the payload that starts ``buf``, read from its headers: the
    fixed-width size of §1, or an entropy-coded payload's coded size (checked by the decoder
    against the buffer). Needs the 32 header bytes, and the coder header for ``FLAG_ENTROPY``."""
    from horovod_aq.codec.format import as_bytes, parse_header

    data = as_bytes(buf)
    header = parse_header(data)
    if not header.entropy:
        return header.payload_size
    start = _body_offset(header.numel, header.bucket_size)
    if data.size < start + CODER_HEADER_SIZE:
        raise PayloadError(f"entropy-coded payload is truncated: {data.size} bytes, shorter "
                           f"than its norms and coder header ({start + CODER_HEADER_SIZE})")
    return struct.unpack_from("<Q", data[start:start + 8].tobytes())[0]


# ------------------------------------------------------------------------------------ symbols


def group_symbols(codes: np.ndarray, bits: int) -> np.ndarray:
    """The uint8 symbols of n codes: s_i = Σ_q code_{g·i+q} << (q·b), the last group padded
    with copies of the last code."""
    g = GROUPS[bits]
    codes = np.asarray(codes, dtype=np.uint8)
    nsym = -(-codes.size // g)
    padded = np.empty(nsym * g, np.uint8)
    padded[:codes.size] = codes
    if codes.size:
        padded[codes.size:] = codes[-1]
    shifts = (np.arange(g, dtype=np.uint32) * bits)
    return (padded.reshape(nsym, g).astype(np.uint32) << shifts).sum(axis=1).astype(np.uint8)


def symbol_codes(bits: int) -> np.ndarray:
    """[2^(g·b), g] uint8: the codes of every symbol, in stream order."""
    g = GROUPS[bits]
    s = np.arange(1 << (g * bits), dtype=np.uint32)[:, None]
    shifts = np.arange(g, dtype=np.uint32)[None, :] * bits
    return ((s >> shifts) & ((1 << bits) - 1)).astype(np.uint8)


# -------------------------------------------------------------------------------------- model


def normalize_frequencies(weights: Any, total_bits: int) -> np.ndarray:
    """Integer frequencies f (int64) with Σ f = 2^total_bits and f_s ≥ 1 exactly where w_s > 0.

    1. f_s = max(1, ⌊w_s·M/W⌋) where w_s > 0 (M = 2^total_bits, W = Σ w, float64);
    2. a deficit d = M − Σ f > 0 goes, one each, to the d largest remainders w_s·M/W − ⌊·⌋
       (ties: the smaller s; d is below the number of symbols present);
    3. an excess is taken from the largest f (ties: the smaller s), never below 1.

    Deterministic: every implementation calls this one function on the host.
    """
    w = np.asarray(weights, dtype=np.float64)
    total = 1 << total_bits
    present = w > 0
    if not present.any():
        raise ValueError("normalize_frequencies needs at least one positive weight")
    scaled = w * (total / w.sum())
    f = np.floor(scaled).astype(np.int64)
    f[present & (f == 0)] = 1
    d = total - int(f.sum())
    if d > 0:
        order = np.argsort(np.where(present, np.floor(scaled) - scaled, 1.0), kind="stable")
        f[order[:d]] += 1
    while d < 0:
        j = int(np.argmax(f))
        take = min(-d, int(f[j]) - 1)
        f[j] -= take
        d += take
    return f


def code_table(codes: np.ndarray, num_levels: int) -> np.ndarray:
    """The CODE TABLE of a payload: u16 frequencies of its n ≥ 1 codes, Σ = 2^15."""
    counts = np.bincount(np.asarray(codes).reshape(-1), minlength=num_levels)[:num_levels]
    return normalize_frequencies(counts, CODE_TABLE_BITS).astype(np.uint16)


def symbol_model(table: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(f, c): the rANS frequencies (Σ f = 2^PRECISION) and cumulative starts of the 2^(g·b)
    symbols under the product model w_s = Π_q t_{code_q(s)} of the CODE TABLE t (int64)."""
    t = np.zeros(1 << bits, np.float64)
    t[:len(table)] = np.asarray(table, dtype=np.float64)
    w = np.prod(t[symbol_codes(bits)], axis=1)
    f = normalize_frequencies(w, PRECISION)
    c = np.concatenate([[0], np.cumsum(f)[:-1]]).astype(np.int64)
    return f, c


def empirical_entropy(codes: Any, num_levels: int) -> float:
    """H = −Σ_j p_j log₂ p_j of the codes' histogram, in bits per code (0 for no codes)."""
    counts = np.bincount(np.asarray(codes).reshape(-1), minlength=num_levels).astype(np.float64)
    if counts.sum() == 0:
        return 0.0
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


# ------------------------------------------------------------------------------- body sections


@dataclass(frozen=True)
class Body:
    """The checked sections of an entropy-coded body (views into the payload)."""

    nsym: int             #: symbols ⌈n/g⌉
    states: np.ndarray    #: [nblk, K] uint32: the decoder's initial states
    counts: np.ndarray    #: [nblk] int64: words of each block
    table: np.ndarray     #: [N] uint16: the CODE TABLE
    words: np.ndarray     #: [W] uint16: the blocks' word streams, in block order


def _refuse(message: str) -> None:
    raise PayloadError(message)


def parse_body(data: np.ndarray, header: Header) -> Body:
    """Check an entropy-coded payload's coder header and length; return its sections
    (docs/format.md §12 lists the checks, in this order). Nothing is sized by a field before
    the buffer length has confirmed it. ``check_body`` checks the sections' contents."""
    n, bits, nlev = header.numel, header.bits, header.num_levels
    at = sections(n, bits, header.bucket_size, nlev)
    start = at.coder
    fixed_part = at.words
    if n == 0 or data.size < fixed_part:
        _refuse(f"entropy-coded payload is truncated: {data.size} bytes, but its header "
                f"(n={n}, bits={bits}, bucket_size={header.bucket_size}, {nlev} levels) needs "
                f"at least {fixed_part}" if n else
                "entropy-coded payload has n = 0 (an empty gradient is a fixed-width payload)")
    size, prec, group, log_lanes, log_steps, reserved = struct.unpack(
        CODER_HEADER_FORMAT, data[start:start + CODER_HEADER_SIZE].tobytes())
    want = coder_fields(bits)
    if (prec, group, log_lanes, log_steps, reserved) != want:
        _refuse(f"entropy coder header has (precision, group, log2 lanes, log2 steps, reserved) "
                f"= {(prec, group, log_lanes, log_steps, reserved)} but this build reads {want} "
                "for this bit width (written by a newer format revision, or corrupted)")
    if size != data.size:
        _refuse(f"entropy-coded payload length mismatch: its coder header states {size} bytes "
                f"but the buffer holds {data.size} (truncated, too long, or a forged length)")
    nblk = at.blocks
    states = data[at.states:at.counts].view("<u4").reshape(nblk, LANES)
    counts = data[at.counts:at.table].view("<u2").astype(np.int64)
    table = data[at.table:at.words].view("<u2")
    words = int(counts.sum())
    if data.size != at.words + WORD_BYTES * words:
        _refuse(f"entropy-coded payload length mismatch: its block counts hold {words} words, "
                f"{at.words + WORD_BYTES * words} bytes in all, but the payload has {data.size}")
    return Body(num_symbols(n, bits), states, counts, table, data[at.words:].view("<u2"))


def check_body(body: Body) -> None:
    """``PayloadError`` unless the CODE TABLE sums to 2^15 and every state is ≥ 2^16 (the data
    checks of an entropy-coded body that precede decoding, after the norms')."""
    total = int(body.table.astype(np.int64).sum())
    if total != 1 << CODE_TABLE_BITS:
        _refuse(f"entropy-coded payload's code table sums to {total}, not 2^{CODE_TABLE_BITS} "
                "(corrupted data)")
    if body.states.size and int(body.states.min()) < STATE_LOW:
        _refuse(f"entropy-coded payload holds coder state {int(body.states.min())} below 2^16 "
                "(corrupted coder state)")
