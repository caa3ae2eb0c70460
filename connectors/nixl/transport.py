"""What the PD connector needs from a transport: :class:`PdTransport`.

The worker's parts (loads, holds, push, sessions) are typed against this
protocol, not against :class:`~kvbridge.backends.nixl.NixlTransport`: these
fourteen members are the whole of what they ask of the transport, so a second
transport is an object with these members, and a wrapper (fault injection,
:mod:`.faults`; tracing, :mod:`.observe`) is one too.

The records it speaks in (descriptor lists, peer handles, transfers) are still
NIXL's own (:mod:`kvbridge.backends.nixl.records`); they are plain records, not
the NIXL API.

Owns: the protocol only. May not hold logic or state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvbridge.backends.nixl import (
    DescList,
    PeerHandle,
    Region,
    Transfer,
    TransportCounters,
    XferOp,
    XferState,
)


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
