"""Publish a worker-side event once every worker that holds the block reported it.

With tensor parallelism each worker rank stores its own slice of a block; the
block is usable (and worth announcing) only when all ranks stored it. Workers
report their events independently and possibly in different steps, so the
aggregator keeps partial reports until they complete.

Invariant: an event is returned by ``take_complete`` exactly as many times as
the *least* number of times any rank reported it (a block stored, removed and
stored again is announced twice once all ranks reported it twice).
"""

from __future__ import annotations

from collections.abc import Iterable

from .schema import KVEvent


class WorkerEventAggregator:
    def __init__(self, num_workers: int) -> None:
        if num_workers <= 0:
            raise ValueError("num_workers: expected a positive number of worker ranks")
        self.num_workers = num_workers
        # Insertion-ordered: events complete in the order they were first reported.
        self._pending: dict[KVEvent, list[int]] = {}

    def add(self, worker_rank: int, events: Iterable[KVEvent]) -> None:
        if not 0 <= worker_rank < self.num_workers:
            raise ValueError(
                f"worker_rank: expected 0..{self.num_workers - 1}, got {worker_rank}"
            )
        for event in events:
            counts = self._pending.get(event)
            if counts is None:
                counts = self._pending[event] = [0] * self.num_workers
            counts[worker_rank] += 1

    def take_complete(self) -> list[KVEvent]:
        """Events every rank has reported (once per complete round), oldest first."""
        out: list[KVEvent] = []
        for event in list(self._pending):
            counts = self._pending[event]
            rounds = min(counts)
            if rounds == 0:
                continue
            out.extend([event] * rounds)
            remaining = [c - rounds for c in counts]
            if any(remaining):
                self._pending[event] = remaining
            else:
                del self._pending[event]
        return out

    @property
    def num_pending(self) -> int:
        """Distinct events still waiting for some rank."""
        return len(self._pending)
