"""Per-bucket statistics of a torch gradient, computed on its device, for level fitting (§5.1).

The device versions of ``horovod_aq.levels.stats.bucket_moments`` and
``horovod_aq.levels.stats.normalized_histogram``: same definitions, in float64, with only the
result vectors copied to the host (float64 numpy arrays, what ``Compressor.record_stats``
takes). Re-exported by ``horovod_aq.torch.kernels``.
"""

from __future__ import annotations

import numpy as np
import torch

from horovod_aq import codec
from horovod_aq.levels.histogram import histogram_edges
from horovod_aq.torch.payload import as_float32_flat

__all__ = ["bucket_moments", "normalized_histogram"]

#: Coordinates binned per pass by ``normalized_histogram`` (bounds its float64 temporaries).
_HISTOGRAM_CHUNK = 1 << 20


def bucket_moments(x: torch.Tensor, bucket_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(norms, means, stds) of the full buckets with a non-zero norm, as float64 numpy arrays.

    Same definition as ``horovod_aq.levels.stats.bucket_moments`` (u = v/‖v‖₂, std with
    ddof = 1, float64), computed on x's device; only the three result vectors are copied to the
    host.
    """
    bucket_size = codec.check_int("bucket_size", bucket_size, 2, codec.MAX_BUCKET_SIZE)
    flat = as_float32_flat(x)
    full_buckets = flat.numel() // bucket_size
    rows = flat[: full_buckets * bucket_size].view(full_buckets, bucket_size).to(torch.float64)
    norms = rows.square().sum(dim=1).sqrt()
    keep = norms > 0
    u = rows[keep] / norms[keep, None]
    if u.shape[0] == 0:
        # No full bucket with a non-zero norm (a tensor smaller than one bucket, or all zeros):
        # no statistics, as in numpy. torch.std over the empty [0, B] selection would warn
        # "std(): degrees of freedom is <= 0" on every recording step.
        return tuple(np.empty(0, dtype=np.float64) for _ in range(3))  # type: ignore[return-value]
    stats = (norms[keep], u.mean(dim=1), u.std(dim=1, correction=1))
    return tuple(t.cpu().numpy() for t in stats)  # type: ignore[return-value]


def normalized_histogram(x: torch.Tensor, bucket_size: int) -> np.ndarray:
    """n_b²-weighted histogram of r = v/‖v_b‖ over every bucket (tail included), float64 numpy.

    The device version of ``horovod_aq.levels.stats.normalized_histogram`` (same rule: in
    float64 a = max|v|, s = v/a, ρ = √Σs², r = clip(s/ρ, −1, 1), weight (a·ρ)², bin = number of
    edges ≤ r, minus one, clamped), fed to the histogram model of ALQ/AMQ refits. Runs only
    at refit steps; one H-bin vector is copied to the host.
    """
    bucket_size = codec.check_int("bucket_size", bucket_size, 2, codec.MAX_BUCKET_SIZE)
    flat = as_float32_flat(x)
    edges_np = histogram_edges()
    edges = torch.from_numpy(edges_np.copy()).to(flat.device)
    bins = edges_np.size - 1
    out = torch.zeros(bins, dtype=torch.float64, device=flat.device)
    full = flat.numel() // bucket_size
    rows_per_chunk = max(1, _HISTOGRAM_CHUNK // bucket_size)
    blocks = [flat[i * bucket_size:min(i + rows_per_chunk, full) * bucket_size]
              .view(-1, bucket_size) for i in range(0, full, rows_per_chunk)]
    if flat.numel() > full * bucket_size:
        blocks.append(flat[full * bucket_size:].view(1, -1))
    for block in blocks:
        block = block.to(torch.float64)
        amax = block.abs().amax(dim=1)
        keep = amax > 0
        if not bool(keep.any()):
            continue
        scaled = block[keep] / amax[keep, None]
        root = scaled.square().sum(dim=1).sqrt()
        r = (scaled / root[:, None]).clamp_(-1.0, 1.0)
        weight = (amax[keep] * root).square()
        k = (torch.bucketize(r, edges, right=True) - 1).clamp_(0, bins - 1)
        out += torch.bincount(k.reshape(-1), weights=weight.repeat_interleave(block.shape[1]),
                              minlength=bins)
    return out.cpu().numpy()
