"""The progress pump: the lock every hook takes, and the thread that progresses an idle rank.

The facade's ``_progress`` (:class:`~kvbridge.connectors.pd.worker.PdWorker`)
drains the transport's notifications (which also progresses a transport that has
no thread of its own, as the passive side of a READ must) and dispatches them, settles handshakes, posts and polls
loads, sends releases, progresses pushes, expires leases and deferred messages,
and sends heartbeats, calling each part in that order. Every hook runs it (or
touches the state) under :attr:`Pump.lock`; the idle pump thread runs the same
step under the same lock when no hook came for ``idle_progress_ms``, so the
worker's state is only ever touched by one thread at a time.

Owns: the state lock, ``last_progress``, ``closed``, the pump thread and its
stop event. May not touch: any part's state (it calls the step it is given,
and reads the hints it is given for its interval).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvbridge.connectors.pd.worker_state import WorkerContext


class Pump:
    """The state lock and the idle progress thread of one rank."""

    def __init__(self, cx: WorkerContext, step: Callable[[], None],
                 peer_may_wait: Callable[[], bool], reading: Callable[[], bool]) -> None:
        self.cx = cx
        self._step = step
        self._peer_may_wait = peer_may_wait
        self._reading = reading
        self.lock = threading.RLock()
        self.last_progress = time.monotonic()
        self.closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def touch(self) -> None:
        """A hook or a step ran (the idle thread waits a full interval after it)."""
        self.last_progress = time.monotonic()

    def start(self) -> None:
        if self.cx.settings.idle_progress_ms > 0:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"kvb-pd-pump-r{self.cx.rank_index}")
            self._thread.start()

    def stop(self) -> bool:
        """Close: no step runs after this returns; False when it was closed already."""
        if self.closed:
            return False
        with self.lock:
            self.closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        return True

    def _loop(self) -> None:
        """Progress while the engine is idle (no hook call for ``idle_progress_ms``).

        An idle engine does not step, yet a peer may be reading from this rank
        (the passive side of a transport without a thread must progress it) or waiting for an ack.
        The pump runs the same step as the hooks, under the same lock, so the
        worker's state is only ever touched by one thread at a time.

        While a peer may be waiting on this rank (blocks held under a lease, loads,
        pushes, releases or handshakes in flight) it polls every
        ``busy_progress_ms`` (0.2 ms) at most: a consumer's ``begin`` is then
        answered (and its ``read`` acked) within a fraction of a millisecond
        instead of a full idle interval: one of them is on every pull load's
        critical path. While a READ of this rank is in flight it polls every
        ``read_progress_ms`` (0.05 ms): the READ moves and is seen done only as
        the rank progresses."""
        s = self.cx.settings
        idle = s.idle_progress_ms / 1000.0
        busy = min(idle, s.busy_progress_ms / 1000.0)
        reading = min(busy, s.read_progress_ms / 1000.0)
        interval = idle
        while not self._stop.wait(interval):
            # the hints are read without the lock: they choose the interval only
            interval = (reading if self._reading() else busy) if self._peer_may_wait() else idle
            if time.monotonic() - self.last_progress < interval:
                continue
            with self.lock:
                if self.closed:
                    return
                try:
                    self._step()
                except Exception:  # never kill the pump; the next hook reports properly
                    self.cx.log.exception("pd: idle progress failed on rank %d",
                                          self.cx.rank_index)
