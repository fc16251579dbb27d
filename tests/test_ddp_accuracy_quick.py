"""``benchmarks/ddp_accuracy.py --quick`` runs end to end (2 DDP processes, 20 steps per run).

It checks the plumbing, not accuracy: the report holds a Markdown table with every
configuration (fp32, ALQ 2/3-bit plain, ALQ 2-bit with the hook's default error feedback,
the two byte-matched PowerSGD ranks), the JSON beside it holds
every run, and the byte ratios are sane: fp32 is 1, ALQ b-bit sends about b/32 of fp32's bytes
(codes plus norms and headers; allgather at 2 processes), and each PowerSGD rank's
compressed-step bytes are the closest of all ranks to its ALQ width's, as PyTorch's own rule
(``_should_compress``) predicts them. The PowerSGD byte counts are also checked inside the
benchmark against that rule and against one DDP bucket per step.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TABLE_RULE = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$", re.MULTILINE)


def test_ddp_accuracy_quick(tmp_path):
    from benchmarks import fashion_mnist

    if fashion_mnist.locate() is None:
        pytest.skip("Fashion-MNIST (Debian package dataset-fashion-mnist) is not installed")
    from benchmarks import ddp_accuracy as bench

    out = tmp_path / "ddp_accuracy.md"
    start = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ddp_accuracy.py"),
                           "--quick", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    elapsed = time.monotonic() - start
    text = out.read_text()
    assert "- Command: `python benchmarks/ddp_accuracy.py --quick" in text, text[:500]
    assert TABLE_RULE.search(text), text[:2000]
    results = json.loads(out.with_suffix(".json").read_text())
    labels = list(results)
    assert labels[:3] == ["fp32", "ALQ 2b", "ALQ 3b"], labels
    psgd = [lb for lb in labels if lb.startswith("PowerSGD r=")]
    assert 1 <= len(psgd) <= 2, labels
    for label in labels:
        assert re.search(rf"^\| {re.escape(label)} \| \d+\.\d\d \|", text, re.MULTILINE), label

    fp32 = results["fp32"][0]["bytes_per_step"]
    numel = results["fp32"][0]["numel"]
    assert fp32 == pytest.approx(bench.ring_bytes(numel, 2))
    for bits in (2, 3):
        run = results[f"ALQ {bits}b"][0]
        assert run["steps"] == bench.QUICK_STEPS and run["telemetry_steps"] == run["steps"]
        assert run["telemetry_bytes_fp32"] == pytest.approx(fp32)
        ratio = run["bytes_steady"] / fp32
        if run["codings"] == ["fixed"]:   # b bits per coordinate, plus headers and norms
            assert bits / 32 < ratio < (bits + 1) / 32, (bits, ratio)
        else:   # wire="auto" timed the entropy-coded wire faster here: fewer bytes, never more
            assert (bits - 1) / 32 < ratio < (bits + 1) / 32, (bits, ratio, run["codings"])
        assert run["error_feedback"] is False
    for bits in (2, 3):                          # the hook's default at <= 3 bits: error feedback
        ef = results[bench.ef_label(bits)][0]
        assert ef["error_feedback"] is True and ef["steps"] == bench.QUICK_STEPS
        ratio = ef["bytes_steady"] / fp32
        assert ratio < (bits + 1) / 32, (bits, ratio)                   # memory stays local
    shapes = [tuple(s) for s in _shapes()]
    for label in psgd:
        run = results[label][0]
        k = run["rank"]
        assert run["compressed_steps"] == bench.QUICK_STEPS - bench.START_POWERSGD_ITER
        want = bench.powersgd_numel(shapes, k)
        assert (run["numel_p"], run["numel_q"], run["numel_uncompressed"]) == \
            (want["p"], want["q"], want["uncompressed"])
        assert run["bytes_steady"] == pytest.approx(bench.ring_bytes(want["total"], 2))
        target = results[run["matched_to"]][0]["bytes_steady"]
        gap = abs(run["bytes_steady"] - target)
        for other in (k - 1, k + 1):
            if other >= 1:
                assert gap <= abs(bench.ring_bytes(bench.powersgd_numel(shapes, other)["total"],
                                                   2) - target)
        assert gap / fp32 < 0.01, (label, run["bytes_steady"] / fp32, target / fp32)
        assert run["bytes_per_step"] > run["bytes_steady"]   # the first steps are fp32
    print(f"ddp_accuracy --quick: {elapsed:.0f} s")


def _shapes():
    from benchmarks.models import SmallCNN

    return [p.shape for p in SmallCNN().parameters()]
