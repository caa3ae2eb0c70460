"""Where a rank's KV lives, as the code that reads it must see it: host-readable or not.

KV in GPU memory can be registered with a transport, digested on its device and
copied with torch, but never read by the host through a pointer, ``.numpy()``,
the buffer protocol or ``tolist``: on a GPU any of these crashes or silently
copies. :func:`host_readable` is the one question every path asks before it
takes a host shortcut (XXH3 over raw addresses, a memoryview of the block,
zero-copy registration with a host-only library).

CPU hosts cannot run the GPU paths for real, but they can run them honestly:
:func:`guard_host_access` wraps a CPU tensor so that it behaves like device KV
for this question and refuses every host-only access with :class:`HostAccessError`
(``.numpy()``, ``tolist()``, ``__array__``, ``__dlpack__``, pickling), while
``data_ptr()`` (registration) and torch ops (copies, gathers, digests) still
work. ``.cpu()`` and ``.to("cpu")`` return a plain copy, as they would from a
GPU. The reference engine allocates guarded KV when ``KVBRIDGE_KV_HOST_GUARD=1``
(:func:`guard_from_env`), and CI runs the connector suite once that way.

Owns: that question, the guard and its switch. May not touch: anything of
kvbridge (ground floor), a transport or a connector.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

#: set to 1 to give the reference engine's KV tensors the host-access guard
GUARD_ENV = "KVBRIDGE_KV_HOST_GUARD"


class HostAccessError(RuntimeError):
    """Host-only access to KV that is not host-readable (GPU memory, or the guard)."""


#: Tensor methods a GPU tensor cannot serve to the host without an explicit copy
_REFUSED = {
    torch.Tensor.numpy: "numpy()",
    torch.Tensor.tolist: "tolist()",
    torch.Tensor.__array__: "__array__ (numpy conversion)",
    torch.Tensor.__dlpack__: "__dlpack__",
    torch.Tensor.__reduce_ex__: "pickling",
}


def _copies_to_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``t.cpu()``, ``t.to("cpu")`` / ``t.to(device=...)`` naming the host."""
    if func is torch.Tensor.cpu:
        return True
    if func is not torch.Tensor.to:
        return False
    device = kwargs.get("device")
    for arg in args[1:]:
        if isinstance(arg, str | torch.device):
            device = arg
    return device is not None and torch.device(device).type == "cpu"


class HostGuardedTensor(torch.Tensor):
    """A CPU tensor that stands in for device KV: torch ops work, host reads refuse.

    Results of torch ops on it stay guarded (a view or a gather of device KV is
    still on the device); ``.cpu()`` and ``.to("cpu")`` are the explicit copy
    to the host and return a plain tensor.
    """

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        refused = _REFUSED.get(func)
        if refused is not None:
            raise HostAccessError(f"host access to KV that is not host-readable: {refused} "
                                  f"(the guard of {GUARD_ENV}; on a GPU this read would "
                                  f"fail or copy): copy it to the host with .cpu() first")
        if _copies_to_host(func, args, kwargs):
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            plain = out.as_subclass(torch.Tensor)
            return plain.clone() if plain.data_ptr() == args[0].data_ptr() else plain
        return super().__torch_function__(func, types, args, kwargs)

    def __iter__(self) -> Any:
        raise HostAccessError("host access to KV that is not host-readable: iteration "
                              f"(the guard of {GUARD_ENV})")


def guard_host_access(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (same storage) refusing host-only access; see :class:`HostGuardedTensor`."""
    if isinstance(tensor, HostGuardedTensor):
        return tensor
    return tensor.as_subclass(HostGuardedTensor)


def guard_from_env() -> bool:
    """Whether ``KVBRIDGE_KV_HOST_GUARD`` asks for guarded KV (``1``, ``true``, ``yes``)."""
    return os.environ.get(GUARD_ENV, "").strip().lower() in ("1", "true", "yes")


def host_readable(tensor: Any) -> bool:
    """Whether the host may read ``tensor``'s bytes directly (pointer, numpy, memoryview):
    host memory (pinned or not), not guarded. Anything without a ``device`` is host."""
    if isinstance(tensor, HostGuardedTensor):
        return False
    device = getattr(tensor, "device", None)
    return device is None or torch.device(device).type == "cpu"


def all_host_readable(tensors: Iterable[Any]) -> bool:
    """:func:`host_readable` of every tensor (True for none)."""
    return all(host_readable(t) for t in tensors)
