"""In-process collection of KV events, and the sink protocol the engine publishes to.

Tiers and connectors append events to an ``EventBuffer`` as things happen; the
engine takes them once per step (``take()``) and hands the step's events to an
``EventSink`` in one batch. Neither side needs to know about ZMQ.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from .schema import KVEvent


@runtime_checkable
class EventSink(Protocol):
    """Receives one batch of events per engine step (``KVEventPublisher`` is one)."""

    def publish(self, events: Sequence[KVEvent]) -> object: ...


class NullEventSink:
    """A sink that drops everything (events disabled)."""

    def publish(self, events: Sequence[KVEvent]) -> None:
        return None


class CollectingEventSink:
    """A sink that keeps every published batch in memory (tests, demos)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batches: list[tuple[KVEvent, ...]] = []

    def publish(self, events: Sequence[KVEvent]) -> None:
        if events:
            with self._lock:
                self._batches.append(tuple(events))

    @property
    def batches(self) -> list[tuple[KVEvent, ...]]:
        with self._lock:
            return list(self._batches)

    @property
    def events(self) -> list[KVEvent]:
        return [event for batch in self.batches for event in batch]


class EventBuffer:
    """Thread-safe append-only list of events with ``take()``.

    Invariant: every appended event is returned by exactly one ``take()``, in
    append order (worker threads may append while the scheduler takes).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[KVEvent] = []

    def append(self, event: KVEvent) -> None:
        with self._lock:
            self._events.append(event)

    def extend(self, events: Iterable[KVEvent]) -> None:
        with self._lock:
            self._events.extend(events)

    def take(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)
