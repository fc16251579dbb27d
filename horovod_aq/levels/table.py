"""Level tables: a validated, versioned, hashable signed table ℓ_0 < … < ℓ_{N−1} on [−1, 1].

Every quantizer in the package is one signed table with endpoints ±1 (``docs/quantizers.md`` §2):
the transmitted symbol is the level index J ∈ {0, …, N−1}, sent with

    bits = ⌈log₂ N⌉   (1 ≤ bits ≤ 8, so 2 ≤ N ≤ 256)

bits per coordinate. Kernels compute in float32, so a table must stay strictly increasing after
rounding to float32 as well; that is checked here once, not in every kernel.

A table is global and versioned (§4): every rank holds the same table, the version increases at
each refit, and each payload carries the version and a short hash (CRC-32 of the float64 values,
little-endian) so that a decoder holding another table refuses the payload.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

MAX_BITS = 8


def validate_levels(levels: object) -> np.ndarray:
    """Return ``levels`` as a read-only float64 array after checking it is a valid table.

    Valid means: one-dimensional, finite, 2 ≤ N ≤ 2^8 entries, strictly increasing (also after
    rounding to float32), ℓ_0 = −1 and ℓ_{N−1} = +1 exactly. Raises ``ValueError`` naming the
    first violated rule.
    """
    arr = np.array(levels, dtype=np.float64, copy=True)
    if arr.ndim != 1:
        raise ValueError(f"a level table must be one-dimensional, got shape {arr.shape}")
    n = arr.size
    if n < 2 or n > 2**MAX_BITS:
        raise ValueError(
            f"a level table needs 2..{2**MAX_BITS} levels (1..{MAX_BITS} bits), got {n}"
        )
    if not np.all(np.isfinite(arr)):
        raise ValueError("a level table must contain only finite values")
    if arr[0] != -1.0 or arr[-1] != 1.0:
        raise ValueError(
            f"a level table must start at -1 and end at +1 exactly, "
            f"got [{arr[0]!r}, …, {arr[-1]!r}]"
        )
    if not np.all(np.diff(arr) > 0):
        raise ValueError("a level table must be strictly increasing")
    if not np.all(np.diff(arr.astype(np.float32)) > 0):
        raise ValueError(
            "a level table must stay strictly increasing in float32 (two levels round to the "
            "same float32 value); spread the levels further apart"
        )
    arr.setflags(write=False)
    return arr


def bits_for(num_levels: int) -> int:
    """Code width ⌈log₂ N⌉ for a table of N levels (at least 1)."""
    if num_levels < 2:
        raise ValueError(f"a level table needs at least 2 levels, got {num_levels}")
    return max(1, int(num_levels - 1).bit_length())


def table_hash(levels: np.ndarray) -> int:
    """Short hash of a table: CRC-32 of its float64 little-endian bytes (an unsigned 32-bit int)."""
    return zlib.crc32(np.ascontiguousarray(levels, dtype="<f8").tobytes()) & 0xFFFFFFFF


@dataclass(frozen=True, eq=False)
class LevelTable:
    """A validated level table with its version number.

    ``version`` is 0 for a table nobody has refitted and grows by one at every refit; ``hash``
    and ``bits`` are derived. Two tables are ``same_as`` each other when versions and values agree.
    """

    levels: np.ndarray
    version: int = 0
    hash: int = field(init=False)
    bits: int = field(init=False)

    def __post_init__(self) -> None:
        levels = validate_levels(self.levels)
        if not (0 <= int(self.version) < 2**32):
            raise ValueError(f"table version must fit in 32 unsigned bits, got {self.version}")
        object.__setattr__(self, "levels", levels)
        object.__setattr__(self, "version", int(self.version))
        object.__setattr__(self, "hash", table_hash(levels))
        object.__setattr__(self, "bits", bits_for(levels.size))

    @property
    def num_levels(self) -> int:
        return int(self.levels.size)

    def same_as(self, other: "LevelTable") -> bool:
        return (
            self.version == other.version
            and self.hash == other.hash
            and np.array_equal(self.levels, other.levels)
        )

    def with_version(self, version: int) -> "LevelTable":
        return LevelTable(self.levels, version)

    def __repr__(self) -> str:
        vals = ", ".join(f"{v:.6g}" for v in self.levels)
        return (f"LevelTable(version={self.version}, bits={self.bits}, hash={self.hash:08x}, "
                f"levels=[{vals}])")
