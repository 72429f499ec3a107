"""The GPU key writer: :func:`cpindex.formats.write_keys` on a device tensor is one launch of the
binding's ``write_keys`` (``write.h``), on the current stream, with no host synchronization. A
slot past the cache is recorded in the device's write error word (one per device, made with its
first write), which :func:`check_writes` reads from its pinned host mirror."""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from ..errors import CPIndexError
from ..layouts import Cache
from . import structs
from .build import KernelUnavailable, load
from .launcher import ErrorMonitor, cache_parts

_monitors: dict[torch.device, ErrorMonitor] = {}
_monitors_lock = threading.Lock()


def _device(device: torch.device | str | int | None) -> torch.device:
    if device is None or isinstance(device, int):
        index = torch.cuda.current_device() if device is None else device
        return torch.device("cuda", index)
    dev = torch.device(device)
    if dev.type != "cpu" and dev.index is None:
        dev = torch.device(dev.type, torch.cuda.current_device())
    return dev


def _write_monitor(device: torch.device) -> ErrorMonitor:
    """The error word of ``device``'s writes (created with the first write there)."""
    with _monitors_lock:
        monitor = _monitors.get(device)
        if monitor is None:
            monitor = _monitors[device] = ErrorMonitor(device, 0)
        return monitor


def write_on_device(cache: Cache, fmt: str, keys: Tensor, slot_mapping: Tensor) -> None:
    """Write ``keys`` at ``slot_mapping`` into ``cache`` (all checked on the host already) with
    one launch on the current stream."""
    mod = load(keys.device)
    if not hasattr(mod, "write_keys"):
        raise KernelUnavailable(
            "write_keys: the kernel module built for this device has no write_keys binding"
        )
    monitor = _write_monitor(keys.device)
    # The binding takes rows with stride 1 that start 16-byte aligned, and int64 slots.
    row_bytes = keys.stride(0) * keys.element_size()
    if keys.stride(1) != 1 or row_bytes % 16 or keys.data_ptr() % 16:
        keys = keys.clone(memory_format=torch.contiguous_format)
    slots = slot_mapping.to(torch.int64).contiguous()
    kv, ks = cache_parts(cache)
    mod.write_keys(
        keys,
        slots,
        kv,
        ks,
        structs.FORMAT_IDS[fmt],
        monitor.device_ptr,
        monitor.host_device_ptr,
    )


def check_writes(device: torch.device | str | int | None = None) -> None:
    """Raise :class:`~cpindex.errors.BadSlotError` if a :func:`~cpindex.formats.write_keys` on
    ``device`` (the current CUDA device by default) met a slot past its cache since the last
    check.

    Reads host memory only (the kernel mirrors its error word there), so it costs no device
    sync. The first bad slot is reported, once: raising clears the word (after a device
    synchronize, outside graph capture), so later writes report their own. A no-op on the
    CPU, where ``write_keys`` raises at once.
    """
    if not _monitors:  # no GPU write yet (always so on a CPU-only machine)
        return
    dev = _device(device)
    if dev.type == "cpu":
        return
    monitor = _monitors.get(dev)
    if monitor is None:
        return
    try:
        monitor.check()
    except CPIndexError:
        if not torch.cuda.is_current_stream_capturing():
            monitor.reset()
        raise
