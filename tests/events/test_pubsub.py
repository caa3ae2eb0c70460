"""Publisher and subscriber over real ZMQ sockets on 127.0.0.1 (and inproc)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from kvbridge.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventWireFormat,
    GapDetected,
    GapLost,
    KVEvent,
    KVEventPublisher,
    KVEventSubscriber,
    Locality,
    MalformedFrame,
    Medium,
    PublisherClosedError,
    PublisherConfig,
    PublisherRestarted,
    ReceivedBatch,
    StreamItem,
    encode_batch,
)
from kvbridge.events.wire import END_SEQ, encode_seq
from tests.conftest import free_port


def step_events(i: int) -> list[KVEvent]:
    """What one engine step might publish; distinct per step."""
    return [
        BlockStored(
            block_hashes=(2 * i + 1, 2 * i + 2),
            parent_block_hash=2 * i if i else None,
            token_ids=tuple(range(i, i + 32)),
            block_size=16,
            medium=Medium.CPU,
            group_idx=i % 2,
            locality=Locality.LOCAL,
        ),
        BlockRemoved(block_hashes=(i,), medium=Medium.STORAGE, locality=Locality.REMOTE),
    ]


@pytest.fixture
def make_publisher() -> Iterator[Callable[..., KVEventPublisher]]:
    made: list[KVEventPublisher] = []

    def make(**kwargs: Any) -> KVEventPublisher:
        pub = KVEventPublisher(PublisherConfig(**kwargs))
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.close(timeout_s=1.0)


def collect(sub: KVEventSubscriber, num_batches: int, timeout_s: float = 10.0) -> list[StreamItem]:
    """Items until ``num_batches`` batches arrived (bounded by ``timeout_s``)."""
    items: list[StreamItem] = []
    deadline = time.monotonic() + timeout_s
    batches = 0
    while batches < num_batches:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"only {batches}/{num_batches} batches; items: {items[-5:]}"
        item = sub.get(remaining)
        if item is None:
            continue
        items.append(item)
        if isinstance(item, ReceivedBatch):
            batches += 1
    return items


def batches_of(items: list[StreamItem]) -> list[ReceivedBatch]:
    return [item for item in items if isinstance(item, ReceivedBatch)]


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    ("wire_format", "replay_includes_topic"),
    [(EventWireFormat.MAP, True), (EventWireFormat.ARRAY, False)],
)
def test_round_trip_every_event_type_over_zmq(
    make_publisher: Callable[..., KVEventPublisher],
    make_subscriber: Callable[..., KVEventSubscriber],
    wire_format: EventWireFormat,
    replay_includes_topic: bool,
) -> None:
    pub = make_publisher(
        topic="kv-events", wire_format=wire_format, replay_includes_topic=replay_includes_topic,
        data_parallel_rank=2,
    )
    sub = make_subscriber(
        endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, topic="kv-events", start_seq=0
    )
    sent = [step_events(i) for i in range(5)] + [[AllBlocksCleared()]]
    for events in sent:
        assert pub.publish(events) is not None
    got = batches_of(collect(sub, len(sent)))
    assert [b.seq for b in got] == list(range(len(sent)))
    assert [list(b.batch.events) for b in got] == sent
    assert all(b.batch.data_parallel_rank == 2 for b in got)
    assert sub.stats.lost_batches == 0 and sub.stats.malformed_frames == 0
    assert pub.publish([]) is None  # an empty step publishes nothing


def test_free_port_endpoints_are_resolved(make_publisher: Callable[..., KVEventPublisher]) -> None:
    pub = make_publisher()
    assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":*")
    assert pub.replay_endpoint is not None and pub.replay_endpoint != pub.endpoint


# ---------------------------------------------------------------- gaps and replay


def test_late_joiner_repairs_by_replay(
    make_publisher: Callable[..., KVEventPublisher],
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    pub = make_publisher(topic="t")
    for i in range(50):
        pub.publish(step_events(i))
    assert pub.flush()
    sub = make_subscriber(
        endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, topic="t", start_seq=0
    )
    first = batches_of(collect(sub, 50))
    assert [b.seq for b in first] == list(range(50)) and all(b.replayed for b in first)
    assert sub.incarnation == pub.incarnation
    for i in range(50, 60):
        pub.publish(step_events(i))
    later = batches_of(collect(sub, 10))
    assert [b.seq for b in later] == list(range(50, 60))
    assert [list(b.batch.events) for b in first + later] == [step_events(i) for i in range(60)]
    assert sub.stats.lost_batches == 0


def test_hwm_overflow_is_repaired_by_replay(
    make_publisher: Callable[..., KVEventPublisher],
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    # inproc has no kernel buffers: with tiny high-water marks the PUB drops for sure.
    name = f"inproc://kv-events-{uuid.uuid4().hex}"
    pub = make_publisher(endpoint=name, replay_endpoint=name + "-replay", hwm=4)
    sub = make_subscriber(
        endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, start_seq=0, rcvhwm=4,
        idle_resync_s=0.2,
    )
    pub.publish(step_events(0))
    assert batches_of(collect(sub, 1))[0].seq == 0  # connected and caught up
    for i in range(1, 300):
        pub.publish(step_events(i))
    assert pub.flush()
    items = collect(sub, 299)
    got = batches_of(items)
    assert [b.seq for b in got] == list(range(1, 300))
    assert [list(b.batch.events) for b in got] == [step_events(i) for i in range(1, 300)]
    gaps = [item for item in items if isinstance(item, GapDetected)]
    assert gaps, "the tiny HWM should have dropped live batches"
    assert sub.stats.replayed_batches >= sum(g.num_batches for g in gaps) > 0
    assert sub.stats.lost_batches == 0 and sub.stats.gaps == len(gaps)
    assert not any(isinstance(item, GapLost) for item in items)


def test_batches_evicted_from_the_ring_are_reported_lost(
    make_publisher: Callable[..., KVEventPublisher],
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    pub = make_publisher(replay_buffer_batches=10)
    for i in range(50):
        pub.publish(step_events(i))
    assert pub.flush()
    sub = make_subscriber(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, start_seq=0)
    items = collect(sub, 10)
    lost = [item for item in items if isinstance(item, GapLost)]
    assert [(g.start_seq, g.end_seq) for g in lost] == [(0, 40)]
    assert [b.seq for b in batches_of(items)] == list(range(40, 50))
    assert sub.stats.lost_batches == 40


def test_gap_without_replay_endpoint_is_lost_not_hung(
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    ctx = zmq.Context.instance()
    xpub = ctx.socket(zmq.XPUB)
    xpub.setsockopt(zmq.LINGER, 0)
    try:
        xpub.bind("tcp://127.0.0.1:*")
        sub = make_subscriber(endpoint=xpub.getsockopt_string(zmq.LAST_ENDPOINT))
        assert xpub.poll(5000) and xpub.recv()[:1] == b"\x01"  # subscribed
        for seq in (0, 1, 5):
            payload = encode_batch(EventBatch(1.0, tuple(step_events(seq)), 0))
            xpub.send_multipart((b"", encode_seq(seq), payload))
        items = collect(sub, 3)
        assert [b.seq for b in batches_of(items)] == [0, 1, 5]
        lost = [item for item in items if isinstance(item, GapLost)]
        assert [(g.start_seq, g.end_seq, g.reason) for g in lost] == [
            (2, 5, "no replay endpoint")
        ]
    finally:
        xpub.close()


# ---------------------------------------------------------------- restarts


def _fixed_endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def _rebind(make: Callable[..., KVEventPublisher], **kwargs: Any) -> KVEventPublisher:
    """A restarted publisher on the same endpoints; ZMQ releases a closed socket's
    port asynchronously, so retry briefly (as a restarted process would)."""
    deadline = time.monotonic() + 5.0
    while True:
        try:
            return make(**kwargs)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _until_subscribed(sub: KVEventSubscriber, pub: KVEventPublisher) -> list[StreamItem]:
    """Readiness handshake after a publisher restart: drive the subscriber (libzmq
    re-sends a SUB's subscription after a reconnect only when its owner uses the
    socket) until the new publisher has seen the subscription; returns the items
    that arrived meanwhile."""
    items: list[StreamItem] = []
    deadline = time.monotonic() + 20.0
    while not pub.wait_for_subscribers(1, timeout_s=0.0):
        assert time.monotonic() < deadline, "the SUB did not reconnect"
        item = sub.get(0.02)
        if item is not None:
            items.append(item)
    return items


def test_restart_detected_when_sequence_goes_backwards(
    make_publisher: Callable[..., KVEventPublisher],
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    endpoint, replay = _fixed_endpoints()
    first = make_publisher(endpoint=endpoint, replay_endpoint=replay)
    sub = make_subscriber(endpoint=endpoint, replay_endpoint=replay, start_seq=0)
    for i in range(10):
        first.publish(step_events(i))
    assert [b.seq for b in batches_of(collect(sub, 10))] == list(range(10))
    first.close()
    second = _rebind(make_publisher, endpoint=endpoint, replay_endpoint=replay)
    assert second.incarnation != first.incarnation
    items = _until_subscribed(sub, second)
    for i in range(3):
        second.publish(step_events(100 + i))
    items += collect(sub, 3)
    restarts = [item for item in items if isinstance(item, PublisherRestarted)]
    assert len(restarts) == 1
    assert restarts[0].previous_incarnation == first.incarnation
    assert restarts[0].last_seq == 9
    got = batches_of(items)
    assert [b.seq for b in got] == [0, 1, 2]
    assert [list(b.batch.events) for b in got] == [step_events(100 + i) for i in range(3)]
    assert sub.stats.restarts == 1 and sub.stats.lost_batches == 0


def test_restart_is_not_mistaken_for_a_gap(
    make_publisher: Callable[..., KVEventPublisher],
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    """The new incarnation is already past the old one's seq when the subscriber
    hears it: seq alone looks like a gap; the incarnation tells the truth, and the
    subscriber never splices the new publisher's batches into the old stream."""
    endpoint, replay = _fixed_endpoints()
    first = make_publisher(endpoint=endpoint, replay_endpoint=replay)
    sub = make_subscriber(endpoint=endpoint, replay_endpoint=replay, start_seq=0)
    for i in range(5):
        first.publish(step_events(i))
    collect(sub, 5)
    first.close()
    second = _rebind(make_publisher, endpoint=endpoint, replay_endpoint=replay)
    for i in range(20):  # before the SUB reconnects: missed live
        second.publish(step_events(200 + i))
    assert second.flush()
    items = _until_subscribed(sub, second)
    second.publish(step_events(220))
    items += collect(sub, 21 - len(batches_of(items)))
    restarts = [item for item in items if isinstance(item, PublisherRestarted)]
    assert len(restarts) == 1 and restarts[0].incarnation == second.incarnation
    got = batches_of(items)
    assert [b.seq for b in got] == list(range(21))
    assert [list(b.batch.events) for b in got] == [step_events(200 + i) for i in range(21)]
    assert sub.incarnation == second.incarnation
    assert sub.stats.lost_batches == 0


# ---------------------------------------------------------------- malformed input


def test_malformed_frames_are_reported_not_fatal(
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    ctx = zmq.Context.instance()
    xpub = ctx.socket(zmq.XPUB)
    xpub.setsockopt(zmq.LINGER, 0)
    try:
        xpub.bind("tcp://127.0.0.1:*")
        sub = make_subscriber(endpoint=xpub.getsockopt_string(zmq.LAST_ENDPOINT), topic="kv")
        assert xpub.poll(5000) and xpub.recv() == b"\x01kv"

        def good(seq: int) -> bytes:
            return encode_batch(EventBatch(1.0, tuple(step_events(seq)), 0))

        bad_field = msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}], 0])
        xpub.send_multipart((b"kv", encode_seq(0), good(0)))
        xpub.send_multipart((b"kv", b"\x01\x02", good(1)))  # seq not 8 bytes
        xpub.send_multipart((b"kv", encode_seq(1)))  # two frames
        xpub.send_multipart((b"kv", encode_seq(1), b"\xc1"))  # not msgpack
        xpub.send_multipart((b"kv", encode_seq(2), bad_field))  # wrong field type
        xpub.send_multipart((b"kv", encode_seq(3), good(3)))
        items = collect(sub, 2)
        malformed = [item for item in items if isinstance(item, MalformedFrame)]
        assert len(malformed) == 4
        assert "frames[1] (seq)" in malformed[0].reason
        assert "expected 3 frames" in malformed[1].reason
        assert malformed[2].seq == 1 and "payload" in malformed[2].reason
        assert malformed[3].seq == 2 and "events[0].block_hashes[0]" in malformed[3].reason
        assert [b.seq for b in batches_of(items)] == [0, 3]
        # seqs 1 and 2 arrived (unreadable): not gaps.
        assert sub.stats.malformed_frames == 4 and sub.stats.gaps == 0
    finally:
        xpub.close()


# ---------------------------------------------------------------- vLLM interop


def _vllm_layout_events(payload: bytes) -> list[dict[str, Any]]:
    """Decode as a vLLM subscriber written against vLLM's field layout would."""
    ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
    assert isinstance(ts, float) and dp_rank == 0
    return events


def test_vllm_style_client_reads_live_and_replay(
    make_publisher: Callable[..., KVEventPublisher],
) -> None:
    """A client that speaks only vLLM's protocol: SUB on the topic, DEALER sending
    the 8-byte start seq, replies [topic, seq, payload] ended by [b"", -1, b""]."""
    pub = make_publisher(topic="kv-events")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        sub.connect(pub.endpoint)
        dealer.connect(pub.replay_endpoint)
        assert pub.wait_for_subscribers(1), "the SUB never subscribed"
        for i in range(5):
            pub.publish(step_events(i))
        live = []
        for _ in range(5):
            assert sub.poll(5000)
            topic, seq_bytes, payload = sub.recv_multipart()
            assert topic == b"kv-events" and len(seq_bytes) == 8
            live.append((int.from_bytes(seq_bytes, "big"), _vllm_layout_events(payload)))
        assert [seq for seq, _ in live] == list(range(5))
        assert live[0][1][0]["type"] == "BlockStored" and live[0][1][0]["medium"] == "CPU"
        assert live[0][1][0]["locality"] == "LOCAL" and live[0][1][1]["type"] == "BlockRemoved"

        dealer.send_multipart((b"", (2).to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            topic, seq_bytes, payload = frames[1:]
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                break
            assert topic == b"kv-events"
            replayed.append((seq, _vllm_layout_events(payload)))
        assert replayed == live[2:]
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)


class VllmStylePublisher:
    """vLLM's publisher protocol, reimplemented minimally from its wire layout:
    PUB [topic, seq, payload]; ROUTER answers an 8-byte start seq with
    [topic, seq, payload]... then [b"", END_SEQ, b""]; anything else unparsed.
    (An XPUB, the same wire to a SUB, so the test can see the subscription arrive.)"""

    def __init__(self, topic: bytes) -> None:
        ctx = zmq.Context.instance()
        self.topic = topic
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def wait_for_subscriber(self, timeout_s: float = 10.0) -> bool:
        """Readiness handshake: True once a SUB's subscription arrived."""
        return bool(self.pub.poll(int(timeout_s * 1000))) and self.pub.recv()[:1] == b"\x01"

    def send(self, seq: int, events: list[KVEvent], live: bool = True) -> None:
        payload = encode_batch(EventBatch(time.time(), tuple(events), 0))
        with self.lock:
            self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.router.poll(20):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")  # vLLM reads it unsigned
            with self.lock:
                buffered = list(self.buffer)
            for seq, payload in buffered:
                if seq >= start_seq:
                    self.router.send_multipart(
                        (client, b"", self.topic, seq.to_bytes(8, "big"), payload)
                    )
            self.router.send_multipart((client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.pub.close()
        self.router.close()


def test_subscriber_repairs_gaps_from_a_vllm_style_publisher(
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    vllm = VllmStylePublisher(b"kv-events")
    try:
        sub = make_subscriber(
            endpoint=vllm.endpoint, replay_endpoint=vllm.replay_endpoint, topic="kv-events",
            idle_resync_s=None,
        )
        assert vllm.wait_for_subscriber(), "the subscriber never subscribed"
        vllm.send(0, step_events(0))
        assert [b.seq for b in batches_of(collect(sub, 1))] == [0]
        for seq in range(1, 6):
            vllm.send(seq, step_events(seq), live=seq == 5)  # 1..4 lost live
        items = collect(sub, 5)
        got = batches_of(items)
        assert [b.seq for b in got] == [1, 2, 3, 4, 5]
        assert [list(b.batch.events) for b in got] == [step_events(s) for s in range(1, 6)]
        assert [b.replayed for b in got] == [True] * 4 + [False]
        assert sub.publisher_supports_incarnation is False  # fell back to the plain protocol
        # One probe (answered by the end marker alone) and one plain request for the gap.
        assert sub.stats.replay_requests == 2
        assert sub.stats.lost_batches == 0
    finally:
        vllm.close()


# ---------------------------------------------------------------- lifecycle


def test_close_drains_the_queue_and_refuses_more(
    make_publisher: Callable[..., KVEventPublisher],
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    pub = make_publisher()
    # Live only (no replay endpoint): what arrives was drained and flushed by close().
    sub = make_subscriber(endpoint=pub.endpoint)
    deadline = time.monotonic() + 5.0
    while sub.get(0.05) is None:  # a probe until the SUB is attached
        assert time.monotonic() < deadline
        pub.publish([AllBlocksCleared()])
    for i in range(500):
        pub.publish(step_events(i))
    assert pub.close(timeout_s=5.0) == 0
    assert pub.stats.dropped_batches == 0
    with pytest.raises(PublisherClosedError):
        pub.publish(step_events(0))
    assert pub.close() == 0  # idempotent
    got: list[ReceivedBatch] = []
    deadline = time.monotonic() + 10.0
    while len(got) < 500:
        item = sub.get(max(0.0, deadline - time.monotonic()))
        assert item is not None, f"only {len(got)} of 500 batches arrived after close()"
        if isinstance(item, ReceivedBatch) and item.batch.events != (AllBlocksCleared(),):
            got.append(item)
    assert [list(b.batch.events) for b in got] == [step_events(i) for i in range(500)]
    assert sub.stats.gaps == 0


def test_close_past_its_deadline_counts_every_unsent_batch_abandoned(
    make_publisher: Callable[..., KVEventPublisher],
) -> None:
    """The thread takes queued batches in bursts; when close() gives up mid-burst,
    the batches it had taken but not sent are counted abandoned, not lost silently."""
    pub = make_publisher()
    total = 5000
    for i in range(total):
        pub.publish(step_events(i))
    abandoned = pub.close(timeout_s=0.0)
    assert pub.stats.published_batches + abandoned == total
    assert pub.stats.dropped_batches == 0


def _soak(make_publisher: Callable[..., KVEventPublisher],
          make_subscriber: Callable[..., KVEventSubscriber], num_events: int) -> None:
    batch_size = 32
    pub = make_publisher(topic="soak")
    sub = make_subscriber(
        endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, topic="soak", start_seq=0
    )
    num_batches = num_events // batch_size
    received: list[ReceivedBatch] = []
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            for item in sub.batches(idle_timeout_s=20.0, max_batches=num_batches):
                received.append(item)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    consumer = threading.Thread(target=consume)
    consumer.start()
    for b in range(num_batches):
        pub.publish([
            BlockStored(block_hashes=(b * batch_size + k,), parent_block_hash=None,
                        token_ids=tuple(range(16)), block_size=16)
            for k in range(batch_size)
        ])
    consumer.join(120)
    assert not consumer.is_alive() and not errors
    assert len(received) == num_batches
    assert [r.seq for r in received] == list(range(num_batches))
    hashes = [e.block_hashes[0] for r in received for e in r.batch.events]  # type: ignore[union-attr]
    assert hashes == list(range(num_batches * batch_size))
    assert sub.stats.lost_batches == 0 and pub.stats.dropped_batches == 0


def test_soak_10k_events_no_loss(
    make_publisher: Callable[..., KVEventPublisher],
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    _soak(make_publisher, make_subscriber, 10_000)


@pytest.mark.slow
def test_soak_100k_events_no_loss(
    make_publisher: Callable[..., KVEventPublisher],
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    _soak(make_publisher, make_subscriber, 100_000)


def test_full_queue_drops_are_visible_to_subscribers(
    make_publisher: Callable[..., KVEventPublisher],
    make_subscriber: Callable[..., KVEventSubscriber],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A publisher thread that cannot keep up (fault injected: the real encoder,
    slowed down) drops batches with their seqs consumed; subscribers report
    exactly those as lost instead of silently missing them."""
    import kvbridge.events.publisher as publisher_module

    real_encode = publisher_module.encode_events

    def slow_encode(*args: Any, **kwargs: Any) -> bytes:
        time.sleep(0.002)
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(publisher_module, "encode_events", slow_encode)
    pub = make_publisher(max_queue_batches=2, enqueue_timeout_s=0.0)
    results = [pub.publish(step_events(i)) for i in range(100)]
    dropped = [i for i, seq in enumerate(results) if seq is None]
    assert dropped, "a 2-batch queue in front of a slowed encoder must overflow"
    assert pub.flush(10.0)
    # Drops at the very end are revealed by the next batch (as on the live stream).
    assert pub.publish(step_events(100)) == 100
    assert pub.flush(10.0)
    assert pub.stats.dropped_batches == len(dropped)
    assert pub.stats.next_seq == 101  # dropped batches still consumed their seq
    sub = make_subscriber(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, start_seq=0)
    kept = [i for i in range(101) if i not in dropped]
    items = collect(sub, len(kept))
    assert [b.seq for b in batches_of(items)] == kept
    lost = {seq for item in items if isinstance(item, GapLost)
            for seq in range(item.start_seq, item.end_seq)}
    assert lost == set(dropped) and sub.stats.lost_batches == len(dropped)


def test_restart_that_looks_like_a_continuation_is_detected(
    make_publisher: Callable[..., KVEventPublisher],
    make_subscriber: Callable[..., KVEventSubscriber],
) -> None:
    """The new publisher's first batch heard live carries exactly the seq the
    subscriber expects next. Only the incarnation (checked after each reconnect)
    reveals the restart."""
    endpoint, replay = _fixed_endpoints()
    first = make_publisher(endpoint=endpoint, replay_endpoint=replay)
    sub = make_subscriber(endpoint=endpoint, replay_endpoint=replay)  # live tail
    deadline = time.monotonic() + 5.0
    while not isinstance(sub.get(0.05), ReceivedBatch):
        assert time.monotonic() < deadline
        first.publish([AllBlocksCleared()])
    assert first.flush()
    while sub.get(0.2) is not None:
        pass
    assert sub.incarnation == first.incarnation  # learned when the stream started
    expected = sub.next_seq
    assert expected == first.stats.next_seq
    first.close()
    second = _rebind(make_publisher, endpoint=endpoint, replay_endpoint=replay)
    for i in range(expected):  # missed live: the SUB has not reconnected yet
        second.publish(step_events(300 + i))
    assert second.flush()
    items = _until_subscribed(sub, second)
    second.publish(step_events(300 + expected))
    items += collect(sub, expected + 1 - len(batches_of(items)))
    restarts = [item for item in items if isinstance(item, PublisherRestarted)]
    assert len(restarts) == 1 and restarts[0].incarnation == second.incarnation
    got = batches_of(items)
    assert [b.seq for b in got] == list(range(expected + 1))
    assert [list(b.batch.events) for b in got] == [
        step_events(300 + i) for i in range(expected + 1)
    ]
