"""Horovod's own program patterns, as Horovod writes them, with the packed PyTorch optimizer and
every default but ``bits``, at 2, 3 and 4 bits (error feedback is on by default at 2 and 3:
docs/quantizers.md §5.9), on real ranks (docs/horovod_compat.md).

* **Rank-0 checkpoints and resume** (Horovod's ``examples/pytorch/pytorch_imagenet_resnet50.py``):
  at the end of every epoch ``if hvd.rank() == 0: torch.save({..., 'optimizer':
  optimizer.state_dict()})`` on rank 0 alone; a new launch finds the latest epoch on rank 0,
  broadcasts it, loads the checkpoint on rank 0 only, then ``hvd.broadcast_parameters`` and
  ``hvd.broadcast_optimizer_state``, and trains on. ``state_dict()`` must return at once with no
  collective (a collective would leave rank 0 waiting: the launch sets a short stall deadline so
  that it would fail instead of hang), the replicas must end identical, the compressor must go
  on from the checkpoint's step and table, and at 4 bits (no error memory) the resumed run must
  be bitwise the uninterrupted one.
* **Uneven steps with ``hvd.join()``**: ranks with fewer batches join early; the others train
  on, each step averaged as Horovod does (the joined ranks count as zeros), and ``hvd.join()``
  returns in the time of the steps; the compressor's step and table stay in agreement, and after
  broadcasting from the rank ``hvd.join()`` returns (Horovod's pattern) the replicas train on
  identically. 2 ranks (Gloo; MPI in the slow matrix) and 3 ranks (Gloo, each rank a different
  number of batches).

Elastic Horovod's pattern (``hvd.elastic.TorchState(model, optimizer, ...)``) runs in
tests/test_elastic.py, the DDP hook under PyTorch's ``Join`` in tests/test_ddp.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from horovod_aq.tools.launcher import run_local
from tests import launches
from tests.ranks import init_torch

BITS = (2, 3, 4)
#: A short stall deadline: a rank-0-only state_dict() that ran a collective would fail within it
#: instead of waiting for the default 300 s.
STALL_S = 20
EPOCHS, STEPS_PER_EPOCH, BATCH = 3, 6, 16
SIZES = (20, 64, 10)


def _model_and_optimizer(torch, bits: int):
    import horovod_aq
    import horovod_aq.torch as aqt
    from tests.ranks import tiny_model

    model = tiny_model(torch, 0, SIZES)
    opt = aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=horovod_aq.ALQ(bits=bits, schedule="0,4"))
    return model, opt


def _batch(torch, rank: int, epoch: int, step: int):
    gen = torch.Generator().manual_seed(10_000 * epoch + 100 * step + rank)
    x = torch.randn(BATCH, SIZES[0], generator=gen)
    return x, (x[:, :SIZES[-1]].sum(1) > 0).long() + 2 * (x[:, 0] > 0).long()


def _fingerprint(torch, model, opt) -> str:
    import hashlib

    q = opt.compression.quantizer
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    digest.update(q.table.levels.tobytes())
    digest.update(f"{q.table.version}:{q.step}".encode())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------- checks (inside the ranks)
def imagenet_pattern(directory: str, epochs: int):
    """Horovod's ImageNet example, reduced to what it does around the training loop, for each
    bit width: resume from the latest checkpoint rank 0 finds, train up to ``epochs``, save on
    rank 0 at the end of every epoch."""
    torch, hvd = init_torch()
    import logging
    import time

    import torch.nn.functional as F

    lines = []

    class Grab(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    grab = Grab(level=logging.INFO)
    logging.getLogger("horovod_aq").addHandler(grab)
    logging.getLogger("horovod_aq").setLevel(logging.INFO)
    out = {}
    for bits in BITS:
        checkpoint = os.path.join(directory, f"alq{bits}-checkpoint-{{epoch}}.pth.tar")
        model, opt = _model_and_optimizer(torch, bits)
        resume_from_epoch = 0      # as Horovod's example: rank 0 looks, then broadcasts it
        if hvd.rank() == 0:
            for try_epoch in range(epochs, 0, -1):
                if os.path.exists(checkpoint.format(epoch=try_epoch)):
                    resume_from_epoch = try_epoch
                    break
        resume_from_epoch = hvd.broadcast(torch.tensor(resume_from_epoch), root_rank=0,
                                          name=f"resume_from_epoch.{bits}").item()
        if resume_from_epoch > 0 and hvd.rank() == 0:
            saved = torch.load(checkpoint.format(epoch=resume_from_epoch), weights_only=False)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        q = opt.compression.quantizer
        resumed = (q.step, q.table.version)
        save_seconds = []
        for epoch in range(resume_from_epoch, epochs):
            for step in range(STEPS_PER_EPOCH):
                x, y = _batch(torch, hvd.rank(), epoch, step)
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            if hvd.rank() == 0:    # save_checkpoint(epoch): rank 0 alone
                started = time.monotonic()
                state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                save_seconds.append(time.monotonic() - started)
                torch.save(state, checkpoint.format(epoch=epoch + 1))
            else:
                time.sleep(0.5)    # the other ranks are elsewhere (a collective would stall)
        out[bits] = {"resumed": resumed, "step": q.step, "version": q.table.version,
                     "error_feedback": opt.compression.error_memory is not None,
                     "fingerprint": _fingerprint(torch, model, opt),
                     "save_seconds": save_seconds}
    out["lines"] = lines
    logging.getLogger("horovod_aq").removeHandler(grab)   # a later check of the launch has its own
    return out


def imagenet_first_epochs(directory: str, epochs: int):
    """:func:`imagenet_pattern` as the second check of a launch (the first part of a resumed
    run, in its own directory)."""
    return imagenet_pattern(directory, epochs)


def uneven_join(steps: tuple[int, ...]):
    """Rank r trains ``steps[r]`` batches, then ``hvd.join()``; then, as Horovod's users do,
    broadcast parameters and optimizer state from the rank it returns, and train 2 more steps
    together. For each bit width."""
    torch, hvd = init_torch()
    import time

    import torch.nn.functional as F

    rank, size = hvd.rank(), hvd.size()
    out = {}
    for bits in BITS:
        model, opt = _model_and_optimizer(torch, bits)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        q = opt.compression.quantizer
        alone = []   # steps this rank trained alone: max |averaged − local/P| over parameters
        started = time.monotonic()
        for step in range(steps[rank]):
            x, y = _batch(torch, rank, 0, step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            local = [p.grad.clone() for p in model.parameters()]
            opt.synchronize()
            if step >= sorted(steps)[-2]:
                alone.append(max(float((p.grad - g / size).abs().max())
                                 for p, g in zip(model.parameters(), local)))
            with opt.skip_synchronize():
                opt.step()
        last = hvd.join()
        seconds = time.monotonic() - started
        at_join = (q.step, q.table.version, q.table.levels.tobytes())
        hvd.broadcast_parameters(model.state_dict(), root_rank=last)
        hvd.broadcast_optimizer_state(opt, root_rank=last)
        for step in range(2):
            x, y = _batch(torch, rank, 1, step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        out[bits] = {"last": last, "seconds": seconds, "at_join": at_join, "alone": alone,
                     "step": q.step, "fingerprint": _fingerprint(torch, model, opt)}
    return out


# ---------------------------------------------------------------- launches
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Three epochs, then (in the same launch, into another directory) two epochs saved on rank
    0; a new launch resumes from the latest checkpoint and trains the third."""
    env = {"HOROVOD_AQ_STALL_TIMEOUT_S": str(STALL_S)}
    straight = tmp_path_factory.mktemp("straight")
    resumed = tmp_path_factory.mktemp("resumed")
    run = run_local([(imagenet_pattern, {"directory": str(straight), "epochs": EPOCHS}),
                     (imagenet_first_epochs, {"directory": str(resumed), "epochs": EPOCHS - 1})],
                    np=2, controller="gloo", timeout=300, env=env)
    second = run_local([(imagenet_pattern, {"directory": str(resumed), "epochs": EPOCHS})],
                       np=2, controller="gloo", timeout=300, env=env)
    return {"straight": run.get(imagenet_pattern), "first": run.get(imagenet_first_epochs),
            "second": second.get(imagenet_pattern)}


#: (controller, ranks) -> the batches each rank trains before it joins.
JOIN_STEPS = {("gloo", 2): (6, 4), ("mpi", 2): (6, 4), ("gloo", 3): (7, 4, 5)}


@pytest.fixture(scope="module", params=launches.params(list(JOIN_STEPS), slow=[("mpi", 2)]),
                ids=lambda p: f"{p[0]}-{p[1]}")
def joined(request):
    controller, ranks = request.param
    steps = JOIN_STEPS[request.param]
    return steps, run_local([(uneven_join, {"steps": steps})], np=ranks, controller=controller,
                            timeout=300).get(uneven_join)


# ---------------------------------------------------------------- tests
@pytest.mark.multiprocess
@pytest.mark.parametrize("bits", BITS)
def test_rank_0_checkpoints_save_at_once_and_resume(checkpoints, bits):
    steps = EPOCHS * STEPS_PER_EPOCH
    straight = [r[bits] for r in checkpoints["straight"]]
    first = [r[bits] for r in checkpoints["first"]]
    second = [r[bits] for r in checkpoints["second"]]
    assert straight[0]["error_feedback"] is (bits <= 3)
    # state_dict() on rank 0 alone returned at once: no collective (which would have waited for
    # the other rank until the stall deadline)
    saves = straight[0]["save_seconds"] + first[0]["save_seconds"] + second[0]["save_seconds"]
    assert len(saves) == 2 * EPOCHS and max(saves) < 1.0, saves
    for run in (straight, first, second):        # identical replicas in every launch
        assert len({r["fingerprint"] for r in run}) == 1, run
    # the resumed launch went on from the checkpoint's step and table, on every rank
    assert [r["resumed"] for r in second] == [(first[0]["step"], first[0]["version"])] * 2
    assert second[0]["step"] == straight[0]["step"] == steps
    assert second[0]["version"] == straight[0]["version"]
    if bits == 4:   # no error memory: the resumed run is the uninterrupted one, bit for bit
        assert second[0]["fingerprint"] == straight[0]["fingerprint"]


@pytest.mark.multiprocess
def test_rank_0_checkpoint_says_whose_error_memory_restarts(checkpoints):
    """With error feedback, a checkpoint saved on rank 0 alone holds rank 0's memory: rank 1
    says in one log line that it keeps its own (empty in a new job)."""
    rank1 = checkpoints["second"][1]["lines"]
    said = [line for line in rank1 if "holds its own error-feedback memory only" in line]
    assert len(said) == 2, rank1       # one line per bit width with error feedback (2, 3)
    assert all("consolidate_state_dict" in line for line in said)
    assert not any("error-feedback memory" in line for line in checkpoints["second"][0]["lines"])


@pytest.mark.multiprocess
def test_uneven_steps_with_hvd_join(joined):
    steps, results = joined
    size = len(steps)
    longest = int(np.argmax(steps))
    for bits in BITS:
        runs = [r[bits] for r in results]
        assert {r["last"] for r in runs} == {longest}, runs   # hvd.join()'s answer, everywhere
        for r in runs:                             # in the time of the steps, not a stall
            assert r["seconds"] < 60, r["seconds"]
        # the compressor's step and table agree when the join ends (a step some rank had
        # joined counts no compressor step), and on after the broadcast
        assert len({r["at_join"] for r in runs}) == 1, [r["at_join"][:2] for r in runs]
        assert runs[0]["at_join"][0] == sorted(steps)[0]
        assert all(r["step"] == sorted(steps)[0] + 2 for r in runs)
        assert len({r["fingerprint"] for r in runs}) == 1
        # the longest rank's steps alone are its own gradient over P, exactly (joined = zeros)
        alone = runs[longest]["alone"]
        assert len(alone) == steps[longest] - sorted(steps)[-2] and max(alone) == 0.0, alone
    assert size == len(results)
