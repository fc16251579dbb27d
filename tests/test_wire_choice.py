"""``wire="auto"`` (docs/protocol.md §5.5): the candidates, the rule that picks one from its timed
trials (checked on noisy trials with outliers), the schedule, the agreement over a threaded
multi-rank Comm, checkpoints and bad input."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from horovod_aq.packed import autowire
from horovod_aq.packed.autowire import AutoWire, WireDecision, with_modes
from horovod_aq.packed.choice import (
    TOLERANCE,
    Trials,
    WireChoice,
    allowed_modes,
    candidates,
    choose,
)
from horovod_aq.packed.cost import TWO_PHASE_MIN_RANKS
from horovod_aq.packed.plan import BucketPlan

#: How much slower than the fastest candidate the choice may truly be: the target of issue 36
#: ("auto takes at most 1.05x the step of the fastest fixed mode").
TARGET = 1.05


def _plans(numels, mode="allgather"):
    return [BucketPlan(i, f"m.{i}.{i:08x}", (i,), n, mode) for i, n in enumerate(numels)]


# ------------------------------------------------------------------------------ candidates
def test_candidates_cover_every_coding_in_every_allowed_mode():
    both = ("fixed", "entropy")
    assert candidates(2) == tuple(WireChoice(c, "allgather") for c in both)
    assert candidates(4) == tuple(WireChoice(c, m) for m in ("allgather", "two_phase")
                                  for c in both)
    assert candidates(TWO_PHASE_MIN_RANKS) == tuple(WireChoice(c, "two_phase") for c in both)
    assert candidates(4, "two_phase") == tuple(WireChoice(c, "two_phase") for c in both)
    assert allowed_modes(4, "allgather") == ("allgather",)
    with pytest.raises(ValueError, match="exchange must be"):
        allowed_modes(4, "ring")


# ------------------------------------------------------------------------------ the rule
def test_the_fastest_wins_unless_the_leanest_is_within_the_tolerance():
    fast_fat = Trials((1.0, 1.0, 1.0), (10e6,) * 3)
    lean_close = Trials((1.02, 1.02, 1.02), (4e6,) * 3)
    lean_slow = Trials((1.3, 1.3, 1.3), (4e6,) * 3)
    assert choose([fast_fat, lean_close])[0] == 1                 # cannot tell: fewer bytes
    assert "fewest bytes, and within 3%" in choose([fast_fat, lean_close])[1]
    assert choose([fast_fat, lean_slow]) == (0, "the fastest (the candidate with the fewest "
                                                "bytes took 1.30x as long)")
    assert choose([lean_close])[1] == "the fastest, and the fewest bytes"
    # the faster half: slow steps (a cache miss after a switch) do not decide
    spiky = Trials((0.5, 9.0, 0.5, 7.0), (4e6,) * 4)
    assert spiky.time == 0.5 and choose([fast_fat, spiky])[0] == 1
    with pytest.raises(ValueError, match="at least one timed step"):
        choose([fast_fat, Trials((), ())])


@pytest.mark.parametrize("noise", [0.03, 0.10])
def test_the_choice_is_within_the_target_of_the_fastest_on_noisy_trials(noise):
    """Random candidates (true step times 0.1-5 s, bytes 1-100 MB), k = 4 trials each with
    ``noise`` relative jitter and one step in five an outlier 1.5-4x slower (a cache miss, a
    descheduled rank), as on a shared 2-core host: the choice's true time is within TARGET of
    the fastest in almost every draw, and never far off."""
    rng = np.random.default_rng(0)
    draws, off, worst = 3000, 0, 1.0
    for _ in range(draws):
        count = int(rng.choice([2, 4]))
        true = rng.uniform(0.1, 5.0, count)
        if rng.random() < 0.5:   # near-ties, where the rule prefers fewer bytes
            true = true.min() * rng.uniform(1.0, 1.06, count)
        nbytes = rng.uniform(1e6, 1e8, count)
        trials = []
        for t, b in zip(true, nbytes):
            steps = t * (1 + rng.normal(0, noise, 4))
            slow = rng.random(4) < 0.2
            steps[slow] *= rng.uniform(1.5, 4.0, slow.sum())
            trials.append(Trials(tuple(steps), (b,) * 4))
        chosen = choose(trials)[0]
        ratio = true[chosen] / true.min()
        worst = max(worst, ratio)
        off += ratio > TARGET
    assert off / draws < (0.01 if noise < 0.05 else 0.03), off
    assert worst < 1.5, worst
    assert TOLERANCE < TARGET - 1


# ------------------------------------------------------------------------------ schedule
def test_schedule_warms_up_runs_each_candidate_in_turn_and_decides_at_one_boundary():
    w = AutoWire(warmup_steps=2, trials=2, ranks=4)
    assert [w.coding(t, 0) for t in range(10, 12)] == ["fixed", "fixed"]   # warm-up from 10
    assert w.measure_steps == 8 and w.decision_step == 20
    trial = [(w.coding(t, i), w.mode(t, i, "allgather")) for t in range(12, 20) for i in (0, 1)]
    cands = [(c.coding, c.mode) for c in candidates(4)]
    assert trial == [cands[j % 4] for j in range(8) for _ in (0, 1)]   # all buckets alike
    assert [w.trial(t) for t in (11, 12, 19, 20)] == [None, 0, 7, None]
    assert [w.due(t) for t in (18, 19)] == [False, True]
    assert w.mode(11, 0, "two_phase") == "two_phase"    # warm-up: the planned mode
    assert AutoWire("entropy").coding(0, 3) == "entropy" and not AutoWire("fixed").due(99)
    with pytest.raises(ValueError, match="wire must be one of"):
        AutoWire("zstd")
    with pytest.raises(ValueError, match="warmup_steps must be >= 1"):
        AutoWire(warmup_steps=0)


def test_only_trial_steps_are_recorded():
    w = AutoWire(warmup_steps=1, trials=1, ranks=2)
    w.begin(0)
    for step in range(5):
        w.record_step(step, 0.1, 100.0, 50.0)
    assert [row[0] for row in w._rows] == [0, 1]      # steps 1 and 2: the two trials


# ------------------------------------------------------------------------------ agreement
class Hub:
    """Shared memory of P threads that play P ranks."""

    def __init__(self, size):
        self.size, self.slots = size, {}
        self.barrier = threading.Barrier(size, timeout=20)
        self.names = [[] for _ in range(size)]


class ThreadComm:
    """A refit ``Comm`` of one rank among the Hub's threads (allgather and broadcast)."""

    def __init__(self, hub, rank):
        self.hub, self.rank, self.size = hub, rank, hub.size

    def _exchange(self, name, value, read):
        self.hub.names[self.rank].append(name)
        self.hub.slots[(name, self.rank)] = value
        self.hub.barrier.wait()
        out = read()
        self.hub.barrier.wait()
        return out

    def allgather(self, array, name):
        row = np.ascontiguousarray(array).reshape(1, -1).copy()
        return self._exchange(name, row, lambda: np.concatenate(
            [self.hub.slots[(name, r)] for r in range(self.size)]))

    def broadcast(self, array, root, name):
        got = self._exchange(name, np.array(array, copy=True),
                             lambda: self.hub.slots[(name, root)].copy())
        assert got.shape == np.shape(array) and got.dtype == np.asarray(array).dtype
        return got


#: True step seconds and bytes (every rank, per step) of the 4 candidates at 4 ranks: fixed and
#: entropy allgather, fixed and entropy two-phase.
TRUE = {("fixed", "allgather"): (0.90, 12e6), ("entropy", "allgather"): (0.80, 9e6),
        ("fixed", "two_phase"): (0.41, 6e6), ("entropy", "two_phase"): (0.40, 4.5e6)}


def _run_ranks(p, plans, *, slow_rank=None):
    hub = Hub(p)

    def rank_main(rank):
        rng = np.random.default_rng(rank)
        w = AutoWire(name="key", ranks=p)
        w.begin(5)
        for t in range(5, w.decision_step):
            c = w._wire_at(t, 0)
            seconds, nbytes = (0.05, 1e6) if c is None else TRUE[(c.coding, c.mode)]
            seconds *= 1 + abs(rng.normal(0, 0.02))
            if rank == slow_rank:   # one rank slower: a step takes its slowest rank's time
                seconds *= 1.5
            w.record_step(t, seconds, nbytes / p, nbytes / p / (p - 1))
        assert w.due(w.decision_step - 1)
        return w, w.decide(ThreadComm(hub, rank), plans)

    with ThreadPoolExecutor(p) as pool:
        return list(pool.map(rank_main, range(p))), hub


def test_every_rank_gets_rank_0s_decision(caplog):
    plans = _plans([2**20, 2**16, 3000])
    with caplog.at_level(logging.INFO, logger="horovod_aq.packed.autowire"):
        results, hub = _run_ranks(4, plans)
    decisions = [d for _, d in results]
    assert all(np.array_equal(d.to_array(), decisions[0].to_array()) for d in decisions)
    d = decisions[0]
    assert d.decided and d.step == 5 + autowire.WARMUP_STEPS + 4 * autowire.TRIALS
    # two-phase entropy is as fast as two-phase fixed within the noise and sends fewer bytes
    assert all(c.coding == "entropy" and c.mode == "two_phase" for c in d.choices)
    assert d.choices[0].seconds == pytest.approx(0.40, rel=0.05)
    assert d.choices[0].fixed_seconds == pytest.approx(0.90, rel=0.05)
    assert all(names == hub.names[0] for names in hub.names)   # rank-independent names
    assert hub.names[0] == ["aq.wire.trials.key", "aq.wire.decision.key"]
    assert caplog.text.count("horovod_aq: key: wire from step") == 1   # logged once (rank 0)
    assert "fewest bytes" in caplog.text and "fixed/allgather 0.9" in caplog.text
    w = results[2][0]
    assert w.coding(d.step, 0) == "entropy" and w.mode(d.step, 0, "allgather") == "two_phase"
    assert [p.mode for p in with_modes(plans, d)] == ["two_phase"] * 3


def test_a_step_takes_its_slowest_ranks_time():
    results, _ = _run_ranks(3, _plans([2**20]), slow_rank=2)
    assert results[0][1].choices[0].seconds == pytest.approx(0.40 * 1.5, rel=0.05)


def test_a_failed_choice_on_the_root_is_a_fallback_on_every_rank(caplog):
    plans = _plans([2**20, 2**16], mode="two_phase")
    hub = Hub(3)

    def rank_main(rank):
        w = AutoWire(ranks=3)
        w.begin(0)   # nothing recorded: the root has no trial times
        return w.decide(ThreadComm(hub, rank), plans)

    with caplog.at_level(logging.WARNING), ThreadPoolExecutor(3) as pool:
        decisions = list(pool.map(rank_main, range(3)))
    assert all(not d.decided for d in decisions)
    assert all(c == WireChoice("fixed", "two_phase") for d in decisions for c in d.choices)
    assert "at least one timed step" in caplog.text


def test_one_rank_decides_without_collectives():
    from horovod_aq.refit import LocalComm

    w = AutoWire()
    w.begin(0)
    d = w.decide(LocalComm(), _plans([100]))
    assert d.choices == (WireChoice("fixed", "allgather"),)


# ------------------------------------------------------------------------------ checkpoints
def test_the_decision_round_trips_through_state_dict():
    plans = _plans([2**20, 2**16])
    w, d = _run_ranks(4, plans)[0][0]
    state = w.state_dict()
    again = AutoWire(name="key", ranks=4)
    again.load_state_dict(state)
    assert np.array_equal(again.decision.to_array(), d.to_array())
    assert again.start == w.start and not again.due(d.step + 10)
    assert [again.coding(d.step + 3, i) for i in range(2)] == [w.coding(d.step + 3, i)
                                                               for i in range(2)]
    other = AutoWire("fixed")
    other.load_state_dict(state)          # another wire setting: measured again (not applied)
    assert other.decision is None
    fresh = AutoWire()
    fresh.load_state_dict(AutoWire().state_dict())    # undecided: restarts at first use
    assert fresh.start is None and fresh.coding(50, 0) == "fixed" and fresh.start == 50


def test_bad_decision_vectors_and_foreign_plans_are_refused():
    d = WireDecision(7, autowire.plans_digest(_plans([10])), (WireChoice("fixed",
                                                                         "allgather"),))
    assert WireDecision.from_array(d.to_array()) == d
    with pytest.raises(ValueError, match="not a wire decision vector"):
        WireDecision.from_array(d.to_array()[:-1])
    with pytest.raises(ValueError, match="restart the measurement"):
        with_modes(_plans([11]), d)
