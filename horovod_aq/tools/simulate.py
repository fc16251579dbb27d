"""Data-parallel SGD with quantized gradients, simulated in one process with numpy.

P workers each compute a minibatch gradient, send it through a compressor exactly as a rank
would (error compensation, the numpy codec's encode/decode with the current level table,
refit statistics), the decoded payloads are averaged, and the model takes an SGD step. The
compressor sees the same ``end_step`` protocol as on real ranks, over a single-process
:class:`~horovod_aq.refit.LocalComm`. Used by the linear-model benchmark (the ECQ-SGD paper's
synthetic least squares) and by tests of DQSGD and ECQ-SGD.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from horovod_aq import codec
from horovod_aq.refit import LocalComm


@dataclass(frozen=True)
class LeastSquares:
    """min_w f(w) = ‖A·w − b‖² / (2n), with b = A·w* + noise (the ECQ paper's Syn-d data)."""

    A: np.ndarray
    b: np.ndarray
    w_star: np.ndarray

    @classmethod
    def synthetic(cls, n: int = 10_000, dim: int = 256, noise: float = 0.1,
                  seed: int = 0) -> "LeastSquares":
        rng = np.random.default_rng(seed)
        A = rng.standard_normal((n, dim))
        w_star = rng.standard_normal(dim)
        b = A @ w_star + noise * rng.standard_normal(n)
        return cls(A, b, w_star)

    def loss(self, w: np.ndarray) -> float:
        r = self.A @ w - self.b
        return float(r @ r / (2 * len(self.b)))

    def gradient(self, w: np.ndarray, rows: np.ndarray) -> np.ndarray:
        A = self.A[rows]
        return A.T @ (A @ w - self.b[rows]) / len(rows)


@dataclass
class Run:
    """Loss after every step (index 0 = before training) and the bits of every step."""

    losses: np.ndarray
    bits: np.ndarray
    distance: float


def run_sgd(problem: LeastSquares, compressor: Any, *, workers: int = 4,
            steps: int = 500, lr: float = 0.02, batch: int = 32, seed: int = 0) -> Run:
    """Simulate ``steps`` of data-parallel SGD; ``compressor=None`` is full-precision SGD."""
    rng = np.random.default_rng(seed)
    w = np.zeros(problem.A.shape[1])
    losses, bits = [problem.loss(w)], []
    comm = LocalComm()
    ef = compressor.error_memory if compressor is not None else None
    q = compressor.quantizer if compressor is not None else None
    for _ in range(steps):
        decoded = []
        for p in range(workers):
            g = problem.gradient(w, rng.integers(0, len(problem.b), batch))
            if compressor is None:
                decoded.append(g)
                continue
            x = ef.compensate(f"worker{p}", g) if ef is not None else g
            if q.recording:
                q.record_gradient(x)
            payload = codec.encode(x.astype(np.float32), q.table, bucket_size=q.bucket_size,
                                   norm=q.norm, seed=int(rng.integers(2**63)))
            g_hat = codec.decode(payload, q.table).astype(np.float64)
            if ef is not None:
                ef.update(f"worker{p}", g, g_hat)
            decoded.append(g_hat)
        avg = np.mean(decoded, axis=0)
        if q is not None:
            bits.append(q.bits)
            q.observe_aggregate(avg)
            q.end_step(comm)
        w = w - lr * avg
        losses.append(problem.loss(w))
    return Run(np.array(losses), np.array(bits), float(np.linalg.norm(w - problem.w_star)))
