"""What error feedback costs a rank's send, per step, on the CPU: unfused steps vs the fused pass.

The torch wire's ``Wire.submit`` of one bucket (``packed.send.send_bucket``: compensate, check,
encode, memory update; the collective is a stub that returns at once) is timed three ways, one
thread, best and median of ``--repeats``:

* **plain**: the quantizer alone (no error feedback): the fused CPU encoder;
* **EF unfused**: ``ErrorFeedback(quantizer)`` through the separate steps the wire ran before
  the fusion: x = g + α·h, the peak check of x, encode, decode of the own payload(s),
  h ← β·h + (g − g̃), the finiteness check of h (``torch.compensated.fusable`` forced off);
* **EF fused**: the same through the one-pass kernel (docs/dynamic.md §2.6).

EF overhead = EF time − plain time. Both paths send the same bytes and leave the same memory
(checked here on every configuration before timing).

Then (unless ``--no-steps``) the same three setups train the cluster benchmark's MLP
(784→4096→1536→10, 9,523,722 parameters; ``benchmarks.models.CLUSTER_MLP``) on 2 local ranks
(Gloo over loopback, one thread each, batch 32, SGD with momentum, allgather, fixed wire),
rounds of steps interleaved; a step's time is the larger of the two ranks'. The send overheads
are also given as a share of the plain step.

    python benchmarks/ef_overhead.py                 # 9.4M coordinates, 3 bits, B = 256, l2
    python benchmarks/ef_overhead.py --quick         # small, for a smoke run

Results: benchmarks/results/ef_overhead.md (quick runs: benchmarks/results/quick/).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np
import torch

import horovod_aq
from benchmarks import report
from horovod_aq.packed.plan import BucketPlan
from horovod_aq.torch import compensated
from horovod_aq.torch.wire import Bucket, Wire

VARIANTS = ("plain", "EF unfused", "EF fused")


class _Done:
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class StubCollectives:
    """Collectives that send nothing: only the rank's own send work is timed."""

    zero_fills_joined = False

    def __init__(self, size: int) -> None:
        self.rank, self.size = 0, size

    def allgather(self, payload, name, then, *, delimit=None):
        return _Done()

    def alltoall(self, payloads, name, *, variable=False):
        return _Done()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=9_400_000)
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--bucket-size", type=int, default=256)
    p.add_argument("--norm", default="l2", choices=("l2", "linf"))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-steps", action="store_true", help="skip the 2-rank training steps")
    p.add_argument("--rounds", type=int, default=5, help="rounds of 2-rank steps (first untimed)")
    p.add_argument("--steps", type=int, default=3, help="steps of each setup per round")
    p.add_argument("--quick", action="store_true", help="200K coordinates, 3 repeats, small MLP")
    args = p.parse_args(argv)
    args.sizes = (784, 4096, 1536, 10)
    if args.quick:
        args.numel, args.repeats, args.rounds, args.steps = 200_000, 3, 2, 2
        args.sizes = (784, 256, 10)
    return args


def train_steps(cfg: dict) -> dict:
    """One rank: the MLP trained with each setup (``VARIANTS``), rounds interleaved; the
    seconds of every step and the wire's encode seconds, per setup."""
    import horovod.torch as hvd
    import torch.nn.functional as F

    import horovod_aq.torch as aqt
    from benchmarks.models import mlp

    torch.set_num_threads(1)
    hvd.init()
    fusable = compensated.fusable
    gen = torch.Generator().manual_seed(hvd.rank())
    batches = [(torch.randn(32, cfg["sizes"][0], generator=gen),
                torch.randint(0, cfg["sizes"][-1], (32,), generator=gen)) for _ in range(4)]

    def build(k: int, variant: str):
        torch.manual_seed(0)
        model = mlp(cfg["sizes"])
        q = horovod_aq.QSGD(bits=cfg["bits"], bucket_size=cfg["bucket_size"], norm=cfg["norm"],
                            seed=1, name=f"ef{k}")
        comp = q if variant == "plain" else horovod_aq.ErrorFeedback(q)
        opt = aqt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            named_parameters=model.named_parameters(), compression=comp, exchange="allgather",
            wire="fixed", error_feedback=variant != "plain")
        return model, opt

    built = {v: build(k, v) for k, v in enumerate(VARIANTS)}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    encode: dict[str, list[float]] = {v: [] for v in VARIANTS}
    step = 0
    for rnd in range(cfg["rounds"]):
        for variant in VARIANTS:
            model, opt = built[variant]
            compensated.fusable = (lambda wire, raw: False) if variant == "EF unfused" \
                else fusable
            hvd.barrier()
            for _ in range(cfg["steps"]):
                x, y = batches[step % len(batches)]
                step += 1
                started = time.perf_counter()
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                if rnd:   # the first round warms up (plans, compiles, pages)
                    times[variant].append(time.perf_counter() - started)
                    encode[variant].append(opt.telemetry.last.extra.get("encode_s", 0.0))
    compensated.fusable = fusable
    hvd.shutdown()
    return {"times": times, "encode": encode}


def measure_steps(args) -> dict[str, tuple[float, float]]:
    """(median step seconds, median encode seconds per step) of each setup on 2 ranks."""
    from horovod_aq.tools.launcher import run_local

    cfg = {"sizes": args.sizes, "bits": args.bits, "bucket_size": args.bucket_size,
           "norm": args.norm, "rounds": args.rounds, "steps": args.steps}
    ranks = run_local([(train_steps, {"cfg": cfg})], np=2, timeout=1200).get("train_steps")
    out = {}
    for variant in VARIANTS:
        steps = np.max([r["times"][variant] for r in ranks], axis=0)
        encode = np.max([r["encode"][variant] for r in ranks], axis=0)
        out[variant] = (float(np.median(steps)), float(np.median(encode)))
    return out


def _wire(comp, mode: str, ranks: int, coding: str, numel: int):
    wire = Wire(comp, StubCollectives(ranks), stream_rank=0)
    bucket = Bucket(BucketPlan(0, "bench", (0,), numel, mode), ["w"], [numel], coding=coding)
    return wire, bucket


def _send(wire: Wire, bucket: Bucket, g: torch.Tensor) -> list[torch.Tensor]:
    sent = []
    wire.tap = lambda b, part, values, payload: sent.append(payload)
    bucket.reset()
    wire.submit(bucket, g)
    return sent


def measure(args, mode: str, ranks: int, coding: str) -> dict[str, list[float]]:
    """Seconds of each variant's send of one bucket (after one untimed warm-up send, and one
    send that checks that fused and unfused agree)."""
    rng = np.random.default_rng(0)
    g = torch.from_numpy((rng.standard_normal(args.numel) * 1e-3).astype(np.float32))
    h0 = torch.from_numpy((rng.standard_normal(args.numel) * 1e-4).astype(np.float32))

    def quantizer():
        return horovod_aq.QSGD(bits=args.bits, bucket_size=args.bucket_size, norm=args.norm,
                               seed=1)

    setups = {"plain": quantizer(), "EF unfused": horovod_aq.ErrorFeedback(quantizer()),
              "EF fused": horovod_aq.ErrorFeedback(quantizer())}
    wires = {k: _wire(c, mode, ranks, coding, args.numel) for k, c in setups.items()}
    fusable = compensated.fusable
    off = lambda wire, raw: False  # noqa: E731
    for name in VARIANTS[1:]:
        setups[name].error_memory.memory["bench"] = h0.clone()
    compensated.fusable = off
    want = _send(*wires["EF unfused"], g)
    compensated.fusable = fusable
    got = _send(*wires["EF fused"], g)
    if [p.numpy().tobytes() for p in got] != [p.numpy().tobytes() for p in want] or not (
            setups["EF fused"].error_memory.memory["bench"].numpy().tobytes()
            == setups["EF unfused"].error_memory.memory["bench"].numpy().tobytes()):
        raise SystemExit("fused and unfused sends differ: not timing them")
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for _ in range(args.repeats + 1):
        for name in VARIANTS:
            wire, bucket = wires[name]
            compensated.fusable = off if name == "EF unfused" else fusable
            wire.tap = None
            bucket.reset()
            started = time.perf_counter()
            wire.submit(bucket, g)
            times[name].append(time.perf_counter() - started)
    compensated.fusable = fusable
    return {k: v[1:] for k, v in times.items()}   # the first round warms caches and pages


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    configs = [("allgather", 1, "fixed"), ("allgather", 1, "entropy"),
               ("two_phase", 2, "fixed"), ("two_phase", 2, "entropy")]
    stepped = None if args.no_steps else measure_steps(args)
    step_s = None if stepped is None else stepped["plain"][0]
    rows = []
    for mode, ranks, coding in configs:
        times = measure(args, mode, ranks, coding)
        best = {k: min(v) for k, v in times.items()}
        plain = best["plain"]
        for name in VARIANTS:
            over = best[name] - plain
            share = ("" if step_s is None or name == "plain"
                     else f"{100 * over / step_s:.1f} %")
            rows.append([f"{mode} (P = {ranks})", coding, name, f"{1e3 * best[name]:.1f}",
                         f"{1e3 * statistics.median(times[name]):.1f}",
                         "" if name == "plain" else f"{1e3 * over:.1f}", share])
        print(f"{mode} P={ranks} {coding}: " + ", ".join(
            f"{k} {1e3 * v:.1f} ms" for k, v in best.items()), flush=True)
    headers = ["exchange", "coding", "send", "best ms", "median ms", "EF overhead ms",
               "of the plain step"]
    body = report.markdown_table(headers, rows)
    if stepped is not None:
        step_rows = [[name, f"{stepped[name][0]:.3f}", f"{1e3 * stepped[name][1]:.1f}",
                      "" if name == "plain" else
                      f"{1e3 * (stepped[name][0] - step_s):+.1f} ms "
                      f"({100 * (stepped[name][0] - step_s) / step_s:+.1f} %)"]
                     for name in VARIANTS]
        body += ("\n\n### Training steps on 2 ranks (loopback)\n\n" + report.markdown_table(
            ["setup", "median step s", "median encode ms/step", "vs plain"], step_rows))
        print("steps: " + ", ".join(f"{k} {v[0]:.3f} s" for k, v in stepped.items()))
    notes = [f"Workload: {args.numel:,} float32 coordinates N(0, 1e-6), memory N(0, 1e-8); "
             f"QSGD {args.bits}-bit, B = {args.bucket_size}, {args.norm}; ErrorFeedback with "
             "the default α, β; one thread (torch.set_num_threads(1); the kernels are "
             "single-threaded)",
             "Timed: `Wire.submit` of one bucket with stub collectives (encode, and with error "
             "feedback compensate, check and memory update), best and median of "
             f"{args.repeats} rounds after a warm-up round; P = 2 two-phase encodes two "
             "zero-padded chunks",
             "Fused and unfused sends were checked to give the same payload bytes and memory "
             "before timing"]
    if stepped is not None:
        notes.append(f"Steps: MLP {'→'.join(map(str, args.sizes))}, 2 ranks (Gloo, loopback), "
                     f"{args.rounds - 1} timed rounds × {args.steps} steps per setup after one "
                     "warm-up round, interleaved; median over steps of the larger rank time; "
                     "encode = the wire's encode seconds (with error feedback: the send pass); "
                     "the send table's step share is of the plain median step")
    path = report.write("ef_overhead", "Error-feedback overhead of a rank's send (CPU)", body,
                        quick=args.quick, notes=notes)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
