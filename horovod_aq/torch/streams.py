"""The stock path's random stream on PyTorch (one object per compressor).

Horovod's ``compression=`` hook gives no bucket identity, so the stock path draws from one
seeded ``torch.Generator`` per device (``seed_for_rank(seed, rank)``), saved in the compressor's
``state_dict``. The packed exchange needs no state: it draws from the format's counter-based
stream (``horovod_aq.codec.stream``, keyed by seed, rank, step, bucket and part).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from horovod_aq.backend import horovod_world
from horovod_aq.compressors import Compressor, seed_for_rank


class TorchStreams:
    """Per-compressor PyTorch random streams (see the module docstring)."""

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self.generators: dict[str, torch.Generator] = {}
        self._pending: dict[str, Any] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        gen = self.generators.get(key)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed_for_rank(self.compressor.seed, _rank()))
            if key in self._pending:
                gen.set_state(torch.from_numpy(np.asarray(self._pending.pop(key), dtype=np.uint8)))
            self.generators[key] = gen
        return gen

    def state_dict(self) -> dict[str, Any]:
        saved = {k: g.get_state().numpy().copy() for k, g in self.generators.items()}
        saved.update({k: v for k, v in self._pending.items() if k not in saved})
        return {"generators": saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = dict(state.get("generators", {}))
        for key, gen in self.generators.items():
            if key in self._pending:
                gen.set_state(torch.from_numpy(np.asarray(self._pending.pop(key), dtype=np.uint8)))


def _rank() -> int:
    return horovod_world("horovod.torch")[0]


def torch_streams(compression: Any) -> TorchStreams:
    """The random streams of ``compression``'s quantizer (created on first use; restores saved
    streams)."""
    quantizer = compression.quantizer
    return quantizer.framework_state("torch", lambda: TorchStreams(quantizer))


#: Pre-redesign names.
TorchState = TorchStreams
torch_state = torch_streams
