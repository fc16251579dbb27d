"""The one wire engine of the packed torch exchanges: the Horovod optimizer and the DDP hook.

A :class:`Wire` moves :class:`Bucket` s — fused gradient vectors, each exchanged as one payload
stream — through the stages of docs/protocol.md §5 with the packed kernels, over a small
collective adapter (:class:`Collectives`): Horovod handles (:class:`horovod_aq.torch.comm.
HorovodCollectives`) or ``torch.distributed`` works (:class:`horovod_aq.torch.dist_comm.
DistCollectives`). Every per-rank decision is :mod:`horovod_aq.packed`'s: the send order and
error-feedback update (``send``), the markers (``marker``), the outcome of what arrived
(``receive``), the parameter of an element (``params``), the real part of a chunk (``chunks``),
the stall deadline (``waiting``).

Stages of a bucket (``Bucket.stage``)::

    idle ─submit─▶ ag ──────────────────────────────▶ done     allgather (§5.1)
    idle ─submit─▶ a2a ─advance─▶ ag2 ──────────────▶ done     two-phase (§5.2)

1. :meth:`Wire.submit` sends the bucket's raw float32 gradient (``packed.send.send_bucket``;
   with error feedback one pass, CPU or Triton, encodes and updates the memory,
   ``torch.compensated``; without it, on Triton, the same one-pass kernel encodes and the
   markers are put in place on the device after the encode, ``triton_send.Send`` — or, with
   entropy coding, chosen on the host with the parts' histograms, ``entropy.entropy_of_parts``):
   one allgather "aq.ag.<bucket>" of the payload, or one alltoall "aq.a2a.<bucket>" of the P
   chunk payloads (markers in their place when the gradient cannot travel).
2. :meth:`Wire.advance` (two-phase): waits for the alltoall, decides on the received chunks
   (plain payloads by one device flag, anything else by ``packed.receive``: docs/protocol.md
   §5.8), decodes and averages chunk r, zeroes what is not gradient
   (``packed.chunks``), re-encodes it with part P and starts the allgather "aq.ag.<bucket>".
3. When an allgather's rows arrive they are checked and decoded (all P payloads averaged, or
   the P averaged chunks concatenated) — in the work's callback under ``torch.distributed``
   (overlapping the backward pass), when collected under Horovod. :meth:`Wire.finish` returns
   the averaged gradient and raises what a callback kept, at the same point on every rank.
4. With ``defer`` (the optimizer's and the DDP hook's wires), plain rows are decoded on the
   device and their flag is left unread — the final rows', and two-phase's alltoall rows, whose
   chunk goes out as a marker where the flag is False; the presence masks' union stays there
   too, and zeroes the re-encoded chunk's absent parameters on the device:
   :meth:`Wire.settle`, at the step's end, reads the flags and unions of every bucket in one
   copy and sends a bucket whose flag is False through the checked path (docs/protocol.md
   §5.8).

Collectives go out in the order the caller calls :meth:`~Wire.submit` and :meth:`~Wire.advance`
(``torch.distributed`` pairs them by issue order, so the DDP hook calls both from the hook, in
bucket order; callbacks only decode). Payloads travel as lists of per-rank byte payloads with
their sizes (:class:`Received`).

**Coding** (``Bucket.coding``, the same on every rank, switchable at a step boundary):
"fixed" payloads have one size per bucket on every rank (``Received.rows``); "entropy" payloads
(docs/format.md §12, :mod:`horovod_aq.torch.entropy`) have data-dependent sizes, never above the
fixed size: the collectives carry them with their sizes (docs/protocol.md §5.4 — Horovod's
allgather reads them from the payloads' own headers, ``packed.delimit``; ``torch.distributed``
gathers the sizes first) and the wire decodes the list of rows (``Received.row_list``) with the
decoders of variable rows, bitwise ``codec.decode_average`` of the same rows (with Triton on the
device, with one flag like the fixed rows', ``entropy.device_values``; two-phase's alltoall
flag is read with the re-encode's histograms, and rows that were not plain then take the
checked path).

A bucket may carry a **presence mask** (the optimizer's: one bit per parameter appended to every
first-phase payload, ``np.packbits`` order): parameters no rank had a gradient for are then
exact zeros in the result and in the re-encoded chunk (docs/protocol.md §15).

:attr:`Wire.tap`, when set, sees every payload the wire encodes: ``tap(bucket, part, values,
payload)`` (part k < P: chunk k or the allgather payload; part P: a re-encoded chunk). Where the
markers are put in place on the device, the payload it is handed becomes the marker afterwards,
in stream order (a copy made at once holds the payload).

**Timing.** :attr:`Wire.seconds` adds up the seconds spent encoding, decoding and waiting, and
:attr:`Wire.sent` the bytes this rank sent (telemetry; ``wire="auto"`` compares whole steps
and their bytes, docs/protocol.md §5.5, so the wire times nothing else and never synchronizes a
device to time a kernel).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from horovod_aq import codec
from horovod_aq.codec.stream import StreamKey
from horovod_aq.packed import plan as names
from horovod_aq.packed.chunks import chunk_param_parts, chunk_zero_spans
from horovod_aq.packed.cost import chunk_numel, inner_mode
from horovod_aq.packed.delimit import payload_sizes
from horovod_aq.packed.marker import marker_for
from horovod_aq.packed.params import contiguous_offsets, param_at
from horovod_aq.packed.plan import CODINGS, BucketPlan
from horovod_aq.packed.receive import SKIP, receive_outcome
from horovod_aq.packed.send import (
    SendSteps,
    first_bad_element,
    reencode_chunk,
    reencode_part,
    send_bucket,
    sent_bytes,
    sent_values,
)
from horovod_aq.packed.waiting import FOREVER, Deadline, wait_until
from horovod_aq.torch import compensated, entropy, kernels, markers, stats
from horovod_aq.torch.payload import device_constant

#: What the wire times (``Wire.seconds``): encoding, decoding and averaging, waiting.
TIMED = ("encode", "decode", "wait")
#: What :attr:`Wire.sent` counts: bytes of this rank's first-phase payloads (all P chunk payloads
#: in two-phase; ``packed.cost.payload_bytes_of``), bytes it sent to other ranks (allgather:
#: (P − 1)·size; two-phase: the P − 1 chunks for others plus (P − 1)·re-encoded size; the
#: node-aware modes: their float32 stages too) and, of those, the node-aware stages' bytes to
#: the ranks of its node (docs/protocol.md §5.7).
SENT = ("payload_bytes", "bytes_sent", "node_bytes")
#: What a rank waiting for a payload collective is doing (``ExchangeStalledError``).
EXCHANGING = "waiting for the gradient exchange"


#: Received payloads: [P, size] rows (fixed coding) or a list of P 1-D rows (any sizes).
Rows = torch.Tensor | list[torch.Tensor]


def _heads(rows: Rows) -> Any:
    """The rows' first ``HEADER_SIZE`` bytes on the host (``packed.receive`` reads them), in
    one copy (a row of a list shorter than a header keeps its length)."""
    if isinstance(rows, list):
        sizes = [min(r.numel(), codec.HEADER_SIZE) for r in rows]
        host = torch.stack([torch.nn.functional.pad(r[:n], (0, codec.HEADER_SIZE - n))
                            for r, n in zip(rows, sizes)]).cpu().numpy()
        return [head[:n] for head, n in zip(host, sizes)]
    return rows[:, :codec.HEADER_SIZE].cpu().numpy()


def _peak(x: torch.Tensor) -> float:
    """max|x_i| in one pass without a temporary (NaN when x holds a NaN); 0 when empty."""
    if not x.numel():
        return 0.0
    low, high = torch.stack(torch.aminmax(x)).tolist()   # one device→host copy
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


class Received:
    """What a collective delivered to this rank: the per-rank payloads, back to back in ``flat``
    (uint8), with their ``sizes`` in rank order, and ``host``, the same bytes on the host where
    the collective copied them there to learn the sizes (Horovod's allgather of variable
    payloads, ``packed.delimit``), else None."""

    __slots__ = ("flat", "sizes", "host")

    def __init__(self, flat: torch.Tensor, sizes: Sequence[int],
                 host: np.ndarray | None = None) -> None:
        self.flat, self.sizes, self.host = flat, list(sizes), host

    def rows(self) -> torch.Tensor:
        """The payloads as [P, size] rows (a view: every rank's payload has the same size)."""
        if len(set(self.sizes)) > 1:
            raise ValueError(f"payloads of different sizes {self.sizes} cannot be viewed as "
                             "rows; use row_list()")
        return self.flat.view(len(self.sizes), -1)

    def row_list(self) -> list[torch.Tensor]:
        """The payloads as a list of 1-D views of ``flat``, one per rank (any sizes)."""
        if sum(self.sizes) != self.flat.numel():
            raise ValueError(f"payload sizes {self.sizes} do not add up to the "
                             f"{self.flat.numel()} bytes received")
        return list(torch.split(self.flat, self.sizes))

    def host_row_list(self) -> list[torch.Tensor] | None:
        """:meth:`row_list` of ``host`` (CPU tensors sharing its memory), None without it."""
        if self.host is None:
            return None
        return list(torch.split(torch.from_numpy(self.host), self.sizes))


class Pending(Protocol):
    """A collective in flight."""

    def done(self) -> bool:
        """Whether :meth:`wait` would return at once."""

    def wait(self) -> Any:
        """Its outcome (an allgather's: what its ``then`` returned, raising what it raised)."""


class Collectives(Protocol):
    """The payload collectives of one process group (the wire's adapter)."""

    #: This rank within the group (the two-phase chunk it averages) and the group's size.
    rank: int
    size: int
    #: Whether a rank that left (``hvd.join()``) is received as zeros.
    zero_fills_joined: bool

    def allgather(self, payload: torch.Tensor, name: str, then: Callable[[Received], Any], *,
                  delimit: Callable[[np.ndarray, int], list[int]] | None = None) -> Pending:
        """Gather every rank's ``payload``; ``then(received)`` runs once they arrived.

        ``delimit``: None when every rank's payload has this one's size; otherwise sizes differ
        by rank, and ``delimit(concatenation, P)`` gives them from the bytes (for a collective
        that delivers only the concatenation; one that exchanges sizes need not call it)."""

    def alltoall(self, payloads: list[torch.Tensor], name: str, *, variable: bool = False,
                 received: Sequence[int] | None = None) -> Pending:
        """Send ``payloads[r]`` to rank r; ``wait()`` gives the :class:`Received` payloads.
        ``variable``: the sizes may differ by rank and destination and are not known ahead;
        ``received``: the sizes rank r sends this one, known ahead (None and not
        ``variable``: every payload has one size)."""


class Bucket:
    """One exchanged vector: its plan and parameters, and its exchange of the current step."""

    __slots__ = (
        # what it is (fixed when planned)
        "plan", "names", "numels", "offsets", "masked", "coding", "key",
        # its exchange in the current step
        "stage", "pending", "table", "result", "skipped", "gone", "step", "unsettled",
        "unsettled_chunks", "unsettled_seen",
    )

    def __init__(self, plan: BucketPlan, names: Sequence[str], numels: Sequence[int], *,
                 masked: bool = False, coding: str = "fixed", key: str | None = None) -> None:
        self.plan = plan
        #: The error-feedback memory's key (the bucket's name unless given).
        self.key = plan.name if key is None else key
        self.names, self.numels = tuple(names), tuple(int(n) for n in numels)
        #: Where each parameter starts in the bucket (back to back, in bucket order).
        self.offsets = tuple(contiguous_offsets(self.numels))
        #: Whether first-phase payloads carry a presence mask.
        self.masked = masked
        if coding not in CODINGS:
            raise ValueError(f"coding must be one of {CODINGS}, got {coding!r}")
        #: "fixed" or "entropy" (``packed.plan.CODINGS``): how payloads are coded. The same on
        #: every rank; change it only between steps (every rank at the same step).
        self.coding = coding
        self.reset()

    def reset(self) -> None:
        """Forget the current step's exchange."""
        self.stage, self.pending, self.table = "idle", None, None
        self.result: torch.Tensor | None = None
        self.skipped = False
        #: Positions of the parameters no rank had a gradient for (from the presence masks).
        self.gone: list[int] = []
        #: The compressor step of the exchange (set by ``Wire.submit``).
        self.step: int | None = None
        #: A final decode whose device flag is not read yet (``Wire.settle``): (flag, rows,
        #: whether the rows were averaged); None when there is none.
        self.unsettled: tuple[torch.Tensor, Rows, bool] | None = None
        #: Two-phase's alltoall rows whose device flag is not read yet: (flag, rows); None
        #: when there are none.
        self.unsettled_chunks: tuple[torch.Tensor, Rows] | None = None
        #: Which parameters some rank had a gradient for (the union of the presence masks, a
        #: bool per parameter on the device), not read yet (``Wire.settle``); None when not held.
        self.unsettled_seen: torch.Tensor | None = None

    #: The plan's index (the stream key's bucket), name, size and exchange mode.
    index = property(lambda self: self.plan.index)
    name = property(lambda self: self.plan.name)
    numel = property(lambda self: self.plan.numel)
    mode = property(lambda self: self.plan.mode)

    @property
    def variable(self) -> bool:
        """Whether payload sizes may differ by rank (the entropy-coded wire)."""
        return self.coding == "entropy"

    @property
    def mask_bytes(self) -> int:
        """Bytes of the presence mask (one bit per parameter), 0 without one."""
        return (len(self.names) + 7) // 8 if self.masked else 0

    def param_at(self, element: int | None) -> str | None:
        """The parameter holding element ``element`` (None if none)."""
        return param_at(element, self.offsets, self.numels, self.names)

    def spans(self, positions: Sequence[int]) -> list[tuple[int, int]]:
        """(offset, numel) of the parameters at ``positions``."""
        return [(self.offsets[k], self.numels[k]) for k in positions]


class Wire:
    """The stages of a bucket's exchange for one compressor over one :class:`Collectives`.

    Args:
        compression: the compressor (or ``ErrorFeedback``) whose tables and memory are used.
        comm: the payload collectives of the process group.
        stream_rank: the global rank, which keys the random stream (docs/format.md §6).
        deadline: how long one wait may last (``packed.waiting.Deadline``).
        defer: whether what the device decides stays there until :meth:`settle` (one host
            read per step for all buckets, docs/protocol.md §5.8): the flags of plain final
            rows and of two-phase's alltoall rows, the union of their presence masks, and the
            outcome of a send with error feedback on Triton (:meth:`hold_send`). The caller
            then settles every bucket it finished before using their results.

    Buckets in the node-aware modes go through :attr:`node`, the
    :class:`~horovod_aq.torch.node_exchange.NodeExchange` that
    :func:`~horovod_aq.torch.node_exchange.build_wire` attaches on a topology.
    """

    __slots__ = (
        # what it sends with
        "compression", "q", "memory",
        # where and how
        "comm", "ranks", "rank", "stream_rank", "deadline", "node", "defer",
        # what it tells
        "tap", "seconds", "sent",
        # sends whose outcome is read at the step's end (settle)
        "held",
    )

    def __init__(self, compression: Any, comm: Collectives, *, stream_rank: int,
                 deadline: Deadline = FOREVER, defer: bool = False) -> None:
        self.compression = compression
        self.q = compression.quantizer
        self.memory = compression.error_memory
        self.comm = comm
        self.ranks, self.rank = comm.size, comm.rank
        self.stream_rank = stream_rank
        self.deadline = deadline
        self.defer = bool(defer)
        #: ``tap(bucket, part, values, payload)`` for every payload encoded (None: no tap).
        self.tap: Callable[[Bucket, int, torch.Tensor, torch.Tensor], Any] | None = None
        #: Seconds spent encoding, decoding and waiting since :meth:`take_seconds`.
        self.seconds = dict.fromkeys(TIMED, 0.0)
        #: Bytes this rank encoded and sent since :meth:`take_sent` (:data:`SENT`).
        self.sent = dict.fromkeys(SENT, 0)
        #: The node-aware stages (``node_exchange.NodeExchange``; None without a topology).
        self.node: Any = None
        #: Sends whose outcome the device keeps until :meth:`settle` (:meth:`hold_send`).
        self.held: list[tuple[str, Any, torch.Tensor, Any, torch.Tensor]] = []

    @property
    def per_node(self) -> int:
        """Ranks per node of the topology (1: none): the node-aware modes need more."""
        return 1 if self.node is None else self.node.topology.per_node

    # ------------------------------------------------------------------ what it tells
    def take_seconds(self) -> dict[str, float]:
        """The seconds of :attr:`seconds` since the last call, then zero (in place: the
        node-aware exchange's inner wire adds to the same counts)."""
        out = dict(self.seconds)
        self.seconds.update(dict.fromkeys(TIMED, 0.0))
        return out

    def take_sent(self) -> dict[str, int]:
        """The byte counts of :attr:`sent` since the last call, then zero (in place)."""
        out = dict(self.sent)
        self.sent.update(dict.fromkeys(SENT, 0))
        return out

    def _node(self, bucket: Bucket) -> Any:
        """The node-aware stages for a bucket in a node-aware mode, else None."""
        if inner_mode(bucket.mode) is None:
            return None
        if self.node is None:
            raise ValueError(f"bucket {bucket.name} is in mode {bucket.mode!r}, which needs a "
                             "topology: declare it (HOROVOD_AQ_TOPOLOGY=MxL, docs/protocol.md "
                             "§5.7) or use a flat mode")
        return self.node

    def _count(self, payload_bytes: int, to_others: int) -> None:
        """Count bytes leaving this rank (``packed.send.sent_bytes``; presence masks excluded,
        as in ``packed.cost``)."""
        self.sent["payload_bytes"] += payload_bytes
        self.sent["bytes_sent"] += to_others

    # ------------------------------------------------------------------ 1. submission
    def submit(self, bucket: Bucket, raw: torch.Tensor,
               present: Sequence[bool] | None = None) -> None:
        """Send ``raw`` (the bucket's float32 gradient, flat): payloads, or markers (stage 1).
        ``present``: which parameters had a gradient on this rank (masked buckets)."""
        node = self._node(bucket)
        if node is not None:
            return node.submit(bucket, raw, present)
        q, P = self.q, self.ranks
        if any(key == bucket.key for key, *_ in self.held):   # a step that was never settled
            self.settle([])
        bucket.table, bucket.step = q.table, q.step
        fused = compensated.fusable(self, raw)   # error feedback fused into the encoder
        whole = bucket.mode == "allgather"
        sizes = [self._payload_numel(bucket, whole)] * (1 if whole else P)
        send = self._send(bucket, sizes, raw.device) if (
            self.memory is None and not q.recording and self.launches_first(raw)) else None
        steps = SendSteps(compensate=lambda g: g if self.memory is None else
                          self.memory.compensate(bucket.key, g),
                          first_bad=self._first_bad, record=self._record,
                          # Send pads each chunk with zeros itself: no padded copy of x
                          parts=lambda x: self.parts(bucket, x, padded=send is None),
                          encode=lambda part, k: self._encode(bucket, part, k, checked=True,
                                                              send=send, numel=sizes[k]),
                          markers=lambda bad: self._markers(bucket, bad, raw.device),
                          encode_compensated=(lambda g: compensated.encode_compensated(
                              self, bucket, g)) if fused else None,
                          recording=lambda: q.recording,
                          decide=None if send is None else
                          lambda x, sent: self._decided(bucket, send, x, sent))
        update = None if self.memory is None else (
            lambda g, sent: self._update_memory(bucket, g, sent))
        payloads = send_bucket(raw, steps, update)
        self._count(*sent_bytes(bucket.mode, [p.numel() for p in payloads], self.rank, P))
        mask = self.presence_mask(bucket, present, raw.device)
        if mask is not None:
            payloads = [torch.cat([p, mask]) for p in payloads]
        if bucket.mode == "allgather":
            self._allgather(bucket, payloads[0], "ag")
        else:
            assert len(payloads) == P
            bucket.stage = "a2a"
            name = names.alltoall_name(bucket.name)
            bucket.pending = (self.comm.alltoall(payloads, name, variable=True)
                              if bucket.variable else self.comm.alltoall(payloads, name))

    def _allgather(self, bucket: Bucket, payload: torch.Tensor, stage: str) -> None:
        # the stage is set first: under torch.distributed the callback may run at once
        bucket.stage = stage
        name = names.allgather_name(bucket.name)
        then = lambda got: self._gathered(bucket, got)  # noqa: E731
        if not bucket.variable:
            bucket.pending = self.comm.allgather(payload, name, then)
            return
        trailer = bucket.mask_bytes if stage == "ag" else 0
        bucket.pending = self.comm.allgather(
            payload, name, then, delimit=lambda flat, count: payload_sizes(flat, count, trailer))

    def decides_on_device(self, bucket: Bucket, x: torch.Tensor) -> bool:
        """Whether a send of x can choose between payloads and markers on the device, after its
        encode (``packed.send``, "Decided after the encode"): :meth:`launches_first`, with
        fixed-width codes. A first-phase send also needs a step that records nothing, and no
        error memory (or, with it, a wire that settles: ``torch.compensated``)."""
        return not bucket.variable and self.launches_first(x)

    def launches_first(self, x: torch.Tensor) -> bool:
        """Whether a send of x can encode every part before ``packed.send`` step 2 (no error
        memory, nothing recorded): Triton's kernels (whose encode skips the host check),
        float32 values, no checksums. Step 2 then reads nothing with fixed-width codes
        (``Send.decide``) and is read with the histograms of entropy coding
        (:meth:`_decided`)."""
        return (not self.q.checksum and x.dtype == torch.float32
                and kernels.implementation_for(x.device) == "triton")

    def _decided(self, bucket: Bucket, send: Any, x: torch.Tensor, fixed: list[torch.Tensor],
                 *, part: int | None = None, offset: int = 0,
                 plain: torch.Tensor | None = None) -> list[torch.Tensor] | None:
        """``packed.send`` step 2 after the encode of every part of x by ``send``
        (:meth:`_send`; its fixed-width payloads ``fixed``): the payloads, or the markers naming
        element ``offset`` + the first bad one. Fixed codes: chosen on the device
        (``Send.decide``). Entropy coding: the payloads coded, the choice made on the host with
        the histograms' read (:meth:`entropy_code`, with the re-encode's flag ``plain``: None
        where it is False), and shown to the tap (as part ``part``, the re-encoded chunk x;
        None: the parts of x)."""
        if not bucket.variable:
            return send.decide(offset=offset)
        payloads, result, rows_plain = self.entropy_code(bucket, send, fixed, plain=plain)
        if not rows_plain:
            return None
        if payloads is None:
            mode, numel = ("allgather", x.numel()) if part is not None else (None, None)
            return self._markers(bucket, offset + send.first_bad_of(result), x.device,
                                 mode=mode, numel=numel)
        if self.tap is not None:
            views = [(part, x)] if part is not None else enumerate(self.parts(bucket, x))
            for (k, values), payload in zip(views, payloads):
                self.tap(bucket, k, values, payload)
        return payloads

    def entropy_code(self, bucket: Bucket, send: Any, fixed: list[torch.Tensor], *,
                     plain: torch.Tensor | None = None) -> entropy.Coded:
        """``entropy.entropy_of_parts`` of ``send``'s parts (``fixed``), timed as the encode."""
        started = time.perf_counter()
        got = entropy.entropy_of_parts(fixed, bucket.table, send.sizes, self.q.bucket_size,
                                       checksum=self.q.checksum, send=send, plain=plain)
        self.seconds["encode"] += time.perf_counter() - started
        return got

    def _send(self, bucket: Bucket, sizes: list[int], device: torch.device) -> Any:
        """A send without error memory whose parts (of ``sizes`` coordinates) are encoded in one
        pass each and decided after the encode (:meth:`_decided`)."""
        from horovod_aq.torch import triton_send

        q = self.q
        return triton_send.Send(bucket.table, bucket_size=q.bucket_size, norm=q.norm,
                                alpha=0.0, beta=0.0, sizes=sizes, device=device, memory=False)

    def _chunks_failed(self, bucket: Bucket, rows: Rows) -> None:
        """Two-phase's alltoall rows that were not plain, found at :meth:`settle`: a marker or
        a joined rank (every rank received it: the same outcome everywhere), skipped or raised
        as at once; a bad payload raises here (this rank sent a marker instead of its chunk,
        so the others stop too). Rows that the checked path decodes would have needed their
        own average re-encoded: that cannot happen for the rows :meth:`_plain` refuses
        (no checksum; a wire that settles decides presence masks on the device), and is
        reported as a bug."""
        if self._outcome(bucket, rows, names.alltoall_name(bucket.name)) == SKIP:
            return
        self._decode_average(bucket, self._unmask(bucket, rows),   # raises what is wrong
                             self._payload_numel(bucket, False))
        raise RuntimeError(f"horovod_aq: bucket {bucket.name}: its alltoall rows were not plain "
                           "payloads, yet they decode (please report this bug)")

    def _update_memory(self, bucket: Bucket, raw: torch.Tensor,
                       sent: list[torch.Tensor]) -> None:
        """h ← β·h + (g − g̃), g̃ the decode of this rank's own payloads."""
        decode = entropy.decode if bucket.variable else kernels.decode
        self.memory.update(bucket.key, raw, sent_values(
            sent, lambda p: decode(p, bucket.table), torch.cat, bucket.numel))

    def _first_bad(self, raw: torch.Tensor, x: torch.Tensor) -> int | None:
        q = self.q
        return first_bad_element(
            raw, x, first_nonfinite=kernels.first_nonfinite,
            peak=_peak,
            norms=lambda v: kernels.bucket_norms(v, q.bucket_size, q.norm).cpu().numpy(),
            bucket_size=q.bucket_size)

    def _record(self, x: torch.Tensor) -> None:
        q = self.q
        if q.recording:
            q.record_stats(*stats.bucket_moments(x, q.bucket_size),
                           histogram=stats.normalized_histogram(x, q.bucket_size)
                           if q.wants_histogram else None)

    def parts(self, bucket: Bucket, x: torch.Tensor, *,
              padded: bool = True) -> list[torch.Tensor]:
        """[x], or the P chunks of x padded with zeros to P·m (two-phase); not ``padded``: the
        chunks' coordinates of x (views; the last ones shorter or empty), for an encode that
        pads them itself (``triton_send.Send``)."""
        if bucket.mode == "allgather":
            return [x]
        P, n = self.ranks, bucket.numel
        m = chunk_numel(n, P, self.q.bucket_size)
        if not padded:
            return [x[min(k * m, n):min((k + 1) * m, n)] for k in range(P)]
        padded = torch.zeros(P * m, dtype=torch.float32, device=x.device)
        padded[:bucket.numel] = x
        return list(padded.view(P, m))

    def _encode(self, bucket: Bucket, x: torch.Tensor, part: int, *, checked: bool = False,
                send: Any = None, numel: int | None = None) -> torch.Tensor:
        """Part ``part`` of x; ``checked``: ``packed.send`` step 2 found x sendable, so a fixed
        encode skips its own check and host sync (the re-encoded chunk has no step 2), or
        ``send`` (:meth:`_send`) decides it after the encode, padding x with zeros to the
        part's ``numel`` (the tap sees the padded values)."""
        q = self.q
        if send is not None:
            encode = lambda x, table, *, key, **_: send.encode(x, None, None, key)  # noqa: E731
        else:
            encode = lambda *a, **k: (  # noqa: E731
                entropy.encode_entropy if bucket.variable else kernels.encode)(
                    *a, **k, checked=checked)
        payload = self.timed_encode(bucket, part, lambda key: encode(
            x, bucket.table, bucket_size=q.bucket_size, norm=q.norm, key=key,
            checksum=q.checksum))
        if self.tap is not None and not (send is not None and bucket.variable):  # _decided
            short = 0 if numel is None else numel - x.numel()
            self.tap(bucket, part, torch.nn.functional.pad(x, (0, short)) if short else x,
                     payload)
        return payload

    def timed_encode(self, bucket: Bucket, part: int,
                     run: Callable[[StreamKey], torch.Tensor | None]) -> torch.Tensor | None:
        """``run(key)``: the payload of ``part`` (None: not encodable), with the format's stream
        of (seed, rank, step, bucket, part) (docs/format.md §6: a resumed run draws exactly what
        an uninterrupted one would); timed into ``seconds``."""
        q = self.q
        started = time.perf_counter()
        payload = run(StreamKey(q.seed, self.stream_rank, q.step, bucket.index, part))
        self.seconds["encode"] += time.perf_counter() - started
        return payload

    def _markers(self, bucket: Bucket, first_bad: int, device: torch.device, *,
                 mode: str | None = None, numel: int | None = None) -> list[torch.Tensor]:
        """The markers of the bucket's send (of ``numel`` coordinates sent by ``mode``: the
        re-encoded chunk's)."""
        q = self.q
        spec = marker_for(mode or bucket.mode, numel or bucket.numel, self.ranks,
                          bucket.table.bits, q.bucket_size)
        one = torch.from_numpy(spec.payload(bucket.table, q.bucket_size, q.norm,
                                            first_bad)).to(device)
        return [one] * spec.copies

    @staticmethod
    def presence_mask(bucket: Bucket, present: Sequence[bool] | None,
                      device: torch.device) -> torch.Tensor | None:
        """The bucket's presence mask (one bit per parameter, ``np.packbits`` order; all set
        for ``present`` None), None for an unmasked bucket."""
        if not bucket.masked:
            return None
        bits = np.ones(len(bucket.names), dtype=bool) if present is None else np.asarray(
            present, dtype=bool)
        return device_constant(np.packbits(bits), device)   # no copy per step

    def _unmask(self, bucket: Bucket, rows: Rows) -> Rows:
        """The payloads of masked ``rows``; records in ``bucket.gone`` the parameters that no
        rank had a gradient for."""
        k = bucket.mask_bytes
        if not k:
            return rows
        if isinstance(rows, list):
            tails = torch.stack([r[-k:] for r in rows]).cpu().numpy()   # one copy
            rows = [r[:-k] for r in rows]
        else:
            tails = rows[:, -k:].cpu().numpy()
            rows = rows[:, :-k].contiguous()
        masks = np.unpackbits(tails, axis=1)[:, :len(bucket.names)]
        bucket.gone = [i for i, seen in enumerate(masks.any(axis=0)) if not seen]
        return rows

    @staticmethod
    def _rows(bucket: Bucket, received: Received) -> Rows:
        """[P, size] rows (fixed coding) or a list of P rows (entropy coding)."""
        return received.row_list() if bucket.variable else received.rows()

    def _plain(self, bucket: Bucket, rows: Rows, numel: int, *, average: bool = True,
               host: list[torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decode of ``rows`` and one device flag, read nowhere here: True when they are
        plain payloads (no marker, no joined rank, no checksum, every header what this rank's
        encode writes, every norm and code valid: ``kernels.decode_flagged``; entropy-coded
        rows, with Triton: ``entropy.device_values``, whose one copy of the rows' headers and
        models, or their ``host`` copy, returns None for anything else; and, on a wire that
        decides at once, every presence bit set); None where only the checked path decides.
        When the flag is False the decode is not the result: the checked path decides, skips
        or raises as the oracle (docs/protocol.md §5.8). With ``defer`` the masks' union goes
        to ``bucket.unsettled_seen`` instead (:meth:`settle` reads it)."""
        k = bucket.mask_bytes if average else 0   # re-encoded chunks carry no mask
        if isinstance(rows, list):
            cut = lambda some: [r[:-k] if k else r for r in some]  # noqa: E731 - the masks
            got = self._plain_variable(bucket, cut(rows), numel, average,
                                       None if host is None else cut(host))
            masks = torch.stack([r[-k:] for r in rows]) if got is not None and k else None
        else:
            got = kernels.decode_flagged(rows[:, :-k] if k else rows, bucket.table,
                                         numel=numel, bucket_size=self.q.bucket_size,
                                         norm=self.q.norm, average=average)
            masks = rows[:, -k:] if k else None
        if got is None:
            return None
        values, ok = got
        if masks is not None and self.defer:
            bucket.unsettled_seen = self._seen(bucket, masks)
        elif masks is not None:
            ok = ok & (masks == self._full_mask(bucket, masks.device)).all()
        return values, ok

    def _plain_variable(self, bucket: Bucket, rows: list[torch.Tensor], numel: int,
                        average: bool, host: list[torch.Tensor] | None
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Entropy-coded (or fixed-width) ``rows`` of any lengths decoded on the device with
        one flag (``entropy.device_values``, Triton only: elsewhere the checked path's
        compiled decoders run on the host anyway; their headers read from ``host``, the same
        rows on the host, where the collective copied them): their average, each row divided
        by P and added in rank order (``entropy.average_values``, bitwise
        ``codec.decode_average``), or their concatenation."""
        if kernels.implementation_for(rows[0].device) != "triton":
            return None
        q = self.q
        got = entropy.device_values(rows, bucket.table, numel=numel, bucket_size=q.bucket_size,
                                    norm=q.norm, host=host)
        if got is None:
            return None
        values, ok = got
        return (entropy.average_values(values) if average else torch.cat(values)), ok

    @staticmethod
    def _seen(bucket: Bucket, masks: torch.Tensor) -> torch.Tensor:
        """Which parameters some rank had a gradient for: the union of the rows' presence
        ``masks`` ([P, mask_bytes], ``np.packbits`` order), a bool per parameter, on the
        device."""
        shifts = device_constant(np.arange(7, -1, -1, dtype=np.uint8), masks.device)
        bits = (masks.unsqueeze(-1) >> shifts) & 1          # np.unpackbits, [P, bytes, 8]
        return bits.amax(dim=0).reshape(-1)[:len(bucket.names)].bool()

    def _zero_unseen(self, bucket: Bucket, chunk: torch.Tensor, seen: torch.Tensor,
                     m: int) -> None:
        """Exact zeros in this rank's ``chunk`` (of ``m``) where no rank had the parameter
        (``seen`` False): ``chunk_zero_spans``' absent spans, on the device, without reading
        ``seen`` (``packed.chunks.chunk_param_parts``)."""
        first, parts = chunk_param_parts(bucket.numel, m, self.rank, bucket.offsets,
                                         bucket.numels)
        if not parts:
            return
        valid = sum(parts)
        absent = torch.repeat_interleave(~seen[first:first + len(parts)],
                                         device_constant(np.asarray(parts), seen.device),
                                         output_size=valid)
        chunk[:valid].masked_fill_(absent, 0.0)

    @staticmethod
    def _full_mask(bucket: Bucket, device: torch.device) -> torch.Tensor:
        """The presence mask with every bit set, made on the device (no host copy)."""
        full = torch.full((bucket.mask_bytes,), 0xFF, dtype=torch.uint8, device=device)
        tail = len(bucket.names) % 8   # np.packbits: the first names take the high bits
        if tail:
            full[-1] = (0xFF << (8 - tail)) & 0xFF
        return full

    def _decode_average(self, bucket: Bucket, rows: Rows, numel: int) -> torch.Tensor:
        q = self.q
        average = entropy.decode_average if isinstance(rows, list) else kernels.decode_average
        return average(rows, bucket.table, numel=numel, bucket_size=q.bucket_size, norm=q.norm)

    # ------------------------------------------------------------------ 2. two-phase stage 2
    def ready(self, bucket: Bucket) -> bool:
        """Whether the bucket's collective in flight has completed (never blocks)."""
        return bucket.pending is not None and bucket.pending.done()

    def advances(self, bucket: Bucket) -> bool:
        """Whether :meth:`advance` has a stage still to run for the bucket (the DDP hook calls
        it once per later bucket, in order, while this holds)."""
        if self._node(bucket) is not None:
            return bucket.stage in ("rs", "cross")
        return bucket.stage == "a2a"

    def memory_key(self, bucket: Bucket) -> str:
        """The error-feedback memory's key for the bucket in its current mode."""
        node = self._node(bucket)
        return bucket.key if node is None else node.memory_key(bucket)

    def advanceable(self, bucket: Bucket) -> bool:
        """Whether :meth:`advance` has work for the bucket that needs no waiting (a two-phase
        alltoall that completed; a node-aware stage whose collective completed)."""
        node = self._node(bucket)
        if node is not None:
            return node.advanceable(bucket)
        return bucket.stage == "a2a" and self.ready(bucket)

    def advance(self, bucket: Bucket) -> None:
        """Two-phase stage 2: wait for the alltoall, decide on the received chunks, decode and
        average chunk r, re-encode it (part P) and start the allgather of the averaged chunks.
        Does nothing in any other stage. (Node-aware modes: their next stage.)"""
        node = self._node(bucket)
        if node is not None:
            return node.advance(bucket)
        if bucket.stage != "a2a":
            return
        q, P = self.q, self.ranks
        collective = names.alltoall_name(bucket.name)
        received = self._wait(bucket, collective)
        rows = self._rows(bucket, received)
        m = chunk_numel(bucket.numel, P, q.bucket_size)
        started = time.perf_counter()
        got = self._plain(bucket, rows, m)
        # decided at settle, a chunk of rows that were not plain being replaced by its marker;
        # not with entropy coding: a marker in place of a shorter payload would misstate its size
        held = self.defer and got is not None and not bucket.variable
        # entropy coding with Triton: the flag is read with the re-encode's histograms
        late = got is not None and bucket.variable and self.launches_first(got[0])
        if held:
            chunk, bucket.unsettled_chunks = got[0], (got[1], rows)
        elif late:
            chunk = got[0]
        else:
            chunk = got[0] if got is not None and bool(got[1]) else None   # one synchronisation
        if chunk is None:
            chunk = self._checked_chunk(bucket, rows, collective, m)
        self.seconds["decode"] += time.perf_counter() - started
        if chunk is None:   # skipped
            return
        payload = self._reencode(bucket, chunk, held=held, plain=got[1] if late else None)
        if payload is None:   # the rows were not plain after all: decided as at once
            started = time.perf_counter()
            chunk = self._checked_chunk(bucket, rows, collective, m)
            self.seconds["decode"] += time.perf_counter() - started
            if chunk is None:
                return
            payload = self._reencode(bucket, chunk)
        self._count(0, sent_bytes("allgather", [payload.numel()], self.rank, P)[1])
        self._allgather(bucket, payload, "ag2")

    def _checked_chunk(self, bucket: Bucket, rows: Rows, collective: str,
                       m: int) -> torch.Tensor | None:
        """The checked path of two-phase's alltoall rows (``packed.receive``): None where the
        bucket is skipped, else the average of chunk r (raises what is wrong)."""
        if self._outcome(bucket, rows, collective) == SKIP:
            return None
        return self._decode_average(bucket, self._unmask(bucket, rows), m)

    def _reencode(self, bucket: Bucket, chunk: torch.Tensor, *, held: bool = False,
                  plain: torch.Tensor | None = None) -> torch.Tensor | None:
        """The payload of this rank's averaged ``chunk`` (part P), its absent parameters
        zeroed, or its marker naming element r·m + j where it cannot travel, or r·m where its
        rows were not plain (``held``: decided at :meth:`settle`); None where ``plain``, read
        with the entropy coder's histograms, says they were not (the caller takes the checked
        path)."""
        q, P = self.q, self.ranks
        m = chunk.numel()
        for lo, hi in chunk_zero_spans(bucket.numel, m, self.rank, bucket.spans(bucket.gone)):
            chunk[lo:hi] = 0.0
        if held and bucket.unsettled_seen is not None:   # absent parameters, on the device
            self._zero_unseen(bucket, chunk, bucket.unsettled_seen, m)
        if self.launches_first(chunk):
            send = self._send(bucket, [m], chunk.device)
            fixed = self._encode(bucket, chunk, reencode_part(P), send=send)
            if held:
                send.refuse(~bucket.unsettled_chunks[0])
            sent = self._decided(bucket, send, chunk, [fixed], part=reencode_part(P),
                                 offset=self.rank * m, plain=plain)
            return None if sent is None else sent[0]
        payload = reencode_chunk(
            chunk, self.rank, m, encode=lambda c: self._encode(bucket, c, reencode_part(P)),
            first_bad=lambda c: self._first_bad(c, c),
            marker=lambda bad: self._markers(bucket, bad, chunk.device, mode="allgather",
                                             numel=m)[0])
        if held:
            refused = (~bucket.unsettled_chunks[0]).to(torch.int64) - 1   # 0: not plain
            [payload] = markers.markers_or([payload], refused, offset=self.rank * m,
                                           numel=m, table=bucket.table,
                                           bucket_size=q.bucket_size, norm=q.norm)
        return payload

    # ------------------------------------------------------------------ 3. the allgathers
    def _gathered(self, bucket: Bucket, received: Received) -> None:
        """The allgather's rows arrived: decide and decode (stage 3). Plain rows are decoded
        on the device and decided by their flag: at once, or at :meth:`settle` (``defer``)."""
        rows = self._rows(bucket, received)
        started = time.perf_counter()
        average = bucket.stage == "ag"
        got = self._plain(bucket, rows, self._payload_numel(bucket, average), average=average,
                          host=received.host_row_list())
        if got is not None and self.defer:
            result, bucket.unsettled = got[0], (got[1], rows, average)
        elif got is not None and bool(got[1]):   # one synchronisation
            result = got[0]
        else:
            result = self._checked(bucket, rows, average)
            if result is None:   # skipped
                return
        self._deliver(bucket, result, average)
        self.seconds["decode"] += time.perf_counter() - started

    def _payload_numel(self, bucket: Bucket, whole: bool) -> int:
        """Coordinates of one payload: the bucket's (allgather: sent and averaged whole) or a
        two-phase chunk's m."""
        return bucket.numel if whole else chunk_numel(bucket.numel, self.ranks,
                                                      self.q.bucket_size)

    def _checked(self, bucket: Bucket, rows: Rows, average: bool) -> torch.Tensor | None:
        """The final rows decided by ``packed.receive`` and decoded by the checked decoders:
        the average of the payloads, or the averaged chunks concatenated; None when the bucket
        is skipped (its result is NaN). Raises what the rows call for."""
        collective = names.allgather_name(bucket.name)
        if self._outcome(bucket, rows, collective) == SKIP:   # a marker (a chunk's, too)
            return None
        numel = self._payload_numel(bucket, average)
        if average:
            return self._decode_average(bucket, self._unmask(bucket, rows), numel)
        kw = {"numel": numel, "bucket_size": self.q.bucket_size, "norm": self.q.norm}
        return (entropy.decode_each(rows, bucket.table, **kw) if bucket.variable
                else torch.cat([kernels.decode(row, bucket.table, **kw) for row in rows]))

    @staticmethod
    def _deliver(bucket: Bucket, result: torch.Tensor, average: bool) -> None:
        """The bucket's result: the decoded rows without the two-phase padding, exact zeros
        where no rank had a gradient."""
        if not average:
            result = result[:bucket.numel]
        for offset, numel in bucket.spans(bucket.gone):
            result[offset:offset + numel] = 0.0
        bucket.result, bucket.stage = result, "done"

    def hold_send(self, key: str, send: Any, new: torch.Tensor, old: Any,
                  raw: torch.Tensor) -> None:
        """A send with error feedback whose outcome stays on the device (``torch.compensated``):
        ``send`` (a ``triton_send.Send``) wrote h' = ``new``, already the memory of
        ``key`` in place of ``old``, for the raw gradient ``raw``. :meth:`settle` reads its
        outcome and keeps h' or gives h back (``ErrorMemory.settle_swap``)."""
        self.held.append((key, send, new, old, raw))

    def settle(self, buckets: Sequence[Bucket]) -> list[tuple[Bucket, BaseException]]:
        """What ``defer`` left on the device, read in one copy (the step's one synchronisation):
        first every held send's outcome (:meth:`hold_send`; all of them, whatever ``buckets``
        holds), then the alltoall rows and final rows of the buckets given, and the union of
        their presence masks (``Bucket.gone``; the absent parameters' coordinates of a plain
        result are zeroed then). A bucket whose flag is False takes the checked path
        (``packed.receive``): its result is replaced, it is skipped, or its error is returned
        beside it, in the order given (every rank meets the same outcome, or stops). Call it
        once every bucket finished, before using any result; nothing held costs nothing."""
        held = [b for b in buckets if b.unsettled is not None or b.unsettled_chunks is not None]
        sends, self.held = self.held, []
        if not held and not sends:
            return []
        started = time.perf_counter()
        flags = [kept[0] for b in held for kept in (b.unsettled_chunks, b.unsettled)
                 if kept is not None]   # per bucket: the alltoall's, then the final rows'
        seen = [b.unsettled_seen for b in held if b.unsettled_seen is not None]
        parts = ([torch.stack(flags).to(torch.float64)] if flags else []) + [
            s.to(torch.float64) for s in seen]
        host = torch.cat(parts + [send.result for _, send, *_ in sends]).cpu().numpy()  # 1 copy
        plain = iter(host[:len(flags)] != 0)
        at = len(flags)
        unions = []
        for s in seen:
            unions.append(host[at:at + s.numel()] != 0)
            at += s.numel()
        union = iter(unions)
        for key, send, new, old, raw in sends:
            outcome = send.outcome_of(host[at:at + send.result.numel()])
            at += send.result.numel()
            finite, squares = outcome or (True, None)
            self.memory.settle_swap(key, new, old, raw, travelled=outcome is not None,
                                    finite=finite, sum_of_squares=squares)
        failed: list[tuple[Bucket, BaseException]] = []
        for bucket in held:
            chunks, final = bucket.unsettled_chunks, bucket.unsettled
            masked = bucket.unsettled_seen is not None
            bucket.unsettled_chunks = bucket.unsettled = bucket.unsettled_seen = None
            chunks_plain = chunks is None or next(plain)
            final_plain = final is None or next(plain)
            if masked:   # the parameters no rank had a gradient for
                bucket.gone = [i for i, had in enumerate(next(union)) if not had]
            try:
                if not chunks_plain:
                    self._chunks_failed(bucket, chunks[1])
                elif not final_plain:
                    _, rows, average = final
                    result = self._checked(bucket, rows, average)
                    if result is not None:
                        self._deliver(bucket, result, average)
                elif bucket.gone:   # the plain decode, delivered before they were known
                    self._deliver(bucket, bucket.result, True)
            except Exception as exc:  # noqa: BLE001 - the caller raises it at the step's end
                failed.append((bucket, exc))
        self.seconds["decode"] += time.perf_counter() - started
        return failed

    def _outcome(self, bucket: Bucket, rows: Rows, collective: str) -> str:
        """``packed.receive`` on the rows' headers; a skipped bucket's result is NaN."""
        outcome = receive_outcome(_heads(rows),
                                  nonfinite=self.compression.nonfinite, bucket=bucket.name,
                                  collective=collective, param_at=bucket.param_at,
                                  joined=self.comm.zero_fills_joined)
        if outcome == SKIP:
            device = rows[0].device if isinstance(rows, list) else rows.device
            bucket.result = torch.full((bucket.numel,), float("nan"), device=device)
            bucket.skipped, bucket.stage = True, "done"
        return outcome

    def _wait(self, bucket: Bucket, collective: str) -> Any:
        pending, bucket.pending = bucket.pending, None
        started = time.perf_counter()
        wait_until(pending.done, self.deadline, collective, bucket.name, EXCHANGING)
        self.seconds["wait"] += time.perf_counter() - started
        return pending.wait()

    def finish(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's averaged float32 gradient: advances and waits as needed, raises what a
        callback kept. Idempotent once done. With ``defer`` it stands only once :meth:`settle`
        returned (read ``bucket.result`` then)."""
        node = self._node(bucket)
        if node is not None:
            return node.finish(bucket)
        self.advance(bucket)
        if bucket.pending is not None:   # also when a callback finished: it may have raised
            self._wait(bucket, names.allgather_name(bucket.name))
        if bucket.result is None:
            raise RuntimeError(f"bucket {bucket.name} finished without a result (stage "
                               f"{bucket.stage}): it was never submitted")
        return bucket.result


__all__ = ["Bucket", "Collectives", "Pending", "Received", "SENT", "TIMED", "Wire"]
