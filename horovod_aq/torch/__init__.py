"""PyTorch integration: the packed-exchange ``DistributedOptimizer`` and stock-path ``refit``.

``horovod_aq.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
compression=horovod_aq.ALQ(bits=3))`` sends bit-packed codes; with Horovod's own
``hvd.DistributedOptimizer(..., compression=horovod_aq.ALQ(bits=3))`` call
:func:`refit` once per step after ``optimizer.step()`` to keep adaptive levels fitted.

``horovod_aq.torch.kernels`` needs only PyTorch; the integration needs Horovod, imported here
so that, under an MPI launcher, mpi4py can initialize MPI before Horovod (see
:mod:`horovod_aq.mpi`). A missing Horovod is reported when the integration is used.
"""

import importlib

from horovod_aq import mpi as _mpi
from horovod_aq._requirements import require

require("torch", "torch")
try:
    import horovod.torch as _hvd
except ImportError:  # kernels still work; the integration raises a clear error on use
    _hvd = None
else:
    _mpi.preinit(horovod_initialized=_hvd.is_initialized())

_LAZY = {
    "DistributedOptimizer": "horovod_aq.torch.optimizer",
    "DEFAULT_FUSION_BYTES": "horovod_aq.torch.optimizer",
    "ConfigMismatchError": "horovod_aq.sync",
    "refit": "horovod_aq.torch.stock",
    "HorovodComm": "horovod_aq.torch.comm",
    "comm_for": "horovod_aq.torch.comm",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'horovod_aq.torch' has no attribute {name!r}")
    if _hvd is None:
        require("horovod.torch", "torch")
    return getattr(importlib.import_module(_LAZY[name]), name)


__all__ = sorted(_LAZY)
