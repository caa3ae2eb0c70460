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
the live path, the replay path (what to ask for, reading one reply within the
bounds above, delivering it) and the incarnation. It may not touch what it is
configured with and reports (:mod:`~kvbridge.events.subscriber_config`), the
items it hands out (:mod:`~kvbridge.events.stream`; both re-exported here), the
replay DEALER, sealing and backoff (:mod:`~kvbridge.events.replay_dealer`),
sequencing decisions (:mod:`~kvbridge.events.sequencer`), or the bytes of
frames and payloads (:mod:`~kvbridge.events.wire`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvbridge.auth import ClusterAuth

from .errors import EndpointError, EventDecodeError
from .replay_dealer import ReplayDealer
from .sequencer import Gap, LiveVerdict, ReplayVerdict, SequenceTracker
from .stream import (
    GapDetected,
    GapLost,
    MalformedFrame,
    PublisherRestarted,
    ReceivedBatch,
    StreamItem,
    _received_batch,
)
from .subscriber_config import SubscriberConfig, SubscriberStats, _Counters
from .wire import (
    SEQ_BYTES,
    ReplayInfo,
    ReplayRequest,
    decode_batch,
    encode_replay_request,
    encode_seq,
    parse_pub_frames,
    parse_replay_reply,
)

logger = logging.getLogger(__name__)


@dataclass
class _ReplayResult:
    info: ReplayInfo | None
    batches: list[tuple[int, bytes, bytes | None]]
    complete: bool
    #: Why the reply is incomplete (None when complete).
    failure: str | None = None
    #: The subscriber asked for less than the caller's range (chunked): ask again.
    truncated: bool = False


class KVEventSubscriber:
    """One subscriber of one publisher (one endpoint, one incarnation at a time).

    Not thread-safe: use it from one thread. ``close()`` releases the sockets.
    """

    _POLL_SLICE_MS = 50

    def __init__(self, config: SubscriberConfig, *, context: zmq.Context[Any] | None = None,
                 auth: ClusterAuth | None = None) -> None:
        self.config = config
        self._auth = auth
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
        self._tracker = SequenceTracker(config.start_seq)
        self._ready: deque[StreamItem] = deque()
        self._counters = _Counters()
        self.incarnation: int | None = None
        #: None: unknown yet; False: a vLLM publisher (plain replay protocol only).
        self.publisher_supports_incarnation: bool | None = None
        self._needs_catch_up = config.start_seq is not None and config.replay_endpoint is not None
        self._connects = 0
        self._needs_hello = self._monitor is not None
        self._verify_incarnation = False
        self._closed = False
        self._last_activity = time.monotonic()
        self._last_monitor_check = 0.0
        self._resync_interval = config.idle_resync_s

    # ------------------------------------------------------------ public API

    def get(self, timeout_s: float | None = None) -> StreamItem | None:
        """The next item, or None when ``timeout_s`` passed with nothing to report
        (``None`` waits until something arrives)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self._ready:
                return self._ready.popleft()
            if self._closed:
                return None
            if self._needs_catch_up:
                self._needs_catch_up = False
                self._catch_up(self.config.start_seq or 0)
                continue
            # Fast path: a frame already queued needs no poll (one syscall less per batch).
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                pass
            else:
                now = time.monotonic()
                self._last_activity = now
                if now - self._last_monitor_check >= 0.005:
                    self._drain_monitor()  # reconnects must be noticed on a busy stream too
                self._on_live(frames)
                if not self._ready and deadline is not None and now >= deadline:
                    return None  # only duplicates arrived: still honour the timeout
                continue
            self._drain_monitor()
            if self._resync_due():
                self._resync()
                continue
            if deadline is None:
                wait_ms = self._POLL_SLICE_MS
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                wait_ms = max(1, min(self._POLL_SLICE_MS, int(remaining * 1000)))
            if self._sub.poll(wait_ms, zmq.POLLIN):
                self._last_activity = time.monotonic()
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
        c = self._counters
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
        return self._tracker.expected

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

    # ------------------------------------------------------------ live path

    def _malformed(self, source: str, reason: str, seq: int | None = None) -> None:
        self._counters.malformed_frames += 1
        logger.warning("malformed KV event frame (%s, seq=%s): %s", source, seq, reason)
        self._ready.append(MalformedFrame(source=source, reason=reason, seq=seq))

    def _on_live(self, frames: list[bytes]) -> None:
        if (len(frames) == 3 and len(frames[1]) == SEQ_BYTES and not self._needs_hello
                and not self._verify_incarnation):
            # The common case, in one test: a well-formed frame with the seq expected
            # next (what parse_pub_frames and _process_live would conclude, without
            # building a LiveFrame or a verdict). Anything else takes the full path.
            seq = int.from_bytes(frames[1], "big", signed=True)
            if self._tracker.in_order_live(seq):
                self._deliver(seq, bytes(frames[2]), bytes(frames[0]), replayed=False)
                return
        try:
            live = parse_pub_frames(frames)
        except EventDecodeError as exc:
            self._malformed("live", str(exc))
            return
        if self._needs_hello:
            # Learn the incarnation up front, so that a reconnect can be checked.
            self._needs_hello = False
            if self.incarnation is None and self.publisher_supports_incarnation is not False:
                self._request_replay(0, 0)
        if self._verify_incarnation:
            self._verify_incarnation = False
            new_incarnation = self._current_incarnation_if_changed()
            if new_incarnation is not None:
                # This frame may be a stale one of the old incarnation: _restart
                # discards queued frames and replays the new incarnation instead.
                self._restart(live.seq, "new incarnation after reconnect", new_incarnation)
                return
        self._process_live(live.seq, live.payload, live.topic)

    def _process_live(self, seq: int, payload: bytes, topic: bytes) -> None:
        verdict = self._tracker.on_live(seq)
        if verdict is LiveVerdict.RESTART:
            self._restart(seq, "sequence number went backwards")
            if self.config.replay_endpoint is not None:
                return  # the catch-up replay delivered this seq
            verdict = self._tracker.on_live(seq)
        if verdict is LiveVerdict.DUPLICATE:
            self._counters.duplicates_dropped += 1
            return
        if verdict is LiveVerdict.GAP:
            gap = self._tracker.gap_before(seq)
            self._counters.gaps += 1
            self._ready.append(GapDetected(gap.start_seq, gap.end_seq))
            if self._repair(gap):
                return  # a new incarnation: the catch-up replay covered this seq
            self._declare_lost(self._tracker.skip_to(seq), "not in the publisher's replay ring")
        self._deliver(seq, payload, topic, replayed=False)

    def _deliver(self, seq: int, payload: bytes, topic: bytes, replayed: bool) -> None:
        self._tracker.delivered(seq)
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            self._malformed("replay" if replayed else "live", str(exc), seq)
            return
        self._counters.received_batches += 1
        self._counters.received_events += len(batch.events)
        if replayed:
            self._counters.replayed_batches += 1
        self._ready.append(_received_batch(seq, batch, topic, replayed))

    def _declare_lost(self, lost: Gap | None, reason: str) -> None:
        if lost is None or lost.num_batches <= 0:
            return
        self._counters.lost_batches += lost.num_batches
        logger.warning("KV event batches %d..%d lost: %s", lost.start_seq, lost.end_seq - 1, reason)
        self._ready.append(GapLost(lost.start_seq, lost.end_seq, reason))

    def _restart(self, seq: int, reason: str, incarnation: int | None = None) -> None:
        """Switch to a new publisher incarnation.

        With a replay endpoint, frames already queued on the SUB socket are
        discarded (they may belong to the old incarnation; those of the new one
        come back by replay) and the new incarnation is replayed from seq 0.
        """
        expected = self._tracker.expected
        last = None if expected is None else expected - 1
        self._counters.restarts += 1
        logger.warning(
            "KV event publisher restarted (%s): incarnation %s -> %s, last seq %s, now seq %d",
            reason,
            self.incarnation,
            incarnation,
            last,
            seq,
        )
        self._ready.append(PublisherRestarted(self.incarnation, incarnation, last, seq, reason))
        self.incarnation = incarnation
        if self.config.replay_endpoint is None:
            self._tracker.reset(None)
            return
        self._tracker.reset(0)
        while True:
            try:
                self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._counters.duplicates_dropped += 1
        self._catch_up(0)

    # ------------------------------------------------------------ replay path

    def _resync_due(self) -> bool:
        return (
            self._resync_interval is not None
            and self.config.replay_endpoint is not None
            and self._tracker.expected is not None
            and time.monotonic() - self._last_activity >= self._resync_interval
        )

    def _resync(self) -> None:
        """Idle: fetch anything published since ``expected`` that never arrived live."""
        self._last_activity = time.monotonic()
        expected = self._tracker.expected
        assert expected is not None
        result = self._request_replay(expected, None)
        base = self.config.idle_resync_s or 1.0
        if result.failure is not None:
            # A silent or dead publisher (or backing off after one): ask less and
            # less often (up to 30 s).
            self._resync_interval = min(30.0, 2 * (self._resync_interval or base))
            return
        self._resync_interval = self.config.idle_resync_s
        info = result.info
        if info is not None and not info.matched:
            self._restart(info.next_seq, "new incarnation found while idle", info.incarnation)
            return
        newer = [seq for seq, _, _ in result.batches if seq >= expected]
        if newer:
            self._counters.gaps += 1
            self._ready.append(GapDetected(expected, max(newer) + 1))
            self._apply_replay(result, end=None)

    def _catch_up(self, start: int) -> None:
        for _ in range(self.config.max_replay_chunks):
            result = self._request_replay(start, None)
            if result.info is not None and not result.info.matched:
                # Restarted yet again: forget the incarnation; the next gap finds out.
                self.incarnation = None
                return
            if result.info is not None and result.info.oldest_seq > start:
                self._declare_lost(
                    self._tracker.skip_to(result.info.oldest_seq), "evicted from the replay ring"
                )
            self._apply_replay(result, end=None)
            # Chunked (or cut at the pending bound by a plain publisher): go on from
            # where the stream now is, as long as each round makes progress.
            resume = self._tracker.expected
            if not result.truncated or resume is None or resume <= start:
                return
            start = resume

    def _repair(self, gap: Gap) -> bool:
        """Replay ``gap``; True when the publisher turned out to be a new incarnation."""
        if self.config.replay_endpoint is None:
            self._declare_lost(self._tracker.skip_to(gap.end_seq), "no replay endpoint")
            return False
        start = gap.start_seq
        for _ in range(self.config.max_replay_chunks):
            result = self._request_replay(start, gap.end_seq)
            if result.info is not None and not result.info.matched:
                self._restart(
                    gap.end_seq, "replay answered by a new incarnation", result.info.incarnation
                )
                return True
            self._apply_replay(result, end=gap.end_seq)
            resume = self._tracker.expected
            if result.truncated and resume is not None and start < resume < gap.end_seq:
                start = resume  # the next chunk of a gap larger than one reply may hold
                continue
            if result.failure is not None:
                self._declare_lost(self._tracker.skip_to(gap.end_seq), result.failure)
            return False
        self._declare_lost(
            self._tracker.skip_to(gap.end_seq),
            f"gap larger than max_replay_chunks={self.config.max_replay_chunks} replies",
        )
        return False

    def _apply_replay(self, result: _ReplayResult, end: int | None) -> None:
        for seq, payload, topic in result.batches:
            if end is not None and seq >= end:
                continue  # the live stream delivers these
            verdict = self._tracker.on_replayed(seq)
            if verdict is ReplayVerdict.DUPLICATE:
                self._counters.duplicates_dropped += 1
                continue
            if verdict is ReplayVerdict.LOST_BEFORE:
                self._declare_lost(self._tracker.skip_to(seq), "not in the publisher's replay ring")
            self._deliver(seq, payload, topic if topic is not None else b"", replayed=True)

    def _replay_failed(self, result: _ReplayResult) -> _ReplayResult:
        """Start (or extend) the backoff after a timed-out or overrun replay."""
        backoff = self._replay.failed()  # also discards the DEALER: late replies unread
        logger.warning(
            "KV event replay failed (%s); no replay for %.1f s (%d failures in a row)",
            result.failure,
            backoff,
            self._replay.failures,
        )
        return result

    def _request_replay(self, start: int, end: int | None) -> _ReplayResult:
        config = self.config
        now = time.monotonic()
        if now < self._replay.blocked_until:
            self._counters.replays_skipped += 1
            reason = (
                f"replay endpoint backing off after {self._replay.failures} failed replays "
                f"(next try in {self._replay.blocked_until - now:.1f} s)"
            )
            return _ReplayResult(None, [], complete=False, failure=reason)
        self._counters.replay_requests += 1
        use_ext = self.publisher_supports_incarnation is not False or self._auth is not None
        sock = self._replay.socket()
        # Ask a kvbridge publisher for no more than one reply may hold; the caller
        # asks again for the rest (a vLLM publisher always replays to its newest).
        asked_end = end
        if end is None or end - start > config.max_pending_batches:
            asked_end = start + config.max_pending_batches
        if use_ext:
            request = ReplayRequest(
                start_seq=start, end_seq=asked_end, incarnation=self.incarnation
            )
            sock.send_multipart((b"", self._replay.seal(encode_replay_request(request))))
        else:
            sock.send_multipart((b"", encode_seq(start)))
        info: ReplayInfo | None = None
        batches: list[tuple[int, bytes, bytes | None]] = []
        num_replies = 0
        num_bytes = 0
        deadline = time.monotonic() + config.replay_timeout_s
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
                self._counters.replay_timeouts += 1
                logger.warning("KV event replay from seq %d timed out", start)
                return self._replay_failed(
                    _ReplayResult(info, batches, complete=False, failure="replay timed out")
                )
            frames = sock.recv_multipart()
            num_replies += 1
            num_bytes += sum(len(frame) for frame in frames)
            if num_replies > config.max_pending_batches + 2 or num_bytes > config.max_pending_bytes:
                # +2: the info header and the end marker.
                self._counters.replay_overruns += 1
                failure = (
                    f"replay reply exceeded the subscriber's pending bound "
                    f"(max_pending_batches={config.max_pending_batches}, "
                    f"max_pending_bytes={config.max_pending_bytes})"
                )
                if batches and (not use_ext or (info is not None and info.matched)):
                    # A plain (vLLM) publisher replays up to its newest batch, and a
                    # kvbridge one (ReplayInfo first) up to max_pending_batches of
                    # any size: an honest large gap is cut here, then asked for
                    # again from the next seq (no backoff: this round made progress;
                    # max_replay_chunks bounds the rounds per gap).
                    self._replay.discard()
                    return _ReplayResult(info, batches, complete=False, truncated=True)
                return self._replay_failed(
                    _ReplayResult(info, batches, complete=False, failure=failure)
                )
            if frames and frames[0] == b"":
                frames = frames[1:]
            try:
                reply = parse_replay_reply(frames)
            except EventDecodeError as exc:
                self._malformed("replay", str(exc))
                continue
            if reply.info is not None:
                info = reply.info
                self.publisher_supports_incarnation = True
                if info.matched:
                    self.incarnation = info.incarnation
                continue
            if reply.end:
                if use_ext and info is None and self._auth is not None:
                    return self._replay_failed(_ReplayResult(
                        None, batches, complete=False,
                        failure="replay refused by the publisher (busy, or it is not "
                                "configured with this cluster secret)"))
                if use_ext and info is None and self.publisher_supports_incarnation:
                    # This publisher answered with ReplayInfo before: an end marker
                    # alone is a refusal (too many replays under way), not a vLLM
                    # publisher. Keep the extended protocol; back off.
                    return self._replay_failed(_ReplayResult(
                        None, batches, complete=False,
                        failure="replay refused by the publisher (busy)"))
                if use_ext and info is None:
                    # A vLLM publisher read our request as an out-of-range seq.
                    self.publisher_supports_incarnation = False
                    if end is not None and end <= start:
                        return _ReplayResult(None, batches, complete=True)  # a probe only
                    use_ext = False
                    sock.send_multipart((b"", encode_seq(start)))
                    continue
                self._replay.succeeded()
                # A kvbridge publisher caps each reply (and so do we, by asking for
                # at most max_pending_batches): more may follow when this reply
                # stopped short of the caller's range (not just of the chunk asked
                # for) and of what the publisher holds.
                truncated = False
                if info is not None and batches:
                    limit = info.next_seq if end is None else min(end, info.next_seq)
                    truncated = batches[-1][0] + 1 < limit
                return _ReplayResult(info, batches, complete=True, truncated=truncated)
            if reply.seq < start or (end is not None and reply.seq >= end):
                continue  # not asked for (counted against the bound above)
            if batches and reply.seq <= batches[-1][0]:
                continue  # a reply stream goes forward only
            batches.append((reply.seq, reply.payload, reply.topic))

    def _current_incarnation_if_changed(self) -> int | None:
        """Ask a kvbridge publisher who it is now (an empty-range replay request).

        Returns the new incarnation when it differs from the known one, else None.
        """
        known = self.incarnation
        if known is None or self.publisher_supports_incarnation is False:
            return None
        if self.config.replay_endpoint is None:
            return None
        info = self._request_replay(0, 0).info
        if info is None or info.matched:
            return None
        return info.incarnation

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
                self._connects += 1
                if self._connects > 1:
                    self._verify_incarnation = True
