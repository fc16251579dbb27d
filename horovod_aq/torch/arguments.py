"""The arguments of ``horovod_aq.torch.DistributedOptimizer``: Horovod's rules and the packed
exchange's, checked before anything is built, with messages that say what to do
(docs/horovod_compat.md)."""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import numpy as np
import torch
from horovod.torch.compression import FP16Compressor, NoneCompressor
from horovod.torch.mpi_ops import Adasum, Average, Sum

from horovod_aq import error_feedback_setting
from horovod_aq.compressors import FP16, Compressor, NoCompression
from horovod_aq.packed.protocol import check_compression

logger = logging.getLogger(__name__)

ADASUM_MESSAGE = (
    "op=hvd.Adasum cannot run on quantized gradients: Adasum combines the full-precision gradient "
    "vectors of pairs of ranks adaptively (scaling each by their dot products and norms, "
    "recursively), and packed codes cannot be combined that way, nor summed. Use op=hvd.Average "
    "(or hvd.Sum) with horovod_aq compression, or hvd.DistributedOptimizer(op=hvd.Adasum) without "
    "it (horovod_aq.torch.DistributedOptimizer with NoCompression()/FP16() hands Adasum to "
    "Horovod's own optimizer).")
WRAPPED_MESSAGE = (
    "optimizer is already a DistributedOptimizer (horovod_aq's or Horovod's): wrap the local "
    "torch optimizer once, e.g. horovod_aq.torch.DistributedOptimizer(torch.optim.SGD(...), "
    "named_parameters=model.named_parameters(), compression=...)")


def check_horovod_args(optimizer: Any, compression: Any, *, op: Any,
                       gradient_predivide_factor: float, num_groups: int, groups: Any,
                       backward_passes_per_step: Any,
                       error_feedback: bool | str = "auto") -> tuple[Any, Any]:
    """``hvd.DistributedOptimizer``'s arguments as Horovod checks them, plus what the packed
    exchange refuses; returns (the compression resolved, with error feedback as
    ``error_feedback`` says (:mod:`horovod_aq.error_feedback_setting`), the groups:
    ``num_groups`` folded in).
    """
    if "_allreduce_grad_async" in type(optimizer).__dict__:
        raise TypeError(WRAPPED_MESSAGE)
    error_feedback_setting.check(error_feedback)
    compression = resolve_compression(compression)
    check_compression(compression, "hvd.DistributedOptimizer")
    compression = error_feedback_setting.resolve(compression, error_feedback, optimizer)
    passthrough = not compression.quantizes and compression.error_memory is None
    if op == Adasum and not passthrough:
        raise ValueError(ADASUM_MESSAGE)
    if gradient_predivide_factor != 1.0:
        if op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if not (isinstance(gradient_predivide_factor, (int, float))
                and math.isfinite(gradient_predivide_factor) and gradient_predivide_factor > 0):
            raise ValueError("gradient_predivide_factor must be a finite number > 0, got "
                             f"{gradient_predivide_factor!r}")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed "
                      "in v0.23.0.", DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = num_groups
    check_groups(groups)
    if isinstance(backward_passes_per_step, bool) or not isinstance(
            backward_passes_per_step, (int, np.integer)) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, got "
                         f"{backward_passes_per_step!r}")
    return compression, groups


def check_packed_op(op: Any) -> None:
    """The packed exchange averages quantized gradients (or sums them, ``hvd.Sum``)."""
    if op not in (Average, Sum):
        raise ValueError("the packed exchange averages quantized gradients: op must be "
                         f"hvd.Average or hvd.Sum, got {op!r}; use hvd.DistributedOptimizer "
                         "without horovod_aq compression for other reductions")


def groups_key(groups: Any, parameter_names: dict[Any, str]) -> Any:
    """Horovod ``groups`` as rank-independent content (parameter names, not tensors)."""
    if isinstance(groups, list):
        return [[parameter_names.get(p, "?") for p in members] for members in groups]
    return groups


def resolve_compression(compression: Any) -> Any:
    """None and Horovod's ``Compression.none`` → NoCompression(), ``Compression.fp16`` → FP16(),
    a compressor class → an instance with its default settings; anything else as it is."""
    if compression is None or is_horovod(compression, NoneCompressor):
        return NoCompression()
    if is_horovod(compression, FP16Compressor):
        return FP16()
    if isinstance(compression, type) and issubclass(compression, Compressor):
        try:
            instance = compression()
        except Exception as exc:
            raise TypeError(
                f"compression=horovod_aq.{compression.__name__} is a class that cannot be used "
                f"with default settings ({exc}); pass an instance, e.g. "
                "compression=horovod_aq.ALQ(bits=3)") from exc
        logger.info("compression=horovod_aq.%s (the class): using %r, its default settings; "
                    "pass an instance such as horovod_aq.ALQ(bits=3) to choose them",
                    compression.__name__, instance)
        return instance
    return compression


def is_horovod(compression: Any, cls: type) -> bool:
    return (isinstance(compression, type) and issubclass(compression, cls)) or isinstance(
        compression, cls)


def check_groups(groups: Any) -> None:
    """Horovod's rules for ``groups``: None, an integer > 0 or a list of lists of tensors, each
    tensor at most once."""
    if groups is None:
        return
    if isinstance(groups, list):
        seen: set[int] = set()
        for members in groups:
            for p in members:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
        return
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups <= 0:
        raise ValueError("groups should be a non-negative integer or a list of list of "
                         f"torch.Tensor, got {groups!r}.")


__all__ = ["ADASUM_MESSAGE", "WRAPPED_MESSAGE", "check_groups", "check_horovod_args",
           "check_packed_op", "groups_key", "is_horovod", "resolve_compression"]
