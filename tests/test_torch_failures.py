"""Hostile failure modes of the packed PyTorch optimizer, on 2 real ranks (Gloo and MPI).

Each check provokes one way a real training script goes wrong — parameters without a gradient,
a finite gradient too large to quantize, an extra optimizer on one rank, a backward pass that
fails and is retried, parameters added after wrapping, a tail chunk of zero padding, a rank that
stops early — and asserts what every rank sees: the same result or the same error, never a
hang. The check that leaves a collective behind (a stalled exchange) runs in a launch of its
own, with a short stall timeout. Uneven steps with ``hvd.join()``, which the optimizer supports,
run in tests/test_horovod_patterns.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from horovod_aq.tools.launcher import run_local
from tests import launches
from tests.ranks import init_torch

STALL_S = 4.0   # the stall timeout of the stall launch (seconds)


def _qsgd(**kw):
    import horovod_aq

    kw.setdefault("bits", 3)
    kw.setdefault("bucket_size", 4)
    kw.setdefault("seed", 3)
    return horovod_aq.QSGD(**kw)


def _error(fn):
    """(exception type name, message) of what ``fn()`` raised, or None."""
    try:
        fn()
    except Exception as exc:   # noqa: BLE001 — the checks report it
        return type(exc).__name__, str(exc)
    return None


class _Three:
    """Three parameters: ``used`` always gets a gradient, ``unused`` never, ``half`` only on
    rank 0 (built with torch inside the ranks)."""

    def __init__(self, torch, rank):
        torch.manual_seed(0)
        self.module = torch.nn.Module()
        self.module.used = torch.nn.Parameter(torch.randn(6))
        self.module.unused = torch.nn.Parameter(torch.randn(5))
        self.module.partial = torch.nn.Parameter(torch.randn(3))
        self.rank = rank

    def loss(self, torch, step):
        gen = torch.Generator().manual_seed(100 * step + self.rank)
        x = torch.randn(6, generator=gen)
        loss = (self.module.used * x).sum() ** 2
        if self.rank == 0:
            loss = loss + (self.module.partial ** 2).sum()
        return loss


# ---------------------------------------------------------------- checks (inside the ranks)
def missing_gradients():
    """17.4: a parameter with no gradient on any rank stays bitwise unchanged and its .grad
    stays None (allgather and two-phase, SGD and Adam); one with a gradient on some ranks only
    gets Horovod's zeros from the others (a finite gradient on every rank)."""
    torch, hvd = init_torch()
    import horovod_aq.torch as aqt

    out = {}
    for exchange in ("allgather", "two_phase"):
        for kind in ("sgd", "adam"):
            m = _Three(torch, hvd.rank())
            params = m.module.named_parameters()
            base = (torch.optim.SGD(m.module.parameters(), lr=0.1) if kind == "sgd"
                    else torch.optim.Adam(m.module.parameters(), lr=0.1))
            opt = aqt.DistributedOptimizer(base, params, _qsgd(), exchange=exchange)
            before = m.module.unused.detach().clone()
            used_before = m.module.used.detach().clone()
            grads_none, halves = [], []
            for step in range(3):
                opt.zero_grad()
                m.loss(torch, step).backward()
                opt.step()
                grads_none.append(m.module.unused.grad is None)
                halves.append(m.module.partial.grad is not None
                              and bool(torch.isfinite(m.module.partial.grad).all()))
            out[f"{exchange}-{kind}"] = {
                "unused_same": bool(torch.equal(m.module.unused.detach(), before)),
                "unused_grad_none": all(grads_none),
                "used_moved": not bool(torch.equal(m.module.used.detach(), used_before)),
                "half_grad": all(halves),
                "weights": {k: v.detach().numpy().copy()
                            for k, v in m.module.state_dict().items()},
            }
    return out


def overflowing_norm():
    """17.5: finite values whose bucket norm overflows float32 on rank 0 only: every rank raises
    the same NonFiniteGradientError (nonfinite="raise") or skips the step (nonfinite="skip"),
    and the optimizer works on afterwards. And both ranks sending 3e38: a finite average."""
    torch, hvd = init_torch()
    import horovod_aq.torch as aqt

    rank = hvd.rank()
    out = {}

    def make(nonfinite, bucket_size=4):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.zeros(8))
        opt = aqt.DistributedOptimizer(
            torch.optim.SGD([p], lr=1e-3), [("p", p)],
            _qsgd(bucket_size=bucket_size, nonfinite=nonfinite), exchange="allgather")
        return p, opt

    def set_grad(p, value):
        p.grad = torch.full_like(p, value)

    for mode in ("raise", "skip"):
        p, opt = make(mode)
        set_grad(p, 2e38 if rank == 0 else 1.0)   # finite, but a bucket of 4 has norm 4e38
        err = _error(opt.step)
        value = p.detach().clone()
        again = None
        if mode == "skip":
            opt.zero_grad()
            set_grad(p, 0.5)
            again = _error(opt.step)
        out[mode] = {"error": err, "unchanged": bool(torch.equal(value, torch.zeros(8))),
                     "again": again,
                     "after": p.detach().numpy().copy()}

    p, opt = make("raise", bucket_size=2)
    p.grad = torch.tensor([3e38, 0.0] * 4)   # norm 3e38 per bucket: 3e38 travels exactly
    opt.synchronize()
    out["huge"] = {"finite": bool(torch.isfinite(p.grad).all()),
                   "grad": p.grad.numpy().copy()}
    with opt.skip_synchronize():
        opt.step()
    return out


def content_names():
    """17.2: rank 0 builds one more packed optimizer (an evaluation copy, first) than rank 1:
    the training optimizers still meet (names come from content, not a counter). And an
    error-feedback checkpoint loaded into a second optimizer for the same model in the same
    process restores the memory (its keys are content names)."""
    torch, hvd = init_torch()
    import horovod_aq
    import horovod_aq.torch as aqt
    from tests.ranks import tiny_model

    rank = hvd.rank()
    model = tiny_model(torch, 1)
    if rank == 0:   # an evaluation copy that never steps (the same content as the real one)
        import copy

        evaluated = copy.deepcopy(model)
        aqt.DistributedOptimizer(
            torch.optim.SGD(evaluated.parameters(), lr=0.1), evaluated.named_parameters(),
            horovod_aq.ErrorFeedback(_qsgd(bits=2), alpha=0.3, beta=0.8), fusion_bytes=4000)
    comp = horovod_aq.ErrorFeedback(_qsgd(bits=2), alpha=0.3, beta=0.8)
    opt = aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters(), comp, fusion_bytes=4000)
    import torch.nn.functional as F

    for step in range(2):
        gen = torch.Generator().manual_seed(step * 7 + rank)
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(8, 20, generator=gen)),
                        torch.randint(0, 10, (8,), generator=gen)).backward()
        opt.step()
    state = opt.state_dict()   # collective with error feedback
    comp2 = horovod_aq.ErrorFeedback(_qsgd(bits=2), alpha=0.3, beta=0.8)
    opt2 = aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    model.named_parameters(), comp2, fusion_bytes=4000)
    opt2.load_state_dict(state)
    mem = comp.error_memory.local_state()
    # What opt2 will use at its first exchange: the memory under its own bucket names.
    mem2 = {}
    for name, numel, _, _ in opt2.buckets:
        h = comp2.error_memory.saved(name, torch.zeros(numel))
        if h is not None:
            mem2[name] = h.numpy().copy()
    return {"weights": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
            "names": [b[0] for b in opt.buckets], "names2": [b[0] for b in opt2.buckets],
            "memory_norm": comp.error_memory.memory_norm(),
            "memory_same": sorted(mem) == sorted(mem2)
            and all(np.array_equal(mem[k], mem2[k]) for k in mem)}


def retried_backward():
    """17.10: rank 1's backward raises before anything was submitted, the script catches it,
    calls zero_grad() and retries: the step completes with the same weights on every rank. When
    the failure comes after part of the exchange was submitted, zero_grad() says what to do
    (step(), then zero_grad()), and following that keeps the ranks in step."""
    torch, hvd = init_torch()
    import torch.nn.functional as F

    import horovod_aq.torch as aqt
    from tests.ranks import tiny_model

    rank = hvd.rank()
    out = {}
    for case, fusion in (("early", 25 * 2**20), ("late", 400)):
        model = tiny_model(torch, 2)
        opt = aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       model.named_parameters(), _qsgd(), fusion_bytes=fusion)
        failed = {"armed": rank == 1}

        def boom(grad):
            if failed["armed"]:
                failed["armed"] = False
                raise RuntimeError("simulated failure in backward")
            return grad

        messages = []
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(8, 20, generator=gen)
            y = torch.randint(0, 10, (8,), generator=gen)
            opt.zero_grad()
            hidden = model[0](x)
            if step == 1:
                hidden.register_hook(boom)   # the first layer's gradients: the last to come
            loss = F.cross_entropy(model[2](model[1](hidden)), y)
            try:
                loss.backward()
            except RuntimeError as exc:
                messages.append(str(exc))
                err = _error(opt.zero_grad)
                messages.append(err)
                if err is None:   # nothing submitted yet: retry the backward
                    hidden = model[0](x)
                    F.cross_entropy(model[2](model[1](hidden)), y).backward()
                else:             # part of the exchange is out: complete it with the others
                    opt.step()
                    opt.zero_grad()
                    continue
            opt.step()
        out[case] = {"messages": messages,
                     "weights": {k: v.detach().numpy().copy()
                                 for k, v in model.state_dict().items()}}
    return out


def padded_tail_chunk():
    """17.7: a one-element parameter over the two-phase exchange: its chunk is mostly zero
    padding. Each rank's value is exactly representable (|x| / norm = 1), so the average must
    be exact — padding must not enter the re-encoded chunk's norm."""
    torch, hvd = init_torch()
    import horovod_aq.torch as aqt

    rank = hvd.rank()
    p = torch.nn.Parameter(torch.zeros(1))
    opt = aqt.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), [("w", p)],
                                   _qsgd(bits=2, bucket_size=4), exchange="two_phase",
                                   error_feedback=False)   # the plain 2-bit quantizer
    grads = []
    for step in range(6):
        mine = np.float32(0.2 if rank == 0 else 0.4) * np.float32(step + 1)
        p.grad = torch.full((1,), float(mine))
        opt.synchronize()
        grads.append(float(p.grad[0]))
        with opt.skip_synchronize():
            opt.step()
    return {"grads": grads, "modes": [b[2] for b in opt.buckets]}


def stalled_exchange():
    """17.2: the ranks step different optimizers (one rank is out of line): with a short stall
    timeout every rank ends with ExchangeStalledError naming its collective — no hang."""
    torch, hvd = init_torch()
    import horovod_aq.torch as aqt

    rank = hvd.rank()
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(6))
    b = torch.nn.Parameter(torch.randn(9))
    opt_a = aqt.DistributedOptimizer(torch.optim.SGD([a], lr=0.1), [("a", a)], _qsgd(),
                                     stall_timeout_s=STALL_S)
    opt_b = aqt.DistributedOptimizer(torch.optim.SGD([b], lr=0.1), [("b", b)], _qsgd(),
                                     stall_timeout_s=STALL_S)
    for opt, p in ((opt_a, a), (opt_b, b)):   # both handshakes, together
        opt.zero_grad()
        (p ** 2).sum().backward()
        opt.step()
    opt, p = (opt_a, a) if rank == 0 else (opt_b, b)
    opt.zero_grad()
    import time

    def step():   # the agreement is collected before the step's first bucket: in backward()
        (p ** 2).sum().backward()
        opt.step()
    started = time.monotonic()
    err = _error(step)
    return {"error": err, "seconds": time.monotonic() - started}


def checksummed_exchange():
    """checksum=True: every payload the optimizer encodes carries FLAG_CHECKSUM, the decoders
    verify it, and training is bitwise the one without (allgather and two-phase)."""
    torch, hvd = init_torch()
    import horovod_aq.torch as aqt
    from tests.ranks import ChecksumFlags, tiny_model

    out = {}
    for exchange in ("allgather", "two_phase"):
        for checksum in (False, True):
            model = tiny_model(torch, 0)
            opt = aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           model.named_parameters(),
                                           _qsgd(bucket_size=64, checksum=checksum),
                                           exchange=exchange)
            with ChecksumFlags(opt.wire) as flags:
                for step in range(2):
                    opt.zero_grad()
                    gen = torch.Generator().manual_seed(10 * step + hvd.rank())
                    model(torch.randn(8, 20, generator=gen)).square().mean().backward()
                    opt.step()
            out[(exchange, checksum)] = {"flags": flags.seen(), "weights": [
                p.detach().numpy().copy() for p in model.parameters()]}
    return out


CHECKS = [missing_gradients, overflowing_norm, content_names, retried_backward,
          padded_tail_chunk, checksummed_exchange]


@pytest.fixture(scope="module", params=launches.params(["gloo", "mpi"], slow=["mpi"]))
def launch(request):
    return run_local(CHECKS, np=2, controller=request.param, timeout=600)


@pytest.fixture(scope="module", params=launches.params(["gloo", "mpi"], slow=["mpi"]))
def stall_launch(request):
    # each of these leaves Horovod shut down or a collective behind: one launch each
    return run_local([stalled_exchange], np=2, controller=request.param, timeout=300)


# ---------------------------------------------------------------- tests
def _same_weights(a, b):
    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.multiprocess
def test_checksummed_exchange(launch):
    from horovod_aq import codec

    for r in launch.get(checksummed_exchange):
        for exchange in ("allgather", "two_phase"):
            plain, checked = r[(exchange, False)], r[(exchange, True)]
            assert plain["flags"] == [0] and checked["flags"] == [codec.FLAG_CHECKSUM]
            for a, b in zip(plain["weights"], checked["weights"]):
                np.testing.assert_array_equal(a, b)


@pytest.mark.multiprocess
def test_parameters_without_gradient_stay_unchanged(launch):
    results = launch.get(missing_gradients)
    for key, r0 in results[0].items():
        for r in results:
            assert r[key]["unused_same"], key
            assert r[key]["unused_grad_none"], key
            assert r[key]["used_moved"], key
            assert r[key]["half_grad"], key
        assert _same_weights(r0["weights"], results[1][key]["weights"]), key


@pytest.mark.multiprocess
def test_overflowing_norm_is_a_nonfinite_gradient_on_every_rank(launch):
    r0, r1 = launch.get(overflowing_norm)
    assert r0["raise"]["error"] is not None
    assert r0["raise"]["error"] == r1["raise"]["error"]
    assert r0["raise"]["error"][0] == "NonFiniteGradientError"
    assert "rank 0" in r0["raise"]["error"][1] and "'p'" in r0["raise"]["error"][1]
    for r in (r0, r1):
        assert r["skip"]["error"] is None and r["skip"]["unchanged"]
        assert r["raise"]["again"] is None and r["skip"]["again"] is None   # not broken
        assert r["huge"]["finite"]
        assert np.array_equal(r["huge"]["grad"][::2], np.full(4, np.float32(3e38)))
    assert np.array_equal(r0["skip"]["after"], r1["skip"]["after"])
    assert np.array_equal(r0["raise"]["after"], r1["raise"]["after"])


@pytest.mark.multiprocess
def test_names_do_not_depend_on_how_many_optimizers_a_rank_built(launch):
    r0, r1 = launch.get(content_names)
    assert _same_weights(r0["weights"], r1["weights"])
    assert r0["names"] == r1["names"] and r0["names2"] == r0["names"]
    for r in (r0, r1):
        assert r["memory_norm"] > 0
        assert r["memory_same"]


@pytest.mark.multiprocess
def test_a_failed_backward_can_be_retried_or_completed(launch):
    r0, r1 = launch.get(retried_backward)
    assert r0["early"]["messages"] == [] and r0["late"]["messages"] == []
    early = r1["early"]["messages"]
    assert len(early) == 2 and "simulated failure" in early[0] and early[1] is None
    assert _same_weights(r0["early"]["weights"], r1["early"]["weights"])
    late = r1["late"]["messages"]
    assert "simulated failure" in late[0]
    assert late[1][0] == "AssertionError" and "optimizer.step()" in late[1][1]
    assert _same_weights(r0["late"]["weights"], r1["late"]["weights"])


@pytest.mark.multiprocess
def test_two_phase_padding_adds_no_noise(launch):
    r0, r1 = launch.get(padded_tail_chunk)
    assert r0["modes"] == ["two_phase"]
    half = np.float32(2)
    expected = [float(np.float32(np.float32(0.2) * np.float32(k + 1)) / half
                      + np.float32(np.float32(0.4) * np.float32(k + 1)) / half)
                for k in range(6)]
    assert r0["grads"] == expected and r1["grads"] == expected


@pytest.mark.multiprocess
def test_a_stalled_exchange_ends_with_an_error_on_every_rank(stall_launch):
    results = stall_launch.get(stalled_exchange)
    stalled = 0
    for r in results:
        assert r["error"] is not None   # every rank ends with an error, none hangs
        kind, message = r["error"]
        assert r["seconds"] < 60
        if kind == "ExchangeStalledError":
            stalled += 1
            # the first collective a rank waits for in a step: the agreement on what trains
            assert "aq.trainable." in message and "which parameters train" in message
            assert "different collective" in message
            assert "at step 1" in message
        else:   # a rank whose peer ended first may see Horovod's shutdown instead
            assert kind == "HorovodInternalError", r["error"]
    assert stalled >= 1


# ---------------------------------------------------------------- the core decisions (no ranks)
def test_first_unsendable_flags_norms_past_float32():
    from horovod_aq.packed.protocol import FLOAT32_MAX, bucket_sendable, first_unsendable

    assert first_unsendable(np.array([1.0, FLOAT32_MAX, 3e38])) is None
    assert first_unsendable(np.array([1.0, 4e38, 5e38])) == 1            # float64 norms
    assert first_unsendable(np.array([1.0, np.inf], dtype=np.float32)) == 1
    assert first_unsendable(np.array([np.nan])) == 0
    assert bucket_sendable([2.0]) and not bucket_sendable([1e39])


def test_stall_timeout_setting(monkeypatch):
    from horovod_aq.packed.waiting import (
        DEFAULT_STALL_TIMEOUT_S,
        STALL_TIMEOUT_ENV,
        ExchangeStalledError,
        stall_timeout_s,
    )

    monkeypatch.delenv(STALL_TIMEOUT_ENV, raising=False)
    assert stall_timeout_s() == DEFAULT_STALL_TIMEOUT_S
    monkeypatch.setenv(STALL_TIMEOUT_ENV, "12.5")
    assert stall_timeout_s() == 12.5
    assert stall_timeout_s(3) == 3.0 and stall_timeout_s(0) is None
    monkeypatch.setenv(STALL_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=STALL_TIMEOUT_ENV):
        stall_timeout_s()
    with pytest.raises(ValueError):
        stall_timeout_s("5")
    err = ExchangeStalledError("aq.ag.b", bucket="b", step=7, doing="waiting", timeout_s=2)
    assert "'aq.ag.b'" in str(err) and "step 7" in str(err) and "different collective" in str(err)


def test_content_names_and_the_handshake_name():
    from horovod_aq.packed import plan

    key = plan.exchange_key("qsgd3b4", [("a", 6), ("b", 9)], ("auto", 100))
    assert key == plan.exchange_key("qsgd3b4", [("a", 6), ("b", 9)], ("auto", 100))
    assert key.startswith("qsgd3b4.c")
    assert key != plan.exchange_key("qsgd3b4", [("a", 6), ("b", 10)], ("auto", 100))
    assert key != plan.exchange_key("qsgd3b4", [("a", 6), ("b", 9)], ("two_phase", 100))
    assert plan.handshake_name() == "aq.handshake"   # one name, every framework


def test_joined_rows_are_rows_without_the_magic():
    from horovod_aq.packed.receive import joined_message, joined_rows

    assert joined_rows(np.array([[65, 81], [0, 0], [65, 81]], dtype=np.uint8)) == [1]
    assert joined_rows(np.array([[65, 81]], dtype=np.uint8)) == []
    assert "rank(s) 1, 2 called hvd.join()" in joined_message([1, 2], "aq.ag.x")


def test_norm_may_overflow_bounds_the_exact_check():
    import math

    from horovod_aq.packed.protocol import FLOAT32_MAX, first_unsendable, norm_may_overflow

    B = 64
    edge = FLOAT32_MAX / math.sqrt(B)
    assert not norm_may_overflow(edge, B) and norm_may_overflow(edge * 1.01, B)
    # at the bound every value equal: the norm is exactly FLOAT32_MAX, still sendable
    assert first_unsendable([math.sqrt(B) * edge * 0.999]) is None
