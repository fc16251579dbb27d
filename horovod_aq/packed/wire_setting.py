"""The ``wire=`` setting of the packed torch exchanges — once for the Horovod optimizer and the DDP
hook (docs/protocol.md §5.4, §5.5).

``wire`` is "fixed", "entropy" or "auto", or an :class:`~horovod_aq.packed.autowire.AutoWire`
whose ``wire``, ``warmup_steps`` and ``trials`` are taken (e.g.
``AutoWire("auto", warmup_steps=1, trials=2)`` for a short measurement). A
:class:`WireSetting` holds the exchange's own AutoWire (named after the exchange, so that the
agreement's collective names are rank-independent and unique) and does, for either engine:

* :meth:`WireSetting.attach`: takes the set size from the engine
  (:class:`~horovod_aq.torch.wire.Wire`), which fixes the trials' candidates;
* :meth:`WireSetting.coding` / :meth:`WireSetting.mode`: a bucket's coding and exchange mode at a
  step (the schedule's: warm-up, trials, then the decision's; a bucket the decision does not
  know keeps fixed codes and its planned mode, on every rank alike);
* :meth:`WireSetting.digest`: the wire's part of the handshake's layout digest ("auto" with its
  schedule, and after a decision every bucket's decided coding and mode), so ranks on different
  settings or decisions stop with ``ConfigMismatchError`` instead of misreading payloads;
* :meth:`WireSetting.end_step`: at the end of every exchanged step, on every rank: the step's
  seconds (from the end of the step before) and bytes go to the trials, and the agreement
  (:meth:`AutoWire.decide` over the engine's refit ``Comm``: rank 0 chooses and logs one line,
  every rank installs its broadcast) runs when it is due; a decision made for other buckets
  (the layout changed) restarts the measurement.

What the engines do: set ``Bucket.coding`` and the bucket's mode from :meth:`coding` and
:meth:`mode` at every step (the trials change both, on every rank alike, without a new
handshake: the digest's "auto(...)" text stands for the whole schedule), re-plan the buckets
with :func:`~horovod_aq.packed.autowire.with_modes` at the decision, and run the handshake
again before the next exchange.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from horovod_aq.packed.autowire import AutoWire, WireDecision, plans_digest
from horovod_aq.packed.plan import BucketPlan
from horovod_aq.packed.protocol import check_wire

logger = logging.getLogger(__name__)


def _auto_for(wire: Any, name: str, exchange: str) -> AutoWire:
    if isinstance(wire, AutoWire):
        return AutoWire(wire.wire, warmup_steps=wire.warmup_steps, trials=wire.trials,
                        name=name, exchange=exchange)
    return AutoWire(check_wire(wire), name=name, exchange=exchange)


class WireSetting:
    """The wire setting of one packed exchange (module docstring); ``exchange``: "auto" or the
    forced mode, which the trials keep."""

    __slots__ = ("auto", "_last_end")

    def __init__(self, wire: Any = "fixed", *, name: str, exchange: str = "auto") -> None:
        #: The exchange's :class:`AutoWire` (schedule, trials, decision; a forced coding too).
        self.auto = _auto_for(wire, name, exchange)
        #: When the last exchanged step ended on this rank (perf_counter; None: none yet).
        self._last_end: float | None = None

    @property
    def wire(self) -> str:
        """"fixed", "entropy" or "auto"."""
        return self.auto.wire

    @property
    def decision(self) -> WireDecision | None:
        """The agreed decision (``wire="auto"``), None before it."""
        return self.auto.decision

    def attach(self, engine: Any) -> None:
        """Take the set size and the ranks per node from the wire engine (``engine.ranks``,
        ``engine.per_node``): the trials' candidates."""
        self.auto.ranks, self.auto.per_node = engine.ranks, engine.per_node

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
        text = f"auto(warmup={a.warmup_steps},trials={a.trials})"
        if a.decision is not None:
            text += f"@{a.decision.step}:" + ",".join(
                f"{c.coding}/{c.mode}" for c in a.decision.choices)
        return text

    def end_step(self, step: int, comm: Any, plans: Sequence[BucketPlan], *,
                 sent: Mapping[str, float]) -> WireDecision | None:
        """At the end of exchanged step ``step``, on every rank: the step's seconds and ``sent``
        (this rank's ``bytes_sent`` less its ``node_bytes``, and its ``payload_bytes``,
        :data:`horovod_aq.torch.wire.SENT`) go to the trials; the agreement when it is due
        (returns the new decision), else None. A decision made for other buckets than
        ``plans`` restarts the measurement at the next step (logged)."""
        a = self.auto
        now = time.perf_counter()
        seconds = math.nan if self._last_end is None else now - self._last_end
        self._last_end = now
        if a.wire != "auto" or not plans:
            return None
        if a.decision is not None:
            if plans_digest(plans) != a.decision.layout:
                logger.info("horovod_aq: %s: the buckets changed since the wire decision; "
                            "measuring the wire again from step %d", a.name, step + 1)
                a.restart(step + 1)
            return None
        a.record_step(step, seconds,   # the bytes that leave the node (the network's share)
                      float(sent.get("bytes_sent", 0)) - float(sent.get("node_bytes", 0)),
                      float(sent.get("payload_bytes", 0)))
        if not a.due(step):
            return None
        return a.decide(comm, plans)

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
