"""Horovod's stock TensorFlow path carries whatever hvd.Compression.fp16 carries, as the PyTorch one
does: a dequantized value ℓ·‖v‖₂ is up to √B times a coordinate, so without the wire scale
(:func:`horovod_aq.stock.wire_scale`, 2^−⌈log₂√B⌉) the fp16 sum overflows ~30x earlier than
Horovod's own fp16 and the range guard stops the step.

Gradients whose coordinates all have magnitude 12000-13300 on 2 ranks (|r| ≈ 1/√B after the L2
normalization, which QSGD 2-bit and NUQSGD 3-bit round up to the levels 1/3 and 1/8: an unscaled
2-rank sum would reach 2.8e5 and 1.0e5, measured with the numpy codec, while Horovod's fp16 sum
peaks at 2.7e4): the sum must stay finite, and the average of REPEATS steps must be unbiased —
its squared error from the fp32 average within [0.5, 2] x its expectation Σᵢ Var(avgᵢ)/REPEATS,
computed from the table (stochastic rounding between levels a < r < b has variance
(b − r)(r − a)·‖v‖²)."""

from __future__ import annotations

import numpy as np
import pytest

from horovod_aq.tools.launcher import run_local
from tests.ranks import init_tf

pytestmark = pytest.mark.multiprocess

PEAK = 12000.0
N, B, P = 4096, 1024, 2
REPEATS = 200
COMPRESSORS = {"qsgd": ("QSGD", 2), "nuqsgd": ("NUQSGD", 3)}


def gradient(rank: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    signs = np.where(rng.random(N) < 0.5, -1.0, 1.0)
    return (signs * PEAK * (1 + 0.05 * rng.random(N)) * (1.0 + 0.05 * rank)).astype(np.float32)


def large_gradients():
    tf, hvd = init_tf()
    import horovod_aq
    from horovod_aq import stock

    grad = tf.constant(gradient(hvd.rank()))
    out, scales = {}, {}
    comps = {"fp16": hvd.Compression.fp16}
    comps.update({name: getattr(horovod_aq, cls)(bits=bits, bucket_size=B, seed=5)
                  for name, (cls, bits) in COMPRESSORS.items()})
    for name, comp in comps.items():

        @tf.function
        def step(g, comp=comp, name=name):   # as Horovod runs it: traced once, run every step
            wire, ctx = comp.compress(g)
            return comp.decompress(hvd.allreduce(wire, op=hvd.Average, name=name), ctx)

        repeats = REPEATS if name != "fp16" else 1
        out[name] = sum(step(grad).numpy().astype(np.float64) for _ in range(repeats)) / repeats
        if name != "fp16":
            scales[name] = stock.wire_scale(comp)
    return {"avg": out, "scales": scales}


@pytest.fixture(scope="module")
def launch():
    return run_local([large_gradients], np=P, controller="gloo", timeout=600)


def variance_of_average(levels: np.ndarray) -> np.ndarray:
    """Var of the P-rank average of one quantization of each rank's gradient, per coordinate."""
    total = np.zeros(N)
    for rank in range(P):
        x = gradient(rank).astype(np.float64).reshape(-1, B)
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        r = x / norms
        hi = np.clip(np.searchsorted(levels, r), 1, len(levels) - 1)
        a, b = levels[hi - 1], levels[hi]
        total += ((b - r) * (r - a) * norms ** 2).reshape(-1)
    return total / P ** 2


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_stock_path_carries_what_fp16_carries(launch, name):
    import horovod_aq

    r = launch.get(large_gradients)[0]
    assert r["scales"][name] == 2.0 ** -5        # 1/√1024, the PyTorch stock path's scale
    assert np.all(np.isfinite(r["avg"]["fp16"]))
    got = r["avg"][name]
    assert np.all(np.isfinite(got))
    cls, bits = COMPRESSORS[name]
    levels = getattr(horovod_aq, cls)(bits=bits, bucket_size=B).table.levels
    expected = np.mean([gradient(rank).astype(np.float64) for rank in range(P)], axis=0)
    ratio = np.sum((got - expected) ** 2) / (variance_of_average(levels).sum() / REPEATS)
    assert 0.5 < ratio < 2.0, ratio
