"""Property tests of the subscriber's replay negotiation, without a socket.

``SubscriberCore`` yields the I/O it needs; here a simulated publisher answers it
(kvbridge's extended protocol or vLLM's plain one), with replies drawn at random:
honest, silent, refused, cut short, flooded past the bounds, mixed with garbage,
out-of-range and repeated batches, or missing a batch. Whatever the replies:

- no event number is delivered twice or out of order, and none is lost silently:
  every seq from where the stream started to where it now is was delivered or
  reported in a ``GapLost`` (the two never overlap);
- each delivered batch is the one published under that seq;
- every wait names its deadline, no later than the request's send time plus
  ``replay_timeout_s``;
- one exchange reads at most ``max_pending_batches + 3`` messages, holds at most
  ``max_pending_batches + 2`` batches (the header's and end marker's slots) and
  ``max_pending_bytes`` payload bytes;
- with an honest publisher that still holds everything, nothing is lost;
- when the publisher restarts (a new incarnation, seqs from 0 again), the restart
  is reported once, and each incarnation's part of the stream keeps the rules
  above on its own.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.events import BlockRemoved, encode_events
from kvbridge.events.replay_exchange import (
    ExchangeEnd,
    Malformed,
    ReplayExchange,
    Resend,
)
from kvbridge.events.stream import GapDetected, GapLost, PublisherRestarted, ReceivedBatch
from kvbridge.events.subscriber_config import SubscriberConfig
from kvbridge.events.subscriber_core import (
    AwaitReply,
    DiscardReplay,
    DropQueuedLive,
    IoRequest,
    SendReplay,
    SubscriberCore,
    drive,
)
from kvbridge.events.wire import (
    REPLAY_MAGIC,
    ReplayInfo,
    encode_replay_info,
    encode_seq,
    parse_replay_request,
    replay_batch_frames,
    replay_end_frames,
)

TOPIC = b"kv"
TIMEOUT_S = 1.0
BEHAVIOURS = ["honest", "silent", "refuse", "garbage", "noise", "cut", "flood", "skip"]


def payload(seq: int, incarnation: int = 7) -> bytes:
    """A batch whose one event names its seq (and, past 7, its publisher's incarnation):
    a delivered batch says where it came from."""
    return encode_events(float(seq), [BlockRemoved((origin(seq, incarnation),))], None)


def origin(seq: int, incarnation: int = 7) -> int:
    return seq + (incarnation - 7) * 1000


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class SimPublisher:
    """The replay endpoint: a ring ``[oldest, next_seq)`` of one incarnation."""

    next_seq: int
    oldest: int
    plain: bool  # a vLLM publisher: the extended request reads as an out-of-range seq
    behaviours: deque[str]
    incarnation: int = 7
    outbox: deque[list[bytes]] = field(default_factory=deque)

    def batch(self, seq: int) -> list[bytes]:
        return [b"", *replay_batch_frames(TOPIC, seq, payload(seq, self.incarnation))]

    def restart(self, next_seq: int) -> None:
        """A new incarnation: seqs start at 0 again, the old ring is gone."""
        self.incarnation += 1
        self.next_seq = next_seq
        self.oldest = 0
        self.outbox.clear()  # the old process's connection died with it

    def on_request(self, frame: bytes) -> None:
        extended = frame.startswith(REPLAY_MAGIC)
        request = parse_replay_request(frame)
        behaviour = self.behaviours.popleft() if self.behaviours else "honest"
        end_marker = [b"", *replay_end_frames()]
        if behaviour == "silent":
            return
        if behaviour == "refuse" or (extended and self.plain):
            self.outbox.append(end_marker)
            return
        replies: list[list[bytes]] = []
        first = max(request.start_seq, self.oldest)
        if extended:
            matched = request.incarnation in (None, self.incarnation)
            info = ReplayInfo(self.incarnation, self.oldest, self.next_seq, matched)
            replies.append([b"", REPLAY_MAGIC, encode_replay_info(info)])
            last = self.next_seq if request.end_seq is None else min(request.end_seq,
                                                                    self.next_seq)
            seqs = list(range(first, last)) if matched else []
        else:
            seqs = list(range(first, self.next_seq))
        if behaviour == "skip" and len(seqs) > 2:
            del seqs[len(seqs) // 2]
        batches = [self.batch(seq) for seq in seqs]
        if behaviour == "noise":
            noisy: list[list[bytes]] = [self.batch(max(0, request.start_seq - 1))]
            for one in batches:
                noisy += [one, one]
            if request.end_seq is not None and request.end_seq < self.next_seq:
                noisy.append(self.batch(request.end_seq))  # published, but not asked for
            batches = noisy
        if behaviour == "flood":
            batches = batches * 50
        if behaviour == "garbage":
            replies.append([b"", b"not a reply"])
        replies += batches
        if behaviour != "cut":
            replies.append(end_marker)
        self.outbox.extend(replies)


@dataclass
class Edge:
    """Runs the core's I/O requests against ``SimPublisher`` and checks each wait."""

    publisher: SimPublisher
    clock: Clock
    live_queue: deque[list[bytes]] = field(default_factory=deque)
    last_send: float = 0.0
    performed: int = 0
    waits: int = 0

    def perform(self, request: IoRequest) -> object:
        self.performed += 1
        assert self.performed < 20_000, "a core procedure does not end"
        self.clock.now += 0.001
        if isinstance(request, SendReplay):
            self.last_send = self.clock.now
            self.publisher.on_request(request.frame)
            return None
        if isinstance(request, AwaitReply):
            self.waits += 1
            # every wait has a finite deadline, set by the request it waits for
            assert math.isfinite(request.deadline)
            assert request.deadline <= self.last_send + TIMEOUT_S
            if not self.publisher.outbox:
                self.clock.now = max(self.clock.now, request.deadline)
                return None
            return self.publisher.outbox.popleft()
        if isinstance(request, DiscardReplay):
            self.publisher.outbox.clear()  # the connection's late replies are gone
            return None
        if isinstance(request, DropQueuedLive):
            dropped = len(self.live_queue)
            self.live_queue.clear()
            return dropped
        raise AssertionError(f"unknown request {request!r}")


def run(core: SubscriberCore, edge: Edge, live: list[int], resync_rounds: int = 5,
        restart_at: int | None = None, restarted: list[int] | None = None) -> list[object]:
    """Feed ``live`` (then, after ``restart_at`` of them, the publisher restarts with
    ``restarted`` seqs published and those in the list arriving live)."""
    clock = edge.clock
    if core.needs_catch_up:
        drive(core.first_catch_up(), edge.perform)
    stream = [(seq, 7) for seq in live]
    if restart_at is not None:
        stream = stream[:restart_at] + [(seq, 8) for seq in (restarted or [])]
    for seq, incarnation in stream:
        if incarnation != edge.publisher.incarnation:
            edge.publisher.restart(max(restarted or [0]) + 1)
        clock.now += 0.01
        core.last_activity = clock.now
        frames = [TOPIC, encode_seq(seq), payload(seq, incarnation)]
        if not core.live_in_order(frames):
            drive(core.on_live(frames), edge.perform)
    # idle: the tail resync asks for what never arrived live, one reply per round
    for _ in range(resync_rounds):
        clock.now += 60.0
        if core.resync_due():
            drive(core.resync(), edge.perform)
    return list(core.ready)


def check_stream(items: list[object], lower: int | None, expected: int | None,
                 published: int, catch_up: bool, incarnation: int | None = 7
                 ) -> tuple[list[int], set[int]]:
    """One incarnation's items (``incarnation`` None: either may have been spliced in,
    as vLLM's plain protocol cannot tell)."""
    delivered = [item.seq for item in items if isinstance(item, ReceivedBatch)]
    assert delivered == sorted(set(delivered)), "a seq delivered twice or out of order"
    for item in items:
        if isinstance(item, ReceivedBatch):
            made = item.batch.events[0].block_hashes
            if incarnation is None:
                assert made in ((origin(item.seq, 7),), (origin(item.seq, 8),))
            else:
                assert made == (origin(item.seq, incarnation),), "another seq's batch"
    assert all(0 <= seq < published for seq in delivered)
    lost: set[int] = set()
    for item in items:
        if isinstance(item, GapLost):
            span = set(range(item.start_seq, item.end_seq))
            assert span and not span & lost, "a loss reported twice"
            lost |= span
    assert not lost & set(delivered), "a seq both delivered and reported lost"
    if lower is not None and expected is not None:
        missing = set(range(lower, expected)) - set(delivered) - lost
        assert not missing, f"seqs lost silently: {sorted(missing)}"
    if not catch_up:
        # without a catch-up (a late joiner's, or a restart's), every replayed batch
        # and every loss lies in a gap reported before it
        gaps: list[GapDetected] = []
        for item in items:
            if isinstance(item, GapDetected):
                gaps.append(item)
            elif isinstance(item, ReceivedBatch) and item.replayed:
                assert any(g.start_seq <= item.seq < g.end_seq for g in gaps), item
            elif isinstance(item, GapLost):
                assert any(g.start_seq <= item.start_seq and item.end_seq <= g.end_seq
                           for g in gaps), item
    return delivered, lost


settings_ = settings(max_examples=150, deadline=None)


@settings_
@given(
    num_published=st.integers(1, 30),
    oldest=st.integers(0, 8),
    plain=st.booleans(),
    start=st.none() | st.integers(0, 5),
    live_mask=st.lists(st.booleans(), min_size=30, max_size=30),
    behaviours=st.lists(st.sampled_from(BEHAVIOURS), max_size=12),
    max_pending=st.integers(1, 6),
    max_chunks=st.integers(1, 4),
)
def test_no_seq_is_lost_silently_or_delivered_twice(
    num_published: int, oldest: int, plain: bool, start: int | None, live_mask: list[bool],
    behaviours: list[str], max_pending: int, max_chunks: int,
) -> None:
    oldest = min(oldest, num_published - 1)
    config = SubscriberConfig(
        endpoint="tcp://sim", replay_endpoint="tcp://sim-replay", start_seq=start,
        replay_timeout_s=TIMEOUT_S, max_pending_batches=max_pending,
        max_pending_bytes=max_pending * 200, max_replay_chunks=max_chunks,
        replay_backoff_s=0.5, replay_backoff_max_s=4.0,
    )
    clock = Clock()
    core = SubscriberCore(config, clock=clock)
    publisher = SimPublisher(num_published, oldest, plain, deque(behaviours))
    edge = Edge(publisher, clock)
    live = [seq for seq in range(num_published) if live_mask[seq]]
    items = run(core, edge, live)
    lower = start if start is not None else (live[0] if live else None)
    check_stream(items, lower, core.tracker.expected, num_published, start is not None)
    if live and start is None:
        assert core.tracker.expected is not None and core.tracker.expected >= live[-1] + 1


@settings_
@given(
    num_published=st.integers(1, 30),
    plain=st.booleans(),
    start=st.none() | st.just(0),
    live_mask=st.lists(st.booleans(), min_size=30, max_size=30),
    max_pending=st.integers(1, 6),
)
def test_an_honest_publisher_that_holds_everything_loses_nothing(
    num_published: int, plain: bool, start: int | None, live_mask: list[bool],
    max_pending: int,
) -> None:
    config = SubscriberConfig(
        endpoint="tcp://sim", replay_endpoint="tcp://sim-replay", start_seq=start,
        replay_timeout_s=TIMEOUT_S, max_pending_batches=max_pending,
        max_pending_bytes=1 << 20, max_replay_chunks=100,
    )
    clock = Clock()
    core = SubscriberCore(config, clock=clock)
    edge = Edge(SimPublisher(num_published, 0, plain, deque()), clock)
    live = [seq for seq in range(num_published) if live_mask[seq]]
    items = run(core, edge, live, resync_rounds=num_published + 2)
    lower = start if start is not None else (live[0] if live else None)
    delivered, lost = check_stream(items, lower, core.tracker.expected, num_published,
                                   start is not None)
    assert not lost
    if lower is not None:
        assert delivered == list(range(lower, num_published))
    if start is None and live:
        # each hole in the live stream was reported as a gap (the tail's by the resync)
        holes = set(range(live[0], num_published)) - set(live)
        covered = {seq for item in items if isinstance(item, GapDetected)
                   for seq in range(item.start_seq, item.end_seq)}
        assert holes <= covered


@settings_
@given(
    first=st.integers(1, 15),
    restart_at=st.integers(0, 15),
    second=st.integers(1, 15),
    plain=st.booleans(),
    live_mask=st.lists(st.booleans(), min_size=15, max_size=15),
    live_mask_after=st.lists(st.booleans(), min_size=15, max_size=15),
    behaviours=st.lists(st.sampled_from(BEHAVIOURS), max_size=8),
    max_pending=st.integers(1, 6),
)
def test_each_incarnation_between_restarts_is_one_gapless_stream(
    first: int, restart_at: int, second: int, plain: bool, live_mask: list[bool],
    live_mask_after: list[bool], behaviours: list[str], max_pending: int,
) -> None:
    config = SubscriberConfig(
        endpoint="tcp://sim", replay_endpoint="tcp://sim-replay",
        replay_timeout_s=TIMEOUT_S, max_pending_batches=max_pending,
        max_pending_bytes=max_pending * 200, max_replay_chunks=4,
        replay_backoff_s=0.5, replay_backoff_max_s=4.0,
    )
    clock = Clock()
    # watch_reconnects: the first live frame asks the publisher who it is (a hello)
    core = SubscriberCore(config, clock=clock, watch_reconnects=True)
    edge = Edge(SimPublisher(first, 0, plain, deque(behaviours)), clock)
    live = [seq for seq in range(first) if live_mask[seq]]
    after = [seq for seq in range(second) if live_mask_after[seq]]
    restart_at = min(restart_at, len(live))
    items = run(core, edge, live, restart_at=restart_at, restarted=after)
    # split at each restart the subscriber reported; each part is one stream
    parts: list[list[object]] = [[]]
    restarts: list[PublisherRestarted] = []
    for item in items:
        if isinstance(item, PublisherRestarted):
            restarts.append(item)
            parts.append([])
        else:
            parts[-1].append(item)
    assert len(restarts) <= 1, "one restart of the publisher reported more than once"
    if restart_at and after and after[0] <= live[restart_at - 1]:
        assert restarts, "the live stream went backwards and no restart was reported"
    fed = live[:restart_at] + after
    for index, part in enumerate(parts):
        lower = (fed[0] if fed else None) if index == 0 else 0
        if index + 1 < len(parts):
            last = restarts[index].last_seq
            end = None if last is None else last + 1
        else:
            end = core.tracker.expected
        # a live frame carries no incarnation, and a replay asked for before the
        # subscriber learned one may be answered by either: each batch is checked to
        # be the one published under its seq by one of the two
        check_stream(part, lower, end, 1000, catch_up=index > 0, incarnation=None)


# --------------------------------------------------------------- one exchange

_reply = st.one_of(
    st.tuples(st.just("batch"), st.integers(-2, 30), st.integers(0, 60)),
    st.tuples(st.just("info"), st.booleans(), st.integers(0, 30)),
    st.tuples(st.just("end"), st.just(0), st.just(0)),
    st.tuples(st.just("garbage"), st.just(0), st.just(0)),
)


def _frames(kind: str, a: int | bool, b: int) -> list[bytes]:
    if kind == "batch":
        return [b"", *replay_batch_frames(TOPIC, int(a), b"x" * b)]
    if kind == "info":
        return [b"", REPLAY_MAGIC, encode_replay_info(ReplayInfo(3, 0, int(b), bool(a)))]
    if kind == "end":
        return [b"", *replay_end_frames()]
    return [b"", b"\x01\x02"]


@settings(max_examples=300, deadline=None)
@given(
    start=st.integers(0, 10),
    span=st.none() | st.integers(0, 20),
    replies=st.lists(_reply, max_size=80),
    max_pending=st.integers(1, 12),
    max_bytes=st.integers(1, 400),
    extended=st.booleans(),
    sealed=st.booleans(),
    known=st.sampled_from([None, True, False]),
)
def test_one_exchange_is_bounded_and_ends_by_its_deadline(
    start: int, span: int | None, replies: list[tuple[str, int | bool, int]],
    max_pending: int, max_bytes: int, extended: bool, sealed: bool, known: bool | None,
) -> None:
    end = None if span is None else start + span
    exchange = ReplayExchange(
        start, end, now=50.0, timeout_s=TIMEOUT_S, max_pending_batches=max_pending,
        max_pending_bytes=max_bytes, extended=extended, sealed=sealed,
        publisher_supports_incarnation=known, incarnation=None,
    )
    assert exchange.deadline == 50.0 + TIMEOUT_S
    read = 0
    for reply in replies:
        if exchange.result is not None:
            break
        step = exchange.on_frames(_frames(*reply))
        read += 1
        assert exchange.deadline == 50.0 + TIMEOUT_S  # a fallback never extends it
        # the message bound (batches + header + end marker) is what holds memory: a
        # publisher that sends no header can fill the two extra slots with batches
        assert exchange.num_pending <= max_pending + 2
        if isinstance(step, Resend):
            assert not exchange.extended and step.frame == encode_seq(start)
        if isinstance(step, Malformed):
            assert reply[0] == "garbage"
    if exchange.result is None:
        exchange.on_timeout()  # what the caller does once the deadline passed
        assert exchange.ending is ExchangeEnd.FAILED
    result = exchange.result
    assert result is not None and exchange.ending is not None
    assert read <= max_pending + 3  # the header, the end marker, and the one over the bound
    seqs = [seq for seq, _, _ in result.batches]
    assert seqs == sorted(set(seqs)), "batches out of order or repeated"
    assert all(seq >= start and (end is None or seq < end) for seq in seqs)
    assert len(seqs) <= max_pending + 2
    assert sum(len(p) for _, p, _ in result.batches) <= max_bytes
    assert (result.failure is None) == (exchange.ending is not ExchangeEnd.FAILED)
    with pytest.raises(RuntimeError, match="already ended"):
        exchange.on_frames(_frames("end", 0, 0))
