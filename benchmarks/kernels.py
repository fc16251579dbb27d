"""Encode/decode throughput of the payload kernels, one thread, next to a same-run memcpy.

For every implementation (the numpy oracle, the fused CPU kernel, the torch ops, the torch
dispatch the optimizer uses, TensorFlow), bit width and vector size this measures ``encode``
(bucket norms, the format's Philox stream, stochastic rounding, packing) of a float32 vector and
``decode_average`` of ``DECODE_RANKS`` gathered payloads, and reports GB/s of float32 data
(encode: 4·n bytes in; decode: 4·n·P bytes out, best of ``--repeats``) next to a single-threaded
memory copy (``np.copyto`` of 4·n bytes) measured in the same run, with the ratio.

    python benchmarks/kernels.py                  # 1M, 16M, 64M elements; 2/3/4/8 bits
    python benchmarks/kernels.py --quick          # CI: small sizes, a few seconds per framework
    python benchmarks/kernels.py --entropy        # the entropy-coded wire (docs/format.md §12)
                                                  # beside the fixed-width kernel, ALQ tables

``--entropy`` measures ``fused`` (fixed width) and ``fused-entropy`` (quantize + entropy-code,
decode + average of entropy-coded rows) on ALQ tables fitted to the vector, reports the wire's
bits per coordinate with the empirical entropy of the codes, and writes
benchmarks/results/kernels_entropy.md.

Results go to benchmarks/results/kernels.md (``--output``) with the command, the machine, the
library versions and the thread counts. TensorFlow runs ``encode_with`` / ``decode_with`` inside
``tf.function`` with the table held in variables, as the integration does.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import loadavg, machine  # (imported after the sys.path insert)
from horovod_aq import codec
from horovod_aq.levels.table import LevelTable

SIZES = {"64K": 1 << 16, "1M": 1 << 20, "16M": 1 << 24, "64M": 1 << 26}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="small sizes for CI (64K, 1M; 2 and 8 bits)")
    p.add_argument("--sizes", default=None, help="comma list from " + ",".join(SIZES))
    p.add_argument("--bits", default=None, help="comma list, default 2,3,4,8")
    p.add_argument("--frameworks", default=None,
                   help="comma list of numpy, fused, fused-entropy, torch-ops, torch, tf "
                        "(default all but fused-entropy; with --entropy: fused,fused-entropy)")
    p.add_argument("--entropy", action="store_true",
                   help="the entropy-coded wire beside the fixed-width kernel, on ALQ tables")
    p.add_argument("--bucket-size", type=int, default=1024)
    p.add_argument("--norm", default="l2", choices=sorted(codec.NORM_CODES))
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs per measurement, best kept (default 3; 2 at 64M)")
    p.add_argument("--output", default=None, help="markdown file (default benchmarks/results/"
                                                  "kernels.md, kernels_quick.md with --quick)")
    args = p.parse_args(argv)
    args.sizes = (args.sizes or ("64K,1M" if args.quick else "1M,16M,64M")).split(",")
    args.bits = [int(b) for b in (args.bits or ("2,8" if args.quick else "2,3,4,8")).split(",")]
    args.frameworks = (args.frameworks or ("fused,fused-entropy" if args.entropy else
                                           "numpy,fused,torch-ops,torch,tf")).split(",")
    unknown = set(args.sizes) - set(SIZES)
    if unknown:
        p.error(f"unknown sizes {sorted(unknown)}; use {sorted(SIZES)}")
    if args.output is None:
        folder = ROOT / "benchmarks" / "results" / ("quick" if args.quick else "")
        args.output = str(folder / ("kernels_entropy.md" if args.entropy else "kernels.md"))
    return args


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up (tracing, caches, allocator)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


# ------------------------------------------------------------------------------- frameworks
#: Payload rows averaged by the decode measurement (decode_average of P gathered payloads).
DECODE_RANKS = 4


class NumpyBench:
    """The reference codec (written for clarity, not speed)."""

    name = "numpy oracle"

    def version(self) -> str:
        return f"numpy {np.__version__}"

    def prepare(self, x: np.ndarray, table: LevelTable, bucket: int, norm: str, key):
        rows = np.stack([codec.encode(x, table, bucket_size=bucket, norm=norm, key=key)]
                        * DECODE_RANKS)
        return (lambda: codec.encode(x, table, bucket_size=bucket, norm=norm, key=key),
                lambda: codec.decode_average(rows, table))


class FusedBench:
    """``horovod_aq.codec.fused``: one compiled pass per bucket (numba), single-threaded."""

    name = "fused CPU (numba)"

    def __init__(self):
        import numba

        from horovod_aq.codec import fused

        self.numba, self.fused = numba, fused

    def version(self) -> str:
        return f"numba {self.numba.__version__}"

    def prepare(self, x, table, bucket, norm, key):
        fused = self.fused
        out = np.empty(codec.payload_size(x.size, table.bits, bucket), np.uint8)
        rows = np.stack([fused.encode(x, table, bucket_size=bucket, norm=norm, key=key)]
                        * DECODE_RANKS)
        avg = np.empty(x.size, np.float32)
        return (lambda: fused.encode(x, table, bucket_size=bucket, norm=norm, key=key, out=out),
                lambda: fused.decode_average(rows, table, out=avg))


class FusedEntropyBench(FusedBench):
    """``horovod_aq.codec.fused_entropy``: the fused quantizer with one code per byte, the
    histogram, the per-payload model and interleaved rANS; decode + average of P rows."""

    name = "fused entropy-coded"

    def prepare(self, x, table, bucket, norm, key):
        from horovod_aq.codec import fused_entropy

        self.payload = fused_entropy.encode_entropy(x, table, bucket_size=bucket, norm=norm,
                                                    key=key)
        rows = [self.payload] * DECODE_RANKS
        avg = np.empty(x.size, np.float32)
        return (lambda: fused_entropy.encode_entropy(x, table, bucket_size=bucket, norm=norm,
                                                     key=key),
                lambda: fused_entropy.decode_average(rows, table, out=avg))


class TorchBench:
    """``horovod_aq.torch.kernels`` on CPU tensors: "torch ops" forces the vectorized torch
    implementation, "torch (dispatch)" is what the optimizer runs (the fused kernel on CPU)."""

    def __init__(self, implementation: str):
        import torch

        from horovod_aq.torch import kernels

        torch.set_num_threads(1)
        self.torch, self.k, self.implementation = torch, kernels, implementation
        self.name = "torch ops" if implementation == "ops" else "torch (dispatch)"

    def version(self) -> str:
        return f"torch {self.torch.__version__}"

    def prepare(self, x, table, bucket, norm, key):
        k, torch, impl = self.k, self.torch, self.implementation

        def run(fn):
            def call():
                saved, k.IMPLEMENTATION = k.IMPLEMENTATION, impl
                try:
                    return fn()
                finally:
                    k.IMPLEMENTATION = saved
            return call

        xt = torch.from_numpy(x)
        payload = run(lambda: k.encode(xt, table, bucket_size=bucket, norm=norm, key=key))()
        rows = payload.repeat(DECODE_RANKS, 1)
        return (run(lambda: k.encode(xt, table, bucket_size=bucket, norm=norm, key=key)),
                run(lambda: k.decode_average(rows, table)))


class TensorFlowBench:
    """``horovod_aq.tensorflow.kernels`` in ``tf.function`` with the table in variables, as the
    packed exchange runs them, one intra-op thread."""

    name = "tf"

    def __init__(self):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf

        from horovod_aq.tensorflow import kernels

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        self.tf, self.k = tf, kernels

    def version(self) -> str:
        return f"tensorflow {self.tf.__version__}"

    def prepare(self, x, table, bucket, norm, key):
        tf, k = self.tf, self.k
        n, bits = x.size, table.bits
        levels = tf.Variable(k.levels_tensor(table))
        header = tf.Variable(k.header_tensor(n, table, bucket, norm))
        step = tf.Variable(np.int64(key.step))
        k0, k1 = key.philox_key()
        xt = tf.constant(x)
        encode = tf.function(lambda v: k.encode_with(
            v, levels, header, bits=bits, bucket_size=bucket, norm=norm, check=False,
            key=(k0, k1, step.read_value(), key.bucket, key.part)))
        decode = tf.function(lambda p: k.decode_average_with(
            p, levels, header, numel=n, bits=bits, bucket_size=bucket, check=False))
        rows = tf.stack([encode(xt)] * DECODE_RANKS)
        # .numpy() would add a copy to the host buffer; wait for completion with a tiny read.
        return (lambda: encode(xt)[:1].numpy(), lambda: decode(rows)[:1].numpy())


def make_bench(name: str):
    try:
        if name == "numpy":
            return NumpyBench()
        if name == "fused":
            return FusedBench()
        if name == "fused-entropy":
            return FusedEntropyBench()
        if name == "torch-ops":
            return TorchBench("ops")
        if name == "torch":
            return TorchBench("auto")
        if name == "tf":
            return TensorFlowBench()
    except ImportError as err:
        print(f"skipping {name}: {err}", file=sys.stderr)
        return None
    raise SystemExit(f"unknown implementation {name!r}")


# ---------------------------------------------------------------------------------- report


def main(argv=None) -> int:
    args = parse_args(argv)
    benches = [b for b in (make_bench(f) for f in args.frameworks) if b]
    key = codec.StreamKey(seed=0, rank=0, step=1, bucket=0, part=0)
    rows = []
    load_start = loadavg()
    started = time.perf_counter()
    for size_name in args.sizes:
        n = SIZES[size_name]
        repeats = args.repeats or (2 if n >= SIZES["64M"] else 3)
        rng = np.random.default_rng(0)
        x = (rng.standard_normal(n, dtype=np.float32)
             * rng.lognormal(0, 1, n).astype(np.float32))
        dst = np.empty_like(x)
        copy = best_time(lambda dst=dst, x=x: np.copyto(dst, x), max(repeats, 5))
        copy_gbs = 4 * n / copy / 1e9
        print(f"{size_name}: memcpy {copy_gbs:.2f} GB/s", flush=True)
        for bits in args.bits:
            table = alq_table(x, bits, args.bucket_size) if args.entropy else LevelTable(
                np.linspace(-1.0, 1.0, 2**bits))
            wire = wire_bits(x, table, args.bucket_size, args.norm, key) if args.entropy else ""
            for bench in benches:
                if bench.name == "numpy oracle" and n > SIZES["16M"]:
                    continue  # minutes per call; its speed is known from the smaller sizes
                encode, decode = bench.prepare(x, table, args.bucket_size, args.norm, key)
                enc = 4 * n / best_time(encode, repeats) / 1e9
                dec = 4 * n * DECODE_RANKS / best_time(decode, repeats) / 1e9
                rows.append((bench.name, bits, size_name, enc, enc / copy_gbs, dec,
                             dec / copy_gbs, copy_gbs)
                            + ((wire[bench.name],) if args.entropy else ()))
                print(f"  {bench.name:18s} {bits} bits: encode {enc:6.3f} GB/s "
                      f"({enc / copy_gbs:.3f}x memcpy), decode {dec:6.3f} GB/s "
                      f"({dec / copy_gbs:.3f}x)", flush=True)
                del encode, decode
    elapsed = time.perf_counter() - started
    write_report(args, benches, rows, load_start, loadavg(), elapsed)
    print(f"wrote {args.output}")
    return 0


def alq_table(x: np.ndarray, bits: int, bucket: int) -> LevelTable:
    """The ALQ table fitted to x (one refit, as at step 0 of training)."""
    import horovod_aq
    from horovod_aq.refit import LocalComm

    comp = horovod_aq.ALQ(bits=bits, bucket_size=bucket)
    comp.record_gradient(x)
    comp.end_step(LocalComm())
    return comp.table


def wire_bits(x, table, bucket, norm, key) -> dict[str, str]:
    """Bits per coordinate each implementation sends, and the codes' empirical entropy H."""
    from horovod_aq.codec import fused_entropy

    n = x.size
    coded = fused_entropy.encode_entropy(x, table, bucket_size=bucket, norm=norm, key=key)
    codes, _ = codec.quantize_codes(x[: 1 << 20], table, bucket_size=bucket, norm=norm,
                                    uniforms=codec.stream_uniforms(min(n, 1 << 20), key))
    entropy = codec.empirical_entropy(codes, table.num_levels)
    norms = 32.0 * codec.num_buckets(n, bucket) / n
    wire = 8 * coded.size / n
    return {"fused CPU (numba)": f"{8 * codec.payload_size(n, table.bits, bucket) / n:.3f}",
            "fused entropy-coded": f"{wire:.3f} (H + norms = {entropy + norms:.3f}: "
                                   f"×{wire / (entropy + norms):.3f})"}


def write_report(args, benches, rows, load_start, load_end, elapsed) -> None:
    command = "python " + " ".join([os.path.relpath(__file__, ROOT)] + sys.argv[1:])
    env_threads = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
                   if k in os.environ}
    lines = [
        "# Payload kernel throughput",
        "",
        f"- Command: `{command}`",
        f"- Date: {dt.datetime.now().isoformat(timespec='seconds')}, total {elapsed:.0f} s",
        f"- Machine: {machine()}",
        (f"- Load average at start / end: {load_start} / {load_end} (on a shared machine, "
         "other jobs inflate times; each figure is the best of its repeats)"),
        (f"- Python {platform.python_version()}; "
         + "; ".join(f"{b.name}: {b.version()}" for b in benches)),
        ("- Threads: one everywhere (torch.set_num_threads(1), TF intra/inter-op 1, the fused "
         "kernel is single-threaded, numpy's copy is single-threaded)"
         + (f"; environment {env_threads}" if env_threads else "; OMP_NUM_THREADS unset")),
        (f"- Workload: float32 N(0,1)·lognormal vector, uniform table (2^b levels), "
         f"bucket size {args.bucket_size}, {args.norm} norm, uniforms from the format's stream "
         "(every implementation writes the same bytes)"),
        (f"- GB/s: encode = 4·n bytes of float32 in / best time; decode = decode_average of "
         f"{DECODE_RANKS} payloads, 4·n·{DECODE_RANKS} bytes of float32 decoded / best time. "
         "memcpy = `np.copyto` of 4·n bytes in the same run; ratio = kernel GB/s ÷ memcpy GB/s "
         "(targets: encode ≥ 0.25, decode ≥ 0.5)."),
        ("- Implementations: numpy oracle = `horovod_aq.codec.reference` (not measured at 64M); "
         "fused CPU = `horovod_aq.codec.fused`; torch ops = `horovod_aq.torch.kernels` with "
         "HOROVOD_AQ_KERNELS=ops; torch (dispatch) = the same module as the optimizer calls it "
         "(CPU tensors go to the fused kernel); tf = `encode_with` / `decode_average_with` in "
         "`tf.function`, levels and header in variables."),
    ]
    if args.entropy:
        lines += [
            ("- Entropy mode: tables are ALQ fitted to the vector (one refit); `fused "
             "entropy-coded` = `horovod_aq.codec.fused_entropy` (quantize + entropy-code; decode "
             "+ average of entropy-coded rows); wire = bits per coordinate of the payload, with "
             "the codes' empirical entropy H (first 1M coordinates) + 32·⌈n/B⌉/n of norms and "
             "the ratio (target ≤ 1.1). CPU targets: encode ≥ 2 GB/s, decode ≥ 2 GB/s."),
        ]
    lines += [
        "",
        ("| implementation | bits | n | encode GB/s | encode / memcpy | decode GB/s | "
         "decode / memcpy | memcpy GB/s |" + (" wire bits/coordinate |" if args.entropy else "")),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if args.entropy else ""),
    ]
    for name, bits, size, enc, enc_r, dec, dec_r, copy, *wire in rows:
        lines.append(f"| {name} | {bits} | {size} | {enc:.3f} | {enc_r:.3f} | {dec:.3f} | "
                     f"{dec_r:.3f} | {copy:.2f} |" + "".join(f" {w} |" for w in wire))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
