"""The packed optimizer's layout (``horovod_aq.torch.DistributedOptimizer``,
docs/protocol.md §5–§6): which parameters it exchanges and under which names, the fused
buckets and their planned exchange modes (with Horovod's ``groups``), the layout digest the
handshake compares, and each step's wire (``wire="auto"``'s trials, then its decision). The
functions take the optimizer; what they decide is the same on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from horovod.common.util import split_list

from horovod_aq.packed.autowire import with_modes
from horovod_aq.packed.plan import BucketPlan, layout_digest, plan_buckets
from horovod_aq.packed.protocol import Traffic, plan_traffic
from horovod_aq.packed.trainable import Trainable
from horovod_aq.torch.wire import Bucket


class OptimizerBucket(Bucket):
    """A fused group of parameters: the wire's bucket, plus where its parameters' gradients land
    and which of them arrived (and had a gradient) this step."""

    __slots__ = ("params", "slots", "buffer", "arrived", "absent", "delivered")

    def __init__(self, plan: BucketPlan, params: list[torch.Tensor],
                 param_names: list[str]) -> None:
        self.params = params
        self.buffer = torch.zeros(plan.numel, dtype=torch.float32, device=params[0].device)
        #: Parameters whose gradient arrived this step, and those whose ``.grad`` was None on
        #: this rank (sent as zeros; the presence mask tells the other ranks).
        self.arrived: set[torch.Tensor] = set()
        self.absent: set[torch.Tensor] = set()
        super().__init__(plan, param_names, [p.numel() for p in params], masked=True)
        #: (offset, numel) of each parameter in :attr:`buffer`.
        self.slots = {p: (o, n) for p, o, n in zip(params, self.offsets, self.numels)}

    def reset(self) -> None:
        super().reset()
        self.arrived.clear()
        self.absent.clear()
        #: Whether the result was handed over (observed, scaled) this step.
        self.delivered = False

    def present(self) -> list[bool]:
        """Which parameters had a gradient on this rank (the presence mask)."""
        return [p not in self.absent for p in self.params]


def trainable_params(opt: Any) -> list[torch.Tensor]:
    """The parameters that get gradients, in registration order."""
    return [p for group in opt.param_groups for p in group["params"] if p.requires_grad]


def trainable_now(opt: Any) -> Trainable:
    return Trainable.of((param_name(opt, p), p.numel()) for p in trainable_params(opt))


def param_name(opt: Any, p: torch.Tensor) -> str:
    """The parameter's name: from ``named_parameters``, or for a parameter added later
    without one, Horovod's unnamed form by its place (the same on every rank)."""
    name = opt._parameter_names.get(p)
    if name is None:
        g, i = next((g, i) for g, group in enumerate(opt.param_groups)
                    for i, q in enumerate(group["params"]) if q is p)
        name = opt._parameter_names[p] = f"allreduce.noname.{g}.{i}"
    return name


def plan(opt: Any) -> None:
    """Assign every trainable parameter to a bucket or to the allreduce route, in reverse
    registration order (≈ backward order); see :func:`horovod_aq.packed.plan.plan_buckets`.
    With Horovod ``groups``, no bucket mixes two groups (:func:`group_ids`)."""
    ordered = trainable_params(opt)
    ordered.reverse()
    param_names = [opt._parameter_names[p] for p in ordered]
    numels = [p.numel() for p in ordered]
    devices = [str(p.device) for p in ordered]
    comp, settings = opt._aq, opt._aq_settings

    def buckets_of(members: list[int], prefix: str) -> tuple[list[BucketPlan], list[int]]:
        sub, small = plan_buckets(
            [param_names[i] for i in members], [numels[i] for i in members],
            [devices[i] for i in members], prefix=prefix, cap_numel=settings.cap_numel,
            small_threshold=settings.small_tensor_threshold, quantizes=comp.quantizes,
            exchange=settings.exchange, bits=comp.code_bits, bucket_size=comp.bucket_size,
            ranks=opt._aq_ranks, network=settings.network, per_node=opt._aq_per_node)
        return sub, [members[i] for i in small]

    groups = None if opt._aq_passthrough else group_ids(opt, ordered)
    if groups is None:
        plans, small = buckets_of(list(range(len(ordered))), f"{opt._aq_prefix}.0")
    else:
        plans, small = [], []
        for gid in dict.fromkeys(groups):   # groups in backward order of first member
            members = [i for i, g in enumerate(groups) if g == gid]
            sub, sub_small = buckets_of(members, f"{opt._aq_prefix}.0.g{gid}")
            for b in sub:   # one index space for all buckets (the stream key uses it)
                plans.append(dataclasses.replace(
                    b, index=len(plans), members=tuple(members[m] for m in b.members)))
            small.extend(sub_small)
    opt._aq_route: dict[torch.Tensor, OptimizerBucket | None] = {ordered[i]: None for i in small}
    opt._aq_small_numels = [ordered[i].numel() for i in small]
    opt._aq_small_names = [param_names[i] for i in small]
    opt._aq_plans = opt._aq_planned = plans
    opt._aq_buckets = [OptimizerBucket(plan, [ordered[i] for i in plan.members],
                                [param_names[i] for i in plan.members]) for plan in plans]
    for bucket in opt._aq_buckets:
        for p in bucket.params:
            opt._aq_route[p] = bucket
    set_layout(opt)


def set_layout(opt: Any) -> None:
    """The layout digest the handshake compares: buckets, modes, allreduced tensors and the
    wire (with ``wire="auto"``, its schedule and decision)."""
    opt._aq_layout = layout_digest(opt._aq_plans, opt._aq_small_names,
                                    opt._aq_wire_setting.digest())


def replan(opt: Any) -> None:
    """Give the buckets the exchange modes of the wire decision, or the planned ones
    without a decision (every rank at the same step boundary); the handshake runs again
    before the next exchange."""
    decision = opt._aq_wire_setting.decision
    plans = (opt._aq_planned if decision is None
             else with_modes(opt._aq_planned, decision))
    if [p.mode for p in plans] != [p.mode for p in opt._aq_plans]:
        opt._aq_plans = plans
        for bucket, plan in zip(opt._aq_buckets, plans):
            bucket.plan = plan
        opt._aq_traffic.clear()
    set_layout(opt)
    opt._aq_checked = False


def load_wire(opt: Any, state: dict[str, Any] | None) -> None:
    """Install a saved wire setting state (None: measure again), re-plan to it."""
    opt._aq_wire_setting.load_state_dict(state, opt._aq_planned)
    replan(opt)


def group_ids(opt: Any, ordered: list[torch.Tensor]) -> list[int] | None:
    """Horovod's ``groups`` as a group number per parameter of ``ordered`` (None: no groups).

    ``groups=n`` splits the trainable parameters, in registration order, into n contiguous
    groups as Horovod does (``split_list``); ``groups=[[p, ...], ...]`` names groups
    explicitly, and the parameters outside every list share one more group (fused as
    without groups; Horovod allreduces each of them on its own, but its tensor fusion
    batches them again). A group's gradients then travel in buckets of their own, each
    submitted when its last member's gradient is ready — what Horovod's grouped allreduce
    does for a group.
    """
    groups = opt._aq_groups
    if groups is None:
        return None
    if isinstance(groups, list):
        number = {id(p): k for k, members in enumerate(groups) for p in members}
        return [number.get(id(p), len(groups)) for p in ordered]
    registered = trainable_params(opt)
    number = {id(p): k for k, chunk in enumerate(split_list(registered, groups))
              for p in chunk}
    return [number[id(p)] for p in ordered]


def wire_for(opt: Any, step: int) -> None:
    """This step's coding and exchange mode of every bucket (``wire="auto"``: the trials'
    candidate, then the decision's; packed.wire_setting) — the same on every rank, so the
    layout digest and the handshake stand."""
    setting = opt._aq_wire_setting
    for bucket, planned in zip(opt._aq_buckets, opt._aq_planned):
        bucket.coding = setting.coding(step, bucket.index)
        mode = setting.mode(step, bucket.index, planned.mode)
        if mode != bucket.plan.mode:
            bucket.plan = dataclasses.replace(bucket.plan, mode=mode)
            opt._aq_traffic.clear()
    opt._aq_plans = [bucket.plan for bucket in opt._aq_buckets]


def traffic_at(opt: Any, bits: int) -> Traffic:
    """What one exchange of this optimizer's plan sends at code width ``bits``."""
    if bits not in opt._aq_traffic:
        opt._aq_traffic[bits] = plan_traffic(
            opt._aq_plans, opt._aq_small_numels, fp16=opt._aq.fp16_wire, bits=bits,
            bucket_size=opt._aq.bucket_size, ranks=opt._aq_ranks, per_node=opt._aq_per_node)
    return opt._aq_traffic[bits]


__all__ = ["OptimizerBucket", "group_ids", "load_wire", "param_name", "plan", "replan",
           "set_layout", "trainable_now", "trainable_params", "traffic_at", "wire_for"]
