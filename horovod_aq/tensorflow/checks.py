"""Graph assertions of the TensorFlow kernels (``horovod_aq.tensorflow.kernels``).

Inside ``tf.function`` invalid input cannot raise the numpy codec's ``ValueError`` /
``PayloadError`` on the host; these checks fail instead (``tf.errors.InvalidArgumentError``),
with messages that name the field, the rank and both values. Header fields are located by
``horovod_aq.codec.format.HEADER_FIELDS``; the decoder's header check tests every byte in one
graph test and names what differs on the host (one ``tf.cond``, not one assertion per field).
:func:`translate_error` turns a failed check of the packed exchange back into the eager API's
exception.

The data of a payload (the CRC-32 of a checksummed row, the norms, the codes) is checked by
:func:`checksum_check` and :func:`data_check`: the cheap test runs in the graph, and only a
failing (or checksummed) row goes to the host, where the numpy oracle's own checks raise its
``PayloadError`` and message — directly when executing eagerly, inside a
``tf.errors.InvalidArgumentError`` ("PayloadError: …", see :func:`translate_error`) in a graph.
"""

from __future__ import annotations

import re
import struct

import numpy as np
import tensorflow as tf

from horovod_aq import codec
from horovod_aq.codec import (
    FLAG_CHECKSUM,
    FLAG_ENTROPY,
    FLAGS_OFFSET,
    HEADER_SIZE,
    NonFiniteGradientError,
    PayloadError,
)
from horovod_aq.codec.rows import tag_rank
from horovod_aq.packed.protocol import ConfigMismatchError
from horovod_aq.packed.receive import JoinedRankError

__all__ = ["checksum_check", "data_check", "decoder_header_check", "encoder_header_check",
           "field_value", "translate_error", "values_check"]


def values_check(flat: tf.Tensor, norms: tf.Tensor, n: int) -> list:
    """Graph assertions: every element finite, every norm finite. The diagnostics (count, first
    index) are computed only on the failing branch."""
    if n == 0:
        return []

    def fail_values():
        bad = tf.logical_not(tf.math.is_finite(flat))
        count = tf.reduce_sum(tf.cast(bad, tf.int64))
        first = tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int64)
        with tf.control_dependencies([tf.debugging.Assert(
                False, ["cannot quantize a gradient with non-finite values:", count, "of", n,
                        "elements are NaN or ±Inf in float32, first at flat index", first,
                        "; check the loss scale or clip the gradients before compressing"])]):
            return tf.constant(True)

    def fail_norms():
        first = tf.argmax(tf.cast(tf.logical_not(tf.math.is_finite(norms)), tf.int32))
        with tf.control_dependencies([tf.debugging.Assert(
                False, ["bucket", first, ("has a norm that overflows float32; scale the "
                                          "gradient down before compressing")])]):
            return tf.constant(True)

    values_ok = tf.cond(tf.reduce_all(tf.math.is_finite(flat)), lambda: tf.constant(True),
                        fail_values)
    with tf.control_dependencies([values_ok]):
        norms_ok = tf.cond(tf.reduce_all(tf.math.is_finite(norms)), lambda: tf.constant(True),
                           fail_norms)
    return [values_ok, norms_ok]


def field_value(raw: tf.Tensor, width: int) -> tf.Tensor:
    """The integer value of one little-endian header field given as ``width`` bytes."""
    raw = tf.reshape(raw, [width])
    if width == 1:
        return tf.cast(raw[0], tf.int64)
    return tf.bitcast(raw, {2: tf.uint16, 4: tf.uint32, 8: tf.uint64}[width])


def encoder_header_check(header_u8: tf.Tensor, levels: tf.Tensor, n: int, bits: int,
                         bucket_size: int, norm: str) -> list:
    """Assert that the header tensor describes this encode and this levels tensor."""
    if header_u8.shape.rank != 1 or header_u8.shape[0] not in (None, HEADER_SIZE):
        raise ValueError(f"header_u8 must be {HEADER_SIZE} uint8 bytes, "
                         f"got shape {header_u8.shape}")
    want = np.frombuffer(struct.pack(codec.HEADER_FORMAT, codec.MAGIC, codec.FORMAT_VERSION, bits,
                                     codec.NORM_CODES[norm], 0, 0, 0, 0, bucket_size, n, 0),
                         dtype=np.uint8)
    checks = []
    for name in ("magic", "format version", "bits", "norm", "bucket size", "numel"):
        field = codec.HEADER_FIELDS[name]
        checks.append(tf.debugging.assert_equal(
            header_u8[field], tf.constant(want[field]),
            message=f"encode_with: header_u8 has another {name} than this call "
                    f"(numel={n}, bits={bits}, bucket_size={bucket_size}, norm={norm}); "
                    "rebuild it with header_tensor()"))
    num_levels = tf.size(levels, out_type=tf.int64)
    checks.append(tf.debugging.assert_equal(
        field_value(header_u8[codec.HEADER_FIELDS["number of levels"]], 2),
        tf.cast(num_levels, tf.uint16),
        message="encode_with: header_u8 and levels_f32 disagree on the number of levels; "
                "update both at a refit"))
    checks.append(tf.debugging.Assert(
        (num_levels >= 2) & (num_levels <= 1 << bits),
        [f"encode_with: levels_f32 must hold 2..{1 << bits} levels for bits={bits}, got",
         num_levels]))
    return checks


def _advice(name: str) -> str:
    """What a differing header field usually means."""
    if name == "magic":
        return "not a horovod_aq payload (wrong buffer or corrupted data)"
    if name == "format version":
        return "ranks run different horovod_aq versions"
    if name.startswith("level-table"):
        return "ranks disagree on the level table"
    return "ranks disagree on the tensor or the compressor settings"


def _header_keep(entropy: bool) -> np.ndarray:
    """[32] uint8: the header bits a row must share with the expected header. A checksummed
    row (``FLAG_CHECKSUM``) and, on the entropy-coded wire, an entropy-coded one
    (``FLAG_ENTROPY``) differ from it in those flags."""
    keep = np.full(HEADER_SIZE, 0xFF, np.uint8)
    keep[FLAGS_OFFSET] ^= FLAG_CHECKSUM | (FLAG_ENTROPY if entropy else 0)
    return keep


def _shown(name: str, raw: np.ndarray) -> str:
    """A header field's value as the messages show it (little-endian; the magic as bytes)."""
    raw = bytes(np.asarray(raw, np.uint8))
    return repr(raw) if name == "magic" else str(int.from_bytes(raw, "little"))


def _header_refusal(headers: np.ndarray, expected: np.ndarray, entropy: bool) -> np.ndarray:
    """The ``PayloadError`` of the first field, in header order, where a row of ``headers``
    [P, 32] differs from ``expected``: it names the first rank that differs and both values."""
    keep = _header_keep(entropy)
    got, want = headers & keep, expected & keep
    checksummed = (headers[:, FLAGS_OFFSET] & FLAG_CHECKSUM) > 0
    for name, field in codec.HEADER_FIELDS.items():
        same = (got[:, field] == want[field]).all(axis=1)
        if name == "reserved":   # a checksummed row's CRC-32 (the data check verifies it)
            same |= checksummed
        if not same.all():
            rank = int(np.argmin(same))
            raise PayloadError(f"payload {name} differs: the payload of rank {rank} has "
                               f"{_shown(name, got[rank, field])} but this rank expects "
                               f"{_shown(name, want[field])}; {_advice(name)}")
    raise PayloadError("horovod_aq.tensorflow: the graph check refused a header that the host "
                       "accepts (please report this bug)")


def decoder_header_check(headers: tf.Tensor, expected_u8: tf.Tensor, *,
                         entropy: bool = False) -> list:
    """Check that every row of ``headers`` [P, 32] equals the expected header: one graph test
    of every byte at once; a differing header goes to the host, where ``PayloadError`` names
    the first differing field, the first rank that differs and both values (TensorFlow wraps
    it in ``InvalidArgumentError``: :func:`translate_error`). ``entropy``: rows of the
    entropy-coded wire, which may also carry ``FLAG_ENTROPY``."""
    if expected_u8.shape.rank != 1 or expected_u8.shape[0] not in (None, HEADER_SIZE):
        raise ValueError(f"expected_header_u8 must be {HEADER_SIZE} uint8 bytes, got shape "
                         f"{expected_u8.shape}")
    keep = tf.constant(_header_keep(entropy))
    differ = tf.not_equal(tf.bitwise.bitwise_and(headers, keep),
                          tf.bitwise.bitwise_and(expected_u8, keep)[None])
    reserved = np.zeros(HEADER_SIZE, bool)
    reserved[codec.HEADER_FIELDS["reserved"]] = True
    checksummed = tf.bitwise.bitwise_and(headers[:, FLAGS_OFFSET], FLAG_CHECKSUM) > 0
    differ = differ & ~(checksummed[:, None] & tf.constant(reserved)[None])
    ok = tf.logical_not(tf.reduce_any(differ))

    def refuse():
        out = tf.numpy_function(lambda h, e: _header_refusal(h, e, entropy),
                                [headers, expected_u8], tf.bool, stateful=False,
                                name="aq_refuse_header")
        return tf.reshape(out, [])

    return [tf.cond(ok, lambda: tf.constant(True), refuse)]


def _host_checksums(rows: np.ndarray, average: bool) -> np.ndarray:
    """Verify the CRC-32 of the checksummed rows (``codec.check_checksums``; ``average``: the
    error names the rank, as ``codec.decode_average``)."""
    headers = [codec.parse_header(row) for row in rows]
    if average:
        codec.check_checksums(rows, headers)
    else:
        codec.check_checksum(rows[0], headers[0])
    return np.bool_(True)


def checksum_check(rows: tf.Tensor, average: bool) -> list:
    """Graph check of the rows [P, size] whose header carries ``FLAG_CHECKSUM``: their CRC-32
    is verified on the host (``tf.numpy_function``, only when a row is flagged)."""
    flagged = tf.reduce_any(tf.bitwise.bitwise_and(rows[:, FLAGS_OFFSET], FLAG_CHECKSUM) > 0)

    def verify():
        ok = tf.numpy_function(lambda r: _host_checksums(r, average), [rows], tf.bool,
                               stateful=False, name="aq_verify_checksum")
        return tf.reshape(ok, [])

    return [tf.cond(flagged, verify, lambda: tf.constant(True))]


def _host_refusal(rows: np.ndarray, levels: np.ndarray, average: bool) -> np.ndarray:
    """The oracle's data checks of every row (``codec.check_data``), which raise its error."""
    for rank, row in enumerate(rows):
        try:
            codec.check_data(row, codec.parse_header(row), int(np.asarray(levels).size))
        except PayloadError as err:
            if average:
                tag_rank(err, rank)
            raise
    raise PayloadError("horovod_aq.tensorflow: the graph check refused a payload that the numpy "
                       "codec accepts (please report this bug)")


def data_check(rows: tf.Tensor, levels: tf.Tensor, ok: tf.Tensor, average: bool) -> list:
    """Graph check: ``ok`` (every norm finite and ≥ 0, every code < N, computed in the graph);
    else the rows go to the host, where the oracle's checks raise its ``PayloadError``."""
    def refuse():
        out = tf.numpy_function(lambda r, lv: _host_refusal(r, lv, average), [rows, levels],
                                tf.bool, stateful=False, name="aq_refuse_payload")
        return tf.reshape(out, [])

    return [tf.cond(ok, lambda: tf.constant(True), refuse)]


def translate_error(err: tf.errors.OpError) -> Exception:
    """A graph assertion of the exchange as the eager API's exception (PayloadError/ValueError).

    Also a ``PayloadError``, ``NonFiniteGradientError`` or ``ConfigMismatchError`` raised on the
    host inside the graph (``tf.numpy_function``: the data checks, the fused decoder, the receive
    decision of ``horovod_aq.packed.receive``, the agreement on what trains of
    ``horovod_aq.packed.trainable``, which also raises ``JoinedRankError``), whose message
    TensorFlow wraps as "PayloadError: …"."""
    raised = re.search(r"ConfigMismatchError: (.*?)\n(?:Traceback|\n)", err.message, re.S)
    if raised is not None:   # several lines, one per rank
        return ConfigMismatchError(raised.group(1).strip())
    raised = re.search(r"PayloadError: ([^\n]*)", err.message)
    if raised is not None:
        out = PayloadError(raised.group(1).strip())
        rank = re.match(r"rank (\d+): ", str(out))
        if rank is not None:
            out.rank = int(rank.group(1))
        return out
    raised = re.search(r"NonFiniteGradientError: ([^\n]*)", err.message)
    if raised is not None:
        return NonFiniteGradientError(raised.group(1).strip())
    raised = re.search(r"JoinedRankError: ([^\n]*)", err.message)
    if raised is not None:
        return JoinedRankError(raised.group(1).strip())
    found = re.search(r"assertion failed: (.*)", err.message)
    if found is None:
        return err
    parts = re.findall(r"\[([^\[\]]*)\]", found.group(1))
    # tf.debugging.Assert prints string tensors with their quotes escaped
    text = " ".join(p.strip() for p in parts).replace(" ;", ";").replace("\\'", "'")
    if "payload" in text and "differs" in text:
        return PayloadError(f"horovod_aq: {text}")
    return err
