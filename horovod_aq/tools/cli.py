"""The ``horovod-aq`` command: ``doctor``, ``levels``, ``bench``, ``demo``.

    horovod-aq doctor [--full]   versions, frameworks, controllers, MPI, a codec round trip on
                                 every framework (seconds); --full: 2-rank self-tests (minutes)
    horovod-aq levels --method alq --bits 3 --bucket-size 8192 [--dump grad.npy] [--plot f.png]
    horovod-aq bench [--quick]   kernel throughput and level-refit benchmarks
    horovod-aq demo              train the PyTorch MNIST example on 2 local ranks, fp32 and
                                 ALQ 3-bit from the same seeds (0, 1, 2), compare accuracy and
                                 bytes, and time a step of both on an emulated slow link
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_EPOCHS = 5
#: The demo's seeds: one seed is noisy (fp32 itself moves by a point or more between seeds);
#: three give the paired gap a standard error.
DEMO_SEEDS = "0,1,2"
#: The demo's learning rate per rank (the example's --lr, × the ranks): half the example's
#: 0.05, which sits near this model's stability edge, where the paired gap to fp32 spreads by
#: 0.7–1.7 pt from seed to seed; at half of it by about 0.4 (docs/quantizers.md §5.10,
#: benchmarks/results/demo.md), so three seeds resolve it.
DEMO_LR = 0.025
DEMO_OUT = "demo_output"
#: The demo's reference run: the same example with NoCompression (fp32 gradients).
DEMO_BASELINE = "none"
#: The headline calls a gap real from this many standard errors of the paired difference on;
#: under it, "within noise".
NOISE_SE = 2.0


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


# ---------------------------------------------------------------------- bench / demo
def _repo_path(*parts: str) -> str:
    path = os.path.join(REPO_ROOT, *parts)
    if not os.path.exists(path):
        raise SystemExit(f"{os.path.join(*parts)} not found next to the installed package "
                         f"({REPO_ROOT}); run this from a clone of the horovod_aq repository")
    return path


def bench(args: argparse.Namespace) -> int:
    rc = 0
    for script in ("kernels.py", "levels_refit.py"):
        cmd = ([sys.executable, _repo_path("benchmarks", script)]
               + (["--quick"] if args.quick else []))
        print("$ " + " ".join(cmd), flush=True)
        rc |= subprocess.call(cmd)
    return rc


def _horovodrun() -> str:
    from horovod_aq.tools.launcher import _horovodrun as find

    return find()


#: One line of horovodrun's output: ``[rank]<stdout|stderr>:text`` (a regular expression).
RANK_LINE = r"^\[(\d+)\]<(stdout|stderr)>:(.*)$"
#: Lines of a run's output the demo shows (the rest is in the run's horovodrun.log).
PROBLEM_LINE = r"\b(WARNING|ERROR|CRITICAL|Traceback)\b|\w+Error\b|exit with status code"
#: Start-up chatter of TensorFlow, absl and gRPC that the demo never shows, though it says
#: WARNING (the run's log keeps it): absl's notice before ``InitializeLog``, oneDNN's and the
#: CPU-instruction notices, CUDA plugin registrations on a CPU-only machine.
NOISE_LINE = (r"absl::InitializeLog|oneDNN custom operations|TF_ENABLE_ONEDNN_OPTS|"
              r"cpu_feature_guard|This TensorFlow binary is optimized|rebuild TensorFlow with|"
              r"Unable to register cu(DNN|FFT|BLAS) factory|could not find cuda drivers|"
              r"computation placer already registered")
#: The environment of every process the demo starts (on top of its own): one compute thread
#: per rank (2 ranks share the cores), TensorFlow, absl and gRPC quiet below errors, unbuffered
#: output so the progress bar follows the epochs.
DEMO_ENV = {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "3", "TF_CPP_MIN_VLOG_LEVEL": "0",
            "ABSL_MIN_LOG_LEVEL": "2", "GLOG_minloglevel": "2", "GRPC_VERBOSITY": "ERROR",
            "PYTHONUNBUFFERED": "1"}

#: The speed comparison: ``auto`` times the emulated cluster where this machine can build it
#: (root, ``ip``/``tc``, a clone of the repository), else shows the model; ``cluster`` or
#: ``model`` insist on one.
SPEED_CHOICES = ("auto", "cluster", "model")
#: The cluster timing reuses ``benchmarks/cluster.py`` (not installed with the package, so it
#: runs as a script of the clone): its quick cluster, 2 hosts at 100 Mbit/s and an MLP of 0.8M
#: parameters, with Horovod's fp32 allreduce against the library's defaults (``ALQ(bits=3)`` and
#: nothing else), ``CLUSTER_ROUNDS`` rounds of ``CLUSTER_STEPS`` steps of each (the first round
#: untimed). About a minute on 2 cores, mostly rank start-up.
CLUSTER_SCRIPT = ("benchmarks", "cluster.py")
CLUSTER_MODES = ("hvd_fp32", "defaults")
CLUSTER_ROUNDS = 4
CLUSTER_STEPS = 3
#: cluster.py's limit on its launch (s), and what the demo adds before it stops cluster.py
#: (SIGTERM: it tears its namespaces down) and then its whole process tree.
CLUSTER_TIMEOUT_S = 150
CLUSTER_GRACE_S = 30
#: What the emulated cluster needs on PATH (Debian iproute2, util-linux, hostname): where one
#: is missing the demo shows the model rather than let cluster.py install packages.
CLUSTER_TOOLS = ("ip", "tc", "unshare", "hostname")
#: Link rates (Mbit/s) of the model shown where no cluster can be timed.
MODEL_RATES_MBIT = (100.0, 1000.0)


class _DemoProgress:
    """One progress bar over every epoch of every run (tqdm, when installed and wanted), or
    none; :meth:`write` prints above the bar."""

    def __init__(self, total: int, show: bool) -> None:
        self.bar = None
        if show:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, unit="epoch", desc="demo", dynamic_ncols=True,
                                file=sys.stderr)

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _demo_env() -> dict[str, str]:
    """This process's environment with :data:`DEMO_ENV` over it."""
    return dict(os.environ, **DEMO_ENV)


def _demo_run(args: argparse.Namespace, compression: str, seed: int, out: str,
              progress: _DemoProgress) -> dict | int:
    """One run of the example under horovodrun into ``out``; what it recorded, or its exit code.

    The example runs without its own bar (horovodrun prefixes every line of every rank); its
    whole output goes to ``out/horovodrun.log``, rank 0's epoch lines advance ``progress``, and
    only warnings and errors are shown (not :data:`NOISE_LINE`). The bytes are rank 0's
    telemetry (``telemetry.jsonl``: what the packed optimizer put on the wire each step),
    summed over the run."""
    import re

    rank_line, problem_line = re.compile(RANK_LINE), re.compile(PROBLEM_LINE)
    noise_line = re.compile(NOISE_LINE)
    os.makedirs(out, exist_ok=True)
    for stale in ("metrics.json", "telemetry.jsonl"):
        if os.path.exists(os.path.join(out, stale)):
            os.remove(os.path.join(out, stale))
    cmd = [_horovodrun(), "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo",
           sys.executable, _repo_path("examples", "pytorch_mnist.py"),
           "--compression", compression, "--bits", str(args.bits), "--seed", str(seed),
           "--epochs", str(args.epochs), "--lr", str(args.lr),
           "--error-feedback", args.error_feedback, "--out", out, "--no-progress"]
    log_path = os.path.join(out, "horovodrun.log")
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, env=_demo_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace")
        for line in proc.stdout:
            log.write(line)
            m = rank_line.match(line)
            text = (m.group(3) if m else line).rstrip("\n")
            if m and m.group(1) == "0" and m.group(2) == "stdout" and text.startswith("epoch "):
                progress.update()
            elif problem_line.search(text) and not noise_line.search(text):
                progress.write(f"  {line.rstrip()}")
        returncode = proc.wait()
    if returncode:
        with open(log_path) as f:
            tail = f.readlines()[-40:]
        progress.write(f"demo: {compression} seed {seed} failed (exit {returncode}); the end of "
                       f"{log_path}:\n" + "".join(tail))
        return returncode
    with open(os.path.join(out, "metrics.json")) as f:
        metrics = json.load(f)
    with open(os.path.join(out, "telemetry.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {"label": metrics["summary"]["label"], "out": out, "seed": seed,
            "summary": metrics["summary"], "epochs": metrics["epochs"],
            "steps": len(records), "bytes_sent": sum(r["bytes_sent"] for r in records)}


def _mean_epochs(runs: list[dict]) -> list[dict]:
    """The epochs of several seeds' runs, averaged field by field (step losses step by step)."""
    out = []
    for epochs in zip(*(r["epochs"] for r in runs)):
        mean = {k: float(np.mean([e[k] for e in epochs]))
                for k in ("train_loss", "test_loss", "test_acc")}
        mean["step"] = epochs[0]["step"]
        if all("step_loss" in e for e in epochs):
            mean["step_loss"] = np.mean([e["step_loss"] for e in epochs], axis=0).tolist()
        out.append(mean)
    return out


# ------------------------------------------------------------ demo: what it prints (pure)
def paired_gap(diffs: Sequence[float]) -> tuple[float, float | None]:
    """The mean of per-seed differences (points) and its standard error, sample std / √n
    (None for one seed: one difference has no spread)."""
    mean = float(np.mean(diffs))
    if len(diffs) < 2:
        return mean, None
    return mean, float(np.std(diffs, ddof=1) / np.sqrt(len(diffs)))


def gap_phrase(mean: float, se: float | None, *, label: str, base: str = "fp32") -> str:
    """What the gap says: "within noise" when it is under :data:`NOISE_SE` standard errors
    (or exactly zero), else its size and side; with one seed, that one seed cannot tell."""
    where = "above" if mean > 0 else "below"
    if se is None:
        return (f"{label} is {abs(mean):.1f} pt {where} {base} in test accuracy on one seed, "
                "which cannot tell a gap from seed noise (--seeds 0,1,2 gives a standard error)")
    if mean == 0 or abs(mean) < NOISE_SE * se:
        return f"{label} matches {base} within noise in test accuracy: {mean:+.2f} ± {se:.2f} pt"
    return (f"{label} is {abs(mean):.2f} ± {se:.2f} pt {where} {base} in test accuracy, "
            "beyond noise")


def format_headline(*, label: str, base: str, acc_base: Sequence[float],
                    acc_comp: Sequence[float], seeds: Sequence[int], sent_base: float,
                    sent_comp: float, steps: int, bits: float) -> str:
    """The demo's closing line: the paired accuracy gap with its standard error (accuracies in
    percent, one per seed, paired by seed) and the gradient bytes both runs sent (rank 0)."""
    mean, se = paired_gap([c - b for b, c in zip(acc_base, acc_comp)])
    seed_text = ", ".join(map(str, seeds))
    spread = ("" if se is None else
              f"mean ± standard error of the paired difference over seeds {seed_text}, each pair "
              f"from the same initial weights and sample order; within noise = under "
              f"{NOISE_SE:g} standard errors; ")
    mib = 2.0 ** 20
    return (f"demo done: {gap_phrase(mean, se, label=label, base=base)} ({spread}{base} "
            f"{np.mean(acc_base):.2f}%, {label} {np.mean(acc_comp):.2f}%); {label} sent "
            f"{sent_base / sent_comp:.1f}x fewer gradient bytes than {base} "
            f"({sent_comp / mib:.2f} vs {sent_base / mib:.2f} MiB over {steps} steps, rank 0 "
            f"telemetry; {bits:.2f} bits per coordinate)")


def _rate_text(mbit: float) -> str:
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


def cluster_speed(result: dict) -> dict:
    """The speed line's numbers from ``benchmarks/cluster.py --json``'s results: the cluster
    (hosts, Mbit/s), the model's parameters, and per mode of :data:`CLUSTER_MODES` the median
    step (s) and the bytes out of each host per step, over the timed steps."""
    res = result["results"][0]
    s = res["summary"]
    return {"hosts": res["hosts"], "rate": res["rate"], "params": res["params"],
            "steps": s["defaults"]["steps"],
            "fp32_s": s["hvd_fp32"]["median"], "aq_s": s["defaults"]["median"],
            "fp32_bytes": s["hvd_fp32"]["tx_mean"], "aq_bytes": s["defaults"]["tx_mean"]}


def format_speed_measured(speed: dict) -> str:
    """The speed line from a timed emulated cluster (:func:`cluster_speed`)."""
    return (f"speed, measured: a training step on an emulated cluster of {speed['hosts']} hosts "
            f"linked at {_rate_text(speed['rate'])} (network namespaces shaped with tc, "
            f"horovodrun over Gloo; an MLP of {speed['params'] / 1e6:.2f}M parameters, "
            f"benchmarks/cluster.py) took {speed['aq_s']:.3f} s with horovod_aq.ALQ(bits=3) and "
            f"every other default against {speed['fp32_s']:.3f} s with Horovod's fp32 "
            f"allreduce: {speed['fp32_s'] / speed['aq_s']:.1f}x faster (medians of "
            f"{speed['steps']} steps each; {speed['aq_bytes'] / 1e6:.2f} vs "
            f"{speed['fp32_bytes'] / 1e6:.2f} MB out of each host per step)")


def format_speed_model(*, label: str, base: str, bytes_comp: float, bytes_base: float,
                       reason: str, rates: Sequence[float] = MODEL_RATES_MBIT) -> str:
    """The speed line where no cluster was timed: the bytes one rank sent per step (measured)
    and what they take on links of ``rates`` Mbit/s by bytes ÷ bandwidth (a model)."""
    from horovod_aq.packed.cost import transfer_seconds

    links = ", ".join(
        f"{1e3 * transfer_seconds(bytes_comp, r):.2f} vs "
        f"{1e3 * transfer_seconds(bytes_base, r):.2f} ms on {_rate_text(r)}" for r in rates)
    return (f"speed, modelled (not measured: {reason}): each rank sent {bytes_comp / 1e3:.1f} kB "
            f"of gradients per step with {label} against {bytes_base / 1e3:.1f} kB with {base} "
            f"(measured, rank 0 telemetry); bytes ÷ bandwidth puts the transfer at {links} per "
            f"step, {bytes_base / bytes_comp:.1f}x shorter (a model: latency, compute and their "
            "overlap left out; horovod_aq.packed.cost.transfer_seconds)")


# ------------------------------------------------------------ demo: the speed comparison
def _cluster_unavailable() -> str | None:
    """Why the demo cannot time the emulated cluster here (None: it can try)."""
    if not os.path.exists(os.path.join(REPO_ROOT, *CLUSTER_SCRIPT)):
        return (f"no {'/'.join(CLUSTER_SCRIPT)} next to the installed package; a clone of "
                "the repository has it")
    if not sys.platform.startswith("linux"):
        return "the emulated cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, tc); run the demo as root"
    missing = [tool for tool in CLUSTER_TOOLS if shutil.which(tool) is None]
    if missing:
        return (f"no {', '.join(missing)} on PATH: apt-get install iproute2 util-linux "
                f"hostname, or python {'/'.join(CLUSTER_SCRIPT)} --setup")
    return None


def _speed_source(choice: str) -> tuple[str, str | None]:
    """("cluster", None) when the demo will time the emulated cluster, else ("model", why not);
    ("cluster", why not) when ``--speed cluster`` asks for what this machine cannot do."""
    if choice == "model":
        return "model", "--speed model"
    reason = _cluster_unavailable()
    if choice == "cluster" or reason is None:
        return "cluster", reason
    return "model", reason


def _stop(proc: subprocess.Popen, timeout: float) -> int | None:
    """The exit code of ``proc``, or None when it ran past ``timeout`` s and was stopped:
    SIGTERM first (cluster.py tears its namespaces down), then its whole process tree."""
    from horovod_aq.tools.launcher import kill_tree

    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=CLUSTER_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        kill_tree(proc.pid)
        return None


def _last_line(path: str) -> str:
    with open(path, errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    return lines[-1] if lines else "no output"


def _time_cluster(out: str) -> dict | str:
    """Run ``benchmarks/cluster.py``'s quick cluster for :data:`CLUSTER_MODES`; its results
    (:func:`cluster_speed`), or why there are none. Its output goes to ``out/cluster.log``."""
    os.makedirs(out, exist_ok=True)
    result_path, log_path = os.path.join(out, "cluster.json"), os.path.join(out, "cluster.log")
    if os.path.exists(result_path):
        os.remove(result_path)
    cmd = [sys.executable, os.path.join(REPO_ROOT, *CLUSTER_SCRIPT), "--quick",
           "--modes", ",".join(CLUSTER_MODES), "--rounds", str(CLUSTER_ROUNDS),
           "--steps", str(CLUSTER_STEPS), "--timeout", str(CLUSTER_TIMEOUT_S),
           "--json", result_path]
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, env=_demo_env(), cwd=REPO_ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        rc = _stop(proc, CLUSTER_TIMEOUT_S + CLUSTER_GRACE_S)
    if rc is None:
        return f"{'/'.join(CLUSTER_SCRIPT)} ran past {CLUSTER_TIMEOUT_S + CLUSTER_GRACE_S} s " \
               f"and was stopped (its output: {log_path})"
    if rc or not os.path.exists(result_path):
        return (f"{'/'.join(CLUSTER_SCRIPT)} exited with {rc}: {_last_line(log_path)} "
                f"(its output: {log_path})")
    with open(result_path) as f:
        return cluster_speed(json.load(f))


def _speed_line(source: tuple[str, str | None], pairs: list, out: str) -> str:
    """The measured speed line from the emulated cluster, or, where it cannot run or failed,
    the model from the demo runs' own bytes per step."""
    kind, reason = source
    if kind == "cluster":
        print(f"demo: timing a step of Horovod fp32 and of horovod_aq's defaults on an emulated "
              f"2-host cluster at 100 Mbit/s ({'/'.join(CLUSTER_SCRIPT)}; about a minute) ...",
              flush=True)
        speed = _time_cluster(out)
        if isinstance(speed, dict):
            return format_speed_measured(speed)
        reason = speed
    base, comp = (sum(p[i]["bytes_sent"] for p in pairs) / sum(p[i]["steps"] for p in pairs)
                  for i in (0, 1))
    return format_speed_model(label=pairs[0][1]["label"], base=pairs[0][0]["label"],
                              bytes_comp=comp, bytes_base=base, reason=str(reason))


# ------------------------------------------------------------ demo: the command
def _demo_seeds(text: str) -> list[int]:
    """The ``--seeds`` list; empty when it is not a comma-separated list of integers."""
    try:
        return [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        return []


def _demo_refusal(args: argparse.Namespace, seeds: list[int],
                  source: tuple[str, str | None]) -> str | None:
    """What is wrong with the demo's arguments, before anything trains (None: nothing)."""
    if args.compression == DEMO_BASELINE:
        return f"--compression {DEMO_BASELINE} is the baseline itself; pick a quantizer"
    if not seeds:
        return f"--seeds must be a comma-separated list of integers, got {args.seeds!r}"
    kind, reason = source
    if kind == "cluster" and reason:
        return f"--speed cluster: {reason}; or --speed model"
    return None


def _train_pairs(args: argparse.Namespace, seeds: list[int], out: str) -> list | int:
    """fp32 and ``--compression`` runs for every seed, as [(fp32 run, compressed run)], or the
    exit code of the first run that failed."""
    names = ("fp32", f"{args.compression}{args.bits}")
    progress = _DemoProgress(2 * len(seeds) * args.epochs, show=not args.no_progress)
    pairs = []
    try:
        for seed in seeds:
            pair = []
            for compression, name in zip((DEMO_BASELINE, args.compression), names):
                run = _demo_run(args, compression, seed, os.path.join(out, name, f"seed{seed}"),
                                progress)
                if isinstance(run, int):
                    return run
                progress.write(f"  seed {seed}: {run['label']:<12} test accuracy "
                               f"{100 * run['summary']['test_acc']:.1f}%")
                pair.append(run)
            pairs.append(pair)
    finally:
        progress.close()
    return pairs


def _pair_problems(pairs: list) -> list[str]:
    """Where the two runs of a seed did not start alike or did not record the same steps."""
    problems = []
    for base, comp in pairs:
        problems += [f"seed {base['seed']}: {key}: {base['summary'].get(key)} vs "
                     f"{comp['summary'].get(key)}"
                     for key in ("init_fingerprint", "order_fingerprint", "steps")
                     if base["summary"].get(key) != comp["summary"].get(key)]
        if base["steps"] != comp["steps"] or not comp["bytes_sent"]:
            problems.append(f"seed {base['seed']}: telemetry: {base['steps']} vs "
                            f"{comp['steps']} steps recorded, {base['bytes_sent']} vs "
                            f"{comp['bytes_sent']} bytes")
    return problems


def _demo_figure(args: argparse.Namespace, pairs: list, seeds: list[int], out: str) -> str:
    """Both runs' curves, mean over the seeds, in ``out/curves.png``; its path, or why none."""
    figure = os.path.join(out, "curves.png")
    seed_text = (f"seed {seeds[0]}" if len(seeds) == 1
                 else f"mean over seeds {', '.join(map(str, seeds))}")
    base_label, comp_label = pairs[0][0]["label"], pairs[0][1]["label"]
    try:
        from horovod_aq.tools import plots

        plots.plot_steps({label: _mean_epochs([p[i] for p in pairs])
                          for i, label in enumerate((base_label, comp_label))}, figure,
                         title=f"MNIST subset, {args.np} ranks, lr {args.lr:g}, {seed_text}: "
                               f"{base_label} vs {comp_label}")
    except ImportError as exc:
        return f"none ({exc})"
    return figure


def demo(args: argparse.Namespace) -> int:
    """fp32 (NoCompression) and ``--compression`` from the same seeds; then one headline (the
    paired accuracy gap with its standard error, the byte ratio), one speed line (a timed
    emulated cluster, or the bytes ÷ bandwidth model) and where the figure and runs are."""
    seeds = _demo_seeds(args.seeds)
    source = _speed_source(args.speed)
    refusal = _demo_refusal(args, seeds, source)
    if refusal:
        print(f"demo: {refusal}", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    print(f"demo: the MNIST example on {args.np} local ranks, {args.epochs} epochs, learning "
          f"rate {args.lr:g} per rank, seed{'s' if len(seeds) > 1 else ''} "
          f"{', '.join(map(str, seeds))}: fp32 and --compression {args.compression} --bits "
          f"{args.bits} --error-feedback {args.error_feedback}, with the same hyperparameters, "
          "initial weights and sample order for both", flush=True)
    pairs = _train_pairs(args, seeds, out)
    if isinstance(pairs, int):
        return pairs
    problems = _pair_problems(pairs)
    if problems:
        print("demo: the two runs did not start alike or did not record the same steps: "
              + "; ".join(problems), file=sys.stderr)
        return 1
    figure = _demo_figure(args, pairs, seeds, out)
    speed = _speed_line(source, pairs, out)
    print("\n" + format_headline(
        label=pairs[0][1]["label"], base=pairs[0][0]["label"],
        acc_base=[100 * p[0]["summary"]["test_acc"] for p in pairs],
        acc_comp=[100 * p[1]["summary"]["test_acc"] for p in pairs], seeds=seeds,
        sent_base=sum(p[0]["bytes_sent"] for p in pairs),
        sent_comp=sum(p[1]["bytes_sent"] for p in pairs),
        steps=sum(p[1]["steps"] for p in pairs),
        bits=float(np.mean([p[1]["summary"]["bits_per_coordinate"] for p in pairs]))))
    print(speed)
    print(f"figure {figure}; runs and logs in {out}/", flush=True)
    return 0


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
    dm.add_argument("--epochs", type=int, default=DEMO_EPOCHS)
    dm.add_argument("--lr", type=float, default=DEMO_LR,
                    help=f"learning rate per rank, × the ranks (default {DEMO_LR:g}: half the "
                         "example's, where three seeds resolve the gap to fp32)")
    dm.add_argument("--error-feedback", choices=["auto", "on", "off"], default="auto",
                    help="the example's --error-feedback: auto (the package default: on for "
                         "quantizers of <= 3 bits, docs/quantizers.md §5.9), on or off")
    dm.add_argument("--seeds", default=DEMO_SEEDS,
                    help="comma-separated seeds; each trains both runs from the same weights")
    dm.add_argument("--out", default=DEMO_OUT,
                    help="runs go to OUT/fp32/seed<k> and OUT/<compression><bits>/seed<k>, the "
                         "figure (mean over the seeds) to OUT/curves.png")
    dm.add_argument("--no-progress", action="store_true", help="no progress bar")
    dm.add_argument("--speed", choices=SPEED_CHOICES, default="auto",
                    help="the step-time comparison: auto (time Horovod fp32 against the "
                         "defaults on an emulated 2-host cluster at 100 Mbit/s where this "
                         "machine can: root, ip/tc, a clone of the repository; else the bytes ÷ "
                         "bandwidth model), cluster or model")
    dm.set_defaults(fn=demo)
    args = p.parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
