"""ECQ-SGD in the TensorFlow packed exchange: the compensated encode and the memory update
(docs/dynamic.md §2.6, docs/protocol.md §13).

The encode with error feedback is one op per code width. For a bucket's raw gradient g and its
memory h (float32, n coordinates) it computes, in float32 with α, β rounded to float32,

    x_i  = fl(g_i + fl(α·h_i))                 x zero-padded to the parts' coordinates
    payload(s) = encode(x)                     one, or the P chunks of x (two-phase)
    g̃_i  = n_k · L_{code_i}                    read off the codes the encode chose
    h'_i = fl(fl(β·h_i) + fl(g_i − g̃_i))       over the n real coordinates

without packing and unpacking codes or decoding the payload: ``codec.encode_compensated``, the
numpy oracle, bit for bit. Where it runs:

* **Host** (no GPU visible, ``kernels.use_fused``; and always on the entropy-coded wire, whose
  coder is host code): one ``tf.numpy_function`` calling the compiled pass of
  ``codec.fused_compensated`` part by part — the fixed wire with the graph's table variables
  (``encode_compensated_with``: the bytes of ``kernels.encode_with``), the entropy-coded wire
  with the width's table (``try_encode_compensated(coding="entropy")``: the codes the coder
  codes are the pass's own, so h' comes from the very codes sent, in the same pass, as on the
  PyTorch CPU path). numpy keeps subnormals, as the oracle does.
* **Graph ops** (a GPU, or ``HOROVOD_AQ_KERNELS=ops``): the codes and norms of ``kernels``'
  quantizer, packed as ``kernels.encode_with`` packs them, g̃ gathered from the same codes. On a
  CPU, TensorFlow flushes subnormal inputs and results to zero (``codec.reference``
  docstring): there h' differs from the oracle's only in coordinates where g_i, h_i, α·h_i,
  x_i, g̃_i, β·h_i, g_i − g̃_i or h'_i lies below 2^−126 (≈ 1.2e-38) in magnitude.

Where a bucket of x cannot travel (a NaN/±Inf; a bucket whose l2 norm, exact in float64, does
not fit a float32 — the rule of ``PayloadOps._first_bad``, on every norm) the op says so
(``refused``) and its payloads are placeholders: the sender's markers go out instead
(``packed.send.send_bucket``, "Fused") and no memory is updated in that step.

:func:`update_memory` is the step end's update: h ← h' after every check passed, skipped when
any rank sent markers, zeros (counted) for a non-finite h' with ``reset_on_nonfinite``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from horovod_aq import codec
from horovod_aq.codec import HEADER_SIZE, NORM_BYTES
from horovod_aq.codec.stream import StreamKey
from horovod_aq.packed.protocol import first_unsendable, norm_may_overflow
from horovod_aq.tensorflow import kernels
from horovod_aq.tensorflow.bits import pack_bits
from horovod_aq.tensorflow.tensors import per_bucket

__all__ = ["Compensated", "MemoryUpdate", "Parts", "on_host", "in_graph", "update_memory"]


class Compensated(NamedTuple):
    """What the compensated encode of one bucket returns (tensors)."""

    payloads: tuple[tf.Tensor, ...]   #: one per part; placeholders where ``refused``
    memory: tf.Tensor                 #: h' (float32, the bucket's n coordinates)
    finite: tf.Tensor                 #: bool: every h'_i is finite
    refused: tf.Tensor                #: bool: a bucket of x cannot travel (markers go out)


@dataclasses.dataclass(frozen=True)
class Parts:
    """How a bucket of ``numel`` coordinates is encoded: ``copies`` payloads of ``size``
    coordinates each (1 × n for allgather; P chunks of m for two-phase, zero-padded), the
    streams (seed, rank, step, ``bucket``, part k) and the settings fixed at trace time."""

    numel: int
    size: int
    copies: int
    bucket: int
    alpha: float
    beta: float
    bucket_size: int
    norm: str
    checksum: bool

    def spans(self) -> list[tuple[int, int]]:
        """[lo, hi) of g for each part (empty past the bucket's end)."""
        return [(min(k * self.size, self.numel), min((k + 1) * self.size, self.numel))
                for k in range(self.copies)]


def on_host(g: tf.Tensor, h: tf.Tensor, step: tf.Tensor, parts: Parts, *, seed: int, rank: int,
            bits: int, levels: tf.Tensor | None = None, header: tf.Tensor | None = None,
            table_of: Callable[[], Any] | None = None) -> Compensated:
    """The compiled pass (module docstring, "Host") as one ``tf.numpy_function``: the fixed
    wire with ``levels`` and ``header`` (graph variables), or the entropy-coded wire with
    ``table_of()`` (the width's ``LevelTable``); ``step`` is read in-graph."""
    from horovod_aq.codec import fused_compensated  # numba: imported when a graph is built

    entropy = table_of is not None
    size = None if entropy else codec.payload_size(parts.size, bits, parts.bucket_size)
    n = parts.numel

    def refused() -> tuple:
        blank = np.zeros(HEADER_SIZE if entropy else size, np.uint8)
        return (*[blank] * parts.copies, np.zeros(n, np.float32), np.True_, np.True_)

    def run(gv: np.ndarray, hv: np.ndarray, at: np.ndarray, *table: np.ndarray) -> tuple:
        out = np.empty(n, np.float32)
        payloads, finite = [], True
        for k, (lo, hi) in enumerate(parts.spans()):
            key = StreamKey(seed, rank, int(at), parts.bucket, k)
            common = dict(bucket_size=parts.bucket_size, norm=parts.norm, numel=parts.size,
                          checksum=parts.checksum, memory_out=out[lo:hi])
            if entropy:
                found = fused_compensated.try_encode_compensated(
                    gv[lo:hi], hv[lo:hi], parts.alpha, parts.beta, table_of(), key=key,
                    coding="entropy", **common)
            else:
                found = fused_compensated.encode_compensated_with(
                    gv[lo:hi], hv[lo:hi], parts.alpha, parts.beta, table[0], table[1],
                    bits=bits, key=key.scalars(), **common)
            if found is None:
                return refused()
            payloads.append(found.payload)
            finite = finite and found.memory_finite
        if parts.norm == "linf" and _l2_overflows(gv, hv, payloads, parts):
            return refused()
        return (*payloads, out, np.bool_(finite), np.False_)

    inputs = [g, h, tf.cast(step, tf.int64)] + ([] if entropy else [levels, header])
    out = tf.numpy_function(run, inputs, [tf.uint8] * parts.copies + [tf.float32, tf.bool, tf.bool],
                            stateful=False, name="aq_compensated_encode")
    for p in out[:parts.copies]:
        p.set_shape([size])
    out[-3].set_shape([n])
    for flag in out[-2:]:
        flag.set_shape([])
    return Compensated(tuple(out[:parts.copies]), *out[parts.copies:])


def _l2_overflows(g: np.ndarray, h: np.ndarray, payloads: list[np.ndarray],
                  parts: Parts) -> bool:
    """Whether a bucket of x = g + α·h has an l2 norm past float32 where the payloads hold L∞
    norms (``PayloadOps._first_bad``'s rule, whatever the norm): the largest |x_i| is the
    largest L∞ norm, so x and its l2 norms are computed only when that may overflow."""
    nb = -(-parts.size // parts.bucket_size)
    peak = max(float(np.max(p[HEADER_SIZE:HEADER_SIZE + NORM_BYTES * nb].view("<f4")))
               for p in payloads)
    if not norm_may_overflow(peak, parts.bucket_size):
        return False
    with np.errstate(over="ignore"):
        x = g + np.float32(parts.alpha) * h
        return first_unsendable(codec.bucket_norms(x, parts.bucket_size, "l2")) is not None


def in_graph(g: tf.Tensor, h: tf.Tensor, levels: tf.Tensor, header: tf.Tensor, keys: list,
             parts: Parts, *, bits: int, compensate: Callable[[tf.Tensor, tf.Tensor], tf.Tensor],
             update: Callable[[tf.Tensor, tf.Tensor, tf.Tensor], tf.Tensor],
             unsendable: Callable[[tf.Tensor, tf.Tensor], tf.Tensor]) -> Compensated:
    """The same with TensorFlow ops (module docstring, "Graph ops"): x = ``compensate(g, h)``
    (g + α·h), each part quantized with the stream ``keys[k]`` and packed as
    ``kernels.encode_with`` packs it, g̃ = n_k·L_code of the same codes (the decoder's product,
    ``kernels._dequantize``), h' = ``update(h, g, g̃)`` (β·h + (g − g̃)); ``unsendable(g, x)``
    is the bool of what cannot travel."""
    B = parts.bucket_size
    x = compensate(g, h)
    padded = tf.pad(x, [[0, parts.copies * parts.size - parts.numel]])
    lookup = kernels._lookup(levels, bits)
    payloads, sent = [], []
    for k in range(parts.copies):
        chunk = padded[k * parts.size:(k + 1) * parts.size]
        codes, norms, n = kernels._quantize_codes(
            chunk, levels, bucket_size=B, norm=parts.norm, uniforms=None, seed=None,
            check=False, extra_deps=[], key=keys[k])
        payload = tf.concat([header, tf.reshape(tf.bitcast(norms, tf.uint8), [-1]),
                             pack_bits(codes, n, bits)], axis=0)
        payloads.append(kernels._seal(payload) if parts.checksum else payload)
        sent.append(per_bucket(tf.math.multiply, tf.gather(lookup, codes), norms, n, min(B, n)))
    g_hat = (sent[0] if len(sent) == 1 else tf.concat(sent, axis=0))[:parts.numel]
    new = update(h, g, g_hat)
    return Compensated(tuple(payloads), new, tf.reduce_all(tf.math.is_finite(new)),
                       unsendable(g, x))


@dataclasses.dataclass(frozen=True)
class MemoryUpdate:
    """A bucket's pending update: its memory variable h and the h' its encode computed."""

    variable: tf.Variable
    new: tf.Tensor
    finite: tf.Tensor


def update_memory(error_memory: Any, resets: tf.Variable, updates: Iterable[MemoryUpdate],
                  any_skipped: tf.Tensor, after: list[tf.Tensor]) -> list[tf.Tensor]:
    """ECQ-SGD's h ← h' = β·h + (g − g̃) for every bucket of ``updates``: after ``after`` (every
    check passed), not at all when a rank sent non-finite markers (``any_skipped``); a
    non-finite h' becomes zeros, counted in ``resets``, when ``error_memory.
    reset_on_nonfinite`` (zeros, not h'·0: ∞·0 is NaN)."""
    ops = []
    with tf.control_dependencies(after):
        for u in updates:
            def commit(u: MemoryUpdate = u) -> tf.Tensor:
                new, deps = u.new, []
                if error_memory.reset_on_nonfinite:
                    new = tf.where(u.finite, new, tf.zeros_like(new))
                    deps.append(resets.assign_add(tf.cast(tf.logical_not(u.finite), tf.int64)))
                deps.append(u.variable.assign(new))
                with tf.control_dependencies(deps):
                    return tf.constant(True)

            ops.append(tf.cond(any_skipped, lambda: tf.constant(False), commit))
    return ops
