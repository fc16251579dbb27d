"""Level tables, the gradient distribution model, expected variance and level fitting.

Framework-free (numpy + scipy). Spec: ``docs/quantizers.md``.

* ``table``: ``LevelTable`` and table validation (§2, §4).
* ``families``: fixed tables — U-ref, U-paper, E-ref, ternary, natural dithering (§2).
* ``model``: the ``Distribution`` protocol — what the fitters and ``variance`` use of a law F.
* ``distribution``: the truncated-normal mixture F of normalized coordinates (§5, §6).
* ``histogram``: the empirical (histogram) model of F, for heavy tails and sparse gradients
  (§5.1 extension); accepted by every fitter and variance function below.
* ``stats``: per-bucket statistics, their fixed-size exchange format and merge (§5.1, §5.2).
* ``variance``: closed-form V(ℓ; F), symbol probabilities, entropy, Huffman lengths (§6, §10).
* ``alq`` (a package): ALQ / ALQ-N (exact coordinate descent) and ALQ-G (§7).
* ``amq``: AMQ / AMQ-N (the exponential multiplier p) (§8).

A refit on the root is ``stats = BucketStats.merge(gathered, top_k)`` followed by e.g.
``fit_alq(stats.mixture(), bits)`` or ``fit_amq(stats.pooled_normal(), bits)``; with statistics
built by ``BucketStats.from_gradient(g, B, histogram=True)``,
``fit_alq(stats.histogram_model(), bits)`` fits the empirical law instead.
"""

from horovod_aq.levels.alq import alq_descent, alq_initializations, fit_alq, fit_alq_gd
from horovod_aq.levels.amq import amq_multiplier, amq_variance, fit_amq
from horovod_aq.levels.distribution import (
    STD_CEIL,
    STD_FLOOR,
    FoldedTruncatedNormalMixture,
    TruncatedNormalMixture,
)
from horovod_aq.levels.families import (
    check_bits,
    exponential,
    natural,
    separate_levels,
    ternary,
    uniform,
    uniform_with_zero,
)
from horovod_aq.levels.histogram import (
    HISTOGRAM_BINS,
    HISTOGRAM_SCALE,
    FoldedHistogramDistribution,
    HistogramDistribution,
    histogram_bin_index,
    histogram_edges,
)
from horovod_aq.levels.model import Distribution, Law
from horovod_aq.levels.stats import BucketStats, bucket_moments, normalized_histogram
from horovod_aq.levels.table import LevelTable, bits_for, table_hash, validate_levels
from horovod_aq.levels.variance import (
    canonical_huffman_codes,
    entropy,
    expected_variance,
    huffman_code_lengths,
    huffman_expected_length,
    stochastic_rounding_variance,
    symbol_probabilities,
)

__all__ = [
    "HISTOGRAM_BINS",
    "HISTOGRAM_SCALE",
    "STD_CEIL",
    "STD_FLOOR",
    "BucketStats",
    "Distribution",
    "FoldedHistogramDistribution",
    "FoldedTruncatedNormalMixture",
    "HistogramDistribution",
    "Law",
    "LevelTable",
    "TruncatedNormalMixture",
    "alq_descent",
    "alq_initializations",
    "amq_multiplier",
    "amq_variance",
    "bits_for",
    "bucket_moments",
    "canonical_huffman_codes",
    "check_bits",
    "entropy",
    "expected_variance",
    "exponential",
    "fit_alq",
    "fit_alq_gd",
    "fit_amq",
    "histogram_bin_index",
    "histogram_edges",
    "huffman_code_lengths",
    "huffman_expected_length",
    "natural",
    "normalized_histogram",
    "separate_levels",
    "stochastic_rounding_variance",
    "symbol_probabilities",
    "table_hash",
    "ternary",
    "uniform",
    "uniform_with_zero",
    "validate_levels",
]
