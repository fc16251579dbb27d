"""The horovod_aq payload: one uint8 buffer per gradient, and the numpy oracle that writes it.

Its modules (every public name is re-exported here, so ``codec.encode`` etc. keep working):

* ``horovod_aq.codec.format``: the wire format — the layout byte by byte, the header fields and
  offsets, sizes, ``make_header`` / ``parse_header`` / ``check_header``, the non-finite marker,
  the errors and the validators and messages shared by every kernel (``docs/format.md``);
* ``horovod_aq.codec.bits``: LSB-first bit packing of the codes;
* ``horovod_aq.codec.stream``: the counter-based random stream of stochastic rounding
  (Philox4x32-10 keyed by seed, rank, step, bucket and part), part of the format;
* ``horovod_aq.codec.reference``: the numpy reference encoder/decoder and its eight arithmetic
  steps, which ``horovod_aq.torch.kernels`` and ``horovod_aq.tensorflow.kernels`` match byte for
  byte, and ECQ-SGD's send as one operation (``encode_compensated``, docs/dynamic.md §2.6).
* ``horovod_aq.codec.quantize`` and ``horovod_aq.codec.rows``: the oracle's arithmetic steps
  (norms, rounding, dequantizing, uniforms) and its checks and reading of gathered rows, shared
  with the entropy-coded body (``horovod_aq.codec.entropy``).

Per-bucket statistics are not part of the codec: they are ``horovod_aq.levels.stats``
(``bucket_moments``, re-exported here).

This package imports numpy only, never torch or tensorflow.
"""

from __future__ import annotations

from horovod_aq.codec.bits import pack_bits, unpack_bits
from horovod_aq.codec.entropy import encode_entropy
from horovod_aq.codec.entropy_format import (
    empirical_entropy,
    entropy_payload_size,
    payload_length,
)
from horovod_aq.codec.format import (
    CHECKSUM_OFFSET,
    CODES_PER_GROUP,
    FLAG_CHECKSUM,
    FLAG_ENTROPY,
    FLAG_NONFINITE,
    FLAGS_OFFSET,
    FLOAT32_TINY,
    FORMAT_VERSION,
    HEADER_FIELDS,
    HEADER_FORMAT,
    HEADER_SIZE,
    MAGIC,
    MARKER_INDEX_OFFSET,
    MAX_BUCKET_SIZE,
    MAX_NUMEL,
    NORM_BYTES,
    NORM_CODES,
    NORM_NAMES,
    TABLE_ID_SLICE,
    Header,
    NonFiniteGradientError,
    PayloadError,
    as_bytes,
    as_table,
    bad_code_message,
    bad_norm_message,
    check_bits,
    check_bool,
    check_bucket_size,
    check_checksum,
    check_finite,
    check_header,
    check_int,
    check_norm,
    check_norms,
    check_payload_norms,
    check_size,
    float32_levels,
    make_header,
    non_finite_message,
    nonfinite_payload,
    nonfinite_rows,
    norm_overflow_message,
    num_buckets,
    packed_size,
    parse_header,
    payload_checksum,
    payload_size,
    seal_checksum,
)
from horovod_aq.codec.quantize import (
    bucket_norms,
    draw_uniforms,
    pairwise_sum_rows,
    quantize_codes,
    rounding_variance,
)
from horovod_aq.codec.reference import (
    Compensated,
    decode,
    decode_average,
    encode,
    encode_compensated,
    memory_sum_of_squares,
    quantize,
    variable_rows,
)
from horovod_aq.codec.rows import check_checksums, check_data, check_rows, parse_rows
from horovod_aq.codec.stream import StreamKey, philox4x32, seed_for_rank, stream_uniforms
from horovod_aq.levels.stats import bucket_moments

__all__ = [
    "CHECKSUM_OFFSET", "CODES_PER_GROUP", "Compensated", "FLAGS_OFFSET", "FLAG_CHECKSUM",
    "FLAG_ENTROPY", "FLAG_NONFINITE",
    "FLOAT32_TINY", "FORMAT_VERSION", "HEADER_FIELDS", "HEADER_FORMAT", "HEADER_SIZE", "Header",
    "MAGIC", "MARKER_INDEX_OFFSET", "MAX_BUCKET_SIZE", "MAX_NUMEL", "NORM_BYTES", "NORM_CODES",
    "NORM_NAMES", "NonFiniteGradientError", "PayloadError", "StreamKey", "TABLE_ID_SLICE",
    "as_bytes", "as_table", "bad_code_message", "bad_norm_message", "bucket_moments",
    "bucket_norms", "check_bits", "check_bool", "check_bucket_size",
    "check_checksum", "check_checksums", "check_data", "check_finite", "check_header", "check_int",
    "check_norm", "check_norms", "check_payload_norms", "check_rows", "check_size", "decode",
    "decode_average", "draw_uniforms", "empirical_entropy", "encode", "encode_compensated",
    "encode_entropy",
    "entropy_payload_size", "float32_levels", "make_header", "memory_sum_of_squares",
    "non_finite_message", "nonfinite_payload", "nonfinite_rows", "norm_overflow_message",
    "num_buckets", "pack_bits", "packed_size", "pairwise_sum_rows", "parse_header", "parse_rows",
    "payload_checksum", "payload_length", "payload_size", "philox4x32", "quantize",
    "quantize_codes",
    "rounding_variance", "seal_checksum", "seed_for_rank", "stream_uniforms", "unpack_bits",
    "variable_rows",
]
