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
    # one fused bucket holds every parameter; allgather on 2 ranks: bytes sent = (P−1)·payload
    numel = tele[0]["numel_quantized"]
    payload = cost.payload_bytes(numel, 3, 1024)
    for rec in tele:
        assert rec["payload_bytes"] == payload
        assert rec["bytes_sent"] == payload
        assert rec["bytes_fp32"] == 4 * numel              # 2(P−1)/P·4n at P = 2
        assert math.isclose(rec["bits_per_coordinate"], 8 * payload / numel)
    assert tele[0]["refit"] and tele[0]["table_version"] == 1
    assert summary["compression_ratio"] == pytest.approx(4 * numel / payload, rel=1e-9)
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
DEMO_LINE = re.compile(
    r"^demo done: test accuracy fp32 (\d+\.\d)%, ALQ 3-bit (\d+\.\d)% \(seed (\d+), same "
    r"initial weights and sample order\); ALQ 3-bit sent (\d+\.\d)x fewer gradient bytes than "
    r"fp32 \(([\d.]+) vs ([\d.]+) MiB over (\d+) steps, rank 0 telemetry; ([\d.]+) bits per "
    r"coordinate\); figure (\S+), runs in ", re.MULTILINE)


def _launches(out: str) -> list[list[str]]:
    return [line[2:].split() for line in out.splitlines() if line.startswith("$ ")]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.multiprocess
def test_cli_demo_trains_fp32_and_alq_from_one_seed_and_compares(tmp_path, capfd):
    out = tmp_path / "demo"
    assert cli.main(["demo", "--epochs", "1", "--out", str(out), "--no-progress"]) == 0
    text = capfd.readouterr().out
    launches = _launches(text)
    assert [_flag(a, "--compression") for a in launches] == ["none", "alq"], text[-3000:]
    assert {_flag(a, "--seed") for a in launches} == {"0"}
    runs = {}
    for name in ("fp32", "alq3"):
        with open(out / name / "metrics.json") as f:
            runs[name] = json.load(f)
        with open(out / name / "telemetry.jsonl") as f:
            runs[name]["telemetry"] = [json.loads(line) for line in f]
    fp32, alq = runs["fp32"]["summary"], runs["alq3"]["summary"]
    assert (fp32["compression"], alq["compression"]) == ("none", "alq")
    for key in ("seed", "steps", "init_fingerprint", "order_fingerprint"):  # started alike
        assert fp32[key] == alq[key], key
    assert fp32["test_acc"] > 0.3 and alq["test_acc"] > 0.3               # chance is 0.1
    steps = [len(r["telemetry"]) for r in runs.values()]
    assert steps == [fp32["steps"]] * 2
    sent = {k: sum(rec["bytes_sent"] for rec in r["telemetry"]) for k, r in runs.items()}
    m = DEMO_LINE.search(text)
    assert m, text[-3000:]
    assert float(m.group(1)) == round(100 * fp32["test_acc"], 1)
    assert float(m.group(2)) == round(100 * alq["test_acc"], 1)
    assert int(m.group(3)) == 0 and int(m.group(7)) == steps[0]
    assert float(m.group(4)) == round(sent["fp32"] / sent["alq3"], 1)
    assert float(m.group(4)) > 8                                           # 3 bits vs 32
    assert m.group(9) == str(out / "curves.png")
    assert (out / "curves.png").stat().st_size > 10_000


def _fake_demo_runs(monkeypatch, *, bytes_per_step: dict, fingerprint: dict | None = None,
                    fail: str | None = None) -> list[list[str]]:
    """Stand in for horovodrun: write what the example writes (metrics.json, telemetry)."""
    calls = []

    def run(cmd, env=None):
        calls.append(cmd)
        comp, out = _flag(cmd, "--compression"), _flag(cmd, "--out")
        if comp == fail:
            return subprocess.CompletedProcess(cmd, 3)
        os.makedirs(out, exist_ok=True)
        steps, acc = 4, {"none": 0.9, "alq": 0.875}[comp]
        epochs = [{"epoch": 1, "step": steps, "step_loss": [2.0, 1.5, 1.0, 0.5],
                   "train_loss": 1.25, "test_loss": 0.6, "test_acc": acc}]
        summary = {"compression": comp, "test_acc": acc, "seed": int(_flag(cmd, "--seed")),
                   "steps": steps, "init_fingerprint": (fingerprint or {}).get(comp, "a"),
                   "order_fingerprint": "b", "bits_per_coordinate": 3.04 if comp == "alq" else 32,
                   "compression_ratio": 99.0}         # not what the closing line may use
        with open(os.path.join(out, "metrics.json"), "w") as f:
            json.dump({"summary": summary, "epochs": epochs}, f)
        with open(os.path.join(out, "telemetry.jsonl"), "w") as f:
            for step in range(steps):
                f.write(json.dumps({"step": step, "bytes_sent": bytes_per_step[comp]}) + "\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(cli.subprocess, "run", run)
    monkeypatch.setattr(cli, "_horovodrun", lambda: "horovodrun")
    return calls


def test_cli_demo_closing_line_takes_the_byte_ratio_from_telemetry(tmp_path, monkeypatch,
                                                                   capsys):
    calls = _fake_demo_runs(monkeypatch, bytes_per_step={"none": 1_048_576, "alq": 131_072})
    assert cli.main(["demo", "--out", str(tmp_path), "--seed", "7", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert [_flag(c, "--compression") for c in calls] == ["none", "alq"]
    assert {_flag(c, "--seed") for c in calls} == {"7"}
    assert [_flag(c, "--out") for c in calls] == [str(tmp_path / "fp32"), str(tmp_path / "alq3")]
    m = DEMO_LINE.search(out)
    assert m, out
    assert m.groups()[:8] == ("90.0", "87.5", "7", "8.0", "0.50", "4.00", "4", "3.04")
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_cli_demo_refuses_runs_that_did_not_start_alike(tmp_path, monkeypatch, capsys):
    _fake_demo_runs(monkeypatch, bytes_per_step={"none": 8, "alq": 1},
                    fingerprint={"none": "a", "alq": "c"})
    assert cli.main(["demo", "--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "init_fingerprint: a vs c" in captured.err and "demo done" not in captured.out


@pytest.mark.parametrize("fail", ["none", "alq"])
def test_cli_demo_stops_at_a_failed_run(tmp_path, monkeypatch, capsys, fail):
    calls = _fake_demo_runs(monkeypatch, bytes_per_step={"none": 8, "alq": 1}, fail=fail)
    assert cli.main(["demo", "--out", str(tmp_path)]) == 3
    assert len(calls) == (1 if fail == "none" else 2)
    assert "demo done" not in capsys.readouterr().out


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
def test_cli_doctor_full_runs_the_self_tests(capsys):
    assert cli.main(["doctor", "--full"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "self-test   2 ranks, gloo" in out and "self-test   2 ranks, mpi" in out
    assert "all checks passed" in out
