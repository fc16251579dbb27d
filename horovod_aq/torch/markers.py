"""Non-finite markers put in place with torch ops, nothing read on the host: two-phase's
averaged chunk of alltoall rows that were not plain, where the wire settles at the step's end
(docs/protocol.md §5.8) on a device without Triton's kernels (CPU). With Triton the one-pass
send writes its markers itself (``triton_send.Send.decide``, one launch).

For payloads of n coordinates and a 0-dim int64 ``bad`` (−1: nothing to replace), where
bad ≥ 0 each payload becomes ``codec.nonfinite_payload`` of its size naming o + bad (o: the
``offset``), the index clipped as ``packed.marker.marker_index``: its header (cached on the
device, the index written there), zeros elsewhere. Bitwise the host's markers
(``tests/test_torch_markers.py``).
"""

from __future__ import annotations

import torch

from horovod_aq.codec import HEADER_SIZE, MARKER_INDEX_OFFSET
from horovod_aq.levels.table import LevelTable
from horovod_aq.packed.marker import MAX_MARKER_INDEX
from horovod_aq.torch.payload import header_tensor

__all__ = ["markers_or"]


def markers_or(payloads: list[torch.Tensor], bad: torch.Tensor, *, offset: int = 0,
               numel: int, table: LevelTable, bucket_size: int,
               norm: str) -> list[torch.Tensor]:
    """Each of ``payloads`` (``numel`` coordinates each) where bad < 0, else the marker of its
    size naming element ``offset`` + bad (module docstring); new tensors, nothing read on the
    host. The marker's header is made once."""
    if not payloads:
        return []
    device = payloads[0].device
    refused = bad >= 0
    index = (bad + offset).clamp(0, MAX_MARKER_INDEX)
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=device)
    field = ((index >> shifts) & 0xFF).to(torch.uint8)   # 4 bytes, little-endian
    head = header_tensor(numel, table, bucket_size, norm, device, marker=True).clone()
    head[MARKER_INDEX_OFFSET:MARKER_INDEX_OFFSET + 4] = field
    zero = torch.zeros((), dtype=torch.uint8, device=device)
    out = []
    for payload in payloads:
        sent = torch.where(refused, zero, payload)
        sent[:HEADER_SIZE] = torch.where(refused, head, payload[:HEADER_SIZE])
        out.append(sent)
    return out
