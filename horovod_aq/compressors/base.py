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
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from horovod_aq.backend import backend_for
from horovod_aq.codec.stream import seed_for_rank  # noqa: F401  (re-exported)
from horovod_aq.compressors import arguments
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
#: Gradients through a compressor whose first step never ended before it says so: a loop with
#: no step boundary (e.g. direct ``hvd.allreduce(t, compression=comp)``) needs explicit refits.
UNENDED_STEP_WARNING = 10_000


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

    ``checksum``: the packed exchanges (PyTorch optimizer, TensorFlow tape and Keras, DDP hook)
    write a CRC-32 of every payload into its header, and every decoder refuses a payload whose
    bytes changed (docs/format.md §11). Off by default: benchmarks/results/checksum.md measures
    7–20 % of encode + decode time on the CPU path.
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
        checksum: bool = False,
    ) -> None:
        # every argument checked before anything is set (horovod_aq.compressors.arguments)
        if self.quantizes:
            bits = arguments.bits(bits)
        bucket_size = arguments.bucket_size(
            self.default_bucket_size if bucket_size is None else bucket_size)
        norm = arguments.choice("norm", self.default_norm if norm is None else norm, NORMS)
        seed = arguments.seed(seed)
        schedule = arguments.schedule(schedule)
        top_k = arguments.integer("top_k", top_k, 1)
        name = arguments.name(name)
        nonfinite = arguments.choice("nonfinite", nonfinite, NONFINITE)
        if not isinstance(checksum, bool):
            raise TypeError(f"checksum must be True or False, got {checksum!r}")
        self.nonfinite = nonfinite
        #: Whether the packed exchanges write a CRC-32 into every payload (docs/format.md §11);
        #: decoders verify any payload that carries one.
        self.checksum = checksum
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
        self._step_open = False
        self._last_refitted = False
        self._open_calls = 0
        self._listeners: list[Callable[[LevelTable], None]] = []
        self._framework: dict[str, Any] = {}
        self._pending_framework: dict[str, Any] = {}
        self._warned_stock = False
        #: The ErrorFeedback the packed entry points use around this compressor
        #: (``error_feedback="auto"`` / True; :mod:`horovod_aq.error_feedback_setting`), made
        #: once so that every exchange given this compressor shares one error memory.
        self.error_feedback_wrapper: Any = None

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
        the process set that ``comm`` spans. Compressors that do not quantize (no table, never
        recording) only count the step: ``comm`` is then not used, so every integration ends
        every step with this one call.
        """
        refitted = self.refit(comm) if self.recording else False
        self._close_step(refitted)
        return refitted

    def _close_step(self, refitted: bool) -> None:
        """The bookkeeping of every step end: the next step, no statistics, closed."""
        self.step += 1
        self._stats = None
        self._step_open = False
        self._open_calls = 0
        self._last_refitted = refitted

    # ------------------------------------------------------------------ step boundaries
    def open_step(self) -> None:
        """Mark the current step as begun: its gradients went through this compressor.

        The automatic step ends (docs/protocol.md §14) and the explicit ``refit`` calls end a step
        only while it is open (:meth:`end_open_step`), so a step that a hook already ended is not
        ended twice when user code also calls ``refit``. Every rank opens the same steps (they
        quantize the same tensors), so the decision is rank-identical without a collective.
        """
        self._step_open = True
        self._open_calls += 1
        if self._open_calls == UNENDED_STEP_WARNING and self.step == 0 and self.adaptive:
            message = (f"{self.name}: {UNENDED_STEP_WARNING} gradients went through this "
                       "compressor and its first step never ended, so its levels are never "
                       "refitted. Without a Horovod optimizer or tape (e.g. hvd.allreduce(t, "
                       "compression=comp) in your own loop) add horovod_aq.torch.refit(comp) / "
                       "horovod_aq.tensorflow.refit(comp) after each update")
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    @property
    def step_open(self) -> bool:
        """Whether gradients went through since the last :meth:`end_step`."""
        return self._step_open

    @property
    def last_refitted(self) -> bool:
        """Whether the step ended last refitted the table."""
        return self._last_refitted

    def end_open_step(self, comm: Comm) -> bool:
        """:meth:`end_step` if the step is open; else the result of the step ended last (it was
        already ended, e.g. by an automatic hook, or no gradient went through)."""
        return self.end_step(comm) if self._step_open else self._last_refitted

    def advance_step(self) -> None:
        """End the step without the refit protocol (a single-member process set: there is
        nothing to agree on and no statistics are kept)."""
        self.step += 1
        self._stats = None
        self._step_open = False
        self._last_refitted = False

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
    class _HorovodHook:
        """``compress`` / ``decompress`` that also work when called on the class.

        Horovod users write ``compression=hvd.Compression.fp16`` — a class with static methods —
        so ``compression=horovod_aq.ALQ`` is a natural mistake; Horovod then calls
        ``ALQ.compress(tensor)``. Looked up on an instance this is the ordinary method; looked
        up on a class it calls the method of the class's :meth:`~Compressor.shared` instance,
        so that every call (and a refit of that instance) works on one table and one step.
        """

        def __init__(self, fn: Callable[..., Any]) -> None:
            self.fn = fn
            self.__doc__ = fn.__doc__
            self.__name__ = getattr(fn, "__name__", "compress")

        def __get__(self, obj: Any, cls: type | None = None) -> Any:
            fn = self.fn
            if obj is not None:
                return fn.__get__(obj, type(obj))

            def on_class(*args: Any, **kwargs: Any) -> Any:
                if args and isinstance(args[0], cls):   # Compressor.compress(instance, tensor)
                    return fn(*args, **kwargs)
                return fn(cls.shared(), *args, **kwargs)
            on_class.__doc__, on_class.__name__ = fn.__doc__, self.__name__
            return on_class

    #: The instance each compressor class stands for when passed as a class (see :meth:`shared`).
    _shared_instances: ClassVar[dict[type, Compressor]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in ("compress", "decompress"):   # subclasses' own versions work on the class too
            fn = cls.__dict__.get(name)
            if hasattr(fn, "__code__"):
                setattr(cls, name, Compressor._HorovodHook(fn))

    @classmethod
    def shared(cls) -> Compressor:
        """The one instance, with default settings, that the class stands for where Horovod is
        given the class (``hvd.DistributedOptimizer(..., compression=horovod_aq.ALQ)``): created
        (and logged) on first use, the same object afterwards, so its statistics, table and step
        are those its refits use (``horovod_aq.torch.refit(horovod_aq.ALQ.shared())``). Pass an
        instance, e.g. ``horovod_aq.ALQ(bits=3)``, to choose settings."""
        instance = Compressor._shared_instances.get(cls)
        if instance is None:
            try:
                made = cls()
            except Exception as exc:
                raise TypeError(
                    f"compression=horovod_aq.{cls.__name__} (the class) has no usable default "
                    f"settings ({exc!r}); pass an instance, e.g. "
                    "compression=horovod_aq.ALQ(bits=3)") from exc
            instance = Compressor._shared_instances.setdefault(cls, made)
            if instance is made:
                logger.info("compression=horovod_aq.%s (the class): using one shared %r; pass "
                            "an instance such as horovod_aq.ALQ(bits=3) to choose settings",
                            cls.__name__, instance)
        return instance

    @_HorovodHook
    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """Horovod stock path: quantize → dequantize → fp16 (summable). Returns (wire, ctx)."""
        return backend_for(tensor).compress(self, tensor)

    @_HorovodHook
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
                "name": self.name, "nonfinite": self.nonfinite,
                **({"checksum": True} if self.checksum else {})}

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
        """Restore :meth:`state_dict`. Everything is checked before anything changes: a state
        that is not a mapping (``TypeError``), lacks ``config`` or ``step``, has a negative or
        non-integer step, a table the codec refuses, or was saved with other settings
        (``ValueError``) leaves the compressor as it was."""
        table, step = self._checked_state(state)
        if table is not None:
            self.set_table(table)
        self.step = step
        self._stats = None
        self._step_open = False
        self._pending_framework = dict(state.get("framework", {}))
        for key, fw_state in self._framework.items():
            if key in self._pending_framework:
                fw_state.load_state_dict(self._pending_framework.pop(key))

    def _checked_state(self, state: Any) -> tuple[LevelTable | None, int]:
        """The table (None: the state has none) and step that :meth:`load_state_dict` installs,
        after every check; raises with what to pass instead."""
        what = (f"{self.name}.load_state_dict expects the dict that state_dict() returned "
                "(of a compressor built with the same settings)")
        if not isinstance(state, Mapping):
            raise TypeError(f"{what}, got {type(state).__name__}")
        missing = [key for key in ("config", "step") if key not in state]
        if missing and "inner" in state:
            raise ValueError(f"{what}; this one was saved with error feedback (an ErrorFeedback "
                             "state): build the optimizer with error_feedback=True, or wrap the "
                             "compressor in horovod_aq.ErrorFeedback, to resume it")
        if missing:
            raise ValueError(f"{what}; this one has no {' or '.join(map(repr, missing))} "
                             f"(its keys: {sorted(map(str, state))})")
        theirs = state["config"]
        if not isinstance(theirs, Mapping):
            raise TypeError(f"{what}; its 'config' is a {type(theirs).__name__}, not a dict")
        theirs, mine = dict(theirs), self.config()
        if theirs != mine:
            diff = {k: (theirs.get(k), mine.get(k)) for k in sorted(set(theirs) | set(mine))
                    if theirs.get(k) != mine.get(k)}
            raise ValueError(f"state_dict was saved by a compressor with other settings "
                             f"(saved, current): {diff}; build the compressor with the saved "
                             "settings")
        try:
            step = arguments.step(state["step"])
        except ValueError as exc:   # SettingTypeError is a ValueError too
            raise type(exc)(f"{what}; its {exc}") from None
        if not isinstance(state.get("framework", {}), Mapping):
            raise TypeError(f"{what}; its 'framework' is a "
                            f"{type(state['framework']).__name__}, not a dict")
        table = None
        if "table" in state:
            saved = state["table"]
            try:
                table = LevelTable(np.asarray(saved["levels"], dtype=np.float64),
                                   arguments.integer("version", saved["version"], 0))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{what}; its 'table' is not a level table with a version "
                                 f"({type(exc).__name__}: {exc})") from None
            if self._table is not None and table.num_levels != self._table.num_levels:
                raise ValueError(f"{what}; its table has {table.num_levels} levels, this "
                                 f"compressor's has {self._table.num_levels}")
        return table, step

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "method")
        return f"{type(self).__name__}({args})"
