"""``horovod-aq demo``: the PyTorch MNIST example (``examples/pytorch_mnist.py``) trained under
horovodrun on 2 local ranks, with fp32 gradients (NoCompression) and with ``--compression``
(ALQ 3-bit by default), both from the same seeds (0, 1, 2), hyperparameters, initial weights
and sample order. It then prints one headline (the paired test-accuracy gap with its standard
error, and how many fewer gradient bytes the compressed runs sent, from rank 0's telemetry),
one speed line (a step of Horovod's fp32 allreduce against the library's defaults, timed on
``benchmarks/cluster.py``'s emulated 2-host cluster at 100 Mbit/s where this machine can build
it, else the bytes ÷ bandwidth model), and where the figure (``curves.png``) and the runs are.

The lines themselves come from :mod:`horovod_aq.tools.demo_report` (pure functions).
:func:`horovodrun_path`, :func:`launch`, :func:`cluster_unavailable` and :func:`time_cluster`
are the demo's seams: everything it starts goes through them, so a test can stand a fake
launcher or cluster in without starting processes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

from horovod_aq.tools.demo_report import (
    cluster_speed,
    format_headline,
    format_speed_measured,
    format_speed_model,
)
from horovod_aq.tools.repo import REPO_ROOT, repo_path

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


# ------------------------------------------------------------ demo: the runs
def horovodrun_path() -> str:
    """The horovodrun the demo launches the example with: the one next to this Python, else
    the one on PATH. One of the demo's seams (with :func:`launch`): a test returns any name
    here and stands a fake in for :func:`launch`."""
    from horovod_aq.tools.launcher import _horovodrun as find

    return find()


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


def launch(cmd: list[str]) -> subprocess.Popen:
    """Start one run of the example: ``cmd`` (horovodrun and its arguments) with the demo's
    environment (:data:`DEMO_ENV`), its stdout and stderr together on one text pipe. The demo's
    seam for the launch: a stand-in returns anything with ``stdout`` (the output's lines) and
    ``wait()`` (the exit code)."""
    return subprocess.Popen(cmd, env=_demo_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")


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
    cmd = [horovodrun_path(), "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo",
           sys.executable, repo_path("examples", "pytorch_mnist.py"),
           "--compression", compression, "--bits", str(args.bits), "--seed", str(seed),
           "--epochs", str(args.epochs), "--lr", str(args.lr),
           "--error-feedback", args.error_feedback, "--out", out, "--no-progress"]
    log_path = os.path.join(out, "horovodrun.log")
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        proc = launch(cmd)
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


# ------------------------------------------------------------ demo: the speed comparison
def cluster_unavailable() -> str | None:
    """Why the demo cannot time the emulated cluster here (None: it can try): no
    ``benchmarks/cluster.py`` clone, not Linux, not root, or no ip/tc/unshare/hostname. The
    demo's seam for whether it times the cluster (``--speed auto``) or shows the model."""
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
    reason = cluster_unavailable()
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


def time_cluster(out: str) -> dict | str:
    """Run ``benchmarks/cluster.py``'s quick cluster for :data:`CLUSTER_MODES`; its results
    (:func:`~horovod_aq.tools.demo_report.cluster_speed`), or why there are none. Its output
    goes to ``out/cluster.log``. The demo's seam for the cluster timing: a stand-in returns
    such a dict (the measured speed line) or a reason (the model, with that reason)."""
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
        speed = time_cluster(out)
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

