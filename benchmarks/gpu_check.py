"""GPU check of the Triton kernels (``horovod_aq.torch.triton_kernels``), for a bare CUDA machine.

``benchmarks/gpu_check.sh`` runs ``tests/test_triton_kernels.py`` on the GPU first, then this
script, which needs torch (CUDA) and triton only (no Horovod, no TensorFlow) and measures:

1. the instructions of the compiled kernels (PTX for the GPU's architecture): IEEE division
   (``div.rn.f32``), correctly rounded float64 sqrt, no fused multiply-add (``docs/format.md`` §5);
2. throughput of ``encode`` and ``decode_average`` (P = 2 and 8) on 16M and 64M float32
   coordinates at 2/3/4/8 bits, against a device-to-device copy (``torch.empty_like(x).copy_(x)``)
   timed the same way in the same run (CUDA events, median): GB/s of float32 data (4·n bytes per
   call) and the ratio to the copy (target ≥ 50 %);
2b. the entropy coder (``horovod_aq.torch.triton_entropy``, docs/format.md §12): rANS encode
   and decode of 16M and 64M symbols, checked against the numpy oracle, in GB/s of symbols
   beside DietGPU's published 250–410 GB/s on an A100;
2c. error feedback fused into the encode (``horovod_aq.torch.triton_compensated``, docs/dynamic.md
   §2.6): 64M float32 coordinates at 2/3/4 bits (and B = 1000, the three-pass kernel), against
   the same-run copy and the unfused steps on the device, payload and h' checked bit for bit;
3. a single-process "packed step" of a small model: two ranks' flattened gradients encoded with
   their stream keys, ``decode_average`` of the two payloads, both checked byte for byte against
   the numpy oracle, then applied.

    benchmarks/gpu_check.sh                          # the tests, then this script
    python benchmarks/gpu_check.py --out PATH.md     # default benchmarks/results/gpu.md
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu.md   # CPU: interpreter, tiny sizes

The report (Markdown: device, versions, command, tables) is written to ``--out``. A dry run
measures the interpreter on tiny inputs (numbers meaningless, marked as such) and compiles the
PTX for sm_90 without a GPU. Exit status 1 if a byte-exactness or instruction check fails.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="report path (default benchmarks/results/gpu.md; a dry run prints it "
                        "unless --out is given)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU: Triton's interpreter on tiny inputs, PTX compiled for sm_90")
    p.add_argument("--bucket-size", type=int, default=512)
    p.add_argument("--ptx-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arch", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ptx-kernels", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


args = parse_args()
if args.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
elif args.ptx_only:
    os.environ.pop("TRITON_INTERPRET", None)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.report import machine, markdown_table, versions  # noqa: E402
from horovod_aq import codec  # noqa: E402
from horovod_aq.codec.stream import StreamKey, stream_uniforms  # noqa: E402
from horovod_aq.levels import families  # noqa: E402
from horovod_aq.levels.table import LevelTable  # noqa: E402
from horovod_aq.torch import triton_entropy as te  # noqa: E402
from horovod_aq.torch import triton_kernels as tk  # noqa: E402
from horovod_aq.torch import triton_send as ts  # noqa: E402

TARGET_RATIO = 0.5
BITS = (2, 3, 4, 8)


# ------------------------------------------------------------------------- 1. instructions


def _signature(fn, ptr_types: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ptr_types:
            sig[name] = ptr_types[name]
        else:
            sig[name] = "fp32" if name in ("world_f", "alpha", "beta") else "i32"
    return sig


#: Instructions that would break bit-exactness: approximate division or sqrt, flushing
#: subnormals (.ftz), and fused or fusable float arithmetic (ptxas contracts a plain mul.f32 +
#: add.f32 into an FMA; with enable_fp_fusion=False LLVM writes the non-contractible .rn forms).
APPROXIMATE = (r"div\.(approx|full)", r"rcp\.approx", r"sqrt\.approx", r"\.ftz\b", r"\bfma\.",
               r"\bmad\.[a-z.]*f(32|64)", r"\b(add|sub|mul)\.f(32|64)\b")
_COMPENSATED_PTRS = {"g_ptr": "*fp32", "h_ptr": "*fp32", "norms_ptr": "*fp32",
                     "lev_ptr": "*fp32", "gap_ptr": "*fp32", "codes_ptr": "*u8",
                     "out_ptr": "*fp32", "sq_ptr": "*fp64", "status_ptr": "*i32",
                     "first_ptr": "*i64"}
#: (kernel, pointer types, constexprs, instructions required)
PTX_CASES = [
    ("_decode_kernel", {"rows_ptr": "*u8", "norms_ptr": "*fp32", "lookup_ptr": "*fp32",
                        "out_ptr": "*fp32", "flag_ptr": "*i32", "head_ptr": "*u8"},
     {"BITS": 3, "GROUPS": tk.DECODE_GROUPS, "AVERAGE": True, "POW2_BUCKET": True,
      "WIDE": False, "CHECK_NAN": True, "HEAD": True, "HEADER": 32},
     ("div.rn.f32", "mul.rn.f32", "add.rn.f32")),
    ("_norm_kernel", {"src_ptr": "*fp16", "norms_ptr": "*fp32"},
     {"W": 512, "LOG_W": 9, "ROWS": tk.NORM_BLOCK // 512, "L2": True, "FROM_INPUT": True,
      "WIDE": False, "SQUARES": False},
     ("mul.rn.f64", "add.rn.f64", "sqrt.rn.f64", "cvt.rn.f32.f64")),
    ("_norm_kernel", {"src_ptr": "*fp64", "norms_ptr": "*fp32"},
     {"W": tk.NORM_BLOCK, "LOG_W": tk.NORM_BLOCK.bit_length() - 1, "ROWS": 1, "L2": True,
      "FROM_INPUT": False, "WIDE": False, "SQUARES": False},
     ("add.rn.f64", "sqrt.rn.f64")),
    ("_send_kernel", _COMPENSATED_PTRS,
     {"BITS": 3, "GROUPS": tk.ENCODE_GROUPS, "ROWS": 4, "W": 256, "LOG_W": 8, "LOCAL": True,
      "L2": True, "HAS_H": True, "POW2_BUCKET": True, "WIDE": False, "NEVER": 2**62,
      "MEMORY": True},
     ("div.rn.f32", "mul.rn.f32", "add.rn.f32", "sub.rn.f32", "mul.rn.f64", "add.rn.f64",
      "sqrt.rn.f64", "atom.global")),
    ("_send_kernel", _COMPENSATED_PTRS,
     {"BITS": 8, "GROUPS": tk.ENCODE_GROUPS, "ROWS": 1, "W": 8 * tk.ENCODE_GROUPS,
      "LOG_W": 10, "LOCAL": False, "L2": False, "HAS_H": False, "POW2_BUCKET": False,
      "WIDE": True, "NEVER": 2**62, "MEMORY": True},
     ("div.rn.f32", "mul.rn.f32", "sub.rn.f32", "atom.global")),
    ("_send_kernel", {**_COMPENSATED_PTRS, "g_ptr": "*bf16"},   # the plain encode
     {"BITS": 8, "GROUPS": tk.ENCODE_GROUPS, "ROWS": 1, "W": 8 * tk.ENCODE_GROUPS,
      "LOG_W": 10, "LOCAL": False, "L2": False, "HAS_H": False, "POW2_BUCKET": False,
      "WIDE": True, "NEVER": 2**62, "MEMORY": False},
     ("div.rn.f32", "mul.hi.u32", "atom.global")),
    ("_send_kernel", _COMPENSATED_PTRS,   # the plain one-pass encode (no memory)
     {"BITS": 2, "GROUPS": tk.ENCODE_GROUPS, "ROWS": 2, "W": 512, "LOG_W": 9, "LOCAL": True,
      "L2": True, "HAS_H": False, "POW2_BUCKET": True, "WIDE": False, "NEVER": 2**62,
      "MEMORY": False},
     ("div.rn.f32", "sub.rn.f32", "mul.rn.f64", "add.rn.f64", "sqrt.rn.f64", "atom.global")),
    ("_marker_kernel", {"pay_ptr": "*u8", "first_ptr": "*i64", "head_ptr": "*u8"},
     {"NEVER": 2**62, "MAX_INDEX": 2**32 - 1, "HEADER": 32, "INDEX_AT": 28, "BLOCK": 4096},
     ("st.global",)),
    ("_histogram_kernel", {"codes_ptr": "*u8", "counts_ptr": "*i32"},   # the entropy model's
     {"BINS": 8, "BLOCK": te.HISTOGRAM_BLOCK}, ("atom.global",)),
    ("_partial_kernel", {"src_ptr": "*fp32", "dst_ptr": "*fp64"},
     {"M": 256, "LOG_M": 8, "KT": tk.NORM_BLOCK // 256, "L2": True, "FROM_INPUT": True,
      "WIDE": False},
     ("mul.rn.f64", "add.rn.f64")),
]


def ptx_rows(arch: int, only: str | None = None) -> list[list[object]]:
    """Compile every case (or those of the kernels named in the comma list ``only``) for
    sm_<arch> (no GPU needed) and check its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource


    sends = ts._kernels()
    kernels = {**tk._kernels(), "_send_kernel": sends["send"],
               "_marker_kernel": sends["markers"], "_histogram_kernel": te._histogram_kernel}
    target = GPUTarget("cuda", arch, 32)
    rows = []
    for name, ptrs, constexprs, required in PTX_CASES:
        if only is not None and name not in only.split(","):
            continue
        fn = kernels[name]
        src = ASTSource(fn, _signature(fn, ptrs, constexprs), constexprs)
        compiled = triton.compile(src, target=target,
                                  options={"num_warps": tk.NUM_WARPS, "enable_fp_fusion": False})
        ptx = compiled.asm["ptx"]
        missing = [i for i in required if i not in ptx]
        present = sorted({m.group(0) for pattern in APPROXIMATE
                          for m in re.finditer(pattern, ptx)})
        ok = not missing and not present
        variant = ", ".join(f"{k}={v}" for k, v in constexprs.items()
                            if k not in ("GROUPS", "NEVER"))
        rows.append([name, f"{ptrs[next(iter(ptrs))][1:]}; {variant}",
                     ", ".join(f"{i} ×{ptx.count(i)}" for i in required),
                     ", ".join(present) or "none", "ok" if ok else
                     f"FAIL (missing {missing}, present {present})"])
    return rows


def ptx_section(dry_run: bool) -> tuple[str, bool]:
    """The instruction table; in a dry run compiled in a subprocess without the interpreter."""
    headers = ["kernel", "variant", "required (count)", "forbidden found", "check"]
    if not dry_run:
        major, minor = torch.cuda.get_device_capability()
        rows = ptx_rows(10 * major + minor)
        arch = f"sm_{major}{minor}"
    else:
        import triton.backends
        if "nvidia" not in getattr(triton.backends, "backends", {"nvidia": None}):
            return "Instruction check not run: this triton has no NVIDIA backend.\n", True
        proc = subprocess.run([sys.executable, __file__, "--ptx-only", "--arch", "90"],
                              capture_output=True, text=True, cwd=ROOT, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"the PTX compile failed:\n{proc.stdout[-3000:]}"
                               f"\n{proc.stderr[-3000:]}")
        rows = [line.split("\t") for line in proc.stdout.strip().splitlines()]
        arch = "sm_90 (compiled without a GPU)"
    ok = all(row[-1] == "ok" for row in rows)
    text = (f"PTX for {arch}, compiled with `enable_fp_fusion=False`.\n\n"
            + markdown_table(headers, rows) + "\n")
    return text, ok


# --------------------------------------------------------------------------- 2. throughput


def timed(fn, reps: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` (after one warm-up call); CUDA events on a GPU."""
    fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def throughput_rows(sizes: dict[str, int], bucket_size: int, device: torch.device,
                    reps: int) -> tuple[list[list[object]], bool]:
    rows, all_ok = [], True
    gen = torch.Generator(device=device).manual_seed(0)
    for label, n in sizes.items():
        x = torch.randn(n, generator=gen, device=device, dtype=torch.float32)
        copy_s = timed(lambda: torch.empty_like(x).copy_(x), reps, device)
        gbs = lambda seconds: 4 * n / seconds / 1e9  # noqa: E731 - float32 bytes per second
        rows.append([label, "-", "copy", f"{copy_s * 1e3:.3f}", f"{gbs(copy_s):.1f}", "100 %",
                     "-"])
        for bits in BITS:
            table = LevelTable(families.uniform(bits), 1)
            key = StreamKey(seed=bits, rank=0, step=1)
            out = torch.empty(codec.payload_size(n, bits, bucket_size), dtype=torch.uint8,
                              device=device)
            ops = [("encode", lambda: ts.encode(x, table, bucket_size=bucket_size, key=key,
                                                out=out))]
            payload = ts.encode(x, table, bucket_size=bucket_size, key=key)
            for world in (2, 8):
                gathered = payload.expand(world, -1).contiguous()
                ops.append((f"decode_average P={world}",
                            lambda g=gathered: tk.decode_average(g, table)))
            for op, fn in ops:
                seconds = timed(fn, reps, device)
                ratio = copy_s / seconds
                ok = ratio >= TARGET_RATIO
                all_ok &= ok
                rows.append([label, bits, op, f"{seconds * 1e3:.3f}", f"{gbs(seconds):.1f}",
                             f"{100 * ratio:.0f} %", "yes" if ok else "no"])
    return rows, all_ok


# ---------------------------------------------------------------- 2b. the entropy coder (rANS)

#: DietGPU's published rANS throughput on an A100 (GB/s of uncompressed bytes), for scale.
DIETGPU_A100_GBS = (250, 410)


def entropy_rows(sizes: dict[str, int], device: torch.device, reps: int,
                 check_max: int) -> tuple[list[list[object]], bool]:
    """``horovod_aq.torch.triton_entropy``: encode_symbols / decode_symbols of ALQ-like 3-bit
    code pairs (one uint8 symbol = 2 codes), GB/s of uint8 symbols (DietGPU's unit: bytes of
    uncompressed input) and of the float32 coordinates they carry; words, states and counts
    compared with the numpy oracle (``codec.rans``) up to ``check_max`` symbols."""
    from horovod_aq.codec import entropy_format as ef
    from horovod_aq.codec import rans
    from horovod_aq.torch import triton_entropy as te

    rows, all_ok = [], True
    rng = np.random.default_rng(0)
    probs = np.array([0.0005, 0.02, 0.18, 0.3, 0.3, 0.18, 0.0195, 0.0005])
    for label, n in sizes.items():
        codes = rng.choice(8, size=2 * n, p=probs / probs.sum()).astype(np.uint8)
        f, c = ef.symbol_model(ef.code_table(codes, 8), 3)
        symbols = ef.group_symbols(codes, 3)
        dev = torch.from_numpy(symbols).to(device)
        encoded = te.encode_symbols(dev, f, c)
        words, states, counts = encoded
        ok = True
        if n <= check_max:
            want = rans.encode_symbols(symbols, f, c)
            ok = (np.array_equal(states.cpu().numpy(), want[0])
                  and np.array_equal(counts.cpu().numpy(), want[1])
                  and np.array_equal(words.cpu().numpy(), want[2]))
        back = te.decode_symbols(states, counts, words, f, c, n)
        ok = ok and back is not None and bool(torch.equal(back, dev))
        all_ok &= ok
        bits = 8 * (2 * words.numel() + 130 * states.shape[0]) / (2 * n)
        for op, fn in (("rANS encode", lambda: te.encode_symbols(dev, f, c)),
                       ("rANS decode", lambda: te.decode_symbols(states, counts, words, f, c,
                                                                 n))):
            seconds = timed(fn, reps, device)
            rows.append([label, op, f"{seconds * 1e3:.3f}", f"{n / seconds / 1e9:.1f}",
                         f"{8 * n / seconds / 1e9:.1f}", f"{bits:.3f}",
                         "yes" if ok else ("NO" if n <= check_max else "round trip only")])
    return rows, all_ok


def entropy_encode_rows(sizes: dict[str, int], bucket_size: int, device: torch.device,
                        reps: int, check_max: int) -> tuple[list[list[object]], bool]:
    """Quantize + entropy-code on the device (``horovod_aq.torch.entropy.encode_entropy_triton``:
    the fixed-width Triton encode, a device histogram, the host model, rANS) of float32 vectors
    on a fitted-looking ALQ-like table, in GB/s of float32 input, next to the fixed-width encode;
    payloads compared with ``codec.encode_entropy`` up to ``check_max`` coordinates."""
    from horovod_aq.torch import entropy

    rows, all_ok = [], True
    table = LevelTable(np.array([-1.0, -0.45, -0.18, -0.05, 0.05, 0.18, 0.45, 1.0]), 1)
    gen = torch.Generator(device=device).manual_seed(1)
    for label, n in sizes.items():
        x = torch.randn(n, generator=gen, device=device, dtype=torch.float32)
        key = StreamKey(seed=7, rank=0, step=1)
        payload = entropy.encode_entropy_triton(x, table, bucket_size=bucket_size, key=key)
        ok = True
        if n <= check_max:
            want = codec.encode_entropy(x.cpu().numpy(), table, bucket_size=bucket_size, key=key)
            ok = payload.cpu().numpy().tobytes() == want.tobytes()
        all_ok &= ok
        fixed_s = timed(lambda: ts.encode(x, table, bucket_size=bucket_size, key=key), reps,
                        device)
        coded_s = timed(lambda: entropy.encode_entropy_triton(x, table, bucket_size=bucket_size,
                                                              key=key), reps, device)
        bits = 8 * payload.numel() / n
        rows.append([label, f"{fixed_s * 1e3:.3f}", f"{4 * n / fixed_s / 1e9:.1f}",
                     f"{coded_s * 1e3:.3f}", f"{4 * n / coded_s / 1e9:.1f}", f"{bits:.3f}",
                     "yes" if ok else ("NO" if n <= check_max else "not checked")])
    return rows, all_ok


# ------------------------------------------------------ 2c. error feedback fused into the encode

#: α, β of the fused-encode rows (ALQ 3-bit's default pair, docs/dynamic.md §2.4).
EF_ALPHA, EF_BETA = 0.5103, 0.9
EF_BITS = (2, 3, 4)


def compensated_rows(n: int, bucket_size: int, device: torch.device,
                     reps: int) -> tuple[list[list[object]], bool]:
    """ECQ-SGD's fused send (``horovod_aq.torch.triton_compensated``: x = g + α·h, encode,
    h' = β·h + (g − g̃), flags and S_k, and the one device→host read) of n float32 coordinates
    at 2/3/4 bits — B = ``bucket_size`` (one pass when a power of two ≤ 4096) and B = 1000
    (three passes) at 3 bits — against a device-to-device copy timed in the same run, and
    against the unfused steps on the device (compensate, ``encode``, ``decode``, the memory
    update, its finite check and ‖h'‖², as ``ErrorMemory.update`` and telemetry run them).
    Payload and h' are checked bit for bit against the unfused steps (bitwise the oracle's,
    tests/test_triton_compensated.py)."""

    gen = torch.Generator(device=device).manual_seed(2)
    g = torch.randn(n, generator=gen, device=device, dtype=torch.float32)
    h = 0.1 * torch.randn(n, generator=gen, device=device, dtype=torch.float32)
    out = torch.empty_like(g)
    copy_s = timed(lambda: torch.empty_like(g).copy_(g), reps, device)
    gbs = lambda seconds: 4 * n / seconds / 1e9  # noqa: E731 - float32 bytes of g per second
    rows = [["copy", "-", "-", f"{copy_s * 1e3:.3f}", f"{gbs(copy_s):.1f}", "100 %", "-", "-"]]
    all_ok = True
    cases = [(bits, bucket_size) for bits in EF_BITS] + [(3, 1000)]
    for bits, B in cases:
        table = LevelTable(families.uniform(bits), 1)
        key = StreamKey(seed=bits, rank=0, step=1)

        def fused():
            send = ts.Send(table, bucket_size=B, norm="l2", alpha=EF_ALPHA, beta=EF_BETA,
                           sizes=[n], device=device)
            payload = send.encode(g, h, out, key)
            return payload, send.outcome()

        def unfused():
            x = g + EF_ALPHA * h
            payload = ts.encode(x, table, bucket_size=B, key=key)
            new = EF_BETA * h + (g - tk.decode(payload, table))
            return payload, new, bool(torch.isfinite(new).all()), \
                float(torch.sum(new.to(torch.float64) ** 2))

        payload, found = fused()
        want, new, finite, squares = unfused()
        ok = (found is not None and found[0] == finite and torch.equal(payload, want)
              and torch.equal(out.view(torch.int32), new.view(torch.int32))
              and abs(found[1] - squares) <= 1e-9 * squares)
        all_ok &= ok
        fused_s, unfused_s = timed(fused, reps, device), timed(unfused, reps, device)
        passes = "one" if ts.local_width(min(B, n)) else "three"
        rows.append([f"fused, {passes} pass{'es' if passes == 'three' else ''}", bits, B,
                     f"{fused_s * 1e3:.3f}", f"{gbs(fused_s):.1f}",
                     f"{100 * copy_s / fused_s:.0f} %", f"{unfused_s / fused_s:.1f}×",
                     "yes" if ok else "NO"])
    return rows, all_ok


# -------------------------------------------------------------------------- 3. packed step


def packed_step(device: torch.device, bits: int = 3, bucket_size: int = 128) -> tuple[list, bool]:
    """Two simulated ranks: each encodes its flattened gradient with its stream key; the gathered
    [2, size] rows are averaged; payloads and average are checked against the numpy oracle."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10)).to(device)
    params = list(model.parameters())
    table = LevelTable(families.uniform(bits), 1)
    payloads, oracle_rows, grads = [], [], []
    for rank in range(2):
        model.zero_grad()
        data = torch.randn(16, 32, device=device)
        target = torch.randint(0, 10, (16,), device=device)
        torch.nn.functional.cross_entropy(model(data), target).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        key = StreamKey(seed=1234, rank=rank, step=0, bucket=0)
        payloads.append(ts.encode(flat, table, bucket_size=bucket_size, key=key))
        host = flat.cpu().numpy()
        oracle_rows.append(codec.encode(host, table, bucket_size=bucket_size,
                                        uniforms=stream_uniforms(host.size, key)))
        grads.append(flat)
    gathered = torch.stack(payloads)
    average = tk.decode_average(gathered, table)
    want = codec.decode_average(np.stack(oracle_rows), table)
    payloads_ok = gathered.cpu().numpy().tobytes() == np.stack(oracle_rows).tobytes()
    average_ok = average.cpu().numpy().tobytes() == want.tobytes()
    offset = 0
    for p in params:  # apply the averaged gradient as an optimizer would
        p.grad = average[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    torch.optim.SGD(params, lr=0.1).step()
    true_mean = (grads[0] + grads[1]) / 2
    rel = float((average - true_mean).norm() / true_mean.norm())
    n = average.numel()
    rows = [["packed step", f"{n} parameters, {bits} bits, B = {bucket_size}",
             f"{gathered.shape[1]} B per rank ({4 * n} B float32)",
             "yes" if payloads_ok else "NO", "yes" if average_ok else "NO", f"{rel:.3f}"]]
    return rows, payloads_ok and average_ok


# ------------------------------------------------------------------------------------ main


def main() -> int:
    if args.ptx_only:
        for row in ptx_rows(args.arch or 90, args.ptx_kernels):
            print("\t".join(str(c) for c in row))
        return 0
    if args.dry_run:
        device = torch.device("cpu")
        sizes, reps, device_name = {"4K": 4096, "5000": 5000}, 2, "CPU (Triton interpreter)"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run on CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        sizes, reps = {"16M": 1 << 24, "64M": 1 << 26}, 20
        device_name = torch.cuda.get_device_name(device)
    import triton

    started = time.time()
    ptx_text, ptx_ok = ptx_section(args.dry_run)
    perf, perf_ok = throughput_rows(sizes, args.bucket_size, device, reps)
    fused_ef, fused_ef_ok = compensated_rows(5000 if args.dry_run else 1 << 26,
                                             args.bucket_size, device, reps)
    step, step_ok = packed_step(device)
    coder, coder_ok = entropy_rows({"5000": 5000} if args.dry_run else
                                   {"16M": 1 << 24, "64M": 1 << 26}, device,
                                   reps, 1 << 24)
    coded, coded_ok = entropy_encode_rows({"5000": 5000} if args.dry_run else
                                          {"1M": 1 << 20, "16M": 1 << 24, "64M": 1 << 26},
                                          args.bucket_size, device, reps, 1 << 20)
    script = os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)
    lines = [
        "# Triton kernels on the GPU" + (" (dry run: interpreter, numbers meaningless)"
                                         if args.dry_run else ""),
        "",
        f"- Command: `python {script} {' '.join(sys.argv[1:])}`".rstrip(),
        f"- Date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- Device: {device_name}; host {machine()}",
        f"- Versions: {versions(('numpy', 'torch', 'triton'))}, CUDA {torch.version.cuda}",
        f"- Bucket size {args.bucket_size}, l2 norm, uniform tables; throughput is GB/s of "
        "float32 data (4·n bytes per call), median of "
        f"{reps} calls timed with {'CUDA events' if device.type == 'cuda' else 'perf_counter'}"
        "; `encode` includes its one host sync, `decode_average` its header copy.",
        "",
        "## Instructions",
        "",
        ptx_text,
        "## Throughput",
        "",
        f"Target: at least {100 * TARGET_RATIO:.0f} % of the copy.",
        "",
        markdown_table(["n", "bits", "op", "ms", "GB/s", "vs copy", "≥ target"], perf),
        "",
        "## Error feedback fused into the encode (docs/dynamic.md §2.6)",
        "",
        "`horovod_aq.torch.triton_send.Send` (what the torch wire runs for CUDA float32 "
        "gradients with error feedback): x = g + α·h, bucket norms, codes, packing and "
        "h' = β·h + (g − g̃) in one kernel, the finite flags and per-bucket ‖h'‖² sums read to "
        f"the host once (included); {'5000' if args.dry_run else '64M'} float32 coordinates, "
        "l2. GB/s of float32 g (4·n bytes per call); the one-pass kernel reads g and h and "
        "writes h' (12·n bytes against the copy's 8·n). \"unfused\": the steps it replaces on "
        "the device (compensate, encode, decode, memory update, finite check, ‖h'‖²), same "
        "run; \"= unfused\": payload and h' bit for bit.",
        "",
        markdown_table(["op", "bits", "B", "ms", "GB/s", "vs copy", "unfused / fused",
                        "= unfused"], fused_ef),
        "",
        "## Entropy coder (rANS, docs/format.md §12)",
        "",
        "`horovod_aq.torch.triton_entropy`: interleaved rANS of 3-bit code pairs with an "
        "ALQ-like skew (one uint8 symbol carries 2 coordinates). DietGPU's published rANS: "
        f"{DIETGPU_A100_GBS[0]}–{DIETGPU_A100_GBS[1]} GB/s of uncompressed bytes on an A100 "
        "(compare the symbol column). Includes the host compaction of the words (encode) and "
        "the host read of the status flags (decode).",
        "",
        markdown_table(["symbols", "op", "ms", "GB/s of symbols", "GB/s of float32 "
                        "coordinates", "bits per coordinate", "= oracle"], coder),
        "",
        "## Quantize + entropy-code on the device",
        "",
        "`horovod_aq.torch.entropy.encode_entropy_triton` (what the torch wire calls for CUDA "
        "tensors with `wire=\"entropy\"`): the fixed-width encode, a device histogram of the "
        "codes, the symbol model on the host, rANS; an ALQ-like 3-bit table, GB/s of float32 "
        "input.",
        "",
        markdown_table(["n", "fixed encode ms", "fixed GB/s", "entropy encode ms",
                        "entropy GB/s", "bits per coordinate", "= oracle"], coded),
        "",
        "## Packed step",
        "",
        markdown_table(["check", "model", "payload", "payloads = oracle", "average = oracle",
                        "‖avg − mean‖ / ‖mean‖ (rounding noise)"], step),
        "",
        f"Total {time.time() - started:.0f} s; triton {triton.__version__}.",
    ]
    report = "\n".join(lines) + "\n"
    out = args.out
    if out is None and not args.dry_run:
        out = ROOT / "benchmarks" / "results" / "gpu.md"
    if out is None:
        print(report)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
        print(report)
        print(f"wrote {out}")
    summary = (f"instructions {'ok' if ptx_ok else 'FAILED'}; fused error feedback "
               f"{'ok' if fused_ef_ok else 'FAILED'}; packed step "
               f"{'ok' if step_ok else 'FAILED'}; entropy coder "
               f"{'ok' if coder_ok else 'FAILED'}; entropy encode "
               f"{'ok' if coded_ok else 'FAILED'}; throughput "
               f"{'meets' if perf_ok else 'misses'} the {100 * TARGET_RATIO:.0f} % target")
    print(summary)
    return 0 if ptx_ok and fused_ef_ok and step_ok and coder_ok and coded_ok else 1


if __name__ == "__main__":
    sys.exit(main())
