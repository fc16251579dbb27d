"""Which symbol model the entropy-coded wire uses: per-payload frequencies or an agreed model.

Trains the examples' CNN (``examples/torch_net.py``) with plain SGD on MNIST 5k
(``horovod_aq.tools.datasets``), one process, and at every step quantizes the flattened
gradient with each compressor (its refits follow its schedule: steps 0 and 100 of the default
one). For every step it measures, in bits per coordinate:

* H: the empirical entropy of the step's codes (what any model can at best reach);
* per-payload: the bits of the actual entropy-coded payload (``codec.encode_entropy``: code
  table + rANS), and, within it, what the code table costs (2 bytes per level);
* agreed, histogram: the cross-entropy of the step's codes under the code histogram of the last
  refit step (a model every rank could agree on at the refit; stale between refits);
* agreed, model: the cross-entropy under the symbol probabilities of the table and the fitted
  distribution of the last refit (``levels.symbol_probabilities`` of the refit's statistics).

A stale agreed model costs its KL divergence D = cross-entropy − H per coordinate; the
per-payload table costs 16·N/n bits per coordinate. Output: a Markdown table (mean and worst
over the steps since the last refit) to ``--output`` (default
benchmarks/results/entropy_model.md).

    python benchmarks/entropy_model.py              # 300 steps
    python benchmarks/entropy_model.py --steps 40   # quick look
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import horovod_aq  # noqa: E402
from benchmarks.report import machine  # noqa: E402
from examples.torch_net import Net  # noqa: E402
from horovod_aq import codec  # noqa: E402
from horovod_aq.codec.entropy_format import empirical_entropy  # noqa: E402
from horovod_aq.levels import symbol_probabilities  # noqa: E402
from horovod_aq.refit import LocalComm  # noqa: E402
from horovod_aq.tools.datasets import load_mnist_5k  # noqa: E402

#: The issue's four rows: (label, constructor).
COMPRESSORS = {
    "ALQ 3-bit, B=1024, L2": lambda: horovod_aq.ALQ(bits=3, bucket_size=1024),
    "ALQ 2-bit, L∞": lambda: horovod_aq.ALQ(bits=2, norm="linf"),
    "ALQ 4-bit": lambda: horovod_aq.ALQ(bits=4),
    "QSGD 3-bit, B=512": lambda: horovod_aq.QSGD(bits=3, bucket_size=512),
}


def cross_entropy(codes: np.ndarray, probs: np.ndarray, floor: float = 2.0**-15) -> float:
    """Bits per code of ``codes`` under ``probs`` (each probability at least ``floor``, the
    smallest a coder could give a symbol it must still be able to send)."""
    p = np.maximum(np.asarray(probs, np.float64), floor)
    p = p / p.sum()
    counts = np.bincount(codes, minlength=p.size)[:p.size].astype(np.float64)
    return float(-(counts * np.log2(p)).sum() / counts.sum())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--output", default=str(ROOT / "benchmarks/results/entropy_model.md"))
    args = ap.parse_args(argv)
    begin = time.time()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    train, _ = load_mnist_5k()
    images = torch.tensor(train.images).reshape(-1, 1, 28, 28)
    labels = torch.tensor(train.labels).long()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    comps = {name: make() for name, make in COMPRESSORS.items()}
    ref = {name: None for name in comps}        # (code histogram, model probs) of the last refit
    rows = {name: [] for name in comps}
    rng = np.random.default_rng(0)
    for step in range(args.steps):
        idx = rng.choice(len(labels), args.batch, replace=False)
        opt.zero_grad()
        F.cross_entropy(model(images[idx]), labels[idx]).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy()
        for name, comp in comps.items():
            table = comp.table
            key = codec.StreamKey(seed=0, rank=0, step=step)
            u = codec.stream_uniforms(grad.size, key)
            codes, _ = codec.quantize_codes(grad, table, bucket_size=comp.bucket_size,
                                            norm=comp.norm, uniforms=u)
            payload = codec.encode_entropy(grad, table, bucket_size=comp.bucket_size,
                                           norm=comp.norm, key=key)
            n = grad.size
            refitting = comp.recording
            if refitting or ref[name] is None:
                stats = horovod_aq.levels.BucketStats.from_gradient(grad, comp.bucket_size)
            comp.record_gradient(grad)
            refitted = comp.end_step(LocalComm())
            if refitting or ref[name] is None:
                # the agreed model of the table now in force: the refit step's statistics under it
                new_table = comp.table
                new_codes, _ = codec.quantize_codes(grad, new_table, bucket_size=comp.bucket_size,
                                                    norm=comp.norm, uniforms=u)
                hist = np.bincount(new_codes, minlength=new_table.num_levels).astype(np.float64)
                model_probs = symbol_probabilities(new_table.levels, stats.mixture())
                ref[name] = (hist / hist.sum(), model_probs, step)
            hist_p, model_p, since = ref[name]
            rows[name].append({
                "step": step, "refit": since,
                "H": empirical_entropy(codes, table.num_levels),
                "payload": 8.0 * payload.size / n,
                "table": 16.0 * table.num_levels / n,
                "norms": 32.0 * codec.num_buckets(n, comp.bucket_size) / n,
                "fixed": 8.0 * codec.payload_size(n, table.bits, comp.bucket_size) / n,
                "agreed_hist": cross_entropy(codes, hist_p),
                "agreed_model": cross_entropy(codes, model_p),
                "refitted": refitted,
            })
    wall = time.time() - begin
    lines = [
        "# Symbol model of the entropy-coded wire: per-payload table or agreed model",
        "",
        f"- Command: `python benchmarks/entropy_model.py --steps {args.steps}`",
        f"- Date: {dt.datetime.now().isoformat(timespec='seconds')}, wall time {wall:.0f} s",
        f"- Machine: {machine()}",
        f"- Workload: examples/torch_net.py's CNN ({grad.size} parameters, one payload per "
        f"step), SGD lr {args.lr}, batch {args.batch}, MNIST 5k; each compressor's default "
        "refit schedule (refits at steps 0 and 100 within this run)",
        "- Bits per coordinate. H = empirical entropy of the step's codes; payload = the "
        "entropy-coded payload (`codec.encode_entropy`, everything: header, norms, code table, "
        "coder states, words); norms = 32·⌈n/B⌉/n; table = its code table (16·N/n); "
        "D_hist / D_model = KL cost of an agreed model (cross-entropy − H) built at the last "
        "refit from the refit step's code histogram / from the table and fitted distribution "
        "(`levels.symbol_probabilities`), averaged (and worst) over steps since that refit.",
        "",
        "| compressor | steps | fixed | H | payload | payload − H − norms | of which table "
        "| D_hist mean (max) | D_model mean (max) | payload / (H + norms) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rs in rows.items():
        for lo, hi in ((1, 100), (101, args.steps)):
            sel = [r for r in rs if lo <= r["step"] < hi]
            if not sel:
                continue

            def mean(k, sel=sel):
                return float(np.mean([r[k] for r in sel]))

            d_hist = [r["agreed_hist"] - r["H"] for r in sel]
            d_model = [r["agreed_model"] - r["H"] for r in sel]
            lines.append(
                f"| {name} | {lo}–{hi - 1} | {mean('fixed'):.3f} | {mean('H'):.3f} | "
                f"{mean('payload'):.3f} | {mean('payload') - mean('H') - mean('norms'):.3f} | "
                f"{mean('table'):.4f} | {np.mean(d_hist):.3f} ({np.max(d_hist):.3f}) | "
                f"{np.mean(d_model):.3f} ({np.max(d_model):.3f}) | "
                f"{np.mean([r['payload'] / (r['H'] + r['norms']) for r in sel]):.3f} |")
    Path(args.output).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
