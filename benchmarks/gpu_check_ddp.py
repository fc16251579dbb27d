"""GPU check of the DDP communication hook (``horovod_aq.torch.ddp``) over NCCL.

Needs torch with CUDA (and Triton, which torch's CUDA wheels ship) and numba; no Horovod. It
spawns one process per GPU (at most ``--ranks``; with one GPU a single-rank NCCL group, which
still runs the CUDA kernels, NCCL's uint8/float64/int64 collectives and the futures, but no
averaging across ranks) and checks:

1. **oracle**: DDP with ``ALQ(bits=3)`` (refits after steps 0 and 2), allgather and two-phase,
   fixed-width and entropy-coded wire (``wire="entropy"``, the same codes):
   the gradients DDP applies equal the numpy codec's encode → decode_average of every rank's
   bucket with the format's stream keys, bit for bit; the table versions advance at the
   scheduled steps identically on every rank; DDP's bucket rebuild is followed;
2. **markers**: a NaN gradient with ``nonfinite="skip"`` gives NaN for its bucket on every rank
   and the next step trains;
3. **step time**: a 29M-parameter MLP, median step (forward + backward + SGD step) with DDP's own
   fp32 allreduce and with the ALQ 3-bit hook, fixed and entropy-coded wire (timed between device
   synchronisations); on CUDA, over three more steps, the host synchronisations torch's sync
   debug mode reports (with their source lines) and the device kernels and copies its profiler
   records (``step_costs``).

    python benchmarks/gpu_check_ddp.py --out benchmarks/results/gpu_ddp.md
    python benchmarks/gpu_check_ddp.py --dry-run          # CPU, Gloo, 2 ranks, small sizes
    python benchmarks/gpu_check_ddp.py --interpret        # the dry run on the GPU's code path
    python benchmarks/gpu_check_ddp.py --share-gpu 2      # 2 ranks on GPU 0, Gloo, CUDA tensors

Exit status 1 if a check fails. The report (Markdown) goes to ``--out`` (default: printed).
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BUCKET = 256
SEED = 5
ORACLE_SIZES = (64, 512, 512, 256, 10)
#: DDP's bucket cap of the oracle runs: several buckets (and so several units) per step.
BUCKET_CAP_MB = 0.5
#: The oracle and timing model of ``--interpret`` (Triton's interpreter runs a kernel's
#: programs one after another in Python), and its cap: ≈ 7K parameters in 3 buckets.
INTERPRETED_SIZES, INTERPRETED_CAP_MB = (8, 64, 64, 32, 10), 0.01
TIMING_SIZES = (2048, 4096, 4096, 1024, 10)     # ≈ 29M parameters


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="report path (default: print it)")
    p.add_argument("--ranks", type=int, default=2, help="at most this many processes/GPUs")
    p.add_argument("--steps", type=int, default=5, help="oracle steps per exchange mode")
    p.add_argument("--timing-steps", type=int, default=20)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: Gloo, 2 ranks, small timing model (numbers meaningless)")
    p.add_argument("--interpret", action="store_true",
                   help="a dry run on the GPU's code path: Triton's kernels in its interpreter "
                        "on CPU tensors (HOROVOD_AQ_KERNELS=triton, TRITON_INTERPRET=1), a tiny "
                        "model and 2 timing steps (slow: the interpreter)")
    p.add_argument("--share-gpu", type=int, default=0, metavar="RANKS",
                   help="RANKS processes on GPU 0 over Gloo (CUDA tensors; NCCL refuses two "
                        "ranks on one device): the multi-rank paths on a one-GPU machine")
    return p.parse_args(argv)


# ---------------------------------------------------------------- inside a rank
def _model(torch, sizes, seed=0):
    from tests.ranks import tiny_model  # the deterministic MLP of the multi-process tests

    return tiny_model(torch, seed=seed, sizes=sizes)


def _batch(torch, sizes, rank, step, device, n=32):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, sizes[0], generator=gen)
    return x.to(device), (x[:, 0] > 0).long().to(device)


def oracle_run(torch, device, exchange, steps, wire="fixed"):
    """Train with the hook; log every unit's input (CPU copies) and the applied gradients."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import horovod_aq
    from horovod_aq.torch import ddp as aqddp

    model = _model(torch, ORACLE_SIZES).to(device)
    net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=BUCKET_CAP_MB)
    comp = horovod_aq.ALQ(bits=3, bucket_size=BUCKET, seed=SEED, schedule="0,2,0")
    state = aqddp.register(net, comp, exchange=exchange, wire=wire)
    from tests.ranks import record_ddp_submits

    log = []
    record_ddp_submits(state, log)   # every unit's input, through the engine's public tap
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads, versions, layouts = [], [], []
    for step in range(steps):
        x, y = _batch(torch, ORACLE_SIZES, dist.get_rank(), step, device)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        grads.append({n: p.grad.detach().cpu().numpy().copy()
                      for n, p in model.named_parameters()})
        versions.append(comp.table.version)
        layouts.append(len(state.buckets))
        opt.step()
    return {"log": log, "grads": grads, "versions": versions, "layouts": layouts}


def skip_run(torch, device):
    import numpy as np
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import horovod_aq
    from horovod_aq.torch import ddp as aqddp

    model = _model(torch, ORACLE_SIZES).to(device)
    net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    state = aqddp.register(net, horovod_aq.QSGD(bits=3, bucket_size=BUCKET, nonfinite="skip"))
    handle = None
    if dist.get_rank() == dist.get_world_size() - 1:
        handle = dict(model.named_parameters())["2.weight"].register_hook(
            lambda g: g * float("nan"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(2):
        x, y = _batch(torch, ORACLE_SIZES, dist.get_rank(), step, device)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        nan = any(bool(torch.isnan(p.grad).any()) for p in model.parameters())
        out.append((state.skipped, nan))
        if handle is not None:
            handle.remove()
            handle = None
        if not state.skipped:
            opt.step()
    finite = all(np.isfinite(p.detach().cpu().numpy()).all() for p in model.parameters())
    return {"steps": out, "finite": finite}


def timing_run(torch, device, sizes, steps, hook, wire="fixed"):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import horovod_aq
    from horovod_aq.torch import ddp as aqddp

    model = _model(torch, sizes).to(device)
    net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if hook:
        aqddp.register(net, horovod_aq.ALQ(bits=3, bucket_size=8192), wire=wire)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = _batch(torch, sizes, dist.get_rank(), 0, device, n=64)

    def step():
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return step_costs(torch, device, step, steps)


def median_step(torch, device, step, steps: int, warmup: int = 3) -> float:
    """Median seconds of ``step()`` over ``steps`` calls after ``warmup``, each timed between
    device synchronisations."""
    times = []
    for k in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if k >= warmup:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def host_syncs(torch, step, steps: int) -> dict:
    """Host synchronisations per call of ``step()`` that torch's sync debug mode reports
    (``torch.cuda.set_sync_debug_mode("warn")``), with the source lines that made them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return {"per_step": len(syncs) / steps, "where": dict(where.most_common(12))}


def device_kernels(torch, step, steps: int) -> dict:
    """Device kernels and copies per call of ``step()`` that torch's profiler records, with the
    most frequent names."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    names = collections.Counter(e.name[:60] for e in events)
    return {"per_step": len(events) / steps, "top": dict(names.most_common(8))}


#: Steps over which ``step_costs`` counts host synchronisations and device kernels.
COUNTED_STEPS = 3


def step_costs(torch, device, step, steps: int, counted: int = COUNTED_STEPS) -> dict:
    """The median step (``median_step``) and, on CUDA, its host synchronisations and device
    kernels per step over ``counted`` more steps."""
    out = {"median": median_step(torch, device, step, steps), "syncs": None, "kernels": None}
    if device.type == "cuda":
        out["syncs"] = host_syncs(torch, step, counted)
        out["kernels"] = device_kernels(torch, step, counted)
    return out


def cost_rows(label: str, costs: dict, buckets: int | None = None) -> tuple[str, str | None]:
    """Report rows of one optimizer's ``step_costs`` (rank 0's counts): the median step, and
    host syncs and kernels per step (None off CUDA)."""
    time_row = f"| {label} | {costs['median'] * 1e3:.2f} ms |"
    if costs["syncs"] is None:
        return time_row, None
    syncs, kernels = costs["syncs"], costs["kernels"]
    where = ", ".join(f"`{k}` ×{v}" for k, v in syncs["where"].items()) or "—"
    top = ", ".join(f"`{n}` ×{v}" for n, v in kernels["top"].items())
    fused = "—" if buckets is None else str(buckets)
    return time_row, (f"| {label} | {syncs['per_step']:.1f} | {where} | "
                      f"{kernels['per_step']:.1f} | {fused} | {top} |")


#: The header of the rows ``cost_rows`` gives second.
COST_HEADER = ["| optimizer | host syncs per step | where (file:line × count) | device kernels "
               "and copies per step | fused buckets | most frequent (name × count) |",
               "|---|---:|---|---:|---:|---|"]


def rank_main(rank, world, port, args, outdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from horovod_aq.torch.process_exit import destroy_and_exit

    torch.set_num_threads(1)
    if args.interpret:
        global ORACLE_SIZES, BUCKET_CAP_MB
        ORACLE_SIZES, BUCKET_CAP_MB = INTERPRETED_SIZES, INTERPRETED_CAP_MB
    if args.dry_run:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    elif args.share_gpu:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world,
                                device_id=device)
    outcome = {}
    for name, fn in (("oracle_allgather", lambda: oracle_run(torch, device, "allgather",
                                                               args.steps)),
                     ("oracle_two_phase", lambda: oracle_run(torch, device, "two_phase",
                                                               args.steps)),
                     ("oracle_allgather_entropy", lambda: oracle_run(
                         torch, device, "allgather", args.steps, wire="entropy")),
                     ("oracle_two_phase_entropy", lambda: oracle_run(
                         torch, device, "two_phase", args.steps, wire="entropy")),
                     ("skip", lambda: skip_run(torch, device)),
                     ("time_fp32", lambda: timing_run(
                         torch, device, ORACLE_SIZES if args.dry_run else TIMING_SIZES,
                         args.timing_steps, hook=False)),
                     ("time_alq3", lambda: timing_run(
                         torch, device, ORACLE_SIZES if args.dry_run else TIMING_SIZES,
                         args.timing_steps, hook=True)),
                     ("time_alq3_entropy", lambda: timing_run(
                         torch, device, ORACLE_SIZES if args.dry_run else TIMING_SIZES,
                         args.timing_steps, hook=True, wire="entropy"))):
        started = time.perf_counter()
        try:
            outcome[name] = ("ok", fn(), time.perf_counter() - started)
        except Exception:  # noqa: BLE001 - reported
            outcome[name] = ("error", traceback.format_exc(), time.perf_counter() - started)
    gathered = [None] * world
    dist.all_gather_object(gathered, outcome)
    if rank == 0:
        import pickle

        with open(os.path.join(outdir, "outcomes.pkl"), "wb") as f:
            pickle.dump(gathered, f)
    destroy_and_exit()     # not a normal return: PyTorch's Gloo shutdown race, docs/ddp.md §6


# ---------------------------------------------------------------- the oracle (driver)
def check_oracle(ranks: list[dict], world: int) -> list[str]:
    """Problems found comparing every step's applied gradients with the numpy codec."""
    import numpy as np

    from horovod_aq import codec
    from horovod_aq.codec.stream import StreamKey
    from horovod_aq.levels import LevelTable
    from horovod_aq.packed.cost import chunk_numel

    problems = []
    steps = len(ranks[0]["grads"])
    for step in range(steps):
        units = [[e for e in r["log"] if e["step"] == step] for r in ranks]
        for j, e0 in enumerate(units[0]):
            entries = [u[j] for u in units]
            table = LevelTable(e0["levels"], e0["version"])

            def enc(x, rank, part, e0=e0, table=table):
                return codec.encode(x, table, bucket_size=BUCKET, norm=e0["norm"],
                                    key=StreamKey(SEED, rank, step, e0["index"], part))
            n = e0["raw"].size
            if e0["mode"] == "allgather":
                want = codec.decode_average(np.stack([enc(e["raw"], r, 0)
                                                      for r, e in enumerate(entries)]), table)
            else:
                m = chunk_numel(n, world, BUCKET)
                pad = [np.concatenate([e["raw"], np.zeros(world * m - n, np.float32)])
                       for e in entries]
                want = np.concatenate([codec.decode(enc(codec.decode_average(np.stack(
                    [enc(pad[p][r * m:(r + 1) * m], p, r) for p in range(world)]), table),
                    r, world), table) for r in range(world)])[:n]
            for r, res in enumerate(ranks):
                got = np.concatenate([res["grads"][step][k].ravel() for k in e0["names"]])
                if not np.array_equal(got, want):
                    problems.append(f"step {step} bucket {e0['index']} rank {r}: "
                                    f"{int((got != want).sum())} of {n} coordinates differ")
    versions = [r["versions"] for r in ranks]
    if any(v != versions[0] for v in versions) or versions[0][:3] != [1, 1, 2]:
        problems.append(f"table versions per rank {versions} (expected 1, 1, 2, … everywhere)")
    return problems


def main() -> int:
    args = parse_args()
    if args.interpret:   # before torch: the ranks inherit the environment
        os.environ.update(HOROVOD_AQ_KERNELS="triton", TRITON_INTERPRET="1")
        args.dry_run, args.timing_steps = True, min(args.timing_steps, 2)
    import torch
    import torch.multiprocessing as mp

    if args.dry_run:
        world, device = 2, "CPU (dry run: Gloo" + (
            "; Triton's kernels in its interpreter)" if args.interpret else ")")
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --dry-run on CPU", file=sys.stderr)
            return 2
        world = args.share_gpu or max(1, min(args.ranks, torch.cuda.device_count()))
        device = torch.cuda.get_device_name(0) + (
            f", shared by {world} ranks over Gloo" if args.share_gpu else "")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as outdir:
        started = time.perf_counter()
        mp.spawn(rank_main, args=(world, port, args, outdir), nprocs=world, join=True)
        import pickle

        with open(os.path.join(outdir, "outcomes.pkl"), "rb") as f:
            gathered = pickle.load(f)
        total = time.perf_counter() - started

    lines, failed = [], False
    for name in ("oracle_allgather", "oracle_two_phase", "oracle_allgather_entropy",
                 "oracle_two_phase_entropy"):
        errs = [o[name][1] for o in gathered if o[name][0] != "ok"]
        if errs:
            problems = ["error:\n```\n" + errs[0][-3000:] + "\n```"]
        else:
            ranks = [o[name][1] for o in gathered]
            problems = check_oracle(ranks, world)
            if max(ranks[0]["layouts"][1:], default=0) < 2:
                problems.append(f"DDP's rebuilt layout has {ranks[0]['layouts']} buckets "
                                "(expected several)")
        failed |= bool(problems)
        lines.append(f"| {name} | {'PASS' if not problems else 'FAIL'} | "
                     f"{'; '.join(problems)[:2000] or 'bit-exact vs numpy, versions 1,1,2,…'} |")
    skips = [o["skip"] for o in gathered]
    if any(s[0] != "ok" for s in skips):
        failed = True
        lines.append(f"| skip | FAIL | error: {[s[1] for s in skips if s[0] != 'ok'][0][-1500:]} |")
    else:
        ok = all(s[1]["steps"] == [(True, True), (False, False)] and s[1]["finite"]
                 for s in skips)
        failed |= not ok
        lines.append(f"| skip | {'PASS' if ok else 'FAIL'} | {[s[1] for s in skips]} |")
    timing, counts = [], []
    for name in ("time_fp32", "time_alq3", "time_alq3_entropy"):
        outs = [o[name] for o in gathered]
        if any(o[0] != "ok" for o in outs):
            failed = True
            timing.append(f"| {name} | error: {[o[1] for o in outs if o[0] != 'ok'][0][-800:]} |")
        else:
            slowest = max((o[1] for o in outs), key=lambda c: c["median"])
            row, count = cost_rows(name, {**outs[0][1], "median": slowest["median"]})
            timing.append(row)
            if count:
                counts.append(count)
    report = "\n".join([
        "# GPU check of the DDP hook (NCCL)", "",
        f"- date: {dt.datetime.now().isoformat(timespec='seconds')}",
        f"- device: {device}; ranks: {world}; torch {torch.__version__}",
        f"- command: `python benchmarks/gpu_check_ddp.py {' '.join(sys.argv[1:])}`",
        f"- wall time: {total:.0f} s", "",
        "| check | result | details |", "|---|---|---|", *lines, "",
        f"Median step, {'dry-run model' if args.dry_run else '≈29M-parameter MLP'}, "
        "batch 64 per rank (max over ranks):", "",
        "| mode | median step |", "|---|---:|", *timing, "",
        *([f"Host synchronisations and device work per step (rank 0, {COUNTED_STEPS} steps after "
           "the timed ones; torch's sync debug mode and profiler):", "", *COST_HEADER, *counts,
           ""] if counts else [])])
    write_report(args.out, report)
    return 1 if failed else 0


def write_report(out: Path | None, text: str) -> None:
    """The Markdown report into ``out`` (its folder made) and on stdout."""
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
