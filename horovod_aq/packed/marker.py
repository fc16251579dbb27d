"""What a rank sends instead of payloads when its bucket cannot be encoded (docs/protocol.md §4).

A bucket holding NaN/±Inf, or finite values whose bucket norm does not fit a float32
(:func:`horovod_aq.packed.protocol.first_unsendable`), is sent as **non-finite markers**
(docs/format.md §7): a payload-sized buffer whose header has ``FLAG_NONFINITE`` set and, in its
reserved field, the first bad element of the *whole* bucket; zeros elsewhere. It stands in for
every payload the rank would have sent, with the same size, so the collective completes and every
rank receives the same rows:

==============  ============================  ===========  ====================================
mode            a marker stands for            copies       size of one copy
==============  ============================  ===========  ====================================
allgather       the bucket (n elements)        1            ``payload_size(n, b, B)``
two_phase       one chunk (m elements)         P            ``payload_size(m, b, B)``
==============  ============================  ===========  ====================================

with m = ``chunk_numel(n, P, B)``. Every copy carries the same element index, so whichever chunk
a rank receives names the parameter (docs/protocol.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from horovod_aq.codec import nonfinite_payload, payload_size
from horovod_aq.levels.table import LevelTable
from horovod_aq.packed.cost import chunk_numel

#: The largest element index a marker's 32-bit field holds; larger indices are clipped to it.
MAX_MARKER_INDEX = 2**32 - 1


@dataclass(frozen=True)
class Marker:
    """The markers one rank sends for one bucket in place of its payloads (module docstring)."""

    #: Elements one copy stands for: the bucket's n (allgather) or a chunk's m (two-phase).
    numel: int
    #: How many copies travel: 1 (allgather) or P (two-phase alltoall, one per destination).
    copies: int
    #: Bytes of one copy, the size of the payload it replaces.
    size: int

    def payload(self, table: LevelTable, bucket_size: int, norm: str,
                first_bad: int) -> np.ndarray:
        """One copy (uint8): ``codec.nonfinite_payload`` naming ``first_bad``, the first bad
        element of the whole bucket."""
        return nonfinite_payload(self.numel, table, bucket_size, norm, first_bad)

    def payloads(self, table: LevelTable, bucket_size: int, norm: str,
                 first_bad: int) -> list[np.ndarray]:
        """Every copy, in destination order (the same bytes for each)."""
        one = self.payload(table, bucket_size, norm, first_bad)
        return [one] * self.copies


def marker_for(mode: str, numel: int, ranks: int, bits: int, bucket_size: int) -> Marker:
    """The marker of a bucket of ``numel`` elements sent by ``mode`` among ``ranks`` ranks at code
    width ``bits`` (the table's)."""
    if mode == "two_phase":
        m = chunk_numel(numel, ranks, bucket_size)
        return Marker(m, ranks, payload_size(m, bits, bucket_size))
    if mode != "allgather":
        raise ValueError(f"markers replace packed payloads only, not mode {mode!r}")
    return Marker(numel, 1, payload_size(numel, bits, bucket_size))


def marker_index(first_bad: int) -> int:
    """What a marker's index field (``MARKER_INDEX_OFFSET``, 4 bytes little-endian) holds for
    the first bad element ``first_bad``: the index, clipped to ``MAX_MARKER_INDEX``."""
    return min(int(first_bad), MAX_MARKER_INDEX)


__all__ = ["MAX_MARKER_INDEX", "Marker", "marker_for", "marker_index"]
