"""The scheduler half on its own (as in a serving engine's scheduler process), and start-up
against a master that is not there."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvbridge.backends.mooncake import MooncakeSetupError
from kvbridge.connectors import ConnectorConfig, ConnectorContext, ConnectorRequest, KVRole
from kvbridge.connectors.mooncake_store import MooncakeStoreScheduler, clients, parse_settings
from kvbridge.engine.core import Engine, EngineConfig
from kvbridge.engine.workload import make_requests, run_workload
from kvbridge.layouts import ParallelTopology, hash_blocks, load_spec
from tests.conftest import free_port


def test_scheduler_alone_answers_none_then_the_hits(held_store: tuple[dict[str, Any],
                                                                      Any]) -> None:
    extra = held_store[0]
    spec = load_spec("tiny-gqa")
    (req,) = make_requests(1, prompt_tokens=4 * 16 + 7, max_tokens=1, seed=31, prefix="alone")
    writer = Engine(EngineConfig(spec, ParallelTopology(), num_blocks=32, connector=ConnectorConfig(
        "mooncake_store", KVRole.PRODUCER, extra=extra)))
    try:
        assert run_workload([req], engine=writer, shutdown=False).failed_requests == 0
    finally:
        writer.shutdown()
    # a scheduler half in its own scope: it sets up a client of its own (no segment)
    own = {**extra, "client_scope": "engine", "scheduler_segment_size": 0}
    config = ConnectorConfig("mooncake_store", KVRole.CONSUMER, extra=own, engine_id="alone")
    ctx = ConnectorContext(spec=spec, topology=ParallelTopology(), config=config,
                           num_blocks=(32,), extra=parse_settings(own))
    scheduler = MooncakeStoreScheduler(ctx)
    hashes = tuple(hash_blocks(req.prompt, 16))
    view = ConnectorRequest("alone-0", req.prompt, len(req.prompt), (hashes,))
    try:
        answer = scheduler.get_num_new_matched_tokens(view, 0)
        assert answer == (None, False)  # never waits for the store
        deadline = time.monotonic() + 15
        while answer[0] is None and time.monotonic() < deadline:
            time.sleep(0.01)
            answer = scheduler.get_num_new_matched_tokens(view, 0)
        assert answer == (4 * 16, True)
        assert scheduler.get_num_new_matched_tokens(view, 16) == (3 * 16, True)
        stats = scheduler.get_stats()
        assert stats["lookups"] == 1 and stats["hit_blocks"] == 4
        assert any(k.scope == "engine:alone" for k in clients.live_keys())
    finally:
        scheduler.shutdown()
    assert not any(k.scope == "engine:alone" for k in clients.live_keys())


def test_engine_start_without_master_fails_fast_and_cleanly(mooncake_setups: list[str]) -> None:
    threads_before = set(threading.enumerate())
    port = free_port()
    extra = {"master_address": f"127.0.0.1:{port}",
             "metadata_server": f"http://127.0.0.1:{free_port()}/metadata",
             "global_segment_size": 8 << 20}
    with pytest.raises(MooncakeSetupError, match="does not accept connections"):
        Engine(EngineConfig(load_spec("tiny-gqa"), ParallelTopology(), num_blocks=16,
                            connector=ConnectorConfig("mooncake_store", KVRole.CONSUMER,
                                                      extra=extra)))
    assert mooncake_setups == []  # fast: refused before Mooncake's setup() (~90 s here)
    assert not [k for k in clients.live_keys() if k.master_address.endswith(f":{port}")]
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        extra_threads = [t for t in threading.enumerate()
                         if t not in threads_before and t.is_alive()]
        if not extra_threads:
            break
        time.sleep(0.05)
    assert not extra_threads, [t.name for t in extra_threads]


def _ask(scheduler: MooncakeStoreScheduler, view: ConnectorRequest,
         timeout_s: float = 15.0) -> tuple[int | None, bool]:
    deadline = time.monotonic() + timeout_s
    answer = scheduler.get_num_new_matched_tokens(view, 0)
    while answer[0] is None and time.monotonic() < deadline:
        time.sleep(0.01)
        answer = scheduler.get_num_new_matched_tokens(view, 0)
    return answer


def test_scheduler_without_master_misses_then_recovers(tmp_path: Any) -> None:
    """No master at first: lookups are misses (never a wait); once a master serves on that
    address the scheduler's client is set up and lookups run, without a restart."""
    from kvbridge.backends.mooncake.master import MooncakeMaster
    from tests.conftest import require

    require("mooncake.store", "Mooncake (mooncake-transfer-engine-non-cuda)")
    rpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    extra = {"master_address": f"127.0.0.1:{rpc_port}",
             "metadata_server": f"http://127.0.0.1:{http_port}/metadata",
             "client_scope": "engine", "reconnect_interval_s": 0.2}
    spec = load_spec("tiny-gqa")
    config = ConnectorConfig("mooncake_store", KVRole.CONSUMER, extra=extra, engine_id="late")
    ctx = ConnectorContext(spec=spec, topology=ParallelTopology(), config=config,
                           num_blocks=(32,), extra=parse_settings(extra))
    (req,) = make_requests(1, prompt_tokens=40, max_tokens=1, seed=41, prefix="late")
    view = ConnectorRequest("late-0", req.prompt, len(req.prompt),
                            (tuple(hash_blocks(req.prompt, 16)),))
    scheduler = MooncakeStoreScheduler(ctx)
    try:
        assert _ask(scheduler, view) == (0, False)
        assert scheduler.get_stats()["client_setup_failures"] >= 1
        scheduler.request_finished(view, ((),))
        with MooncakeMaster(rpc_port=rpc_port, http_port=http_port, metrics_port=metrics_port,
                            log_path=tmp_path / "late_master.log"):
            time.sleep(0.3)  # past reconnect_interval_s
            lookups = scheduler.get_stats()["lookups"]
            assert _ask(scheduler, view) == (0, False)  # an empty store: a real miss
            stats = scheduler.get_stats()
            assert stats["lookups"] == lookups + 1
            assert stats["lookup_failures"] == 1  # only the one before the master existed
            scheduler.shutdown()
    finally:
        scheduler.shutdown()
    assert not any(k.scope == "engine:late" for k in clients.live_keys())
