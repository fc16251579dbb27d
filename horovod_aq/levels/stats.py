"""Per-bucket gradient statistics for fitting the levels (``docs/quantizers.md`` §5.1, §5.2, §5.4).

For each FULL bucket v_b of B coordinates with n_b = ‖v_b‖₂ > 0 (zero buckets and the partial
tail are skipped, as in the reference):

    u = v_b / n_b,   m_b = mean(u),   s_b = std(u) with divisor B − 1        (§5.1)

Because Σ u_i² = 1, s_b² = (1 − B·m_b²)/(B − 1). ``bucket_moments`` is the one numpy definition
of (n_b, m_b, s_b); ``BucketStats.from_gradient`` builds the statistics on it. The mixture of
§5.3 uses the top-K buckets by norm; the single normal of ALQ-N/AMQ-N (§5.4) uses pooled sums
over ALL nonzero full buckets:

    count = Σ_b B,   sum_u = Σ_b Σ_i u_i = Σ_b B·m_b,
    sum_sq_dev = Σ_b Σ_i (u_i − m_b)² = Σ_b (B − 1)·s_b².

Multi-rank use (§5.2): every rank computes its ``BucketStats`` (or a framework kernel computes
the per-bucket arrays and calls ``BucketStats.from_buckets``), packs it into the fixed-size vector
of ``to_array(top_k)``, the vectors are allgathered, and the root calls
``BucketStats.merge([BucketStats.from_array(a) for a in gathered], top_k)`` and fits on
``mixture()`` or ``pooled_normal()``. Rows are always kept in one canonical order (norm
descending, ties by mean then std ascending) and the pooled sums are added with ``math.fsum``
(exactly rounded), so the merge does not depend on the order the ranks are listed in.

Empirical histogram (optional; ``histogram`` module). The exact expected error of a gradient is

    E‖Q(g) − g‖² = Σ_b n_b² Σ_{i∈b} σ²(r_i),   r_i = v_i/n_b,

so the law to fit is that of ALL normalized coordinates, each weighted by its bucket's n_b²:
``normalized_histogram`` bins them on the default grid (``histogram.histogram_edges()``), over
EVERY bucket — the partial tail bucket included, with its own norm — skipping zero-norm
buckets. ``BucketStats.histogram`` carries these H = ``HISTOGRAM_BINS`` weights through
``to_array``/``from_array``/``merge`` and ``histogram_model()`` turns them into a
``HistogramDistribution``; then V(ℓ; model)·Σweights ≈ E‖Q(g) − g‖² up to the binning.

Binning rule, for kernels that compute the histogram on the device (torch ``bucketize``, TF
``searchsorted`` + segment sums) and must assign the same bins:

* buckets are consecutive runs of B coordinates of the flattened gradient; the last run may be
  shorter (the partial tail bucket) and is binned with its own norm;
* per bucket, a = max_i |v_i|; a bucket with a = 0 is skipped (contributes nothing);
  otherwise s_i = v_i/a, ρ = √(Σ_i s_i²) (float64), r_i = s_i/ρ and the weight is
  n_b² = (a·ρ)²; all arithmetic in float64 (inputs are converted first);
* r is clipped to [−1, 1] and falls in bin k = #{m : e_m ≤ r} − 1, clamped to [0, H − 1]
  (``histogram.histogram_bin_index``): half-open bins [e_k, e_{k+1}), a value exactly on an
  interior edge goes to the bin on its right, r = 1 to the last bin, r = −1 to bin 0. The
  default grid has an odd number of bins and no edge at 0, so r = 0 (exact zeros) always lands
  in the central bin (H − 1)/2;
* bin k receives Σ n_b² over the coordinates assigned to it.

Given the same r values the assignment is bit-identical (``torch.bucketize(r, edges,
right=True) − 1``); r itself may differ by an ulp when a kernel forms the norm in another
order, which moves only values within an ulp of an edge. Weights are summed per block of
buckets (``np.bincount``) and the blocks in order, so they are deterministic for a given input
(and may differ from a device's by float rounding). n_b² must stay within float64: gradients
with bucket norms above ~1e154 raise ValueError.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from horovod_aq.levels.distribution import TruncatedNormalMixture
from horovod_aq.levels.histogram import (
    HISTOGRAM_BINS,
    HistogramDistribution,
    _check_edges,
    histogram_edges,
)

__all__ = ["BucketStats", "bucket_moments", "normalized_histogram"]

#: Length of the header of ``BucketStats.to_array``: bucket_size, count, sum_u, sum_sq_dev.
ARRAY_HEADER = 4
#: ``bucket_moments`` and ``normalized_histogram`` convert at most about this many coordinates
#: to float64 at a time.
_STATS_CHUNK = 1 << 20
# A stats vector without a histogram has length 3·k + ARRAY_HEADER, one with a histogram
# 3·k + ARRAY_HEADER + HISTOGRAM_BINS; H ≢ 0 (mod 3) keeps the two kinds of lengths apart.
assert HISTOGRAM_BINS % 3 != 0


def _check_top_k(top_k: int | None) -> int | None:
    if top_k is None:
        return None
    if isinstance(top_k, bool) or int(top_k) != top_k or int(top_k) < 1:
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    return int(top_k)


def _check_bucket_size(bucket_size: object) -> int:
    if isinstance(bucket_size, bool):
        raise ValueError(f"bucket_size must be an integer >= 2, got {bucket_size!r}")
    try:
        b = int(bucket_size)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise ValueError(f"bucket_size must be an integer >= 2, got {bucket_size!r}") from None
    if b != bucket_size or b < 2:
        raise ValueError(f"bucket_size must be an integer >= 2, got {bucket_size!r}")
    return b


def _check_histogram(histogram: object) -> np.ndarray:
    h = np.array(histogram, dtype=np.float64, copy=True).reshape(-1)
    if h.size != HISTOGRAM_BINS:
        raise ValueError(
            f"a histogram has {HISTOGRAM_BINS} weights (the default grid), got {h.size}"
        )
    if not np.all(np.isfinite(h)):
        raise ValueError("histogram weights must be finite")
    if np.any(h < 0.0):
        raise ValueError("histogram weights must be non-negative")
    h.setflags(write=False)
    return h


def _sum_histograms(histograms: list[np.ndarray]) -> np.ndarray:
    """Bin-wise exactly rounded sums (``math.fsum``): independent of the order of the inputs."""
    if len(histograms) == 1:
        return histograms[0]
    cols = np.stack(histograms, axis=1).tolist()
    try:
        return np.array([math.fsum(col) for col in cols], dtype=np.float64)
    except OverflowError:
        raise ValueError("merged histogram weights overflow float64") from None


def _canonical_order(norms: np.ndarray, means: np.ndarray, stds: np.ndarray) -> np.ndarray:
    """Row order: norm descending, then mean ascending, then std ascending (deterministic)."""
    return np.lexsort((stds, means, -norms))


@dataclass(frozen=True, eq=False)
class BucketStats:
    """Statistics of the nonzero full buckets of one gradient (or of several, merged).

    ``norms``, ``means``, ``stds`` (float64, canonical order) describe the kept buckets — the
    top-K by norm, or all. ``count``, ``sum_u``, ``sum_sq_dev`` are pooled over ALL nonzero full
    buckets (for the single-normal model, §5.4). ``histogram`` (optional, None when absent) holds
    the ``HISTOGRAM_BINS`` n_b²-weighted bin weights of ALL normalized coordinates on the default
    grid (module docstring), for ``histogram_model()``. Build with ``from_gradient``,
    ``from_buckets``, ``merge`` or ``from_array`` rather than directly.
    """

    norms: np.ndarray
    means: np.ndarray
    stds: np.ndarray
    bucket_size: int
    count: int
    sum_u: float
    sum_sq_dev: float
    histogram: np.ndarray | None = None

    def __post_init__(self) -> None:
        b = _check_bucket_size(self.bucket_size)
        arrays = []
        for name in ("norms", "means", "stds"):
            arr = np.array(getattr(self, name), dtype=np.float64, copy=True).reshape(-1)
            if not np.all(np.isfinite(arr)):
                raise ValueError(f"bucket {name} must be finite")
            arrays.append(arr)
        norms, means, stds = arrays
        if not (norms.size == means.size == stds.size):
            raise ValueError("norms, means and stds differ in length")
        if np.any(norms <= 0.0):
            raise ValueError("kept bucket norms must be positive (zero buckets are skipped)")
        if np.any(stds < 0.0):
            raise ValueError("bucket stds must be non-negative")
        if np.any(np.abs(means) > 1.0):
            raise ValueError("bucket means of normalized coordinates must lie in [-1, 1]")
        count = int(self.count)
        if count != self.count or count < 0 or count % b:
            raise ValueError(
                f"count must be a non-negative multiple of bucket_size, got {self.count!r}"
            )
        if not (math.isfinite(self.sum_u) and math.isfinite(self.sum_sq_dev)):
            raise ValueError("pooled sums must be finite")
        if self.sum_sq_dev < 0.0:
            raise ValueError("sum_sq_dev must be non-negative")
        if count == 0 and norms.size:
            raise ValueError("kept buckets but count = 0")
        order = _canonical_order(norms, means, stds)
        for name, arr in zip(("norms", "means", "stds"), arrays):
            arr = arr[order]
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "bucket_size", b)
        object.__setattr__(self, "count", count)
        object.__setattr__(self, "sum_u", float(self.sum_u))
        object.__setattr__(self, "sum_sq_dev", float(self.sum_sq_dev))
        if self.histogram is not None:
            object.__setattr__(self, "histogram", _check_histogram(self.histogram))

    # -- constructors ------------------------------------------------------------------------------
    @classmethod
    def from_gradient(
        cls, x: object, bucket_size: int, *, top_k: int | None = None, histogram: bool = False
    ) -> BucketStats:
        """Statistics of the full buckets of the flattened gradient ``x`` (§5.1).

        ``from_buckets(*bucket_moments(x, bucket_size), bucket_size, top_k)``: buckets are
        consecutive runs of ``bucket_size`` coordinates; the partial tail and buckets of norm 0
        are skipped. Raises ValueError for non-finite input or bucket_size < 2; an all-zero or
        too short ``x`` gives empty statistics (whose ``mixture()`` raises).
        ``histogram=True`` also stores ``normalized_histogram(x, bucket_size)`` (all buckets,
        the partial tail included) for ``histogram_model()``.
        """
        b = _check_bucket_size(bucket_size)
        v = _real_vector(x)
        norms, means, stds = _moments(v, b)
        hist = normalized_histogram(v, b) if histogram else None
        return cls.from_buckets(norms, means, stds, b, top_k=top_k, histogram=hist)

    @classmethod
    def from_buckets(
        cls,
        norms: object,
        means: object,
        stds: object,
        bucket_size: int,
        top_k: int | None = None,
        histogram: object | None = None,
    ) -> BucketStats:
        """From per-bucket arrays of ALL full buckets (as a framework kernel computes them).

        Zero-norm rows are skipped (their mean/std may be NaN, as 0/0 gives on a device);
        every other value must be finite, norms and stds non-negative. The pooled sums use every
        nonzero row; the kept rows are the ``top_k`` largest norms (all if None). ``histogram``
        (optional) is the gradient's ``normalized_histogram`` (all buckets, the partial tail
        included — computed separately, by the rule of the module docstring).
        """
        b = _check_bucket_size(bucket_size)
        top_k = _check_top_k(top_k)
        n = np.array(norms, dtype=np.float64).reshape(-1)
        m = np.array(means, dtype=np.float64).reshape(-1)
        s = np.array(stds, dtype=np.float64).reshape(-1)
        if not (n.size == m.size == s.size):
            raise ValueError(
                f"norms, means and stds differ in length ({n.size}, {m.size}, {s.size})"
            )
        if not np.all(np.isfinite(n)):
            raise ValueError("bucket norms must be finite (non-finite gradient?)")
        if np.any(n < 0.0):
            raise ValueError("bucket norms must be non-negative")
        nz = n > 0.0
        n, m, s = n[nz], m[nz], s[nz]
        if not (np.all(np.isfinite(m)) and np.all(np.isfinite(s))):
            raise ValueError("bucket means and stds must be finite for nonzero buckets")
        if np.any(s < 0.0):
            raise ValueError("bucket stds must be non-negative")
        count = b * int(n.size)
        sum_u = math.fsum((b * m).tolist())
        sum_sq_dev = math.fsum(((b - 1) * s * s).tolist())
        if top_k is not None and n.size > top_k:
            keep = _canonical_order(n, m, s)[:top_k]
            n, m, s = n[keep], m[keep], s[keep]
        hist = None if histogram is None else _check_histogram(histogram)
        return cls(n, m, s, b, count, sum_u, sum_sq_dev, hist)

    @classmethod
    def merge(cls, stats: Iterable[BucketStats], top_k: int | None = None) -> BucketStats:
        """Global top-K by norm over all ``stats`` and summed pooled sums (what the root does).

        All inputs must share one bucket size, and either all or none carry a histogram
        (histograms are added bin by bin). The result does not depend on the order of the
        inputs (canonical row order; pooled sums and histogram bins are exactly rounded sums,
        ``math.fsum``).
        """
        items = list(stats)
        if not items:
            raise ValueError("merge needs at least one BucketStats")
        top_k = _check_top_k(top_k)
        sizes = {s.bucket_size for s in items}
        if len(sizes) != 1:
            raise ValueError(f"cannot merge statistics of different bucket sizes {sorted(sizes)}")
        hists = [s.histogram for s in items]
        has = [h is not None for h in hists]
        if any(has) and not all(has):
            raise ValueError(
                "cannot merge statistics with and without a histogram (configure every rank "
                "the same way)"
            )
        histogram = _sum_histograms(hists) if all(has) else None  # type: ignore[arg-type]
        n = np.concatenate([s.norms for s in items])
        m = np.concatenate([s.means for s in items])
        sd = np.concatenate([s.stds for s in items])
        order = _canonical_order(n, m, sd)
        if top_k is not None:
            order = order[:top_k]
        return cls(
            n[order],
            m[order],
            sd[order],
            items[0].bucket_size,
            sum(s.count for s in items),
            math.fsum(s.sum_u for s in items),
            math.fsum(s.sum_sq_dev for s in items),
            histogram,
        )

    @classmethod
    def from_array(cls, arr: object) -> BucketStats:
        """Inverse of ``to_array``: zero-norm (padding) rows are ignored.

        The length tells whether a histogram block is present: 3·top_k + 4 without,
        3·top_k + 4 + ``HISTOGRAM_BINS`` with (H ≢ 0 mod 3, so the two never coincide).
        """
        a = np.asarray(arr, dtype=np.float64).reshape(-1)
        n_rows = a.size - ARRAY_HEADER
        if n_rows >= 3 and n_rows % 3 == 0:
            n_hist = 0
        elif n_rows - HISTOGRAM_BINS >= 3 and (n_rows - HISTOGRAM_BINS) % 3 == 0:
            n_hist = HISTOGRAM_BINS
        else:
            raise ValueError(
                f"a stats vector has length 3*top_k + {ARRAY_HEADER} (+ {HISTOGRAM_BINS} with a "
                f"histogram) with top_k >= 1, got {a.size}"
            )
        if not np.all(np.isfinite(a)):
            raise ValueError("stats vector contains non-finite values")
        k = (n_rows - n_hist) // 3
        bucket_size, count, sum_u, sum_sq_dev = a[:ARRAY_HEADER]
        rows = a[ARRAY_HEADER : ARRAY_HEADER + 3 * k].reshape(3, k)
        histogram = a[ARRAY_HEADER + 3 * k :] if n_hist else None
        keep = rows[0] != 0.0
        if np.any(rows[0] < 0.0):
            raise ValueError("stats vector has negative norms")
        return cls(
            rows[0, keep],
            rows[1, keep],
            rows[2, keep],
            bucket_size,
            count,
            sum_u,
            sum_sq_dev,
            histogram,
        )

    # -- export ------------------------------------------------------------------------------------
    def to_array(self, top_k: int, *, include_histogram: bool | None = None) -> np.ndarray:
        """Fixed-size float64 vector
        [bucket_size, count, sum_u, sum_sq_dev, norms, means, stds (, histogram)].

        Each of the three row blocks has exactly ``top_k`` entries: the largest-norm rows,
        padded with zero-norm rows; the histogram block (``HISTOGRAM_BINS`` weights) follows
        when ``include_histogram`` is True (zeros if these stats have none) or None and these
        stats carry a histogram. Length 3·top_k + 4 (+ H). Every rank configured alike can
        therefore join one fixed-shape allgather.
        """
        k = _check_top_k(top_k)
        assert k is not None
        if include_histogram is None:
            include_histogram = self.histogram is not None
        n_hist = HISTOGRAM_BINS if include_histogram else 0
        out = np.zeros(ARRAY_HEADER + 3 * k + n_hist, dtype=np.float64)
        out[:ARRAY_HEADER] = (self.bucket_size, self.count, self.sum_u, self.sum_sq_dev)
        r = min(k, self.norms.size)
        rows = out[ARRAY_HEADER : ARRAY_HEADER + 3 * k].reshape(3, k)
        rows[0, :r] = self.norms[:r]
        rows[1, :r] = self.means[:r]
        rows[2, :r] = self.stds[:r]
        if n_hist and self.histogram is not None:
            out[ARRAY_HEADER + 3 * k :] = self.histogram
        return out

    @property
    def num_buckets(self) -> int:
        """Number of nonzero full buckets behind the pooled sums."""
        return self.count // self.bucket_size

    def __len__(self) -> int:
        return int(self.norms.size)

    def _require_nonempty(self) -> None:
        if self.norms.size == 0 or self.count == 0:
            raise ValueError(
                "no nonzero full bucket in the statistics: the gradient was all zeros or shorter "
                f"than one bucket (bucket_size={self.bucket_size}); keep the previous level table "
                "or use a smaller bucket size"
            )

    def mixture(self, weighting: str = "squared_norm") -> TruncatedNormalMixture:
        """The ALQ/AMQ mixture of the kept buckets, weights ∝ n_b² (default) or n_b (§5.3)."""
        self._require_nonempty()
        return TruncatedNormalMixture.from_bucket_stats(
            self.norms, self.means, self.stds, weighting=weighting
        )

    def pooled_normal(self) -> TruncatedNormalMixture:
        """The ALQ-N/AMQ-N single truncated normal from the pooled sums (§5.4)."""
        self._require_nonempty()
        return TruncatedNormalMixture.from_pooled_sums(self.count, self.sum_u, self.sum_sq_dev)

    def histogram_model(self) -> HistogramDistribution:
        """The empirical law of all normalized coordinates, n_b²-weighted, on the default grid.

        ``fit_alq(stats.histogram_model(), bits)`` minimizes the expected error of the whole
        gradient E‖Q(g) − g‖² = V·Σ(histogram) up to the binning (module docstring). Raises
        ValueError when these statistics carry no histogram or an empty one.
        """
        if self.histogram is None:
            raise ValueError(
                "these statistics carry no histogram: build them with "
                "BucketStats.from_gradient(x, bucket_size, histogram=True) or pass "
                "histogram=normalized_histogram(x, bucket_size) to from_buckets"
            )
        if not np.any(self.histogram > 0.0):
            raise ValueError(
                "the histogram is empty: every bucket had zero norm (all-zero gradient); keep "
                "the previous level table"
            )
        return HistogramDistribution(histogram_edges(), self.histogram)


def _block_moments(block: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n_b, m_b, s_b) of the nonzero rows (buckets) of a float64 block (``bucket_moments``)."""
    # scale each bucket by its max |v| before squaring so the norm cannot overflow or underflow
    amax = np.max(np.abs(block), axis=1)
    nz = amax > 0.0
    scaled = block[nz] / amax[nz, None]
    root = np.sqrt(np.einsum("ij,ij->i", scaled, scaled))
    u = scaled / root[:, None]
    return amax[nz] * root, u.mean(axis=1), u.std(axis=1, ddof=1)


def _real_vector(x: object) -> np.ndarray:
    v = np.asarray(x)
    if not np.issubdtype(v.dtype, np.number) or np.iscomplexobj(v):
        raise ValueError(f"x must be a real numeric array, got dtype {v.dtype}")
    v = v.reshape(-1)
    if not np.all(np.isfinite(v)):
        raise ValueError("x contains non-finite values (NaN or inf)")
    return v


def _add_histogram(block: np.ndarray, edges: np.ndarray, out: np.ndarray) -> None:
    """Add the n_b²-weighted bins of the rows (buckets) of a float64 block to ``out``."""
    amax = np.max(np.abs(block), axis=1)
    nz = amax > 0.0
    if not np.any(nz):
        return
    scaled = block[nz] / amax[nz, None]
    root = np.sqrt(np.einsum("ij,ij->i", scaled, scaled))
    r = np.clip(scaled / root[:, None], -1.0, 1.0)
    with np.errstate(over="ignore"):
        n2 = np.square(amax[nz] * root)
    if not np.all(np.isfinite(n2)):
        raise ValueError("a bucket norm is too large: n_b² overflows float64")
    # sorting each bucket first changes no bin (the weight is per bucket) but makes the binary
    # searches run over sorted keys, several times faster than on raw coordinates
    r.sort(axis=1)
    k = np.clip(np.searchsorted(edges, r.ravel(), side="right") - 1, 0, edges.size - 2)
    out += np.bincount(k, weights=np.repeat(n2, block.shape[1]), minlength=edges.size - 1)


def normalized_histogram(x: object, bucket_size: int, edges: object | None = None) -> np.ndarray:
    """n_b²-weighted histogram of the normalized coordinates of ALL buckets of ``x``.

    Bin k holds Σ n_b² over the coordinates i with r_i = v_i/n_b in bin k (binning rule in the
    module docstring), over every bucket of ``bucket_size`` consecutive coordinates of the
    flattened ``x`` — the partial tail bucket included, with its own norm — skipping zero-norm
    buckets. ``edges`` defaults to ``histogram_edges()`` (then the result fits
    ``BucketStats.histogram``). Returns float64 weights, one per bin; Σ weights =
    Σ_b |b|·n_b². Computed in float64 whatever the input dtype, ``_STATS_CHUNK`` coordinates
    at a time. Raises ValueError for non-finite input, bad edges or bucket_size < 2.
    """
    b = _check_bucket_size(bucket_size)
    e = histogram_edges() if edges is None else _check_edges(edges)
    v = _real_vector(x)
    out = np.zeros(e.size - 1, dtype=np.float64)
    n_full = v.size // b
    rows = max(1, _STATS_CHUNK // b)
    for i in range(0, n_full, rows):
        block = np.asarray(v[i * b : min(i + rows, n_full) * b], dtype=np.float64)
        _add_histogram(block.reshape(-1, b), e, out)
    if v.size > n_full * b:
        tail = np.asarray(v[n_full * b :], dtype=np.float64)
        _add_histogram(tail.reshape(1, -1), e, out)
    return out


def _moments(v: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``bucket_moments`` of a checked flat vector v, ``_STATS_CHUNK`` coordinates at a time."""
    n_full = v.size // b
    rows = max(1, _STATS_CHUNK // b)
    parts = [
        _block_moments(
            np.asarray(v[i * b : min(i + rows, n_full) * b], dtype=np.float64).reshape(-1, b)
        )
        for i in range(0, n_full, rows)
    ]
    if not parts:
        parts = [(np.zeros(0), np.zeros(0), np.zeros(0))]
    norms, means, stds = (np.concatenate(p) for p in zip(*parts))
    return norms, means, stds


def bucket_moments(x: object, bucket_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-bucket moments (norms, means, stds) of the full buckets of ``x`` with ‖v_b‖₂ > 0 (§5.1).

    For each full bucket v_b (``bucket_size`` consecutive coordinates of the flattened ``x``;
    the partial tail is skipped) with n_b = ‖v_b‖₂ > 0 and u = v_b/n_b:

        n_b = ‖v_b‖₂,   m_b = (1/B)·Σ_i u_i,   s_b = √(Σ_i (u_i − m_b)²/(B − 1))   (ddof = 1)

    as float64 arrays in bucket order, computed in float64 whatever the input dtype
    (``_STATS_CHUNK`` coordinates at a time); each bucket is scaled by max|v_i| before squaring,
    so n_b neither overflows nor underflows. This is the numpy definition the framework kernels
    match. Raises ValueError for non-finite or non-real input or bucket_size < 2.
    """
    b = _check_bucket_size(bucket_size)
    return _moments(_real_vector(x), b)
