"""ECQ-SGD error compensation around any quantizer.

Spec: ``dynamic_and_error_feedback.md`` §2 (paper arXiv 1806.08054).

Node p keeps an error memory h_p (h_p = 0 at the start). At each step:

    g̃_p = Q( g_p + α·h_p )          quantize the compensated gradient; g̃_p is what is sent
    h_p ← β·h_p + ( g_p − g̃_p )     accumulate the error of the *raw* gradient (no α·h term)

With α = β = 1 this is classic error feedback, e ← (g + e) − Q(g + e). The defaults α = 0.2,
β = 0.9 are the HiPress system's choice (the paper's values could not be checked; §2.4);
quantizers with a large relative variance need small α (stability: α²γ + (β − α)² < 1, §2.3).

The memory is keyed by a stable name — the packed integrations' fused-bucket names — stored in
float32 on the gradient's device, never communicated, and part of ``state_dict()``. Error
compensation makes the sent gradient biased, so the package's unbiasedness guarantee does not
hold with it. Horovod's stock ``compression=`` hook passes no parameter identity, so
:meth:`ErrorFeedback.compress` refuses with an explanation instead of keying memory by call order.

The arithmetic uses only ``+``, ``−`` and ``*`` so it serves torch tensors and eager TensorFlow
tensors alike; integrations that must update memory inside a traced graph keep their own
variables and call :meth:`compensate_value` / :meth:`updated_memory`.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from horovod_aq.compressors import Compressor
from horovod_aq.levels.table import LevelTable
from horovod_aq.sync import Comm

logger = logging.getLogger(__name__)

DEFAULT_ALPHA = 0.2
DEFAULT_BETA = 0.9
#: Warn when the memory grows beyond this multiple of the gradient (unstable α, β; §2.3).
DIVERGENCE_RATIO = 10.0
#: Updates of one memory between two divergence checks (each check reads two norms).
CHECK_EVERY = 50


class ErrorFeedback(Compressor):
    """``ErrorFeedback(inner, alpha=0.2, beta=0.9)`` (alias ``ECQ``): ECQ-SGD around ``inner``.

    Everything about the quantizer (levels, bits, refits, random streams) is ``inner``'s; this
    object adds the per-bucket memory h and the two update rules of the module docstring.
    """

    quantizes = True

    def __init__(self, inner: Compressor, *, alpha: float = DEFAULT_ALPHA,
                 beta: float = DEFAULT_BETA, reset_on_nonfinite: bool = True) -> None:
        if not isinstance(inner, Compressor) or not inner.quantizes:
            raise ValueError("ErrorFeedback wraps a quantizing horovod_aq compressor, e.g. "
                             f"ErrorFeedback(horovod_aq.QSGD(bits=2)); got {inner!r}")
        if isinstance(inner, ErrorFeedback):
            raise ValueError("ErrorFeedback cannot wrap another ErrorFeedback")
        for name, value in (("alpha", alpha), ("beta", beta)):
            if not (math.isfinite(value) and 0.0 <= value <= 1.0):
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        self.inner = inner
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.reset_on_nonfinite = reset_on_nonfinite
        self.memory: dict[str, Any] = {}
        self._pending_memory: dict[str, np.ndarray] = {}
        self._updates: dict[str, int] = {}
        self._warned_stock = False
        self._warned_divergence = False

    # ---------------------------------------------------------------- the ECQ-SGD rules
    def compensate_value(self, x: Any, h: Any) -> Any:
        """g + α·h."""
        return x + self.alpha * h

    def updated_memory(self, h: Any, x: Any, x_hat: Any) -> Any:
        """β·h + (g − g̃)."""
        return self.beta * h + (x - x_hat)

    def compensate(self, key: str, x: Any) -> Any:
        """Return g + α·h for the memory ``key`` (h = 0, allocated like ``x``, on first use)."""
        h = self._memory_for(key, x)
        return x if h is None else self.compensate_value(x, h)

    def update(self, key: str, x: Any, x_hat: Any) -> None:
        """h ← β·h + (g − g̃) for ``key``; reset to zero (with a warning) if it became non-finite."""
        h = self.memory.get(key)
        new = (x - x_hat) if h is None else self.updated_memory(h, x, x_hat)
        if self.reset_on_nonfinite and not _all_finite(new):
            logger.warning("%s: error memory %r became non-finite; reset to zero", self.name, key)
            new = new * 0
        self.memory[key] = new
        count = self._updates[key] = self._updates.get(key, 0) + 1
        if count % CHECK_EVERY == 0 and not self._warned_divergence:
            h_norm, g_norm = _norm(new), _norm(x)
            if g_norm > 0 and h_norm > DIVERGENCE_RATIO * g_norm:
                self._warned_divergence = True
                logger.warning(
                    "%s: error memory %r is %.0fx the gradient: error feedback is unstable for "
                    "this quantizer (needs alpha^2*gamma + (beta-alpha)^2 < 1, gamma = its "
                    "relative variance); lower alpha and use beta close to alpha",
                    self.name, key, h_norm / g_norm)

    def _memory_for(self, key: str, x: Any) -> Any:
        h = self.memory.get(key)
        if h is None and key in self._pending_memory:
            saved = self._pending_memory.pop(key)
            if tuple(saved.shape) == tuple(x.shape):
                h = _like(x, saved)
                self.memory[key] = h
            else:
                logger.warning("%s: saved error memory %r has shape %s, gradient has %s; "
                               "starting from zero", self.name, key, saved.shape, tuple(x.shape))
        return h

    def memory_norm(self) -> float:
        """‖h‖₂ over all buckets (telemetry)."""
        total = 0.0
        for h in self.memory.values():
            a = _to_numpy(h).astype(np.float64)
            total += float(np.dot(a.ravel(), a.ravel()))
        return math.sqrt(total)

    def reset_memory(self, reason: str = "") -> None:
        if self.memory or self._pending_memory:
            logger.warning("%s: error-feedback memory reset%s", self.name,
                           f" ({reason})" if reason else "")
        self.memory.clear()
        self._pending_memory.clear()

    # ---------------------------------------------------------------- delegation to inner
    @property
    def method(self) -> str:  # type: ignore[override]
        return f"ecq-{self.inner.method}"

    @property
    def adaptive(self) -> bool:  # type: ignore[override]
        return self.inner.adaptive

    bits = property(lambda self: self.inner.bits)
    bucket_size = property(lambda self: self.inner.bucket_size)
    norm = property(lambda self: self.inner.norm)
    seed = property(lambda self: self.inner.seed)
    schedule = property(lambda self: self.inner.schedule)
    top_k = property(lambda self: self.inner.top_k)
    nonfinite = property(lambda self: self.inner.nonfinite)
    name = property(lambda self: f"ecq.{self.inner.name}")
    _fw_state = property(lambda self: self.inner._fw_state)

    @property
    def step(self) -> int:  # type: ignore[override]
        return self.inner.step

    @step.setter
    def step(self, value: int) -> None:
        self.inner.step = value

    @property
    def table(self) -> LevelTable:
        return self.inner.table

    @property
    def recording(self) -> bool:
        return self.inner.recording

    def set_table(self, table: LevelTable) -> None:
        self.inner.set_table(table)

    def add_table_listener(self, fn) -> None:
        self.inner.add_table_listener(fn)

    def initial_levels(self) -> np.ndarray:
        return self.inner.initial_levels()

    @property
    def wants_histogram(self) -> bool:
        return self.inner.wants_histogram

    def record_stats(self, norms: np.ndarray, means: np.ndarray, stds: np.ndarray,
                     histogram: np.ndarray | None = None) -> None:
        self.inner.record_stats(norms, means, stds, histogram)

    def record_gradient(self, x: np.ndarray) -> None:
        self.inner.record_gradient(x)

    def observe_aggregate(self, tensor: Any) -> None:
        self.inner.observe_aggregate(tensor)

    def end_step(self, comm: Comm) -> bool:
        return self.inner.end_step(comm)

    def refit(self, comm: Comm) -> bool:
        return self.inner.refit(comm)

    def warn_stock_once(self) -> None:
        self.inner.warn_stock_once()

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        raise TypeError(
            "ErrorFeedback needs to know which parameter a gradient belongs to, and Horovod's "
            "compression= hook passes only the tensor. Use horovod_aq.torch.DistributedOptimizer "
            "or horovod_aq.tensorflow.DistributedGradientTape / horovod_aq.keras."
            "DistributedOptimizer (packed exchange), which keep the memory per fused bucket.")

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        return self.inner.decompress(tensor, ctx)

    def config(self) -> dict[str, Any]:
        return {**self.inner.config(), "error_feedback": {"alpha": self.alpha, "beta": self.beta}}

    def fingerprint(self) -> np.ndarray:
        fp = self.inner.fingerprint().copy()
        fp[0] ^= int(round(self.alpha * 1e6)) * 1_000_003 + int(round(self.beta * 1e6))
        return fp

    def describe_fingerprint(self, fp: np.ndarray) -> str:
        return self.inner.describe_fingerprint(fp) + " (with error feedback)"

    def state_dict(self) -> dict[str, Any]:
        state = {"inner": self.inner.state_dict(), "alpha": self.alpha, "beta": self.beta,
                 "memory": {k: _to_numpy(v).astype(np.float32) for k, v in self.memory.items()}}
        state["memory"].update({k: v for k, v in self._pending_memory.items()
                                if k not in state["memory"]})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state.get("alpha"), state.get("beta")) != (self.alpha, self.beta):
            raise ValueError(f"state_dict has alpha={state.get('alpha')}, "
                             f"beta={state.get('beta')}; "
                             f"this ErrorFeedback has alpha={self.alpha}, beta={self.beta}")
        self.inner.load_state_dict(state["inner"])
        self.memory.clear()
        self._pending_memory = {k: np.asarray(v, dtype=np.float32)
                                for k, v in state.get("memory", {}).items()}

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r}, alpha={self.alpha}, beta={self.beta})"


#: The ECQ-SGD paper's name for the method.
ECQ = ErrorFeedback


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    if hasattr(x, "numpy"):
        return x.numpy()
    return np.asarray(x)


def _like(x: Any, value: np.ndarray) -> Any:
    """``value`` as a tensor of ``x``'s framework, dtype float32 and device."""
    module = type(x).__module__
    if module.startswith("torch"):
        import torch

        return torch.from_numpy(np.ascontiguousarray(value)).to(
            device=x.device, dtype=torch.float32)
    if module.startswith("tensorflow"):
        import tensorflow as tf

        return tf.constant(value, dtype=tf.float32)
    return np.asarray(value, dtype=np.float32)


def _norm(x: Any) -> float:
    a = _to_numpy(x).astype(np.float64).ravel()
    return float(np.sqrt(np.dot(a, a)))


def _all_finite(x: Any) -> bool:
    module = type(x).__module__
    if module.startswith("torch"):
        import torch

        return bool(torch.isfinite(x).all())
    if module.startswith("tensorflow"):
        import tensorflow as tf

        return bool(tf.reduce_all(tf.math.is_finite(x)))
    return bool(np.all(np.isfinite(x)))
