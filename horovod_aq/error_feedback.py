"""ECQ-SGD error compensation: an error memory held beside any quantizer.

Source: docs/dynamic.md §2 (paper arXiv 1806.08054). Node p keeps an error memory h_p per fused
bucket (h_p = 0 at the start). At each step:

    g̃_p = Q( g_p + α·h_p )          quantize the compensated gradient; g̃_p is what is sent
    h_p ← β·h_p + ( g_p − g̃_p )     accumulate the error of the *raw* gradient (no α·h term)

With α = β = 1 this is classic error feedback, e ← (g + e) − Q(g + e).

Default coefficients (docs/dynamic.md §2.4), from the relative variance of the wrapped quantizer's
tables (γ: E‖Q(v) − v‖² = γ·‖v‖²; ``levels.variance``, docs/quantizers.md §6.1):

    β = 0.9,   α = min( β/(1 + γ_G), 2β/(1 + γ_sup) )

γ_G is γ for a bucket of i.i.d. normal coordinates, γ_sup its supremum over all buckets (both the
largest over the widths the quantizer may send). β/(1 + γ) minimizes the contraction factor
λ = α²γ + (β − α)² of the memory (§2.3), to λ = β²γ/(1 + γ), and λ(γ) ≤ β² = 0.81 exactly when
α ≤ 2β/(1 + γ): so with these defaults λ ≤ 0.81 < 1 for every gradient, whatever its shape.
They are computed once, at construction, from the tables the quantizer starts with (an adaptive
quantizer's prior fit) and stay fixed: refits do not change them, so every rank, every traced
graph and every checkpoint holds the same two numbers (rounded down to 4 significant digits).
Explicit ``alpha=``/``beta=`` are used as given; a pair with λ ≥ 1 for Gaussian buckets is warned
about at construction.

Composition, as GRACE's Compressor/Memory split and PowerSGD's ``error_dict``:
:class:`ErrorMemory` holds h and the two rules; :class:`ErrorFeedback` is what users pass as
``compression=`` — a quantizer (:attr:`ErrorFeedback.quantizer`, which owns levels, bits, refits
and random streams) plus an :class:`ErrorMemory` (:attr:`ErrorFeedback.error_memory`).
Integrations ask for those two capabilities and never for the class.

The memory is keyed by the packed integrations' fused-bucket names, stored in float32 on the
gradient's device, and never communicated except when every rank asks for a full checkpoint
(:func:`consolidate_memory`); a checkpoint otherwise holds this rank's memory, tagged with its
rank (:func:`checkpoint_state`, :func:`select_memory`, docs/protocol.md §7). Error compensation
makes the sent gradient biased, so the package's unbiasedness guarantee does not hold with it.
Horovod's stock ``compression=`` hook passes no parameter identity, so
:meth:`ErrorFeedback.compress` refuses with an explanation instead of keying memory by call
order.

The arithmetic uses only ``+``, ``−`` and ``*``, so it serves torch tensors and TensorFlow
tensors alike (other tensor operations go through :mod:`horovod_aq.backend`); integrations that
update memory inside a traced graph keep their own variables and call
:meth:`ErrorMemory.compensate_value` / :meth:`ErrorMemory.updated_memory`.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from horovod_aq.backend import backend_for
from horovod_aq.compressors.base import Compressor, describe_fingerprint, settings_fingerprint
from horovod_aq.levels.variance import gaussian_prior, relative_variance, worst_relative_variance

logger = logging.getLogger(__name__)

#: β of the default coefficients (the HiPress system's value, docs/dynamic.md §2.4).
DEFAULT_BETA = 0.9
#: α of the HiPress system (the package default before it was derived from γ). An
#: :class:`ErrorMemory` built without a quantizer still uses it.
HIPRESS_ALPHA = 0.2
#: Warn when the memory grows beyond this multiple of its expected size (the model's stationary
#: ‖h‖/‖g‖ = √(γ/(1 − λ)), at least 1) times the gradient (unstable α, β; §2.3).
DIVERGENCE_RATIO = 10.0
#: Updates of one memory between two divergence checks (each check reads two norms).
CHECK_EVERY = 50


def _coefficient(name: str, value: Any) -> float:
    """``value`` as a float in [0, 1] (ValueError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) \
            or not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return float(value)


class ErrorMemory:
    """The per-bucket error memory h of one rank and the two ECQ-SGD rules."""

    def __init__(self, *, alpha: float = HIPRESS_ALPHA, beta: float = DEFAULT_BETA,
                 reset_on_nonfinite: bool = True, name: str = "ecq",
                 expected_ratio: float = 1.0, gamma: float | None = None) -> None:
        self.alpha = _coefficient("alpha", alpha)
        self.beta = _coefficient("beta", beta)
        self.reset_on_nonfinite = reset_on_nonfinite
        self.name = name
        #: The model's stationary ‖h‖/‖g‖ (scales the divergence check; §2.3).
        self.expected_ratio = max(1.0, float(expected_ratio))
        #: The quantizer's γ for Gaussian buckets, named in the divergence warning (None: unknown).
        self.gamma = gamma
        #: Bucket name → h (a tensor of the gradient's framework, or a TF variable).
        self.memory: dict[str, Any] = {}
        self._pending: dict[str, np.ndarray] = {}
        #: Bucket name → the memory :meth:`install` replaced, reused as the next output buffer.
        self._spare: dict[str, Any] = {}
        #: Bucket name → (memory, its ‖h‖²) as :meth:`install` was told it.
        self._squares: dict[str, tuple[Any, float]] = {}
        self._updates: dict[str, int] = {}
        self._warned_divergence = False
        #: Bucket names whose last divergence check found ‖h‖ over the bound.
        self._over: set[str] = set()
        #: Every rank's memory, gathered for a full checkpoint (:func:`consolidate_memory`),
        #: valid at the step it was gathered at; None: not gathered, or on another rank.
        self.consolidated: Consolidated | None = None

    # ---------------------------------------------------------------- the ECQ-SGD rules
    def compensate_value(self, x: Any, h: Any) -> Any:
        """g + α·h."""
        return x + self.alpha * h

    def updated_memory(self, h: Any, x: Any, x_hat: Any) -> Any:
        """β·h + (g − g̃)."""
        return self.beta * h + (x - x_hat)

    def compensate(self, key: str, x: Any) -> Any:
        """Return g + α·h for the memory ``key`` (h = 0 on first use)."""
        h = self.saved(key, x)
        return x if h is None else self.compensate_value(x, h)

    def update(self, key: str, x: Any, x_hat: Any) -> None:
        """h ← β·h + (g − g̃) for ``key``; reset to zero (with a warning) if it became non-finite."""
        h = self.memory.get(key)
        new = (x - x_hat) if h is None else self.updated_memory(h, x, x_hat)
        self.install(key, new, x, finite=backend_for(new).all_finite(new))

    def install(self, key: str, new: Any, x: Any, *, finite: bool,
                sum_of_squares: float | None = None, recycle: bool = False) -> None:
        """Make ``new`` = h' the memory of ``key`` after a step whose raw gradient was x = g:
        :meth:`update`'s last stage, and the whole of it where h' was computed elsewhere (the
        fused encoder, docs/dynamic.md §2.6), with the same rules and no pass over h' of its own.

        ``finite``: whether every h'_i is finite. The caller knows it (the fused kernel keeps
        max |h'_i| as it writes h'); finite g, h and bucket norms do not imply it, since
        g − g̃ overflows where |g_i| and |g̃_i| are both near float32's limit. A non-finite h' is
        reset to zero with a warning (``reset_on_nonfinite``).

        ``sum_of_squares``: ‖h'‖² where the caller has it (the fused kernel adds it up as it
        writes h'), so that :meth:`memory_norm` (telemetry, every step) reads no memory. Every
        ``CHECK_EVERY`` installs of a key the divergence check (§2.3) reads ‖g‖, and ‖h'‖
        unless given: on those steps only. ``recycle``: the memory this replaces becomes the
        key's :meth:`spare` (for a caller that writes the next h' into it; otherwise it is
        dropped, so the memory is not held twice).
        """
        backend = backend_for(new)
        if self.reset_on_nonfinite and not finite:
            logger.warning("%s: error memory %r became non-finite; reset to zero", self.name, key)
            new = backend.like(new, np.zeros(tuple(new.shape), np.float32))   # not new·0: ∞·0
            sum_of_squares = 0.0
        old = self.memory.get(key)
        self.memory[key] = new
        if sum_of_squares is None:
            self._squares.pop(key, None)
        else:
            self._squares[key] = (new, float(sum_of_squares))
        if recycle and old is not None and old is not new:
            self._spare[key] = old
        else:
            self._spare.pop(key, None)
        count = self._updates[key] = self._updates.get(key, 0) + 1
        if count % CHECK_EVERY == 0 and not self._warned_divergence:
            self._check_divergence(key, new, x, backend, sum_of_squares)

    def swap_in(self, key: str, new: Any) -> Any:
        """Make ``new`` = h' the memory of ``key`` before anyone knows whether its bucket
        travelled (a GPU send that decides on the device, docs/dynamic.md §2.6); returns the
        memory it replaced (None at first use), which :meth:`settle_swap` needs."""
        old = self.memory.get(key)
        self.memory[key] = new
        self._squares.pop(key, None)
        return old

    def settle_swap(self, key: str, new: Any, old: Any, x: Any, *, travelled: bool,
                    finite: bool, sum_of_squares: float | None) -> None:
        """The outcome of :meth:`swap_in`, read at the step's end: where the bucket did not
        travel the memory is ``old`` again (h unchanged; ``new`` becomes the spare), where it
        did :meth:`install` applies its rules to ``new`` (a non-finite h' reset, ‖h'‖², the
        divergence check). Nothing happens where the memory changed meanwhile (a reset)."""
        if self.memory.get(key) is not new:
            return
        if old is None:
            del self.memory[key]
        else:
            self.memory[key] = old
        if not travelled:
            if old is not None:
                self._spare[key] = new
            return
        self.install(key, new, x, finite=finite, sum_of_squares=sum_of_squares, recycle=True)

    def spare(self, key: str, like: Any) -> Any:
        """A buffer of ``like``'s shape to write the next memory of ``key`` into, or None: the
        memory that :meth:`install` replaced last with ``recycle`` (double buffering: a fused
        step allocates no bucket-sized memory and touches no fresh pages). Taken, it is the
        caller's until it installs it; a tensor once held in :attr:`memory` may thus be
        overwritten two steps later (copy it, as :meth:`local_state` does, to keep it)."""
        buf = self._spare.pop(key, None)
        if buf is None or key not in self.memory or tuple(buf.shape) != tuple(like.shape):
            return None
        return buf

    def forget(self, key: str) -> None:
        """Drop the memory of ``key`` (a bucket that no longer exists) and its spare."""
        self.memory.pop(key, None)
        self._spare.pop(key, None)
        self._squares.pop(key, None)

    def _check_divergence(self, key: str, h: Any, x: Any, backend: Any,
                          h_squares: float | None = None) -> None:
        """Warn (once) when ‖h‖ > DIVERGENCE_RATIO·expected_ratio·‖g‖ at two checks in a row
        (``h_squares``: ‖h‖², when the caller knows it).

        One check over the bound is not enough: a single step whose gradient is far smaller than
        the last few (whose errors h still holds) crosses it while α, β contract (§2.3)."""
        h_norm = math.sqrt(backend.sum_of_squares(h) if h_squares is None else h_squares)
        g_norm = math.sqrt(backend_for(x).sum_of_squares(x))
        if not (g_norm > 0 and h_norm > DIVERGENCE_RATIO * self.expected_ratio * g_norm):
            self._over.discard(key)
            return
        if key not in self._over:
            self._over.add(key)
            return
        self._warned_divergence = True
        lam = None if self.gamma is None else contraction(self.alpha, self.beta, self.gamma)
        if lam is None or lam >= 1.0:
            gamma = "" if self.gamma is None else f", about {self.gamma:.3g} here"
            logger.warning(
                "%s: error memory %r has stayed above %.0fx the gradient for %d updates: error "
                "feedback is unstable for this quantizer (needs alpha^2*gamma + (beta-alpha)^2 < "
                "1, gamma = its relative variance%s; alpha=%g, beta=%g); lower alpha and use beta "
                "close to alpha, or leave both to the defaults", self.name, key,
                h_norm / g_norm, CHECK_EVERY, gamma, self.alpha, self.beta)
        else:
            logger.warning(
                "%s: error memory %r has stayed above %.0fx the gradient for %d updates although "
                "alpha=%g, beta=%g contract for Gaussian buckets of this quantizer "
                "(alpha^2*gamma + (beta-alpha)^2 = %.3g): its buckets are noisier than Gaussian "
                "ones or the training is diverging; check the loss, then lower the learning "
                "rate or alpha", self.name, key, h_norm / g_norm, CHECK_EVERY, self.alpha,
                self.beta, lam)

    def saved(self, key: str, like: Any) -> Any:
        """The memory of ``key``: in use, or loaded from a checkpoint when its shape matches
        ``like`` (installed as a tensor of ``like``'s framework), else None."""
        h = self.memory.get(key)
        if h is None and key in self._pending:
            saved = self._pending.pop(key)
            if tuple(saved.shape) == tuple(like.shape):
                h = self.memory[key] = backend_for(like).like(like, saved)
            else:
                logger.warning("%s: saved error memory %r has shape %s, gradient has %s; "
                               "starting from zero", self.name, key, saved.shape,
                               tuple(like.shape))
        return h

    def memory_norm(self) -> float:
        """‖h‖₂ over all buckets (telemetry): ‖h‖² as :meth:`install` was told it for a memory
        still held, else read from the memory."""
        total = 0.0
        for key, h in self.memory.items():
            known = self._squares.get(key)
            total += known[1] if known is not None and known[0] is h else \
                backend_for(h).sum_of_squares(h)
        return math.sqrt(total)

    def reset(self, reason: str = "") -> None:
        if self.memory or self._pending:
            logger.warning("%s: error-feedback memory reset%s", self.name,
                           f" ({reason})" if reason else "")
        self.memory.clear()
        self._pending.clear()
        self._spare.clear()
        self._squares.clear()
        self._over.clear()
        self.consolidated = None

    #: The pre-redesign name of :meth:`reset`.
    reset_memory = reset

    # ---------------------------------------------------------------- this rank's state
    def local_state(self) -> dict[str, np.ndarray]:
        """This rank's memory as float32 numpy arrays (loaded but unused entries included)."""
        state = {k: backend_for(v).to_numpy(v).astype(np.float32) for k, v in self.memory.items()}
        state.update({k: v for k, v in self._pending.items() if k not in state})
        return state

    def load_local_state(self, memory: dict[str, Any]) -> None:
        """Replace the memory by a saved :meth:`local_state` (installed lazily, at first use)."""
        self.memory.clear()
        self._spare.clear()
        self._squares.clear()
        self._pending = {k: np.asarray(v, dtype=np.float32) for k, v in memory.items()}
        self.consolidated = None


def quantizer_gammas(quantizer: Compressor) -> tuple[float, float]:
    """(γ_G, γ_sup) of the tables ``quantizer`` starts with (docs/quantizers.md §6.1): the relative
    variance E‖Q(v) − v‖²/‖v‖² for a bucket of i.i.d. normal coordinates and its supremum over
    all buckets, each the largest over the widths it may send (DQSGD: every width's table), for
    its bucket size and norm. Adaptive quantizers count with their prior fit (quantizers.md
    §2.5)."""
    b, norm = quantizer.bucket_size, quantizer.norm
    prior = gaussian_prior(b, norm)
    gaussian, worst = [], []
    for comp in quantizer.tables_by_width().values():
        levels = comp.initial_levels()
        gaussian.append(relative_variance(levels, prior))
        worst.append(worst_relative_variance(levels, b, norm))
    return max(gaussian), max(worst)


def _round_down(x: float, digits: int = 4) -> float:
    """x rounded down to ``digits`` significant digits (a short, platform-independent value)."""
    if not x > 0.0:
        return 0.0
    e = math.floor(math.log10(x)) - (digits - 1)
    return float(f"{math.floor(x / 10.0**e * (1 + 1e-12))}e{e}")


def default_alpha(gamma: float, gamma_sup: float, beta: float = DEFAULT_BETA) -> float:
    """α = min(β/(1 + γ_G), 2β/(1 + γ_sup)) (docs/dynamic.md §2.4), rounded down to 4 digits.

    β/(1 + γ) minimizes λ = α²γ + (β − α)²; α ≤ 2β/(1 + γ_sup) keeps λ ≤ β² for every bucket."""
    return _round_down(min(beta / (1.0 + gamma), 2.0 * beta / (1.0 + gamma_sup)))


def contraction(alpha: float, beta: float, gamma: float) -> float:
    """λ = α²γ + (β − α)²: the factor by which E‖h‖² contracts per step (docs/dynamic.md §2.3)."""
    return alpha * alpha * gamma + (beta - alpha) ** 2


class ErrorFeedback:
    """``ErrorFeedback(inner)`` (alias ``ECQ``): ECQ-SGD around ``inner``.

    ``alpha``, ``beta``: the compensation and decay coefficients. Left out (None), β = 0.9 and
    α = min(β/(1 + γ_G), 2β/(1 + γ_sup)) from ``inner``'s relative variance
    (:func:`quantizer_gammas`; docs/dynamic.md §2.4), so that λ = α²γ + (β − α)² ≤ β² < 1 for
    every gradient. Given, they are used as they are. The two numbers are fixed at construction
    and are part of :meth:`config` and :meth:`state_dict`.

    Everything about the quantizer (levels, bits, refits, random streams) is ``inner``'s
    (:attr:`quantizer`); this object adds an :class:`ErrorMemory` (:attr:`error_memory`).
    Attributes it does not define are read from the memory, then from the quantizer, so
    ``ef.table``, ``ef.bits``, ``ef.update(...)`` keep working.
    """

    quantizes = True
    dynamic_width = False
    fp16_wire = False

    def __init__(self, inner: Compressor, *, alpha: float | None = None,
                 beta: float | None = None, reset_on_nonfinite: bool = True) -> None:
        if isinstance(inner, ErrorFeedback):
            raise ValueError("ErrorFeedback cannot wrap another ErrorFeedback")
        if not isinstance(inner, Compressor) or not inner.quantizes:
            raise ValueError("ErrorFeedback wraps a quantizing horovod_aq compressor, e.g. "
                             f"ErrorFeedback(horovod_aq.QSGD(bits=2)); got {inner!r}")
        self.inner = inner
        #: γ_G, γ_sup of ``inner``'s starting tables (:func:`quantizer_gammas`).
        self.gamma, self.gamma_sup = quantizer_gammas(inner)
        #: Whether α was derived from γ (``alpha`` left out).
        self.alpha_from_gamma = alpha is None
        beta = _coefficient("beta", DEFAULT_BETA if beta is None else beta)
        alpha = (default_alpha(self.gamma, self.gamma_sup, beta) if alpha is None
                 else _coefficient("alpha", alpha))
        lam = contraction(alpha, beta, self.gamma)
        self.error_memory = ErrorMemory(
            alpha=alpha, beta=beta, reset_on_nonfinite=reset_on_nonfinite,
            name=f"ecq.{inner.name}", gamma=self.gamma,
            expected_ratio=math.sqrt(self.gamma / (1.0 - lam)) if lam < 1.0 else 1.0)
        if lam >= 1.0:
            logger.warning(
                "%s: alpha=%g, beta=%g give alpha^2*gamma + (beta-alpha)^2 = %.3g >= 1 with "
                "gamma = %.3g (this quantizer, Gaussian buckets): the error memory is expected to "
                "grow without bound. The defaults (alpha and beta left out) would be alpha=%g, "
                "beta=%g", self.name, alpha, beta, lam, self.gamma,
                default_alpha(self.gamma, self.gamma_sup), DEFAULT_BETA)
        self.dynamic_width = inner.dynamic_width

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("inner", "error_memory"):
            raise AttributeError(name)
        memory = self.__dict__.get("error_memory")
        if memory is not None and hasattr(memory, name):
            return getattr(memory, name)
        return getattr(self.__dict__["inner"], name)

    # ---------------------------------------------------------------- capabilities
    @property
    def quantizer(self) -> Compressor:
        return self.inner

    @property
    def name(self) -> str:
        return f"ecq.{self.inner.name}"

    @property
    def method(self) -> str:
        return f"ecq-{self.inner.method}"

    @property
    def step(self) -> int:
        return self.inner.step

    @step.setter
    def step(self, value: int) -> None:
        self.inner.step = value

    def stock_refusal(self, framework: str) -> str | None:
        return ("ErrorFeedback needs to know which parameter a gradient belongs to, and Horovod's "
                "compression= hook passes only the tensor. Use horovod_aq.torch."
                "DistributedOptimizer or horovod_aq.tensorflow.DistributedGradientTape / "
                "horovod_aq.keras.DistributedOptimizer (packed exchange), which keep the memory "
                "per fused bucket.")

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        raise TypeError(self.stock_refusal(""))

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        return self.inner.decompress(tensor, ctx)

    # ---------------------------------------------------------------- identity and state
    def config(self) -> dict[str, Any]:
        mem = self.error_memory
        return {**self.inner.config(), "error_feedback": {"alpha": mem.alpha, "beta": mem.beta}}

    def fingerprint(self) -> np.ndarray:
        q = self.inner
        return settings_fingerprint(self.config(), q.bits, q.bucket_size, q.table, q.step)

    def describe_fingerprint(self, fp: np.ndarray) -> str:
        """The words of the plain quantizer: a mismatch error must read the same on every rank,
        also where one rank has error feedback and another has not (the settings hash of each
        rank says which; docs/protocol.md §3)."""
        return describe_fingerprint(fp)

    def state_dict(self) -> dict[str, Any]:
        mem = self.error_memory
        return {"inner": self.inner.state_dict(), "alpha": mem.alpha, "beta": mem.beta,
                "memory": mem.local_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`: the inner quantizer's state and the error memory, all
        checked before anything changes."""
        mem = self.error_memory
        what = ("ErrorFeedback.load_state_dict expects the dict that state_dict() returned (of "
                "an ErrorFeedback built with the same settings)")
        if not isinstance(state, Mapping):
            raise TypeError(f"{what}, got {type(state).__name__}")
        missing = [key for key in ("inner", "alpha", "beta") if key not in state]
        if missing and "config" in state:
            raise ValueError(
                f"{what}; this one was saved without error feedback (a plain quantizer's "
                "state). To resume it as saved, build the optimizer with error_feedback=False "
                "(the default 'auto' adds error feedback at <= 3 bits, docs/quantizers.md §5.9)")
        if missing:
            raise ValueError(f"{what}; this one has no {' or '.join(map(repr, missing))} "
                             f"(its keys: {sorted(map(str, state))})")
        memory = state.get("memory", {})
        try:
            if not isinstance(memory, Mapping) or not all(isinstance(k, str) for k in memory):
                raise TypeError("not a dict with string keys")
            memory = {k: np.asarray(v, dtype=np.float32) for k, v in memory.items()}
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{what}; its 'memory' must map bucket names to float arrays "
                            f"({exc})") from None
        if (state.get("alpha"), state.get("beta")) != (mem.alpha, mem.beta):
            raise ValueError(
                f"state_dict has alpha={state.get('alpha')}, beta={state.get('beta')}; this "
                f"ErrorFeedback has alpha={mem.alpha}, beta={mem.beta}. Build it with the saved "
                "values (ErrorFeedback(inner, alpha=..., beta=...)); states saved before the "
                "defaults were derived from the quantizer have alpha=0.2, beta=0.9")
        self.inner._checked_state(state["inner"])     # raises before anything changes
        self.inner.load_state_dict(state["inner"])
        mem.load_local_state(memory)

    def __repr__(self) -> str:
        mem = self.error_memory
        return f"ErrorFeedback({self.inner!r}, alpha={mem.alpha}, beta={mem.beta})"


#: The ECQ-SGD paper's name for the method.
ECQ = ErrorFeedback


# -------------------------------------------------------------------- checkpoints
#: Keys of a checkpoint's compressor state that say whose error memory it holds
#: (docs/protocol.md §7): ``"memory_rank"`` (one rank's, with ``"world"``) or
#: ``"memory_by_rank"`` (every rank's, with ``"world"``).
MEMORY_RANK, MEMORY_BY_RANK, WORLD = "memory_rank", "memory_by_rank", "world"


def memory_layout(buckets: list[tuple[str, int]]) -> np.ndarray:
    """[count, crc32 of "name:numel" lines] of the buckets whose memory is gathered."""
    text = "\n".join(f"{k}:{n}" for k, n in buckets)
    return np.array([[len(buckets), zlib.crc32(text.encode())]], dtype=np.int64)


def gather_memory(
    name: str,
    local: dict[str, np.ndarray],
    buckets: list[tuple[str, int]],
    world: int,
    allgather: Callable[[np.ndarray, str], np.ndarray],
) -> dict[int, dict[str, np.ndarray]]:
    """Every rank's memory of ``buckets`` ((name, numel), the same list on every rank; a bucket
    without memory on a rank counts as zeros), as {rank: {bucket: float32 [numel]}}.

    ``allgather(rows [1, L], collective name) -> [world, L]`` is the framework's collective. The
    first gathers the bucket layout, so that ranks holding different buckets all raise the same
    error instead of waiting in different collectives (docs/protocol.md §7).
    """
    if world == 1:
        return {0: dict(local)}
    layouts = allgather(memory_layout(buckets), f"aq.efstate.{name}.layout")
    if (layouts != layouts[0]).any():
        raise ValueError(
            f"{name}: the ranks hold error memory for different fused buckets "
            f"(count, digest per rank: {layouts.tolist()}); call consolidate_state_dict on "
            "every rank after the same training steps")
    out: dict[int, dict[str, np.ndarray]] = {r: {} for r in range(world)}
    for key, numel in buckets:
        mine = local.get(key)
        mine = np.zeros(numel, np.float32) if mine is None else np.asarray(mine, np.float32)
        rows = allgather(np.ascontiguousarray(mine.reshape(1, -1)), f"aq.efstate.{key}")
        for r in range(world):
            out[r][key] = np.asarray(rows[r]).copy()
    return out


class Consolidated:
    """Every rank's error memory as gathered by :func:`consolidate_memory`, kept by the rank
    that will save it, for the compressor step it was gathered at (a later step makes it
    stale)."""

    __slots__ = ("step", "by_rank", "world")

    def __init__(self, step: int, by_rank: dict[int, dict[str, np.ndarray]], world: int) -> None:
        self.step, self.by_rank, self.world = step, by_rank, world


def consolidate_memory(compression: Any, buckets: list[tuple[str, int]], *, rank: int,
                       world: int, to: int,
                       allgather: Callable[[np.ndarray, str], np.ndarray]) -> None:
    """The collective half of a full checkpoint (ZeroRedundancyOptimizer's
    ``consolidate_state_dict(to=0)``): every rank calls it at the same point between steps; rank
    ``to`` keeps every rank's memory, which its next :func:`checkpoint_state` of the same step
    saves. Nothing happens without error memory or on one rank (the local state is complete)."""
    memory = compression.error_memory
    if memory is None:
        return
    if not 0 <= to < world:
        raise ValueError(f"consolidate_state_dict(to={to!r}): to must be a rank in [0, {world})")
    by_rank = gather_memory(compression.name, memory.local_state(), buckets, world, allgather)
    memory.consolidated = (Consolidated(compression.quantizer.step, by_rank, world)
                           if rank == to else None)


def checkpoint_state(compression: Any, *, rank: int, world: int) -> dict[str, Any]:
    """``compression.state_dict()`` as a checkpoint holds it (docs/protocol.md §7), with no
    collective: with error memory, this rank's memory tagged with :data:`MEMORY_RANK` and
    :data:`WORLD` — or, right after :func:`consolidate_memory` kept every rank's memory here
    (no step since), ``"memory": {}`` and every rank's under :data:`MEMORY_BY_RANK`."""
    state = compression.state_dict()
    memory = compression.error_memory
    if memory is None:
        return state
    full = memory.consolidated
    if full is not None and full.step == compression.quantizer.step:
        state["memory"] = {}
        state[MEMORY_BY_RANK] = full.by_rank
        state[WORLD] = full.world
    else:
        state[MEMORY_RANK] = rank
        state[WORLD] = world
    return state


def select_memory(compression: Any, state: dict[str, Any], rank: int, world: int, *,
                  log: bool = True) -> dict:
    """The state to load on ``rank`` of a set of ``world`` ranks from a
    :func:`checkpoint_state` (or a plain ``state_dict()``, loaded as it is): this rank's
    memory when the checkpoint holds it — every rank's (:data:`MEMORY_BY_RANK`) or this rank's
    own (:data:`MEMORY_RANK`) with the same number of ranks — else none, with one log line
    (``log``): a warning when the number of ranks changed, INFO when the checkpoint holds
    another rank's memory only (saved on one rank without ``consolidate_state_dict``). Levels
    and steps are always kept. Rank keys may be ints or strings (JSON)."""
    if compression.error_memory is None or WORLD not in state:
        return state
    state = dict(state)
    saved_world = int(state.pop(WORLD))
    by_rank = state.pop(MEMORY_BY_RANK, None)
    owner = state.pop(MEMORY_RANK, None)
    name = compression.name
    if saved_world != world:
        if log:
            logger.warning("%s: error-feedback memory was saved with %d ranks and this job has "
                           "%d: it restarts from zero (levels and steps are kept)", name,
                           saved_world, world)
        state["memory"] = {}
    elif by_rank is not None:
        state["memory"] = by_rank.get(rank, by_rank.get(str(rank), {}))
    elif owner is not None and int(owner) != rank:
        if log:
            logger.info("%s: this checkpoint holds rank %d's error-feedback memory only (saved "
                        "without consolidate_state_dict): rank %d's restarts from zero (levels "
                        "and steps are kept)", name, int(owner), rank)
        state["memory"] = {}
    return state
