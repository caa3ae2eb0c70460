"""Where an engine's KV events go: one batch per step to the sink, and a kept copy.

:class:`EventOutlet` is the one owner of the event sink, the publisher the engine
bound itself (closed at shutdown) and ``events`` (the kept copy, when
``keep_events``). The step loop gathers each step's events (block pools first,
then the workers', then the scheduler connector's) and hands them here as one
batch.

May not touch: which events a step makes (:mod:`kvbridge.engine.blocks`, the
connectors) or when (:mod:`kvbridge.engine.core`).
"""

from __future__ import annotations

from kvbridge.events import EventSink, KVEvent, KVEventPublisher


class EventOutlet:
    """The event sink of one engine."""

    def __init__(self, sink: EventSink | None, publisher: KVEventPublisher | None, *,
                 keep: bool, close_timeout_s: float) -> None:
        self.sink = sink
        #: bound by the engine itself (``events=``): it closes it
        self.publisher = publisher
        #: events also go to :attr:`events`
        self.keep = keep
        self.events: list[KVEvent] = []
        self._close_timeout_s = close_timeout_s

    def publish(self, events: list[KVEvent]) -> None:
        """One batch to the sink (and :attr:`events` when kept); nothing when empty."""
        if not events:
            return
        if self.sink is not None:
            self.sink.publish(events)
        if self.keep:
            self.events.extend(events)

    def close(self) -> None:
        """Close the engine's own publisher, waiting at most the configured time for
        subscribers to take what is queued (it logs what it abandons)."""
        if self.publisher is not None:
            self.publisher.close(timeout_s=self._close_timeout_s)

    def abandon(self) -> None:
        """Close the engine's own publisher at once (the engine failed to start)."""
        if self.publisher is not None:
            self.publisher.close(timeout_s=0)
