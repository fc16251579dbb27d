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


class EncodeRecorder:
    """Record every payload the packed torch optimizer encodes, with its bucket and phase.

    Phases: "submit" (allgather payload, or one of the P two-phase chunks in order) and "reencode"
    (the two-phase averaged chunk). Entries are (bucket name, phase, input ndarray,
    payload ndarray).
    """

    def __init__(self):
        from horovod_aq.torch import optimizer as opt_mod

        self.mod = opt_mod
        self.entries = []
        self._context = None

    def __enter__(self):
        cls = self.mod._PackedOptimizer
        self._saved = (cls._aq_encode, cls._aq_submit, cls._aq_progress)
        enc, sub, prog = self._saved
        rec = self

        def _aq_encode(opt, x, *args):
            out = enc(opt, x, *args)
            name, phase = rec._context
            rec.entries.append((name, phase, x.detach().cpu().numpy().copy(),
                                out.detach().cpu().numpy().copy()))
            return out

        def _aq_submit(opt, bucket):
            rec._context = (bucket.name, "submit")
            return sub(opt, bucket)

        def _aq_progress(opt, bucket):
            rec._context = (bucket.name, "reencode")
            return prog(opt, bucket)

        cls._aq_encode, cls._aq_submit, cls._aq_progress = _aq_encode, _aq_submit, _aq_progress
        return self

    def __exit__(self, *exc):
        cls = self.mod._PackedOptimizer
        cls._aq_encode, cls._aq_submit, cls._aq_progress = self._saved
        return False


class ChecksumFlags:
    """Within ``with``: record whether each payload ``horovod_aq.torch.kernels.encode`` writes
    carries ``FLAG_CHECKSUM``; ``seen()`` gives the distinct flag values (``[0]``: none did,
    ``[FLAG_CHECKSUM]``: all did)."""

    def __enter__(self):
        from horovod_aq import codec
        from horovod_aq.torch import kernels

        self._kernels, self._encode, self.flags = kernels, kernels.encode, []
        encode = self._encode

        def recorded(*args, **kwargs):
            out = encode(*args, **kwargs)
            self.flags.append(int(out[codec.FLAGS_OFFSET]) & codec.FLAG_CHECKSUM)
            return out

        kernels.encode = recorded
        return self

    def __exit__(self, *exc):
        self._kernels.encode = self._encode
        return False

    def seen(self) -> list[int]:
        return sorted(set(self.flags))
