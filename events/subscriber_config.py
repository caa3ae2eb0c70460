"""What a subscriber is configured with, and the counters it reports.

Owns :class:`SubscriberConfig` (endpoints, topic, where to start, and the bounds
that keep a hostile or broken replay endpoint from costing memory or stalling
the live stream: frame size, pending batches and bytes per reply, chunks per
gap, replay backoff), checked once when it is built, and
:class:`SubscriberStats` with ``_Counters``, its mutable twin inside the
subscriber. Pure data: this module imports no socket library.

May not touch: how the bounds are applied (:mod:`~kvbridge.events.subscriber`
describes and enforces them), the items the subscriber hands out
(:mod:`~kvbridge.events.stream`), sequencing (:mod:`~kvbridge.events.sequencer`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SubscriberConfig:
    endpoint: str
    replay_endpoint: str | None = None
    #: ZMQ prefix filter on the topic frame ("" receives every topic).
    topic: str = ""
    #: None: start with whatever arrives live. 0 (or N): first replay the
    #: publisher's buffered history from that seq (a late joiner catching up).
    start_seq: int | None = None
    replay_timeout_s: float = 2.0
    #: ZMQ receive high-water mark, in messages (batches).
    rcvhwm: int = 100_000
    #: Ask a kvbridge publisher for its incarnation after every reconnect.
    check_incarnation_on_reconnect: bool = True
    #: After this long without live traffic, ask the replay endpoint whether
    #: batches were published that never arrived (a gap at the tail of the stream
    #: is otherwise invisible until the next live batch). None disables it.
    idle_resync_s: float | None = 1.0
    #: Largest frame accepted from the publisher or its replay endpoint, in bytes
    #: (ZMQ MAXMSGSIZE; a peer sending more is disconnected). -1: unlimited.
    max_message_bytes: int = 16 << 20
    #: Receive high-water mark of the replay DEALER, in messages.
    replay_rcvhwm: int = 256
    #: Most messages (batches) one replay reply may hand over before it is cut.
    max_pending_batches: int = 10_000
    #: Most payload bytes one replay reply may hand over before it is cut.
    max_pending_bytes: int = 64 << 20
    #: Most replies (chunks) one gap or catch-up is repaired with; the rest is lost.
    max_replay_chunks: int = 100
    #: No replay for this long after a failed one; doubles per consecutive failure.
    replay_backoff_s: float = 1.0
    replay_backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_pending_batches", "max_pending_bytes", "replay_rcvhwm",
                     "max_replay_chunks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive number")
        if not self.replay_timeout_s > 0:
            raise ValueError("replay_timeout_s: expected > 0 seconds")
        if self.replay_backoff_s < 0 or self.replay_backoff_max_s < self.replay_backoff_s:
            raise ValueError(
                "replay_backoff_s / replay_backoff_max_s: expected 0 <= backoff <= max"
            )
        if self.max_message_bytes < -1 or self.max_message_bytes == 0:
            raise ValueError("max_message_bytes: expected a positive byte count or -1")


@dataclass(frozen=True)
class SubscriberStats:
    received_batches: int
    received_events: int
    replayed_batches: int
    duplicates_dropped: int
    gaps: int
    lost_batches: int
    restarts: int
    malformed_frames: int
    replay_requests: int
    replay_timeouts: int
    #: Replies cut at ``max_pending_batches`` / ``max_pending_bytes``.
    replay_overruns: int = 0
    #: Replay requests not sent because of the backoff after failures.
    replays_skipped: int = 0


class _Counters:
    def __init__(self) -> None:
        self.received_batches = 0
        self.received_events = 0
        self.replayed_batches = 0
        self.duplicates_dropped = 0
        self.gaps = 0
        self.lost_batches = 0
        self.restarts = 0
        self.malformed_frames = 0
        self.replay_requests = 0
        self.replay_timeouts = 0
        self.replay_overruns = 0
        self.replays_skipped = 0
