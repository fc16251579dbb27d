"""horovod_aq for Keras 3 ``model.fit`` (TensorFlow backend).

``DistributedOptimizer(optimizer, compression)`` averages gradients with the packed quantized
exchange (``PartialDistributedOptimizer`` keeps some variables local);
``BroadcastGlobalVariablesCallback``, ``MetricAverageCallback``, ``LearningRateWarmupCallback``
and ``LearningRateScheduleCallback`` are the Keras 3 versions of Horovod's callbacks
(``RefitCallback`` only reports: refits need no callback); ``load_model`` restores a saved model
with a distributed optimizer. See :mod:`horovod_aq.tensorflow.keras`.
"""

from horovod_aq._requirements import require

require("keras", "tensorflow")
require("tensorflow", "tensorflow")
import horovod_aq.tensorflow  # noqa: E402, F401  (mpi4py before Horovod under MPI)

require("horovod.tensorflow", "tensorflow")

from horovod_aq.tensorflow.keras import (  # noqa: E402
    BroadcastGlobalVariablesCallback,
    DistributedOptimizer,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
    PartialDistributedOptimizer,
    RefitCallback,
    broadcast_variables,
    load_model,
)

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "DistributedOptimizer",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "PartialDistributedOptimizer",
    "RefitCallback",
    "broadcast_variables",
    "load_model",
]
