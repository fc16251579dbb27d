"""Encode/decode throughput of the payload kernels (numpy oracle, PyTorch, TensorFlow).

For every framework, bit width and vector size this measures ``encode`` (bucket norms,
stochastic rounding with the framework's RNG, packing) and ``decode`` on a float32 vector, and
reports GB/s of float32 data (4·n bytes / time, best of ``--repeats``) next to a memory-copy
baseline (``np.copyto`` of the same 4·n bytes) measured in the same run, with the ratio.

    python benchmarks/kernels.py                  # 1M, 16M, 64M elements; 2/3/4/8 bits
    python benchmarks/kernels.py --quick          # CI: small sizes, a few seconds per framework

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
    p.add_argument("--frameworks", default="numpy,torch,tf")
    p.add_argument("--bucket-size", type=int, default=512)
    p.add_argument("--norm", default="l2", choices=sorted(codec.NORM_CODES))
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs per measurement, best kept (default 3; 2 at 64M)")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads for torch and TF (default: the libraries' own)")
    p.add_argument("--output", default=None, help="markdown file (default benchmarks/results/"
                                                  "kernels.md, kernels_quick.md with --quick)")
    args = p.parse_args(argv)
    args.sizes = (args.sizes or ("64K,1M" if args.quick else "1M,16M,64M")).split(",")
    args.bits = [int(b) for b in (args.bits or ("2,8" if args.quick else "2,3,4,8")).split(",")]
    args.frameworks = args.frameworks.split(",")
    unknown = set(args.sizes) - set(SIZES)
    if unknown:
        p.error(f"unknown sizes {sorted(unknown)}; use {sorted(SIZES)}")
    if args.output is None:
        folder = ROOT / "benchmarks" / "results" / ("quick" if args.quick else "")
        args.output = str(folder / "kernels.md")
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


class NumpyBench:
    name = "numpy"

    def version(self) -> str:
        return np.__version__

    def threads(self) -> str:
        return "1 (numpy ufuncs)"

    def prepare(self, x: np.ndarray, table: LevelTable, bucket: int, norm: str):
        rng = np.random.default_rng(0)
        payload = codec.encode(x, table, bucket_size=bucket, norm=norm, seed=rng)
        return (lambda: codec.encode(x, table, bucket_size=bucket, norm=norm, seed=rng),
                lambda: codec.decode(payload, table))


class TorchBench:
    name = "torch"

    def __init__(self, threads):
        import torch

        from horovod_aq.torch import kernels

        if threads:
            torch.set_num_threads(threads)
        self.torch, self.k = torch, kernels

    def version(self) -> str:
        return self.torch.__version__

    def threads(self) -> str:
        return f"{self.torch.get_num_threads()} (torch.get_num_threads)"

    def prepare(self, x, table, bucket, norm):
        xt = self.torch.from_numpy(x)
        gen = self.torch.Generator().manual_seed(0)
        payload = self.k.encode(xt, table, bucket_size=bucket, norm=norm, generator=gen)
        return (lambda: self.k.encode(xt, table, bucket_size=bucket, norm=norm, generator=gen),
                lambda: self.k.decode(payload, table))


class TensorFlowBench:
    name = "tf"

    def __init__(self, threads):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf

        from horovod_aq.tensorflow import kernels

        if threads:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
        self.tf, self.k = tf, kernels

    def version(self) -> str:
        return self.tf.__version__

    def threads(self) -> str:
        intra = self.tf.config.threading.get_intra_op_parallelism_threads()
        return f"{intra or os.cpu_count()} intra-op ({'set' if intra else 'default'})"

    def prepare(self, x, table, bucket, norm):
        tf, k = self.tf, self.k
        n, bits = x.size, table.bits
        levels = tf.Variable(k.levels_tensor(table))
        header = tf.Variable(k.header_tensor(n, table, bucket, norm))
        gen = tf.random.Generator.from_seed(0)
        xt = tf.constant(x)
        encode = tf.function(lambda v: k.encode_with(v, levels, header, bits=bits,
                                                     bucket_size=bucket, norm=norm, seed=gen))
        decode = tf.function(lambda p: k.decode_with(p, levels, header, numel=n, bits=bits,
                                                     bucket_size=bucket))
        payload = encode(xt)
        # .numpy() would add a copy to the host buffer; wait for completion with a tiny read.
        return (lambda: encode(xt)[:1].numpy(), lambda: decode(payload)[:1].numpy())


def make_bench(name: str, threads):
    try:
        if name == "numpy":
            return NumpyBench()
        if name == "torch":
            return TorchBench(threads)
        if name == "tf":
            return TensorFlowBench(threads)
    except ImportError as err:
        print(f"skipping {name}: {err}", file=sys.stderr)
        return None
    raise SystemExit(f"unknown framework {name!r}")


# ---------------------------------------------------------------------------------- report


def main(argv=None) -> int:
    args = parse_args(argv)
    benches = [b for b in (make_bench(f, args.threads) for f in args.frameworks) if b]
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
            table = LevelTable(np.linspace(-1.0, 1.0, 2**bits))
            for bench in benches:
                encode, decode = bench.prepare(x, table, args.bucket_size, args.norm)
                enc = 4 * n / best_time(encode, repeats) / 1e9
                dec = 4 * n / best_time(decode, repeats) / 1e9
                rows.append((bench.name, bits, size_name, enc, enc / copy_gbs, dec,
                             dec / copy_gbs, copy_gbs))
                print(f"  {bench.name:6s} {bits} bits: encode {enc:6.3f} GB/s "
                      f"({enc / copy_gbs:.3f}x memcpy), decode {dec:6.3f} GB/s "
                      f"({dec / copy_gbs:.3f}x)", flush=True)
                del encode, decode
    elapsed = time.perf_counter() - started
    write_report(args, benches, rows, load_start, loadavg(), elapsed)
    print(f"wrote {args.output}")
    return 0


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
         + "; ".join(f"{b.name} {b.version()}" for b in benches)),
        ("- Threads: " + "; ".join(f"{b.name} {b.threads()}" for b in benches)
         + (f"; environment {env_threads}" if env_threads else "; OMP_NUM_THREADS unset")),
        (f"- Workload: float32 N(0,1)·lognormal vector, uniform table (2^b levels), "
         f"bucket size {args.bucket_size}, {args.norm} norm, uniforms from each framework's "
         "RNG (numpy Generator, torch.Generator, tf.random.Generator)"),
        ("- GB/s = 4·n bytes of float32 / best time over the repeats (encode: gradient in, "
         "payload out; decode: payload in, float32 out). memcpy = `np.copyto` of the same "
         "4·n bytes in the same run; ratio = kernel GB/s ÷ memcpy GB/s."),
        ("- TensorFlow: `encode_with` / `decode_with` in `tf.function`, levels and header in "
         "variables; numpy: the reference codec (written for clarity, not speed)."),
        "",
        ("| framework | bits | n | encode GB/s | encode / memcpy | decode GB/s | decode / memcpy "
         "| memcpy GB/s |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, bits, size, enc, enc_r, dec, dec_r, copy in rows:
        lines.append(f"| {name} | {bits} | {size} | {enc:.3f} | {enc_r:.3f} | {dec:.3f} | "
                     f"{dec_r:.3f} | {copy:.2f} |")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
