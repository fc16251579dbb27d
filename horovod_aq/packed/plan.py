"""Which tensors travel together, and the names of every collective the package issues.

Fusion (docs/protocol.md §6): tensors are fused in backward order into buckets of at most
``cap_numel`` coordinates on one device; each bucket takes the wire the cost model picks
(:mod:`horovod_aq.packed.cost`). Names: every collective has an explicit name built from the
compressor's name, a digest of the exchange's content (:func:`exchange_key`: the tensors' names
and sizes and the settings), the bucket's position and a CRC-32 of its members' names, so it is
identical on every rank that builds the same model, whatever other objects a rank created —
never Horovod's counter names, nor a per-process counter. The first-exchange handshake has one
fixed name for every exchange of every framework (:func:`handshake_name`).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from horovod_aq.packed.cost import NetworkModel, resolve_exchange

#: Largest fused bucket of the packed optimizers, in bytes of fp32 gradient (PyTorch DDP's
#: default bucket cap).
DEFAULT_FUSION_BYTES = 25 * 2**20
#: How a bucket's payloads are coded (``wire=``): "fixed" — fixed-width codes, one size per
#: bucket on every rank (docs/format.md §1); "entropy" — the smaller of the entropy-coded and
#: the fixed-width payload, sizes differ by rank (docs/format.md §12, docs/protocol.md §5.4).
CODINGS = ("fixed", "entropy")

def op_name(text: str) -> str:
    """A Horovod/TF op name: no '/' (Horovod strips name scopes up to the last one) or ':'."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", text)


def exchange_key(compression_name: str, tensors: Iterable[tuple[str, int]],
                 settings: Iterable[Any] = ()) -> str:
    """The content name of a packed exchange: ``<compression>.c<crc32>``.

    ``tensors``: (name, number of elements) of every tensor the exchange carries, in the order
    the exchange plans them; ``settings``: anything else that changes the layout or the wire
    (exchange mode, fusion cap, small-tensor threshold, process-set size, groups). Ranks that
    build the same model with the same settings get the same key whatever else they created
    (an evaluation copy, a second model), so no collective name depends on creation order, and
    error-feedback memory keyed by bucket names finds its checkpoint in any optimizer built for
    the same model. Two exchanges of identical content in one process share a key: their
    collectives must not be in flight at the same time (Horovod then refuses the duplicate
    name with an error).
    """
    text = repr((compression_name, [(str(n), int(k)) for n, k in tensors],
                 [repr(v) for v in settings]))
    return op_name(f"{compression_name}.c{zlib.crc32(text.encode()) & 0xFFFFFFFF:08x}")


def allgather_name(bucket: str) -> str:
    return f"aq.ag.{bucket}"


def alltoall_name(bucket: str) -> str:
    return f"aq.a2a.{bucket}"


def allreduce_name(prefix: str, tensor: str) -> str:
    """The uncompressed allreduce of one small tensor of the exchange ``prefix``."""
    return f"aq.ar.{prefix}.{op_name(tensor)}"


def handshake_name() -> str:
    """The allgather of the first-exchange check, the same for every packed exchange of every
    framework (PyTorch optimizer, DDP hook, TensorFlow tape and Keras): it must not depend on
    the model, the settings or the layout it compares, so that ranks that disagree on any of
    them still meet in it and all raise ``ConfigMismatchError`` instead of waiting in different
    collectives (docs/protocol.md §3). A process runs one handshake at a time, so one name
    never has two collectives in flight."""
    return "aq.handshake"


def agreement_name(key: str) -> str:
    """The per-step agreement on what trains (:mod:`horovod_aq.packed.trainable`) of the
    exchange whose content key was ``key`` when it was built: no later change of what trains
    alters it, so a rank that changed alone still meets the others in it."""
    return f"aq.trainable.{op_name(key)}"


@dataclass(frozen=True)
class BucketPlan:
    """One fused bucket: which tensors (indices into the planner's input), its name and wire."""

    index: int
    name: str
    members: tuple[int, ...]
    numel: int
    mode: str


def plan_buckets(
    names: list[str],
    numels: list[int],
    devices: list[str],
    *,
    prefix: str,
    cap_numel: int,
    small_threshold: int,
    quantizes: bool,
    exchange: str,
    bits: int,
    bucket_size: int,
    ranks: int,
    network: NetworkModel = NetworkModel(),
    per_node: int = 1,
) -> tuple[list[BucketPlan], list[int]]:
    """Fuse tensors into buckets in the given order (callers pass backward order).

    Consecutive tensors on one device join a bucket while its total stays within ``cap_numel``
    coordinates; a tensor larger than the cap gets a bucket of its own. Tensors below
    ``small_threshold`` elements — and every tensor when the compressor does not quantize — are
    returned separately for an uncompressed allreduce. Names are ``<prefix>.<i>.<crc32 of the
    member names>``, so they depend only on the names, shapes and settings: identical on every
    rank that builds the same model. ``per_node``: the ranks per node of the job's topology
    (1: none; the node-aware modes need one). Returns ``(buckets, uncompressed indices)``.
    """
    buckets: list[BucketPlan] = []
    uncompressed: list[int] = []
    current: list[int] = []

    def close() -> None:
        if not current:
            return
        member_names = "\0".join(names[i] for i in current)
        digest = zlib.crc32(member_names.encode()) & 0xFFFFFFFF
        numel = sum(numels[i] for i in current)
        mode = resolve_exchange(exchange, numel, bits, bucket_size, ranks, network, per_node)
        buckets.append(BucketPlan(len(buckets), f"{prefix}.{len(buckets)}.{digest:08x}",
                                  tuple(current), numel, mode))
        current.clear()

    for i, (numel, device) in enumerate(zip(numels, devices)):
        if not quantizes or numel < small_threshold:
            uncompressed.append(i)
            continue
        if current and (devices[current[0]] != device
                        or sum(numels[j] for j in current) + numel > cap_numel):
            close()
        current.append(i)
    close()
    return buckets, uncompressed


def layout_digest(buckets: list[BucketPlan], uncompressed_names: list[str],
                  coding: str = "fixed") -> int:
    """CRC-32 of the bucket layout, the uncompressed tensors and, when not "fixed", the payload
    coding (compared across ranks by the handshake: ranks on different wires would read each
    other's sizes wrongly)."""
    text = repr([(b.name, b.numel, b.mode) for b in buckets] + sorted(uncompressed_names))
    if coding != "fixed":
        text += f"|coding={coding}"
    return zlib.crc32(text.encode()) & 0xFFFFFFFF
