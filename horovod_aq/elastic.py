"""Elastic Horovod: what a compressor's state does when the world changes.

Horovod's elastic mode (``horovodrun --min-np N --max-np M --host-discovery-script ...``,
``@hvd.elastic.run``) keeps a state object: ``state.commit()`` saves it, a failed collective
``restore()``s the last commit on the surviving ranks, and after workers were added (or a
failure) ``sync()`` hands rank 0's state to every rank, new workers included. A compressor in
that state (``hvd.elastic.TorchState(model, optimizer, compression=comp)``, see
:mod:`horovod_aq.torch.elastic` and docs/horovod_compat.md § Elastic Horovod) follows two rules:

1. **save / restore** keep this rank's whole ``state_dict()``: settings, level table and its
   version, step, DQSGD's width and rule, the random streams, ECQ-SGD error memory;
2. **sync** installs rank 0's settings, table, version and step (and DQSGD's state) on every
   rank, so that the refit schedule and the tables agree again (:func:`synced_state`). Two
   parts are per rank and are not copied from rank 0:

   * the random streams (``"framework"``): each rank keeps its own; a new worker starts its
     stream from ``seed_for_rank(seed, rank)`` at its first gradient. Rank 0's stream on every
     rank would make the ranks' rounding noise identical instead of independent;
   * the error memory (``"memory"``): it restarts from zero on every rank. It is this rank's
     accumulated rounding error of the fused buckets of the old world, whose rank numbers and
     bucket layout the new world need not share — the rule a checkpoint loaded with another
     number of ranks follows (:func:`horovod_aq.error_feedback.select_memory`).

This module imports no framework.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Keys of a compressor's ``state_dict`` (at any depth: ErrorFeedback nests its quantizer's
#: state under ``"inner"``, DQSGD each width's under ``"widths"``) that are per rank.
STREAMS = "framework"
MEMORY = "memory"


def keep_local(shipped: Mapping[str, Any], own: Mapping[str, Any], keys: tuple[str, ...], *,
               reset: tuple[str, ...] = ()) -> dict[str, Any]:
    """``shipped`` (a state from another rank) with the entries named ``keys`` taken from
    ``own`` (this rank's state) and those named ``reset`` emptied, at every level of nesting
    where both are dicts; an entry of ``keys`` that ``own`` lacks is left out."""
    out: dict[str, Any] = {}
    for key, value in shipped.items():
        if key in keys:
            continue
        mine = own.get(key)
        if key in reset:
            out[key] = {}
        elif isinstance(value, Mapping) and isinstance(mine, Mapping):
            out[key] = keep_local(value, mine, keys, reset=reset)
        else:
            out[key] = value
    out.update({key: own[key] for key in keys if key in own})
    return out


def synced_state(root: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """The state a rank loads at an elastic sync: rank 0's ``state_dict()`` (``root``) with this
    rank's own random streams (from ``own``, this rank's ``state_dict()``) and empty error
    memory (module docstring, rule 2)."""
    return keep_local(root, own, (STREAMS,), reset=(MEMORY,))
