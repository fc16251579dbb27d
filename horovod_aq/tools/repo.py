"""Paths into the clone the package runs from: ``benchmarks/`` and ``examples/`` are not
installed with it, so ``horovod-aq bench`` and ``horovod-aq demo`` run them as scripts of the
repository next to the package."""

from __future__ import annotations

import os

#: The repository root: the folder that holds the ``horovod_aq`` package.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def repo_path(*parts: str) -> str:
    """``REPO_ROOT/parts...``; SystemExit saying so when it is not there (an installed package
    without its clone)."""
    path = os.path.join(REPO_ROOT, *parts)
    if not os.path.exists(path):
        raise SystemExit(f"{os.path.join(*parts)} not found next to the installed package "
                         f"({REPO_ROOT}); run this from a clone of the horovod_aq repository")
    return path
