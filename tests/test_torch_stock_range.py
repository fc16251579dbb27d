"""Horovod's stock PyTorch path carries whatever hvd.Compression.fp16 carries (issue: a dequantized
value ℓ·‖v‖₂ is up to √B times a coordinate, so unscaled fp16 overflowed ~30x earlier).

Gradients with coordinates up to 4000 on 2 ranks: Horovod's fp16 sum stays below 65504, so must
ours; the average must be unbiased (mean over repeated steps close to the fp32 average)."""

from __future__ import annotations

import numpy as np
import pytest

from horovod_aq.tools.launcher import run_local
from tests.ranks import init_torch

pytestmark = pytest.mark.multiprocess

PEAK = 4000.0
REPEATS = 200


def large_gradients():
    torch, hvd = init_torch()
    import horovod_aq

    out = {}
    gen = torch.Generator().manual_seed(0)
    base = (torch.rand(4096, generator=gen) * 2 - 1) * PEAK      # same on every rank
    grad = base * (1.0 + 0.1 * hvd.rank())
    for name, comp in (("fp16", hvd.Compression.fp16),
                       ("alq", horovod_aq.ALQ(bits=3, bucket_size=1024, seed=5)),
                       ("qsgd", horovod_aq.QSGD(bits=4, bucket_size=1024, seed=5))):
        total = torch.zeros(4096, dtype=torch.float64)
        for i in range(REPEATS if name != "fp16" else 1):
            wire, ctx = comp.compress(grad.clone())
            summed = hvd.allreduce(wire, op=hvd.Average, name=f"{name}.{i}")
            total += comp.decompress(summed, ctx).double()
        out[name] = (total / (REPEATS if name != "fp16" else 1)).numpy()
    expected = hvd.allreduce(grad, op=hvd.Average, name="fp32").double().numpy()
    return {"avg": out, "expected": expected}


@pytest.fixture(scope="module")
def launch():
    return run_local([large_gradients], np=2, controller="gloo", timeout=300)


@pytest.mark.parametrize("name", ["alq", "qsgd"])
def test_stock_path_carries_what_fp16_carries(launch, name):
    r = launch.get(large_gradients)[0]
    assert np.all(np.isfinite(r["avg"]["fp16"]))
    got = r["avg"][name]
    assert np.all(np.isfinite(got))
    # unbiased: the mean of REPEATS quantized averages is within 5 standard errors of the fp32
    # average (per-coordinate quantization std <= bucket norm ≈ sqrt(B)·PEAK/√3, over √REPEATS,
    # halved by the 2-rank average → tolerance on the relative error of the whole vector)
    rel = np.linalg.norm(got - r["expected"]) / np.linalg.norm(r["expected"])
    assert rel < 0.15, rel
