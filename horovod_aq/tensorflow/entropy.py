"""Graph ops of the entropy-coded, variable-length wire (docs/format.md §12, docs/protocol.md
§5.4) for the TensorFlow packed exchange: encode, delimit, decode-average of variable rows.

TensorFlow has no rANS coder, so every op here is a host call (``tf.numpy_function``) of the
compiled CPU kernels that the PyTorch engines use: ``codec.fused_entropy.encode_entropy`` (byte
for byte ``codec.encode_entropy``), ``codec.fused.decode_average`` / ``decode`` of rows of any
lengths and kinds (bitwise ``codec.decode_average`` / ``decode``), and
``packed.delimit.payload_sizes``, which reads where each rank's payload ends in Horovod's
allgather output (no extra collective). A payload's size is known only when the graph runs, so
every payload has the static shape ``[None]``: sizes vary per step without a retrace.

The host calls read the code width's current :class:`~horovod_aq.levels.table.LevelTable`
through ``table_of()`` (``WidthState.source.table``). The graph's table variables mirror that
table (its listener assigns them), and the exchange checks every received header against the
variables before decoding, so a disagreement fails loudly instead of decoding wrong values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from horovod_aq.codec import HEADER_SIZE
from horovod_aq.codec.stream import StreamKey
from horovod_aq.levels.table import LevelTable
from horovod_aq.packed.delimit import payload_sizes

__all__ = ["VariableRows", "decode_average", "decode_rows", "delimited", "encode_entropy",
           "received", "sizes_of"]

TableOf = Callable[[], LevelTable]


class VariableRows(NamedTuple):
    """P payloads of any sizes as a collective delivered them: back to back in ``flat`` (uint8,
    [None]), their ``sizes`` in rank order (int64, [P]) and their 32 header bytes (``heads``,
    uint8 [P, 32], gathered in-graph: the exchange's checks read only these)."""

    flat: tf.Tensor
    sizes: tf.Tensor
    heads: tf.Tensor


def encode_entropy(x: tf.Tensor, table_of: TableOf, *, seed: int, rank: int, step: tf.Tensor,
                   bucket: int, part: int, bucket_size: int, norm: str,
                   checksum: bool = False) -> tf.Tensor:
    """The payload of ``codec.encode_entropy(x, table_of(), key=StreamKey(seed, rank, step,
    bucket, part))`` (uint8, shape [None]: the smaller of the entropy-coded and the fixed-width
    payload); ``step`` is read in-graph (the state variable), the rest is fixed at trace time."""
    from horovod_aq.codec import fused_entropy

    def run(values: np.ndarray, at: np.ndarray) -> np.ndarray:
        key = StreamKey(seed, rank, int(at), bucket, part)
        return fused_entropy.encode_entropy(values, table_of(), bucket_size=bucket_size,
                                            norm=norm, key=key, checksum=checksum)

    out = tf.numpy_function(run, [tf.reshape(tf.cast(x, tf.float32), [-1]),
                                  tf.cast(step, tf.int64)],
                            tf.uint8, stateful=False, name="aq_entropy_encode")
    out.set_shape([None])
    return out


def _heads(flat: tf.Tensor, sizes: tf.Tensor) -> tf.Tensor:
    """[P, 32]: the first header bytes of each row (every row holds at least a header:
    ``payload_sizes`` parsed it, or the decoder's checks refuse it)."""
    starts = tf.cumsum(sizes, exclusive=True)
    index = starts[:, None] + tf.range(HEADER_SIZE, dtype=tf.int64)[None, :]
    return tf.gather(flat, tf.minimum(index, tf.maximum(tf.size(flat, out_type=tf.int64) - 1, 0)))


def delimited(gathered: tf.Tensor, ranks: int, trailer: int = 0) -> VariableRows:
    """The rows of Horovod's allgather output ``gathered`` (P self-delimiting payloads back to
    back): sizes read from their own headers on the host (``packed.delimit.payload_sizes``; the
    same on every rank, or the same ``PayloadError`` on every rank)."""
    def sizes_of(flat: np.ndarray) -> np.ndarray:
        return np.asarray(payload_sizes(flat, ranks, trailer), dtype=np.int64)

    flat = tf.reshape(gathered, [-1])
    sizes = tf.numpy_function(sizes_of, [flat], tf.int64, stateful=False, name="aq_delimit")
    sizes.set_shape([ranks])
    return VariableRows(flat, sizes, _heads(flat, sizes))


def received(flat: tf.Tensor, splits: tf.Tensor, ranks: int) -> VariableRows:
    """The rows of Horovod's alltoall output with the received ``splits`` it returned."""
    sizes = tf.reshape(tf.cast(splits, tf.int64), [ranks])
    flat = tf.reshape(flat, [-1])
    return VariableRows(flat, sizes, _heads(flat, sizes))


def _split(flat: np.ndarray, sizes: np.ndarray) -> list[np.ndarray]:
    return np.split(np.asarray(flat, np.uint8), np.cumsum(sizes)[:-1].astype(np.int64))


def decode_average(rows: VariableRows, table_of: TableOf, *, numel: int, bucket_size: int,
                   norm: str) -> tf.Tensor:
    """float32 [numel]: bitwise ``codec.decode_average`` of the P rows (the compiled decoder of
    variable rows; its checks raise the oracle's ``PayloadError``, "rank r: …")."""
    from horovod_aq.codec import fused

    def run(flat: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        return fused.decode_average(_split(flat, sizes), table_of(), numel=numel,
                                    bucket_size=bucket_size, norm=norm)

    out = tf.numpy_function(run, [rows.flat, rows.sizes], tf.float32, stateful=False,
                            name="aq_entropy_decode_average")
    out.set_shape([numel])
    return out


def decode_rows(rows: VariableRows | list[tf.Tensor], table_of: TableOf, *, numel: int,
                bucket_size: int, norm: str) -> tf.Tensor:
    """float32 [R·numel]: every row decoded (``codec.decode``, either kind), concatenated.
    ``rows``: received rows, or a list of 1-D payloads (this rank's own)."""
    from horovod_aq.codec import fused

    if isinstance(rows, VariableRows):
        flat, sizes, count = rows.flat, rows.sizes, int(rows.sizes.shape[0])
    else:
        flat = tf.concat(list(rows), axis=0)
        sizes = tf.stack([tf.size(r, out_type=tf.int64) for r in rows])
        count = len(rows)

    def run(data: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        table = table_of()
        return np.concatenate([fused.decode(row, table, numel=numel, bucket_size=bucket_size,
                                            norm=norm) for row in _split(data, lengths)])

    out = tf.numpy_function(run, [flat, sizes], tf.float32, stateful=False,
                            name="aq_entropy_decode_rows")
    out.set_shape([count * numel])
    return out


def sizes_of(payloads: list[Any]) -> tf.Tensor:
    """int64 [len(payloads)]: the byte sizes of 1-D payload tensors (the alltoall's splits)."""
    return tf.stack([tf.size(p, out_type=tf.int64) for p in payloads])
