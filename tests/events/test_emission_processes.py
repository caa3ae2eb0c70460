"""Engines started by a command publish at per-engine endpoints (engine processes too)."""

from __future__ import annotations

import argparse
import time

import pytest

from kvbridge.connectors import ConfigError
from kvbridge.engine import EngineConfig, make_requests
from kvbridge.engine.core import Engine
from kvbridge.engine.harness import EngineProcess
from kvbridge.engine.kv_events import (
    EngineEventsConfig,
    active_publishing,
    offset_endpoint,
    publish_engine_events,
)
from kvbridge.events import (
    AllBlocksCleared,
    BlockStored,
    KVEvent,
    KVEventPublisher,
    KVEventSubscriber,
    ReceivedBatch,
    SubscriberConfig,
)
from kvbridge.layouts import hash_blocks, load_spec
from kvbridge.tools.cli import EXIT_USAGE
from kvbridge.tools.events_flags import (
    add_events_arguments,
    events_config,
    make_event_sink,
    with_engine_events,
)

ANY = "tcp://127.0.0.1:*"


def test_offsets_follow_vllm_and_collisions_are_refused() -> None:
    assert offset_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert offset_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint(ANY, 3) == ANY
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv-1"
    with pytest.raises(ConfigError, match="events_endpoint"):
        offset_endpoint("http://x:1", 0)
    with pytest.raises(ConfigError, match="events_replay_endpoint"):
        EngineEventsConfig("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557")
    config = EngineEventsConfig("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    with publish_engine_events(config) as publishing:
        assert active_publishing() is publishing
        assert publishing.assign().endpoints() == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
        with pytest.raises(ConfigError, match="engine 0 already binds"):
            publishing.assign()  # engine 1's events port is engine 0's replay port
        with pytest.raises(RuntimeError, match="already active"), publish_engine_events(config):
            pass
    assert active_publishing() is None
    assert EngineEventsConfig.from_dict(config.to_dict()) == config


def test_flags_parse_and_usage_errors() -> None:
    parser = argparse.ArgumentParser()
    add_events_arguments(parser)
    assert events_config(parser.parse_args([])) is None
    assert make_event_sink(parser.parse_args([])) is None
    args = parser.parse_args(["--events-endpoint", ANY, "--events-replay-endpoint", ANY])
    assert events_config(args) == EngineEventsConfig(ANY, ANY)
    sink = make_event_sink(args)
    assert isinstance(sink, KVEventPublisher) and sink.replay_endpoint is not None
    sink.close(timeout_s=0)
    bad = parser.parse_args(["--events-replay-endpoint", ANY])
    with pytest.raises(ConfigError, match="needs --events-endpoint"):
        events_config(bad)
    calls: list[object] = []

    def run(ns: argparse.Namespace) -> int:
        calls.append(active_publishing())
        return 0

    assert with_engine_events(run)(bad) == EXIT_USAGE and not calls
    assert with_engine_events(run)(parser.parse_args([])) == 0 and calls == [None]
    assert with_engine_events(run)(args) == 0 and calls[-1] is not None
    assert active_publishing() is None


def test_engines_built_in_a_publishing_block_publish_at_their_own_endpoints() -> None:
    spec = load_spec("tiny-gqa")
    with publish_engine_events(EngineEventsConfig(ANY, ANY)) as publishing:
        first = Engine(EngineConfig(spec, num_blocks=8))
        second = Engine(EngineConfig(spec, num_blocks=8))
    try:
        assert first.publisher is not None and second.publisher is not None
        assert first.publisher.endpoint != second.publisher.endpoint
        assert [e.endpoint for e in publishing.engines] == [first.publisher.endpoint,
                                                            second.publisher.endpoint]
        assert first.config.enable_kv_cache_events and first.keep_events
        with KVEventSubscriber(SubscriberConfig(second.publisher.endpoint,
                                                second.publisher.replay_endpoint,
                                                start_seq=0)) as sub:
            (spec_,) = make_requests(1, prompt_tokens=40, max_tokens=1)
            second.add_request(spec_)
            second.run_until_done(timeout_s=30)
            batch = next(sub.batches(idle_timeout_s=10.0))
        stored = [e for e in batch.batch.events if isinstance(e, BlockStored)]
        assert [h for e in stored for h in e.block_hashes] == hash_blocks(spec_.prompt, 16)
        assert second.events == list(batch.batch.events)  # kept as well
        assert first.publisher.stats.next_seq == 0  # the other engine published nothing
    finally:
        first.shutdown()
        second.shutdown()


def test_engine_process_publishes_block_pool_events() -> None:
    spec = load_spec("tiny-gqa")
    requests = make_requests(2, prompt_tokens=40, max_tokens=1, seed=9)
    with publish_engine_events(EngineEventsConfig(ANY, ANY)) as publishing, \
            EngineProcess(EngineConfig(spec, num_blocks=16), name="solo",
                          start_timeout_s=120) as proc:
        assert proc.events_endpoint is not None and proc.events_replay_endpoint is not None
        assert [(e.name, e.endpoint) for e in publishing.engines] == [("solo",
                                                                        proc.events_endpoint)]
        with KVEventSubscriber(SubscriberConfig(proc.events_endpoint,
                                                proc.events_replay_endpoint,
                                                start_seq=0)) as sub:
            proc.submit(requests)
            deadline = time.monotonic() + 60
            done: list[object] = []
            while len(done) < len(requests):
                assert time.monotonic() < deadline, "requests did not finish"
                done += proc.results()
                time.sleep(0.02)
            assert proc.reset_prefix_cache() == 4
            events: list[KVEvent] = []
            for item in sub.items(idle_timeout_s=10.0):
                assert isinstance(item, ReceivedBatch), item
                events += item.batch.events
                if isinstance(events[-1], AllBlocksCleared):
                    break
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert sorted(stored) == sorted(h for r in requests for h in hash_blocks(r.prompt, 16))
    assert isinstance(events[-1], AllBlocksCleared)
