"""ECQ-SGD's fused send of a bucket for the torch wire: compensate, encode and update the error
memory in one pass per part (docs/dynamic.md §2.6), on CPU and CUDA tensors.

:func:`encode_compensated` is ``packed.send.SendSteps.encode_compensated`` for
:class:`~horovod_aq.torch.wire.Wire`: for each part — the whole bucket (allgather, part 0) or
chunk k of its zero padding to P·m coordinates (two-phase first phase, part k; the averaged
chunk's re-encode has no memory) — it runs the fused kernel on views of g, h and the output
buffer, with the wire's stream key and timing (``Wire.timed_encode``):

* **CPU**: ``codec.fused_compensated.try_encode_compensated`` on zero-copy numpy views, part
  by part;
* **CUDA** (Triton): ``torch.triton_send.Send``: every part is launched without a host
  sync, then one device→host copy of the flags and per-bucket sums decides whether the bucket
  travels (checksums add their own host round trip per part; the entropy-coded wire reads
  them with its histograms, then its sizes: ``Wire.entropy_code``);
* **CUDA, decided on the device** (a wire that settles, ``Wire.defer``; fixed-width codes, no
  checksums, not while recording): the same launches, then the markers chosen on the device
  (``Send.decide``), h' swapped into the memory at once, and the outcome
  read at the step's end by ``Wire.settle`` with the step's other flags (docs/dynamic.md §2.6).

h' goes into the memory's spare buffer (``ErrorMemory.spare``; allocated the first time), is
installed by the returned callable after the send succeeded, and never where a bucket cannot
travel: the wire then sends markers (docs/protocol.md §4) and h stays as it was. The tap, when
set, sees x = g + α·h, computed for it after a successful pass.

Other dtypes, CUDA without Triton and ``HOROVOD_AQ_KERNELS=ops`` keep the unfused steps
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
    """Whether the wire sends ``raw`` with the fused pass: error feedback on, a flat contiguous
    float32 gradient, and a fused kernel for its device (``kernels.implementation_for``): the
    compiled CPU kernel ("fused") or Triton's on CUDA ("triton")."""
    return (wire.memory is not None and raw.dtype == torch.float32 and raw.dim() == 1
            and raw.is_contiguous()
            and kernels.implementation_for(raw.device) in ("fused", "triton"))


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
    memory = wire.memory
    g = raw.detach()
    h = memory.saved(bucket.key, g)
    h = None if h is None else h.detach().contiguous()
    out = memory.spare(bucket.key, g)
    if out is None:
        out = torch.empty_like(g)
    spans = part_spans(bucket.mode, bucket.numel, wire.ranks, wire.q.bucket_size)
    if _decided_on_device(wire, bucket, g):
        return _triton_on_device(wire, bucket, g, h, out, spans)
    parts = (_triton_parts if kernels.implementation_for(g.device) == "triton"
             else _compiled_parts)
    found = parts(wire, bucket, g, h, out, spans)
    if found is None:
        return None
    payloads, finite, squares = found
    _tap(wire, bucket, g, payloads)
    return Fused(payloads, lambda: memory.install(bucket.key, out, g, finite=finite,
                                                  sum_of_squares=squares, recycle=True))


def _tap(wire: Any, bucket: Any, g: torch.Tensor, payloads: list[torch.Tensor]) -> None:
    """The wire's tap sees x = g + α·h of every part (h: the memory before this send)."""
    if wire.tap is not None:
        for part, x in enumerate(wire.parts(bucket, wire.memory.compensate(bucket.key, g))):
            wire.tap(bucket, part, x, payloads[part])


def _decided_on_device(wire: Any, bucket: Any, g: torch.Tensor) -> bool:
    """Whether the send's outcome stays on the device until the step's end: Triton, a wire
    that settles (``Wire.defer``), fixed-width codes without checksums, nothing recorded."""
    return wire.defer and not wire.q.recording and wire.decides_on_device(bucket, g)


Parts = tuple[list[torch.Tensor], bool, float]


def _compiled_parts(wire: Any, bucket: Any, g: torch.Tensor, h: torch.Tensor | None,
                    out: torch.Tensor, spans: list[tuple[int, int, int]]) -> Parts | None:
    """CPU: the compiled kernel part by part on zero-copy numpy views; stops at the first part
    that cannot travel."""
    from horovod_aq.codec import fused_compensated  # numba, as kernels imports it: on first use

    q, memory = wire.q, wire.memory
    g_np, out_np = g.numpy(), out.numpy()
    h_np = None if h is None else h.numpy()
    payloads: list[torch.Tensor] = []
    finite, squares = True, 0.0
    for part, (lo, hi, size) in enumerate(spans):
        sent = []

        def run(key, lo=lo, hi=hi, size=size, sent=sent):
            found = fused_compensated.try_encode_compensated(
                g_np[lo:hi], None if h_np is None else h_np[lo:hi], memory.alpha, memory.beta,
                bucket.table, bucket_size=q.bucket_size, norm=q.norm, key=key, numel=size,
                coding=bucket.coding, checksum=q.checksum, memory_out=out_np[lo:hi])
            sent.append(found)
            return None if found is None else torch.from_numpy(found.payload)

        payload = wire.timed_encode(bucket, part, run)
        if payload is None:
            return None
        payloads.append(payload)
        finite = finite and sent[0].memory_finite
        squares += sent[0].memory_sum_of_squares
    return payloads, finite, squares


def _launched(wire: Any, bucket: Any, g: torch.Tensor, h: torch.Tensor | None,
              out: torch.Tensor, spans: list[tuple[int, int, int]], *,
              finish: bool = True) -> tuple[Any, list]:
    """CUDA: every part launched by ``triton_send.Send`` without waiting: the send and
    its payloads as they travel (sealed where the wire says so); not ``finish``: the
    fixed-width payloads, for the entropy coder."""
    from horovod_aq.torch import triton_compensated, triton_send

    q, memory = wire.q, wire.memory
    send = triton_send.Send(bucket.table, bucket_size=q.bucket_size, norm=q.norm,
                                   alpha=memory.alpha, beta=memory.beta,
                                   sizes=[size for _, _, size in spans], device=g.device)
    payloads = []
    for part, (lo, hi, size) in enumerate(spans):
        def run(key, lo=lo, hi=hi, size=size):
            fixed = send.encode(g[lo:hi], None if h is None else h[lo:hi], out[lo:hi], key)
            return triton_compensated.finish(fixed, bucket.table, size, q.bucket_size,
                                             checksum=q.checksum) if finish else fixed

        payloads.append(wire.timed_encode(bucket, part, run))
    return send, payloads


def _triton_parts(wire: Any, bucket: Any, g: torch.Tensor, h: torch.Tensor | None,
                  out: torch.Tensor, spans: list[tuple[int, int, int]]) -> Parts | None:
    """CUDA: every part launched (:func:`_launched`), then the send's one device→host read
    decides (the parts of a bucket that cannot travel are discarded); entropy-coded parts:
    read with their histograms, then coded (``Wire.entropy_code``: two reads for them all)."""
    if bucket.variable:
        send, fixed = _launched(wire, bucket, g, h, out, spans, finish=False)
        payloads, result, _ = wire.entropy_code(bucket, send, fixed)
        return None if payloads is None else (payloads, *send.outcome_of(result))
    send, payloads = _launched(wire, bucket, g, h, out, spans)
    found = send.outcome()
    return None if found is None else (payloads, *found)


def _triton_on_device(wire: Any, bucket: Any, g: torch.Tensor, h: torch.Tensor | None,
                      out: torch.Tensor, spans: list[tuple[int, int, int]]) -> Fused:
    """CUDA, nothing read on the host: every part launched (:func:`_launched`; fixed-width
    payloads), shown to the tap, then each replaced in place by its marker where the kernel
    found a bad element (``Send.decide``: one launch). The install: h' becomes the memory at
    once (``ErrorMemory.swap_in``), and ``Wire.settle`` reads the send's outcome at the step's
    end with the step's other flags, keeping h' or giving h back (``ErrorMemory.settle_swap``)."""
    memory = wire.memory
    send, payloads = _launched(wire, bucket, g, h, out, spans)
    _tap(wire, bucket, g, payloads)

    def install() -> None:
        wire.hold_send(bucket.key, send, out, memory.swap_in(bucket.key, out), g)
    return Fused(send.decide(), install)
