"""Checkpoints of a compressor used with TensorFlow, error-feedback memory included.

The compressor's own ``state_dict()`` holds everything needed to resume (settings, tables,
step, DQSGD's rule, the random stream) and, with error feedback, *this rank's* memory — the
memory differs on every rank (docs/protocol.md §7). :func:`state_dict` is the TensorFlow
counterpart of ``horovod_aq.torch.DistributedOptimizer.state_dict()["horovod_aq"]``: never a
collective, so rank 0 alone may call it; with ErrorFeedback it tags the memory with this rank
(``error_feedback.checkpoint_state``), or holds every rank's memory when
:func:`consolidate_state_dict` (called on every rank) kept them here since the last step.
:func:`load_state_dict` takes such a dict on every rank and gives a rank its memory back where
the checkpoint holds it with the same number of ranks — otherwise the memory restarts from zero
(one log line; levels, DQSGD state and steps are kept) — and writes everything into the
variables the traced graphs read at once, so the next step uses it without retracing.

A plain ``compressor.load_state_dict(state)`` works as well before the compressor's first
TensorFlow step (the variables are created from it); between steps of an already traced step
function, use :func:`load_state_dict` (a plain load reaches the graphs only at the next
``refit``, which warns).
"""

from __future__ import annotations

from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_aq.error_feedback import checkpoint_state, consolidate_memory, select_memory
from horovod_aq.tensorflow.comm import comm_for


def _require_eager(what: str) -> None:
    if not tf.executing_eagerly():
        raise RuntimeError(f"horovod_aq.tensorflow.{what} runs eagerly, between training steps "
                           "(outside tf.function)")


def _set_size(process_set: hvd.ProcessSet) -> int:
    return process_set.size() if process_set.included() else 1


def _rank(process_set: hvd.ProcessSet) -> int:
    return process_set.rank() if process_set.included() else 0


def state_dict(compressor: Any, *,
               process_set: hvd.ProcessSet = hvd.global_process_set) -> dict[str, Any]:
    """``compressor.state_dict()`` as a checkpoint holds it; never a collective. With error
    memory, this rank's memory tagged with its rank and the set size (the layout PyTorch's
    optimizer saves), or every rank's under ``"memory_by_rank"`` right after
    :func:`consolidate_state_dict` kept them on this rank."""
    _require_eager("state_dict")
    return checkpoint_state(compressor, rank=_rank(process_set), world=_set_size(process_set))


def consolidate_state_dict(compressor: Any, *, to: int = 0,
                           process_set: hvd.ProcessSet = hvd.global_process_set) -> None:
    """Gather every rank's error memory to rank ``to`` of ``process_set``, whose next
    :func:`state_dict` before the next step holds all of them. Collective: call it on every
    rank at the same point between steps. Nothing to gather without error feedback."""
    _require_eager("consolidate_state_dict")
    memory = compressor.error_memory
    buckets = [] if memory is None else sorted(
        (k, int(np.asarray(v).size)) for k, v in memory.local_state().items())

    def allgather(rows: np.ndarray, name: str) -> np.ndarray:   # the integration's one Comm
        return comm_for(process_set).allgather(rows, name)

    consolidate_memory(compressor, buckets, rank=_rank(process_set),
                       world=_set_size(process_set), to=to, allgather=allgather)


def load_state_dict(compressor: Any, state: dict[str, Any], *,
                    process_set: hvd.ProcessSet = hvd.global_process_set) -> None:
    """Restore :func:`state_dict` (or a plain ``compressor.state_dict()``) on this rank.

    Error-feedback memory comes back where the checkpoint holds this rank's (every rank's after
    :func:`consolidate_state_dict`, else the saving rank's) and the number of ranks is
    unchanged; otherwise it restarts from zero (one log line). The TensorFlow variables
    (step, width, tables, memory) are updated at once, so an already traced step function
    continues from the checkpoint.
    """
    _require_eager("load_state_dict")
    compressor.load_state_dict(select_memory(compressor, state, _rank(process_set),
                                             _set_size(process_set)))
    existing = compressor.quantizer.framework_state("tensorflow")
    if existing is not None:
        existing.sync()
