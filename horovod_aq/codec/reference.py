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

This module imports numpy only, never torch or tensorflow.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from horovod_aq.codec.bits import pack_bits, unpack_bits
from horovod_aq.codec.format import (
    FLAG_ENTROPY,
    FLAGS_OFFSET,
    HEADER_SIZE,
    Header,
    NonFiniteGradientError,
    PayloadError,
    as_bytes,
    as_table,
    bad_code_message,
    check_bool,
    check_bucket_size,
    check_checksum,
    check_finite,
    check_header,
    check_norm,
    check_norms,
    check_payload_norms,
    check_size,
    float32_levels,
    make_header,
    parse_header,
    seal_checksum,
)
from horovod_aq.codec.stream import StreamKey, stream_uniforms
from horovod_aq.levels.table import LevelTable

__all__ = [
    "bucket_norms",
    "check_checksums",
    "check_data",
    "check_rows",
    "decode",
    "parse_rows",
    "decode_average",
    "draw_uniforms",
    "variable_rows",
    "encode",
    "pairwise_sum_rows",
    "quantize",
    "quantize_codes",
    "rounding_variance",
]


# ------------------------------------------------------------------------------- input checks


def _is_float_dtype(dtype: np.dtype) -> bool:
    # ml_dtypes' bfloat16 / float8 register as kind "V"; accept them by name.
    return dtype.kind == "f" or dtype.name.startswith(("bfloat16", "float8"))


def _as_float32_flat(x: Any) -> np.ndarray:
    """x flattened and cast to float32, after checking it is floating point and finite."""
    arr = np.asarray(x)
    if not _is_float_dtype(arr.dtype):
        raise ValueError(f"expected a floating-point gradient, got dtype {arr.dtype}")
    with np.errstate(over="ignore"):  # values beyond float32 become ±Inf and are reported
        flat = arr.reshape(-1).astype(np.float32, copy=False)
    check_finite(flat)
    return flat


def draw_uniforms(n: int, seed: Any = None, uniforms: Any = None,
                  key: StreamKey | None = None) -> np.ndarray:
    """The n float32 uniforms of step 8: ``uniforms`` checked (shape (n,), values in [0, 1)
    after rounding to float32); else the format's stream of ``key`` (``codec.stream``: what
    every kernel draws); else drawn from ``seed`` (int, Generator or None; numpy's own
    generator, for tests and tools that need no cross-framework bytes)."""
    if key is not None and uniforms is None:
        return stream_uniforms(n, key)
    if uniforms is not None:
        u = np.asarray(uniforms)
        if u.shape != (n,):
            raise ValueError(f"uniforms must have shape ({n},), got {u.shape}")
        u = u.astype(np.float32, copy=False)
        if n and not (u.min() >= 0.0 and u.max() < 1.0):
            raise ValueError("uniforms must lie in [0, 1) after rounding to float32")
        return u
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    return rng.random(n, dtype=np.float32)


# ----------------------------------------------------------------------------------- buckets


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _bucket_matrix(flat: np.ndarray, bucket_size: int, width: int, dtype: Any) -> np.ndarray:
    """[⌈n/B⌉, width] matrix of the buckets (rows), zero-padded on the right."""
    n = flat.size
    nb = -(-n // bucket_size)
    rows = np.zeros((nb, width), dtype=dtype)
    full = (n // bucket_size) * bucket_size
    length = min(bucket_size, width)
    rows[: n // bucket_size, :length] = flat[:full].reshape(-1, bucket_size)[:, :length]
    if full < n:
        rows[-1, : n - full] = flat[full:]
    return rows


def pairwise_sum_rows(rows: np.ndarray) -> np.ndarray:
    """Row sums in the canonical pairwise order (module docstring, step 2). Width: power of 2."""
    width = rows.shape[1]
    assert width & (width - 1) == 0, "width must be a power of two"
    while width > 1:
        width //= 2
        rows = rows[:, :width] + rows[:, width:]
    return rows[:, 0]


def bucket_norms(x: Any, bucket_size: int, norm: str = "l2") -> np.ndarray:
    """float32 norm of every bucket of the flattened float32 x (step 2), the partial one included.

    l2 accumulates the squares in float64 in the canonical pairwise order; linf is max |x_i|.
    """
    flat = _as_float32_flat(x)
    bucket_size = check_bucket_size(bucket_size)
    norm = check_norm(norm)
    if flat.size == 0:
        return np.zeros(0, dtype=np.float32)
    length = min(bucket_size, flat.size)
    if norm == "linf":
        return np.abs(_bucket_matrix(flat, bucket_size, length, np.float32)).max(axis=1)
    rows = _bucket_matrix(flat, bucket_size, _next_pow2(length), np.float64)
    with np.errstate(over="ignore"):  # an overflowing norm becomes Inf; callers reject it
        return np.sqrt(pairwise_sum_rows(rows * rows)).astype(np.float32)


# -------------------------------------------------------------------------------- quantizing


def _levels_f32(table: LevelTable) -> tuple[np.ndarray, np.ndarray]:
    levels = float32_levels(table)
    return levels, levels[1:] - levels[:-1]


def _normalized(flat: np.ndarray, norms: np.ndarray, bucket_size: int) -> np.ndarray:
    """r = clip(x / n_bucket, −1, 1) in float32, 0 in zero buckets (step 3)."""
    safe = np.where(norms == 0, np.float32(1), norms)  # x is all zeros there: 0 / 1 = 0
    # min(B, n): B > n is one bucket of n elements (never a temporary of B elements)
    per_elem = np.repeat(safe, min(bucket_size, flat.size))[: flat.size]
    return np.clip(flat / per_elem, np.float32(-1), np.float32(1))


def _round(r: np.ndarray, table: LevelTable, u: np.ndarray) -> np.ndarray:
    """Unbiased stochastic rounding of r onto the table (step 4): uint8 codes."""
    levels, widths = _levels_f32(table)
    j = np.clip(np.searchsorted(levels, r, side="right") - 1, 0, levels.size - 2)
    xi = (r - levels[j]) / widths[j]
    return (j + (u < xi)).astype(np.uint8)


def quantize_codes(
    x: Any, table: LevelTable, *, bucket_size: int, norm: str = "l2", uniforms: Any
) -> tuple[np.ndarray, np.ndarray]:
    """Level indices (uint8, one per element) and bucket norms (float32) of x; steps 1–4."""
    table = as_table(table)
    bucket_size = check_bucket_size(bucket_size)
    norm = check_norm(norm)
    flat = _as_float32_flat(x)
    norms = bucket_norms(flat, bucket_size, norm)
    check_norms(norms)
    u = draw_uniforms(flat.size, None, uniforms)
    return _round(_normalized(flat, norms, bucket_size), table, u), norms


def _prepare(
    x: Any, levels: Any, bucket_size: Any, norm: Any, seed: Any, uniforms: Any,
    key: StreamKey | None = None,
) -> tuple[LevelTable, int, np.ndarray, np.ndarray, np.ndarray]:
    """Validate everything, then draw the uniforms (so bad input leaves ``seed`` untouched)."""
    table = as_table(levels)
    bucket_size = check_bucket_size(bucket_size)
    norm = check_norm(norm)
    flat = _as_float32_flat(x)
    norms = bucket_norms(flat, bucket_size, norm)
    check_norms(norms)
    u = draw_uniforms(flat.size, seed, uniforms, key)
    return table, bucket_size, flat, norms, u


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
    table, bucket_size, flat, norms, u = _prepare(x, levels, bucket_size, norm, seed, uniforms,
                                                  key)
    codes = _round(_normalized(flat, norms, bucket_size), table, u)
    payload = np.concatenate(
        [
            np.frombuffer(make_header(flat.size, table, bucket_size, norm), dtype=np.uint8),
            norms.astype("<f4").view(np.uint8),
            pack_bits(codes, table.bits),
        ]
    )
    return seal_checksum(payload) if checksum else payload



def _dequantize(codes: np.ndarray, norms: np.ndarray, table: LevelTable, bucket_size: int):
    """x̂ = n_bucket · L[code] in float32 (step 6)."""
    levels, _ = _levels_f32(table)
    span = min(bucket_size, codes.size)  # Header.span: memory bounded by n, not by B
    return np.repeat(norms, span)[: codes.size] * levels[codes]


def _sections(data: np.ndarray, header: Header) -> tuple[np.ndarray, np.ndarray]:
    """(float32 norms, uint8 codes) of one size-checked payload."""
    norms = np.frombuffer(data[HEADER_SIZE : header.codes_offset].tobytes(), dtype="<f4")
    codes = unpack_bits(data[header.codes_offset :], header.bits, header.numel)
    assert norms.size == header.num_buckets
    return norms.astype(np.float32), codes


def _check_sections(norms: np.ndarray, codes: np.ndarray, num_levels: int) -> None:
    check_payload_norms(norms)
    if codes.size and int(codes.max()) >= num_levels:
        raise PayloadError(bad_code_message(int(codes.max()), num_levels))


def check_data(payload: Any, header: Header, num_levels: int) -> None:
    """The data checks of a size-checked payload, in the order every decoder applies them:
    every bucket norm finite and ≥ 0 (``check_payload_norms``), then every code < N. Raises
    ``PayloadError``; its message is what every decoder raises for such a payload."""
    _check_sections(*_sections(as_bytes(payload), header), num_levels)


def _read_payload(data: np.ndarray, header: Header, table: LevelTable) -> np.ndarray:
    """float32 values of one size-checked payload (checksum already verified)."""
    norms, codes = _sections(data, header)
    _check_sections(norms, codes, table.num_levels)
    return _dequantize(codes, norms, table, header.bucket_size)


def _name_rank(err: Exception, rank: int) -> None:
    """Prefix an error's message with "rank r: " and give it a ``rank`` attribute."""
    err.args = (f"rank {rank}: {err}",) + err.args[1:]
    err.rank = rank


def parse_rows(rows: Any, *, name_rank: bool = True) -> list[Header]:
    """``parse_header`` of every row of a gathered ``[P, ≥ 32]`` buffer (or of a list of rows),
    in rank order; with ``name_rank`` an error names the rank like ``check_rows``."""
    headers = []
    for rank, row in enumerate(rows):
        try:
            headers.append(parse_header(row))
        except PayloadError as err:
            if name_rank:
                _name_rank(err, rank)
            raise
    return headers


def check_checksums(rows: Any, headers: list[Header], *, name_rank: bool = True) -> None:
    """Verify the CRC-32 of every row of a size-checked ``[P, size]`` buffer whose header
    carries ``FLAG_CHECKSUM`` (``codec.check_checksum``), in rank order; with ``name_rank``
    the error names the rank like ``check_rows``."""
    if not any(h.checksummed for h in headers):
        return
    rows = np.asarray(rows)
    for rank, header in enumerate(headers):
        try:
            check_checksum(rows[rank], header)
        except PayloadError as err:
            if name_rank:
                _name_rank(err, rank)
            raise


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
    return _read_payload(data, header, table).astype(dtype, copy=False)


def check_rows(
    headers: list[Header],
    table: LevelTable,
    size: int,
    *,
    numel: int | None = None,
    bucket_size: int | None = None,
    norm: str | None = None,
    name_rank: bool = True,
) -> Header:
    """Check the headers of the P rows (``size`` bytes each) of a gathered buffer, in rank order.

    Settings left as None are taken from row 0; every row must match them, ``table`` and the
    row size (``check_header``, ``check_size``). With ``name_rank`` an error's message starts
    with "rank r:" and the error gets a ``rank`` attribute. Returns row 0's header.
    """
    first = headers[0]
    numel = first.numel if numel is None else numel
    bucket_size = first.bucket_size if bucket_size is None else bucket_size
    norm = first.norm if norm is None else norm
    for rank, header in enumerate(headers):
        try:
            check_header(header, table, numel=numel, bucket_size=bucket_size, norm=norm)
            check_size(header, size)
        except (PayloadError, NonFiniteGradientError) as err:
            if name_rank:
                _name_rank(err, rank)
            raise
    return first


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
            values = _read_payload(rows[rank], headers[rank], table)
        except PayloadError as err:
            _name_rank(err, rank)
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
    table, bucket_size, flat, norms, u = _prepare(x, levels, bucket_size, norm, seed, uniforms,
                                                  key)
    codes = _round(_normalized(flat, norms, bucket_size), table, u)
    return _dequantize(codes, norms, table, bucket_size).astype(dtype, copy=False)


def rounding_variance(
    x: Any, levels: LevelTable | Any, *, bucket_size: int, norm: str = "l2"
) -> np.ndarray:
    """Per-bucket expected squared error E‖Q(v) − v‖² = n²·Σ_i (L_{j+1} − r_i)(r_i − L_j) (§3).

    Computed in float64 from the same float32 r, L_j, L_{j+1} the encoder uses.
    """
    table = as_table(levels)
    bucket_size = check_bucket_size(bucket_size)
    flat = _as_float32_flat(x)
    norms = bucket_norms(flat, bucket_size, norm)
    check_norms(norms)
    levels32, _ = _levels_f32(table)
    r = _normalized(flat, norms, bucket_size)
    j = np.clip(np.searchsorted(levels32, r, side="right") - 1, 0, levels32.size - 2)
    r64 = r.astype(np.float64)
    per_coord = (levels32[j + 1].astype(np.float64) - r64) * (r64 - levels32[j])
    sums = np.bincount(np.arange(flat.size) // bucket_size, per_coord, minlength=norms.size)
    return norms.astype(np.float64) ** 2 * sums
