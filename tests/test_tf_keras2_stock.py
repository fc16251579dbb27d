"""Horovod's own tf_keras path with a horovod_aq compressor (TF_USE_LEGACY_KERAS=1).

``horovod.tensorflow.keras.DistributedOptimizer(opt, compression=horovod_aq.ALQ(bits=3))`` under
tf_keras (Keras 2): Horovod calls ``compress``/``decompress`` in its traced allreduce (fp16 on
the wire), the compressor is a hashable cache key, and ``horovod_aq.tensorflow.refit`` keeps the
levels fitted from a LambdaCallback. TF_USE_LEGACY_KERAS changes how TensorFlow imports Keras, so
this runs in its own launch.
"""

from __future__ import annotations

import numpy as np
import pytest

from horovod_aq.tools.launcher import run_local
from tests.ranks import init_tf

pytestmark = pytest.mark.multiprocess

LEGACY_ENV = {"TF_USE_LEGACY_KERAS": "1"}


def stock_fit():
    """tf_keras model.fit with Horovod's DistributedOptimizer and compression=ALQ(bits=3)."""
    tf, hvd = init_tf()
    import horovod.tensorflow.keras as hvdk

    import horovod_aq
    import horovod_aq.tensorflow as aqtf
    from horovod_aq.tools.datasets import load_mnist_5k

    keras = tf.keras
    train, test = load_mnist_5k(seed=0)
    shard = train.shard(hvd.rank(), hvd.size())
    x = shard.images.reshape(len(shard.labels), -1)
    xt, yt = test.images.reshape(len(test.labels), -1), test.labels
    keras.utils.set_random_seed(hvd.rank())  # different initial weights: the broadcast fixes it
    model = keras.Sequential([keras.layers.Dense(128, activation="relu", input_shape=(784,)),
                              keras.layers.Dense(10)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    comp = horovod_aq.ALQ(bits=3, seed=3, bucket_size=1024)
    opt = hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), compression=comp)
    model.compile(optimizer=opt, loss=loss_fn)
    refits = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: aqtf.refit(comp))
    model.fit(x, shard.labels, batch_size=40, epochs=3, verbose=0,
              callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0), refits])
    logits = model(xt, training=False)
    return {"keras": keras.__name__,
            "loss": float(loss_fn(yt, logits)), "acc": float(np.mean(np.argmax(logits, 1) == yt)),
            "chance_loss": float(np.log(10.0)), "table_version": comp.table.version,
            "steps": comp.step, "weights": [w.numpy() for w in model.weights]}


@pytest.fixture(scope="module", params=["gloo", "mpi"], ids=lambda c: f"{c}-2")
def launch(request):
    return run_local([stock_fit], np=2, controller=request.param, timeout=300, env=LEGACY_ENV)


def test_tf_keras_stock_path_trains(launch):
    results = launch.get(stock_fit)
    r = results[0]
    assert r["keras"].startswith("tf_keras"), r["keras"]    # really Keras 2 (tf_keras)
    assert r["steps"] == 150 and r["table_version"] == 2     # refitted at steps 0 and 100
    assert r["acc"] > 0.85 and r["loss"] < 0.25 * r["chance_loss"], r
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(a, b)                   # the fp16 average is identical
