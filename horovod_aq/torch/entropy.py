"""Entropy-coded payloads (docs/format.md §12) for torch tensors: encode, decode, decode-average.

Byte-identical to the numpy oracle ``codec.encode_entropy`` (the smaller of the entropy-coded
and the fixed-width payload, so never larger than ``payload_size(n, b, B)``) for the same
:class:`~horovod_aq.codec.StreamKey`, and bitwise ``codec.decode`` / ``codec.decode_average`` of
rows of any lengths and kinds. Where each runs (``kernels.implementation_for``):

* **CPU** ("fused"): the compiled numba kernels, zero copy — ``codec.fused_entropy.
  encode_entropy`` (quantizer with one code per byte, histogram, model on the host, compiled
  rANS) and ``codec.fused.decode`` / ``decode_average`` (read both kinds).
* **CUDA with Triton** ("triton"), encode: the fixed-width payload of ``triton_send.encode``
  (same codes as every kernel), its codes unpacked on the device, their histogram (counted
  on the device, read on the host), the code table and product model on the host
  (``entropy_format``, shared by every implementation), the symbols grouped on the device and
  coded by ``triton_entropy.encode_blocks``, the words compacted once their number is read;
  the payload is assembled on the device, the host's bytes sent without waiting
  (``payload.host_to_device``): two host synchronisations for all the parts of a send
  (:func:`entropy_of_parts`: the histograms, with the send's outcome, then the sizes).
  Checksums are computed on the host (``payload.seal_checksum``).
* **CUDA with Triton** ("triton"), decode (:func:`device_values`): one device→host copy of
  the rows' headers, coder headers, block counts and code tables, checked on the host against
  what this rank's encoder writes; the models (f, c, slot table) built on the host and copied
  to the device at once; every entropy-coded row's symbols decoded by
  ``triton_entropy.decode_symbols_flagged``, its codes unpacked and dequantized on the device
  (``kernels.dequantize``), fixed-width rows by ``kernels.decode_flagged``; one flag read at
  the end (norms, coder states, streams). Rows that fail a check take the host path below,
  which raises the oracle's error.
* **Everything else** — ``HOROVOD_AQ_KERNELS=ops``, CUDA without Triton, and rows the device
  path refuses — goes through a host copy and the compiled CPU kernels (the torch ops have no
  rANS coder), then back to the tensor's device: correct everywhere, one device↔host copy of
  the payloads per call.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from horovod_aq import codec
from horovod_aq.codec import FLAG_ENTROPY, FLAGS_OFFSET, HEADER_SIZE, NORM_BYTES
from horovod_aq.codec.entropy_format import (
    CODE_TABLE_BITS,
    CODER_HEADER_FORMAT,
    CODER_HEADER_SIZE,
    COUNT_BYTES,
    GROUPS,
    LANES,
    PRECISION,
    STATE_LOW,
    WORD_BYTES,
    coder_fields,
    entropy_payload_size,
    normalize_frequencies,
    num_symbols,
    sections,
    symbol_model,
)
from horovod_aq.codec.stream import StreamKey
from horovod_aq.levels.table import LevelTable
from horovod_aq.torch import kernels, triton_send
from horovod_aq.torch.payload import as_float32_flat, host_to_device, seal_checksum

__all__ = ["average_values", "decode", "decode_average", "decode_each", "device_values",
           "Coded", "encode_entropy", "entropy_of_fixed", "entropy_of_parts"]


def encode_entropy(x: torch.Tensor, levels: LevelTable | Any, *, bucket_size: int,
                   norm: str = "l2", key: StreamKey, checksum: bool = False,
                   checked: bool = False) -> torch.Tensor:
    """``codec.encode_entropy(x, levels, bucket_size=, norm=, key=key, checksum=)`` byte for
    byte, as a uint8 tensor on x's device (module docstring: where it runs). ``checked``: the
    caller found x finite with every bucket norm within float32 (``kernels.encode``), so the
    Triton encode does not read its own check on the host."""
    checksum = codec.check_bool("checksum", checksum)
    impl = kernels.implementation_for(x.device)
    if impl == "triton":
        return encode_entropy_triton(x, levels, bucket_size=bucket_size, norm=norm, key=key,
                                     checksum=checksum, checked=checked)
    from horovod_aq.codec import fused_entropy

    host = as_float32_flat(x).detach().cpu().numpy()
    payload = torch.from_numpy(fused_entropy.encode_entropy(
        host, levels, bucket_size=bucket_size, norm=norm, key=key, checksum=checksum))
    return payload if x.device.type == "cpu" else payload.to(x.device)


def encode_entropy_triton(x: torch.Tensor, levels: LevelTable | Any, *, bucket_size: int,
                          norm: str = "l2", key: StreamKey, checksum: bool = False,
                          checked: bool = False) -> torch.Tensor:
    """The Triton path of :func:`encode_entropy` (CUDA; CPU tensors under
    ``TRITON_INTERPRET=1``): codes of the fixed-width payload, histogram, host model,
    ``triton_entropy.encode_symbols``, assembled on x's device (docs/format.md §12 layout)."""
    table = codec.as_table(levels)
    fixed = triton_send.encode(x, table, bucket_size=bucket_size, norm=norm, key=key,
                               checked=checked)
    return entropy_of_fixed(fixed, table, x.numel(), bucket_size, checksum=checksum)


def entropy_of_fixed(fixed: torch.Tensor, table: LevelTable, n: int, bucket_size: int, *,
                     checksum: bool = False) -> torch.Tensor:
    """``codec.encode_entropy``'s payload of the codes of a fixed-width payload of n
    coordinates on the device (the Triton path: histogram, host model, rANS; the fixed payload
    itself where it is not larger): :func:`entropy_of_parts` of one part."""
    return entropy_of_parts([fixed], table, [n], bucket_size, checksum=checksum).payloads[0]


class Coded(NamedTuple):
    """What :func:`entropy_of_parts` returns."""

    #: The payloads that travel, in part order; None where step 2 did not run (the send's
    #: bucket cannot travel, or ``plain`` was False).
    payloads: list[torch.Tensor] | None
    #: The host copy of ``send.result`` (float64), for ``Send.outcome_of`` and
    #: ``Send.first_bad_of``; None without a send.
    result: np.ndarray | None
    #: ``plain``, read in the same copy (True without it).
    plain: bool


def entropy_of_parts(fixed: Sequence[torch.Tensor], table: LevelTable, numels: Sequence[int],
                     bucket_size: int, *, checksum: bool = False, send: Any = None,
                     plain: torch.Tensor | None = None) -> Coded:
    """:func:`entropy_of_fixed` of every part of a send (fixed-width payloads of ``numels``
    coordinates on one device) with two host reads for them all:

    1. each part's codes unpacked and counted on the device (``triton_entropy.histogram``),
       every histogram read in one copy — with ``send``'s flags and minima, a
       ``triton_send.Send`` whose parts these are (``Send.result``), and the 0-dim bool
       device tensor ``plain`` (two-phase's re-encode: whether the rows it averaged were
       plain);
    2. unless ``send.outcome_of`` says a bucket cannot travel or ``plain`` is False: the code
       tables and models built on the host (``entropy_format``) and copied without waiting,
       each part's blocks coded (``triton_entropy.encode_blocks``), every block count read in
       one copy, the words compacted on the device (``triton_entropy.compact``) and each
       payload assembled (docs/format.md §12 layout): the entropy-coded one where it is
       smaller than the fixed-width one."""
    from horovod_aq.torch import triton_entropy

    bits, N = table.bits, table.num_levels
    coded = [k for k, n in enumerate(numels) if n]
    codes = {k: kernels.unpack_bits(fixed[k][_codes_at(numels[k], bucket_size):], bits,
                                    numels[k]) for k in coded}                    # 1.
    read_with = ([] if send is None else [send.result.view(torch.int64)]) + (
        [] if plain is None else [plain.reshape(1).to(torch.int64)])
    counted = read_with + [triton_entropy.histogram(codes[k], N) for k in coded]
    read = torch.cat(counted).cpu().numpy() if counted else None   # the read
    result, ok = None, True
    if send is not None:
        result, read = read[:send.result.numel()].view(np.float64), read[send.result.numel():]
    if plain is not None:
        ok, read = bool(read[0]), read[1:]
    if not ok or (send is not None and send.outcome_of(result) is None):
        return Coded(None, result, ok)
    models, blocks = {}, {}
    for j, k in enumerate(coded):                                                 # 2.
        t = normalize_frequencies(read[j * N:(j + 1) * N], CODE_TABLE_BITS).astype(np.uint16)
        models[k] = t, *symbol_model(t, bits)
        blocks[k] = triton_entropy.encode_blocks(_symbols(codes[k], numels[k], bits),
                                                 *models[k][1:])
    totals = dict(zip(coded, torch.stack([blocks[k][2].sum() for k in coded]).cpu().numpy()
                      .tolist() if coded else []))                               # the read
    payloads = []
    for k, n in enumerate(numels):
        payload = fixed[k]
        if n:
            scratch, states, counts = blocks[k]
            size = entropy_payload_size(n, bits, bucket_size, N, totals[k])
            if size < payload.numel():
                words = triton_entropy.compact(scratch, counts, totals[k])
                payload = _assemble(payload, models[k][0], n, bucket_size, bits, size,
                                    words, states, counts)
        payloads.append(seal_checksum(payload) if checksum else payload)
    return Coded(payloads, result, ok)


def _codes_at(n: int, bucket_size: int) -> int:
    """Where the packed codes of a payload of n coordinates start (header, then norms)."""
    return HEADER_SIZE + NORM_BYTES * codec.num_buckets(n, bucket_size)


def _symbols(codes: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The rANS symbols of n codes: groups of g = ``GROUPS[bits]`` codes, code i of a group in
    bits i·b (docs/format.md §12), the last group padded with copies of the last code."""
    g = GROUPS[bits]
    nsym = -(-n // g)
    if nsym * g != n:
        codes = torch.cat([codes, codes[-1:].expand(nsym * g - n)])
    shifts = torch.arange(g, dtype=torch.int32, device=codes.device) * bits
    return (codes.view(nsym, g).to(torch.int32) << shifts).sum(dim=1).to(torch.uint8)


def _assemble(fixed: torch.Tensor, t: np.ndarray, n: int, bucket_size: int, bits: int,
              size: int, words: torch.Tensor, states: torch.Tensor,
              counts: torch.Tensor) -> torch.Tensor:
    """The entropy-coded payload of ``size`` bytes: the fixed payload's header (entropy flag
    set) and norms, the coder header and code table t (the host's bytes, in one copy that does
    not wait), the lanes' states, the blocks' word counts and the words (docs/format.md §12)."""
    codes_at = _codes_at(n, bucket_size)
    head = fixed[:HEADER_SIZE].clone()
    head[FLAGS_OFFSET] |= FLAG_ENTROPY
    coder = struct.pack(CODER_HEADER_FORMAT, size, *coder_fields(bits))
    coder_and_table = host_to_device(
        np.frombuffer(coder + t.astype("<u2").tobytes(), np.uint8), fixed.device)
    payload = torch.cat([
        head, fixed[HEADER_SIZE:codes_at], coder_and_table[:len(coder)],
        states.contiguous().view(torch.uint8).reshape(-1),
        counts.to(torch.int32).view(torch.uint8).view(-1, 4)[:, :2].reshape(-1),
        coder_and_table[len(coder):],
        words.contiguous().view(torch.uint8).reshape(-1)])
    assert payload.numel() == size
    return payload


class _Layout:
    """A payload of (n, table, B): its fixed-width size and, entropy-coded, where its sections
    lie (``entropy_format.sections``, docs/format.md §12)."""

    __slots__ = ("numel", "bits", "bucket_size", "at", "fixed_size")

    def __init__(self, numel: int, table: LevelTable, bucket_size: int) -> None:
        self.numel, self.bits, self.bucket_size = numel, table.bits, bucket_size
        self.at = sections(numel, self.bits, bucket_size, table.num_levels)
        self.fixed_size = codec.payload_size(numel, self.bits, bucket_size)

    def metadata(self, row: torch.Tensor) -> torch.Tensor:
        """A row's header, coder header, block counts and code table (zeros past its end)."""
        at = self.at
        wanted = HEADER_SIZE + CODER_HEADER_SIZE + (at.words - at.counts)
        if row.numel() < at.words:
            return torch.nn.functional.pad(row[:HEADER_SIZE], (0, wanted - min(
                HEADER_SIZE, row.numel())))
        return torch.cat([row[:HEADER_SIZE], row[at.coder:at.states], row[at.counts:at.words]])

    def entropy_sections(self, meta: np.ndarray, size: int) -> tuple[np.ndarray,
                                                                     np.ndarray] | None:
        """(block counts, code table) of an entropy-coded row of ``size`` bytes whose coder
        header, length and table sum are what a decoder accepts (``parse_body``,
        ``check_body``), else None."""
        coder = struct.unpack(CODER_HEADER_FORMAT,
                              meta[HEADER_SIZE:HEADER_SIZE + CODER_HEADER_SIZE].tobytes())
        first = HEADER_SIZE + CODER_HEADER_SIZE
        counts = meta[first:first + COUNT_BYTES * self.at.blocks].view("<u2").astype(np.int64)
        table = meta[first + COUNT_BYTES * self.at.blocks:].view("<u2")
        if (self.numel == 0 or coder != (size, *coder_fields(self.bits))
                or size != self.at.words + WORD_BYTES * int(counts.sum())
                or int(table.astype(np.int64).sum()) != 1 << CODE_TABLE_BITS):
            return None
        return counts, table


def _aligned(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``raw`` (uint8 bytes) viewed as ``dtype``, copied first where it is not aligned."""
    if raw.storage_offset() % dtype.itemsize or not raw.is_contiguous():
        raw = raw.clone()
    return raw.view(dtype)


def device_values(rows: Sequence[torch.Tensor], levels: LevelTable | Any, *, numel: int,
                  bucket_size: int, norm: str, host: Sequence[torch.Tensor] | None = None
                  ) -> tuple[list[torch.Tensor], torch.Tensor] | None:
    """Every row's float32 values decoded on the rows' device (module docstring, "decode"),
    with one 0-dim bool device flag that is True iff every norm, coder state and stream was
    valid: the host decoders would then give the same values. None where a row is not what
    this rank's encoder writes for (``numel``, ``levels``, ``bucket_size``, ``norm``) — another
    header, a marker, a checksum, a coder header, length or code table a decoder refuses —
    known from one device→host copy (none where ``host`` holds the same rows as CPU tensors);
    the caller then decodes on the host."""
    table = codec.as_table(levels)
    rows = list(rows)
    device = rows[0].device
    lay = _Layout(numel, table, bucket_size)
    expected = np.frombuffer(codec.make_header(numel, table, bucket_size, norm), np.uint8)
    coded = expected.copy()
    coded[FLAGS_OFFSET] |= FLAG_ENTROPY
    if host is None:
        meta = torch.stack([lay.metadata(r) for r in rows]).cpu().numpy()   # the one read
    else:
        meta = torch.stack([lay.metadata(r) for r in host]).numpy()
    sections: list[tuple[np.ndarray, np.ndarray] | None] = []
    for row, head in zip(rows, meta):
        if np.array_equal(head[:HEADER_SIZE], expected) and row.numel() == lay.fixed_size:
            sections.append(None)
            continue
        found = (lay.entropy_sections(head, row.numel())
                 if np.array_equal(head[:HEADER_SIZE], coded) else None)
        if found is None:
            return None
        sections.append(found)
    models = [np.concatenate([found[0], triton_entropy().model_array(
        *symbol_model(found[1], lay.bits))]) for found in sections if found is not None]
    on_device = iter(torch.split(host_to_device(   # every model at once
        np.concatenate(models) if models else np.zeros(0, np.int64), device),
        [m.size for m in models]))
    values, flags = [], []
    for row, found in zip(rows, sections):
        if found is None:
            got = kernels.decode_flagged(row[None], table, numel=numel,
                                         bucket_size=bucket_size, norm=norm, average=False)
            if got is None:
                return None
            values.append(got[0])
            flags.append(got[1])
            continue
        out, ok = _entropy_row(row, lay, table, next(on_device))
        values.append(out)
        flags.extend(ok)
    return values, torch.stack(flags).all()


def _entropy_row(row: torch.Tensor, lay: _Layout, table: LevelTable,
                 model: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The values of one checked entropy-coded row, with its flags (norms, states, stream):
    ``model`` holds its block counts, then f, c and the slot table (``model_array``)."""
    alphabet = 1 << (GROUPS[lay.bits] * lay.bits)
    counts, f, c, slots = torch.split(model, [lay.at.blocks, alphabet, alphabet,
                                              1 << PRECISION])
    at = lay.at
    norms = _aligned(row[HEADER_SIZE:at.coder], torch.float32)
    states = _aligned(row[at.states:at.counts], torch.int32).to(torch.int64) & 0xFFFFFFFF
    words = _aligned(row[at.words:], torch.uint16)
    nsym = num_symbols(lay.numel, lay.bits)
    symbols, stream_ok = triton_entropy().decode_symbols_flagged(
        states.view(lay.at.blocks, LANES), counts, words, f, c, slots, nsym)
    g = GROUPS[lay.bits]
    shifts = torch.arange(g, dtype=torch.int32, device=row.device) * lay.bits
    codes = ((symbols.to(torch.int32)[:, None] >> shifts) & ((1 << lay.bits) - 1)).reshape(-1)
    values = kernels.dequantize(codes[:lay.numel], norms, table, lay.bucket_size)
    return values, [(torch.isfinite(norms) & (norms >= 0)).all(), (states >= STATE_LOW).all(),
                    stream_ok]


def average_values(values: list[torch.Tensor]) -> torch.Tensor:
    """(1/P)·Σ_r values_r as ``codec.decode_average`` step 7 sums it: each row divided by P,
    added in rank order (in place, into the first row's tensor)."""
    divisor = torch.full((), len(values), dtype=torch.float32, device=values[0].device)
    acc = values[0].div_(divisor)
    for row in values[1:]:
        acc.add_(row.div_(divisor))
    return acc


def _on_device(rows: list[torch.Tensor], levels: Any, numel: int | None,
               bucket_size: int | None, norm: str | None) -> list[torch.Tensor] | None:
    """:func:`device_values` where it applies (Triton on the rows' device, the settings given)
    and its flag holds (one read), else None: the host path decides, and raises."""
    if (not rows or None in (numel, bucket_size, norm)
            or kernels.implementation_for(rows[0].device) != "triton"):
        return None
    got = device_values(rows, levels, numel=numel, bucket_size=bucket_size, norm=norm)
    return got[0] if got is not None and bool(got[1]) else None


def triton_entropy() -> Any:
    """``horovod_aq.torch.triton_entropy`` (imports Triton: on first use)."""
    from horovod_aq.torch import triton_entropy as module

    return module


def _host_rows(rows: Sequence[torch.Tensor] | torch.Tensor) -> list[np.ndarray]:
    return [r.detach().contiguous().cpu().numpy() for r in rows]


def decode(payload: torch.Tensor, levels: LevelTable | Any, *, numel: int | None = None,
           bucket_size: int | None = None, norm: str | None = None) -> torch.Tensor:
    """float32 values of one payload of either kind on its device (bitwise ``codec.decode``):
    ``kernels.decode`` for a fixed-width payload, the compiled CPU decoder for an entropy-coded
    one (:func:`device_values` with Triton, else via a host copy off the CPU)."""
    on_device = _on_device([payload], levels, numel, bucket_size, norm)
    if on_device is not None:
        return on_device[0]
    if not (payload.numel() > FLAGS_OFFSET and int(payload[FLAGS_OFFSET]) & FLAG_ENTROPY):
        return kernels.decode(payload, levels, numel=numel, bucket_size=bucket_size, norm=norm)
    from horovod_aq.codec import fused

    out = fused.decode(_host_rows([payload])[0], levels, numel=numel, bucket_size=bucket_size,
                       norm=norm)
    return torch.from_numpy(out).to(payload.device)


def decode_each(rows: Sequence[torch.Tensor], levels: LevelTable | Any, *, numel: int,
                bucket_size: int, norm: str) -> torch.Tensor:
    """The values of every row, one row after another (P·numel), each :func:`decode` of its
    row; all at once on the device where :func:`device_values` applies."""
    rows = list(rows)
    on_device = _on_device(rows, levels, numel, bucket_size, norm)
    if on_device is not None:
        return torch.cat(on_device)
    return torch.cat([decode(r, levels, numel=numel, bucket_size=bucket_size, norm=norm)
                      for r in rows])


def decode_average(rows: Sequence[torch.Tensor], levels: LevelTable | Any, *,
                   numel: int | None = None, bucket_size: int | None = None,
                   norm: str | None = None) -> torch.Tensor:
    """The average of P payloads of any lengths and kinds (1-D uint8 tensors on one device),
    bitwise ``codec.decode_average`` of the same rows: equal-size fixed-width rows go to
    ``kernels.decode_average`` (Triton on CUDA), the others to :func:`device_values` with
    Triton (each row divided by P, added in rank order: codec step 7), else to the compiled CPU
    decoder of variable rows (``codec.fused.decode_average``; a host copy off the CPU)."""
    rows = list(rows)
    on_device = _on_device(rows, levels, numel, bucket_size, norm)
    if on_device is not None:
        return average_values(on_device)
    device = rows[0].device
    flags = [int(r[FLAGS_OFFSET]) if r.numel() > FLAGS_OFFSET else 0 for r in rows]
    if len({r.numel() for r in rows}) == 1 and not any(f & FLAG_ENTROPY for f in flags):
        return kernels.decode_average(torch.stack(rows), levels, numel=numel,
                                      bucket_size=bucket_size, norm=norm)
    from horovod_aq.codec import fused

    out = fused.decode_average(_host_rows(rows), levels, numel=numel, bucket_size=bucket_size,
                               norm=norm)
    return torch.from_numpy(out).to(device)
