"""Error types of the events package."""

from __future__ import annotations


class EventsError(Exception):
    """Base class of every error raised by ``kvbridge.events``."""


class EventDecodeError(EventsError, ValueError):
    """A frame or payload does not follow the KV-event wire format.

    ``field`` names the offending part (``"payload"``, ``"events[2].block_size"``,
    ``"frames[1] (seq)"``) so a subscriber can log exactly what a peer got wrong.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class PublisherClosedError(EventsError, RuntimeError):
    """``publish`` was called after ``close``."""
