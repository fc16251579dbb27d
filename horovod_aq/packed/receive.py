"""What a rank does with the rows a collective delivered, decided identically on every rank.

Every rank of an allgather (or, for its own chunk, of a two-phase alltoall) holds the same rows,
so every rank reaches the same outcome from their headers alone (docs/protocol.md §4, §15):

1. **Joined ranks.** A row that does not start with the payload magic is a rank that called
   ``hvd.join()`` (Horovod sends zeros in its place): :class:`JoinedRankError` naming those
   ranks (only where the collectives zero-fill joined ranks).
2. **Markers.** Rows whose flags byte has ``FLAG_NONFINITE`` are non-finite markers
   (:mod:`horovod_aq.packed.marker`). None: :data:`OK`, decode. With ``nonfinite="skip"``:
   :data:`SKIP`, the bucket's result is NaN and the step is skipped on every rank. Otherwise
   :class:`~horovod_aq.codec.NonFiniteGradientError` naming the first flagged rank and the
   parameter holding the element its marker carries (every marker, each two-phase chunk's too,
   carries the first bad element of the whole bucket).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod_aq import codec
from horovod_aq.packed.protocol import nonfinite_message

#: The rows hold payloads: decode them.
OK = "ok"
#: Some rank sent markers and the compressor skips such steps (``nonfinite="skip"``).
SKIP = "skip"
#: The ``nonfinite=`` policies of a compressor.
POLICIES = ("raise", "skip")


class JoinedRankError(RuntimeError):
    """A rank called ``hvd.join()`` while the others still exchange packed gradients."""


def joined_rows(magic: Any) -> list[int]:
    """The ranks whose gathered row starts with zero bytes instead of the payload magic: under
    ``hvd.join()`` Horovod fills a joined rank's part of a collective with zeros."""
    magic = np.asarray(magic, dtype=np.uint8).reshape(len(magic), -1)
    return [r for r in range(magic.shape[0]) if not magic[r].any()]


def joined_message(ranks: Sequence[int] | str, collective: str) -> str:
    """Why the ranks still training stop when others joined (docs/protocol.md §15): an exchange
    that needs every rank's payload (the TensorFlow exchange; the PyTorch optimizer averages
    joined steps with an allreduce instead, ``horovod_aq.torch.uneven``). ``ranks``: the joined
    ranks, or words for them ("1 of 2 ranks")."""
    who = ranks if isinstance(ranks, str) else f"rank(s) {', '.join(map(str, ranks))}"
    return (f"horovod_aq: {who} called hvd.join() (Horovod sent zeros in their place in "
            f"'{collective}'): this packed exchange needs every rank's "
            "payload, and joined ranks send none. Run the same number of steps on every rank "
            "(e.g. drop_last=True, or equal shards per rank), or train the uneven tail with "
            "Horovod's own optimizer or tape, whose allreduce counts joined ranks as zeros; "
            "horovod_aq.torch.DistributedOptimizer supports hvd.join()")


def heads_of(rows: Any) -> list[np.ndarray]:
    """The received rows as a list of uint8 arrays (a [P, size] array, or one array per rank of
    any length: a rank's payload may be shorter than the header only if it sent nothing)."""
    if isinstance(rows, np.ndarray) and rows.ndim == 2:
        return list(rows.astype(np.uint8, copy=False))
    return [np.asarray(r, dtype=np.uint8).reshape(-1) for r in rows]


def check_joined(rows: Any, collective: str) -> None:
    """Raise :class:`JoinedRankError` when a row lacks the payload magic (step 1)."""
    heads = heads_of(rows)
    width = len(codec.MAGIC)
    magic = np.zeros((len(heads), width), dtype=np.uint8)
    for r, head in enumerate(heads):
        magic[r, :min(width, head.size)] = head[:width]
    joined = joined_rows(magic)
    if joined:
        raise JoinedRankError(joined_message(joined, collective))


def flagged_rows(rows: Any) -> list[int]:
    """The ranks whose row is a non-finite marker (flags byte has ``FLAG_NONFINITE``)."""
    return codec.nonfinite_rows([int(h[codec.FLAGS_OFFSET]) if h.size > codec.FLAGS_OFFSET
                                 else 0 for h in heads_of(rows)])


def receive_outcome(rows: Any, *, nonfinite: str, bucket: str, collective: str,
                    param_at: Callable[[int | None], str | None] = lambda _: None,
                    joined: bool = True) -> str:
    """:data:`OK` or :data:`SKIP` for the received ``rows`` (their first ``HEADER_SIZE`` bytes
    are enough), or raise as the module docstring says. ``nonfinite``: the compressor's policy;
    ``param_at``: element → parameter name (:func:`horovod_aq.packed.params.param_at` over the
    bucket); ``joined``: whether the collective zero-fills joined ranks (Horovod's do)."""
    if nonfinite not in POLICIES:
        raise ValueError(f"nonfinite must be one of {POLICIES}, got {nonfinite!r}")
    heads = heads_of(rows)
    if joined:
        check_joined(heads, collective)
    bad = flagged_rows(heads)
    if not bad:
        return OK
    if nonfinite == "skip":
        return SKIP
    rank = bad[0]
    where = codec.parse_header(heads[rank][:codec.HEADER_SIZE]).first_nonfinite
    raise codec.NonFiniteGradientError(nonfinite_message(rank, param_at(where), bucket), where,
                                       rank)


__all__ = ["OK", "POLICIES", "SKIP", "JoinedRankError", "check_joined", "flagged_rows",
           "heads_of", "joined_message", "joined_rows", "receive_outcome"]
