"""Compressors with fixed level tables, and the two non-quantizing baselines.

Level families: docs/quantizers.md §2 (each class names its paper).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from horovod_aq.compressors import arguments
from horovod_aq.compressors.base import Compressor
from horovod_aq.levels import families


class NoCompression(Compressor):
    """Send gradients as they are (fp32 allreduce); the baseline."""

    method = "none"
    quantizes = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(bits=32, **kwargs)

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16(Compressor):
    """Cast to fp16 for the allreduce and back (Horovod's ``Compression.fp16``)."""

    method = "fp16"
    quantizes = False
    fp16_wire = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(bits=16, **kwargs)


class QSGD(Compressor):
    """QSGD (arXiv 1610.02132): uniform levels, L2 bucket norm.

    Default table U-ref, 2^bits zero-free levels ℓ_k = −1 + 2k/(2^b − 1) (the ALQ/NUQSGD
    experiments' convention). ``s=`` selects the paper's grid {0, ±1/s, …, ±1} (2s + 1 levels,
    ⌈log₂(2s+1)⌉ bits per coordinate; ``bits`` is then derived).
    """

    method = "qsgd"

    def __init__(self, bits: int = 4, *, s: int | None = None, **kwargs: Any) -> None:
        self.s = arguments.optional(arguments.integer, "s", s, 1, 127,
                                    allowed="an integer in 1..127 (2s+1 levels <= 256) or None")
        if self.s is not None:
            bits = int(2 * self.s).bit_length()
        super().__init__(bits, **kwargs)

    def initial_levels(self) -> np.ndarray:
        if self.s is not None:
            return families.uniform_with_zero(self.s)
        return families.uniform(self.bits)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "s": self.s}


class QSGDInf(QSGD):
    """QSGDinf: QSGD's uniform levels scaled by the bucket's max-norm ‖v‖∞."""

    method = "qsgdinf"
    default_norm = "linf"


class NUQSGD(Compressor):
    """NUQSGD (arXiv 1908.06077): exponential levels ±{p^(K−1), …, p, 1}, p = 1/2, L2 norm."""

    method = "nuqsgd"

    def __init__(self, bits: int = 3, *, p: float = 0.5, **kwargs: Any) -> None:
        self.p = arguments.real("p", p, lo=0.0, hi=1.0, open_interval=True)
        super().__init__(bits, **kwargs)

    def initial_levels(self) -> np.ndarray:
        return families.exponential(self.bits, self.p)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "p": self.p}


class TernGrad(Compressor):
    """TernGrad (arXiv 1705.07878): levels {−1, 0, 1} scaled by the bucket's ‖v‖∞; 2 bits."""

    method = "terngrad"
    default_norm = "linf"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.pop("bits", None)
        super().__init__(2, **kwargs)

    def initial_levels(self) -> np.ndarray:
        return families.ternary()


class NaturalDithering(Compressor):
    """Natural dithering (arXiv 1905.10988): {0, ±2^(1−s), …, ±1/2, ±1}, s = 2^(bits−1) − 1."""

    method = "natural"

    def __init__(self, bits: int = 3, **kwargs: Any) -> None:
        arguments.integer("bits", bits, 2, 8,
                          allowed="an integer in 2..8 (NaturalDithering needs bits >= 2)")
        super().__init__(bits, **kwargs)

    def initial_levels(self) -> np.ndarray:
        return families.natural(self.bits)
