"""The adaptive defaults in training: L∞ buckets of 256 (docs/quantizers.md §5.6, §5.7).

One process simulates the demo's two ranks (``benchmarks/demo_sim.py``: the example's data,
initial weights, sample order and learning rate; every rank's gradient goes through the compressor
as on the packed allgather exchange, and refits run over a ``LocalComm``) for 40 steps. The
normalized variance E‖Q(g) − g‖²/‖g‖² of the steps after 20 is an exact expectation on the
gradients that training produced. Measured (seed 0, deterministic): 0.122 with the default ALQ
3-bit table refitted on schedule; 0.267 for the same compressor that never refits (its
Gaussian-prior table); 0.439 for the former default (L2 buckets of 1024, refitted). The threshold
0.2 separates them, so the test fails if the default stops adapting or reverts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("mlxtend")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import horovod_aq  # noqa: E402
from benchmarks import demo_sim  # noqa: E402

STEPS = 40
#: Steps whose variance the test averages (the first refits are done by then).
FROM_STEP = 20
DIAG_EVERY = 4


def _variance(config: str) -> tuple[float, dict]:
    run = demo_sim.run(config, 0, workers=2, epochs=1, lr=0.05, batch=32,
                       diag_every=DIAG_EVERY, max_steps=STEPS)
    gammas = run["diag"]["gamma"][FROM_STEP // DIAG_EVERY:]
    return float(np.mean(gammas)), run


def test_default_alq_3bit_adapts_to_low_variance_in_training():
    comp = horovod_aq.ALQ(bits=3)
    assert (comp.norm, comp.bucket_size) == ("linf", 256)
    adapted, run = _variance("alq:bits=3")
    assert run["table_version"] >= 1
    assert not np.allclose(run["table"], comp.table.levels)        # moved off the prior fit
    frozen, frozen_run = _variance("alq:bits=3,schedule=0")
    assert frozen_run["table_version"] == 0
    assert adapted < 0.2 < frozen, (adapted, frozen)
    assert run["history"][-1]["train_loss"] < 2.0                  # it trains (chance: 2.3)
