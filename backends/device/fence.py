"""Fences: "the kernels that wrote this KV have finished", before a transfer reads it.

On a GPU, ``save_kv_layer`` / ``wait_for_save`` run when the CPU has *queued*
the layer's kernels, not when they ran. A CUDA fence is an event recorded on
the current stream of the tensor's device; host memory needs none (the CPU
wrote it already): :data:`DONE`, which costs one method call.

Which paths need it, and why:

* **NIXL push** (``connectors/pd/push.py``): a WRITE is a zero-copy read
  of device memory by UCX, outside every CUDA stream; posted early, it sends
  stale bytes. A fence per layer in ``save_kv_layer`` (and one over the step
  in ``wait_for_save``); a layer's WRITE is posted once its fence is
  ``done()`` (polled by the progress pump, never waited on).
* **Mooncake store puts** (``connectors/mooncake_store/worker.py``): the batch
  put reads the registered tensors directly (Transfer Engine), outside every
  stream: same hazard. ``wait_for_save`` records a fence per device and
  :func:`wait_fence` (bounded by ``op_timeout_s``) before the put; on timeout
  the step's puts are dropped (``put_fence_timeouts``).
* **Offloading stores** (``connectors/offloading/worker.py``): the copy to the
  CPU slots runs ``non_blocking`` on a dedicated copy stream
  (:mod:`kvbridge.backends.device.copy`), which is made to wait for the
  compute stream; the fence (waited on before the copies,
  :data:`FENCE_TIMEOUT_S`) states the rule on the host side too, and on host
  memory it is :data:`DONE`. The copy stream's own end is a :class:`CudaFence`
  recorded on that stream, waited on (bounded) before the scheduler hears of it.
* **Mooncake store puts of device KV** go through a pinned staging buffer,
  filled on the same kind of copy stream after the same fence.
* **Not fenced**: a NIXL *pull* READ of the producer's blocks starts only after
  the producer's scheduler saw the step's output, which the engine obtained by
  synchronising with the step's stream (sampled tokens copied to the host);
  the offload tiers (fs files, Mooncake ``obj``) read the CPU slots, host memory
  a finished store already wrote.

Nothing else of kvbridge is imported here (dependency rule of ``backends``).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

__all__ = ["DONE", "FENCE_TIMEOUT_S", "CudaFence", "Fence", "record_fence", "wait_fence"]

#: Default bound of :func:`wait_fence` for paths without a timeout setting of their own.
FENCE_TIMEOUT_S = 30.0


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
    """A CUDA event recorded on ``stream`` (default: ``device``'s current stream); only
    ever queried (never ``synchronize()``: every wait on it is bounded, see
    :func:`wait_fence`)."""

    def __init__(self, device: Any, stream: Any = None) -> None:
        import torch

        self._event = torch.cuda.Event()
        self._event.record(stream if stream is not None else torch.cuda.current_stream(device))

    def done(self) -> bool:
        return bool(self._event.query())


def record_fence(tensor: Any) -> Fence:
    """A fence for the work queued so far on ``tensor``'s device (:data:`DONE` for host
    memory or anything that is not a CUDA tensor)."""
    device = getattr(tensor, "device", None)
    if device is not None and getattr(device, "type", None) == "cuda":
        return CudaFence(device)
    return DONE


def wait_fence(fence: Fence, timeout_s: float) -> bool:
    """Poll ``fence`` until it passed (True) or ``timeout_s`` ran out (False).

    For paths that must finish inside the engine's step (a put or copy the engine
    waits for anyway). A passed fence returns at once, without reading the clock."""
    if fence.done():
        return True
    deadline = time.monotonic() + timeout_s
    pause = 20e-6
    while True:
        time.sleep(pause)
        if fence.done():
            return True
        if time.monotonic() >= deadline:
            return False
        pause = min(pause * 2, 1e-3)
