"""Checkpoints of ``horovod_aq.torch.DistributedOptimizer``, and its protocol with
``hvd.broadcast_optimizer_state`` (docs/horovod_compat.md, docs/protocol.md §7).

* :func:`state_dict` — the wrapped optimizer's state plus the compressor's under
  ``"horovod_aq"`` and the wire setting's under :data:`WIRE_KEY` (``wire="auto"``: the agreed
  decision, so a resumed job keeps it). It never communicates, so rank 0 alone may call it
  (Horovod's checkpoint pattern) and elastic Horovod's ``TorchState`` may call it on a worker
  that joins: with error feedback it holds this rank's memory, tagged with this rank
  (``error_feedback.checkpoint_state``) — or every rank's, right after
  :func:`consolidate_state_dict` (every rank, ZeroRedundancyOptimizer's pattern) kept them here.
  :func:`load_state_dict` checks everything before it changes anything; a rank whose memory the
  checkpoint does not hold restarts it from zero (one log line).
* Called from ``hvd.broadcast_optimizer_state``, ``state_dict()`` is local on every rank and
  carries the compressor state as the option :data:`BROADCAST_KEY` of the first param group
  (:func:`broadcast_state_dict`). Horovod broadcasts param-group options from the root and
  assigns them with ``optimizer.param_groups[i][key] = value``; the first param group of a
  packed optimizer is a :class:`BroadcastGroup`, which installs the state at that assignment —
  so ``optimizer.compression`` shows the root's step and table when the call returns. The next
  use of the optimizer removes the option (:func:`adopt_broadcast`).

**Why the caller is recognized by its frame.** ``state_dict()`` takes no argument, and Horovod
gives no other sign that its ``broadcast_optimizer_state`` is the caller. The call must be told
apart: there Horovod calls ``state_dict()`` once on a rank with state and twice on a rank
without, so it must not run the error-memory gather (a collective), and an empty state must be
returned empty the first time (Horovod then initializes it with the local ``step()``) and with a
placeholder the second (a stateless optimizer: Horovod would return without broadcasting). So
:func:`broadcast_frame` looks a few frames up the stack for the code object of
``horovod.torch.functions.broadcast_optimizer_state``; the frame object also tells the two calls
of one broadcast apart. A renamed function fails at import, not silently.
"""

from __future__ import annotations

import logging
import sys
import weakref
from types import FrameType
from typing import Any

from horovod.torch import functions as _hvd_functions
from horovod.torch.optimizer import _DistributedOptimizer as _HorovodOptimizer

from horovod_aq.error_feedback import (
    MEMORY_RANK,
    checkpoint_state,
    consolidate_memory,
    select_memory,
)
from horovod_aq.torch import layout

logger = logging.getLogger(__name__)

#: The key under which the compressor's state rides in ``hvd.broadcast_optimizer_state`` (a
#: param-group option of the dict :func:`broadcast_state_dict` returns there).
BROADCAST_KEY = "horovod_aq"
#: Horovod's ``broadcast_optimizer_state``, recognized on the stack by its code object.
_BROADCAST_CODE = _hvd_functions.broadcast_optimizer_state.__code__
#: The key of the wire setting's state (``wire="auto"``'s decision) in ``state_dict()``.
WIRE_KEY = "horovod_aq_wire"
#: How many frames above ``state_dict()`` are searched for it (Horovod calls it directly).
_BROADCAST_DEPTH = 4


class Checkpoint:
    """The checkpoint state of one packed optimizer."""

    __slots__ = ("loaded", "frame", "outgoing")

    def __init__(self) -> None:
        #: The "horovod_aq" state last given to load_state_dict (shipped by
        #: broadcast_optimizer_state until the next exchange).
        self.loaded: dict[str, Any] | None = None
        #: The frame of a broadcast_optimizer_state call that found this rank's state empty.
        self.frame: FrameType | None = None
        #: The option this rank put in its own state for broadcast_optimizer_state (the root
        #: assigns it back to itself: nothing to install).
        self.outgoing: dict[str, Any] | None = None


class BroadcastGroup(dict):
    """The first param group of a packed optimizer: a dict that installs a compressor state the
    moment ``hvd.broadcast_optimizer_state`` assigns it (module docstring). Pickles, copies and
    ``state_dict()`` s as a plain dict."""

    __slots__ = ("_owner",)

    def __init__(self, group: dict[str, Any], owner: Any) -> None:
        super().__init__(group)
        self._owner = weakref.ref(owner)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        owner = self._owner()
        if key == BROADCAST_KEY and owner is not None:
            arrived(owner, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict(self),)


def watch_broadcasts(opt: Any) -> None:
    """Make the first param group of ``opt`` a :class:`BroadcastGroup` (again after torch
    replaced the groups, e.g. in ``load_state_dict``)."""
    if opt.param_groups and not isinstance(opt.param_groups[0], BroadcastGroup):
        opt.param_groups[0] = BroadcastGroup(opt.param_groups[0], opt)


def broadcast_frame() -> FrameType | None:
    """The frame of ``hvd.broadcast_optimizer_state`` if it called ``state_dict()`` (searched
    from the caller of the caller of this function up), else None."""
    frame = sys._getframe(2)
    for _ in range(_BROADCAST_DEPTH):
        if frame is None:
            return None
        if frame.f_code is _BROADCAST_CODE:
            return frame
        frame = frame.f_back
    return None


# ---------------------------------------------------------------------- checkpoints
def state_dict(opt: Any) -> dict[str, Any]:
    """``opt.state_dict()`` (see the module docstring and ``_PackedOptimizer.state_dict``)."""
    frame = broadcast_frame()
    if frame is not None:
        return broadcast_state_dict(opt, frame)
    return _state_dict(opt, lambda comp: checkpoint_state(comp, rank=_rank(opt),
                                                          world=_world(opt)))


def consolidate_state_dict(opt: Any, to: int) -> None:
    """``opt.consolidate_state_dict(to)``: every rank gathers the error memories
    (``error_feedback.consolidate_memory``, one allgather per bucket); rank ``to`` keeps them for
    its next :func:`state_dict` before the next step."""
    if opt._aq_started is None:
        adopt_broadcast(opt)
    consolidate_memory(opt._aq, [(b.name, b.numel) for b in opt._aq_buckets], rank=_rank(opt),
                       world=_world(opt), to=to, allgather=opt._aq_comm.allgather)


def _state_dict(opt: Any, compressor_state: Any) -> dict[str, Any]:
    """The wrapped optimizer's state, ``compressor_state(compressor)`` under
    :data:`BROADCAST_KEY` and the wire setting's under :data:`WIRE_KEY`."""
    if opt._aq_started is None:
        adopt_broadcast(opt)
    state = super(opt.__class__, opt).state_dict()
    state[BROADCAST_KEY] = compressor_state(opt._aq)
    state[WIRE_KEY] = opt._aq_wire_setting.state_dict()
    return state


def load_state_dict(opt: Any, state_dict: dict[str, Any]) -> None:
    """``opt.load_state_dict(state)`` (see ``_PackedOptimizer.load_state_dict``)."""
    if opt._aq_started is None:
        adopt_broadcast(opt)
    state = dict(state_dict)
    aq_state = state.pop(BROADCAST_KEY, None)
    wire_state = state.pop(WIRE_KEY, None)
    check_param_groups(opt.param_groups, state)
    before = None
    if aq_state is not None:
        selected = select_memory(opt._aq, aq_state, _rank(opt), opt._aq_ranks)
        before = opt._aq.state_dict()
        try:
            opt._aq.load_state_dict(selected)
        except Exception:
            _restore(opt._aq, before)
            raise
    try:
        _HorovodOptimizer.load_state_dict(opt, state)
    except Exception:
        if before is not None:
            _restore(opt._aq, before)
        raise
    watch_broadcasts(opt)
    opt._aq_reset_step()
    layout.load_wire(opt, wire_state)
    opt._aq_checked = False
    opt._aq_ckpt.loaded = aq_state


# ---------------------------------------------------------------------- broadcast_optimizer_state
def broadcast_state_dict(opt: Any, frame: FrameType) -> dict[str, Any]:
    """What ``hvd.broadcast_optimizer_state`` gets from ``state_dict()`` (docs/horovod_compat.md):

    * It is local on every rank: Horovod calls ``state_dict()`` once where the state is
      non-empty and twice where it is empty, so no collective may run here.
    * An empty state is returned as it is the first time, so that Horovod initializes it with
      the wrapped optimizer's local ``step()`` on zero gradients (the optimizer's class keeps
      Horovod's ``__module__``: the collective ``step`` is not called, no compressor step is
      counted).
    * Otherwise the first param group carries :data:`BROADCAST_KEY`: the compressor's state
      (the checkpoint's, with every rank's error memory, if one was loaded since the last
      exchange) and the identity of the exchange (``_aq_identity``: its content key without
      the world size, so that a worker joining an elastic job installs it).
    * If the state is still empty after Horovod's local step, the optimizer keeps no state
      (e.g. SGD without momentum) — on every rank, as every rank runs the same optimizer — and
      Horovod would return without broadcasting: one placeholder entry makes it go on.
    """
    ckpt = opt._aq_ckpt
    state = super(opt.__class__, opt).state_dict()
    if not state["state"]:
        if ckpt.frame is not frame:
            ckpt.frame = frame
            return state
        state["state"][BROADCAST_KEY] = {}
    ckpt.frame = None
    if state["param_groups"]:
        compression = ckpt.loaded if ckpt.loaded is not None else opt._aq.state_dict()
        # the root ships its wire state and takes it as every receiver will (an unfinished
        # measurement restarts on every rank at the same step)
        wire = opt._aq_wire_setting.state_dict()
        layout.load_wire(opt, wire)
        ckpt.outgoing = {"exchange": opt._aq_identity, "state": compression, "installed": False,
                         "wire": wire}
        state["param_groups"][0] = {**state["param_groups"][0], BROADCAST_KEY: ckpt.outgoing}
    return state


def arrived(opt: Any, shipped: Any) -> None:
    """A compressor state that ``hvd.broadcast_optimizer_state`` assigned to ``opt``'s first
    param group: installed now on a receiving rank whose exchange has the same content key and
    has not started a step (the root assigns its own state back: nothing to do)."""
    if (not isinstance(shipped, dict) or shipped is opt._aq_ckpt.outgoing
            or shipped.get("installed") or shipped.get("exchange") != opt._aq_identity
            or opt._aq_started is not None):
        return
    install(opt, shipped["state"], shipped.get("wire"))
    shipped["installed"] = True


def adopt_broadcast(opt: Any) -> None:
    """Take the option ``hvd.broadcast_optimizer_state`` left in the param groups: install it if
    it did not arrive through a :class:`BroadcastGroup`; every rank then compares settings,
    table, step and layout again at the next exchange."""
    shipped = None
    for group in opt.param_groups:
        if BROADCAST_KEY in group:
            shipped = dict.pop(group, BROADCAST_KEY)
    if shipped is None:
        return
    if (isinstance(shipped, dict) and shipped is not opt._aq_ckpt.outgoing
            and not shipped.get("installed") and shipped.get("exchange") == opt._aq_identity):
        install(opt, shipped["state"], shipped.get("wire"))
    opt._aq_ckpt.outgoing = None
    opt._aq_reset_step()
    opt._aq_ckpt.loaded = None
    opt._aq_checked = False


def install(opt: Any, shipped: dict[str, Any], wire: dict[str, Any] | None = None) -> None:
    """Install a compressor state broadcast from the root (the same on every rank), and the
    root's wire state (``wire``). Each rank keeps its own random streams and, unless the root
    shipped a loaded checkpoint holding every rank's, its own error memory. A state saved with
    other settings is not installed (warning): the handshake then stops every rank with the
    settings of each."""
    comp = opt._aq
    own = comp.state_dict()
    keep = ("framework",)
    if comp.error_memory is not None and not _holds_memory_of(shipped, _rank(opt)):
        keep = ("framework", "memory")
        if shipped.get(MEMORY_RANK, _rank(opt)) != _rank(opt):
            logger.info("%s: the checkpoint rank %s loaded holds its own error-feedback memory "
                        "only (saved without consolidate_state_dict): rank %d keeps its own "
                        "(empty in a new job)", comp.name, shipped[MEMORY_RANK], _rank(opt))
    state = _keep_local(select_memory(comp, shipped, _rank(opt), opt._aq_ranks, log=False),
                        own, keep)
    try:
        comp.load_state_dict(state)
    except (ValueError, KeyError, TypeError) as exc:
        logger.warning("%s: not adopting the compressor state broadcast by "
                       "broadcast_optimizer_state: %s", comp.name, exc)
    layout.load_wire(opt, wire)
    opt._aq_ckpt.loaded = None
    opt._aq_checked = False


# ---------------------------------------------------------------------- helpers
def _rank(opt: Any) -> int:
    return opt.process_set.rank() if opt.process_set.included() else 0


def _world(opt: Any) -> int:
    return opt._aq_ranks if opt._aq_active else 1


def _holds_memory_of(shipped: dict[str, Any], rank: int) -> bool:
    """Whether a shipped checkpoint state holds ``rank``'s own error memory: every rank's, or
    (one rank's) this one's."""
    return "memory_by_rank" in shipped or shipped.get(MEMORY_RANK) == rank


def _keep_local(shipped: Any, own: Any, keys: tuple[str, ...]) -> Any:
    """``shipped`` with the entries named ``keys`` taken from ``own`` at every level of nesting
    (this rank's random streams and error memory in a state broadcast from the root)."""
    if not isinstance(shipped, dict) or not isinstance(own, dict):
        return shipped
    out = {k: _keep_local(v, own.get(k), keys) for k, v in shipped.items() if k not in keys}
    out.update({k: own[k] for k in keys if k in own})
    return out


def _restore(compression: Any, state: dict[str, Any]) -> None:
    """Put back a compressor state saved just before a failed load (same settings: cannot fail
    on them)."""
    try:
        compression.load_state_dict(state)
    except Exception:   # noqa: BLE001 — the original error is the one to report
        logger.exception("%s: could not restore the compressor state", compression.name)


def check_param_groups(groups: list[dict[str, Any]], state: dict[str, Any]) -> None:
    """torch's own checks of ``Optimizer.load_state_dict``, before anything is loaded."""
    saved = state.get("param_groups")
    if saved is None or "state" not in state:
        raise ValueError("optimizer state_dict must hold 'state' and 'param_groups' (from "
                         "optimizer.state_dict())")
    if len(groups) != len(saved):
        raise ValueError("loaded state dict has a different number of parameter groups")
    if any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved)):
        raise ValueError("loaded state dict contains a parameter group that doesn't match the "
                         "size of optimizer's group")


__all__ = ["BROADCAST_KEY", "BroadcastGroup", "Checkpoint", "WIRE_KEY", "adopt_broadcast",
           "arrived", "broadcast_frame", "consolidate_state_dict", "install", "load_state_dict",
           "state_dict", "watch_broadcasts"]
