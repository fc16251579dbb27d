"""packed.delimit: the sizes of self-delimiting payloads in a concatenation (what Horovod's
allgather of variable-length payloads delivers), and the refusal of forged lengths
(docs/protocol.md §5.4)."""

from __future__ import annotations

import struct

import numpy as np
import pytest

import horovod_aq
from horovod_aq import codec
from horovod_aq.codec.entropy_format import CODER_HEADER_SIZE
from horovod_aq.codec.stream import StreamKey
from horovod_aq.packed.delimit import payload_sizes

B = 64


def _payloads():
    """An entropy-coded payload, a fixed-width one (an incompressible tensor), a marker."""
    table = horovod_aq.QSGD(bits=3, bucket_size=B).table
    rng = np.random.default_rng(1)
    x = rng.standard_normal(6000).astype(np.float32)
    coded = codec.encode_entropy(x, table, bucket_size=B, key=StreamKey(1, 0, 0, 0, 0))
    small = codec.encode_entropy(x[:20], table, bucket_size=B, key=StreamKey(1, 1, 0, 0, 0))
    marker = codec.nonfinite_payload(6000, table, B, "l2", 17)
    assert coded[codec.FLAGS_OFFSET] & codec.FLAG_ENTROPY
    assert not small[codec.FLAGS_OFFSET] & codec.FLAG_ENTROPY
    return [coded, small, marker]


def _body_offset(payload):
    return codec.HEADER_SIZE + codec.NORM_BYTES * codec.parse_header(payload).num_buckets


@pytest.mark.parametrize("trailer", [0, 2])
def test_sizes_of_mixed_payloads_with_a_trailer(trailer):
    rows = [np.concatenate([p, np.full(trailer, 0xFF, np.uint8)]) for p in _payloads()]
    assert payload_sizes(np.concatenate(rows), len(rows), trailer) == [r.size for r in rows]


def _forge(coded, size):
    forged = coded.copy()
    at = _body_offset(coded)
    forged[at:at + 8] = np.frombuffer(struct.pack("<Q", size), np.uint8)
    return forged


@pytest.mark.parametrize("size, message", [
    (2**64 - 1, "outside"), (0, "outside"), (10**6, "outside"),
])
def test_an_out_of_bounds_length_is_refused_naming_the_rank(size, message):
    coded, small, marker = _payloads()
    flat = np.concatenate([small, _forge(coded, size), marker])
    with pytest.raises(codec.PayloadError, match=f"rank 1: .*{message}") as err:
        payload_sizes(flat, 3)
    assert err.value.rank == 1


def test_a_length_that_shifts_the_rows_is_refused():
    coded, small, marker = _payloads()
    flat = np.concatenate([_forge(coded, coded.size - 4), small, marker])
    with pytest.raises(codec.PayloadError, match="rank 1: "):
        payload_sizes(flat, 3)           # rank 1's row now starts 4 bytes early: no magic


def test_a_plausible_forged_length_is_refused_by_the_decoder():
    """A length inside the bounds that lands the next row exactly: the row's own decoder
    refuses it (its block counts do not add up to its length)."""
    coded, small, _ = _payloads()
    forged = _forge(coded, coded.size - 2)
    flat = np.concatenate([forged[:-2], small])
    sizes = payload_sizes(flat, 2)
    rows = np.split(flat, np.cumsum(sizes)[:-1])
    table = horovod_aq.QSGD(bits=3, bucket_size=B).table
    with pytest.raises(codec.PayloadError, match="rank 0: .*length mismatch"):
        codec.decode_average(rows, table)


def test_truncated_and_leftover_bytes_are_refused():
    coded, small, marker = _payloads()
    flat = np.concatenate([coded, small, marker])
    with pytest.raises(codec.PayloadError, match="rank 2: .*truncated"):
        payload_sizes(flat[:-1], 3)
    with pytest.raises(codec.PayloadError, match="3 bytes left over"):
        payload_sizes(np.concatenate([flat, np.zeros(3, np.uint8)]), 3)
    with pytest.raises(codec.PayloadError, match="rank 0: .*truncated"):
        payload_sizes(coded[:codec.HEADER_SIZE + 4], 1)
    with pytest.raises(codec.PayloadError, match="rank 0: .*truncated"):
        payload_sizes(coded[:_body_offset(coded) + CODER_HEADER_SIZE - 1], 1)


def test_a_zero_filled_row_is_not_a_payload():
    coded = _payloads()[0]
    with pytest.raises(codec.PayloadError, match="rank 1: .*not a horovod_aq payload"):
        payload_sizes(np.concatenate([coded, np.zeros(coded.size, np.uint8)]), 2)
