"""kvbridge.events: KV cache events, wire-compatible with vLLM's ZMQ publisher.

Schema (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared`` in timestamped
``EventBatch``es), the msgpack codec, a ZMQ publisher with a replay ROUTER and
incarnation ids, a subscriber client that repairs gaps by replay, and an
in-process ``EventBuffer`` that tiers and connectors append to.

Of the rest of kvbridge this package imports only ``kvbridge.auth`` (the floor: it
seals the replay socket).
"""

from .aggregate import WorkerEventAggregator
from .buffer import CollectingEventSink, EventBuffer, EventSink, NullEventSink
from .errors import EndpointError, EventDecodeError, EventsError, PublisherClosedError
from .publisher import KVEventPublisher, PublisherConfig, PublisherStats
from .schema import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventCounts,
    KVEvent,
    Locality,
    Medium,
)
from .sequencer import Gap, LiveVerdict, ReplayVerdict, SequenceTracker
from .subscriber import (
    GapDetected,
    GapLost,
    KVEventSubscriber,
    MalformedFrame,
    PublisherRestarted,
    ReceivedBatch,
    StreamItem,
    SubscriberConfig,
    SubscriberStats,
)
from .wire import (
    END_SEQ,
    EventWireFormat,
    decode_batch,
    decode_event,
    encode_batch,
    encode_events,
    event_to_wire,
)

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "CollectingEventSink",
    "EventBatch",
    "EventBuffer",
    "EventCounts",
    "EndpointError",
    "EventDecodeError",
    "EventSink",
    "EventWireFormat",
    "EventsError",
    "Gap",
    "GapDetected",
    "GapLost",
    "KVEvent",
    "KVEventPublisher",
    "KVEventSubscriber",
    "LiveVerdict",
    "Locality",
    "MalformedFrame",
    "Medium",
    "NullEventSink",
    "PublisherClosedError",
    "PublisherConfig",
    "PublisherRestarted",
    "PublisherStats",
    "ReceivedBatch",
    "ReplayVerdict",
    "SequenceTracker",
    "StreamItem",
    "SubscriberConfig",
    "SubscriberStats",
    "WorkerEventAggregator",
    "decode_batch",
    "decode_event",
    "encode_batch",
    "encode_events",
    "event_to_wire",
]
