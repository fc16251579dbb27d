"""Fixed level families and the table-repair helper shared by the fitting code.

Spec: ``docs/quantizers.md`` §2. Every family is returned as one signed, sorted float64 table on
[−1, 1] with endpoints ±1 and the sign folded in, valid for ``table.validate_levels``:

==========================  ===========================================  ===============
family                      levels                                       N
==========================  ===========================================  ===============
``uniform(b)`` (U-ref)      ℓ_k = −1 + 2k/(N − 1), no zero for even N    2^b
``uniform_with_zero(s)``    {−1, …, −1/s, 0, 1/s, …, 1} (U-paper)        2s + 1
``exponential(b, p)``       ±{p^(K−1), …, p, 1}, K = 2^(b−1) (E-ref)     2^b
``ternary()``               {−1, 0, 1} (TernGrad)                        3
``natural(b)``              ±{0, 2^(1−s), …, 1/2, 1}, s = 2^(b−1) − 1    2^b − 1
==========================  ===========================================  ===============

``separate_levels`` turns a sorted candidate (a fit whose levels nearly collided, or an
exponential table whose smallest levels underflowed) into a valid table by pushing levels apart
to a minimal gap, changing nothing in a table that is already well separated.
"""

from __future__ import annotations

import logging
import math
import operator

import numpy as np

from horovod_aq.levels.table import MAX_BITS, validate_levels

__all__ = [
    "MIN_RELATIVE_GAP",
    "check_bits",
    "exponential",
    "natural",
    "separate_levels",
    "ternary",
    "uniform",
    "uniform_with_zero",
]

logger = logging.getLogger(__name__)

#: A table counts as well separated when every gap ℓ_{j+1} − ℓ_j is at least this fraction of
#: max(|ℓ_j|, |ℓ_{j+1}|) (about 8 float32 ulps, so float32 rounding keeps the order). Exponential
#: tables with p ≤ 1 − 2⁻²⁰ always are; fitted tables almost always are.
MIN_RELATIVE_GAP = 2.0**-20
# separate_levels works in t = asinh(ℓ/τ): relative spacing for |ℓ| ≫ τ, absolute spacing τ·gap
# (a normal float32 number, 2⁻¹¹⁹) near zero.
_ASINH_SCALE = 2.0**-100
_REPAIR_GAP = 2.0 * MIN_RELATIVE_GAP


def check_bits(bits: object, *, minimum: int = 1) -> int:
    """Return ``bits`` as an int after checking minimum ≤ bits ≤ 8 (ValueError otherwise)."""
    if isinstance(bits, bool):
        raise ValueError(f"bits must be an integer in {minimum}..{MAX_BITS}, got {bits!r}")
    try:
        b = operator.index(bits)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"bits must be an integer in {minimum}..{MAX_BITS}, got {bits!r}"
        ) from None
    if not minimum <= b <= MAX_BITS:
        raise ValueError(f"bits must be in {minimum}..{MAX_BITS}, got {b}")
    return b


def _mirror(positive: np.ndarray, *, zero: bool) -> np.ndarray:
    """Signed table from increasing positive magnitudes: −x[::-1] (, 0), x."""
    parts = [-positive[::-1], np.zeros(1)] if zero else [-positive[::-1]]
    return np.concatenate(parts + [positive]).astype(np.float64)


def uniform(bits: int) -> np.ndarray:
    """U-ref (§2.1): N = 2^b levels ℓ_k = −1 + 2k/(N − 1); zero-free for b ≥ 1. QSGD default."""
    b = check_bits(bits)
    n = 2**b
    k = np.arange(n, dtype=np.float64)
    # compute from both ends so the table is exactly antisymmetric
    left = -1.0 + 2.0 * k / (n - 1)
    right = 1.0 - 2.0 * (n - 1 - k) / (n - 1)
    levels = np.where(k < n / 2, left, right)
    return validate_levels(levels)


def uniform_with_zero(s: int) -> np.ndarray:
    """U-paper (§2.1): {−1, …, −1/s, 0, 1/s, …, 1}, N = 2s + 1 (1 ≤ s ≤ 127).

    With the sign folded in this takes ⌈log₂(2s + 1)⌉ bits; s = 2^(b−1) − 1 fits in b bits.
    """
    if isinstance(s, bool):
        raise ValueError(f"s must be an integer in 1..127, got {s!r}")
    try:
        s = operator.index(s)
    except TypeError:
        raise ValueError(f"s must be an integer in 1..127, got {s!r}") from None
    if not 1 <= s <= (2**MAX_BITS - 1) // 2:
        raise ValueError(f"s must be in 1..{(2**MAX_BITS - 1) // 2}, got {s}")
    positive = np.arange(1, s + 1, dtype=np.float64) / s
    return validate_levels(_mirror(positive, zero=True))


def exponential(bits: int, p: float = 0.5) -> np.ndarray:
    """E-ref (§2.2), also AMQ's family (§8): ±{p^(K−1), …, p, 1} with K = 2^(b−1), p ∈ (0, 1).

    b = 1 gives {−1, 1}. If small p and many bits make the innermost levels underflow or collide
    in float32, they are pushed apart by ``separate_levels`` (logged at debug level).
    """
    b = check_bits(bits)
    p = float(p)
    if not (math.isfinite(p) and 0.0 < p < 1.0):
        raise ValueError(f"the multiplier p must lie in (0, 1), got {p!r}")
    k_pos = 2 ** (b - 1)
    positive = p ** np.arange(k_pos - 1, -1, -1, dtype=np.float64)
    return separate_levels(_mirror(positive, zero=False))


def ternary() -> np.ndarray:
    """TernGrad (§2.3): {−1, 0, 1}."""
    return validate_levels([-1.0, 0.0, 1.0])


def natural(bits: int) -> np.ndarray:
    """Natural dithering (§2.4): ±{0, 2^(1−s), …, 1/2, 1} with s = 2^(b−1) − 1; 2^b − 1 levels.

    Needs b ≥ 2 (b = 1 would leave no nonzero magnitude below 1).
    """
    b = check_bits(bits, minimum=2)
    s = 2 ** (b - 1) - 1
    positive = np.ldexp(1.0, np.arange(1 - s, 1))
    return validate_levels(_mirror(positive, zero=True))


def _well_separated(levels: np.ndarray) -> bool:
    try:
        validate_levels(levels)
    except ValueError:
        return False
    gaps = np.diff(levels)
    scale = np.maximum(np.abs(levels[:-1]), np.abs(levels[1:]))
    return bool(np.all(gaps >= MIN_RELATIVE_GAP * scale))


def _push_apart(t: np.ndarray, first_min: float, last: float, gap: float) -> np.ndarray:
    """Smallest moves making t increasing with steps ≥ gap, t[0] ≥ first_min, t ≤ last − …."""
    t = t.copy()
    t[0] = max(t[0], first_min)
    for j in range(1, t.size):  # forward: push right
        t[j] = max(t[j], t[j - 1] + gap)
    t[-1] = min(t[-1], last)
    for j in range(t.size - 2, -1, -1):  # backward: pull left below the fixed end
        t[j] = min(t[j], t[j + 1] - gap)
    return t


def _move_in_asinh(x: np.ndarray, first_min: float, t_end: float) -> np.ndarray:
    """Push the increasing values x apart in t = asinh(x/τ); unmoved values are kept exactly."""
    t = np.arcsinh(x / _ASINH_SCALE)
    t_new = _push_apart(t, first_min, t_end, _REPAIR_GAP)
    out = x.copy()
    moved = t_new != t
    out[moved] = _ASINH_SCALE * np.sinh(t_new[moved])
    return out


def separate_levels(levels: object) -> np.ndarray:
    """Return a valid table close to ``levels`` (sorted, −1 and 1 at the ends).

    If every gap already satisfies ℓ_{j+1} − ℓ_j ≥ MIN_RELATIVE_GAP·max(|ℓ_j|, |ℓ_{j+1}|) and the
    table passes ``validate_levels``, it is returned unchanged (bit for bit). Otherwise levels are
    pushed apart in t = asinh(ℓ/τ), τ = 2⁻¹⁰⁰, to gaps of 2·MIN_RELATIVE_GAP: relative spacing
    away from zero, absolute spacing ~2⁻¹¹⁹ at zero — only the levels that violate the gap move,
    the ends stay ±1, and a symmetric table stays exactly symmetric.
    """
    L = np.array(levels, dtype=np.float64, copy=True).reshape(-1)
    if L.size < 2:
        raise ValueError("a level table needs at least 2 levels")
    if not np.all(np.isfinite(L)):
        raise ValueError("a level table must contain only finite values")
    L = np.sort(np.clip(L, -1.0, 1.0))
    L[0], L[-1] = -1.0, 1.0
    if _well_separated(L):
        return validate_levels(L)
    t_end = float(np.arcsinh(1.0 / _ASINH_SCALE))
    n = L.size
    if np.array_equal(L, -L[::-1]):
        # symmetric: repair the positive half and mirror it (exact symmetry is kept)
        half = n // 2
        pos = L[n - half :]  # strictly positive half (odd n: the middle level is 0)
        first_min = _REPAIR_GAP if n % 2 else 0.5 * _REPAIR_GAP
        pos = _move_in_asinh(pos, first_min, t_end)
        out = _mirror(pos, zero=bool(n % 2))
    else:
        out = _move_in_asinh(L, -t_end, t_end)
    moved = int(np.count_nonzero(out != L))
    out[0], out[-1] = -1.0, 1.0
    logger.debug("separate_levels moved %d of %d levels", moved, n)
    return validate_levels(out)
