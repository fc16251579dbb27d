"""The examples (short runs on 2 ranks under horovodrun) and the ``horovod-aq`` command."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from horovod_aq.packed import cost
from horovod_aq.tools import cli
from horovod_aq.tools.launcher import RANK_ENV, _horovodrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_TIMEOUT = 600


def _run_example(script: str, tmp_path, *args: str, controller: str = "gloo") -> dict:
    out = tmp_path / script.replace(".py", "")
    cmd = [_horovodrun(), "-np", "2", "-H", "localhost:2", f"--{controller}",
           sys.executable, os.path.join(ROOT, "examples", script), "--out", str(out),
           "--no-progress", *args]
    env = dict(os.environ, **RANK_ENV)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "metrics.json") as f:
        metrics = json.load(f)
    telemetry = [json.loads(line) for line in open(out / "telemetry.jsonl")] \
        if (out / "telemetry.jsonl").exists() else []
    return {"metrics": metrics, "telemetry": telemetry, "stdout": proc.stdout, "out": out}


@pytest.mark.multiprocess
@pytest.mark.parametrize("script", ["pytorch_mnist.py", "tensorflow_mnist.py", "keras_mnist.py"])
def test_example_alq(tmp_path, script):
    run = _run_example(script, tmp_path, "--compression", "alq", "--bits", "3",
                       "--epochs", "1", "--bucket-size", "1024")
    summary = run["metrics"]["summary"]
    assert summary["test_acc"] > 0.3                       # chance is 0.1
    tele = run["telemetry"]
    assert tele, "rank 0 wrote no telemetry"
    # one fused bucket holds every parameter; allgather on 2 ranks: bytes sent = (P−1)·payload.
    # TF sends fixed-width payloads; torch's wire="auto" (its default) sends entropy-coded ones
    # on half of its measurement steps (docs/protocol.md §5.5), never larger than fixed-width
    numel = tele[0]["numel_quantized"]
    payload = cost.payload_bytes(numel, 3, 1024)
    for rec in tele:
        assert rec["payload_bytes"] == payload or (
            script == "pytorch_mnist.py" and 0 < rec["payload_bytes"] < payload)
        assert rec["bytes_sent"] == rec["payload_bytes"]
        assert rec["bytes_fp32"] == 4 * numel              # 2(P−1)/P·4n at P = 2
        assert math.isclose(rec["bits_per_coordinate"], 8 * rec["payload_bytes"] / numel)
    assert tele[0]["payload_bytes"] == payload           # the warm-up steps: fixed width
    if script == "pytorch_mnist.py":
        assert any(rec["payload_bytes"] < payload for rec in tele)   # measured entropy-coded
    assert tele[0]["refit"] and tele[0]["table_version"] == 1
    assert summary["compression_ratio"] == pytest.approx(
        4 * numel * len(tele) / sum(rec["payload_bytes"] for rec in tele), rel=1e-9)
    assert "test accuracy" in run["stdout"] and "fp32 allreduce would send" in run["stdout"]
    for png in ("curves.png", "levels.png"):
        assert (run["out"] / png).stat().st_size > 10_000


@pytest.mark.multiprocess
def test_pytorch_example_stock_path_and_mpi(tmp_path):
    run = _run_example("pytorch_mnist.py", tmp_path, "--compression", "qsgdinf", "--bits", "4",
                       "--exchange", "stock", "--epochs", "1", controller="mpi")
    summary = run["metrics"]["summary"]
    assert summary["test_acc"] > 0.3
    assert summary["bits_per_coordinate"] == 16.0          # the stock path ships fp16
    assert summary["compression_ratio"] == pytest.approx(2.0)


# ---------------------------------------------------------------- the horovod-aq command
#: The compressed run's label: the example's default --error-feedback auto adds error feedback
#: at <= 3 bits (docs/quantizers.md §5.9); the stand-in launcher below writes the plain label.
ALQ_LABEL = r"ALQ 3-bit(?: \+ error feedback)?"
DEMO_LINE = re.compile(
    rf"^demo done: {ALQ_LABEL} is (\d+\.\d) pt (above|below) fp32 in test accuracy, "
    rf"(seed \d+|mean over seeds [\d, ]+) \(fp32 (\d+\.\d)%, {ALQ_LABEL} (\d+\.\d)%; paired by "
    r"seed, same initial weights and sample order: ([+-]\d+\.\d) pt(?: ± (\d+\.\d))?"
    rf"(; one seed is noisy[^)]*)?\); {ALQ_LABEL} sent (\d+\.\d)x fewer gradient bytes than "
    r"fp32 \(([\d.]+) vs ([\d.]+) MiB over (\d+) steps, rank 0 telemetry; ([\d.]+) bits per "
    r"coordinate\); figure (\S+), runs in ", re.MULTILINE)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _logged_command(run_dir) -> list[str]:
    """The horovodrun command line a demo run logged first in its horovodrun.log."""
    with open(run_dir / "horovodrun.log") as f:
        first = f.readline()
    assert first.startswith("$ "), first
    return first[2:].split()


@pytest.mark.multiprocess
def test_cli_demo_trains_fp32_and_alq_from_one_seed_and_compares(tmp_path, capfd):
    out = tmp_path / "demo"
    assert cli.main(["demo", "--epochs", "1", "--seeds", "0", "--out", str(out),
                     "--no-progress"]) == 0
    text = capfd.readouterr().out
    runs = {}
    for name in ("fp32", "alq3"):
        run_dir = out / name / "seed0"
        argv = _logged_command(run_dir)
        assert _flag(argv, "--compression") == {"fp32": "none", "alq3": "alq"}[name]
        assert _flag(argv, "--seed") == "0" and "--no-progress" in argv
        with open(run_dir / "metrics.json") as f:
            runs[name] = json.load(f)
        with open(run_dir / "telemetry.jsonl") as f:
            runs[name]["telemetry"] = [json.loads(line) for line in f]
    fp32, alq = runs["fp32"]["summary"], runs["alq3"]["summary"]
    assert (fp32["compression"], alq["compression"]) == ("none", "alq")
    # the example's --error-feedback auto: the packed default wraps ALQ 3-bit (quantizers.md §5.9)
    assert (fp32["label"], alq["label"]) == ("fp32", "ALQ 3-bit + error feedback")
    for key in ("seed", "steps", "init_fingerprint", "order_fingerprint"):  # started alike
        assert fp32[key] == alq[key], key
    assert fp32["test_acc"] > 0.3 and alq["test_acc"] > 0.3               # chance is 0.1
    steps = [len(r["telemetry"]) for r in runs.values()]
    assert steps == [fp32["steps"]] * 2
    sent = {k: sum(rec["bytes_sent"] for rec in r["telemetry"]) for k, r in runs.items()}
    m = DEMO_LINE.search(text)
    assert m, text[-3000:]
    gap = 100 * alq["test_acc"] - 100 * fp32["test_acc"]
    assert float(m.group(1)) == round(abs(gap), 1) and m.group(3) == "seed 0"
    assert float(m.group(4)) == round(100 * fp32["test_acc"], 1)
    assert float(m.group(5)) == round(100 * alq["test_acc"], 1)
    assert m.group(7) is None and m.group(8)                    # one seed: no spread, a note
    assert int(m.group(12)) == steps[0]
    assert float(m.group(9)) == round(sent["fp32"] / sent["alq3"], 1)
    assert float(m.group(9)) > 8                                           # 3 bits vs 32
    assert m.group(14) == str(out / "curves.png")
    assert (out / "curves.png").stat().st_size > 10_000
    # rank 0's epoch lines go to the log, not to the terminal; no rank prefixes reach it
    assert "<stdout>" not in text and "epoch  1" not in text
    assert "epoch  1" in (out / "alq3" / "seed0" / "horovodrun.log").read_text()


class _FakeHorovodrun:
    """Stands in for ``subprocess.Popen`` of horovodrun: writes what the example writes
    (metrics.json, telemetry) and prints rank-prefixed lines as horovodrun does."""

    def __init__(self, calls, accuracy, bytes_per_step, fingerprint, fail):
        self.calls, self.accuracy, self.bytes_per_step = calls, accuracy, bytes_per_step
        self.fingerprint, self.fail = fingerprint or {}, fail

    def __call__(self, cmd, **kwargs):
        self.calls.append(cmd)
        comp, out, seed = _flag(cmd, "--compression"), _flag(cmd, "--out"), _flag(cmd, "--seed")
        proc = type("Proc", (), {})()
        lines = ["[0]<stdout>:epoch  1  train loss 1.25 ...\n",
                 "[1]<stderr>:INFO horovod_aq: something rank 1 logged\n"]
        proc.stdout = iter(lines)
        proc.wait = lambda: 3 if comp == self.fail else 0
        if comp == self.fail:
            return proc
        os.makedirs(out, exist_ok=True)
        steps, acc = 4, self.accuracy[comp][int(seed)]
        epochs = [{"epoch": 1, "step": steps, "step_loss": [2.0, 1.5, 1.0, 0.5],
                   "train_loss": 1.25, "test_loss": 0.6, "test_acc": acc}]
        summary = {"compression": comp, "label": {"none": "fp32", "alq": "ALQ 3-bit"}[comp],
                   "test_acc": acc, "seed": int(seed), "steps": steps,
                   "init_fingerprint": self.fingerprint.get(comp, "a"),
                   "order_fingerprint": "b", "bits_per_coordinate": 3.04 if comp == "alq" else 32,
                   "compression_ratio": 99.0}         # not what the closing line may use
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump({"summary": summary, "epochs": epochs}, f)
        with open(os.path.join(out, "telemetry.jsonl"), "w") as f:
            for step in range(steps):
                f.write(json.dumps({"step": step, "bytes_sent": self.bytes_per_step[comp]})
                        + "\n")
        return proc


def _fake_demo_runs(monkeypatch, *, bytes_per_step: dict, fingerprint: dict | None = None,
                    fail: str | None = None, accuracy: dict | None = None) -> list[list[str]]:
    calls: list[list[str]] = []
    accuracy = accuracy or {"none": {s: 0.9 for s in range(10)},
                            "alq": {s: 0.875 for s in range(10)}}
    monkeypatch.setattr(cli.subprocess, "Popen",
                        _FakeHorovodrun(calls, accuracy, bytes_per_step, fingerprint, fail))
    monkeypatch.setattr(cli, "_horovodrun", lambda: "horovodrun")
    return calls


def test_cli_demo_closing_line_takes_the_byte_ratio_from_telemetry(tmp_path, monkeypatch,
                                                                   capsys):
    calls = _fake_demo_runs(monkeypatch, bytes_per_step={"none": 1_048_576, "alq": 131_072})
    assert cli.main(["demo", "--out", str(tmp_path), "--seeds", "7", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert [_flag(c, "--compression") for c in calls] == ["none", "alq"]
    assert {_flag(c, "--seed") for c in calls} == {"7"}
    assert [_flag(c, "--out") for c in calls] == [str(tmp_path / "fp32" / "seed7"),
                                                  str(tmp_path / "alq3" / "seed7")]
    m = DEMO_LINE.search(out)
    assert m, out
    assert m.groups()[:7] == ("2.5", "below", "seed 7", "90.0", "87.5", "-2.5", None)
    assert m.group(8).startswith("; one seed is noisy")
    assert m.groups()[8:13] == ("8.0", "0.50", "4.00", "4", "3.04")
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert "<stdout>" not in out and "rank 1 logged" not in out     # only the demo's own lines


def test_cli_demo_reports_the_mean_over_its_seeds(tmp_path, monkeypatch, capsys):
    accuracy = {"none": {0: 0.95, 1: 0.94, 2: 0.96}, "alq": {0: 0.951, 1: 0.935, 2: 0.962}}
    calls = _fake_demo_runs(monkeypatch, bytes_per_step={"none": 80, "alq": 8},
                            accuracy=accuracy)
    assert cli.main(["demo", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert [(_flag(c, "--compression"), _flag(c, "--seed")) for c in calls] == [
        ("none", "0"), ("alq", "0"), ("none", "1"), ("alq", "1"), ("none", "2"), ("alq", "2")]
    m = DEMO_LINE.search(out)
    assert m, out
    diffs = [0.1, -0.5, 0.2]                                  # ALQ − fp32 per seed, in points
    assert m.groups()[:8] == ("0.1", "below", "mean over seeds 0, 1, 2", "95.0", "94.9",
                              "-0.1", f"{np.std(diffs, ddof=1):.1f}", None)
    assert m.group(12) == "12"                                # 3 seeds × 4 steps
    for seed in range(3):
        assert f"seed {seed}: ALQ 3-bit" in out


def test_cli_demo_refuses_runs_that_did_not_start_alike(tmp_path, monkeypatch, capsys):
    _fake_demo_runs(monkeypatch, bytes_per_step={"none": 8, "alq": 1},
                    fingerprint={"none": "a", "alq": "c"})
    assert cli.main(["demo", "--out", str(tmp_path), "--seeds", "0"]) == 1
    captured = capsys.readouterr()
    assert "init_fingerprint: a vs c" in captured.err and "demo done" not in captured.out


@pytest.mark.parametrize("fail", ["none", "alq"])
def test_cli_demo_stops_at_a_failed_run(tmp_path, monkeypatch, capsys, fail):
    calls = _fake_demo_runs(monkeypatch, bytes_per_step={"none": 8, "alq": 1}, fail=fail)
    assert cli.main(["demo", "--out", str(tmp_path)]) == 3
    assert len(calls) == (1 if fail == "none" else 2)
    captured = capsys.readouterr()
    assert "demo done" not in captured.out and "failed (exit 3)" in captured.out


def test_cli_levels_fits_and_plots(tmp_path, capsys):
    png = tmp_path / "levels.png"
    assert cli.main(["levels", "--method", "alq", "--bits", "3", "--bucket-size", "1024",
                     "--synthetic", "sparse", "--numel", "200000", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "levels (v1, 3 bits)" in out and "measured normalized variance" in out
    assert png.stat().st_size > 10_000


def test_cli_levels_from_a_gradient_dump(tmp_path, capsys):
    dump = tmp_path / "grad.npy"
    np.save(dump, np.random.default_rng(0).laplace(size=50_000).astype(np.float32))
    assert cli.main(["levels", "--method", "amq", "--bits", "2", "--bucket-size", "512",
                     "--dump", str(dump)]) == 0
    assert str(dump) in capsys.readouterr().out


def test_cli_doctor_quick_check_runs_no_launch(capsys):
    assert cli.main(["doctor"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert ("codec       encode/decode byte-identical to the numpy oracle, stock hook: numpy, "
            "torch, tensorflow ... ok") in out
    assert "quick checks passed; horovod-aq doctor --full also runs" in out
    assert "self-test" not in out.split("quick checks passed")[0]


def test_cli_doctor_finds_a_kernel_that_differs_from_the_oracle(monkeypatch, capsys):
    from horovod_aq.torch import kernels

    encode = kernels.encode

    def flipped(*args, **kwargs):
        out = encode(*args, **kwargs).clone()
        out[-1] ^= 1
        return out

    monkeypatch.setattr(kernels, "encode", flipped)
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert ("codec round trip (torch) failed: AssertionError: encode differs from the numpy "
            "oracle's bytes") in out and "tensorflow ... FAILED" in out


def test_cli_doctor_reports_missing_mpi(monkeypatch, capsys):
    monkeypatch.setattr(cli.shutil, "which", lambda name: None)
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "mpirun not found" in out and "problems:" in out


def test_cli_doctor_reports_a_missing_framework(monkeypatch, capsys):
    real = cli.importlib.import_module

    def fake(name, *a, **kw):
        if name == "horovod.tensorflow":
            raise ImportError("libtensorflow_framework.so.2: cannot open shared object file")
        return real(name, *a, **kw)

    monkeypatch.setattr(cli.importlib, "import_module", fake)
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "no working TensorFlow extension" in out and "scripts/setup.sh --force" in out
    assert "stock hook: numpy, torch ... ok" in out      # the codec is checked where it can be


@pytest.mark.multiprocess
@pytest.mark.slow
def test_cli_doctor_full_runs_the_self_tests(capsys):
    assert cli.main(["doctor", "--full"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "self-test   2 ranks, gloo" in out and "self-test   2 ranks, mpi" in out
    assert "all checks passed" in out
