"""Helpers that run inside Horovod ranks (imported by the multi-process checks)."""

from __future__ import annotations

import os


def init_torch():
    """Import torch + horovod.torch with one thread, init Horovod; return (torch, hvd)."""
    import horovod.torch as hvd
    import torch

    import horovod_aq.torch  # noqa: F401  (lets mpi4py initialize MPI first under mpirun)

    torch.set_num_threads(1)
    hvd.init()
    return torch, hvd


def init_tf():
    """Import TensorFlow + horovod.tensorflow, one thread each, init Horovod; return (tf, hvd)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from horovod_aq import mpi

    mpi.preinit(horovod_initialized=hvd.is_initialized())

    if not getattr(init_tf, "_threads_set", False):
        try:
            tf.config.threading.set_intra_op_parallelism_threads(1)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError:  # already initialized by an earlier check in this rank
            pass
        init_tf._threads_set = True
    hvd.init()
    return tf, hvd


def tiny_model(torch, seed: int = 0, sizes=(20, 64, 10)):
    """A small deterministic MLP (same weights on every rank for a given seed)."""
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def record_ddp_submits(state, log, sent=None):
    """Log, through the DDP hook engine's public tap (``state.wire.tap``), every unit's input
    (the concatenation of the parts it encoded, without the two-phase padding) with its table
    and step (tests/test_ddp.py, benchmarks/gpu_check_ddp.py); ``sent``: a list that gets every
    payload with its stream key's fields and table."""
    import numpy as np

    q, P = state.compression.quantizer, state.ranks
    parts_of = {}

    def tap(unit, part, values, payload):
        if sent is not None:
            sent.append({"step": q.step, "index": unit.index, "part": part,
                         "values": values.detach().cpu().numpy().copy(),
                         "payload": payload.detach().cpu().numpy().copy(),
                         "levels": q.table.levels.copy(), "version": q.table.version,
                         "norm": q.norm})
        parts = 1 if unit.mode == "allgather" else P
        if part >= parts:          # the re-encoded two-phase chunk
            return
        got = parts_of.setdefault(unit.name, [])
        got.append(values.detach().cpu().numpy().copy())
        if len(got) < parts:
            return
        del parts_of[unit.name]
        log.append({"index": unit.index, "name": unit.name, "mode": unit.mode,
                    "names": list(unit.names), "raw": np.concatenate(got)[:unit.numel],
                    "levels": q.table.levels.copy(), "version": q.table.version,
                    "step": q.step, "bits": q.table.bits, "norm": q.norm})
    state.wire.tap = tap


class EncodeRecorder:
    """Record every payload a packed torch exchange encodes, through the engine's public tap
    (``Wire.tap``): from construction on, or within ``with``.

    Phases: "submit" (allgather payload, or one of the P two-phase chunks in order) and "reencode"
    (the two-phase averaged chunk, stream part P). Entries are (bucket name, phase, input
    ndarray, payload ndarray).
    """

    def __init__(self, wire):
        self.wire = wire
        self.entries = []
        wire.tap = self._tap

    def _tap(self, bucket, part, values, payload):
        phase = "reencode" if bucket.mode == "two_phase" and part == self.wire.ranks else "submit"
        self.entries.append((bucket.name, phase, values.detach().cpu().numpy().copy(),
                             payload.detach().cpu().numpy().copy()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.wire.tap = None
        return False


class ChecksumFlags(EncodeRecorder):
    """Within ``with``: whether each payload the engine ``wire`` encodes carries
    ``FLAG_CHECKSUM``; ``seen()`` gives the distinct flag values (``[0]``: none did,
    ``[FLAG_CHECKSUM]``: all did)."""

    def seen(self) -> list[int]:
        from horovod_aq import codec

        return sorted({int(payload[codec.FLAGS_OFFSET]) & codec.FLAG_CHECKSUM
                       for _, _, _, payload in self.entries})


def assert_same_runs(ranks, skipped) -> None:
    """The ``device_decided`` checks (test_ddp, test_torch_optimizer): on every rank the run
    with CPU's kernels and the run with the Triton kernels skipped the same steps and hold the
    same bits, parameters and error memories."""
    for r in ranks:
        assert r["fused"]["skipped"] == r["triton"]["skipped"] == skipped
        for key in ("params", "memory"):
            cpu, device = r["fused"][key], r["triton"][key]
            assert cpu.keys() == device.keys() and cpu
            for name in cpu:
                assert cpu[name].tobytes() == device[name].tobytes(), (key, name)
