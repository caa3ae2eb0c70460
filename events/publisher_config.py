"""What a publisher is configured with, and the counters it reports.

Owns ``DEFAULT_ENDPOINT``, :class:`PublisherConfig` (endpoints, topic, wire
format, the replay ring's size, and the bounds on queues, replay requests,
replies under way and stalled clients), checked once when it is built, and
:class:`PublisherStats`. Pure data: this module imports no socket library.

May not touch: how the bounds are applied (:mod:`~kvbridge.events.publisher`
states the invariants and enforces them), the wire format it names
(:mod:`~kvbridge.events.wire`), the cluster secret (:mod:`kvbridge.auth`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .encoding import EventWireFormat

DEFAULT_ENDPOINT = "tcp://127.0.0.1:*"


@dataclass(frozen=True)
class PublisherConfig:
    """Where and how to publish. ``tcp://127.0.0.1:*`` binds a free port; read
    the resolved address from ``KVEventPublisher.endpoint``. Endpoints are
    always bound (the publisher is the stable side, as in vLLM's default)."""

    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = DEFAULT_ENDPOINT
    topic: str = ""
    data_parallel_rank: int | None = 0
    wire_format: EventWireFormat = EventWireFormat.MAP
    #: vLLM >= PR #45177 replies [topic, seq, payload]; older vLLM [seq, payload].
    replay_includes_topic: bool = True
    replay_buffer_batches: int = 10_000
    max_queue_batches: int = 100_000
    #: ZMQ send high-water mark of the PUB socket, in messages (batches).
    hwm: int = 100_000
    #: How long ``publish`` waits for queue space before dropping the batch.
    enqueue_timeout_s: float = 1.0
    #: Identifies this publisher's life; None: derived from the start time (ns).
    incarnation: int | None = None
    #: A fixed port may still be held by a just-closed socket (ZMQ releases it
    #: asynchronously): retry the bind for this long on EADDRINUSE.
    bind_retry_s: float = 1.0
    #: Replay ROUTER send high-water mark, in messages per client (never 0: an
    #: unread reply would otherwise queue without bound).
    replay_sndhwm: int = 1000
    #: Replay ROUTER receive high-water mark, in requests.
    replay_rcvhwm: int = 1000
    #: Largest replay request frame accepted (MAXMSGSIZE; a request is < 100 bytes).
    max_replay_request_bytes: int = 1024
    #: Most batches one replay reply carries (the client asks again for the rest).
    max_replay_batches_per_request: int = 10_000
    #: Replies under way at once (one per client identity).
    max_replay_clients: int = 64
    #: Requests a client may queue behind its reply under way; more are refused.
    max_queued_replays: int = 4
    #: A reply whose client read nothing for this long is abandoned.
    replay_stall_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in (
            "replay_buffer_batches",
            "max_queue_batches",
            "replay_sndhwm",
            "replay_rcvhwm",
            "max_replay_request_bytes",
            "max_replay_batches_per_request",
            "max_replay_clients",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive number")
        if self.max_queued_replays < 0:
            raise ValueError("max_queued_replays: expected >= 0")
        if not self.replay_stall_timeout_s > 0:
            raise ValueError("replay_stall_timeout_s: expected > 0 seconds")
        if self.hwm < 0:
            raise ValueError("hwm: expected >= 0 (0 means unlimited)")


@dataclass(frozen=True)
class PublisherStats:
    published_batches: int
    published_events: int
    dropped_batches: int
    replay_requests: int
    replayed_batches: int
    bad_replay_requests: int
    queued_batches: int
    next_seq: int
    #: Requests answered by the end marker alone (too many clients or queued requests).
    refused_replay_requests: int = 0
    #: Replies dropped because their client stopped reading (or went away).
    abandoned_replays: int = 0
    #: Replies under way now.
    replay_clients: int = 0
    #: Subscriptions received on the PUB socket since start (one per SUB and topic;
    #: reconnects count again).
    subscriptions: int = 0
    #: Replay requests refused because they were not sealed with the cluster secret.
    unauthenticated_replay_requests: int = 0
