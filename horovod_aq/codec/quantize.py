"""Steps 1–4, 6 and 8 of the numpy oracle's arithmetic: input checks, bucket norms, normalizing,
stochastic rounding onto the level table, dequantizing, and the uniforms (the definitions are
the module docstring of ``horovod_aq.codec.reference``, ``docs/format.md`` §5).

A leaf of the oracle: ``codec.reference`` (the fixed-width payload) and ``codec.entropy`` (the
entropy-coded one) quantize with these functions, so both write the same codes for the same
uniforms. This module imports numpy only, never torch or tensorflow.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from horovod_aq.codec.format import (
    as_table,
    check_bucket_size,
    check_finite,
    check_norm,
    check_norms,
    float32_levels,
)
from horovod_aq.codec.stream import StreamKey, stream_uniforms
from horovod_aq.levels.table import LevelTable

__all__ = [
    "as_float32_flat",
    "bucket_norms",
    "dequantize",
    "draw_uniforms",
    "is_float_dtype",
    "normalized",
    "pairwise_sum_rows",
    "prepare",
    "quantize_codes",
    "round_codes",
    "rounding_variance",
]


# ------------------------------------------------------------------------------- input checks


def is_float_dtype(dtype: np.dtype) -> bool:
    # ml_dtypes' bfloat16 / float8 register as kind "V"; accept them by name.
    return dtype.kind == "f" or dtype.name.startswith(("bfloat16", "float8"))


def as_float32_flat(x: Any) -> np.ndarray:
    """x flattened and cast to float32, after checking it is floating point and finite."""
    arr = np.asarray(x)
    if not is_float_dtype(arr.dtype):
        raise ValueError(f"expected a floating-point gradient, got dtype {arr.dtype}")
    with np.errstate(over="ignore"):  # values beyond float32 become ±Inf and are reported
        flat = arr.reshape(-1).astype(np.float32, copy=False)
    check_finite(flat)
    return flat


def draw_uniforms(n: int, seed: Any = None, uniforms: Any = None,
                  key: StreamKey | None = None) -> np.ndarray:
    """The n float32 uniforms of step 8: ``uniforms`` checked (shape (n,), values in [0, 1)
    after rounding to float32); else the format's stream of ``key`` (``codec.stream``: what
    every kernel draws); else drawn from ``seed`` (int, Generator or None; numpy's own
    generator, for tests and tools that need no cross-framework bytes)."""
    if key is not None and uniforms is None:
        return stream_uniforms(n, key)
    if uniforms is not None:
        u = np.asarray(uniforms)
        if u.shape != (n,):
            raise ValueError(f"uniforms must have shape ({n},), got {u.shape}")
        u = u.astype(np.float32, copy=False)
        if n and not (u.min() >= 0.0 and u.max() < 1.0):
            raise ValueError("uniforms must lie in [0, 1) after rounding to float32")
        return u
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    return rng.random(n, dtype=np.float32)


# ----------------------------------------------------------------------------------- buckets


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _bucket_matrix(flat: np.ndarray, bucket_size: int, width: int, dtype: Any) -> np.ndarray:
    """[⌈n/B⌉, width] matrix of the buckets (rows), zero-padded on the right."""
    n = flat.size
    nb = -(-n // bucket_size)
    rows = np.zeros((nb, width), dtype=dtype)
    full = (n // bucket_size) * bucket_size
    length = min(bucket_size, width)
    rows[: n // bucket_size, :length] = flat[:full].reshape(-1, bucket_size)[:, :length]
    if full < n:
        rows[-1, : n - full] = flat[full:]
    return rows


def pairwise_sum_rows(rows: np.ndarray) -> np.ndarray:
    """Row sums in the canonical pairwise order (module docstring, step 2). Width: power of 2."""
    width = rows.shape[1]
    assert width & (width - 1) == 0, "width must be a power of two"
    while width > 1:
        width //= 2
        rows = rows[:, :width] + rows[:, width:]
    return rows[:, 0]


def bucket_norms(x: Any, bucket_size: int, norm: str = "l2") -> np.ndarray:
    """float32 norm of every bucket of the flattened float32 x (step 2), the partial one included.

    l2 accumulates the squares in float64 in the canonical pairwise order; linf is max |x_i|.
    """
    flat = as_float32_flat(x)
    bucket_size = check_bucket_size(bucket_size)
    norm = check_norm(norm)
    if flat.size == 0:
        return np.zeros(0, dtype=np.float32)
    length = min(bucket_size, flat.size)
    if norm == "linf":
        return np.abs(_bucket_matrix(flat, bucket_size, length, np.float32)).max(axis=1)
    rows = _bucket_matrix(flat, bucket_size, _next_pow2(length), np.float64)
    with np.errstate(over="ignore"):  # an overflowing norm becomes Inf; callers reject it
        return np.sqrt(pairwise_sum_rows(rows * rows)).astype(np.float32)


# -------------------------------------------------------------------------------- quantizing


def _levels_f32(table: LevelTable) -> tuple[np.ndarray, np.ndarray]:
    levels = float32_levels(table)
    return levels, levels[1:] - levels[:-1]


def normalized(flat: np.ndarray, norms: np.ndarray, bucket_size: int) -> np.ndarray:
    """r = clip(x / n_bucket, −1, 1) in float32, 0 in zero buckets (step 3)."""
    safe = np.where(norms == 0, np.float32(1), norms)  # x is all zeros there: 0 / 1 = 0
    # min(B, n): B > n is one bucket of n elements (never a temporary of B elements)
    per_elem = np.repeat(safe, min(bucket_size, flat.size))[: flat.size]
    return np.clip(flat / per_elem, np.float32(-1), np.float32(1))


def round_codes(r: np.ndarray, table: LevelTable, u: np.ndarray) -> np.ndarray:
    """Unbiased stochastic rounding of r onto the table (step 4): uint8 codes."""
    levels, widths = _levels_f32(table)
    j = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, levels.size - 2)
    xi = (r - levels[j]) / widths[j]
    return (j + (u < xi)).astype(np.uint8)


def quantize_codes(
    x: Any, table: LevelTable, *, bucket_size: int, norm: str = "l2", uniforms: Any
) -> tuple[np.ndarray, np.ndarray]:
    """Level indices (uint8, one per element) and bucket norms (float32) of x; steps 1–4."""
    table, bucket_size, flat, norms, u = prepare(x, table, bucket_size, norm, None, uniforms)
    return round_codes(normalized(flat, norms, bucket_size), table, u), norms


def prepare(
    x: Any, levels: Any, bucket_size: Any, norm: Any, seed: Any, uniforms: Any,
    key: StreamKey | None = None,
) -> tuple[LevelTable, int, np.ndarray, np.ndarray, np.ndarray]:
    """Validate everything, then draw the uniforms (so bad input leaves ``seed`` untouched)."""
    table = as_table(levels)
    bucket_size = check_bucket_size(bucket_size)
    norm = check_norm(norm)
    flat = as_float32_flat(x)
    norms = bucket_norms(flat, bucket_size, norm)
    check_norms(norms)
    u = draw_uniforms(flat.size, seed, uniforms, key)
    return table, bucket_size, flat, norms, u


def dequantize(codes: np.ndarray, norms: np.ndarray, table: LevelTable, bucket_size: int):
    """x̂ = n_bucket · L[code] in float32 (step 6)."""
    levels, _ = _levels_f32(table)
    span = min(bucket_size, codes.size)  # Header.span: memory bounded by n, not by B
    return np.repeat(norms, span)[: codes.size] * levels[codes]


def rounding_variance(
    x: Any, levels: LevelTable | Any, *, bucket_size: int, norm: str = "l2"
) -> np.ndarray:
    """Per-bucket expected squared error E‖Q(v) − v‖² = n²·Σ_i (L_{j+1} − r_i)(r_i − L_j) (§3).

    Computed in float64 from the same float32 r, L_j, L_{j+1} the encoder uses.
    """
    table = as_table(levels)
    bucket_size = check_bucket_size(bucket_size)
    flat = as_float32_flat(x)
    norms = bucket_norms(flat, bucket_size, norm)
    check_norms(norms)
    levels32, _ = _levels_f32(table)
    r = normalized(flat, norms, bucket_size)
    j = np.clip(np.searchsorted(levels32, r, side="right") - 1, 0, levels32.size - 2)
    r64 = r.astype(np.float64)
    per_coord = (levels32[j + 1].astype(np.float64) - r64) * (r64 - levels32[j])
    sums = np.bincount(np.arange(flat.size) // bucket_size, per_coord, minlength=norms.size)
    return norms.astype(np.float64) ** 2 * sums
