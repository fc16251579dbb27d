"""The coder candidates of the entropy-coded wire, side by side on the same codes (one thread).

For ALQ 3-bit codes of an N(0,1)·lognormal vector (n = 1M, bucket 1024; the table fitted to it)
this measures, in one run, the bits per coordinate and the coding speed (million codes per
second, best of 3) of:

* ``zstandard`` (zstd's LZ + Huff0/FSE) on one code per byte, levels 1 and 3;
* ``constriction`` (Rust ANS, ``AnsCoder`` with a ``Categorical`` model of the codes' histogram);
* the package's interleaved rANS (``horovod_aq.codec.entropy_kernels``, numba; code pairs as one
  symbol), without the quantizer, and the whole ``fused_entropy.encode_entropy``;

next to the codes' empirical entropy H. Libraries that are not installed are skipped
(``pip install zstandard constriction``). Output: benchmarks/results/entropy_coders.md.

    python benchmarks/entropy_coders.py
"""

from __future__ import annotations

import datetime as dt
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kernels import alq_table  # noqa: E402
from benchmarks.report import loadavg, machine  # noqa: E402
from horovod_aq import codec  # noqa: E402
from horovod_aq.codec import entropy_format as ef  # noqa: E402
from horovod_aq.codec import entropy_kernels as ek  # noqa: E402
from horovod_aq.codec import fused_entropy  # noqa: E402


def best(fn, repeats=3):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    n, bits, bucket = 1 << 20, 3, 1024
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n, dtype=np.float32) * rng.lognormal(0, 1, n).astype(np.float32))
    table = alq_table(x, bits, bucket)
    key = codec.StreamKey(seed=0, step=1)
    codes, _ = codec.quantize_codes(x, table, bucket_size=bucket,
                                    uniforms=codec.stream_uniforms(n, key))
    H = codec.empirical_entropy(codes, table.num_levels)
    rows = []
    load = loadavg()
    try:
        import zstandard

        for level in (1, 3):
            comp = zstandard.ZstdCompressor(level=level)
            data = codes.tobytes()
            blob = comp.compress(data)
            t_enc = best(lambda c=comp: c.compress(data))
            dec = zstandard.ZstdDecompressor()
            t_dec = best(lambda: dec.decompress(blob))
            rows.append((f"zstandard {zstandard.__version__} level {level}, one code per byte",
                         8 * len(blob) / n, n / t_enc / 1e6, n / t_dec / 1e6))
    except ImportError:
        rows.append(("zstandard: not installed", float("nan"), float("nan"), float("nan")))
    try:
        import constriction

        probs = np.bincount(codes, minlength=table.num_levels).astype(np.float64)
        model = constriction.stream.model.Categorical(probs / probs.sum(), perfect=False)
        symbols = codes.astype(np.int32)

        def ans_encode():
            coder = constriction.stream.stack.AnsCoder()
            coder.encode_reverse(symbols, model)
            return coder.get_compressed()

        blob = ans_encode()
        t_enc = best(ans_encode)
        t_dec = best(lambda: constriction.stream.stack.AnsCoder(blob).decode(model, n))
        rows.append(("constriction 0.5 AnsCoder, Categorical model",
                     32 * len(blob) / n, n / t_enc / 1e6, n / t_dec / 1e6))
    except ImportError:
        rows.append(("constriction: not installed", float("nan"), float("nan"), float("nan")))
    t = fused_entropy.code_table_of(codes, table.num_levels)
    f, c = ef.symbol_model(t, bits)
    tables = ek.encoder_tables(f, c)
    nblk = ef.num_blocks(n, bits)
    states = np.empty(nblk * ef.LANES, np.uint32)
    counts = np.empty(nblk, np.int64)
    words = np.empty(ef.num_symbols(n, bits), np.uint16)
    encoder = ek._rans_encoder(bits)
    total = encoder(codes, *tables, states, counts, words)
    t_enc = best(lambda: encoder(codes, *tables, states, counts, words))
    payload = fused_entropy.encode_entropy(x, table, bucket_size=bucket, key=key)
    out = np.empty(n, np.float32)
    t_dec = best(lambda: fused_entropy.decode_average([payload], table, out=out))
    rows.append(("horovod_aq interleaved rANS (numba), code pairs; decode = decode + scale",
                 8 * (2 * total + 130 * nblk + 16) / n, n / t_enc / 1e6, n / t_dec / 1e6))
    t_full = best(lambda: fused_entropy.encode_entropy(x, table, bucket_size=bucket, key=key))
    t_fixed = best(lambda: codec.fused.encode(x, table, bucket_size=bucket, key=key))
    lines = [
        "# Coder candidates of the entropy-coded wire",
        "",
        "- Command: `python benchmarks/entropy_coders.py`",
        f"- Date: {dt.datetime.now().isoformat(timespec='seconds')}; load average {load} / "
        f"{loadavg()} (a shared machine: compare within the run)",
        f"- Machine: {machine()}; one thread",
        f"- Codes: ALQ {bits}-bit (fitted), n = 1M, bucket {bucket}; empirical entropy "
        f"H = {H:.3f} bits per code",
        "",
        "| coder | bits per code | encode M codes/s | decode M codes/s |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {b:.3f} | {e:.1f} | {d:.1f} |" for name, b, e, d in rows]
    lines += ["", f"Whole payload, same run: `fused_entropy.encode_entropy` {n / t_full / 1e6:.1f}"
              f" M coordinates/s (quantize + code), `fused.encode` (fixed width) "
              f"{n / t_fixed / 1e6:.1f} M coordinates/s.", ""]
    out_path = ROOT / "benchmarks" / "results" / "entropy_coders.md"
    out_path.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
