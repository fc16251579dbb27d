"""The DDP communication hook (horovod_aq.torch.ddp) on real torch.distributed ranks (Gloo).

One launch per rank count runs every check in the same order in every rank
(``torch.multiprocessing`` spawn, Gloo over 127.0.0.1, one thread per process); each pytest test
asserts on one check's per-rank results. The numpy codec is the oracle: the averaged gradient DDP
hands to the parameters must be exactly (bitwise) the numpy encode → decode-and-average of every
rank's bucket with the format's random stream (docs/format.md §6). A last test launches
``examples/ddp_mnist.py`` with ``torchrun``.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np
import pytest

from horovod_aq import codec
from horovod_aq.codec.stream import StreamKey
from horovod_aq.levels import LevelTable
from horovod_aq.packed.cost import chunk_numel
from tests import launches
from tests.ranks import assert_same_runs, record_ddp_submits

pytestmark = pytest.mark.multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = (20, 128, 128, 128, 10)   # ≈ 37k parameters
CAP_MB = 0.02                # DDP bucket cap: the rebuilt layout has three buckets
BUCKET = 64                  # quantization bucket
SEED = 7
LAUNCH_TIMEOUT_S = 420
#: The 4-rank launch declares 2 nodes of 2 (docs/protocol.md §5.7): its node-aware checks use
#: the topology; the others force flat modes, which it leaves alone.
TOPOLOGY = {4: "2x2"}
RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}


# ---------------------------------------------------------------- the launcher
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, checks: list, outdir: str,
               env: dict) -> None:
    """Inside a spawned rank: join the Gloo group, run every check, pickle the outcomes."""
    os.environ.update(RANK_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world), **env)
    import torch
    import torch.distributed as dist

    from horovod_aq.torch.process_exit import destroy_and_exit

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=90))
    outcomes = {}
    for name, kwargs in checks:
        started = time.monotonic()
        try:
            outcomes[name] = ("ok", globals()[name.split("[")[0]](**kwargs))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            outcomes[name] = ("error", type(exc).__name__, str(exc), traceback.format_exc())
        outcomes[name] += (time.monotonic() - started,)
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(outcomes, f)
    destroy_and_exit()     # not a normal return: PyTorch's Gloo shutdown race, docs/ddp.md §6


def launch(checks: list, world: int) -> dict:
    """Run ``checks`` ((function name, kwargs) pairs) on ``world`` spawned Gloo ranks; return
    {check: [outcome of rank 0, …]} with a hard timeout for the whole launch."""
    import torch.multiprocessing as mp

    outdir = tempfile.mkdtemp(prefix="aq_ddp_")
    saved = {k: os.environ.get(k) for k in RANK_ENV}
    os.environ.update(RANK_ENV)
    try:
        env = {"HOROVOD_AQ_TOPOLOGY": TOPOLOGY[world]} if world in TOPOLOGY else {}
        ctx = mp.start_processes(_rank_main, args=(world, _free_port(), checks, outdir, env),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {world}-rank launch ran past {LAUNCH_TIMEOUT_S} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = {}
        for r in range(world):
            with open(os.path.join(outdir, f"rank{r}.pkl"), "rb") as f:
                outcome = pickle.load(f)
            for name, value in outcome.items():
                results.setdefault(name, []).append(value)
        return results
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(outdir, ignore_errors=True)


def _ok(results: dict, check: str) -> list:
    outcomes = results[check]
    failed = [o for o in outcomes if o[0] != "ok"]
    assert not failed, "\n".join(o[3] for o in failed)
    return [o[1] for o in outcomes]


def _seconds(results: dict) -> dict:
    """Seconds each check took on rank 0 (last field of every outcome)."""
    return {name: round(outcomes[0][-1], 1) for name, outcomes in results.items()}


# ---------------------------------------------------------------- helpers inside the ranks
def _setup(method="alq", bits=3, exchange="auto", schedule="0,2,0", error_feedback=False,
           lr=0.05, seed=0, wire="fixed", sizes=SIZES, **comp_kw):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import horovod_aq
    from horovod_aq.torch import ddp as aqddp
    from tests.ranks import tiny_model

    model = tiny_model(torch, seed, sizes)
    net = DDP(model, bucket_cap_mb=CAP_MB)
    if method == "dqsgd":
        comp = horovod_aq.DQSGD(bucket_size=BUCKET, seed=SEED, schedule=schedule, **comp_kw)
    else:
        comp = horovod_aq.from_name(method, bits=bits, bucket_size=BUCKET, seed=SEED,
                                    schedule=schedule, **comp_kw)
    if error_feedback:
        comp = horovod_aq.ErrorFeedback(comp)
    state = aqddp.register(net, comp, exchange=exchange, wire=wire)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return model, net, comp, state, opt


def _batch(rank, step, n=16):
    import torch

    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, SIZES[0], generator=gen)
    return x, (x[:, :SIZES[-1]].sum(1) > 0).long() + 2 * (x[:, 0] > 0).long()


def _train(net, opt, steps, first=0, after=None):
    import torch.distributed as dist
    import torch.nn.functional as F

    losses = []
    for step in range(first, first + steps):
        x, y = _batch(dist.get_rank(), step)
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        if after is not None:
            after(step)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _params(model):
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _grads(model):
    return {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}


# ---------------------------------------------------------------- checks (inside the ranks)
def oracle(exchange="auto", steps=4, wire="fixed"):
    """ALQ 3-bit trains ``steps`` steps (refits after steps 0 and 2); every unit's input, the
    applied gradients, table versions and bucket layouts are logged for the numpy oracle
    (``wire="entropy"``: every payload too)."""
    import torch.distributed as dist

    model, net, comp, state, opt = _setup(exchange=exchange, wire=wire)
    log, grads, versions, layouts = [], [], [], []
    sent = [] if wire == "entropy" else None
    record_ddp_submits(state, log, sent)

    def after(step):
        grads.append(_grads(model))
        versions.append(comp.table.version)
        layouts.append(state.buckets)
    losses = _train(net, opt, steps, after=after)
    return {"log": log, "grads": grads, "versions": versions, "layouts": layouts,
            "losses": losses, "params": _params(model), "rank": dist.get_rank(),
            "telemetry": [r.as_dict() for r in state.telemetry.history], "sent": sent}


def unbiased(exchange="auto", steps=200):
    """Average many exchanges of one fixed gradient; compare with the exact fp32 average."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from tests.ranks import tiny_model

    model, net, comp, state, opt = _setup(method="qsgd", exchange=exchange, schedule="0")
    x, y = _batch(dist.get_rank(), 0)
    samples = []
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        samples.append(np.concatenate([p.grad.numpy().ravel() for p in model.parameters()]))
    ref = tiny_model(torch, 0, SIZES)
    F.cross_entropy(ref(x), y).backward()
    local = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    dist.all_reduce(local)
    s = np.stack(samples).astype(np.float64)
    return {"mean": s.mean(0), "var": s.var(0, ddof=1), "steps": steps,
            "exact": (local / dist.get_world_size()).numpy().astype(np.float64)}


def fp32_training(steps=30):
    """The same model and data with DDP's own fp32 allreduce (the reference)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.ranks import tiny_model

    model = tiny_model(torch, 0, SIZES)
    net = DDP(model, bucket_cap_mb=CAP_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return {"losses": _train(net, opt, steps), "params": _params(model)}


def quantized_training(steps=30, **setup):
    """Train with the hook for ``steps``; losses, params, versions and code widths."""
    model, net, comp, state, opt = _setup(**setup)
    versions, bits = [], []

    def after(step):
        versions.append(comp.quantizer.table.version if comp.quantizes else -1)
        bits.append(state.telemetry.last.bits)
    losses = _train(net, opt, steps, after=after)
    extra = {}
    if comp.error_memory is not None:
        extra["memory_keys"] = sorted(comp.error_memory.memory)
        extra["units"] = [name for _, name, _, _ in state.layout]
    return {"losses": losses, "params": _params(model), "versions": versions, "bits": bits,
            "skipped": state.skipped, **extra}


def resume(k=3, m=4, **setup):
    """Train k steps, save (model, optimizer, hook), train m more; then a fresh model, DDP and
    hook loaded from the checkpoint train the same m steps: the parameters must be identical."""
    import io

    import torch

    model, net, comp, state, opt = _setup(**setup)
    _train(net, opt, k)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "hook": state.state_dict()}, buf)
    layout_saved = [name for _, name, _, _ in state.layout]
    _train(net, opt, m, first=k)
    straight = _params(model)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    model2, net2, comp2, state2, opt2 = _setup(seed=1, **setup)   # other initial weights
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    state2.load_state_dict(saved["hook"])
    first_units = []

    def tap(unit, part, values, payload):
        if part == 0 and len(first_units) < 100:
            first_units.append(unit.name)
    state2.wire.tap = tap
    resumed_losses = _train(net2, opt2, m, first=k)
    return {"straight": straight, "resumed": _params(model2), "layout": layout_saved,
            "first_units": first_units, "versions": (comp.quantizer.table.version,
                                                     comp2.quantizer.table.version),
            "steps": (comp.quantizer.step, comp2.quantizer.step), "losses": resumed_losses}


#: wire="auto" in the launch: warm-up W = 1 (DDP's first, single-bucket step), measurement K = 4.
AUTO_WARMUP, AUTO_TRIALS = 1, 2


def auto_wire(steps=12, resumed_steps=3):
    """wire=AutoWire("auto", warmup_steps=1, trials=2): ALQ 3-bit (refits at steps 0 and 4)
    trains; every unit's coding at every step (tapped), the decision on every rank and
    the autowire log lines; then a fresh model, DDP and hook loaded from the state_dicts train
    on with the decided wire at once."""
    import io
    import logging

    import torch

    from horovod_aq.packed.autowire import AutoWire

    lines = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    log = logging.getLogger("horovod_aq.packed.autowire")
    log.addHandler(Lines(logging.INFO))
    log.setLevel(logging.INFO)

    def build(seed):
        model, net, comp, state, opt = _setup(
            seed=seed, schedule="0,4,0",
            wire=AutoWire("auto", warmup_steps=AUTO_WARMUP, trials=AUTO_TRIALS))
        codings = []
        state.wire.tap = lambda u, part, values, payload: codings.append(
            (u.step, u.index, u.coding, u.mode)) if part == 0 else None
        return model, net, comp, state, opt, codings

    model, net, comp, state, opt, codings = build(0)
    versions = []
    losses = _train(net, opt, steps, after=lambda step: versions.append(comp.table.version))
    decision = state.autowire.decision
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "hook": state.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    model2, net2, comp2, state2, opt2, codings2 = build(1)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    state2.load_state_dict(saved["hook"])
    restored = state2.autowire.decision
    resumed = _train(net2, opt2, resumed_steps, first=steps)
    return {"codings": codings, "decision": decision.to_array().tolist(),
            "decided": decision.decided, "lines": [m for m in lines if "wire from step" in m],
            "losses": losses, "versions": versions, "units": len(state.layout),
            "bits": [r.bits_per_coordinate for r in state.telemetry.history],
            "restored": restored.to_array().tolist(), "resumed_codings": codings2,
            "resumed_losses": resumed}


def skip_nonfinite():
    """nonfinite="skip": a NaN on rank 1 gives NaN for its bucket on every rank, then training
    goes on."""
    import torch.distributed as dist

    model, net, comp, state, opt = _setup(method="qsgd", nonfinite="skip", schedule="0")
    bad = dict(model.named_parameters())["2.weight"]
    handle = bad.register_hook(lambda g: g * float("nan")) if dist.get_rank() == 1 else None
    nan_grads, skipped = [], []

    def after(step):
        nan_grads.append(sorted(n for n, g in _grads(model).items() if np.isnan(g).any()))
        skipped.append(state.skipped)
        if handle is not None and step == 0:
            handle.remove()
        if step == 0:   # do not let the NaN into the weights
            opt.zero_grad()
    _train(net, opt, 3, after=after)
    return {"nan_grads": nan_grads, "skipped": skipped, "params": _params(model),
            "telemetry": [r.as_dict() for r in state.telemetry.history]}


def _one_interpreter_at_a_time():
    """Triton's interpreter swaps ``triton.language``'s functions while a kernel runs, so two
    threads must not run kernels at once: Gloo's callbacks decode on their own thread here
    (compiled kernels on a GPU have no such limit)."""
    import threading

    from triton.runtime import interpreter

    run, lock = interpreter.GridExecutor.__call__, threading.Lock()

    def serial(self, *args, **kwargs):
        with lock:
            return run(self, *args, **kwargs)
    interpreter.GridExecutor.__call__ = serial


#: A model of two DDP buckets for the checks that run Triton's interpreter (≈ 6k parameters).
SMALL = (20, 64, 64, 10)


def device_decided(exchange="two_phase", steps=3):
    """QSGD 2-bit with error feedback, nonfinite="skip", a NaN on rank 1 at step 1, trained with
    CPU's kernels and again with the Triton kernels (in the interpreter), whose sends keep
    their outcome on the device and whose receives are settled at the step's end
    (docs/dynamic.md §2.6, docs/protocol.md §5.8): parameters and memories of both (None
    without Triton)."""
    import torch.distributed as dist

    from horovod_aq.torch import kernels, triton_kernels

    if not triton_kernels.available():
        return None
    _one_interpreter_at_a_time()
    runs, cpu = {}, kernels.implementation_for
    for impl in ("fused", "triton"):
        if impl == "triton":
            kernels.implementation_for = lambda device: "triton"
        try:
            model, net, comp, state, opt = _setup(method="qsgd", bits=2, error_feedback=True,
                                                  nonfinite="skip", schedule="0",
                                                  exchange=exchange, sizes=SMALL)
            bad = dict(model.named_parameters())["2.weight"]
            nan = dist.get_rank() == 1
            bad.register_hook(lambda g: g * float("nan") if nan and state.compression.step == 1
                              else g)
            skipped = []

            def after(step, state=state, skipped=skipped, opt=opt):
                skipped.append(state.skipped)
                if state.skipped:
                    opt.zero_grad()   # do not let the NaN into the weights
            _train(net, opt, steps, after=after)
            runs[impl] = {"skipped": skipped, "params": _params(model),
                          "memory": {k: v.numpy().copy()
                                     for k, v in comp.error_memory.memory.items()}}
        finally:
            kernels.implementation_for = cpu
    return runs


def mismatch():
    """Rank 1 builds its compressor with other bits: every rank raises the same error."""
    import torch.distributed as dist

    _, net, _, _, opt = _setup(method="qsgd", bits=3 + dist.get_rank() % 2, schedule="0")
    _train(net, opt, 1)


def raise_nonfinite(exchange="auto", wire="fixed"):
    """A NaN in rank 1's ``2.weight`` gradient: every rank raises NonFiniteGradientError."""
    import torch.distributed as dist

    model, net, _, _, opt = _setup(method="qsgd", exchange=exchange, schedule="0", wire=wire)
    if dist.get_rank() == 1:
        dict(model.named_parameters())["2.weight"].register_hook(lambda g: g * float("nan"))
    _train(net, opt, 1)


def overflow_marker(exchange="auto"):
    """Rank 1's finite gradient has a bucket whose norm overflows float32: every rank raises the
    same NonFiniteGradientError (a marker, as for NaN), instead of one rank failing to encode.
    L2 norms: an L-inf norm (ALQ's default) of finite values is finite, it cannot overflow."""
    import torch.distributed as dist

    model, net, comp, state, opt = _setup(exchange=exchange, norm="l2")
    if dist.get_rank() == 1:
        dict(model.named_parameters())["2.weight"].register_hook(
            lambda g: torch_full_like(g, 1e38))
    try:
        _train(net, opt, 1)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def torch_full_like(g, value):
    import torch

    return torch.full_like(g, value)


def checksum_exchange(steps=3, exchange="auto"):
    """checksum=True: every payload carries FLAG_CHECKSUM and a CRC the decoders verify; the
    training is bitwise the one without (the CRC changes no decoded value)."""
    from tests.ranks import ChecksumFlags

    out = {}
    for checksum in (False, True):
        model, net, comp, state, opt = _setup(exchange=exchange, checksum=checksum)
        with ChecksumFlags(state.wire) as flags:
            _train(net, opt, steps)
        out[checksum] = {"params": _params(model), "flags": flags.seen()}
    return out


def trainable_changes(steps=2):
    """Fine-tuning under DDP with the hook (docs/ddp.md § Changing what trains): the head trains
    with the body frozen; the body is unfrozen and DDP rebuilt with find_unused_parameters=True
    around the same hook state; then the head is frozen without a rebuild."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import horovod_aq
    from horovod_aq.torch import ddp as aqddp
    from tests.ranks import tiny_model

    model = tiny_model(torch, 0, SIZES)
    body, head = list(model[0].parameters()), list(model[-1].parameters())
    for p in body:
        p.requires_grad_(False)
    net = DDP(model, bucket_cap_mb=CAP_MB)
    state = aqddp.register(net, horovod_aq.QSGD(bits=3, bucket_size=BUCKET, seed=SEED))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params, layouts = [_params(model)], []
    for phase in ("head", "unfrozen", "head frozen"):
        if phase == "unfrozen":
            for p in body:
                p.requires_grad_(True)
            net = DDP(model, bucket_cap_mb=CAP_MB, find_unused_parameters=True)
            net.register_comm_hook(state, aqddp.quantized_hook)
        if phase == "head frozen":
            for p in head:
                p.requires_grad_(False)
        layouts.append([])
        _train(net, opt, steps, first=len(params),
               after=lambda step: layouts[-1].append(sorted(n for b in state.buckets
                                                            for n in b[3])))
        params.append(_params(model))
    return {"params": params, "layouts": layouts}


def uneven_join(steps, bits=3, **state_kw):
    """PyTorch's Join context manager over DDP with uneven inputs: rank r trains ``steps[r]``
    batches; the joined ranks' DDP shadows every bucket through the hook with zeros (every
    hook default: error feedback at 3 bits, wire="auto")."""
    import hashlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    import horovod_aq
    from horovod_aq.torch import ddp as aqddp
    from tests.ranks import tiny_model

    rank = dist.get_rank()
    model = tiny_model(torch, 0, SIZES)
    net = DDP(model, bucket_cap_mb=CAP_MB)
    state = aqddp.register(net, horovod_aq.ALQ(bits=bits, schedule="0,2"), **state_kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    started = time.monotonic()
    with Join([net]):
        for step in range(steps[rank]):
            x, y = _batch(rank, step)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    q = state.compression.quantizer
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    return {"seconds": time.monotonic() - started, "step": q.step, "version": q.table.version,
            "levels": q.table.levels, "error_feedback": state.compression.error_memory is not None,
            "weights": hashlib.sha256(weights.tobytes()).hexdigest()}


CHECKS = {
    2: [("oracle", {}), ("checksum_exchange", {}),
        ("overflow_marker", {}), ("overflow_marker[two_phase]", {"exchange": "two_phase"}),
        ("checksum_exchange[two_phase]", {"exchange": "two_phase"}),
        ("oracle[two_phase]", {"exchange": "two_phase", "steps": 3}),
        ("unbiased", {}), ("fp32_training", {}), ("quantized_training", {}),
        ("quantized_training[ecq]", {"method": "qsgd", "bits": 2, "error_feedback": True,
                                     "schedule": "0"}),
        ("quantized_training[dqsgd]", {"method": "dqsgd", "target_bits": 4, "window": 5}),
        ("quantized_training[fp16]", {"method": "fp16"}),
        ("resume", {"error_feedback": True, "schedule": "0,4,0"}),
        ("skip_nonfinite", {}), ("mismatch", {}), ("raise_nonfinite", {}),
        ("device_decided", {}),
        ("oracle[entropy]", {"wire": "entropy", "steps": 3}),
        ("oracle[entropy_two_phase]", {"exchange": "two_phase", "wire": "entropy", "steps": 3}),
        ("raise_nonfinite[entropy_two_phase]", {"exchange": "two_phase", "wire": "entropy"}),
        ("auto_wire", {}), ("trainable_changes", {}), ("uneven_join", {"steps": (6, 3)})],
    4: [("oracle", {"exchange": "two_phase", "steps": 3}), ("oracle[allgather]",
                                                            {"exchange": "allgather", "steps": 2}),
        ("unbiased", {"exchange": "two_phase", "steps": 150}),
        ("quantized_training", {"exchange": "two_phase", "steps": 20}),
        ("resume", {"exchange": "two_phase", "method": "dqsgd", "target_bits": 3,
                    "max_bits": 4, "window": 3, "levels": "alq", "schedule": "0,4,0"}),
        ("raise_nonfinite", {"exchange": "two_phase"}),
        ("uneven_join", {"steps": (7, 3, 5, 4), "exchange": "two_phase"}),
        ("quantized_training[node]", {"exchange": "node_two_phase", "steps": 20,
                                      "error_feedback": True}),
        ("raise_nonfinite[node]", {"exchange": "node_allgather", "wire": "entropy"})],
}


#: the launch fixture's params (ranks) -> the checks that launch runs (tests/launches.py)
LAUNCHES = {"results": CHECKS}


@pytest.fixture(scope="module", params=list(CHECKS), ids=lambda p: f"gloo-{p}")
def results(request):
    return request.param, launch(CHECKS[request.param], request.param)


def _outcomes(results, check) -> list:
    """Every rank's raw outcome of ``check``: ("ok", value, s) or ("error", type, message, …)."""
    return results[1][launches.read(check)]


def _get(results, check):
    return _ok(results[1], launches.read(check))


def _variant(results, base):
    """The checks of the launch named ``base`` or ``base[...]``."""
    return [c for c in results[1] if c.split("[")[0] == base]


# ---------------------------------------------------------------- the numpy oracle (in pytest)
def _expected(entries, world):
    """What every rank must hold for one unit, from every rank's logged input."""
    e0 = entries[0]
    table = LevelTable(e0["levels"], e0["version"])
    step, index, numel = e0["step"], e0["index"], e0["raw"].size

    def enc(x, rank, part):
        return codec.encode(x, table, bucket_size=BUCKET, norm=e0["norm"],
                            key=StreamKey(SEED, rank, step, index, part))
    if e0["mode"] == "allgather":
        return codec.decode_average(np.stack([enc(e["raw"], r, 0)
                                              for r, e in enumerate(entries)]), table)
    m = chunk_numel(numel, world, BUCKET)
    padded = [np.concatenate([e["raw"], np.zeros(world * m - numel, np.float32)])
              for e in entries]
    out = []
    for r in range(world):
        chunk = codec.decode_average(np.stack([enc(padded[p][r * m:(r + 1) * m], p, r)
                                               for p in range(world)]), table)
        chunk[min(max(numel - r * m, 0), m):] = 0.0     # the unit's padding: exact zeros
        out.append(codec.decode(enc(chunk, r, world), table))
    return np.concatenate(out)[:numel]


def test_hook_equals_numpy_oracle(results):
    for check in _variant(results, "oracle"):
        ranks = _get(results, check)
        world = len(ranks)
        steps = len(ranks[0]["grads"])
        modes = set()
        for step in range(steps):
            units = [[e for e in r["log"] if e["step"] == step] for r in ranks]
            assert all(len(u) == len(units[0]) for u in units)
            for j, e0 in enumerate(units[0]):
                entries = [u[j] for u in units]
                assert all(e["name"] == e0["name"] for e in entries)
                modes.add(e0["mode"])
                expected = _expected(entries, world)
                for r in ranks:
                    got = np.concatenate([r["grads"][step][n].ravel() for n in e0["names"]])
                    np.testing.assert_array_equal(got, expected, err_msg=f"{check} step {step}")
                exact = np.mean([e["raw"] for e in entries], axis=0)
                rel = np.linalg.norm(expected - exact) / np.linalg.norm(exact)
                assert rel < 1.0, (check, step, rel)      # within quantization noise
        wanted = {"oracle[two_phase]": {"two_phase"}, "oracle[allgather]": {"allgather"},
                  "oracle[entropy_two_phase]": {"two_phase"}}
        assert modes == wanted.get(check, {"two_phase"} if world == 4 else {"allgather"})


def test_ddp_rebuilds_buckets_and_the_hook_follows(results):
    ranks = _get(results, _variant(results, "oracle")[0])
    layouts = ranks[0]["layouts"]
    assert len(layouts[0]) == 1, "DDP's first iteration has one bucket of every parameter"
    assert len(layouts[1]) >= 3, "the rebuilt layout should have several buckets"
    assert all(lay == layouts[1] for lay in layouts[1:])
    assert all(r["layouts"] == layouts for r in ranks)


def test_table_version_advances_at_scheduled_steps_on_every_rank(results):
    for check in _variant(results, "oracle") + _variant(results, "quantized_training"):
        ranks = _get(results, check)
        if "[" in check:      # other compressors: see their own tests
            continue
        for r in ranks:       # schedule "0,2,0": refits at the end of steps 0 and 2
            n = len(r["versions"])
            assert r["versions"] == [1, 1] + [2] * (n - 2), (check, r["versions"])
            assert r["versions"] == ranks[0]["versions"]
    ranks = _get(results, _variant(results, "oracle")[0])
    for r in ranks:
        tele = r["telemetry"]
        assert [t["refit"] for t in tele[:3]] == [True, False, True]
        assert [t["table_version"] for t in tele[:3]] == [1, 1, 2]


def test_parameters_identical_on_every_rank(results):
    for check in (_variant(results, "oracle") + _variant(results, "quantized_training")
                  + _variant(results, "fp32_training")):
        ranks = _get(results, check)
        for r in ranks[1:]:
            for n, p in r["params"].items():
                np.testing.assert_array_equal(p, ranks[0]["params"][n], err_msg=check)


def test_exchange_is_unbiased(results):
    (check,) = _variant(results, "unbiased")
    res = _get(results, check)[0]
    err = np.abs(res["mean"] - res["exact"])
    bound = 6 * np.sqrt(res["var"] / res["steps"]) + 1e-6
    assert (err <= bound).mean() > 0.999, float((err <= bound).mean())
    assert np.linalg.norm(res["mean"] - res["exact"]) < 0.2 * np.linalg.norm(res["exact"])


def test_alq_trains_like_fp32(results):
    ranks = _get(results, "quantized_training")
    losses = ranks[0]["losses"]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
    if "fp32_training" in results[1]:
        ref = _get(results, "fp32_training")[0]["losses"]
        assert np.mean(losses[-5:]) < np.mean(ref[-5:]) + 0.25


@pytest.mark.reads("quantized_training[ecq]", "quantized_training[dqsgd]",
                   "quantized_training[fp16]")
def test_error_feedback_dqsgd_and_fp16_hooks_train(results):
    for check in ("quantized_training[ecq]", "quantized_training[dqsgd]",
                  "quantized_training[fp16]"):
        ranks = _get(results, check)
        losses = ranks[0]["losses"]
        assert np.mean(losses[-5:]) < 0.85 * np.mean(losses[:5]), (check, losses)
        for r in ranks[1:]:
            assert r["bits"] == ranks[0]["bits"]
    ecq = _get(results, "quantized_training[ecq]")
    for r in ecq:      # the memory follows DDP's rebuilt buckets (the first one is dropped)
        assert r["memory_keys"] == sorted(r["units"])
    dq = _get(results, "quantized_training[dqsgd]")[0]["bits"]
    assert len(set(dq)) > 1, f"DQSGD never changed its width: {dq}"


def test_state_dict_resume_is_bit_exact(results):
    for r in _get(results, "resume"):
        assert r["steps"][0] == r["steps"][1]
        assert r["versions"][0] == r["versions"][1] >= 2       # a refit in the resumed part
        for n, p in r["straight"].items():
            np.testing.assert_array_equal(r["resumed"][n], p, err_msg=n)
        # the resumed first step exchanged the saved buckets inside DDP's initial one
        assert r["first_units"][:len(r["layout"])] == r["layout"]


@pytest.mark.reads("skip_nonfinite")
def test_nonfinite_skip_on_every_rank(results):
    ranks = _get(results, "skip_nonfinite")
    for r in ranks:
        assert r["skipped"] == [True, False, False]
        assert r["nan_grads"][0] and "2.weight" in r["nan_grads"][0]
        assert r["nan_grads"][1:] == [[], []]
        assert all(np.isfinite(p).all() for p in r["params"].values())
        assert r["telemetry"][0]["extra"].get("skipped") == 1.0


@pytest.mark.reads("device_decided")
def test_the_device_decided_exchange_is_bitwise_the_cpu_one(results):
    ranks = _get(results, "device_decided")
    if ranks[0] is None:
        pytest.skip("Triton is not installed: its kernels are untested")
    assert_same_runs(ranks, [False, True, False])


@pytest.mark.reads("mismatch")
def test_settings_mismatch_fails_everywhere(results):
    outcomes = _outcomes(results, "mismatch")
    assert all(o[0] == "error" and o[1] == "ConfigMismatchError" for o in outcomes), outcomes
    assert len({o[2] for o in outcomes}) == 1            # the same message everywhere
    assert "bits 3" in outcomes[0][2] and "bits 4" in outcomes[0][2]


def test_nonfinite_raises_on_every_rank(results):
    for check in _variant(results, "raise_nonfinite"):
        outcomes = _outcomes(results, check)
        assert all(o[0] == "error" and o[1] == "NonFiniteGradientError" for o in outcomes), (
            check, outcomes)
        assert len({o[2] for o in outcomes}) == 1
        # node-aware: the marker comes from node 0's average (ranks 0 and 1)
        who = "on rank 0–1 (node 0" if check.endswith("[node]") else "on rank 1"
        assert who in outcomes[0][2] and "'2.weight'" in outcomes[0][2], outcomes[0][2]


@pytest.mark.reads("quantized_training[node]")
def test_the_node_aware_hook_trains_with_each_ranks_shard_memory(results):
    ranks = _get(results, "quantized_training[node]")
    losses = ranks[0]["losses"]
    assert np.mean(losses[-5:]) < 0.85 * np.mean(losses[:5]), losses
    for rank, r in enumerate(ranks):   # the memory of this rank's shard of each unit
        assert r["memory_keys"] == sorted(f"{u}.2x2.s{rank % 2}" for u in r["units"])


@pytest.mark.reads("oracle[entropy]", "oracle[entropy_two_phase]", "oracle[two_phase]")
def test_entropy_hook_sends_the_oracles_payloads_and_fewer_bytes(results):
    """wire="entropy": every payload (first phase and re-encoded chunk) is
    ``codec.encode_entropy``'s bytes for its stream key; the averages are the fixed wire's
    (test_hook_equals_numpy_oracle), and telemetry counts fewer bytes than the fixed wire."""
    for check in ("oracle[entropy]", "oracle[entropy_two_phase]"):
        ranks = _get(results, check)
        flagged = 0
        for r in ranks:
            for e in r["sent"]:
                table = LevelTable(e["levels"], e["version"])
                want = codec.encode_entropy(
                    e["values"], table, bucket_size=BUCKET, norm=e["norm"],
                    key=StreamKey(SEED, r["rank"], e["step"], e["index"], e["part"]))
                np.testing.assert_array_equal(e["payload"], want, err_msg=check)
                flagged += bool(want[codec.FLAGS_OFFSET] & codec.FLAG_ENTROPY)
            assert sum(t["payload_bytes"] for t in r["telemetry"]) == sum(
                e["payload"].size for e in r["sent"]
                if e["part"] < (1 if "two_phase" not in check else len(ranks)))
        assert flagged > 0, check
    fixed = _get(results, "oracle[two_phase]")[0]["telemetry"]
    coded = _get(results, "oracle[entropy_two_phase]")[0]["telemetry"]
    assert sum(t["bytes_sent"] for t in coded) < 0.95 * sum(t["bytes_sent"] for t in fixed)


# ---------------------------------------------------------------- the example, under torchrun
def test_ddp_mnist_example_under_torchrun(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        torchrun = shutil.which("torchrun")
    out = tmp_path / "ddp"
    cmd = [torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), os.path.join(ROOT, "examples", "ddp_mnist.py"),
           "--epochs", "1", "--max-steps", "20", "--out", str(out), "--no-progress"]
    env = dict(os.environ, **RANK_ENV)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "metrics.json") as f:
        summary = json.load(f)["summary"]
    assert summary["ranks"] == 2 and summary["table_version"] >= 1
    assert summary["compression_ratio"] > 5
    assert "test accuracy" in proc.stdout


@pytest.mark.parametrize("check", ["checksum_exchange", "checksum_exchange[two_phase]"])
def test_checksum_exchange(results, check):
    for r in _get(results, check):
        assert r[True]["flags"] == [codec.FLAG_CHECKSUM] and r[False]["flags"] == [0]
        for name, value in r[False]["params"].items():
            np.testing.assert_array_equal(r[True]["params"][name], value)


@pytest.mark.parametrize("check", ["overflow_marker", "overflow_marker[two_phase]"])
def test_overflowing_norm_is_a_marker_on_every_rank(results, check):
    for message in _get(results, check):
        assert message.startswith("NonFiniteGradientError") and "rank 1" in message, message


# ---------------------------------------------------------------- a lazy state (one process)
LAZY_SCRIPT = r"""
import os, sys, tempfile
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import horovod_aq
from horovod_aq.torch import ddp as aqddp
from horovod_aq.torch.process_exit import destroy_and_exit

torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
# built before init_process_group, as Lightning's DDPStrategy(ddp_comm_state=...) does
state = aqddp.QuantizedHookState(horovod_aq.ALQ(bits=3, bucket_size=16, schedule="0"),
                                 named_parameters=model.named_parameters())
try:
    state.process_group
    print("no error before init")
except RuntimeError as exc:
    print("before init:", "init_process_group" in str(exc))
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
net = DDP(model)
net.register_comm_hook(state, aqddp.quantized_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    opt.zero_grad()
    net(torch.randn(4, 8)).square().mean().backward()
    opt.step()
print("steps", state.compression.step, "ranks", state.ranks,
      "records", len(state.telemetry.history))
destroy_and_exit()
"""


@pytest.mark.reads("uneven_join")
def test_uneven_inputs_under_torch_join(results):
    """docs/ddp.md § Uneven inputs: every rank leaves the Join context in the time of its
    steps, having made the same compressor steps and refits (the joined ranks' DDP runs the
    hook on zero buckets), and DDP's final broadcast leaves identical replicas."""
    runs = _get(results, "uneven_join")
    steps = dict(CHECKS[results[0]])["uneven_join"]["steps"]
    for r in runs:
        assert r["error_feedback"] and r["seconds"] < 60, r
        assert (r["step"], r["version"]) == (max(steps), runs[0]["version"]) and r["version"] > 1
        np.testing.assert_array_equal(r["levels"], runs[0]["levels"])
    assert len({r["weights"] for r in runs}) == 1


def test_hook_state_is_built_before_the_process_group(tmp_path):
    """Like PowerSGDState, the hook state resolves its process group at the first bucket: it can
    be built before ``init_process_group`` and then trains (one Gloo process)."""
    env = dict(os.environ, **RANK_ENV, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", LAZY_SCRIPT, str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "before init: True" in proc.stdout
    assert "steps 2 ranks 1 records 2" in proc.stdout, proc.stdout


@pytest.mark.reads("auto_wire")
def test_auto_wire_measures_decides_alike_switches_and_keeps_its_decision(results):
    """wire="auto": the schedule's codings (fixed in the warm-up, then each candidate in turn —
    2 ranks: fixed and entropy-coded allgather — for every unit), one agreed decision on every
    rank (one log line, on rank 0, naming every candidate's time) used from the decision step,
    training goes on, and the hook's state_dict brings the decision back."""
    from horovod_aq.packed.autowire import WireDecision

    ranks = _get(results, "auto_wire")
    first = ranks[0]
    for r in ranks:
        np.testing.assert_array_equal(r["decision"], first["decision"])
        assert r["decided"]
    decision = WireDecision.from_array(first["decision"])
    start = AUTO_WARMUP + 2 * AUTO_TRIALS
    assert decision.step == start
    assert len(decision.choices) == first["units"] == 3          # DDP's rebuilt buckets
    for r in ranks:
        for t, i, coding, mode in r["codings"]:
            if t < AUTO_WARMUP:
                want = "fixed"
            elif t < start:
                want = ("fixed", "entropy")[(t - AUTO_WARMUP) % 2]
                assert mode == "allgather"
            else:
                want = decision.choices[i].coding
                assert mode == decision.choices[i].mode
            assert coding == want, (t, i, coding)
        assert {c for t, _, c, _ in r["codings"] if AUTO_WARMUP <= t < start} == {
            "fixed", "entropy"}
        assert max(t for t, _, _, _ in r["codings"]) == 11
    assert len(first["lines"]) == 1 and f"wire from step {start}" in first["lines"][0]
    for wire in ("fixed/allgather", "entropy/allgather"):    # every candidate's trial time
        assert first["lines"][0].count(wire) >= 1, first["lines"][0]
    assert all(not r["lines"] for r in ranks[1:])
    for r in ranks:
        assert np.mean(r["losses"][-3:]) < np.mean(r["losses"][:3])
        assert r["versions"][0] < r["versions"][-1]
        np.testing.assert_array_equal(r["restored"], first["decision"])
        assert {t for t, _, _, _ in r["resumed_codings"]} == {12, 13, 14}
        for t, i, coding, _ in r["resumed_codings"]:
            assert coding == decision.choices[i].coding
        assert np.isfinite(r["resumed_losses"]).all()


@pytest.mark.reads("trainable_changes")
def test_unfreezing_under_ddp_needs_a_rebuild_and_freezing_find_unused(results):
    ranks = _get(results, "trainable_changes")
    first, head, body = ranks[0]["params"], "6.", "0."   # params after each phase
    for r in ranks[1:]:   # replicas identical after every phase
        for got, want in zip(r["params"], first):
            for n in want:
                np.testing.assert_array_equal(got[n], want[n], err_msg=n)
    for n in first[0]:
        moved = [not np.array_equal(a[n], b[n]) for a, b in zip(first, first[1:])]
        assert moved == ([False, True, True] if n.startswith(body) else
                         [True, True, False] if n.startswith(head) else [True] * 3), n
    head_only, unfrozen, head_frozen = ranks[0]["layouts"]   # the hook's units, each step
    assert all(lay == sorted(n for n in first[0] if not n.startswith(body)) for lay in head_only)
    assert all(lay == sorted(first[0]) for lay in unfrozen + head_frozen)   # frozen: still sent
