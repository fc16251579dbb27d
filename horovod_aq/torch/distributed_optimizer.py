"""``horovod_aq.torch.DistributedOptimizer``: wrap a torch optimizer for the packed exchange.

The factory takes ``hvd.DistributedOptimizer``'s whole signature, in its order, plus the packed
exchange's keyword-only settings (docs/horovod_compat.md), checks them, and builds the class at
run time the way Horovod does: the base is the user's optimizer class, the attributes are
Horovod's ``_DistributedOptimizer``'s overlaid with :class:`horovod_aq.torch.optimizer.
_PackedOptimizer`'s (the exchange itself, docs/protocol.md §5). ``op=hvd.Adasum`` without
quantization is handed to Horovod's own optimizer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import horovod.torch as hvd
import torch
from horovod.torch.mpi_ops import Adasum, Average
from horovod.torch.optimizer import _DistributedOptimizer as _HorovodOptimizer

from horovod_aq.packed.cost import NetworkModel
from horovod_aq.packed.plan import DEFAULT_FUSION_BYTES
from horovod_aq.packed.protocol import ExchangeSettings, check_exchange_args, check_wire
from horovod_aq.packed.waiting import stall_timeout_s as stall_timeout_s_of
from horovod_aq.telemetry import Telemetry
from horovod_aq.torch import arguments
from horovod_aq.torch.optimizer import PackedOptimizer, _PackedOptimizer

logger = logging.getLogger(__name__)


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Any = None,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: hvd.ProcessSet = hvd.global_process_set,
    *,
    exchange: str = "auto",
    fusion_bytes: int = DEFAULT_FUSION_BYTES,
    small_tensor_threshold: int = 0,
    network: NetworkModel | None = None,
    telemetry: Telemetry | None = None,
    stall_timeout_s: float | None = None,
    wire: Any = "auto",
    error_feedback: bool | str = "auto",
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are averaged with the packed quantized exchange.

    The arguments up to ``process_set`` are ``hvd.DistributedOptimizer``'s, in its order and
    with its meaning (docs/horovod_compat.md); the keyword-only ones tune the packed exchange.

    Args:
        optimizer: the local optimizer (its class becomes the base of the returned object).
        named_parameters: ``model.named_parameters()``; names make collectives rank-independent.
        compression: a horovod_aq compressor, e.g. ``horovod_aq.ALQ(bits=3)``; a compressor
            class (``horovod_aq.ALQ``) is instantiated with its default settings (logged);
            ``hvd.Compression.none`` / ``.fp16`` mean ``NoCompression()`` / ``FP16()``.
            Default: no compression. Without quantization every gradient takes Horovod's own
            allreduce path (Horovod's speed, ``op``, scaling, ``groups``, sparse allreduce).
        backward_passes_per_step: local gradient accumulation steps before an exchange.
        op: ``hvd.Average`` (default) or ``hvd.Sum`` (the average times the set size).
            ``hvd.Adasum`` cannot combine quantized gradients (ValueError); without
            quantization it is handed to ``hvd.DistributedOptimizer`` unchanged. Without
            quantization any op Horovod's allreduce takes is passed on.
        gradient_predivide_factor: Horovod's split of the average (divide by f before the sum,
            by size/f after; only with ``op=hvd.Average``). Applied exactly as Horovod does to
            the allreduced tensors; the quantized buckets give the average either way (their
            payloads carry fp32 norms, so there is no fp16 range to protect).
        num_groups: Horovod's deprecated spelling of ``groups=n`` (DeprecationWarning).
        groups: Horovod's explicit grouping, ``n`` or a list of lists of parameters. Quantized
            buckets never mix two groups (each group's gradients are fused into buckets of their
            own, within ``fusion_bytes``); without quantization Horovod groups the allreduces.
        sparse_as_dense: Horovod's switch. Quantized: sparse gradients are always densified into
            the exchange (the result is the same dense average). Without quantization: as Horovod
            (sparse allreduce unless True).
        process_set: the Horovod process set to average over (all collectives use it).
        exchange: "auto" (cost model), "allgather" or "two_phase"; on several nodes of several
            ranks also "node_allgather" or "node_two_phase" (docs/protocol.md §5.7).
        fusion_bytes: cap of a fused bucket in bytes of fp32 gradient.
        small_tensor_threshold: parameters with fewer elements are allreduced uncompressed.
        network: parameters of the exchange cost model.
        telemetry: where step records go (default: an in-memory :class:`Telemetry`).
        stall_timeout_s: seconds a wait for one of the packed exchange's collectives may last
            before every stuck rank raises :class:`ExchangeStalledError` naming the collective
            (default ``$HOROVOD_AQ_STALL_TIMEOUT_S``, else 300; 0: wait forever).
        wire: "fixed" (fixed-width codes, one payload size per bucket), "entropy" (the
            entropy-coded body of docs/format.md §12 where it is smaller: variable-length
            payloads, docs/protocol.md §5.4; telemetry counts the bytes really sent) or "auto"
            (the default): after 2 warm-up steps every candidate wire — fixed and entropy
            codes in every exchange mode allowed — runs 4 steps in turn, then every rank takes
            the one rank 0 measured fastest, or within 3 % of it the one with the fewest bytes
            (docs/protocol.md §5.5; one log line). An
            ``horovod_aq.packed.autowire.AutoWire`` sets the schedule
            (``AutoWire("auto", warmup_steps=2, trials=4)``). The decision is in
            :meth:`state_dict` (``"horovod_aq_wire"``); :attr:`autowire` shows it.
        error_feedback: "auto" (the default) wraps a quantizer of at most 3 bits per code in
            ``horovod_aq.ErrorFeedback`` (its default coefficients, one INFO line) unless
            ``optimizer`` is adaptive (Adam, AdamW, RMSprop, ...: there it costs accuracy,
            docs/quantizers.md §5.11; one INFO line says so), True any
            quantizer, False none; an ``ErrorFeedback`` given stays as it is
            (:mod:`horovod_aq.error_feedback_setting`, docs/quantizers.md §5.9).
            :attr:`compression` is the compressor used.
    """
    wire = check_wire(wire)
    compression, groups = arguments.check_horovod_args(
        optimizer, compression, op=op, gradient_predivide_factor=gradient_predivide_factor,
        num_groups=num_groups, groups=groups, backward_passes_per_step=backward_passes_per_step,
        error_feedback=error_feedback)
    if op == Adasum:
        logger.info("op=hvd.Adasum with %s: using hvd.DistributedOptimizer (Horovod's Adasum "
                    "optimizer); the packed exchange's arguments and telemetry do not apply",
                    type(compression).__name__)
        return hvd.DistributedOptimizer(
            optimizer, named_parameters=named_parameters,
            compression=hvd.Compression.fp16 if compression.fp16_wire else hvd.Compression.none,
            backward_passes_per_step=backward_passes_per_step, op=Adasum,
            gradient_predivide_factor=gradient_predivide_factor, groups=groups,
            sparse_as_dense=sparse_as_dense, process_set=process_set)
    if compression.quantizes or compression.error_memory is not None:
        arguments.check_packed_op(op)
    check_exchange_args(exchange=exchange, fusion_bytes=fusion_bytes,
                        small_tensor_threshold=small_tensor_threshold)
    settings = ExchangeSettings(exchange, fusion_bytes, small_tensor_threshold, network)
    stall = stall_timeout_s_of(stall_timeout_s)
    if not hvd.is_initialized():
        raise RuntimeError("call horovod.torch.init() before creating the DistributedOptimizer")
    attrs = dict(_HorovodOptimizer.__dict__)
    # Keep Horovod's __module__: hvd.broadcast_optimizer_state recognizes its optimizers by it
    # and then initializes empty state with the wrapped optimizer's local step() instead of
    # this class's collective one (which would deadlock and count a compressor step).
    attrs.update({k: v for k, v in _PackedOptimizer.__dict__.items()
                  if k not in ("__dict__", "__weakref__", "__module__")})
    cls = PackedOptimizer.register(
        type(optimizer.__class__.__name__, (optimizer.__class__,), attrs))
    return cls(optimizer.param_groups, named_parameters, compression,
               backward_passes_per_step=int(backward_passes_per_step), process_set=process_set,
               settings=settings, sparse_as_dense=sparse_as_dense, telemetry=telemetry, op=op,
               gradient_predivide_factor=gradient_predivide_factor, groups=groups,
               stall_timeout=stall, wire=wire)


__all__ = ["DistributedOptimizer"]
