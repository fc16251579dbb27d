"""The parameters a packed exchange carries, when it must be planned again, and the per-step
agreement that keeps one rank from changing alone.

Fine-tuning changes what trains between two steps: ``requires_grad`` flips (train the head, then
unfreeze the backbone) or ``add_param_group`` adds parameters. Every rank makes the same change
between the same two steps, so an exchange compares :class:`Trainable` at the first gradient of
every step with the one it planned for and, when :func:`replan_reason` says so, plans again
(buckets from the new set, collective names, error memory from zero) behind a new handshake
(docs/horovod_compat.md § Changing what trains).

A rank that did not change while the others did would never meet them: its collectives carry
the old plan's names, and it has no handshake to run. So every rank also contributes
:func:`agreement_row` to one small allgather per step, named from what the exchange was built
with (:func:`horovod_aq.packed.plan.agreement_name`), which no change of what trains alters. It
is collected before the rank waits for any gradient of the step, and before a handshake when
:func:`agree_first` says so; :func:`check_agreement` then raises the same
:class:`~horovod_aq.packed.protocol.ConfigMismatchError` on every rank.

The TensorFlow exchange (the tape, Keras) makes the same agreement per exchange: Keras plans a new
layout when it compiles a new optimizer, the tape when it gets other sources; the agreement is
collected in the traced graph before any bucket collective, and at trace time before a new
layout's handshake (docs/protocol.md §3.1).

This module imports no framework.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterable

import numpy as np

from horovod_aq.packed.protocol import ConfigMismatchError

#: How many parameter names a re-plan's log line or an error lists before "...".
SHOWN_NAMES = 4
#: What changes what trains, and what every rank must do, said by the agreement's error, by
#: framework: the PyTorch optimizer, and the TensorFlow exchange (Keras' ``compile`` with a new
#: optimizer after ``layer.trainable`` changed, or another list of sources given to the tape).
AGREEMENT_REMEDY = {
    "torch": ("requires_grad, add_param_group",
              "change requires_grad and call add_param_group identically on every rank, "
              "between the same two steps"),
    "tensorflow": ("layer.trainable and compile, the tape's sources",
                   "set trainable and compile with a new optimizer (Keras), or pass the same "
                   "sources to the tape, identically on every rank, between the same two steps"),
}


@dataclasses.dataclass(frozen=True)
class Trainable:
    """The parameters that get gradients, as (name, number of elements) in registration order."""

    tensors: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, tensors: Iterable[tuple[str, int]]) -> Trainable:
        return cls(tuple((str(n), int(k)) for n, k in tensors))

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.tensors]

    @property
    def numel(self) -> int:
        return sum(k for _, k in self.tensors)

    @property
    def digest(self) -> int:
        """CRC-32 of the names and sizes, in order."""
        return zlib.crc32(repr(self.tensors).encode()) & 0xFFFFFFFF

    def __str__(self) -> str:
        return f"{len(self.tensors)} tensors, {self.numel:,} elements (set {self.digest:08x})"


def _listed(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:SHOWN_NAMES])
    return shown + (f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else "")


def replan_reason(planned: Trainable, now: Trainable) -> str | None:
    """Why an exchange planned for ``planned`` must be planned again for ``now`` (None: it need
    not). The text goes into the one info line a re-plan logs."""
    if planned == now:
        return None
    before, after = set(planned.names), set(now.names)
    joined = [n for n in now.names if n not in before]
    left = [n for n in planned.names if n not in after]
    parts = ([f"{len(joined)} joined ({_listed(joined)})"] if joined else []) + (
        [f"{len(left)} left ({_listed(left)})"] if left else [])
    what = "; ".join(parts) if parts else "their order or sizes changed"
    return f"the trainable parameters changed: {what}; now {now}"


def agreement_row(trainable: Trainable, layout: int) -> np.ndarray:
    """What each rank contributes to the per-step agreement (int64): the set's digest, count and
    size, and the layout digest the handshake compares."""
    return np.asarray([trainable.digest, len(trainable.tensors), trainable.numel, layout],
                      dtype=np.int64)


def agree_first(*, handshake_due: bool, handshaken_in_world: bool) -> bool:
    """Whether a rank collects this step's agreement before its handshake (and then waits for
    it at once) rather than submitting it after.

    Before: whenever a handshake is due and one already passed in this world. A rank that
    re-planned for a new trainable set is then in its handshake while a rank that did not change
    may have none due; both meet in the agreement first, so both raise instead of one waiting in
    the handshake. After: at the first handshake in a world (a new exchange, or the first step
    after elastic Horovod changed the world), which every rank makes — a new worker included —
    and which checks the settings and model the agreement's name is built from.
    """
    return handshake_due and handshaken_in_world


def check_agreement(gathered: np.ndarray, framework: str = "torch") -> None:
    """Raise :class:`ConfigMismatchError` unless every rank's row of ``gathered`` is the same;
    the message depends only on the rows (and the ``framework``'s words,
    :data:`AGREEMENT_REMEDY`), so every rank raises the same one."""
    rows = np.asarray(gathered, dtype=np.int64).reshape(-1, 4)
    if (rows == rows[0]).all():
        return
    changes, remedy = AGREEMENT_REMEDY[framework]
    lines = [f"rank {r}: {int(count)} tensors, {int(numel):,} elements (set {int(digest):08x}), "
             f"layout {int(layout):08x}" for r, (digest, count, numel, layout) in enumerate(rows)]
    raise ConfigMismatchError(
        f"horovod_aq: ranks disagree on which parameters train ({changes}) at this step: "
        f"{remedy}:\n  " + "\n  ".join(lines))


__all__ = ["AGREEMENT_REMEDY", "Trainable", "agree_first", "agreement_row", "check_agreement",
           "replan_reason"]
