"""Entropy-coded payloads (docs/format.md §12) for torch tensors: encode, decode, decode-average.

Byte-identical to the numpy oracle ``codec.encode_entropy`` (the smaller of the entropy-coded
and the fixed-width payload, so never larger than ``payload_size(n, b, B)``) for the same
:class:`~horovod_aq.codec.StreamKey`, and bitwise ``codec.decode`` / ``codec.decode_average`` of
rows of any lengths and kinds. Where each runs (``kernels.implementation_for``):

* **CPU** ("fused"): the compiled numba kernels, zero copy — ``codec.fused_entropy.
  encode_entropy`` (quantizer with one code per byte, histogram, model on the host, compiled
  rANS) and ``codec.fused.decode`` / ``decode_average`` (read both kinds).
* **CUDA with Triton** ("triton"), encode: the fixed-width payload of ``triton_kernels.encode``
  (same codes as every kernel), its codes unpacked on the device, their histogram
  (``torch.bincount``, one host round trip, which the payload's size needs anyway), the code
  table and product model on the host (``entropy_format``, shared by every implementation), the
  symbols grouped on the device and coded by ``triton_entropy.encode_symbols``; the payload is
  assembled on the device. Checksums are computed on the host (``payload.seal_checksum``).
* **Everything else** — decoding on CUDA, and ``HOROVOD_AQ_KERNELS=ops`` — goes through a
  host copy and the compiled CPU kernels (the torch ops have no rANS coder), then back to the
  tensor's device: correct everywhere, one device↔host copy of the payloads per call.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from horovod_aq import codec
from horovod_aq.codec import FLAG_ENTROPY, FLAGS_OFFSET, HEADER_SIZE, NORM_BYTES
from horovod_aq.codec.entropy_format import (
    CODE_TABLE_BITS,
    CODER_HEADER_FORMAT,
    GROUPS,
    LANES,
    PRECISION,
    STEPS,
    entropy_payload_size,
    normalize_frequencies,
    symbol_model,
)
from horovod_aq.codec.stream import StreamKey
from horovod_aq.levels.table import LevelTable
from horovod_aq.torch import kernels, triton_kernels
from horovod_aq.torch.payload import as_float32_flat, seal_checksum

__all__ = ["decode", "decode_average", "encode_entropy"]


def encode_entropy(x: torch.Tensor, levels: LevelTable | Any, *, bucket_size: int,
                   norm: str = "l2", key: StreamKey, checksum: bool = False) -> torch.Tensor:
    """``codec.encode_entropy(x, levels, bucket_size=, norm=, key=key, checksum=)`` byte for
    byte, as a uint8 tensor on x's device (module docstring: where it runs)."""
    checksum = codec.check_bool("checksum", checksum)
    impl = kernels.implementation_for(x.device)
    if impl == "triton":
        return encode_entropy_triton(x, levels, bucket_size=bucket_size, norm=norm, key=key,
                                     checksum=checksum)
    from horovod_aq.codec import fused_entropy

    host = as_float32_flat(x).detach().cpu().numpy()
    payload = torch.from_numpy(fused_entropy.encode_entropy(
        host, levels, bucket_size=bucket_size, norm=norm, key=key, checksum=checksum))
    return payload if x.device.type == "cpu" else payload.to(x.device)


def encode_entropy_triton(x: torch.Tensor, levels: LevelTable | Any, *, bucket_size: int,
                          norm: str = "l2", key: StreamKey,
                          checksum: bool = False) -> torch.Tensor:
    """The Triton path of :func:`encode_entropy` (CUDA; CPU tensors under
    ``TRITON_INTERPRET=1``): codes of the fixed-width payload, histogram, host model,
    ``triton_entropy.encode_symbols``, assembled on x's device (docs/format.md §12 layout)."""
    table = codec.as_table(levels)
    fixed = triton_kernels.encode(x, table, bucket_size=bucket_size, norm=norm, key=key)
    return entropy_of_fixed(fixed, table, x.numel(), bucket_size, checksum=checksum)


def entropy_of_fixed(fixed: torch.Tensor, table: LevelTable, n: int, bucket_size: int, *,
                     checksum: bool = False) -> torch.Tensor:
    """``codec.encode_entropy``'s payload of the codes of a fixed-width payload of n
    coordinates on the device (the Triton path: histogram, host model, rANS; the fixed payload
    itself where it is not larger)."""
    from horovod_aq.torch import triton_entropy

    bits, N = table.bits, table.num_levels
    if n == 0:
        return seal_checksum(fixed) if checksum else fixed
    codes_at = HEADER_SIZE + NORM_BYTES * codec.num_buckets(n, bucket_size)
    codes = kernels.unpack_bits(fixed[codes_at:], bits, n)            # uint8, on the device
    counts_of = torch.bincount(codes.to(torch.int64), minlength=N)[:N].cpu().numpy()
    t = normalize_frequencies(counts_of, CODE_TABLE_BITS).astype(np.uint16)
    f, c = symbol_model(t, bits)
    g = GROUPS[bits]
    nsym = -(-n // g)
    if nsym * g != n:   # the last symbol is padded with copies of the last code
        codes = torch.cat([codes, codes[-1:].expand(nsym * g - n)])
    shifts = torch.arange(g, dtype=torch.int32, device=codes.device) * bits
    symbols = (codes.view(nsym, g).to(torch.int32) << shifts).sum(dim=1).to(torch.uint8)
    words, states, counts = triton_entropy.encode_symbols(symbols, f, c)
    size = entropy_payload_size(n, bits, bucket_size, N, words.numel())
    if size >= fixed.numel():
        return seal_checksum(fixed) if checksum else fixed
    device = fixed.device
    head = fixed[:HEADER_SIZE].clone()
    head[FLAGS_OFFSET] |= FLAG_ENTROPY
    coder = struct.pack(CODER_HEADER_FORMAT, size, PRECISION, g, LANES.bit_length() - 1,
                        STEPS.bit_length() - 1, 0)

    def host_bytes(raw: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)

    payload = torch.cat([
        head, fixed[HEADER_SIZE:codes_at], host_bytes(coder),
        states.contiguous().view(torch.uint8).reshape(-1),
        counts.to(torch.int32).view(torch.uint8).view(-1, 4)[:, :2].reshape(-1),
        host_bytes(t.astype("<u2").tobytes()),
        words.contiguous().view(torch.uint8).reshape(-1)])
    assert payload.numel() == size
    return seal_checksum(payload) if checksum else payload


def _host_rows(rows: Sequence[torch.Tensor] | torch.Tensor) -> list[np.ndarray]:
    return [r.detach().contiguous().cpu().numpy() for r in rows]


def decode(payload: torch.Tensor, levels: LevelTable | Any, *, numel: int | None = None,
           bucket_size: int | None = None, norm: str | None = None) -> torch.Tensor:
    """float32 values of one payload of either kind on its device (bitwise ``codec.decode``):
    ``kernels.decode`` for a fixed-width payload, the compiled CPU decoder for an entropy-coded
    one (via a host copy off the CPU)."""
    if not (payload.numel() > FLAGS_OFFSET and int(payload[FLAGS_OFFSET]) & FLAG_ENTROPY):
        return kernels.decode(payload, levels, numel=numel, bucket_size=bucket_size, norm=norm)
    from horovod_aq.codec import fused

    out = fused.decode(_host_rows([payload])[0], levels, numel=numel, bucket_size=bucket_size,
                       norm=norm)
    return torch.from_numpy(out).to(payload.device)


def decode_average(rows: Sequence[torch.Tensor], levels: LevelTable | Any, *,
                   numel: int | None = None, bucket_size: int | None = None,
                   norm: str | None = None) -> torch.Tensor:
    """The average of P payloads of any lengths and kinds (1-D uint8 tensors on one device),
    bitwise ``codec.decode_average`` of the same rows: equal-size fixed-width rows go to
    ``kernels.decode_average`` (Triton on CUDA), the others to the compiled CPU decoder of
    variable rows (``codec.fused.decode_average``; a host copy off the CPU)."""
    rows = list(rows)
    device = rows[0].device
    flags = [int(r[FLAGS_OFFSET]) if r.numel() > FLAGS_OFFSET else 0 for r in rows]
    if len({r.numel() for r in rows}) == 1 and not any(f & FLAG_ENTROPY for f in flags):
        return kernels.decode_average(torch.stack(rows), levels, numel=numel,
                                      bucket_size=bucket_size, norm=norm)
    from horovod_aq.codec import fused

    out = fused.decode_average(_host_rows(rows), levels, numel=numel, bucket_size=bucket_size,
                               norm=norm)
    return torch.from_numpy(out).to(device)
