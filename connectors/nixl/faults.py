"""Fault injection for the NIXL worker (tests, conformance, the trace demo): failed loads.

:func:`fail_next_loads` makes the loads a consumer rank is ordered in its next
step fail the way a vanished producer makes them fail: just before such a load
is posted, its session's NIXL peers are removed (the real
``remove_remote_agent``), then the real post runs and the real NIXL path fails
it, so the engine sees those requests, and only those, as failed receives with
their block ids as load errors.

The production worker knows nothing of this: :class:`LoadFault` is installed
around one :class:`~kvbridge.connectors.nixl.worker.NixlWorker` object (its
``start_load_kv`` hook, to learn the step's loads, and its ``_post``, the call
the fault comes before), once, on first use. This module owns only that
wrapper's state; it may not change what the worker does for any other load.
"""

from __future__ import annotations

import time
from typing import Any

from kvbridge.connectors.nixl.scheduler import NixlMetadata
from kvbridge.connectors.nixl.session import PeerSession
from kvbridge.connectors.nixl.state import RecvTransfer
from kvbridge.connectors.nixl.worker import NixlWorker


class LoadFault:
    """Installed around ``worker``: the loads ordered in the step after :meth:`arm` lose
    their NIXL peers just before they are posted."""

    def __init__(self, worker: NixlWorker) -> None:
        self.worker = worker
        self.armed = False
        #: loads ordered in an armed step, not posted yet (consumer request ids)
        self.faulty: set[str] = set()
        real_start, real_post = worker.start_load_kv, worker._post

        def start_load_kv() -> None:
            with worker._state_lock:  # as the hook itself: the pump shares the state
                if self.armed:
                    meta = worker.connector_metadata
                    if isinstance(meta, NixlMetadata):
                        self.faulty.update(order.request_id for order in meta.loads)
                    self.armed = False
                real_start()

        def post(recv: RecvTransfer, session: PeerSession, now: float) -> None:
            if recv.request_id in self.faulty:
                self.faulty.discard(recv.request_id)
                assert worker.transport is not None
                for peer in list(session.peers.values()):
                    worker.transport.remove_peer(peer)  # the real NIXL call: the peer vanishes
            real_post(recv, session, now)

        # instance attributes: every call of the worker (hooks, pump) goes through them
        worker.start_load_kv = start_load_kv  # type: ignore[method-assign]
        worker._post = post  # type: ignore[method-assign]

    def arm(self) -> None:
        """The loads ordered in the worker's next ``start_load_kv`` fail."""
        with self.worker._state_lock:  # as a hook (``_locked``) would
            self.worker._last_progress = time.monotonic()
            self.armed = True


def fail_next_loads(connector: Any) -> bool:
    """Make the loads ordered in ``connector``'s next step fail (a vanished peer), when it
    is a :class:`NixlWorker` (installing the fault around it on first use); False when it
    is not one (nothing done)."""
    if not isinstance(connector, NixlWorker):
        return False
    fault = getattr(connector, "_load_fault", None)
    if not isinstance(fault, LoadFault):
        fault = LoadFault(connector)
        setattr(connector, "_load_fault", fault)  # noqa: B010 (not an attribute of the class)
    fault.arm()
    return True
