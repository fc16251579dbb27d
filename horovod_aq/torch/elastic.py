"""Elastic Horovod on PyTorch: a compressor in ``hvd.elastic.TorchState``.

    import horovod_aq.torch.elastic   # TorchState learns to carry a horovod_aq compressor

    state = hvd.elastic.TorchState(model, optimizer, compression=comp, epoch=0, batch=0)

Importing this module adds :class:`CompressorStateHandler` to Horovod's TorchState handler
registry (``horovod.torch.elastic.state``), for every horovod_aq compression object (a
:class:`~horovod_aq.Compressor`, :class:`~horovod_aq.ErrorFeedback`). Without it TorchState
would treat the compressor as a plain Python attribute and replace it, on the other ranks, by
an unpickled copy at every sync — one the optimizer never sees. The handler follows the rules
of :mod:`horovod_aq.elastic`: ``save``/``restore`` keep this rank's whole ``state_dict``, and
``sync`` broadcasts rank 0's state and loads it with this rank's own random streams and no
error memory (:func:`horovod_aq.elastic.synced_state`).

Horovod's stock ``hvd.DistributedOptimizer(compression=comp)`` needs it: its state holds no
compressor. The packed optimizer (``horovod_aq.torch.DistributedOptimizer``) needs nothing
here: its ``state_dict()`` carries the compressor and never communicates, so Horovod's own
optimizer handler (``TorchState(model, optimizer)``) saves, restores and syncs it.
"""

from __future__ import annotations

import copy
from typing import Any

from horovod.torch.elastic import state as _horovod_state
from horovod.torch.functions import broadcast_object

from horovod_aq.compressors import Compressor
from horovod_aq.elastic import synced_state
from horovod_aq.error_feedback import ErrorFeedback

#: The compression objects the handler takes (Horovod picks a handler by ``isinstance``).
COMPRESSION_TYPES = (Compressor, ErrorFeedback)


class CompressorStateHandler(_horovod_state.StateHandler):
    """TorchState's handler for a horovod_aq compression object (the module docstring)."""

    def __init__(self, compression: Any) -> None:
        super().__init__(compression)
        self._saved = copy.deepcopy(compression.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        root = broadcast_object(self.value.state_dict(), root_rank=0,
                                name=f"aq.elastic.{self.value.name}")
        self.value.load_state_dict(synced_state(root, self.value.state_dict()))


#: horovod_aq's handler, ahead of Horovod's (the first whose types match is taken).
HANDLERS = [(COMPRESSION_TYPES, CompressorStateHandler)]


def _register() -> None:
    registry = [entry for entry in _horovod_state.get_handler_registry()
                if entry[1] is not CompressorStateHandler]
    _horovod_state.set_handler_registry(HANDLERS + registry)


_register()
