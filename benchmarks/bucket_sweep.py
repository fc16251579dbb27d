"""Variance of the adaptive tables against the bucket size: where a smaller bucket stops paying.

    python benchmarks/bucket_sweep.py            # the demo's CNN and the Fashion-MNIST SmallCNN

**Gradients.** fp32 data-parallel SGD in one process (momentum 0.9), each simulated rank its own
shard and sample order: the demo's CNN (``examples/torch_net.py`` on ``load_mnist_5k(seed=0)``,
2 ranks, batch 32, lr 0.1, as ``examples/pytorch_mnist.py``) and the ``SmallCNN`` of
``benchmarks/models.py`` (Fashion-MNIST, 4 ranks, batch 32, lr 0.05). Every rank's gradient is
flattened in backward order (one fused bucket, as the packed optimizer does for these models) at
the steps of ``--steps``.

**Measurement.** For each width b and bucket size B, ALQ with L∞ buckets (the default norm,
docs/quantizers.md §5.6) is refitted on one sampled step's gradients (every rank's statistics,
``record_gradient`` and ``end_step`` over a ``LocalComm``) and measured on the next sampled
step's: the exact expected normalized variance V = E‖Q(g) − g‖²/‖g‖² (``codec.rounding_variance``),
mean over the ranks and the step pairs. The bucket's fp32 norm costs 32/B bits per coordinate,
so halving B from 2B buys log₂(V(2B)/V(B)) / (32/B − 32/(2B)) halvings of the variance per extra
bit; one more code bit buys log₂(V_b/V_{b+1}) at the same B. Results: ``results/bucket_sweep.md``
(docs/quantizers.md §5.7 cites it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from benchmarks import report

BUCKETS = (64, 128, 256, 512, 1024)
WIDTHS = (2, 3, 4)


def gradients(model_name: str, steps: list[int]) -> dict[int, np.ndarray]:
    """{step: [ranks, numel] float32} of fp32 training of ``model_name`` ("demo" or "fmnist")."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if model_name == "demo":
        from torch_net import Net

        from horovod_aq.tools.datasets import load_mnist_5k

        train, _ = load_mnist_5k(seed=0)
        ranks, lr, model = 2, 0.1, Net()
        shards = [train.shard(r, ranks) for r in range(ranks)]
        xs = [torch.from_numpy(s.images[:, None]) for s in shards]
    else:
        from benchmarks import fashion_mnist
        from benchmarks.models import SmallCNN

        train, _ = fashion_mnist.load()
        ranks, lr, model = 4, 0.05, SmallCNN()
        shards = [train.shard(r, ranks) for r in range(ranks)]
        xs = [torch.from_numpy(s.images) for s in shards]
    ys = [torch.from_numpy(s.labels) for s in shards]
    params = [p for p in model.parameters()][::-1]
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    gens = [torch.Generator().manual_seed(r) for r in range(ranks)]
    batch, out, order = 32, {}, None
    per_epoch = len(ys[0]) // batch
    for step in range(max(steps) + 1):
        if step % per_epoch == 0:
            order = [torch.randperm(len(y), generator=g) for y, g in zip(ys, gens)]
        i = step % per_epoch
        grads = []
        for r in range(ranks):
            idx = order[r][i * batch:(i + 1) * batch]
            model.zero_grad()
            F.cross_entropy(model(xs[r][idx]), ys[r][idx]).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]).clone())
        g = torch.stack(grads)
        if step in steps:
            out[step] = g.numpy().copy()
        mean = g.mean(0)
        offset = 0
        for p in params:
            p.grad = mean[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()
    return out


def variance_table(grads: dict[int, np.ndarray]) -> dict[tuple[int, int], float]:
    """{(bits, B): V} with tables refitted on each sampled step and measured on the next."""
    import horovod_aq
    from horovod_aq import codec
    from horovod_aq.refit import LocalComm

    steps = sorted(grads)
    out = {}
    for bits in WIDTHS:
        for b in BUCKETS:
            values = []
            for fit_step, next_step in zip(steps[:-1], steps[1:]):
                comp = horovod_aq.ALQ(bits=bits, bucket_size=b, norm="linf")
                for x in grads[fit_step]:
                    comp.record_gradient(x)
                comp.end_step(LocalComm())
                for x in grads[next_step]:
                    err = codec.rounding_variance(x, comp.table, bucket_size=b, norm="linf")
                    values.append(float(err.sum() / np.sum(x.astype(np.float64) ** 2)))
            out[bits, b] = float(np.mean(values))
    return out


def render(name: str, v: dict[tuple[int, int], float]) -> str:
    rows = [[f"{bits}"] + [f"{v[bits, b]:.4g}" for b in BUCKETS] for bits in WIDTHS]
    table = report.markdown_table(["bits"] + [f"B = {b}" for b in BUCKETS], rows)
    pairs = list(zip(BUCKETS[1:][::-1], BUCKETS[:-1][::-1]))          # (2B, B), largest first
    slope_rows = []
    for bits in WIDTHS:
        row = [f"{bits}"] + [
            f"{np.log2(v[bits, big] / v[bits, small]) / (32 / small - 32 / big):.2f}"
            for big, small in pairs]
        row.append(f"{np.log2(v[bits, 256] / v[bits + 1, 256]):.2f}" if bits + 1 in WIDTHS
                   else "—")
        slope_rows.append(row)
    slopes = report.markdown_table(
        ["bits"] + [f"{big} → {small}" for big, small in pairs] + ["one more code bit, B = 256"],
        slope_rows)
    return (f"## {name}\n\nNormalized variance V (ALQ, L∞ buckets):\n\n{table}\n\n"
            f"Variance halvings per extra bit per coordinate:\n\n{slopes}\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default="50,100,150,200,250,300",
                   help="sampled steps (tables fitted on each, measured on the next)")
    args = p.parse_args(argv)
    steps = [int(s) for s in args.steps.split(",")]
    t0 = time.monotonic()
    body = ""
    for key, title in (("demo", "The demo's CNN (MNIST subset, 2 ranks)"),
                       ("fmnist", "Fashion-MNIST SmallCNN (4 ranks)")):
        body += render(title, variance_table(gradients(key, steps))) + "\n"
    notes = [f"Sampled steps {args.steps} of fp32 training; tables fitted on each sampled step, "
             "measured on the next (exact expected variance, mean over ranks and step pairs)",
             f"Wall time {(time.monotonic() - t0) / 60:.1f} min"]
    path = report.write("bucket_sweep", "Adaptive-table variance against the bucket size", body,
                        notes=notes)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
