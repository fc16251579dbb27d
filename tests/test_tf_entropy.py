"""The graph ops of the entropy-coded wire in TensorFlow (horovod_aq.tensorflow.entropy), in one
process: the bytes of codec.encode_entropy for a step read in-graph without a retrace, rows
delimited from their own headers, the averages of codec.decode_average, forged lengths refused;
and the wire= argument of the tape and the Keras optimizer."""

from __future__ import annotations

import numpy as np
import pytest

from horovod_aq import codec
from horovod_aq.codec import PayloadError
from horovod_aq.codec.stream import StreamKey
from horovod_aq.levels.table import LevelTable

tf = pytest.importorskip("tensorflow")
te = pytest.importorskip("horovod_aq.tensorflow.entropy")

N, BUCKET, SEED, RANK = 1000, 64, 7, 1


def _table() -> LevelTable:
    return LevelTable(np.linspace(-1.0, 1.0, 8), version=3)


def _gradient(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(N) * rng.lognormal(0, 1, N)).astype(np.float32)


def _encode(x: np.ndarray, step: int, part: int = 0) -> np.ndarray:
    return codec.encode_entropy(x, _table(), bucket_size=BUCKET,
                                key=StreamKey(SEED, RANK, step, 2, part))


def test_encode_is_the_oracles_bytes_for_the_step_read_in_graph():
    table = _table()
    step = tf.Variable(np.int64(0), trainable=False)

    @tf.function
    def encode(x):
        return te.encode_entropy(x, lambda: table, seed=SEED, rank=RANK, step=step.read_value(),
                                 bucket=2, part=0, bucket_size=BUCKET, norm="l2")

    x = _gradient(0)
    sizes = []
    for s in range(3):
        step.assign(s)
        got = encode(tf.constant(x)).numpy()
        np.testing.assert_array_equal(got, _encode(x, s))
        sizes.append(got.size)
    assert encode.experimental_get_tracing_count() == 1
    assert max(sizes) < codec.payload_size(N, 3, BUCKET)     # entropy-coded: smaller


def test_delimited_rows_average_like_the_oracle():
    table = _table()
    rows = [_encode(_gradient(p), step=p) for p in range(3)]
    rows.append(codec.encode(_gradient(3), table, bucket_size=BUCKET,
                             key=StreamKey(SEED, 3, 0, 2, 0)))      # a fixed-width row
    assert len({r.size for r in rows}) > 1

    @tf.function(input_signature=[tf.TensorSpec([None], tf.uint8)])
    def average(flat):
        got = te.delimited(flat, len(rows))
        return (got.sizes, got.heads,
                te.decode_average(got, lambda: table, numel=N, bucket_size=BUCKET, norm="l2"),
                te.decode_rows(got, lambda: table, numel=N, bucket_size=BUCKET, norm="l2"))

    sizes, heads, avg, each = average(tf.constant(np.concatenate(rows)))
    assert sizes.numpy().tolist() == [r.size for r in rows]
    np.testing.assert_array_equal(heads.numpy(), np.stack([r[:codec.HEADER_SIZE] for r in rows]))
    np.testing.assert_array_equal(avg.numpy(), codec.decode_average(rows, table))
    np.testing.assert_array_equal(each.numpy(),
                                  np.concatenate([codec.decode(r, table) for r in rows]))


def test_received_splits_and_a_forged_length_is_refused():
    from horovod_aq.tensorflow.checks import translate_error

    table = _table()
    rows = [_encode(_gradient(p), step=p) for p in range(2)]
    flat = tf.constant(np.concatenate(rows))
    got = te.received(flat, tf.constant([r.size for r in rows], tf.int32), 2)
    np.testing.assert_array_equal(
        te.decode_average(got, lambda: table, numel=N, bucket_size=BUCKET, norm="l2").numpy(),
        codec.decode_average(rows, table))
    forged = np.concatenate(rows)
    size_at = codec.HEADER_SIZE + 4 * codec.num_buckets(N, BUCKET)   # the coder header's size
    forged[size_at:size_at + 8] = np.frombuffer(np.uint64(rows[0].size + 9).tobytes(), np.uint8)
    with pytest.raises(PayloadError, match="rank 1: not a horovod_aq payload"):   # eager
        te.delimited(tf.constant(forged), 2)
    with pytest.raises(tf.errors.InvalidArgumentError) as err:                     # traced
        tf.function(lambda flat: te.delimited(flat, 2).sizes)(tf.constant(forged))
    error = translate_error(err.value)
    assert isinstance(error, PayloadError) and error.rank == 1, error


def test_wire_argument_is_checked():
    pytest.importorskip("horovod.tensorflow")
    from horovod_aq.tensorflow.packed import check_tf_wire
    from horovod_aq.tensorflow.tape import DistributedGradientTape

    assert check_tf_wire("fixed") == "fixed" and check_tf_wire("entropy") == "entropy"
    with pytest.raises(ValueError, match="PyTorch exchanges only"):
        check_tf_wire("auto")
    with pytest.raises(ValueError, match="wire must be one of"):
        check_tf_wire("rans")
    import horovod_aq

    with pytest.raises(ValueError, match="PyTorch exchanges only"):
        DistributedGradientTape(tf.GradientTape(), horovod_aq.QSGD(bits=3), wire="auto")
    for mode in ("node_allgather", "node_two_phase"):   # docs/keras.md §2: flat in TensorFlow
        with pytest.raises(ValueError, match="node-aware.*PyTorch exchanges only"):
            DistributedGradientTape(tf.GradientTape(), horovod_aq.QSGD(bits=3), exchange=mode)
