"""What error feedback costs a TensorFlow rank's send and an eager exchange step on the CPU.

Workload: the gradients of the cluster benchmark's MLP (784→4096→1536→10, 9,523,722
coordinates; ``benchmarks.models.CLUSTER_MLP``), QSGD 3-bit, B = 256, l2:

* **plain**: the quantizer alone (no error feedback);
* **EF**: ``ErrorFeedback(quantizer)`` with the default α, β (compensation, encode, and the
  memory update after the checks, docs/protocol.md §13).

**Send** (in this process, one thread): one rank's stage-1 work on one bucket of all the
coordinates in a ``tf.function``, no collective: ``PayloadOps.send_parts`` (plain) against
``PayloadOps.send_compensated`` followed by the memory update it feeds
(``compensated.update_memory``: h ← h'), best and median of ``--repeats`` interleaved calls.

**Steps** (unless ``--no-steps``): each of 2 ranks holds fixed local gradients as tensors and
calls ``PackedExchange.reduce`` eagerly (one ``tf.function`` per layout, the step ending by
itself in the graph: statistics, memory update, telemetry).
Per exchange and coding, rounds of ``--steps`` calls interleave the two setups after one warm-up
round (traces, numba compiles, pages); a step's time is the larger of the two ranks' (Gloo over
loopback, one thread per rank). EF overhead = median EF step − median plain step.

    python benchmarks/tf_ef_step.py                 # 9.5M coordinates
    python benchmarks/tf_ef_step.py --quick         # small, for a smoke run

Results: benchmarks/results/tf_ef_step.md (quick runs: benchmarks/results/quick/).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np

from benchmarks import report

#: (exchange, coding) of the timed setups.
CONFIGS = (("allgather", "fixed"), ("allgather", "entropy"), ("two_phase", "fixed"))
VARIANTS = ("plain", "EF")
SIZES = (784, 4096, 1536, 10)
QUICK_SIZES = (784, 256, 10)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="rounds, the first a warm-up")
    p.add_argument("--steps", type=int, default=3, help="steps per setup and round")
    p.add_argument("--bits", type=int, default=3)
    p.add_argument("--bucket-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7, help="timed sends per setup")
    p.add_argument("--no-steps", action="store_true", help="only the in-process send")
    p.add_argument("--quick", action="store_true", help="a small MLP, 2 rounds")
    args = p.parse_args(argv)
    args.sizes = QUICK_SIZES if args.quick else SIZES
    if args.quick:
        args.rounds = 2
    return args


def rank_steps(cfg: dict) -> dict:
    """One rank: the seconds of every timed ``reduce`` call, by (exchange, coding, variant)."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import horovod_aq
    import horovod_aq.tensorflow as aqtf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    rng = np.random.default_rng(hvd.rank())
    sizes = cfg["sizes"]
    shapes = [s for a, b in zip(sizes[:-1], sizes[1:]) for s in ((a, b), (b,))]
    variables = [tf.Variable(np.zeros(s, np.float32), name=f"v{i}")
                 for i, s in enumerate(shapes)]
    grads = [tf.constant(rng.normal(0.0, 1e-3, s).astype(np.float32)) for s in shapes]
    exchanges = {}
    for k, (exchange, coding) in enumerate(CONFIGS):
        for variant in VARIANTS:
            q = horovod_aq.QSGD(bits=cfg["bits"], bucket_size=cfg["bucket_size"], seed=1,
                                name=f"tfef{k}{variant}")
            comp = q if variant == "plain" else horovod_aq.ErrorFeedback(q)
            exchanges[(exchange, coding, variant)] = aqtf.exchange_for(
                comp, process_set=hvd.global_process_set, exchange=exchange, wire=coding)
    times: dict[tuple, list[float]] = {key: [] for key in exchanges}
    for rnd in range(cfg["rounds"]):
        for key, ex in exchanges.items():
            hvd.allreduce(tf.constant(0.0), name=f"sync.{rnd}.{'.'.join(key)}")
            for _ in range(cfg["steps"]):
                started = time.perf_counter()
                out = ex.reduce(grads, variables)
                float(out[0][0, 0])
                if rnd:   # the first round warms up
                    times[key].append(time.perf_counter() - started)
    hvd.shutdown()
    return {"|".join(k): v for k, v in times.items()}


def measure_send(args, numel: int) -> list[list[str]]:
    """The send table (module docstring): rows of (exchange, coding, setup, best, median,
    EF overhead)."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import horovod_aq
    from horovod_aq.packed.plan import BucketPlan
    from horovod_aq.tensorflow.compensated import MemoryUpdate, update_memory
    from horovod_aq.tensorflow.payloads import PayloadOps
    from horovod_aq.tensorflow.state import tf_state

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    g = tf.constant(np.random.default_rng(0).normal(0.0, 1e-3, numel).astype(np.float32))

    def build(mode: str, coding: str, variant: str, name: str):
        q = horovod_aq.QSGD(bits=args.bits, bucket_size=args.bucket_size, seed=1, name=name)
        comp = q if variant == "plain" else horovod_aq.ErrorFeedback(q)
        st = tf_state(comp)
        ops = PayloadOps(comp, st, ranks=2, rank=0, coding=coding)
        bucket = BucketPlan(0, name, (0,), numel, mode)
        if variant == "plain":
            return tf.function(lambda g: ops.send_parts(g, bucket, mode=mode))
        memory = st.memory_variable(name, numel)

        def send(g):
            sent, fused = ops.send_compensated(g, memory.read_value(), bucket, mode=mode)
            return sent, update_memory(st.error_memory, st.memory_resets,
                                       [MemoryUpdate(memory, fused.memory, fused.finite)],
                                       tf.constant(False), sent)

        return tf.function(send)

    rows = []
    for k, (exchange, coding) in enumerate(CONFIGS):
        fns = {v: build(exchange, coding, v, f"send{k}{v}") for v in VARIANTS}
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for fn in fns.values():
            fn(g)                                   # trace, compile, pages
        for _ in range(args.repeats):
            for variant, fn in fns.items():
                started = time.perf_counter()
                fn(g)
                times[variant].append(time.perf_counter() - started)
        best = {v: min(t) for v, t in times.items()}
        for variant in VARIANTS:
            rows.append([exchange, coding, variant, f"{1e3 * best[variant]:.1f}",
                         f"{1e3 * float(np.median(times[variant])):.1f}",
                         "" if variant == "plain" else
                         f"{1e3 * (best[variant] - best['plain']):+.1f}"])
        print(f"send {exchange} {coding}: " + ", ".join(f"{v} {1e3 * b:.1f} ms"
                                                        for v, b in best.items()), flush=True)
    return rows


def main(argv=None) -> int:
    from horovod_aq.tools.launcher import run_local

    args = parse_args(argv)
    numel = sum(a * b + b for a, b in zip(args.sizes[:-1], args.sizes[1:]))
    send_rows = measure_send(args, numel)
    body = ("### One rank's send (in process, one thread)\n\n" + report.markdown_table(
        ["exchange", "coding", "setup", "best ms", "median ms", "EF overhead ms (best)"],
        send_rows))
    notes = [f"Workload: MLP {'→'.join(map(str, args.sizes))} gradients ({numel:,} float32 "
             f"coordinates, N(0, 1e-6)); QSGD {args.bits}-bit, B = {args.bucket_size}, l2; "
             "ErrorFeedback with the default α, β",
             "Send: one bucket of all coordinates, `PayloadOps.send_parts` (plain) or "
             "`send_compensated` + `compensated.update_memory` (EF) in a tf.function, P = 2 "
             f"(two-phase: two chunks), no collective; best and median of {args.repeats} "
             "interleaved calls after a warm-up call"]
    if args.no_steps:
        path = report.write("tf_ef_step", "Error feedback in the TensorFlow exchange (CPU)",
                            body, quick=args.quick, notes=notes)
        print(f"wrote {path}")
        return 0
    cfg = {"sizes": args.sizes, "bits": args.bits, "bucket_size": args.bucket_size,
           "rounds": args.rounds, "steps": args.steps}
    ranks = run_local([(rank_steps, {"cfg": cfg})], np=2, timeout=1800).get("rank_steps")
    rows = []
    for exchange, coding in CONFIGS:
        median = {}
        for variant in VARIANTS:
            key = f"{exchange}|{coding}|{variant}"
            steps = np.max([r[key] for r in ranks], axis=0)
            median[variant] = float(np.median(steps))
            rows.append([exchange, coding, variant, f"{1e3 * float(np.min(steps)):.1f}",
                         f"{1e3 * median[variant]:.1f}",
                         "" if variant == "plain" else
                         f"{1e3 * (median[variant] - median['plain']):+.1f}"])
        print(f"{exchange} {coding}: " + ", ".join(f"{k} {1e3 * v:.1f} ms"
                                                   for k, v in median.items()), flush=True)
    body += ("\n\n### Eager exchange steps on 2 ranks (loopback)\n\n" + report.markdown_table(
        ["exchange", "coding", "setup", "best ms", "median ms", "EF overhead ms (median)"],
        rows))
    notes.append("Steps: one eager `PackedExchange.reduce` call (its tf.function: encode, "
                 "collectives, decode, error-feedback update, in-graph step end with telemetry) "
                 f"on fixed per-rank gradients, 2 ranks (Gloo, loopback, one thread each), "
                 f"{args.rounds - 1} timed rounds × {args.steps} steps per setup after one "
                 "warm-up round, interleaved; a step is the larger rank time")
    path = report.write("tf_ef_step", "Error feedback in the TensorFlow exchange (CPU)",
                        body, quick=args.quick, notes=notes)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
