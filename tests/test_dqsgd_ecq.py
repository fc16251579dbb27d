"""DQSGD bit rule and ECQ-SGD error compensation (single process; numpy simulation)."""

from __future__ import annotations

import numpy as np
import pytest

import horovod_aq
from horovod_aq import codec
from horovod_aq.refit import LocalComm
from horovod_aq.schedule import DQSGDRule, dqsgd_bits
from horovod_aq.tools.simulate import LeastSquares, run_sgd


def _drive(rule: DQSGDRule, norms) -> list[int]:
    bits = [rule.first_bits()]
    for step, g in enumerate(norms[:-1], start=1):
        bits.append(rule.next_bits(step, bits[-1], g))
    return bits


# --------------------------------------------------------------------------- the rule
def test_dqsgd_formula():
    # B = log2(t·G + 1) + 1: t·G = 7 gives exactly 4 bits
    assert dqsgd_bits(7.0, 1.0) == pytest.approx(4.0)
    assert dqsgd_bits(0.0, 5.0) == pytest.approx(1.0)


@pytest.mark.parametrize("pattern", ["decay", "growth", "noisy", "spiky"])
def test_budget_is_never_exceeded(pattern):
    rng = np.random.default_rng(1)
    n = 400
    steps = np.arange(n)
    norms = {"decay": 1.0 / (1 + 0.05 * steps),
             "growth": np.exp(steps / 80.0),           # adversarial: norms keep rising
             "noisy": np.abs(rng.standard_normal(n)) + 0.01,
             "spiky": np.where(steps % 37 == 0, 100.0, 0.1)}[pattern]
    budget = 3.0 * n
    rule = DQSGDRule(budget=budget, horizon=n, min_bits=2, max_bits=8)
    bits = _drive(rule, list(norms))
    assert sum(bits) <= budget
    assert min(bits) >= 2 and max(bits) <= 8
    # the budget is used, not hoarded: within one max-width step of it
    assert sum(bits) >= budget - 8


@pytest.mark.parametrize("target", [2.5, 4.0, 6.0])
def test_target_mean_is_met(target):
    rng = np.random.default_rng(2)
    n = 1000
    norms = (1.0 / (1 + 0.01 * np.arange(n))) * (1 + 0.5 * rng.random(n))
    bits = _drive(DQSGDRule(target_bits=target), list(norms))
    # integral feedback keeps the running mean on target (rounding to integers: ±0.1)
    assert abs(np.mean(bits) - target) < 0.1


def test_bits_follow_the_gradient_norm():
    # with a stationary mix of small and large norms, large norms get more bits
    norms = [0.1, 10.0] * 200
    bits = _drive(DQSGDRule(target_bits=4.0, window=20), norms)
    after_small = [b for b, g in zip(bits[1:], norms[:-1]) if g == 0.1][20:]
    after_large = [b for b, g in zip(bits[1:], norms[:-1]) if g == 10.0][20:]
    assert np.mean(after_large) > np.mean(after_small) + 1


def test_strongly_convex_mode_spends_more_bits_late():
    n = 300
    bits = _drive(DQSGDRule(budget=4.0 * n, horizon=n, alpha=0.99), [1.0] * n)
    assert sum(bits) <= 4.0 * n
    assert np.mean(bits[-50:]) > np.mean(bits[:50])


@pytest.mark.parametrize("kwargs, message", [
    ({"budget": 100.0}, "horizon"),
    ({"budget": 10.0, "horizon": 10, "min_bits": 2}, "cannot be met"),
    ({"target_bits": 9.0}, "target_bits"),
    ({"min_bits": 5, "max_bits": 3}, "min_bits"),
    ({"alpha": 0.5}, "strongly convex"),
])
def test_rule_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DQSGDRule(**kwargs)


# --------------------------------------------------------------------------- the compressor
def test_dqsgd_tables_follow_the_bits():
    comp = horovod_aq.DQSGD(target_bits=4.0, bucket_size=64)
    rng = np.random.default_rng(0)
    for step in range(30):
        assert comp.table.bits == comp.bits
        assert comp.table.num_levels == 2 ** comp.bits
        g = rng.standard_normal(1000) * (10.0 if step % 2 else 0.01)
        payload = codec.encode(g.astype(np.float32), comp.table, bucket_size=64, seed=step)
        assert codec.parse_header(payload).bits == comp.bits   # every payload states its bits
        comp.observe_aggregate(g)
        comp.end_step(LocalComm())
    assert len(set(comp.bits_history)) > 1


def test_dqsgd_state_dict_round_trip():
    a = horovod_aq.DQSGD(target_bits=3.0, levels="alq", bucket_size=256, schedule="0,3,0")
    rng = np.random.default_rng(0)
    for _ in range(5):
        g = rng.standard_normal(4096)
        if a.recording:
            a.record_gradient(g)
        a.observe_aggregate(g)
        a.end_step(LocalComm())
    b = horovod_aq.DQSGD(target_bits=3.0, levels="alq", bucket_size=256, schedule="0,3,0")
    b.load_state_dict(a.state_dict())
    assert (b.bits, b.step) == (a.bits, a.step)
    for w in a.widths:
        assert b.widths[w].table.same_as(a.widths[w].table)
        assert a.widths[w].table.version == 2       # every width refitted at steps 0 and 3
    assert b.rule.norms == a.rule.norms and b.rule.spent == a.rule.spent


def test_dqsgd_rejects_single_width_families():
    with pytest.raises(ValueError, match="multi-width"):
        horovod_aq.DQSGD(levels="terngrad")


# --------------------------------------------------------------------------- ECQ-SGD
def test_ecq_update_rule_is_the_papers():
    ef = horovod_aq.ErrorFeedback(horovod_aq.QSGD(bits=2), alpha=0.3, beta=0.7)
    g1, q1 = np.array([1.0, 2.0]), np.array([0.5, 2.5])
    np.testing.assert_array_equal(ef.compensate("k", g1), g1)     # h = 0 at the start
    ef.update("k", g1, q1)
    np.testing.assert_allclose(ef.memory["k"], g1 - q1)           # h = g − g̃
    g2, q2 = np.array([0.0, 1.0]), np.array([1.0, 1.0])
    np.testing.assert_allclose(ef.compensate("k", g2), g2 + 0.3 * (g1 - q1))
    ef.update("k", g2, q2)
    # h ← β·h + (g − g̃): the α·h term is NOT part of the accumulated error
    np.testing.assert_allclose(ef.memory["k"], 0.7 * (g1 - q1) + (g2 - q2))


def test_ecq_refuses_the_stock_path():
    import torch

    ef = horovod_aq.ECQ(horovod_aq.QSGD(bits=2))
    with pytest.raises(TypeError, match="parameter"):
        ef.compress(torch.ones(10))


def test_ecq_state_dict_keeps_memory():
    ef = horovod_aq.ErrorFeedback(horovod_aq.NUQSGD(bits=3))
    ef.update("bucket0", np.ones(4, np.float32), np.zeros(4, np.float32))
    other = horovod_aq.ErrorFeedback(horovod_aq.NUQSGD(bits=3))
    other.load_state_dict(ef.state_dict())
    np.testing.assert_array_equal(other.compensate("bucket0", np.zeros(4, np.float32)),
                                  np.float32(0.2) * np.ones(4, np.float32))
    with pytest.raises(ValueError, match="alpha"):
        horovod_aq.ErrorFeedback(horovod_aq.NUQSGD(bits=3), alpha=0.5).load_state_dict(
            ef.state_dict())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ecq_beats_plain_qsgd_on_least_squares(seed):
    # The ECQ-SGD paper's synthetic linear regression (Syn-256): 4 workers, lr 0.02, 300 steps,
    # 2-bit QSGD (uniform zero-free levels ±{1/3, 1}) on buckets of 64 coordinates, with and
    # without error compensation (α = 0.2, β = 0.9). Measured: ECQ ends at about half the loss
    # (seed 1: 0.0073 vs 0.0148); the assertion asks for 25% lower.
    problem = LeastSquares.synthetic(n=10_000, dim=256, seed=seed)
    plain = run_sgd(problem, horovod_aq.QSGD(bits=2, bucket_size=64), steps=300, seed=seed)
    ecq = run_sgd(problem, horovod_aq.ErrorFeedback(horovod_aq.QSGD(bits=2, bucket_size=64)),
                  steps=300, seed=seed)
    assert ecq.losses[-1] < 0.75 * plain.losses[-1]
    assert ecq.distance < plain.distance
