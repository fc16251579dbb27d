"""The DDP hook under PyTorch Lightning and Hugging Face Accelerate, 2 CPU processes on Gloo.

One ``torchrun --nproc-per-node 2`` launch of ``tests/lightning_accelerate_ranks.py`` trains
the same 784-64-10 MLP from the same seed on the bundled MNIST subset for 300 steps four
times: a Lightning ``Trainer`` with ALQ 3-bit and without a hook (fp32), and an
``Accelerator(cpu=True)`` loop without and with ALQ 3-bit (the snippets of docs/ddp.md
§ "Lightning and Accelerate").

Tolerance: ALQ's test accuracy (1,000 images) is within ACCURACY_TOLERANCE of the fp32 run of
the same framework. Ten fp32 runs of this setup with different seeds (init and data order)
spread with a standard deviation of 0.0069 (range 0.021), so the difference of two runs has a
standard deviation of about 0.0098 and 0.03 is three of them. A run whose hook silently stopped
adapting fails the refit check (table version ≥ 2: the default schedule refits at steps 0 and
100) and one whose hook was not called fails the telemetry step count.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

import horovod_aq

pytestmark = pytest.mark.multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 300
ACCURACY_TOLERANCE = 0.03
RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """[rank 0's results, rank 1's results] of the one launch."""
    out = tmp_path_factory.mktemp("lightning_accelerate")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        torchrun = shutil.which("torchrun")
    cmd = [torchrun, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()),
           os.path.join(ROOT, "tests", "lightning_accelerate_ranks.py"), str(out), str(STEPS)]
    env = dict(os.environ, **RANK_ENV)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = []
    for rank in range(2):
        with open(out / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


def test_the_state_is_built_before_the_process_group(runs):
    # Lightning's Trainer creates the group; the hook state came first and resolved lazily
    assert [r["group_before_lightning"] for r in runs] == [False, False]
    assert [r["world"] for r in runs] == [2, 2]


@pytest.mark.parametrize("framework", ["lightning", "accelerate"])
def test_alq_trains_like_fp32_and_replicas_agree(runs, framework):
    alq, fp32 = (runs[0][f"{framework}_{kind}"] for kind in ("alq", "fp32"))
    for kind in ("alq", "fp32"):
        np.testing.assert_array_equal(runs[0][f"{framework}_{kind}"]["params"],
                                      runs[1][f"{framework}_{kind}"]["params"])
    assert alq["steps"] == STEPS, "the hook did not run at every step"
    assert [r[f"{framework}_alq"]["version"] for r in runs] == [alq["version"]] * 2
    assert alq["version"] >= 2, "the level table was not refitted at step 100"
    np.testing.assert_array_equal(runs[0][f"{framework}_alq"]["levels"],
                                  runs[1][f"{framework}_alq"]["levels"])
    assert not np.allclose(alq["levels"], horovod_aq.ALQ(bits=3).quantizer.table.levels)
    assert fp32["accuracy"] > 0.85, fp32
    assert abs(alq["accuracy"] - fp32["accuracy"]) <= ACCURACY_TOLERANCE, \
        (framework, alq["accuracy"], fp32["accuracy"])
    print(f"{framework}: ALQ 3-bit {alq['accuracy']:.3f}, fp32 {fp32['accuracy']:.3f}")
