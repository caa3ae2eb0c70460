"""Fault injection for the PD worker (tests, conformance, the trace demo): failed loads.

:func:`fail_next_loads` makes the loads a consumer rank is ordered in its next
step fail the way a vanished producer makes them fail: as such a load's first
message goes out, the transport's peer it goes to is removed (the real
``remove_peer`` of the adapter) and the real send fails, so the adapter's own path
fails the load, and the engine sees those requests, and only those, as failed
receives with their block ids as load errors.

The production worker knows nothing of this: the fault is a
:class:`FaultyTransport` the worker is given in place of its transport
(:meth:`~kvbridge.connectors.pd.worker.PdWorker.wrap_transport`), installed
once, on first use; which loads are doomed it learns as an observer of the
worker (:meth:`~kvbridge.connectors.pd.worker.PdWorker.observe`: the loads
each step orders). This module owns only the fault's state; it may not change
what the transport does for any other load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvbridge.backends.transfer import PeerHandle
from kvbridge.connectors.pd import messages
from kvbridge.connectors.pd.observe import NullObserver
from kvbridge.connectors.pd.scheduler import LoadOrder
from kvbridge.connectors.pd.transport import ForwardingTransport, PdTransport
from kvbridge.connectors.pd.worker import PdWorker


class FaultyTransport(ForwardingTransport):
    """A :class:`~.transport.PdTransport` that loses the peer a doomed load's first
    message goes to (every other call runs on ``inner`` unchanged)."""

    def __init__(self, inner: PdTransport) -> None:
        super().__init__(inner)
        #: producer request ids of doomed loads that sent nothing yet
        self.doomed: set[str] = set()

    def doom(self, producer_request_ids: Sequence[str]) -> None:
        self.doomed.update(producer_request_ids)

    def send_notif(self, peer: PeerHandle, msg: bytes) -> None:
        if self.doomed:
            try:
                rid = getattr(messages.decode(msg), "request_id", None)
            except messages.NotifError:
                rid = None
            if rid in self.doomed:
                self.doomed.discard(rid)
                self.inner.remove_peer(peer)  # the adapter's real call: the peer vanishes
        self.inner.send_notif(peer, msg)


class LoadFault(NullObserver):
    """Installed on ``worker``: the loads ordered in the step after :meth:`arm` lose
    their transport peer as they are posted."""

    def __init__(self, worker: PdWorker) -> None:
        self.worker = worker
        self.armed = False
        self.transport: FaultyTransport | None = None

        def wrap(inner: PdTransport) -> PdTransport:
            self.transport = FaultyTransport(inner)
            return self.transport

        worker.wrap_transport(wrap)
        worker.observe(self)

    def loads_ordered(self, orders: Sequence[LoadOrder]) -> None:
        """The worker's step orders these loads (under its state lock)."""
        if self.armed and self.transport is not None:
            self.transport.doom([order.params.producer_request_id for order in orders])
        self.armed = False

    def arm(self) -> None:
        """The loads ordered in the worker's next ``start_load_kv`` fail."""
        with self.worker.pump.lock:  # as a hook (``_locked``) would
            self.worker.pump.touch()
            self.armed = True


def fail_next_loads(connector: Any) -> bool:
    """Make the loads ordered in ``connector``'s next step fail (a vanished peer), when it
    is a registered :class:`~kvbridge.connectors.pd.worker.PdWorker` (installing the fault
    on it on first use); False when it is not one (nothing done)."""
    if not isinstance(connector, PdWorker) or connector.transport is None:
        return False
    fault = getattr(connector, "_load_fault", None)
    if not isinstance(fault, LoadFault):
        fault = LoadFault(connector)
        setattr(connector, "_load_fault", fault)  # noqa: B010 (not an attribute of the class)
    fault.arm()
    return True
