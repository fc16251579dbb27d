"""Normalized quantization variance of every quantizer on the gradients of a real training run.

    python benchmarks/variance.py            # 4 ranks, 2500 steps, bits 2/3/4 × buckets 1024/8192
    python benchmarks/variance.py --quick    # CI: 2 ranks, 30 steps, 3 bits, bucket 1024
    python benchmarks/variance.py --norms linf   # adaptive methods with their default norm only

**Training.** A small CNN (``benchmarks/models.py``: ``SmallCNN``, 281k parameters) trains on
Fashion-MNIST (``benchmarks/fashion_mnist.py``; each rank its own shard of the 60k training
images, batch 32 per rank) with 4 ranks under ``horovodrun``
(``horovod_aq.tools.launcher.run_local``), SGD with momentum, **fp32 gradients averaged with a
plain Horovod allreduce**. So every quantizer is measured on the same, unquantized trajectory.

**Measurement** (every ``--sample-every`` steps and at the last step). On each rank the local
gradient is flattened network-wide in backward order (reverse registration order; buckets
cross layer boundaries, as in the ALQ paper's experiments), and for every quantizer
configuration (method × bits × bucket size) the script computes the exact expected normalized
variance

    E‖Q(g) − g‖² / ‖g‖²,   E‖Q(g) − g‖² = Σ_b ‖v_b‖² Σ_i (ℓ_{j+1} − r_i)(r_i − ℓ_j)

with the numpy codec's closed form (``horovod_aq.codec.rounding_variance``: the same float32
normalization and level lookup as the encoder; tail bucket quantized with its own norm). The
value reported for a step is the mean over the ranks; the table gives the mean over the sampled
steps after step 0 (at step 0 the adaptive methods still use their starting table, the fit
to the Gaussian prior TN(0, 1/√B); step 0 is in the plot and the .json). At the last sample
a Monte-Carlo estimate with ``codec.quantize`` (8 seeds) is compared with the closed form for
a few configurations, as a check.

**Adaptive methods** (ALQ, ALQ-N, ALQ-G, AMQ, AMQ-N) refit exactly as in training: each is a
real compressor object on every rank, with its default refit schedule (steps 0, 100, 2000 and
every 10,000; ``--schedule`` changes it). On a due step every rank
records the statistics of its own gradient through the stock path's
``horovod_aq.torch.stock.quantize_local`` (what ``compress`` does in training), and
``compressor.end_step`` runs the real refit protocol across the 4 ranks (statistics gathered to
rank 0, fitted there, table broadcast). As in training, the table fitted at step t is used from
step t + 1. Fixed methods use their fixed tables; every method uses its own norm (L∞ for
QSGDinf and TernGrad, L2 otherwise). TernGrad is ternary whatever the bit width (one value per
bucket size, repeated in every bits column). Adaptive methods are measured with every fitting
model their class accepts (``cls.MODELS``): ALQ, ALQ-G and AMQ with the package's default
``model="histogram"`` (the n_b²-weighted empirical histogram of normalized coordinates) and with
``model="mixture"`` (the paper's truncated-normal mixture of the top-K buckets); ALQ-N and
AMQ-N with their single pooled truncated normal. Each adaptive variant is measured with every
bucket norm of ``--norms`` (default both): L∞, the package default (docs/quantizers.md §5.6), and
L2, the paper's.

Results: ``benchmarks/results/variance.md`` (table of means, best adaptive vs best fixed per
column) and ``variance.png`` (one panel per bits × bucket size; refit steps dotted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import report

#: Display name → horovod_aq method name (``horovod_aq.METHODS``), fixed methods first.
FIXED = {"QSGD": "qsgd", "QSGDinf": "qsgdinf", "NUQSGD": "nuqsgd", "TernGrad": "terngrad",
         "natural": "natural"}
ADAPTIVE = {"ALQ": "alq", "ALQ-N": "alqn", "ALQ-G": "alqg", "AMQ": "amq", "AMQ-N": "amqn"}
#: Configurations checked by Monte Carlo at the last sample: (display name, bits, bucket).
MC_CHECKS = (("QSGD", 3, 1024), ("NUQSGD", 3, 8192), ("ALQ (histogram)", 3, 8192),
             ("ALQ (mixture)", 3, 8192), ("ALQ (histogram, L2)", 3, 8192),
             ("AMQ (histogram)", 2, 1024))
#: How the norms are written; labels of adaptive methods name the norm unless it is L∞ (the
#: package default at every width but AMQ-N's from 3 bits, docs/quantizers.md §5.6). Every variant
#: passes its norm explicitly.
NORM_NAMES = {"linf": "L∞", "l2": "L2"}
DEFAULT_NORM = "linf"


def model_variants(method: str, requested: list[str] | None) -> list[str | None]:
    """The ``model=`` values to measure for an adaptive method: every model its class accepts
    (``cls.MODELS``; the first is the default), filtered by ``requested`` (None: all). A class
    without the option gives [None] (its only model)."""
    import horovod_aq

    models = list(getattr(horovod_aq.METHODS[method], "MODELS", ()) or [None])
    if requested is not None and len(models) > 1:
        kept = [m for m in models if m in requested]
        models = kept or models[:1]
    return models


def config_keys(bits_list, buckets, requested_models, norms=("linf", "l2")):
    """(label, method, bits, bucket, model, norm) of every compressor to build (fixed methods:
    model and norm None, i.e. their own)."""
    keys = []
    for bucket in buckets:
        for label, method in FIXED.items():
            for bits in ([2] if method == "terngrad" else bits_list):
                keys.append((label, method, bits, bucket, None, None))
        for label, method in ADAPTIVE.items():
            variants = model_variants(method, requested_models)
            for norm in norms:
                for model in variants:
                    parts = ([] if len(variants) == 1 and len(model_variants(method, None)) == 1
                             else [model]) + ([] if norm == DEFAULT_NORM else [NORM_NAMES[norm]])
                    name = f"{label} ({', '.join(parts)})" if parts else label
                    for bits in bits_list:
                        keys.append((name, method, bits, bucket, model, norm))
    return keys


def measure(steps: int, sample_every: int, bits_list: list[int], buckets: list[int],
            models: list, lr: float, batch: int, seed: int, schedule: str | None,
            norms: tuple = ("linf", "l2")) -> dict:
    """Runs in every rank: train with fp32 allreduce, measure every quantizer on the way."""
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F

    import horovod_aq
    from benchmarks import fashion_mnist
    from benchmarks.models import SmallCNN, backward_order, evaluate, flat_gradient, num_parameters
    from horovod_aq import codec
    from horovod_aq.torch import stock
    from horovod_aq.torch.comm import comm_for

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    train, test = fashion_mnist.load()
    shard = train.shard(rank, size)
    xs, ys = torch.from_numpy(shard.images), torch.from_numpy(shard.labels)
    torch.manual_seed(seed)
    model = SmallCNN()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    params = [p for _, p in backward_order(model)]

    comps = {}
    for key in config_keys(bits_list, buckets, models, norms):
        label, method, bits, bucket, variant, norm = key
        kwargs = {"bits": bits, "bucket_size": bucket, "seed": seed,
                  "name": f"var.{method}.{variant or 'default'}.{norm or 'own'}.{bits}b{bucket}"}
        if method in ADAPTIVE.values():
            if schedule:
                kwargs["schedule"] = schedule
            if variant is not None:
                kwargs["model"] = variant   # explicit, even for the default
            kwargs["norm"] = norm           # explicit, even for the default
        comps[key] = horovod_aq.from_name(method, **kwargs)
    adaptive = [c for c in comps.values() if c.adaptive]
    comm = comm_for(hvd.global_process_set)

    values: dict[tuple, list[float]] = {k: [] for k in comps}
    sampled: list[int] = []
    refits: dict[tuple, list[int]] = {k: [] for k in comps if comps[k].adaptive}
    losses: list[float] = []
    mc: dict[tuple, tuple[float, float, float]] = {}
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    order = torch.randperm(len(ys), generator=gen)
    pos = 0
    t_measure = 0.0
    t0 = time.perf_counter()
    for step in range(steps):
        if pos + batch > len(ys):
            order, pos = torch.randperm(len(ys), generator=gen), 0
        idx = order[pos:pos + batch]
        pos += batch
        opt.zero_grad()
        loss = F.cross_entropy(model(xs[idx]), ys[idx])
        loss.backward()
        losses.append(loss.item())
        g = flat_gradient(model)
        if step % sample_every == 0 or step == steps - 1:
            tm = time.perf_counter()
            gn = g.numpy()
            norm2 = float(np.dot(gn.astype(np.float64), gn.astype(np.float64)))
            for key, comp in comps.items():
                err = codec.rounding_variance(gn, comp.table, bucket_size=comp.bucket_size,
                                              norm=comp.norm).sum()
                values[key].append(float(err) / norm2)
            sampled.append(step)
            if step == steps - 1:
                for label, bits, bucket in MC_CHECKS:
                    key = next((k for k in comps if k[0] == label and k[2] == bits
                                and k[3] == bucket), None)
                    if key is None:
                        continue
                    comp = comps[key]
                    errs = [float(np.sum((codec.quantize(gn, comp.table, bucket_size=bucket,
                                                         norm=comp.norm, seed=s)
                                          .astype(np.float64) - gn) ** 2)) / norm2
                            for s in range(8)]
                    mc[key] = (values[key][-1], float(np.mean(errs)),
                               float(np.std(errs, ddof=1) / np.sqrt(len(errs))))
            t_measure += time.perf_counter() - tm
        for comp in adaptive:   # the refit protocol, on every rank, as in training
            if comp.recording:
                stock.quantize_local(comp, g)
            key = next(k for k, c in comps.items() if c is comp)
            if comp.end_step(comm):
                refits[key].append(comp.step - 1)
        avg = hvd.allreduce(g, op=hvd.Average, name="var.grad")
        offset = 0
        for p in params:
            p.grad.copy_(avg[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
    seconds = time.perf_counter() - t0
    test_loss, test_acc = evaluate(model, test, name="var.test")
    levels = {k: c.table.levels.tolist() for k, c in comps.items() if c.adaptive}
    return {"values": values, "steps": sampled, "refits": refits, "mc": mc,
            "train_loss_last100": float(np.mean(losses[-100:])),
            "test_loss": test_loss, "test_acc": test_acc,
            "params": num_parameters(model), "seconds": seconds, "measure_seconds": t_measure,
            "levels": levels, "versions": {k: c.table.version for k, c in comps.items()}}


def plot_grid(steps, means, refit_steps, bits_list, buckets, labels, path: Path) -> None:
    from horovod_aq.tools.plots import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(len(bits_list), len(buckets), squeeze=False,
                             figsize=(5.2 * len(buckets), 3.4 * len(bits_list)), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {}
    for i, label in enumerate(labels):
        adaptive = label.split(" ")[0] in ADAPTIVE
        styles[label] = {"color": colors[i % len(colors)],
                         "ls": ("-." if "mixture" in label else "-") if adaptive else "--",
                         "marker": "." if adaptive else None,
                         "alpha": 0.55 if adaptive and "L2" in label else 1.0}
    for i, bits in enumerate(bits_list):
        for j, bucket in enumerate(buckets):
            ax = axes[i][j]
            for label in labels:
                series = means.get((label, bits, bucket))
                if series is None:
                    continue
                ax.plot(steps, series, label=label, lw=1.2, ms=3, **styles[label])
            for s in refit_steps:
                ax.axvline(s, color="grey", ls=":", lw=0.8)
            ax.set_yscale("log")
            ax.set_title(f"{bits} bits, bucket {bucket}", fontsize="medium")
            if j == 0:
                ax.set_ylabel("E‖Q(g)−g‖² / ‖g‖²")
            if i == len(bits_list) - 1:
                ax.set_xlabel("training step")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", ncol=min(len(names), 6), fontsize="small")
    fig.suptitle("Normalized variance on the gradients of a Fashion-MNIST CNN (4 ranks); "
                 "dotted: refit steps", y=0.005, va="bottom", fontsize="small")
    fig.tight_layout(rect=(0, 0.02, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="CI: 2 ranks, 30 steps, sample every 10, 3 bits, bucket 1024")
    p.add_argument("--np", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--steps", type=int, default=2500,
                   help="training steps (default 2500 ≈ 5.3 epochs; refits at 0, 100, 2000)")
    p.add_argument("--sample-every", type=int, default=50)
    p.add_argument("--bits", default="2,3,4")
    p.add_argument("--buckets", default="1024,8192")
    p.add_argument("--models", default="all",
                   help="model= variants of the adaptive methods to measure: 'all' (every value "
                        "each class accepts, e.g. histogram and mixture for ALQ/ALQ-G/AMQ) or a "
                        "comma list")
    p.add_argument("--norms", default="linf,l2",
                   help="bucket norms to measure the adaptive methods with (first: the "
                        "package default, linf)")
    p.add_argument("--schedule", default=None,
                   help="refit schedule of the adaptive methods, reference format "
                        "'I1,…,Ik,E' (default: the compressors' own, 0,100,2000 every 10000)")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--controller", choices=["gloo", "mpi"], default="gloo")
    p.add_argument("--timeout", type=float, default=None, help="launch limit (s)")
    args = p.parse_args(argv)
    if args.quick:
        args.np, args.steps, args.sample_every = 2, 30, 10
        args.bits, args.buckets = "3", "1024"
    args.bits = [int(b) for b in args.bits.split(",")]
    args.buckets = [int(b) for b in args.buckets.split(",")]
    args.norms = tuple(n.strip() for n in args.norms.split(",") if n.strip())
    if not args.norms or any(n not in NORM_NAMES for n in args.norms):
        raise SystemExit(f"--norms takes a comma list of {sorted(NORM_NAMES)}")
    args.models = (None if args.models == "all" else
                   [m.strip() for m in args.models.split(",") if m.strip()])
    if args.timeout is None:
        args.timeout = 600 if args.quick else 4 * 3600
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from benchmarks import fashion_mnist
    from horovod_aq.tools.launcher import run_local

    fashion_mnist.ensure_installed()
    models = args.models
    kwargs = {"steps": args.steps, "sample_every": args.sample_every, "bits_list": args.bits,
              "buckets": args.buckets, "models": models, "lr": args.lr, "batch": args.batch,
              "seed": args.seed, "schedule": args.schedule, "norms": args.norms}
    t0 = time.monotonic()
    res = run_local([(measure, kwargs)], np=args.np, controller=args.controller,
                    timeout=args.timeout).get("measure")
    wall = time.monotonic() - t0
    keys = list(res[0]["values"])
    steps = res[0]["steps"]
    means = {k: [statistics.fmean(r["values"][k][i] for r in res) for i in range(len(steps))]
             for k in keys}
    labels = list(dict.fromkeys(k[0] for k in keys))
    label_norm = {k[0]: k[5] for k in keys}
    # TernGrad is ternary at every bit width: show it in every bits column
    per_cell: dict[tuple, list[float]] = {}
    for (label, method, bits, bucket, _model, _norm), series in means.items():
        targets = args.bits if method == "terngrad" else [bits]
        for b in targets:
            per_cell[(label, b, bucket)] = series
    refit_steps = sorted({s for r in res[:1] for v in r["refits"].values() for s in v})

    columns = [(b, B) for b in args.bits for B in args.buckets]
    # the table's mean leaves out step 0, where the adaptive methods still use their starting
    # table (their fit to the Gaussian prior); step 0 is in the plot and in the .json
    first = 1 if len(steps) > 1 and steps[0] == 0 else 0

    def avg(series):
        return statistics.fmean(series[first:])

    rows = []
    for label in labels:
        row = [label + (" †" if label == "TernGrad" else "")]
        for b, B in columns:
            series = per_cell.get((label, b, B))
            row.append(f"{avg(series):.4g}" if series else "–")
        rows.append(row)

    def best(group, b, B, norm=None):
        vals = [(avg(per_cell[(lb, b, B)]), lb) for lb in labels
                if lb.split(" ")[0] in group and (lb, b, B) in per_cell
                and not (lb == "TernGrad" and b != 2)
                and (norm is None or label_norm[lb] == norm)]
        return min(vals) if vals else (float("nan"), "–")

    best_rows = [["best fixed"]]
    for norm in args.norms:
        best_rows += [[f"best adaptive, {NORM_NAMES[norm]}"],
                      [f"best adaptive, {NORM_NAMES[norm]} ÷ best fixed"]]
    for b, B in columns:
        bf, lf = best(FIXED, b, B)
        best_rows[0].append(f"{bf:.4g} ({lf})")
        for i, norm in enumerate(args.norms):
            ba, la = best(ADAPTIVE, b, B, norm)
            best_rows[1 + 2 * i].append(f"{ba:.4g} ({la})")
            best_rows[2 + 2 * i].append(f"{ba / bf:.3f}")
    headers = ["method"] + [f"{b} bits, B={B}" for b, B in columns]
    table = report.markdown_table(headers, rows + best_rows)

    final_rows = []
    for label in labels:
        row = [label]
        for b, B in columns:
            series = per_cell.get((label, b, B))
            row.append(f"{series[-1]:.4g}" if series else "–")
        final_rows.append(row)
    final_table = report.markdown_table(headers, final_rows)

    mc_lines = []
    for key, (closed, mc_mean, mc_se) in res[0]["mc"].items():
        mc_lines.append(f"{key[0]} {key[2]} bits B={key[3]} (rank 0, step {steps[-1]}): closed "
                        f"form {closed:.4g}, Monte Carlo {mc_mean:.4g} ± {mc_se:.2g} "
                        f"(8 seeds)")
    fig = report.figure_path("variance", quick=args.quick)
    plot_grid(steps, per_cell, refit_steps, args.bits, args.buckets, labels, fig)

    r0 = res[0]
    notes = [
        f"Training: SmallCNN ({r0['params']:,} parameters) on Fashion-MNIST, {args.np} ranks "
        f"({args.controller}), batch {args.batch}/rank, SGD lr {args.lr} momentum 0.9, fp32 "
        f"allreduce, {args.steps} steps (≈{args.steps * args.batch * args.np / 60000:.1f} epochs), "
        f"seed {args.seed}; final test accuracy {100 * r0['test_acc']:.2f}%, test loss "
        f"{r0['test_loss']:.4f}",
        f"Measured every {args.sample_every} steps and at the last ({len(steps)} samples): exact "
        "E‖Q(g)−g‖²/‖g‖² (codec.rounding_variance) of each rank's local gradient, flattened "
        "network-wide in backward order; mean over ranks, then over samples",
        "Adaptive refits: real protocol across the ranks (stats via stock.quantize_local → "
        "end_step: gather to rank 0, fit, broadcast), schedule "
        f"{args.schedule or 'default (0,100,2000, every 10000)'}; refit steps seen: "
        f"{', '.join(map(str, refit_steps)) or 'none'} (new table used from the next step)",
        "Norms of the adaptive methods: " + ", ".join(NORM_NAMES[n] for n in args.norms)
        + " (L∞ = the package default, docs/quantizers.md §5.6: levels fitted to the L2 "
        "statistics rescaled to v/‖v‖∞, labels without a norm; L2 = the paper's, labels "
        "'…, L2')",
        "Models of the adaptive methods: " + "; ".join(
            f"{lb} {', '.join(str(m) for m in model_variants(me, None))}"
            for lb, me in ADAPTIVE.items()) + " (first = default; 'histogram' = n_b²-weighted "
        "histogram of normalized coordinates, 'mixture' = the paper's truncated-normal mixture "
        "of the top-K buckets, 'pooled' = one truncated normal)",
        f"Wall time {wall / 60:.1f} min (measurement {r0['measure_seconds'] / 60:.1f} min of "
        f"rank 0's {r0['seconds'] / 60:.1f} min)",
    ]
    body = (f"### Mean normalized variance over training (samples at steps {steps[first]}–"
            f"{steps[-1]})\n\n" + table + "\n\n† TernGrad is "
            "ternary (log₂3 ≈ 1.58 bits of information, 2 bits on the wire) at every bit width; "
            "its value is repeated in each bits column and left out of the 'best fixed' rows "
            "except at 2 bits.\n\n"
            f"### At the last sampled step ({steps[-1]})\n\n" + final_table + "\n\n"
            "### Closed form vs Monte Carlo\n\n" + "\n".join(f"- {m}" for m in mc_lines) + "\n\n"
            f"![normalized variance over training]({fig.name})\n")
    path = report.write("variance", "Normalized quantization variance during training", body,
                        quick=args.quick, notes=notes)
    path.with_suffix(".json").write_text(json.dumps({
        "args": {k: v for k, v in vars(args).items()}, "steps": steps,
        "refit_steps": refit_steps, "test_acc": r0["test_acc"], "test_loss": r0["test_loss"],
        "series": [{"method": k[0], "bits": k[1], "bucket": k[2], "values": v}
                   for k, v in per_cell.items()],
        "levels_rank0": [{"method": k[0], "bits": k[2], "bucket": k[3], "norm": k[5],
                          "levels": v}
                         for k, v in r0["levels"].items()]}, indent=1))
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
