"""The adaptive defaults in training: L∞ buckets of 256 (docs/quantizers.md §5.6, §5.7).

One process simulates the demo's two ranks (``benchmarks/demo_sim.py``: the example's data,
initial weights, sample order and learning rate; every rank's gradient goes through the compressor
as on the packed allgather exchange, and refits run over a ``LocalComm``) for 40 steps. The
normalized variance E‖Q(g) − g‖²/‖g‖² of the steps after 20 is an exact expectation on the
gradients that training produced. Measured (seed 0, deterministic): 0.122 with the default ALQ
3-bit table refitted on schedule; 0.267 for the same compressor that never refits (its
Gaussian-prior table); 0.439 for the former default (L2 buckets of 1024, refitted). The threshold
0.2 separates them, so the test fails if the default stops adapting or reverts.

The packed entry points' ``error_feedback="auto"`` (docs/quantizers.md §5.9) is pinned here too:
its default on every entry point and its width; tests/test_error_feedback_setting.py has the
rule's table, and the 2-rank launch of tests/test_torch_optimizer.py (``ef_auto_two_bits``) shows
the memory in use while training.
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


#: The packed entry points and the function whose ``error_feedback=`` default is pinned (the
#: TF/Keras ones are read from their source, so this test needs no TensorFlow).
PACKED_ENTRY_POINTS = [("horovod_aq/torch/distributed_optimizer.py", "DistributedOptimizer"),
                       ("horovod_aq/torch/ddp.py", "__init__"),
                       ("horovod_aq/tensorflow/tape.py", "DistributedGradientTape"),
                       ("horovod_aq/tensorflow/keras.py", "DistributedOptimizer"),
                       ("horovod_aq/tensorflow/keras.py", "_settings")]


@pytest.mark.parametrize("path, function", PACKED_ENTRY_POINTS)
def test_error_feedback_defaults_to_auto_on_every_packed_entry_point(path, function):
    """docs/quantizers.md §5.9: error_feedback="auto" everywhere the packed exchange starts."""
    import ast

    tree = ast.parse((Path(__file__).resolve().parents[1] / path).read_text())
    found = [node for node in ast.walk(tree)
             if isinstance(node, ast.FunctionDef) and node.name == function]
    defaults = {}
    for node in found:
        args = node.args
        named = args.kwonlyargs + args.args[len(args.args) - len(args.defaults):]
        values = args.kw_defaults + args.defaults
        defaults.update({a.arg: v for a, v in zip(named, values) if a.arg == "error_feedback"})
    assert "error_feedback" in defaults, f"{path}:{function} has no error_feedback keyword"
    assert ast.literal_eval(defaults["error_feedback"]) == "auto"


def test_auto_error_feedback_is_on_up_to_three_bits_and_off_at_four():
    """The rule's width (docs/quantizers.md §5.9, §5.10) and what the DDP hook state, which needs
    no process group to resolve it, ends up using."""
    from horovod_aq import error_feedback_setting
    from horovod_aq.torch.ddp import QuantizedHookState

    assert error_feedback_setting.AUTO_MAX_BITS == 3
    for bits in (2, 3):
        comp = horovod_aq.ALQ(bits=bits)
        state = QuantizedHookState(comp)
        assert isinstance(state.compression, horovod_aq.ErrorFeedback)
        assert state.compression.quantizer is comp and state.prefix.startswith("ecq.")
    four = horovod_aq.ALQ(bits=4)
    assert QuantizedHookState(four).compression is four
    off = QuantizedHookState(horovod_aq.ALQ(bits=3), error_feedback=False)
    assert off.compression.error_memory is None
    import torch

    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])   # §5.11
    three = horovod_aq.ALQ(bits=3)
    assert QuantizedHookState(three, optimizer=adamw).compression is three


def test_demo_sim_stops_a_diverging_run_and_says_where():
    """At a learning rate far past stability the gradients become non-finite; the simulation
    records the step and stops instead of failing inside the codec (which refuses them)."""
    run = demo_sim.run("alq:bits=2", 0, workers=2, epochs=1, lr=50.0, batch=32,
                       diag_every=0, max_steps=60)
    assert run["diverged_step"] is not None and 0 < run["diverged_step"] < 60, run["diverged_step"]
    stable = demo_sim.run("fp32", 0, workers=2, epochs=1, lr=0.05, batch=32,
                          diag_every=0, max_steps=10)
    assert stable["diverged_step"] is None
