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
:func:`agreement_row` to one small collective per step, named from what the exchange was built
with (:func:`horovod_aq.packed.plan.agreement_name`), which no change of what trains alters. It
is collected before the rank waits for any gradient of the step, and before a handshake when
:func:`agree_first` says so; :func:`check_agreement` then raises the same
:class:`~horovod_aq.packed.protocol.ConfigMismatchError` on every rank.

The PyTorch optimizer sends the row as a sum (:func:`agreement_terms`, one allreduce), the one
collective Horovod's ``hvd.join()`` supports: a rank that joined contributes zeros, so the sum
also counts the ranks that still train (:func:`check_agreement_sums`; docs/protocol.md §15).

The TensorFlow exchange (the tape, Keras) makes the same agreement per exchange: Keras plans a new
layout when it compiles a new optimizer, the tape when it gets other sources; the agreement is
collected in the traced graph before any bucket collective, and at trace time before a new
layout's handshake (docs/protocol.md §3.1).

This module imports no framework.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Iterable

import numpy as np

from horovod_aq.packed.protocol import ConfigMismatchError
from horovod_aq.packed.receive import JoinedRankError, joined_message

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


#: The agreement's sum form: every int64 field of :func:`agreement_row` is split into
#: ``LIMBS`` limbs of ``LIMB_BITS`` bits, so that the sums of the limbs' squares over up to
#: ``MAX_SUM_RANKS`` ranks, times that count, stay below 2⁶³.
LIMB_BITS, LIMBS = 16, 4
MAX_SUM_RANKS = 1 << 15


def agreement_terms(row: np.ndarray) -> np.ndarray:
    """What a rank adds to the agreement's allreduce (int64): ``[1, x, x²]``, x the limbs of
    ``row`` (:data:`LIMB_BITS`-bit pieces of every field, low first)."""
    shifts = np.arange(LIMBS, dtype=np.uint64) * np.uint64(LIMB_BITS)
    x = ((np.asarray(row, dtype=np.int64).astype(np.uint64)[:, None] >> shifts)
         & np.uint64((1 << LIMB_BITS) - 1)).reshape(-1).astype(np.int64)
    return np.concatenate([[1], x, x * x]).astype(np.int64)


def agreement_sums(sums: np.ndarray) -> tuple[int, bool]:
    """(A, agree) from the sums of :func:`agreement_terms`: the number A of ranks that added
    their terms (the others called ``hvd.join()`` and added zeros), and whether their rows are
    all the same.

    With S = Σ x and Q = Σ x² over those A ranks, A·Q ≥ S² (Cauchy–Schwarz), with equality for
    every limb exactly when every rank's row is the same. Every rank holds the same sums, so
    every rank decides alike."""
    sums = np.asarray(sums, dtype=np.int64).reshape(-1)
    active = int(sums[0])
    half = (sums.size - 1) // 2
    s, q = sums[1:1 + half], sums[1 + half:]
    return active, active > 0 and bool(np.array_equal(active * q, s * s))


def check_agreement_sums(sums: np.ndarray, ranks: int,
                         gather_rows: Callable[[], np.ndarray],
                         framework: str = "torch") -> int:
    """The number of ranks that still train (:func:`agreement_sums`), after checking that their
    rows agree: when they differ, every rank calls ``gather_rows()`` (an allgather of the
    rows) for :func:`check_agreement`'s message, or, when ranks joined (no allgather is
    possible then), raises a shorter :class:`ConfigMismatchError`."""
    if ranks > MAX_SUM_RANKS:
        raise ValueError(f"the agreement's sums hold up to {MAX_SUM_RANKS} ranks, got {ranks}")
    active, agree = agreement_sums(sums)
    if agree:
        return active
    if active == ranks:
        check_agreement(gather_rows(), framework)
    changes, remedy = AGREEMENT_REMEDY[framework]
    raise ConfigMismatchError(
        f"horovod_aq: ranks disagree on which parameters train ({changes}) at this step, "
        f"while {ranks - active} of {ranks} ranks joined (hvd.join()): {remedy}")


def refuse_joined(active: int, ranks: int, collective: str) -> None:
    """For an exchange that needs every rank's payload (the TensorFlow exchange): raise
    :class:`~horovod_aq.packed.receive.JoinedRankError` when only ``active`` of ``ranks`` ranks
    took part in the agreement's sums."""
    if active < ranks:
        raise JoinedRankError(joined_message(f"{ranks - active} of {ranks} ranks", collective))


def check_agreement(gathered: np.ndarray, framework: str = "torch",
                    collective: str = "the per-step agreement") -> None:
    """Raise :class:`ConfigMismatchError` unless every rank's row of ``gathered`` is the same;
    the message depends only on the rows (and the ``framework``'s words,
    :data:`AGREEMENT_REMEDY`), so every rank raises the same one. A row of zeros is a rank that
    called ``hvd.join()`` (Horovod zero-fills it in a cached allgather): then
    :class:`~horovod_aq.packed.receive.JoinedRankError`."""
    rows = np.asarray(gathered, dtype=np.int64).reshape(-1, 4)
    if (rows == rows[0]).all():
        return
    joined = [r for r in range(len(rows)) if not rows[r].any()]
    if joined:
        raise JoinedRankError(joined_message(joined, collective))
    changes, remedy = AGREEMENT_REMEDY[framework]
    lines = [f"rank {r}: {int(count)} tensors, {int(numel):,} elements (set {int(digest):08x}), "
             f"layout {int(layout):08x}" for r, (digest, count, numel, layout) in enumerate(rows)]
    raise ConfigMismatchError(
        f"horovod_aq: ranks disagree on which parameters train ({changes}) at this step: "
        f"{remedy}:\n  " + "\n  ".join(lines))


__all__ = ["AGREEMENT_REMEDY", "LIMBS", "LIMB_BITS", "MAX_SUM_RANKS", "Trainable", "agree_first",
           "agreement_row", "agreement_sums", "agreement_terms", "check_agreement",
           "check_agreement_sums", "refuse_joined", "replan_reason"]
