"""Checkpoints of a compressor used with TensorFlow, error-feedback memory included.

The compressor's own ``state_dict()`` holds everything needed to resume (settings, tables,
step, DQSGD's rule, the random stream) and, for :class:`~horovod_aq.ErrorFeedback`, *this
rank's* memory — the memory differs on every rank. :func:`state_dict` is the TensorFlow
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

import logging
import zlib
from typing import Any

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from horovod_aq.compressors import Compressor
from horovod_aq.error_feedback import ErrorFeedback
from horovod_aq.tensorflow.state import tf_state

logger = logging.getLogger(__name__)


def _require_eager(what: str) -> None:
    if not tf.executing_eagerly():
        raise RuntimeError(f"horovod_aq.tensorflow.{what} runs eagerly, between training steps "
                           "(outside tf.function)")


def _set_size(process_set: hvd.ProcessSet) -> int:
    return process_set.size() if process_set.included() else 1


def state_dict(compressor: Compressor, *,
               process_set: hvd.ProcessSet = hvd.global_process_set) -> dict[str, Any]:
    """``compressor.state_dict()``, with ErrorFeedback memory gathered from every rank.

    Collective with ErrorFeedback and more than one rank: call it on every rank of
    ``process_set`` at the same point; the dict is then the same on every rank (save rank 0's).
    Otherwise local. The ErrorFeedback layout matches PyTorch's: ``"memory"`` is empty,
    ``"memory_by_rank"`` maps each rank of the set to {bucket name: float32 [numel]} and
    ``"world"`` is the set size.
    """
    _require_eager("state_dict")
    state = compressor.state_dict()
    if not isinstance(compressor, ErrorFeedback):
        return state
    local = state.pop("memory")
    world = _set_size(process_set)
    state["memory"] = {}
    state["memory_by_rank"] = _gather_memory(compressor, local, process_set, world)
    state["world"] = world
    return state


def _gather_memory(compressor: ErrorFeedback, local: dict[str, np.ndarray],
                   process_set: hvd.ProcessSet, world: int) -> dict[int, dict[str, np.ndarray]]:
    """One allgather per bucket ("aq.efstate.<bucket>"), after one that checks that every rank
    holds memory for the same buckets (else every rank raises the same error, no hang)."""
    if world == 1:
        return {0: local}
    keys = sorted(local)
    sizes = [int(np.asarray(local[k]).size) for k in keys]
    digest = zlib.crc32("\n".join(f"{k}:{n}" for k, n in zip(keys, sizes)).encode())
    mine = tf.constant([[len(keys), digest]], dtype=tf.int64)
    layouts = hvd.allgather(mine, name=f"aq.efstate.{compressor.name}.layout",
                            process_set=process_set).numpy()
    if (layouts != layouts[0]).any():
        raise ValueError(
            f"{compressor.name}: the ranks hold error memory for different fused buckets "
            f"(count, digest per rank: {layouts.tolist()}); call state_dict on every rank after "
            "the same training steps")
    out: dict[int, dict[str, np.ndarray]] = {r: {} for r in range(world)}
    for key in keys:
        row = np.ascontiguousarray(np.asarray(local[key], dtype=np.float32).reshape(1, -1))
        rows = hvd.allgather(tf.constant(row), name=f"aq.efstate.{key}",
                             process_set=process_set).numpy()
        for r in range(world):
            out[r][key] = rows[r].copy()
    return out


def load_state_dict(compressor: Compressor, state: dict[str, Any], *,
                    process_set: hvd.ProcessSet = hvd.global_process_set) -> None:
    """Restore :func:`state_dict` (or a plain ``compressor.state_dict()``) on this rank.

    Error-feedback memory comes back only if the number of ranks is unchanged; otherwise it
    restarts from zero (with a warning). The TensorFlow variables (step, width, tables, memory)
    are updated at once, so an already traced step function continues from the checkpoint.
    """
    _require_eager("load_state_dict")
    state = dict(state)
    if isinstance(compressor, ErrorFeedback) and "memory_by_rank" in state:
        by_rank, world = state.pop("memory_by_rank"), int(state.pop("world"))
        if world == _set_size(process_set):
            rank = process_set.rank() if process_set.included() else 0
            state["memory"] = by_rank.get(rank, by_rank.get(str(rank), {}))
        else:
            logger.warning("%s: error-feedback memory was saved with %d ranks and this job has "
                           "%d: it restarts from zero (levels and steps are kept)",
                           compressor.name, world, _set_size(process_set))
            state["memory"] = {}
    compressor.load_state_dict(state)
    if "tensorflow" in compressor._fw_state:
        tf_state(compressor).sync()
