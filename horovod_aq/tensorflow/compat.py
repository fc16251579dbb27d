"""Two small Keras 3 adaptations, installed when horovod_aq's TensorFlow integration is imported.

Importing this module (or ``horovod_aq.tensorflow.tape``, ``horovod_aq.tensorflow.stock``,
``horovod_aq.keras``, which import it) calls :func:`install` once. Both changes are additions
that nothing in Keras or TensorFlow looks for, and both leave every other object alone.

1. **``Variable.ref()`` for Keras 3 variables.** Horovod 0.28.1's
   ``hvd.DistributedGradientTape.gradient`` keys its sources by ``source.ref()``, a
   ``tf.Variable`` method that Keras 3 variables (``keras.Variable``, what ``model.
   trainable_variables`` holds under Keras 3) lack, so Horovod's own tape failed with
   ``AttributeError: 'Variable' object has no attribute 'ref'`` for every Keras 3 model (also
   with Horovod's own compressions). :func:`install` gives the Keras 3 TensorFlow-backend variable
   class a ``ref()`` returning the same kind of hashable reference (``object_identity.Reference``
   to the Keras variable itself, so ``.deref()`` gives it back). Nothing else changes: Horovod's
   Keras 2 optimizer and callbacks still do not work under Keras 3 (their hooks are never
   called, ``optimizer.variables()`` is not callable); ``horovod_aq.keras`` replaces them.
2. **A collective overflow decision for ``LossScaleOptimizer``.** Under
   ``keras.mixed_precision.set_global_policy("mixed_float16")`` Keras' ``compile`` wraps the
   optimizer in ``keras.optimizers.LossScaleOptimizer``, whose ``apply`` checks the *local*
   gradients and calls the inner optimizer only if they are finite — so when fp16 overflowed on
   one rank, that rank skipped the exchange inside ``horovod_aq.keras.DistributedOptimizer`` and
   the ranks fell out of step. :func:`install` wraps ``LossScaleOptimizer.apply``: when the inner
   optimizer is a horovod_aq distributed optimizer, the exchange runs first, on every rank, with
   non-finite markers (``nonfinite="skip"`` semantics, docs/protocol.md §4), and the loss-scale
   logic then decides on the *averaged* gradients, which are identical on every rank: every rank
   skips together and keeps one loss scale. Any other inner optimizer takes the original path.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_installed: dict[str, bool] = {}


def _keras3() -> Any:
    """The Keras 3 package when it is installed with the TensorFlow backend, else None."""
    try:
        if importlib.util.find_spec("keras") is None:
            return None
        import keras
    except ImportError:
        return None

    if not str(getattr(keras, "__version__", "0")).startswith("3"):
        return None
    if keras.backend.backend() != "tensorflow":
        return None
    return keras


def _variable_ref(self: Any) -> Any:
    """A hashable reference to this Keras variable, like ``tf.Variable.ref()`` (added by
    :mod:`horovod_aq.tensorflow.compat` for Horovod's tape, which keys sources by it)."""
    from tensorflow.python.util import object_identity

    return object_identity.Reference(self)


def install_variable_ref() -> bool:
    """Give Keras 3's TensorFlow ``Variable`` a ``ref()`` method (module docstring, 1).
    Returns whether the class has one now."""
    keras = _keras3()
    if keras is None:
        return False
    from keras.src.backend.tensorflow.core import Variable

    if not hasattr(Variable, "ref"):
        Variable.ref = _variable_ref
        logger.debug("horovod_aq: Keras 3 variables now have ref() (for Horovod's tape)")
    return True


def install_loss_scale_hook() -> bool:
    """Route ``LossScaleOptimizer.apply`` to the inner horovod_aq optimizer's collective version
    when there is one (module docstring, 2). Returns whether the hook is in place."""
    keras = _keras3()
    if keras is None:
        return False
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    current = LossScaleOptimizer.apply
    if getattr(current, "_horovod_aq_hook", False):
        return True
    original = current

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        inner = getattr(self, "inner_optimizer", None)
        collective = getattr(inner, "_aq_loss_scale_apply", None)
        if collective is None:
            return original(self, grads, trainable_variables)
        return collective(self, grads, trainable_variables)

    apply._horovod_aq_hook = True  # type: ignore[attr-defined]
    apply.__doc__ = original.__doc__
    apply.__wrapped__ = original  # type: ignore[attr-defined]
    LossScaleOptimizer.apply = apply
    return True


def install() -> None:
    """Install both adaptations once per process (idempotent, thread-safe)."""
    with _lock:
        if _installed.get("done"):
            return
        _installed["ref"] = install_variable_ref()
        _installed["loss_scale"] = install_loss_scale_hook()
        _installed["done"] = True


install()
