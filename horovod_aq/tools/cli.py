"""The ``horovod-aq`` command: ``doctor``, ``levels``, ``bench``, ``demo``.

    horovod-aq doctor [--full]   versions, frameworks, controllers, MPI, a codec round trip on
                                 every framework (seconds); --full: 2-rank self-tests (minutes)
    horovod-aq levels --method alq --bits 3 --bucket-size 8192 [--dump grad.npy] [--plot f.png]
    horovod-aq bench [--quick]   kernel throughput and level-refit benchmarks
    horovod-aq demo              train the PyTorch MNIST example on 2 local ranks, fp32 and
                                 ALQ 3-bit from the same seeds (0, 1, 2), compare accuracy and
                                 bytes, and time a step of both on an emulated slow link
                                 (horovod_aq.tools.demo)
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

from horovod_aq.tools import demo
from horovod_aq.tools.repo import repo_path


# ---------------------------------------------------------------------- doctor
def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure is a finding
        return f"missing ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
    return getattr(mod, "__version__", "present")


def selftest_packed_torch() -> dict:
    """Inside a rank: one packed ALQ exchange and one stock-path step; report what came out."""
    import horovod.torch as hvd
    import torch

    import horovod_aq
    import horovod_aq.torch as aqt
    from horovod_aq import codec

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    comp = horovod_aq.ALQ(bits=3, bucket_size=256, schedule="0,0")
    opt = aqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters(), comp, exchange="auto")
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(hvd.rank()))
    model(x).square().mean().backward()
    opt.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    payload = codec.encode(np.linspace(-1, 1, 1000, dtype=np.float32), comp.table,
                           bucket_size=256, seed=0)
    return {"weights": weights, "table": comp.table.levels, "version": comp.table.version,
            "roundtrip": float(np.abs(codec.decode(payload, comp.table)).max()),
            "bits": opt.telemetry.last.bits_per_coordinate}


def selftest_packed_tf() -> dict:
    """Inside a rank: the TensorFlow packed tape on a tiny variable."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import horovod_aq
    import horovod_aq.tensorflow as aqtf

    hvd.init()
    v = tf.Variable(tf.ones([300]))
    comp = horovod_aq.QSGD(bits=4, bucket_size=128)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * float(hvd.rank() + 1))
    tape = aqtf.DistributedGradientTape(tape, compression=comp)
    (g,) = tape.gradient(loss, [v])
    return {"grad": g.numpy()}


def _check_selftests(controller: str) -> list[str]:
    from horovod_aq.tools.launcher import run_local

    problems = []
    try:
        res = run_local([selftest_packed_torch], np=2, controller=controller, timeout=300)
        out = res.get(selftest_packed_torch)
        if not np.array_equal(out[0]["weights"], out[1]["weights"]):
            problems.append(f"{controller}: ranks hold different weights after a packed step")
        if not np.array_equal(out[0]["table"], out[1]["table"]) or out[0]["version"] != 1:
            problems.append(f"{controller}: level tables differ across ranks after the refit")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"{controller}: PyTorch packed-exchange self-test failed: {exc}")
    try:
        res = run_local([selftest_packed_tf], np=2, controller=controller, timeout=300)
        out = res.get(selftest_packed_tf)
        if not np.array_equal(out[0]["grad"], out[1]["grad"]):
            problems.append(f"{controller}: TensorFlow ranks received different gradients")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"{controller}: TensorFlow packed-exchange self-test failed: {exc}")
    return problems


def _codec_case():
    """The quick check's input: an ALQ 3-bit table, 700 heavy-tailed values (two full buckets
    of 256 and a partial one) and a stream key with every field set."""
    import horovod_aq
    from horovod_aq.codec.stream import StreamKey

    comp = horovod_aq.ALQ(bits=3, bucket_size=256)
    x = np.random.default_rng(0).standard_t(3, 700).astype(np.float32)
    return comp, x, StreamKey(seed=7, rank=1, step=2, bucket=3, part=0)


def _roundtrip(framework: str) -> None:
    """One process, no collective: ``framework``'s encode of :func:`_codec_case` is byte for
    byte the numpy oracle's payload, its decode gives the oracle's values, and the stock
    ``compress``/``decompress`` hook returns a finite gradient of the same shape. Raises
    AssertionError saying what differed."""
    from horovod_aq import codec

    comp, x, key = _codec_case()
    payload = codec.encode(x, comp.table, bucket_size=comp.bucket_size, key=key)
    values = codec.decode(payload, comp.table)
    if framework == "numpy":
        assert values.shape == x.shape and np.all(np.isfinite(values)), "oracle decode"
        return
    if framework == "torch":
        import torch

        from horovod_aq.torch import kernels

        ours = kernels.encode(torch.from_numpy(x), comp.table, bucket_size=comp.bucket_size,
                              key=key).numpy()
        decoded = kernels.decode(torch.from_numpy(payload), comp.table).numpy()
        grad = torch.from_numpy(x)
    else:
        import tensorflow as tf

        from horovod_aq.tensorflow import kernels

        ours = kernels.encode(tf.constant(x), comp.table, bucket_size=comp.bucket_size,
                              key=key).numpy()
        decoded = kernels.decode(tf.constant(payload), comp.table).numpy()
        grad = tf.constant(x)
    assert np.array_equal(ours, payload), "encode differs from the numpy oracle's bytes"
    assert np.array_equal(decoded, values), "decode differs from the numpy oracle's values"
    stock = logging.getLogger("horovod_aq")
    level, stock.level = stock.level, logging.ERROR   # the stock path's one-time notice
    try:
        wire, ctx = comp.compress(grad)
        out = np.asarray(comp.decompress(wire, ctx))
    finally:
        stock.setLevel(level)
    assert out.shape == x.shape and np.all(np.isfinite(out)), "stock compress/decompress"


def _check_codec(frameworks: Sequence[str]) -> list[str]:
    problems = []
    for fw in ("numpy", *frameworks):
        try:
            _roundtrip(fw)
        except Exception as exc:  # noqa: BLE001 - any failure is a finding
            problems.append(f"codec round trip ({fw}) failed: {type(exc).__name__}: {exc}; run "
                            "the kernel tests (pytest tests/test_kernels_cross.py)")
    return problems


def doctor(args: argparse.Namespace) -> int:
    """The installation in seconds: versions, MPI, Horovod's extensions and controllers, and a
    single-process codec round trip on every framework present; ``--full`` adds the 2-rank
    self-tests of the packed exchange on every controller (minutes)."""
    print(f"python      {platform.python_version()} ({sys.executable})")
    print(f"platform    {platform.platform()}, {os.cpu_count()} CPUs")
    for mod in ("numpy", "scipy", "torch", "tensorflow", "keras", "tf_keras", "mpi4py",
                "horovod", "horovod_aq"):
        print(f"{mod:<11} {_version(mod)}")
    problems: list[str] = []
    mpirun = shutil.which("mpirun")
    if mpirun:
        first = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
        print(f"MPI         {first.splitlines()[0] if first else 'unknown'} ({mpirun})")
    else:
        problems.append("mpirun not found: install Open MPI (apt-get install openmpi-bin "
                        "libopenmpi-dev) and rebuild Horovod (scripts/setup.sh --force)")
    built = {}
    for fw, mod in (("PyTorch", "horovod.torch"), ("TensorFlow", "horovod.tensorflow")):
        try:
            hv = importlib.import_module(mod)
            built[fw] = hv
            print(f"Horovod/{fw:<10} built (gloo={hv.gloo_built()}, mpi={hv.mpi_built()}, "
                  f"nccl={hv.nccl_built()})")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"Horovod has no working {fw} extension ({str(exc).splitlines()[0]}); "
                            "rebuild it with scripts/setup.sh --force")
    controllers = []
    if built:
        hv = next(iter(built.values()))
        if hv.gloo_built():
            controllers.append("gloo")
        else:
            problems.append("Horovod was built without Gloo")
        if hv.mpi_built() and mpirun:
            controllers.append("mpi")
        elif not hv.mpi_built():
            problems.append("Horovod was built without MPI (HOROVOD_WITH_MPI=1 needs Open MPI "
                            "headers at build time)")
    frameworks = [fw for fw, name in (("torch", "PyTorch"), ("tensorflow", "TensorFlow"))
                  if name in built]
    found = _check_codec(frameworks)
    problems += found
    print(f"codec       encode/decode byte-identical to the numpy oracle, stock hook: "
          f"{', '.join(['numpy', *frameworks])} ... {'ok' if not found else 'FAILED'}")
    if args.full and "PyTorch" in built and "TensorFlow" in built:
        for controller in controllers:
            print(f"self-test   2 ranks, {controller}: packed exchange (PyTorch, TensorFlow) ...",
                  flush=True)
            found = _check_selftests(controller)
            problems += found
            print(f"            {'ok' if not found else 'FAILED'}")
    if problems:
        print("\nproblems:")
        for p in problems:
            print(f"  - {p}")
        return 1
    if args.full:
        print("\nall checks passed")
    else:
        print("\nquick checks passed; horovod-aq doctor --full also runs the 2-rank self-tests "
              f"of the packed exchange ({', '.join(controllers) or 'no controller'}; minutes)")
    return 0


# ---------------------------------------------------------------------- levels
def _synthetic(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal(n)
    if kind == "laplace":
        return rng.laplace(size=n)
    if kind == "student-t":
        return rng.standard_t(3, size=n)
    if kind == "sparse":
        return rng.standard_t(3, size=n) * (rng.random(n) < 0.5)
    raise ValueError(f"unknown synthetic distribution {kind!r}")


def levels(args: argparse.Namespace) -> int:
    import horovod_aq
    from horovod_aq import codec
    from horovod_aq.levels import entropy, expected_variance, huffman_expected_length
    from horovod_aq.refit import LocalComm

    grad = (np.load(args.dump).astype(np.float64).ravel() if args.dump
            else _synthetic(args.synthetic, args.numel, args.seed))
    kwargs = {"bits": args.bits}
    if args.bucket_size:
        kwargs["bucket_size"] = args.bucket_size
    comp = horovod_aq.from_name(args.method, **kwargs)
    if not comp.quantizes:
        print(f"{args.method} does not quantize: no level table")
        return 2
    if comp.adaptive:
        comp.record_gradient(grad)
        comp.end_step(LocalComm())
    B = comp.bucket_size
    table = comp.table
    q = codec.quantize(grad.astype(np.float32), table, bucket_size=B, norm=comp.norm,
                       seed=args.seed)
    measured = float(np.sum((q - grad) ** 2) / np.sum(grad ** 2))
    print(f"{comp!r}")
    print(f"source: {args.dump or args.synthetic + f' ({args.numel} coordinates)'}")
    print(f"levels (v{table.version}, {table.bits} bits): "
          + np.array2string(table.levels, precision=6, max_line_width=100))
    print(f"measured normalized variance E||Q(g)-g||^2/||g||^2 = {measured:.4g} (one draw)")
    x32, key = grad.astype(np.float32), codec.StreamKey(seed=args.seed)
    codes, _ = codec.quantize_codes(x32, table, bucket_size=B, norm=comp.norm,
                                    uniforms=codec.stream_uniforms(x32.size, key))
    coded = codec.encode_entropy(x32, table, bucket_size=B, norm=comp.norm, key=key)
    per = 8.0 / max(1, x32.size)
    print(f"measured: empirical entropy {codec.empirical_entropy(codes, table.num_levels):.3f} "
          f"bits/coordinate; entropy-coded payload {per * coded.size:.3f} bits/coordinate "
          f"(fixed-width {per * codec.payload_size(x32.size, table.bits, B):.3f}, of which "
          f"norms {per * 4 * codec.num_buckets(x32.size, B):.3f}; docs/format.md §12)")
    stats = horovod_aq.levels.BucketStats.from_gradient(grad, B)
    if len(stats):
        dist = stats.mixture()
        print(f"model (truncated-normal mixture): "
              f"B*V = {B * expected_variance(table.levels, dist):.4g}, "
              f"entropy {entropy(table.levels, dist):.3f} bits, Huffman "
              f"{huffman_expected_length(table.levels, dist):.3f} bits/coordinate")
    if args.plot:
        from horovod_aq.tools import plots

        plots.plot_levels(table.levels, args.plot, gradient=grad, bucket_size=B,
                          title=f"{args.method} {table.bits}-bit levels, bucket {B}")
        print(f"wrote {args.plot}")
    return 0


# ---------------------------------------------------------------------- bench
def bench(args: argparse.Namespace) -> int:
    rc = 0
    for script in ("kernels.py", "levels_refit.py"):
        cmd = ([sys.executable, repo_path("benchmarks", script)]
               + (["--quick"] if args.quick else []))
        print("$ " + " ".join(cmd), flush=True)
        rc |= subprocess.call(cmd)
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="horovod-aq", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="check the installation in seconds (--full: 2-rank "
                       "self-tests, minutes)")
    d.add_argument("--full", action="store_true",
                   help="also run the 2-rank self-tests of the packed exchange on Gloo and MPI")
    d.set_defaults(fn=doctor)
    lv = sub.add_parser("levels", help="fit and show a level table")
    lv.add_argument("--method", default="alq")
    lv.add_argument("--bits", type=int, default=3)
    lv.add_argument("--bucket-size", type=int, default=None)
    lv.add_argument("--dump", help="a saved gradient (.npy) instead of synthetic data")
    lv.add_argument("--synthetic", default="student-t",
                    choices=["normal", "laplace", "student-t", "sparse"])
    lv.add_argument("--numel", type=int, default=1 << 20)
    lv.add_argument("--seed", type=int, default=0)
    lv.add_argument("--plot", help="write the table over the gradient density to this PNG")
    lv.set_defaults(fn=levels)
    b = sub.add_parser("bench", help="kernel and refit benchmarks")
    b.add_argument("--quick", action="store_true")
    b.set_defaults(fn=bench)
    dm = sub.add_parser("demo", help="train the PyTorch example on 2 local ranks, fp32 and "
                        "ALQ 3-bit from the same seeds, compare, and time a step on a slow link")
    dm.add_argument("--np", type=int, default=2)
    dm.add_argument("--compression", default="alq", help="the run compared with fp32")
    dm.add_argument("--bits", type=int, default=3)
    dm.add_argument("--epochs", type=int, default=demo.DEMO_EPOCHS)
    dm.add_argument("--lr", type=float, default=demo.DEMO_LR,
                    help=f"learning rate per rank, × the ranks (default {demo.DEMO_LR:g}: half "
                         "the example's, where three seeds resolve the gap to fp32)")
    dm.add_argument("--error-feedback", choices=["auto", "on", "off"], default="auto",
                    help="the example's --error-feedback: auto (the package default: on for "
                         "quantizers of <= 3 bits, docs/quantizers.md §5.9), on or off")
    dm.add_argument("--seeds", default=demo.DEMO_SEEDS,
                    help="comma-separated seeds; each trains both runs from the same weights")
    dm.add_argument("--out", default=demo.DEMO_OUT,
                    help="runs go to OUT/fp32/seed<k> and OUT/<compression><bits>/seed<k>, the "
                         "figure (mean over the seeds) to OUT/curves.png")
    dm.add_argument("--no-progress", action="store_true", help="no progress bar")
    dm.add_argument("--speed", choices=demo.SPEED_CHOICES, default="auto",
                    help="the step-time comparison: auto (time Horovod fp32 against the "
                         "defaults on an emulated 2-host cluster at 100 Mbit/s where this "
                         "machine can: root, ip/tc, a clone of the repository; else the bytes ÷ "
                         "bandwidth model), cluster or model")
    dm.set_defaults(fn=demo.demo)
    args = p.parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
