"""The two-phase exchange's chunks (docs/protocol.md §5.2): their size, and which coordinates of
this rank's averaged chunk are real.

A bucket of n coordinates is padded with zeros to P equal chunks of m = ``chunk_numel(n, P, B)``
coordinates (whole quantization buckets). Rank r averages chunk r, coordinates
``[r·m, (r+1)·m)`` of the padded bucket. Before it re-encodes that average it sets exact zeros
where there is no gradient (docs/protocol.md §15): the padding past the bucket's end, and the
parameters no rank had a gradient for. Their decoded zeros carry rounding noise, which would
enter the norm of the re-encoded chunk and so add variance to the real coordinates.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def chunk_valid(numel: int, m: int, rank: int) -> int:
    """How many leading coordinates of rank ``rank``'s chunk of ``m`` lie inside a bucket of
    ``numel``: ``min(max(numel − rank·m, 0), m)`` (the rest is padding)."""
    return min(max(numel - rank * m, 0), m)


def chunk_zero_spans(numel: int, m: int, rank: int,
                     absent: Iterable[tuple[int, int]] = ()) -> list[tuple[int, int]]:
    """The spans ``(lo, hi)`` of rank ``rank``'s chunk (indices into the chunk of ``m``) that must
    be exact zeros before re-encoding: the padding past the bucket end, then the part of every
    ``(offset, numel)`` span in ``absent`` (parameters no rank had a gradient for) that falls in
    the chunk. Empty spans are left out."""
    start = rank * m
    valid = chunk_valid(numel, m, rank)
    spans = [(valid, m)] if valid < m else []
    for offset, n in absent:
        lo, hi = max(offset, start), min(offset + n, start + valid)
        if lo < hi:
            spans.append((lo - start, hi - start))
    return spans


def chunk_param_parts(numel: int, m: int, rank: int, offsets: Sequence[int],
                      numels: Sequence[int]) -> tuple[int, list[int]]:
    """Which parameters (back to back at ``offsets``, of ``numels``) rank ``rank``'s chunk of
    ``m`` holds: the first one's position j and how many coordinates of each, j on, lie in the
    chunk's valid part (in chunk order, adding up to ``chunk_valid``; ``(0, [])`` for a chunk of
    padding only). Coordinate i of the chunk is the parameter's whose running count first
    exceeds i: a device mask per parameter expands to the chunk's coordinates without a host
    read (``chunk_zero_spans``' absent spans, from a mask that stays on the device)."""
    start = rank * m
    end = start + chunk_valid(numel, m, rank)
    # offsets and ends never decrease: the overlapping parameters are one run
    held = [j for j, (offset, n) in enumerate(zip(offsets, numels))
            if offset < end and offset + n > start]
    if not held:
        return 0, []
    return held[0], [min(offsets[j] + numels[j], end) - max(offsets[j], start) for j in held]


__all__ = ["chunk_param_parts", "chunk_valid", "chunk_zero_spans"]
