"""Constructor validation: every bad argument is refused at construction, with an exception that
names the argument and the allowed values (``horovod_aq.compressors.arguments``)."""

from __future__ import annotations

import numpy as np
import pytest

import horovod_aq
from horovod_aq import codec
from horovod_aq.codec.stream import StreamKey
from horovod_aq.compressors import arguments
from horovod_aq.compressors.arguments import SettingTypeError
from horovod_aq.packed.protocol import check_exchange_args
from horovod_aq.schedule import RefitSchedule

T, V = SettingTypeError, ValueError
SCHEDULE = "schedule must be a horovod_aq.RefitSchedule (e.g. RefitSchedule(steps="

#: (call, exception, message fragment)
BAD = [
    # bits
    (lambda: horovod_aq.ALQ(bits=True), T, "bits must be an integer in 1..8, got True (bool)"),
    (lambda: horovod_aq.QSGD(bits=3.0), T, "bits must be an integer in 1..8, got 3.0 (float)"),
    (lambda: horovod_aq.QSGD(bits="3"), T, "bits must be an integer in 1..8, got '3' (str)"),
    (lambda: horovod_aq.QSGD(bits=0), V, "bits must be an integer in 1..8, got 0"),
    (lambda: horovod_aq.ALQ(bits=9), V, "bits must be an integer in 1..8, got 9"),
    (lambda: horovod_aq.NaturalDithering(bits=1), V, "NaturalDithering needs bits >= 2"),
    (lambda: horovod_aq.NaturalDithering(bits="3"), T, "bits must be an integer in 2..8"),
    # bucket_size
    (lambda: horovod_aq.QSGD(bucket_size=2**40), V,
     "bucket_size must be an integer >= 2 and <= 4294967295 (the payload header stores it in "
     "32 bits), got 1099511627776"),
    (lambda: horovod_aq.ALQ(bucket_size=1), V, "bucket_size must be an integer >= 2"),
    (lambda: horovod_aq.ALQ(bucket_size=512.0), T, "bucket_size must be an integer >= 2"),
    # seed
    (lambda: horovod_aq.ALQ(seed=None), T, "seed must be >= 0 (an integer, the same on every "
                                           "rank: it keys the random stream"),
    (lambda: horovod_aq.QSGD(seed=-1), V, "seed must be >= 0"),
    (lambda: horovod_aq.QSGD(seed="0"), T, "got '0' (str)"),
    # top_k
    (lambda: horovod_aq.ALQ(top_k="5"), T, "top_k must be >= 1 (an integer), got '5' (str)"),
    (lambda: horovod_aq.ALQ(top_k=0), V, "top_k must be >= 1"),
    (lambda: horovod_aq.ALQ(top_k=2.5), T, "top_k must be >= 1"),
    # norm, nonfinite, name
    (lambda: horovod_aq.QSGD(norm="l1"), V, "norm must be one of ('l2', 'linf'), got 'l1'"),
    (lambda: horovod_aq.QSGD(norm=2), T, "norm must be one of ('l2', 'linf'), got 2 (int)"),
    (lambda: horovod_aq.QSGD(nonfinite="ignore"), V, "nonfinite must be one of ('raise', 'skip')"),
    (lambda: horovod_aq.QSGD(nonfinite=True), T, "nonfinite must be one of"),
    (lambda: horovod_aq.QSGD(name=3), T, "name must be a string or None, got 3 (int)"),
    # schedule
    (lambda: horovod_aq.ALQ(schedule=100), T, SCHEDULE),
    (lambda: horovod_aq.ALQ(schedule=[0, 100]), T, '"0,100,2000,10000" (refit steps, then the '
                                                  "period"),
    (lambda: horovod_aq.ALQ(schedule={}), T, "got {} (dict)"),
    (lambda: horovod_aq.ALQ(schedule="0,a"), V, "comma-separated integers"),
    (lambda: RefitSchedule(every=2.5), T, "every must be a positive integer (the refit period "
                                          "in steps) or None (no period), got 2.5 (float)"),
    (lambda: RefitSchedule(every=0), V, "every must be a positive integer"),
    (lambda: RefitSchedule(every="100"), T, "every must be a positive integer"),
    (lambda: RefitSchedule(steps=(0, 1.5)), T, "steps must be >= 0 (integers: the refit steps), "
                                               "got 1.5 (float)"),
    (lambda: RefitSchedule(steps=(-1,)), V, "steps must be >= 0"),
    (lambda: RefitSchedule(steps="0,100"), T, "RefitSchedule.parse reads the"),
    (lambda: RefitSchedule(steps=100), T, "steps must be a sequence of integers >= 0"),
    # QSGD's s, NUQSGD's p
    (lambda: horovod_aq.QSGD(s=2.5), T, "s must be an integer in 1..127 (2s+1 levels <= 256) "
                                        "or None, got 2.5 (float)"),
    (lambda: horovod_aq.QSGD(s=128), V, "s must be an integer in 1..127"),
    (lambda: horovod_aq.QSGD(s=0), V, "s must be an integer in 1..127"),
    (lambda: horovod_aq.NUQSGD(p="0.5"), T, "p must be a real number in (0.0, 1.0), got '0.5' "
                                            "(str)"),
    (lambda: horovod_aq.NUQSGD(p=1.0), V, "p must be a real number in (0.0, 1.0), got 1.0"),
    (lambda: horovod_aq.NUQSGD(p=float("nan")), V, "p must be a real number in (0.0, 1.0)"),
    (lambda: horovod_aq.NUQSGD(p=True), T, "got True (bool)"),
    # DQSGD
    (lambda: horovod_aq.DQSGD(min_bits=2.5), T, "min_bits must be an integer in 1..8"),
    (lambda: horovod_aq.DQSGD(max_bits=9), V, "max_bits must be an integer in 1..8, got 9"),
    (lambda: horovod_aq.DQSGD(window=0), V, "window must be >= 1 (an integer), got 0"),
    (lambda: horovod_aq.DQSGD(budget=300.0, horizon="100"), T, "horizon must be >= 1"),
    (lambda: horovod_aq.DQSGD(target_bits="4"), T, "target_bits must be a real number"),
    (lambda: horovod_aq.DQSGD(True), T, "bits must be a real number (the target mean width)"),
    (lambda: horovod_aq.DQSGD(warmup_bits=True), T, "warmup_bits must be an integer in 1..8"),
    (lambda: horovod_aq.DQSGD(alpha=2.0, horizon=10), V, "alpha must be a real number in (0.0, "
                                                         "1.0)"),
    (lambda: horovod_aq.DQSGD(levels=3), V, "levels must name a multi-width family"),
    (lambda: horovod_aq.DQSGD(seed=None), T, "seed must be >= 0"),
    # the random stream's key (its step is the compressor's step)
    (lambda: StreamKey(seed=0, step=-7), V, "StreamKey step must be an integer >= 0, got -7"),
    (lambda: StreamKey(seed=None), TypeError, "StreamKey seed must be an integer >= 0, got None"),
    (lambda: StreamKey(seed=0, rank=1.0), TypeError, "StreamKey rank must be an integer >= 0"),
    (lambda: StreamKey(seed=0, bucket=True), TypeError, "StreamKey bucket must be an integer"),
    (lambda: arguments.step(-7), V, "step must be >= 0 (an integer), got -7"),
    # the packed exchange's arguments (the optimizers call check_exchange_args)
    (lambda: check_exchange_args(small_tensor_threshold=-1), V,
     "small_tensor_threshold must be >= 0 (an integer: tensors with fewer elements are sent "
     "uncompressed), got -1"),
    (lambda: check_exchange_args(small_tensor_threshold=10.5), T, "small_tensor_threshold must"),
    (lambda: check_exchange_args(fusion_bytes="64"), T, "fusion_bytes must be >= 4"),
    (lambda: check_exchange_args(fusion_bytes=2), V, "fusion_bytes must be >= 4"),
    (lambda: check_exchange_args(exchange="ring"), V,
     "exchange must be one of ('auto', 'allgather', 'two_phase', 'node_allgather', "
     "'node_two_phase'), got 'ring'"),
    # the codec's own keyword
    (lambda: codec.encode(np.ones(3, np.float32), horovod_aq.QSGD(bits=2).table, bucket_size=2,
                          seed=0, checksum=1), TypeError, "checksum must be True or False"),
]


def _id(case) -> str:
    return case[2][:40]


@pytest.mark.parametrize("call, kind, fragment", BAD, ids=[_id(c) for c in BAD])
def test_bad_arguments_are_refused_at_construction(call, kind, fragment):
    with pytest.raises(kind) as info:
        call()
    assert fragment in str(info.value), str(info.value)
    if kind is T:  # a wrong type is a TypeError, and a ValueError for earlier callers
        assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


def test_good_edge_values_are_accepted():
    comp = horovod_aq.QSGD(bits=np.int64(3), bucket_size=2**32 - 1, seed=np.uint64(5), top_k=1)
    assert (comp.bits, comp.bucket_size, comp.seed, comp.top_k) == (3, 2**32 - 1, 5, 1)
    assert type(comp.bits) is int and type(comp.bucket_size) is int
    assert horovod_aq.ALQ(schedule="0,100").schedule == RefitSchedule(steps=(0,), every=100)
    assert horovod_aq.ALQ(schedule=RefitSchedule.never()).schedule == RefitSchedule.never()
    assert horovod_aq.NUQSGD(p=np.float32(0.25)).p == 0.25
    assert horovod_aq.QSGD(s=np.int32(2)).bits == 3
    assert RefitSchedule(steps=[np.int64(5), 0], every=np.int64(7)) == RefitSchedule((0, 5), 7)
    assert horovod_aq.DQSGD(4, min_bits=np.int64(2)).rule.min_bits == 2
    assert StreamKey(seed=np.int64(1), step=2**40).counter_words()[0] == 0
    check_exchange_args(exchange="two_phase", fusion_bytes=4, small_tensor_threshold=0)
    # the largest bucket size encodes and decodes a small tensor in bounded memory
    payload = codec.encode(np.float32([0.5, -1.0]), comp.table, bucket_size=comp.bucket_size,
                           key=StreamKey(seed=comp.seed))
    assert codec.decode(payload, comp.table).shape == (2,)


def test_from_name_refuses_what_is_not_a_name():
    with pytest.raises(TypeError) as info:
        horovod_aq.from_name(None, bits=3)
    assert "from_name needs a compression name (a string), got None (NoneType)" in str(
        info.value) and "'alq'" in str(info.value)
    assert isinstance(info.value, ValueError)   # SettingTypeError, like every other setting
    with pytest.raises(ValueError, match="unknown compression 'alq3'; choose from"):
        horovod_aq.from_name("alq3")
    assert horovod_aq.from_name("ALQ", bits=2).bits == 2


def _trained_alq() -> horovod_aq.ALQ:
    """An ALQ compressor past its first refit (table v1, step 3)."""
    from horovod_aq.refit import LocalComm

    comp = horovod_aq.ALQ(bits=3, bucket_size=64, schedule="0,0")
    comp.record_gradient(np.random.default_rng(0).standard_t(3, 4096))
    for _ in range(3):
        comp.end_step(LocalComm())
    assert (comp.table.version, comp.step) == (1, 3)
    return comp


def _damaged(key: str, value) -> dict:
    state = horovod_aq.ALQ(bits=3, bucket_size=64, schedule="0,0").state_dict()
    state["step"] = 7
    state["table"] = {"levels": np.linspace(-1, 1, 8).tolist(), "version": 4}
    if value is KeyError:
        del state[key]
    else:
        state[key] = value
    return state


#: (state, exception, message fragment): every one leaves the compressor as it was
BAD_STATES = [
    (None, TypeError, "load_state_dict expects the dict that state_dict() returned (of a "
                      "compressor built with the same settings), got NoneType"),
    ([("step", 1)], TypeError, "got list"),
    ({}, ValueError, "this one has no 'config' or 'step' (its keys: [])"),
    (_damaged("config", KeyError), ValueError, "this one has no 'config' (its keys: "),
    (_damaged("step", KeyError), ValueError, "this one has no 'step'"),
    (_damaged("config", "alq"), TypeError, "its 'config' is a str, not a dict"),
    (_damaged("step", -3), ValueError, "its step must be >= 0 (an integer), got -3"),
    (_damaged("step", 2.5), TypeError, "its step must be >= 0 (an integer), got 2.5 (float)"),
    (_damaged("table", {"levels": [0.0, 1.0], "version": 2}), ValueError,
     "its 'table' is not a level table with a version (ValueError: a level table must start at "
     "-1"),
    (_damaged("table", {"levels": [-1.0, 1.0], "version": -1}), ValueError,
     "its 'table' is not a level table with a version (ValueError: version must be >= 0"),
    (_damaged("table", {"levels": [-1.0, 1.0]}), ValueError, "(KeyError: 'version')"),
    (_damaged("table", {"levels": [-1.0, 1.0], "version": 2}), ValueError,
     "its table has 2 levels, this compressor's has 8"),
    (_damaged("framework", 5), TypeError, "its 'framework' is a int, not a dict"),
    (horovod_aq.ALQ(bits=2, bucket_size=64, schedule="0,0", name="x").state_dict(),
     ValueError, "state_dict was saved by a compressor with other settings (saved, current): "
                 "{'bits': (2, 3), 'name': ('x', 'alq3b64')}; build the compressor with the "
                 "saved settings"),
]


@pytest.mark.parametrize("state, kind, fragment", BAD_STATES,
                         ids=[f"{i}-{c[2][-30:]}" for i, c in enumerate(BAD_STATES)])
def test_load_state_dict_refuses_a_bad_state_and_changes_nothing(state, kind, fragment):
    comp = _trained_alq()
    before = comp.state_dict()
    with pytest.raises(kind) as info:
        comp.load_state_dict(state)
    assert fragment in str(info.value), str(info.value)
    after = comp.state_dict()
    assert after["step"] == before["step"] == 3
    assert after["table"] == before["table"]


def test_load_state_dict_installs_a_good_state():
    comp = _trained_alq()
    fresh = horovod_aq.ALQ(bits=3, bucket_size=64, schedule="0,0")
    fresh.load_state_dict(comp.state_dict())
    assert fresh.step == 3 and fresh.table.same_as(comp.table)
    state = comp.state_dict()
    state["step"] = np.int64(0)        # numpy integers (e.g. from an .npz) are integers
    fresh.load_state_dict(state)
    assert fresh.step == 0 and type(fresh.step) is int


# ------------------------------------------- ErrorFeedback and DQSGD states (issue 26.5)
def _ef_state(change):
    state = horovod_aq.ErrorFeedback(horovod_aq.ALQ(bits=2, bucket_size=64)).state_dict()
    change(state)
    return state


BAD_EF_STATES = [
    (None, TypeError, "got NoneType"),
    ({}, ValueError, "this one has no 'inner' or 'alpha' or 'beta'"),
    (_ef_state(lambda s: s.pop("inner")), ValueError, "this one has no 'inner'"),
    (_ef_state(lambda s: s.update(memory={"b": "x"})), TypeError,
     "its 'memory' must map bucket names to float arrays"),
    (_ef_state(lambda s: s["inner"].update(step=-1)), ValueError, "its step must be >= 0"),
    (_ef_state(lambda s: s.update(beta=0.5)), ValueError, "Build it with the saved values"),
]


@pytest.mark.parametrize("state, kind, fragment", BAD_EF_STATES,
                         ids=[f"{i}-{c[2][-25:]}" for i, c in enumerate(BAD_EF_STATES)])
def test_error_feedback_load_state_dict_refuses_and_changes_nothing(state, kind, fragment):
    ef = horovod_aq.ErrorFeedback(horovod_aq.ALQ(bits=2, bucket_size=64))
    ef.inner.step = 5
    ef.error_memory.load_local_state({"b0": np.ones(4, np.float32)})
    before = ef.state_dict()
    with pytest.raises(kind) as info:
        ef.load_state_dict(state)
    assert fragment in str(info.value), str(info.value)
    after = ef.state_dict()
    assert after["inner"] == before["inner"] and after["inner"]["step"] == 5
    assert set(after["memory"]) == {"b0"}


def _dqsgd_state(change):
    state = horovod_aq.DQSGD(target_bits=3, bucket_size=64).state_dict()
    change(state)
    return state


BAD_DQSGD_STATES = [
    (None, TypeError, "got NoneType"),
    (_dqsgd_state(lambda s: s.pop("widths")), ValueError, "this one has no 'widths'"),
    (_dqsgd_state(lambda s: s["widths"].pop("2")), ValueError,
     "its 'widths' must hold one state per width"),
    (_dqsgd_state(lambda s: s["widths"]["3"].update(step=-4)), ValueError,
     "its step must be >= 0"),
    (_dqsgd_state(lambda s: s.update(bits=99)), ValueError, "its 'bits' must be one of"),
    (_dqsgd_state(lambda s: s["rule"].update(spent=float("nan"))), ValueError,
     "finite non-negative norms, spent and t"),
    (_dqsgd_state(lambda s: s.update(rule=[])), ValueError, "its 'rule' must be a dict"),
]


@pytest.mark.parametrize("state, kind, fragment", BAD_DQSGD_STATES,
                         ids=[f"{i}-{c[2][-25:]}" for i, c in enumerate(BAD_DQSGD_STATES)])
def test_dqsgd_load_state_dict_refuses_and_changes_nothing(state, kind, fragment):
    comp = horovod_aq.DQSGD(target_bits=3, bucket_size=64)
    comp.step, comp.bits = 6, 4
    comp.rule.spent = 12.0
    before = comp.state_dict()
    with pytest.raises(kind) as info:
        comp.load_state_dict(state)
    assert fragment in str(info.value), str(info.value)
    assert comp.state_dict() == before


def test_dqsgd_and_error_feedback_load_their_own_states():
    comp = horovod_aq.DQSGD(target_bits=3, bucket_size=64)
    comp.step, comp.bits = 6, 4
    comp.rule.spent = 12.0
    fresh = horovod_aq.DQSGD(target_bits=3, bucket_size=64)
    fresh.load_state_dict(comp.state_dict())
    assert fresh.state_dict() == comp.state_dict()
    ef = horovod_aq.ErrorFeedback(horovod_aq.ALQ(bits=2, bucket_size=64))
    ef.error_memory.load_local_state({"b0": np.arange(3, dtype=np.float32)})
    other = horovod_aq.ErrorFeedback(horovod_aq.ALQ(bits=2, bucket_size=64))
    other.load_state_dict(ef.state_dict())
    assert np.array_equal(other.state_dict()["memory"]["b0"], np.arange(3))
