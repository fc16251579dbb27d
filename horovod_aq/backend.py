"""The one place that maps a tensor's type to a framework package.

The framework-free core (compressors, error feedback, DQSGD) needs a handful of tensor operations:
Horovod's stock ``compress``/``decompress``, a float64 sum of squares (DQSGD reads the aggregated
gradient's norm), a finiteness check and conversions to and from numpy (error memory). A
:class:`Backend` provides them for one framework. :func:`backend_for` picks it from the tensor's
type and imports the framework's backend module (``horovod_aq.torch.backend``,
``horovod_aq.tensorflow.backend``) only when it first sees one of its tensors, so importing the
core never imports torch or TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import numpy as np


class Backend(Protocol):
    """Tensor operations the core asks of a framework (one object per framework)."""

    name: str

    def to_numpy(self, x: Any) -> np.ndarray:
        """A host copy of ``x``."""
        ...

    def like(self, x: Any, value: np.ndarray) -> Any:
        """``value`` as a float32 tensor of ``x``'s framework (and device)."""
        ...

    def all_finite(self, x: Any) -> bool:
        ...

    def sum_of_squares(self, x: Any) -> float:
        """Σx² accumulated in float64."""
        ...

    def compress(self, compressor: Any, tensor: Any) -> tuple[Any, Any]:
        """Horovod's stock ``compression=`` hook (docs/protocol.md §1)."""
        ...

    def decompress(self, compressor: Any, tensor: Any, ctx: Any) -> Any:
        ...


class NumpyBackend:
    """numpy arrays (the simulation, the oracle's tests); no Horovod stock path."""

    name = "numpy"

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def like(self, x: Any, value: np.ndarray) -> np.ndarray:
        return np.asarray(value, dtype=np.float32)

    def all_finite(self, x: Any) -> bool:
        return bool(np.all(np.isfinite(x)))

    def sum_of_squares(self, x: Any) -> float:
        a = np.asarray(x, dtype=np.float64).ravel()
        return float(np.dot(a, a))

    def compress(self, compressor: Any, tensor: Any) -> tuple[Any, Any]:
        raise TypeError(f"{compressor.name}: Horovod's compression= hook passes torch or "
                        f"TensorFlow tensors, got {type(tensor).__name__}")

    decompress = compress  # type: ignore[assignment]


#: Top-level module of a tensor's type → the backend module of its framework.
_PACKAGES = {
    "torch": "horovod_aq.torch.backend",
    "tensorflow": "horovod_aq.tensorflow.backend",
    "tf_keras": "horovod_aq.tensorflow.backend",
    "keras": "horovod_aq.tensorflow.backend",
}
_NUMPY = NumpyBackend()
_loaded: dict[str, Backend] = {}


def backend_for(x: Any) -> Backend:
    """The :class:`Backend` of ``x``'s framework (its module imported on first use)."""
    if isinstance(x, (np.ndarray, np.generic, float, int, list, tuple)):
        return _NUMPY
    root = type(x).__module__.split(".", 1)[0]
    path = _PACKAGES.get(root)
    if path is None:
        raise TypeError(f"horovod_aq handles numpy arrays and torch and TensorFlow tensors, got "
                        f"{type(x).__module__}.{type(x).__name__}")
    if path not in _loaded:
        _loaded[path] = importlib.import_module(path).BACKEND
    return _loaded[path]


def horovod_world(module: str) -> tuple[int, int]:
    """(rank, size) of the framework's Horovod (``module``, e.g. "horovod.torch"); (0, 1) when
    Horovod is missing or not initialized."""
    try:
        hvd = importlib.import_module(module)
    except ImportError:
        return 0, 1
    return (hvd.rank(), hvd.size()) if hvd.is_initialized() else (0, 1)
