"""TensorFlow integration: the packed-exchange ``DistributedGradientTape`` and ``refit``.

``horovod_aq.tensorflow.DistributedGradientTape(tape, compression=horovod_aq.ALQ(bits=3))``
sends bit-packed codes (eager or inside ``tf.function``, Keras 3 or ``tf.Variable`` sources);
``horovod_aq.keras.DistributedOptimizer`` does the same for Keras 3 ``model.fit``. With
Horovod's own ``hvd.DistributedGradientTape(tape, compression=horovod_aq.ALQ(bits=3))`` (or
tf_keras' ``horovod.tensorflow.keras.DistributedOptimizer``) the gradients are quantized and sent
as fp16. Either way adaptive levels are refitted on schedule with no extra call: steps end by
themselves (docs/protocol.md §14); :func:`refit` is the explicit, optional form.

``horovod_aq.tensorflow.kernels`` needs only TensorFlow; the integration needs Horovod, imported
here so that, under an MPI launcher, mpi4py can initialize MPI before Horovod (see
:mod:`horovod_aq.mpi`). A missing Horovod is reported when the integration is used.
"""

from horovod_aq._requirements import import_horovod, lazy_attributes, require

require("tensorflow", "tensorflow")
_hvd = import_horovod("horovod.tensorflow")
from horovod_aq.tensorflow import compat as _compat  # noqa: E402, F401  (Keras 3 ref() for Horovod)

_LAZY = {
    "DistributedGradientTape": "horovod_aq.tensorflow.tape",
    "PartialDistributedGradientTape": "horovod_aq.tensorflow.tape",
    "DEFAULT_FUSION_BYTES": "horovod_aq.packed.plan",
    "PackedExchange": "horovod_aq.tensorflow.packed",
    "exchange_for": "horovod_aq.tensorflow.packed",
    "ConfigMismatchError": "horovod_aq.packed.protocol",
    "PayloadError": "horovod_aq.codec",
    "refit": "horovod_aq.tensorflow.step",
    "HorovodComm": "horovod_aq.tensorflow.comm",
    "comm_for": "horovod_aq.tensorflow.comm",
    "tf_state": "horovod_aq.tensorflow.state",
    "state_dict": "horovod_aq.tensorflow.checkpoint",
    "load_state_dict": "horovod_aq.tensorflow.checkpoint",
}
_WITHOUT_HOROVOD = {"ConfigMismatchError", "PayloadError", "tf_state"}
__getattr__ = lazy_attributes(__name__, _LAZY, "horovod.tensorflow",
                              horovod_present=_hvd is not None,
                              without_horovod=frozenset(_WITHOUT_HOROVOD))

__all__ = ["DEFAULT_FUSION_BYTES", "ConfigMismatchError", "DistributedGradientTape", "HorovodComm",
           "PartialDistributedGradientTape",
           "PackedExchange", "PayloadError", "comm_for", "exchange_for",
           "load_state_dict", "refit", "state_dict", "tf_state"]
