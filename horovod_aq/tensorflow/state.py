"""Per-compressor TensorFlow state: level table, random stream and refit statistics as variables.

Traced graphs (Horovod's cached ``tf.function``, a user's ``@tf.function`` train step, Keras'
train function) must see refits *without retracing*. So everything a graph reads that changes
between steps lives in ``tf.Variable`` objects owned by one :class:`TFState` per compressor
(``compression.quantizer.framework_state("tensorflow")``, created on first use by
:func:`tf_state`; for an ErrorFeedback that is its quantizer's):

=================  ==========================================================================
``levels``         float32 [N]: ``codec.float32_levels(table)``, assigned by a table listener
                   (fixed-width compressors; DQSGD keeps one per width in ``widths``)
``table_id``       uint8 [8]: header bytes 8..16 (table version u32, table hash u32); a
                   payload header is built in-graph as ``const[:8] ‖ table_id ‖ const[16:]``
                   (:meth:`TFState.header`), the rest of the header never changes at a refit
``recording``      bool: the compressor's schedule wants this step's statistics
``step``           int64: the compressor's step (tags recorded statistics)
``generator``      ``tf.random.Generator`` seeded with ``seed_for_rank(seed, hvd.rank())``
                   (the stock path's stream; its state is part of ``compressor.state_dict()``;
                   the packed exchange draws stateless per-(step, bucket, part) streams)
``widths``         one :class:`WidthState` (``levels`` + ``table_id`` of that width's table)
                   per code width: one for a fixed-width compressor (``levels``/``table_id``
                   above are its variables), one per width in [min_bits, max_bits] for
                   :class:`~horovod_aq.DQSGD`, each assigned by that width's table listener
``width_index``    int32 (DQSGD only): position of ``compressor.bits`` among the widths; the
                   packed exchange selects its encode/decode branch with ``tf.switch_case`` on
                   it, so a new width never retraces
``memory``         (compressions with an ``error_memory`` only) float32 [numel] per fused
                   bucket, keyed by bucket name: the error memory h, updated in-graph; the same
                   variables are the values of ``error_memory.memory``, so the core's
                   ``state_dict()`` and ``memory_norm()`` read them
=================  ==========================================================================

The eager :meth:`TFState.sync` (run by ``refit`` after every step) copies step, recording flag
and width into the variables, and re-installs the memory variables when the core replaced
``error_memory.memory`` (``load_state_dict``, ``reset``): the saved (or zero) memory is
assigned into the existing variables, which every traced graph keeps reading.

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

import dataclasses
import logging
import threading
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from horovod_aq import codec
from horovod_aq.backend import horovod_world
from horovod_aq.codec import TABLE_ID_SLICE
from horovod_aq.compressors import Compressor, seed_for_rank
from horovod_aq.levels.table import LevelTable
from horovod_aq.tensorflow.stats import graph_bucket_moments, graph_normalized_histogram

logger = logging.getLogger(__name__)


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


class StatsSlot:
    """Variables receiving one call site's bucket statistics on recording steps (and the
    normalized histogram when the compressor's fit uses one, ``wants_histogram``)."""

    def __init__(self, state: TFState, numel: int, name: str) -> None:
        self.state = state
        self.name = name  #: the call site (bucket name or stock call number)
        self.buckets = numel // state.quantizer.bucket_size
        zeros = np.zeros(self.buckets, np.float64)
        label = _var_name(name)
        self.norms = state_variable(zeros, name=f"aq_stats_norms_{label}")
        self.means = state_variable(zeros, name=f"aq_stats_means_{label}")
        self.stds = state_variable(zeros, name=f"aq_stats_stds_{label}")
        self.histogram: tf.Variable | None = None
        if state.quantizer.wants_histogram:
            from horovod_aq.levels.histogram import HISTOGRAM_BINS

            self.histogram = state_variable(np.zeros(HISTOGRAM_BINS, np.float64),
                                            name=f"aq_stats_hist_{label}")
        self.written_at = state_variable(np.int64(-1), name=f"aq_stats_step_{label}")

    def record(self, flat: tf.Tensor, *, finite_only: bool = True) -> tf.Tensor:
        """Graph op: when ``state.recording``, write the statistics of ``flat`` and the step.

        With ``finite_only`` (default) a ``flat`` holding NaN/Inf (a step that every rank skips
        or raises on, e.g. a loss-scale overflow) writes nothing: its statistics would poison
        the fit, so this rank contributes nothing from this call site at this step (the check
        runs on recording steps only)."""
        bucket_size = self.state.quantizer.bucket_size

        def write() -> tf.Tensor:
            norms, means, stds = graph_bucket_moments(flat, bucket_size)
            ops = [self.norms.assign(norms), self.means.assign(means), self.stds.assign(stds)]
            if self.histogram is not None:
                ops.append(self.histogram.assign(graph_normalized_histogram(flat, bucket_size)))
            with tf.control_dependencies(ops):
                return tf.identity(self.written_at.assign(self.state.step.read_value()))

        def skip() -> tf.Tensor:
            return tf.constant(-1, tf.int64)

        def guarded() -> tf.Tensor:
            return tf.cond(tf.reduce_all(tf.math.is_finite(flat)), write, skip)

        return tf.cond(self.state.recording.read_value(), guarded if finite_only else write, skip)

    def read(self, step: int) -> tuple[np.ndarray, ...] | None:
        """(norms, means, stds, histogram or None) if written at ``step`` (eager); zero buckets
        dropped."""
        if int(self.written_at.numpy()) != step:
            return None
        norms = self.norms.numpy()
        keep = norms > 0
        histogram = self.histogram.numpy() if self.histogram is not None else None
        return norms[keep], self.means.numpy()[keep], self.stds.numpy()[keep], histogram


@dataclasses.dataclass(eq=False)
class WidthState:
    """The variables of one code width: its table's float32 levels and header identity bytes.

    ``source`` is the compressor whose ``table`` this width encodes with (the compressor
    itself, or ``DQSGD.widths[b]``); its table listener keeps the variables current."""

    bits: int                      #: ``source.table.bits``: the payload's code width
    source: Compressor
    levels: tf.Variable
    table_id: tf.Variable

    def on_table(self, table: LevelTable) -> None:
        """Table listener: copy a new (refitted or loaded) table into the variables."""
        with tf.init_scope():
            self.levels.assign(codec.float32_levels(table))
            self.table_id.assign(table_id_bytes(table))

    def header(self, numel: int, bucket_size: int, norm: str) -> tf.Tensor:
        """The 32 header bytes of a payload of ``numel`` elements for this width's *current*
        table (``const[:8] ‖ table_id ‖ const[16:]``)."""
        const = np.frombuffer(codec.make_header(numel, self.source.table, bucket_size, norm),
                              dtype=np.uint8)
        return tf.concat([tf.constant(const[:TABLE_ID_SLICE.start]), self.table_id.read_value(),
                          tf.constant(const[TABLE_ID_SLICE.stop:])], axis=0)


class TFState:
    """The TensorFlow variables of one compressor (see the module docstring)."""

    def __init__(self, compressor: Any) -> None:
        self.compressor = compressor
        #: The compressor that owns tables, bits, step and refits (``compressor.quantizer``).
        self.quantizer: Compressor = compressor.quantizer
        #: The ECQ-SGD memory whose values live in :attr:`memory` (else None).
        self.error_memory = compressor.error_memory
        #: Whether the code width changes per step (DQSGD): selects a branch per width.
        self.dynamic = bool(compressor.dynamic_width)
        self.lock = threading.Lock()
        self.slots: list[StatsSlot] = []
        #: Packed exchanges built on this compressor (``horovod_aq.tensorflow.packed``), by key.
        self.exchanges: dict[tuple, Any] = {}
        name = _var_name(compressor.name)
        q = self.quantizer
        self.widths: list[WidthState] = []
        self.levels: tf.Variable | None = None
        self.table_id: tf.Variable | None = None
        self.width_index: tf.Variable | None = None
        if compressor.quantizes:
            for bits, source in compressor.tables_by_width().items():
                suffix = f"_b{bits}" if self.dynamic else ""
                table = source.table
                width = WidthState(
                    table.bits, source,
                    state_variable(codec.float32_levels(table), name=f"aq_levels_{name}{suffix}"),
                    state_variable(table_id_bytes(table), name=f"aq_table_{name}{suffix}"))
                source.add_table_listener(width.on_table)
                self.widths.append(width)
            if not self.dynamic:
                self.levels, self.table_id = self.widths[0].levels, self.widths[0].table_id
            else:
                self.width_index = state_variable(np.int32(self._width_position()),
                                                  name=f"aq_width_{name}")
        self.recording = state_variable(bool(q.recording), name=f"aq_recording_{name}")
        self.step = state_variable(np.int64(q.step), name=f"aq_step_{name}")
        #: ErrorFeedback memory variables by bucket name (see :meth:`memory_variable`).
        self.memory: dict[str, tf.Variable] = {}
        #: In-graph resets of a non-finite memory (``reset_on_nonfinite``); logged by refit.
        self.memory_resets = (state_variable(np.int64(0), name=f"aq_ef_resets_{name}")
                              if self.error_memory is not None else None)
        self._resets_seen = 0
        with tf.init_scope(), tf.variable_creator_scope(_direct_creator):
            self.generator = tf.random.Generator.from_seed(
                seed_for_rank(q.seed, horovod_world("horovod.tensorflow")[0]))
        self._synced = self._sync_key()

    # ------------------------------------------------------------------ eager updates
    def _width_position(self) -> int:
        """Position of the current width among :attr:`widths` (dynamic widths)."""
        q = self.quantizer
        keys = [w.bits for w in self.widths]
        if q.bits not in keys:
            raise ValueError(f"{q.name}: bits={q.bits} is not one of its widths {keys}")
        return keys.index(q.bits)

    def _sync_key(self) -> tuple[int, int]:
        q = self.quantizer
        return (q.step, q.bits if self.dynamic else -1)

    def sync(self) -> None:
        """Copy the compressor's step, recording flag and (DQSGD) width into the variables and
        re-install error-feedback memory the core replaced (eager)."""
        with tf.init_scope():
            self.recording.assign(bool(self.quantizer.recording))
            self.step.assign(np.int64(self.quantizer.step))
            if self.width_index is not None:
                self.width_index.assign(np.int32(self._width_position()))
            self._sync_memory()
        self._synced = self._sync_key()

    @property
    def in_sync(self) -> bool:
        """Whether the variables hold the compressor's step and width (no change behind
        :meth:`sync`'s back, e.g. a ``load_state_dict`` between steps)."""
        return self._synced == self._sync_key()

    # ------------------------------------------------------------------ error feedback
    def memory_variable(self, key: str, numel: int) -> tf.Variable:
        """The float32 [numel] memory variable of the fused bucket ``key`` (error feedback).

        Created on first use (eagerly, also while a graph traces) from the memory the compressor
        holds for ``key`` — a loaded checkpoint's, if its shape matches (the core's
        ``ErrorMemory.saved`` decides and warns) — else zeros, and installed as
        ``error_memory.memory[key]``."""
        ef = self.error_memory
        if ef is None:
            raise TypeError(f"{self.compressor.name} keeps no error-feedback memory")
        with self.lock:
            var = self.memory.get(key)
            if var is not None:
                if int(var.shape.num_elements()) != numel:
                    raise ValueError(f"{ef.name}: bucket {key!r} has {numel} elements, its error "
                                     f"memory {int(var.shape.num_elements())}")
                return var
            var = state_variable(self._initial_memory(key, numel), dtype=tf.float32,
                                 name=f"aq_ef_{_var_name(key)}")
            self.memory[key] = var
            ef.memory[key] = var
            return var

    def _initial_memory(self, key: str, numel: int) -> np.ndarray:
        """The value a memory variable starts from: what the compressor holds for ``key`` (a
        loaded checkpoint's, when its shape matches: the core's ``ErrorMemory.saved`` decides
        and warns), else zeros."""
        ef = self.error_memory
        assert ef is not None
        zeros = np.zeros(numel, np.float32)
        saved = ef.saved(key, zeros)
        return zeros if saved is None else np.asarray(saved, dtype=np.float32).reshape(numel)

    def _sync_memory(self) -> None:
        """Re-install memory variables that ``error_memory.memory`` no longer holds (eager)."""
        ef = self.error_memory
        if ef is None:
            return
        with self.lock:
            items = list(self.memory.items())
        for key, var in items:
            if ef.memory.get(key) is var:
                continue
            var.assign(self._initial_memory(key, int(var.shape.num_elements())))
            ef.memory[key] = var

    def take_memory_resets(self) -> int:
        """In-graph memory resets since the last call (eager)."""
        if self.memory_resets is None:
            return 0
        total = int(self.memory_resets.numpy())
        new, self._resets_seen = total - self._resets_seen, total
        return new

    # ------------------------------------------------------------------ graph helpers
    def header(self, numel: int) -> tf.Tensor:
        """The 32 header bytes of a payload of ``numel`` elements for the *current* table of a
        fixed-width compressor."""
        if len(self.widths) != 1:
            raise TypeError(f"{self.compressor.name} has {len(self.widths)} code widths; use "
                            "its WidthState.header")
        q = self.quantizer
        return self.widths[0].header(numel, q.bucket_size, q.norm)

    def new_slot(self, numel: int, name: str) -> StatsSlot | None:
        """A statistics slot for a call site quantizing ``numel`` elements (None: a compressor
        that is never refitted, or nothing to record)."""
        q = self.quantizer
        if not q.adaptive or numel == 0 or (numel // q.bucket_size == 0 and not q.wants_histogram):
            return None
        slot = StatsSlot(self, numel, name)
        with self.lock:
            self.slots.append(slot)
        return slot

    def flush_stats(self) -> int:
        """Hand the statistics recorded at the current step to the compressor (eager); returns
        the number of slots read."""
        q = self.quantizer
        step = q.step
        with self.lock:
            slots = list(self.slots)
        used = 0
        for slot in slots:
            stats = slot.read(step)
            if stats is not None:
                used += 1
                norms, means, stds, histogram = stats
                if histogram is not None:
                    q.record_stats(norms, means, stds, histogram=histogram)
                elif norms.size:
                    q.record_stats(norms, means, stds)
        return used

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.state.numpy().copy(),
                "algorithm": int(self.generator.algorithm)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "generator" in state:
            if (int(state.get("algorithm", self.generator.algorithm))
                    != int(self.generator.algorithm)):
                raise ValueError("the saved TensorFlow random stream uses another RNG algorithm")
            with tf.init_scope():
                self.generator.state.assign(np.asarray(state["generator"], dtype=np.int64))
        self.sync()


def _var_name(text: str) -> str:
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in text)


def tf_state(compression: Any) -> TFState:
    """The :class:`TFState` of ``compression``, kept by its quantizer (created on first use;
    restores a saved random stream)."""
    return compression.quantizer.framework_state("tensorflow", lambda: TFState(compression))
