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

from collections.abc import Iterable


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


__all__ = ["chunk_valid", "chunk_zero_spans"]
