"""The layouts of the TensorFlow packed exchange: how one list of sources is fused into buckets.

:func:`make_plan` is what :class:`~horovod_aq.tensorflow.packed.PackedExchange` runs once per
list of (source name, shape, dtype) it meets: the core's bucket planner
(``packed.plan.plan_buckets``, in backward order, docs/protocol.md §6) with the exchange's
settings, the content key that names every collective of the layout (the same on every rank that
averages the same sources with the same settings, whatever else a rank created), the layout
digest its handshake compares, this rank's row of the per-step agreement on what trains
(``packed.trainable``, docs/protocol.md §3.1) and where each source sits in its bucket.
:func:`plan_traffic_at` is what one exchange of a layout sends at a code width (telemetry,
docs/protocol.md §8).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from horovod_aq.packed import plan as names
from horovod_aq.packed.plan import BucketPlan, layout_digest, plan_buckets
from horovod_aq.packed.protocol import ExchangeSettings, Traffic, plan_traffic
from horovod_aq.packed.trainable import Trainable, agreement_row

__all__ = ["Plan", "make_plan", "plan_traffic_at", "small_numels"]


@dataclasses.dataclass
class Plan:
    """One layout: the buckets of a list of sources and its static telemetry numbers."""

    index: int
    names: list[str]
    shapes: list[tuple[int, ...]]
    buckets: list[BucketPlan]
    small: list[int]
    layout: int
    offsets: dict[int, int]          # source position -> offset inside its bucket
    fns: dict = dataclasses.field(default_factory=dict)  # eager entries by "raise" flag
    checked: bool = False
    content: str = ""                # the layout's content key (bucket and allreduce names)
    agreement: np.ndarray = dataclasses.field(   # this rank's row of the per-step agreement
        default_factory=lambda: np.zeros(4, np.int64))
    traffic: dict[int, Traffic] = dataclasses.field(default_factory=dict)  # by code width


def make_plan(compression: Any, settings: ExchangeSettings, *, ranks: int, coding: str,
              index: int, source_names: list[str], shapes: list[tuple[int, ...]]) -> Plan:
    """The layout number ``index`` of these sources (module docstring); ``coding`` ("fixed" or
    "entropy") enters the layout digest."""
    numels = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    order = list(range(len(source_names)))[::-1]
    content = names.exchange_key(compression.name, zip(source_names, numels),
                                 (settings.exchange, settings.cap_numel,
                                  settings.small_tensor_threshold, ranks))
    planned, small = plan_buckets(
        [source_names[i] for i in order], [numels[i] for i in order], [""] * len(order),
        prefix=f"{content}.0", cap_numel=settings.cap_numel,
        small_threshold=settings.small_tensor_threshold, quantizes=compression.quantizes,
        exchange=settings.exchange, bits=compression.code_bits,
        bucket_size=compression.bucket_size, ranks=ranks, network=settings.network)
    # map back from the reversed order to source positions
    buckets = [dataclasses.replace(b, members=tuple(order[m] for m in b.members))
               for b in planned]
    small = [order[m] for m in small]
    plan = Plan(index, source_names, shapes, buckets, small,
                layout_digest(buckets, [source_names[i] for i in small], coding), {})
    plan.content = content
    plan.agreement = agreement_row(Trainable.of(zip(source_names, numels)), plan.layout)
    for b in buckets:
        offset = 0
        for m in b.members:
            plan.offsets[m] = offset
            offset += numels[m]
    return plan


def small_numels(plan: Plan) -> list[int]:
    """The sizes of the layout's small tensors (its named allreduces)."""
    return [int(np.prod(plan.shapes[i], dtype=np.int64)) for i in plan.small]


def plan_traffic_at(plan: Plan, compression: Any, ranks: int, bits: int) -> Traffic:
    """What one exchange of ``plan`` sends at code width ``bits`` (``packed.protocol.
    plan_traffic``, kept per width in ``plan.traffic``)."""
    if bits not in plan.traffic:
        plan.traffic[bits] = plan_traffic(
            plan.buckets, small_numels(plan), fp16=compression.fp16_wire, bits=bits,
            bucket_size=compression.bucket_size, ranks=ranks)
    return plan.traffic[bits]
