"""The TensorFlow / Keras 3 snippets the documentation shows, run as written on 2 real ranks.

``SNIPPETS`` holds the README's TensorFlow snippets and docs/keras.md's (the text there must be
exactly these strings; ``python -m tests.test_tf_dropin`` prints them as Markdown). Each runs
with ``exec`` after ``SETUP`` (a small Keras 3 model with different initial weights on every rank,
random data), and the check asserts what the snippet promises: identical weights on every rank
after training, steps counted, refits done.

Also here, on Horovod's own paths under Keras 3:

* ``hvd.DistributedGradientTape(tape, compression=comp)`` with Keras 3 variables (Horovod keys
  sources by ``Variable.ref()``, which ``horovod_aq.tensorflow.compat`` adds) — this check runs
  first in the launch, before anything imports horovod_aq's TensorFlow modules, so it also shows
  that Keras 3 variables lack ``ref()`` until then;
* ``sparse_as_dense=True`` on the stock path, eager (the densified embedding gradient enters
  Horovod's ``tf.function`` with an unknown row count) and in ``tf.function``;
* what does not work under Keras 3: Horovod's own Keras optimizer does not average;
* ``examples/tensorflow_mnist.py --exchange stock``;
* a Horovod-style Keras script (Horovod's ``tensorflow2_keras_mnist.py`` pattern) with
  horovod_aq.keras: warmup, broadcast and metric-average callbacks, a checkpoint.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from horovod_aq.tools.launcher import run_local
from tests import launches
from tests.ranks import init_tf

pytestmark = pytest.mark.multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: What every snippet may use (the README states it in words).
SETUP = '''\
import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

hvd.init()
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10)])
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = keras.optimizers.SGD(0.1)
rng = np.random.default_rng(hvd.rank())
x = rng.standard_normal((256, 64)).astype(np.float32)
y = rng.integers(0, 10, 256)
data = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 256, 32)]
'''

SNIPPETS = {
    # README: the packed exchange in a custom training loop
    "tape": '''\
import horovod_aq, horovod_aq.tensorflow as aqtf, horovod_aq.keras as aqk

comp = horovod_aq.ALQ(bits=3)
aqk.broadcast_variables(model.variables, root_rank=0)   # same initial weights everywhere

@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = aqtf.DistributedGradientTape(tape, comp)           # packed exchange
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

for xb, yb in data:
    train_step(xb, yb)      # steps end inside: refits when due, no retracing
''',
    # README: Keras 3 model.fit
    "fit": '''\
import horovod_aq, horovod_aq.keras as aqk

opt = aqk.DistributedOptimizer(keras.optimizers.SGD(0.1), horovod_aq.ALQ(bits=3))
model.compile(optimizer=opt, loss=loss_fn, jit_compile=False)
model.fit(x, y, batch_size=32, callbacks=[aqk.BroadcastGlobalVariablesCallback(0),
                                          aqk.MetricAverageCallback()])
''',
    # README: Horovod's own tape with a horovod_aq compressor (stock path, fp16 wire)
    "stock": '''\
import horovod_aq
import horovod_aq.tensorflow.compat   # Keras 3 variables get the ref() Horovod's tape uses

comp = horovod_aq.ALQ(bits=3)
for v in model.variables:             # same initial weights everywhere
    v.assign(hvd.broadcast(v, root_rank=0, name=v.path))

@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = hvd.DistributedGradientTape(tape, compression=comp)   # quantized, sent as fp16
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

for xb, yb in data:
    train_step(xb, yb)      # each step ends as the next begins
''',
    # docs/keras.md: mixed precision
    "mixed_precision": '''\
import horovod_aq, horovod_aq.keras as aqk

keras.mixed_precision.set_global_policy("mixed_float16")
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10),
                          keras.layers.Activation("linear", dtype="float32")])
opt = aqk.DistributedOptimizer(keras.optimizers.SGD(0.1), horovod_aq.ALQ(bits=3))
model.compile(optimizer=opt, loss=loss_fn, jit_compile=False)  # wraps opt: LossScaleOptimizer
model.fit(x, y, batch_size=32, callbacks=[aqk.BroadcastGlobalVariablesCallback(0)])
keras.mixed_precision.set_global_policy("float32")
''',
    # docs/keras.md: local gradient aggregation and warmup
    "aggregation": '''\
import horovod_aq, horovod_aq.keras as aqk

opt = aqk.DistributedOptimizer(keras.optimizers.SGD(0.1 * hvd.size(), momentum=0.9),
                               horovod_aq.ALQ(bits=3), backward_passes_per_step=2,
                               average_aggregated_gradients=True)
model.compile(optimizer=opt, loss=loss_fn, jit_compile=False)
model.fit(x, y, batch_size=16, epochs=2, callbacks=[
    aqk.BroadcastGlobalVariablesCallback(0),
    aqk.LearningRateWarmupCallback(initial_lr=0.1 * hvd.size(), warmup_epochs=1),
])                          # 16 micro-batches per epoch: 8 exchanges and updates
''',
}

#: docs/keras.md: Horovod's tensorflow2_keras_mnist.py pattern on horovod_aq.keras. In the
#: test the download line is replaced by the bundled 5k digits (no network in the ranks).
HOROVOD_STYLE = '''\
import horovod.tensorflow as hvd        # init / rank / size, as before
import horovod_aq
import horovod_aq.keras as hvdk         # was: import horovod.tensorflow.keras as hvd
import keras
import tensorflow as tf

hvd.init()
(images, labels), _ = keras.datasets.mnist.load_data(path=f"mnist-{hvd.rank()}.npz")
dataset = tf.data.Dataset.from_tensor_slices(
    (tf.cast(images[..., None] / 255.0, tf.float32), tf.cast(labels, tf.int64)))
dataset = dataset.repeat().shuffle(10000).batch(64)

model = keras.Sequential([keras.Input((28, 28, 1)),
                          keras.layers.Conv2D(16, 3, activation="relu"),
                          keras.layers.MaxPooling2D(2),
                          keras.layers.Flatten(),
                          keras.layers.Dense(10, activation="softmax")])
scaled_lr = 0.002 * hvd.size()
opt = hvdk.DistributedOptimizer(keras.optimizers.Adam(scaled_lr), horovod_aq.ALQ(bits=3),
                                backward_passes_per_step=1, average_aggregated_gradients=True)
model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=opt,
              metrics=["accuracy"], jit_compile=False)    # no experimental_run_tf_function
callbacks = [hvdk.BroadcastGlobalVariablesCallback(0), hvdk.MetricAverageCallback(),
             hvdk.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=1)]
if hvd.rank() == 0:
    callbacks.append(keras.callbacks.ModelCheckpoint("checkpoint-{epoch}.keras"))
history = model.fit(dataset, steps_per_epoch=100 // hvd.size(), callbacks=callbacks, epochs=3,
                    verbose=1 if hvd.rank() == 0 else 0)
'''
DOWNLOAD_LINE = ('(images, labels), _ = keras.datasets.mnist.load_data('
                 'path=f"mnist-{hvd.rank()}.npz")')


# ---------------------------------------------------------------- helpers (inside the ranks)
def _run_snippet(name: str, extra: dict | None = None) -> dict:
    """exec SETUP + SNIPPETS[name] in a fresh namespace; return the namespace."""
    init_tf()
    namespace: dict = dict(extra or {})
    exec(compile(SETUP, "<setup>", "exec"), namespace)
    exec(compile(SNIPPETS[name], f"<snippet {name}>", "exec"), namespace)
    return namespace


def _weights(model) -> list:
    return [w.numpy() for w in model.weights]


# ---------------------------------------------------------------- checks (inside the ranks)
def snippet_stock():
    """Runs first: Keras 3 variables have no ref() before horovod_aq's TensorFlow modules are
    imported; the README's stock-path snippet then trains with Horovod's own tape."""
    import sys

    from keras.src.backend.tensorflow.core import Variable

    before = {"ref": hasattr(Variable, "ref"),
              "imported": sorted(m for m in sys.modules if m.startswith("horovod_aq.tensorflow"))}
    ns = _run_snippet("stock")
    comp = ns["comp"]
    import horovod_aq.tensorflow as aqtf

    ended = comp.step
    aqtf.refit(comp)     # the last step is still open on this path
    return {"before": before, "weights": _weights(ns["model"]), "ended": ended,
            "steps": comp.step, "version": comp.table.version}


def snippet_tape():
    ns = _run_snippet("tape")
    comp = ns["comp"]
    return {"weights": _weights(ns["model"]), "steps": comp.step, "version": comp.table.version,
            "traces": ns["train_step"].experimental_get_tracing_count()}


def snippet_fit():
    ns = _run_snippet("fit")
    opt = ns["opt"]
    return {"weights": _weights(ns["model"]), "steps": opt.compression.step,
            "version": opt.compression.table.version}


def snippet_mixed_precision():
    ns = _run_snippet("mixed_precision")
    model = ns["model"]
    return {"weights": _weights(model), "wrapper": type(model.optimizer).__name__,
            "scale": float(model.optimizer.dynamic_scale.numpy()),
            "steps": ns["opt"].compression.step}


def snippet_aggregation():
    ns = _run_snippet("aggregation")
    opt = ns["opt"]
    return {"weights": _weights(ns["model"]), "steps": opt.compression.step,
            "iterations": int(opt.iterations.numpy()),
            "lr": float(np.asarray(opt.learning_rate))}


def horovod_keras_optimizer_under_keras3():
    """What does not work: Horovod's Keras optimizer under Keras 3 builds, trains, and leaves the
    ranks apart (Keras 3 never calls the hooks it overrides)."""
    tf, hvd = init_tf()
    import horovod.tensorflow.keras as hvdk
    import keras

    import horovod_aq.keras as aqk

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    aqk.broadcast_variables(model.variables)
    model.compile(optimizer=hvdk.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  jit_compile=False)
    rng = np.random.default_rng(hvd.rank())
    model.fit(rng.standard_normal((8, 4)), rng.standard_normal((8, 3)), batch_size=8, verbose=0)
    return _weights(model)


def stock_sparse_as_dense():
    """Horovod's tape with sparse_as_dense=True and an ALQ compressor on a Keras 3 text model,
    eager and in tf.function; refits at steps 0 and 1 on the eager run (statistics of the
    dynamically shaped embedding gradient included)."""
    tf, hvd = init_tf()
    import keras

    import horovod_aq
    import horovod_aq.keras as aqk
    import horovod_aq.tensorflow as aqtf

    rng = np.random.default_rng(hvd.rank())
    tokens = rng.integers(0, 100, (16, 8)).astype(np.int32)
    labels = rng.integers(0, 2, 16)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out = {}
    for mode in ("eager", "function"):
        keras.utils.set_random_seed(2 + hvd.rank())
        model = keras.Sequential([keras.Input((8,), dtype="int32"),
                                  keras.layers.Embedding(100, 16),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
        aqk.broadcast_variables(model.variables)
        sgd = keras.optimizers.SGD(0.5)
        comp = horovod_aq.ALQ(bits=3, bucket_size=64, seed=4, schedule="0,1,0")

        def step(xb, yb, model=model, comp=comp, sgd=sgd):   # Python objects, not tf inputs
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            tape = hvd.DistributedGradientTape(tape, compression=comp, sparse_as_dense=True)
            grads = tape.gradient(loss, model.trainable_variables)
            sgd.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        fn = step if mode == "eager" else tf.function(step)
        losses = [float(fn(tf.constant(tokens), tf.constant(labels))) for _ in range(3)]
        aqtf.refit(comp)
        out[mode] = {"weights": _weights(model), "losses": losses, "steps": comp.step,
                     "version": comp.table.version}
    return out


def example_tensorflow_mnist_stock():
    """examples/tensorflow_mnist.py --exchange stock: Horovod's own tape on the Keras 3 CNN."""
    import importlib.util
    import sys
    import tempfile

    init_tf()
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    spec = importlib.util.spec_from_file_location(
        "tensorflow_mnist", os.path.join(ROOT, "examples", "tensorflow_mnist.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with tempfile.TemporaryDirectory(prefix="aq_tf_stock_") as out:
        return example.main(["--compression", "qsgdinf", "--bits", "4", "--exchange", "stock",
                             "--epochs", "1", "--out", out, "--no-progress"])


def horovod_style_script():
    """docs/keras.md's Horovod-style script, with the bundled digits for the download."""
    import tempfile

    init_tf()
    from horovod_aq.tools.datasets import load_mnist_5k

    train, test = load_mnist_5k(seed=0)
    import horovod.tensorflow as hvd

    shard = train.shard(hvd.rank(), hvd.size())
    images = np.round(shard.images * 255.0).astype(np.uint8)      # [N, 28, 28] like MNIST's
    namespace = {"_local": ((images, shard.labels), None)}
    assert DOWNLOAD_LINE in HOROVOD_STYLE
    script = HOROVOD_STYLE.replace(DOWNLOAD_LINE, "(images, labels), _ = _local")
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix=f"aq_hvd_style_{hvd.rank()}_") as workdir:
        os.chdir(workdir)
        try:
            exec(compile(script, "<horovod-style script>", "exec"), namespace)
        finally:
            os.chdir(here)
        checkpoints = sorted(os.listdir(workdir))
    model = namespace["model"]
    xt = test.images[..., None]
    acc = float(np.mean(np.argmax(model(xt, training=False).numpy(), 1) == test.labels))
    hist = namespace["history"].history
    return {"weights": _weights(model), "acc": acc, "lr": hist["lr"], "loss": hist["loss"],
            "checkpoints": checkpoints,
            "steps": namespace["opt"].compression.step}


CHECKS = {"gloo": [snippet_stock, snippet_tape, snippet_fit, snippet_mixed_precision,
                   snippet_aggregation, horovod_keras_optimizer_under_keras3,
                   stock_sparse_as_dense, example_tensorflow_mnist_stock, horovod_style_script],
          "mpi": [snippet_stock, snippet_tape, snippet_mixed_precision]}


#: controller -> the checks its launch runs (tests/launches.py)
LAUNCHES = {"launch": CHECKS}


@pytest.fixture(scope="module", params=launches.params(CHECKS, slow=["mpi"]),
                ids=lambda c: f"{c}-2")
def launch(request):
    return run_local(CHECKS[request.param], np=2, controller=request.param, timeout=600)


def _get(launch, check):
    return launch.get(launches.read(check))


def _same(a, b):
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


# ---------------------------------------------------------------- tests
def test_stock_snippet_with_keras3_variables(launch):
    r0, r1 = _get(launch, snippet_stock)
    assert r0["before"] == {"ref": False, "imported": []}   # Keras 3 lacks ref() without us
    _same(r0["weights"], r1["weights"])                       # fp16 averages are identical
    assert r0["ended"] == 7 and r0["steps"] == 8              # 8 steps; the last ends on refit
    assert r0["version"] == 1                                 # ALQ's first refit, at step 0


def test_tape_snippet(launch):
    r0, r1 = _get(launch, snippet_tape)
    _same(r0["weights"], r1["weights"])
    assert r0["steps"] == 8 and r0["version"] == 1 and r0["traces"] == 1


@pytest.mark.reads("snippet_fit")
def test_fit_snippet(launch):
    r0, r1 = _get(launch, snippet_fit)
    _same(r0["weights"], r1["weights"])
    assert r0["steps"] == 8 and r0["version"] == 1


def test_mixed_precision_snippet(launch):
    r0, r1 = _get(launch, snippet_mixed_precision)
    _same(r0["weights"], r1["weights"])
    assert r0["wrapper"] == "LossScaleOptimizer" and r0["scale"] == r1["scale"]
    assert r0["steps"] == 8


@pytest.mark.reads("snippet_aggregation")
def test_aggregation_snippet(launch):
    r0, r1 = _get(launch, snippet_aggregation)
    _same(r0["weights"], r1["weights"])
    assert r0["iterations"] == 32 and r0["steps"] == 16       # 2 epochs × 8 exchanges
    assert r0["lr"] == pytest.approx(0.2)                     # warmup reached initial_lr


@pytest.mark.reads("horovod_keras_optimizer_under_keras3")
def test_horovods_keras_optimizer_does_not_average_under_keras3(launch):
    r0, r1 = _get(launch, horovod_keras_optimizer_under_keras3)
    assert any(not np.array_equal(a, b) for a, b in zip(r0, r1))


@pytest.mark.reads("stock_sparse_as_dense")
def test_stock_sparse_as_dense(launch):
    r0, r1 = _get(launch, stock_sparse_as_dense)
    for mode in ("eager", "function"):
        _same(r0[mode]["weights"], r1[mode]["weights"])
        assert all(np.isfinite(r0[mode]["losses"]))
        assert r0[mode]["steps"] == 3 and r0[mode]["version"] == 2, r0[mode]


@pytest.mark.reads("example_tensorflow_mnist_stock")
def test_tensorflow_mnist_example_stock_path(launch):
    r0, _ = _get(launch, example_tensorflow_mnist_stock)
    assert r0["exchange"] == "stock" and r0["test_acc"] > 0.3
    assert r0["bits_per_coordinate"] == 16.0


@pytest.mark.reads("horovod_style_script")
def test_horovod_style_script(launch):
    r0, r1 = _get(launch, horovod_style_script)
    _same(r0["weights"], r1["weights"])
    assert r0["lr"] == r1["lr"] and r0["loss"] == r1["loss"]   # MetricAverageCallback
    assert r0["lr"][-1] == pytest.approx(0.004)                 # warmup reached scaled_lr
    assert r0["lr"][0] < r0["lr"][1] < r0["lr"][-1] + 1e-9
    assert r0["steps"] == 150 and r0["acc"] > 0.5
    assert r0["checkpoints"] == [f"checkpoint-{e}.keras" for e in (1, 2, 3)]
    assert r1["checkpoints"] == []


#: The snippets docs/keras.md shows (the README shows "tape").
DOCS_KERAS = ("fit", "stock", "mixed_precision", "aggregation")


def test_docs_keras_md_shows_the_tested_snippets():
    with open(os.path.join(ROOT, "docs", "keras.md"), encoding="utf-8") as f:
        text = f.read()
    for name in DOCS_KERAS:
        assert SNIPPETS[name] in text, name
    assert HOROVOD_STYLE in text


#: The snippets the README shows, word for word.
README = ("tape",)


def test_readme_shows_the_tested_snippets():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    for name in README:
        assert f"```python\n{SNIPPETS[name]}```" in text, name


def readme_markdown() -> str:
    """The snippets as Markdown, for the README and docs/keras.md."""
    parts = ["Setup assumed by the snippets:\n", "```python\n" + SETUP + "```\n"]
    for name, text in SNIPPETS.items():
        parts.append(f"\n`{name}`:\n\n```python\n{text}```\n")
    parts.append("\nHorovod-style script:\n\n```python\n" + HOROVOD_STYLE + "```\n")
    return "".join(parts)


if __name__ == "__main__":
    print(readme_markdown())
