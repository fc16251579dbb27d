"""horovod_aq: adaptive gradient quantization for Horovod.

Compressors (one object for PyTorch and TensorFlow, usable as Horovod's ``compression=``):
``NoCompression``, ``FP16``, ``QSGD``, ``QSGDInf``, ``NUQSGD``, ``TernGrad``,
``NaturalDithering``, ``ALQ``, ``ALQN``, ``ALQG``, ``AMQ``, ``AMQN``.
Packed exchange: ``horovod_aq.torch.DistributedOptimizer``,
``horovod_aq.tensorflow.DistributedGradientTape``, ``horovod_aq.keras.DistributedOptimizer``.
"""

from horovod_aq.compressors import (
    ALQ,
    ALQG,
    ALQN,
    AMQ,
    AMQN,
    DQSGD,
    FP16,
    METHODS,
    NUQSGD,
    QSGD,
    Compressor,
    NaturalDithering,
    NoCompression,
    QSGDInf,
    TernGrad,
    from_name,
)
from horovod_aq.error_feedback import ECQ, ErrorFeedback
from horovod_aq.schedule import RefitSchedule
from horovod_aq.telemetry import JsonlSink, StepRecord, Telemetry, TensorBoardSink

__version__ = "0.1.0"

__all__ = [
    "ALQ", "ALQG", "ALQN", "AMQ", "AMQN", "FP16", "NUQSGD", "QSGD", "QSGDInf", "TernGrad",
    "NaturalDithering", "NoCompression", "Compressor", "METHODS", "from_name", "RefitSchedule",
    "Telemetry", "StepRecord", "JsonlSink", "TensorBoardSink", "__version__",
    "DQSGD", "ErrorFeedback", "ECQ",
]
