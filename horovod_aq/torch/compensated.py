"""ECQ-SGD's fused send of a bucket for the torch wire: compensate, encode and update the error
memory in one pass per part (docs/dynamic.md §2.6), on CPU tensors.

:func:`encode_compensated` is ``packed.send.SendSteps.encode_compensated`` for
:class:`~horovod_aq.torch.wire.Wire`: for each part — the whole bucket (allgather, part 0) or
chunk k of its zero padding to P·m coordinates (two-phase first phase, part k; the averaged
chunk's re-encode has no memory) — it runs ``codec.fused_compensated.try_encode_compensated``
on zero-copy numpy views of g, h and the output buffer, with the wire's stream key, timing and
measurement (``Wire.timed_encode``). h' goes into the memory's spare buffer
(``ErrorMemory.spare``; allocated the first time), is installed by the returned callable after
the send succeeded, and never where a bucket cannot travel: the wire then sends markers
(docs/protocol.md §4) and h stays as it was. The tap, when set, sees x = g + α·h, computed for
it after a successful pass.

CUDA tensors, other dtypes and ``HOROVOD_AQ_KERNELS=ops`` keep the unfused steps
(:func:`fusable`); both give bitwise the same payloads and memory.
"""

from __future__ import annotations

from typing import Any

import torch

from horovod_aq.packed.cost import chunk_numel
from horovod_aq.packed.send import Fused
from horovod_aq.torch import kernels

__all__ = ["encode_compensated", "fusable", "part_spans"]


def fusable(wire: Any, raw: torch.Tensor) -> bool:
    """Whether the wire sends ``raw`` with the fused pass: error feedback on, a float32 CPU
    gradient, and the compiled CPU kernels in use (``kernels.implementation_for``)."""
    return (wire.memory is not None and raw.device.type == "cpu" and raw.dtype == torch.float32
            and raw.dim() == 1 and raw.is_contiguous()
            and kernels.implementation_for(raw.device) == "fused")


def part_spans(mode: str, numel: int, ranks: int, bucket_size: int) -> list[tuple[int, int, int]]:
    """(lo, hi, size) of each part: coordinates [lo, hi) of the bucket, encoded as a payload of
    ``size`` coordinates (zero padding past hi): [(0, n, n)] for allgather; for two-phase the P
    chunks of m = ``chunk_numel`` coordinates (docs/protocol.md §5.2)."""
    if mode == "allgather":
        return [(0, numel, numel)]
    m = chunk_numel(numel, ranks, bucket_size)
    return [(min(k * m, numel), min((k + 1) * m, numel), m) for k in range(ranks)]


def encode_compensated(wire: Any, bucket: Any, raw: torch.Tensor) -> Fused | None:
    """``send.Fused`` (payloads, install) for ``raw`` = g, or None when a bucket of
    x = g + α·h cannot travel (module docstring)."""
    from horovod_aq.codec import fused_compensated  # numba, as kernels imports it: on first use

    q, memory = wire.q, wire.memory
    g = raw.detach()
    h = memory.saved(bucket.name, g)
    out = memory.spare(bucket.name, g)
    if out is None:
        out = torch.empty(g.shape, dtype=torch.float32)
    g_np, out_np = g.numpy(), out.numpy()
    h_np = None if h is None else h.detach().contiguous().numpy()
    payloads: list[torch.Tensor] = []
    finite, squares = True, 0.0
    for part, (lo, hi, size) in enumerate(part_spans(bucket.mode, bucket.numel, wire.ranks,
                                                     q.bucket_size)):
        sent = []

        def run(key, lo=lo, hi=hi, size=size, sent=sent):
            found = fused_compensated.try_encode_compensated(
                g_np[lo:hi], None if h_np is None else h_np[lo:hi], memory.alpha, memory.beta,
                bucket.table, bucket_size=q.bucket_size, norm=q.norm, key=key, numel=size,
                coding=bucket.coding, checksum=q.checksum, memory_out=out_np[lo:hi])
            sent.append(found)
            return None if found is None else torch.from_numpy(found.payload)

        payload = wire.timed_encode(bucket, part, size, g.device, run)
        if payload is None:
            return None
        payloads.append(payload)
        finite = finite and sent[0].memory_finite
        squares += sent[0].memory_sum_of_squares
    if wire.tap is not None:
        for part, x in enumerate(wire.parts(bucket, memory.compensate(bucket.name, g))):
            wire.tap(bucket, part, x, payloads[part])
    return Fused(payloads, lambda: memory.install(bucket.name, out, g, finite=finite,
                                                  sum_of_squares=squares, recycle=True))
