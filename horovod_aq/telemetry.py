"""Per-step numbers: bits per coordinate, bytes on the wire, level tables, refits.

The packed integrations fill one :class:`StepRecord` per optimizer step and hand it to a
:class:`Telemetry`, which keeps the recent history, logs a line every ``log_every`` steps and
forwards each record to its sinks: :class:`JsonlSink` (one JSON object per line, the default
for scripts) and :class:`TensorBoardSink` (torch's ``SummaryWriter`` or ``tf.summary``, when
available). ``bytes_sent`` counts what this rank puts on the wire for gradients in one step
(ring algorithms, ``docs/protocol.md`` §5.3); ``bytes_fp32`` is what a fp32 ring allreduce of the
same gradients would send, so ``compression_ratio = bytes_fp32 / bytes_sent``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
from typing import Any, Protocol

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class StepRecord:
    """What one optimizer step sent (this rank's view)."""

    step: int
    method: str
    ranks: int
    numel: int = 0              #: gradient coordinates exchanged (quantized + uncompressed)
    numel_quantized: int = 0    #: of which quantized
    payload_bytes: int = 0      #: bytes of this rank's encoded payloads (quantized part)
    bytes_sent: int = 0         #: bytes this rank sent for gradients
    bytes_fp32: int = 0         #: bytes a fp32 ring allreduce would send
    table_version: int = -1
    bits: int = 0               #: code width of this step's payloads (DQSGD varies it)
    exchanges: dict[str, int] = dataclasses.field(default_factory=dict)  #: mode → buckets
    refit: bool = False
    levels: list[float] | None = None  #: the new table, on refit steps
    extra: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def bits_per_coordinate(self) -> float:
        """Bits of payload per quantized coordinate, header and norms included."""
        return 8.0 * self.payload_bytes / self.numel_quantized if self.numel_quantized else 0.0

    @property
    def compression_ratio(self) -> float:
        return self.bytes_fp32 / self.bytes_sent if self.bytes_sent else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["bits_per_coordinate"] = self.bits_per_coordinate
        d["compression_ratio"] = self.compression_ratio
        return d


class Sink(Protocol):
    def write(self, record: StepRecord) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Append each record as one JSON line to ``path`` (directories are created)."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: StepRecord) -> None:
        self._file.write(json.dumps(record.as_dict()) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars per step to TensorBoard through ``writer.add_scalar`` (torch SummaryWriter) or a
    ``tf.summary`` file writer (pass ``framework="tensorflow"`` and a log directory)."""

    SCALARS = ("bits_per_coordinate", "compression_ratio", "bytes_sent", "table_version")

    def __init__(self, logdir: str, framework: str = "torch") -> None:
        self.framework = framework
        if framework == "torch":
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(logdir)
        elif framework == "tensorflow":
            import tensorflow as tf

            self._tf = tf
            self._writer = tf.summary.create_file_writer(logdir)
        else:
            raise ValueError(f"framework must be 'torch' or 'tensorflow', got {framework!r}")

    def write(self, record: StepRecord) -> None:
        values = record.as_dict()
        scalars = {f"horovod_aq/{k}": float(values[k]) for k in self.SCALARS}
        scalars.update({f"horovod_aq/{k}": float(v) for k, v in record.extra.items()})
        if self.framework == "torch":
            for tag, v in scalars.items():
                self._writer.add_scalar(tag, v, record.step)
        else:
            with self._writer.as_default():
                for tag, v in scalars.items():
                    self._tf.summary.scalar(tag, v, step=record.step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class Telemetry:
    """Collects :class:`StepRecord` objects; ``last``, ``history`` and ``totals()`` for reports."""

    def __init__(self, sinks: list[Sink] | tuple[Sink, ...] = (), *, history: int = 1000,
                 log_every: int = 100) -> None:
        self.sinks = list(sinks)
        self.history: collections.deque[StepRecord] = collections.deque(maxlen=history)
        self.log_every = log_every
        self._totals = {"steps": 0, "numel": 0, "numel_quantized": 0, "payload_bytes": 0,
                        "bytes_sent": 0, "bytes_fp32": 0, "refits": 0}

    @property
    def last(self) -> StepRecord | None:
        return self.history[-1] if self.history else None

    def record(self, rec: StepRecord) -> None:
        self.history.append(rec)
        t = self._totals
        t["steps"] += 1
        for key in ("numel", "numel_quantized", "payload_bytes", "bytes_sent", "bytes_fp32"):
            t[key] += getattr(rec, key)
        t["refits"] += int(rec.refit)
        for sink in self.sinks:
            sink.write(rec)
        if rec.refit:
            logger.info("step %d: %s refit -> table v%d", rec.step, rec.method, rec.table_version)
        if self.log_every and rec.step % self.log_every == 0:
            logger.info("step %d: %s %.3f bits/coord, %d B sent (%.1fx less than fp32), table v%d",
                        rec.step, rec.method, rec.bits_per_coordinate, rec.bytes_sent,
                        rec.compression_ratio, rec.table_version)

    def totals(self) -> dict[str, float]:
        """Sums since creation plus the overall bits/coordinate and compression ratio."""
        t = dict(self._totals)
        t["bits_per_coordinate"] = (8.0 * t["payload_bytes"] / t["numel_quantized"]
                                    if t["numel_quantized"] else 0.0)
        t["compression_ratio"] = t["bytes_fp32"] / t["bytes_sent"] if t["bytes_sent"] else 0.0
        return t

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
