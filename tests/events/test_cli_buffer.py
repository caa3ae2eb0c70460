"""`kvbridge events tail` and the in-process EventBuffer."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest

from kvbridge.auth import resolve_auth
from kvbridge.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CollectingEventSink,
    EndpointError,
    EventBuffer,
    EventSink,
    KVEventPublisher,
    KVEventSubscriber,
    Locality,
    Medium,
    NullEventSink,
    PublisherConfig,
    SubscriberConfig,
)
from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, main


@pytest.fixture
def publisher() -> Iterator[KVEventPublisher]:
    # sealed like an engine's when the environment has a cluster secret (make test-auth)
    pub = KVEventPublisher(PublisherConfig(topic="kv-events"), auth=resolve_auth())
    yield pub
    pub.close(timeout_s=1.0)


def _publish_three(pub: KVEventPublisher) -> None:
    pub.publish([BlockStored(block_hashes=(1, 2), parent_block_hash=None,
                             token_ids=tuple(range(32)), block_size=16, medium=Medium.CPU,
                             group_idx=1, locality=Locality.LOCAL)])
    pub.publish([BlockRemoved(block_hashes=(b"\xab" * 4,), medium=Medium.STORAGE)])
    pub.publish([AllBlocksCleared()])
    assert pub.flush()


def test_tail_json_prints_replayed_batches(
    publisher: KVEventPublisher, capsys: pytest.CaptureFixture[str]
) -> None:
    _publish_three(publisher)
    assert publisher.replay_endpoint is not None
    rc = main(["events", "tail", publisher.endpoint, "--replay", publisher.replay_endpoint,
               "--topic", "kv-events", "--from-seq", "0", "--json", "--count", "3",
               "--timeout", "20"])
    assert rc == EXIT_OK
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    batches = [line for line in lines if line["kind"] == "batch"]
    assert [b["seq"] for b in batches] == [0, 1, 2] and all(b["replayed"] for b in batches)
    stored = batches[0]["events"][0]
    assert stored["type"] == "BlockStored" and stored["medium"] == "CPU"
    assert stored["group_idx"] == 1 and stored["locality"] == "LOCAL"
    assert stored["block_hashes"] == [1, 2] and len(stored["token_ids"]) == 32
    assert batches[1]["events"][0]["block_hashes"] == ["abababab"]
    assert batches[2]["events"] == [{"type": "AllBlocksCleared"}]


def test_tail_text_marks_lost_batches(capsys: pytest.CaptureFixture[str]) -> None:
    pub = KVEventPublisher(PublisherConfig(replay_buffer_batches=1), auth=resolve_auth())
    try:
        _publish_three(pub)
        assert pub.replay_endpoint is not None
        rc = main(["events", "tail", pub.endpoint, "--replay", pub.replay_endpoint,
                   "--from-seq", "0", "--count", "1", "--timeout", "20"])
    finally:
        pub.close(timeout_s=1.0)
    assert rc == EXIT_OK
    out = capsys.readouterr()
    assert "!! lost: batches 0..1" in out.out
    assert "seq=2 (replayed)" in out.out and "AllBlocksCleared" in out.out
    assert "1 batches" in out.err and "2 lost" in out.err


def test_tail_usage_errors_and_timeout(publisher: KVEventPublisher) -> None:
    assert main(["events", "tail", publisher.endpoint, "--from-seq", "0"]) == EXIT_USAGE
    assert main(["events", "tail", publisher.endpoint, "--count", "0"]) == EXIT_USAGE
    # Nothing published: the count is not reached before the timeout.
    assert main(["events", "tail", publisher.endpoint, "--count", "1",
                 "--timeout", "0.3"]) == EXIT_FAILURE


def test_tail_refuses_an_endpoint_zmq_cannot_connect_to_naming_the_argument(
        publisher: KVEventPublisher, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a ZMQError traceback and exit 1."""
    assert main(["events", "tail", "not-an-endpoint", "--timeout", "1"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("kvbridge events tail: ENDPOINT: cannot connect to "
                          "'not-an-endpoint' (") and "tcp://HOST:PORT" in err, err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert main(["events", "tail", publisher.endpoint, "--replay", "tcp://no-port",
                 "--timeout", "1"]) == EXIT_USAGE
    assert capsys.readouterr().err.startswith("kvbridge events tail: --replay: cannot "
                                              "connect to 'tcp://no-port'")
    with pytest.raises(EndpointError) as info:
        KVEventSubscriber(SubscriberConfig(endpoint="udp://1.2.3.4:5"))
    assert info.value.field == "endpoint"


def test_event_buffer_hands_out_every_event_once() -> None:
    buffer = EventBuffer()
    taken: list[object] = []
    done = threading.Event()

    def producer(offset: int) -> None:
        for i in range(2000):
            buffer.append(BlockRemoved(block_hashes=(offset + i,)))

    threads = [threading.Thread(target=producer, args=(k * 10_000,)) for k in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while not done.is_set():
        assert time.monotonic() < deadline, "producer threads still appending after 30 s"
        taken.extend(buffer.take())
        if not any(t.is_alive() for t in threads):
            done.set()
    for t in threads:
        t.join(10)
    taken.extend(buffer.take())
    hashes = [e.block_hashes[0] for e in taken]  # type: ignore[attr-defined]
    assert sorted(hashes) == sorted(k * 10_000 + i for k in range(4) for i in range(2000))
    # Per producer, append order is kept.
    for k in range(4):
        mine = [h for h in hashes if k * 10_000 <= h < (k + 1) * 10_000]
        assert mine == sorted(mine)
    assert len(buffer) == 0 and buffer.take() == []


def test_sinks_satisfy_the_protocol(publisher: KVEventPublisher) -> None:
    collecting = CollectingEventSink()
    for sink in (publisher, collecting, NullEventSink()):
        assert isinstance(sink, EventSink)
    collecting.publish([AllBlocksCleared()])
    collecting.publish([])
    assert collecting.batches == [(AllBlocksCleared(),)]


def test_worker_events_complete_when_every_rank_reported() -> None:
    from kvbridge.events import WorkerEventAggregator

    agg = WorkerEventAggregator(num_workers=2)
    a = BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(), block_size=16)
    b = BlockRemoved(block_hashes=(1,))
    agg.add(0, [a, b])
    assert agg.take_complete() == [] and agg.num_pending == 2
    agg.add(1, [a])
    assert agg.take_complete() == [a]
    agg.add(0, [a])  # stored again on rank 0 only
    agg.add(1, [b, a])
    assert agg.take_complete() == [b, a] and agg.num_pending == 0
    with pytest.raises(ValueError, match="worker_rank"):
        agg.add(2, [a])
