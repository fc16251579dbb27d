"""Where a parameter sits in its fused bucket: the element → parameter lookup.

A bucket holds its parameters' flattened gradients back to back; parameter k occupies elements
``[offsets[k], offsets[k] + numels[k])``. Every integration names the parameter of an element
(the first bad element a non-finite marker carries, docs/protocol.md §4) with :func:`param_at`;
:func:`param_starts` gives the same lookup as sorted arrays for an in-graph ``searchsorted``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


def param_at(element: int | None, offsets: Sequence[int], numels: Sequence[int],
             names: Sequence[str]) -> str | None:
    """The name of the parameter holding bucket element ``element``: the k with
    ``offsets[k] ≤ element < offsets[k] + numels[k]``; None when ``element`` is None or lies
    in no parameter (a two-phase chunk's zero padding past the bucket's end)."""
    if element is None:
        return None
    for offset, numel, name in zip(offsets, numels, names):
        if offset <= element < offset + numel:
            return name
    return None


def contiguous_offsets(numels: Sequence[int]) -> list[int]:
    """The offsets of parameters laid out back to back in the given order (0, n₀, n₀+n₁, …)."""
    return list(itertools.accumulate(numels[:-1], initial=0)) if len(numels) else []


def param_starts(offsets: Sequence[int], names: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """(sorted int64 start offsets, the names in that order): the parameter of element e is
    ``names[searchsorted(starts, e, side="right") − 1]`` (:func:`param_at` for an e inside the
    bucket)."""
    order = np.argsort(np.asarray(offsets, dtype=np.int64), kind="stable")
    return np.asarray(offsets, dtype=np.int64)[order], [names[i] for i in order]


__all__ = ["contiguous_offsets", "param_at", "param_starts"]
