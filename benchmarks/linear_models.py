"""Linear models: ECQ-SGD vs QSGD vs SGD, and DQSGD's bits-vs-loss trade-off (simulated).

    python benchmarks/linear_models.py          # Syn-256 (5 seeds, 500 steps), Syn-1024 (3, 1000)
    python benchmarks/linear_models.py --quick  # CI: Syn-256, 3 seeds, 300 steps, fewer configs

A small-scale reproduction of the ECQ-SGD paper's linear-model comparison (arXiv 1806.08054,
synthetic least squares "Syn-d": loss vs iteration for 32-bit SGD, QSGD and ECQ-SGD) and of
DQSGD's claim (arXiv 2107.14575) that a per-step bit width reaches a given loss with fewer bits
than a fixed width. Spec: ``docs/dynamic.md`` §1 (DQSGD) and §2 (ECQ-SGD).

**Problem** (``horovod_aq.tools.simulate.LeastSquares.synthetic``, the paper's Syn-d): n = 10,000
rows, A_ij ~ N(0, 1), w* ~ N(0, I_d), b = A·w* + 0.1·ε, ε ~ N(0, I_n);

    f(w) = ‖A·w − b‖² / (2n),   f* = f(ŵ),   ŵ = argmin f (least-squares solution, lstsq).

The curves and tables report the **excess loss** f(w_t) − f* (f* ≈ 0.005 is the noise floor
of the data; it is printed per dimension). Curvature: μ, L = extreme eigenvalues of AᵀA/n.

**Training** (``horovod_aq.tools.simulate.run_sgd``: in-process data-parallel SGD through the real
numpy codec and the real compressor objects, not a re-implementation). P = 4 workers, w_0 = 0;
at every step each worker draws a minibatch of 32 rows (with replacement), computes its
gradient g_p, sends it through the compressor (error compensation for ECQ, then
``codec.encode``/``codec.decode`` with the compressor's current level table and bucket size,
fresh quantization uniforms per worker and step), and the model takes
w ← w − η·(1/P)·Σ_p ĝ_p with η = 0.02 (the paper's learning rate), no momentum.

**Quantizers.** QSGD (``horovod_aq.QSGD(bits=b, bucket_size=64)``): the package's default
uniform table U-ref, 2^b zero-free levels ℓ_k = −1 + 2k/(2^b − 1), each bucket of 64
coordinates scaled by its L2 norm, unbiased stochastic rounding. b = 1 is the two-level table
{−1, +1}·‖v‖₂ (normalized variance Σ_i (1 − r_i²) ≈ 63 per 64-bucket). ECQ-SGD
(``horovod_aq.ECQ(QSGD(...), alpha=α, beta=β)``) keeps per worker
h_p ← β·h_p + (g_p − Q(g_p + α·h_p)) and sends Q(g_p + α·h_p); α = 0.2, β = 0.9 (``--alpha``,
``--beta``) are HiPress's values, the package defaults before they were derived from the
quantizer's γ (the paper's own values could not be checked, spec §2.4;
``benchmarks/ecq_stability.py`` compares them with the current defaults).
Classic error feedback (α = β = 1) at 2 bits is run too, as a stability check (spec §2.3:
needs α²γ + (β − α)² < 1 with γ the quantizer's relative variance).

**DQSGD** (``horovod_aq.DQSGD``, uniform U-ref tables at every width, bucket 64, widths
2…8): B_n = clip(round(log₂(t·G_{n−1} + 1) + 1), 2, 8) with G the norm of the previous step's
averaged gradient. Two modes:

* ``target_bits=b̄`` (non-convex rule, Theorem 3): t calibrated so the running mean width is b̄.
* ``budget=b̄·N, horizon=N, alpha=α_T`` (strongly convex rule, Theorem 1: t scaled by
  α_T^((N−n)/2), so late steps, whose noise is discounted least, get more bits), with the
  theorem's α_T = 1 − 2μη + Lμη² computed from this problem's μ and L. The budget is a hard
  cap on Σ_n B_n.

**Bits.** "code bits/coordinate" is the mean over steps of the width B_n (what the DQSGD
paper's compression ratio counts). "wire bits/coordinate" is the full payload of one worker per
step, ``codec.payload_size(d, B_n, 64)``·8/d: codes + one fp32 norm per 64 coordinates
(0.5 bits/coordinate) + the 32-byte header (256/d bits/coordinate); fp32 is 32.

**Metrics.** Final excess loss = mean of f(w_t) − f* over the last 10% of the steps (less
noisy than the last iterate); ‖w_N − w*‖ (distance to the generating vector, as in the
paper). Seed s fixes the data (Syn-d drawn with seed s), the minibatches and the quantization
uniforms, identical for every method of that seed (paired comparison); tables give
mean ± sample std over seeds, and "ECQ/QSGD" is the per-seed ratio of final excess losses. A
run is reported as diverged, and stopped, once f(w_t) > 100·f(w_0) or when the codec refuses
a gradient (non-finite, or a bucket norm that overflows float32). For DQSGD the table also
gives the mean width over the first half of the steps and over the last 10%.

Results: ``benchmarks/results/linear_models.md`` (tables), ``linear_models.png`` (loss curves
per dimension, log y, mean over seeds with min–max band; bits vs final loss; DQSGD widths per
step) and ``linear_models.json`` (per-run numbers).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import report
from horovod_aq.tools.simulate import LeastSquares

#: A run stops as diverged once f(w_t) exceeds this multiple of f(w_0).
DIVERGENCE_FACTOR = 100.0


class Diverged(Exception):
    """Raised from the loss evaluation of a run whose loss has blown up."""


@dataclass(frozen=True)
class GuardedLeastSquares(LeastSquares):
    """The same problem; ``loss`` (evaluated by run_sgd after every step) raises
    :class:`Diverged` above ``limit``, so a diverging run stops early instead of running on."""

    limit: float = math.inf

    def loss(self, w: np.ndarray) -> float:
        value = super().loss(w)
        if not value <= self.limit:        # also NaN
            raise Diverged(f"f(w) = {value:.3g} exceeded {DIVERGENCE_FACTOR:g}·f(w_0)")
        return value


@dataclass(frozen=True)
class Config:
    """One method: a label, a compressor factory (None: fp32 SGD) and how to draw it."""

    label: str
    make: Callable[[], object] | None
    kind: str            # "sgd", "qsgd", "ecq", "ef", "dqsgd", "dqsgd-sc"
    bits: float = 32.0   # nominal width (fixed methods) or target mean (DQSGD)
    group: str = ""      # quantizer setting shared by a QSGD row and its ECQ rows (plot colour)
    pair: str = ""       # ECQ rows: the label of the plain QSGD row with the same quantizer


@dataclass(frozen=True)
class Problem:
    dim: int
    seed: int
    data: GuardedLeastSquares
    f_star: float
    mu: float
    L: float


def make_problem(dim: int, seed: int, rows: int, noise: float) -> Problem:
    syn = LeastSquares.synthetic(n=rows, dim=dim, noise=noise, seed=seed)
    data = GuardedLeastSquares(syn.A, syn.b, syn.w_star,
                               limit=DIVERGENCE_FACTOR * syn.loss(np.zeros(dim)))
    w_hat = np.linalg.lstsq(data.A, data.b, rcond=None)[0]
    eig = np.linalg.eigvalsh(data.A.T @ data.A / rows)
    return Problem(dim, seed, data, data.loss(w_hat), float(eig[0]), float(eig[-1]))


def ecq_configs(dim: int, bits_list, bucket: int, alpha: float, beta: float, classic: bool,
                paper_s: int) -> list[Config]:
    """SGD; QSGD and ECQ-SGD at each width (bucket ``bucket``); classic EF at 2 bits; and the
    paper's grid (U-paper, s levels, one L2 norm per vector) with and without ECQ."""
    import horovod_aq

    configs = [Config("SGD fp32", None, "sgd")]
    for b in bits_list:
        configs.append(Config(f"QSGD {b}b", lambda b=b: horovod_aq.QSGD(bits=b, bucket_size=bucket),
                              "qsgd", b, f"{b}b"))
        configs.append(Config(
            f"ECQ-SGD {b}b",
            lambda b=b: horovod_aq.ECQ(horovod_aq.QSGD(bits=b, bucket_size=bucket),
                                       alpha=alpha, beta=beta), "ecq", b, f"{b}b", f"QSGD {b}b"))
    if classic:
        configs.append(Config(
            "EF (α=β=1) 2b",
            lambda: horovod_aq.ECQ(horovod_aq.QSGD(bits=2, bucket_size=bucket),
                                   alpha=1.0, beta=1.0), "ef", 2, "2b", "QSGD 2b"))
    if paper_s:
        bits = int(2 * paper_s).bit_length()
        plain = f"QSGD s={paper_s}, 1 norm/vector"
        configs.append(Config(plain, lambda: horovod_aq.QSGD(s=paper_s, bucket_size=dim),
                              "qsgd", bits, "paper"))
        configs.append(Config(
            f"ECQ-SGD s={paper_s}, 1 norm/vector",
            lambda: horovod_aq.ECQ(horovod_aq.QSGD(s=paper_s, bucket_size=dim),
                                   alpha=alpha, beta=beta), "ecq", bits, "paper", plain))
    return configs


def tradeoff_configs(fixed_bits, targets, budgets, bucket: int, steps: int,
                     alpha_t: float) -> list[Config]:
    import horovod_aq

    configs = [Config(f"QSGD {b}b", lambda b=b: horovod_aq.QSGD(bits=b, bucket_size=bucket),
                      "qsgd", b) for b in fixed_bits]
    configs += [Config(f"DQSGD target {t:g}",
                       lambda t=t: horovod_aq.DQSGD(target_bits=t, bucket_size=bucket),
                       "dqsgd", t) for t in targets]
    configs += [Config(f"DQSGD budget {t:g}·N, α_T",
                       lambda t=t: horovod_aq.DQSGD(budget=t * steps, horizon=steps,
                                                    alpha=alpha_t, bucket_size=bucket),
                       "dqsgd-sc", t) for t in budgets]
    return configs


def run_config(problem: Problem, config: Config, *, steps: int, lr: float, batch: int,
               workers: int) -> dict:
    """One training run; the numbers every table and plot is made of."""
    from horovod_aq import codec
    from horovod_aq.codec import NonFiniteGradientError
    from horovod_aq.tools.simulate import run_sgd

    comp = config.make() if config.make is not None else None
    tail = max(1, steps // 10)
    t0 = time.perf_counter()
    diverged = ""
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            run = run_sgd(problem.data, comp, workers=workers, steps=steps, lr=lr, batch=batch,
                          seed=problem.seed)
        losses, bits, distance = run.losses, run.bits, run.distance
        if not np.all(np.isfinite(losses)):
            diverged = "non-finite loss"
        elif np.mean(losses[-tail:]) > losses[0]:
            diverged = (f"loss grew from {losses[0] - problem.f_star:.3g} to "
                        f"{losses[-1] - problem.f_star:.3g} (excess)")
    except Diverged as err:
        losses, bits, distance = np.array([np.nan]), np.array([]), math.nan
        diverged = str(err)
    except (NonFiniteGradientError, ValueError) as err:   # the codec refuses overflowing norms
        losses, bits, distance = np.array([np.nan]), np.array([]), math.nan
        diverged = f"codec refused the gradient ({str(err).split(';')[0]})"
    seconds = time.perf_counter() - t0
    excess = losses - problem.f_star
    bucket = comp.bucket_size if comp is not None else problem.dim
    out = {"label": config.label, "kind": config.kind, "dim": problem.dim,
           "seed": problem.seed, "steps": steps, "diverged": diverged, "seconds": seconds,
           "final": math.nan if diverged else float(np.mean(excess[-tail:])),
           "last": math.nan if diverged else float(excess[-1]),
           "loss_last": math.nan if diverged else float(losses[-1]),
           "distance": math.nan if diverged else distance,
           "curve": None if diverged else excess}
    if comp is None:
        out["code_bits"], out["wire_bits"] = 32.0, 32.0
    elif bits.size:
        out["code_bits"] = float(np.mean(bits))
        out["wire_bits"] = float(np.mean([codec.payload_size(problem.dim, int(b), bucket)
                                          for b in bits])) * 8 / problem.dim
    else:   # stopped before the first step finished: the nominal width
        out["code_bits"] = float(comp.bits)
        out["wire_bits"] = codec.payload_size(problem.dim, comp.bits, bucket) * 8 / problem.dim
    out["bits_history"] = bits.astype(int).tolist() if config.kind.startswith("dqsgd") else None
    if config.kind in ("ecq", "ef") and comp is not None and not diverged:
        out["memory_norm"] = comp.memory_norm()
    return out


# ------------------------------------------------------------------------------- summaries
def fmt(values, digits: int = 3) -> str:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return "diverged"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}g}"
    return f"{statistics.fmean(vals):.{digits}g} ± {statistics.stdev(vals):.{digits}g}"


def runs_of(results: list[dict], dim: int, label: str) -> list[dict]:
    return sorted((r for r in results if r["dim"] == dim and r["label"] == label),
                  key=lambda r: r["seed"])


def ecq_table(results: list[dict], dim: int, configs: list[Config]) -> str:
    rows = []
    for c in configs:
        runs = runs_of(results, dim, c.label)
        if not runs:
            continue
        ratio = ""
        if c.pair:
            plain = {r["seed"]: r for r in runs_of(results, dim, c.pair)}
            ratios = [r["final"] / plain[r["seed"]]["final"] for r in runs
                      if r["seed"] in plain and not r["diverged"]
                      and not plain[r["seed"]]["diverged"]]
            ratio = (f"{statistics.fmean(ratios):.2f} (max {max(ratios):.2f})" if ratios
                     else "—")
        diverged = sum(1 for r in runs if r["diverged"])
        wire = [r["wire_bits"] for r in runs if not math.isnan(r["wire_bits"])]
        rows.append([c.label, fmt([r["final"] for r in runs]), fmt([r["last"] for r in runs]),
                     fmt([r["distance"] for r in runs]), ratio,
                     f"{statistics.fmean(wire):.2f}" if wire else "—",
                     f"{diverged}/{len(runs)}" if diverged else "0"])
    return report.markdown_table(
        ["method", "final excess loss (last 10%)", "last-iterate excess loss", "‖w_N − w*‖",
         "ECQ/QSGD (per seed)", "wire bits/coord", "diverged"], rows)


def tradeoff_rows(results: list[dict], dim: int, configs: list[Config]) -> list[dict]:
    rows = []
    for c in configs:
        runs = runs_of(results, dim, c.label)
        ok = [r for r in runs if not r["diverged"]]
        if not runs:
            continue
        finals = [r["final"] for r in ok]
        rows.append({
            "label": c.label, "kind": c.kind, "nominal": c.bits,
            "code_bits": statistics.fmean(r["code_bits"] for r in ok) if ok else math.nan,
            "wire_bits": statistics.fmean(r["wire_bits"] for r in ok) if ok else math.nan,
            "final": statistics.fmean(finals) if finals else math.nan,
            "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "finals": [r["final"] for r in runs], "lasts": [r["last"] for r in runs],
            "distance": [r["distance"] for r in runs],
            "widths": _widths(ok),
            "diverged": len(runs) - len(ok)})
    return rows


def _widths(runs: list[dict]) -> tuple[float, float] | None:
    """DQSGD: mean width over the first half of the steps and over the last 10% (all seeds)."""
    hists = [np.asarray(r["bits_history"], dtype=float) for r in runs if r["bits_history"]]
    if not hists:
        return None
    n = min(h.size for h in hists)
    return (float(np.mean([h[: n // 2].mean() for h in hists])),
            float(np.mean([h[-max(1, n // 10):].mean() for h in hists])))


def interpolate_fixed(rows: list[dict], bits: float, key: str = "final") -> float:
    """``key`` of fixed-width QSGD at ``bits`` by log-linear interpolation between widths."""
    fixed = sorted((r["code_bits"], r["final"] if key == "final" else
                    statistics.fmean(v for v in r[key + "s"] if not math.isnan(v)))
                   for r in rows if r["kind"] == "qsgd" and r["final"] > 0)
    if not fixed or not fixed[0][0] <= bits <= fixed[-1][0]:
        return math.nan
    xs = [x for x, _ in fixed]
    ys = [math.log(y) for _, y in fixed]
    return math.exp(float(np.interp(bits, xs, ys)))


def tradeoff_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        vs = vs_last = ""
        if r["kind"].startswith("dqsgd"):
            ref = interpolate_fixed(rows, r["code_bits"])
            ref_last = interpolate_fixed(rows, r["code_bits"], "last")
            vs = "—" if math.isnan(ref) else f"{r['final'] / ref:.2f}"
            vs_last = ("—" if math.isnan(ref_last) else
                       f"{statistics.fmean(r['lasts']) / ref_last:.2f}")
        widths = "" if not r["widths"] else f"{r['widths'][0]:.2f} / {r['widths'][1]:.2f}"
        out.append([r["label"], f"{r['code_bits']:.2f}", f"{r['wire_bits']:.2f}", widths,
                    fmt(r["finals"]), vs, fmt(r["lasts"]), vs_last, fmt(r["distance"]),
                    f"{r['diverged']}/{len(r['finals'])}" if r["diverged"] else "0"])
    return report.markdown_table(
        ["method", "code bits/coord", "wire bits/coord", "width: first half / last 10%",
         "final excess loss (last 10%)",
         "÷ fixed QSGD at same bits", "last-iterate excess loss", "÷ fixed (last iterate)",
         "‖w_N − w*‖", "diverged"], out)


# ------------------------------------------------------------------------------- plot
LINESTYLE = {"sgd": "-", "qsgd": "--", "ecq": "-", "ef": ":"}


def plot(results, dims, ecq_cfgs: dict[int, list[Config]], trade_dim, trade_cfgs, rows,
         path: Path) -> None:
    from horovod_aq.tools.plots import _pyplot

    plt = _pyplot()
    panels = len(dims) + 2
    fig, axes = plt.subplots(math.ceil(panels / 2), 2, figsize=(13, 4.6 * math.ceil(panels / 2)),
                             squeeze=False)
    axes = axes.ravel()
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    groups = list(dict.fromkeys(c.group for d in dims for c in ecq_cfgs[d] if c.group))
    color = {g: palette[(i + 1) % len(palette)] for i, g in enumerate(groups)}
    color[""] = "black"
    for ax, dim in zip(axes, dims):
        for c in ecq_cfgs[dim]:
            curves = [r["curve"] for r in runs_of(results, dim, c.label) if not r["diverged"]]
            if not curves:
                continue
            stack = np.vstack(curves)
            xs = np.arange(stack.shape[1])
            col = "grey" if c.kind == "ef" else color[c.group]
            ax.plot(xs, stack.mean(axis=0), color=col, ls=LINESTYLE[c.kind], lw=1.3,
                    label=f"{c.label}")
            ax.fill_between(xs, stack.min(axis=0), stack.max(axis=0), color=col, alpha=0.12,
                            lw=0)
        gone = [c.label for c in ecq_cfgs[dim]
                if all(r["diverged"] for r in runs_of(results, dim, c.label))
                and runs_of(results, dim, c.label)]
        ax.set_yscale("log")
        ax.set_xlabel("iteration")
        ax.set_ylabel("f(w) − f*   (mean over seeds; band: min–max)")
        ax.set_title(f"Syn-{dim}, P = 4: SGD, QSGD (dashed), ECQ-SGD (solid)"
                     + (f"\ndiverged, not drawn: {', '.join(gone)}" if gone else ""),
                     fontsize="medium")
        ax.legend(fontsize="x-small", ncol=2)
    ax = axes[len(dims)]
    markers = {"qsgd": ("o", "-", "QSGD, fixed width"),
               "dqsgd": ("s", "none", "DQSGD target mean (non-convex rule)"),
               "dqsgd-sc": ("^", "none", "DQSGD budget, α_T (strongly convex rule)")}
    for kind, (marker, ls, name) in markers.items():
        pts = sorted((r for r in rows if r["kind"] == kind and not math.isnan(r["final"])),
                     key=lambda r: r["code_bits"])
        if not pts:
            continue
        ax.errorbar([r["code_bits"] for r in pts], [r["final"] for r in pts],
                    yerr=[r["final_std"] for r in pts], marker=marker, ls=ls, capsize=3,
                    label=name)
        for r in pts:
            ax.annotate(f"{r['nominal']:g}", (r["code_bits"], r["final"]),
                        textcoords="offset points", xytext=(4, 4), fontsize="x-small")
    sgd = [r["final"] for r in runs_of(results, trade_dim, "SGD fp32") if not r["diverged"]]
    if sgd:
        ax.axhline(statistics.fmean(sgd), color="black", ls=":", lw=1,
                   label="SGD fp32 (32 bits)")
    ax.set_yscale("log")
    ax.set_xlabel("code bits per coordinate, mean over steps (wire: + norms + header)")
    ax.set_ylabel("final f(w) − f*  (last 10% of steps; mean ± std)")
    ax.set_title(f"Syn-{trade_dim}: bits vs final loss (labels: nominal / target bits)",
                 fontsize="medium")
    ax.legend(fontsize="x-small")
    ax = axes[len(dims) + 1]
    seed = min(r["seed"] for r in results)
    for c in trade_cfgs:
        runs = [r for r in runs_of(results, trade_dim, c.label)
                if r["bits_history"] and r["seed"] == seed]
        if not runs:
            continue
        hist = np.array(runs[0]["bits_history"], dtype=float)
        k = 10
        smooth = np.convolve(hist, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(smooth.size) + k - 1, smooth, lw=1.2,
                ls="-" if c.kind == "dqsgd" else "--", label=c.label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("DQSGD width B_n (bits; 10-step running mean)")
    ax.set_title(f"Syn-{trade_dim}: DQSGD widths per step (seed {seed})", fontsize="medium")
    ax.legend(fontsize="x-small")
    for ax in axes[panels:]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="CI: Syn-256 only, seeds 0,1,2, 300 steps; SGD, QSGD and ECQ-SGD at 2 "
                        "bits; trade-off QSGD 2/3/4 bits vs DQSGD target 3 and budget 3·N")
    p.add_argument("--dims", default="256,1024", help="Syn-d dimensions of the ECQ comparison")
    p.add_argument("--steps", default="500,1000",
                   help="steps per dimension (one value, or one per --dims entry)")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--seeds-per-dim", default="5,3",
                   help="how many of --seeds each dimension uses (one value or one per dim)")
    p.add_argument("--tradeoff-dim", type=int, default=256,
                   help="dimension of the DQSGD trade-off (its steps and seeds as above)")
    p.add_argument("--rows", type=int, default=10_000, help="samples n of Syn-d")
    p.add_argument("--noise", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--batch", type=int, default=32, help="rows per worker per step")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--bucket-size", type=int, default=64)
    p.add_argument("--ecq-bits", default="1,2,4")
    p.add_argument("--alpha", type=float, default=0.2, help="ECQ compensation coefficient")
    p.add_argument("--beta", type=float, default=0.9, help="ECQ time-decay factor")
    p.add_argument("--no-classic-ef", action="store_true",
                   help="skip the α = β = 1 (classic error feedback) 2-bit row")
    p.add_argument("--paper-s", type=int, default=4,
                   help="also run the paper's quantizer: U-paper grid with s levels (2s+1 "
                        "points), one L2 norm per vector; 0 skips it")
    p.add_argument("--fixed-bits", default="2,3,4,6,8", help="QSGD widths of the trade-off")
    p.add_argument("--targets", default="2.5,3,4,5", help="DQSGD target mean widths")
    p.add_argument("--budgets", default="2.5,3,4",
                   help="DQSGD budgets in the strongly convex mode, as mean bits per step "
                        "(budget = value × steps)")
    args = p.parse_args(argv)
    if args.quick:
        args.dims, args.steps, args.seeds, args.seeds_per_dim = "256", "300", "0,1,2", "3"
        args.ecq_bits, args.fixed_bits, args.targets, args.budgets = "2", "2,3,4", "3", "3"
        args.no_classic_ef, args.paper_s, args.tradeoff_dim = True, 0, 256
    args.dims = [int(d) for d in args.dims.split(",")]
    args.seeds = [int(s) for s in args.seeds.split(",")]
    steps = [int(n) for n in args.steps.split(",")]
    per_dim = [int(n) for n in args.seeds_per_dim.split(",")]
    for name, values in (("--steps", steps), ("--seeds-per-dim", per_dim)):
        if len(values) not in (1, len(args.dims)):
            p.error(f"{name} needs one value or one per dimension ({len(args.dims)})")
    args.steps = {d: steps[i if len(steps) > 1 else 0] for i, d in enumerate(args.dims)}
    args.dim_seeds = {d: args.seeds[:per_dim[i if len(per_dim) > 1 else 0]]
                      for i, d in enumerate(args.dims)}
    if args.tradeoff_dim not in args.dims:
        args.steps[args.tradeoff_dim] = steps[0]
        args.dim_seeds[args.tradeoff_dim] = args.seeds[:per_dim[0]]
    args.ecq_bits = [int(b) for b in args.ecq_bits.split(",") if b]
    args.fixed_bits = [int(b) for b in args.fixed_bits.split(",")]
    args.targets = [float(t) for t in args.targets.split(",") if t]
    args.budgets = [float(t) for t in args.budgets.split(",") if t]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_all, cpu_all = time.monotonic(), time.process_time()
    common = {"lr": args.lr, "batch": args.batch, "workers": args.workers}
    ecq_cfgs = {d: ecq_configs(d, args.ecq_bits, args.bucket_size, args.alpha, args.beta,
                               not args.no_classic_ef, args.paper_s) for d in args.dims}
    problems: dict[tuple[int, int], Problem] = {}
    results: list[dict] = []
    done: set[tuple[int, int, str]] = set()

    def problem(dim: int, seed: int) -> Problem:
        if (dim, seed) not in problems:
            problems[dim, seed] = make_problem(dim, seed, args.rows, args.noise)
        return problems[dim, seed]

    def run(pr: Problem, config: Config) -> None:
        key = (pr.dim, pr.seed, config.label)
        if key in done:      # rows shared by both parts (SGD, QSGD 2b, 4b) run once
            return
        done.add(key)
        r = run_config(pr, config, steps=args.steps[pr.dim], **common)
        results.append(r)
        print(f"Syn-{pr.dim} seed {pr.seed} {config.label:32s} final {r['final']:.4g} "
              f"bits {r['code_bits']:.2f} ({r['seconds']:.1f} s)"
              f"{' DIVERGED: ' + r['diverged'] if r['diverged'] else ''}",
              file=sys.stderr, flush=True)

    t0 = time.monotonic()
    for dim in args.dims:
        for seed in args.dim_seeds[dim]:
            for c in ecq_cfgs[dim]:
                run(problem(dim, seed), c)
    t_ecq = time.monotonic() - t0

    # the DQSGD trade-off on one dimension; α_T from the curvature of that dimension's problems
    t0 = time.monotonic()
    td, t_steps, t_seeds = args.tradeoff_dim, args.steps[args.tradeoff_dim], args.dim_seeds[
        args.tradeoff_dim]
    mu = statistics.fmean(problem(td, s).mu for s in t_seeds)
    L = statistics.fmean(problem(td, s).L for s in t_seeds)
    alpha_t = 1 - 2 * mu * args.lr + L * mu * args.lr ** 2
    sgd_cfg = Config("SGD fp32", None, "sgd")
    trade_cfgs = [sgd_cfg] + tradeoff_configs(args.fixed_bits, args.targets, args.budgets,
                                              args.bucket_size, t_steps, alpha_t)
    for seed in t_seeds:
        for c in trade_cfgs:
            run(problem(td, seed), c)
    t_trade = time.monotonic() - t0
    wall, cpu = time.monotonic() - t_all, time.process_time() - cpu_all

    # ---- report
    rows = tradeoff_rows(results, td, trade_cfgs)
    fig = report.figure_path("linear_models", quick=args.quick)
    plot(results, args.dims, ecq_cfgs, td, trade_cfgs, rows, fig)

    body = ["## 1. ECQ-SGD vs QSGD vs SGD (the ECQ-SGD paper's Syn-d comparison)\n"]
    for dim in args.dims:
        pr = [problems[dim, s] for s in args.dim_seeds[dim]]
        steps = args.steps[dim]
        body.append(
            f"### Syn-{dim} ({steps} steps, seeds {', '.join(map(str, args.dim_seeds[dim]))})\n\n"
            f"f* = {fmt([p.f_star for p in pr], 4)}; curvature of AᵀA/n: μ = "
            f"{fmt([p.mu for p in pr])}, L = {fmt([p.L for p in pr])}; "
            f"f(w_0) − f* = {fmt([p.data.loss(np.zeros(dim)) - p.f_star for p in pr])}; "
            f"final = mean over the last {max(1, steps // 10)} steps.\n\n"
            + ecq_table(results, dim, ecq_cfgs[dim]) + "\n")
    body.append(
        "Excess loss f(w) − f*, mean ± sample std over seeds. ECQ/QSGD: per-seed ratio of the "
        "ECQ row's final excess loss to the plain QSGD row with the same quantizer (same data, "
        "minibatches and uniforms), mean over seeds and the worst seed. wire bits/coord: one "
        "worker's payload per step (codes + fp32 bucket norms + 32-byte header) per coordinate. "
        + (f"QSGD s={args.paper_s}, 1 norm/vector: the paper's quantizer (U-paper grid "
           f"{{0, ±1/{args.paper_s}, …, ±1}}, {2 * args.paper_s + 1} points, "
           f"{int(2 * args.paper_s).bit_length()} bits, one L2 norm for the whole vector)."
           if args.paper_s else "") + "\n")
    body.append(
        f"## 2. DQSGD: bits vs final loss (Syn-{td}, {t_steps} steps, seeds "
        f"{', '.join(map(str, t_seeds))})\n\n"
        f"Strongly convex mode: α_T = 1 − 2μη + Lμη² = {alpha_t:.5f} (μ = {mu:.3f}, L = {L:.3f}, "
        f"η = {args.lr}; mean over the seeds' problems), horizon N = {t_steps}, budget = value × "
        "N bits per coordinate in total.\n\n" + tradeoff_table(rows) + "\n\n"
        "÷ fixed QSGD at same bits: the DQSGD row's excess loss divided by fixed-width QSGD's "
        "at the same code bits/coordinate (log-linear interpolation between the measured "
        "widths); below 1 means DQSGD reaches a lower loss with the same bits. The code → wire "
        f"overhead (bucket norms + header) is the same {32 / args.bucket_size + 256 / td:.2f} "
        "bits/coordinate for every quantized row.\n")
    body.append(findings(results, args, rows))
    body.append(f"\n![loss curves and bits-vs-loss trade-off]({fig.name})\n")
    failures: dict[tuple[int, str], list[dict]] = {}
    for r in results:
        if r["diverged"]:
            failures.setdefault((r["dim"], r["label"]), []).append(r)
    if failures:
        body.append("\nDiverged runs (a run stops once f(w_t) > "
                    f"{DIVERGENCE_FACTOR:g}·f(w_0) or the codec refuses a gradient):\n\n"
                    + "\n".join(f"- Syn-{d} {label}, seeds "
                                 f"{', '.join(str(r['seed']) for r in rs)}: {rs[0]['diverged']}"
                                 + (" (first seed)" if len(rs) > 1 else "")
                                 for (d, label), rs in failures.items()) + "\n")
    notes = [
        f"Problem: Syn-d least squares (horovod_aq.tools.simulate.LeastSquares.synthetic), n = "
        f"{args.rows}, A ~ N(0,1), w* ~ N(0,I), noise {args.noise}; ECQ comparison at d = "
        f"{', '.join(map(str, args.dims))}, DQSGD trade-off at d = {td}",
        f"Training: horovod_aq.tools.simulate.run_sgd (real numpy codec and compressor objects), "
        f"{args.workers} workers, batch {args.batch}/worker (with replacement), lr {args.lr}, "
        f"no momentum, w_0 = 0, steps "
        + ", ".join(f"{args.steps[d]} (d = {d})" for d in args.dims),
        f"Quantizers: QSGD U-ref (2^b zero-free uniform levels), L2 norm, bucket "
        f"{args.bucket_size}, widths {', '.join(map(str, args.ecq_bits))}; ECQ-SGD α = "
        f"{args.alpha}, β = {args.beta}"
        + ("" if args.no_classic_ef else "; classic EF α = β = 1 at 2 bits")
        + (f"; paper grid s = {args.paper_s}, one norm per vector" if args.paper_s else "")
        + f"; DQSGD widths 2–8 (U-ref at each, bucket {args.bucket_size}), window 50, targets "
        f"{', '.join(f'{t:g}' for t in args.targets)}; strongly convex budgets "
        f"{', '.join(f'{t:g}' for t in args.budgets)}·N; fixed QSGD "
        f"{', '.join(map(str, args.fixed_bits))} bits",
        "Seeds: " + "; ".join(f"d = {d}: {', '.join(map(str, args.dim_seeds[d]))}"
                              for d in args.dims)
        + " (seed = data, minibatches and uniforms; paired across methods)",
        f"Wall time {wall:.0f} s (ECQ comparison {t_ecq:.0f} s, DQSGD trade-off "
        f"{t_trade:.0f} s; CPU time {cpu:.0f} s), one process (numpy, no launcher)",
    ]
    path = report.write("linear_models", "Linear models: ECQ-SGD, QSGD and DQSGD on synthetic "
                        "least squares", "\n".join(body), quick=args.quick, notes=notes)
    dump = {"args": {k: v for k, v in vars(args).items()}, "alpha_T": alpha_t,
            "tradeoff": rows,
            "problems": [{"dim": p.dim, "seed": p.seed, "f_star": p.f_star, "mu": p.mu,
                          "L": p.L} for p in problems.values()],
            "runs": [{k: v for k, v in r.items() if k not in ("curve", "bits_history")}
                     for r in results]}
    path.with_suffix(".json").write_text(json.dumps(_plain(dump), indent=1))
    print(path.read_text())
    return 0


def _plain(value):
    """JSON-ready copy: numpy scalars as Python numbers, NaN as null."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.floating, np.integer)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def findings(results: list[dict], args, rows: list[dict]) -> str:
    """Sentences computed from the numbers (nothing the numbers do not carry)."""
    lines = ["### Summary (computed from the tables)\n"]
    for dim in args.dims:
        sgd = [r["final"] for r in runs_of(results, dim, "SGD fp32") if not r["diverged"]]
        pairs_by = {}
        for r in results:
            if r["dim"] == dim and r["kind"] == "ecq":
                pairs_by.setdefault(r["label"], []).append(r)
        for label, ecq_runs in pairs_by.items():
            plain_label = label.replace("ECQ-SGD", "QSGD")
            q = {r["seed"]: r for r in runs_of(results, dim, plain_label)}
            pairs = [(q[e["seed"]]["final"], e["final"]) for e in ecq_runs
                     if e["seed"] in q and not (q[e["seed"]]["diverged"] or e["diverged"])]
            if not pairs:
                lines.append(f"- Syn-{dim}, {label}: diverged "
                             f"({sum(1 for e in ecq_runs if e['diverged'])}/{len(ecq_runs)} "
                             f"runs), and {plain_label} "
                             f"{sum(1 for r in q.values() if r['diverged'])}/{len(q)}.")
                continue
            wins = sum(1 for qq, ee in pairs if ee < qq)
            lines.append(
                f"- Syn-{dim}, {label}: final excess loss "
                f"{statistics.fmean(e for _, e in pairs):.3g} vs {plain_label} "
                f"{statistics.fmean(q for q, _ in pairs):.3g} (SGD fp32 "
                f"{statistics.fmean(sgd):.3g}); ECQ lower on {wins}/{len(pairs)} seeds.")
    ef = [r for r in results if r["kind"] == "ef"]
    if ef:
        bad = sum(1 for r in ef if r["diverged"])
        lines.append(f"- Classic EF (α = β = 1) at 2 bits: {bad}/{len(ef)} runs diverged.")
    for r in rows:
        if not r["kind"].startswith("dqsgd") or math.isnan(r["final"]):
            continue
        ref = interpolate_fixed(rows, r["code_bits"])
        if math.isnan(ref):
            continue
        lines.append(f"- {r['label']}: {r['code_bits']:.2f} code bits/coordinate, final "
                     f"excess loss {r['final']:.3g} vs {ref:.3g} for fixed-width QSGD at the "
                     f"same bits (×{r['final'] / ref:.2f}).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
