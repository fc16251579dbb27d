"""The public compressor classes: settings + current level table + state.

==================  ==============================  ======  ==========  =========
class               levels                          norm    bucket      adaptive
==================  ==============================  ======  ==========  =========
QSGD                uniform U-ref (or U-paper: s=)  L2      512         no
QSGDInf             uniform U-ref                   L∞      512         no
NUQSGD              exponential, p = 1/2            L2      512         no
TernGrad            {−1, 0, 1}                      L∞      512         no
NaturalDithering    {0, ±2^(1−s), …, ±1}            L2/L∞   512         no
ALQ / ALQN / ALQG   fitted (coordinate descent /    L∞      256         yes
                    single normal / gradient)
AMQ / AMQN          exponential with fitted p       L∞ (*)  256         yes
DQSGD               any of the above, per-step      —       —           as its family
                    bit width
==================  ==============================  ======  ==========  =========

(*) AMQN: L2 from 3 bits. Adaptive defaults: docs/quantizers.md §5.6 (norm), §5.7 (bucket).

``base`` holds the :class:`Compressor` protocol every integration uses, ``fixed`` and
``adaptive`` the level families (docs/quantizers.md §2, §7, §8), ``dqsgd`` the dynamic width
(docs/dynamic.md §1).
"""

from __future__ import annotations

from typing import Any

from horovod_aq.compressors.adaptive import (
    ALQ,
    ALQG,
    ALQN,
    AMQ,
    AMQN,
    AdaptiveCompressor,
    _Adaptive,
    prior_levels,
)
from horovod_aq.compressors.arguments import SettingTypeError
from horovod_aq.compressors.base import (
    DEFAULT_TOP_K,
    DEFAULT_WEIGHTING,
    NONFINITE,
    NORMS,
    Compressor,
    seed_for_rank,
)
from horovod_aq.compressors.dqsgd import DQSGD
from horovod_aq.compressors.fixed import (
    FP16,
    NUQSGD,
    QSGD,
    NaturalDithering,
    NoCompression,
    QSGDInf,
    TernGrad,
)

#: Every compressor class by its command-line name.
METHODS: dict[str, type[Compressor]] = {
    cls.method: cls
    for cls in (NoCompression, FP16, QSGD, QSGDInf, NUQSGD, TernGrad, NaturalDithering,
                ALQ, ALQN, ALQG, AMQ, AMQN, DQSGD)
}
#: Compressors whose width is fixed by the method (``from_name`` drops ``bits`` for them).
_FIXED_WIDTH = (NoCompression, FP16, TernGrad)


def from_name(method: str, **kwargs: Any) -> Compressor:
    """Build a compressor from its name ("alq", "qsgd", …), passing only the arguments it takes."""
    if not isinstance(method, str):
        raise SettingTypeError(f"from_name needs a compression name (a string), got {method!r} "
                               f"({type(method).__name__}); choose from {sorted(METHODS)}")
    try:
        cls = METHODS[method.lower()]
    except KeyError:
        raise ValueError(f"unknown compression {method!r}; choose from {sorted(METHODS)}") from None
    if cls in _FIXED_WIDTH:
        kwargs.pop("bits", None)
    return cls(**kwargs)


__all__ = [
    "ALQ", "ALQG", "ALQN", "AMQ", "AMQN", "DQSGD", "FP16", "NUQSGD", "QSGD", "QSGDInf",
    "TernGrad", "NaturalDithering", "NoCompression", "Compressor", "AdaptiveCompressor",
    "METHODS", "from_name", "seed_for_rank", "prior_levels", "NORMS", "NONFINITE",
    "DEFAULT_TOP_K", "DEFAULT_WEIGHTING", "_Adaptive",
]
