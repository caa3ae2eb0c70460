"""What a worker tells an observer (tracing): :class:`WorkerObserver`.

The worker's parts call the observer at the points a trace shows: the loads a
step orders, a handshake (or its failure), a notification received, a load's
failure, a finished load's verification, the requests a step finished. Transfers posted, their
completions and the notifications sent are seen by the transport the parts
are given: :class:`ObservedTransport` wraps the real one (it is a
:class:`~.transport.PdTransport` like any other) and tells the observer.

An observer only looks: it must not change an argument nor raise. The worker
tells every observer attached (``PdWorker.observe``, in the order attached)
through one :class:`Observers`; none is attached by default.

Owns: the protocol, :class:`NullObserver` (a base that ignores every event),
:class:`Observers` and the observing transport. May not hold any of the
worker's state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvbridge.backends.transfer import (
    DescList,
    PeerHandle,
    Transfer,
    XferOp,
    XferState,
)
from kvbridge.connectors.pd import messages
from kvbridge.connectors.pd.scheduler import LoadOrder
from kvbridge.connectors.pd.state import RecvTransfer
from kvbridge.connectors.pd.transport import ForwardingTransport, PdTransport
from kvbridge.handshake import FetchResult
from kvbridge.layouts.digests import Digester


class WorkerObserver(Protocol):
    """The events of one rank's PD worker, in the order they happen."""

    def loads_ordered(self, orders: Sequence[LoadOrder]) -> None: ...
    def handshake(self, address: str, result: FetchResult) -> None: ...
    def handshake_failed(self, address: str, error: Exception) -> None: ...
    def posted(self, xfer: Transfer) -> None: ...
    def polled(self, xfer: Transfer, state: XferState) -> None: ...
    def notif_sent(self, peer: PeerHandle, msg: bytes, error: str | None) -> None: ...
    def notif_received(self, sender: str, msg: messages.Notif) -> None: ...
    def failure(self, recv: RecvTransfer, reason: str) -> None: ...
    def verified(self, recv: RecvTransfer, bad: set[tuple[int, int]],
                 digesters: Mapping[str, Digester]) -> None: ...
    def finished(self, sending: set[str], recving: set[str]) -> None: ...


class NullObserver:
    """Ignores every event: a base for an observer of a few of them."""

    def loads_ordered(self, orders: Sequence[LoadOrder]) -> None:
        pass

    def handshake(self, address: str, result: FetchResult) -> None:
        pass

    def handshake_failed(self, address: str, error: Exception) -> None:
        pass

    def posted(self, xfer: Transfer) -> None:
        pass

    def polled(self, xfer: Transfer, state: XferState) -> None:
        pass

    def notif_sent(self, peer: PeerHandle, msg: bytes, error: str | None) -> None:
        pass

    def notif_received(self, sender: str, msg: messages.Notif) -> None:
        pass

    def failure(self, recv: RecvTransfer, reason: str) -> None:
        pass

    def verified(self, recv: RecvTransfer, bad: set[tuple[int, int]],
                 digesters: Mapping[str, Digester]) -> None:
        pass

    def finished(self, sending: set[str], recving: set[str]) -> None:
        pass


class Observers:
    """Every observer attached to one worker, each told of every event in turn."""

    def __init__(self) -> None:
        self._all: list[WorkerObserver] = []

    def attach(self, observer: WorkerObserver) -> None:
        self._all.append(observer)

    def loads_ordered(self, orders: Sequence[LoadOrder]) -> None:
        for observer in self._all:
            observer.loads_ordered(orders)

    def handshake(self, address: str, result: FetchResult) -> None:
        for observer in self._all:
            observer.handshake(address, result)

    def handshake_failed(self, address: str, error: Exception) -> None:
        for observer in self._all:
            observer.handshake_failed(address, error)

    def posted(self, xfer: Transfer) -> None:
        for observer in self._all:
            observer.posted(xfer)

    def polled(self, xfer: Transfer, state: XferState) -> None:
        for observer in self._all:
            observer.polled(xfer, state)

    def notif_sent(self, peer: PeerHandle, msg: bytes, error: str | None) -> None:
        for observer in self._all:
            observer.notif_sent(peer, msg, error)

    def notif_received(self, sender: str, msg: messages.Notif) -> None:
        for observer in self._all:
            observer.notif_received(sender, msg)

    def failure(self, recv: RecvTransfer, reason: str) -> None:
        for observer in self._all:
            observer.failure(recv, reason)

    def verified(self, recv: RecvTransfer, bad: set[tuple[int, int]],
                 digesters: Mapping[str, Digester]) -> None:
        for observer in self._all:
            observer.verified(recv, bad, digesters)

    def finished(self, sending: set[str], recving: set[str]) -> None:
        for observer in self._all:
            observer.finished(sending, recving)


class ObservedTransport(ForwardingTransport):
    """A :class:`~.transport.PdTransport` that runs every call on ``inner`` and tells
    ``observer`` of the transfers posted and settled and the notifications sent."""

    def __init__(self, inner: PdTransport, observer: WorkerObserver) -> None:
        super().__init__(inner)
        self.observer = observer

    def post(self, op: XferOp | str, local: DescList, local_idx: Any, remote: DescList,
             remote_idx: Any, notif: bytes = b"", deadline_s: float = 30.0) -> Transfer:
        xfer = self.inner.post(op, local, local_idx, remote, remote_idx, notif, deadline_s)
        self.observer.posted(xfer)
        return xfer

    def poll(self, xfer: Transfer) -> XferState:
        state = self.inner.poll(xfer)
        self.observer.polled(xfer, state)
        return state

    def send_notif(self, peer: PeerHandle, msg: bytes) -> None:
        try:
            self.inner.send_notif(peer, msg)
        except Exception as exc:
            self.observer.notif_sent(peer, msg, str(exc))
            raise
        self.observer.notif_sent(peer, msg, None)
