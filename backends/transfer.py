"""The vocabulary of a one-sided transfer transport: errors, memory types, states, records.

A transport registers memory, adds peers from their metadata, prepares
descriptor lists and posts READs and WRITEs against them, then polls each
transfer to a terminal state. The PD connector core speaks to any transport in
these records (:class:`Region`, :class:`PeerHandle`, :class:`DescList`,
:class:`Transfer` with its :class:`XferState` lifecycle, :class:`XferOp`,
:class:`TransportCounters`), the memory type names (``DRAM``, ``VRAM``) and one
error base, :class:`TransportError`, that every adapter's errors subclass.
Records only: no library call, no lock, no state machine (a transport advances
a :class:`Transfer`; this file only says what one is).

May not touch: any transfer library, torch, or any other module of kvbridge
(it is the bottom of the transport adapters: each of them may import it, it
imports none of them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

#: Memory types kvbridge registers and prepares: host memory (pinned or not) and
#: CUDA device memory.
DRAM = "DRAM"
VRAM = "VRAM"
MEM_TYPES = (DRAM, VRAM)


class TransportError(RuntimeError):
    """A transport refused a call: a bad argument, an unknown handle or peer, a closed
    transport, or a peer it cannot reach. Each adapter raises a subclass of it."""


class XferOp(str, enum.Enum):
    """Direction of a transfer, seen from the initiator (the side that posts)."""

    READ = "READ"  # remote -> local
    WRITE = "WRITE"  # local -> remote


class XferState(str, enum.Enum):
    """Lifecycle of a :class:`Transfer`. Only PENDING is non-terminal."""

    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"
    TIMED_OUT = "TIMED_OUT"

    @property
    def terminal(self) -> bool:
        return self is not XferState.PENDING


@dataclass(frozen=True)
class Region:
    """A registered memory region. ``region_id`` indexes :meth:`register_regions` order.

    ``addr``/``nbytes`` span the item given (a tensor, or ``(addr, nbytes)``);
    the transport's registration behind it is the item's whole backing storage
    (for transports that register whole allocations), shared by every region on
    the same storage. ``mem_type`` is ``DRAM`` or ``VRAM``,
    ``device_id`` the CUDA device (0 for host memory).
    """

    region_id: int
    addr: int
    nbytes: int
    mem_type: str = DRAM
    device_id: int = 0


@dataclass(frozen=True)
class PeerHandle:
    """A remote agent added from its metadata.

    ``generation`` increases every time a peer of the same name is (re-)added,
    so lists prepared for an earlier incarnation are refused instead of
    silently addressing a restarted process's memory.
    """

    name: str
    generation: int


@dataclass(frozen=True)
class DescList:
    """A prepared descriptor list; transfers refer to its rows by index.

    ``peer`` is ``None`` for a local list. ``num_descs`` bounds valid indices.
    """

    list_id: int
    num_descs: int
    peer: PeerHandle | None


@dataclass(frozen=True)
class TransportCounters:
    """Live-object counts for leak checks, plus lifetime totals."""

    registrations: int
    dlists: int
    xfer_handles: int
    peers: int
    zombies: int
    forced_releases: int
    posted: int
    done: int
    failed: int
    timed_out: int
    bytes_done: int
    #: transfers cut across lanes (several agents of one rank), each counted once in
    #: ``posted`` too
    cut_transfers: int = 0

    @property
    def live(self) -> int:
        """Sum of the live counts; zero after the transport's ``close``."""
        return self.registrations + self.dlists + self.xfer_handles + self.peers


@dataclass(eq=False)  # identity semantics: each post is a distinct transfer
class Transfer:
    """One posted transfer. Created by a transport's ``post``, advanced by its ``poll``.

    Telemetry: ``nbytes`` and ``num_descs`` are computed from the prepared
    lists at post time; ``duration_s`` is post-to-terminal as observed by
    ``poll`` (so its resolution is the caller's polling interval);
    ``library_xfer_s`` is the transfer library's own telemetry of a DONE
    transfer (post to the completion the library saw), None when it gave none.

    ``quiesced`` is True once the library no longer touches this transfer's
    memory (DONE, or an error it reported). A TIMED_OUT transfer becomes
    quiesced later, when its zombie handle settles; until then its local
    blocks (READ destination / WRITE source) must not be reused.
    """

    transfer_id: int
    op: XferOp
    peer: PeerHandle
    nbytes: int
    num_descs: int
    notif: bytes
    posted_at: float
    deadline: float
    state: XferState = XferState.PENDING
    error: str | None = None
    finished_at: float | None = None
    quiesced: bool = False
    library_xfer_s: float | None = None
    _handle: Any = field(default=None, repr=False)
    #: parts 1.. of a transfer cut across lanes (a transport's own part records); part 0
    #: is ``_handle``, on the transport's own agent
    _lane_parts: list[Any] = field(default_factory=list, repr=False)

    @property
    def duration_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.posted_at

    @property
    def gbps(self) -> float | None:
        d = self.duration_s
        return None if not d else self.nbytes / d / 1e9
