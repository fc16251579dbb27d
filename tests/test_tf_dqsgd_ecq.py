"""DQSGD dynamic widths and ECQ-SGD error feedback on the TensorFlow packed paths, on real ranks.

One launch per controller runs every check (TF start-up costs seconds per rank); each pytest test
asserts on one check's per-rank results. As in ``test_tf_packed``, the numpy codec is the oracle:
the averaged gradients must be bitwise the numpy decode-and-average of the recorded payloads, and
the error-feedback payloads and memory must be bitwise ``codec.encode_compensated``'s of each
rank's local gradient and memory, which is ECQ-SGD's two rules with ``codec.decode`` of what the
rank sent (``test_torch_optimizer::test_ecq_on_the_packed_path``).
"""

from __future__ import annotations

import numpy as np
import pytest

from horovod_aq import codec
from horovod_aq.tools.launcher import run_local
from tests import launches
from tests.ranks import init_tf
from tests.test_tf_packed import (
    BUCKET,
    FUSION_BYTES,
    EncodeRecorder,
    _assert_allgather_oracle,
    _assert_two_phase_oracle,
    _distributed_tape,
    _evaluate,
    _keras_model,
    _mnist,
    _variables,
)

pytestmark = pytest.mark.multiprocess

ALPHA, BETA = 0.3, 0.8
DQSGD_STEPS = 20


# ---------------------------------------------------------------- helpers (inside the ranks)
def _batch(tf, rank: int, step: int):
    """The inputs of ``test_tf_packed._loss`` as tensors (arguments of a traced step)."""
    rng = np.random.default_rng(1000 * step + rank)
    x = tf.constant(rng.standard_normal((8, 20)).astype(np.float32))
    y = tf.constant(rng.integers(0, 10, 8))
    return x, y


def _forward(tf, v, x, y):
    h = tf.nn.relu(x @ v["w1"] + v["b1"])
    h = tf.nn.relu(h @ v["w2"] + v["b2"])
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h @ v["w3"]))


def _same(a, b) -> bool:
    return all(np.array_equal(p, q) for p, q in zip(a, b))


def _ecq():
    import horovod_aq

    return horovod_aq.ECQ(horovod_aq.QSGD(bits=2, bucket_size=BUCKET, seed=7),
                          alpha=ALPHA, beta=BETA)


def _traced_step(tf, hvd, comp, v, exchange="allgather", lr=0.0, *, traced=True, local=False,
                 **tape_kwargs):
    """A tf.function train step (tape → packed exchange → SGD update when lr > 0); eager with
    ``traced=False``. ``local``: it returns (averaged, local) gradients, the local ones from
    the same tape (persistent), so they are bitwise what the exchange received."""
    holder = {}

    def train_step(x, y, scale):
        with tf.GradientTape(persistent=local) as tape:
            loss = scale * _forward(tf, v, x, y)
        t = _distributed_tape(tape, comp, exchange=exchange, fusion_bytes=FUSION_BYTES,
                              **tape_kwargs)
        holder["tape"] = t
        grads = t.gradient(loss, list(v.values()))
        if lr:
            for var, g in zip(v.values(), grads):
                var.assign_sub(lr * g)
        return (grads, tape.gradient(loss, list(v.values()))) if local else grads

    return (tf.function(train_step) if traced else train_step), holder


# ---------------------------------------------------------------- checks (inside the ranks)
def dqsgd_in_function(exchange: str, steps: int = DQSGD_STEPS, **kwargs):
    """DQSGD in a tf.function custom loop; the loss is scaled by 10 every third step so that the
    aggregated-gradient norm, and with it the width, jumps around."""
    tf, hvd = init_tf()
    import horovod_aq
    import horovod_aq.tensorflow as aqtf

    v = _variables(tf)
    settings = {"target_bits": 3.0, "min_bits": 2, "max_bits": 6, "window": 5, **kwargs}
    comp = horovod_aq.DQSGD(bucket_size=BUCKET, **settings)
    train_step, holder = _traced_step(tf, hvd, comp, v, exchange, lr=0.01)
    bits, tables, headers, norms, grads, entries = [], [], [], [], [], []
    with EncodeRecorder() as rec:
        for step in range(steps):
            n = len(rec.entries)
            x, y = _batch(tf, hvd.rank(), step)
            bits.append(comp.bits)
            tables.append((comp.table.levels.copy(), comp.table.version))
            out = train_step(x, y, tf.constant(10.0 if step % 3 == 0 else 1.0))
            grads.append([g.numpy() for g in out])
            aqtf.refit(comp)
            norms.append(comp.rule.norms[-1])  # G of this step, from the decoded aggregate
            entries.append(sorted(rec.entries[n:], key=lambda e: e[2]))
            headers.append(sorted({int(e[5][3]) for e in entries[-1]}))
    t = holder["tape"]
    widths = sorted(comp.widths)
    return {"bits": bits, "tables": tables, "headers": headers, "norms": norms, "grads": grads,
            "entries": entries, "buckets": t.buckets,
            "names": [f"{i}:{k}" for i, k in enumerate(v)],
            "telemetry_bits": [r.bits for r in t.telemetry.history],
            "payload_bytes": [r.payload_bytes for r in t.telemetry.history],
            "traces": train_step.experimental_get_tracing_count(),
            "weights": {k: x.numpy() for k, x in v.items()},
            "versions": [comp.widths[b].table.version for b in widths],
            "width_levels": [comp.widths[b].table.levels.tobytes() for b in widths],
            "levels_vars": [w.levels.numpy().tobytes() for w in aqtf.tf_state(comp).widths],
            "levels_f32": [codec.float32_levels(comp.widths[b].table).tobytes() for b in widths]}


def dqsgd_allgather():
    return dqsgd_in_function("allgather")


def dqsgd_alq_two_phase():
    """Adaptive widths: every width's table is refitted at steps 0 and 3 (the core refits all
    of them from the same statistics) and reaches the graph through its listener."""
    return dqsgd_in_function("two_phase", steps=6, levels="alq", schedule="0,3,0", max_bits=4)


def dqsgd_width_mismatch():
    """Rank 1 switches to another width between two steps of a traced step function: every
    rank's decoder refuses the exchange (the size and header checks run before any decode)."""
    tf, hvd = init_tf()
    import horovod_aq
    import horovod_aq.tensorflow as aqtf

    v = _variables(tf)
    comp = horovod_aq.DQSGD(target_bits=2.0, min_bits=2, max_bits=3, bucket_size=BUCKET)
    # the plain DQSGD ("auto" would add error feedback at a mean of 2 bits)
    train_step, _ = _traced_step(tf, hvd, comp, v, error_feedback=False)
    x, y = _batch(tf, hvd.rank(), 0)
    train_step(x, y, tf.constant(1.0))                 # the handshake passes
    aqtf.refit(comp)
    if hvd.rank() == 1:
        comp.bits = 3 if comp.bits == 2 else 2
        aqtf.tf_state(comp).sync()
    try:
        train_step(x, y, tf.constant(1.0))
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def ecq_in_function(exchange: str, steps: int = 3, comp=None, wire: str = "fixed",
                    traced: bool = True):
    """ECQ-SGD in a tf.function step (eager with ``traced=False``; lr 0): record what was
    encoded, the local gradients the exchange received, the telemetry and the gathered
    memory."""
    tf, hvd = init_tf()
    import horovod_aq.tensorflow as aqtf
    from horovod_aq.tensorflow import checkpoint

    v = _variables(tf)
    comp = comp if comp is not None else _ecq()
    train_step, holder = _traced_step(tf, hvd, comp, v, exchange, traced=traced, local=True,
                                      wire=wire)
    per_step, local, grads, ef_norms, tables = [], [], [], [], []
    with EncodeRecorder() as rec:
        for step in range(steps):
            n = len(rec.entries)
            x, y = _batch(tf, hvd.rank(), step)
            tables.append((comp.table.levels.copy(), comp.table.version))
            averaged, own = train_step(x, y, tf.constant(1.0))
            grads.append([g.numpy() for g in averaged])
            aqtf.refit(comp)
            local.append([g.numpy() for g in own])
            per_step.append(sorted(rec.entries[n:], key=lambda e: e[2]))
            ef_norms.append(holder["tape"].telemetry.last.extra.get("ef_memory_norm"))
    own = checkpoint.state_dict(comp)["memory"]         # no collective: this rank's memory
    gathered = []
    for to in range(hvd.size()):                        # every rank: each keeps all in turn
        checkpoint.consolidate_state_dict(comp, to=to)
        gathered.append(checkpoint.state_dict(comp))
    state = gathered[hvd.rank()]
    names = [f"{i}:{k}" for i, k in enumerate(v)]
    return {"entries": per_step, "buckets": holder["tape"].buckets, "names": names,
            "local": [dict(zip(names, g)) for g in local], "grads": grads, "own": own,
            "elsewhere": [g.get("memory_rank") for k, g in enumerate(gathered)
                          if k != hvd.rank()],
            "tables": tables, "memory_by_rank": state["memory_by_rank"], "world": state["world"],
            "memory_keys": sorted(comp.memory), "ef_norms": ef_norms,
            "traces": train_step.experimental_get_tracing_count() if traced else 1}


def ecq_allgather():
    return ecq_in_function("allgather")


def ecq_two_phase():
    return ecq_in_function("two_phase")


def ecq_eager_entropy():
    """Eager tapes on the entropy-coded wire, two-phase (the host encoder's codes)."""
    return ecq_in_function("two_phase", wire="entropy", traced=False)


def ecq_dqsgd():
    """ErrorFeedback around DQSGD: the memory rules hold while the width changes."""
    import horovod_aq

    inner = horovod_aq.DQSGD(target_bits=2.5, min_bits=2, max_bits=3, bucket_size=BUCKET,
                             window=2, warmup_bits=3)
    return ecq_in_function("allgather", steps=4,
                           comp=horovod_aq.ECQ(inner, alpha=ALPHA, beta=BETA))


def ecq_checkpoint():
    """Memory through checkpoint.state_dict / load_state_dict: a fresh compressor and an already
    traced one rolled back both continue bitwise; another world size drops the memory with a
    warning."""
    import logging

    tf, hvd = init_tf()
    import horovod_aq.tensorflow as aqtf
    from horovod_aq.tensorflow import checkpoint

    v = _variables(tf)

    def runner(comp):
        train_step, _ = _traced_step(tf, hvd, comp, v)

        def run(step):
            out = train_step(*_batch(tf, hvd.rank(), step), tf.constant(1.0))
            aqtf.refit(comp)
            return [g.numpy() for g in out]

        return train_step, run

    a = _ecq()
    fa, run_a = runner(a)
    run_a(0)
    run_a(1)
    saved = checkpoint.state_dict(a)
    b = _ecq()
    checkpoint.load_state_dict(b, saved)
    ga, gb = run_a(2), runner(b)[1](2)
    run_a(3)
    checkpoint.load_state_dict(a, saved)               # roll the traced compressor back
    ga2 = run_a(2)
    c = _ecq()                                          # saved with 2 ranks, loaded by "3"
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("horovod_aq.error_feedback").addHandler(handler)
    try:
        checkpoint.load_state_dict(c, {**saved, "world": 3})
    finally:
        logging.getLogger("horovod_aq.error_feedback").removeHandler(handler)
    return {"world": saved["world"], "owner": saved["memory_rank"],
            "keys": sorted(saved["memory"]), "buckets": len(a.memory),
            "nonzero": all(np.any(m) for m in saved["memory"].values()),
            "fresh_identical": _same(ga, gb), "rollback_identical": _same(ga2, ga),
            "step": a.step, "traces": fa.experimental_get_tracing_count(),
            "dropped": checkpoint.state_dict(c)["memory"], "warnings": messages}


def ecq_nonfinite_skip():
    """nonfinite="skip": a step in which rank 1's gradient holds a NaN is skipped on every rank
    and updates no rank's memory; the next finite step updates it again."""
    tf, hvd = init_tf()
    import horovod_aq
    import horovod_aq.tensorflow as aqtf

    v = _variables(tf)
    comp = horovod_aq.ECQ(horovod_aq.QSGD(bits=2, bucket_size=BUCKET, seed=7, nonfinite="skip"))
    train_step, holder = _traced_step(tf, hvd, comp, v)
    poison = float("nan") if hvd.rank() == 1 else 1.0
    memory = []
    for step, scale in enumerate((1.0, poison, 1.0)):
        out = train_step(*_batch(tf, hvd.rank(), step), tf.constant(scale))
        aqtf.refit(comp)
        memory.append({k: np.asarray(h).copy() for k, h in comp.state_dict()["memory"].items()})
        if step == 1:
            nan = all(np.isnan(g.numpy()).all() for g in out)
    skipped = [r.extra.get("skipped", 0.0) for r in holder["tape"].telemetry.history]
    return {"nan": nan, "skipped": skipped,
            "kept": all(np.array_equal(memory[0][k], memory[1][k]) for k in memory[0]),
            "updated": all(not np.array_equal(memory[1][k], memory[2][k]) for k in memory[0])}


def ecq_auto():
    """error_feedback="auto" with a plain ALQ 2-bit: tapes rebuilt at every step (eager) and
    the Keras optimizer share one ErrorFeedback, one exchange and one memory, which grows."""
    tf, hvd = init_tf()
    import keras

    import horovod_aq
    import horovod_aq.keras as aqk

    v = _variables(tf)
    comp = horovod_aq.ALQ(bits=2, bucket_size=BUCKET, seed=7, schedule="0")
    tapes = []
    for step in range(3):
        x, y = _batch(tf, hvd.rank(), step)
        with tf.GradientTape() as tape:
            loss = _forward(tf, v, x, y)
        t = _distributed_tape(tape, comp, exchange="allgather", fusion_bytes=FUSION_BYTES)
        for var, g in zip(v.values(), t.gradient(loss, list(v.values()))):
            var.assign_sub(0.05 * g)
        tapes.append(t)
    used = tapes[0].compression
    opt = aqk.DistributedOptimizer(keras.optimizers.SGD(0.05), horovod_aq.TernGrad())
    off = aqk.DistributedOptimizer(keras.optimizers.SGD(0.05), horovod_aq.TernGrad(),
                                   error_feedback=False)
    adam = aqk.DistributedOptimizer(keras.optimizers.Adam(1e-3), horovod_aq.TernGrad())
    return {"type": type(used).__name__, "inner_is_given": used.quantizer is comp,
            "one_wrapper": all(t.compression is used for t in tapes),
            "one_exchange": all(t.exchange is tapes[0].exchange for t in tapes),
            "norms": [r.extra.get("ef_memory_norm") for r in tapes[0].telemetry.history],
            "memory_keys": sorted(used.memory), "buckets": sorted(b[0] for b in t.buckets),
            "keras": type(opt.compression).__name__, "keras_off": type(off.compression).__name__,
            "keras_adam": type(adam.compression).__name__}


def keras_fit_ecq():
    """Keras 3 model.fit with ECQ(QSGD 4-bit) through horovod_aq.keras.DistributedOptimizer."""
    tf, hvd = init_tf()
    import keras

    import horovod_aq
    import horovod_aq.keras as aqk

    x, y, xt, yt = _mnist(hvd)
    x, y = x[:1000], y[:1000]                  # 25 batches of 40 per epoch
    model = _keras_model(keras, seed=hvd.rank())
    comp = horovod_aq.ECQ(horovod_aq.QSGD(bits=4, seed=3))
    opt = aqk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), comp)
    model.compile(optimizer=opt, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=40, epochs=2, verbose=0, shuffle=True,
                        callbacks=[aqk.BroadcastGlobalVariablesCallback(0), aqk.RefitCallback(opt),
                                   aqk.MetricAverageCallback()])
    loss, acc = _evaluate(tf, keras, model, xt, yt)
    last = opt.telemetry.last
    return {"loss": loss, "acc": acc, "history": [float(a) for a in history.history["loss"]],
            "weights": [w.numpy() for w in model.weights], "steps": comp.step,
            "ef_norm": last.extra.get("ef_memory_norm"), "bits": last.bits,
            "buckets": len(opt.buckets), "memory_keys": sorted(comp.memory)}


#: Each check runs under one controller, so that both launches together stay within about 90 s
#: on two cores: under Gloo the fixed-family DQSGD run (allgather, 20 steps: the width must
#: change), the refusal of another width, ECQ on allgather, its checkpoint and its non-finite
#: skip, model.fit, error_feedback="auto" at 2 bits and ECQ eagerly on the entropy-coded
#: two-phase wire; under
#: MPI the adaptive DQSGD two-phase run (variable-size alltoall and allgather, refits of every
#: width over mpi4py), ECQ on the two-phase exchange and ECQ around DQSGD.
CHECKS = {"gloo": [dqsgd_allgather, dqsgd_width_mismatch, ecq_allgather, ecq_checkpoint,
                   ecq_nonfinite_skip, keras_fit_ecq, ecq_auto, ecq_eager_entropy],
          "mpi": [dqsgd_alq_two_phase, ecq_two_phase, ecq_dqsgd]}


#: controller -> the checks its launch runs (tests/launches.py)
LAUNCHES = {"launch": CHECKS}


@pytest.fixture(scope="module", params=launches.params(CHECKS, slow=["mpi"]),
                ids=lambda c: f"{c}-2")
def launch(request):
    return run_local(CHECKS[request.param], np=2, controller=request.param, timeout=600)


def _get(launch, check):
    return launch.get(launches.read(check))


def _step_view(result, step):
    """One step of a multi-step result in the shape ``test_tf_packed``'s oracles take."""
    return {"entries": result["entries"][step], "buckets": result["buckets"],
            "grads": dict(zip(result["names"], result["grads"][step]))}


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("check", [dqsgd_allgather, dqsgd_alq_two_phase],
                         ids=["allgather", "alq-two_phase"])
def test_dqsgd_widths_agree_change_and_never_retrace(launch, check):
    from horovod_aq.levels import LevelTable

    results = _get(launch, check)
    bits = results[0]["bits"]
    assert all(r["bits"] == bits for r in results)          # identical on every step
    if check is dqsgd_allgather:
        assert len(set(bits)) > 1, bits                      # and they do change
    for r in results:
        assert r["headers"] == [[b] for b in bits]           # every payload states its bits
        assert r["telemetry_bits"] == bits
        assert r["traces"] == 1                              # a new width never retraces
        assert r["levels_vars"] == r["levels_f32"]           # every width's graph table
    assert results[0]["norms"] == results[1]["norms"]       # G bitwise the same on every rank
    assert results[0]["width_levels"] == results[1]["width_levels"]
    if check is dqsgd_alq_two_phase:                         # every width refitted twice
        assert results[0]["versions"] == [2] * len(results[0]["versions"])
    for k in results[0]["weights"]:
        np.testing.assert_array_equal(results[0]["weights"][k], results[1]["weights"][k])
    oracle = _assert_allgather_oracle if check is dqsgd_allgather else _assert_two_phase_oracle
    sizes = {}
    for step, b in enumerate(bits):
        table = LevelTable(*results[0]["tables"][step])
        assert table.bits == b
        oracle([_step_view(r, step) for r in results], table)  # decoded with that width's table
        total = sum(np.sum(g.astype(np.float64) ** 2) for g in results[0]["grads"][step])
        np.testing.assert_allclose(results[0]["norms"][step], np.sqrt(total), rtol=1e-12)
        sizes.setdefault(b, set()).add(results[0]["payload_bytes"][step])
        recorded = sum(e[5].size for e in results[0]["entries"][step] if e[1] == "submit")
        assert results[0]["payload_bytes"][step] == recorded  # telemetry: this width's bytes
    assert all(len(s) == 1 for s in sizes.values())


@pytest.mark.reads("dqsgd_width_mismatch")
def test_dqsgd_other_width_is_refused(launch):
    for message in _get(launch, dqsgd_width_mismatch):
        assert message.startswith("InvalidArgumentError"), message
        assert "payload size differs" in message and "DQSGD bit width" in message, message


@pytest.mark.parametrize("check", [ecq_allgather, ecq_two_phase, ecq_dqsgd, ecq_eager_entropy],
                         ids=["allgather", "two_phase", "around-dqsgd", "eager-entropy-two_phase"])
def test_ecq_in_function_follows_the_rules(launch, check):
    """Payloads and memory bitwise the oracle's ``codec.encode_compensated`` of the local
    gradient g and the memory h (x = g + α·h, h' = β·h + (g − g̃)), step after step: the
    compensated encode reads g̃ off its own codes (docs/dynamic.md §2.6)."""
    from horovod_aq.codec.stream import stream_uniforms
    from horovod_aq.levels import LevelTable

    results = _get(launch, check)
    tables = [LevelTable(*t) for t in results[0]["tables"]]
    if check is ecq_dqsgd:
        assert len({t.bits for t in tables}) > 1, [t.bits for t in tables]
    for rank, r in enumerate(results):
        assert r["traces"] == 1
        assert r["world"] == 2 and sorted(r["memory_by_rank"]) == [0, 1]
        assert r["elsewhere"] == [rank], "consolidated on another rank: this one keeps its own"
        assert r["memory_keys"] == sorted(b[0] for b in r["buckets"])
        assert sorted(r["memory_by_rank"][rank]) == r["memory_keys"] == sorted(r["own"])
        for name in r["memory_keys"]:
            np.testing.assert_array_equal(r["memory_by_rank"][rank][name], r["own"][name])
        hs = {}
        for name, numel, mode, params in r["buckets"]:
            two_phase = check in (ecq_two_phase, ecq_eager_entropy)
            assert mode == ("two_phase" if two_phase else "allgather")
            h = np.zeros(numel, np.float32)
            for step in range(len(r["entries"])):
                sent = [e for e in r["entries"][step] if e[0] == name and e[1] == "submit"]
                assert len(sent) == (1 if mode == "allgather" else 2)
                inp = np.concatenate([e[4] for e in sent])[:numel]
                g = np.concatenate([r["local"][step][n].ravel() for n in params])
                assert inp.tobytes() == (g + np.float32(ALPHA) * h).tobytes()   # x = g + α·h
                m = sent[0][4].size                  # coordinates per payload (chunk: padded)
                new = []
                for k, e in enumerate(sent):
                    lo, hi = min(k * m, numel), min((k + 1) * m, numel)
                    want = codec.encode_compensated(
                        g[lo:hi], h[lo:hi], ALPHA, BETA, tables[step], bucket_size=BUCKET,
                        numel=m, uniforms=stream_uniforms(m, tuple(int(c) for c in e[3])),
                        coding="entropy" if check is ecq_eager_entropy else "fixed")
                    assert want.payload.tobytes() == e[5].tobytes()
                    new.append(want.memory)
                decoded = np.concatenate([codec.decode(e[5], tables[step])
                                          for e in sent])[:numel]
                rule = np.float32(BETA) * h + (g - decoded)             # β·h + (g − g̃)
                h = np.concatenate(new)
                assert h.tobytes() == rule.tobytes()
            hs[name] = h
            kept = np.asarray(r["memory_by_rank"][rank][name])
            assert kept.dtype == np.float32 and kept.tobytes() == h.tobytes()   # bitwise
        for step, norm in enumerate(r["ef_norms"]):
            assert norm is not None and norm > 0
        final = np.sqrt(sum(np.sum(h.astype(np.float64) ** 2) for h in hs.values()))
        np.testing.assert_allclose(r["ef_norms"][-1], final, rtol=1e-5)
    for other in (0, 1):                             # every rank gathered the same memory
        for name in results[0]["memory_keys"]:
            np.testing.assert_array_equal(results[0]["memory_by_rank"][other][name],
                                          results[1]["memory_by_rank"][other][name])
    oracle = (_assert_two_phase_oracle if check in (ecq_two_phase, ecq_eager_entropy)
              else _assert_allgather_oracle)
    for step in range(len(results[0]["entries"])):  # the exchange itself is unchanged
        oracle([_step_view(r, step) for r in results], tables[step])


@pytest.mark.reads("ecq_checkpoint")
def test_ecq_checkpoint_round_trip(launch):
    for rank, r in enumerate(_get(launch, ecq_checkpoint)):
        assert r["world"] == 2 and r["owner"] == rank
        assert r["keys"] and len(r["keys"]) == r["buckets"] and r["nonzero"]
        assert r["fresh_identical"], "a compressor loaded from state_dict continues bitwise"
        assert r["rollback_identical"], "a traced compressor rolled back continues bitwise"
        assert r["step"] == 3 and r["traces"] == 1
        assert r["dropped"] == {}, "another world size restarts from zero"
        assert any("saved with 3 ranks" in m and "restarts from zero" in m
                   for m in r["warnings"]), r["warnings"]


@pytest.mark.reads("ecq_nonfinite_skip")
def test_ecq_skipped_step_updates_no_memory(launch):
    for r in _get(launch, ecq_nonfinite_skip):
        assert r["nan"] and r["skipped"] == [0.0, 1.0, 0.0], r
        assert r["kept"] and r["updated"], r


@pytest.mark.reads("keras_fit_ecq")
def test_keras_fit_with_ecq_trains(launch):
    r0, r1 = _get(launch, keras_fit_ecq)
    for a, b in zip(r0["weights"], r1["weights"]):
        np.testing.assert_array_equal(a, b)          # broadcast + identical averages
    assert r0["history"] == r1["history"]
    assert r0["steps"] == 50 and r0["bits"] == 4
    assert r0["history"][1] < r0["history"][0], r0["history"]
    assert r0["loss"] < 0.6 and r0["acc"] > 0.8, r0
    assert r0["ef_norm"] > 0 and len(r0["memory_keys"]) == r0["buckets"]


@pytest.mark.reads("ecq_auto")
def test_auto_error_feedback_keeps_one_memory_across_rebuilt_tapes(launch):
    """docs/quantizers.md §5.9 on TensorFlow: fails if "auto" stopped adding error feedback at
    2 bits, or if a tape rebuilt every step started a new memory; under Keras's Adam "auto"
    sends the plain quantizer (§5.11)."""
    for r in _get(launch, ecq_auto):
        assert (r["type"], r["inner_is_given"], r["one_wrapper"], r["one_exchange"]) == (
            "ErrorFeedback", True, True, True)
        assert len(r["norms"]) == 3 and all(n is not None and n > 0 for n in r["norms"])
        assert r["memory_keys"] == r["buckets"]
        assert (r["keras"], r["keras_off"], r["keras_adam"]) == (
            "ErrorFeedback", "TernGrad", "TernGrad")
