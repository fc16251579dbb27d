"""The checks and the reading of gathered fixed-width payload rows, in the order every decoder
applies them: headers (``parse_rows``, ``check_rows``), checksums (``check_checksums``), then each
row's data (``check_data``: norms, then codes; ``read_fixed_payload``: the values, step 6 of
``horovod_aq.codec.reference``). An error found in row r names its rank (``tag_rank``).

A leaf of the oracle: ``codec.reference``, ``codec.entropy`` and the fused kernels read rows with
these functions, so they raise the same errors with the same messages. This module imports numpy
only, never torch or tensorflow.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from horovod_aq.codec.bits import unpack_bits
from horovod_aq.codec.format import (
    HEADER_SIZE,
    Header,
    NonFiniteGradientError,
    PayloadError,
    as_bytes,
    bad_code_message,
    check_checksum,
    check_header,
    check_payload_norms,
    check_size,
    parse_header,
)
from horovod_aq.codec.quantize import dequantize
from horovod_aq.levels.table import LevelTable

__all__ = ["check_checksums", "check_data", "check_rows", "parse_rows", "read_fixed_payload",
           "tag_rank"]


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


def read_fixed_payload(data: np.ndarray, header: Header, table: LevelTable) -> np.ndarray:
    """float32 values of one size-checked payload (checksum already verified)."""
    norms, codes = _sections(data, header)
    _check_sections(norms, codes, table.num_levels)
    return dequantize(codes, norms, table, header.bucket_size)


def tag_rank(err: Exception, rank: int) -> None:
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
                tag_rank(err, rank)
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
                tag_rank(err, rank)
            raise


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
                tag_rank(err, rank)
            raise
    return first
