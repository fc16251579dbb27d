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
from horovod_aq.tools import cli, demo, demo_report
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
#: The demo's headline: the paired gap (within noise, beyond noise, or one seed), its standard
#: error over several seeds, both mean accuracies and the byte ratio.
DEMO_LINE = re.compile(
    rf"^demo done: (?P<label>{ALQ_LABEL}) (?:matches fp32 within noise in test accuracy: "
    r"(?P<within>[+-]\d+\.\d\d) ± (?P<within_se>\d+\.\d\d) pt|is (?P<gap>\d+\.\d+)"
    r"(?: ± (?P<se>\d+\.\d\d))? pt (?P<side>above|below) fp32 in test accuracy"
    r"(?P<verdict>, beyond noise| on one seed, which cannot tell a gap from seed noise "
    r"\(--seeds 0,1,2 gives a standard error\))) \((?:mean ± standard error of the paired "
    r"difference over seeds (?P<seeds>[\d, ]+), each pair from the same initial weights and "
    r"sample order; within noise = under 2 standard errors; )?fp32 (?P<acc_base>\d+\.\d\d)%, "
    rf"{ALQ_LABEL} (?P<acc_comp>\d+\.\d\d)%\); {ALQ_LABEL} sent (?P<ratio>\d+\.\d)x fewer "
    r"gradient bytes than fp32 \((?P<mib_comp>[\d.]+) vs (?P<mib_base>[\d.]+) MiB over "
    r"(?P<steps>\d+) steps, rank 0 telemetry; (?P<bits>[\d.]+) bits per coordinate\)$",
    re.MULTILINE)
#: The speed line where the demo timed the emulated cluster.
SPEED_MEASURED = re.compile(
    r"^speed, measured: a training step on an emulated cluster of (?P<hosts>\d+) hosts linked "
    r"at (?P<rate>[\d.]+ [MG]bit/s) .* took (?P<aq>\d+\.\d+) s with horovod_aq\.ALQ\(bits=3\) "
    r"and every other default against (?P<fp32>\d+\.\d+) s with Horovod's fp32 allreduce: "
    r"(?P<speedup>\d+\.\d)x faster \(medians of (?P<steps>\d+) steps each; "
    r"(?P<aq_mb>[\d.]+) vs (?P<fp32_mb>[\d.]+) MB out of each host per step\)$", re.MULTILINE)
#: The speed line where it could not: measured bytes per step, a bytes ÷ bandwidth model.
SPEED_MODEL = re.compile(
    r"^speed, modelled \(not measured: (?P<reason>.+?)\): each rank sent (?P<comp_kb>[\d.]+) kB "
    rf"of gradients per step with {ALQ_LABEL} against (?P<base_kb>[\d.]+) kB with fp32 "
    r"\(measured, rank 0 telemetry\); bytes ÷ bandwidth puts the transfer at (?P<c100>[\d.]+) "
    r"vs (?P<b100>[\d.]+) ms on 100 Mbit/s, (?P<c1g>[\d.]+) vs (?P<b1g>[\d.]+) ms on 1 Gbit/s "
    r"per step, (?P<ratio>\d+\.\d)x shorter \(a model: ", re.MULTILINE)


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
                     "--no-progress", "--speed", "model"]) == 0
    text = capfd.readouterr().out
    runs = {}
    for name in ("fp32", "alq3"):
        run_dir = out / name / "seed0"
        argv = _logged_command(run_dir)
        assert _flag(argv, "--compression") == {"fp32": "none", "alq3": "alq"}[name]
        assert _flag(argv, "--seed") == "0" and "--no-progress" in argv
        assert float(_flag(argv, "--lr")) == demo.DEMO_LR
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
    assert float(m["gap"]) == round(abs(gap), 1) and m["verdict"].startswith(" on one seed")
    assert m["se"] is None and m["seeds"] is None                # one seed: no spread
    assert float(m["acc_base"]) == round(100 * fp32["test_acc"], 2)
    assert float(m["acc_comp"]) == round(100 * alq["test_acc"], 2)
    assert int(m["steps"]) == steps[0]
    assert float(m["ratio"]) == round(sent["fp32"] / sent["alq3"], 1)
    assert float(m["ratio"]) > 8                                           # 3 bits vs 32
    speed = SPEED_MODEL.search(text)
    assert speed and speed["reason"] == "--speed model", text[-3000:]
    assert float(speed["base_kb"]) == round(sent["fp32"] / steps[0] / 1e3, 1)
    assert f"figure {out / 'curves.png'}; runs and logs in {out}/" in text
    assert (out / "curves.png").stat().st_size > 10_000
    # rank 0's epoch lines go to the log, not to the terminal; no rank prefixes reach it, nor
    # TensorFlow's or absl's start-up notices
    assert "<stdout>" not in text and "epoch  1" not in text
    assert "absl" not in text and "oneDNN" not in text
    assert "epoch  1" in (out / "alq3" / "seed0" / "horovodrun.log").read_text()


class _FakeHorovodrun:
    """Stands in for :func:`horovod_aq.tools.demo.launch` (the demo's seam for horovodrun):
    writes what the example writes (metrics.json, telemetry) and prints rank-prefixed lines as
    horovodrun does, TensorFlow's start-up notices among them."""

    def __init__(self, calls, accuracy, bytes_per_step, fingerprint, fail):
        self.calls, self.accuracy, self.bytes_per_step = calls, accuracy, bytes_per_step
        self.fingerprint, self.fail = fingerprint or {}, fail

    def __call__(self, cmd, **kwargs):
        self.calls.append(cmd)
        comp, out, seed = _flag(cmd, "--compression"), _flag(cmd, "--out"), _flag(cmd, "--seed")
        proc = type("Proc", (), {})()
        lines = ["[0]<stdout>:epoch  1  train loss 1.25 ...\n",
                 "[1]<stderr>:INFO horovod_aq: something rank 1 logged\n",
                 "[1]<stderr>:WARNING: All log messages before absl::InitializeLog() is called "
                 "are written to STDERR\n",
                 "[0]<stderr>:2026-12-06 I tensorflow/core/util/port.cc:153] WARNING oneDNN "
                 "custom operations are on.\n"]
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


#: What the stand-in cluster timing returns (demo_report.cluster_speed's fields).
FAKE_SPEED = {"hosts": 2, "rate": 100.0, "params": 814_090, "steps": 9, "fp32_s": 0.3,
              "aq_s": 0.05, "fp32_bytes": 3.3e6, "aq_bytes": 3.4e5}


def _fake_demo_runs(monkeypatch, *, bytes_per_step: dict, fingerprint: dict | None = None,
                    fail: str | None = None, accuracy: dict | None = None,
                    cluster: dict | str | None = None) -> list[list[str]]:
    """Stand-ins for horovodrun and, for the speed line, the cluster: ``cluster`` None (this
    machine cannot build one: the model), what the timing returned, or why it failed."""
    calls: list[list[str]] = []
    accuracy = accuracy or {"none": {s: 0.9 for s in range(10)},
                            "alq": {s: 0.875 for s in range(10)}}
    monkeypatch.setattr(demo, "launch",
                        _FakeHorovodrun(calls, accuracy, bytes_per_step, fingerprint, fail))
    monkeypatch.setattr(demo, "horovodrun_path", lambda: "horovodrun")
    monkeypatch.setattr(demo, "cluster_unavailable",
                        lambda: "no cluster in this test" if cluster is None else None)
    monkeypatch.setattr(demo, "time_cluster", lambda out: cluster)
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
    assert (m["gap"], m["side"], m["se"], m["seeds"]) == ("2.5", "below", None, None)
    assert m["verdict"].startswith(" on one seed, which cannot tell")
    assert (m["acc_base"], m["acc_comp"], m["ratio"], m["mib_comp"], m["mib_base"], m["steps"],
            m["bits"]) == ("90.00", "87.50", "8.0", "0.50", "4.00", "4", "3.04")
    speed = SPEED_MODEL.search(out)
    assert speed, out
    assert speed["reason"] == "no cluster in this test"
    # 1 MiB per step: 83.89 ms at 100 Mbit/s, 8.39 ms at 1 Gbit/s; 128 KiB an eighth of that
    assert (speed["comp_kb"], speed["base_kb"]) == ("131.1", "1048.6")
    assert (speed["c100"], speed["b100"], speed["c1g"], speed["b1g"], speed["ratio"]) == (
        "10.49", "83.89", "1.05", "8.39", "8.0")
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert "<stdout>" not in out and "rank 1 logged" not in out     # only the demo's own lines
    assert "absl" not in out and "oneDNN" not in out                # no start-up notices


def test_cli_demo_reports_the_mean_over_its_seeds_with_its_standard_error(tmp_path,
                                                                         monkeypatch, capsys):
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
    se = np.std(diffs, ddof=1) / np.sqrt(3)                   # 0.22: the mean −0.07 is within
    assert (m["within"], m["within_se"], m["seeds"]) == ("-0.07", f"{se:.2f}", "0, 1, 2")
    assert (m["acc_base"], m["acc_comp"], m["steps"]) == ("95.00", "94.93", "12")  # 3 × 4
    assert SPEED_MODEL.search(out), out
    for seed in range(3):
        assert f"seed {seed}: ALQ 3-bit" in out


def test_cli_demo_names_a_gap_beyond_noise(tmp_path, monkeypatch, capsys):
    accuracy = {"none": {0: 0.95, 1: 0.94, 2: 0.96}, "alq": {0: 0.94, 1: 0.928, 2: 0.952}}
    _fake_demo_runs(monkeypatch, bytes_per_step={"none": 80, "alq": 8}, accuracy=accuracy)
    assert cli.main(["demo", "--out", str(tmp_path), "--no-progress"]) == 0
    m = DEMO_LINE.search(capsys.readouterr().out)
    assert m and (m["gap"], m["se"], m["side"], m["verdict"]) == (
        "1.00", "0.12", "below", ", beyond noise")


def test_cli_demo_prints_the_measured_speedup_of_a_timed_cluster(tmp_path, monkeypatch,
                                                                 capsys):
    _fake_demo_runs(monkeypatch, bytes_per_step={"none": 80, "alq": 8}, cluster=FAKE_SPEED)
    assert cli.main(["demo", "--out", str(tmp_path), "--seeds", "0,1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert DEMO_LINE.search(out), out
    m = SPEED_MEASURED.search(out)
    assert m, out
    assert (m["hosts"], m["rate"], m["aq"], m["fp32"], m["speedup"], m["steps"], m["aq_mb"],
            m["fp32_mb"]) == ("2", "100 Mbit/s", "0.050", "0.300", "6.0", "9", "0.34", "3.30")
    assert not SPEED_MODEL.search(out)


def test_cli_demo_falls_back_to_the_model_when_the_cluster_fails(tmp_path, monkeypatch,
                                                                 capsys):
    _fake_demo_runs(monkeypatch, bytes_per_step={"none": 80, "alq": 8},
                    cluster="benchmarks/cluster.py exited with 2: no bridge")
    assert cli.main(["demo", "--out", str(tmp_path), "--seeds", "0", "--no-progress"]) == 0
    out = capsys.readouterr().out
    m = SPEED_MODEL.search(out)
    assert m and m["reason"] == "benchmarks/cluster.py exited with 2: no bridge", out
    assert not SPEED_MEASURED.search(out)


def test_cli_demo_speed_cluster_refuses_before_training_where_it_cannot(tmp_path, monkeypatch,
                                                                         capsys):
    calls = _fake_demo_runs(monkeypatch, bytes_per_step={"none": 8, "alq": 1})
    assert cli.main(["demo", "--out", str(tmp_path), "--speed", "cluster"]) == 2
    assert calls == []
    assert "--speed cluster: no cluster in this test; or --speed model" in capsys.readouterr().err


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


# ------------------------------------------------ the demo's lines, from their pure functions
def test_demo_headline_keeps_the_spread_and_says_within_noise_under_two_standard_errors():
    kwargs = {"label": "ALQ 3-bit + error feedback", "base": "fp32", "seeds": [0, 1, 2],
              "sent_base": 10 * 2**20, "sent_comp": 2**20, "steps": 930, "bits": 3.12}
    line = demo_report.format_headline(acc_base=[96.0, 95.0, 97.0],
                                       acc_comp=[95.8, 95.1, 96.8], **kwargs)
    m = DEMO_LINE.search(line)
    assert m, line
    se = np.std([-0.2, 0.1, -0.2], ddof=1) / np.sqrt(3)       # 0.10; the mean −0.10 is within
    assert (m["within"], m["within_se"]) == ("-0.10", f"{se:.2f}")
    assert "± " in line and "standard error of the paired difference" in line
    line = demo_report.format_headline(acc_base=[96.0, 95.0, 97.0],
                                       acc_comp=[95.0, 94.1, 95.9], **kwargs)
    m = DEMO_LINE.search(line)
    assert m and (m["gap"], m["side"], m["verdict"]) == ("1.00", "below", ", beyond noise")
    assert m["se"] == f"{np.std([-1.0, -0.9, -1.1], ddof=1) / np.sqrt(3):.2f}"
    assert (m["ratio"], m["mib_comp"], m["mib_base"], m["steps"]) == ("10.0", "1.00", "10.00",
                                                                      "930")


@pytest.mark.parametrize("mean,se,verdict", [
    (0.0, 0.0, "within noise"), (0.39, 0.2, "within noise"), (-0.41, 0.2, "below"),
    (0.5, 0.2, "above"), (0.4, None, "one seed")])
def test_demo_gap_phrase_is_within_noise_under_two_standard_errors(mean, se, verdict):
    assert verdict in demo_report.gap_phrase(mean, se, label="ALQ 3-bit")


def test_demo_speed_lines_measured_and_modelled():
    result = {"results": [{"hosts": 2, "rate": 100.0, "params": 814_090, "summary": {
        "hvd_fp32": {"median": 0.31, "steps": 9, "tx_mean": 3.31e6},
        "defaults": {"median": 0.062, "steps": 9, "tx_mean": 3.5e5}}}]}
    speed = demo_report.cluster_speed(result)
    m = SPEED_MEASURED.search(demo_report.format_speed_measured(speed))
    assert m and (m["aq"], m["fp32"], m["speedup"], m["steps"]) == ("0.062", "0.310", "5.0", "9")
    line = demo_report.format_speed_model(label="ALQ 3-bit", base="fp32", bytes_comp=17_500,
                                          bytes_base=175_000, reason="no root")
    m = SPEED_MODEL.search(line)
    assert m and (m["reason"], m["c100"], m["b100"], m["c1g"], m["b1g"], m["ratio"]) == (
        "no root", "1.40", "14.00", "0.14", "1.40", "10.0")
    assert cost.transfer_seconds(12.5e6, 100.0) == pytest.approx(1.0)      # 100 Mbit in 1 s
    with pytest.raises(ValueError, match="positive"):
        cost.transfer_seconds(1, 0)


def test_demo_filters_tensorflow_and_absl_start_up_notices():
    noise, problem = re.compile(demo.NOISE_LINE), re.compile(demo.PROBLEM_LINE)
    for line in ("WARNING: All log messages before absl::InitializeLog() is called are "
                 "written to STDERR",
                 "I tensorflow/core/util/port.cc:153] oneDNN custom operations are on. You may "
                 "see slightly different numerical results. To turn them off, set the "
                 "environment variable `TF_ENABLE_ONEDNN_OPTS=0`."):
        assert noise.search(line)
    for line in ("WARNING horovod_aq.error_feedback: error memory 45x its gradient",
                 "RuntimeError: Gloo timed out"):
        assert problem.search(line) and not noise.search(line)
    assert demo.DEMO_ENV["TF_CPP_MIN_LOG_LEVEL"] == "3"


def test_cluster_script_takes_the_demo_s_rounds_with_quick_and_writes_json(tmp_path):
    sys.path.insert(0, ROOT)
    from benchmarks import cluster

    args = cluster.parse_args(["--quick", "--modes", ",".join(demo.CLUSTER_MODES), "--rounds",
                               str(demo.CLUSTER_ROUNDS), "--steps", str(demo.CLUSTER_STEPS),
                               "--json", str(tmp_path / "c.json")])
    assert (args.hosts, args.rates, args.modes) == ([2], [100.0], list(demo.CLUSTER_MODES))
    assert (args.rounds, args.steps, args.warmup_rounds) == (demo.CLUSTER_ROUNDS,
                                                            demo.CLUSTER_STEPS, 1)
    assert args.json == str(tmp_path / "c.json")
    quick = cluster.parse_args(["--quick"])
    assert (quick.rounds, quick.steps) == (2, 2)
    full = cluster.parse_args([])
    assert (full.rounds, full.steps, full.warmup_rounds) == (5, 3, 1)


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
