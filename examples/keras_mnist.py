"""Train a small CNN on handwritten digits with quantized gradients (Keras 3 ``model.fit``).

    horovodrun -np 2 -H localhost:2 --gloo python examples/keras_mnist.py \
        --compression alq --bits 3 --epochs 5 --out runs/keras_alq3

``horovod_aq.keras.DistributedOptimizer`` averages gradients with the packed exchange inside
Keras' compiled train step, where each step also ends (refits when due, telemetry); the
callbacks broadcast rank 0's initial weights and average the epoch metrics over ranks. Data,
flags and reports are those of ``pytorch_mnist.py``. Horovod's own Keras optimizer does not
average under Keras 3 (Keras 3's trainer never calls the hooks it overrides; it needs tf_keras,
``TF_USE_LEGACY_KERAS=1``), so
``--exchange stock`` is not offered here: ``tensorflow_mnist.py --exchange stock`` runs Horovod's
own tape on the same model.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import keras  # noqa: E402
from tensorflow_mnist import init_and_load, local_gradient, make_model  # noqa: E402

import horovod_aq.keras as aqk  # noqa: E402  (before Horovod's init: mpi4py under MPI)


class EpochReport(keras.callbacks.Callback):
    """Test loss/accuracy and the example's per-epoch line after every epoch."""

    def __init__(self, meter: common.EpochMeter, test, steps: int, rank: int) -> None:
        super().__init__()
        self.meter, self.test, self.steps, self.rank = meter, test, steps, rank
        self.history: list[dict] = []

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self.t0 = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None) -> None:
        xt, yt = self.test
        test_loss, test_acc = self.model.evaluate(xt, yt, verbose=0, batch_size=500)
        self.history.append(self.meter.record(epoch + 1, logs["loss"], test_loss, test_acc,
                                              time.perf_counter() - self.t0, self.steps))
        if self.rank == 0:
            common.print_epoch(self.history[-1])


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__)
    args = p.parse_args(argv)
    if args.exchange == "stock":
        p.error("--exchange stock: Horovod's Keras optimizer does not average under Keras 3 "
                "(it needs tf_keras, TF_USE_LEGACY_KERAS=1); use tensorflow_mnist.py --exchange "
                "stock for Horovod's own tape, or --exchange auto here")
    rank, size, xs, ys, xt, yt = init_and_load(args)
    test_data = (xt, yt)

    model = make_model()
    compression = common.make_compressor(args)
    telemetry = common.make_telemetry(args, rank, framework="tensorflow")
    optimizer = aqk.DistributedOptimizer(
        keras.optimizers.SGD(learning_rate=args.lr * size, momentum=0.9), compression,
        exchange=args.exchange, telemetry=telemetry, error_feedback=common.error_feedback(args))
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    steps = -(-len(ys) // args.batch_size)
    numel = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    report = EpochReport(common.EpochMeter(telemetry, compression, numel=numel, ranks=size),
                         test_data, steps, rank)
    model.fit(xs, ys, batch_size=args.batch_size, epochs=args.epochs, shuffle=True, verbose=0,
              callbacks=[aqk.BroadcastGlobalVariablesCallback(0), aqk.MetricAverageCallback(),
                         report])

    result = common.summary(args, report.history, telemetry, compression, size)
    if rank == 0:
        common.finish(args, result, report.history, compression,
                      gradient=local_gradient(model, model.loss, xs[:256], ys[:256]))
    telemetry.close()
    return result


if __name__ == "__main__":
    main()
