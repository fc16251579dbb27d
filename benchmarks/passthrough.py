"""Quantization off: horovod_aq.torch.DistributedOptimizer vs Horovod's own, time per step.

    python benchmarks/passthrough.py                          # 2 ranks, Gloo then MPI
    git show <commit>:horovod_aq/torch/optimizer.py > /tmp/optimizer_before.py
    python benchmarks/passthrough.py --before /tmp/optimizer_before.py   # + the older optimizer

A user who turns quantization off (``NoCompression()`` / ``FP16()``) must get Horovod's speed.
Every rank trains one MNIST MLP (784-128-10, batch 32, SGD with momentum, the bundled 5k
subset) per variant — Horovod's ``hvd.DistributedOptimizer`` with ``Compression.none`` and
``.fp16``, ours with ``NoCompression()`` and ``FP16()``, and with ``--before`` the same two with
the optimizer module in that file (e.g. the version before the pass-through), and a diagnostic
variant: ours with ``NoCompression()`` whose allreduces are waited for with
``horovod_aq.torch.optimizer.wait`` (sleeping polls) instead of Horovod's ``synchronize``
(which spins, yielding, until the collective is done). All variants are
built first and then timed side by side in interleaved rounds (each round runs ``--steps``
steps of every variant in turn), so that load changes on a shared machine hit every variant
alike; the first round is warm-up. Reported: the median over rounds of the time per step, the
mean over ranks, and the ratio to Horovod's own optimizer with the same wire format. Results go
to benchmarks/results/passthrough.md (with the command, machine and versions).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import report  # noqa: E402
from horovod_aq.tools.launcher import run_local  # noqa: E402

#: (label, who builds it, wire) in the order they run within a round.
VARIANTS = (("hvd.DistributedOptimizer, Compression.none", "horovod", "none"),
            ("horovod_aq, NoCompression()", "ours", "none"),
            ("hvd.DistributedOptimizer, Compression.fp16", "horovod", "fp16"),
            ("horovod_aq, FP16()", "ours", "fp16"),
            ("horovod_aq, NoCompression(), sleeping waits (diagnostic)", "ours-poll", "none"))


def bench(rounds: int, steps: int, before: str | None) -> dict:
    import importlib.util
    import types

    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F
    from horovod.torch.optimizer import _DistributedOptimizer

    import horovod_aq
    import horovod_aq.torch as aqt
    from horovod_aq.tools.datasets import load_mnist_5k
    from horovod_aq.torch.optimizer import wait

    def sleeping_waits(opt):
        """Horovod's submission (the pass-through), waited for by polling with sleeps."""
        def submit(self, p):
            self._aq_begin()
            handle, ctx = _DistributedOptimizer._allreduce_grad_async(self, p)
            return (lambda: wait(handle)), ctx
        opt._allreduce_grad_async = types.MethodType(submit, opt)

    torch.set_num_threads(1)
    hvd.init()
    train, _ = load_mnist_5k(seed=0)
    shard = train.shard(hvd.rank(), hvd.size())
    xs = torch.from_numpy(shard.images.reshape(len(shard.labels), -1))
    ys = torch.from_numpy(shard.labels)

    variants = list(VARIANTS)
    factories = {"horovod": hvd.DistributedOptimizer, "ours": aqt.DistributedOptimizer,
                 "ours-poll": aqt.DistributedOptimizer}
    if before:
        spec = importlib.util.spec_from_file_location("horovod_aq_optimizer_before", before)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        factories["before"] = module.DistributedOptimizer
        variants += [("horovod_aq, NoCompression() (before)", "before", "none"),
                     ("horovod_aq, FP16() (before)", "before", "fp16")]
    runs = []
    for label, who, wire in variants:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(784, 128), torch.nn.ReLU(),
                                    torch.nn.Linear(128, 10))
        base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if who == "horovod":
            comp = hvd.Compression.fp16 if wire == "fp16" else hvd.Compression.none
            opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                           compression=comp)
        else:
            comp = horovod_aq.FP16() if wire == "fp16" else horovod_aq.NoCompression()
            opt = factories[who](base, named_parameters=model.named_parameters(),
                                 compression=comp)
            if who == "ours-poll":
                sleeping_waits(opt)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        runs.append((label, model, opt, torch.Generator().manual_seed(hvd.rank())))
    seconds = {label: [] for label, *_ in runs}
    for _ in range(rounds + 1):
        for label, model, opt, gen in runs:
            hvd.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                idx = torch.randint(0, len(ys), (32,), generator=gen)
                opt.zero_grad()
                F.cross_entropy(model(xs[idx]), ys[idx]).backward()
                opt.step()
            seconds[label].append((time.perf_counter() - t0) / steps)
    return {label: times[1:] for label, times in seconds.items()}   # round 0: warm-up


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--controllers", nargs="+", choices=["gloo", "mpi"], default=["gloo", "mpi"])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=40, help="steps per variant and round")
    p.add_argument("--before", help="an older horovod_aq/torch/optimizer.py to time as well")
    p.add_argument("--quick", action="store_true", help="3 rounds of 10 steps")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps = 3, 10
    kwargs = {"rounds": args.rounds, "steps": args.steps,
              "before": os.path.abspath(args.before) if args.before else None}
    sections = []
    for controller in args.controllers:
        res = run_local([(bench, kwargs)], np=args.np, controller=controller,
                        timeout=1800).get("bench")
        labels = list(res[0])
        per_step = {k: float(np.mean([np.median(r[k]) for r in res])) for k in labels}
        spread = {k: float(np.mean([np.percentile(r[k], 75) - np.percentile(r[k], 25)
                                    for r in res])) for k in labels}
        reference = {"none": per_step[VARIANTS[0][0]], "fp16": per_step[VARIANTS[2][0]]}
        rows = []
        for label in labels:
            wire = "fp16" if ("fp16" in label or "FP16" in label) else "none"
            rows.append([label, wire, f"{1e3 * per_step[label]:.2f}",
                         f"{1e3 * spread[label]:.2f}",
                         f"{per_step[label] / reference[wire]:.2f}"])
        table = report.markdown_table(
            ["optimizer", "wire", "ms / step (median)", "IQR (ms)", "× Horovod's own"], rows)
        sections.append(f"### {args.np} ranks, {controller}\n\n{table}")
    summary = (f"{args.np} ranks, MNIST MLP 784-128-10, batch 32, {args.rounds} interleaved "
               f"rounds × {args.steps} steps per variant (after one warm-up round); time per step "
               "is each rank's median over rounds, averaged over ranks; the ratio compares with "
               "Horovod's own optimizer on the same wire.")
    body = summary + "\n\n" + "\n\n".join(sections)
    report.write("passthrough", "Quantization off: pass-through to Horovod's allreduce", body,
                 quick=args.quick)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
