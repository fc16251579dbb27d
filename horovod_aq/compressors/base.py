"""The compressor base class: settings, the current level table, the step counter and state.

A compressor is one object for PyTorch and TensorFlow and for both ways in (docs/protocol.md §1):
Horovod's stock ``compression=`` hook (:meth:`Compressor.compress` dispatches on the tensor's type
through :mod:`horovod_aq.backend`) and the packed exchange, whose integrations read
:attr:`~Compressor.table`, :attr:`~Compressor.bucket_size` and :attr:`~Compressor.norm`, record
statistics with :meth:`~Compressor.record_stats` and end every step with
:meth:`~Compressor.end_step` (the refit protocol of :mod:`horovod_aq.refit`).

What the integrations may ask of any compression object — a plain quantizer, DQSGD or
:class:`~horovod_aq.ErrorFeedback` — are capabilities, not classes: :attr:`quantizer` (the
object that owns table, bits and step), :attr:`error_memory` (None, or the ECQ-SGD memory),
:meth:`tables_by_width` (the code widths it may switch between, each with the compressor that
owns that width's table), :attr:`dynamic_width` and :meth:`stock_refusal`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from horovod_aq.backend import backend_for
from horovod_aq.codec.stream import seed_for_rank  # noqa: F401  (re-exported)
from horovod_aq.levels.stats import BucketStats
from horovod_aq.levels.table import LevelTable
from horovod_aq.refit import Comm, agree_on_table
from horovod_aq.schedule import RefitSchedule

logger = logging.getLogger(__name__)

NORMS = ("l2", "linf")
#: What a non-finite (NaN/Inf) gradient does: every rank raises, or every rank skips the step.
NONFINITE = ("raise", "skip")
#: Buckets of statistics each rank contributes to a refit (the reference's ``dist_num``; its
#: ImageNet configs use 350).
DEFAULT_TOP_K = 350
#: Weighting of bucket components in the fitted mixture (docs/quantizers.md §5.3): squared norms
#: (γ = 2) make the model's variance equal the gradient's total quantization error.
DEFAULT_WEIGHTING = "squared_norm"


def settings_fingerprint(config: dict[str, Any], bits: int, bucket_size: int,
                         table: LevelTable | None, step: int) -> np.ndarray:
    """Settings + table identity as int64s, compared across ranks at the first exchange
    (docs/protocol.md §3): [sha256(config) (56 bits), bits, B, table version, table hash, step]."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).digest()
    return np.array([int.from_bytes(digest[:7], "little"), bits, bucket_size,
                     -1 if table is None else table.version,
                     -1 if table is None else table.hash, step], dtype=np.int64)


def describe_fingerprint(fp: np.ndarray) -> str:
    """One rank's :func:`settings_fingerprint` in words (for mismatch errors)."""
    return (f"settings hash {int(fp[0]):x}, bits {int(fp[1])}, bucket_size {int(fp[2])}, "
            f"table v{int(fp[3])} (hash {int(fp[4]) & 0xFFFFFFFF:08x}), step {int(fp[5])}")


class Compressor:
    """Base class: Horovod's ``compress``/``decompress`` plus what the packed exchange needs.

    Subclasses set :attr:`method` and implement :meth:`initial_levels` (and :meth:`fit_levels`
    when adaptive). Instances are hashable by identity (TensorFlow caches on them).

    ``nonfinite``: what a NaN/Inf gradient does. "raise" (default): on the packed paths every
    rank raises :class:`~horovod_aq.codec.NonFiniteGradientError` naming the rank and the
    parameter (the bad rank sends a marker instead of data, so no rank hangs); on the stock path
    the bad rank raises. "skip": every rank skips the optimizer step consistently — the packed
    optimizers leave the weights untouched and return NaN gradients for the affected tensors (so
    AMP's GradScaler lowers its scale), and the stock path sends NaN so that every rank sees it.
    """

    method: ClassVar[str] = "base"
    adaptive: ClassVar[bool] = False
    quantizes: ClassVar[bool] = True
    default_bucket_size: ClassVar[int] = 512
    default_norm: ClassVar[str] = "l2"
    #: Whether the code width changes from step to step (DQSGD).
    dynamic_width: ClassVar[bool] = False
    #: The ECQ-SGD memory this compression carries (:class:`~horovod_aq.ErrorFeedback` only).
    error_memory: ClassVar[Any] = None
    #: Whether uncompressed tensors travel as fp16 (FP16) rather than as they are.
    fp16_wire: ClassVar[bool] = False

    def __init__(
        self,
        bits: int = 3,
        *,
        bucket_size: int | None = None,
        norm: str | None = None,
        seed: int = 0,
        schedule: RefitSchedule | str | None = None,
        top_k: int = DEFAULT_TOP_K,
        name: str | None = None,
        nonfinite: str = "raise",
    ) -> None:
        if self.quantizes and (not isinstance(bits, (int, np.integer)) or not 1 <= int(bits) <= 8):
            raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
        bucket_size = self.default_bucket_size if bucket_size is None else bucket_size
        if not isinstance(bucket_size, (int, np.integer)) or bucket_size < 2:
            raise ValueError(f"bucket_size must be an integer >= 2, got {bucket_size!r}")
        norm = self.default_norm if norm is None else norm
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
        if isinstance(schedule, str):
            schedule = RefitSchedule.parse(schedule)
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
        self.nonfinite = nonfinite
        self.bits = int(bits)
        self.bucket_size = int(bucket_size)
        self.norm = norm
        self.seed = int(seed)
        self.schedule = schedule if schedule is not None else (
            RefitSchedule() if self.adaptive else RefitSchedule.never())
        self.top_k = int(top_k)
        self.name = name or f"{self.method}{self.bits}b{self.bucket_size}"
        self.step = 0
        self._table = LevelTable(self.initial_levels(), 0) if self.quantizes else None
        self._stats: BucketStats | None = None
        self._listeners: list[Callable[[LevelTable], None]] = []
        self._framework: dict[str, Any] = {}
        self._pending_framework: dict[str, Any] = {}
        self._warned_stock = False

    # ------------------------------------------------------------------ capabilities
    @property
    def quantizer(self) -> Compressor:
        """The compressor that owns the level table, bits, step and refits (itself)."""
        return self

    def tables_by_width(self) -> dict[int, Compressor]:
        """Every code width this compression may send, with the compressor owning its table."""
        return {self.table.bits: self} if self.quantizes else {}

    @property
    def code_bits(self) -> int:
        """The code width of the current step's payloads (the table's; ``bits`` if none)."""
        return self.table.bits if self.quantizes else self.bits

    def stock_refusal(self, framework: str) -> str | None:
        """Why this compression cannot run on Horovod's stock path of ``framework`` (None: it
        can)."""
        return None

    # ------------------------------------------------------------------ levels
    def initial_levels(self) -> np.ndarray:
        """The table before any refit (fixed methods: their only table)."""
        raise NotImplementedError

    def fit_levels(self, stats: BucketStats) -> np.ndarray:
        """Fit a new level array to merged statistics (adaptive methods; runs on the root)."""
        raise TypeError(f"{type(self).__name__} has fixed levels and is never refitted")

    @property
    def table(self) -> LevelTable:
        if self._table is None:
            raise TypeError(f"{type(self).__name__} does not quantize and has no level table")
        return self._table

    def set_table(self, table: LevelTable) -> None:
        """Install a (broadcast) table; framework state holding level copies is told."""
        if table.num_levels != self.table.num_levels:
            raise ValueError(
                f"{self.name}: new table has {table.num_levels} levels, "
                f"expected {self.table.num_levels}"
            )
        self._table = table
        self._notify()

    def add_table_listener(self, fn: Callable[[LevelTable], None]) -> None:
        """Call ``fn(table)`` after every table change (framework copies, e.g. a tf.Variable)."""
        self._listeners.append(fn)

    def _notify(self) -> None:
        for listener in list(self._listeners):
            listener(self.table)

    # ------------------------------------------------------------------ refit bookkeeping
    @property
    def recording(self) -> bool:
        """Whether the current step's gradients feed a refit (adaptive and the schedule is due)."""
        return self.adaptive and self.schedule.due(self.step)

    @property
    def wants_histogram(self) -> bool:
        """Whether refits need the n_b²-weighted histogram of normalized coordinates
        (``model="histogram"``); integrations then pass ``histogram=`` to :meth:`record_stats`."""
        return False

    def record_stats(self, norms: np.ndarray, means: np.ndarray, stds: np.ndarray,
                     histogram: np.ndarray | None = None) -> None:
        """Add per-bucket statistics of this step's local gradient (kept: the top-K by norm),
        and its normalized histogram when the fit uses one."""
        if self.wants_histogram and histogram is None:
            raise ValueError(f"{self.name} fits a histogram model: pass histogram= "
                             "(kernels.normalized_histogram) to record_stats")
        new = BucketStats.from_buckets(norms, means, stds, self.bucket_size, top_k=self.top_k,
                                       histogram=histogram if self.wants_histogram else None)
        self._stats = (new if self._stats is None
                       else BucketStats.merge([self._stats, new], self.top_k))

    def observe_aggregate(self, tensor: Any) -> None:
        """See a part of this step's averaged gradient (identical on every rank). Integrations
        call it on every decoded bucket; DQSGD derives the next step's bits from it."""

    def record_gradient(self, x: np.ndarray) -> None:
        """:meth:`record_stats` from a numpy gradient (the numpy definitions of the statistics)."""
        from horovod_aq.levels.stats import bucket_moments, normalized_histogram

        self.record_stats(*bucket_moments(x, self.bucket_size),
                          histogram=normalized_histogram(x, self.bucket_size)
                          if self.wants_histogram else None)

    def end_step(self, comm: Comm) -> bool:
        """Finish one training step on every rank: refit if due (collective), advance the step.

        Returns whether the table changed. Must be called at the same step on every rank of
        the process set that ``comm`` spans.
        """
        refitted = self.refit(comm) if self.recording else False
        self.step += 1
        self._stats = None
        return refitted

    def refit(self, comm: Comm, stats: BucketStats | None = None) -> bool:
        """Run the refit protocol now (collective) with ``stats``, by default the statistics
        recorded so far (docs/protocol.md §2)."""
        if not self.adaptive:
            return False
        stats = stats if stats is not None else self._stats
        if stats is None:
            stats = BucketStats.from_buckets(np.empty(0), np.empty(0), np.empty(0),
                                             self.bucket_size)
        local = stats.to_array(self.top_k, include_histogram=self.wants_histogram)

        def fit(arrays: list[np.ndarray]) -> np.ndarray:
            merged = BucketStats.merge([BucketStats.from_array(a) for a in arrays], self.top_k)
            return self.fit_levels(merged)

        table, refitted = agree_on_table(comm, local, fit, self.table, name=self.name)
        self._stats = None
        if refitted:
            self.set_table(table)
            logger.info("%s: refitted level table -> v%d %s", self.name, table.version,
                        np.array2string(table.levels, precision=5))
        return refitted

    # ------------------------------------------------------------------ Horovod interface
    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """Horovod stock path: quantize → dequantize → fp16 (summable). Returns (wire, ctx)."""
        return backend_for(tensor).compress(self, tensor)

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        """Horovod stock path: cast the summed fp16 back to the gradient's dtype."""
        return backend_for(tensor).decompress(self, tensor, ctx)

    def warn_stock_once(self) -> None:
        if not self._warned_stock:
            self._warned_stock = True
            logger.warning(
                "%s on Horovod's stock compression= path: gradients are quantized and "
                "dequantized, then sent as fp16 (2x less traffic than fp32, not %d bits). Use "
                "horovod_aq.torch.DistributedOptimizer / horovod_aq.tensorflow."
                "DistributedGradientTape for the bit-packed exchange.", self.name, self.bits)

    # ------------------------------------------------------------------ framework state
    def framework_state(self, key: str, factory: Callable[[], Any] | None = None) -> Any:
        """The per-compressor state a framework keeps (``key`` = "torch" / "tensorflow").

        Created with ``factory()`` on first use and restored from a loaded :meth:`state_dict`;
        its own ``state_dict()`` is saved with the compressor's. None if absent and no factory.
        """
        state = self._framework.get(key)
        if state is None and factory is not None:
            state = self._framework[key] = factory()
            pending = self._pending_framework.pop(key, None)
            if pending is not None:
                state.load_state_dict(pending)
        return state

    # ------------------------------------------------------------------ identity and state
    def config(self) -> dict[str, Any]:
        """The settings that must agree on every rank."""
        return {"method": self.method, "bits": self.bits, "bucket_size": self.bucket_size,
                "norm": self.norm, "schedule": str(self.schedule), "top_k": self.top_k,
                "name": self.name, "nonfinite": self.nonfinite}

    def fingerprint(self) -> np.ndarray:
        """Settings + table identity as int64s (:func:`settings_fingerprint`)."""
        return settings_fingerprint(self.config(), self.bits, self.bucket_size, self._table,
                                    self.step)

    def describe_fingerprint(self, fp: np.ndarray) -> str:
        return describe_fingerprint(fp)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: settings, table + version, step, random streams."""
        state: dict[str, Any] = {"config": self.config(), "step": self.step}
        if self._table is not None:
            state["table"] = {"levels": self._table.levels.tolist(), "version": self._table.version}
        framework = {key: s.state_dict() for key, s in self._framework.items()}
        framework.update({k: v for k, v in self._pending_framework.items() if k not in framework})
        if framework:
            state["framework"] = framework
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; refuses a state saved with other settings."""
        theirs = dict(state["config"])
        mine = self.config()
        if theirs != mine:
            diff = {k: (theirs.get(k), mine.get(k)) for k in set(theirs) | set(mine)
                    if theirs.get(k) != mine.get(k)}
            raise ValueError(f"state_dict was saved by a compressor with other settings "
                             f"(saved, current): {diff}")
        if "table" in state:
            self.set_table(LevelTable(np.asarray(state["table"]["levels"], dtype=np.float64),
                                      int(state["table"]["version"])))
        self.step = int(state["step"])
        self._stats = None
        self._pending_framework = dict(state.get("framework", {}))
        for key, fw_state in self._framework.items():
            if key in self._pending_framework:
                fw_state.load_state_dict(self._pending_framework.pop(key))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "method")
        return f"{type(self).__name__}({args})"
