"""ECQ-SGD's fused send on CUDA (Triton) as ``codec.encode_compensated``'s functions: one part
compensated, encoded and its new memory written in one kernel (``torch.triton_send.Send``, whose
docstring has the arithmetic; docs/dynamic.md §2.6), its outcome read on the host, and the
payload that travels (entropy-coded or sealed with its checksum where asked).

:func:`encode_compensated` raises the oracle's error where x cannot be encoded;
:func:`try_encode_compensated` returns None there; :func:`finish` makes the travelling payload
of a fixed-width one. Tested under ``TRITON_INTERPRET=1`` on CPU tensors
(``tests/test_triton_compensated.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from horovod_aq import codec
from horovod_aq.codec import reference
from horovod_aq.codec.reference import Compensated
from horovod_aq.codec.stream import StreamKey
from horovod_aq.levels.table import LevelTable
from horovod_aq.torch import payload as common
from horovod_aq.torch.triton_send import Send

__all__ = ["encode_compensated", "finish", "try_encode_compensated"]


def finish(payload: torch.Tensor, table: LevelTable, numel: int, bucket_size: int, *,
           coding: str = "fixed", checksum: bool = False) -> torch.Tensor:
    """The payload that travels, from a part's fixed-width ``payload`` of ``numel``
    coordinates: itself, or ``codec.encode_entropy``'s of the same codes (``coding`` "entropy");
    sealed with its CRC-32 on the host when ``checksum``."""
    if coding == "entropy":
        from horovod_aq.torch.entropy import entropy_of_fixed

        return entropy_of_fixed(payload, table, numel, bucket_size, checksum=checksum)
    if coding != "fixed":
        raise ValueError(f"coding must be 'fixed' or 'entropy', got {coding!r}")
    return common.seal_checksum(payload) if checksum else payload


def try_encode_compensated(g: torch.Tensor, h: torch.Tensor | None, alpha: float, beta: float,
                           levels: LevelTable | Any, *, bucket_size: int, norm: str = "l2",
                           key: StreamKey, numel: int | None = None, coding: str = "fixed",
                           checksum: bool = False,
                           memory_out: torch.Tensor | None = None) -> Compensated | None:
    """``codec.encode_compensated(g, h, alpha, beta, levels, bucket_size=, norm=, numel=,
    key=key, checksum=, coding=)`` bit for bit on g's device — payload and h' as tensors, h'
    in ``memory_out`` (allocated if None) — or None when a bucket of x holds a NaN/±Inf or
    has a norm beyond float32 (h untouched). One part of a :class:`Send`."""
    checksum = codec.check_bool("checksum", checksum)
    if coding not in ("fixed", "entropy"):
        raise ValueError(f"coding must be 'fixed' or 'entropy', got {coding!r}")
    flat = common.as_float32_flat(g)
    n = flat.numel() if numel is None else int(numel)
    if n < flat.numel():
        raise ValueError(f"numel must be at least the {flat.numel()} coordinates of g, got {n}")
    hf = None if h is None else common.as_float32_flat(h)
    out = torch.empty_like(flat) if memory_out is None else memory_out
    send = Send(levels, bucket_size=bucket_size, norm=norm, alpha=alpha, beta=beta, sizes=[n],
                device=flat.device)
    payload = send.encode(flat, hf, out, key)
    found = send.outcome()
    if found is None:
        return None
    payload = finish(payload, send.table, n, send.bucket_size, coding=coding, checksum=checksum)
    return Compensated(payload, out, *found)


def encode_compensated(g: torch.Tensor, h: torch.Tensor | None, alpha: float, beta: float,
                       levels: LevelTable | Any, *, bucket_size: int, norm: str = "l2",
                       key: StreamKey, numel: int | None = None, coding: str = "fixed",
                       checksum: bool = False,
                       memory_out: torch.Tensor | None = None) -> Compensated:
    """:func:`try_encode_compensated`, raising the oracle's error (from host copies) where x
    cannot be encoded."""
    found = try_encode_compensated(g, h, alpha, beta, levels, bucket_size=bucket_size, norm=norm,
                                   key=key, numel=numel, coding=coding, checksum=checksum,
                                   memory_out=memory_out)
    if found is None:
        host_g = common.as_float32_flat(g).cpu().numpy()
        n = host_g.size if numel is None else int(numel)
        reference.encode_compensated(  # raises the oracle's error
            host_g, None if h is None else common.as_float32_flat(h).cpu().numpy(), alpha, beta,
            levels, bucket_size=bucket_size, norm=norm, numel=n, uniforms=np.zeros(n, np.float32))
        raise RuntimeError("horovod_aq.torch.triton_compensated: the kernel refused input that "
                           "the reference codec accepts (please report this bug)")
    return found
