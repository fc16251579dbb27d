"""The packed exchange's per-rank decisions (horovod_aq.packed: marker, receive, params, chunks,
send, waiting, trainable), framework-free: every integration calls these, so they are checked
here once."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

import horovod_aq
from horovod_aq import codec
from horovod_aq.codec.stream import StreamKey
from horovod_aq.packed import chunks, marker, params, plan, receive, send, waiting
from horovod_aq.packed.cost import chunk_numel
from horovod_aq.packed.receive import JoinedRankError
from horovod_aq.packed.waiting import ExchangeStalledError

B = 8


def _table(bits=3):
    return horovod_aq.QSGD(bits=bits, bucket_size=B).table


def _payload(x, rank=0, part=0, table=None):
    return codec.encode(np.asarray(x, np.float32), table or _table(), bucket_size=B, norm="l2",
                        key=StreamKey(1, rank, 0, 0, part))


# ---------------------------------------------------------------- marker fields
def test_marker_fields_per_mode():
    t = _table()
    ag = marker.marker_for("allgather", 21, 4, t.bits, B)
    assert (ag.numel, ag.copies, ag.size) == (21, 1, codec.payload_size(21, t.bits, B))
    m = chunk_numel(21, 4, B)
    tp = marker.marker_for("two_phase", 21, 4, t.bits, B)
    assert (tp.numel, tp.copies, tp.size) == (m, 4, codec.payload_size(m, t.bits, B))
    copies = tp.payloads(t, B, "l2", 17)
    assert len(copies) == 4 and all(c.size == tp.size for c in copies)
    for c in copies:   # every copy names the first bad element of the whole bucket
        header = codec.parse_header(c)
        assert header.nonfinite and header.first_nonfinite == 17
        assert not c[codec.HEADER_SIZE:].any()
    with pytest.raises(ValueError, match="packed payloads only"):
        marker.marker_for("allreduce", 21, 4, t.bits, B)
    assert marker.marker_index(2**40) == marker.MAX_MARKER_INDEX == 2**32 - 1


# ---------------------------------------------------------------- element -> parameter
def test_param_at_and_param_starts_agree():
    names, numels = ["a", "b", "c"], [3, 0, 5]
    offsets = params.contiguous_offsets(numels)
    assert offsets == [0, 3, 3]
    assert [params.param_at(e, offsets, numels, names) for e in (0, 2, 3, 7, 8, None)] == \
        ["a", "a", "c", "c", None, None]
    starts, ordered = params.param_starts([5, 0], ["late", "early"])
    assert starts.tolist() == [0, 5] and ordered == ["early", "late"]
    assert ordered[int(np.searchsorted(starts, 6, side="right")) - 1] == "late"
    assert params.contiguous_offsets([]) == []


# ---------------------------------------------------------------- receive outcome
def test_receive_outcome_ok_skip_and_raise_naming_rank_and_parameter():
    t = _table()
    good = _payload(np.arange(12) / 7.0, table=t)
    bad = marker.marker_for("allgather", 12, 2, t.bits, B).payload(t, B, "l2", 9)
    lookup = lambda e: params.param_at(e, [0, 8], [8, 4], ["w", "b"])   # noqa: E731
    rows = np.stack([good, good])
    assert receive.receive_outcome(rows, nonfinite="raise", bucket="x", collective="aq.ag.x",
                                   param_at=lookup) == receive.OK
    rows = np.stack([good, bad])
    assert receive.receive_outcome(rows, nonfinite="skip", bucket="x",
                                   collective="aq.ag.x") == receive.SKIP
    with pytest.raises(codec.NonFiniteGradientError) as err:
        receive.receive_outcome(rows, nonfinite="raise", bucket="x", collective="aq.ag.x",
                                param_at=lookup)
    assert "on rank 1" in str(err.value) and "'b'" in str(err.value) and err.value.first == 9
    with pytest.raises(ValueError, match="nonfinite"):
        receive.receive_outcome(rows, nonfinite="ignore", bucket="x", collective="c")


def test_a_two_phase_marker_names_the_parameter_too():
    """Every chunk's marker carries the first bad element of the whole bucket, so the rank that
    averages any chunk names the parameter (the torch optimizer used to drop it)."""
    t = _table()
    n, P = 40, 4
    spec = marker.marker_for("two_phase", n, P, t.bits, B)
    copies = spec.payloads(t, B, "l2", 33)
    m = spec.numel
    good = _payload(np.ones(m), table=t)
    for r in range(P):    # rank r receives chunk r from every rank; rank 2 sent markers
        rows = np.stack([good, good, copies[r], good])
        with pytest.raises(codec.NonFiniteGradientError, match="on rank 2") as err:
            receive.receive_outcome(
                rows, nonfinite="raise", bucket="x", collective="aq.a2a.x",
                param_at=lambda e: params.param_at(e, [0, 30], [30, 10], ["big", "tail"]))
        assert "'tail'" in str(err.value)


def test_rows_without_the_magic_are_joined_ranks():
    good = _payload(np.ones(10))
    rows = [good, np.zeros_like(good), good[:0]]     # a zero-filled row, an empty one
    with pytest.raises(JoinedRankError, match=r"rank\(s\) 1, 2 called hvd.join\(\)"):
        receive.receive_outcome(rows, nonfinite="raise", bucket="x", collective="aq.ag.x")
    # transports that do not zero-fill joined ranks: the check is left to the decoder
    assert receive.receive_outcome(rows, nonfinite="raise", bucket="x", collective="c",
                                   joined=False) == receive.OK


# ---------------------------------------------------------------- two-phase chunk spans
def test_chunk_zero_spans_cover_the_padding_and_absent_parameters():
    n, P = 21, 4
    m = chunk_numel(n, P, B)                     # 8: chunks [0,8) [8,16) [16,24) [24,32)
    assert [chunks.chunk_valid(n, m, r) for r in range(P)] == [8, 8, 5, 0]
    assert chunks.chunk_zero_spans(n, m, 0) == []
    assert chunks.chunk_zero_spans(n, m, 2) == [(5, 8)]
    assert chunks.chunk_zero_spans(n, m, 3) == [(0, 8)]
    # parameter (6, 4) = elements 6..9 had no gradient on any rank
    assert chunks.chunk_zero_spans(n, m, 0, [(6, 4)]) == [(6, 8)]
    assert chunks.chunk_zero_spans(n, m, 1, [(6, 4)]) == [(0, 2)]
    assert chunks.chunk_zero_spans(n, m, 2, [(6, 4), (19, 2)]) == [(5, 8), (3, 5)]


def test_chunk_param_parts_expand_to_the_chunks_coordinates():
    n, P = 21, 4
    m = chunk_numel(n, P, B)                     # 8: chunks [0,8) [8,16) [16,24) [24,32)
    offsets, numels = (0, 6, 10, 10, 19), (6, 4, 0, 9, 2)   # an empty parameter at 10
    parts = [chunks.chunk_param_parts(n, m, r, offsets, numels) for r in range(P)]
    assert parts == [(0, [6, 2]), (1, [2, 0, 6]), (3, [3, 2]), (0, [])]
    for r, (first, counts) in enumerate(parts):   # np.repeat of the owners: each coordinate's
        owner = np.repeat(np.arange(first, first + len(counts)), counts)
        valid = chunks.chunk_valid(n, m, r)
        want = [max(j for j in range(len(offsets)) if offsets[j] <= r * m + i and numels[j])
                for i in range(valid)]
        assert owner.tolist() == want
        # the same zeros as chunk_zero_spans, for every set of absent parameters
        for absent in ([1], [0, 4], [3]):
            zero = np.zeros(m, bool)
            for lo, hi in chunks.chunk_zero_spans(n, m, r, [(offsets[k], numels[k])
                                                            for k in absent]):
                zero[lo:hi] = True
            assert (np.isin(owner, absent) == zero[:valid]).all()


# ---------------------------------------------------------------- send order
def _numpy_steps(log, ranks, mode, ef=None, name="b"):
    q = horovod_aq.QSGD(bits=3, bucket_size=B)
    n_box = {}

    def parts(x):
        if mode == "allgather":
            return [x]
        m = chunk_numel(x.size, ranks, B)
        padded = np.zeros(ranks * m, np.float32)
        padded[:x.size] = x
        return list(padded.reshape(ranks, m))

    def first_bad(raw, x):
        n_box["n"] = raw.size
        log.append("check")
        return send.first_bad_element(
            raw, x, first_nonfinite=lambda v: (int(np.argmax(~np.isfinite(v)))
                                               if not np.isfinite(v).all() else None),
            peak=lambda v: float(np.abs(v).max()) if v.size else 0.0,
            norms=lambda v: codec.bucket_norms(v, B),
            bucket_size=B)

    def encode(part, k):
        log.append(f"encode {k}")
        return _payload(part, part=k, table=q.table)

    def markers(bad):
        log.append(f"markers {bad}")
        spec = marker.marker_for(mode, n_box["n"], ranks, q.table.bits, B)
        return spec.payloads(q.table, B, "l2", bad)

    def compensate(raw):
        log.append("compensate")
        return raw if ef is None else ef.compensate(name, raw)

    return q, send.SendSteps(compensate=compensate, first_bad=first_bad,
                             record=lambda x: log.append("record"), parts=parts,
                             encode=encode, markers=markers)


@pytest.mark.parametrize("mode", ["allgather", "two_phase"])
def test_send_bucket_runs_the_steps_in_order_and_updates_memory_from_what_was_sent(mode):
    ranks = 3
    ef = horovod_aq.ErrorFeedback(horovod_aq.QSGD(bits=3, bucket_size=B), alpha=1.0, beta=1.0)
    log = []
    q, steps = _numpy_steps(log, ranks, mode, ef=ef)
    raw = np.linspace(-1, 1, 20).astype(np.float32)

    def update(g, payloads):
        log.append("update")
        sent = send.sent_values(payloads, lambda p: codec.decode(p, q.table), np.concatenate,
                                g.size)
        ef.update("b", g, sent)

    payloads = send.send_bucket(raw, steps, update)
    parts = 1 if mode == "allgather" else ranks
    assert log == ["compensate", "check", "record"] + [f"encode {k}" for k in range(parts)] + \
        ["update"]
    assert len(payloads) == parts
    sent = np.concatenate([codec.decode(p, q.table) for p in payloads])[:raw.size]
    np.testing.assert_array_equal(ef.memory["b"], raw - sent)       # h = g − g̃ at first use
    assert send.reencode_part(ranks) == ranks


@pytest.mark.parametrize("mode", ["allgather", "two_phase"])
def test_send_bucket_sends_markers_for_what_cannot_travel(mode):
    ranks = 2
    log = []
    _, steps = _numpy_steps(log, ranks, mode)
    raw = np.ones(20, np.float32)
    raw[13] = np.nan
    out = send.send_bucket(raw, steps, lambda g, p: log.append("update"))
    assert log == ["compensate", "check", "markers 13"]
    assert len(out) == (1 if mode == "allgather" else ranks)
    assert all(codec.parse_header(p).first_nonfinite == 13 for p in out)
    # finite values whose bucket norm overflows float32: the first element of that bucket
    log.clear()
    big = np.ones(20, np.float32)
    big[B:2 * B] = 3e38
    send.send_bucket(big, steps)
    assert log == ["compensate", "check", f"markers {B}"]


@pytest.mark.parametrize("mode", ["allgather", "two_phase"])
def test_send_bucket_decided_after_the_encode_encodes_first_and_sends_what_decide_chose(mode):
    """``SendSteps.decide`` (the device's choice of markers, tests/test_torch_markers.py for its
    bytes): step 4 first, then step 2 on x and the payloads; it never records or updates."""
    ranks = 3
    log = []
    _, steps = _numpy_steps(log, ranks, mode)
    raw = np.linspace(-1, 1, 20).astype(np.float32)
    chosen = []

    def decide(x, payloads):
        log.append("decide")
        np.testing.assert_array_equal(x, raw)
        chosen.extend(p[::-1] for p in payloads)   # stands for "replaced by markers"
        return chosen

    steps = dataclasses.replace(steps, decide=decide)
    assert send.send_bucket(raw, steps) is chosen
    parts = 1 if mode == "allgather" else ranks
    assert log == ["compensate"] + [f"encode {k}" for k in range(parts)] + ["decide"]
    with pytest.raises(ValueError, match="without error memory"):
        send.send_bucket(raw, steps, lambda g, p: None)


def _fused_step(log, ranks, mode, ef, table, name="b"):
    """``SendSteps.encode_compensated`` from the numpy oracle (``codec.encode_compensated`` per
    part, the keys of ``_payload``): payloads and an install that is logged."""
    mem = ef.error_memory

    def step(raw):
        log.append("fused")
        n = raw.size
        m = n if mode == "allgather" else chunk_numel(n, ranks, B)
        spans = [(min(k * m, n), min((k + 1) * m, n)) for k in range(1 if mode == "allgather"
                                                                    else ranks)]
        h = mem.memory.get(name)
        sent = []
        for k, (lo, hi) in enumerate(spans):
            try:
                sent.append(codec.encode_compensated(
                    raw[lo:hi], None if h is None else h[lo:hi], mem.alpha, mem.beta, table,
                    bucket_size=B, numel=m, key=StreamKey(1, 0, 0, 0, k)))
            except ValueError:
                return None
        new = np.concatenate([c.memory for c in sent])
        finite = all(c.memory_finite for c in sent)

        def install():
            log.append("install")
            mem.install(name, new, raw, finite=finite)
        return send.Fused([c.payload for c in sent], install)
    return step


@pytest.mark.parametrize("mode", ["allgather", "two_phase"])
@pytest.mark.parametrize("recording", [True, False])
def test_send_bucket_with_a_fused_step_sends_and_remembers_what_the_steps_do(mode, recording):
    # steps 1, 4, 5 in one pass: the same payloads and memory as the five steps; step 3 only
    # when recording (x computed for it), the memory installed last
    ranks = 3
    efs = [horovod_aq.ErrorFeedback(horovod_aq.QSGD(bits=3, bucket_size=B), alpha=0.5,
                                    beta=0.9) for _ in range(2)]
    log, fused_log = [], []
    q, steps = _numpy_steps(log, ranks, mode, ef=efs[0])
    _, plain = _numpy_steps(fused_log, ranks, mode, ef=efs[1])
    fused = dataclasses.replace(plain, encode_compensated=_fused_step(
        fused_log, ranks, mode, efs[1], q.table), recording=lambda: recording)

    def update(g, payloads):
        sent = send.sent_values(payloads, lambda p: codec.decode(p, q.table), np.concatenate,
                                g.size)
        efs[0].update("b", g, sent)

    for seed in range(2):                       # the first use of the memory, then h ≠ 0
        raw = np.random.default_rng(seed).standard_normal(21).astype(np.float32)
        want = send.send_bucket(raw, steps, update)
        fused_log.clear()
        got = send.send_bucket(raw, fused, lambda g, p: fused_log.append("update"))
        assert fused_log == ["fused"] + (["compensate", "record"] if recording else []) + \
            ["install"]
        assert [p.tobytes() for p in got] == [p.tobytes() for p in want]
        assert efs[1].memory["b"].tobytes() == efs[0].memory["b"].tobytes()


@pytest.mark.parametrize("mode", ["allgather", "two_phase"])
def test_a_failed_fused_step_sends_the_markers_of_the_steps_and_installs_nothing(mode):
    ranks = 2
    ef = horovod_aq.ErrorFeedback(horovod_aq.QSGD(bits=3, bucket_size=B), alpha=1.0, beta=1.0)
    log = []
    q, plain = _numpy_steps(log, ranks, mode, ef=ef)
    steps = dataclasses.replace(plain, encode_compensated=_fused_step(log, ranks, mode, ef,
                                                                      q.table))
    ef.error_memory.memory["b"] = h = np.zeros(20, np.float32)
    raw = np.ones(20, np.float32)
    raw[13] = np.nan
    out = send.send_bucket(raw, steps)
    assert log == ["fused", "compensate", "check", "markers 13"]
    assert ef.memory["b"] is h and all(codec.parse_header(p).first_nonfinite == 13 for p in out)
    log.clear()
    big = np.ones(20, np.float32)
    big[B:2 * B] = 3e38                         # finite, a bucket norm past float32
    send.send_bucket(big, steps)
    assert log == ["fused", "compensate", "check", f"markers {B}"]
    # a fused step that refuses what the check lets travel is a bug, not markers
    refusing = dataclasses.replace(plain, encode_compensated=lambda raw: None)
    with pytest.raises(RuntimeError, match="please report this bug"):
        send.send_bucket(np.ones(20, np.float32), refusing)


def test_first_bad_element_checks_the_compensated_values_too():
    raw = np.ones(6, np.float32)
    x = raw.copy()
    x[4] = np.inf
    kwargs = dict(first_nonfinite=lambda v: (int(np.argmax(~np.isfinite(v)))
                                             if not np.isfinite(v).all() else None),
                  peak=lambda v: float(np.abs(v).max()),
                  norms=lambda v: codec.bucket_norms(v, 4), bucket_size=4)
    assert send.first_bad_element(raw, x, **kwargs) == 4
    assert send.first_bad_element(raw, raw, **kwargs) is None


# ---------------------------------------------------------------- waiting
def test_wait_until_polls_and_ends_a_stalled_wait_with_an_error():
    calls = []

    def done():
        calls.append(1)
        return len(calls) > 3
    waiting.wait_until(done, waiting.FOREVER, "aq.ag.x")
    assert len(calls) == 4
    started = time.monotonic()
    deadline = waiting.Deadline(0.05, step=lambda: 5)
    with pytest.raises(ExchangeStalledError) as err:
        waiting.wait_until(lambda: False, deadline, "aq.handshake")
    assert time.monotonic() - started < 5
    text = str(err.value)
    assert "'aq.handshake'" in text and "at step 5" in text and "comparing settings" in text
    assert waiting.doing("aq.efstate.x") == "gathering error-feedback memory for a checkpoint"
    err = waiting.Deadline(1.0).stalled("aq.ag.b", "b", "encoding")
    assert "at step" not in str(err) and "of bucket b" in str(err) and "encoding" in str(err)


def test_one_handshake_name_for_every_framework():
    assert plan.handshake_name() == "aq.handshake"


def test_sent_bytes_of_each_exchange():
    assert send.sent_bytes("allgather", [100], 0, 4) == (100, 300)
    # two-phase: all P chunks are this rank's payloads; all but its own leave it
    assert send.sent_bytes("two_phase", [10, 20, 30], 1, 3) == (60, 40)
    # a re-encoded chunk goes out like an allgather payload
    assert send.sent_bytes("allgather", [7], 2, 3)[1] == 14


# ---------------------------------------------------------------- what trains (packed.trainable)
def test_a_change_of_what_trains_is_planned_again():
    from horovod_aq.packed.trainable import Trainable, replan_reason

    head = Trainable.of([("head.w", 640), ("head.b", 10)])
    assert replan_reason(head, Trainable.of([("head.w", 640), ("head.b", 10)])) is None
    both = Trainable.of([("body.w", 1280), ("body.b", 64), ("head.w", 640), ("head.b", 10)])
    assert str(both) == f"4 tensors, 1,994 elements (set {both.digest:08x})"
    assert replan_reason(head, both) == (
        "the trainable parameters changed: 2 joined ('body.w', 'body.b'); now " + str(both))
    assert replan_reason(both, head).endswith("2 left ('body.w', 'body.b'); now " + str(head))
    swapped = replan_reason(head, Trainable.of([("body.w", 1280)]))
    assert "1 joined ('body.w'); 2 left ('head.w', 'head.b')" in swapped
    reordered = Trainable.of([("head.b", 10), ("head.w", 640)])
    assert "their order or sizes changed" in replan_reason(head, reordered)
    many = Trainable.of([(f"p{i}", 1) for i in range(6)])
    assert "6 joined ('p0', 'p1', 'p2', 'p3' and 2 more)" in replan_reason(Trainable.of([]), many)


def test_the_agreement_on_what_trains_fails_alike_on_every_rank():
    from horovod_aq.packed.protocol import ConfigMismatchError
    from horovod_aq.packed.trainable import Trainable, agree_first, agreement_row, check_agreement

    head = Trainable.of([("head.w", 640), ("head.b", 10)])
    both = Trainable.of([("body.w", 1280), ("head.w", 640), ("head.b", 10)])
    row = agreement_row(head, 0xABC)
    assert row.dtype == np.int64 and row.tolist() == [head.digest, 2, 650, 0xABC]
    check_agreement(np.stack([row, row]))    # the same everywhere: nothing to say
    rows = np.stack([agreement_row(both, 0xDEF), row])
    with pytest.raises(ConfigMismatchError) as err:
        check_agreement(rows)
    message = str(err.value)
    assert "requires_grad and call add_param_group identically on every rank" in message
    assert f"rank 0: 3 tensors, 1,930 elements (set {both.digest:08x}), layout 00000def" in message
    assert f"rank 1: 2 tensors, 650 elements (set {head.digest:08x}), layout 00000abc" in message
    with pytest.raises(ConfigMismatchError) as again:   # a function of the rows alone
        check_agreement(rows.reshape(-1))
    assert str(again.value) == message
    with pytest.raises(ConfigMismatchError) as keras:   # the TensorFlow exchange's words
        check_agreement(rows, "tensorflow")
    assert "(layer.trainable and compile, the tape's sources)" in str(keras.value)
    assert str(keras.value).endswith(message.split("step: ", 1)[1].split(":\n", 1)[1])
    assert plan.agreement_name("qsgd.c1234abcd") == "aq.trainable.qsgd.c1234abcd"
    assert waiting.doing("aq.trainable.qsgd.c1") == (
        "agreeing with the other ranks on which parameters train")
    # collected before a handshake only once one passed in this world
    assert agree_first(handshake_due=True, handshaken_in_world=True)
    assert not agree_first(handshake_due=True, handshaken_in_world=False)
    assert not agree_first(handshake_due=False, handshaken_in_world=True)


def test_the_agreement_travels_as_sums_that_count_the_ranks_and_detect_any_difference():
    """docs/protocol.md §3.1: [1, x, x²] summed over the ranks that took part; A·Q = S² for every
    limb exactly when every row is the same (Cauchy–Schwarz). Checked on rows where a plain sum
    could not tell (the mean of three rows equal to one of them), on random rows, at the int64
    bound, and with joined ranks (they add zeros)."""
    from horovod_aq.packed.protocol import ConfigMismatchError
    from horovod_aq.packed.trainable import (
        MAX_SUM_RANKS,
        agreement_sums,
        agreement_terms,
        check_agreement,
        check_agreement_sums,
        refuse_joined,
    )

    def summed(rows):   # what the allreduce gives; a joined rank adds zeros
        return sum(agreement_terms(r) for r in rows)

    row = np.array([0xDEADBEEF, 12, 9_400_000_000, 0x12345678], np.int64)
    assert agreement_terms(row).shape == (33,)
    assert agreement_sums(summed([row] * 5)) == (5, True)
    # a sum alone would pass this: the middle row is the mean of the three
    low, mid, high = row.copy(), row.copy(), row.copy()
    low[1], mid[1], high[1] = 11, 12, 13
    assert agreement_sums(summed([low, mid, high])) == (3, False)
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows = [rng.integers(0, 2**32, 4, dtype=np.int64) for _ in range(rng.integers(2, 9))]
        if rng.random() < 0.5:
            rows = [rows[0]] * len(rows)
        same = all(np.array_equal(r, rows[0]) for r in rows)
        assert agreement_sums(summed(rows)) == (len(rows), same)
    top = np.full(4, -1, np.int64)   # every limb 0xFFFF: the sums' bound
    assert agreement_sums(agreement_terms(top) * MAX_SUM_RANKS) == (MAX_SUM_RANKS, True)
    # two of three ranks still train (the third joined: zeros) and agree
    assert check_agreement_sums(summed([row, row]), 3, gather_rows=None) == 2
    with pytest.raises(ConfigMismatchError, match="while 1 of 3 ranks joined"):
        check_agreement_sums(summed([low, high]), 3, gather_rows=None)
    with pytest.raises(ConfigMismatchError, match="rank 1: 13 tensors"):   # every rank: rows
        check_agreement_sums(summed([low, high]), 2, gather_rows=lambda: np.stack([low, high]))
    with pytest.raises(ValueError, match="up to 32768 ranks"):
        check_agreement_sums(summed([row]), MAX_SUM_RANKS + 1, gather_rows=None)
    refuse_joined(2, 2, "aq.trainable.k")
    with pytest.raises(JoinedRankError, match="1 of 2 ranks called hvd.join()"):
        refuse_joined(1, 2, "aq.trainable.k")
    with pytest.raises(JoinedRankError, match="rank\\(s\\) 1 called hvd.join()"):
        check_agreement(np.stack([row, np.zeros(4, np.int64)]))   # a zero row: joined


def test_the_watchdog_ends_a_wait_that_cannot_poll_once_and_names_it():
    from horovod_aq.packed.watchdog import Watchdog

    expired = []
    dog = Watchdog(expired.append)
    assert dog.arm(waiting.Deadline(None), "aq.ag.x") == 0       # no deadline: not watched
    token = dog.arm(waiting.Deadline(0.05, step=lambda: 3), "aq.ag.x", "x")
    dog.disarm(token)                                           # done in time
    time.sleep(0.15)
    assert expired == [] and dog.stalled is None
    dog.arm(waiting.Deadline(0.05, step=lambda: 7), "aq.trainable.k, aq.ag.x", None,
            waiting.EXCHANGING)
    dog.arm(waiting.Deadline(30.0), "aq.ag.y")
    dog.settle(5.0)     # nothing stalled yet: returns at once
    deadline = time.monotonic() + 5
    while dog.stalled is None and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.settle(5.0)
    assert len(expired) == 1 and expired[0] is dog.stalled
    message = str(dog.stalled)
    assert ("collective 'aq.trainable.k, aq.ag.x' did not complete within 0.05 s at step 7"
            in message)
    assert dog.arm(waiting.Deadline(0.01), "aq.ag.z") == 0     # after a stall nothing more
    time.sleep(0.05)
    assert len(expired) == 1


def test_reencode_chunk_sends_a_marker_only_for_an_unsendable_average():
    def refuse(chunk):
        raise ValueError("bucket 0 has a norm that overflows float32")

    kw = {"marker": lambda bad: ("marker", bad)}
    assert send.reencode_chunk([1.0], 2, 10, encode=lambda c: "payload",
                               first_bad=lambda c: 0, **kw) == "payload"
    assert send.reencode_chunk([1.0], 2, 10, encode=refuse, first_bad=lambda c: 3,
                               **kw) == ("marker", 23)   # element r·m + j of the bucket
    with pytest.raises(ValueError, match="overflows"):   # sendable after all: another error
        send.reencode_chunk([1.0], 2, 10, encode=refuse, first_bad=lambda c: None, **kw)
