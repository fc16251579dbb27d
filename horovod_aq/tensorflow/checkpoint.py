"""Checkpoints of a compressor used with TensorFlow, error-feedback memory included.

The compressor's own ``state_dict()`` holds everything needed to resume (settings, tables,
step, DQSGD's rule, the random stream) and, with error feedback, *this rank's* memory — the
memory differs on every rank (docs/protocol.md §7). :func:`state_dict` is the TensorFlow
counterpart of ``horovod_aq.torch.DistributedOptimizer.state_dict()["horovod_aq"]``: with
ErrorFeedback and more than one rank it is **collective** (call it on every rank, save rank 0's
dict); the memory of every rank is gathered into ``memory_by_rank`` with the set size in
``world``. :func:`load_state_dict` takes such a dict on every rank, picks this rank's memory —
or, when the number of ranks changed, restarts the memory from zero with a warning (levels,
DQSGD state and steps are kept) — and writes everything into the variables the traced graphs
read at once, so the next step uses it without retracing.

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

from horovod_aq.error_feedback import collective_state_dict, select_memory
from horovod_aq.tensorflow.comm import comm_for


def _require_eager(what: str) -> None:
    if not tf.executing_eagerly():
        raise RuntimeError(f"horovod_aq.tensorflow.{what} runs eagerly, between training steps "
                           "(outside tf.function)")


def _set_size(process_set: hvd.ProcessSet) -> int:
    return process_set.size() if process_set.included() else 1


def state_dict(compressor: Any, *,
               process_set: hvd.ProcessSet = hvd.global_process_set) -> dict[str, Any]:
    """``compressor.state_dict()``, with error-feedback memory gathered from every rank.

    Collective with error memory and more than one rank: call it on every rank of
    ``process_set`` at the same point; the dict is then the same on every rank (save rank 0's).
    Otherwise local. The layout matches PyTorch's (:func:`horovod_aq.error_feedback.
    collective_state_dict`): ``"memory"`` is empty, ``"memory_by_rank"`` maps each rank of the
    set to {bucket name: float32 [numel]} and ``"world"`` is the set size.
    """
    _require_eager("state_dict")
    memory = compressor.error_memory
    buckets = [] if memory is None else sorted(
        (k, int(np.asarray(v).size)) for k, v in memory.local_state().items())

    def allgather(rows: np.ndarray, name: str) -> np.ndarray:   # the integration's one Comm
        return comm_for(process_set).allgather(rows, name)

    return collective_state_dict(compressor, buckets, _set_size(process_set), allgather)


def load_state_dict(compressor: Any, state: dict[str, Any], *,
                    process_set: hvd.ProcessSet = hvd.global_process_set) -> None:
    """Restore :func:`state_dict` (or a plain ``compressor.state_dict()``) on this rank.

    Error-feedback memory comes back only if the number of ranks is unchanged; otherwise it
    restarts from zero (with a warning). The TensorFlow variables (step, width, tables, memory)
    are updated at once, so an already traced step function continues from the checkpoint.
    """
    _require_eager("load_state_dict")
    rank = process_set.rank() if process_set.included() else 0
    compressor.load_state_dict(select_memory(compressor, state, rank, _set_size(process_set)))
    existing = compressor.quantizer.framework_state("tensorflow")
    if existing is not None:
        existing.sync()
