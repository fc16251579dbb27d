"""PyTorch integration: the packed-exchange ``DistributedOptimizer`` and stock-path ``refit``.

``horovod_aq.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
compression=horovod_aq.ALQ(bits=3))`` sends bit-packed codes; with Horovod's own
``hvd.DistributedOptimizer(..., compression=horovod_aq.ALQ(bits=3))`` call
:func:`refit` once per step after ``optimizer.step()`` to keep adaptive levels fitted.

``horovod_aq.torch.kernels`` needs only PyTorch; the integration needs Horovod, imported here
so that, under an MPI launcher, mpi4py can initialize MPI before Horovod (see
:mod:`horovod_aq.mpi`). A missing Horovod is reported when the integration is used.
"""

from horovod_aq._requirements import import_horovod, lazy_attributes, require

require("torch", "torch")
_hvd = import_horovod("horovod.torch")

_LAZY = {
    "DistributedOptimizer": "horovod_aq.torch.optimizer",
    "DEFAULT_FUSION_BYTES": "horovod_aq.packed.plan",
    "ConfigMismatchError": "horovod_aq.packed.protocol",
    "refit": "horovod_aq.torch.stock",
    "HorovodComm": "horovod_aq.torch.comm",
    "comm_for": "horovod_aq.torch.comm",
}
__getattr__ = lazy_attributes(__name__, _LAZY, "horovod.torch", horovod_present=_hvd is not None,
                              without_horovod=frozenset({"ConfigMismatchError"}))
__all__ = sorted(_LAZY)
