"""ECQ-SGD stability: the default α, β (derived from the quantizer's γ) against plain QSGD and
against the former fixed defaults α = 0.2, β = 0.9, on synthetic least squares (simulated).

    python benchmarks/ecq_stability.py          # Syn-256, 2/4 workers, B 64/256, 2/4 bits, 5 seeds
    python benchmarks/ecq_stability.py --quick  # CI: 4 workers, B 256, 2 bits, 2 seeds, 200 steps

Spec: ``docs/dynamic.md`` §2.3 (stability λ = α²γ + (β − α)² < 1) and §2.4 (the default rule
β = 0.9, α = min(β/(1 + γ_G), 2β/(1 + γ_sup)), which keeps λ ≤ β² for every gradient).

**Problem and training** as in ``benchmarks/linear_models.py`` (its helpers are reused): Syn-d
least squares (n = 10,000 rows, A ~ N(0, 1), w* ~ N(0, I), noise 0.1), in-process data-parallel
SGD through the real numpy codec and compressor objects (``horovod_aq.tools.simulate.run_sgd``),
P workers with minibatches of 32 rows, lr 0.02, no momentum, w_0 = 0.

**Quantizers.** ``QSGD(bits=b, bucket_size=B)`` (U-ref, 2^b zero-free levels, L2 bucket norm) for
every b in ``--bits`` and B in ``--buckets``; each plain, as ``ErrorFeedback(QSGD(...))`` with the
defaults, and as ``ErrorFeedback(QSGD(...), alpha=0.2, beta=0.9)``. The table gives each cell's
γ_G (the relative variance for a bucket of i.i.d. normal coordinates, B·V(ℓ; TN(0, 1/B))), γ_sup
(its supremum over all buckets), the default α and λ = α²γ_G + (β − α)² for both pairs.

**Metrics.** Final excess loss f(w) − f* (mean over the last 10 % of the steps); a run that
exceeds 100·f(w_0) or whose gradient the codec refuses (overflowing norm) is *diverged*. Seed s
fixes data, minibatches and quantization uniforms, the same for the three methods of a cell
(paired). "defaults ≤ plain" counts the seeds on which the default ECQ ends at or below plain
QSGD (a diverged plain run counts as +∞; a diverged ECQ run never counts).

Results: ``benchmarks/results/ecq_stability.md`` and ``ecq_stability.json`` (per-run numbers).
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
from benchmarks.linear_models import Config, _plain, make_problem, run_config

#: The former fixed defaults (the HiPress system's values).
OLD_ALPHA, OLD_BETA = 0.2, 0.9


def cell_configs(bits: int, bucket: int) -> list[Config]:
    """Plain QSGD, ECQ with the default coefficients, ECQ with α = 0.2, β = 0.9."""
    import horovod_aq

    def q():
        return horovod_aq.QSGD(bits=bits, bucket_size=bucket)

    return [Config("QSGD", q, "qsgd", bits),
            Config("ECQ defaults", lambda: horovod_aq.ErrorFeedback(q()), "ecq", bits),
            Config("ECQ α=0.2, β=0.9",
                   lambda: horovod_aq.ErrorFeedback(q(), alpha=OLD_ALPHA, beta=OLD_BETA),
                   "ecq-old", bits)]


def fmt(values: list[float]) -> str:
    """mean ± sample std of the finite values, with the number of diverged runs."""
    ok = [v for v in values if math.isfinite(v)]
    bad = len(values) - len(ok)
    if not ok:
        return f"diverged ({bad}/{len(values)})"
    text = f"{statistics.fmean(ok):.3g}" + (f" ± {statistics.stdev(ok):.2g}" if len(ok) > 1
                                            else "")
    return text + (f" ({bad}/{len(values)} diverged)" if bad else "")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="CI: 4 workers, B 256, 2 bits, seeds 0,1, 200 steps")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--workers", default="2,4")
    p.add_argument("--buckets", default="64,256")
    p.add_argument("--bits", default="2,4")
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.workers, args.buckets, args.bits, args.steps = "0,1", "4", "256", "2", 200
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.workers = [int(w) for w in args.workers.split(",")]
    args.buckets = [int(b) for b in args.buckets.split(",")]
    args.bits = [int(b) for b in args.bits.split(",")]
    return args


def main(argv=None) -> int:
    import logging

    import horovod_aq
    from horovod_aq.error_feedback import contraction

    args = parse_args(argv)
    logging.getLogger("horovod_aq").setLevel(logging.ERROR)   # the expected divergence warnings
    t0 = time.perf_counter()
    problems = {s: make_problem(args.dim, s, args.rows, args.noise) for s in args.seeds}
    runs: list[dict] = []
    rows: list[list[str]] = []
    verdicts: list[str] = []
    for workers in args.workers:
        for bucket in args.buckets:
            for bits in args.bits:
                ef = horovod_aq.ErrorFeedback(horovod_aq.QSGD(bits=bits, bucket_size=bucket))
                gamma, gamma_sup, alpha = ef.gamma, ef.gamma_sup, ef.alpha
                finals: dict[str, list[float]] = {}
                for cfg in cell_configs(bits, bucket):
                    for seed in args.seeds:
                        r = run_config(problems[seed], cfg, steps=args.steps, lr=args.lr,
                                       batch=args.batch, workers=workers)
                        final = math.inf if r["diverged"] else r["final"]
                        finals.setdefault(cfg.label, []).append(final)
                        runs.append({"workers": workers, "bucket": bucket, "bits": bits,
                                     "method": cfg.label, "seed": seed, "final": final,
                                     "diverged": r["diverged"], "seconds": r["seconds"]})
                plain, new, old = (finals[k] for k in ("QSGD", "ECQ defaults",
                                                       "ECQ α=0.2, β=0.9"))
                wins = sum(1 for p, e in zip(plain, new) if math.isfinite(e) and e <= p)
                rows.append([str(workers), str(bucket), str(bits), f"{gamma:.3g}",
                             f"{gamma_sup:.3g}", f"{alpha:.4g}",
                             f"{contraction(alpha, ef.beta, gamma):.3f}",
                             f"{contraction(OLD_ALPHA, OLD_BETA, gamma):.3f}",
                             fmt(plain), fmt(new), fmt(old), f"{wins}/{len(plain)}"])
                def diverged(values):
                    return f"{sum(1 for v in values if not math.isfinite(v))}/{len(values)}"

                verdicts.append(f"P = {workers}, B = {bucket}, {bits} bits: defaults ≤ plain on "
                                f"{wins}/{len(plain)} seeds; diverged: plain {diverged(plain)}, "
                                f"defaults {diverged(new)}, α = 0.2, β = 0.9 {diverged(old)}")
                print(verdicts[-1], flush=True)
    wall = time.perf_counter() - t0
    headers = ["workers", "B", "bits", "γ_G", "γ_sup", "default α (β = 0.9)",
               "λ defaults", "λ α=0.2, β=0.9", "QSGD", "ECQ defaults", "ECQ α=0.2, β=0.9",
               "defaults ≤ plain"]
    body = ("### Final excess loss f(w) − f* (mean over the last 10 % of the steps; mean ± sample "
            "std over seeds)\n\n" + report.markdown_table(headers, rows) + "\n\n"
            "γ_G: relative variance E‖Q(v) − v‖²/‖v‖² of the QSGD table for a bucket of i.i.d. "
            "normal coordinates; γ_sup: its supremum over all buckets (docs/quantizers.md §6.1). "
            "λ = α²γ_G + (β − α)² (docs/dynamic.md §2.3; the memory contracts when λ < 1). "
            "Diverged: the loss exceeded 100·f(w_0) or the codec refused an overflowing bucket "
            "norm.\n\n### Summary\n\n" + "\n".join(f"- {v}" for v in verdicts) + "\n")
    notes = [
        f"Problem: Syn-{args.dim} least squares (horovod_aq.tools.simulate.LeastSquares."
        f"synthetic), n = {args.rows}, noise {args.noise}; seeds "
        f"{', '.join(map(str, args.seeds))} (data, minibatches and uniforms; paired)",
        f"Training: horovod_aq.tools.simulate.run_sgd, workers {', '.join(map(str, args.workers))}"
        f", batch {args.batch}/worker, lr {args.lr}, no momentum, {args.steps} steps",
        f"Quantizers: QSGD U-ref, L2 norm, buckets {', '.join(map(str, args.buckets))}, bits "
        f"{', '.join(map(str, args.bits))}; ECQ defaults: β = 0.9, α = min(β/(1 + γ_G), "
        f"2β/(1 + γ_sup)) (docs/dynamic.md §2.4)",
        f"Wall time {wall:.0f} s, one process (numpy)",
    ]
    path = report.write("ecq_stability", "ECQ-SGD stability: default α, β vs plain QSGD and "
                        "α = 0.2, β = 0.9", body, quick=args.quick, notes=notes)
    path.with_suffix(".json").write_text(json.dumps(_plain({"args": vars(args), "runs": runs}),
                                                    indent=1))
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
