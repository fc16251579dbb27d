"""When adaptive level tables are refitted (``docs/quantizers.md`` §9).

The schedule is a deterministic function of the global step, so every rank refits at the same
step without talking about it. A refit at step t uses the statistics of the gradients computed
in step t and the new table takes effect from step t + 1 (the reference refits *before* step t
on freshly sampled gradients at the same weights; using step t's own gradients costs no extra
backward pass and differs by one step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from horovod_aq._arguments import SettingTypeError, integer

#: The ALQ paper's CIFAR-10 schedule: at steps 0, 100, 2000 and every 10,000 steps.
DEFAULT_STEPS = (0, 100, 2000)
DEFAULT_EVERY = 10_000


@dataclass(frozen=True)
class RefitSchedule:
    """Refit at step t when t ∈ ``steps`` or (``every`` and t mod ``every`` = 0).

    ``RefitSchedule.parse("0,100,2000,10000")`` reads the reference's ``--g_osnap_iter``
    format, where the last number is the period. ``RefitSchedule(steps=(), every=None)`` never
    refits (the initial table stays).
    """

    steps: tuple[int, ...] = DEFAULT_STEPS
    every: int | None = DEFAULT_EVERY

    def __post_init__(self) -> None:
        # checked, never truncated (every=2.5 is refused, not read as 2)
        if isinstance(self.steps, (str, bytes)) or not hasattr(self.steps, "__iter__"):
            raise SettingTypeError(
                f"steps must be a sequence of integers >= 0 (the refit steps), got "
                f"{self.steps!r} ({type(self.steps).__name__}); RefitSchedule.parse reads the "
                '"0,100,2000,10000" string form')
        steps = tuple(sorted({integer("steps", s, 0,
                                      allowed=">= 0 (integers: the refit steps)")
                              for s in self.steps}))
        every = None if self.every is None else integer(
            "every", self.every, 1,
            allowed="a positive integer (the refit period in steps) or None (no period)")
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "every", every)

    def due(self, step: int) -> bool:
        """Whether a refit happens at (the end of) global step ``step``."""
        if step in self.steps:
            return True
        return self.every is not None and step % self.every == 0

    @classmethod
    def parse(cls, text: str) -> "RefitSchedule":
        """Parse "I_1,…,I_k,E" (reference format: explicit steps then the period E)."""
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            return cls(steps=(), every=None)
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"refit schedule must be comma-separated integers, "
                             f"got {text!r}") from None
        if len(values) == 1:
            return cls(steps=(), every=values[0] or None)
        return cls(steps=tuple(values[:-1]), every=values[-1] or None)

    @classmethod
    def never(cls) -> "RefitSchedule":
        return cls(steps=(), every=None)

    def __str__(self) -> str:
        """The reference format that :meth:`parse` reads back ("0" = never)."""
        return ",".join([str(s) for s in self.steps] + [str(self.every or 0)])


# --------------------------------------------------------------------------- DQSGD bit rule
#: Range of t searched when calibrating the DQSGD constant (relative to 1/Ḡ).
_T_SEARCH = (1e-9, 1e9)


def dqsgd_bits(t: float, norm: float) -> float:
    """Unrounded DQSGD bit width (``docs/dynamic.md`` §1.3, non-convex case):

        B = log₂(t·‖g‖_p + 1) + 1
    """
    return math.log2(t * norm + 1.0) + 1.0


@dataclass
class DQSGDRule:
    """The per-step bit width of DQSGD (arXiv 2107.14575) as the package applies it (§1.5).

    ``B_n = clip(round(log₂(t_n·G_n + 1) + 1), min_bits, max_bits)`` where G_n is the norm of
    the *previous* step's aggregated gradient — bitwise identical on every rank, so the bits
    agree without a collective — and t_n is calibrated from rank-identical inputs only:

    * ``target_bits`` mode: t is the value for which the mean unrounded width over the last
      ``window`` norms equals the target (bisection; B is increasing in t).
    * ``budget`` mode: a hard cap Σ_n B_n ≤ ``budget`` over ``horizon`` steps (bits per
      coordinate summed over steps; header and norms are not counted). The target for step n is
      the remaining budget spread over the remaining steps, and B_n is capped so that every later
      step can still afford ``min_bits`` — so the total never exceeds the budget.
    * ``alpha`` (strongly convex mode, Theorem 1): t_n = t·α^((N−n)/2) spends more bits late.

    Step 0 (no aggregate seen yet) uses ``warmup_bits`` (default: the target rounded).
    """

    target_bits: float | None = 4.0
    budget: float | None = None
    horizon: int | None = None
    min_bits: int = 2
    max_bits: int = 8
    window: int = 50
    alpha: float | None = None
    warmup_bits: int | None = None

    def __post_init__(self) -> None:
        if not (1 <= self.min_bits <= self.max_bits <= 8):
            raise ValueError(f"need 1 <= min_bits <= max_bits <= 8, "
                             f"got {self.min_bits}, {self.max_bits}")
        if self.budget is not None:
            if not self.horizon or self.horizon < 1:
                raise ValueError("budget mode needs horizon= (the number of steps it covers)")
            if self.budget < self.min_bits * self.horizon:
                raise ValueError(f"budget {self.budget} is below min_bits × horizon = "
                                 f"{self.min_bits * self.horizon}: it cannot be met")
            self.target_bits = None
        elif self.target_bits is None or not self.min_bits <= self.target_bits <= self.max_bits:
            raise ValueError(f"target_bits must lie in [{self.min_bits}, {self.max_bits}], got "
                             f"{self.target_bits}")
        if self.alpha is not None and not (0.0 < self.alpha < 1.0 and self.horizon):
            raise ValueError("strongly convex mode needs 0 < alpha < 1 and horizon=")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        self.norms: list[float] = []
        self.spent = 0.0
        self.t: float | None = None

    def mean_target(self, step: int) -> float:
        """The mean width the rule aims at from ``step`` on.

        Budget mode: the remaining budget over the remaining steps. Target mode (and budget mode
        past its horizon, with target budget/horizon): the target plus the deficit of the bits
        spent so far spread over one window, so the running mean converges to the target even
        while gradient norms drift (B follows ‖g‖, and norms usually shrink during training).
        """
        if self.budget is not None and step < self.horizon:
            return (self.budget - self.spent) / max(1, self.horizon - step)
        target = self.target_bits if self.budget is None else self.budget / self.horizon
        deficit = target * step - self.spent
        return min(max(target + deficit / self.window, self.min_bits), self.max_bits)

    def _cap(self, step: int) -> int:
        """Largest width this step may use without making the budget unmeetable."""
        if self.budget is None or step >= self.horizon:
            return self.max_bits
        later = self.horizon - step - 1
        return int(math.floor(self.budget - self.spent - later * self.min_bits + 1e-9))

    def _clip(self, b: float, step: int) -> int:
        return int(min(max(round(b), self.min_bits), self.max_bits, self._cap(step)))

    def first_bits(self) -> int:
        w = self.warmup_bits if self.warmup_bits is not None else self.mean_target(0)
        return self._clip(w, 0)

    def calibrate(self, target: float) -> float:
        """t such that the mean of clip(log₂(t·G + 1) + 1) over the window equals ``target``."""
        norms = [g for g in self.norms[-self.window:] if g > 0]
        if not norms:
            return 0.0
        scale = 1.0 / (sum(norms) / len(norms))

        def mean_bits(t: float) -> float:
            return sum(min(max(dqsgd_bits(t, g), self.min_bits), self.max_bits)
                       for g in norms) / len(norms)

        lo, hi = _T_SEARCH[0] * scale, _T_SEARCH[1] * scale
        for _ in range(200):
            mid = math.sqrt(lo * hi)
            if mean_bits(mid) < target:
                lo = mid
            else:
                hi = mid
        return math.sqrt(lo * hi)

    def next_bits(self, step: int, bits_used: int, aggregate_norm: float) -> int:
        """Record step ``step - 1``'s width and aggregate norm; return the width of ``step``."""
        self.spent += bits_used
        if math.isfinite(aggregate_norm):
            self.norms.append(float(aggregate_norm))
            self.norms = self.norms[-self.window:]
        if not self.norms or self.norms[-1] <= 0.0:
            return self._clip(self.mean_target(step), step)
        self.t = self.calibrate(self.mean_target(step))
        t = self.t
        if self.alpha is not None:
            t *= self.alpha ** (max(self.horizon - step, 0) / 2.0)
        return self._clip(dqsgd_bits(t, self.norms[-1]), step)

    def state_dict(self) -> dict:
        return {"norms": list(self.norms), "spent": self.spent, "t": self.t}

    def load_state_dict(self, state: dict) -> None:
        self.norms = [float(g) for g in state["norms"]]
        self.spent = float(state["spent"])
        self.t = state["t"]
