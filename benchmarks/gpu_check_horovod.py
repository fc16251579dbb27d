"""GPU check of the Horovod packed optimizer (``horovod_aq.torch.DistributedOptimizer``) on CUDA.

Needs Horovod built with NCCL (``scripts/gpu_wheel.sh`` for a machine with no network,
``scripts/setup.sh --gpu`` otherwise), torch with CUDA, Triton and numba. Run one process per GPU
under ``horovodrun`` (rank 0 writes the report; every rank exits 1 if a check failed)::

    horovodrun --gloo -np 1 -H localhost:1 python benchmarks/gpu_check_horovod.py \
        --out benchmarks/results/gpu_horovod.md
    horovodrun --gloo -np 2 -H localhost:2 python benchmarks/gpu_check_horovod.py --dry-run

(``--dry-run``: CPU tensors over Gloo, small sizes; the numbers mean nothing.) Checks:

1. **oracle**: ``ALQ(bits=3)`` refitting after steps 0 and 2, allgather and two-phase, error
   feedback off and on, 3 steps each. Without error feedback every payload a rank sends is
   ``codec.encode`` of its gradient with the format's stream key (docs/format.md §6); in every run
   the gradients the optimizer hands to SGD are the numpy ``decode_average`` of the payloads
   (allgather) or the two-phase chain (decode_average of chunk r, re-encoded, decoded), bit for
   bit on every rank, and the table versions advance identically (1, 1, 2);
2. **host synchronisations**: ``torch.cuda.set_sync_debug_mode("warn")`` over whole steps
   (forward, backward, exchange, SGD step) after three warm-up steps, for Horovod's fp32
   optimizer and the packed one, counted per step with the source lines that made them;
3. **step time**: a 29M-parameter MLP, median step (forward + backward + exchange + SGD step,
   timed between device synchronisations), Horovod's fp32 ``DistributedOptimizer`` (NCCL
   allreduce) against the packed ALQ 3-bit optimizer with its defaults;
4. **launches**: the device kernels and copies per step (torch's profiler) of both, with the
   packed optimizer's number of fused buckets.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_check_ddp import (  # noqa: E402
    TIMING_SIZES,
    _batch,
    _model,
    median_step,
    write_report,
)

BUCKET = 256
SEED = 5
ORACLE_SIZES = (64, 512, 512, 256, 10)
ORACLE_STEPS = 3
FUSION_BYTES = 1 << 18       # several fused buckets for the oracle model
ORACLE_RUNS = [(exchange, ef) for ef in (False, True) for exchange in ("allgather", "two_phase")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="report path (default: print it)")
    p.add_argument("--timing-steps", type=int, default=20)
    p.add_argument("--sync-steps", type=int, default=3)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU tensors, small timing model (numbers meaningless)")
    return p.parse_args(argv)


# ---------------------------------------------------------------- inside a rank
def oracle_run(torch, hvd, device, exchange: str, error_feedback: bool) -> dict:
    """Three packed steps; what every payload encoded and what SGD was handed."""
    import torch.nn.functional as F

    import horovod_aq
    import horovod_aq.torch as aqt

    model = _model(torch, ORACLE_SIZES).to(device)
    comp = horovod_aq.ALQ(bits=3, bucket_size=BUCKET, seed=SEED, schedule="0,2,0")
    opt = aqt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
        compression=comp, exchange=exchange, error_feedback=error_feedback,
        fusion_bytes=FUSION_BYTES)
    sent: list[dict] = []
    opt.wire.tap = lambda bucket, part, values, payload: sent.append({
        "bucket": bucket.name, "index": bucket.index, "part": part,
        "values": values.detach().cpu().numpy().copy(),
        "payload": payload.detach().cpu().numpy().copy()})
    steps = []
    for step in range(ORACLE_STEPS):
        sent.clear()
        table = (comp.table.levels.copy(), comp.table.version, comp.step)
        opt.zero_grad()
        x, y = _batch(torch, ORACLE_SIZES, hvd.rank(), step, device)
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        grads = {n: p.grad.detach().cpu().numpy().copy() for n, p in model.named_parameters()}
        with opt.skip_synchronize():
            opt.step()
        steps.append({"table": table, "sent": list(sent), "grads": grads,
                      "version_after": comp.table.version})
    return {"steps": steps, "buckets": opt.buckets, "norm": comp.norm,
            "error_feedback": error_feedback, "exchange": exchange}


def _step(torch, model, opt, x, y) -> None:
    import torch.nn.functional as F

    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _optimizer(torch, hvd, model, packed: bool):
    import horovod_aq
    import horovod_aq.torch as aqt

    base = torch.optim.SGD(model.parameters(), lr=0.01)
    if not packed:
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    return aqt.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                    compression=horovod_aq.ALQ(bits=3))


def timing_run(torch, hvd, device, sizes, steps: int, packed: bool) -> float:
    """Median seconds of a whole step, between device synchronisations, after 3 warm-ups."""
    model = _model(torch, sizes).to(device)
    opt = _optimizer(torch, hvd, model, packed)
    x, y = _batch(torch, sizes, hvd.rank(), 0, device, n=64)
    return median_step(torch, device, lambda: _step(torch, model, opt, x, y), steps)


def _warmed(torch, hvd, device, sizes, packed: bool):
    """The model, its optimizer and a batch after 3 steps (tables fitted, buffers allocated)."""
    model = _model(torch, sizes).to(device)
    opt = _optimizer(torch, hvd, model, packed)
    x, y = _batch(torch, sizes, hvd.rank(), 0, device, n=64)
    for _ in range(3):
        _step(torch, model, opt, x, y)
    torch.cuda.synchronize()
    return model, opt, x, y


def sync_run(torch, hvd, device, sizes, steps: int, packed: bool) -> dict:
    """Host synchronisations per step that torch's sync debug mode reports, by source line."""
    if device.type != "cuda":
        return {"per_step": None, "where": {}}
    model, opt, x, y = _warmed(torch, hvd, device, sizes, packed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                _step(torch, model, opt, x, y)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return {"per_step": len(syncs) / steps, "where": dict(where.most_common(12))}


def launch_run(torch, hvd, device, sizes, steps: int, packed: bool) -> dict:
    """Device kernels and copies per step that torch's profiler records, and the buckets."""
    if device.type != "cuda":
        return {"per_step": None, "buckets": None, "top": {}}
    from torch.profiler import ProfilerActivity, profile

    model, opt, x, y = _warmed(torch, hvd, device, sizes, packed)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _step(torch, model, opt, x, y)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    names = collections.Counter(e.name[:60] for e in events)
    return {"per_step": len(events) / steps,
            "buckets": len(opt.buckets) if packed else None,
            "top": dict(names.most_common(8))}


def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except Exception:
        return ("error", traceback.format_exc())


# ---------------------------------------------------------------- checks (every rank)
def check_oracle(ranks: list[dict]) -> list[str]:
    """Problems found comparing every step's payloads and applied gradients with the codec."""
    import numpy as np

    from horovod_aq import codec
    from horovod_aq.codec.stream import StreamKey
    from horovod_aq.levels import LevelTable

    problems = []
    P = len(ranks)
    for step in range(ORACLE_STEPS):
        levels, version, q_step = ranks[0]["steps"][step]["table"]
        table = LevelTable(levels, version)
        sent = [r["steps"][step]["sent"] for r in ranks]
        if not ranks[0]["error_feedback"]:
            for rank, entries in enumerate(sent):
                for e in entries:
                    if e["part"] == P and ranks[0]["exchange"] == "two_phase":
                        continue   # the re-encode of an average: checked through the chain
                    want = codec.encode(e["values"], table, bucket_size=BUCKET,
                                        norm=ranks[0]["norm"],
                                        key=StreamKey(SEED, rank, q_step, e["index"], e["part"]))
                    if not np.array_equal(want, e["payload"]):
                        problems.append(f"step {step} rank {rank} {e['bucket']} part "
                                        f"{e['part']}: the payload is not codec.encode's")
        for name, numel, mode, params in ranks[0]["buckets"]:
            def of(rank, part, name=name):
                return next(e for e in sent[rank] if e["bucket"] == name and e["part"] == part)
            if mode == "allgather":
                want = codec.decode_average(np.stack([of(r, 0)["payload"] for r in range(P)]),
                                            table)
            else:
                pieces = []
                for r in range(P):
                    avg = codec.decode_average(
                        np.stack([of(p, r)["payload"] for p in range(P)]), table)
                    avg[max(numel - r * avg.size, 0):] = 0
                    again = of(r, P)
                    if not np.array_equal(again["values"], avg):
                        problems.append(f"step {step} {name}: rank {r} re-encoded another "
                                        "average than decode_average's")
                    pieces.append(codec.decode(again["payload"], table))
                want = np.concatenate(pieces)[:numel]
            for r, res in enumerate(ranks):
                got = np.concatenate([res["steps"][step]["grads"][n].ravel() for n in params])
                if not np.array_equal(got, want):
                    problems.append(f"step {step} {name} rank {r}: "
                                    f"{int((got != want).sum())} of {numel} coordinates differ")
    versions = [[s["version_after"] for s in r["steps"]] for r in ranks]
    if any(v != [1, 1, 2] for v in versions):
        problems.append(f"table versions per rank {versions} (expected 1, 1, 2 everywhere)")
    return problems


def report(args, gathered: list[dict], device: str, world: int, seconds: float) -> tuple[str, bool]:
    import horovod
    import torch

    lines, failed = [], False
    for exchange, ef in ORACLE_RUNS:
        name = f"oracle {exchange}{', error feedback' if ef else ''}"
        outs = [o[name] for o in gathered]
        if any(o[0] != "ok" for o in outs):
            problems = ["error:\n```\n" + [o[1] for o in outs if o[0] != "ok"][0][-3000:]
                        + "\n```"]
        else:
            problems = check_oracle([o[1] for o in outs])
        failed |= bool(problems)
        detail = "; ".join(problems)[:2000] or (
            "gradients bit-exact vs numpy decode" + ("" if ef else ", payloads vs codec.encode")
            + ", versions 1,1,2")
        lines.append(f"| {name} | {'PASS' if not problems else 'FAIL'} | {detail} |")
    timing, syncs, launches = [], [], []
    for label, key in (("Horovod fp32 (allreduce)", "fp32"),
                       ("packed ALQ 3-bit, defaults", "alq3")):
        t = [o[f"time {key}"] for o in gathered]
        s = [o[f"sync {key}"] for o in gathered]
        k = [o[f"launch {key}"] for o in gathered]
        if any(o[0] != "ok" for o in t + s + k):
            failed = True
            err = [o[1] for o in t + s + k if o[0] != "ok"][0][-800:]
            timing.append(f"| {label} | error: {err} |")
            continue
        timing.append(f"| {label} | {max(o[1] for o in t) * 1e3:.2f} ms |")
        first, kernels = s[0][1], k[0][1]
        if first["per_step"] is not None:
            where = ", ".join(f"`{k}` ×{v}" for k, v in first["where"].items()) or "—"
            syncs.append(f"| {label} | {first['per_step']:.1f} | {where} |")
        if kernels["per_step"] is not None:
            top = ", ".join(f"`{n}` ×{v}" for n, v in kernels["top"].items())
            buckets = "—" if kernels["buckets"] is None else str(kernels["buckets"])
            launches.append(f"| {label} | {kernels['per_step']:.1f} | {buckets} | {top} |")
    out = [
        "# GPU check of the Horovod packed optimizer", "",
        f"- date: {dt.datetime.now().isoformat(timespec='seconds')}",
        f"- device: {device}; ranks: {world}; torch {torch.__version__}; "
        f"horovod {horovod.__version__}",
        f"- command: `horovodrun -np {world} python benchmarks/gpu_check_horovod.py "
        f"{' '.join(sys.argv[1:])}`",
        f"- wall time: {seconds:.0f} s", "",
        "| check | result | details |", "|---|---|---|", *lines, "",
        f"Median step, {'dry-run model' if args.dry_run else '≈29M-parameter MLP'}, "
        "batch 64 per rank (max over ranks):", "",
        "| optimizer | median step |", "|---|---:|", *timing, ""]
    if syncs:
        out += [f"Host synchronisations per step (rank 0, torch's sync debug mode, "
                f"{args.sync_steps} steps after 3 warm-ups):", "",
                "| optimizer | per step | where (file:line × count) |", "|---|---:|---|",
                *syncs, ""]
    if launches:
        out += [f"Device kernels and copies per step (rank 0, torch's profiler, "
                f"{args.sync_steps} steps after 3 warm-ups; the model's forward, backward and "
                "SGD step included):", "",
                "| optimizer | per step | fused buckets | most frequent (name × count) |",
                "|---|---:|---:|---|", *launches, ""]
    return "\n".join(out), failed


def main(argv=None) -> int:
    args = parse_args(argv)
    import horovod.torch as hvd
    import torch

    started = time.perf_counter()
    hvd.init()
    torch.set_num_threads(1)
    if args.dry_run:
        device, sizes, name = torch.device("cpu"), (64, 256, 256, 10), "CPU (dry run)"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --dry-run on CPU", file=sys.stderr)
            return 2
        torch.cuda.set_device(hvd.local_rank())
        device, sizes = torch.device("cuda", hvd.local_rank()), TIMING_SIZES
        name = f"{torch.cuda.get_device_name(device)}, NCCL built: {bool(hvd.nccl_built())}"
    outcomes = {}
    for exchange, ef in ORACLE_RUNS:
        outcomes[f"oracle {exchange}{', error feedback' if ef else ''}"] = outcome(
            oracle_run, torch, hvd, device, exchange, ef)
    for key, packed in (("fp32", False), ("alq3", True)):
        outcomes[f"time {key}"] = outcome(timing_run, torch, hvd, device, sizes,
                                          args.timing_steps, packed)
        outcomes[f"sync {key}"] = outcome(sync_run, torch, hvd, device, sizes,
                                          args.sync_steps, packed)
        outcomes[f"launch {key}"] = outcome(launch_run, torch, hvd, device, sizes,
                                            args.sync_steps, packed)
    gathered = hvd.allgather_object(outcomes)
    text, failed = report(args, gathered, name, hvd.size(), time.perf_counter() - started)
    if hvd.rank() == 0:
        write_report(args.out, text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
