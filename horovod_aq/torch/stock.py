"""PyTorch's side of Horovod's stock ``compression=`` path (decisions: :mod:`horovod_aq.stock`).

``hvd.DistributedOptimizer(opt, compression=horovod_aq.ALQ(bits=3))``: ``compress`` quantizes
the gradient with the compressor's table and this rank's stream (the true quantization noise),
dequantizes it and ships fp16; ``decompress`` casts the average back to the gradient's dtype.
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
    flat = tensor.detach().reshape(-1)
    if kernels.first_nonfinite(flat) is not None:
        if compressor.nonfinite == "skip":   # every rank's sum becomes NaN: all skip alike
            return torch.full(tensor.shape, float("nan"), dtype=torch.float16,
                              device=tensor.device), tensor.dtype
        raise NonFiniteGradientError(stock.nonfinite_message(compressor, tensor.shape, "torch"))
    q = quantize_local(compressor, flat)
    peak = float(q.abs().max()) if q.numel() else 0.0
    if stock.exceeds_fp16(peak, horovod_world("horovod.torch")[1]):
        raise ValueError(stock.fp16_range_message(compressor, "torch", peak))
    return q.to(torch.float16).reshape(tensor.shape), tensor.dtype


def decompress(compressor: Compressor, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
    if ctx is not None:
        compressor.observe_aggregate(tensor)
    return tensor if ctx is None else tensor.to(ctx)


def refit(compressor: Compressor, *, process_set: Any = None) -> bool:
    """End one training step of ``compressor`` on the stock path; refit its levels when due.

    Call it once per step, after ``optimizer.step()``, on every rank of ``process_set``
    (default: all ranks). During the steps its schedule marks (``compressor.schedule``; pass
    ``schedule=`` to the compressor to change it) the compressor records bucket statistics
    inside ``compress``; at the end of such a step this runs the refit protocol (statistics
    gathered to rank 0, fitted, table broadcast) and the new table is used from the next step.
    DQSGD also picks the next step's bits here. Returns whether the table changed.
    """
    import horovod.torch as hvd

    from horovod_aq.torch.comm import comm_for

    process_set = process_set if process_set is not None else hvd.global_process_set
    if not process_set.included():
        return False
    return compressor.end_step(comm_for(process_set))
