"""The end of a TensorFlow training step: refit adaptive levels when due, record telemetry.

One protocol serves every TensorFlow way in, because all of them keep the compressor's table,
flags and recorded statistics in the same :class:`~horovod_aq.tensorflow.state.TFState`. Steps
end by themselves (docs/protocol.md §14), from inside the traced step, through a
``tf.py_function`` (which runs eagerly in the middle of the graph, so the collectives below are
ordinary eager Horovod/mpi4py calls and a refit changes only variables: no retrace):

* the packed tape and the Keras 3 optimizer (:mod:`~horovod_aq.tensorflow.packed`) end the step
  after the exchange's last collective: :func:`end_step_in_graph`;
* Horovod's stock path (``hvd.DistributedGradientTape(tape, compression=comp)``, tf_keras'
  ``hvd.DistributedOptimizer``) only calls ``compress`` per tensor, so the first ``compress``
  of each traced graph ends the *previous* step before it quantizes (:func:`begin_step_in_graph`):
  the refit of step t still uses step t's statistics and takes effect at step t + 1.

:func:`refit` (``horovod_aq.tensorflow.refit``, ``tape.end_step()``, Keras'
``RefitCallback``) is the explicit, eager form: it ends the current step only if it is still open,
so calling it as well never ends a step twice.

Protocol (shared with PyTorch; ``Compressor.end_step``, docs/protocol.md §2): during a recording
step the traced graphs wrote per-bucket statistics into slots; here they are handed to
``compressor.record_stats``, then ``compressor.end_step(comm)`` gathers them to rank 0 of the
process set, fits, broadcasts the table (mpi4py under MPI, Horovod under Gloo) and advances the
step. The table listener assigns the new levels to the variables the graphs read, and the
recording flag / step variables are set for the next step.

DQSGD: before ``end_step`` the in-graph sum of squares of the decoded aggregate (bitwise the same
on every rank) is handed to ``observe_aggregate``; the core's rule picks the next width, which
``sync`` copies into the width variable the graphs switch on. ErrorFeedback: the memory is
updated in-graph; here in-graph resets of a non-finite memory are logged, and the telemetry
records ``ef_memory_norm``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_aq.tensorflow.comm import comm_for
from horovod_aq.tensorflow.state import tf_state

logger = logging.getLogger(__name__)


def refit(compressor: Any, *, process_set: hvd.ProcessSet | None = None) -> bool:
    """End the current training step of ``compressor`` on every rank of ``process_set``, if it
    has not ended by itself (module docstring).

    Every TensorFlow path ends its steps automatically; this explicit form is for loops that
    bypass them, and harmless after them. Call it eagerly (outside ``tf.function``), after the
    optimizer step, on every rank of the set (default: all ranks). Refits the levels when the
    schedule says so (the new table is used from the next step) and records one telemetry record
    per packed exchange that ran. With a single-member set nothing is exchanged or fitted; the
    step is only counted. Returns whether the table changed in the step that ended.
    """
    if not tf.executing_eagerly():
        raise RuntimeError(
            "horovod_aq.tensorflow.refit / end_step run the refit protocol eagerly between steps; "
            "call it after your tf.function train step returns, not inside it (steps also end "
            "by themselves: the call is optional)")
    if not compressor.quantizer.step_open:
        return compressor.quantizer.last_refitted
    return _end_step(compressor, process_set)


def end_step_in_graph(compressor: Any, process_set: hvd.ProcessSet) -> tf.Tensor:
    """Graph op ending the step that the enclosing exchange belongs to (returns True when run).

    Place it after the exchange's side effects (statistics slots, counters, memory updates).
    """
    def end() -> bool:
        compressor.quantizer.open_step()
        _end_step(compressor, process_set)
        return True

    return tf.py_function(end, [], tf.bool, name="aq_end_step")


def begin_step_in_graph(compressor: Any) -> tf.Tensor:
    """Graph op for Horovod's stock path: end the previous step if it is open (refit when due,
    collective on the global process set), then open this one. Returns True when run."""
    def begin() -> bool:
        q = compressor.quantizer
        if q.step_open:
            _end_step(compressor, None)
        q.open_step()
        return True

    return tf.py_function(begin, [], tf.bool, name="aq_begin_step")


def _end_step(compressor: Any, process_set: hvd.ProcessSet | None) -> bool:
    """End the current step now (eager; also inside a py_function): refit when due, sync the
    graph's variables, record telemetry."""
    state = tf_state(compressor)
    if not hvd.is_initialized():   # one process without Horovod (compress called directly)
        compressor.quantizer.advance_step()
        state.sync()
        return False
    process_set = process_set if process_set is not None else hvd.global_process_set
    if not process_set.included():
        return False
    if not state.in_sync:
        logger.warning("%s: its step or width changed outside refit() (a plain load_state_dict "
                       "between steps?); the recording flag, width or error-feedback memory of "
                       "the step that just ran may have been stale. Restore checkpoints with "
                       "horovod_aq.tensorflow.checkpoint.load_state_dict, which updates the "
                       "variables at once", compressor.name)
    with state.lock:
        exchanges = [e for e in state.exchanges.values()
                     if e.process_set.process_set_id == process_set.process_set_id]
    ran = [(e, e.take_calls()) for e in exchanges]
    q = compressor.quantizer
    step, bits = q.step, compressor.code_bits  # this step's
    if process_set.size() > 1:
        if state.dynamic:
            _observe_aggregates(q, exchanges)
        if q.recording:
            state.flush_stats()
        refitted = q.end_step(comm_for(process_set))
    else:
        q.advance_step()
        refitted = False
    resets = state.take_memory_resets()
    if resets:
        logger.warning("%s: the error memory of %d bucket(s) became non-finite; reset to zero",
                       compressor.name, resets)
    state.sync()
    for exchange, (calls, skipped) in ran:
        if calls:
            exchange.record_step(step, refitted, calls, skipped, bits=bits)
    return refitted


def _observe_aggregates(compressor: Any, exchanges: list) -> None:
    """Hand DQSGD this step's aggregated-gradient norm, as the in-graph float64 Σ‖·‖² of every
    exchange (in creation order, the same on every rank). ``observe_aggregate`` takes a part of
    the aggregate; the graph already reduced the decoded buckets to their sum of squares S, and
    the one-element vector [√S] is a part with that norm — a rank-identical input, since S is."""
    for exchange in exchanges:
        total = exchange.take_aggregate()
        if total > 0.0:
            compressor.observe_aggregate(np.array([math.sqrt(total)], dtype=np.float64))

