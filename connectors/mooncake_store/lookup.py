"""The scheduler half's own store client, on a background thread: existence checks and removals.

The scheduler thread must never wait for the store, so a lookup is a
:class:`~concurrent.futures.Future` answered by this thread: the scheduler
returns ``None`` ("ask again next step") until it is done, and treats a
lookup that outlives ``lookup_timeout_s`` as a miss.

The client comes from the process-wide pool (:mod:`.clients`): in the
reference engine it is the workers' client; in a serving engine's scheduler
process it is a client of its own that lends ``scheduler_segment_size``
bytes (0 by default: it only checks existence). It is acquired lazily on
this thread, so the scheduler never blocks on ``setup()``; when setup fails
(master down) every lookup answers ``None`` (a miss) and setup is retried at
most every ``reconnect_interval_s``. Once set up, Mooncake re-mounts by itself
after a master restart, so recovery needs nothing from us.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

from kvbridge.backends.mooncake import KeyResult, MooncakeError, MooncakeStoreClient
from kvbridge.connectors.mooncake_store import clients
from kvbridge.connectors.mooncake_store.settings import MooncakeStoreSettings

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: ``None`` when no client could be set up (master unreachable): a miss.
ExistsAnswer = list[KeyResult] | None


class LookupThread:
    """One daemon thread serving existence checks for the scheduler half. Thread-safe."""

    def __init__(self, settings: MooncakeStoreSettings, pool_key: clients.PoolKey,
                 name: str = "kvb-mooncake-lookup") -> None:
        self.settings = settings
        self.pool_key = pool_key
        self._jobs: queue.SimpleQueue[tuple[Sequence[str], Future[ExistsAnswer]] | None] = (
            queue.SimpleQueue())
        self._client_lock = threading.Lock()
        self._client: MooncakeStoreClient | None = None
        self._next_connect = 0.0
        self._closed = False
        self.setup_failures = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def exists(self, keys: Sequence[str]) -> Future[ExistsAnswer]:
        """Queue a batch existence check; the future's result is per-key results or None."""
        future: Future[ExistsAnswer] = Future()
        if self._closed:
            future.set_result(None)
            return future
        self._jobs.put((keys, future))
        return future

    def call(self, fn: Callable[[MooncakeStoreClient], T]) -> T | None:
        """Run ``fn(client)`` on the caller's thread (None when no client can be set up).

        For rare administrative calls (removals); the client's own deadline bounds them.
        """
        client = self._ensure_client()
        return fn(client) if client is not None else None

    def _ensure_client(self) -> MooncakeStoreClient | None:
        with self._client_lock:
            if self._client is not None or self._closed:
                return self._client
            now = time.monotonic()
            if now < self._next_connect:
                return None
            try:
                self._client = clients.acquire(
                    self.pool_key,
                    self.settings.client_config(segment_size=self.settings.scheduler_segment_size))
            except MooncakeError as exc:
                self.setup_failures += 1
                self._next_connect = now + self.settings.reconnect_interval_s
                logger.warning("mooncake store lookups: no client (%s); lookups are misses, "
                               "retrying in %.1f s", exc, self.settings.reconnect_interval_s)
                return None
            return self._client

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            keys, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                client = self._ensure_client()
                future.set_result(client.batch_exists_results(keys) if client is not None
                                  else None)
            except Exception as exc:  # a lookup must answer, whatever happened
                logger.warning("mooncake store lookup of %d keys failed: %r", len(keys), exc)
                future.set_result(None)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the thread (bounded) and release the client. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join(self.settings.op_timeout_s + 1.0 if timeout_s is None else timeout_s)
        if self._thread.is_alive():
            logger.warning("mooncake store lookup thread still busy at shutdown")
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            clients.release(self.pool_key)
