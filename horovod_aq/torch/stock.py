"""PyTorch side of the compressors: random streams and Horovod's stock ``compression=`` path.

Stock path (``hvd.DistributedOptimizer(opt, compression=horovod_aq.ALQ(bits=3))``): Horovod
*sums* whatever ``compress`` returns, so the compressor quantizes the gradient with its level
table (unbiased stochastic rounding, the true quantization noise), dequantizes it and ships fp16.
``decompress`` casts the average back to the gradient's dtype.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from horovod_aq import codec
from horovod_aq.compressors import Compressor, seed_for_rank
from horovod_aq.torch import kernels

logger = logging.getLogger(__name__)

#: Largest finite fp16 value: an fp16 sum over the ranks must stay below it.
FP16_MAX = 65504.0


class TorchState:
    """Per-compressor PyTorch state: one seeded ``torch.Generator`` per device (the rank's
    stream, ``seed_for_rank(seed, rank)``), saved in the compressor's ``state_dict``."""

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self.generators: dict[str, torch.Generator] = {}
        self._keyed: dict[str, torch.Generator] = {}
        self._pending: dict[str, Any] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        gen = self.generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed_for_rank(self.compressor.seed, _rank()))
            if key in self._pending:
                gen.set_state(torch.from_numpy(np.asarray(self._pending.pop(key), dtype=np.uint8)))
            self.generators[key] = gen
        return gen

    def stream(self, device: torch.device, *key: int) -> torch.Generator:
        """A generator seeded from (seed, rank, *key): the packed optimizers draw the uniforms of
        step s, bucket b, part k from ``stream(device, s, b, k)``, so a resumed run draws exactly
        what an uninterrupted one would, whatever happened to generator states."""
        gen = self._keyed.get(str(device))
        if gen is None:
            gen = self._keyed[str(device)] = torch.Generator(device=device)
        gen.manual_seed(seed_for_rank(self.compressor.seed, _rank(), *key))
        return gen

    def state_dict(self) -> dict[str, Any]:
        saved = {k: g.get_state().numpy().copy() for k, g in self.generators.items()}
        saved.update({k: v for k, v in self._pending.items() if k not in saved})
        return {"generators": saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = dict(state.get("generators", {}))
        for key, gen in self.generators.items():
            if key in self._pending:
                gen.set_state(torch.from_numpy(np.asarray(self._pending.pop(key), dtype=np.uint8)))


def _rank() -> int:
    try:
        import horovod.torch as hvd

        return hvd.rank() if hvd.is_initialized() else 0
    except ImportError:
        return 0


def torch_state(compressor: Compressor) -> TorchState:
    """The compressor's :class:`TorchState` (created on first use; restores saved streams)."""
    state = compressor._fw_state.get("torch")
    if state is None:
        state = TorchState(compressor)
        pending = getattr(compressor, "_pending_framework_state", {}).pop("torch", None)
        if pending is not None:
            state.load_state_dict(pending)
        compressor._fw_state["torch"] = state
    return state


def quantize_local(compressor: Compressor, flat: torch.Tensor) -> torch.Tensor:
    """Quantize→dequantize a flat float tensor with the compressor's table and this rank's stream;
    records refit statistics when the compressor's schedule asks for them."""
    gen = torch_state(compressor).generator(flat.device)
    out = kernels.quantize(flat, compressor.table, bucket_size=compressor.bucket_size,
                           norm=compressor.norm, generator=gen)
    if compressor.recording:
        compressor.record_stats(
            *kernels.bucket_stats(flat, compressor.bucket_size),
            histogram=kernels.normalized_histogram(flat, compressor.bucket_size)
            if compressor.wants_histogram else None)
    return out


def compress(compressor: Compressor, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
    if not tensor.is_floating_point():
        return tensor, None
    if compressor.method == "fp16":
        return tensor.to(torch.float16), tensor.dtype
    compressor.warn_stock_once()
    flat = tensor.detach().reshape(-1)
    if kernels.first_nonfinite(flat) is not None:
        if compressor.nonfinite == "skip":   # every rank's sum becomes NaN: all skip alike
            return torch.full(tensor.shape, float("nan"), dtype=torch.float16,
                              device=tensor.device), tensor.dtype
        raise codec.NonFiniteGradientError(
            f"{compressor.name}: a gradient of shape {tuple(tensor.shape)} has non-finite values "
            "on this rank (Horovod's compression= hook does not say which parameter; the packed "
            "horovod_aq.torch.DistributedOptimizer names it and stops every rank together). "
            "Pass nonfinite='skip' to the compressor to send NaN so that every rank skips the "
            "step (e.g. with AMP's GradScaler).")
    q = quantize_local(compressor, flat)
    peak = float(q.abs().max()) if q.numel() else 0.0
    if peak * _world() > FP16_MAX:
        raise ValueError(
            f"{compressor.name}: a quantized gradient value ({peak:.3g}) times the number of ranks "
            f"exceeds the fp16 range ({FP16_MAX}) of the stock compression= path; scale the loss "
            "down or use horovod_aq.torch.DistributedOptimizer (packed exchange, fp32 norms)")
    return q.to(torch.float16).reshape(tensor.shape), tensor.dtype


def decompress(compressor: Compressor, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
    if ctx is not None:
        compressor.observe_aggregate(tensor)
    return tensor if ctx is None else tensor.to(ctx)


def _world() -> int:
    try:
        import horovod.torch as hvd

        return hvd.size() if hvd.is_initialized() else 1
    except ImportError:
        return 1


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
