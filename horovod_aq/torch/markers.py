"""Non-finite markers decided on the device: ``packed.send`` step 2 for a send without error
memory, and the payloads replaced by markers where it finds an element, with no host read
(docs/protocol.md §4; the host's version is ``packed.send.first_bad_element``).

For x, the n coordinates of a bucket or of a two-phase averaged chunk (g itself: no memory),
encoded as if it could travel, with ν_k the bucket norms its payloads hold (float32, bucket
order)::

    f   = min{i : x_i not finite}                  (n if none)
    j   = min{k : ν_k not finite}                  (K if none)
    bad = f  if f < n,   else  j·B  if j < K,   else  −1

A bucket of finite values has an unsendable norm exactly where its float32 norm is ±inf
(``packed.protocol.first_unsendable``), and every decoder refuses a payload of non-finite x, so
where bad ≥ 0 each payload is replaced by ``codec.nonfinite_payload`` of its size naming
o + bad (o: where x starts in the bucket), the index clipped as ``packed.marker.marker_index``:
its header (cached on the device, the index written there), zeros elsewhere. Where bad = −1 the
payloads are unchanged. Bitwise the host's markers (``tests/test_torch_markers.py``).
"""

from __future__ import annotations

import torch

from horovod_aq import codec
from horovod_aq.codec import HEADER_SIZE, MARKER_INDEX_OFFSET
from horovod_aq.levels.table import LevelTable
from horovod_aq.packed.marker import MAX_MARKER_INDEX
from horovod_aq.torch.payload import header_tensor

__all__ = ["first_bad", "first_unsendable", "markers_or", "payload_norms"]


def payload_norms(payloads: list[torch.Tensor], sizes: list[int],
                  bucket_size: int) -> torch.Tensor:
    """ν_k of fixed-width payloads (of ``sizes`` coordinates: a bucket's parts, in order), in
    bucket order: their float32 norms, concatenated."""
    return torch.cat([p[HEADER_SIZE:HEADER_SIZE + codec.NORM_BYTES * codec.num_buckets(
        n, bucket_size)].view(torch.float32) for p, n in zip(payloads, sizes, strict=True)])


def first_unsendable(norms: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """j·B for the first bucket whose norm ν_j is not finite, −1 where none: a 0-dim int64
    tensor on the norms' device."""
    minus_one = torch.full((), -1, dtype=torch.int64, device=norms.device)
    if not norms.numel():
        return minus_one
    unsendable = ~torch.isfinite(norms)
    j = unsendable.view(torch.uint8).argmax()         # the first True (0 where none is)
    return torch.where(unsendable[j], j * bucket_size, minus_one)


def first_bad(x: torch.Tensor, norms: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """bad (module docstring): a 0-dim int64 tensor on x's device, −1 where x can travel."""
    if not x.numel():
        return first_unsendable(norms, bucket_size)
    finite = torch.isfinite(x)
    f = finite.view(torch.uint8).argmin()             # the first False (0 where all are True)
    return torch.where(~finite[f], f, first_unsendable(norms, bucket_size))


def markers_or(payloads: list[torch.Tensor], bad: torch.Tensor, *, offset: int = 0,
               numel: int, table: LevelTable, bucket_size: int,
               norm: str) -> list[torch.Tensor]:
    """Each of ``payloads`` (``numel`` coordinates each: one part, or two-phase's P chunks)
    where bad < 0, else the marker of its size naming element ``offset`` + bad (module
    docstring); new tensors, nothing read on the host. The marker's header is made once."""
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
