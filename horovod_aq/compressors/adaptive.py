"""Compressors whose level tables are fitted to the gradients while training runs.

ALQ, ALQ-N, ALQ-G, AMQ and AMQ-N ("Adaptive Gradient Quantization for Data-Parallel SGD",
arXiv 2010.12460): each class names its fitter (docs/quantizers.md §7 and §8) and the distribution
model it fits to (§5); the refit protocol itself is the base class's (docs/protocol.md §2).

Defaults (docs/quantizers.md §5.6, §5.7), each with its measured before/after there:

* **Buckets are normalized by ‖v‖∞ at every width**, not by the paper's ‖v‖₂. With L2 scaling the
  levels ±1 are almost never used (|r| ≤ ‖v‖∞/‖v‖₂ ≪ 1), so the largest coordinates of a bucket
  are rounded across the widest interval [ℓ_{N−2}, 1] with noise of their own size: on the demo's
  CNN (examples/pytorch_mnist.py) ALQ 3-bit with L2 buckets trained 2.0 pt below fp32, and its
  noise cost as much as Gaussian noise of the same per-coordinate variance, against nothing for
  the same amount spread evenly. The statistics stay the L2 ones every integration records; the
  fit turns them into the law of v/‖v‖∞ (``levels.variance.linf_law``). AMQ-N keeps L2 from 3
  bits (:attr:`AdaptiveCompressor.l2_from_bits`): its single pooled normal has no tails to rescale.
* **256 coordinates per bucket** (:data:`DEFAULT_BUCKET_SIZE`), not the paper's 8192: with L∞
  scaling the variance falls with the bucket's length faster than the norms' 32/B bits per
  coordinate grow down to about 256 (the distortion-rate slope of §5.7).

``norm=`` and ``bucket_size=`` choose either at any width.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from horovod_aq.compressors.base import DEFAULT_WEIGHTING, Compressor
from horovod_aq.levels import fit_alq, fit_alq_gd, fit_amq
from horovod_aq.levels.model import Distribution
from horovod_aq.levels.stats import BucketStats
from horovod_aq.levels.variance import gaussian_prior, linf_law

#: The adaptive compressors' default bucket size (docs/quantizers.md §5.7).
DEFAULT_BUCKET_SIZE = 256


@functools.lru_cache(maxsize=64)
def prior_levels(fitter: Callable[..., np.ndarray], bits: int, bucket_size: int,
                 norm: str = "l2") -> np.ndarray:
    """``fitter``'s table for the Gaussian prior of normalized coordinates
    (``levels.variance.gaussian_prior``, docs/quantizers.md §5.1, §5.6): TN(0, 1/B) for L2,
    TN(0, 1/z_B²) with z_B = Φ⁻¹(1 − 1/(2B)) for L∞. Read-only, cached."""
    levels = np.asarray(fitter(gaussian_prior(bucket_size, norm), bits), dtype=np.float64)
    levels.setflags(write=False)
    return levels


class AdaptiveCompressor(Compressor):
    """Adaptive tables: start from the fit to a Gaussian prior, refit on schedule.

    ``norm`` (default ``"linf"``, ``"l2"`` from :attr:`l2_from_bits` bits where a class sets it;
    docs/quantizers.md §5.6): the bucket scale. The fits always start from the L2 statistics of
    §5.1–§5.5; with L∞ the law is rescaled by ``linf_law`` first. Measured on the CNN gradients
    of benchmarks/variance.py, L∞ lowers the variance of every histogram-model fit at 2, 3 and 4
    bits by 1.7–4.9× (B = 1024: ALQ 4.71 → 1.19 at 2 bits, where TernGrad has 2.23; 0.340 → 0.155
    at 3 bits).

    ``model`` is the distribution F the levels are fitted to (docs/quantizers.md §5):

    * ``"histogram"`` (default): the n_b²-weighted histogram of every normalized coordinate r
      (1025 bins, fine near 0). Its expected variance is the gradient's actual quantization
      error, sparse gradients' point mass at 0 and heavy tails included. Measured on a small
      MNIST CNN at 3 bits with L2 scaling: normalized variance 0.54 vs 1.51 with the mixture at
      B = 8192, and 0.38 vs 0.55 at B = 1024.
    * ``"mixture"``: the paper's mixture of truncated normals over the top-K buckets, weights
      ∝ n_b^γ (``weighting``: "squared_norm" γ = 2, or "norm" γ = 1 as the reference code).
      Each component has std ≈ 1/√B, so it cannot represent within-bucket heavy tails.
    """

    adaptive = True
    #: :data:`DEFAULT_BUCKET_SIZE`; pass bucket_size=8192 to reproduce the paper's setting.
    default_bucket_size = DEFAULT_BUCKET_SIZE
    default_norm = "linf"
    #: The width from which ``norm`` defaults to L2 (None: L∞ at every width).
    l2_from_bits: ClassVar[int | None] = None
    MODELS: ClassVar[tuple[str, ...]] = ("histogram", "mixture")
    #: fitter(distribution, bits) -> levels: the method's solver.
    fitter: ClassVar[Callable[..., np.ndarray]]

    def __init__(self, bits: int = 3, *, model: str = "histogram",
                 weighting: str = DEFAULT_WEIGHTING, **kwargs: Any) -> None:
        if kwargs.get("norm") is None and self.l2_from_bits is not None \
                and isinstance(bits, (int, np.integer)) and not isinstance(bits, bool):
            kwargs["norm"] = "l2" if bits >= self.l2_from_bits else "linf"
        if weighting not in ("squared_norm", "norm"):
            raise ValueError(f"weighting must be 'squared_norm' or 'norm', got {weighting!r}")
        if model not in self.MODELS:
            raise ValueError(f"model must be one of {self.MODELS}, got {model!r}")
        self.weighting = weighting
        self.model = model
        super().__init__(bits, **kwargs)

    @property
    def wants_histogram(self) -> bool:
        return self.model == "histogram"

    def initial_levels(self) -> np.ndarray:
        """The table before the first refit: this method's fit to the Gaussian prior
        (:func:`prior_levels`). The reference starts from E-ref (p = 1/2) instead; measured on
        a small MNIST CNN at 3 bits and B = 1024, E-ref's first exchange has normalized variance
        15.1 and the prior's 0.55 — one very noisy first step that momentum carries on."""
        return prior_levels(type(self).fitter, self.bits, self.bucket_size, self.norm)

    def distribution(self, stats: BucketStats) -> Distribution:
        """The fitting distribution F for ``model``, as a law of v/‖v‖∞ when ``norm`` is L∞."""
        dist: Distribution
        if self.model == "histogram":
            dist = stats.histogram_model()
        elif self.model == "pooled":
            dist = stats.pooled_normal()
        else:
            dist = stats.mixture(self.weighting)
        return linf_law(dist, self.bucket_size) if self.norm == "linf" else dist

    def fit_levels(self, stats: BucketStats) -> np.ndarray:
        return type(self).fitter(self.distribution(stats), self.bits)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "model": self.model, "weighting": self.weighting}


#: The pre-redesign name of :class:`AdaptiveCompressor`.
_Adaptive = AdaptiveCompressor


class ALQ(AdaptiveCompressor):
    """ALQ (arXiv 2010.12460): levels fitted by exact coordinate descent on the expected variance
    V(ℓ; F) (docs/quantizers.md §6–§7); F per ``model`` (see :class:`AdaptiveCompressor`)."""

    method = "alq"
    fitter = staticmethod(fit_alq)

    def __init__(self, bits: int = 3, *, symmetric: bool = False, **kwargs: Any) -> None:
        self.symmetric = bool(symmetric)
        super().__init__(bits, **kwargs)

    def fit_levels(self, stats: BucketStats) -> np.ndarray:
        return fit_alq(self.distribution(stats), self.bits, symmetric=self.symmetric,
                       initial=self.table.levels)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "symmetric": self.symmetric}


class ALQN(ALQ):
    """ALQ-N: ALQ on a single pooled truncated normal (docs/quantizers.md §5.4)."""

    method = "alqn"
    MODELS = ("pooled",)

    def __init__(self, bits: int = 3, **kwargs: Any) -> None:
        kwargs.setdefault("model", "pooled")
        super().__init__(bits, **kwargs)


class ALQG(AdaptiveCompressor):
    """ALQ-G: levels moved by clipped gradient steps on the expected variance (§7.3)."""

    method = "alqg"
    fitter = staticmethod(fit_alq_gd)


class AMQ(AdaptiveCompressor):
    """AMQ: exponential levels ±{p^s, …, p, 1} with the multiplier p fitted (§8)."""

    method = "amq"
    fitter = staticmethod(fit_amq)


class AMQN(AMQ):
    """AMQ-N: AMQ on a single pooled truncated normal; L2 buckets from 3 bits (the pooled
    normal has no tails for ``linf_law`` to rescale: docs/quantizers.md §5.6)."""

    method = "amqn"
    MODELS = ("pooled",)
    l2_from_bits = 3

    def __init__(self, bits: int = 3, **kwargs: Any) -> None:
        kwargs.setdefault("model", "pooled")
        super().__init__(bits, **kwargs)
