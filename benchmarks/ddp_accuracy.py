"""Test accuracy under PyTorch DDP: fp32 vs PowerSGD vs the horovod_aq ALQ hook, at matched bytes.

    python benchmarks/ddp_accuracy.py --procs 4 --seeds 0,1 --epochs 1
    python benchmarks/ddp_accuracy.py --converged --seeds 0 --resume   # 10 epochs, cosine lr
    python benchmarks/ddp_accuracy.py --quick       # smoke test: 2 processes, 20 steps, seed 0

**Task and recipe** are those of ``benchmarks/accuracy.py`` (imported, not copied): Fashion-MNIST
(``benchmarks/fashion_mnist.py``), the ``SmallCNN`` of ``benchmarks/models.py``, each process
training on its own shard (``Split.shard``) with ``accuracy.py``'s default batch (32 per
process), SGD with momentum 0.9 at its default constant learning rate, the same data order
(generator seeded ``seed*1000 + rank``), for ``--epochs`` epochs, ``--lr-schedule`` constant or
cosine (``accuracy.lr_at``). ``--converged``: 10 epochs, cosine from lr 0.05 (``accuracy.py
--converged``'s recipe), report ``results/ddp_accuracy_converged.md``; ``--resume`` keeps the seeds
its .json already holds per (configuration, seed), so the seeds, and rows added later, can
run in parts (a matched PowerSGD rank then comes from the stored ALQ row's bytes). The
difference: no Horovod.
The processes are started with ``torch.multiprocessing.spawn`` (one thread each), joined by a
Gloo process group, and the model is wrapped in ``DistributedDataParallel``.

**Configurations** (one spawn per seed runs them all, one after the other; ``torch.manual_seed
(seed)`` before building each model, so every configuration of a seed starts from the same
weights, which DDP also broadcasts from rank 0):

* ``fp32`` — DDP's own allreduce (no hook), DDP's default buckets;
* ``ALQ 2b`` / ``ALQ 3b`` — ``horovod_aq.torch.ddp.register(model, horovod_aq.ALQ(bits=b))``
  (package defaults: L∞ buckets of 256, ``exchange="auto"``, ``wire="auto"``; with
  ``error_feedback=False``, the plain quantizer, where the default would wrap it in
  ``ErrorFeedback``), DDP's default buckets;
* ``EF(ALQ 2b) (default)`` — the hook as a user gets it at 2 bits: ``register(model,
  horovod_aq.ALQ(bits=2))`` with ``error_feedback="auto"``, which wraps it in ``ErrorFeedback``
  (docs/quantizers.md §5.9; the run checks that it did). Same bytes as ``ALQ 2b``. One row per
  ``--bits`` entry ≤ ``AUTO_MAX_BITS`` (3), so also ``EF(ALQ 3b) (default)``;
* ``PowerSGD r=k`` — ``powerSGD_hook.powerSGD_hook`` with ``PowerSGDState(
  matrix_approximation_rank=k, start_powerSGD_iter=2, use_error_feedback=True,
  warm_start=True)`` (PyTorch's defaults otherwise, e.g. ``min_compression_rate=2``). The ranks
  k are chosen in the run, after the ALQ rows: the k whose bytes per step are closest to ALQ
  2-bit's and ALQ 3-bit's measured ones (``--ranks`` fixes them instead). **One DDP bucket**:
  the hook issues its allreduces from future callbacks; on Gloo those run in network order and
  with several buckets the ranks have issued collectives in different orders ("Received data
  size doesn't match expected size", docs/ddp.md §2). ``bucket_cap_mb=10000`` gives one bucket:
  an explicit ``bucket_cap_mb`` also sets DDP's first-bucket cap (by default 1 MiB after the
  rebuild, which would split this 1.1 MB model in two). The run checks that every step had one
  bucket.

**Bytes per step per rank** use one model for every row, the ring allreduce of
docs/protocol.md §5.3: an allreduce of n fp32 values sends 2(P−1)/P·4n bytes per rank.
* fp32: that of the 281,034 gradients (= the ALQ hook's ``bytes_fp32`` telemetry).
* ALQ: the hook state's telemetry (``state.telemetry.totals()["bytes_sent"] / steps``): the
  packed payloads (codes, fp32 bucket norms, headers) by the formulas of docs/ddp.md §2. Not
  counted: the one-off handshakes and the refit protocol's statistics/table traffic.
* PowerSGD: per compressed step, its three allreduces — the uncompressed tensors (the 1-D
  biases and any matrix that ``min_compression_rate`` leaves uncompressed), all P matrices
  (``state.p_memory_dict``, Σ n·k) and all Q matrices (``state.q_memory_dict``, Σ m·k) — each
  as a fp32 ring allreduce; read from the hook state after every call (the uncompressed count
  is the step's increase of ``state.total_numel_after_compression`` minus P and Q). The first
  ``start_powerSGD_iter`` steps are plain fp32 allreduces. The table gives the mean over all
  steps of the run (as for ALQ); the matching uses the compressed steps.

**Reported**: test accuracy on the full 10k test set after the budget (evaluated by rank 0;
the weights are identical on every rank), mean ± sample std over seeds; bytes per step per
rank and their ratio to fp32's; seconds per run (rank 0's training + evaluation). Results:
``benchmarks/results/ddp_accuracy.md`` and ``.json`` (``--quick``: ``results/quick/``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import accuracy, report  # noqa: E402
from horovod_aq.error_feedback_setting import AUTO_MAX_BITS  # noqa: E402

#: PowerSGD's DDP bucket cap (MB): one bucket for the whole model (module docstring).
POWERSGD_BUCKET_MB = 10_000
START_POWERSGD_ITER = 2
MIN_COMPRESSION_RATE = 2
GLOO_TIMEOUT_S = 900
QUICK_STEPS = 20


def _codings(state) -> list[str]:
    """The codings ``wire="auto"`` decided for the hook's buckets (``["undecided"]`` while it
    still measures): the steady bytes are those of the fixed-width or entropy-coded wire."""
    auto = state.autowire
    if auto.wire != "auto":
        return [auto.wire]
    if auto.decision is None:
        return ["undecided"]
    return sorted({choice.coding for choice in auto.decision.choices})


def ring_bytes(numel: int, ranks: int, itemsize: int = 4) -> float:
    """Bytes one rank sends in a ring allreduce of ``numel`` values (docs/protocol.md §5.3)."""
    return 2 * (ranks - 1) / ranks * itemsize * numel


def powersgd_numel(shapes: list[tuple[int, ...]], rank: int,
                   min_compression_rate: float = MIN_COMPRESSION_RATE) -> dict[str, int]:
    """Values PowerSGD allreduces per compressed step for one bucket holding tensors of these
    shapes: PyTorch's rule (``powerSGD_hook._should_compress``: a tensor viewed as
    (shape[0], -1) with k = min(n, m, rank) is compressed if (n + m)·k·rate < n·m)."""
    p = q = unc = 0
    for shape in shapes:
        n = shape[0] if shape else 1
        m = 1
        for d in shape[1:]:
            m *= d
        k = min(n, m, rank)
        if len(shape) > 1 and (n + m) * k * min_compression_rate < n * m:
            p, q = p + n * k, q + m * k
        else:
            unc += n * m
    return {"p": p, "q": q, "uncompressed": unc, "total": p + q + unc}


def choose_rank(shapes: list[tuple[int, ...]], target_bytes: float, ranks: int,
                max_rank: int = 128) -> int:
    """The PowerSGD rank whose compressed-step bytes are closest to ``target_bytes``."""
    return min(range(1, max_rank + 1),
               key=lambda k: (abs(ring_bytes(powersgd_numel(shapes, k)["total"], ranks)
                                  - target_bytes), k))


def ef_label(bits: int) -> str:
    """The row of the hook with its default error feedback at ``bits`` (≤ AUTO_MAX_BITS)."""
    return f"EF(ALQ {bits}b) (default)"


# ============================================================================ worker (one rank)
def _evaluate(model, test) -> tuple[float, float]:
    """(test loss, test accuracy) on the whole test set, on this process alone."""
    import torch
    import torch.nn.functional as F

    model.eval()
    loss = correct = 0.0
    with torch.no_grad():
        for i in range(0, len(test.labels), 2000):
            x = torch.from_numpy(test.images[i:i + 2000])
            y = torch.from_numpy(test.labels[i:i + 2000])
            logits = model(x)
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += float((logits.argmax(1) == y).sum())
    model.train()
    return loss / len(test.labels), correct / len(test.labels)


def _train(cfg: dict, kind: str, *, bits: int = 0, prank: int = 0, ef: bool = False) -> dict:
    """One configuration in this rank: build, train for the budget, evaluate (rank 0)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import horovod_aq
    from benchmarks import fashion_mnist
    from benchmarks.models import SmallCNN
    from horovod_aq.torch import ddp as aqddp

    rank, size, seed = dist.get_rank(), dist.get_world_size(), cfg["seed"]
    train, test = fashion_mnist.load()
    shard = train.shard(rank, size)
    xs, ys = torch.from_numpy(shard.images), torch.from_numpy(shard.labels)
    torch.manual_seed(seed)
    model = SmallCNN()
    shapes = [tuple(p.shape) for p in model.parameters()]
    numel = sum(p.numel() for p in model.parameters())
    calls: list[dict] = []      # PowerSGD: one entry per hook call
    state = None
    if kind == "powersgd":
        net = DDP(model, bucket_cap_mb=POWERSGD_BUCKET_MB)
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=prank,
            start_powerSGD_iter=START_POWERSGD_ITER, min_compression_rate=MIN_COMPRESSION_RATE,
            use_error_feedback=True, warm_start=True, random_seed=seed)

        def counted(st, bucket):
            compressed = st.iter >= st.start_powerSGD_iter
            before = st.total_numel_after_compression
            fut = powerSGD_hook.powerSGD_hook(st, bucket)
            entry = {"index": bucket.index(), "numel": bucket.buffer().numel(),
                     "compressed": compressed}
            if compressed:
                idx = bucket.index()
                entry["p"] = st.p_memory_dict[idx].numel()
                entry["q"] = st.q_memory_dict[idx].numel()
                entry["uncompressed"] = (st.total_numel_after_compression - before
                                         - entry["p"] - entry["q"])
            calls.append(entry)
            return fut

        net.register_comm_hook(state, counted)
    else:
        net = DDP(model)
        if kind == "alq":
            comp = horovod_aq.ALQ(bits=bits, seed=seed,
                                  name=f"ddpacc.{'ef' if ef else ''}alq{bits}.s{seed}")
            if ef:     # the hook's default: error_feedback="auto" wraps a ≤ 3-bit quantizer
                state = aqddp.register(net, comp)
                if not isinstance(state.compression, horovod_aq.ErrorFeedback):
                    raise RuntimeError(f"error_feedback='auto' kept {state.compression!r} plain")
            else:
                state = aqddp.register(net, comp, error_feedback=False)   # the plain quantizer
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    batch = cfg["batch"]
    steps_per_epoch = len(ys) // batch
    total = cfg["steps"] or round(cfg["epochs"] * steps_per_epoch)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    t0 = time.perf_counter()
    step = 0
    while step < total:
        order = torch.randperm(len(ys), generator=gen)
        for i in range(steps_per_epoch):
            if step >= total:
                break
            idx = order[i * batch:(i + 1) * batch]
            for group in opt.param_groups:
                group["lr"] = accuracy.lr_at(step, total, cfg["lr"], cfg["lr_schedule"])
            opt.zero_grad()
            F.cross_entropy(net(xs[idx]), ys[idx]).backward()
            opt.step()
            step += 1
    test_loss, test_acc = _evaluate(model, test) if rank == 0 else (float("nan"),) * 2
    seconds = time.perf_counter() - t0
    fp32 = ring_bytes(numel, size)
    out = {"seed": seed, "kind": kind, "steps": step, "seconds": seconds,
           "test_acc": test_acc, "test_loss": test_loss, "numel": numel,
           "bytes_fp32_per_step": fp32}
    if kind == "fp32":
        out.update(bytes_per_step=fp32, bytes_steady=fp32)
    elif kind == "alq":
        t = state.telemetry.totals()
        hist = [r.bytes_sent for r in state.telemetry.history]
        out.update(bits=bits, error_feedback=ef, bytes_per_step=t["bytes_sent"] / t["steps"],
                   bytes_steady=statistics.median(hist), telemetry_steps=t["steps"],
                   telemetry_bytes_fp32=t["bytes_fp32"] / t["steps"],
                   bits_per_coordinate=t["bits_per_coordinate"],
                   ddp_buckets=len(state.layout), exchange=[b[2] for b in state.buckets],
                   codings=_codings(state))
    else:
        if max(c["index"] for c in calls) != 0:
            raise RuntimeError(f"PowerSGD saw {1 + max(c['index'] for c in calls)} buckets")
        per_step = [ring_bytes(c["numel"], size) if not c["compressed"] else
                    sum(ring_bytes(c[k], size) for k in ("uncompressed", "p", "q"))
                    for c in calls]
        comp = [c for c in calls if c["compressed"]]
        want = powersgd_numel(shapes, prank)
        last = comp[-1] if comp else {}
        if comp and (last["p"], last["q"], last["uncompressed"]) != \
                (want["p"], want["q"], want["uncompressed"]):
            raise RuntimeError(f"PowerSGD allreduced {last}, the rule predicts {want}")
        out.update(rank=prank, bytes_per_step=statistics.fmean(per_step),
                   bytes_steady=per_step[-1], hook_calls=len(calls),
                   compressed_steps=len(comp),
                   numel_p=last.get("p"), numel_q=last.get("q"),
                   numel_uncompressed=last.get("uncompressed"))
    dist.barrier()
    return out


def _worker(rank: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{cfg['store']}", rank=rank,
                            world_size=cfg["procs"],
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    from benchmarks.models import SmallCNN
    from horovod_aq.torch.process_exit import destroy_and_exit

    shapes = [tuple(p.shape) for p in SmallCNN().parameters()]
    skip = set(cfg["skip"])            # labels this seed already has (--resume)
    runs = [] if "fp32" in skip else [("fp32", _train(cfg, "fp32"))]
    alq = dict(cfg["alq_bytes"])       # bits -> steady bytes of the stored ALQ rows
    for b in cfg["bits"]:
        if f"ALQ {b}b" not in skip:
            r = _train(cfg, "alq", bits=b)
            runs.append((f"ALQ {b}b", r))
            alq[b] = r["bytes_steady"]
    for b in cfg["bits"]:
        if b <= AUTO_MAX_BITS and ef_label(b) not in skip:
            runs.append((ef_label(b), _train(cfg, "alq", bits=b, ef=True)))
    ranks = cfg["ranks"] or [choose_rank(shapes, alq[b], cfg["procs"]) for b in cfg["bits"]]
    done = set()
    for k, b in zip(ranks, cfg["bits"]):
        if k in done or f"PowerSGD r={k}" in skip:
            continue
        done.add(k)
        r = _train(cfg, "powersgd", prank=k)
        r["matched_to"] = f"ALQ {b}b" if not cfg["ranks"] else None
        runs.append((f"PowerSGD r={k}", r))
    if rank == 0:
        Path(cfg["result"]).write_text(json.dumps(runs))
    destroy_and_exit()     # not a normal return: PyTorch's Gloo shutdown race, docs/ddp.md §6


# ============================================================================ driver
def parse_args(argv=None) -> argparse.Namespace:
    base = accuracy.parse_args([])     # the accuracy benchmark's recipe (lr, batch)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: 2 processes, seed 0, {QUICK_STEPS} steps per run")
    p.add_argument("--converged", action="store_true",
                   help="10 epochs, cosine lr from 0.05, seeds 0,1,2, report "
                        "results/ddp_accuracy_converged.md")
    p.add_argument("--procs", type=int, default=4, help="DDP processes (Gloo, 1 thread each)")
    p.add_argument("--seeds", default=None, help="default 0,1 (--converged: 0,1,2)")
    p.add_argument("--epochs", type=float, default=None, help="default 1 (--converged: 10)")
    p.add_argument("--steps", type=int, default=0, help="steps per run (overrides --epochs)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"(peak) learning rate (default {base.lr}; --converged: 0.05)")
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default=None,
                   help="default constant (--converged: cosine)")
    p.add_argument("--resume", action="store_true",
                   help="keep the seeds the report's .json already holds; run the others")
    p.add_argument("--batch", type=int, default=base.batch, help="samples per process per step")
    p.add_argument("--bits", default="2,3", help="ALQ widths (each gets a matched PowerSGD)")
    p.add_argument("--ranks", default=None,
                   help="PowerSGD ranks, one per ALQ width (default: matched by bytes)")
    p.add_argument("--out", default=None,
                   help="report path (default benchmarks/results/ddp_accuracy.md; "
                        "--quick: results/quick/); a .json with every run goes beside it")
    args = p.parse_args(argv)
    preset = ({"seeds": "0,1,2", "epochs": 10.0, "lr": 0.05, "lr_schedule": "cosine"}
              if args.converged else
              {"seeds": "0,1", "epochs": 1.0, "lr": base.lr, "lr_schedule": "constant"})
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        args.procs, args.seeds, args.steps = 2, "0", args.steps or QUICK_STEPS
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.bits = [int(b) for b in args.bits.split(",")]
    args.ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    if args.ranks and len(args.ranks) != len(args.bits):
        p.error("--ranks needs one rank per --bits entry")
    if args.out is None:
        args.out = str((report.RESULTS / "quick" if args.quick else report.RESULTS)
                       / ("ddp_accuracy_converged.md" if args.converged else "ddp_accuracy.md"))
    return args


def run_seed(args: argparse.Namespace, seed: int, skip: set[str],
             alq_bytes: dict[int, float]) -> list[tuple[str, dict]]:
    import torch.multiprocessing as mp

    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[k] = "1"
    with tempfile.TemporaryDirectory(prefix="ddp_accuracy.") as tmp:
        cfg = {"seed": seed, "procs": args.procs, "lr": args.lr,
               "lr_schedule": args.lr_schedule, "batch": args.batch,
               "epochs": args.epochs, "steps": args.steps, "bits": args.bits,
               "ranks": args.ranks, "skip": sorted(skip), "alq_bytes": alq_bytes,
               "store": os.path.join(tmp, "store"),
               "result": os.path.join(tmp, "result.json")}
        mp.spawn(_worker, args=(cfg,), nprocs=args.procs, join=True)
        return [tuple(x) for x in json.loads(Path(cfg["result"]).read_text())]


def render(args: argparse.Namespace, results: dict[str, list[dict]], wall: float) -> str:
    fp32 = statistics.fmean(r["bytes_per_step"] for r in results["fp32"])
    rows = []
    order = {"fp32": 0, "alq": 1, "powersgd": 2}      # fp32, ALQ (plain, then EF), PowerSGD
    for label, runs in sorted(results.items(), key=lambda kv: (
            order[kv[1][0]["kind"]], kv[1][0].get("error_feedback", False))):
        r0 = runs[0]
        sent = statistics.fmean(r["bytes_per_step"] for r in runs)
        steady = statistics.fmean(r["bytes_steady"] for r in runs)
        if r0["kind"] == "powersgd":
            what = (f"P {r0['numel_p']:,} + Q {r0['numel_q']:,} + uncompressed "
                    f"{r0['numel_uncompressed']:,} values; first {START_POWERSGD_ITER} steps fp32"
                    + (f"; matched to {r0['matched_to']}" if r0.get("matched_to") else ""))
        elif r0["kind"] == "alq":
            what = (f"{r0['bits_per_coordinate']:.3f} bits/coordinate"
                    + (", error feedback" if r0.get("error_feedback") else "")
                    + f"; {r0['ddp_buckets']} "
                    f"DDP bucket(s): {' + '.join(r0['exchange'])}")
        else:
            what = f"{r0['numel']:,} values"
        rows.append([label, accuracy.fmt([r["test_acc"] for r in runs], 2, 100),
                     accuracy.fmt([r["test_loss"] for r in runs], 4),
                     f"{sent / 1e3:.1f}", f"{sent / fp32:.4f}", f"{steady / fp32:.4f}", what,
                     ", ".join(str(r["seed"]) for r in runs),
                     f"{statistics.fmean(r['seconds'] for r in runs):.0f}"])
    table = report.markdown_table(
        ["configuration", "test accuracy (%)", "test loss", "kB sent/rank/step (mean)",
         "bytes vs fp32 (mean)", "bytes vs fp32 (steady)", "what is sent", "seeds",
         "s per run"], rows)
    r0 = results["fp32"][0]
    notes = [
        f"Task: Fashion-MNIST, SmallCNN ({r0['numel']:,} parameters), PyTorch DDP with "
        f"{args.procs} processes (torch.multiprocessing.spawn, Gloo, 1 thread each), batch "
        f"{args.batch}/process, SGD lr {args.lr} ({args.lr_schedule}) momentum 0.9, "
        f"{r0['steps']} steps per run "
        + (f"({args.epochs:g} epoch)" if not args.steps else "(--steps)"),
        f"Seeds {', '.join(str(r['seed']) for r in results['fp32'])} of "
        f"{', '.join(map(str, args.seeds))} done (mean ± sample std over seeds); all "
        "configurations of a seed in one spawn (rows added later: a later spawn), same "
        "initial weights",
        f"PowerSGD: start_powerSGD_iter={START_POWERSGD_ITER}, error feedback, warm start, "
        f"min_compression_rate={MIN_COMPRESSION_RATE}, ONE DDP bucket (bucket_cap_mb="
        f"{POWERSGD_BUCKET_MB}, which also lifts DDP's 1 MiB first-bucket cap; checked every "
        "step); fp32 and ALQ: DDP's default buckets",
        f"Wall time {wall / 60:.1f} min",
    ]
    body = (table + "\n\nBytes: what one rank sends per step, every row by the ring-allreduce "
            "model (an allreduce of n fp32 values: 2(P−1)/P·4n bytes per rank). ALQ: the hook "
            "state's telemetry (packed codes + fp32 norms + headers; handshakes and refit "
            "traffic not counted). PowerSGD: its allreduces of the uncompressed tensors, of P "
            "and of Q, sizes read from the hook state. (mean): over all steps of the run; "
            "(steady): the last step. s per run: rank 0's training + test evaluation.\n")
    text = report.header("Test accuracy under PyTorch DDP: fp32, PowerSGD, ALQ hook", notes)
    return text + "\n" + body


def main(argv=None) -> int:
    args = parse_args(argv)
    from benchmarks import fashion_mnist

    fashion_mnist.ensure_installed()
    results: dict[str, list[dict]] = {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.resume and out.with_suffix(".json").exists():
        results = json.loads(out.with_suffix(".json").read_text())
    t_all = time.monotonic()
    for seed in args.seeds:
        have = {label for label, runs in results.items() for r in runs if r["seed"] == seed}
        matched = {r["matched_to"] for label, runs in results.items() for r in runs
                   if r["seed"] == seed and r.get("matched_to")}
        want = {"fp32", *(f"ALQ {b}b" for b in args.bits),
                *(ef_label(b) for b in args.bits if b <= AUTO_MAX_BITS)}
        if want <= have and (args.ranks or {f"ALQ {b}b" for b in args.bits} <= matched):
            continue
        alq_bytes = {b: r["bytes_steady"] for b in args.bits
                     for r in results.get(f"ALQ {b}b", []) if r["seed"] == seed}
        t0 = time.monotonic()
        for label, r in run_seed(args, seed, have, alq_bytes):
            results.setdefault(label, []).append(r)
        print(f"seed {seed}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        out.write_text(render(args, results, time.monotonic() - t_all))   # after every seed
        out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
