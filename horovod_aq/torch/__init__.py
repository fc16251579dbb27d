"""PyTorch integration: the packed-exchange ``DistributedOptimizer`` and stock-path ``refit``.

``horovod_aq.torch.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
compression=horovod_aq.ALQ(bits=3))`` sends bit-packed codes; with Horovod's own
``hvd.DistributedOptimizer(..., compression=horovod_aq.ALQ(bits=3))`` the gradients are
quantized and sent as fp16. Either way adaptive levels are refitted on schedule with no extra
call (docs/protocol.md §14); :func:`refit` is for loops without a Horovod optimizer.

``horovod_aq.torch.kernels`` needs only PyTorch; the integration needs Horovod, imported here
so that, under an MPI launcher, mpi4py can initialize MPI before Horovod (see
:mod:`horovod_aq.mpi`). A missing Horovod is reported when the integration is used.
"""

from horovod_aq._requirements import import_horovod, lazy_attributes, require

require("torch", "torch")
_hvd = import_horovod("horovod.torch")

_LAZY = {
    "DistributedOptimizer": "horovod_aq.torch.distributed_optimizer",
    "DEFAULT_FUSION_BYTES": "horovod_aq.packed.plan",
    "ConfigMismatchError": "horovod_aq.packed.protocol",
    "refit": "horovod_aq.torch.stock",
    "HorovodComm": "horovod_aq.torch.comm",
    "comm_for": "horovod_aq.torch.comm",
    "QuantizedHookState": "horovod_aq.torch.ddp",
    "quantized_hook": "horovod_aq.torch.ddp",
}
_WITHOUT_HOROVOD = frozenset({"ConfigMismatchError", "QuantizedHookState", "quantized_hook"})
__getattr__ = lazy_attributes(__name__, _LAZY, "horovod.torch", horovod_present=_hvd is not None,
                              without_horovod=_WITHOUT_HOROVOD)
__all__ = sorted(_LAZY)
