"""The per-rank decisions of the packed exchange, written once for every framework.

Every integration (``horovod_aq.torch.DistributedOptimizer``, the DDP hook, the TensorFlow
``PackedExchange`` behind the tape and the Keras optimizer) calls these and only moves tensors;
the decisions of a bucket's send and receive are the sibling modules' (``send``, ``marker``,
``receive``, ``params``, ``chunks``, ``waiting``):

* :class:`ExchangeSettings` — the user's arguments, validated with errors that name them;
  :func:`check_exchange_args` — the same checks as one function (types included) for the
  integrations to call at construction;
* :func:`check_compression` / :func:`check_average` — what a packed exchange accepts;
* the first-exchange handshake: :func:`handshake` over the integration's ``Comm``
  (:func:`handshake_vector`, :func:`check_handshake`; docs/protocol.md §3);
* the non-finite decision's message (docs/protocol.md §4): :func:`nonfinite_message`, whose
  pieces :func:`nonfinite_pieces` also build the TensorFlow graph assertion, so both frameworks
  raise the same text;
* the telemetry of a step (docs/protocol.md §8): :func:`plan_traffic` (bytes from the bucket
  plan and the step's code width), :func:`measured_traffic` (the same with the payload sizes
  actually sent, §5.4) and :func:`step_record`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from horovod_aq.compressors.base import Compressor
from horovod_aq.error_feedback import ErrorFeedback
from horovod_aq.packed.autowire import AutoWire
from horovod_aq.packed.choice import WIRES
from horovod_aq.packed.cost import (
    EXCHANGES,
    NetworkModel,
    bytes_sent,
    payload_bytes_of,
)
from horovod_aq.packed.plan import DEFAULT_FUSION_BYTES, BucketPlan, handshake_name
from horovod_aq.telemetry import StepRecord

#: Start of the non-finite error's message (TensorFlow translates graph assertions by it).
NONFINITE_MARK = "horovod_aq: non-finite gradient"
NONFINITE_REMEDY = ("every rank stops here. Lower the learning rate or use loss scaling, or pass "
                    "nonfinite='skip' to the compressor to skip such steps on every rank")


class ConfigMismatchError(ValueError):
    """Ranks disagree on compressor settings, level table, step or the tensors exchanged."""


# ---------------------------------------------------------------------- arguments
@dataclasses.dataclass(frozen=True)
class ExchangeSettings:
    """The packed exchange's tuning arguments, validated at construction.

    ``exchange``: "auto" (the cost model), "allgather" or "two_phase"; ``fusion_bytes``: cap of
    a fused bucket in bytes of fp32 gradient; ``small_tensor_threshold``: tensors with fewer
    elements are allreduced uncompressed; ``network``: the cost model's parameters.
    """

    exchange: str = "auto"
    fusion_bytes: int = DEFAULT_FUSION_BYTES
    small_tensor_threshold: int = 0
    network: NetworkModel = NetworkModel()

    def __post_init__(self) -> None:
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")
        if self.fusion_bytes < 4:
            raise ValueError(f"fusion_bytes must be >= 4, got {self.fusion_bytes}")
        if self.small_tensor_threshold < 0:
            raise ValueError(
                f"small_tensor_threshold must be >= 0, got {self.small_tensor_threshold}")
        if self.network is None:
            object.__setattr__(self, "network", NetworkModel())

    @property
    def cap_numel(self) -> int:
        """The fusion cap in fp32 coordinates."""
        return max(1, self.fusion_bytes // 4)


def check_exchange_args(*, exchange: Any = "auto", fusion_bytes: Any = DEFAULT_FUSION_BYTES,
                        small_tensor_threshold: Any = 0) -> None:
    """Check the packed exchange's own arguments at construction, for every framework's
    optimizer, tape and Keras wrapper alike: ``exchange`` one of ``EXCHANGES``,
    ``fusion_bytes`` an integer >= 4, ``small_tensor_threshold`` an integer >= 0. Raises
    ``ValueError`` (a value out of range) or ``TypeError`` (a wrong type, also a ``ValueError``:
    ``horovod_aq.compressors.arguments.SettingTypeError``) naming the argument."""
    from horovod_aq.compressors import arguments

    arguments.choice("exchange", exchange, EXCHANGES)
    arguments.integer("fusion_bytes", fusion_bytes, 4,
                      allowed=">= 4 (an integer: the cap of a fused bucket in bytes)")
    arguments.integer("small_tensor_threshold", small_tensor_threshold, 0,
                      allowed=">= 0 (an integer: tensors with fewer elements are sent "
                              "uncompressed)")


def check_wire(wire: Any) -> Any:
    """The ``wire=`` argument of the packed exchanges (Horovod optimizer, DDP hook): one of
    ``packed.choice.WIRES`` ("auto", or a coding of ``packed.plan.CODINGS``), or an
    :class:`~horovod_aq.packed.autowire.AutoWire` (its setting and schedule); a ``ValueError``
    that says what to pass otherwise."""
    if isinstance(wire, AutoWire):
        return wire
    if not isinstance(wire, str) or wire not in WIRES:
        raise ValueError(f"wire must be one of {WIRES}, got {wire!r}: pass wire='fixed' "
                         "(fixed-width codes), wire='entropy' (entropy-coded, variable-length "
                         "payloads), wire='auto' (measured in the first steps, then decided "
                         "per bucket) or an AutoWire (auto with its own schedule)")
    return wire


def is_compression(obj: Any) -> bool:
    """Whether ``obj`` is a horovod_aq compression (a compressor or error feedback around one)."""
    return isinstance(obj, (Compressor, ErrorFeedback))


def check_compression(compression: Any, horovod_api: str) -> None:
    """Refuse anything but a horovod_aq compression; ``horovod_api`` names Horovod's own
    wrapper, which takes ``hvd.Compression.*`` objects."""
    if not is_compression(compression):
        raise TypeError(
            "compression must be a horovod_aq compressor such as horovod_aq.ALQ(bits=3); "
            f"Horovod's hvd.Compression.* objects belong to {horovod_api}")


def check_average(op: Any, average: Any, horovod_api: str) -> None:
    """The packed exchange averages: refuse other reduction ops."""
    if op != average:
        raise ValueError("the packed exchange averages gradients (op=hvd.Average); use "
                         f"{horovod_api} for Sum or Adasum")


# ---------------------------------------------------------------------- handshake
def handshake_vector(fingerprint: np.ndarray, layout: int, ranks: int) -> np.ndarray:
    """What each rank contributes to the first-exchange agreement check (int64)."""
    return np.concatenate([np.asarray(fingerprint, dtype=np.int64),
                           [layout, ranks]]).astype(np.int64)


def handshake(comm: Any, compression: Any, layout: int) -> None:
    """The first-exchange check of one layout over the integration's :class:`~horovod_aq.refit.
    Comm` (docs/protocol.md §3): one allgather, named :func:`~horovod_aq.packed.plan.
    handshake_name`, of :func:`handshake_vector`; :func:`check_handshake` then raises the same
    :class:`ConfigMismatchError` on every rank if any row differs."""
    mine = handshake_vector(compression.fingerprint(), layout, comm.size)
    check_handshake(comm.allgather(mine, handshake_name()), compression.describe_fingerprint)


def check_handshake(gathered: np.ndarray, describe: Callable[[np.ndarray], str]) -> None:
    """Raise :class:`ConfigMismatchError` unless every rank's row of ``gathered`` is identical.

    Every rank holds the same gathered rows, so every rank raises the same message (no rank is
    left waiting in a later collective). ``describe`` renders a fingerprint row.
    """
    gathered = np.asarray(gathered)
    if (gathered == gathered[0]).all():
        return
    lines = [f"rank {r}: {describe(row[:-2])}, layout {int(row[-2]):08x}, ranks {int(row[-1])}"
             for r, row in enumerate(gathered)]
    raise ConfigMismatchError(
        "horovod_aq: ranks disagree on the compressor settings, level table, step or the set of "
        "tensors exchanged; every rank must build the same model, optimizer and compressor (and "
        "load the same checkpoint):\n  " + "\n  ".join(lines))


# ---------------------------------------------------------------------- non-finite gradients
def nonfinite_pieces(bucket: str) -> tuple[str, str, str]:
    """The message of :func:`nonfinite_message` around its two values: (before the rank,
    between the rank and the quoted parameter name, after it)."""
    return (f"{NONFINITE_MARK} on rank", "(of the process set) for parameter",
            f"(bucket {bucket}); {NONFINITE_REMEDY}")


def nonfinite_message(rank: int | str, source: str | None, bucket: str) -> str:
    """Why every rank stops: ``rank`` sent non-finite markers, first for ``source`` (None: the
    marker did not say which tensor, e.g. a two-phase chunk). ``rank`` may be words (the ranks
    of a node, docs/protocol.md §5.7)."""
    before, middle, after = nonfinite_pieces(bucket)
    where = f"'{source}'" if source else "(one of the bucket's)"
    return f"{before} {rank} {middle} {where} {after}"


# ---------------------------------------------------------------------- sendable buckets
#: The largest finite float32: a bucket norm above it cannot be written into a payload.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def first_unsendable(norms: Any) -> int | None:
    """Index of the first quantization bucket whose norm cannot travel, or None.

    ``norms``: the buckets' norms, float64 (the exact ``sqrt`` of the float64 sum of squares,
    ``codec.bucket_norms`` before its cast) or float32 (where an overflowing norm is ``inf``).
    A bucket is sendable when its norm is finite and rounds to a finite float32 (≤
    ``FLOAT32_MAX`` after rounding to nearest). A rank holding an unsendable bucket of finite
    values must treat it like a non-finite gradient — send the non-finite marker
    (docs/protocol.md §4, §15) — so that every rank raises the same error or skips the step
    (``nonfinite="skip"``) alike, instead of one rank raising in its encoder while the others
    wait in the collective.
    """
    values = np.asarray(norms, dtype=np.float64).reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        bad = ~np.isfinite(values.astype(np.float32))
    return int(np.argmax(bad)) if bad.any() else None


def norm_may_overflow(peak: Any, bucket_size: int) -> Any:
    """Whether a bucket of ``bucket_size`` values, the largest of magnitude ``peak``, can have a
    norm past ``FLOAT32_MAX`` (‖v‖ ≤ √B·max|v_i|). Below this bound :func:`first_unsendable`
    need not be computed. ``peak`` may be a float or a framework scalar tensor (the comparison
    is then a tensor)."""
    return peak > FLOAT32_MAX / math.sqrt(bucket_size)


def bucket_sendable(norms: Any) -> bool:
    """Whether every quantization bucket of ``norms`` can travel (:func:`first_unsendable`)."""
    return first_unsendable(norms) is None


# ---------------------------------------------------------------------- telemetry
@dataclasses.dataclass
class Traffic:
    """What one exchange of a bucket plan sends from this rank (docs/protocol.md §5.3)."""

    numel: int = 0
    numel_quantized: int = 0
    payload_bytes: int = 0
    bytes_sent: int = 0
    exchanges: dict[str, int] = dataclasses.field(default_factory=dict)


def plan_traffic(buckets: Sequence[BucketPlan], small_numels: Sequence[int], *, fp16: bool,
                 bits: int, bucket_size: int, ranks: int, per_node: int = 1) -> Traffic:
    """The traffic of one exchange: quantized buckets at code width ``bits`` plus the small
    tensors' allreduces (fp16 on the wire for the FP16 compressor); ``per_node``: the ranks per
    node of the node-aware modes."""
    t = Traffic()
    for b in buckets:
        t.numel += b.numel
        t.numel_quantized += b.numel
        t.payload_bytes += payload_bytes_of(b.mode, b.numel, bits, bucket_size, ranks,
                                            per_node)
        t.bytes_sent += bytes_sent(b.mode, b.numel, bits, bucket_size, ranks, per_node)
        t.exchanges[b.mode] = t.exchanges.get(b.mode, 0) + 1
    wire = "allreduce_fp16" if fp16 else "allreduce_fp32"
    for n in small_numels:
        t.numel += n
        t.bytes_sent += bytes_sent(wire, n, 0, 1, ranks)
    return t


def measured_traffic(planned: Traffic, sent: dict[str, int], small_numels: Sequence[int], *,
                     fp16: bool, ranks: int) -> dict[str, int]:
    """``payload_bytes`` and ``bytes_sent`` of a step whose quantized buckets' bytes were
    counted by the wire (``sent``: its ``payload_bytes`` and ``bytes_sent``, presence masks
    excluded): the real sizes of variable-length payloads (docs/protocol.md §5.4), plus the
    small tensors' allreduces of ``planned``'s model. With fixed-width payloads it equals
    ``planned`` except on a skipped two-phase step (no re-encoded chunks travel)."""
    wire = "allreduce_fp16" if fp16 else "allreduce_fp32"
    small = sum(bytes_sent(wire, n, 0, 1, ranks) for n in small_numels)
    return {"payload_bytes": int(sent["payload_bytes"]),
            "bytes_sent": int(sent["bytes_sent"]) + small}


def step_record(compression: Any, *, step: int, ranks: int, bits: int, traffic: Traffic | None,
                calls: int = 1, refitted: bool = False, skipped: int = 0) -> StepRecord:
    """The :class:`~horovod_aq.telemetry.StepRecord` of a step that ran ``calls`` exchanges of
    ``traffic`` at code width ``bits``; table, refit and error-memory fields from
    ``compression`` after the step ended."""
    rec = StepRecord(step=step, method=compression.method, ranks=ranks, bits=bits)
    if traffic is not None:
        rec.numel = traffic.numel * calls
        rec.numel_quantized = traffic.numel_quantized * calls
        rec.payload_bytes = traffic.payload_bytes * calls
        rec.bytes_sent = traffic.bytes_sent * calls
        rec.exchanges = {k: v * calls for k, v in traffic.exchanges.items()}
    rec.bytes_fp32 = bytes_sent("allreduce_fp32", rec.numel, 0, 1, ranks)
    if compression.quantizes:
        rec.table_version = compression.quantizer.table.version
    rec.refit = refitted
    if refitted:
        rec.levels = compression.quantizer.table.levels.tolist()
    if skipped:
        rec.extra["skipped"] = float(skipped)
    if compression.error_memory is not None:
        rec.extra["ef_memory_norm"] = compression.error_memory.memory_norm()
    return rec
