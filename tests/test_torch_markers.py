"""Non-finite markers put in place with torch ops (horovod_aq.torch.markers) against the host's
markers (``codec.nonfinite_payload``), byte for byte. (Triton's one-pass send decides and
writes its own: tests/test_triton_compensated.py.)"""

from __future__ import annotations

import numpy as np
import pytest

import horovod_aq
from horovod_aq import codec
from horovod_aq.packed.marker import MAX_MARKER_INDEX

torch = pytest.importorskip("torch")
markers = pytest.importorskip("horovod_aq.torch.markers")

B = 16
N = 100   # six full buckets and a partial one


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
