"""Compressors whose level tables are fitted to the gradients while training runs.

ALQ, ALQ-N, ALQ-G, AMQ and AMQ-N ("Adaptive Gradient Quantization for Data-Parallel SGD",
arXiv 2010.12460): each class names its fitter (docs/quantizers.md §7 and §8) and the distribution
model it fits to (§5); the refit protocol itself is the base class's (docs/protocol.md §2).

At 1 and 2 bits buckets are normalized by ‖v‖∞ by default (docs/quantizers.md §5.6), not by the
paper's ‖v‖₂: with L2 scaling the levels ±1 are almost never used (|r| ≤ ‖v‖∞/‖v‖₂ ≪ 1), which
leaves a 2-bit table two usable levels. The statistics stay the L2 ones every integration records;
the fit turns them into the law of v/‖v‖∞ (``levels.variance.linf_law``). From 3 bits on the
default is the paper's ‖v‖₂ (its tables have enough levels; the L∞ law is an approximation, and
the demo's CNN trained to 91.3 % with L∞ against 95.9 % with L2 at 3 bits). ``norm=`` chooses
either at any width.
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

#: Adaptive compressors scale buckets by ‖v‖∞ up to this many bits when ``norm=`` is not given,
#: and by ‖v‖₂ above it (quantizers.md §5.6).
LINF_DEFAULT_MAX_BITS = 2


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

    ``norm`` (default ``"linf"`` up to :data:`LINF_DEFAULT_MAX_BITS` bits, else ``"l2"``;
    docs/quantizers.md §5.6): the bucket scale. The fits always start
    from the L2 statistics of §5.1–§5.5; with L∞ the law is rescaled by ``linf_law`` first.
    Measured on the CNN gradients of benchmarks/variance.py, L∞ lowers the variance of every
    histogram-model fit at 2, 3 and 4 bits by 1.7–4.9× (B = 1024: ALQ 4.71 → 1.19 at 2 bits, where
    TernGrad has 2.23; 0.340 → 0.155 at 3 bits).

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
    #: 1024, not the paper's 8192: on small or sparse models the larger bucket costs a lot of
    #: variance (MNIST CNN, 3 bits: test accuracy 95.9% at 1024 vs 93.1% at 8192, fp32 96.2%)
    #: and the norms cost only 32/1024 = 0.03 bits per coordinate. Pass bucket_size=8192 to
    #: reproduce the paper's setting.
    default_bucket_size = 1024
    MODELS: ClassVar[tuple[str, ...]] = ("histogram", "mixture")
    #: fitter(distribution, bits) -> levels: the method's solver.
    fitter: ClassVar[Callable[..., np.ndarray]]

    def __init__(self, bits: int = 3, *, model: str = "histogram",
                 weighting: str = DEFAULT_WEIGHTING, **kwargs: Any) -> None:
        if kwargs.get("norm") is None and isinstance(bits, (int, np.integer)) \
                and not isinstance(bits, bool):
            kwargs["norm"] = "linf" if bits <= LINF_DEFAULT_MAX_BITS else "l2"
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
    """AMQ-N: AMQ on a single pooled truncated normal."""

    method = "amqn"
    MODELS = ("pooled",)

    def __init__(self, bits: int = 3, **kwargs: Any) -> None:
        kwargs.setdefault("model", "pooled")
        super().__init__(bits, **kwargs)
