"""What the PD connector needs from a transport: :class:`PdTransport`, and how it gets one.

The worker's parts (loads, holds, push, sessions) are typed against this
protocol, not against any transport library: these fourteen members are the
whole of what they ask of a transport, so an adapter is an object with these
members, and a wrapper (fault injection, tracing, :mod:`.observe`) is one too.
The worker facade makes its rank's transport with a :class:`TransportFactory`
that the adapter's plugin hands it.

The records it speaks in (descriptor lists, peer handles, transfers) are the
transport-neutral ones of :mod:`kvbridge.backends.transfer`; an adapter raises
a :class:`~kvbridge.backends.transfer.TransportError` (a subclass of it) for
any call it refuses.

Owns: the protocols, and :class:`ForwardingTransport` (every member passed to
an inner transport: a wrapper overrides only what it changes). May not hold
logic or state beyond that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvbridge.backends.transfer import (
    DRAM,
    DescList,
    PeerHandle,
    Region,
    Transfer,
    TransportCounters,
    XferOp,
    XferState,
)

if TYPE_CHECKING:
    from kvbridge.connectors.pd.settings import PdSettings


class PdTransport(Protocol):
    """One rank's agent: registered memory, peers, one-sided transfers, notifications."""

    # ---- memory and identity (the facade, at registration)
    def register_regions(self, regions: Sequence[Any]) -> list[Region]: ...
    @property
    def memory_type(self) -> tuple[str, int]: ...
    def agent_metadata(self) -> bytes: ...

    # ---- peers and descriptor lists (sessions, producer push lists)
    def add_peer(self, peer_name: str, metadata: bytes) -> PeerHandle: ...
    def remove_peer(self, peer: PeerHandle) -> None: ...
    def prepare_local_descs(self, descs: Any) -> DescList: ...
    def prepare_remote(self, peer: PeerHandle, descs: Any, mem_type: str = ...) -> DescList: ...
    def release_dlist(self, dlist: DescList) -> None: ...

    # ---- transfers and notifications (loads, push, the pump)
    def post(self, op: XferOp | str, local: DescList, local_idx: Any, remote: DescList,
             remote_idx: Any, notif: bytes = ..., deadline_s: float = ...) -> Transfer: ...
    def poll(self, xfer: Transfer) -> XferState: ...
    def send_notif(self, peer: PeerHandle, msg: bytes) -> None: ...
    def get_notifs(self) -> dict[str, list[bytes]]: ...

    # ---- accounting and end of life (the facade)
    def counters(self) -> TransportCounters: ...
    def close(self, *, strict: bool = ...) -> TransportCounters: ...


class TransportFactory(Protocol):
    """Makes one rank's transport: what an adapter gives the PD worker."""

    #: the adapter's name (its connector's name): the prefix of the transport's live counts in
    #: :meth:`PdWorker.totals <kvbridge.connectors.pd.worker.PdWorker.totals>`
    @property
    def name(self) -> str: ...

    def __call__(self, agent_name: str, settings: PdSettings) -> PdTransport:
        """A transport for one rank, under ``agent_name`` (unique per process and
        rank; peers see it in the handshake), set up from the connector's settings."""
        ...


class ForwardingTransport:
    """A :class:`PdTransport` that runs every call on ``inner`` unchanged; the base of
    the wrappers (fault injection, tracing), which override what they change."""

    def __init__(self, inner: PdTransport) -> None:
        self.inner = inner

    def register_regions(self, regions: Sequence[Any]) -> list[Region]:
        return self.inner.register_regions(regions)

    @property
    def memory_type(self) -> tuple[str, int]:
        return self.inner.memory_type

    def agent_metadata(self) -> bytes:
        return self.inner.agent_metadata()

    def add_peer(self, peer_name: str, metadata: bytes) -> PeerHandle:
        return self.inner.add_peer(peer_name, metadata)

    def remove_peer(self, peer: PeerHandle) -> None:
        self.inner.remove_peer(peer)

    def prepare_local_descs(self, descs: Any) -> DescList:
        return self.inner.prepare_local_descs(descs)

    def prepare_remote(self, peer: PeerHandle, descs: Any, mem_type: str = DRAM) -> DescList:
        return self.inner.prepare_remote(peer, descs, mem_type)

    def release_dlist(self, dlist: DescList) -> None:
        self.inner.release_dlist(dlist)

    def post(self, op: XferOp | str, local: DescList, local_idx: Any, remote: DescList,
             remote_idx: Any, notif: bytes = b"", deadline_s: float = 30.0) -> Transfer:
        return self.inner.post(op, local, local_idx, remote, remote_idx, notif, deadline_s)

    def poll(self, xfer: Transfer) -> XferState:
        return self.inner.poll(xfer)

    def send_notif(self, peer: PeerHandle, msg: bytes) -> None:
        self.inner.send_notif(peer, msg)

    def get_notifs(self) -> dict[str, list[bytes]]:
        return self.inner.get_notifs()

    def counters(self) -> TransportCounters:
        return self.inner.counters()

    def close(self, *, strict: bool = True) -> TransportCounters:
        return self.inner.close(strict=strict)
