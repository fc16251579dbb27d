"""GPU check of the Horovod packed optimizer (``horovod_aq.torch.DistributedOptimizer``) on CUDA.

Needs Horovod built with NCCL (``scripts/gpu_wheel.sh`` for a machine with no network,
``scripts/setup.sh --gpu`` otherwise), torch with CUDA, Triton and numba. Run one process per GPU
under ``horovodrun`` (rank 0 writes the report; every rank exits 1 if a check failed)::

    horovodrun --gloo -np 1 -H localhost:1 python benchmarks/gpu_check_horovod.py \
        --out benchmarks/results/gpu_horovod.md
    horovodrun --gloo -np 2 -H localhost:2 python benchmarks/gpu_check_horovod.py --dry-run
    horovodrun --gloo -np 2 -H localhost:2 python benchmarks/gpu_check_horovod.py --interpret

(``--dry-run``: CPU tensors over Gloo, small sizes; the numbers mean nothing. ``--interpret``:
the same on the GPU's code path, Triton's kernels in its interpreter, a tiny model.) Checks:

1. **oracle**: ``ALQ(bits=3)`` refitting after steps 0 and 2, allgather and two-phase, error
   feedback off and on, and the entropy-coded wire without it, 3 steps each. Without error
   feedback every payload a rank sends is ``codec.encode`` (``codec.encode_entropy``) of its
   gradient with the format's stream key (docs/format.md §6); in every run
   the gradients the optimizer hands to SGD are the numpy ``decode_average`` of the payloads
   (allgather) or the two-phase chain (decode_average of chunk r, re-encoded, decoded), bit for
   bit on every rank, and the table versions advance identically (1, 1, 2);
2. **step time**: a 29M-parameter MLP, median step (forward + backward + exchange + SGD step,
   timed between device synchronisations), Horovod's fp32 ``DistributedOptimizer`` (NCCL
   allreduce) against the packed ALQ 3-bit optimizer with its defaults, with two-phase and with
   the entropy-coded wire;
3. **host synchronisations and launches** (CUDA; ``gpu_check_ddp.step_costs``): over three more
   whole steps of each, the host synchronisations ``torch.cuda.set_sync_debug_mode("warn")``
   reports, with the source lines that made them, and the device kernels and copies torch's
   profiler records, with the packed optimizer's number of fused buckets.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_check_ddp import (  # noqa: E402
    COST_HEADER,
    COUNTED_STEPS,
    TIMING_SIZES,
    _batch,
    _model,
    cost_rows,
    step_costs,
    write_report,
)

BUCKET = 256
SEED = 5
ORACLE_SIZES = (64, 512, 512, 256, 10)
ORACLE_STEPS = 3
FUSION_BYTES = 1 << 18       # several fused buckets for the oracle model
#: The oracle and timing model of ``--interpret`` (Triton's interpreter runs a kernel's
#: programs one after another in Python) and its fusion: ≈ 7K parameters in several buckets.
INTERPRETED_SIZES, INTERPRETED_FUSION_BYTES = (8, 64, 64, 32, 10), 1 << 13
#: (exchange, error feedback, wire) of the oracle runs: fixed codes with and without error
#: feedback, and the entropy-coded wire without it.
ORACLE_RUNS = [(exchange, ef, wire) for ef, wire in ((False, "fixed"), (True, "fixed"),
                                                     (False, "entropy"))
               for exchange in ("allgather", "two_phase")]
#: The timed and counted optimizers: (key, packed, forced settings). Two-phase forced: its
#: buckets carry presence masks, whose union stays on the device; the entropy-coded wire: its
#: rows delimited and checked from one host copy, decoded on the device (docs/gpu.md §1).
COST_RUNS = [("fp32", False, {}), ("alq3", True, {}),
             ("alq3_two_phase", True, {"exchange": "two_phase"}),
             ("alq3_entropy", True, {"wire": "entropy"})]
COST_LABELS = [("Horovod fp32 (allreduce)", "fp32"), ("packed ALQ 3-bit, defaults", "alq3"),
               ("packed ALQ 3-bit, two-phase", "alq3_two_phase"),
               ("packed ALQ 3-bit, entropy-coded wire", "alq3_entropy")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="report path (default: print it)")
    p.add_argument("--timing-steps", type=int, default=20)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU tensors, small timing model (numbers meaningless)")
    p.add_argument("--interpret", action="store_true",
                   help="a dry run on the GPU's code path: Triton's kernels in its interpreter "
                        "on CPU tensors (HOROVOD_AQ_KERNELS=triton, TRITON_INTERPRET=1), a tiny "
                        "model and 2 timing steps (slow: the interpreter)")
    return p.parse_args(argv)


# ---------------------------------------------------------------- inside a rank
def oracle_name(exchange: str, error_feedback: bool, wire: str) -> str:
    return (f"oracle {exchange}{', error feedback' if error_feedback else ''}"
            f"{', entropy-coded wire' if wire == 'entropy' else ''}")


def oracle_run(torch, hvd, device, exchange: str, error_feedback: bool,
               wire: str = "fixed") -> dict:
    """Three packed steps; what every payload encoded and what SGD was handed."""
    import torch.nn.functional as F

    import horovod_aq
    import horovod_aq.torch as aqt

    model = _model(torch, ORACLE_SIZES).to(device)
    comp = horovod_aq.ALQ(bits=3, bucket_size=BUCKET, seed=SEED, schedule="0,2,0")
    opt = aqt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
        compression=comp, exchange=exchange, error_feedback=error_feedback,
        fusion_bytes=FUSION_BYTES, wire=wire)
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
            "error_feedback": error_feedback, "exchange": exchange, "wire": wire}


def _step(torch, model, opt, x, y) -> None:
    import torch.nn.functional as F

    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _optimizer(torch, hvd, model, packed: bool, chosen: dict | None = None):
    import horovod_aq
    import horovod_aq.torch as aqt

    base = torch.optim.SGD(model.parameters(), lr=0.01)
    if not packed:
        return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    return aqt.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                    compression=horovod_aq.ALQ(bits=3), **(chosen or {}))


def costs_run(torch, hvd, device, sizes, steps: int, packed: bool,
              chosen: dict | None = None) -> dict:
    """The median step and, on CUDA, host synchronisations and device kernels per step
    (``gpu_check_ddp.step_costs``), with the packed optimizer's number of fused buckets
    (``chosen``: the optimizer's settings forced, else the defaults)."""
    model = _model(torch, sizes).to(device)
    opt = _optimizer(torch, hvd, model, packed, chosen)
    x, y = _batch(torch, sizes, hvd.rank(), 0, device, n=64)
    costs = step_costs(torch, device, lambda: _step(torch, model, opt, x, y), steps)
    costs["buckets"] = len(opt.buckets) if packed else None
    return costs


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
    encode = codec.encode_entropy if ranks[0]["wire"] == "entropy" else codec.encode
    for step in range(ORACLE_STEPS):
        levels, version, q_step = ranks[0]["steps"][step]["table"]
        table = LevelTable(levels, version)
        sent = [r["steps"][step]["sent"] for r in ranks]
        if not ranks[0]["error_feedback"]:
            for rank, entries in enumerate(sent):
                for e in entries:
                    if e["part"] == P and ranks[0]["exchange"] == "two_phase":
                        continue   # the re-encode of an average: checked through the chain
                    want = encode(e["values"], table, bucket_size=BUCKET,
                                  norm=ranks[0]["norm"],
                                  key=StreamKey(SEED, rank, q_step, e["index"], e["part"]))
                    if not np.array_equal(want, e["payload"]):
                        problems.append(f"step {step} rank {rank} {e['bucket']} part "
                                        f"{e['part']}: the payload is not {encode.__name__}'s")
        for name, numel, mode, params in ranks[0]["buckets"]:
            def of(rank, part, name=name):
                return next(e for e in sent[rank] if e["bucket"] == name and e["part"] == part)
            if mode == "allgather":   # (a list: entropy-coded payloads differ in length)
                want = codec.decode_average([of(r, 0)["payload"] for r in range(P)], table)
            else:
                pieces = []
                for r in range(P):
                    avg = codec.decode_average([of(p, r)["payload"] for p in range(P)], table)
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
    for exchange, ef, wire in ORACLE_RUNS:
        name = oracle_name(exchange, ef, wire)
        outs = [o[name] for o in gathered]
        if any(o[0] != "ok" for o in outs):
            problems = ["error:\n```\n" + [o[1] for o in outs if o[0] != "ok"][0][-3000:]
                        + "\n```"]
        else:
            problems = check_oracle([o[1] for o in outs])
        failed |= bool(problems)
        detail = "; ".join(problems)[:2000] or (
            "gradients bit-exact vs numpy decode" + ("" if ef else ", payloads vs codec."
                                                     + ("encode_entropy" if wire == "entropy"
                                                        else "encode"))
            + ", versions 1,1,2")
        lines.append(f"| {name} | {'PASS' if not problems else 'FAIL'} | {detail} |")
    timing, counts = [], []
    for label, key in COST_LABELS:
        outs = [o[f"costs {key}"] for o in gathered]
        if any(o[0] != "ok" for o in outs):
            failed = True
            timing.append(f"| {label} | error: {[o[1] for o in outs if o[0] != 'ok'][0][-800:]} |")
            continue
        slowest = max(o[1]["median"] for o in outs)
        row, count = cost_rows(label, {**outs[0][1], "median": slowest}, outs[0][1]["buckets"])
        timing.append(row)
        if count:
            counts.append(count)
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
    if counts:
        out += [f"Host synchronisations and device work per step (rank 0, {COUNTED_STEPS} steps "
                "after the timed ones; torch's sync debug mode and profiler; the model's forward, "
                "backward and SGD step included):", "", *COST_HEADER, *counts, ""]
    return "\n".join(out), failed


def main(argv=None) -> int:
    global ORACLE_SIZES, FUSION_BYTES
    args = parse_args(argv)
    if args.interpret:   # before horovod_aq reads it
        os.environ.update(HOROVOD_AQ_KERNELS="triton", TRITON_INTERPRET="1")
        args.dry_run, args.timing_steps = True, min(args.timing_steps, 2)
        ORACLE_SIZES, FUSION_BYTES = INTERPRETED_SIZES, INTERPRETED_FUSION_BYTES
    import horovod.torch as hvd
    import torch

    started = time.perf_counter()
    hvd.init()
    torch.set_num_threads(1)
    if args.interpret:
        device, sizes = torch.device("cpu"), INTERPRETED_SIZES
        name = "CPU (dry run; Triton's kernels in its interpreter)"
    elif args.dry_run:
        device, sizes, name = torch.device("cpu"), (64, 256, 256, 10), "CPU (dry run)"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --dry-run on CPU", file=sys.stderr)
            return 2
        torch.cuda.set_device(hvd.local_rank())
        device, sizes = torch.device("cuda", hvd.local_rank()), TIMING_SIZES
        name = f"{torch.cuda.get_device_name(device)}, NCCL built: {bool(hvd.nccl_built())}"
    outcomes = {}
    for exchange, ef, wire in ORACLE_RUNS:
        outcomes[oracle_name(exchange, ef, wire)] = outcome(
            oracle_run, torch, hvd, device, exchange, ef, wire)
    for key, packed, chosen in COST_RUNS:
        outcomes[f"costs {key}"] = outcome(costs_run, torch, hvd, device, sizes,
                                           args.timing_steps, packed, chosen)
    gathered = hvd.allgather_object(outcomes)
    text, failed = report(args, gathered, name, hvd.size(), time.perf_counter() - started)
    if hvd.rank() == 0:
        write_report(args.out, text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
