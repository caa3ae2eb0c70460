"""Outcomes of a worker's loads, reported once per step as one consistent snapshot.

Workers that load blocks on a background thread (the Mooncake store, the shared
storage reference connector) record each finished load here; ``get_finished``
takes one snapshot, and the step's other two reports (requests whose load
failed, blocks that could not be loaded) read that same snapshot. Invariant: a
request reported finished with a failure has its invalid blocks reported in the
same step, even when another load completes while the step reports.
"""

from __future__ import annotations

import threading

from kvbridge.connectors.api import BlockRef


class LoadOutcomes:
    """Thread-safe: loads finish on any thread, reports are taken on the worker's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._invalid: set[BlockRef] = set()
        self._report_failed: set[str] = set()
        self._report_invalid: set[BlockRef] = set()

    def add_invalid(self, blocks: set[BlockRef]) -> None:
        """Blocks of a synchronous load that failed (the request itself is not tracked)."""
        with self._lock:
            self._invalid |= blocks

    def finish(self, request_id: str, failed: set[BlockRef]) -> None:
        """An asynchronous load of ``request_id`` ended; ``failed`` are its blocks that did not load."""
        with self._lock:
            self._invalid |= failed
            self._done.add(request_id)
            if failed:
                self._failed.add(request_id)

    def snapshot(self) -> set[str]:
        """Start a step's report: the requests whose loads finished since the last one."""
        with self._lock:
            done, self._done = self._done, set()
            self._report_failed, self._failed = self._failed, set()
            self._report_invalid, self._invalid = self._invalid, set()
        return done

    def take_failed_recving(self) -> set[str]:
        """Requests of the last snapshot whose load failed (each reported once)."""
        failed, self._report_failed = self._report_failed, set()
        return failed

    def take_invalid_blocks(self) -> set[BlockRef]:
        """Blocks of the last snapshot that could not be loaded (each reported once)."""
        invalid, self._report_invalid = self._report_invalid, set()
        return invalid
