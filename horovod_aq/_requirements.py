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


def import_horovod(module: str) -> ModuleType | None:
    """Import a framework's Horovod (``horovod.torch`` / ``horovod.tensorflow``) if installed and,
    under an MPI launcher, let mpi4py initialize MPI before Horovod does (:mod:`horovod_aq.mpi`).
    Returns None when Horovod is missing: kernels still work, the integration raises on use."""
    from horovod_aq import mpi

    try:
        hvd = importlib.import_module(module)
    except ImportError:
        return None
    mpi.preinit(horovod_initialized=hvd.is_initialized())
    return hvd


def lazy_attributes(package: str, attributes: dict[str, str], horovod: str, *,
                    horovod_present: bool, without_horovod: frozenset[str] = frozenset()):
    """A module ``__getattr__`` importing ``attributes[name]`` (a module path) on first access,
    with the install hint of :func:`require` when Horovod is needed but missing."""
    purpose = package.rsplit(".", 1)[-1]

    def __getattr__(name: str):
        if name not in attributes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if not horovod_present and name not in without_horovod:
            require(horovod, purpose)
        return getattr(importlib.import_module(attributes[name]), name)

    return __getattr__
