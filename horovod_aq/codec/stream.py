"""The random stream of stochastic rounding: part of the wire format (docs/format.md §6).

Every encoder — the numpy oracle, the compiled CPU kernel, the Triton GPU kernel, TensorFlow —
draws coordinate i's uniform from a counter-based generator, so the bytes are a pure function
of (gradient, level table, key) and nobody hands uniforms around:

    key      (k0, k1) = the low and high 32 bits of seed_for_rank(seed, rank)
    counter  (c0, c1, c2, c3) = (⌊i/4⌋, step mod 2³², bucket mod 2³², part mod 2³²)
    word     w = Philox4x32-10(counter, key)[i mod 4]
    uniform  u_i = ⌊w / 2⁸⌋ · 2⁻²⁴                   (exact in float32, in [0, 1 − 2⁻²⁴])

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) is
available, or easy to write, in numpy, numba, Triton, CUDA and TensorFlow, and costs a few integer
multiplies per 4 coordinates. ``step`` is the compressor's step, ``bucket`` the fused bucket's
index in its exchange, ``part`` the two-phase chunk (0 for allgather; P for the re-encoded
average). A checkpoint therefore needs the step, not a generator state.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

#: Philox4x32 multipliers and Weyl key increments (Random123).
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10
#: Bits of a Philox word kept for a float32 uniform (its mantissa plus the implicit one).
UNIFORM_BITS = 24
#: Coordinates one counter serves (the four output words).
WORDS_PER_COUNTER = 4
#: Largest payload the stream can index: c0 = ⌊i/4⌋ is a 32-bit word.
MAX_STREAM_NUMEL = WORDS_PER_COUNTER * 2**32


def seed_for_rank(seed: int, rank: int, *key: int) -> int:
    """Independent 63-bit seed of ``rank``'s random stream derived from the user's ``seed``
    (numpy's SeedSequence of [seed, rank, *key]; a stable, documented hash)."""
    entropy = [int(seed), int(rank), *(int(k) for k in key)]
    state = np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0]
    return int(state) & (2**63 - 1)


@dataclasses.dataclass(frozen=True)
class StreamKey:
    """Which stream an encode draws from: the user's seed, the rank, the compressor's step,
    the fused bucket's index and the part (docs/format.md §6)."""

    seed: int
    rank: int = 0
    step: int = 0
    bucket: int = 0
    part: int = 0

    def __post_init__(self) -> None:
        # every field an integer >= 0 (a negative step would wrap to another step's stream)
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"StreamKey {field.name} must be an integer >= 0, got "
                                f"{value!r} ({type(value).__name__})")
            if value < 0:
                raise ValueError(f"StreamKey {field.name} must be an integer >= 0, got {value}")
            object.__setattr__(self, field.name, int(value))

    def philox_key(self) -> tuple[int, int]:
        """(k0, k1): the two 32-bit key words."""
        k = seed_for_rank(self.seed, self.rank)
        return k & 0xFFFFFFFF, k >> 32

    def counter_words(self) -> tuple[int, int, int]:
        """(c1, c2, c3) = (step, bucket, part) mod 2³²."""
        return self.step % 2**32, self.bucket % 2**32, self.part % 2**32

    def scalars(self) -> tuple[int, int, int, int, int]:
        """(k0, k1, c1, c2, c3): everything a kernel needs besides the coordinate index."""
        return (*self.philox_key(), *self.counter_words())


def _mulhilo(a: int, b: Any, rshift: Callable[[Any, int], Any]) -> tuple[Any, Any]:
    """(high, low) 32-bit halves of a·b for a constant a < 2³² and b holding 32-bit values in a
    signed 64-bit integer array: b is split into 16-bit halves so that no partial product
    reaches 2⁶³ (numpy, torch and TensorFlow int64 arithmetic alike)."""
    b_lo, b_hi = b & 0xFFFF, rshift(b, 16)
    p_lo, p_hi = b_lo * a, b_hi * a                       # each < 2⁴⁸
    low_sum = p_lo + (p_hi & 0xFFFF) * 65536              # < 2⁴⁹
    return rshift(p_hi, 16) + rshift(low_sum, 32), low_sum & 0xFFFFFFFF


def philox4x32(counter: tuple[Any, Any, Any, Any], key: tuple[int, int], *,
               rounds: int = PHILOX_ROUNDS,
               rshift: Callable[[Any, int], Any] = operator.rshift) -> tuple[Any, ...]:
    """Philox4x32-``rounds`` of ``counter`` (four int64 arrays or tensors of 32-bit values,
    broadcast together) under ``key``; returns the four output words, same type.

    One round: (hi₀, lo₀) = M0·c0, (hi₁, lo₁) = M1·c2,
    c ← (hi₁ ⊕ c1 ⊕ k0, lo₁, hi₀ ⊕ c3 ⊕ k1, lo₀); between rounds k ← k + (W0, W1) mod 2³².
    Written with ``&``, ``^``, ``+``, ``*`` and ``rshift`` only, so the one definition serves
    numpy (the oracle), torch and TensorFlow (whose tensors lack ``>>``: pass
    ``tf.bitwise.right_shift``).
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key[0] & 0xFFFFFFFF, key[1] & 0xFFFFFFFF
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + PHILOX_W0) & 0xFFFFFFFF, (k1 + PHILOX_W1) & 0xFFFFFFFF
        hi0, lo0 = _mulhilo(PHILOX_M0, c0, rshift)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2, rshift)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def words_to_uniforms(words: np.ndarray) -> np.ndarray:
    """u = ⌊w / 2⁸⌋ · 2⁻²⁴ as float32 (exact: 24 significant bits)."""
    top = np.asarray(words, dtype=np.int64) >> (32 - UNIFORM_BITS)
    return top.astype(np.float32) * np.float32(2.0**-UNIFORM_BITS)


def key_scalars(key: StreamKey | tuple[int, int, int, int, int]) -> tuple[int, ...]:
    """(k0, k1, c1, c2, c3) of a :class:`StreamKey`, or such a tuple itself (as the kernels
    pass them)."""
    if isinstance(key, StreamKey):
        return key.scalars()
    k0, k1, c1, c2, c3 = (int(v) for v in key)
    return k0 & 0xFFFFFFFF, k1 & 0xFFFFFFFF, c1 % 2**32, c2 % 2**32, c3 % 2**32


def stream_uniforms(n: int, key: StreamKey | tuple[int, int, int, int, int],
                    start: int = 0) -> np.ndarray:
    """The float32 uniforms of coordinates ``start`` … ``start + n − 1`` of ``key``'s stream
    (a :class:`StreamKey` or its :meth:`~StreamKey.scalars`)."""
    if n < 0 or start < 0 or start + n > MAX_STREAM_NUMEL:
        raise ValueError(f"the stream indexes coordinates 0..{MAX_STREAM_NUMEL - 1}; asked for "
                         f"{start}..{start + n - 1}")
    if n == 0:
        return np.zeros(0, np.float32)
    k0, k1, c1, c2, c3 = key_scalars(key)
    first, last = start // WORDS_PER_COUNTER, (start + n - 1) // WORDS_PER_COUNTER
    c0 = np.arange(first, last + 1, dtype=np.int64)
    fill = [np.full_like(c0, c) for c in (c1, c2, c3)]
    words = np.stack(philox4x32((c0, *fill), (k0, k1)), axis=1).reshape(-1)
    offset = start - first * WORDS_PER_COUNTER
    return words_to_uniforms(words[offset:offset + n])
