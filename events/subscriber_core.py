"""Everything a subscriber decides, without a socket (sans-I/O).

:class:`SubscriberCore` is the protocol of :class:`~kvbridge.events.subscriber.
KVEventSubscriber`: live frames in, stream items out, and the replay negotiation
in between (when to ask, for which range, how to read the reply, what a reply
means for the sequence, chunk after chunk, with backoff after failures). It
owns the sequence tracker, the items ready for the application, the counters,
the publisher's incarnation and the replay backoff.

Where it needs the network it does not call it: each procedure that may talk
to the replay endpoint is a generator that *yields* an I/O request and is
*sent* the answer, and the subscriber runs it against ZMQ (:func:`drive`
documents the contract). A test runs the same procedures against a simulated
publisher, with random replies, and no socket:

- :class:`SendReplay` -- send ``frame`` to the replay endpoint (sealed with the
  cluster secret first when ``extended``); answer None;
- :class:`AwaitReply` -- one reply message, or None when ``deadline`` (the
  clock's time, named by the core) passed first: nothing waits without one;
- :class:`DiscardReplay` -- drop the replay connection (late replies to an
  abandoned request must never be read as the answer to a new one); answer None;
- :class:`DropQueuedLive` -- discard the live frames already queued (a restart:
  they may belong to the old incarnation); answer how many.

One exchange's reply is read by :class:`~kvbridge.events.replay_exchange.
ReplayExchange` (reply kinds, bounds, the vLLM fallback, refusals); this module
decides what the result means for the stream. Sequencing verdicts come from
:class:`~kvbridge.events.sequencer.SequenceTracker`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from .errors import EventDecodeError
from .replay_exchange import (
    ExchangeEnd,
    ExchangeFailure,
    Malformed,
    ReplayExchange,
    ReplayResult,
    Resend,
)
from .sequencer import Gap, LiveVerdict, ReplayVerdict, SequenceTracker
from .stream import (
    GapDetected,
    GapLost,
    MalformedFrame,
    PublisherRestarted,
    StreamItem,
    _received_batch,
)
from .subscriber_config import SubscriberConfig, _Counters
from .wire import SEQ_BYTES, decode_batch, parse_pub_frames

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SendReplay:
    frame: bytes
    #: kvbridge's extended request: sealed with the cluster secret, if there is one
    extended: bool


@dataclass(frozen=True)
class AwaitReply:
    #: the core's clock; the driver answers None once it passed
    deadline: float


@dataclass(frozen=True)
class DiscardReplay:
    pass


@dataclass(frozen=True)
class DropQueuedLive:
    pass


IoRequest = SendReplay | AwaitReply | DiscardReplay | DropQueuedLive
#: A core procedure: yields I/O requests, is sent their answers, returns T.
Io = Generator[IoRequest, Any, Any]


def drive(steps: Io, perform: Callable[[IoRequest], Any]) -> Any:
    """Run a core procedure: ``perform`` each request it yields, send it the answer;
    returns what the procedure returns."""
    try:
        request = next(steps)
        while True:
            request = steps.send(perform(request))
    except StopIteration as stop:
        return stop.value


class SubscriberCore:
    """The protocol state of one subscriber of one publisher; one thread.

    ``sealed``: replay requests are sealed with a cluster secret (only kvbridge's
    extended protocol is spoken then). ``clock``: monotonic seconds (tests pass
    their own), used for the replay deadlines, the backoff and idle resyncs.
    """

    def __init__(self, config: SubscriberConfig, *, sealed: bool = False,
                 watch_reconnects: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._sealed = sealed
        self._clock = clock
        self.tracker = SequenceTracker(config.start_seq)
        self.ready: deque[StreamItem] = deque()
        self.counters = _Counters()
        self.incarnation: int | None = None
        #: None: unknown yet; False: a vLLM publisher (plain replay protocol only).
        self.publisher_supports_incarnation: bool | None = None
        self.needs_catch_up = config.start_seq is not None and config.replay_endpoint is not None
        self._connects = 0
        #: the first live frame asks a kvbridge publisher who it is (its incarnation)
        self.needs_hello = watch_reconnects
        #: a reconnect happened: the next live frame checks the incarnation first
        self.verify_incarnation = False
        self.last_activity = clock()
        self._resync_interval = config.idle_resync_s
        #: consecutive failed replays, and the clock before which none is tried
        self.replay_failures = 0
        self.replay_blocked_until = 0.0

    # ------------------------------------------------------------ live path

    def live_in_order(self, frames: list[bytes]) -> bool:
        """The common case, in one test: a well-formed frame with the seq expected
        next is delivered (True). False: nothing was done; ``on_live`` decides."""
        if (len(frames) == 3 and len(frames[1]) == SEQ_BYTES and not self.needs_hello
                and not self.verify_incarnation):
            # What parse_pub_frames and _process_live would conclude, without
            # building a LiveFrame or a verdict.
            seq = int.from_bytes(frames[1], "big", signed=True)
            if self.tracker.in_order_live(seq):
                self._deliver(seq, bytes(frames[2]), bytes(frames[0]), replayed=False)
                return True
        return False

    def on_live(self, frames: list[bytes]) -> Io:
        """A live frame that ``live_in_order`` did not take (the caller tries it
        first: the common case needs no generator)."""
        try:
            live = parse_pub_frames(frames)
        except EventDecodeError as exc:
            self._malformed("live", str(exc))
            return
        if self.needs_hello:
            # Learn the incarnation up front, so that a reconnect can be checked.
            self.needs_hello = False
            if self.incarnation is None and self.publisher_supports_incarnation is not False:
                yield from self._request_replay(0, 0)
        if self.verify_incarnation:
            self.verify_incarnation = False
            new_incarnation = yield from self._current_incarnation_if_changed()
            if new_incarnation is not None:
                # This frame may be a stale one of the old incarnation: _restart
                # discards queued frames and replays the new incarnation instead.
                yield from self._restart(live.seq, "new incarnation after reconnect",
                                         new_incarnation)
                return
        yield from self._process_live(live.seq, live.payload, live.topic)

    def on_connected(self) -> None:
        """The SUB socket (re)connected: after the first, the incarnation is checked."""
        self._connects += 1
        if self._connects > 1:
            self.verify_incarnation = True

    def _process_live(self, seq: int, payload: bytes, topic: bytes) -> Io:
        verdict = self.tracker.on_live(seq)
        if verdict is LiveVerdict.RESTART:
            yield from self._restart(seq, "sequence number went backwards")
            if self.config.replay_endpoint is not None:
                return  # the catch-up replay delivered this seq
            verdict = self.tracker.on_live(seq)
        if verdict is LiveVerdict.DUPLICATE:
            self.counters.duplicates_dropped += 1
            return
        if verdict is LiveVerdict.GAP:
            gap = self.tracker.gap_before(seq)
            self.counters.gaps += 1
            self.ready.append(GapDetected(gap.start_seq, gap.end_seq))
            if (yield from self._repair(gap)):
                return  # a new incarnation: the catch-up replay covered this seq
            self._declare_lost(self.tracker.skip_to(seq), "not in the publisher's replay ring")
        self._deliver(seq, payload, topic, replayed=False)

    def _malformed(self, source: str, reason: str, seq: int | None = None) -> None:
        self.counters.malformed_frames += 1
        logger.warning("malformed KV event frame (%s, seq=%s): %s", source, seq, reason)
        self.ready.append(MalformedFrame(source=source, reason=reason, seq=seq))

    def _deliver(self, seq: int, payload: bytes, topic: bytes, replayed: bool) -> None:
        self.tracker.delivered(seq)
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            self._malformed("replay" if replayed else "live", str(exc), seq)
            return
        self.counters.received_batches += 1
        self.counters.received_events += len(batch.events)
        if replayed:
            self.counters.replayed_batches += 1
        self.ready.append(_received_batch(seq, batch, topic, replayed))

    def _declare_lost(self, lost: Gap | None, reason: str) -> None:
        if lost is None or lost.num_batches <= 0:
            return
        self.counters.lost_batches += lost.num_batches
        logger.warning("KV event batches %d..%d lost: %s", lost.start_seq, lost.end_seq - 1, reason)
        self.ready.append(GapLost(lost.start_seq, lost.end_seq, reason))

    def _restart(self, seq: int, reason: str, incarnation: int | None = None) -> Io:
        """Switch to a new publisher incarnation.

        With a replay endpoint, frames already queued live are discarded (they may
        belong to the old incarnation; those of the new one come back by replay)
        and the new incarnation is replayed from seq 0.
        """
        expected = self.tracker.expected
        last = None if expected is None else expected - 1
        self.counters.restarts += 1
        logger.warning(
            "KV event publisher restarted (%s): incarnation %s -> %s, last seq %s, now seq %d",
            reason,
            self.incarnation,
            incarnation,
            last,
            seq,
        )
        self.ready.append(PublisherRestarted(self.incarnation, incarnation, last, seq, reason))
        self.incarnation = incarnation
        if self.config.replay_endpoint is None:
            self.tracker.reset(None)
            return
        self.tracker.reset(0)
        self.counters.duplicates_dropped += yield DropQueuedLive()
        yield from self.catch_up(0)

    # ------------------------------------------------------------ replay path

    def resync_due(self) -> bool:
        return (
            self._resync_interval is not None
            and self.config.replay_endpoint is not None
            and self.tracker.expected is not None
            and self._clock() - self.last_activity >= self._resync_interval
        )

    def resync(self) -> Io:
        """Idle: fetch anything published since ``expected`` that never arrived live."""
        self.last_activity = self._clock()
        expected = self.tracker.expected
        assert expected is not None
        result = yield from self._request_replay(expected, None)
        base = self.config.idle_resync_s or 1.0
        if result.failure is not None:
            # A silent or dead publisher (or backing off after one): ask less and
            # less often (up to 30 s).
            self._resync_interval = min(30.0, 2 * (self._resync_interval or base))
            return
        self._resync_interval = self.config.idle_resync_s
        info = result.info
        if info is not None and not info.matched:
            yield from self._restart(info.next_seq, "new incarnation found while idle",
                                     info.incarnation)
            return
        newer = [seq for seq, _, _ in result.batches if seq >= expected]
        if newer:
            self.counters.gaps += 1
            self.ready.append(GapDetected(expected, max(newer) + 1))
            self._apply_replay(result, end=None)

    def first_catch_up(self) -> Io:
        """A late joiner's catch-up from ``start_seq`` (once, before any live frame)."""
        self.needs_catch_up = False
        return self.catch_up(self.config.start_seq or 0)

    def catch_up(self, start: int) -> Io:
        """Replay everything the publisher holds from ``start`` on (a late joiner, or a
        new incarnation), chunk after chunk."""
        for _ in range(self.config.max_replay_chunks):
            result = yield from self._request_replay(start, None)
            if result.info is not None and not result.info.matched:
                # Restarted yet again: forget the incarnation; the next gap finds out.
                self.incarnation = None
                return
            if result.info is not None and result.info.oldest_seq > start:
                self._declare_lost(
                    self.tracker.skip_to(result.info.oldest_seq), "evicted from the replay ring"
                )
            self._apply_replay(result, end=None)
            # Chunked (or cut at the pending bound by a plain publisher): go on from
            # where the stream now is, as long as each round makes progress.
            resume = self.tracker.expected
            if not result.truncated or resume is None or resume <= start:
                return
            start = resume

    def _repair(self, gap: Gap) -> Io:
        """Replay ``gap``; True when the publisher turned out to be a new incarnation."""
        if self.config.replay_endpoint is None:
            self._declare_lost(self.tracker.skip_to(gap.end_seq), "no replay endpoint")
            return False
        start = gap.start_seq
        for _ in range(self.config.max_replay_chunks):
            result = yield from self._request_replay(start, gap.end_seq)
            if result.info is not None and not result.info.matched:
                yield from self._restart(
                    gap.end_seq, "replay answered by a new incarnation", result.info.incarnation
                )
                return True
            self._apply_replay(result, end=gap.end_seq)
            resume = self.tracker.expected
            if result.truncated and resume is not None and start < resume < gap.end_seq:
                start = resume  # the next chunk of a gap larger than one reply may hold
                continue
            if result.failure is not None:
                self._declare_lost(self.tracker.skip_to(gap.end_seq), result.failure)
            return False
        self._declare_lost(
            self.tracker.skip_to(gap.end_seq),
            f"gap larger than max_replay_chunks={self.config.max_replay_chunks} replies",
        )
        return False

    def _apply_replay(self, result: ReplayResult, end: int | None) -> None:
        for seq, payload, topic in result.batches:
            if end is not None and seq >= end:
                continue  # the live stream delivers these
            verdict = self.tracker.on_replayed(seq)
            if verdict is ReplayVerdict.DUPLICATE:
                self.counters.duplicates_dropped += 1
                continue
            if verdict is ReplayVerdict.LOST_BEFORE:
                self._declare_lost(self.tracker.skip_to(seq), "not in the publisher's replay ring")
            self._deliver(seq, payload, topic if topic is not None else b"", replayed=True)

    def _request_replay(self, start: int, end: int | None) -> Io:
        """One exchange with the replay endpoint; returns its ``ReplayResult``."""
        config = self.config
        now = self._clock()
        if now < self.replay_blocked_until:
            self.counters.replays_skipped += 1
            reason = (
                f"replay endpoint backing off after {self.replay_failures} failed replays "
                f"(next try in {self.replay_blocked_until - now:.1f} s)"
            )
            return ReplayResult(None, [], complete=False, failure=reason)
        self.counters.replay_requests += 1
        exchange = ReplayExchange(
            start, end, now=now, timeout_s=config.replay_timeout_s,
            max_pending_batches=config.max_pending_batches,
            max_pending_bytes=config.max_pending_bytes,
            extended=self.publisher_supports_incarnation is not False or self._sealed,
            sealed=self._sealed,
            publisher_supports_incarnation=self.publisher_supports_incarnation,
            incarnation=self.incarnation,
        )
        yield SendReplay(exchange.request, exchange.extended)
        try:
            while exchange.result is None:
                frames = yield AwaitReply(exchange.deadline)
                if frames is None:
                    exchange.on_timeout()
                    break
                step = exchange.on_frames(frames)
                if isinstance(step, Malformed):
                    self._malformed("replay", step.reason)
                elif isinstance(step, Resend):
                    yield SendReplay(step.frame, extended=False)
        finally:
            # what the exchange learned holds whatever its end
            self.publisher_supports_incarnation = exchange.publisher_supports_incarnation
            self.incarnation = exchange.incarnation
        result = exchange.result
        assert result is not None and exchange.ending is not None
        if exchange.failure_kind is ExchangeFailure.TIMEOUT:
            self.counters.replay_timeouts += 1
            logger.warning("KV event replay from seq %d timed out", start)
        elif exchange.failure_kind is ExchangeFailure.OVERRUN:
            self.counters.replay_overruns += 1
        if exchange.ending is ExchangeEnd.FAILED:
            yield from self._replay_failed(result)
        elif exchange.ending is ExchangeEnd.TRUNCATED:
            yield DiscardReplay()
        elif exchange.ending is ExchangeEnd.SUCCEEDED:
            self.replay_failures = 0
        return result

    def _replay_failed(self, result: ReplayResult) -> Io:
        """Start (or extend) the backoff after a failed replay: no replay for
        ``replay_backoff_s``, doubling per consecutive failure up to
        ``replay_backoff_max_s``."""
        self.replay_failures += 1
        config = self.config
        backoff = min(
            config.replay_backoff_max_s,
            config.replay_backoff_s * 2 ** min(self.replay_failures - 1, 32),
        )
        self.replay_blocked_until = self._clock() + backoff
        yield DiscardReplay()  # late replies to this request must never be read
        logger.warning(
            "KV event replay failed (%s); no replay for %.1f s (%d failures in a row)",
            result.failure,
            backoff,
            self.replay_failures,
        )

    def _current_incarnation_if_changed(self) -> Io:
        """Ask a kvbridge publisher who it is now (an empty-range replay request).

        Returns the new incarnation when it differs from the known one, else None.
        """
        known = self.incarnation
        if known is None or self.publisher_supports_incarnation is False:
            return None
        if self.config.replay_endpoint is None:
            return None
        info = (yield from self._request_replay(0, 0)).info
        if info is None or info.matched:
            return None
        return info.incarnation
