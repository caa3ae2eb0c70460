"""What memory an item to register is, and which registration a descriptor lies in.

Owns the pure checks behind :meth:`NixlTransport.register_regions
<kvbridge.backends.nixl.NixlTransport.register_regions>` and
:meth:`~kvbridge.backends.nixl.NixlTransport.prepare_local_descs`:
:func:`memory_of` (address, size, memory type and backing storage of a tensor
or a raw tuple), :class:`Registration` (one NIXL registration: a distinct
backing storage), :func:`registration_of` and :func:`check_inside_registrations`
(every local descriptor inside one registration, of one memory type and
device), :func:`set_cuda_device` and :class:`AgentLock` (the transport's
lock, which binds each thread that enters it to the registered device).

CUDA: UCX disables CUDA IPC on a thread without a current CUDA context, so
once VRAM is registered every thread that enters the transport (the engine
thread, a handshake executor, a progress pump) has ``torch.cuda.set_device``
called for the registered device first (:func:`set_cuda_device`), once per
thread. The transport calls it through ``kvbridge.backends.nixl.set_cuda_device``
(the name a test replaces to record the calls).

May not touch: the NIXL agent (no registration, no NIXL call is made here)
or the transport's tables; torch only through the tensor's attributes
and ``torch.cuda`` device calls. Imports only :mod:`.records` of kvbridge.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.backends.nixl.records import DRAM, MEM_TYPES, VRAM, NixlTransportError


@dataclass(frozen=True)
class MemoryOf:
    """What :func:`memory_of` found about one item to register."""

    addr: int
    nbytes: int
    mem_type: str
    device_id: int
    storage_addr: int  # the backing allocation, registered once for all its views
    storage_nbytes: int


def memory_of(item: Any, where: str = "region") -> MemoryOf:
    """Address, size, memory type and backing storage of a tensor or raw tuple.

    ``item`` is a contiguous tensor (``cpu`` -> DRAM, pinned or not; ``cuda`` ->
    VRAM on its device), ``(addr, nbytes)`` (host memory) or ``(addr, nbytes,
    mem_type, device_id)``. Only the tensor's attributes are read (``device``,
    ``data_ptr``, ``untyped_storage``), so a description of a CUDA tensor
    works on a machine without CUDA.
    """
    if isinstance(item, tuple):
        if len(item) not in (2, 4):
            raise NixlTransportError(f"{where}: expected (addr, nbytes) or (addr, nbytes, "
                                     f"mem_type, device_id), got {item!r}")
        addr, nbytes = int(item[0]), int(item[1])
        mem_type, device_id = (DRAM, 0) if len(item) == 2 else (str(item[2]), int(item[3]))
        storage_addr, storage_nbytes = addr, nbytes
    else:
        if not getattr(item, "is_contiguous", lambda: False)():
            raise NixlTransportError(f"{where}: expected a contiguous tensor")
        device = item.device
        if device.type == "cpu":
            mem_type, device_id = DRAM, 0
        elif device.type == "cuda":
            mem_type = VRAM
            device_id = device.index if device.index is not None else _current_cuda_device()
        else:
            raise NixlTransportError(f"{where}: expected host (cpu) or CUDA memory, got "
                                     f"{device}")
        addr, nbytes = int(item.data_ptr()), int(item.numel() * item.element_size())
        storage = item.untyped_storage()
        storage_addr, storage_nbytes = int(storage.data_ptr()), int(storage.nbytes())
        if not (storage_addr <= addr and addr + nbytes <= storage_addr + storage_nbytes):
            storage_addr, storage_nbytes = addr, nbytes  # not a plain view: register itself
    if mem_type not in MEM_TYPES:
        raise NixlTransportError(f"{where}: mem_type must be one of {MEM_TYPES}, got "
                                 f"{mem_type!r}")
    if device_id < 0 or (mem_type == DRAM and device_id != 0):
        raise NixlTransportError(f"{where}: device_id must be >= 0 (0 for DRAM), got "
                                 f"{device_id}")
    if addr <= 0 or nbytes <= 0:
        raise NixlTransportError(f"{where}: expected addr > 0 and nbytes > 0, got {addr}, "
                                 f"{nbytes}")
    return MemoryOf(addr, nbytes, mem_type, device_id, storage_addr, storage_nbytes)


def _current_cuda_device() -> int:
    import torch

    return int(torch.cuda.current_device())


def set_cuda_device(device_id: int) -> None:
    """Make ``device_id`` the current CUDA device of the calling thread (creates its
    context). Module-level so that a test on a machine without CUDA can record the
    calls in its place."""
    import torch

    torch.cuda.set_device(device_id)


@dataclass
class Registration:
    """One NIXL registration: a distinct backing storage."""

    addr: int
    nbytes: int
    mem_type: str
    device_id: int
    handle: Any


def registration_of(registrations: Sequence[Registration], info: MemoryOf
                    ) -> Registration | None:
    """The registration that holds all of ``info`` with its memory type and device, if any."""
    for reg in registrations:
        if ((reg.mem_type, reg.device_id) == (info.mem_type, info.device_id)
                and reg.addr <= info.addr
                and info.addr + info.nbytes <= reg.addr + reg.nbytes):
            return reg
    return None


def check_inside_registrations(arr: np.ndarray, registrations: Sequence[Registration]) -> str:
    """Every descriptor of ``arr`` inside one registration, all of one memory type,
    with that registration's device id (filled in for two-column input, whose
    device column is 0); returns the memory type."""
    starts = arr[:, 0].astype(np.int64)
    if arr.shape[1] == 5:
        last = (arr[:, 3] * (arr[:, 4] - np.uint64(1))).astype(np.int64)
        ends = starts + last + arr[:, 1].astype(np.int64)
    else:
        ends = starts + arr[:, 1].astype(np.int64)
    owner = np.full(arr.shape[0], -1, dtype=np.int64)
    for i, r in enumerate(registrations):
        owner[(owner < 0) & (starts >= r.addr) & (ends <= r.addr + r.nbytes)] = i
    if (owner < 0).any():
        k = int(np.flatnonzero(owner < 0)[0])
        raise NixlTransportError(
            f"local descs row {k} (addr {int(starts[k]):#x}, len {int(arr[k, 1])}) "
            "is not inside any registered region"
        )
    kinds = {(registrations[i].mem_type, registrations[i].device_id)
             for i in np.unique(owner).tolist()}
    if len({m for m, _ in kinds}) > 1:
        raise NixlTransportError(f"local descs span memory types {sorted(kinds)}: a list "
                                 "is of one memory type")
    devices = np.array([r.device_id for r in registrations], dtype=np.uint64)[owner]
    wrong = (arr[:, 2] != devices) & (arr[:, 2] != 0)
    if wrong.any():
        k = int(np.flatnonzero(wrong)[0])
        raise NixlTransportError(f"local descs row {k}: device {int(arr[k, 2])}, but its "
                                 f"memory is registered on device {int(devices[k])}")
    arr[:, 2] = devices
    return next(iter(kinds))[0]


class AgentLock:
    """The transport's lock; entering it also makes the registered CUDA device
    current on the calling thread (``bind_thread``: the transport's own binding,
    which calls :func:`set_cuda_device` once per thread)."""

    def __init__(self, bind_thread: Callable[[], None]) -> None:
        self._rlock = threading.RLock()
        self._bind_thread = bind_thread

    def __enter__(self) -> None:
        self._rlock.acquire()
        try:
            self._bind_thread()
        except BaseException:
            self._rlock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        self._rlock.release()
