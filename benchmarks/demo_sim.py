"""The demo's training (examples/pytorch_mnist.py) simulated in one process, with noise diagnostics.

    python benchmarks/demo_sim.py --configs "fp32;alq:bits=3" --seeds 0,1,2 --out runs.jsonl

P simulated workers train the example's CNN (``examples/torch_net.py``) on the example's data
(``load_mnist_5k(seed)``, shard r = every P-th image), with the example's initial weights
(``torch.manual_seed(seed)`` then ``Net()``), sample order (generator ``seed*1000 + rank``),
batch, SGD momentum 0.9 and learning rate lr·P. Each step, every worker's gradient is fused
into one flat vector in reverse registration order (what the packed optimizer does with the
default fusion cap for this 47k-parameter model: one bucket) and sent through the compressor
exactly as a rank would on the allgather exchange: error compensation (``ErrorFeedback``),
``codec.quantize`` with the current table, bucket size and norm, refit statistics
(``record_gradient``), the average of the P decoded vectors, ``end_step`` over a
``LocalComm``. The random streams are numpy's, not the format's (the packed path's bytes are not
reproduced; its distribution is).

Diagnostics per step (exact expectations, no sampling): the quantization error of the averaged
gradient E‖ḡ_Q − ḡ‖² = Σ_p E‖Q(x_p) − x_p‖²/P², the minibatch noise of ḡ estimated from the
workers' disagreement (P = 2: ‖g_1 − g_2‖²/4), their ratio ρ (overall and per layer), and each
worker's normalized variance γ = E‖Q(x_p) − x_p‖²/‖x_p‖². ρ is the quantization noise in units of
the SGD noise the step already has: at the same learning rate it acts like a batch (1 + ρ)×
smaller.

Configurations: ``fp32`` or ``method:key=value,...`` (compressor arguments; ``ef=1`` wraps in
ErrorFeedback, ``efa=``/``efb=`` its α/β; ``gauss=1`` replaces the
rounding by Gaussian noise of the same per-coordinate variance; ``small=N`` sends tensors under N
elements in fp32; ``noise=ρ`` on fp32 adds Gaussian noise of ρ × the minibatch noise, per layer).
A run stops at the first step where a worker's gradient is non-finite and records it as
``diverged_step``; its accuracy is then the model's when it stopped. Results go to ``--out`` as
JSON lines (one per run), appended as runs finish, so a grid can run in parts; ``--report NAME``
then writes ``benchmarks/results/NAME.md`` from every run in ``--out`` (with ``--configs ''`` it
only writes the report).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))


#: Steps whose per-worker gradients ``--dump`` saves.
DUMP_STEPS = (0, 10, 50, 100, 150, 200, 250, 300)


def parse_config(text: str) -> tuple[str, dict]:
    method, _, rest = text.partition(":")
    kwargs: dict = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        if k in ("schedule", "norm", "model"):
            kwargs[k] = v
            continue
        try:
            kwargs[k] = int(v)
        except ValueError:
            try:
                kwargs[k] = float(v)
            except ValueError:
                kwargs[k] = v
    return method, kwargs


def per_coordinate_error(x: np.ndarray, comp, bucket_size: int, norm: str) -> np.ndarray:
    """E(Q(x)_i − x_i)² per coordinate (docs/quantizers.md §3), float64."""
    from horovod_aq import codec

    levels = comp.table.levels.astype(np.float32)
    n = x.size
    nb = -(-n // bucket_size)
    pad = np.zeros(nb * bucket_size, np.float32)
    pad[:n] = x
    rows = pad.reshape(nb, bucket_size)
    norms = codec.bucket_norms(x.astype(np.float32), bucket_size, norm).astype(np.float64)
    safe = np.where(norms > 0, norms, 1.0)
    r = np.clip(rows / safe[:, None].astype(np.float32), -1, 1).astype(np.float32)
    j = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, levels.size - 2)
    r64 = r.astype(np.float64)
    var = (levels[j + 1].astype(np.float64) - r64) * (r64 - levels[j]) * (norms[:, None] ** 2)
    var[norms == 0] = 0.0
    return var.reshape(-1)[:n]


def run(config: str, seed: int, *, workers: int, epochs: int, lr: float, batch: int,
        diag_every: int, dump: dict | None = None, max_steps: int = 0) -> dict:
    """Train one configuration; ``max_steps`` > 0 stops (and evaluates) after that many steps."""
    import torch
    import torch.nn.functional as F
    from torch_net import Net, evaluate

    import horovod_aq
    from horovod_aq import codec
    from horovod_aq.refit import LocalComm
    from horovod_aq.tools.datasets import load_mnist_5k

    torch.set_num_threads(1)
    method, kwargs = parse_config(config)
    noise = float(kwargs.pop("noise", 0.0))
    ef = bool(kwargs.pop("ef", 0))
    ef_args = {k: kwargs.pop(f"ef{k[0]}") for k in ("alpha", "beta") if f"ef{k[0]}" in kwargs}
    gauss = bool(kwargs.pop("gauss", 0))
    small = int(kwargs.pop("small", 0))
    if method == "fp32":
        comp = None
    else:
        comp = horovod_aq.from_name(method, seed=seed, **kwargs)
        if ef:
            comp = horovod_aq.ErrorFeedback(comp, **ef_args)
    q = comp.quantizer if comp is not None else None
    memory = comp.error_memory if comp is not None else None
    torch.manual_seed(seed)
    train, test = load_mnist_5k(seed=seed)
    shards = [train.shard(r, workers) for r in range(workers)]
    xs = [torch.from_numpy(s.images[:, None]) for s in shards]
    ys = [torch.from_numpy(s.labels) for s in shards]
    xt, yt = torch.from_numpy(test.images[:, None]), torch.from_numpy(test.labels)
    model = Net()
    params = [p for _, p in model.named_parameters()][::-1]      # backward (fused) order
    names = [n for n, _ in model.named_parameters()][::-1]
    sizes = [p.numel() for p in params]
    bounds = np.cumsum([0] + sizes)
    keep = np.concatenate([np.full(n, n < small) for n in sizes])
    opt = torch.optim.SGD(model.parameters(), lr=lr * workers, momentum=0.9)
    gens = [torch.Generator().manual_seed(seed * 1000 + r) for r in range(workers)]
    rng = np.random.default_rng([seed, 12345])
    steps_per_epoch = len(ys[0]) // batch
    diag = {"gamma": [], "rho": [], "rho_layer": [], "qerr": [], "sgd": [], "gnorm2": []}
    history = []
    step = 0
    diverged = None     # the first step whose gradient is non-finite: training stops there
    t0 = time.perf_counter()
    for epoch in range(1, epochs + 1):
        orders = [torch.randperm(len(y), generator=g) for y, g in zip(ys, gens)]
        losses = []
        for i in range(steps_per_epoch):
            if max_steps and step >= max_steps:
                break
            grads = []
            for r in range(workers):
                idx = orders[r][i * batch:(i + 1) * batch]
                model.zero_grad()
                loss = F.cross_entropy(model(xs[r][idx]), ys[r][idx])
                loss.backward()
                losses.append(loss.item())
                grads.append(torch.cat([p.grad.reshape(-1) for p in params]).numpy().copy())
            g = np.stack(grads)
            if not np.isfinite(g).all():
                diverged = step
                break
            if dump is not None and step in DUMP_STEPS:
                dump[f"s{step}"] = g.copy()
            want_diag = diag_every and step % diag_every == 0
            if comp is None:
                avg = g.mean(0)
                if noise > 0:
                    sgd = ((g[0] - g[1]) ** 2 / 4.0) if workers == 2 else g.var(0, ddof=1) / workers
                    for a, b in zip(bounds[:-1], bounds[1:]):
                        s = np.sqrt(noise * sgd[a:b].sum() / (b - a))
                        avg[a:b] += rng.standard_normal(b - a).astype(np.float32) * s
                err = None
            else:
                sent = []
                errs = []
                for r in range(workers):
                    x = g[r]
                    if memory is not None:
                        x = memory.compensate(f"w{r}", x)
                    if q.recording:
                        q.record_gradient(x)
                    if want_diag or gauss:
                        errs.append(per_coordinate_error(x, q, q.bucket_size, q.norm))
                    if gauss:    # the same per-coordinate variance, Gaussian
                        xq = (x + np.sqrt(errs[-1]) * rng.standard_normal(x.size)
                              ).astype(np.float32)
                    else:
                        xq = codec.quantize(x.astype(np.float32), q.table,
                                            bucket_size=q.bucket_size, norm=q.norm, seed=rng)
                    if small:    # tensors below ``small`` elements travel in fp32
                        xq = np.where(keep, x, xq).astype(np.float32)
                    if memory is not None:
                        memory.update(f"w{r}", g[r], xq)
                    sent.append(xq / np.float32(workers))
                avg = np.sum(sent, axis=0, dtype=np.float32)
                q.end_step(LocalComm())
                err = np.sum(errs, axis=0) / workers ** 2 if want_diag else None
                if err is not None and small:
                    err = np.where(keep, 0.0, err)
            if want_diag and err is not None:
                sgd = ((g[0] - g[1]).astype(np.float64) ** 2 / 4.0) if workers == 2 \
                    else g.astype(np.float64).var(0, ddof=1) / workers
                per_layer = [float(err[a:b].sum() / max(sgd[a:b].sum(), 1e-30))
                             for a, b in zip(bounds[:-1], bounds[1:])]
                diag["rho"].append(float(err.sum() / sgd.sum()))
                diag["rho_layer"].append(per_layer)
                diag["qerr"].append(float(err.sum()))
                diag["sgd"].append(float(sgd.sum()))
                diag["gnorm2"].append(float((g.mean(0).astype(np.float64) ** 2).sum()))
                diag["gamma"].append(float(np.mean(
                    [e.sum() / max(float((gg.astype(np.float64) ** 2).sum()),
                                                  1e-30) for e, gg in zip(errs, g)])))
            t = torch.from_numpy(avg)
            for p, a, b in zip(params, bounds[:-1], bounds[1:]):
                p.grad = t[a:b].view_as(p).clone()
            opt.step()
            step += 1
        test_loss, test_acc = evaluate(model, xt, yt)
        history.append({"epoch": epoch, "train_loss": float(np.mean(losses)),
                        "test_loss": test_loss, "test_acc": test_acc})
        if diverged is not None or (max_steps and step >= max_steps):
            break
    out = {"config": config, "seed": seed, "workers": workers, "epochs": epochs, "lr": lr,
           "batch": batch, "test_acc": history[-1]["test_acc"], "history": history,
           "seconds": time.perf_counter() - t0, "layers": names,
           "diverged_step": diverged}
    if diag["rho"]:
        out["diag"] = {k: v for k, v in diag.items()}
        out["summary"] = {"gamma": float(np.mean(diag["gamma"])),
                          "rho": float(np.mean(diag["rho"])),
                          "rho_layer": np.mean(diag["rho_layer"], axis=0).tolist()}
    if q is not None:
        out["table"] = q.table.levels.tolist()
        out["table_version"] = q.table.version
    return out


def summarize(runs: list[dict]) -> str:
    """A Markdown table: per configuration and learning rate, test accuracy, its paired
    difference to fp32 at that learning rate, the last epoch's training loss, γ and ρ (means over
    the diagnosed steps and the seeds), and the seeds that diverged."""
    from benchmarks import report

    groups: dict[tuple[str, float], dict[int, dict]] = {}
    for r in runs:
        groups.setdefault((r["config"], r["lr"]), {})[r["seed"]] = r
    rows = []
    for (config, lr), seeds in groups.items():
        fp32 = groups.get(("fp32", lr), {})
        order = sorted(seeds)
        acc = [100 * seeds[s]["test_acc"] for s in order]
        paired = [100 * (seeds[s]["test_acc"] - fp32[s]["test_acc"]) for s in order if s in fp32]
        loss = [seeds[s]["history"][-1]["train_loss"] for s in order
                if seeds[s].get("diverged_step") is None]
        diag = [seeds[s]["summary"] for s in order if "summary" in seeds[s]]
        spread = f" ± {np.std(paired, ddof=1):.2f}" if len(paired) > 1 else ""
        stops = [f"seed {s} at step {seeds[s]['diverged_step']}" for s in order
                 if seeds[s].get("diverged_step") is not None]
        rows.append([f"`{config}`", f"{lr:g}", ", ".join(map(str, order)),
                     " / ".join(f"{a:.1f}" for a in acc) + f" (mean {np.mean(acc):.2f})",
                     f"{np.mean(paired):+.2f}{spread}" if paired and config != "fp32" else "—",
                     f"{np.mean(loss):.4f}" if loss else "—",
                     f"{np.mean([d['gamma'] for d in diag]):.3f}" if diag else "—",
                     f"{np.mean([d['rho'] for d in diag]):.3f}" if diag else "—",
                     ", ".join(stops) or "—"])
    return report.markdown_table(
        ["configuration", "lr per rank", "seeds", "test accuracy (%) per seed",
         "minus fp32, paired (pt)", "train loss, last epoch", "γ", "ρ",
         "diverged"], rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", required=True, help="';'-separated configurations")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.05, help="per worker (scaled by --workers)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--diag-every", type=int, default=5)
    p.add_argument("--out", required=True)
    p.add_argument("--report", default=None,
                   help="write benchmarks/results/REPORT.md from every run in --out")
    p.add_argument("--dump", default=None, help="save the workers' gradients at DUMP_STEPS "
                   "to DUMP_<config>_<seed>.npz")
    args = p.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(";") if c.strip()]
    seeds = [int(s) for s in args.seeds.split(",")]
    for config in configs:
        for seed in seeds:
            dump = {} if args.dump else None
            res = run(config, seed, workers=args.workers, epochs=args.epochs, lr=args.lr,
                      batch=args.batch, diag_every=args.diag_every, dump=dump)
            if dump:
                np.savez(f"{args.dump}_{config.replace(':', '_').replace(',', '_')}_{seed}.npz",
                         **dump)
            with open(args.out, "a") as f:
                f.write(json.dumps(res) + "\n")
            s = res.get("summary", {})
            print(f"{config:40s} seed {seed}: acc {100 * res['test_acc']:.1f}  "
                  f"gamma {s.get('gamma', float('nan')):.3f} rho {s.get('rho', float('nan')):.3f}"
                  f"  {res['seconds']:.0f}s", flush=True)
    if args.report:
        from benchmarks import report

        with open(args.out) as f:
            runs = [json.loads(line) for line in f if line.strip()]
        wall = sum(r["seconds"] for r in runs) / 60
        notes = [f"Runs: every JSON line of {os.path.basename(args.out)} ({len(runs)} runs). "
                 "The grid ran in parts: a row is the command above with --configs set to the "
                 "row's configuration and --seeds to its seeds",
                 f"Wall time: {wall:.1f} min, the sum of the runs' own times (one process, "
                 "one thread; the load average above is the report's, not the runs')",
                 "Configurations: `fp32`, or a compressor with its arguments; `noise=ρ`: fp32 "
                 "plus Gaussian noise of ρ × the minibatch noise, even over each layer; "
                 "`gauss=1`: the quantizer's own per-coordinate variance as Gaussian noise "
                 "(the module docstring lists every key)",
                 f"{args.workers} simulated ranks, {args.epochs} epochs, the row's lr per rank "
                 f"(× {args.workers}), batch {args.batch} per rank, SGD momentum 0.9",
                 "γ: E‖Q(x)−x‖²/‖x‖² per rank (exact expectation), ρ: E‖ḡ_Q − ḡ‖² ÷ the "
                 f"minibatch noise of ḡ; both every {args.diag_every} steps, mean over the run; "
                 "with `ef=1` both measure the compensated vector (gradient plus error "
                 "memory) the quantizer sees, not the step's error",
                 "diverged: the seeds whose gradients turned non-finite, and the step; the run "
                 "stops there, its accuracy is the model's then, and the loss column leaves it "
                 "out. A run near 10 % without an entry collapsed with finite gradients"]
        path = report.write(args.report, "The demo's training, simulated: accuracy and noise",
                            summarize(runs) + "\n", notes=notes)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
