"""Per-compressor TensorFlow state: the level table, random stream and refit statistics as variables.

Traced graphs (Horovod's cached ``tf.function``, a user's ``@tf.function`` train step, Keras'
train function) must see refits *without retracing*. So everything a graph reads that changes
between steps lives in ``tf.Variable`` objects owned by one :class:`TFState` per compressor
(``compressor._fw_state["tensorflow"]``, created on first use by :func:`tf_state`):

=================  ==========================================================================
``levels``         float32 [N]: ``codec.float32_levels(table)``, assigned by a table listener
``table_id``       uint8 [8]: header bytes 8..16 (table version u32, table hash u32); a
                   payload header is built in-graph as ``const[:8] ‖ table_id ‖ const[16:]``
                   (:meth:`TFState.header`), the rest of the header never changes at a refit
``recording``      bool: the compressor's schedule wants this step's statistics
``step``           int64: the compressor's step (tags recorded statistics)
``generator``      ``tf.random.Generator`` seeded with ``seed_for_rank(seed, hvd.rank())``
                   (the stock path's stream; its state is part of ``compressor.state_dict()``;
                   the packed exchange draws stateless per-(step, bucket, part) streams)
=================  ==========================================================================

Refit statistics are computed in-graph, on the tensor that is quantized, and written into a
:class:`StatsSlot` (one per traced call site: a fused bucket, or a tensor on the stock path)
inside ``tf.cond(recording, ...)``, so non-recording steps pay nothing. The slot stores
(norms, means, stds) of every full bucket, the n_b²-weighted histogram of normalized
coordinates when the fit uses one (``compressor.wants_histogram``;
:func:`graph_normalized_histogram`), and ``written_at`` = the step. The eager end of the step
(:func:`horovod_aq.tensorflow.refit`) hands every slot written at the current step to
``compressor.record_stats`` (zero buckets dropped) and runs the shared refit protocol
``compressor.end_step(comm)``; slots of stale traces are never written and are ignored.

Variables are created with :func:`state_variable`: eagerly (``tf.init_scope``) and past
``tf.function``'s "singleton variables on the first call" rule, because a call site may first be
traced in a retrace (Keras retraces for a partial last batch, Horovod's cached function for new
shapes).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from horovod_aq import codec
from horovod_aq.compressors import Compressor, seed_for_rank
from horovod_aq.levels.table import LevelTable

logger = logging.getLogger(__name__)

#: Header bytes that change at a refit: table version (u32) and table hash (u32).
TABLE_ID_SLICE = slice(8, 16)


def _direct_creator(next_creator, **kwargs):
    return resource_variable_ops.ResourceVariable(**kwargs)


def state_variable(initial: Any, *, dtype: tf.DType | None = None, name: str = "aq") -> tf.Variable:
    """A non-trainable resource variable created eagerly, even while a ``tf.function`` traces.

    ``tf.init_scope`` lifts creation out of the graph being traced; the creator scope bypasses
    ``tf.function``'s check that variables are only created on its first trace (the variable is
    created and initialized eagerly, so the check's concern — a graph re-creating it on every
    call — does not apply).
    """
    with tf.init_scope(), tf.variable_creator_scope(_direct_creator):
        return tf.Variable(tf.convert_to_tensor(initial, dtype=dtype), trainable=False,
                           name=name)


def table_id_bytes(table: LevelTable) -> np.ndarray:
    """Header bytes 8..16 of a payload encoded with ``table`` (version, hash; little-endian)."""
    raw = codec.make_header(0, table, 2, "l2")
    return np.frombuffer(raw, dtype=np.uint8)[TABLE_ID_SLICE].copy()


def graph_bucket_stats(flat: tf.Tensor, bucket_size: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """(norms, means, stds) in float64 of EVERY full bucket of a flat tensor, graph-safe.

    Same definition as ``codec.bucket_stats`` (u = v/‖v‖₂, std with divisor B − 1) except that
    zero buckets are kept (with mean 0, std 0) so that the shapes are static; the eager side
    drops them (``norms > 0``) before ``compressor.record_stats``.
    """
    n = int(flat.shape.num_elements())
    full = n // bucket_size
    rows = tf.reshape(tf.cast(flat[: full * bucket_size], tf.float64), [full, bucket_size])
    norms = tf.sqrt(tf.reduce_sum(tf.square(rows), axis=1))
    u = rows / tf.where(norms > 0, norms, tf.ones_like(norms))[:, None]
    means = tf.reduce_mean(u, axis=1)
    var = tf.reduce_sum(tf.square(u - means[:, None]), axis=1) / (bucket_size - 1)
    return norms, means, tf.sqrt(var)


def graph_normalized_histogram(flat: tf.Tensor, bucket_size: int) -> tf.Tensor:
    """``levels.stats.normalized_histogram`` in-graph: float64 weights of the default grid.

    Every bucket, the partial tail with its own norm, zero buckets skipped; in float64
    a = max|v|, s = v/a, ρ = √Σs², r = clip(s/ρ, −1, 1), weight (a·ρ)², bin = number of edges
    ≤ r minus one, clamped to [0, H − 1] (the binning rule of ``levels.stats``).
    """
    from horovod_aq.levels.histogram import histogram_edges

    edges_np = histogram_edges()
    bins = edges_np.size - 1
    n = int(flat.shape.num_elements())
    full = n // bucket_size
    x = tf.cast(flat, tf.float64)
    blocks = []
    if full:
        blocks.append(tf.reshape(x[: full * bucket_size], [full, bucket_size]))
    if n > full * bucket_size:
        blocks.append(tf.reshape(x[full * bucket_size:], [1, n - full * bucket_size]))
    out = tf.zeros([bins], tf.float64)
    edges = tf.constant(edges_np[None, :])
    for block in blocks:
        amax = tf.reduce_max(tf.abs(block), axis=1)
        keep = amax > 0
        scaled = block / tf.where(keep, amax, tf.ones_like(amax))[:, None]
        root = tf.sqrt(tf.reduce_sum(tf.square(scaled), axis=1))
        r = tf.clip_by_value(scaled / tf.where(keep, root, tf.ones_like(root))[:, None], -1.0, 1.0)
        weight = tf.where(keep, tf.square(amax * root), tf.zeros_like(amax))
        k = tf.searchsorted(edges, tf.reshape(r, [1, -1]), side="right", out_type=tf.int32) - 1
        k = tf.clip_by_value(tf.reshape(k, [-1]), 0, bins - 1)
        w = tf.reshape(tf.broadcast_to(weight[:, None], tf.shape(block)), [-1])
        out += tf.math.unsorted_segment_sum(w, k, bins)
    return out


class StatsSlot:
    """Variables receiving one call site's bucket statistics on recording steps (and the
    normalized histogram when the compressor's fit uses one, ``wants_histogram``)."""

    def __init__(self, state: TFState, numel: int, name: str) -> None:
        self.state = state
        self.name = name  #: the call site (bucket name or stock call number)
        self.buckets = numel // state.compressor.bucket_size
        zeros = np.zeros(self.buckets, np.float64)
        label = _var_name(name)
        self.norms = state_variable(zeros, name=f"aq_stats_norms_{label}")
        self.means = state_variable(zeros, name=f"aq_stats_means_{label}")
        self.stds = state_variable(zeros, name=f"aq_stats_stds_{label}")
        self.histogram: tf.Variable | None = None
        if getattr(state.compressor, "wants_histogram", False):
            from horovod_aq.levels.histogram import HISTOGRAM_BINS

            self.histogram = state_variable(np.zeros(HISTOGRAM_BINS, np.float64),
                                            name=f"aq_stats_hist_{label}")
        self.written_at = state_variable(np.int64(-1), name=f"aq_stats_step_{label}")

    def record(self, flat: tf.Tensor) -> tf.Tensor:
        """Graph op: when ``state.recording``, write the statistics of ``flat`` and the step."""
        bucket_size = self.state.compressor.bucket_size

        def write() -> tf.Tensor:
            norms, means, stds = graph_bucket_stats(flat, bucket_size)
            ops = [self.norms.assign(norms), self.means.assign(means), self.stds.assign(stds)]
            if self.histogram is not None:
                ops.append(self.histogram.assign(graph_normalized_histogram(flat, bucket_size)))
            with tf.control_dependencies(ops):
                return tf.identity(self.written_at.assign(self.state.step.read_value()))

        def skip() -> tf.Tensor:
            return tf.constant(-1, tf.int64)

        return tf.cond(self.state.recording.read_value(), write, skip)

    def read(self, step: int) -> tuple[np.ndarray, ...] | None:
        """(norms, means, stds, histogram or None) if written at ``step`` (eager); zero buckets
        dropped."""
        if int(self.written_at.numpy()) != step:
            return None
        norms = self.norms.numpy()
        keep = norms > 0
        histogram = self.histogram.numpy() if self.histogram is not None else None
        return norms[keep], self.means.numpy()[keep], self.stds.numpy()[keep], histogram


class TFState:
    """The TensorFlow variables of one compressor (see the module docstring)."""

    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self.lock = threading.Lock()
        self.slots: list[StatsSlot] = []
        #: Packed exchanges built on this compressor (``horovod_aq.tensorflow.packed``), by key.
        self.exchanges: dict[tuple, Any] = {}
        name = _var_name(compressor.name)
        self.levels: tf.Variable | None = None
        self.table_id: tf.Variable | None = None
        if compressor.quantizes:
            table = compressor.table
            self.levels = state_variable(codec.float32_levels(table), name=f"aq_levels_{name}")
            self.table_id = state_variable(table_id_bytes(table), name=f"aq_table_{name}")
            compressor.add_table_listener(self._on_table)
        self.recording = state_variable(bool(compressor.recording), name=f"aq_recording_{name}")
        self.step = state_variable(np.int64(compressor.step), name=f"aq_step_{name}")
        with tf.init_scope(), tf.variable_creator_scope(_direct_creator):
            self.generator = tf.random.Generator.from_seed(
                seed_for_rank(compressor.seed, _rank()))
        self._synced_step = compressor.step

    # ------------------------------------------------------------------ eager updates
    def _on_table(self, table: LevelTable) -> None:
        """Table listener: copy a new (refitted or loaded) table into the variables."""
        with tf.init_scope():
            self.levels.assign(codec.float32_levels(table))
            self.table_id.assign(table_id_bytes(table))

    def sync(self) -> None:
        """Copy the compressor's step and recording flag into the variables (eager)."""
        with tf.init_scope():
            self.recording.assign(bool(self.compressor.recording))
            self.step.assign(np.int64(self.compressor.step))
        self._synced_step = self.compressor.step

    @property
    def in_sync(self) -> bool:
        return self._synced_step == self.compressor.step

    # ------------------------------------------------------------------ graph helpers
    def header(self, numel: int) -> tf.Tensor:
        """The 32 header bytes of a payload of ``numel`` elements for the *current* table."""
        comp = self.compressor
        const = np.frombuffer(codec.make_header(numel, comp.table, comp.bucket_size, comp.norm),
                              dtype=np.uint8)
        return tf.concat([tf.constant(const[:TABLE_ID_SLICE.start]), self.table_id.read_value(),
                          tf.constant(const[TABLE_ID_SLICE.stop:])], axis=0)

    def new_slot(self, numel: int, name: str) -> StatsSlot | None:
        """A statistics slot for a call site quantizing ``numel`` elements (None: a compressor
        that is never refitted, or nothing to record)."""
        comp = self.compressor
        if not comp.adaptive or numel == 0 or (
                numel // comp.bucket_size == 0 and not getattr(comp, "wants_histogram", False)):
            return None
        slot = StatsSlot(self, numel, name)
        with self.lock:
            self.slots.append(slot)
        return slot

    def flush_stats(self) -> int:
        """Hand the statistics recorded at the current step to the compressor (eager); returns
        the number of slots read."""
        step = self.compressor.step
        with self.lock:
            slots = list(self.slots)
        used = 0
        for slot in slots:
            stats = slot.read(step)
            if stats is not None:
                used += 1
                norms, means, stds, histogram = stats
                if histogram is not None:
                    self.compressor.record_stats(norms, means, stds, histogram=histogram)
                elif norms.size:
                    self.compressor.record_stats(norms, means, stds)
        return used

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.state.numpy().copy(),
                "algorithm": int(self.generator.algorithm)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "generator" in state:
            if int(state.get("algorithm", self.generator.algorithm)) != int(self.generator.algorithm):
                raise ValueError("the saved TensorFlow random stream uses another RNG algorithm")
            with tf.init_scope():
                self.generator.state.assign(np.asarray(state["generator"], dtype=np.int64))
        self.sync()


def _var_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in text)


def _rank() -> int:
    try:
        import horovod.tensorflow as hvd

        return hvd.rank() if hvd.is_initialized() else 0
    except ImportError:  # pragma: no cover - the integration requires Horovod
        return 0


def check_supported(compressor: Compressor) -> None:
    """Refuse compressors whose per-step state the TensorFlow integration does not carry yet."""
    from horovod_aq.dqsgd import DQSGD
    from horovod_aq.error_feedback import ErrorFeedback

    if isinstance(compressor, (DQSGD, ErrorFeedback)):
        raise NotImplementedError(
            f"{type(compressor).__name__} is not supported with TensorFlow yet (dynamic bit widths "
            "change the traced payload shapes; error-feedback memory needs per-bucket graph "
            "variables); use it with horovod_aq.torch.DistributedOptimizer, or a fixed-width "
            "compressor with TensorFlow")


def tf_state(compressor: Compressor) -> TFState:
    """The compressor's :class:`TFState` (created on first use; restores a saved random stream)."""
    state = compressor._fw_state.get("tensorflow")
    if state is None:
        check_supported(compressor)
        state = TFState(compressor)
        pending = getattr(compressor, "_pending_framework_state", {}).pop("tensorflow", None)
        if pending is not None:
            state.load_state_dict(pending)
        compressor._fw_state["tensorflow"] = state
    return state
