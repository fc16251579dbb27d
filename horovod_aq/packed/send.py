"""The order in which a rank sends one bucket, with its error-feedback update (docs/protocol.md
§4, §5, docs/quantizers.md on ECQ-SGD), written once for every framework.

For a bucket's raw local gradient g:

1. **compensate**: x = g + α·h with error feedback (ECQ-SGD), else x = g;
2. **check**: the first element that cannot travel — a NaN/±Inf of g or x, or the first
   element of a quantization bucket whose norm does not fit a float32
   (:func:`~horovod_aq.packed.protocol.first_unsendable`). If there is one, the rank sends
   non-finite markers instead (:mod:`horovod_aq.packed.marker`) and steps 3–5 do not run;
3. **record** the refit statistics of x (when the schedule says so);
4. **encode** the parts: x itself (allgather, part 0) or the P chunks of x padded with zeros to
   P·m coordinates (two-phase, part k for chunk k; the averaged chunk is re-encoded later with
   part :func:`reencode_part`);
5. **update** the error memory from what was sent: h ← β·h + (g − g̃), g̃ = the decode of the
   payloads just encoded (:func:`sent_values`).

:func:`send_bucket` runs these steps with the framework's callables (:class:`SendSteps`), so
PyTorch calls it eagerly and TensorFlow at trace time (its ``branch`` is a ``tf.cond``).

**Fused** (``SendSteps.encode_compensated``, where the framework has a kernel for it: the torch
wire on CPU tensors and, with Triton, CUDA tensors; the TensorFlow graph's encode with error
feedback; docs/dynamic.md §2.6): steps 1, 4 and 5 run as one pass per part, which returns the
payloads and h' without installing it (:class:`Fused`), or nothing when a bucket of x cannot
travel. Then step 2 is that outcome: only a failed pass computes x and the first bad element
for the markers (the same element as above) and installs nothing. Step 3 computes x only on the
steps that record, and h' is installed last. In a graph the outcome is known only when the
graph runs: the pass always returns a :class:`Fused` whose ``refused`` is a bool tensor, and
``branch`` and ``when`` are the graph's conditionals. What is sent and what h becomes are
bitwise the unfused steps' (``codec.encode_compensated`` is the definition).

**Decided after the encode** (``SendSteps.decide``, where there is no error memory and nothing
is recorded: the torch wire with Triton, docs/protocol.md §4): step 4 runs first, as if x could
travel, and step 2 then chooses, on the device, between the payloads and the markers from x and
the payloads' bucket norms, so the host reads nothing. The same bytes as steps 2–4 in order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from horovod_aq.packed.protocol import first_unsendable, norm_may_overflow

Payloads = list[Any]


def python_branch(bad: Any, on_bad: Callable[[], Payloads],
                  on_ok: Callable[[], Payloads]) -> Payloads:
    """Step 2's choice in eager code: ``bad`` is the first bad element or None."""
    return on_ok() if bad is None else on_bad()


def python_when(flag: Any, action: Callable[[], Any]) -> None:
    """Step 3's condition in eager code: ``action()`` if ``flag``."""
    if flag:
        action()


@dataclass(frozen=True)
class Fused:
    """What the fused pass (steps 1, 4, 5) returns: every part's payload and the callable that
    installs h'. ``refused``: whether a bucket of x could not travel, in the form ``branch``
    takes — None eagerly (a refused bucket returns no :class:`Fused` at all); in a graph a bool
    tensor, known when the graph runs (the payloads are then placeholders, never sent)."""

    payloads: Payloads
    install: Callable[[], Any]
    refused: Any = None


@dataclass(frozen=True)
class SendSteps:
    """The framework's tensor work for one bucket; :func:`send_bucket` calls it in order."""

    #: raw g → x = g + α·h (error feedback), else g itself.
    compensate: Callable[[Any], Any]
    #: (g, x) → the first element that cannot travel (NaN/±Inf, or a bucket norm past float32),
    #: in whatever form ``branch`` takes (None / int eagerly, a tensor in a graph).
    first_bad: Callable[[Any, Any], Any]
    #: x → nothing; records refit statistics while the compressor is recording.
    record: Callable[[Any], Any]
    #: x → the parts to encode, in part order: [x], or the P chunks of the zero-padded x.
    parts: Callable[[Any], Sequence[Any]]
    #: (part values, part index) → its payload.
    encode: Callable[[Any, int], Any]
    #: first bad element → the markers sent in place of the payloads (one per part).
    markers: Callable[[Any], Payloads]
    #: (bad, on_bad, on_ok) → the payloads; :func:`python_branch` eagerly, ``tf.cond`` in a graph.
    branch: Callable[[Any, Callable[[], Payloads], Callable[[], Payloads]], Payloads] = \
        python_branch
    #: Steps 1, 4 and 5 in one pass (module docstring), or None: raw g → :class:`Fused`, or
    #: None (eagerly) when a bucket of x cannot travel (nothing installed).
    encode_compensated: Callable[[Any], Fused | None] | None = None
    #: () → whether ``record`` records this step (the fused path computes x for it only then):
    #: a bool, or in a graph whatever ``when`` takes (a bool tensor).
    recording: Callable[[], Any] = lambda: True
    #: (flag, action) → ``action()`` if ``flag``: :func:`python_when` eagerly, a ``tf.cond``
    #: in a graph (the fused path's step 3).
    when: Callable[[Any, Callable[[], Any]], Any] = python_when
    #: Step 2 after step 4 (module docstring, "Decided after the encode"), or None:
    #: (x, payloads) → the payloads, or the markers where an element of x cannot travel. Only
    #: without error memory (no ``update``) and while nothing is recorded.
    decide: Callable[[Any, Payloads], Payloads] | None = None


def send_bucket(raw: Any, steps: SendSteps,
                update: Callable[[Any, Payloads], Any] | None = None) -> Payloads:
    """Steps 1–5 of the module docstring for the raw gradient ``raw``: the payloads to send, or
    the markers. ``update(raw, payloads)`` is step 5 (error feedback; None: no memory, or the
    framework updates later, as the TensorFlow graph does after its checks); with
    ``steps.encode_compensated`` the fused pass updates the memory instead."""
    if steps.encode_compensated is not None:
        return _send_fused(raw, steps)
    if steps.decide is not None:
        if update is not None:
            raise ValueError("SendSteps.decide sends without error memory: it has no update")
        x = steps.compensate(raw)                  # 1. x = g
        sent = [steps.encode(part, k) for k, part in enumerate(steps.parts(x))]   # 4.
        return steps.decide(x, sent)               # 2. payloads, or markers
    x = steps.compensate(raw)                      # 1. g + α·h
    bad = steps.first_bad(raw, x)                  # 2. what cannot travel → markers

    def payloads() -> Payloads:
        steps.record(x)                            # 3. refit statistics
        sent = [steps.encode(part, k) for k, part in enumerate(steps.parts(x))]   # 4.
        if update is not None:
            update(raw, sent)                      # 5. h ← β·h + (g − g̃)
        return sent

    return steps.branch(bad, lambda: steps.markers(bad), payloads)


def _send_fused(raw: Any, steps: SendSteps) -> Payloads:
    """Steps 1–5 with the fused pass (module docstring, "Fused")."""
    assert steps.encode_compensated is not None
    fused = steps.encode_compensated(raw)          # 1, 4, 5: payloads and h', not installed

    def markers() -> Payloads:                     # 2. what cannot travel → markers
        bad = steps.first_bad(raw, steps.compensate(raw))
        if bad is None:
            raise RuntimeError("horovod_aq: the fused error-feedback encoder refused a bucket "
                               "that the unfused check lets travel (please report this bug)")
        return steps.markers(bad)

    if fused is None:
        return markers()

    def payloads() -> Payloads:
        steps.when(steps.recording(),              # 3. refit statistics of x
                   lambda: steps.record(steps.compensate(raw)))
        fused.install()                            # 5. h ← h' = β·h + (g − g̃)
        return fused.payloads

    return steps.branch(fused.refused, markers, payloads)


def first_bad_element(raw: Any, x: Any, *, first_nonfinite: Callable[[Any], int | None],
                      peak: Callable[[Any], float], norms: Callable[[Any], Any],
                      bucket_size: int) -> int | None:
    """Step 2 eagerly: the first NaN/±Inf of g, else of x (g + α·h), else the first element of
    the first quantization bucket of x whose norm does not fit a float32; None if all travel.

    One pass in the common case: ``peak(x)`` = max|x_i| (NaN or inf when x is not finite — and x
    is finite only if g is; 0 for no elements). Only a non-finite peak pays for
    ``first_nonfinite``, and only a peak that may overflow (``norm_may_overflow``) for the
    per-bucket ``norms(x)`` (numpy, float32 or float64). Two-phase chunks are whole
    quantization buckets, so the buckets of x are those of its chunks and the element is the
    same."""
    top = peak(x)
    if not math.isfinite(top):
        bad = first_nonfinite(raw)
        return bad if bad is not None else first_nonfinite(x)
    if norm_may_overflow(top, bucket_size):
        j = first_unsendable(norms(x))
        return None if j is None else j * bucket_size
    return None


def sent_values(payloads: Sequence[Any], decode: Callable[[Any], Any],
                concat: Callable[[list[Any]], Any], numel: int) -> Any:
    """g̃, what this rank sent: the decode of its payloads, concatenated, without the two-phase
    padding (the first ``numel`` values)."""
    return concat([decode(p) for p in payloads])[:numel]


def sent_bytes(mode: str, sizes: Sequence[Any], rank: int, ranks: int) -> tuple[Any, Any]:
    """(payload bytes, bytes sent to other ranks) of one first-phase send (docs/protocol.md §8):
    ``sizes`` are this rank's payload sizes — one (allgather: (P − 1)·size go out) or the P
    chunks of a two-phase bucket (all but its own chunk go out). Integers or framework scalar
    tensors alike. A re-encoded two-phase chunk of size s adds (P − 1)·s to the bytes sent
    (``sent_bytes("allgather", [s], …)[1]``) and nothing to the payload bytes."""
    if mode == "allgather":
        return sizes[0], (ranks - 1) * sizes[0]
    total = sum(sizes[1:], sizes[0])
    return total, total - sizes[rank]


def reencode_part(ranks: int) -> int:
    """The stream part of a two-phase bucket's re-encoded averaged chunk: P (chunks used
    0 … P−1; docs/format.md §6)."""
    return ranks


def reencode_chunk(chunk: Any, rank: int, m: int, *, encode: Callable[[Any], Any],
                   first_bad: Callable[[Any], int | None], marker: Callable[[int], Any]) -> Any:
    """Two-phase stage 2's send of this rank's averaged chunk (m coordinates): its payload, or
    a non-finite marker of the chunk's size naming element rank·m + j of the bucket, where the
    average cannot travel (ranks' sendable payloads can average to a bucket whose norm is past
    float32): every rank then decides as for any marker (docs/protocol.md §4), where this rank
    would raise alone while the others wait for its allgather. ``encode`` raises
    ``ValueError`` for such a chunk; ``first_bad`` gives its first bad element (None: the error
    was another one, raised again)."""
    try:
        return encode(chunk)
    except ValueError:
        j = first_bad(chunk)
        if j is None:
            raise
        return marker(rank * m + j)


__all__ = ["Fused", "SendSteps", "first_bad_element", "python_branch", "python_when",
           "reencode_chunk", "reencode_part", "send_bucket", "sent_bytes", "sent_values"]
