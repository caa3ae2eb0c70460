"""The reference engine: colocated runs, prefix caching, preemption, abort, bad input,
engine-side bounds, and the hook order it drives."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from kvbridge.connectors import (
    BlockIds,
    BlockRef,
    ConfigError,
    ConnectorConfig,
    ConnectorContext,
    ConnectorMetadata,
    ConnectorPlugin,
    ConnectorRequest,
    KVCaches,
    KVRole,
    RoleError,
    SchedulerConnector,
    SchedulerStep,
    TransferMode,
    TransferParams,
    UnknownConnectorError,
    WorkerConnector,
    registry,
)
from kvbridge.engine import Engine, EngineConfig, RequestSpec, RequestState, reference_output
from kvbridge.engine.conformance import check_hook_order
from kvbridge.engine.core import HookCall
from kvbridge.engine.workload import make_requests, run_workload
from kvbridge.layouts import ParallelTopology, load_spec


@pytest.mark.parametrize(("preset", "topo"), [
    ("tiny-gqa", ParallelTopology()),
    ("tiny-gqa", ParallelTopology(tp_size=2, pp_size=2)),
    ("tiny-hybrid", ParallelTopology(tp_size=2, dcp_size=2)),
    ("tiny-mla", ParallelTopology(tp_size=4, dcp_size=2)),
])
def test_colocated_workload_matches_reference(preset: str, topo: ParallelTopology) -> None:
    requests = make_requests(6, prompt_tokens=70, shared_prefix_tokens=40, max_tokens=5)
    config = EngineConfig(load_spec(preset), topo, num_blocks=64, max_num_batched_tokens=96)
    engine = Engine(config)
    result = run_workload(requests, engine=engine, shutdown=False)
    assert result.failed_requests == 0 and not result.wrong_outputs
    stats = engine.stats()
    assert stats["local_hit_tokens"] > 0  # the shared prefix hit the prefix cache
    assert stats["tokens_computed"] > 0
    assert engine.idle_problems() == []
    engine.shutdown()


def test_live_request_kv_verifies_mid_run() -> None:
    engine = Engine(EngineConfig(load_spec("tiny-hybrid"), ParallelTopology(tp_size=2),
                                 num_blocks=32))
    spec = make_requests(1, prompt_tokens=50, max_tokens=8)[0]
    engine.add_request(spec)
    for _ in range(3):
        engine.step()
    req = engine.requests[spec.request_id]
    verified, mismatched = engine.verify_request_blocks(spec.request_id, 0,
                                                        req.num_computed_tokens)
    assert verified > 0 and mismatched == 0
    engine.run_until_done()


def test_preemption_under_block_pressure_keeps_outputs_right() -> None:
    requests = make_requests(6, prompt_tokens=40, max_tokens=30)
    engine = Engine(EngineConfig(load_spec("tiny-gqa"), num_blocks=12,
                                 max_num_batched_tokens=64))
    result = run_workload(requests, engine=engine, shutdown=False)
    assert engine.stats()["preemptions"] > 0
    assert result.failed_requests == 0 and not result.wrong_outputs
    assert engine.idle_problems() == []


def test_abort_waiting_and_running_requests() -> None:
    engine = Engine(EngineConfig(load_spec("tiny-gqa"), num_blocks=64))
    requests = make_requests(3, prompt_tokens=40, max_tokens=20)
    for spec in requests:
        engine.add_request(spec)
    assert engine.abort(requests[0].request_id)  # before scheduling
    engine.step()
    engine.step()
    assert engine.requests[requests[1].request_id].state is RequestState.RUNNING
    assert engine.abort(requests[1].request_id)
    assert not engine.abort(requests[1].request_id)  # already finished
    assert not engine.abort("nope")
    results = {r.request_id: r for r in engine.run_until_done()}
    assert results[requests[0].request_id].state is RequestState.FINISHED_ABORTED
    assert results[requests[1].request_id].state is RequestState.FINISHED_ABORTED
    assert list(results[requests[2].request_id].output) == reference_output(
        requests[2].prompt, 20)
    assert engine.idle_problems() == []


def test_bad_input_is_refused_before_anything_changes(tmp_path: Path) -> None:
    engine = Engine(EngineConfig(load_spec("tiny-gqa")))
    spec = RequestSpec("a", (1, 2, 3))
    engine.add_request(spec)
    with pytest.raises(ConfigError, match="duplicate request id"):
        engine.add_request(spec)
    params = TransferParams(mode=TransferMode.PULL, producer_engine_id="p",
                            producer_host="127.0.0.1", producer_port=1,
                            producer_request_id="x", block_ids=((1,),),
                            producer_topology=ParallelTopology(), num_tokens=3)
    with pytest.raises(RoleError, match="transfer_params"):
        engine.add_request(RequestSpec("b", (1, 2, 3), transfer_params=params))
    with pytest.raises(RoleError, match="remote_decode"):
        engine.add_request(RequestSpec("c", (1, 2, 3), remote_decode=True))
    assert list(engine.requests) == ["a"]
    with pytest.raises(UnknownConnectorError, match="shared_storage"):
        Engine(EngineConfig(load_spec("tiny-gqa"),
                            connector=ConnectorConfig("no-such", KVRole.BOTH)))
    with pytest.raises(ConfigError, match="path"):
        Engine(EngineConfig(load_spec("tiny-gqa"),
                            connector=ConnectorConfig("shared_storage", KVRole.BOTH)))
    consumer = Engine(EngineConfig(load_spec("tiny-gqa"), connector=ConnectorConfig(
        "shared_storage", KVRole.CONSUMER, extra={"path": str(tmp_path)})))
    with pytest.raises(RoleError, match="kv_producer"):
        consumer.add_request(RequestSpec("d", (1, 2, 3), remote_decode=True))
    with pytest.raises(Exception, match="block_ids"):
        consumer.add_request(RequestSpec("e", (1, 2, 3), transfer_params=TransferParams(
            mode=TransferMode.PULL, producer_engine_id="p", producer_host="h",
            producer_port=1, producer_request_id="x", block_ids=((1,), (2,)),
            producer_topology=ParallelTopology(), num_tokens=3)))
    consumer.shutdown()


# --- a deliberately misbehaving connector, to check the engine's own bounds ---------------

class _Meta(ConnectorMetadata):
    def __init__(self, loads: Mapping[str, BlockIds]) -> None:
        self.loads = dict(loads)


class _Sched(SchedulerConnector):
    """Claims 32 external tokens for every request; loads run async."""

    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        self.loads: dict[str, BlockIds] = {}

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return max(0, 32 - num_computed_tokens), True

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        if num_external_tokens:
            self.loads[request.request_id] = block_ids

    def build_connector_meta(self, step: SchedulerStep) -> _Meta:
        meta = _Meta(self.loads)
        self.loads = {}
        return meta

    def request_finished(self, request: ConnectorRequest,
                         block_ids: BlockIds) -> tuple[bool, TransferParams | None]:
        return False, None


class _Worker(WorkerConnector):
    """``behaviour``: "fail_unnamed" reports every load failed without block ids;
    "never" never reports the load at all."""

    behaviour = "fail_unnamed"

    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        self.pending: set[str] = set()

    def register_kv_caches(self, caches: KVCaches) -> None:
        self.caches = caches

    def start_load_kv(self) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, _Meta)
        self.pending |= set(meta.loads)

    def wait_for_layer_load(self, layer_id: int) -> None:
        return None

    def save_kv_layer(self, layer_id: int, kv_layer: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_request_ids: frozenset[str]) -> tuple[set[str], set[str]]:
        if self.behaviour == "never":
            return set(), set()
        return set(), set(self.pending)

    def get_failed_recving(self) -> set[str]:
        if self.behaviour == "never":
            return set()
        failed, self.pending = self.pending, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[BlockRef]:
        return set()

    def shutdown(self) -> None:
        return None


class _Plugin(ConnectorPlugin):
    name = "test-misbehaving"

    @classmethod
    def create_scheduler(cls, ctx: ConnectorContext) -> SchedulerConnector:
        return _Sched(ctx)

    @classmethod
    def create_worker(cls, ctx: ConnectorContext) -> WorkerConnector:
        return _Worker(ctx)


@pytest.fixture
def misbehaving() -> Any:
    registry.register(_Plugin)
    yield _Worker
    _Worker.behaviour = "fail_unnamed"
    registry.unregister(_Plugin.name)


def test_failed_receive_without_block_ids_recomputes_everything(misbehaving: Any) -> None:
    config = EngineConfig(load_spec("tiny-gqa"), ParallelTopology(tp_size=2), num_blocks=32,
                          connector=ConnectorConfig(_Plugin.name, KVRole.CONSUMER),
                          record_hooks=True)
    engine = Engine(config)
    requests = make_requests(2, prompt_tokens=40, max_tokens=3)
    result = run_workload(requests, engine=engine, shutdown=False)
    assert result.failed_requests == 0 and not result.wrong_outputs
    assert all(r.num_recomputed_tokens == 32 and r.num_external_tokens == 0
               for r in result.results)
    assert engine.stats()["failed_loads"] == 2
    assert engine.idle_problems() == []
    engine.shutdown()
    assert check_hook_order(engine) == []


def test_connector_that_never_answers_is_bounded_by_the_engine(
        misbehaving: Any, caplog: pytest.LogCaptureFixture) -> None:
    misbehaving.behaviour = "never"
    config = EngineConfig(load_spec("tiny-gqa"), num_blocks=32,
                          connector=ConnectorConfig(_Plugin.name, KVRole.CONSUMER),
                          remote_kv_timeout_s=0.05)
    engine = Engine(config)
    spec = make_requests(1, prompt_tokens=40, max_tokens=2)[0]
    with caplog.at_level(logging.ERROR):
        results = run_workload([spec], engine=engine, shutdown=False, timeout_s=30).results
    assert results[0].state is RequestState.FINISHED_LENGTH
    assert list(results[0].output) == reference_output(spec.prompt, 2)
    stats = engine.stats()
    assert stats["remote_kv_timeouts"] == 1 and stats["quarantined_blocks"] == 2
    assert "never reported it" in caplog.text
    # quarantined blocks stay out of circulation; the engine says why it is not clean
    assert any("timeouts" in p for p in engine.idle_problems())
    engine.shutdown()


def test_hook_order_checker_flags_violations() -> None:
    engine = Engine(EngineConfig(load_spec("tiny-gqa")))
    engine.hook_log = [
        HookCall(1, "scheduler", None, "update_state_after_alloc", "r1"),
        HookCall(1, "scheduler", None, "build_connector_meta", None),
        HookCall(1, "scheduler", None, "request_finished", "r1"),
        HookCall(2, "scheduler", None, "build_connector_meta", None),
        HookCall(2, "scheduler", None, "build_connector_meta", None),
        HookCall(2, "scheduler", None, "request_finished", "r1"),
    ]
    problems = check_hook_order(engine)
    assert any("without a lookup" in p for p in problems)
    assert any("build_connector_meta called 2 times" in p for p in problems)
    assert any("request_finished twice" in p for p in problems)


def test_abort_while_receiving_holds_blocks_until_the_receive_ends(misbehaving: Any) -> None:
    misbehaving.behaviour = "never"
    engine = Engine(EngineConfig(load_spec("tiny-gqa"), num_blocks=32,
                                 connector=ConnectorConfig(_Plugin.name, KVRole.CONSUMER),
                                 remote_kv_timeout_s=0.2))
    spec = make_requests(1, prompt_tokens=40, max_tokens=2)[0]
    engine.add_request(spec)
    engine.step()
    assert engine.requests[spec.request_id].state is RequestState.WAITING_FOR_REMOTE_KVS
    assert engine.abort(spec.request_id)
    assert engine.pop_results()[0].state is RequestState.FINISHED_ABORTED
    # the blocks a transfer may still write are not reused while it could
    assert engine.pools[0].num_used == 2 and engine.has_pending_transfers()
    engine.run_until_done(timeout_s=10)
    assert not engine.has_work()
    stats = engine.stats()
    assert stats["remote_kv_timeouts"] == 1 and stats["quarantined_blocks"] == 2
    engine.shutdown()


class _AsksForever(_Sched):
    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return None, False


class _AsksForeverPlugin(_Plugin):
    name = "test-asks-forever"

    @classmethod
    def create_scheduler(cls, ctx: ConnectorContext) -> SchedulerConnector:
        return _AsksForever(ctx)


def test_lookup_that_never_answers_becomes_a_miss() -> None:
    registry.register(_AsksForeverPlugin)
    try:
        engine = Engine(EngineConfig(load_spec("tiny-gqa"), num_blocks=32, connector=(
            ConnectorConfig(_AsksForeverPlugin.name, KVRole.CONSUMER)),
            remote_kv_timeout_s=0.1))
        spec = make_requests(1, prompt_tokens=40, max_tokens=2)[0]
        results = run_workload([spec], engine=engine, shutdown=False, timeout_s=30).results
        assert list(results[0].output) == reference_output(spec.prompt, 2)
        stats = engine.stats()
        assert stats["lookup_timeouts"] == 1 and stats["lookups_deferred"] >= 1
        assert any("lookup timeouts" in p for p in engine.idle_problems())
        engine.shutdown()
    finally:
        registry.unregister(_AsksForeverPlugin.name)
