"""The NIXL transport's own errors; the records it speaks in are transport-neutral.

:class:`NixlTransportError` is a :class:`~kvbridge.backends.transfer.TransportError`
(so code above the transport catches the neutral one), and
:class:`NixlUnavailableError` says NIXL cannot load. The records and memory type
names (:mod:`kvbridge.backends.transfer`) are re-exported here, where the NIXL
modules have always imported them from.

May not touch: NIXL itself, torch, or any module of kvbridge but
:mod:`kvbridge.backends.transfer` (the bottom of the ``nixl`` modules: every one
of them may import it).
"""

from __future__ import annotations

from kvbridge.backends.transfer import (
    DRAM,
    MEM_TYPES,
    VRAM,
    DescList,
    PeerHandle,
    Region,
    Transfer,
    TransportCounters,
    TransportError,
    XferOp,
    XferState,
)

__all__ = ["DRAM", "MEM_TYPES", "VRAM", "DescList", "NixlTransportError",
           "NixlUnavailableError", "PeerHandle", "Region", "Transfer", "TransportCounters",
           "TransportError", "XferOp", "XferState"]


class NixlTransportError(TransportError):
    """A misuse of the NIXL transport (bad argument, unknown handle, closed transport)."""


class NixlUnavailableError(NixlTransportError):
    """NIXL cannot be imported or has no UCX backend on this machine."""
