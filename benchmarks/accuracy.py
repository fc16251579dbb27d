"""Final test accuracy and loss after a fixed budget: fp32, fp16 and every quantizer.

    python benchmarks/accuracy.py             # 4 ranks, seeds 0,1,2, 1 epoch per configuration
    python benchmarks/accuracy.py --converged --seeds 0 --resume   # 10 epochs, cosine lr; a part
    python benchmarks/accuracy.py --quick     # CI: 2 ranks, 1 seed, 3 configurations, 40 steps

**Task.** Fashion-MNIST (``benchmarks/fashion_mnist.py``: the Debian package
``dataset-fashion-mnist``, 60,000 training and 10,000 test images, read from its idx files; the
setup step installs it with apt-get when missing), the ``SmallCNN`` of ``benchmarks/models.py``
(281k parameters), 4 ranks, each training on its own 15,000-image shard with batch 32 (global
batch 128), SGD with momentum 0.9, learning rate ``--lr`` (constant, or ``--lr-schedule cosine``:
lr·(1 + cos(π·t/T))/2 at step t of T), for ``--epochs`` epochs.

**Converged runs** (``--converged``): 10 epochs, cosine schedule from lr 0.05, every method with
its own default bucket size (``--bucket-size 0``), the configurations of :data:`CONVERGED`, and
the report ``results/accuracy_converged.md``. A full run takes hours on a shared 2-core machine,
so it runs in parts: ``--seeds 0 --resume`` adds seed 0's runs to what the .json beside the report
already holds (a (configuration, seed) already there is skipped); each launch runs ``--group``
configurations and the report and .json are rewritten after each launch.

**Configurations.** fp32, fp16, and each quantizer at 3 bits — QSGD, QSGDinf, NUQSGD, TernGrad
(always ternary), natural dithering, ALQ, ALQ-N, ALQ-G, AMQ, AMQ-N — plus ALQ, AMQ and QSGDinf at 2
bits, ALQ at 2 and 3 bits with the paper's L2 bucket norm ("(L2)"): the adaptive methods'
default is L∞ at every width, docs/quantizers.md §5.6; "EF(ALQ 2b)", "EF(ALQ 3b)" and
"EF(QSGDinf 3b)" are ``ErrorFeedback(...)`` of the row's quantizer, and "EF(ALQ 2b) entropy"
the first on ``wire="entropy"`` (``results/accuracy_ef_entropy.md``). Every other row passes
``error_feedback=False``, so its quantizer is sent plain also where the package default
(``error_feedback="auto"``, docs/quantizers.md §5.9) would add error feedback.
**Every configuration, fp32 and fp16 included, runs through the packed optimizer**
``horovod_aq.torch.DistributedOptimizer`` (exchange="auto"): quantizers send bit-packed codes,
fp32 and fp16 go through its named Horovod allreduce (``horovod_aq.NoCompression`` /
``horovod_aq.FP16``), so all rows share one code path and one telemetry (bits per coordinate,
bytes sent per step). Every quantizer uses the same bucket size ``--bucket-size`` (default 1024, the
package's default for the adaptive methods and close to the fixed methods' 512; the ALQ paper used
8192 — ``variance.py`` measures both, and ``--bucket-size 8192`` reruns this at the paper's
setting). Adaptive methods use their default fitting model (the gradient histogram for
ALQ/ALQ-G/AMQ, one pooled truncated normal for ALQ-N/AMQ-N) and refit on their default schedule
(steps 0, 100, 2000, …).

**Seeds.** Seed s fixes the initial weights (identical for every configuration of that seed),
the data order and the quantizers' random streams. All configurations of one seed run in ONE
4-rank launch (``horovod_aq.tools.launcher.run_local`` with one check per configuration) to amortize
start-up; seeds are separate launches. The table gives mean ± sample std over the seeds of the
final test accuracy and test loss (full 10k test set), the payload bits per coordinate (norms and
headers included), and bytes sent per rank per step relative to fp32 (the optimizer's telemetry).
A run whose gradients become non-finite is reported as diverged.

Results: ``benchmarks/results/accuracy.md`` and ``accuracy.png`` (test accuracy per epoch,
mean over seeds).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import report

#: (label, method, bits, other compressor arguments) of the full benchmark, in table order.
CONFIGS = (
    ("fp32", "none", 32, {}), ("fp16", "fp16", 16, {}),
    ("QSGD 3b", "qsgd", 3, {}), ("QSGDinf 3b", "qsgdinf", 3, {}), ("NUQSGD 3b", "nuqsgd", 3, {}),
    ("TernGrad", "terngrad", 2, {}), ("natural 3b", "natural", 3, {}),
    ("ALQ 3b", "alq", 3, {}), ("ALQ-N 3b", "alqn", 3, {}), ("ALQ-G 3b", "alqg", 3, {}),
    ("AMQ 3b", "amq", 3, {}), ("AMQ-N 3b", "amqn", 3, {}),
    ("ALQ 3b (L2)", "alq", 3, {"norm": "l2"}),
    ("ALQ 2b", "alq", 2, {}), ("AMQ 2b", "amq", 2, {}), ("ALQ 2b (L2)", "alq", 2, {"norm": "l2"}),
    ("QSGDinf 2b", "qsgdinf", 2, {}), ("ALQ 4b", "alq", 4, {}),
    ("EF(ALQ 2b)", "alq", 2, {"error_feedback": True}),
    ("EF(ALQ 3b)", "alq", 3, {"error_feedback": True}),
    ("EF(QSGDinf 3b)", "qsgdinf", 3, {"error_feedback": True}),
    ("EF(ALQ 2b) entropy", "alq", 2, {"error_feedback": True, "wire": "entropy"}),
    ("ALQ 3b (L2 B1024)", "alq", 3, {"norm": "l2", "bucket_size": 1024}),
)
QUICK_CONFIGS = ("fp32", "QSGDinf 3b", "ALQ 3b")
#: The converged benchmark's configurations (docs/quantizers.md §5.6, §5.7 cite it).
CONVERGED = ("fp32", "ALQ 2b", "ALQ 3b", "ALQ 4b", "AMQ 3b", "QSGDinf 3b", "QSGD 3b",
             "NUQSGD 3b", "natural 3b", "TernGrad", "EF(ALQ 2b)", "EF(ALQ 3b)",
             "EF(QSGDinf 3b)", "ALQ 3b (L2 B1024)")


def lr_at(step: int, total: int, lr: float, schedule: str) -> float:
    """The learning rate of step ``step`` of ``total``: ``lr``, or lr·(1 + cos(π·step/total))/2."""
    if schedule == "constant":
        return lr
    return 0.5 * lr * (1.0 + math.cos(math.pi * step / max(1, total)))


def train_config(label: str, method: str, bits: int, seed: int, epochs: float, lr: float,
                 batch: int, bucket_size: int | None, options: dict | None = None,
                 lr_schedule: str = "constant") -> dict:
    """Runs in every rank: train one configuration from scratch, evaluate on the test set.

    ``options``: compressor arguments (they win over ``bucket_size``), ``error_feedback``:
    wrap the compressor in :class:`horovod_aq.ErrorFeedback` (its default coefficients; the
    optimizer's ``error_feedback=``, given explicitly: every other row sends its plain
    quantizer, also at 2 bits where the package default would add error feedback), and
    ``wire``: the optimizer's ``wire=`` (default "auto")."""
    import horovod.torch as hvd
    import numpy as np
    import torch
    import torch.nn.functional as F

    import horovod_aq
    import horovod_aq.torch as aqt
    from benchmarks import fashion_mnist
    from benchmarks.models import SmallCNN, evaluate
    from horovod_aq.codec import NonFiniteGradientError

    torch.set_num_threads(1)
    if not hvd.is_initialized():
        hvd.init()
    rank, size = hvd.rank(), hvd.size()
    train, test = fashion_mnist.load()
    shard = train.shard(rank, size)
    xs, ys = torch.from_numpy(shard.images), torch.from_numpy(shard.labels)
    torch.manual_seed(seed)
    model = SmallCNN()
    options = dict(options or {})
    error_feedback = options.pop("error_feedback", False)
    wire = options.pop("wire", "auto")
    kwargs = {"seed": seed, "name": f"acc.{_slug(label)}.s{seed}", **options}
    if method not in ("none", "fp16"):
        kwargs["bits"] = bits
        if bucket_size:
            kwargs.setdefault("bucket_size", bucket_size)
    comp = horovod_aq.from_name(method, **kwargs)
    opt = aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=comp,
                                   exchange="auto", wire=wire,
                                   error_feedback=error_feedback and comp.quantizes)
    comp = opt.compression
    steps_per_epoch = len(ys) // batch
    total = round(epochs * steps_per_epoch)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)

    history: list[dict] = []
    losses: list[float] = []
    diverged = None
    t0 = time.perf_counter()
    step = 0
    epoch = 0
    while step < total and diverged is None:
        epoch += 1
        order = torch.randperm(len(ys), generator=gen)
        for i in range(steps_per_epoch):
            if step >= total:
                break
            idx = order[i * batch:(i + 1) * batch]
            for group in opt.param_groups:
                group["lr"] = lr_at(step, total, lr, lr_schedule)
            opt.zero_grad()
            loss = F.cross_entropy(model(xs[idx]), ys[idx])
            loss.backward()
            try:
                opt.step()
            except NonFiniteGradientError as exc:   # raised on every rank alike
                diverged = f"step {step}: {str(exc).splitlines()[0][:120]}"
                break
            losses.append(loss.item())
            step += 1
        if diverged is None:
            test_loss, test_acc = evaluate(model, test,
                                           name=f"acc.eval.{kwargs['name']}.{len(history)}")
            history.append({"epoch": step / steps_per_epoch, "test_loss": test_loss,
                            "test_acc": test_acc,
                            "train_loss": float(np.mean(losses[-steps_per_epoch:]))})
    seconds = time.perf_counter() - t0
    totals = opt.telemetry.totals()
    return {"label": label, "seed": seed, "history": history, "diverged": diverged,
            "test_acc": history[-1]["test_acc"] if history and not diverged else float("nan"),
            "test_loss": history[-1]["test_loss"] if history and not diverged else float("nan"),
            "steps": step, "seconds": seconds,
            "bits_per_coordinate": (totals["bits_per_coordinate"] if comp.quantizes
                                    else float(comp.bits)),
            "bytes_per_step": totals["bytes_sent"] / max(1, totals["steps"]),
            "bytes_fp32_per_step": totals["bytes_fp32"] / max(1, totals["steps"]),
            "bucket_size": comp.bucket_size if comp.quantizes else None,
            "norm": comp.norm if comp.quantizes else None,
            "table_version": comp.table.version if comp.quantizes else None,
            "exchange": exchange_of(opt) if comp.quantizes else None}


def exchange_of(opt) -> str:
    """The buckets' exchange modes and codings at the end of a run, e.g. "two_phase/fixed +
    allgather/fixed". ``exchange="auto"`` and ``wire="auto"`` decide them from timings measured
    in the run (docs/protocol.md §5.5), so the bytes sent can differ between runs of one
    configuration on a loaded machine."""
    decision = opt.autowire.decision
    if decision is not None and decision.decided:
        picked = [f"{c.mode}/{c.coding}" for c in decision.choices]
    else:
        picked = [f"{mode}/{opt.autowire.wire if opt.autowire.wire != 'auto' else 'fixed'}"
                  for _, _, mode, _ in opt.buckets]
    counts: dict[str, int] = {}
    for key in picked:
        counts[key] = counts.get(key, 0) + 1
    return " + ".join(f"{n}× {k}" if n > 1 else k for k, n in counts.items())


def exchanges(runs: list[dict]) -> str:
    """The distinct ``exchange_of`` values of ``runs``, with the seeds of each when they
    differ ("—" without quantized buckets; "not recorded" for runs from before the field)."""
    seeds: dict[str, list[int]] = {}
    for r in runs:
        key = r.get("exchange", "not recorded") or "—"
        seeds.setdefault(key, []).append(r["seed"])
    if len(seeds) == 1:
        return next(iter(seeds))
    return "; ".join(f"{k} (seed {', '.join(map(str, v))})" for k, v in seeds.items())


def _slug(label: str) -> str:
    """``label`` as a name: "ALQ 2b (L2)" → "ALQ_2b_L2"."""
    return label.replace(" ", "_").replace("(", "").replace(")", "").replace("∞", "inf")


def _named(label: str, seed: int):
    """A uniquely named function per configuration (run_local keys checks by name)."""
    def check(**kwargs):
        return train_config(**kwargs)
    check.__qualname__ = check.__name__ = f"{_slug(label)}_seed{seed}"
    check.__module__ = __name__
    return check


def fmt(values: list[float], digits: int, scale: float = 1.0) -> str:
    vals = [v * scale for v in values if not math.isnan(v)]
    if not vals:
        return "diverged"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}f}"
    return f"{statistics.fmean(vals):.{digits}f} ± {statistics.stdev(vals):.{digits}f}"


def plot(results: dict[str, list[dict]], path: Path) -> None:
    from horovod_aq.tools.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    for label, runs in results.items():
        ok = [r for r in runs if not r["diverged"] and r["history"]]
        if not ok:
            continue
        n = min(len(r["history"]) for r in ok)
        xs = [ok[0]["history"][i]["epoch"] for i in range(n)]
        ys = [100 * statistics.fmean(r["history"][i]["test_acc"] for r in ok) for i in range(n)]
        adaptive = label.split(" ")[0] in ("ALQ", "ALQ-N", "ALQ-G", "AMQ", "AMQ-N")
        ax.plot(xs, ys, marker="o", ls="-" if adaptive else "--", label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%), mean over seeds")
    ax.set_title("Fashion-MNIST SmallCNN, 4 ranks: test accuracy per epoch")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"CI: 2 ranks, seed 0, {', '.join(QUICK_CONFIGS)}, 40 steps")
    p.add_argument("--converged", action="store_true",
                   help="10 epochs, cosine lr from 0.05, per-method bucket sizes, the CONVERGED "
                        "configurations, report results/accuracy_converged.md")
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--epochs", type=float, default=None,
                   help="training budget per configuration, in epochs of the training set "
                        "(default 1; --converged: 10)")
    p.add_argument("--lr", type=float, default=None, help="(peak) learning rate (default 0.02; "
                   "--converged: 0.05)")
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default=None,
                   help="default constant; --converged: cosine")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--bucket-size", type=int, default=None,
                   help="bucket size of every quantizer (0: each method's own default; "
                        "default 1024, --converged: 0)")
    p.add_argument("--configs", default=None,
                   help="comma list of configuration labels (default: all; --converged: "
                        "CONVERGED); " + "; ".join(c[0] for c in CONFIGS))
    p.add_argument("--resume", action="store_true",
                   help="keep the runs the report's .json already holds; run only the missing "
                        "(configuration, seed) pairs")
    p.add_argument("--group", type=int, default=0,
                   help="configurations per launch (0: all of a seed in one launch)")
    p.add_argument("--controller", choices=["gloo", "mpi"], default="gloo")
    p.add_argument("--timeout", type=float, default=None, help="limit per launch (s)")
    p.add_argument("--report", default=None,
                   help="report name under benchmarks/results/ (default accuracy; --converged: "
                        "accuracy_converged)")
    args = p.parse_args(argv)
    preset = {"epochs": 10.0, "lr": 0.05, "lr_schedule": "cosine", "bucket_size": 0} \
        if args.converged else {"epochs": 1.0, "lr": 0.02, "lr_schedule": "constant",
                                "bucket_size": 1024}
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    chosen = [c.strip() for c in args.configs.split(",")] if args.configs else None
    if args.converged:
        chosen = chosen or list(CONVERGED)
    if args.quick:
        args.np, args.seeds = 2, "0"
        chosen = chosen or list(QUICK_CONFIGS)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    labels = [c[0] for c in CONFIGS]
    if chosen:
        unknown = set(chosen) - set(labels)
        if unknown:
            p.error(f"unknown configurations {sorted(unknown)}; choose from {labels}")
    args.configs = [c for c in CONFIGS if chosen is None or c[0] in chosen]
    args.report = args.report or ("accuracy_converged" if args.converged else "accuracy")
    if args.timeout is None:
        args.timeout = 600 if args.quick else 3 * 3600
    return args


def render(args: argparse.Namespace, results: dict[str, list[dict]], wall: float,
           epochs: float) -> Path:
    """Write the report (table, figure, notes) and the .json of every run; returns the .md."""
    fp32 = results.get("fp32")
    fp32_bytes = statistics.fmean(r["bytes_per_step"] for r in fp32) if fp32 else None
    fp32_acc = {r["seed"]: r["test_acc"] for r in fp32 or []}
    order = {c[0]: i for i, c in enumerate(CONFIGS)}
    rows = []
    for label, runs in sorted(results.items(), key=lambda kv: order.get(kv[0], len(order))):
        if not runs:
            continue
        bits = statistics.fmean(r["bits_per_coordinate"] for r in runs)
        sent = statistics.fmean(r["bytes_per_step"] for r in runs)
        ratio = (f"{sent / fp32_bytes:.4f}" if fp32_bytes else
                 f"{sent / statistics.fmean(r['bytes_fp32_per_step'] for r in runs):.4f}")
        diverged = sum(1 for r in runs if r["diverged"])
        paired = [r["test_acc"] - fp32_acc[r["seed"]] for r in runs if r["seed"] in fp32_acc]
        rows.append([label, fmt([r["test_acc"] for r in runs], 2, 100),
                     fmt(paired, 2, 100) if label != "fp32" and paired else "—",
                     fmt([r["test_loss"] for r in runs], 4),
                     f"{bits:.3f}", f"{sent / 1e6:.3f}", ratio, exchanges(runs),
                     f"{diverged}/{len(runs)}" if diverged else "0",
                     ", ".join(str(r["seed"]) for r in runs),
                     f"{statistics.fmean(r['seconds'] for r in runs):.0f}"])
    table = report.markdown_table(
        ["configuration", "test accuracy (%)", "minus fp32, paired by seed (pt)", "test loss",
         "bits/coordinate", "MB sent/rank/step", "bytes vs fp32", "buckets: exchange/coding",
         "diverged", "seeds",
         "s per run"], rows)
    fig = report.figure_path(args.report, quick=args.quick)
    plot(results, fig)
    r0 = next(r for runs in results.values() for r in runs)
    schedule = ("constant" if args.lr_schedule == "constant"
                else "cosine decay to 0 over the budget")
    notes = [
        f"Task: Fashion-MNIST (60k train / 10k test, Debian dataset-fashion-mnist), SmallCNN "
        f"(281,034 parameters), {args.np} ranks ({args.controller}), batch {args.batch}/rank, "
        f"SGD lr {args.lr} ({schedule}) momentum 0.9, budget {epochs:g} epochs "
        f"({r0['steps']} steps) per run",
        "Seeds: mean ± sample std over the seeds each row lists; the paired column is the mean "
        "± sample std of (row − fp32) per seed (same initial weights and data order); all "
        "configurations of a launch share one seed",
        "Every row uses horovod_aq.torch.DistributedOptimizer (exchange='auto'): fp32/fp16 via "
        "NoCompression/FP16 (named Horovod allreduce), quantizers packed, bucket "
        f"{args.bucket_size or 'per-method default (adaptive 256, fixed 512 unless the row says)'}"
        "; TernGrad is ternary (2-bit codes); EF(…) is ErrorFeedback with its default "
        "coefficients, every other row error_feedback=False; 'entropy': wire='entropy' (the "
        "others wire='auto')",
        f"Wall time of this invocation {wall / 60:.1f} min",
    ]
    if args.resume:
        notes.append("In parts (--resume): the rows keep the runs of earlier invocations from the "
                     "report's .json; the command and wall time above are this invocation's, "
                     "s per run is each row's own")
    body = (table + "\n\nbits/coordinate: payload bits per quantized coordinate (codes + fp32 "
            "norms + header); bytes vs fp32: telemetry bytes sent per rank per step ÷ fp32's; "
            "buckets: each bucket's exchange and coding at the end of the run (exchange='auto' "
            "and wire='auto' decide them from timings measured in the run, so a loaded machine "
            "can change them: at 4 ranks an allgather sends 3 payloads per rank, the two-phase "
            "exchange 1.5).\n"
            f"\n![test accuracy per epoch]({fig.name})\n")
    failures = [f"{lb} seed {r['seed']}: {r['diverged']}" for lb, runs in results.items()
                for r in runs if r["diverged"]]
    if failures:
        body += "\nDiverged runs:\n" + "\n".join(f"- {f}" for f in failures) + "\n"
    path = report.write(args.report, "Test accuracy after a fixed budget", body,
                        quick=args.quick, notes=notes)
    path.with_suffix(".json").write_text(json.dumps(results, indent=1))
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    from benchmarks import fashion_mnist
    from horovod_aq.tools.launcher import run_local

    fashion_mnist.ensure_installed()
    shard = 60000 // args.np
    epochs = args.epochs if not args.quick else 40 / (shard // args.batch)
    saved = report.figure_path(args.report, quick=args.quick).with_suffix(".json")
    results: dict[str, list[dict]] = {c[0]: [] for c in args.configs}
    if args.resume and saved.exists():
        for label, runs in json.loads(saved.read_text()).items():
            results.setdefault(label, []).extend(runs)
    t_all = time.monotonic()
    path = None
    for seed in args.seeds:
        todo = [c for c in args.configs
                if not any(r["seed"] == seed for r in results.get(c[0], []))]
        size = args.group or len(todo) or 1
        for start in range(0, len(todo), size):
            part = todo[start:start + size]
            checks = [(_named(label, seed),
                       {"label": label, "method": method, "bits": bits, "seed": seed,
                        "epochs": epochs, "lr": args.lr, "batch": args.batch,
                        "bucket_size": args.bucket_size or None, "options": options,
                        "lr_schedule": args.lr_schedule})
                      for label, method, bits, options in part]
            t0 = time.monotonic()
            launch = run_local(checks, np=args.np, controller=args.controller,
                               timeout=args.timeout)
            for check, (label, *_) in zip(checks, part):
                results.setdefault(label, []).append(launch.get(check[0])[0])
                results[label].sort(key=lambda r: r["seed"])
            print(f"seed {seed}: {len(checks)} configurations in {time.monotonic() - t0:.0f} s",
                  file=sys.stderr, flush=True)
            path = render(args, results, time.monotonic() - t_all, epochs)
    if path is None:
        path = render(args, results, time.monotonic() - t_all, epochs)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
