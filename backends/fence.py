"""Fences: "the kernels that wrote this KV have finished", before a transfer reads it.

On a GPU, ``save_kv_layer`` runs when the CPU has *queued* the layer's
kernels, not when they ran; a WRITE posted then would send stale bytes. The
NIXL connector records a fence there (and in ``wait_for_save``) and posts the
layer's WRITE only once ``done()``. A CUDA fence is an event recorded on the
current stream of the tensor's device; host memory needs none (the CPU wrote
it already): :data:`DONE`.

Nothing else of kvbridge is imported here (dependency rule of ``backends``).
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["DONE", "CudaFence", "Fence", "record_fence"]


class Fence(Protocol):
    def done(self) -> bool:
        """True once every kernel queued before the fence was recorded has finished."""
        ...


class _Done:
    def done(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "DONE"


#: The fence of host memory: already passed.
DONE: Fence = _Done()


class CudaFence:
    """A CUDA event recorded on ``device``'s current stream (queried, never waited on:
    the engine thread must not block)."""

    def __init__(self, device: Any) -> None:
        import torch

        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(device))

    def done(self) -> bool:
        return bool(self._event.query())


def record_fence(tensor: Any) -> Fence:
    """A fence for the work queued so far on ``tensor``'s device (:data:`DONE` for host
    memory or anything that is not a CUDA tensor)."""
    device = getattr(tensor, "device", None)
    if device is not None and getattr(device, "type", None) == "cuda":
        return CudaFence(device)
    return DONE
