"""Adaptive compressors refit on their schedule on every path with no call beyond what a Horovod
or Keras user writes (docs/protocol.md §14).

Every check trains with ``ALQ(schedule="0,2,4,0")`` (refits at the ends of steps 0, 2 and 4) and
no ``refit`` / ``RefitCallback``, and records the table version after every step: if a path
stopped ending its steps, the version would stay at 0 and these tests fail. Paths that end a step
inside it (PyTorch stock hook, packed tape, Keras 3 optimizer) reach v1 after step 0; Horovod's
TensorFlow stock path ends step t when step t+1 begins, so there the versions lag one step. A
second compressor also gets explicit ``refit`` calls after every step: they must not end a step
twice (same versions, same step counter). Each path runs under Gloo and MPI.
"""

from __future__ import annotations

import numpy as np
import pytest

from horovod_aq.tools.launcher import run_local
from tests import launches
from tests.ranks import init_tf, init_torch

pytestmark = pytest.mark.multiprocess

SCHEDULE = "0,2,4,0"
STEPS = 6
#: Table version after each of the STEPS steps when the step ends inside it.
IN_STEP = [1, 1, 2, 2, 3, 3]
#: ... and when step t ends as step t + 1 begins (TensorFlow stock path).
NEXT_STEP = [0, 1, 1, 2, 2, 3]


def _alq(seed=3):
    import horovod_aq

    return horovod_aq.ALQ(bits=3, bucket_size=64, seed=seed, schedule=SCHEDULE)


def _result(comps, versions, extra=None):
    out = {"versions": versions, "steps": [c.step for c in comps],
           "levels": [c.table.levels.tobytes() for c in comps]}
    out.update(extra or {})
    return out


# ---------------------------------------------------------------- PyTorch (in the ranks)
def torch_stock():
    """hvd.DistributedOptimizer(compression=ALQ): the step post-hook ends every step; Horovod's
    broadcast_optimizer_state (a local step with zero gradients) counts no step. The packed
    optimizer ("packed") ends its steps in synchronize()."""
    torch, hvd = init_torch()
    import horovod_aq.torch as aqt
    from tests.ranks import tiny_model

    out = {}
    for mode in ("auto", "explicit", "packed"):
        model = tiny_model(torch, seed=1)
        comp = _alq()
        wrap = aqt.DistributedOptimizer if mode == "packed" else hvd.DistributedOptimizer
        opt = wrap(torch.optim.Adam(model.parameters(), lr=0.01),
                   named_parameters=model.named_parameters(), compression=comp)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        before = comp.step
        recorded_at = []                 # statistics are measured only when a refit needs them
        record = comp.record_stats
        comp.record_stats = lambda *a, _c=comp, **k: (recorded_at.append(_c.step), record(*a, **k))
        gen = torch.Generator().manual_seed(hvd.rank())
        versions = []
        for _ in range(STEPS):
            opt.zero_grad()
            x = torch.randn(16, 20, generator=gen)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            if mode != "auto":
                aqt.refit(comp)
            versions.append(comp.table.version)
        out[mode] = _result([comp], versions, {"step_before": before,
                                               "recorded_at": sorted(set(recorded_at))})
    return out


@pytest.fixture(scope="module", params=launches.params(["gloo", "mpi"], slow=["mpi"]),
                ids=lambda c: f"{c}-2")
def torch_launch(request):
    return run_local([torch_stock], np=2, controller=request.param, timeout=300)


def test_torch_stock_path_refits_by_itself(torch_launch):
    results = torch_launch.get(torch_stock)
    for r in results:
        for mode in ("auto", "explicit", "packed"):
            assert r[mode]["step_before"] == 0, "broadcast_optimizer_state counted a step"
            assert r[mode]["versions"] == IN_STEP, (mode, r[mode]["versions"])
            assert r[mode]["steps"] == [STEPS], (mode, r[mode]["steps"])
            assert r[mode]["recorded_at"] == [0, 2, 4], r[mode]["recorded_at"]
    assert results[0]["auto"]["levels"] == results[1]["auto"]["levels"]


# ---------------------------------------------------------------- TensorFlow (in the ranks)
def _tf_data(tf, hvd, step):
    rng = np.random.default_rng(1000 * step + hvd.rank())
    return (tf.constant(rng.standard_normal((16, 20)).astype(np.float32)),)


def _tf_variables(tf):
    rng = np.random.default_rng(0)
    return [tf.Variable(rng.standard_normal(s).astype(np.float32) * 0.3)
            for s in ((20, 64), (64,), (64, 10))]


def _tf_loss(tf, v, x):
    h = tf.nn.relu(x @ v[0] + v[1])
    return tf.reduce_mean(tf.square(h @ v[2]))


def tf_tapes():
    """Horovod's stock tape and our packed tape in a tf.function train step, no refit calls
    (and, for a second compressor of each, explicit refit calls that must change nothing)."""
    tf, hvd = init_tf()
    import horovod_aq.tensorflow as aqtf

    out = {}
    for path in ("stock", "packed"):
        for mode in ("auto", "explicit"):
            v = _tf_variables(tf)
            comp = _alq()

            @tf.function
            def train_step(x, v=v, comp=comp, path=path):
                with tf.GradientTape() as tape:
                    loss = _tf_loss(tf, v, x)
                if path == "stock":
                    tape = hvd.DistributedGradientTape(tape, compression=comp)
                else:
                    tape = aqtf.DistributedGradientTape(tape, comp)
                grads = tape.gradient(loss, v)
                for var, g in zip(v, grads):
                    var.assign_sub(0.05 * g)
                return loss

            versions = []
            for step in range(STEPS):
                train_step(*_tf_data(tf, hvd, step))
                if mode == "explicit":
                    aqtf.refit(comp)
                versions.append(comp.table.version)
            out[f"{path}-{mode}"] = _result(
                [comp], versions, {"traces": train_step.experimental_get_tracing_count(),
                                   "weights": [x.numpy() for x in v]})
    return out


def keras3_fit():
    """Keras 3 model.fit with horovod_aq.keras.DistributedOptimizer and Horovod's usual
    callbacks (ours for Keras 3), without RefitCallback."""
    tf, hvd = init_tf()
    import keras

    import horovod_aq.keras as aqk

    rng = np.random.default_rng(hvd.rank())
    x = rng.standard_normal((16 * STEPS, 20)).astype(np.float32)
    y = (x[:, :1] * 2.0).astype(np.float32)
    keras.utils.set_random_seed(hvd.rank())
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1)])
    comp = _alq()
    opt = aqk.DistributedOptimizer(keras.optimizers.SGD(0.01), comp)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    versions = []
    seen = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: versions.append(comp.table.version))
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
              callbacks=[aqk.BroadcastGlobalVariablesCallback(0), seen,
                         aqk.MetricAverageCallback()])
    return _result([comp], versions, {"weights": [w.numpy() for w in model.weights]})


@pytest.fixture(scope="module", params=launches.params(["gloo", "mpi"], slow=["mpi"]),
                ids=lambda c: f"{c}-2")
def tf_launch(request):
    return run_local([tf_tapes, keras3_fit], np=2, controller=request.param, timeout=600)


@pytest.mark.parametrize("path,expected", [("stock", NEXT_STEP), ("packed", IN_STEP)])
def test_tf_tapes_refit_by_themselves(tf_launch, path, expected):
    results = tf_launch.get(tf_tapes)
    for r in results:
        for mode, want in (("auto", expected), ("explicit", IN_STEP)):
            got = r[f"{path}-{mode}"]
            assert got["versions"] == want, (path, mode, got["versions"])
            assert got["traces"] == 1, "a refit retraced the train step"
    steps_after = STEPS - 1 if path == "stock" else STEPS   # stock: the last step is still open
    assert results[0][f"{path}-auto"]["steps"] == [steps_after]
    # explicit refit calls end the open step at once: the same tables, a full step count
    assert results[0][f"{path}-explicit"]["steps"] == [STEPS]
    a, b = results[0][f"{path}-auto"], results[1][f"{path}-auto"]
    assert a["levels"] == b["levels"]
    for wa, wb in zip(a["weights"], b["weights"]):
        np.testing.assert_array_equal(wa, wb)


def test_keras3_fit_refits_without_callback(tf_launch):
    results = tf_launch.get(keras3_fit)
    for r in results:
        assert r["versions"] == IN_STEP, r["versions"]
        assert r["steps"] == [STEPS]
    assert results[0]["levels"] == results[1]["levels"]
    for wa, wb in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(wa, wb)
