"""A transformer with AdamW: validation bpc and time to a target, fp32 vs 16-bit vs PowerSGD vs
horovod_aq, under DDP and Horovod.

    python benchmarks/transformer.py --seeds 0,1,2          # the grid, resumable (about 2 h)
    python benchmarks/transformer.py --seeds 0 --rows "fp32,ALQ 3b"   # some rows only
    python benchmarks/transformer.py --quick                # plumbing: 3 rows, 1 seed, 30 steps

**Task**: ``examples/transformer_char.py`` with its defaults (``examples/gpt.py``): a 3-layer
character-level GPT (d_model 128, 4 heads, context 64, 616,448 parameters, GPT-2
initialisation, tied embeddings) on CPython's ``pydoc_data.topics`` text (the last 10 %
validate), AdamW lr 2e-3 with betas (0.9, 0.95) and weight decay 0.1 on matrices, 50 steps of
linear warm-up then cosine decay to 0.1·lr, gradient clipping 1.0, 500 steps of 32 windows × 64
characters per rank, 2 ranks. Validation bits per character every 25 steps on 128 windows spread
over the validation text, and at the end on all 726 windows.

**Rows** (:data:`ROWS`; DDP under ``torchrun --standalone`` unless marked Horovod, then
``horovodrun --gloo``): DDP's fp32 allreduce, PyTorch's ``fp16_compress_hook`` and
``bf16_compress_hook``, horovod_aq's hook with ``ALQ(bits=b)`` at its defaults (b = 2, 3, 4;
``wire="auto"``; the hook is given the AdamW optimizer, so ``error_feedback="auto"`` sends the
plain quantizer, docs/quantizers.md §5.11), the same with ``error_feedback=True`` at 2 and 3 bits
("EF", what "auto" chose before it knew the optimizer), without it ("plain") and at 2 bits with
buckets of 64 coordinates, ``DQSGD(target_bits=3)`` at the hook's defaults, PowerSGD (error
feedback, warm start, from step 2, one DDP bucket) at the rank whose bytes per step are closest to
"ALQ 3b"'s (:func:`benchmarks.ddp_accuracy.choose_rank` on PyTorch's compression rule, from the
first stored "ALQ 3b" run's steady bytes, then kept for every seed) and at
:data:`POWERSGD_LARGER_RANKS` (looking for the rank that matches ALQ's accuracy), and Horovod's
packed optimizer with fp32 (``NoCompression``) and ALQ 2- and 3-bit defaults.

**Seeds**: seed s fixes the initial weights (identical in every row) and each rank's data order
(``seed*1000 + rank``). Every (row, seed) is one launch; the report and its .json are rewritten
after each, and a rerun skips the (row, seed) pairs the .json holds (failed launches are
retried; the driver exits non-zero if any failed). Before the first launch, each pending row
that quantizes runs once for the --quick budget, unrecorded (:func:`warm_up`: numba compiles
the codec kernels of a code width once per checkout; ``--no-warm-up`` skips it). Per-launch
logs: ``runs/transformer/``.

**Reported** (``benchmarks/results/transformer.md``, ``.json``, ``.png``): final validation bpc
(all windows) mean ± sample sd over seeds; its paired difference to fp32 (same seed): mean ± its
standard error sd/√n; bytes one rank sends per step (mean over the run, and the steady per-step
bytes of the last evaluation interval) and their ratio to fp32's; time to :data:`TARGET_BPC`:
the first evaluated step whose subset bpc is at or below it, and rank 0's training seconds up to
it (evaluations excluded); seconds per run (training + evaluations, rank 0). Bytes: horovod_aq's
telemetry, else the ring-allreduce formula 2(P−1)/P·w·n, PowerSGD's P, Q and uncompressed
tensors from its hook state (``examples/transformer_char.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from benchmarks import report  # noqa: E402
from benchmarks.ddp_accuracy import choose_rank, powersgd_numel, ring_bytes  # noqa: E402

EXAMPLE = ROOT / "examples" / "transformer_char.py"
RANKS = 2
#: Validation bpc (on the evaluation subset) that defines "time to target". Calibration
#: (``examples/transformer_char.py --ddp --ddp-hook allreduce``, seed 0, 500 steps): fp32's
#: subset bpc was 2.2807 at step 350 and 2.2256 at step 375, so it first reaches 2.25 at 75 % of
#: the training (the final bpc on all windows: 2.1210).
TARGET_BPC = 2.25
#: Larger PowerSGD ranks than the byte-matched one (about 2x and 4x its bytes), to find the rank
#: whose accuracy matches ALQ's.
POWERSGD_LARGER_RANKS = (16, 32)
#: Wall-clock limit of one launch (s): a hung run ends and the grid goes on.
RUN_TIMEOUT_S = 3600
QUICK_STEPS = 30
QUICK_EVAL_EVERY = 10
QUICK_ROWS = ("fp32", "ALQ 3b", "Horovod packed ALQ 3b")
MATCHED = "PowerSGD (matched to ALQ 3b)"

#: label → (launcher, example flags, what the row is). "ddp": torchrun + --ddp.
ROWS: dict[str, tuple[str, list[str], str]] = {
    "fp32": ("ddp", ["--ddp-hook", "allreduce"], "DDP's own fp32 allreduce"),
    "fp16": ("ddp", ["--ddp-hook", "fp16"], "PyTorch fp16_compress_hook"),
    "bf16": ("ddp", ["--ddp-hook", "bf16"], "PyTorch bf16_compress_hook"),
    "ALQ 2b": ("ddp", ["--compression", "alq", "--bits", "2"],
               "hook, ALQ(bits=2) defaults (AdamW: no error feedback)"),
    "ALQ 3b": ("ddp", ["--compression", "alq", "--bits", "3"],
               "hook, ALQ(bits=3) defaults (AdamW: no error feedback)"),
    "ALQ 4b": ("ddp", ["--compression", "alq", "--bits", "4"], "hook, ALQ(bits=4) defaults"),
    "ALQ 2b EF": ("ddp", ["--compression", "alq", "--bits", "2", "--error-feedback", "on"],
                  "hook, ALQ(bits=2), error_feedback=True"),
    "ALQ 3b EF": ("ddp", ["--compression", "alq", "--bits", "3", "--error-feedback", "on"],
                  "hook, ALQ(bits=3), error_feedback=True"),
    "ALQ 2b plain": ("ddp", ["--compression", "alq", "--bits", "2", "--error-feedback", "off"],
                     "hook, ALQ(bits=2), error_feedback=False"),
    "ALQ 3b plain": ("ddp", ["--compression", "alq", "--bits", "3", "--error-feedback", "off"],
                     "hook, ALQ(bits=3), error_feedback=False"),
    "ALQ 2b plain B=64": ("ddp", ["--compression", "alq", "--bits", "2", "--error-feedback",
                                  "off", "--bucket-size", "64"],
                          "hook, ALQ(bits=2, bucket_size=64), error_feedback=False"),
    "DQSGD target 3": ("ddp", ["--compression", "dqsgd", "--bits", "3"],
                "hook, DQSGD(target_bits=3) defaults"),
    MATCHED: ("ddp", ["--ddp-hook", "powersgd"], "PowerSGD, rank matched in bytes to ALQ 3b"),
    **{f"PowerSGD r={r}": ("ddp", ["--ddp-hook", "powersgd", "--powersgd-rank", str(r)],
                           "PowerSGD, a larger rank") for r in POWERSGD_LARGER_RANKS},
    "Horovod packed fp32": ("horovod", ["--compression", "none"],
                            "horovod_aq.torch.DistributedOptimizer, NoCompression"),
    "Horovod packed ALQ 2b": ("horovod", ["--compression", "alq", "--bits", "2"],
                              "horovod_aq.torch.DistributedOptimizer, ALQ(bits=2) defaults"),
    "Horovod packed ALQ 3b": ("horovod", ["--compression", "alq", "--bits", "3"],
                              "horovod_aq.torch.DistributedOptimizer, ALQ(bits=3) defaults"),
}


# ============================================================================ measures
def model_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of the example's default GPT (what PowerSGD compresses)."""
    import gpt

    corpus = gpt.load_corpus()
    return [tuple(p.shape) for p in gpt.build(gpt.GPTConfig(corpus.vocab_size), 0).parameters()]


def steady_bytes(run: dict) -> float:
    """Bytes per step over the last evaluation interval of a run's curve."""
    a, b = run["curve"][-2], run["curve"][-1]
    return (b["bytes_sent"] - a["bytes_sent"]) / (b["step"] - a["step"])


def first_reach(curve: list[dict], target: float) -> dict | None:
    """The first evaluation point whose subset bpc is at or below ``target`` (None: never)."""
    return next((pt for pt in curve if pt["val_bpc"] <= target), None)


def crossing(curve: list[dict], target: float) -> dict | None:
    """Where the subset bpc curve first crosses ``target``, linearly interpolated between the
    last evaluation above it (s₀, b₀) and the first at or below it (s₁, b₁):
    step = s₀ + (b₀ − target)/(b₀ − b₁)·(s₁ − s₀), training seconds alike (None: never)."""
    hit = first_reach(curve, target)
    if hit is None:
        return None
    i = curve.index(hit)
    if i == 0:
        return {"step": float(hit["step"]), "train_seconds": hit["train_seconds"]}
    a = curve[i - 1]
    w = (a["val_bpc"] - target) / (a["val_bpc"] - hit["val_bpc"])
    return {k: a[k] + w * (hit[k] - a[k]) for k in ("step", "train_seconds")}


def paired(rows: dict[str, list[dict]], label: str, key: str = "val_bpc") -> list[float]:
    """``key`` of ``label`` minus fp32's, for each seed both rows hold."""
    ref = {r["seed"]: r[key] for r in rows.get("fp32", [])}
    return [r[key] - ref[r["seed"]] for r in rows[label] if r["seed"] in ref]


def mean_sd(values: list[float], digits: int) -> str:
    if not values:
        return "—"
    if any(not math.isfinite(v) for v in values):
        return "non-finite"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def mean_se(values: list[float], digits: int) -> str:
    """mean ± standard error (sd/√n); the mean alone for one value."""
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:+.{digits}f}"
    se = statistics.stdev(values) / math.sqrt(len(values))
    return f"{statistics.fmean(values):+.{digits}f} ± {se:.{digits}f}"


# ============================================================================ launches
def command(label: str, seed: int, args: argparse.Namespace, out: str,
            prank: int | None, *, quick: bool = False) -> list[str]:
    """The launch of one (row, seed); ``quick``: the --quick budget (also for warm-ups)."""
    launcher, flags, _ = ROWS[label]
    flags = list(flags) + (["--powersgd-rank", str(prank)] if label == MATCHED else [])
    example = [str(EXAMPLE), *flags, "--seed", str(seed), "--out", out,
               "--target-bpc", str(args.target)]
    if quick or args.quick:
        example += ["--steps", str(QUICK_STEPS), "--eval-every", str(QUICK_EVAL_EVERY),
                    "--eval-windows", "32"]
    py = sys.executable
    if launcher == "ddp":
        torchrun = os.path.join(os.path.dirname(py), "torchrun")
        return [torchrun, "--standalone", "--nproc-per-node", str(RANKS), *example, "--ddp"]
    from horovod_aq.tools.launcher import _horovodrun

    return [_horovodrun(), "-np", str(RANKS), "-H", f"localhost:{RANKS}", "--gloo", py, *example]


def uses_kernels(label: str) -> bool:
    """Whether a row runs horovod_aq's codec kernels (a quantizing compressor)."""
    flags = ROWS[label][1]
    return "--compression" in flags and flags[flags.index("--compression") + 1] != "none"


def warm_up(labels: list[str], args: argparse.Namespace, logs: Path) -> None:
    """One quick launch (seed 0, not recorded) of each row in ``labels`` that runs horovod_aq's
    codec kernels. numba compiles a kernel per code width on its first call in a checkout
    (``cache=True`` keeps it, docs in horovod_aq/codec/fused.py) and the packed exchanges time
    candidate wires on their first steps; without this, a row's first recorded seed would count
    the compilation in its time to target and could let it sway the wire choice."""
    for label in labels:
        if not uses_kernels(label):
            continue
        tmp = tempfile.mkdtemp(prefix="transformer.warm.")
        try:
            launch(command(label, 0, args, tmp, None, quick=True),
                   logs / f"warm.{_slug(label)}.log")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"warm-up of {label} failed: {exc}", file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _slug(label: str) -> str:
    return label.replace(" ", "_").replace("(", "").replace(")", "").replace("=", "")


def launch(cmd: list[str], log: Path) -> dict:
    """Run one launch with one thread per rank and this checkout's horovod_aq first on
    PYTHONPATH; its output goes to ``log``; returns rank 0's metrics.json."""
    from horovod_aq.tools.launcher import _rank_env

    out = cmd[cmd.index("--out") + 1]
    with open(log, "w") as f:
        f.write(shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=ROOT, env=_rank_env(None), stdout=f,
                              stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise RuntimeError(f"exit status {proc.returncode}; log {log}:\n{tail}")
    metrics = json.loads((Path(out) / "metrics.json").read_text())
    run = dict(metrics["summary"], curve=metrics["curve"])
    run["command"] = shlex.join(cmd)
    return run


# ============================================================================ report
def render(args: argparse.Namespace, data: dict, wall: float) -> str:
    rows = data["rows"]
    fp32 = statistics.fmean(r["bytes_fp32_per_step"] for runs in rows.values() for r in runs)
    table = []
    for label in [lb for lb in ROWS if lb in rows] + [lb for lb in rows if lb not in ROWS]:
        runs = sorted(rows[label], key=lambda r: r["seed"])
        r0 = runs[0]
        sent = statistics.fmean(r["bytes_per_step"] for r in runs)
        steady = statistics.fmean(steady_bytes(r) for r in runs)
        hit = [pt for pt in (first_reach(r["curve"], args.target) for r in runs) if pt]
        cross = [pt for pt in (crossing(r["curve"], args.target) for r in runs) if pt]
        bits = [r["bits_per_coordinate"] for r in runs if r.get("bits_per_coordinate")]
        name = label if label != MATCHED else f"PowerSGD r={r0['powersgd_rank']} (matched)"
        table.append([
            name, ROWS[label][2] if label in ROWS else r0["label"],
            mean_sd([r["val_bpc"] for r in runs], 4),
            "0 (reference)" if label == "fp32" else mean_se(paired(rows, label), 4),
            f"{sent / 1e3:.1f}", f"{sent / fp32:.3f}", f"{steady / fp32:.3f}",
            f"{statistics.fmean(bits):.2f}" if bits else "—",
            (f"{statistics.fmean(pt['step'] for pt in hit):.0f} ({len(hit)}/{len(runs)})"
             if hit else f"not reached (0/{len(runs)})"),
            f"{statistics.fmean(pt['step'] for pt in cross):.0f}" if cross else "—",
            f"{statistics.fmean(pt['train_seconds'] for pt in cross):.0f}" if cross else "—",
            f"{statistics.fmean(r['seconds'] for r in runs):.0f} "
            f"({statistics.fmean(r['launch_seconds'] for r in runs):.0f})",
            ", ".join(str(r["seed"]) for r in runs)])
    head = ["row", "what", "val bpc", "minus fp32 (paired, ± se)", "kB/rank/step",
            "bytes vs fp32", "steady vs fp32", "bits/coord", f"step to {args.target} bpc",
            "step (interpolated)", "train s to target (interpolated)", "s per run (launch)",
            "seeds"]
    r0 = next(iter(rows.values()))[0]
    launched = sum(r["launch_seconds"] for runs in rows.values() for r in runs)
    notes = [
        f"Task: examples/transformer_char.py, GPT {r0['numel']:,} parameters, {RANKS} ranks "
        f"(1 thread each, Gloo), {r0['steps']} steps, AdamW, corpus pydoc_data.topics "
        f"({r0['corpus']}); per-run logs in runs/transformer/",
        f"Seeds asked: {', '.join(map(str, args.seeds))}; PowerSGD matched rank: "
        f"{data.get('powersgd_matched_rank', 'not yet chosen')}",
        f"Target {args.target} bpc on the evaluation subset ({r0['eval_windows']} of "
        f"{r0['val_windows']} validation windows, every {r0['curve'][1]['step']} steps)",
        f"Launches of the stored runs: {launched / 60:.0f} min in all (this invocation "
        f"{wall / 60:.1f} min)",
    ]
    body = report.markdown_table(head, table) + (
        "\n\nval bpc: validation bits per character on all windows after the last step, mean ± "
        "sample sd over seeds. minus fp32: the row's bpc minus fp32's of the same seed, mean ± "
        "standard error (sd/√n). Bytes: what one rank sends per step (mean over the run; "
        "steady: the last evaluation interval), horovod_aq's telemetry (packed payloads; "
        "handshakes and refit traffic not counted) or the ring allreduce 2(P−1)/P·w·n (fp32 "
        "w = 4, fp16/bf16 w = 2; PowerSGD: its uncompressed tensors + P + Q in fp32, first 2 "
        "steps whole). bits/coord: horovod_aq's payload bits per quantized coordinate. step "
        "to target: the first evaluation at or below the target (mean over the seeds that "
        "reached it); interpolated: the crossing linearly interpolated between that evaluation "
        "and the one before (crossing()); train s: rank 0's training seconds to it "
        "(evaluations excluded), interpolated alike. s per "
        "run: rank 0's training and evaluations (launch: the whole launch, start-up included). "
        "Times are on a shared 2-core machine: compare them within one report only.\n")
    return report.header("A transformer with AdamW: fp32, 16-bit, PowerSGD and horovod_aq",
                         notes) + "\n" + body


def plot(data: dict, path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, runs in data["rows"].items():
        steps = [pt["step"] for pt in runs[0]["curve"]]
        mean = [statistics.fmean(r["curve"][i]["val_bpc"] for r in runs
                                 if len(r["curve"]) > i) for i in range(len(steps))]
        ax.plot(steps[1:], mean[1:], label=label, lw=1.2)
    ax.axhline(target, color="grey", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("validation bpc (subset), mean over seeds")
    ax.set_title("char-level GPT, AdamW, 2 ranks")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ============================================================================ driver
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"plumbing: rows {', '.join(QUICK_ROWS)}, seed 0, {QUICK_STEPS} steps; "
                        "report under results/quick/, no resume")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rows", default=None,
                   help="comma-separated row labels (default: every row)")
    p.add_argument("--target", type=float, default=TARGET_BPC,
                   help="validation bpc of 'time to target'")
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="skip the unrecorded quick launch of each pending quantizing row "
                        "before the grid (it compiles the codec kernels: warm_up())")
    p.add_argument("--out", default=None,
                   help="report path (default benchmarks/results/transformer.md; --quick: "
                        "results/quick/); .json and .png beside it")
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.rows = list(QUICK_ROWS) if args.quick and args.rows is None else (
        [r.strip() for r in args.rows.split(",")] if args.rows else list(ROWS))
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if args.quick:
        args.seeds = [0]
    if args.out is None:
        args.out = str((report.RESULTS / "quick" if args.quick else report.RESULTS)
                       / "transformer.md")
    return args


def matched_rank(data: dict) -> int | None:
    """PowerSGD's rank matched to ALQ 3b: chosen once, from the first stored ALQ 3b run."""
    if "powersgd_matched_rank" not in data and data["rows"].get("ALQ 3b"):
        target = steady_bytes(data["rows"]["ALQ 3b"][0])
        data["powersgd_matched_rank"] = choose_rank(model_shapes(), target, RANKS)
    return data.get("powersgd_matched_rank")


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    store = out.with_suffix(".json")
    data = {"rows": {}}
    if store.exists() and not args.quick:
        data = json.loads(store.read_text())
    logs = ROOT / "runs" / ("transformer_quick" if args.quick else "transformer")
    logs.mkdir(parents=True, exist_ok=True)
    # the matched PowerSGD row needs ALQ 3b first (of some seed): order the rows so
    order = sorted(args.rows, key=lambda lb: (lb == MATCHED, list(ROWS).index(lb)))
    failed: list[str] = []
    t_all = time.monotonic()
    pending = [lb for lb in order
               if any(all(r["seed"] != s for r in data["rows"].get(lb, [])) for s in args.seeds)]
    if args.warm_up and not args.quick:
        warm_up(pending, args, logs)
    for seed in args.seeds:
        for label in order:
            if any(r["seed"] == seed for r in data["rows"].get(label, [])):
                continue
            prank = matched_rank(data) if label == MATCHED else None
            if label == MATCHED and prank is None:
                failed.append(f"{label} seed {seed}: no ALQ 3b run to match yet")
                continue
            tmp = tempfile.mkdtemp(prefix="transformer.")
            log = logs / f"{_slug(label)}.s{seed}.log"
            t0 = time.monotonic()
            try:
                run = launch(command(label, seed, args, tmp, prank), log)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                failed.append(f"{label} seed {seed}: {exc}")
                print(f"FAILED {label} seed {seed}: {exc}", file=sys.stderr, flush=True)
                continue
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            run["launch_seconds"] = time.monotonic() - t0
            data["rows"].setdefault(label, []).append(run)
            if label == "ALQ 3b":
                matched_rank(data)
            if label == MATCHED and abs(steady_bytes(run) / ring_bytes(
                    powersgd_numel(model_shapes(), prank)["total"], RANKS) - 1) > 1e-9:
                raise RuntimeError(f"PowerSGD r={prank} sent {steady_bytes(run)} B per step; "
                                   "PyTorch's compression rule predicts otherwise")
            print(f"{label}, seed {seed}: val bpc {run['val_bpc']:.4f}, "
                  f"{run['launch_seconds']:.0f} s", file=sys.stderr, flush=True)
            store.write_text(json.dumps(data, indent=1))
            out.write_text(render(args, data, time.monotonic() - t_all))
            plot(data, out.with_suffix(".png"), args.target)
    if data["rows"]:
        out.write_text(render(args, data, time.monotonic() - t_all))
        plot(data, out.with_suffix(".png"), args.target)
        print(out.read_text())
    if failed:
        print("failed (rerun to retry):\n" + "\n".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
