"""The reference shared-storage connector: settings, byte-exact PD transfer, failure modes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.connectors import ConfigError, ConnectorConfig, KVRole, registry
from kvbridge.connectors.shared_storage import SharedStoragePlugin, StorageSettings
from kvbridge.engine import EngineConfig
from kvbridge.engine.workload import make_requests, run_workload
from kvbridge.events import BlockStored
from kvbridge.layouts import ParallelTopology, load_spec


def test_settings_are_validated_naming_the_key(tmp_path: Path) -> None:
    parsed = SharedStoragePlugin.parse_extra({"path": str(tmp_path), "load_async": True})
    assert parsed == StorageSettings(tmp_path, load_async=True)
    with pytest.raises(ConfigError, match="kv_connector_extra_config.path"):
        SharedStoragePlugin.parse_extra({})
    with pytest.raises(ConfigError, match="kv_connector_extra_config.load_async"):
        SharedStoragePlugin.parse_extra({"path": "x", "load_async": "yes"})
    with pytest.raises(ConfigError, match="kv_connector_extra_config.colour"):
        SharedStoragePlugin.parse_extra({"path": "x", "colour": 1})
    assert registry.load("shared_storage") is SharedStoragePlugin


def _pd(tmp_path: Path, preset: str, topo: ParallelTopology, **extra: object) -> tuple:
    spec = load_spec(preset)
    store = {"path": str(tmp_path / "store"), **extra}
    producer = EngineConfig(spec, topo, num_blocks=64, connector=ConnectorConfig(
        "shared_storage", KVRole.PRODUCER, extra=store))
    consumer = EngineConfig(spec, topo, num_blocks=64, connector=ConnectorConfig(
        "shared_storage", KVRole.CONSUMER, extra=store))
    return producer, consumer


@pytest.mark.parametrize(("preset", "topo"), [
    ("tiny-gqa", ParallelTopology(tp_size=2)),
    ("tiny-hybrid", ParallelTopology(tp_size=2, dcp_size=2)),
    ("tiny-mla", ParallelTopology(pp_size=2)),
])
def test_pd_transfer_verifies_every_byte(tmp_path: Path, preset: str,
                                         topo: ParallelTopology) -> None:
    producer, consumer = _pd(tmp_path, preset, topo)
    requests = make_requests(4, prompt_tokens=75, max_tokens=3)
    result = run_workload(requests, engine=producer, consumer=consumer)
    assert result.failed_requests == 0 and not result.wrong_outputs
    assert result.external_tokens > 0 and result.mismatched_bytes == 0
    assert result.verified_bytes > 0
    events = [e for e in result.producer_results]
    assert events  # producer finished every prefill
    stored = result.producer_stats["connector_stats"]["save_blocks"]
    assert stored > 0


def test_short_block_file_is_a_load_error_and_recomputed(tmp_path: Path) -> None:
    producer, consumer = _pd(tmp_path, "tiny-gqa", ParallelTopology())
    requests = make_requests(2, prompt_tokens=50, max_tokens=2)

    def truncate(engine: object, step: object) -> None:
        for path in sorted((tmp_path / "store").rglob("*.kv")):
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])

    result = run_workload(requests, engine=producer, consumer=consumer,
                          consumer_step_hook=truncate)
    assert result.failed_requests == 0 and not result.wrong_outputs
    assert result.recomputed_tokens > 0 and result.mismatched_bytes == 0
    assert result.engine_stats["failed_loads"] >= 1
    assert result.engine_stats["worker_stats"]["load_errors"] >= 1


def test_producer_emits_self_describing_stored_events(tmp_path: Path) -> None:
    from kvbridge.engine import Engine

    spec = load_spec("tiny-gqa")
    engine = Engine(EngineConfig(spec, num_blocks=32, connector=ConnectorConfig(
        "shared_storage", KVRole.BOTH, extra={"path": str(tmp_path)})))
    requests = make_requests(1, prompt_tokens=40, max_tokens=1)
    run_workload(requests, engine=engine, shutdown=False)
    stored = [e for e in engine.events if isinstance(e, BlockStored)]
    assert len(stored) == 2  # two full 16-token blocks of a 40-token prompt
    assert stored[0].parent_block_hash is None and stored[1].parent_block_hash == \
        stored[0].block_hashes[0]
    assert list(stored[0].token_ids) == list(requests[0].prompt[:16])
    engine.shutdown()


def test_engine_publishes_each_steps_events_to_a_sink(tmp_path: Path) -> None:
    from kvbridge.engine import Engine
    from kvbridge.events import CollectingEventSink

    sink = CollectingEventSink()
    engine = Engine(EngineConfig(load_spec("tiny-gqa"), num_blocks=32, connector=ConnectorConfig(
        "shared_storage", KVRole.BOTH, extra={"path": str(tmp_path)})), event_sink=sink)
    run_workload(make_requests(2, prompt_tokens=40, max_tokens=1), engine=engine)
    assert len(sink.events) == 4 and not engine.events
    assert all(isinstance(e, BlockStored) and e.medium == "STORAGE" for e in sink.events)
