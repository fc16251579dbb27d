"""The :class:`~horovod_aq.backend.Backend` of torch tensors (registered by
:mod:`horovod_aq.backend` under the module name ``torch``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from horovod_aq.torch import stock


class TorchBackend:
    name = "torch"

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        return x.detach().cpu().numpy()

    def like(self, x: torch.Tensor, value: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(value)).to(device=x.device,
                                                                dtype=torch.float32)

    def all_finite(self, x: torch.Tensor) -> bool:
        return bool(torch.isfinite(x).all())

    def sum_of_squares(self, x: torch.Tensor) -> float:
        return float(torch.sum(x.detach().to(torch.float64) ** 2))

    def compress(self, compressor: Any, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return stock.compress(compressor, tensor)

    def decompress(self, compressor: Any, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return stock.decompress(compressor, tensor, ctx)


BACKEND = TorchBackend()
