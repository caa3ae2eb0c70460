"""Hostile and broken peers of the KV event stream, over real ZMQ on 127.0.0.1.

Each test is the regression test of one defect: a deeply nested ``extra_keys``
(RecursionError out of the subscriber and ``kvbridge events tail``), a replay
endpoint that floods replies (unbounded buffering), a replay endpoint that never
answers (one timeout per gap, live batches starved), and replay requests that
are never read (the publisher's ROUTER queued every reply).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from kvbridge.events import (
    BlockStored,
    EventBatch,
    GapDetected,
    GapLost,
    KVEventPublisher,
    KVEventSubscriber,
    MalformedFrame,
    PublisherConfig,
    ReceivedBatch,
    StreamItem,
    SubscriberConfig,
    encode_batch,
)
from kvbridge.events.wire import MAX_EXTRA_KEYS_DEPTH, encode_seq
from kvbridge.tools.cli import EXIT_OK, main

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class PeakRss:
    """Samples this process's resident set in a thread; ``growth`` is peak - start."""

    def __init__(self) -> None:
        self.start = _rss_bytes()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak - self.start


@pytest.fixture
def xpub() -> Iterator[zmq.Socket[Any]]:
    """A raw publisher socket: the test writes whatever frames it wants."""
    sock = zmq.Context.instance().socket(zmq.XPUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    yield sock
    sock.close(linger=0)


def _endpoint(sock: zmq.Socket[Any]) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _await_subscription(xpub: zmq.Socket[Any]) -> None:
    """Readiness handshake: XPUB hands over the SUB's subscription message once the
    SUB is attached, so frames sent after it are not lost to the slow joiner."""
    assert xpub.poll(10_000), "the subscriber never subscribed"
    assert xpub.recv()[:1] == b"\x01"


def _stored(i: int, extra_keys: Any = None) -> BlockStored:
    return BlockStored(block_hashes=(i + 1,), parent_block_hash=None,
                       token_ids=tuple(range(16)), block_size=16, extra_keys=extra_keys)


def _good_payload(i: int) -> bytes:
    return encode_batch(EventBatch(1.0, (_stored(i),), 0))


def _nested_payload(depth: int) -> bytes:
    value: Any = ["k"]
    for _ in range(depth - 1):
        value = [value]
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
             "token_ids": [], "block_size": 16, "extra_keys": value}
    return msgpack.packb([1.0, [event], 0], use_bin_type=True)


def _collect(sub: KVEventSubscriber, num_batches: int, timeout_s: float = 60.0) -> list[StreamItem]:
    items: list[StreamItem] = []
    deadline = time.monotonic() + timeout_s
    batches = 0
    while batches < num_batches:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"only {batches}/{num_batches} batches; last items: {items[-5:]}"
        item = sub.get(remaining)
        if item is None:
            continue
        items.append(item)
        batches += isinstance(item, ReceivedBatch)
    return items


# ---------------------------------------------------------------- nesting


def test_deeply_nested_extra_keys_reject_the_batch_and_the_stream_goes_on(
    xpub: zmq.Socket[Any], make_subscriber: Callable[..., KVEventSubscriber]
) -> None:
    sub = make_subscriber(endpoint=_endpoint(xpub))
    _await_subscription(xpub)
    at_limit = encode_batch(EventBatch(1.0, (_stored(7, extra_keys=_nest(MAX_EXTRA_KEYS_DEPTH)),), 0))
    xpub.send_multipart((b"", encode_seq(0), _good_payload(0)))
    xpub.send_multipart((b"", encode_seq(1), _nested_payload(600)))
    xpub.send_multipart((b"", encode_seq(2), at_limit))
    xpub.send_multipart((b"", encode_seq(3), _good_payload(3)))
    items = _collect(sub, 3)
    malformed = [item for item in items if isinstance(item, MalformedFrame)]
    assert len(malformed) == 1 and malformed[0].seq == 1
    assert "events[0].extra_keys" in malformed[0].reason
    assert f"deeper than {MAX_EXTRA_KEYS_DEPTH} levels" in malformed[0].reason
    got = [item for item in items if isinstance(item, ReceivedBatch)]
    assert [b.seq for b in got] == [0, 2, 3]
    assert got[1].batch.events[0] == _stored(7, extra_keys=_nest(MAX_EXTRA_KEYS_DEPTH))
    assert sub.stats.malformed_frames == 1 and sub.stats.gaps == 0


def _nest(depth: int) -> Any:
    value: Any = ("k",)
    for _ in range(depth - 1):
        value = (value,)
    return value


def test_tail_survives_deeply_nested_extra_keys(
    xpub: zmq.Socket[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvbridge events tail` used to die of the RecursionError; it reports the
    malformed batch (field named) and prints the next one."""
    result: list[int] = []
    tail = threading.Thread(target=lambda: result.append(main(
        ["events", "tail", _endpoint(xpub), "--json", "--count", "1", "--timeout", "60"])))
    tail.start()
    try:
        _await_subscription(xpub)
        xpub.send_multipart((b"", encode_seq(0), _nested_payload(600)))
        xpub.send_multipart((b"", encode_seq(1), _good_payload(1)))
    finally:
        tail.join(90)
    assert not tail.is_alive() and result == [EXIT_OK]
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["kind"] for line in lines] == ["malformed", "batch"]
    assert lines[0]["seq"] == 0 and "events[0].extra_keys" in lines[0]["reason"]
    assert lines[1]["seq"] == 1 and lines[1]["events"][0]["block_hashes"] == [2]


# ---------------------------------------------------------------- replay endpoints


class FloodingReplayEndpoint:
    """A replay ROUTER that answers any request with ``num_frames`` in-range replies
    of ``frame_bytes`` garbage each, then the end marker. Sends block on a full pipe
    (ROUTER_MANDATORY) instead of dropping, and stop when the client goes away."""

    def __init__(self, num_frames: int, frame_bytes: int) -> None:
        self.router = zmq.Context.instance().socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.SNDHWM, 8)
        self.router.setsockopt(zmq.SNDTIMEO, 100)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = _endpoint(self.router)
        self.num_frames = num_frames
        self.garbage = os.urandom(frame_bytes)
        self.sent = 0
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            identity = self.router.recv_multipart()[0]
            self.requests += 1
            seq = 1
            while seq <= self.num_frames and not self._stop.is_set():
                try:
                    self.router.send_multipart(
                        (identity, b"", b"", encode_seq(seq), self.garbage), copy=False)
                except zmq.Again:
                    continue  # full pipe: the client is slow (or has stopped reading)
                except zmq.ZMQError:
                    break  # EHOSTUNREACH: the client closed its socket
                self.sent += 1
                seq += 1
            else:
                with contextlib.suppress(zmq.ZMQError):
                    self.router.send_multipart((identity, b"", b"", encode_seq(-1), b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.router.close(linger=0)


def test_flooding_replay_endpoint_is_cut_at_the_pending_bound(
    xpub: zmq.Socket[Any], make_subscriber: Callable[..., KVEventSubscriber]
) -> None:
    """400 x 256 KiB of replies to one gap: the subscriber held all 100 MiB before;
    now it stops at max_pending_bytes, reports the rest of the gap lost (the bound
    named), backs off, and keeps delivering live batches."""
    flood = FloodingReplayEndpoint(num_frames=400, frame_bytes=256 << 10)
    try:
        sub = make_subscriber(
            endpoint=_endpoint(xpub), replay_endpoint=flood.endpoint,
            check_incarnation_on_reconnect=False, idle_resync_s=None,
            replay_timeout_s=60.0, max_pending_bytes=4 << 20, replay_rcvhwm=8,
        )
        _await_subscription(xpub)
        xpub.send_multipart((b"", encode_seq(0), _good_payload(0)))
        assert [b.seq for b in _collect(sub, 1) if isinstance(b, ReceivedBatch)] == [0]
        rss = PeakRss()
        xpub.send_multipart((b"", encode_seq(1000), _good_payload(1000)))
        items = _collect(sub, 1)
        growth = rss.stop()
        xpub.send_multipart((b"", encode_seq(1001), _good_payload(1001)))
        items += _collect(sub, 1)
    finally:
        flood.close()
    assert [item for item in items if isinstance(item, GapDetected)] == [GapDetected(1, 1000)]
    lost = [item for item in items if isinstance(item, GapLost)]
    assert len(lost) == 1 and lost[0].end_seq == 1000
    assert "pending bound" in lost[0].reason and "max_pending_bytes" in lost[0].reason
    # The garbage that did arrive in range was reported, each one, and is bounded.
    garbage = [item for item in items if isinstance(item, MalformedFrame)]
    assert 0 < len(garbage) <= (4 << 20) // (256 << 10)
    assert lost[0].start_seq == 1 + len(garbage)
    assert [b.seq for b in items if isinstance(b, ReceivedBatch)] == [1000, 1001]
    assert sub.stats.replay_overruns == 1 and flood.sent < 400
    assert growth < 48 << 20, f"subscriber grew by {growth >> 20} MiB during one replay"


def test_silent_replay_endpoint_costs_one_timeout_not_one_per_gap(
    xpub: zmq.Socket[Any], make_subscriber: Callable[..., KVEventSubscriber]
) -> None:
    """Every other batch is missed live and the replay endpoint never answers:
    one replay times out, then the subscriber backs off and every gap is reported
    lost at once while each live batch is delivered (before: one timeout per gap)."""
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # bound, never read
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:*")
    try:
        sub = make_subscriber(
            endpoint=_endpoint(xpub), replay_endpoint=_endpoint(silent),
            check_incarnation_on_reconnect=False, idle_resync_s=None,
            replay_timeout_s=0.3, replay_backoff_s=600.0, replay_backoff_max_s=600.0,
        )
        _await_subscription(xpub)
        seqs = list(range(0, 100, 2))
        for seq in seqs:
            xpub.send_multipart((b"", encode_seq(seq), _good_payload(seq)))
        items = _collect(sub, len(seqs))
    finally:
        silent.close(linger=0)
    assert [b.seq for b in items if isinstance(b, ReceivedBatch)] == seqs
    lost = [item for item in items if isinstance(item, GapLost)]
    assert [(g.start_seq, g.end_seq) for g in lost] == [(s - 1, s) for s in seqs[1:]]
    assert lost[0].reason == "replay timed out"
    assert all("backing off after 1 failed replays" in g.reason for g in lost[1:])
    assert sub.stats.replay_timeouts == 1 and sub.stats.replay_requests == 1
    assert sub.stats.replays_skipped == len(seqs) - 2



def test_tail_keeps_printing_live_batches_when_replay_is_silent(
    xpub: zmq.Socket[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvbridge events tail --replay <silent>`: one replay times out, the other gaps
    are reported lost at once (backing off) and every live batch is printed."""
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:*")
    seqs = list(range(0, 40, 2))
    result: list[int] = []
    tail = threading.Thread(target=lambda: result.append(main(
        ["events", "tail", _endpoint(xpub), "--replay", _endpoint(silent), "--json",
         "--count", str(len(seqs)), "--timeout", "120", "--replay-timeout", "0.5"])))
    tail.start()
    try:
        _await_subscription(xpub)
        for seq in seqs:
            xpub.send_multipart((b"", encode_seq(seq), _good_payload(seq)))
    finally:
        tail.join(180)
        silent.close(linger=0)
    assert not tail.is_alive() and result == [EXIT_OK]
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["seq"] for line in lines if line["kind"] == "batch"] == seqs
    lost = [line for line in lines if line["kind"] == "lost"]
    assert len(lost) == len(seqs) - 1
    # The first replay (or the incarnation probe) timed out; the backoff covers the rest.
    assert sum("backing off" in line["reason"] for line in lost) >= len(seqs) - 2


# ---------------------------------------------------------------- the publisher's ROUTER


def _kilobyte_step(i: int) -> list[BlockStored]:
    # ~1 KB payload: 300 token ids of 3 bytes each.
    return [BlockStored(block_hashes=(i + 1,), parent_block_hash=None,
                        token_ids=tuple(range(1000, 1300)), block_size=300)]


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_unread_replay_requests_do_not_queue_replies_without_bound() -> None:
    """3,000 replay requests from a client that never reads its replies, against a
    100-batch ring: with SNDHWM 0 the ROUTER queued every reply (~300 MB). Now the
    client's queue is bounded, the surplus is refused, the stalled reply abandoned,
    and an honest subscriber still gets its full replay."""
    pub = KVEventPublisher(PublisherConfig(replay_stall_timeout_s=0.5))
    greedy = zmq.Context.instance().socket(zmq.DEALER)
    greedy.setsockopt(zmq.LINGER, 0)
    greedy.setsockopt(zmq.SNDTIMEO, 10_000)
    try:
        for i in range(100):
            pub.publish(_kilobyte_step(i))
        assert pub.flush()
        assert pub.replay_endpoint is not None
        greedy.connect(pub.replay_endpoint)
        rss = PeakRss()
        for _ in range(3000):
            greedy.send_multipart((b"", encode_seq(0)))
        _wait_for(lambda: pub.stats.replay_requests >= 3000, "the requests to be read")
        # The last stalled reply (and the requests queued behind it) is abandoned.
        _wait_for(lambda: pub.stats.replay_clients == 0, "the stalled reply to be abandoned")
        growth = rss.stop()
        stats = pub.stats
        assert stats.refused_replay_requests > 0 and stats.abandoned_replays > 0
        assert growth < 64 << 20, f"publisher process grew by {growth >> 20} MiB"
        with KVEventSubscriber(SubscriberConfig(pub.endpoint, pub.replay_endpoint,
                                                start_seq=0)) as honest:
            got = [b for b in _collect(honest, 100) if isinstance(b, ReceivedBatch)]
        assert [b.seq for b in got] == list(range(100)) and all(b.replayed for b in got)
        assert [list(b.batch.events) for b in got] == [_kilobyte_step(i) for i in range(100)]
    finally:
        greedy.close(linger=0)
        pub.close(timeout_s=1.0)


def test_replies_are_capped_per_request_and_the_subscriber_asks_in_chunks(
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    """A reply carries at most max_replay_batches_per_request batches (a plain
    vLLM-style request sees the cap, then the end marker); kvbridge's subscriber
    asks again from where the reply stopped and loses nothing."""
    pub = KVEventPublisher(PublisherConfig(max_replay_batches_per_request=7))
    plain = zmq.Context.instance().socket(zmq.DEALER)
    plain.setsockopt(zmq.LINGER, 0)
    try:
        for i in range(50):
            pub.publish(_kilobyte_step(i))
        assert pub.flush()
        assert pub.replay_endpoint is not None
        plain.connect(pub.replay_endpoint)
        plain.send_multipart((b"", encode_seq(3)))
        seqs = []
        while True:
            assert plain.poll(10_000), "no reply"
            _, _topic, seq_frame, _payload = plain.recv_multipart()
            seq = int.from_bytes(seq_frame, "big", signed=True)
            if seq == -1:
                break
            seqs.append(seq)
        assert seqs == list(range(3, 10))
        sub = make_subscriber(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint,
                              start_seq=0)
        got = [b for b in _collect(sub, 50) if isinstance(b, ReceivedBatch)]
        assert [b.seq for b in got] == list(range(50))
        assert sub.stats.lost_batches == 0
        assert sub.stats.replay_requests >= 50 // 7
    finally:
        plain.close(linger=0)
        pub.close(timeout_s=1.0)


@pytest.mark.parametrize(("config", "kwargs", "field"), [
    (SubscriberConfig, {"max_pending_bytes": 0}, "max_pending_bytes"),
    (SubscriberConfig, {"max_pending_batches": -1}, "max_pending_batches"),
    (SubscriberConfig, {"replay_timeout_s": 0.0}, "replay_timeout_s"),
    (SubscriberConfig, {"replay_backoff_s": 5.0, "replay_backoff_max_s": 1.0}, "replay_backoff_s"),
    (SubscriberConfig, {"max_message_bytes": 0}, "max_message_bytes"),
    (PublisherConfig, {"replay_sndhwm": 0}, "replay_sndhwm"),
    (PublisherConfig, {"max_replay_batches_per_request": 0}, "max_replay_batches_per_request"),
    (PublisherConfig, {"max_replay_clients": 0}, "max_replay_clients"),
    (PublisherConfig, {"replay_stall_timeout_s": 0.0}, "replay_stall_timeout_s"),
])
def test_unbounded_settings_are_refused(config: Any, kwargs: dict[str, Any], field: str) -> None:
    """0 means "unlimited" to ZeroMQ: the bounds refuse it instead of passing it on."""
    if config is SubscriberConfig:
        kwargs = {"endpoint": "tcp://127.0.0.1:1", **kwargs}
    with pytest.raises(ValueError, match=field):
        config(**kwargs)


def test_chunked_repair_stops_at_max_replay_chunks(
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    """A gap is repaired with at most max_replay_chunks replies (a replay endpoint
    that keeps answering in range can no longer hold the live stream forever);
    the rest of the gap is reported lost with the bound named."""
    pub = KVEventPublisher(PublisherConfig(max_replay_batches_per_request=5))
    try:
        for i in range(40):
            pub.publish(_kilobyte_step(i))
        assert pub.flush()
        sub = make_subscriber(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint,
                              start_seq=0, idle_resync_s=None, max_replay_chunks=2)
        assert pub.wait_for_subscribers(1)
        first = _collect(sub, 10)
        assert [b.seq for b in first if isinstance(b, ReceivedBatch)] == list(range(10))
        pub.publish(_kilobyte_step(40))
        items = _collect(sub, 11)
    finally:
        pub.close(timeout_s=1.0)
    assert [b.seq for b in items if isinstance(b, ReceivedBatch)] == [*range(10, 20), 40]
    assert [item for item in items if isinstance(item, GapDetected)] == [GapDetected(10, 40)]
    lost = [item for item in items if isinstance(item, GapLost)]
    assert [(g.start_seq, g.end_seq) for g in lost] == [(20, 40)]
    assert "max_replay_chunks=2" in lost[0].reason



def test_subscriber_chunks_a_catch_up_larger_than_its_own_pending_bound(
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    """The subscriber asks for at most max_pending_batches per reply; when the
    publisher answers that chunk in full (its own cap, 10,000, is larger) the
    subscriber asks for the rest instead of stopping after the first chunk."""
    pub = KVEventPublisher(PublisherConfig())
    try:
        for i in range(40):
            pub.publish(_kilobyte_step(i))
        assert pub.flush()
        sub = make_subscriber(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint,
                              start_seq=0, idle_resync_s=None, max_pending_batches=4)
        assert pub.wait_for_subscribers(1)
        head = _collect(sub, 40)
        pub.publish(_kilobyte_step(40))
        items = head + _collect(sub, 1)
    finally:
        pub.close(timeout_s=1.0)
    assert [b.seq for b in items if isinstance(b, ReceivedBatch)] == list(range(41))
    assert [item for item in items if isinstance(item, (GapDetected, GapLost))] == []
    assert sub.stats.lost_batches == 0 and sub.stats.replay_requests >= 10


def test_subscriber_chunks_a_gap_larger_than_its_own_pending_bound(
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    """Same for a gap before a live batch: chunk after chunk of max_pending_batches
    (up to max_replay_chunks), the rest lost with that bound named -- not the
    batches after the first chunk reported "not in the publisher's replay ring"."""
    pub = KVEventPublisher(PublisherConfig())
    try:
        for i in range(40):
            pub.publish(_kilobyte_step(i))
        assert pub.flush()
        sub = make_subscriber(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint,
                              start_seq=0, idle_resync_s=None, max_pending_batches=4,
                              max_replay_chunks=3)
        assert pub.wait_for_subscribers(1)
        head = _collect(sub, 12)  # the catch-up: three chunks of four
        assert [b.seq for b in head if isinstance(b, ReceivedBatch)] == list(range(12))
        pub.publish(_kilobyte_step(40))
        items = _collect(sub, 13)
    finally:
        pub.close(timeout_s=1.0)
    assert [b.seq for b in items if isinstance(b, ReceivedBatch)] == [*range(12, 24), 40]
    assert [item for item in items if isinstance(item, GapDetected)] == [GapDetected(12, 40)]
    lost = [item for item in items if isinstance(item, GapLost)]
    assert [(g.start_seq, g.end_seq) for g in lost] == [(24, 40)]
    assert "max_replay_chunks=3" in lost[0].reason


def test_honest_gap_larger_than_max_pending_bytes_is_chunked_not_lost(
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    """A kvbridge publisher's reply (ReplayInfo first) cut at max_pending_bytes --
    honest batches, just large -- is asked for again from where it stopped, with
    no backoff, like a plain publisher's; before, the rest of the gap was reported
    lost and replay backed off (the docstring promised an honest gap never hits
    the bound, but only the batch count was chunked)."""
    pub = KVEventPublisher(PublisherConfig())
    try:
        for i in range(60):
            pub.publish(_kilobyte_step(i))
        assert pub.flush()
        sub = make_subscriber(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint,
                              start_seq=0, idle_resync_s=None, max_pending_bytes=16 << 10)
        assert pub.wait_for_subscribers(1)
        items = _collect(sub, 60)
        pub.publish(_kilobyte_step(60))
        items += _collect(sub, 1)
    finally:
        pub.close(timeout_s=1.0)
    assert [b.seq for b in items if isinstance(b, ReceivedBatch)] == list(range(61))
    assert [item for item in items if isinstance(item, (GapDetected, GapLost))] == []
    assert sub.stats.lost_batches == 0 and sub.stats.replays_skipped == 0
    assert sub.stats.replay_overruns >= 60 * 1000 // (16 << 10)  # it was cut, and went on


def test_a_busy_kvbridge_publishers_refusal_does_not_downgrade_the_protocol(
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    """A kvbridge publisher that refuses a replay (max_replay_clients under way)
    answers with the end marker alone, as a vLLM publisher answers an extended
    request. A subscriber that has already seen this publisher's ReplayInfo must
    take it as a refusal (failed replay, backoff) -- it used to conclude "vLLM
    publisher" and drop the incarnation check for good."""
    big = [BlockStored(block_hashes=(1,), parent_block_hash=None,
                       token_ids=tuple(range(1000, 21000)), block_size=20000)]  # ~60 KB
    pub = KVEventPublisher(PublisherConfig(max_replay_clients=1, replay_sndhwm=1,
                                           replay_stall_timeout_s=120.0))
    greedy = zmq.Context.instance().socket(zmq.DEALER)
    greedy.setsockopt(zmq.LINGER, 0)
    greedy.setsockopt(zmq.RCVHWM, 1)
    greedy.setsockopt(zmq.RCVBUF, 4096)
    try:
        for _ in range(300):  # ~18 MB: more than the socket buffers between the two
            pub.publish(big)
        assert pub.flush()
        assert pub.replay_endpoint is not None
        sub = make_subscriber(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint,
                              start_seq=299, idle_resync_s=0.05)
        assert pub.wait_for_subscribers(1)
        assert [b.seq for b in _collect(sub, 1) if isinstance(b, ReceivedBatch)] == [299]
        assert sub.publisher_supports_incarnation is True  # it answered with ReplayInfo
        greedy.connect(pub.replay_endpoint)
        greedy.send_multipart((b"", encode_seq(0)))  # a reply it never reads: stays under way
        _wait_for(lambda: pub.stats.replay_clients == 1, "the greedy reply to be under way")
        refused = pub.stats.refused_replay_requests
        deadline = time.monotonic() + 60
        while pub.stats.refused_replay_requests < refused + 2:  # idle resyncs, refused
            assert time.monotonic() < deadline, "no idle resync was refused"
            sub.get(0.05)
        assert pub.stats.replay_clients == 1  # still busy: every resync was refused
        assert sub.publisher_supports_incarnation is True
        assert sub.stats.replay_timeouts == 0
    finally:
        greedy.close(linger=0)
        pub.close(timeout_s=1.0)
