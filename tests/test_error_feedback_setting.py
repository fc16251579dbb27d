"""``error_feedback=`` of the packed entry points (horovod_aq.error_feedback_setting): which
compressor each setting gives, once per compressor, and what the stock path logs."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import horovod_aq
from horovod_aq import error_feedback_setting as setting
from horovod_aq import stock
from horovod_aq.error_feedback import ErrorFeedback

#: (compressor factory, whether "auto" adds error feedback)
TABLE = [
    (lambda: horovod_aq.ALQ(bits=2), True),
    (lambda: horovod_aq.ALQ(bits=3), True),
    (lambda: horovod_aq.ALQ(bits=4), False),
    (lambda: horovod_aq.ALQN(bits=2), True),
    (lambda: horovod_aq.ALQG(bits=2), True),
    (lambda: horovod_aq.AMQ(bits=2), True),
    (lambda: horovod_aq.AMQN(bits=3), True),
    (lambda: horovod_aq.QSGD(bits=1), True),
    (lambda: horovod_aq.QSGD(bits=2), True),
    (lambda: horovod_aq.QSGD(s=1), True),                # {0, ±1}: 2-bit codes
    (lambda: horovod_aq.QSGD(s=2), True),                # 5 levels: 3-bit codes
    (lambda: horovod_aq.QSGD(s=4), False),               # 9 levels: 4-bit codes
    (lambda: horovod_aq.QSGD(bits=4), False),
    (lambda: horovod_aq.QSGDInf(bits=2), True),
    (lambda: horovod_aq.NUQSGD(bits=2), True),
    (lambda: horovod_aq.NUQSGD(bits=3), True),
    (lambda: horovod_aq.TernGrad(), True),
    (lambda: horovod_aq.NaturalDithering(bits=2), True),
    (lambda: horovod_aq.NaturalDithering(bits=3), True),
    (lambda: horovod_aq.DQSGD(4), False),                          # default min_bits=2
    (lambda: horovod_aq.DQSGD(target_bits=2.5, min_bits=2, max_bits=3), True),
    (lambda: horovod_aq.DQSGD(target_bits=3.5, min_bits=3, max_bits=4), False),
    (lambda: horovod_aq.DQSGD(target_bits=2.0, min_bits=1, max_bits=4), True),
    (lambda: horovod_aq.DQSGD(budget=20.0, horizon=10, min_bits=1, max_bits=6), True),
    (lambda: horovod_aq.DQSGD(budget=30.0, horizon=10, min_bits=2, max_bits=6), True),
    (lambda: horovod_aq.DQSGD(budget=40.0, horizon=10, min_bits=2, max_bits=6), False),
    (lambda: horovod_aq.NoCompression(), False),
    (lambda: horovod_aq.FP16(), False),
]
IDS = ["alq2", "alq3", "alq4", "alqn2", "alqg2", "amq2", "amqn3", "qsgd1", "qsgd2", "qsgd_s1",
       "qsgd_s2", "qsgd_s4", "qsgd4", "qsgdinf2", "nuqsgd2", "nuqsgd3", "terngrad", "natural2",
       "natural3", "dqsgd4", "dqsgd2.5", "dqsgd3.5", "dqsgd2", "dqsgd_budget2", "dqsgd_budget3",
       "dqsgd_budget4", "none", "fp16"]


@pytest.mark.parametrize("make, auto", TABLE, ids=IDS)
def test_each_setting_gives_the_compressor_of_the_rule(make, auto):
    comp = make()
    assert setting.wanted(comp) is auto
    assert setting.resolve(comp, False) is comp
    got = setting.resolve(comp, "auto")
    if auto:
        assert isinstance(got, ErrorFeedback) and got.quantizer is comp
        # the default coefficients, derived from the quantizer (docs/dynamic.md §2.4)
        assert (got.error_memory.alpha, got.error_memory.beta) == (
            ErrorFeedback(comp).error_memory.alpha, 0.9)
    else:
        assert got is comp
    if comp.quantizes:
        forced = setting.resolve(comp, True)
        assert isinstance(forced, ErrorFeedback) and forced.quantizer is comp
        assert not auto or forced is got                 # one wrapper per compressor
    else:
        with pytest.raises(ValueError, match="error_feedback=True needs a quantizer"):
            setting.resolve(comp, True)


@pytest.mark.parametrize("value", ["auto", True, False])
def test_an_error_feedback_given_is_kept(value):
    ef = horovod_aq.ECQ(horovod_aq.QSGD(bits=2), alpha=0.3, beta=0.8)
    assert setting.resolve(ef, value) is ef
    assert not setting.wanted(ef)


def test_one_wrapper_per_compressor_and_one_log_line(caplog):
    comp = horovod_aq.ALQ(bits=2)
    with caplog.at_level(logging.INFO, logger="horovod_aq.error_feedback_setting"):
        first = setting.resolve(comp)
        assert setting.resolve(comp) is first and setting.resolve(comp, True) is first
        other = horovod_aq.ALQ(bits=2, name="other")
        assert setting.resolve(other) is not first and setting.resolve(other).quantizer is other
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(comp.name)]
    assert len(lines) == 1, lines
    assert "error_feedback='auto'" in lines[0] and "error_feedback=False" in lines[0]
    assert "docs/quantizers.md §5.9" in lines[0]


@pytest.mark.parametrize("name, adaptive", [
    ("SGD", False), ("Adam", True), ("AdamW", True), ("RMSprop", True), ("Adagrad", True),
    ("NAdam", True), ("MyAdamW", True), (None, False)])
def test_auto_sends_the_plain_quantizer_under_an_adaptive_optimizer(name, adaptive, caplog):
    """docs/quantizers.md §5.11: error feedback costs accuracy under AdamW, so "auto" leaves it
    out where the entry point knows the optimizer is adaptive; True still forces it."""
    torch = pytest.importorskip("torch")
    params = [torch.nn.Parameter(torch.zeros(3))]
    if name == "MyAdamW":                              # a user's subclass: by its bases
        cls = type("MyAdamW", (torch.optim.AdamW,), {})
    else:
        cls = None if name is None else getattr(torch.optim, name)
    optimizer = None if cls is None else cls(params, lr=0.1)
    assert setting.adaptive(optimizer) is adaptive
    comp = horovod_aq.ALQ(bits=2)
    with caplog.at_level(logging.INFO, logger="horovod_aq.error_feedback_setting"):
        got = setting.resolve(comp, "auto", optimizer)
    assert (got is comp) is adaptive
    assert setting.wanted(comp, optimizer) is not adaptive
    lines = [r.getMessage() for r in caplog.records]
    if adaptive:
        assert len(lines) == 1 and "error feedback off" in lines[0], lines
        assert "§5.11" in lines[0] and "error_feedback=True" in lines[0]
    forced = setting.resolve(comp, True, optimizer)
    assert isinstance(forced, ErrorFeedback) and forced.quantizer is comp
    four = horovod_aq.ALQ(bits=4)                  # no error feedback at 4 bits either way
    assert setting.resolve(four, "auto", optimizer) is four


@pytest.mark.parametrize("attribute", setting.WRAPPED_OPTIMIZER_ATTRIBUTES)
def test_a_wrapper_is_judged_by_the_optimizer_it_wraps(attribute):
    """Keras's LossScaleOptimizer, ZeroRedundancyOptimizer, Lightning's and Accelerate's."""
    torch = pytest.importorskip("torch")
    params = [torch.nn.Parameter(torch.zeros(1))]
    for inner, expected in ((torch.optim.Adam(params), True), (torch.optim.SGD(params, 0.1),
                                                                False)):
        wrapper = type("Wrapper", (), {attribute: inner})()
        assert setting.adaptive(wrapper) is expected
    assert not setting.adaptive(object())
    loop = type("Loop", (), {})()
    loop.optimizer = loop                              # a wrapper that points back ends
    assert not setting.adaptive(loop)


def test_the_wrapper_is_what_the_ranks_compare():
    """Every rank decides from the same settings, and the handshake digest sees the wrapper."""
    a, b = setting.resolve(horovod_aq.ALQ(bits=2)), setting.resolve(horovod_aq.ALQ(bits=2))
    np.testing.assert_array_equal(a.fingerprint(), b.fingerprint())
    plain = horovod_aq.ALQ(bits=2)
    assert int(a.fingerprint()[0]) != int(plain.fingerprint()[0])
    assert a.config()["error_feedback"] == {"alpha": a.error_memory.alpha, "beta": 0.9}


@pytest.mark.parametrize("value", ["on", "yes", 1, 0, None, np.bool_(True), "AUTO"])
def test_other_values_are_refused_saying_what_to_pass(value):
    with pytest.raises(TypeError, match="error_feedback must be 'auto', True or False"):
        setting.resolve(horovod_aq.ALQ(bits=2), value)
    with pytest.raises(ValueError):      # a SettingTypeError is a ValueError too
        setting.check(value)


def test_states_saved_with_the_other_setting_say_what_to_pass():
    plain, ef = horovod_aq.ALQ(bits=2), setting.resolve(horovod_aq.ALQ(bits=2))
    with pytest.raises(ValueError, match="error_feedback=False"):
        ef.load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match="error_feedback=True"):
        horovod_aq.ALQ(bits=2).load_state_dict(ef.state_dict())
    ef.load_state_dict(setting.resolve(horovod_aq.ALQ(bits=2)).state_dict())   # same setting


def test_the_stock_path_warns_once_at_two_bits(caplog):
    """Only at <= STOCK_WARNING_MAX_BITS: at 3 bits "auto" adds error feedback on the packed
    paths, but the plain 3-bit quantizer loses far less than the 2-bit one (the module's
    docstring), so the stock path stays quiet there."""
    assert setting.STOCK_WARNING_MAX_BITS == 2 < setting.AUTO_MAX_BITS
    two, three = horovod_aq.ALQ(bits=2), horovod_aq.ALQ(bits=3)
    with caplog.at_level(logging.WARNING, logger="horovod_aq.stock"):
        for _ in range(3):
            assert stock.route(two, "torch") == "quantize"
            assert stock.route(three, "torch") == "quantize"
    lines = [r.getMessage() for r in caplog.records if r.name == "horovod_aq.stock"]
    assert len(lines) == 1 and lines[0].startswith(two.name), lines
    assert "horovod_aq.torch.DistributedOptimizer" in lines[0]
    assert "docs/quantizers.md §5.9" in lines[0]
