"""The examples (short runs on 2 ranks under horovodrun) and the ``horovod-aq`` command."""

from __future__ import annotations

import json
import math
import os
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


def test_cli_doctor_reports_missing_mpi(monkeypatch, capsys):
    monkeypatch.setattr(cli.shutil, "which", lambda name: None)
    assert cli.main(["doctor", "--skip-selftest"]) == 1
    out = capsys.readouterr().out
    assert "mpirun not found" in out and "problems:" in out


def test_cli_doctor_reports_a_missing_framework(monkeypatch, capsys):
    real = cli.importlib.import_module

    def fake(name, *a, **kw):
        if name == "horovod.tensorflow":
            raise ImportError("libtensorflow_framework.so.2: cannot open shared object file")
        return real(name, *a, **kw)

    monkeypatch.setattr(cli.importlib, "import_module", fake)
    assert cli.main(["doctor", "--skip-selftest"]) == 1
    out = capsys.readouterr().out
    assert "no working TensorFlow extension" in out and "scripts/setup.sh --force" in out


@pytest.mark.multiprocess
def test_cli_doctor_passes_with_self_tests(capsys):
    assert cli.main(["doctor"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "self-test   2 ranks, gloo" in out and "self-test   2 ranks, mpi" in out
    assert "all checks passed" in out
