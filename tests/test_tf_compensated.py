"""ECQ-SGD's compensated encode in the TensorFlow exchange (``horovod_aq.tensorflow.
compensated`` through ``PayloadOps.send_compensated``), in one process: payloads and h' bitwise
``codec.encode_compensated``'s (docs/dynamic.md §2.6) on the host pass and with graph ops,
allgather and two-phase, fixed and entropy-coded, in a tf.function and eagerly; markers where
x cannot travel; statistics and the tap on the fused path; the memory update's rules.
The exchange over real ranks: tests/test_tf_dqsgd_ecq.py."""

from __future__ import annotations

import numpy as np
import pytest

import horovod_aq
from horovod_aq import codec
from horovod_aq.codec.stream import StreamKey
from horovod_aq.packed.cost import chunk_numel
from horovod_aq.packed.plan import BucketPlan

tf = pytest.importorskip("tensorflow")
kernels = pytest.importorskip("horovod_aq.tensorflow.kernels")
from horovod_aq.tensorflow import compensated  # noqa: E402
from horovod_aq.tensorflow.payloads import PayloadOps  # noqa: E402
from horovod_aq.tensorflow.state import tf_state  # noqa: E402
from horovod_aq.tensorflow.stats import graph_bucket_moments  # noqa: E402

P, B, N, RANK, SEED, INDEX = 2, 64, 1000, 1, 7, 3
ALPHA, BETA = 0.3, 0.8
#: float32's smallest normal magnitude: TensorFlow's CPU kernels flush values below it to zero.
TINY = np.float32(2.0 ** -126)


@pytest.fixture(params=["auto", "ops"], ids=["host", "graph-ops"])
def implementation(request, monkeypatch):
    """The host pass (no GPU here: ``kernels.use_fused``) or TensorFlow ops
    (``HOROVOD_AQ_KERNELS=ops``)."""
    monkeypatch.setattr(kernels, "IMPLEMENTATION", request.param)
    return request.param


def _ecq(inner=None, **kwargs):
    inner = inner if inner is not None else horovod_aq.QSGD(bits=2, bucket_size=B, seed=SEED,
                                                            **kwargs)
    return horovod_aq.ErrorFeedback(inner, alpha=ALPHA, beta=BETA)


def _send(comp, mode, coding, traced=True, slot=None):
    """``send_compensated`` of a bucket as a function (g, h) → (payloads, h', finite,
    refused), traced or eager."""
    ops = PayloadOps(comp, tf_state(comp), ranks=P, rank=RANK, coding=coding)
    bucket = BucketPlan(INDEX, "b", (0,), N, mode)

    def send(g, h):
        sent, fused = ops.send_compensated(g, h, bucket, mode=mode,
                                           record=None if slot is None else slot.record)
        return sent, fused.memory, fused.finite, fused.refused

    return (tf.function(send) if traced else send), ops


def _oracle(comp, g, h, mode, coding, step=0):
    """Every part's ``codec.encode_compensated`` (the chunk's zero padding, part k's stream)."""
    m = N if mode == "allgather" else chunk_numel(N, P, B)
    out = []
    for k in range(1 if mode == "allgather" else P):
        lo, hi = min(k * m, N), min((k + 1) * m, N)
        out.append(codec.encode_compensated(
            g[lo:hi], h[lo:hi], ALPHA, BETA, comp.quantizer.table, bucket_size=B,
            norm=comp.quantizer.norm, numel=m, key=StreamKey(SEED, RANK, step, INDEX, k),
            coding=coding, checksum=comp.quantizer.checksum))
    return out


def _bits(v) -> bytes:
    arr = v.numpy() if hasattr(v, "numpy") else v
    return np.ascontiguousarray(arr, np.float32).view(np.uint32).tobytes()


def _gradient(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(N) * rng.lognormal(0, 1, N)).astype(np.float32)
    h = (0.1 * rng.standard_normal(N)).astype(np.float32)
    g[:5] = 0.0                      # an exact zero and a −0.0 of g − g̃ at first use
    return g, h


@pytest.mark.parametrize("traced", [True, False], ids=["tf.function", "eager"])
@pytest.mark.parametrize("coding", ["fixed", "entropy"])
@pytest.mark.parametrize("mode", ["allgather", "two_phase"])
def test_payloads_and_memory_are_the_oracles_bit_for_bit(implementation, mode, coding, traced):
    comp = _ecq()
    send, _ = _send(comp, mode, coding, traced)
    g, _ = _gradient(0)
    h = np.zeros(N, np.float32)        # a graph's memory starts at zero
    for step in range(3):              # h' of one step is the next step's h
        tf_state(comp).step.assign(step)
        sent, memory, finite, refused = send(tf.constant(g), tf.constant(h))
        want = _oracle(comp, g, h, mode, coding, step)
        assert [p.numpy().tobytes() for p in sent] == [w.payload.tobytes() for w in want]
        h_new = np.concatenate([w.memory for w in want])
        assert _bits(memory) == _bits(h_new)
        assert bool(finite) and not bool(refused)
        # and the oracle is ECQ-SGD's rule with g̃ the decode of the payloads sent
        decoded = np.concatenate([codec.decode(p.numpy(), comp.quantizer.table)
                                  for p in sent])[:N]
        assert _bits(h_new) == _bits(np.float32(BETA) * h + (g - decoded))
        g, h = _gradient(step + 1)[0], h_new


def test_checksummed_payloads_and_dqsgd_widths(implementation):
    # the checksum flag seals the same bytes as the oracle; DQSGD encodes in a tf.switch_case
    # branch per width (the current one chosen by the width variable)
    for comp in (_ecq(checksum=True),
                 _ecq(horovod_aq.DQSGD(target_bits=2.5, min_bits=2, max_bits=3, bucket_size=B,
                                   seed=SEED))):
        st = tf_state(comp)
        for bits in sorted(set(comp.quantizer.widths) if st.dynamic else [2]):
            if st.dynamic:
                comp.quantizer.bits = bits
                st.sync()
            send, _ = _send(comp, "two_phase", "fixed")
            g, h = _gradient(bits)
            sent, memory, _, _ = send(tf.constant(g), tf.constant(h))
            want = _oracle(comp, g, h, "two_phase", "fixed")
            assert [p.numpy().tobytes() for p in sent] == [w.payload.tobytes() for w in want]
            assert codec.parse_header(sent[0].numpy()).bits == bits
            assert _bits(memory) == _bits(np.concatenate([w.memory for w in want]))


@pytest.mark.parametrize("coding", ["fixed", "entropy"])
@pytest.mark.parametrize("mode", ["allgather", "two_phase"])
def test_what_cannot_travel_sends_markers(implementation, mode, coding):
    # a NaN of g, an inf of g + α·h, a finite bucket whose l2 norm overflows float32 (refused on
    # either norm, the rule of PayloadOps._first_bad): markers naming the first bad element
    copies = 1 if mode == "allgather" else P
    for norm in ("l2", "linf"):
        comp = _ecq(norm=norm)
        send, _ = _send(comp, mode, coding)
        cases = []
        g, h = _gradient(0)
        g[700] = np.nan               # a NaN of g
        cases.append((g, h, 700))
        g, h = _gradient(0)
        g[300], h[300] = 3.3e38, 3.3e38   # finite g and h, g + α·h overflows
        cases.append((g, h, 300))
        g, h = _gradient(0)
        g[2 * B:3 * B] = 3e38 / 4     # |x_i| < float32 max, the bucket's l2 norm 6e38
        cases.append((g, h, 2 * B))
        for g, h, first in cases:
            sent, _, _, refused = send(tf.constant(g), tf.constant(h))
            assert bool(refused)
            assert len(sent) == copies
            for p in sent:
                head = codec.parse_header(p.numpy())
                assert head.nonfinite and head.first_nonfinite == first


def test_statistics_of_x_on_recording_steps_and_the_tap(implementation):
    # the fused path records the statistics of x = g + α·h only when the compressor records,
    # and hands the tap x and the payload of every part
    comp = _ecq(horovod_aq.ALQ(bits=3, bucket_size=B, seed=SEED))
    st = tf_state(comp)
    slot = st.new_slot(N, "b#stats")
    send, ops = _send(comp, "two_phase", "fixed", slot=slot)
    tapped = []
    ops.tap = lambda bucket, part, values, payload: tapped.append((part, values, payload))
    g, h = _gradient(4)
    x = g + np.float32(ALPHA) * h
    for step, recording in enumerate((False, True)):
        st.step.assign(step)
        st.recording.assign(recording)
        tapped.clear()
        sent, _, _, _ = send(tf.constant(g), tf.constant(h))
        assert int(slot.written_at.numpy()) == (step if recording else -1)
        m = chunk_numel(N, P, B)
        padded = np.concatenate([x, np.zeros(P * m - N, np.float32)])
        assert [t[0] for t in tapped] == list(range(P))
        for k, (_, values, payload) in enumerate(tapped):
            assert _bits(values) == _bits(padded[k * m:(k + 1) * m])
            assert payload.tobytes() == sent[k].numpy().tobytes()
    want = graph_bucket_moments(tf.constant(x), B)   # of x, not g (float64 sums: eager vs graph)
    for got, expected in zip((slot.norms, slot.means, slot.stds), want):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-12, atol=0)


@pytest.mark.parametrize("traced", [True, False], ids=["tf.function", "eager"])
def test_subnormals_differ_only_where_the_oracle_meets_one(implementation, traced):
    # TensorFlow runs its CPU kernels with subnormals flushed to zero (FTZ/DAZ), and so runs
    # the host pass's numpy_function on its executor's threads (a traced graph); numpy does not.
    # h' then differs at most in quantization buckets holding a subnormal x_i (their norm and
    # codes may change: the payload too) and in coordinates where the oracle meets a subnormal
    # (docs/dynamic.md §2.6); elsewhere it is bitwise the oracle's
    comp = _ecq()
    send, _ = _send(comp, "allgather", "fixed", traced)
    g, h = _gradient(5)
    g[:B], h[:B] = 0.0, TINY / 4      # a zero-gradient bucket with a subnormal memory
    g[B:B + 8] = 0.0
    h[B:B + 8] = TINY * 3             # β·h of a normal bucket's coordinates near the limit
    g[2 * B:2 * B + 8] = TINY / 8     # subnormal gradients in a normal bucket
    _, memory, _, _ = send(tf.constant(g), tf.constant(h))
    want = _oracle(comp, g, h, "allgather", "fixed")[0]
    a, b = np.float32(ALPHA), np.float32(BETA)
    g_hat = codec.decode(want.payload, comp.quantizer.table)
    x = g + a * h

    def sub(v):
        return (v != 0) & (np.abs(v) < TINY)

    suspects = sub(g) | sub(h) | sub(a * h) | sub(b * h) | sub(g - g_hat) | sub(g_hat) | \
        sub(want.memory)
    for k in range(0, N, B):          # a bucket holding a subnormal x_i: its norm may differ
        suspects[k:k + B] |= sub(x[k:k + B]).any()
    assert suspects.any() and not suspects.all()
    got = memory.numpy()
    assert _bits(got[~suspects]) == _bits(want.memory[~suspects])


def test_update_memory_installs_resets_and_skips():
    comp = _ecq()
    st = tf_state(comp)
    var = st.memory_variable("u", 4)
    resets = st.memory_resets
    before = int(resets.numpy())
    new = tf.constant([1.0, -2.0, 0.5, 3.0])
    update = compensated.MemoryUpdate(var, new, tf.constant(True))
    compensated.update_memory(comp.error_memory, resets, [update], tf.constant(True), [])
    assert not np.any(var.numpy())                     # a step with markers: unchanged
    compensated.update_memory(comp.error_memory, resets, [update], tf.constant(False), [])
    np.testing.assert_array_equal(var.numpy(), new.numpy())
    bad = compensated.MemoryUpdate(var, tf.constant([np.inf, 1.0, 1.0, 1.0]),
                                   tf.constant(False))
    compensated.update_memory(comp.error_memory, resets, [bad], tf.constant(False), [])
    assert not np.any(var.numpy()) and int(resets.numpy()) == before + 1   # zeros, counted
