"""Clear errors when an optional dependency (a framework, Horovod) is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL_HINT = (
    "Horovod 0.28.1 must be built from source with this project's patch for current PyTorch and "
    "TensorFlow: run `scripts/setup.sh` from the horovod_aq repository (it creates .venv), or "
    "see README.md, 'Install'."
)


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` or raise ImportError saying what it is needed for and how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        hint = INSTALL_HINT if module.startswith("horovod") else (
            f"install it (e.g. `pip install horovod-aq[{purpose}]`) or run scripts/setup.sh")
        raise ImportError(f"horovod_aq.{purpose} needs `{module}`, which failed to import "
                          f"({exc}). {hint}") from exc
