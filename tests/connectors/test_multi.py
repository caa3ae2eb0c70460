"""The ``multi`` connector: config, lookup ownership, saves to all, merged outputs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import pytest

from kvbridge.connectors import ConfigError, ConnectorConfig, ContractError, KVRole, registry
from kvbridge.connectors.api import ConnectorContext, ConnectorMetadata, KVCaches, WorkerConnector
from kvbridge.connectors.multi import (
    MultiMetadata,
    MultiPlugin,
    MultiScheduler,
    MultiSettings,
    MultiWorker,
    _unpack_blobs,
)
from kvbridge.connectors.offloading import OffloadingScheduler
from kvbridge.connectors.offloading.scheduler import pools_of
from kvbridge.engine.core import Engine, EngineConfig
from kvbridge.engine.request import RequestSpec, RequestState
from kvbridge.engine.workload import check_outputs, make_requests
from kvbridge.layouts import ParallelTopology, load_spec

MAX_STEPS = 400


def _engine(children: list[dict[str, Any]], role: KVRole = KVRole.BOTH,
            topology: ParallelTopology | None = None) -> Engine:
    return Engine(EngineConfig(load_spec("tiny-gqa"), topology or ParallelTopology(),
                               num_blocks=128, record_hooks=True,
                               connector=ConnectorConfig("multi", role,
                                                         extra={"connectors": children})))


def _run(engine: Engine, specs: list[RequestSpec]) -> list[Any]:
    for spec in specs:
        engine.add_request(spec)
    steps = 0
    while engine.has_work():
        assert steps < MAX_STEPS, engine.stats()
        if engine.step().num_scheduled == 0:
            time.sleep(0.001)
        steps += 1
    results = engine.pop_results()
    assert not check_outputs(results, specs)
    assert all(r.state is RequestState.FINISHED_LENGTH for r in results)
    assert not engine.idle_problems()
    stats = engine.stats()
    assert stats["stray_finished_sending"] == 0 and stats["stray_finished_recving"] == 0
    assert stats["mismatched_bytes"] == 0
    return results


def _again(specs: list[RequestSpec], tag: str) -> list[RequestSpec]:
    return [RequestSpec(f"{s.request_id}-{tag}", s.prompt, max_tokens=s.max_tokens)
            for s in specs]


def _storage(path: Path, **flags: bool) -> dict[str, Any]:
    return {"connector": "shared_storage", "extra": {"path": str(path), **flags}}


def _offloading(fs_dir: Path | None = None) -> dict[str, Any]:
    extra: dict[str, Any] = {"cpu_blocks": 64}
    if fs_dir is not None:
        extra.update(fs_dir=str(fs_dir), fs_o_direct=False)
    return {"connector": "offloading", "role": "kv_both", "extra": extra}


def test_registered_with_conformance_cases() -> None:
    assert registry.load("multi") is MultiPlugin
    assert {c.name for c in MultiPlugin.conformance_cases()} >= {"multi-storage+offloading-pd"}


@pytest.mark.parametrize(("extra", "field"), [
    ({}, "kv_connector_extra_config.connectors"),
    ({"connectors": []}, "kv_connector_extra_config.connectors"),
    ({"connectors": [{"connector": "multi"}]},
     "kv_connector_extra_config.connectors[0].connector"),
    ({"connectors": [{"connector": "shared_storage", "extra": {"path": "/x"}, "x": 1}]},
     "kv_connector_extra_config.connectors[0].x"),
    ({"connectors": [{"connector": "offloading", "extra": {"cpu_blocks": -1}}]},
     "kv_connector_extra_config.connectors[0].extra.cpu_blocks"),
    ({"connectors": [{"connector": "offloading", "role": "boss"}]},
     "kv_connector_extra_config.connectors[0].role"),
    ({"connectors": [], "more": 1}, "kv_connector_extra_config.more"),
])
def test_config_errors_name_the_field(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        MultiPlugin.parse_extra(extra)
    assert info.value.field == field


def test_unknown_child_connector_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        MultiPlugin.parse_extra({"connectors": [{"connector": "no-such-connector"}]})


def test_first_child_with_tokens_loads_and_saves_go_to_all(tmp_path: Path) -> None:
    specs = make_requests(4, prompt_tokens=64, max_tokens=2, seed=1)
    children = [_offloading(), _storage(tmp_path / "store")]
    with _engine(children) as engine:
        _run(engine, specs)
        engine.reset_prefix_cache()
        results = _run(engine, _again(specs, "again"))
        stats = engine.stats()["connector_stats"]
    assert isinstance(stats, dict)
    # saves went to both children
    assert stats["0.offloading.store_parts"] == 16
    assert stats["1.shared_storage.save_blocks"] == 16
    # the offloading connector is first and has every block: it owns every load
    assert stats["0.offloading.load_blocks"] == 16
    assert stats["1.shared_storage.load_blocks"] == 0
    assert sum(r.num_external_tokens for r in results) == 4 * 63
    # a fresh engine: the offloading CPU tier is empty, shared_storage still has the blocks
    with _engine(children) as engine:
        results = _run(engine, _again(specs, "fresh"))
        stats = engine.stats()["connector_stats"]
    assert isinstance(stats, dict)
    assert stats["0.offloading.load_blocks"] == 0
    assert stats["1.shared_storage.load_blocks"] == 16
    assert sum(r.num_external_tokens for r in results) == 4 * 63


def test_a_child_that_asks_again_defers_the_lookup(tmp_path: Path) -> None:
    specs = make_requests(2, prompt_tokens=48, max_tokens=2, seed=2)
    children = [_storage(tmp_path / "a"), _storage(tmp_path / "b", lookup_async=True)]
    with _engine(children) as engine:
        _run(engine, specs)
        assert engine.stats()["lookups_deferred"] >= 2


def test_free_delayed_by_two_children_is_released_once_after_both(tmp_path: Path) -> None:
    specs = make_requests(3, prompt_tokens=48, max_tokens=2, seed=3)
    children = [_storage(tmp_path / "a", save_async=True),
                _storage(tmp_path / "b", save_async=True)]
    with _engine(children, topology=ParallelTopology(tp_size=2)) as engine:
        _run(engine, specs)  # idle: every delayed free released, none stray
        finished = [rid for o in engine.output_log for rid in o.finished_sending]
    assert sorted(finished) == sorted(s.request_id for s in specs)  # once each
    assert list((tmp_path / "a").rglob("*.kv")) and list((tmp_path / "b").rglob("*.kv"))


def test_handshake_blobs_round_trip_and_malformed_ones_are_refused() -> None:
    packed = msgpack.packb([b"nixl-md", None], use_bin_type=True)
    assert _unpack_blobs(packed, 2) == [b"nixl-md", None]
    with pytest.raises(ContractError):
        _unpack_blobs(packed, 3)
    with pytest.raises(ContractError):
        _unpack_blobs(b"\xc1garbage", 2)


def test_scheduler_shutdown_reaches_every_child(tmp_path: Path) -> None:
    engine = _engine([_offloading(), _storage(tmp_path / "s")])
    scheduler = engine.scheduler_connector
    assert isinstance(scheduler, MultiScheduler) and len(scheduler.children) == 2
    engine.shutdown()
    shutdowns = [c for c in engine.hook_log if c.hook == "shutdown"]
    assert len(shutdowns) == 2  # one worker + the scheduler, each fanned out to children
    offloading = scheduler.children[0]
    assert isinstance(offloading, OffloadingScheduler)
    assert pools_of(offloading.token) is None  # the CPU tier was released


class _Sender(WorkerConnector):
    """A child worker that reports given requests as sent in given steps."""

    def __init__(self, ctx: ConnectorContext, plan: dict[int, set[str]]) -> None:
        super().__init__(ctx)
        self.plan = plan
        self.step = 0

    def register_kv_caches(self, caches: KVCaches) -> None: ...
    def start_load_kv(self) -> None: ...
    def wait_for_layer_load(self, layer_id: int) -> None: ...
    def save_kv_layer(self, layer_id: int, kv_layer: Any) -> None: ...
    def wait_for_save(self) -> None: ...
    def get_block_ids_with_load_errors(self) -> set[tuple[int, int]]:
        return set()
    def shutdown(self) -> None: ...

    def get_finished(self, finished_request_ids: frozenset[str]) -> tuple[set[str], set[str]]:
        self.step += 1
        return set(self.plan.get(self.step, set())), set()


def test_worker_reports_a_delayed_request_once_after_every_child_that_delays_it() -> None:
    spec = load_spec("tiny-gqa")
    ctx = ConnectorContext(spec, ParallelTopology(), ConnectorConfig("multi", KVRole.BOTH),
                           (16,), extra=MultiSettings(()), rank=ParallelTopology(),
                           worker_index=0)
    worker = MultiWorker(ctx)
    worker.children = [_Sender(ctx, {1: {"a"}, 3: {"b"}}), _Sender(ctx, {2: {"a", "b"}})]
    done = []
    for step in range(1, 5):
        empty = tuple(ConnectorMetadata() for _ in worker.children)
        worker.bind_connector_metadata(MultiMetadata(empty, {"a": 2, "b": 2} if step == 1
                                                     else {}))
        done.append(worker.get_finished(frozenset())[0])
        worker.clear_connector_metadata()
    assert done == [set(), {"a"}, {"b"}, set()]
