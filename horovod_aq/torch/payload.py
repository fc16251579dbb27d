"""What every torch kernel of the payload shares (the ops in ``horovod_aq.torch.kernels`` and
Triton's in ``horovod_aq.torch.triton_kernels``): a leaf module, imported by both and importing
neither.

* device caches (:class:`DeviceCache`), the payload header as a device tensor
  (:func:`header_tensor`), the wire's small per-step constants (:func:`device_constant`) and
  host arrays that change every call, sent without a synchronisation (:func:`host_to_device`);
* the float32 input (:func:`as_float32_flat`) and the encoder's finiteness check
  (:func:`check_finite`, the numpy codec's messages);
* the host-side validation of received rows with the numpy codec's checks and messages
  (:func:`checked_headers`, :func:`check_payload_tensor`, :func:`check_valid`) and the CRC-32 of
  checksummed payloads (:func:`seal_checksum`, :func:`verify_checksums`; docs/format.md §11).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from horovod_aq import codec
from horovod_aq.codec import HEADER_SIZE, PayloadError
from horovod_aq.levels.table import LevelTable

#: Entries of a small device cache (headers, shift vectors).
CACHE_ENTRIES = 64
#: The gradient dtypes the kernels take.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class DeviceCache:
    """A small thread-safe LRU of device tensors (level tables, headers, shift vectors)."""

    def __init__(self, entries: int = CACHE_ENTRIES) -> None:
        self._items: OrderedDict[tuple, Any] = OrderedDict()
        self._entries = entries
        self._lock = threading.Lock()

    def get(self, key: tuple, make: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = make()
        self.put(key, value)
        return value

    def put(self, key: tuple, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._entries:
                self._items.popitem(last=False)


_HEADERS = DeviceCache()
#: Entries of the cache of small constants (a few per bucket: presence masks, chunk counts).
CONSTANT_ENTRIES = 4096
_CONSTANTS = DeviceCache(CONSTANT_ENTRIES)


def device_constant(values: np.ndarray, device) -> torch.Tensor:
    """``values`` on ``device``, copied there once and then taken from a cache keyed by their
    bytes: a host-to-device copy that is not cached waits for the device's stream (a host
    synchronisation, which ``torch.cuda.set_sync_debug_mode`` reports), so the small arrays a
    step sends to the device every time (presence masks, chunk counts) come from here. Read
    only: the tensor is shared."""
    a = np.ascontiguousarray(values)
    key = ("constant", a.dtype.str, a.shape, a.tobytes(), str(device))
    return _CONSTANTS.get(key, lambda: torch.from_numpy(a.copy()).to(device))


def host_to_device(values: np.ndarray, device) -> torch.Tensor:
    """A new tensor of ``values`` on ``device``, sent without waiting for the device: on CUDA
    through pinned memory, in stream order (a blocking copy from pageable memory waits for the
    stream: a host synchronisation). For the arrays that change every call (an entropy
    coder's model, a payload's coder header), which :func:`device_constant` cannot cache."""
    host = torch.from_numpy(np.array(values, copy=True, order="C"))
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def header_tensor(numel: int, table: LevelTable, bucket_size: int, norm: str,
                  device, *, marker: bool = False) -> torch.Tensor:
    """The header tensor of a payload (``marker``: of a non-finite marker naming element 0);
    one cache slot per tensor shape, replaced when the table changes (a refit), so refits do
    not accumulate headers."""
    raw = codec.make_header(numel, table, bucket_size, norm,
                            first_nonfinite=0 if marker else None)
    key = ("header", numel, table.num_levels, bucket_size, norm, str(device), marker)
    cached = _HEADERS.get(key, lambda: (raw, torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                                      .to(device)))
    if cached[0] != raw:
        cached = (raw, torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device))
        _HEADERS.put(key, cached)
    return cached[1]


def as_float32_flat(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"expected a floating-point gradient, got dtype {x.dtype}")
    return x.detach().reshape(-1).to(torch.float32).contiguous()


def check_finite(flat: torch.Tensor, norms: torch.Tensor) -> None:
    """One host sync: a non-finite element makes its bucket's norm non-finite."""
    if norms.numel() == 0 or bool(torch.isfinite(norms).all()):
        return
    bad = ~torch.isfinite(flat)  # error path only
    count = int(bad.sum())
    if count:
        raise ValueError(codec.non_finite_message(count, int(bad.int().argmax()), flat.numel()))
    raise ValueError(codec.norm_overflow_message(int((~torch.isfinite(norms)).int().argmax())))


def seal_checksum(payload: torch.Tensor) -> torch.Tensor:
    """``codec.seal_checksum`` of a contiguous 1-D uint8 payload tensor, in place: the CRC-32 is
    computed on the host (zero-copy on CPU; otherwise one copy of the payload to the host and
    the 32 header bytes back). Returns ``payload``."""
    if payload.device.type == "cpu":
        codec.seal_checksum(payload.numpy())
        return payload
    host = payload.cpu().numpy()
    codec.seal_checksum(host)
    payload[:HEADER_SIZE] = torch.from_numpy(host[:HEADER_SIZE]).to(payload.device)
    return payload


def host_headers(rows: torch.Tensor, name_rank: bool = True) -> list[codec.Header]:
    """Parse the headers of a [P, size] uint8 tensor (one 32·P-byte copy to the host)."""
    raw = rows[:, :HEADER_SIZE].cpu().numpy()
    return codec.parse_rows(raw, name_rank=name_rank)


def check_payload_tensor(payload: torch.Tensor, ndim: int) -> None:
    if not isinstance(payload, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor payload, got {type(payload).__name__}")
    if payload.dtype != torch.uint8 or payload.dim() != ndim:
        shape = "[P, size]" if ndim == 2 else "1-D"
        raise PayloadError(
            f"a payload must be a {shape} uint8 tensor, got dtype {payload.dtype} and shape "
            f"{tuple(payload.shape)}"
        )


def check_valid(valid: list[torch.Tensor], refuse: Callable[[], Any]) -> None:
    """One host sync on the validity flags of a decode; if one is False, ``refuse()`` (which
    reruns the numpy oracle on a host copy and raises its error). Shared with Triton."""
    if not valid or bool(torch.stack(valid).all()):
        return
    refuse()
    raise RuntimeError("horovod_aq.torch.kernels: the device check refused a payload that the "
                       "numpy codec accepts (please report this bug)")


def verify_checksums(rows: torch.Tensor, headers: list[codec.Header], *, single: bool) -> None:
    """``codec.check_checksums`` of the rows whose header carries ``FLAG_CHECKSUM``, on the
    host (zero-copy for CPU tensors). Shared with Triton."""
    if not any(h.checksummed for h in headers):
        return
    host = rows.detach().cpu().numpy()
    if single:
        codec.check_checksum(host[0], headers[0])
    else:
        codec.check_checksums(host, headers)


def checked_headers(rows: torch.Tensor, table: LevelTable, numel: int | None,
                    bucket_size: int | None, norm: str | None, *,
                    single: bool = False) -> tuple[list[codec.Header], codec.Header]:
    """Validate gathered payload rows [P, size] (``single``: the one row of a ``decode``, whose
    tensor the caller checked) on the host with the numpy codec's checks and messages, and the
    CRC-32 of checksummed rows (``verify_checksums``); returns (every header, row 0's checked
    header). Shared by these ops and ``horovod_aq.torch.triton_kernels``."""
    if not single:
        check_payload_tensor(rows, 2)
    world, size = rows.shape
    if world == 0:
        raise PayloadError("decode_average needs at least one payload row")
    if size < HEADER_SIZE:
        codec.parse_rows(rows[:1].cpu().numpy(), name_rank=not single)  # raises "truncated"
    headers = host_headers(rows, name_rank=not single)
    first = codec.check_rows(headers, table, size, numel=numel, bucket_size=bucket_size,
                             norm=norm, name_rank=not single)
    verify_checksums(rows, headers, single=single)
    return headers, first


__all__ = ["CACHE_ENTRIES", "DeviceCache", "FLOAT_DTYPES", "as_float32_flat", "check_finite",
           "check_payload_tensor", "check_valid", "checked_headers", "header_tensor",
           "host_headers", "seal_checksum", "verify_checksums"]
