"""Failure modes on real ranks (PyTorch): non-finite gradients, misconfigured ranks, a rank that
dies, checkpoint/resume across jobs (also with another world size)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from horovod_aq.tools.launcher import LaunchError, run_local
from tests import launches
from tests.ranks import init_torch, tiny_model

pytestmark = pytest.mark.multiprocess


def _opt(torch, model, comp, **kw):
    import horovod_aq.torch as aqt

    return aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    model.named_parameters(), comp, fusion_bytes=4000, **kw)


def _batch(torch, rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 20, generator=gen), torch.randint(0, 10, (8,), generator=gen)


# ---------------------------------------------------------------- checks run inside the ranks
def _raise_once(torch, hvd, F, model, opt):
    x, y = _batch(torch, hvd.rank(), 9)
    if hvd.rank() == 1:
        x = x.clone()
        x[0, 0] = float("inf")   # an Inf input gives non-finite gradients on rank 1 only
    try:
        F.cross_entropy(model(x), y).backward()
        opt.step()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def nonfinite_skip_consistently():
    """nonfinite="skip": every rank skips the step (weights unchanged), then training goes on;
    with AMP's GradScaler the scale drops on every rank."""
    torch, hvd = init_torch()
    import torch.nn.functional as F

    import horovod_aq

    model = tiny_model(torch, 0)
    comp = horovod_aq.ALQ(bits=3, bucket_size=64, nonfinite="skip")
    opt = _opt(torch, model, comp)
    snapshots, skipped = [], []
    for step in range(4):
        x, y = _batch(torch, hvd.rank(), step)
        if step == 2 and hvd.rank() == 1:
            x = x.clone()
            x[0, 0] = float("nan")
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        snapshots.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())
        skipped.append(opt.telemetry.last.extra.get("skipped", 0.0))
    # GradScaler pattern (synchronize, unscale, step without a second exchange)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model2 = tiny_model(torch, 0)
    opt2 = _opt(torch, model2, horovod_aq.QSGD(bits=4, bucket_size=64, nonfinite="skip"))
    x, y = _batch(torch, hvd.rank(), 0)
    if hvd.rank() == 0:
        x = x.clone()
        x[1, 1] = float("inf")
    before = torch.cat([p.detach().reshape(-1) for p in model2.parameters()]).numpy()
    scaler.scale(F.cross_entropy(model2(x), y)).backward()
    opt2.synchronize()
    scaler.unscale_(opt2)
    with opt2.skip_synchronize():
        scaler.step(opt2)
    scaler.update()
    after = torch.cat([p.detach().reshape(-1) for p in model2.parameters()]).numpy()
    return {"snapshots": snapshots, "skipped": skipped, "scale": scaler.get_scale(),
            "amp_unchanged": bool(np.array_equal(before, after))}


def stock_nonfinite_skip():
    """Stock path with nonfinite="skip": the bad rank sends NaN, so every rank sees NaN."""
    torch, hvd = init_torch()
    import torch.nn.functional as F

    import horovod_aq

    model = tiny_model(torch, 0)
    comp = horovod_aq.QSGD(bits=3, nonfinite="skip")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=comp)
    x, y = _batch(torch, hvd.rank(), 0)
    if hvd.rank() == 1:
        x = x.clone()
        x[0, 0] = float("nan")
    F.cross_entropy(model(x), y).backward()
    opt.synchronize()
    return {n: bool(torch.isnan(p.grad).any()) for n, p in model.named_parameters()}


def misconfigured(kind: str):
    torch, hvd = init_torch()
    import torch.nn.functional as F

    import horovod_aq

    odd = hvd.rank() == 1
    sizes = (20, 64, 10)
    comp_kwargs = {"bits": 3, "bucket_size": 64}
    method = "qsgd"
    if kind == "bucket_size" and odd:
        comp_kwargs["bucket_size"] = 128
    if kind == "method" and odd:
        method = "nuqsgd"
    if kind == "parameters" and odd:
        sizes = (20, 64, 64, 10)
    model = tiny_model(torch, 0, sizes=sizes)
    comp = horovod_aq.from_name(method, **comp_kwargs)
    if kind == "table_version" and odd:
        comp.set_table(comp.table.with_version(5))
    opt = _opt(torch, model, comp)
    x, y = _batch(torch, hvd.rank(), 0)
    try:
        F.cross_entropy(model(x), y).backward()
        opt.step()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def nonfinite_stops(exchange: str):
    """Two healthy steps, then an Inf gradient on rank 1 only: the error every rank raises."""
    torch, hvd = init_torch()
    import torch.nn.functional as F

    import horovod_aq

    model = tiny_model(torch, 0)
    opt = _opt(torch, model, horovod_aq.QSGD(bits=3, bucket_size=64), exchange=exchange)
    for step in range(2):  # healthy steps first
        x, y = _batch(torch, hvd.rank(), step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _raise_once(torch, hvd, F, model, opt)


def nonfinite_allgather():
    return nonfinite_stops("allgather")


def nonfinite_two_phase():
    return nonfinite_stops("two_phase")


def misconfig_bucket_size():
    return misconfigured("bucket_size")


def misconfig_method():
    return misconfigured("method")


def misconfig_parameters():
    return misconfigured("parameters")


def misconfig_table_version():
    return misconfigured("table_version")


def train_steps(first: int, last: int, checkpoint: str | None = None, save: str | None = None):
    """Steps [first, last) of a run with ALQ (refits at 0 and 4), ECQ-SGD and two-phase
    exchange; load ``checkpoint`` first / save to ``save`` at the end (rank 0 writes)."""
    torch, hvd = init_torch()
    import logging

    import torch.nn.functional as F

    import horovod_aq

    warnings = []

    class Grab(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    grab = Grab(level=logging.WARNING)
    logging.getLogger("horovod_aq").addHandler(grab)
    model = tiny_model(torch, 0)
    comp = horovod_aq.ErrorFeedback(horovod_aq.ALQ(bits=3, bucket_size=64, schedule="0,4,0"))
    opt = _opt(torch, model, comp, exchange="two_phase")
    if checkpoint:
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    for step in range(first, last):
        x, y = _batch(torch, hvd.rank(), step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    if save:
        opt.consolidate_state_dict(to=0)   # every rank: rank 0 keeps every rank's memory
        if hvd.rank() == 0:                # Horovod's pattern: state_dict() on rank 0 only
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, save)
        hvd.barrier()
    logging.getLogger("horovod_aq").removeHandler(grab)   # a later check has its own
    return {"weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy(),
            "table": comp.table.levels, "version": comp.table.version, "step": comp.step,
            "memory_norm": comp.memory_norm(), "warnings": warnings}


def sleep_long(ready: str):
    """Say this rank is up (a file in ``ready``), then sleep in the check."""
    _, hvd = init_torch()
    open(os.path.join(ready, f"rank{hvd.rank()}"), "w").close()
    time.sleep(120)
    return "woke"


def train_and_save(last: int, save: str):
    """:func:`train_steps` from step 0 to ``last``, saved (a second check of the same launch)."""
    return train_steps(0, last, save=save)


def rank_dies():
    torch, hvd = init_torch()
    import signal

    import torch.nn.functional as F

    import horovod_aq

    model = tiny_model(torch, 0)
    opt = _opt(torch, model, horovod_aq.QSGD(bits=3))
    for step in range(10):
        if step == 3 and hvd.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = _batch(torch, hvd.rank(), step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return "finished"


#: One launch per controller runs them all; the checks that end in an error on every rank come
#: after the ones that train on.
CHECKS = [nonfinite_skip_consistently, stock_nonfinite_skip, misconfig_bucket_size,
          misconfig_method, misconfig_parameters, misconfig_table_version, nonfinite_allgather,
          nonfinite_two_phase]


@pytest.fixture(scope="module", params=launches.params(["gloo", "mpi"], slow=["mpi"]))
def launch(request):
    return run_local(CHECKS, np=2, controller=request.param, timeout=600)


def _same_error_everywhere(messages, *needles):
    assert len(set(messages)) == 1, messages
    for needle in needles:
        assert needle in messages[0], messages[0]


@pytest.mark.parametrize("check", [nonfinite_allgather, nonfinite_two_phase])
def test_nonfinite_gradient_stops_every_rank(launch, check):
    messages = launch.get(check)
    # every bucket fails; each rank meets them in its own order, all name the first bucket's
    _same_error_everywhere(messages, "NonFiniteGradientError", "rank 1", "'2.bias'")
    if check is nonfinite_allgather:   # the marker carries the element index → parameter name
        assert "for parameter '" in messages[0], messages[0]


def test_nonfinite_skip_is_consistent(launch):
    r0, r1 = launch.get(nonfinite_skip_consistently)
    for r in (r0, r1):
        assert r["skipped"] == [0.0, 0.0, 1.0, 0.0]
        np.testing.assert_array_equal(r["snapshots"][2], r["snapshots"][1])   # step 2 skipped
        assert not np.array_equal(r["snapshots"][3], r["snapshots"][2])       # then trains on
        assert np.isfinite(r["snapshots"][3]).all()
        assert r["amp_unchanged"] and r["scale"] == 512.0   # GradScaler halved its scale
    np.testing.assert_array_equal(r0["snapshots"][3], r1["snapshots"][3])


def test_stock_path_skip_sends_nan_to_everyone(launch):
    for r in launch.get(stock_nonfinite_skip):
        assert all(r.values()), r


@pytest.mark.parametrize("check, words", [
    (misconfig_bucket_size, ["bucket_size 64", "bucket_size 128"]),
    (misconfig_method, ["settings hash"]),
    (misconfig_parameters, ["layout"]),
    (misconfig_table_version, ["table v0", "table v5"]),
])
def test_misconfiguration_fails_everywhere_with_one_message(launch, check, words):
    messages = launch.get(check)
    _same_error_everywhere(messages, "ConfigMismatchError", *words)


@pytest.mark.parametrize("controller", launches.params(["gloo", "mpi"], slow=["mpi"]))
def test_an_interrupted_caller_leaves_no_rank_behind(controller, tmp_path):
    """A test runner's timeout signal (or Ctrl-C) arriving while run_local waits kills the
    launch's processes: ranks in their own session would otherwise spin on after the caller."""
    import signal

    import psutil

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        # every 0.5 s until both ranks are asleep in the check: then once, as a signal would
        if len(list(tmp_path.iterdir())) == 2:
            signal.setitimer(signal.ITIMER_REAL, 0)
            raise Interrupted

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5, 0.5)
    try:
        with pytest.raises(Interrupted):
            run_local([(sleep_long, {"ready": str(tmp_path)})], np=2, controller=controller,
                      timeout=300)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not left, [(p.pid, p.name()) for p in left]


@pytest.mark.parametrize("controller", launches.params(["gloo", "mpi"], slow=["mpi"]))
def test_dead_rank_ends_the_job_and_is_named(controller):
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run_local([rank_dies], np=2, controller=controller, timeout=240,
                  env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "20"})
    elapsed = time.monotonic() - t0
    assert elapsed < 120, f"the job took {elapsed:.0f}s to fail"
    text = str(info.value)
    assert ("Process name: 1" in text) or ("process rank 1" in text), text[-2000:]


def test_checkpoint_resume_is_bit_identical(tmp_path):
    ckpt = str(tmp_path / "ckpt.pt")
    # one launch: the uninterrupted run, then a new run of 3 steps that saves its checkpoint
    straight = run_local([(train_steps, {"first": 0, "last": 7}),
                          (train_and_save, {"last": 3, "save": ckpt})], np=2, controller="gloo",
                         timeout=300)
    straight.get("train_and_save")
    straight = straight.get("train_steps")
    resumed = run_local([(train_steps, {"first": 3, "last": 7, "checkpoint": ckpt})], np=2,
                        controller="mpi", timeout=300).get("train_steps")
    for a, b in zip(straight, resumed):
        np.testing.assert_array_equal(a["weights"], b["weights"])
        np.testing.assert_array_equal(a["table"], b["table"])
        assert (a["version"], a["step"]) == (b["version"], b["step"]) == (2, 7)
        assert a["memory_norm"] == b["memory_norm"] > 0
    # a 4-rank job resumes the 2-rank checkpoint: levels and steps kept, memory restarts
    wider = run_local([(train_steps, {"first": 3, "last": 4, "checkpoint": ckpt})], np=4,
                      controller="gloo", timeout=300).get("train_steps")
    for r in wider:
        assert r["step"] == 4 and r["version"] == 1
        assert any("saved with 2 ranks" in w for w in r["warnings"])
