"""Subscriber client: live stream plus replay, merged in order, with gaps and
restarts made visible.

``KVEventSubscriber.get(timeout_s)`` returns the next ``StreamItem``:

- ``ReceivedBatch``      a decoded batch, live or replayed, in sequence order;
- ``GapDetected``        sequence numbers were skipped; a replay follows;
- ``GapLost``            part of a gap could not be replayed (evicted from the
                         publisher's ring, dropped by it, no replay endpoint,
                         replay timed out or refused by a busy publisher, the
                         reply overran the pending bound, replay backing off
                         after failures);
- ``PublisherRestarted`` a new publisher incarnation; sequence numbers restart;
- ``MalformedFrame``     a frame or payload that does not parse (also counted
                         and logged; never fatal).

It works against vLLM's publisher (plain 8-byte replay requests) and against
kvbridge's (replay requests that carry the incarnation, so that a restart is
never mistaken for a gap and another incarnation's batches are never spliced
in). All sequencing decisions are made by ``SequenceTracker`` (sans-I/O).

With ``auth`` (the cluster secret, :mod:`kvbridge.auth`) every replay request
is sealed, and only kvbridge's extended protocol is spoken (a member is a
kvbridge publisher): an end marker without a ``ReplayInfo`` is then the
publisher's refusal (busy, or not configured with this secret), reported as a
failed replay, not a vLLM publisher.

Bounds (a replay endpoint is a peer, and a hostile or broken one must not cost
memory or stall the live stream):

- every frame is capped by ``max_message_bytes`` (ZMQ ``MAXMSGSIZE``: a larger
  frame disconnects the peer before it is buffered); the replay DEALER's queue by
  ``replay_rcvhwm`` messages;
- one replay reply is read into at most ``max_pending_batches`` messages and
  ``max_pending_bytes`` payload bytes; replies outside the requested range are
  dropped but still count. Past the bound the reply is abandoned (its socket
  closed): what arrived in order is delivered, the rest of the gap is reported
  as ``GapLost`` (reason names the bound) and skipped. kvbridge publishers are
  asked for ranges of at most ``max_pending_batches``, chunk after chunk (at most
  ``max_replay_chunks`` per gap); a reply from a publisher that answered in order
  (a plain one, or a kvbridge one whose ``ReplayInfo`` matched) and was cut at a
  bound is a chunk too, so an honest large gap is not lost to the bound;
- after a replay fails (timeout or overrun) no replay is tried for
  ``replay_backoff_s``, doubling per consecutive failure up to
  ``replay_backoff_max_s``; gaps in that window are reported lost at once and
  live batches keep flowing. One successful replay resets the backoff.

This file owns :class:`KVEventSubscriber`: its SUB socket and connect monitor,
the wait for the next item, and the running of the protocol against ZMQ. Every
decision (the live path, the replay path: what to ask for, reading one reply
within the bounds above, delivering it, the incarnation, the backoff) is made by
:class:`~kvbridge.events.subscriber_core.SubscriberCore` (sans-I/O), which yields
the I/O it needs. It may not touch what it is configured with and reports
(:mod:`~kvbridge.events.subscriber_config`), the items it hands out
(:mod:`~kvbridge.events.stream`; both re-exported here), the replay DEALER and
sealing (:mod:`~kvbridge.events.replay_dealer`), or the bytes of frames and
payloads (:mod:`~kvbridge.events.wire`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvbridge.auth import ClusterAuth

from .errors import EndpointError
from .replay_dealer import ReplayDealer
from .sequencer import SequenceTracker
from .stream import (
    GapDetected,
    GapLost,
    MalformedFrame,
    PublisherRestarted,
    ReceivedBatch,
    StreamItem,
)
from .subscriber_config import SubscriberConfig, SubscriberStats
from .subscriber_core import (
    AwaitReply,
    DiscardReplay,
    DropQueuedLive,
    IoRequest,
    SendReplay,
    SubscriberCore,
    drive,
)

__all__ = [
    "GapDetected",
    "GapLost",
    "KVEventSubscriber",
    "MalformedFrame",
    "PublisherRestarted",
    "ReceivedBatch",
    "StreamItem",
    "SubscriberConfig",
    "SubscriberStats",
]

logger = logging.getLogger(__name__)


class KVEventSubscriber:
    """One subscriber of one publisher (one endpoint, one incarnation at a time).

    Not thread-safe: use it from one thread. ``close()`` releases the sockets.
    """

    _POLL_SLICE_MS = 50

    def __init__(self, config: SubscriberConfig, *, context: zmq.Context[Any] | None = None,
                 auth: ClusterAuth | None = None) -> None:
        self.config = config
        self._ctx = context or zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, config.rcvhwm)
        self._sub.setsockopt(zmq.MAXMSGSIZE, config.max_message_bytes)
        self._sub.setsockopt(zmq.SUBSCRIBE, config.topic.encode("utf-8"))
        self._monitor: zmq.Socket[Any] | None = None
        if config.replay_endpoint is not None and config.check_incarnation_on_reconnect:
            self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        self._replay = ReplayDealer(config, self._ctx, auth)
        try:
            try:
                self._sub.connect(config.endpoint)
            except zmq.ZMQError as exc:
                raise EndpointError("endpoint", config.endpoint,
                                    zmq.strerror(exc.errno or 0)) from None
            if config.replay_endpoint is not None:
                # connected on first use; tried here once so that a malformed address is
                # refused now, naming it, not in the middle of a gap
                self._replay.socket()
                self._replay.discard()
        except EndpointError:
            if self._monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._sub.disable_monitor()
                self._monitor.close(linger=0)
            self._sub.close(linger=0)
            raise
        self._core = SubscriberCore(config, sealed=auth is not None,
                                    watch_reconnects=self._monitor is not None)
        self._live_in_order = self._core.live_in_order  # bound once: called per frame
        self._closed = False
        self._last_monitor_check = 0.0

    # ------------------------------------------------------------ public API

    def get(self, timeout_s: float | None = None) -> StreamItem | None:
        """The next item, or None when ``timeout_s`` passed with nothing to report
        (``None`` waits until something arrives)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        core = self._core
        ready = core.ready
        while True:
            if ready:
                return ready.popleft()
            if self._closed:
                return None
            if core.needs_catch_up:
                drive(core.first_catch_up(), self._perform)
                continue
            # Fast path: a frame already queued needs no poll (one syscall less per batch).
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                pass
            else:
                now = time.monotonic()
                core.last_activity = now
                if now - self._last_monitor_check >= 0.005:
                    self._drain_monitor()  # reconnects must be noticed on a busy stream too
                self._on_live(frames)
                if not ready and deadline is not None and now >= deadline:
                    return None  # only duplicates arrived: still honour the timeout
                continue
            self._drain_monitor()
            if core.resync_due():
                drive(core.resync(), self._perform)
                continue
            if deadline is None:
                wait_ms = self._POLL_SLICE_MS
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                wait_ms = max(1, min(self._POLL_SLICE_MS, int(remaining * 1000)))
            if self._sub.poll(wait_ms, zmq.POLLIN):
                core.last_activity = time.monotonic()
                self._on_live(self._sub.recv_multipart(zmq.NOBLOCK))

    def items(
        self, *, idle_timeout_s: float | None = None, max_items: int | None = None
    ) -> Iterator[StreamItem]:
        """Iterate items; stops after ``idle_timeout_s`` without any, or ``max_items``."""
        count = 0
        while max_items is None or count < max_items:
            item = self.get(idle_timeout_s)
            if item is None:
                return
            count += 1
            yield item

    def batches(
        self, *, idle_timeout_s: float | None = None, max_batches: int | None = None
    ) -> Iterator[ReceivedBatch]:
        """Only the batches (gaps, restarts and malformed frames are still counted)."""
        count = 0
        for item in self.items(idle_timeout_s=idle_timeout_s):
            if isinstance(item, ReceivedBatch):
                yield item
                count += 1
                if max_batches is not None and count >= max_batches:
                    return

    def __iter__(self) -> Iterator[StreamItem]:
        return self.items()

    @property
    def stats(self) -> SubscriberStats:
        c = self._core.counters
        return SubscriberStats(
            received_batches=c.received_batches,
            received_events=c.received_events,
            replayed_batches=c.replayed_batches,
            duplicates_dropped=c.duplicates_dropped,
            gaps=c.gaps,
            lost_batches=c.lost_batches,
            restarts=c.restarts,
            malformed_frames=c.malformed_frames,
            replay_requests=c.replay_requests,
            replay_timeouts=c.replay_timeouts,
            replay_overruns=c.replay_overruns,
            replays_skipped=c.replays_skipped,
        )

    @property
    def next_seq(self) -> int | None:
        """The seq the subscriber expects next (None before the first batch)."""
        return self._core.tracker.expected

    @property
    def incarnation(self) -> int | None:
        """The publisher's incarnation, when a kvbridge publisher told it."""
        return self._core.incarnation

    @property
    def publisher_supports_incarnation(self) -> bool | None:
        """None: unknown yet; False: a vLLM publisher (plain replay protocol only)."""
        return self._core.publisher_supports_incarnation

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._monitor.close(linger=0)
        self._sub.close(linger=0)
        self._replay.close()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the I/O edge

    @property
    def _ready(self) -> deque[StreamItem]:
        return self._core.ready

    @property
    def _tracker(self) -> SequenceTracker:
        return self._core.tracker

    def _on_live(self, frames: list[bytes]) -> None:
        if not self._live_in_order(frames):
            drive(self._core.on_live(frames), self._perform)

    def _perform(self, request: IoRequest) -> object:
        """One I/O request of the core, against the replay DEALER or the SUB socket."""
        if isinstance(request, AwaitReply):
            sock = self._replay.socket()
            remaining_ms = int((request.deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
                return None
            return sock.recv_multipart()
        if isinstance(request, SendReplay):
            frame = self._replay.seal(request.frame) if request.extended else request.frame
            self._replay.socket().send_multipart((b"", frame))
            return None
        if isinstance(request, DiscardReplay):
            self._replay.discard()
            return None
        if isinstance(request, DropQueuedLive):
            dropped = 0
            while True:
                try:
                    self._sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    return dropped
                dropped += 1
        raise TypeError(f"unknown I/O request {request!r}")

    def _drain_monitor(self) -> None:
        self._last_monitor_check = time.monotonic()
        if self._monitor is None:
            return
        while self._monitor.poll(0, zmq.POLLIN):
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event.get("event") == zmq.EVENT_CONNECTED:
                self._core.on_connected()
