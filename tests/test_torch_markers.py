"""Non-finite markers decided on the device (horovod_aq.torch.markers) against the host's
decision (``packed.send.first_bad_element``) and the host's markers
(``codec.nonfinite_payload``), byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

import horovod_aq
from horovod_aq import codec
from horovod_aq.packed.marker import MAX_MARKER_INDEX
from horovod_aq.packed.protocol import first_unsendable
from horovod_aq.packed.send import first_bad_element

torch = pytest.importorskip("torch")
markers = pytest.importorskip("horovod_aq.torch.markers")

B = 16
N = 100   # six full buckets and a partial one


def _host_first_bad(x: np.ndarray, norm: str) -> int | None:
    """``packed.send`` step 2 on the host (x = g: no error memory)."""
    def first_nonfinite(v):
        bad = ~np.isfinite(v.numpy())
        return int(np.argmax(bad)) if bad.any() else None

    def peak(v):
        a = v.numpy()
        return float(np.max(np.abs(a))) if a.size else 0.0

    t = torch.from_numpy(x)
    return first_bad_element(t, t, first_nonfinite=first_nonfinite, peak=peak,
                             norms=lambda v: codec.bucket_norms(v.numpy(), B, norm),
                             bucket_size=B)


def _norms(x: np.ndarray, norm: str) -> np.ndarray:
    """Every bucket's float32 norm as an encode of x writes it, non-finite x included (l2: the
    float64 sum of squares, cast: ±inf past float32)."""
    v = np.concatenate([x, np.zeros(-x.size % B, np.float32)]).reshape(-1, B).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return (np.sqrt((v * v).sum(axis=1)) if norm == "l2"
                else np.abs(v).max(axis=1)).astype(np.float32)


#: (first, last + 1) → the value written there.
CASES = {
    "finite": [],
    "nan": [((37, 38), np.nan)],
    "inf late, nan later": [((90, 91), -np.inf), ((95, 96), np.nan)],
    "overflowing bucket": [((32, 48), 3e38)],
    "overflow before a nan": [((0, 16), 3e38), ((70, 71), np.nan)],
    "partial bucket overflows": [((96, 100), 3e38)],
}


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("norm", ["l2", "linf"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_first_bad_element_is_the_hosts(case, norm):
    x = np.random.default_rng(3).standard_normal(N).astype(np.float32)
    for (lo, hi), value in CASES[case]:
        x[lo:hi] = value
    norms = _norms(x, norm)

    want = _host_first_bad(x, norm)
    got = int(markers.first_bad(torch.from_numpy(x), torch.from_numpy(norms), B))
    assert got == (-1 if want is None else want)
    if "overflow" in case and norm == "l2":   # a NaN anywhere comes first, else the bucket
        assert want == (70 if "nan" in case else first_unsendable(norms) * B)


@pytest.mark.parametrize("bad, offset", [(-1, 0), (0, 0), (37, 0), (5, 300),
                                         (2**40, 0)])
def test_a_marker_replaces_the_payload_exactly_as_the_hosts(bad, offset):
    table = horovod_aq.QSGD(bits=3, bucket_size=B).table
    x = np.random.default_rng(4).standard_normal(N).astype(np.float32)
    payload = codec.encode(x, table, bucket_size=B, norm="l2")
    sent = markers.markers_or([torch.from_numpy(payload.copy())] * 2, torch.tensor(bad),
                              offset=offset, numel=N, table=table, bucket_size=B, norm="l2")
    want = payload if bad < 0 else codec.nonfinite_payload(N, table, B, "l2",
                                                           min(bad + offset, MAX_MARKER_INDEX))
    assert len(sent) == 2
    for got in sent:
        np.testing.assert_array_equal(got.numpy(), want)


def test_an_empty_part_travels():
    empty = torch.zeros(0, dtype=torch.float32)
    assert int(markers.first_bad(empty, empty, B)) == -1
