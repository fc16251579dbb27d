"""Horovod's own tf_keras path with a horovod_aq compressor (TF_USE_LEGACY_KERAS=1).

``horovod.tensorflow.keras.DistributedOptimizer(opt, compression=horovod_aq.ALQ(bits=3))`` under
tf_keras (Keras 2): Horovod calls ``compress``/``decompress`` in its traced allreduce (fp16 on
the wire), the compressor is a hashable cache key, and the levels are refitted with no callback
(each step ends as the next begins, docs/protocol.md §14). TF_USE_LEGACY_KERAS changes how
TensorFlow imports Keras, so this runs in its own launch.

Horovod's local gradient aggregation with an infinite gradient (the pattern of Horovod's own
``test_grad_aggregation_with_inf_grad``) must behave as with ``hvd.Compression.fp16`` when the
compressor has ``nonfinite="skip"`` (the non-finite values pass through), and with the default
``nonfinite="raise"`` every rank must raise the same error after the allreduce — also when only
one rank's gradient is non-finite.
"""

from __future__ import annotations

import numpy as np
import pytest

from horovod_aq.tools.launcher import run_local
from tests import launches
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
    model.fit(x, shard.labels, batch_size=40, epochs=3, verbose=0,
              callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
    ended = comp.step          # the last step is still open: it ends as a next step begins
    aqtf.refit(comp)           # ... or with an explicit call
    logits = model(xt, training=False)
    return {"keras": keras.__name__,
            "loss": float(loss_fn(yt, logits)), "acc": float(np.mean(np.argmax(logits, 1) == yt)),
            "chance_loss": float(np.log(10.0)), "table_version": comp.table.version,
            "ended": ended, "steps": comp.step, "weights": [w.numpy() for w in model.weights]}


def stock_inf_aggregation():
    """backward_passes_per_step=2, sparse_as_dense=True, an infinite gradient in the first
    aggregation cycle (on every rank), with fp16, ALQ nonfinite="skip" and ALQ "raise"."""
    tf, hvd = init_tf()
    import horovod_aq

    out = {}
    for label in ("fp16", "alq_skip", "alq_raise"):
        comp = {"fp16": hvd.Compression.fp16,
                "alq_skip": horovod_aq.ALQ(bits=3, bucket_size=64, nonfinite="skip"),
                "alq_raise": horovod_aq.ALQ(bits=3, bucket_size=64)}[label]
        calls = tf.Variable(0, trainable=False, dtype=tf.int32)
        opt = hvd.DistributedOptimizer(tf.keras.optimizers.legacy.SGD(),
                                       backward_passes_per_step=2, sparse_as_dense=True,
                                       compression=comp)
        x = tf.Variable(0.0)

        def loss(calls=calls, x=x):
            calls.assign_add(1)
            return tf.cond(calls > 1, lambda: x, lambda: x * float("inf"))

        try:
            for _ in range(4):
                grads_and_vars = opt._compute_gradients(loss=loss, var_list=[x])
                opt.apply_gradients(grads_and_vars)
            out[label] = {"last_grad_finite": bool(tf.math.is_finite(grads_and_vars[0][0])),
                          "x": float(x.numpy())}
        except Exception as exc:  # noqa: BLE001
            out[label] = f"{type(exc).__name__}: {exc}"
    return out


def stock_raise_one_rank():
    """nonfinite="raise" with an infinite gradient on rank 1 only (Horovod's tape): both ranks
    raise the same error after the allreduce instead of rank 1 alone before it."""
    tf, hvd = init_tf()
    import horovod_aq

    comp = horovod_aq.ALQ(bits=3, bucket_size=64)
    w = tf.Variable(np.ones(100, np.float32))
    scale = float("inf") if hvd.rank() == 1 else 1.0

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w) * scale
        tape = hvd.DistributedGradientTape(tape, compression=comp)
        return tape.gradient(loss, [w])

    try:
        step()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.fixture(scope="module", params=launches.params(["gloo", "mpi"], slow=["mpi"]),
                ids=lambda c: f"{c}-2")
def launch(request):
    return run_local([stock_fit, stock_inf_aggregation, stock_raise_one_rank], np=2,
                     controller=request.param, timeout=300, env=LEGACY_ENV)


def test_tf_keras_stock_path_trains(launch):
    results = launch.get(stock_fit)
    r = results[0]
    assert r["keras"].startswith("tf_keras"), r["keras"]    # really Keras 2 (tf_keras)
    assert r["ended"] == 149 and r["steps"] == 150           # no callback: steps end by themselves
    assert r["table_version"] == 2                           # refitted at steps 0 and 100
    assert r["acc"] > 0.85 and r["loss"] < 0.25 * r["chance_loss"], r
    for a, b in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(a, b)                   # the fp16 average is identical


def test_inf_gradient_with_aggregation_passes_through_like_fp16(launch):
    for r in launch.get(stock_inf_aggregation):
        assert r["fp16"] == {"last_grad_finite": True, "x": float("-inf")}, r["fp16"]
        assert r["alq_skip"] == r["fp16"], r["alq_skip"]           # non-finite passes through
        assert r["alq_raise"].startswith("InvalidArgumentError"), r["alq_raise"]
        assert "the allreduced gradient of shape () is not finite" in r["alq_raise"]


def test_nonfinite_raise_stops_every_rank_together(launch):
    messages = launch.get(stock_raise_one_rank)
    for m in messages:
        assert m.startswith("InvalidArgumentError") and "is not finite" in m, m[:500]
        assert "Set the compressor's nonfinite option to skip" in m.replace("\\'", "'")
