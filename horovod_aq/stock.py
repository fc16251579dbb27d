"""Horovod's stock ``compression=`` path: what to do with a gradient, and the errors it raises.

Horovod calls ``compression.compress(tensor)`` and *sums* what it returns across ranks, then
calls ``decompress`` (docs/protocol.md §1). Bit-packed codes cannot be summed, so a quantizing
compressor quantizes, dequantizes and ships fp16 there: the training sees the true quantization
noise, the wire saves 2x. The framework modules (``horovod_aq.torch.stock``,
``horovod_aq.tensorflow.stock``) do the tensor work; the decisions and messages are here.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any

from horovod_aq import error_feedback_setting

logger = logging.getLogger(__name__)

#: Largest finite fp16 value: an fp16 sum over the ranks must stay below it.
FP16_MAX = 65504.0
#: The packed integration to recommend, by framework.
PACKED_API = {"torch": "horovod_aq.torch.DistributedOptimizer",
              "tensorflow": "horovod_aq.tensorflow.DistributedGradientTape"}
#: Compressors already warned that this path runs them without error feedback.
_WARNED_NO_MEMORY: weakref.WeakSet = weakref.WeakSet()


def route(compression: Any, framework: str) -> str:
    """How the stock hook sends a floating-point gradient of ``compression``: "identity"
    (NoCompression), "fp16" (FP16) or "quantize" (quantize → dequantize → fp16). Raises for a
    compression the path cannot carry (:meth:`~horovod_aq.Compressor.stock_refusal`)."""
    if not compression.quantizes:
        return "fp16" if compression.fp16_wire else "identity"
    refusal = compression.stock_refusal(framework)
    if refusal is not None:
        raise NotImplementedError(refusal)
    compression.warn_stock_once()
    if compression not in _WARNED_NO_MEMORY:
        _WARNED_NO_MEMORY.add(compression)
        message = error_feedback_setting.stock_warning(compression, PACKED_API[framework])
        if message is not None:
            logger.warning(message)
    return "quantize"


def wire_scale(compression: Any) -> float:
    """The power of two c that the stock path multiplies dequantized values by before the fp16
    cast (and divides the average by after it); the same on every rank.

    A dequantized value is ℓ·‖v‖ with |ℓ| ≤ 1 (docs/quantizers.md §1). With the l2 norm
    ‖v‖₂ ≤ √B·max|v_i|, so q can be √B times the largest coordinate, and an fp16 sum would
    overflow at gradients √B times smaller than Horovod's own fp16 carries. With
    c = 2^−⌈log₂ √B⌉ ≤ 1/√B, |c·q| ≤ max|v_i|: the wire has Horovod's fp16 range. With the linf
    norm |q| ≤ max|v_i| already and c = 1. A power of two rescales fp16 values exactly (short of
    the subnormal range).
    """
    if compression.norm != "l2":
        return 1.0
    return 2.0 ** -math.ceil(0.5 * math.log2(compression.bucket_size))


def exceeds_fp16(peak: float, world: int) -> bool:
    """Whether an fp16 sum of ``world`` values of magnitude ``peak`` can overflow."""
    return peak * world > FP16_MAX


def fp16_range_message(compression: Any, framework: str, peak: float | None = None) -> str:
    value = "" if peak is None else f" ({peak:.3g})"
    return (f"{compression.name}: a quantized gradient value{value} (scaled for the wire) times "
            f"the number of ranks exceeds the fp16 range ({FP16_MAX}) of the stock compression= "
            f"path, as hvd.Compression.fp16 would; scale the loss down or use "
            f"{PACKED_API[framework]} (packed exchange, fp32 norms)")


def nonfinite_message(compression: Any, shape: Any, framework: str) -> str:
    return (f"{compression.name}: a gradient of shape {tuple(shape)} has non-finite values on "
            "this rank (Horovod's compression= hook does not say which parameter; the packed "
            f"{PACKED_API[framework]} names it and stops every rank together). Pass "
            "nonfinite='skip' to the compressor to send NaN so that every rank skips the step "
            "(e.g. with AMP's GradScaler).")
