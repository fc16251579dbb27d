"""A level table prepared for one device, with the encoder's interval finder (codec step 4:
j = the level interval holding a normalized coordinate r), for the torch ops of
``horovod_aq.torch.kernels``."""

from __future__ import annotations

import numpy as np
import torch

from horovod_aq import codec
from horovod_aq.levels.table import LevelTable
from horovod_aq.torch.payload import DeviceCache

#: Prepared level tables kept per process (each holds a 1.5 MB cell array): enough for DQSGD's
#: seven widths plus one more, so a run that refits keeps a bounded, small set.
TABLE_CACHE_ENTRIES = 8
_TABLES = DeviceCache(TABLE_CACHE_ENTRIES)

#: The interval finder's cells span 2^CELL_SHIFT consecutive float32 values: 23 − 13 = 10
#: mantissa bits are kept, so a cell is 2^−10 ≈ 0.1 % of its magnitude wide.
CELL_SHIFT = 13
_CELL_MASK = (1 << (32 - CELL_SHIFT)) - 1
_NEGATIVE_CELLS = 1 << (31 - CELL_SHIFT)  # cell index of −0.0; negative floats come after it
_ONE_CELL = int(np.float32(1.0).view(np.int32)) >> CELL_SHIFT  # the last cell with |r| ≤ 1


class DeviceTable:
    """A level table prepared for one device (cached per version, hash and device).

    Holds float32 ``levels`` L, ``gaps`` L[j+1] − L[j], ``following`` (L[k+1], +inf at the end),
    ``lookup`` (L padded with NaN to 2^bits entries, for decoding) and ``cells``.

    ``cells`` replaces ``torch.searchsorted`` (~7 ns per element on CPU, the slowest step) by
    two table look-ups. The float32 bit pattern of r ∈ [−1, 1] without its low CELL_SHIFT bits
    names a *cell* of 2^CELL_SHIFT consecutive floats; the cell stores j at its smallest float.
    When no cell holds two levels, at most the level L[j+1] lies inside the cell, so

        j(r) = cells[bits(r) >> CELL_SHIFT] + [r ≥ L[j+1]]

    is exactly searchsorted's answer (−0.0 and +0.0 included: comparisons are on floats). Tables
    with two levels in one cell (levels closer than ~0.1 % of their size) fall back to
    searchsorted (``cells`` is None); both paths are tested against each other.
    """

    def __init__(self, table: LevelTable, device) -> None:
        levels = codec.float32_levels(table)
        lookup = np.full(1 << table.bits, np.nan, dtype=np.float32)
        lookup[: levels.size] = levels

        def put(arr: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(arr).to(device)

        self.levels = put(levels)
        self.gaps = put(levels[1:] - levels[:-1])
        self.following = put(np.append(levels[1:], np.float32(np.inf)))
        self.lookup = put(lookup)
        self.num_levels = levels.size
        # Flushed subnormal levels make a run of zeros; −0.0 must then be looked up as +0.0.
        self.plus_zero = int(np.count_nonzero(levels == 0)) > 1
        cells = _build_cells(levels, self.plus_zero)
        self.cells = None if cells is None else torch.from_numpy(cells).to(device)

    def locate(self, r: torch.Tensor) -> torch.Tensor:
        """j = clip(searchsorted(L, r, right) − 1, 0, N − 2) as int32, for r in [−1, 1]."""
        if self.cells is None:
            j = torch.searchsorted(self.levels, r, right=True, out_int32=True).sub_(1)
            return j.clamp_(0, self.num_levels - 2)
        if self.plus_zero:
            r.add_(0.0)  # −0.0 + 0.0 = +0.0; codes do not change (ξ = ±0 either way)
        cell = (r.view(torch.int32) >> CELL_SHIFT).bitwise_and_(_CELL_MASK)
        j = self.cells.index_select(0, cell)
        j.add_(torch.ge(r, self.following.index_select(0, j)).view(torch.uint8))
        return j.clamp_(max=self.num_levels - 2)


def _build_cells(levels: np.ndarray, plus_zero: bool) -> np.ndarray | None:
    """int32 j at the smallest float of every cell (clipped to 0..N−1), or None when some cell
    holds two levels. Unused cells (|r| > 1) hold 0. With ``plus_zero`` the lookup never sees
    −0.0, so the cell of the negative subnormals ends at −2^−149."""
    magnitude = np.arange(_ONE_CELL + 1, dtype=np.int64) << CELL_SHIFT
    lowest = magnitude.astype(np.int32).view(np.float32)  # of the positive cells
    highest = (magnitude + (1 << CELL_SHIFT) - 1).astype(np.int32).view(np.float32)
    negative_largest = -lowest
    if plus_zero:
        negative_largest[0] = -np.float32(2.0**-149)
    cells = np.zeros(_NEGATIVE_CELLS + _ONE_CELL + 1, dtype=np.int32)
    for smallest, largest, offset in ((lowest, highest, 0),
                                      (-highest, negative_largest, _NEGATIVE_CELLS)):
        j_small = np.searchsorted(levels, smallest, side="right") - 1
        j_large = np.searchsorted(levels, largest, side="right") - 1
        if int((j_large - j_small).max()) > 1:
            return None
        cells[offset : offset + smallest.size] = np.clip(j_small, 0, levels.size - 1)
    return cells


def device_table(table: LevelTable, device) -> DeviceTable:
    key = ("table", table.version, table.hash, table.num_levels, str(device))
    return _TABLES.get(key, lambda: DeviceTable(table, device))


__all__ = ["CELL_SHIFT", "DeviceTable", "TABLE_CACHE_ENTRIES", "device_table"]
