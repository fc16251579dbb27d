"""The ``wire=`` setting of the packed torch exchanges — once for the Horovod optimizer and the DDP
hook (docs/protocol.md §5.4, §5.5).

``wire`` is "fixed", "entropy" or "auto", or an :class:`~horovod_aq.packed.autowire.AutoWire`
whose ``wire``, ``warmup_steps`` and ``measure_steps`` are taken (e.g.
``AutoWire("auto", warmup_steps=1, measure_steps=4)`` for a short measurement). A
:class:`WireSetting` holds the exchange's own AutoWire (named after the exchange, so that the
agreement's collective names are rank-independent and unique) and does, for either engine:

* :meth:`WireSetting.attach`: hands the AutoWire to the :class:`~horovod_aq.torch.wire.Wire`,
  which records the measurement steps' samples;
* :meth:`WireSetting.coding` / :meth:`WireSetting.mode`: a bucket's coding and exchange mode at a
  step (the schedule's, then the decision's; a bucket the decision does not know keeps fixed
  codes and its planned mode, on every rank alike);
* :meth:`WireSetting.digest`: the wire's part of the handshake's layout digest ("auto" with its
  schedule, and after a decision every bucket's decided coding and mode), so ranks on different
  settings or decisions stop with ``ConfigMismatchError`` instead of misreading payloads;
* :meth:`WireSetting.end_step`: at the end of every exchanged step, on every rank: the
  agreement (:meth:`AutoWire.decide` over the engine's refit ``Comm``: rank 0 fits, chooses and
  logs one line, every rank installs its broadcast) when it is due; a decision made for other
  buckets (the layout changed) restarts the measurement.

What the engines do with a decision: set ``Bucket.coding`` from :meth:`coding` at every step,
re-plan the buckets with :func:`~horovod_aq.packed.autowire.with_modes` when modes changed, and
run the handshake again before the next exchange.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from horovod_aq.packed.autowire import AutoWire, WireDecision, plans_digest
from horovod_aq.packed.plan import BucketPlan
from horovod_aq.packed.protocol import check_wire

logger = logging.getLogger(__name__)


def _auto_for(wire: Any, name: str) -> AutoWire:
    if isinstance(wire, AutoWire):
        return AutoWire(wire.wire, warmup_steps=wire.warmup_steps,
                        measure_steps=wire.measure_steps, name=name)
    return AutoWire(check_wire(wire), name=name)


class WireSetting:
    """The wire setting of one packed exchange (module docstring)."""

    __slots__ = ("auto",)

    def __init__(self, wire: Any = "fixed", *, name: str) -> None:
        #: The exchange's :class:`AutoWire` (schedule, samples, decision; a forced coding too).
        self.auto = _auto_for(wire, name)

    @property
    def wire(self) -> str:
        """"fixed", "entropy" or "auto"."""
        return self.auto.wire

    @property
    def decision(self) -> WireDecision | None:
        """The agreed decision (``wire="auto"``), None before it."""
        return self.auto.decision

    def attach(self, engine: Any) -> None:
        """Let the wire engine record into this setting's AutoWire (``wire="auto"`` only)."""
        engine.auto = self.auto if self.auto.wire == "auto" else None

    def _known(self, step: int, index: int) -> bool:
        d = self.auto.decision
        return d is None or step < d.step or 0 <= index < len(d.choices)

    def coding(self, step: int, index: int) -> str:
        """The coding of bucket ``index`` at ``step`` (anchors the schedule at the first step)."""
        return self.auto.coding(step, index) if self._known(step, index) else "fixed"

    def mode(self, step: int, index: int, planned: str) -> str:
        """The exchange mode of bucket ``index`` at ``step``: the decided one, else ``planned``."""
        return self.auto.mode(step, index, planned) if self._known(step, index) else planned

    def digest(self) -> str:
        """The wire's text in the handshake's layout digest (``packed.plan.layout_digest``)."""
        a = self.auto
        if a.wire != "auto":
            return a.wire
        text = f"auto(warmup={a.warmup_steps},measure={a.measure_steps})"
        if a.decision is not None:
            text += f"@{a.decision.step}:" + ",".join(
                f"{c.coding}/{c.mode}" for c in a.decision.choices)
        return text

    def end_step(self, step: int, comm: Any, plans: Sequence[BucketPlan], *, bits: int,
                 compression: Any, exchange: str) -> WireDecision | None:
        """At the end of exchanged step ``step``, on every rank: the agreement when it is due
        (returns the new decision), else None. A decision made for other buckets than ``plans``
        restarts the measurement at the next step (logged)."""
        a = self.auto
        if a.wire != "auto" or not plans:
            return None
        if a.decision is not None:
            if plans_digest(plans) != a.decision.layout:
                logger.info("horovod_aq: %s: the buckets changed since the wire decision; "
                            "measuring the wire again from step %d", a.name, step + 1)
                a.restart(step + 1)
            return None
        if not a.due(step):
            return None
        return a.decide(comm, plans, bits=bits, bucket_size=compression.bucket_size,
                        num_levels=compression.quantizer.table.num_levels, exchange=exchange)

    def modes_changed(self, plans: Sequence[BucketPlan]) -> bool:
        """Whether the decision gives any of ``plans`` another exchange mode."""
        d = self.auto.decision
        return d is not None and any(c.mode != p.mode for c, p in zip(d.choices, plans))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The AutoWire's state (setting, anchor, decision vector)."""
        return self.auto.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None,
                        plans: Sequence[BucketPlan] | None = None) -> None:
        """Restore a saved decision (None: nothing saved, measure again). With ``plans``, a
        decision made for other buckets is dropped (logged) and the measurement restarts."""
        if state is None:
            self.auto.load_state_dict({"wire": self.auto.wire, "decision": None})
            return
        self.auto.load_state_dict(state)
        d = self.auto.decision
        if d is not None and plans is not None and plans_digest(plans) != d.layout:
            logger.warning("horovod_aq: %s: the checkpoint's wire decision was made for other "
                           "buckets; measuring the wire again", self.auto.name)
            self.auto.load_state_dict({"wire": self.auto.wire, "decision": None})


__all__ = ["WireSetting"]
