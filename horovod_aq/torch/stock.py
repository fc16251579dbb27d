"""PyTorch's side of Horovod's stock ``compression=`` path (decisions: :mod:`horovod_aq.stock`).

``hvd.DistributedOptimizer(opt, compression=horovod_aq.ALQ(bits=3))``: ``compress`` quantizes
the gradient with the compressor's table and this rank's stream (the true quantization noise),
dequantizes it, scales it by the power of two :func:`horovod_aq.stock.wire_scale` (so the fp16 wire
has the range of Horovod's own fp16) and ships fp16; ``decompress`` undoes the scale and casts the
average back to the gradient's dtype.

Steps end by themselves (docs/protocol.md §14): the first ``compress`` registers one global
optimizer step post-hook (``torch.optim.optimizer.register_optimizer_step_post_hook``). After
every ``optimizer.step()`` of a Horovod ``DistributedOptimizer`` whose ``compression`` is a
horovod_aq compressor with an open step (its gradients went through ``compress``), the hook runs
:func:`refit` on the optimizer's process set: the refit protocol when the schedule says so, and
the step counter. An explicit :func:`refit` call after ``step()`` finds the step already ended and
changes nothing; so does the hook after Horovod's own local step in ``broadcast_optimizer_state``
(no gradient went through ``compress``).
"""

from __future__ import annotations

from typing import Any

import torch

from horovod_aq import stock
from horovod_aq.backend import horovod_world
from horovod_aq.codec import NonFiniteGradientError
from horovod_aq.compressors import Compressor
from horovod_aq.torch import kernels
from horovod_aq.torch.streams import torch_streams

_STEP_HOOK: list[Any] = []   # the handle of the one global optimizer step post-hook


def quantize_local(compressor: Compressor, flat: torch.Tensor) -> torch.Tensor:
    """Quantize→dequantize a flat float tensor with the compressor's table and this rank's stream;
    records refit statistics when the compressor's schedule asks for them."""
    gen = torch_streams(compressor).generator(flat.device)
    out = kernels.quantize(flat, compressor.table, bucket_size=compressor.bucket_size,
                           norm=compressor.norm, generator=gen)
    if compressor.recording:
        compressor.record_stats(
            *kernels.bucket_moments(flat, compressor.bucket_size),
            histogram=kernels.normalized_histogram(flat, compressor.bucket_size)
            if compressor.wants_histogram else None)
    return out


def compress(compressor: Compressor, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    if not tensor.is_floating_point():
        return tensor, None
    route = stock.route(compressor, "torch")
    if route == "identity":
        return tensor, None
    if route == "fp16":
        return tensor.to(torch.float16), tensor.dtype
    compressor.quantizer.open_step()     # on every rank, also one that sends NaN below
    _ensure_step_hook()
    flat = tensor.detach().reshape(-1)
    scale = stock.wire_scale(compressor)
    if kernels.first_nonfinite(flat) is not None:
        if compressor.nonfinite == "skip":   # every rank's sum becomes NaN: all skip alike
            return torch.full(tensor.shape, float("nan"), dtype=torch.float16,
                              device=tensor.device), (tensor.dtype, scale)
        raise NonFiniteGradientError(stock.nonfinite_message(compressor, tensor.shape, "torch"))
    q = quantize_local(compressor, flat).mul_(scale)
    peak = float(q.abs().max()) if q.numel() else 0.0
    if stock.exceeds_fp16(peak, horovod_world("horovod.torch")[1]):
        raise ValueError(stock.fp16_range_message(compressor, "torch", peak))
    return q.to(torch.float16).reshape(tensor.shape), (tensor.dtype, scale)


def decompress(compressor: Compressor, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
    if ctx is None:
        return tensor
    if not isinstance(ctx, tuple):          # FP16's cast
        return tensor.to(ctx)
    dtype, scale = ctx
    out = tensor.to(dtype).div_(scale)      # undo stock.wire_scale (a power of two: exact)
    compressor.observe_aggregate(out)
    return out


def refit(compressor: Compressor, *, process_set: Any = None) -> bool:
    """End one training step of ``compressor`` on the stock path; refit its levels when due.

    Horovod's ``DistributedOptimizer`` ends its steps by itself (module docstring); call this only
    where no such optimizer runs the step (e.g. ``hvd.allreduce(t, compression=comp)`` in a
    custom loop): once per step, after the update, on every rank of ``process_set`` (default: all
    ranks). During the steps its schedule marks (``compressor.schedule``) the compressor records
    bucket statistics inside ``compress``; at the end of such a step this runs the refit protocol
    (statistics gathered to rank 0, fitted, table broadcast) and the new table is used from the
    next step. A step that already ended (by the hook) is not ended again. Returns whether the
    table changed in the step that ended.
    """
    import horovod.torch as hvd

    from horovod_aq.torch.comm import comm_for

    process_set = process_set if process_set is not None else hvd.global_process_set
    if not process_set.included():
        return False
    if isinstance(compressor, type):
        compressor = compressor.shared()       # the class stands for its shared instance
    return compressor.quantizer.end_open_step(comm_for(process_set))


def _ensure_step_hook() -> None:
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _STEP_HOOK.append(register_optimizer_step_post_hook(_end_step_after_update))


def _end_step_after_update(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Global step post-hook: end the open step of a Horovod optimizer's horovod_aq compressor.

    Fires for every optimizer; Horovod's ``DistributedOptimizer`` keeps its compression in
    ``_compression`` and its process set in ``process_set``. Torch wraps both the Horovod class's
    ``step`` and the base class's, so the hook may fire twice per step: the second finds the step
    ended.
    """
    compression = getattr(optimizer, "_compression", None)
    if isinstance(compression, type) and issubclass(compression, Compressor):
        compression = compression.shared()     # compression=horovod_aq.ALQ (the class)
    if not isinstance(compression, Compressor) or not compression.quantizer.step_open:
        return
    refit(compression, process_set=getattr(optimizer, "process_set", None))
