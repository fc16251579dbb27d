"""Train a small CNN on handwritten digits with quantized gradients (TensorFlow custom loop).

    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow_mnist.py \
        --compression alq --bits 3 --epochs 5 --out runs/tf_alq3

The training step runs inside ``tf.function`` with ``horovod_aq.tensorflow.DistributedGradientTape``
(packed exchange) — or Horovod's own ``hvd.DistributedGradientTape`` with ``--exchange stock``
(fp16 wire). Steps end by themselves (adaptive refits, telemetry): no refit call is needed.
Horovod's tape keys its sources by ``Variable.ref()``, which Keras 3 variables lack: importing
``horovod_aq.tensorflow`` (its ``compat`` module) gives them one, so ``--exchange stock`` trains
this Keras 3 model with Horovod's own tape. Data, flags and reports are those of
``pytorch_mnist.py``.
"""

from __future__ import annotations

import logging
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod_aq.tensorflow as aqtf  # noqa: E402  (before Horovod's init: mpi4py under MPI)
import horovod_aq.tensorflow.compat  # noqa: E402, F401  (Keras 3 variables get ref() for hvd's tape)
from horovod_aq.keras import broadcast_variables  # noqa: E402
from horovod_aq.tools.datasets import load_mnist_5k  # noqa: E402


def make_model() -> keras.Model:
    """The same CNN as pytorch_mnist.py: two 5×5 convolutions with pooling, two dense layers."""
    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 5, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(32, 5, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def init_and_load(args) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Threads, ``hvd.init``, logging (INFO on rank 0) and seeds; then this rank's training
    shard and the whole test set as NHWC images: (rank, size, xs, ys, xt, yt)."""
    try:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    except RuntimeError:   # TensorFlow already started in this process (main() called twice)
        pass
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    logging.basicConfig(level=logging.WARNING if rank else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    keras.utils.set_random_seed(args.seed)
    train, test = load_mnist_5k(seed=args.seed)
    shard = train.shard(rank, size)
    return (rank, size, shard.images[..., None], shard.labels, test.images[..., None],
            test.labels)


def local_gradient(model: keras.Model, loss_fn, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """This rank's gradient on (x, y) from a plain tape (no exchange), flattened in backward
    order — what the level plot draws."""
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=False))
    grads = tape.gradient(loss, model.trainable_variables)
    return np.concatenate([g.numpy().ravel() for g in grads[::-1]])


def main(argv: list[str] | None = None) -> dict:
    args = common.parser(__doc__).parse_args(argv)
    rank, size, xs, ys, xt, yt = init_and_load(args)

    model = make_model()
    broadcast_variables(model.variables, root_rank=0)
    optimizer = keras.optimizers.SGD(learning_rate=args.lr * size, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    compression = common.make_compressor(args)
    telemetry = common.make_telemetry(args, rank, framework="tensorflow")

    def distributed(tape: tf.GradientTape):
        if args.exchange == "stock":
            return hvd.DistributedGradientTape(tape, compression=compression)
        return aqtf.DistributedGradientTape(tape, compression, exchange=args.exchange,
                                            telemetry=telemetry,
                                            error_feedback=common.error_feedback(args))

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = distributed(tape).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    numel = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    steps_per_epoch = len(ys) // args.batch_size
    meter = common.EpochMeter(telemetry, compression, numel=numel, ranks=size)
    rng = np.random.default_rng(args.seed * 1000 + rank)
    history = []
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        order = rng.permutation(len(ys))
        losses = []
        show = rank == 0 and not args.no_progress
        for i in common.progress(range(steps_per_epoch), show, f"epoch {epoch}"):
            idx = order[i * args.batch_size:(i + 1) * args.batch_size]
            losses.append(float(train_step(tf.constant(xs[idx]), tf.constant(ys[idx]))))
        train_loss = float(hvd.allreduce(tf.constant(np.mean(losses)), name="metric.loss"))
        logits = model(xt, training=False)
        test_loss = float(loss_fn(yt, logits))
        test_acc = float(np.mean(np.argmax(logits.numpy(), axis=1) == yt))
        history.append(meter.record(epoch, train_loss, test_loss, test_acc,
                                    time.perf_counter() - t0, steps_per_epoch))
        if rank == 0:
            common.print_epoch(history[-1])

    result = common.summary(args, history, telemetry, compression, size)
    if rank == 0:
        common.finish(args, result, history, compression,
                      gradient=local_gradient(model, loss_fn, xs[:256], ys[:256]))
    telemetry.close()
    return result


if __name__ == "__main__":
    main()
