"""``error_feedback=`` of the packed entry points: the compressor a packed exchange really uses.

``horovod_aq.torch.DistributedOptimizer``, ``horovod_aq.torch.ddp.QuantizedHookState``,
``horovod_aq.tensorflow.DistributedGradientTape`` and ``horovod_aq.keras.DistributedOptimizer``
take ``error_feedback: bool | str = "auto"`` and call :func:`resolve` once, at construction:

* ``"auto"`` (the default): :class:`~horovod_aq.ErrorFeedback` with its default coefficients
  around a quantizer whose code width is at most :data:`AUTO_MAX_BITS` (3) bits, the compressor
  unchanged otherwise. At 2 bits the demo trains 6.1 pt below fp32 without error feedback and
  level with it with; at 3 bits, over 20 simulated seeds, 0.96 pt below without and level with
  (docs/quantizers.md §5.9, §5.10). **Except under an adaptive optimizer**: where the entry
  point is given the optimizer (the packed optimizers wrap it; the DDP hook takes
  ``optimizer=``) and :func:`adaptive` finds it divides each coordinate by a running second
  moment (Adam, AdamW, RMSprop, ...), "auto" sends the plain quantizer. Error feedback there is
  a loss: AdamW on a character GPT, validation bits per character minus fp32's, 3 bits +0.018
  with it against +0.010 without, 2 bits +0.093 against +0.052 (docs/quantizers.md §5.11).
* ``True``: ErrorFeedback around any quantizer (refused for ``NoCompression`` / ``FP16``, which
  send full-precision values and have no quantization error to keep).
* ``False``: the compressor as given.

An ErrorFeedback (``ECQ``) passed as ``compression=`` is kept as it is under every setting.

**Code width** (:func:`code_width`): the widest table a quantizer sends (TernGrad: 2; QSGD with
``s=``: its derived bits). DQSGD counts with the mean width its rule aims at (``target_bits``, or
``budget / horizon``), not with ``min_bits``: its default ``min_bits=2`` would otherwise turn
error feedback on for every DQSGD, also for ``DQSGD(4)``, which sends 4 bits on average and
only occasionally 2. A DQSGD aiming at 3 bits or fewer on average is wrapped; its ErrorFeedback
takes α from the narrowest width's variance (``quantizer_gammas``), so it is stable at every
width.

**One wrapper per compressor.** The ErrorFeedback made for a compressor is kept on it
(:attr:`~horovod_aq.Compressor.error_feedback_wrapper`) and returned again: a TF tape rebuilt
every step, or two entry points given the same compressor, use one error memory, as they use one
level table. Every rank decides from the same settings, so all ranks agree; the wrapper's
settings are part of the handshake digest (``ErrorFeedback.config``) all the same.

The stock ``compression=`` paths (Horovod's own optimizers) cannot carry a memory per parameter:
:func:`stock_warning` is what they log once at :data:`STOCK_WARNING_MAX_BITS` (2) bits or fewer,
where the plain quantizer loses several points; at 3 bits it loses about one on the demo and
0.14 pt converged, which a warning on every stock 3-bit run would overstate.
"""

from __future__ import annotations

import logging
from typing import Any

from horovod_aq._arguments import SettingTypeError, shown
from horovod_aq.compressors import DQSGD, Compressor
from horovod_aq.error_feedback import ErrorFeedback

logger = logging.getLogger(__name__)

#: The settings ``error_feedback=`` takes.
SETTINGS = ("auto", True, False)
#: "auto" turns error feedback on for quantizers of at most this many bits per code.
AUTO_MAX_BITS = 3
#: The stock paths warn that they cannot keep the memory at most this many bits per code.
STOCK_WARNING_MAX_BITS = 2
#: Where the rule and its measurements are documented.
DOCS = "docs/quantizers.md §5.9"
#: Where the adaptive optimizers' exception is measured.
ADAPTIVE_DOCS = "docs/quantizers.md §5.11"
#: Optimizer classes (or base classes) that divide each coordinate by a running second moment.
ADAPTIVE_OPTIMIZERS = frozenset({
    "Adam", "AdamW", "NAdam", "Nadam", "RAdam", "Adamax", "SparseAdam", "Adagrad", "Adadelta",
    "RMSprop", "Adafactor", "Lamb", "LAMB", "FusedAdam", "FusedLAMB", "DeepSpeedCPUAdam",
    "AdamW8bit", "Adam8bit", "PagedAdamW",
})
#: Where wrappers keep the optimizer they wrap: Keras's ``LossScaleOptimizer``, PyTorch's
#: ``ZeroRedundancyOptimizer`` (``optim``), Lightning's ``LightningOptimizer`` (``_optimizer``)
#: and Accelerate's ``AcceleratedOptimizer`` (``optimizer``).
WRAPPED_OPTIMIZER_ATTRIBUTES = ("inner_optimizer", "optim", "_optimizer", "optimizer")


def check(value: Any) -> bool | str:
    """``value`` if it is one of :data:`SETTINGS` (:class:`SettingTypeError`, a TypeError and a
    ValueError, otherwise, saying what to pass)."""
    if isinstance(value, bool) or (isinstance(value, str) and value == "auto"):
        return value
    raise SettingTypeError(
        f"error_feedback must be 'auto', True or False, got {shown(value)}; 'auto' (the "
        f"default) turns error feedback on for quantizers of <= {AUTO_MAX_BITS} bits ({DOCS})")


def code_width(compression: Any) -> float | None:
    """The code width that decides "auto": the widest table the quantizer sends; DQSGD: the mean
    width it aims at (module docstring). None for a compression that does not quantize."""
    quantizer = compression.quantizer
    if not quantizer.quantizes:
        return None
    if isinstance(quantizer, DQSGD):
        rule = quantizer.rule
        return float(rule.target_bits if rule.budget is None else rule.budget / rule.horizon)
    return float(max(quantizer.tables_by_width()))


def adaptive(optimizer: Any, _depth: int = 4) -> bool:
    """Whether ``optimizer`` scales each coordinate by a running mean of its squared gradient,
    where error feedback is a loss (docs/quantizers.md §5.11): its class, or a base class, is
    named in :data:`ADAPTIVE_OPTIMIZERS` (PyTorch's, Keras's and the usual third-party names),
    or it wraps such an optimizer in one of :data:`WRAPPED_OPTIMIZER_ATTRIBUTES`. None: not
    known (False). Wrappers are followed ``_depth`` levels deep (an attribute may point back)."""
    if optimizer is None:
        return False
    if any(cls.__name__ in ADAPTIVE_OPTIMIZERS for cls in type(optimizer).__mro__):
        return True
    return _depth > 0 and any(adaptive(getattr(optimizer, name, None), _depth - 1)
                              for name in WRAPPED_OPTIMIZER_ATTRIBUTES)


def wanted(compression: Any, optimizer: Any = None) -> bool:
    """Whether "auto" puts error feedback around ``compression``: it quantizes at most
    :data:`AUTO_MAX_BITS` bits per code, carries no error memory yet, and ``optimizer`` (None:
    not known) is not :func:`adaptive`."""
    if compression.error_memory is not None or adaptive(optimizer):
        return False
    width = code_width(compression)
    return width is not None and width <= AUTO_MAX_BITS


def resolve(compression: Any, error_feedback: Any = "auto", optimizer: Any = None) -> Any:
    """The compression a packed exchange uses for ``compression`` under ``error_feedback``,
    for the local ``optimizer`` (None: not known) that steps on the average (module docstring);
    logs the decision once per compressor when it adds error feedback, and when "auto" leaves
    it out for an adaptive optimizer."""
    setting = check(error_feedback)
    if compression.error_memory is not None or setting is False:
        return compression
    if setting is True and not compression.quantizes:
        raise ValueError(
            f"error_feedback=True needs a quantizer; {type(compression).__name__}() sends "
            "full-precision values, with no quantization error to keep. Pass a quantizer (e.g. "
            "compression=horovod_aq.ALQ(bits=2)) or leave error_feedback='auto'")
    if setting == "auto":
        if not wanted(compression):
            return compression
        if adaptive(optimizer):
            logger.info("%s: error feedback off (error_feedback='auto' and %s, an adaptive "
                        "optimizer, where it costs accuracy: %s); pass error_feedback=True to "
                        "keep it", compression.name, type(optimizer).__name__, ADAPTIVE_DOCS)
            return compression
    return _wrapper(compression, setting)


def _wrapper(compression: Compressor, setting: bool | str) -> ErrorFeedback:
    """The one ErrorFeedback (default coefficients) of ``compression``, made on first use."""
    wrapper = compression.error_feedback_wrapper
    if wrapper is None:
        wrapper = compression.error_feedback_wrapper = ErrorFeedback(compression)
        memory = wrapper.error_memory
        why = (f"error_feedback='auto' and a code width of {code_width(compression):g} bits, "
               f"at most {AUTO_MAX_BITS}" if setting == "auto" else "error_feedback=True")
        logger.info("%s: error feedback on (%s): ErrorFeedback(alpha=%g, beta=%g) keeps each "
                    "rank's quantization error and adds it back (%s); pass error_feedback=False "
                    "to send the plain quantizer", compression.name, why, memory.alpha,
                    memory.beta, DOCS)
    return wrapper


def stock_warning(compression: Any, packed_api: str) -> str | None:
    """What Horovod's stock ``compression=`` path logs once for ``compression`` (None: nothing):
    "auto" would add error feedback there at <= :data:`STOCK_WARNING_MAX_BITS` bits, and that
    path has no place for the memory."""
    if not wanted(compression) or code_width(compression) > STOCK_WARNING_MAX_BITS:
        return None
    return (f"{compression.name} sends codes of {code_width(compression):g} bits on Horovod's "
            f"stock compression= path, which cannot keep error feedback's memory: at <= "
            f"{STOCK_WARNING_MAX_BITS} bits training without it loses accuracy ({DOCS}). Use "
            f"{packed_api} (packed exchange; error_feedback='auto' turns it on), or 3 bits")


__all__ = ["ADAPTIVE_DOCS", "ADAPTIVE_OPTIMIZERS", "AUTO_MAX_BITS", "DOCS", "SETTINGS",
           "STOCK_WARNING_MAX_BITS", "WRAPPED_OPTIMIZER_ATTRIBUTES", "adaptive", "check",
           "code_width", "resolve", "stock_warning", "wanted"]
