"""Single-process checks of the TensorFlow integration's state (no Horovod ranks launched).

The stock ``compress`` runs here without ``hvd.init()`` (one rank, stream of rank 0): its values
must be exactly the numpy codec's quantization with the uniforms the compressor's generator
draws, and a new level table must reach an already traced function without retracing.
"""

from __future__ import annotations

import numpy as np
import pytest

import horovod_aq
from horovod_aq import codec
from horovod_aq.levels.stats import bucket_moments, normalized_histogram
from horovod_aq.levels.table import LevelTable

tf = pytest.importorskip("tensorflow")
pytest.importorskip("horovod.tensorflow")

from horovod_aq.tensorflow.state import graph_bucket_moments, tf_state  # noqa: E402

BUCKET = 64


def _gradient(n=1000, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * rng.lognormal(0, 1, n)).astype(np.float32)
    x[BUCKET:2 * BUCKET] = 0.0  # a zero bucket
    return x


def _next_uniforms(comp, n):
    gen = tf_state(comp).generator
    clone = tf.random.Generator.from_state(gen.state.numpy(), gen.algorithm)
    return clone.uniform([n], dtype=tf.float32).numpy()


def test_stock_compress_is_codec_quantize_and_sees_new_tables_without_retrace():
    comp = horovod_aq.ALQ(bits=3, bucket_size=BUCKET, seed=5)
    x = _gradient()
    fn = tf.function(lambda t: comp.decompress(*comp.compress(t)))
    for version in range(3):
        if version:
            levels = np.sort(np.concatenate([[-1.0, 1.0], np.random.default_rng(version)
                                             .uniform(-0.9, 0.9, 6)]))
            comp.set_table(LevelTable(levels, version))
        u = _next_uniforms(comp, x.size)
        got = fn(tf.constant(x)).numpy()
        want = codec.quantize(x, comp.table, bucket_size=BUCKET, norm=comp.norm, uniforms=u)
        np.testing.assert_array_equal(got, want.astype(np.float16).astype(np.float32))
    assert fn.experimental_get_tracing_count() == 1


def test_autograph_stops_at_the_stock_hooks(caplog):
    """Horovod calls ``compression=`` inside a ``tf.function`` with AutoGraph on. AutoGraph must
    call the TF backend's hooks as written (``do_not_convert``): converting the quantizer behind
    them took seconds at every first trace (tensorflow/backend.py). AutoGraph logs each call it
    converts at verbosity 1 (``tf.autograph.set_verbosity``)."""
    comp = horovod_aq.ALQ(bits=3, bucket_size=BUCKET, seed=5)

    @tf.function   # AutoGraph on, as in Horovod's allreduce_grads
    def hook(t):
        wire, ctx = comp.compress(t)
        return comp.decompress(wire, ctx)

    tf.autograph.set_verbosity(1)
    try:
        with caplog.at_level("INFO", logger="tensorflow"):
            hook(tf.constant(_gradient()))
    finally:
        tf.autograph.set_verbosity(0)
    converted = [r.getMessage().split("\n")[0] for r in caplog.records
                 if r.getMessage().startswith("Converted call:")]
    assert any("TensorFlowBackend.compress" in c for c in converted), converted   # reached
    assert not any("quantize_local" in c or "encode_with" in c for c in converted), converted


def test_stock_fp16_casts_and_guards_the_fp16_range():
    x = tf.constant(_gradient())
    wire, ctx = horovod_aq.FP16().compress(x)
    assert wire.dtype == tf.float16 and ctx == tf.float32
    comp = horovod_aq.QSGD(bits=4, bucket_size=BUCKET)
    # The wire carries c·q with c = 2^-ceil(log2 sqrt B) = 1/8 (horovod_aq.stock.wire_scale), so a
    # constant bucket of 1e5 travels as 12,500 and fits; 1e6 travels as 125,000 and must not.
    comp.compress(tf.constant(np.full(BUCKET, 1e5, np.float32)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="fp16 range"):
        comp.compress(tf.constant(np.full(BUCKET, 1e6, np.float32)))


def test_recorded_statistics_match_the_codec():
    comp = horovod_aq.ALQ(bits=3, bucket_size=BUCKET, schedule="0,0")  # refit at step 0 only
    x = _gradient(2000)
    tf.function(lambda t: comp.compress(t)[0])(tf.constant(x))
    state = tf_state(comp)
    assert comp.recording and state.recording.numpy()
    stats = [s.read(0) for s in state.slots]
    assert len(stats) == 1 and stats[0] is not None
    for got, want in zip(stats[0], bucket_moments(x, BUCKET)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    assert comp.wants_histogram  # ALQ's default model: the histogram is recorded too
    np.testing.assert_allclose(stats[0][3], normalized_histogram(x, BUCKET), rtol=1e-12)
    norms, means, stds = (t.numpy() for t in graph_bucket_moments(tf.constant(x), BUCKET))
    assert norms.size == x.size // BUCKET and norms[1] == 0 and means[1] == 0 and stds[1] == 0


def test_state_dict_restores_the_random_stream():
    comp = horovod_aq.QSGD(bits=3, bucket_size=BUCKET, seed=9)
    x = tf.constant(_gradient())
    comp.compress(x)
    saved = comp.state_dict()
    assert "tensorflow" in saved["framework"]
    a = comp.compress(x)[0].numpy()
    other = horovod_aq.QSGD(bits=3, bucket_size=BUCKET, seed=9)
    other.load_state_dict(saved)
    np.testing.assert_array_equal(other.compress(x)[0].numpy(), a)


def test_stock_path_refuses_dqsgd_and_error_feedback_clearly():
    from horovod_aq import DQSGD
    from horovod_aq.error_feedback import ErrorFeedback

    x = tf.constant(_gradient())
    with pytest.raises(NotImplementedError, match="DistributedGradientTape"):
        DQSGD(target_bits=3).compress(x)            # Horovod's compression= hook
    with pytest.raises(TypeError, match="parameter"):
        ErrorFeedback(horovod_aq.QSGD(bits=2)).compress(x)


def test_dqsgd_state_keeps_one_table_per_width_and_the_width_index():
    comp = horovod_aq.DQSGD(target_bits=3.0, min_bits=2, max_bits=5, levels="alq",
                            bucket_size=BUCKET)
    state = tf_state(comp)
    assert [w.bits for w in state.widths] == [2, 3, 4, 5]
    assert state.levels is None and int(state.width_index.numpy()) == comp.bits - 2
    for w, b in zip(state.widths, range(2, 6)):
        assert w.levels.numpy().tobytes() == codec.float32_levels(comp.widths[b].table).tobytes()
    levels = np.sort(np.concatenate([[-1.0, 1.0], np.linspace(-0.5, 0.5, 6)]))
    comp.widths[3].set_table(LevelTable(levels, 1))      # a refit of one width (listener)
    np.testing.assert_array_equal(state.widths[1].levels.numpy(),
                                  codec.float32_levels(comp.widths[3].table))
    assert state.widths[0].levels.numpy().size == 4       # the other widths are untouched
    comp.bits = 5
    assert not state.in_sync
    state.sync()
    assert state.in_sync and int(state.width_index.numpy()) == 3


def test_error_feedback_memory_variables_follow_the_core():
    ef = horovod_aq.ECQ(horovod_aq.QSGD(bits=2, bucket_size=BUCKET), alpha=0.3, beta=0.8)
    state = tf_state(ef)
    assert ef.quantizer.framework_state("tensorflow") is state
    assert state.error_memory is ef.error_memory
    var = state.memory_variable("bucket0", 8)
    assert ef.memory["bucket0"] is var and var.dtype == tf.float32
    var.assign(np.arange(8, dtype=np.float32))
    saved = ef.state_dict()                               # the core reads the variables
    np.testing.assert_array_equal(saved["memory"]["bucket0"], np.arange(8))
    assert ef.memory_norm() == pytest.approx(np.linalg.norm(np.arange(8)))
    other = horovod_aq.ECQ(horovod_aq.QSGD(bits=2, bucket_size=BUCKET), alpha=0.3, beta=0.8)
    other.load_state_dict(saved)                          # a fresh compressor: created from it
    np.testing.assert_array_equal(tf_state(other).memory_variable("bucket0", 8).numpy(),
                                  np.arange(8))
    ef.reset_memory("test")                               # the core drops its memory ...
    state.sync()                                          # ... and the variable follows
    assert ef.memory["bucket0"] is var and not var.numpy().any()
    ef.load_state_dict(saved)                             # a load between steps
    state.sync()
    np.testing.assert_array_equal(var.numpy(), np.arange(8))
    with pytest.raises(ValueError, match="elements"):
        state.memory_variable("bucket0", 9)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64", "int64",
                                   "uint32", "bool", "uint8", "int8"])
def test_variable_bytes_roundtrip(dtype):
    from horovod_aq.tensorflow.callbacks import _as_bytes, _from_bytes

    rng = np.random.default_rng(0)
    for shape in [(), (3,), (2, 5)]:
        value = tf.cast(tf.constant(rng.uniform(0, 100, shape)), dtype)
        back = _from_bytes(_as_bytes(value), value.dtype, value.shape)
        assert back.dtype == value.dtype and back.shape == value.shape
        np.testing.assert_array_equal(back.numpy(), value.numpy())


def test_keras_wrapper_refuses_other_optimizers():
    from horovod_aq.tensorflow.keras import DistributedOptimizer

    with pytest.raises(TypeError, match="Keras 3 optimizer"):
        DistributedOptimizer(object(), horovod_aq.ALQ())
