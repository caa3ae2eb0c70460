"""Copies between KV on a device and host memory: one copy stream per device, bounded
waits, pinned host memory.

The connectors that move KV through host memory (the offloading connector's CPU
slots, the Mooncake store's staging buffer) gather blocks on the KV's device,
copy across once, and scatter on the other side. On a CUDA device the copies run
``non_blocking`` on a dedicated stream (:func:`copy_stream`, made once per
device and shared by every caller in the process), made to wait for the
compute stream first (:func:`on_copy_stream`), so the copy reads what the
kernels queued before it wrote and writes nothing they still read; the caller
then waits for the stream's end with a bounded wait (:func:`finish`) before it
tells anyone the bytes landed. Host memory on the other side must be pinned for
the copy to be asynchronous and run at the copy engine's speed
(:func:`pin_host_memory` registers an existing mapping with CUDA;
:func:`host_buffer` allocates pinned).

On the host (plain or guarded CPU KV) the same calls run: no stream, copies
are synchronous, :func:`finish` returns at once and nothing is pinned, so the
CPU test suite exercises the very code a GPU runs.

Owns: the per-device copy streams, the pin registry of this process. Nothing
else of kvbridge is imported here besides :mod:`.fence` (dependency rule of
``backends``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch

from kvbridge.backends.device.fence import CudaFence, wait_fence

logger = logging.getLogger(__name__)

__all__ = ["copy_stream", "finish", "host_buffer", "is_cuda", "on_copy_stream",
           "pin_host_memory", "unpin_host_memory"]

_lock = threading.Lock()
_streams: dict[torch.device, Any] = {}
#: host addresses this process registered with CUDA (ptr -> bytes)
_pinned: dict[int, int] = {}


def is_cuda(device: Any) -> bool:
    return torch.device(device).type == "cuda"


def _normal(device: Any) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def copy_stream(device: Any) -> Any:
    """The dedicated copy stream of a CUDA ``device`` (made on first use), None elsewhere."""
    if not is_cuda(device):
        return None
    device = _normal(device)
    with _lock:
        stream = _streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)
            _streams[device] = stream
        return stream


@contextlib.contextmanager
def on_copy_stream(device: Any) -> Iterator[Any]:
    """Run the body's torch ops on ``device``'s copy stream, ordered after the work queued
    so far on the compute (current) stream; yields the stream (None on the host)."""
    stream = copy_stream(device)
    if stream is None:
        yield None
        return
    stream.wait_stream(torch.cuda.current_stream(_normal(device)))
    with torch.cuda.stream(stream):
        yield stream


def finish(device: Any, timeout_s: float) -> bool:
    """Wait, at most ``timeout_s``, until the copies queued on ``device``'s copy stream
    ran; True at once on the host. On timeout the compute stream is made to wait for
    the copy stream, so no later kernel can overtake the late copy."""
    stream = copy_stream(device)
    if stream is None:
        return True
    if wait_fence(CudaFence(device, stream), timeout_s):
        return True
    torch.cuda.current_stream(_normal(device)).wait_stream(stream)
    return False


def host_buffer(nbytes: int, device: Any) -> torch.Tensor:
    """``nbytes`` of host memory (uint8) for copies to and from ``device``: pinned when
    ``device`` is a CUDA device, plain otherwise."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=is_cuda(device))


def pin_host_memory(ptr: int, nbytes: int) -> bool:
    """Register ``[ptr, ptr + nbytes)`` (e.g. an mmap) with CUDA as pinned memory, once per
    process; False (logged) if CUDA refused: copies still work, only synchronously."""
    with _lock:
        if ptr in _pinned:
            return True
        rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(rc) != 0:
            logger.warning("cudaHostRegister(0x%x, %d B) failed (%s): copies to and from "
                           "this memory run unpinned (synchronous, slower)", ptr, nbytes, rc)
            return False
        _pinned[ptr] = nbytes
        return True


def unpin_host_memory(ptr: int) -> None:
    """Undo :func:`pin_host_memory` (no-op for memory this process did not pin)."""
    with _lock:
        if _pinned.pop(ptr, None) is None:
            return
        rc = torch.cuda.cudart().cudaHostUnregister(ptr)
        if int(rc) != 0:
            logger.warning("cudaHostUnregister(0x%x) failed (%s)", ptr, rc)
