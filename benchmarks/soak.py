"""Soak test (benchmark mode, not CI): many steps on 4 ranks with frequent refits.

    python benchmarks/soak.py                   # 4 ranks, 10,000 steps, refit every 500
    python benchmarks/soak.py --steps 500 --np 2 --quick

Each rank trains a small MLP with the packed PyTorch optimizer (ALQ 3-bit with ECQ-SGD error
feedback, two-phase exchange at 4 ranks) and samples, every ``--sample-every`` steps, its
resident memory (RSS), the number of live torch tensors (gc) and open file descriptors. At the
end every rank's level table is compared. Pass/fail: RSS growth over the second half of the run
below ``--max-growth-mb``, live tensors flat, identical tables. Results go to
benchmarks/results/soak.md (with the command, machine and versions).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import report  # noqa: E402
from horovod_aq.tools.launcher import run_local  # noqa: E402


def soak(steps: int, refit_every: int, sample_every: int) -> dict:
    import horovod.torch as hvd
    import psutil
    import torch
    import torch.nn.functional as F

    import horovod_aq
    import horovod_aq.torch as aqt

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    comp = horovod_aq.ErrorFeedback(horovod_aq.ALQ(
        bits=3, bucket_size=1024, schedule=horovod_aq.RefitSchedule(steps=(0,), every=refit_every)))
    opt = aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   model.named_parameters(), comp)
    proc = psutil.Process()
    gen = torch.Generator().manual_seed(hvd.rank())
    samples = []
    t0 = time.perf_counter()
    for step in range(steps):
        x = torch.randn(32, 256, generator=gen)
        y = torch.randint(0, 10, (32,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step % sample_every == 0 or step == steps - 1:
            gc.collect()
            tensors = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
            samples.append((step, proc.memory_info().rss / 2**20, tensors, proc.num_fds()))
    return {"samples": samples, "levels": comp.table.levels.tobytes(),
            "version": comp.table.version, "seconds": time.perf_counter() - t0,
            "modes": sorted({b[2] for b in opt.buckets})}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--refit-every", type=int, default=500)
    p.add_argument("--sample-every", type=int, default=250)
    p.add_argument("--controller", choices=["gloo", "mpi"], default="gloo")
    p.add_argument("--max-growth-mb", type=float, default=20.0)
    p.add_argument("--quick", action="store_true", help="1000 steps, 2 ranks, refit every 50")
    args = p.parse_args()
    if args.quick:
        args.np, args.steps, args.refit_every, args.sample_every = 2, 1000, 50, 50
    kwargs = {"steps": args.steps, "refit_every": args.refit_every,
              "sample_every": args.sample_every}
    res = run_local([(soak, kwargs)], np=args.np, controller=args.controller,
                    timeout=max(600, args.steps * 0.5)).get("soak")
    rows, ok = [], True
    identical = len({r["levels"] for r in res}) == 1 and len({r["version"] for r in res}) == 1
    ok &= identical
    for rank, r in enumerate(res):
        s = np.array(r["samples"], dtype=float)
        half = s[s[:, 0] >= s[-1, 0] / 2]
        growth = half[-1, 1] - half[0, 1]
        tensor_growth = half[-1, 2] - half[0, 2]
        fd_growth = half[-1, 3] - half[0, 3]
        rank_ok = growth < args.max_growth_mb and tensor_growth <= 0 and fd_growth <= 0
        ok &= rank_ok
        rows.append([rank, f"{s[0, 1]:.0f}", f"{s[-1, 1]:.0f}", f"{growth:+.1f}",
                     f"{int(s[0, 2])} → {int(s[-1, 2])}", f"{int(s[0, 3])} → {int(s[-1, 3])}",
                     f"{r['seconds']:.0f}", "ok" if rank_ok else "FAIL"])
    table = report.markdown_table(
        ["rank", "RSS start (MiB)", "RSS end (MiB)", "RSS growth, 2nd half (MiB)",
         "live tensors", "open fds", "seconds", "verdict"], rows)
    summary = (f"{args.np} ranks ({args.controller}), {args.steps} steps, ALQ 3-bit + ECQ-SGD, "
               f"refit every {args.refit_every} steps → final table v{res[0]['version']}, "
               f"exchange {', '.join(res[0]['modes'])}; tables identical on every rank: "
               f"{'yes' if identical else 'NO'}. Verdict: {'PASS' if ok else 'FAIL'}.")
    report.write("soak", "Soak test", summary + "\n\n" + table, quick=args.quick)
    print(summary)
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
