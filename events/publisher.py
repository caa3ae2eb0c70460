"""ZMQ publisher of KV event batches, with a replay ROUTER (vLLM-compatible).

One background thread owns both sockets: it encodes queued batches, sends them
on the PUB socket, keeps the last ``replay_buffer_batches`` payloads in a ring,
and answers replay requests on the ROUTER socket between sends.

The PUB socket is an XPUB (the same wire for SUB peers, vLLM's included) so that
the publisher sees each subscription arrive: ``wait_for_subscribers`` is the
readiness handshake against ZeroMQ's slow joiner (a batch published before a
SUB's subscription reached the publisher is not delivered to it live), in
place of sleeping and hoping.

Invariants:

- Sequence numbers are assigned in ``publish`` under one lock, in call order,
  starting at 0 for every publisher (incarnation). A batch that cannot be
  queued within ``enqueue_timeout_s`` is dropped *with its sequence number
  consumed*, so subscribers see the hole and report it as lost instead of
  silently missing it (``stats.dropped_batches`` counts them).
- The ring holds payloads in increasing seq order; a replay streams the ring
  entries of the requested range that existed when the request arrived (at most
  ``max_replay_batches_per_request`` of them), then the end marker. Entries
  evicted while a slow reply is under way are skipped; the client sees the hole.
- Replay memory is bounded: the ROUTER queues at most ``replay_sndhwm`` messages
  per client and ``replay_rcvhwm`` unread requests; requests are at most
  ``max_replay_request_bytes`` (MAXMSGSIZE). A reply is a cursor into the ring,
  sent without blocking as the client's queue drains, never a copy of it. At
  most ``max_replay_clients`` replies are under way (more: answered by the end
  marker alone, counted as refused); a client may queue ``max_queued_replays``
  more requests behind its reply; a reply that makes no progress for
  ``replay_stall_timeout_s`` (the client stopped reading) is abandoned.
- With a cluster secret (``auth``, :mod:`kvbridge.auth`) only sealed replay
  requests are answered; any other gets the end marker alone and is counted in
  ``unauthenticated_replay_requests``. Replies are not sealed (they carry what
  the PUB stream carries). Without a secret a non-loopback replay endpoint is
  refused unless ``insecure_no_auth``. The PUB stream is vLLM's one-way
  protocol and is not authenticated.
- ``close`` stops accepting batches, lets the thread drain the queue until a
  deadline, flushes the PUB socket within what is left of it, and reports how
  many queued batches were abandoned.

This file owns :class:`KVEventPublisher`: its sockets, its thread, the queue,
the replay ring and the replies streamed from it. It may not touch what it is
configured with and reports (:mod:`~kvbridge.events.publisher_config`,
re-exported here) or the bytes of frames and payloads
(:mod:`~kvbridge.events.wire`; ``encode_events`` is looked up in this module
when a batch is sent, which tests rely on to slow the encoder down).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from kvbridge.auth import AuthError, ClusterAuth, Label, check_bind, endpoint_host

from .errors import EventDecodeError, PublisherClosedError
from .publisher_config import DEFAULT_ENDPOINT as DEFAULT_ENDPOINT
from .publisher_config import PublisherConfig, PublisherStats
from .schema import EventBatch, KVEvent
from .wire import (
    REPLAY_MAGIC,
    ReplayInfo,
    ReplayRequest,
    encode_events,
    encode_replay_info,
    encode_seq,
    parse_replay_request,
    replay_batch_frames,
    replay_end_frames,
)

logger = logging.getLogger(__name__)


_SENTINEL: Any = object()
#: Most batches sent between two looks at subscriptions and replay requests.
_BURST = 256

_Message = tuple[Any, ...]


@dataclass
class _ReplyStream:
    """One client's reply under way: a generator of messages over the ring."""

    identity: bytes
    messages: Iterator[_Message]
    pending: _Message | None
    last_progress: float
    queued: deque[tuple[tuple[bytes, ...], list[bytes]]]


def _bind(sock: zmq.Socket[Any], endpoint: str, retry_s: float) -> None:
    deadline = time.monotonic() + retry_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


class KVEventPublisher:
    """Publishes batches of KV events; satisfies the ``EventSink`` protocol.

    Usage::

        with KVEventPublisher(PublisherConfig(topic="kv-events")) as pub:
            pub.publish([BlockStored(...), BlockRemoved(...)])
    """

    def __init__(
        self, config: PublisherConfig | None = None, *, context: zmq.Context[Any] | None = None,
        auth: ClusterAuth | None = None, insecure_no_auth: bool = False,
    ) -> None:
        self.config = config or PublisherConfig()
        self._auth = auth
        if self.config.replay_endpoint is not None:
            check_bind(endpoint_host(self.config.replay_endpoint), auth is not None,
                       insecure_no_auth, "the KV events replay endpoint")
        self.incarnation = (
            self.config.incarnation if self.config.incarnation is not None else time.time_ns()
        )
        self._topic = self.config.topic.encode("utf-8")
        self._ctx = context or zmq.Context.instance()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=self.config.max_queue_batches)
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=self.config.replay_buffer_batches)
        self._lock = threading.Lock()
        self._next_seq = 0
        self._closed = False
        self._abort = threading.Event()
        self._published_batches = 0
        self._published_events = 0
        self._dropped_batches = 0
        self._replay_requests = 0
        self._replayed_batches = 0
        self._bad_replay_requests = 0
        self._refused_replay_requests = 0
        self._unauthenticated_replay_requests = 0
        self._abandoned_replays = 0
        self._streams: dict[bytes, _ReplyStream] = {}
        self._ring_appended = 0  # entries ever appended to the ring (thread-owned)
        self._linger_ms = 0
        self._sent_next = 0  # seq after the newest batch sent (thread-owned)
        self._last_drop_log = -1.0e9
        self._last_refuse_log = -1.0e9

        self._pub = self._ctx.socket(zmq.XPUB)
        self._replay: zmq.Socket[Any] | None = None
        self._subscriptions = 0
        self._subscribed = threading.Condition()
        #: Notified after each burst while a flush() waits (no sleep-polling).
        self._progress = threading.Condition()
        self._flush_waiters = 0
        try:
            # Every subscription message, also a second one for a known topic.
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
            self._pub.setsockopt(zmq.MAXMSGSIZE, 4096)  # subscriptions are topic-sized
            self._pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            _bind(self._pub, self.config.endpoint, self.config.bind_retry_s)
            self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint: str | None = None
            if self.config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # Bounded queues; a full client queue makes a non-blocking send
                # fail (ROUTER_MANDATORY) instead of dropping part of a reply.
                self._replay.setsockopt(zmq.SNDHWM, self.config.replay_sndhwm)
                self._replay.setsockopt(zmq.RCVHWM, self.config.replay_rcvhwm)
                self._replay.setsockopt(zmq.MAXMSGSIZE, self.config.max_replay_request_bytes)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                _bind(self._replay, self.config.replay_endpoint, self.config.bind_retry_s)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise

        self._thread = threading.Thread(
            target=self._run, name="kvbridge-events-publisher", daemon=True
        )
        self._thread.start()
        logger.info(
            "KV event publisher on %s (replay %s), topic %r, incarnation %d",
            self.endpoint,
            self.replay_endpoint,
            self.config.topic,
            self.incarnation,
        )

    # ------------------------------------------------------------ caller side

    def publish(self, events: Sequence[KVEvent], *, ts: float | None = None) -> int | None:
        """Queue one batch (one engine step). Returns its seq, or None when the
        batch was empty or had to be dropped because the queue stayed full."""
        if not events:
            return None
        stamp = time.time() if ts is None else ts
        with self._lock:
            if self._closed:
                raise PublisherClosedError("publish() after close()")
            seq = self._next_seq
            self._next_seq += 1
            try:
                self._queue.put((seq, stamp, tuple(events)), timeout=self.config.enqueue_timeout_s)
            except queue.Full:
                self._dropped_batches += 1
                now = time.monotonic()
                if now - self._last_drop_log >= 1.0:  # at most one line per second
                    self._last_drop_log = now
                    logger.warning(
                        "KV event queue full for %.3f s: dropped batch seq=%d (%d events; "
                        "%d dropped so far); subscribers will report them lost",
                        self.config.enqueue_timeout_s,
                        seq,
                        len(events),
                        self._dropped_batches,
                    )
                return None
        return seq

    def publish_batch(self, batch: EventBatch) -> int | None:
        return self.publish(batch.events, ts=batch.ts)

    @property
    def stats(self) -> PublisherStats:
        with self._lock:
            next_seq = self._next_seq
        return PublisherStats(
            published_batches=self._published_batches,
            published_events=self._published_events,
            dropped_batches=self._dropped_batches,
            replay_requests=self._replay_requests,
            replayed_batches=self._replayed_batches,
            bad_replay_requests=self._bad_replay_requests,
            queued_batches=self._queue.qsize(),
            next_seq=next_seq,
            refused_replay_requests=self._refused_replay_requests,
            abandoned_replays=self._abandoned_replays,
            replay_clients=len(self._streams),
            subscriptions=self._subscriptions,
            unauthenticated_replay_requests=self._unauthenticated_replay_requests,
        )

    def wait_for_subscribers(self, count: int = 1, timeout_s: float = 10.0) -> bool:
        """Wait until ``count`` subscriptions have reached the PUB socket (True) or
        ``timeout_s`` passed (False). A batch published after this returns True is
        delivered live to those subscribers (up to their high-water marks).

        After a reconnect, libzmq re-sends a SUB's subscription only when the SUB's
        owner next uses that socket: keep the subscriber polling meanwhile."""
        deadline = time.monotonic() + timeout_s
        with self._subscribed:
            while self._subscriptions < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._subscribed.wait(min(remaining, 0.05))
            return True

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued batch has been sent (True) or the timeout passed."""
        deadline = time.monotonic() + timeout_s
        with self._progress:
            self._flush_waiters += 1
            try:
                while True:
                    with self._lock:
                        target = self._next_seq
                    if self._published_batches + self._dropped_batches >= target:
                        return True
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not self._thread.is_alive():
                        return False
                    # Woken after each burst the thread sends; the cap re-checks a
                    # thread that died (or batches dropped by publish) meanwhile.
                    self._progress.wait(min(remaining, 0.05))
            finally:
                self._flush_waiters -= 1

    def close(self, timeout_s: float = 2.0) -> int:
        """Stop accepting batches, drain the queue until ``timeout_s``, close the
        sockets. Returns the number of queued batches that were abandoned."""
        with self._lock:
            if self._closed:
                return 0
            self._closed = True
        deadline = time.monotonic() + max(0.0, timeout_s)
        # Set before the sentinel: the thread reads it when it closes the PUB socket.
        self._linger_ms = int(max(0.0, timeout_s) * 1000)
        try:
            self._queue.put(_SENTINEL, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            self._abort.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._abort.set()
            self._thread.join(1.0)
        abandoned = sum(1 for item in list(self._queue.queue) if item is not _SENTINEL)
        if abandoned:
            logger.warning("KV event publisher closed with %d batches unsent", abandoned)
        return abandoned

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ thread side

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # keep the reason; the engine must not die of its events
            logger.exception("KV event publisher thread failed")
        finally:
            # Flush what is in the PUB socket within the remaining close() budget.
            self._pub.close(linger=self._linger_ms)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _loop(self) -> None:
        wire_format = self.config.wire_format
        dp_rank = self.config.data_parallel_rank
        topic = self._topic
        # One send per frame with plain int flags: send_multipart's per-frame checks
        # and flag arithmetic cost more than the sends of a small batch.
        send = self._pub.send
        more = int(zmq.SNDMORE)
        while not self._abort.is_set():
            self._read_subscriptions()
            self._serve_replays()
            try:
                item = self._queue.get(timeout=0.002)
            except queue.Empty:
                continue
            # Drain a burst before looking at replay requests again: the rest of it
            # is taken from the queue under one lock, not one get() per batch.
            burst = [item, *self._take_queued(_BURST - 1)]
            for index, item in enumerate(burst):
                if item is _SENTINEL:
                    return
                seq, ts, events = item
                payload = encode_events(ts, events, dp_rank, wire_format)
                send(topic, more)
                send(encode_seq(seq), more)
                send(payload)
                self._ring.append((seq, payload))
                self._ring_appended += 1
                self._sent_next = seq + 1
                self._published_batches += 1
                self._published_events += len(events)
                if self._abort.is_set():
                    self._requeue(burst[index + 1 :])
                    return
            if self._flush_waiters:
                with self._progress:
                    self._progress.notify_all()

    def _take_queued(self, limit: int) -> list[Any]:
        """Up to ``limit`` queued items at once (frees their slots for ``publish``)."""
        q = self._queue
        with q.mutex:
            items = q.queue
            count = min(limit, len(items))
            taken = [items.popleft() for _ in range(count)]
            if count:
                q.not_full.notify(count)
        return taken

    def _requeue(self, items: list[Any]) -> None:
        """Put taken but unsent items back in front (``close`` counts them abandoned)."""
        q = self._queue
        with q.mutex:
            q.queue.extendleft(reversed(items))

    def _read_subscriptions(self) -> None:
        """Count subscribe messages (byte 1, then the topic) from the XPUB socket.

        Read generously each round: libzmq keeps unread XPUB subscription messages
        in an unbounded list."""
        for _ in range(1024):
            try:
                message = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if message[:1] == b"\x01":
                with self._subscribed:
                    self._subscriptions += 1
                    self._subscribed.notify_all()

    def _serve_replays(self) -> None:
        replay = self._replay
        if replay is None:
            return
        for _ in range(16):
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._accept_request(frames)
        if self._streams:
            now = time.monotonic()
            for stream in list(self._streams.values()):
                self._pump(replay, stream, now)

    def _accept_request(self, frames: list[bytes]) -> None:
        identity, rest = frames[0], frames[1:]
        # REQ (and DEALER clients imitating it) put an empty delimiter first.
        delim: tuple[bytes, ...] = (b"",) if len(rest) >= 2 and rest[0] == b"" else ()
        body = rest[len(delim) :]
        self._replay_requests += 1
        stream = self._streams.get(identity)
        if stream is not None:
            if len(stream.queued) >= self.config.max_queued_replays:
                self._refuse(identity, delim, "too many queued requests from one client")
            else:
                stream.queued.append((delim, body))
            return
        if len(self._streams) >= self.config.max_replay_clients:
            self._refuse(identity, delim, f"{len(self._streams)} replays already under way")
            return
        self._streams[identity] = _ReplyStream(
            identity, self._reply(identity, delim, body), None, time.monotonic(), deque()
        )

    def _refuse(self, identity: bytes, delim: tuple[bytes, ...], why: str) -> None:
        self._refused_replay_requests += 1
        now = time.monotonic()
        if now - self._last_refuse_log >= 1.0:  # at most one line per second
            self._last_refuse_log = now
            logger.warning(
                "replay request refused (%s): answered with the end marker (%d refused so far)",
                why,
                self._refused_replay_requests,
            )
        assert self._replay is not None
        # A full queue or a vanished client: it times out on its own.
        with contextlib.suppress(zmq.ZMQError):
            self._replay.send_multipart(self._end_message(identity, delim), zmq.NOBLOCK)

    def _pump(self, replay: zmq.Socket[Any], stream: _ReplyStream, now: float) -> None:
        """Send what the client's queue takes now (a slice, so live batches and
        other clients are not starved); finish, abandon or keep the stream."""
        for _ in range(256):
            message = stream.pending
            if message is None:
                message = next(stream.messages, None)
                if message is None:
                    if stream.queued:  # the client's next request
                        delim, body = stream.queued.popleft()
                        stream.messages = self._reply(stream.identity, delim, body)
                        continue
                    del self._streams[stream.identity]
                    return
            try:
                replay.send_multipart(message, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                stream.pending = message
                if now - stream.last_progress >= self.config.replay_stall_timeout_s:
                    self._abandon(stream, "the client read nothing for "
                                  f"{self.config.replay_stall_timeout_s:.1f} s")
                return
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the client went away
                self._abandon(stream, str(exc))
                return
            stream.pending = None
            stream.last_progress = now

    def _abandon(self, stream: _ReplyStream, why: str) -> None:
        self._abandoned_replays += 1 + len(stream.queued)
        del self._streams[stream.identity]
        logger.info("replay reply abandoned: %s", why)

    def _first_ordinal_at_or_after(self, seq: int) -> int:
        """The ring ordinal (count of entries appended before it) of the first
        entry with a seq >= ``seq`` (binary search: ring seqs increase)."""
        ring = self._ring
        lo, hi = 0, len(ring)
        while lo < hi:
            mid = (lo + hi) // 2
            if ring[mid][0] < seq:
                lo = mid + 1
            else:
                hi = mid
        return self._ring_appended - len(ring) + lo

    def _reply(
        self, identity: bytes, delim: tuple[bytes, ...], body: list[bytes]
    ) -> Iterator[_Message]:
        """The messages answering one request, produced as the client takes them."""
        if len(body) == 1 and self._auth is not None:
            try:
                body = [self._auth.open_request(Label.EVENTS_REPLAY, body[0]).body]
            except AuthError as exc:
                self._unauthenticated_replay_requests += 1
                now = time.monotonic()
                if now - self._last_refuse_log >= 1.0:  # at most one line per second
                    self._last_refuse_log = now
                    logger.warning("replay request refused: %s (%d so far)", exc.reason,
                                   self._unauthenticated_replay_requests)
                yield self._end_message(identity, delim)
                return
        try:
            if len(body) != 1:
                raise EventDecodeError("replay_request", f"expected 1 frame, got {len(body)}")
            request: ReplayRequest = parse_replay_request(body[0])
        except EventDecodeError as exc:
            self._bad_replay_requests += 1
            logger.warning("invalid replay request: %s", exc)
            yield self._end_message(identity, delim)
            return
        head = (identity, *delim)
        ring = self._ring
        oldest = ring[0][0] if ring else self._sent_next
        stop_seq = self._sent_next  # what existed when the request arrived
        if request.end_seq is not None:
            stop_seq = min(stop_seq, request.end_seq)
        if body[0].startswith(REPLAY_MAGIC):
            matched = request.incarnation is None or request.incarnation == self.incarnation
            info = ReplayInfo(self.incarnation, oldest, self._sent_next, matched)
            yield (*head, REPLAY_MAGIC, encode_replay_info(info))
            if not matched:
                yield self._end_message(identity, delim)
                return
        ordinal = self._first_ordinal_at_or_after(request.start_seq)
        with_topic = self.config.replay_includes_topic
        for _ in range(self.config.max_replay_batches_per_request):
            base = self._ring_appended - len(ring)
            index = max(0, ordinal - base)  # evicted meanwhile: go on with the oldest
            if index >= len(ring):
                break
            seq, payload = ring[index]
            if seq >= stop_seq:
                break
            ordinal = base + index + 1
            self._replayed_batches += 1
            yield (*head, *replay_batch_frames(self._topic if with_topic else None, seq, payload))
        yield self._end_message(identity, delim)

    def _end_message(self, identity: bytes, delim: tuple[bytes, ...]) -> _Message:
        return (identity, *delim, *replay_end_frames(self.config.replay_includes_topic))
