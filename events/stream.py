"""The items a subscriber hands out: batches, gaps, losses, restarts, malformed frames.

Owns :class:`ReceivedBatch`, :class:`GapDetected`, :class:`GapLost`,
:class:`PublisherRestarted`, :class:`MalformedFrame` and their union
:data:`StreamItem`: what a router consuming kvbridge's (or vLLM's) KV events
sees of the stream, in order. Pure data: this module imports no socket library.

May not touch: when each item is produced (:mod:`~kvbridge.events.subscriber`
and :mod:`~kvbridge.events.sequencer` decide), the batch inside
(:mod:`~kvbridge.events.schema`), the wire (:mod:`~kvbridge.events.wire`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from .schema import EventBatch


@dataclass(frozen=True)
class ReceivedBatch:
    seq: int
    batch: EventBatch
    topic: bytes
    replayed: bool = False


_new = object.__new__
_set = object.__setattr__


def _received_batch(seq: int, batch: EventBatch, topic: bytes, replayed: bool) -> ReceivedBatch:
    """``ReceivedBatch(seq, batch, topic, replayed)`` without the frozen dataclass
    ``__init__`` (one ``object.__setattr__`` per field): the subscriber builds one
    per batch. Equal to the constructed one in every field."""
    item = _new(ReceivedBatch)
    _set(item, "__dict__", {"seq": seq, "batch": batch, "topic": topic, "replayed": replayed})
    return item


@dataclass(frozen=True)
class GapDetected:
    start_seq: int
    end_seq: int  # exclusive

    @property
    def num_batches(self) -> int:
        return self.end_seq - self.start_seq


@dataclass(frozen=True)
class GapLost:
    start_seq: int
    end_seq: int  # exclusive
    reason: str

    @property
    def num_batches(self) -> int:
        return self.end_seq - self.start_seq


@dataclass(frozen=True)
class PublisherRestarted:
    previous_incarnation: int | None
    incarnation: int | None
    last_seq: int | None  # last seq delivered from the previous incarnation
    seq: int  # the seq that revealed the restart
    reason: str


@dataclass(frozen=True)
class MalformedFrame:
    source: str  # "live" or "replay"
    reason: str
    seq: int | None = None


StreamItem: TypeAlias = ReceivedBatch | GapDetected | GapLost | PublisherRestarted | MalformedFrame
