"""horovod_aq for Keras 3 ``model.fit`` (TensorFlow backend).

``DistributedOptimizer(optimizer, compression)`` averages gradients with the packed quantized
exchange; ``BroadcastGlobalVariablesCallback``, ``MetricAverageCallback`` and ``RefitCallback``
are the callbacks a distributed ``fit`` needs. See :mod:`horovod_aq.tensorflow.keras`.
"""

from horovod_aq._requirements import require

require("keras", "tensorflow")
require("tensorflow", "tensorflow")
import horovod_aq.tensorflow  # noqa: E402, F401  (mpi4py before Horovod under MPI)

require("horovod.tensorflow", "tensorflow")

from horovod_aq.tensorflow.keras import (  # noqa: E402
    BroadcastGlobalVariablesCallback,
    DistributedOptimizer,
    MetricAverageCallback,
    RefitCallback,
    broadcast_variables,
)

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "DistributedOptimizer",
    "MetricAverageCallback",
    "RefitCallback",
    "broadcast_variables",
]
