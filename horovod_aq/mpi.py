"""mpi4py next to Horovod: when it is safe, and how the refit transport is chosen.

Measured here (Open MPI 4.1.4, mpi4py 4.1.2, Horovod 0.28.1, 2 ranks under ``horovodrun --mpi``):
importing ``mpi4py.MPI`` *after* ``hvd.init()`` initialized MPI crashes intermittently
(SIGSEGV inside ``MPI_Comm_size(MPI_COMM_WORLD)``, 3 of 4 launches), while letting mpi4py
initialize MPI first (``MPI_THREAD_MULTIPLE``, which Horovod then adopts and does not finalize)
ran 50 interleaved mpi4py/Horovod collectives cleanly in every launch.

So the framework integrations call :func:`preinit` when they are imported: under an MPI launcher,
before Horovod is initialized, it imports ``mpi4py.MPI``. The refit protocol uses mpi4py
(:class:`horovod_aq.refit.MPIComm`) only when :func:`mpi4py_owns_mpi` says mpi4py initialized MPI;
otherwise it falls back to Horovod's own collectives, which are correct under either controller.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

#: Environment variables set by MPI launchers (Open MPI, MPICH/Hydra, Slurm's PMI).
MPI_LAUNCH_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
_owns = False


def launched_by_mpi() -> bool:
    return any(v in os.environ for v in MPI_LAUNCH_ENV)


def preinit(horovod_initialized: bool) -> None:
    """Let mpi4py initialize MPI first when running under MPI and Horovod is not yet initialized."""
    global _owns
    if _owns or horovod_initialized or not launched_by_mpi():
        return
    if "mpi4py.MPI" in sys.modules:
        _owns = True  # the user imported it before Horovod: it initialized MPI
        return
    try:
        from mpi4py import MPI  # noqa: F401  (initializes MPI with MPI_THREAD_MULTIPLE)
    except ImportError:
        return
    _owns = True
    logger.debug("mpi4py initialized MPI before Horovod (refits will use mpi4py)")


def mpi4py_owns_mpi() -> bool:
    """True when mpi4py initialized MPI before Horovod, so using it beside Horovod is safe."""
    return _owns
