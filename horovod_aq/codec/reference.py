"""The numpy reference encoder/decoder (the oracle) of the payload in ``horovod_aq.codec.format``.

``horovod_aq.torch.kernels`` and ``horovod_aq.tensorflow.kernels`` produce the same bytes for the
same uniforms; this module defines every arithmetic step they follow (``docs/format.md``).

Arithmetic (bit-identical in numpy, PyTorch and TensorFlow)
-----------------------------------------------------------
1. x is flattened and cast to float32 (fp16 / bf16 / fp64 accepted; the cast rounds to nearest).
   Every element must be finite.
2. Bucket k holds x[kB : (k+1)B]; the last bucket may be partial (B' < B) and is quantized with
   its own norm (§1 tail policy (a): no zeros, no silent full precision).
   Its norm n_k is

   * l2:   float32( sqrt( S_k ) ), S_k = Σ_i float64(x_i)² accumulated in float64 in the
     canonical *pairwise order* below, sqrt in float64, one rounding to float32;
   * linf: max_i |x_i| (exact in float32).

   Canonical pairwise order: zero-pad the bucket's squares q_0, …, q_{L−1} to a power of two
   W ≥ L and halve repeatedly, q_k ← q_k + q_{k+W/2} for k < W/2, until one value is left.
   Every float64 square of a float32 is exact and adding a zero is exact, so the result does not
   depend on which power of two W ≥ L is used; a fixed order makes the float64 sum, and hence the
   float32 norm, identical in every framework (a library's ``sum`` has no specified order).
   A norm that overflows float32 (finite values, ‖v‖ > 3.4e38) is rejected.
3. r_i = clip(x_i / n_k, −1, 1) in float32 (IEEE division); r_i = 0 when n_k = 0.
4. With L the levels rounded to float32, values below the float32 normal range (|ℓ| < 2^−126)
   flushed to 0 (``float32_levels``; N values), and D_j = L_{j+1} − L_j in float32:
   j_i = clip(searchsorted(L, r_i, side="right") − 1, 0, N − 2),
   ξ_i = (r_i − L_{j_i}) / D_{j_i} in float32, and code_i = j_i + [u_i < ξ_i] with u_i a float32
   uniform in [0, 1). Since P(code = j+1) = ξ, E[L_code] = r (unbiased, §3), and the
   per-coordinate variance is n²·(L_{j+1} − r)(r − L_j) (``rounding_variance``).
5. Codes are packed as in the format (``horovod_aq.codec.bits``).
6. Decoding: x̂_i = n_k · L_{code_i} in float32. A zero bucket decodes to zeros (±0.0).
7. Averaging P gathered payloads (rows in rank order): each decoded row is divided by P first
   (float32 division), then acc = x̂⁽⁰⁾/P and acc = acc + x̂⁽ᵖ⁾/P for p = 1, …, P−1 in float32,
   *sequentially* (a tree sum over ranks has no specified order), then a cast to the requested
   dtype. Dividing before summing keeps the average finite whenever every row is (P rows of
   ~3e38 would overflow a float32 sum); for P a power of two it is bitwise the sum divided by P
   (outside the subnormal range). Every rank and every framework obtains the same bits.
8. Uniforms: u_i is coordinate i of the format's counter-based stream of a
   :class:`~horovod_aq.codec.stream.StreamKey` (seed, rank, step, bucket, part; Philox4x32-10,
   ``horovod_aq.codec.stream``): pass ``key=`` and every kernel produces the same bytes. Explicit
   ``uniforms`` (n float32 values in [0, 1)) override it; ``seed`` draws numpy's own
   ``default_rng(seed).random(n, dtype=np.float32)`` instead (tests and tools).

Subnormals. TensorFlow runs its CPU kernels with denormals flushed to zero (FTZ/DAZ), numpy and
PyTorch do not. The format therefore flushes subnormal *levels* (exponential tables reach 2^−127
at 8 bits, and every exact zero of a gradient would round against them), and rejects tables whose
float32 gaps are subnormal. Subnormal *data* is not flushed (that would cost a pass over every
gradient): for elements with |x| < 1.2e-38, or whose normalized or decoded values underflow,
TensorFlow's bytes may differ from numpy's and PyTorch's in those coordinates.

Where the steps are: 1–4, 6 and 8 in ``horovod_aq.codec.quantize``, 5 in
``horovod_aq.codec.bits``, the row checks and the reading of one row in
``horovod_aq.codec.rows``; this module writes and reads whole payloads (``encode``, ``decode``,
``decode_average``, ``quantize``) and hands entropy-coded ones to ``horovod_aq.codec.entropy``.

Error feedback. ``encode_compensated`` defines ECQ-SGD's send as one operation (compensate,
encode, memory update; docs/dynamic.md §2.6), which the fused kernel
(``horovod_aq.codec.fused_compensated``) matches bit for bit.

This module imports numpy only, never torch or tensorflow.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from horovod_aq.codec.bits import pack_bits
from horovod_aq.codec.format import (
    FLAG_ENTROPY,
    FLAGS_OFFSET,
    PayloadError,
    as_bytes,
    as_table,
    check_bool,
    check_checksum,
    check_header,
    check_size,
    make_header,
    parse_header,
    seal_checksum,
)
from horovod_aq.codec.quantize import (
    _bucket_matrix,
    dequantize,
    normalized,
    pairwise_sum_rows,
    prepare,
    round_codes,
)
from horovod_aq.codec.rows import (
    check_checksums,
    check_rows,
    parse_rows,
    read_fixed_payload,
    tag_rank,
)
from horovod_aq.codec.stream import StreamKey
from horovod_aq.levels.table import LevelTable

__all__ = ["Compensated", "decode", "decode_average", "encode", "encode_compensated",
           "memory_sum_of_squares", "quantize", "variable_rows"]


# ---------------------------------------------------------------------------- encode / decode


def encode(
    x: Any,
    levels: LevelTable | Any,
    *,
    bucket_size: int,
    norm: str = "l2",
    seed: Any = None,
    uniforms: Any = None,
    key: StreamKey | None = None,
    checksum: bool = False,
) -> np.ndarray:
    """Quantize and pack x into one uint8 payload of ``payload_size(x.size, bits, bucket_size)``.

    Args:
        x: gradient of any shape, floating point (cast to float32), finite.
        levels: a ``LevelTable``, or an array of levels (taken as table version 0).
        bucket_size: B, coordinates per bucket (≥ 1).
        norm: ``"l2"`` or ``"linf"``.
        seed: int or ``np.random.Generator`` for numpy's own uniforms (None: fresh entropy).
        uniforms: n float32 values in [0, 1); overrides ``key`` and ``seed``.
        key: the format's random stream (:class:`~horovod_aq.codec.stream.StreamKey`): every
            kernel given the same key produces the same bytes.
        checksum: write ``FLAG_CHECKSUM`` and the payload's CRC-32 (``codec.payload_checksum``)
            into the header; every decoder then verifies it. Off by default
            (``docs/format.md`` §11).
    """
    checksum = check_bool("checksum", checksum)
    table, bucket_size, flat, norms, u = prepare(x, levels, bucket_size, norm, seed, uniforms,
                                                 key)
    codes = round_codes(normalized(flat, norms, bucket_size), table, u)
    payload = np.concatenate(
        [
            np.frombuffer(make_header(flat.size, table, bucket_size, norm), dtype=np.uint8),
            norms.astype("<f4").view(np.uint8),
            pack_bits(codes, table.bits),
        ]
    )
    return seal_checksum(payload) if checksum else payload


def decode(
    payload: Any,
    levels: LevelTable | Any,
    *,
    dtype: Any = np.float32,
    numel: int | None = None,
    bucket_size: int | None = None,
    norm: str | None = None,
) -> np.ndarray:
    """Decode one payload into a flat array of ``dtype`` (reshape it yourself).

    The header must match ``levels`` (version and hash) and, when given, ``numel``,
    ``bucket_size`` and ``norm``; the size must match the header exactly; a checksummed
    payload must match its CRC-32; every norm must be finite and ≥ 0 and every code < N.
    Memory: O(size + n), whatever bucket size the header states.
    """
    table = as_table(levels)
    data = as_bytes(payload)
    header = parse_header(data)
    check_header(header, table, numel=numel, bucket_size=bucket_size, norm=norm)
    if header.entropy:  # docs/format.md §12
        from horovod_aq.codec.entropy import read_payload

        return read_payload(data, header, table).astype(dtype, copy=False)
    check_size(header, data.size)
    check_checksum(data, header)
    return read_fixed_payload(data, header, table).astype(dtype, copy=False)


def variable_rows(payloads: Any) -> bool:
    """Whether gathered payloads need the row-by-row decoder of variable-length payloads: a
    list of rows of different lengths, or rows with an entropy-coded body (``FLAG_ENTROPY``)."""
    if isinstance(payloads, (list, tuple)):
        rows = [as_bytes(p) for p in payloads]
        return bool(rows) and (len({r.size for r in rows}) > 1 or any(
            r.size > FLAGS_OFFSET and r[FLAGS_OFFSET] & FLAG_ENTROPY for r in rows))
    rows = np.asarray(payloads)
    return (rows.ndim == 2 and rows.dtype == np.uint8 and rows.shape[1] > FLAGS_OFFSET
            and bool(np.any(rows[:, FLAGS_OFFSET] & FLAG_ENTROPY)))


def decode_average(
    payloads: Any,
    levels: LevelTable | Any,
    *,
    dtype: Any = np.float32,
    numel: int | None = None,
    bucket_size: int | None = None,
    norm: str | None = None,
) -> np.ndarray:
    """Average of the decoded rows of a gathered ``[P, size]`` uint8 buffer (step 7).

    Rows are divided by P and summed sequentially in rank order in float32, so the result is
    bitwise the same on every rank and in every framework. All rows must carry the same header
    settings; a list of 1-D payloads is accepted too. Checks, in this order: every header
    (``check_rows``), every checksum (``check_checksums``), then each row's data
    (``check_data``); every error names the rank ("rank r: …", attribute ``rank``).
    """
    table = as_table(levels)
    if variable_rows(payloads):  # entropy-coded or different lengths: docs/format.md §12
        from horovod_aq.codec.entropy import decode_rows_average

        return decode_rows_average(payloads, table, dtype=dtype, numel=numel,
                                   bucket_size=bucket_size, norm=norm)
    if isinstance(payloads, (list, tuple)):
        payloads = np.stack([as_bytes(p) for p in payloads]) if payloads else np.zeros((0, 0))
    rows = np.asarray(payloads)
    if rows.ndim != 2 or rows.dtype != np.uint8 or rows.shape[0] == 0:
        raise PayloadError(
            f"gathered payloads must be a non-empty [P, size] uint8 array, got dtype {rows.dtype} "
            f"and shape {rows.shape}"
        )
    headers = parse_rows(rows)
    check_rows(headers, table, rows.shape[1], numel=numel, bucket_size=bucket_size, norm=norm)
    check_checksums(rows, headers)
    acc = None
    world = np.float32(rows.shape[0])
    for rank in range(rows.shape[0]):
        try:
            values = read_fixed_payload(rows[rank], headers[rank], table)
        except PayloadError as err:
            tag_rank(err, rank)
            raise
        values = values / world   # before the sum: no float32 overflow (step 7)
        acc = values if acc is None else acc + values
    return acc.astype(dtype, copy=False)


def quantize(
    x: Any,
    levels: LevelTable | Any,
    *,
    bucket_size: int,
    norm: str = "l2",
    seed: Any = None,
    uniforms: Any = None,
    dtype: Any = np.float32,
    key: StreamKey | None = None,
) -> np.ndarray:
    """``decode(encode(x))`` without packing: the flat quantized values, bitwise the same."""
    table, bucket_size, flat, norms, u = prepare(x, levels, bucket_size, norm, seed, uniforms,
                                                 key)
    codes = round_codes(normalized(flat, norms, bucket_size), table, u)
    return dequantize(codes, norms, table, bucket_size).astype(dtype, copy=False)


# ---------------------------------------------------------------------------- error feedback


class Compensated(NamedTuple):
    """What ECQ-SGD's send of one bucket produces (``encode_compensated``)."""

    #: The uint8 payload of x = g + α·h (fixed-width, or as ``codec.encode_entropy`` writes it).
    payload: np.ndarray
    #: h' = β·h + (g − g̃), float32, one value per coordinate of g.
    memory: np.ndarray
    #: Whether every value of ``memory`` is finite (g − g̃ may overflow near float32's limit).
    memory_finite: bool
    #: ‖h'‖² as :func:`memory_sum_of_squares` adds it (telemetry's ‖h‖, docs/dynamic.md §2.6).
    memory_sum_of_squares: float


def encode_compensated(
    g: Any,
    h: Any,
    alpha: float,
    beta: float,
    levels: LevelTable | Any,
    *,
    bucket_size: int,
    norm: str = "l2",
    numel: int | None = None,
    uniforms: Any = None,
    key: StreamKey | None = None,
    checksum: bool = False,
    coding: str = "fixed",
) -> Compensated:
    """ECQ-SGD's send of one bucket as one operation (docs/dynamic.md §2.1, §2.6):

        x  = g + α·h                x_i  = fl(g_i + fl(α·h_i))
        payload = encode(x)         x zero-padded to ``numel`` coordinates
        g̃  = decode(payload)        g̃_i  = n_k·L_{code_i}           (step 6)
        h' = β·h + (g − g̃)          h'_i = fl(fl(β·h_i) + fl(g_i − g̃_i))

    in float32 with α, β rounded to float32 — the operations, in this order, that
    ``ErrorMemory.compensate_value`` (``x + alpha * h``) and ``ErrorMemory.updated_memory``
    (``beta * h + (x - x_hat)``) run on float32 torch tensors, so h' is bitwise the unfused
    update's. ``h`` None is the memory's first use: x = g and h' = g − g̃ (no β·0 term, as
    ``ErrorMemory.update``; a −0.0 of g − g̃ stays −0.0).

    Args:
        g: the bucket's raw gradient (flattened, cast to float32); h: its memory (same size,
            float32) or None.
        numel: coordinates of the payload, ≥ g.size (default g.size): a two-phase chunk
            (docs/protocol.md §5.2) pads g and h with zeros, x_i = +0.0 there; h' covers g only.
        uniforms, key: the stream of ``encode`` (n = ``numel`` uniforms).
        coding: "fixed" (``encode``) or "entropy" (``codec.encode_entropy``: the same codes,
            so the same g̃ and h').

    Raises the errors of ``encode`` for an x that cannot be encoded (NaN/±Inf, a bucket norm
    beyond float32).
    """
    if coding not in ("fixed", "entropy"):
        raise ValueError(f"coding must be 'fixed' or 'entropy', got {coding!r}")
    g = np.asarray(g)
    with np.errstate(over="ignore"):
        g = g.reshape(-1).astype(np.float32, copy=False)
    n = g.size
    numel = n if numel is None else int(numel)
    if numel < n:
        raise ValueError(f"numel must be at least the {n} coordinates of g, got {numel}")
    a, b = np.float32(alpha), np.float32(beta)
    x = np.zeros(numel, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        if h is None:
            x[:n] = g
        else:
            h = np.asarray(h, dtype=np.float32).reshape(-1)
            if h.size != n:
                raise ValueError(f"h must have the {n} coordinates of g, got {h.size}")
            x[:n] = g + a * h
    if coding == "entropy":
        from horovod_aq.codec.entropy import encode_entropy

        payload = encode_entropy(x, levels, bucket_size=bucket_size, norm=norm,
                                 uniforms=uniforms, key=key, checksum=checksum)
    else:
        payload = encode(x, levels, bucket_size=bucket_size, norm=norm, uniforms=uniforms,
                         key=key, checksum=checksum)
    g_hat = decode(payload, levels)[:n]
    with np.errstate(over="ignore", invalid="ignore"):
        memory = g - g_hat if h is None else b * h + (g - g_hat)
    return Compensated(payload, memory, bool(np.isfinite(memory).all()),
                       memory_sum_of_squares(memory, bucket_size))


def memory_sum_of_squares(memory: np.ndarray, bucket_size: int) -> float:
    """‖h'‖² = Σ_k S_k added in bucket order in float64, S_k = Σ float64(h'_i)² over bucket k
    in the canonical pairwise order of the l2 norm (step 2): what the fused kernel accumulates
    while it writes h' (docs/dynamic.md §2.6)."""
    flat = np.asarray(memory, np.float32).reshape(-1)
    if flat.size == 0:
        return 0.0
    width = 1 << max(0, min(int(bucket_size), flat.size) - 1).bit_length()
    rows = _bucket_matrix(flat, int(bucket_size), width, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        sums = pairwise_sum_rows(rows * rows)
        return float(np.cumsum(sums)[-1])   # sequential, in bucket order
