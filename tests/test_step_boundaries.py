"""Open steps (docs/protocol.md §14): a step ends once, however many paths try to end it."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import horovod_aq
from horovod_aq.compressors import base
from horovod_aq.refit import LocalComm


def _grad(seed=0):
    return np.random.default_rng(seed).standard_normal(4096)


def test_an_ended_step_is_not_ended_again():
    comp = horovod_aq.ALQ(bits=3, bucket_size=256, schedule="0,0")
    comp.open_step()
    comp.record_gradient(_grad())
    assert comp.step_open
    assert comp.end_open_step(LocalComm()) is True       # step 0 refits
    assert (comp.step, comp.table.version, comp.step_open) == (1, 1, False)
    # a second end (an explicit refit after the hook) changes nothing and reports the refit
    assert comp.end_open_step(LocalComm()) is True
    assert (comp.step, comp.table.version) == (1, 1)
    comp.open_step()
    assert comp.end_open_step(LocalComm()) is False      # step 1: not scheduled
    assert comp.step == 2


def test_no_gradient_no_step():
    """Horovod's local step in broadcast_optimizer_state quantizes nothing: no step counted."""
    comp = horovod_aq.ALQ(bits=3, bucket_size=256)
    assert comp.end_open_step(LocalComm()) is False
    assert comp.step == 0


def test_advance_step_closes_without_a_refit():
    comp = horovod_aq.ALQ(bits=3, bucket_size=256, schedule="0,0")
    comp.open_step()
    comp.advance_step()
    assert (comp.step, comp.table.version, comp.step_open) == (1, 0, False)


def test_dqsgd_closes_its_steps():
    comp = horovod_aq.DQSGD(target_bits=4)
    comp.open_step()
    comp.end_open_step(LocalComm())
    assert (comp.step, comp.step_open) == (1, False)
    comp.end_open_step(LocalComm())
    assert comp.step == 1


def test_a_first_step_that_never_ends_is_reported(monkeypatch):
    monkeypatch.setattr(base, "UNENDED_STEP_WARNING", 5)
    comp = horovod_aq.ALQ(bits=3, bucket_size=256)
    with pytest.warns(RuntimeWarning, match=r"horovod_aq\.torch\.refit\(comp\)"):
        for _ in range(5):
            comp.open_step()
    fixed = horovod_aq.QSGD(bits=3)          # nothing to refit: nothing to report
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(6):
            fixed.open_step()


class _NoComm:
    """A Comm that must not be used (a step end that needs no collective)."""

    rank, size = 0, 2

    def allgather(self, array, name):
        raise AssertionError(f"collective {name} run for a compressor that does not quantize")

    broadcast = allgather


@pytest.mark.parametrize("make", [horovod_aq.NoCompression, horovod_aq.FP16])
def test_end_step_counts_the_steps_of_compressors_that_do_not_quantize(make):
    comp = make()
    comp.open_step()
    assert comp.end_step(_NoComm()) is False
    assert (comp.step, comp.step_open) == (1, False)


def test_dqsgd_end_step_resets_the_open_gradient_count():
    """DQSGD ends a step with the same bookkeeping as every compressor (it once copied it and
    left the count of gradients of the step behind)."""
    comp = horovod_aq.DQSGD(target_bits=4)
    for _ in range(3):
        comp.open_step()
    comp.end_step(LocalComm())
    assert comp._open_calls == 0 and comp.step == 1
