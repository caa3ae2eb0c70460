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


class EndpointError(EventsError, ValueError):
    """An endpoint ZeroMQ cannot connect to (``field``: ``endpoint`` or ``replay_endpoint``).

    Raised when the subscriber is made, before anything is received, so a typo in an
    address is a usage error that names the argument, not a traceback later.
    """

    def __init__(self, field: str, endpoint: str, reason: str) -> None:
        super().__init__(f"{field}: cannot connect to {endpoint[:200]!r} ({reason}); "
                         "expected tcp://HOST:PORT, ipc://PATH or inproc://NAME")
        self.field = field
        self.endpoint = endpoint
        self.reason = reason
