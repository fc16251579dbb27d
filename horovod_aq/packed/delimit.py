"""Where each rank's payload ends in a concatenation of variable-length payloads.

Horovod's allgather takes a different first dimension on every rank but returns only the
concatenation, in rank order. The payloads of the entropy-coded wire delimit themselves
(docs/format.md §12, docs/protocol.md §5.4), so the receiver needs no size exchange: row r starts
where row r − 1 ended, and its length is read from its own headers (``codec.payload_length``):

* a fixed-width payload or a non-finite marker: ``payload_size(n, b, B)`` of its 32-byte header;
* an entropy-coded payload (``FLAG_ENTROPY``): the coded size in its coder header, which must lie
  in [body offset + 16, ``payload_size(n, b, B)``] (the entropy wire never sends more than the
  fixed-width size);

then ``trailer`` more bytes (a presence mask) follow it. Every rank holds the same concatenation,
so every rank computes the same sizes or raises the same :class:`~horovod_aq.codec.PayloadError`
("rank r: …") — no rank-dependent branch. A forged length cannot make a row reach past the buffer
or the next row start off its magic without an error here; a length that is plausible but wrong
is refused by the row's decoder, which checks its coder header and block counts against the
row's exact length (docs/format.md §12).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from horovod_aq import codec
from horovod_aq.codec.entropy_format import CODER_HEADER_SIZE
from horovod_aq.codec.rows import tag_rank


def payload_sizes(flat: Any, count: int, trailer: int = 0) -> list[int]:
    """The sizes of the ``count`` rows (payload + ``trailer`` bytes each) that fill the uint8
    buffer ``flat`` back to back, read from the payloads' headers (module docstring).

    Raises ``PayloadError`` ("rank r: …", attribute ``rank``) when a row's header is not a
    payload's, its stated length is out of bounds or runs past the buffer, or bytes are left
    after the last row."""
    data = np.asarray(flat, dtype=np.uint8).reshape(-1)
    sizes: list[int] = []
    at = 0
    for rank in range(count):
        try:
            sizes.append(_row_size(data[at:], trailer))
        except codec.PayloadError as err:
            tag_rank(err, rank)
            raise
        at += sizes[-1]
    if at != data.size:
        raise codec.PayloadError(
            f"gathered payloads are {data.size} bytes but their {count} headers account for "
            f"{at}: {data.size - at} bytes left over (a forged or corrupted length field)")
    return sizes


def _row_size(rest: np.ndarray, trailer: int) -> int:
    """Bytes of the row that starts ``rest``: its payload's length, plus ``trailer``."""
    header = codec.parse_header(rest[:codec.HEADER_SIZE])
    fixed = header.payload_size
    length = codec.payload_length(rest) if header.entropy else fixed
    if header.entropy:
        shortest = codec.HEADER_SIZE + codec.NORM_BYTES * header.num_buckets + CODER_HEADER_SIZE
        if not shortest <= length <= fixed:
            raise codec.PayloadError(
                f"entropy-coded payload states a length of {length} bytes, outside "
                f"[{shortest}, {fixed}] for n = {header.numel} at {header.bits} bits (a forged "
                "or corrupted length field)")
    if length + trailer > rest.size:
        raise codec.PayloadError(
            f"payload is truncated: its headers state {length} bytes (+{trailer} of presence "
            f"mask) but only {rest.size} are left in the gathered buffer")
    return length + trailer


__all__ = ["payload_sizes"]
