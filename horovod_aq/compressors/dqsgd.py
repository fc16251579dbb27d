"""DQSGD: a bit width that changes from step to step (arXiv 2107.14575; the rule is
:class:`horovod_aq.schedule.DQSGDRule`, docs/dynamic.md §1).

The width of step n is derived from the norm of step n−1's *aggregated* gradient, which every
rank decodes from the same bytes, so all ranks agree on it without a collective; every payload
states its bits and a decoder expecting another width refuses it. Any level family works
underneath — uniform by default; with an adaptive family (``levels="alq"`` …) one table per
width in [min_bits, max_bits] is kept and all of them are refitted together at refit steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from horovod_aq.backend import backend_for
from horovod_aq.compressors import arguments
from horovod_aq.compressors.adaptive import ALQ, ALQG, ALQN, AMQ, AMQN
from horovod_aq.compressors.base import Compressor
from horovod_aq.compressors.fixed import NUQSGD, QSGD, NaturalDithering, QSGDInf
from horovod_aq.levels.table import LevelTable
from horovod_aq.refit import Comm
from horovod_aq.schedule import DQSGDRule, RefitSchedule

#: The level families DQSGD can switch widths within, by name.
FAMILIES: dict[str, type[Compressor]] = {
    cls.method: cls
    for cls in (QSGD, QSGDInf, NUQSGD, NaturalDithering, ALQ, ALQN, ALQG, AMQ, AMQN)}


class DQSGD(Compressor):
    """Dynamic bit widths. ``DQSGD(target_bits=4)`` (or ``DQSGD(4)``) aims at a mean of 4 bits
    per coordinate;
    ``DQSGD(budget=3.0 * 1000, horizon=1000)`` never spends more than 3000 bits per coordinate
    over the first 1000 steps. ``levels`` names the family ("qsgd" = uniform, "nuqsgd",
    "qsgdinf", "natural", or an adaptive one: "alq", "alqn", "alqg", "amq", "amqn").
    """

    method = "dqsgd"
    dynamic_width = True

    def __init__(
        self,
        bits: float | None = None,
        *,
        target_bits: float | None = 4.0,
        budget: float | None = None,
        horizon: int | None = None,
        min_bits: int = 2,
        max_bits: int = 8,
        window: int = 50,
        alpha: float | None = None,
        warmup_bits: int | None = None,
        levels: str = "qsgd",
        bucket_size: int | None = None,
        seed: int = 0,
        schedule: RefitSchedule | str | None = None,
        name: str | None = None,
        nonfinite: str = "raise",
        checksum: bool = False,
        **level_kwargs: Any,
    ) -> None:
        if bits is not None:   # the generic factory's ``bits`` is the target mean width
            target_bits = arguments.real("bits", bits,
                                         allowed="a real number (the target mean width)")
        # types here; the ranges (target within [min_bits, max_bits], a meetable budget) are
        # the rule's (horovod_aq.schedule.DQSGDRule)
        target_bits = arguments.optional(arguments.real, "target_bits", target_bits)
        budget = arguments.optional(arguments.real, "budget", budget)
        horizon = arguments.optional(arguments.integer, "horizon", horizon, 1)
        min_bits = arguments.integer("min_bits", min_bits, 1, 8)
        max_bits = arguments.integer("max_bits", max_bits, 1, 8)
        window = arguments.integer("window", window, 1)
        alpha = arguments.optional(arguments.real, "alpha", alpha, lo=0.0, hi=1.0,
                                   open_interval=True)
        warmup_bits = arguments.optional(arguments.integer, "warmup_bits", warmup_bits, 1, 8)
        if not isinstance(levels, str) or levels not in FAMILIES:
            raise ValueError(f"levels must name a multi-width family, one of "
                             f"{sorted(FAMILIES)}; got {levels!r}")
        self.rule = DQSGDRule(target_bits=target_bits, budget=budget, horizon=horizon,
                              min_bits=min_bits, max_bits=max_bits, window=window, alpha=alpha,
                              warmup_bits=warmup_bits)
        family = FAMILIES[levels]
        if levels == "natural" and min_bits < 2:
            raise ValueError("natural dithering needs min_bits >= 2")
        common = {"seed": seed, "schedule": schedule, **level_kwargs}
        if bucket_size is not None:
            common["bucket_size"] = bucket_size
        first = family(min_bits, **common)
        common["norm"] = first.norm      # one bucket scale for every width (the narrowest's)
        self.widths: dict[int, Compressor] = {
            b: first if b == min_bits else family(b, **common)
            for b in range(min_bits, max_bits + 1)}
        self.levels_family = levels
        self.adaptive = first.adaptive  # type: ignore[misc]
        super().__init__(min_bits, bucket_size=first.bucket_size, norm=first.norm, seed=seed,
                         schedule=first.schedule, top_k=first.top_k, nonfinite=nonfinite,
                         checksum=checksum,
                         name=name or f"dqsgd-{levels}{min_bits}-{max_bits}b{first.bucket_size}")
        self.bits = self.first_bits = self.rule.first_bits()
        self._aggregate_sq = 0.0
        self.bits_history: list[int] = []

    # the table of the current width
    def initial_levels(self) -> np.ndarray:
        return self.widths[self.rule.min_bits].initial_levels()

    @property
    def table(self) -> LevelTable:
        return self.widths[self.bits].table

    def set_table(self, table: LevelTable) -> None:
        self.widths[table.bits].set_table(table)
        self._notify()

    def tables_by_width(self) -> dict[int, Compressor]:
        return dict(sorted(self.widths.items()))

    def stock_refusal(self, framework: str) -> str | None:
        if framework != "tensorflow":
            return None
        return (f"{self.name}: DQSGD is not supported on Horovod's stock compression= path in "
                "TensorFlow (its bit width derives from the aggregated gradient, which that path "
                "does not see in a rank-identical order); use horovod_aq.tensorflow."
                "DistributedGradientTape or horovod_aq.keras.DistributedOptimizer (packed "
                "exchange)")

    @property
    def wants_histogram(self) -> bool:
        return self.widths[self.rule.min_bits].wants_histogram

    # bits: derived from the aggregated gradient every rank decoded identically
    def observe_aggregate(self, tensor: Any) -> None:
        """Add ‖part of the averaged gradient‖² (called on the decoded aggregate, every rank)."""
        self._aggregate_sq += backend_for(tensor).sum_of_squares(tensor)

    def end_step(self, comm: Comm) -> bool:
        refitted = False
        if self.recording:
            refitted = self.refit(comm)
        self.bits_history.append(self.bits)
        g = math.sqrt(self._aggregate_sq)
        self._aggregate_sq = 0.0
        self._close_step(refitted)
        previous = self.bits
        self.bits = self.rule.next_bits(self.step, previous, g)
        if self.bits != previous:
            self._notify()
        return refitted

    def refit(self, comm: Comm, stats=None) -> bool:
        """Refit every width's table from the same statistics (one protocol round per width)."""
        if not self.adaptive:
            return False
        stats = stats if stats is not None else self._stats
        changed = False
        for comp in self.widths.values():
            changed |= comp.refit(comm, stats)
        self._stats = None
        return changed

    def config(self) -> dict[str, Any]:
        r = self.rule
        # "bits" is the first width, a setting: the current width is state (state_dict's
        # "bits"), and the handshake's fingerprint carries it separately
        return {**super().config(), "bits": self.first_bits, "levels": self.levels_family,
                "target_bits": r.target_bits,
                "budget": r.budget, "horizon": r.horizon, "min_bits": r.min_bits,
                "max_bits": r.max_bits, "window": r.window, "alpha": r.alpha}

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.pop("table", None)
        state["bits"] = self.bits
        state["rule"] = self.rule.state_dict()
        state["widths"] = {str(b): c.state_dict() for b, c in self.widths.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; every part (settings, step, each width's table, the
        rule's norms and spending, the current width) is checked before anything changes."""
        super().load_state_dict(state)      # runs _checked_state first: nothing changed on error
        for b, sub in state["widths"].items():
            self.widths[int(b)].load_state_dict(sub)
        self.rule.load_state_dict(state["rule"])
        self.bits = int(state["bits"])

    def _checked_state(self, state: Any) -> tuple[Any, int]:
        checked = super()._checked_state(state)
        what = f"{self.name}.load_state_dict expects the dict that state_dict() returned"
        missing = [key for key in ("widths", "rule", "bits") if key not in state]
        if missing:
            raise ValueError(f"{what}; this one has no {' or '.join(map(repr, missing))}")
        widths, rule = state["widths"], state["rule"]
        if not isinstance(widths, Mapping) or sorted(map(str, widths)) != sorted(
                map(str, self.widths)):
            raise ValueError(f"{what}; its 'widths' must hold one state per width "
                             f"{sorted(self.widths)}, got "
                             f"{sorted(widths) if isinstance(widths, Mapping) else widths!r}")
        for b, sub in widths.items():
            self.widths[int(b)]._checked_state(sub)
        if not isinstance(rule, Mapping) or not {"norms", "spent", "t"} <= set(rule):
            raise ValueError(f"{what}; its 'rule' must be a dict with 'norms', 'spent' and 't'")
        try:
            numbers = [float(g) for g in rule["norms"]] + [float(rule["spent"])] + (
                [] if rule["t"] is None else [float(rule["t"])])
        except (TypeError, ValueError):
            numbers = [math.nan]
        if not all(math.isfinite(v) and v >= 0 for v in numbers):
            raise ValueError(f"{what}; its 'rule' must hold finite non-negative norms, spent "
                             f"and t, got {dict(rule)!r}")
        if isinstance(state["bits"], bool) or state["bits"] not in self.widths:
            raise ValueError(f"{what}; its 'bits' must be one of {sorted(self.widths)}, got "
                             f"{state['bits']!r}")
        return checked
