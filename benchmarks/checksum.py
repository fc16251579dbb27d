"""Cost of the optional payload checksum (CRC-32, docs/format.md §11) on the fused CPU path.

For every bit width and vector size this measures, on one thread, the fused kernel's ``encode``
of a float32 vector and ``decode_average`` of ``RANKS`` gathered payloads, without and with
``checksum=True``, and the CRC-32 of one payload alone (``codec.payload_checksum``). A step that
checksums pays one CRC per payload it encodes and one per row it decodes, so its cost is
(1 + P)·CRC; the table gives it as a share of encode + decode time. That is an upper bound on
its share of a training step, which also waits for the network and runs forward, backward and
the update.

    python benchmarks/checksum.py                 # 1M and 16M elements; 2/3/4/8 bits
    python benchmarks/checksum.py --quick         # 64K and 1M; 3 bits

Results go to benchmarks/results/checksum.md (``--output``) with the command, the machine and
the versions, and the default the issue's rule gives (on if the checksum costs at most
``LIMIT`` of step time; the upper bound is used).
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

from benchmarks.report import loadavg, machine, versions  # (after the sys.path insert)
from horovod_aq import codec
from horovod_aq.codec import fused
from horovod_aq.codec.stream import StreamKey
from horovod_aq.levels.table import LevelTable

SIZES = {"64K": 1 << 16, "1M": 1 << 20, "16M": 1 << 24}
#: Rows of the decode_average measurement (as benchmarks/kernels.py).
RANKS = 4
#: The issue's rule: on by default only if it costs at most this share of step time.
LIMIT = 0.02


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="64K and 1M elements, 3 bits")
    p.add_argument("--sizes", default=None, help="comma list from " + ",".join(SIZES))
    p.add_argument("--bits", default=None, help="comma list, default 2,3,4,8")
    p.add_argument("--bucket-size", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=None,
                   help="timed rounds, best kept (default 40 up to 1M elements, 15 above: the "
                        "best of many rounds is what a shared machine lets through)")
    p.add_argument("--output", default=None,
                   help="markdown file (default benchmarks/results/checksum.md)")
    args = p.parse_args(argv)
    args.sizes = (args.sizes or ("64K,1M" if args.quick else "1M,16M")).split(",")
    args.bits = [int(b) for b in (args.bits or ("3" if args.quick else "2,3,4,8")).split(",")]
    if set(args.sizes) - set(SIZES):
        p.error(f"unknown sizes {sorted(set(args.sizes) - set(SIZES))}; use {sorted(SIZES)}")
    if args.output is None:
        folder = ROOT / "benchmarks" / "results" / ("quick" if args.quick else "")
        args.output = str(folder / "checksum.md")
    return args


def best_times(fns: dict, repeats: int) -> dict[str, float]:
    """Best time of each function; the functions take turns in every round, so that a load
    change on a shared machine affects all of them alike."""
    for fn in fns.values():
        fn()  # warm-up (compilation, caches)
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def measure(n: int, bits: int, bucket: int, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(bits)
    x = (rng.standard_normal(n) * rng.lognormal(0, 1, n)).astype(np.float32)
    table = LevelTable(np.linspace(-1.0, 1.0, 2**bits), 0)
    size = codec.payload_size(n, bits, bucket)
    buf = np.empty(size, np.uint8)
    out = np.empty(n, np.float32)

    def encoded(checksum: bool) -> np.ndarray:
        return np.stack([fused.encode(x, table, bucket_size=bucket, checksum=checksum,
                                      key=StreamKey(seed=1, rank=r)) for r in range(RANKS)])

    plain, sealed = encoded(False), encoded(True)
    key = StreamKey(seed=1)
    row = {"n": n, "bits": bits, "payload": size}
    row.update(best_times({
        "encode": lambda: fused.encode(x, table, bucket_size=bucket, key=key, out=buf),
        "encode+crc": lambda: fused.encode(x, table, bucket_size=bucket, key=key, out=buf,
                                           checksum=True),
        "decode": lambda: fused.decode_average(plain, table, out=out),
        "decode+crc": lambda: fused.decode_average(sealed, table, out=out),
        "crc": lambda: codec.payload_checksum(sealed[0]),
    }, repeats))
    base = row["encode"] + row["decode"]
    row["cost"] = (1 + RANKS) * row["crc"]
    row["share"] = row["cost"] / base
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    started, load_start = time.time(), loadavg()
    rows = []
    for size in args.sizes:
        for bits in args.bits:
            n = SIZES[size]
            repeats = args.repeats or (40 if n <= SIZES["1M"] else 15)
            rows.append(measure(n, bits, args.bucket_size, repeats))
            r = rows[-1]
            print(f"{size} {bits}-bit: encode {r['encode'] * 1e3:.2f} ms, decode_average "
                  f"{r['decode'] * 1e3:.2f} ms, CRC {r['crc'] * 1e3:.3f} ms/payload, "
                  f"(1+P)·CRC = {100 * r['share']:.1f} % of encode+decode", flush=True)
    write_report(args, rows, load_start, loadavg(), time.time() - started)
    return 0


def kernel_throughputs(path: Path = ROOT / "benchmarks" / "results" / "kernels.md") -> dict:
    """{(bits, "1M"): (encode GB/s, decode GB/s)} of the fused CPU rows of
    benchmarks/kernels.py's committed results (measured on a quiet machine), if present."""
    found = {}
    if not path.exists():
        return found
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 6 and cells[0] == "fused CPU (numba)":
            try:
                found[(int(cells[1]), cells[2])] = (float(cells[3]), float(cells[5]))
            except ValueError:
                continue
    return found


def cross_check(rows) -> tuple[list[str], list[float]]:
    """The share again, from the encode and decode throughputs of benchmarks/results/kernels.md
    and this run's CRC throughput: a check that does not depend on this run's load."""
    names = {v: k for k, v in SIZES.items()}
    known = kernel_throughputs()
    lines, shares = [], []
    for r in rows:
        speeds = known.get((r["bits"], names.get(r["n"])))
        if speeds is None:
            continue
        enc = 4 * r["n"] / (speeds[0] * 1e9)
        dec = 4 * r["n"] * RANKS / (speeds[1] * 1e9)
        crc_gbs = r["payload"] / r["crc"] / 1e9
        cost = (1 + RANKS) * r["payload"] / (crc_gbs * 1e9)
        shares.append(cost / (enc + dec))
        lines.append(f"| {names[r['n']]} | {r['bits']} | {enc * 1e3:.2f} | {dec * 1e3:.2f} | "
                     f"{crc_gbs:.2f} | {cost * 1e3:.2f} | {100 * shares[-1]:.1f} % |")
    if not lines:
        return [], []
    return [
        "",
        "Cross-check with the encode and decode throughputs of `benchmarks/results/kernels.md` "
        "(the same kernels, measured on a quieter machine; a loaded machine slows the "
        "memory-bound kernels more than the CRC, which lowers the share above) and this run's "
        "CRC throughput:",
        "",
        "| n | bits | encode ms (kernels.md) | decode ms (kernels.md) | CRC GB/s (this run) | "
        "cost ms | share of encode+decode |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *lines,
    ], shares


def write_report(args, rows, load_start, load_end, elapsed) -> None:
    names = {v: k for k, v in SIZES.items()}
    checked, checked_shares = cross_check(rows)
    measured = max(r["share"] for r in rows)
    worst = max([measured, *checked_shares])
    default = "on" if worst <= LIMIT else "off"
    command = "python benchmarks/checksum.py" + (" " + " ".join(sys.argv[1:])
                                                 if sys.argv[1:] else "")
    lines = [
        "# Cost of the payload checksum (CRC-32) on the fused CPU path",
        "",
        f"- Command: `{command}`",
        f"- Date: {dt.datetime.now().isoformat(timespec='seconds')}, total {elapsed:.0f} s",
        f"- Machine: {machine()}",
        f"- Load average at start / end: {load_start} / {load_end} (a shared machine: each "
        "figure is the best of its repeats)",
        f"- {versions(('numpy', 'numba'))}; CRC-32 = zlib.crc32 (zlib "
        f"{__import__('zlib').ZLIB_RUNTIME_VERSION})",
        f"- Workload: float32 N(0,1)·lognormal vector, uniform table (2^b levels), bucket size "
        f"{args.bucket_size}, l2 norm, the format's random stream; one thread; "
        f"decode = `decode_average` of P = {RANKS} payloads; best of "
        f"{args.repeats or '40 (≤ 1M) / 15 (16M)'} rounds, the five timings taking turns in "
        "every round",
        "- encode / decode: `horovod_aq.codec.fused.encode` / `decode_average` without the "
        "checksum; +CRC: the same with `checksum=True` (encode writes it, decode verifies P rows); "
        "CRC: `codec.payload_checksum` of one payload",
        "- cost = (1 + P)·CRC, what a step that checksums pays (one CRC per payload encoded, "
        "one per row decoded); share = cost / (encode + decode). Encode + decode is part of a "
        "step, so the share is an **upper bound** on the checksum's share of step time. The "
        "+CRC columns are the end-to-end timings with the checksum (on a shared machine their "
        "difference to the plain timings is within the noise; the CRC alone is the reliable "
        "figure)",
        "",
        "| n | bits | payload bytes | encode ms | encode+CRC ms | decode ms | decode+CRC ms | "
        "CRC ms | cost ms | share of encode+decode |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {names.get(r['n'], r['n'])} | {r['bits']} | {r['payload']} | "
            f"{r['encode'] * 1e3:.2f} | {r['encode+crc'] * 1e3:.2f} | {r['decode'] * 1e3:.2f} | "
            f"{r['decode+crc'] * 1e3:.2f} | {r['crc'] * 1e3:.3f} | {r['cost'] * 1e3:.2f} | "
            f"{100 * r['share']:.1f} % |")
    lines += checked
    cross = (f"; with the kernels.md throughputs: {100 * max(checked_shares):.1f} %"
             if checked_shares else "")
    lines += [
        "",
        f"Largest share: {100 * measured:.1f} % of encode + decode in this run{cross} (limit "
        f"{100 * LIMIT:.0f} %). Default by the rule (on only if this upper bound on its share of "
        f"step time is within the limit): **{default}**.",
        "",
    ]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text("\n".join(lines))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    sys.exit(main())
