"""``benchmarks/transformer.py --quick`` runs end to end: 3 rows (DDP fp32, the DDP hook's ALQ
3-bit defaults, the Horovod packed optimizer's ALQ 3-bit defaults), seed 0, 30 steps each, under
torchrun and horovodrun (about a minute on 2 cores).

It checks the plumbing, not accuracy: the report's table holds every row; the JSON beside it
holds every run with its bpc curve (an evaluation every 10 steps, falling from the near-uniform
start); every row started from the same weights; fp32's bytes are the ring allreduce's
2(P−1)/P·4n = 4n at P = 2; the quantized rows send between 2/32 and 4/32 of that (3-bit codes
plus bucket norms and headers, or the entropy-coded body that ``wire="auto"`` may choose); the
time to a target that every row reaches within the quick run is the first evaluation at or
below it, and its interpolated crossing lies between that evaluation and the one before; under
AdamW both packed paths send the plain quantizer (the DDP hook is given the optimizer); the
resume rule skips a (row, seed) the JSON holds.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TABLE_RULE = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$", re.MULTILINE)
#: Every quick row's subset bpc is about 5.2 at step 10 and 4.4 at step 20 (from 6.35).
TARGET = 4.8


def test_transformer_quick(tmp_path):
    from benchmarks import transformer as bench

    out = tmp_path / "transformer.md"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "transformer.py"), "--quick",
           "--out", str(out), "--target", str(TARGET)]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                          capture_output=True, text=True, timeout=420, check=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    text = out.read_text()
    assert "- Command: `python benchmarks/transformer.py --quick" in text, text[:500]
    assert TABLE_RULE.search(text), text[:2000]
    assert out.with_suffix(".png").stat().st_size > 1000
    data = json.loads(out.with_suffix(".json").read_text())
    rows = data["rows"]
    assert list(rows) == list(bench.QUICK_ROWS)
    for label in rows:
        assert re.search(rf"^\| {re.escape(label)} \| .*\| \d\.\d{{4}} \|", text, re.M), label

    runs = {label: runs[0] for label, runs in rows.items()}
    assert len({r["init_fingerprint"] for r in runs.values()}) == 1       # same start
    fp32 = runs["fp32"]
    assert fp32["bytes_fp32_per_step"] == 4 * fp32["numel"]               # 2(P-1)/P*4n, P = 2
    assert fp32["bytes_per_step"] == fp32["bytes_fp32_per_step"]
    for label, run in runs.items():
        steps = [pt["step"] for pt in run["curve"]]
        assert run["steps"] == bench.QUICK_STEPS
        assert steps == list(range(0, bench.QUICK_STEPS + 1, bench.QUICK_EVAL_EVERY)), steps
        bpc = [pt["val_bpc"] for pt in run["curve"]]
        assert abs(bpc[0] - math.log2(103)) < 0.5 and bpc[-1] < bpc[0] - 1.0, (label, bpc)
        assert math.isfinite(run["val_bpc"]) and run["val_bpc"] < bpc[0] - 1.0
        reach = bench.first_reach(run["curve"], TARGET)
        assert reach is not None, (label, bpc)
        assert run["time_to_target"]["step"] == reach["step"]              # example == driver
        assert all(b > TARGET for b in bpc[:steps.index(reach["step"])])
        assert 0 < reach["train_seconds"] <= run["train_seconds"]
        cross, i = bench.crossing(run["curve"], TARGET), steps.index(reach["step"])
        assert steps[i - 1] < cross["step"] <= reach["step"], (cross, steps)
        frac = (cross["step"] - steps[i - 1]) / (steps[i] - steps[i - 1])
        assert bpc[i - 1] + frac * (bpc[i] - bpc[i - 1]) == pytest.approx(TARGET)
        if label != "fp32":
            ratio = bench.steady_bytes(run) / fp32["bytes_per_step"]
            assert 2 / 32 < ratio < 4 / 32, (label, ratio)
            # AdamW: error_feedback="auto" sends the plain quantizer (docs/quantizers.md §5.11)
            assert run["compressor"] == "ALQ 3-bit", run["compressor"]
            assert "error feedback" not in run["label"], run["label"]
    assert text.count("(1/1)") == len(rows)                                # every row reached
    m = re.search(r"^\| ALQ 3b \|.*\| ([+-]\d\.\d{4}) \|", text, re.M)
    assert m and float(m.group(1)) == pytest.approx(
        runs["ALQ 3b"]["val_bpc"] - fp32["val_bpc"], abs=1e-4)

    # resume: a rerun finds every (row, seed) stored and launches nothing
    again = subprocess.run(cmd[:2] + ["--rows", "fp32", "--seeds", "0", "--out", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "val bpc" not in again.stderr                   # no "<row>, seed 0: val bpc" line
    assert json.loads(out.with_suffix(".json").read_text()) == data
