"""Unit tests of the connector API types: params, config, aggregation, registry."""

from __future__ import annotations

import json
import warnings

import msgpack
import pytest

from kvbridge.connectors import (
    ConfigError,
    ConnectorConfig,
    ConnectorPlugin,
    ContractError,
    KVRole,
    LoadFailurePolicy,
    OutputAggregator,
    RoleError,
    TransferMode,
    TransferParams,
    TransferParamsError,
    UnknownConnectorError,
    WorkerOutput,
    block_range,
    registry,
)
from kvbridge.connectors.params import TRANSFER_PARAMS_VERSION
from kvbridge.layouts import ParallelTopology


def _params(**overrides: object) -> TransferParams:
    base: dict[str, object] = dict(
        mode=TransferMode.PULL, producer_engine_id="prefill-0", producer_host="127.0.0.1",
        producer_port=5555, producer_request_id="req-1", block_ids=((1, 2, 3), (4,)),
        producer_topology=ParallelTopology(tp_size=2), num_tokens=40)
    base.update(overrides)
    return TransferParams(**base)  # type: ignore[arg-type]


def test_transfer_params_round_trip_through_json_and_msgpack() -> None:
    params = _params(extra={"lease_s": 30.0})
    wire = params.to_dict()
    assert TransferParams.from_dict(json.loads(json.dumps(wire))) == params
    assert TransferParams.from_dict(msgpack.unpackb(msgpack.packb(wire))) == params
    assert TransferParams.from_json(params.to_json()) == params
    assert wire["version"] == TRANSFER_PARAMS_VERSION and wire["block_ids"] == [[1, 2, 3], [4]]


@pytest.mark.parametrize("field", ["mode", "producer_host", "producer_port", "block_ids",
                                   "producer_topology", "num_tokens", "producer_request_id"])
def test_missing_field_is_named(field: str) -> None:
    wire = _params().to_dict()
    del wire[field]
    with pytest.raises(TransferParamsError) as info:
        TransferParams.from_dict(wire)
    assert info.value.field == f"transfer_params.{field}"
    assert "missing" in str(info.value)


def test_unknown_version_and_field_and_bad_types_are_named() -> None:
    wire = _params().to_dict()
    with pytest.raises(TransferParamsError, match="unsupported version 3"):
        TransferParams.from_dict({**wire, "version": 3})
    with pytest.raises(TransferParamsError, match="transfer_params.remote_block_ids"):
        TransferParams.from_dict({**wire, "remote_block_ids": [1]})
    with pytest.raises(TransferParamsError, match=r"block_ids\[0\]\[1\]"):
        TransferParams.from_dict({**wire, "block_ids": [[1, -2]]})
    with pytest.raises(TransferParamsError, match="producer_port"):
        TransferParams.from_dict({**wire, "producer_port": 70000})
    with pytest.raises(TransferParamsError, match="producer_topology.tp_size"):
        TransferParams.from_dict({**wire, "producer_topology": {"tp_size": 0}})
    with pytest.raises(TransferParamsError, match="mode"):
        TransferParams.from_dict({**wire, "mode": "teleport"})
    with pytest.raises(TransferParamsError, match="extra.blob"):
        TransferParams.from_dict({**wire, "extra": {"blob": [1, 2]}})


def test_push_needs_consumer_address() -> None:
    with pytest.raises(TransferParamsError, match="consumer_engine_id"):
        _params(mode=TransferMode.PUSH, block_ids=())
    params = _params(mode=TransferMode.PUSH, block_ids=(), consumer_engine_id="decode-0",
                     consumer_host="127.0.0.1", consumer_port=6000)
    assert TransferParams.from_dict(params.to_dict()) == params


def test_config_from_dict_json_and_cli_agree() -> None:
    by_dict = ConnectorConfig.from_dict({"kv_connector": "shared_storage", "kv_role": "kv_both",
                                         "engine_id": "e1",
                                         "kv_connector_extra_config": {"path": "/tmp/x"}})
    by_json = ConnectorConfig.from_json(json.dumps({"connector": "shared_storage",
                                                    "role": "both", "engine_id": "e1",
                                                    "extra": {"path": "/tmp/x"}}))
    by_cli = ConnectorConfig.from_cli(["--kv-connector", "shared_storage", "--kv-role",
                                       "kv_both", "--engine-id", "e1",
                                       "--kv-config", '{"path": "/tmp/x"}'])
    assert by_dict == by_json == by_cli
    assert by_dict.role is KVRole.BOTH and by_dict.load_failure_policy is LoadFailurePolicy.RECOMPUTE
    assert ConnectorConfig.from_dict(by_dict.to_dict()) == by_dict


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        ConnectorConfig.from_dict({"kv_connector": "x", "kv_role": "decoder"})
    assert info.value.field == "kv_role" and "kv_consumer" in str(info.value)
    with pytest.raises(ConfigError, match="kv_role: missing"):
        ConnectorConfig.from_dict({"kv_connector": "x"})
    with pytest.raises(ConfigError, match="kv_buffer_size"):
        ConnectorConfig.from_dict({"kv_connector": "x", "kv_role": "kv_both",
                                   "kv_buffer_size": 1})
    with pytest.raises(ConfigError, match="given twice"):
        ConnectorConfig.from_dict({"kv_connector": "x", "connector": "y", "kv_role": "kv_both"})
    with pytest.raises(ConfigError, match="kv_config: invalid JSON"):
        ConnectorConfig.from_cli(["--kv-connector", "x", "--kv-role", "kv_both",
                                  "--kv-config", "{bad"])
    with pytest.raises(ConfigError, match="kv_load_failure_policy"):
        ConnectorConfig.from_dict({"kv_connector": "x", "kv_role": "kv_both",
                                   "kv_load_failure_policy": "retry"})


def test_aggregator_finishes_only_when_every_rank_reported() -> None:
    agg = OutputAggregator(num_workers=2)
    out = agg.aggregate([WorkerOutput(0, finished_recving=frozenset({"a", "b"}),
                                      finished_sending=frozenset({"s"})),
                         WorkerOutput(1, finished_recving=frozenset({"a"}))])
    assert out.finished_recving == {"a"} and not out.finished_sending
    assert agg.pending() == {"sending": {"s": 1}, "recving": {"b": 1}}
    out = agg.aggregate([WorkerOutput(0), WorkerOutput(1, failed_recving=frozenset({"b"}),
                                                       invalid_block_ids=frozenset({(0, 7)}),
                                                       finished_sending=frozenset({"s"}))])
    assert out.finished_recving == {"b"} and out.failed_recving == {"b"}
    assert out.finished_sending == {"s"} and out.invalid_block_ids == {(0, 7)}
    assert agg.pending() == {"sending": {}, "recving": {}}
    # a duplicate report from one rank does not count twice
    agg.aggregate([WorkerOutput(0, finished_recving=frozenset({"c"}))])
    out = agg.aggregate([WorkerOutput(0, finished_recving=frozenset({"c"}))])
    assert not out.finished_recving


def test_failure_on_one_rank_fails_the_request_even_if_reported_earlier() -> None:
    agg = OutputAggregator(num_workers=2)
    first = agg.aggregate([WorkerOutput(0, failed_recving=frozenset({"r"}))])
    assert not first.finished_recving
    second = agg.aggregate([WorkerOutput(1, finished_recving=frozenset({"r"}))])
    assert second.failed_recving == {"r"} and second.finished_recving == {"r"}


def test_worker_output_failed_is_finished_and_refs_are_checked() -> None:
    out = WorkerOutput(0, failed_recving=frozenset({"x"}))
    assert out.finished_recving == {"x"}
    with pytest.raises(ContractError, match="invalid_block_ids"):
        WorkerOutput(0, invalid_block_ids=frozenset({5}))  # type: ignore[arg-type]


def test_block_range() -> None:
    assert list(block_range(16, 0, 33)) == [0, 1, 2]
    assert list(block_range(16, 16, 32)) == [1]
    assert list(block_range(32, 40, 40)) == []


class _PDPlugin(ConnectorPlugin):
    name = "test-pd"
    supported_roles = frozenset({KVRole.PRODUCER, KVRole.CONSUMER, KVRole.BOTH})
    deprecated_roles = frozenset({KVRole.BOTH})

    @classmethod
    def create_scheduler(cls, ctx):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    @classmethod
    def create_worker(cls, ctx):  # type: ignore[no-untyped-def]
        raise NotImplementedError


class _ProducerOnly(_PDPlugin):
    name = "test-producer-only"
    supported_roles = frozenset({KVRole.PRODUCER})


def test_registry_unknown_name_lists_available() -> None:
    registry.register(_PDPlugin)
    try:
        with pytest.raises(UnknownConnectorError) as info:
            registry.load("no-such-connector")
        assert "test-pd" in str(info.value) and info.value.field == "kv_connector"
        assert registry.load("test-pd") is _PDPlugin
        assert registry.load(f"{__name__}:_PDPlugin") is _PDPlugin
    finally:
        registry.unregister("test-pd")
    with pytest.raises(ConfigError, match="cannot import module"):
        registry.load("no_such_module_xyz:Plugin")
    with pytest.raises(ConfigError, match="not a ConnectorPlugin"):
        registry.load("json:dumps")


def test_resolve_checks_role_and_extra_before_anything_is_built() -> None:
    registry.register(_PDPlugin)
    registry.register(_ProducerOnly)
    try:
        with pytest.warns(DeprecationWarning, match="kv_producer"):
            resolved = registry.resolve(ConnectorConfig("test-pd", KVRole.BOTH))
        assert resolved.plugin is _PDPlugin and resolved.extra is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            registry.resolve(ConnectorConfig("test-pd", KVRole.CONSUMER))
        with pytest.raises(RoleError, match="kv_consumer"):
            registry.resolve(ConnectorConfig("test-producer-only", KVRole.CONSUMER))
        with pytest.raises(ConfigError, match="kv_connector_extra_config.foo"):
            registry.resolve(ConnectorConfig("test-pd", KVRole.CONSUMER, extra={"foo": 1}))
    finally:
        registry.unregister("test-pd")
        registry.unregister("test-producer-only")


def test_context_role_check_and_block_tokens() -> None:
    from kvbridge.connectors import ConnectorContext
    from kvbridge.layouts import load_spec

    spec = load_spec("tiny-hybrid")
    ctx = ConnectorContext(spec=spec, topology=ParallelTopology(tp_size=2, dcp_size=2),
                           config=ConnectorConfig("x", KVRole.CONSUMER), num_blocks=(8, 8))
    assert ctx.block_tokens(0) == 32 and ctx.block_tokens(1) == 16  # token-sharded vs not
    assert ctx.num_workers == 2 and not ctx.is_worker
    ctx.require_role("load", KVRole.CONSUMER, KVRole.BOTH)
    with pytest.raises(RoleError, match="save needs role kv_producer; this engine is "
                                        "kv_consumer"):
        ctx.require_role("save", KVRole.PRODUCER)
    with pytest.raises(ContractError, match="worker halves only"):
        ctx.rank_shapes()


def test_worker_collect_output_calls_reporting_hooks_in_order() -> None:
    from kvbridge.connectors import ConnectorContext, WorkerConnector
    from kvbridge.events import BlockRemoved
    from kvbridge.layouts import load_spec

    calls: list[str] = []

    class W(WorkerConnector):
        def register_kv_caches(self, caches):  # type: ignore[no-untyped-def]
            calls.append("register")

        def start_load_kv(self) -> None: ...
        def wait_for_layer_load(self, layer_id: int) -> None: ...
        def save_kv_layer(self, layer_id, kv_layer) -> None: ...  # type: ignore[no-untyped-def]
        def wait_for_save(self) -> None: ...

        def get_finished(self, finished_request_ids):  # type: ignore[no-untyped-def]
            calls.append("get_finished")
            return {"s"}, {"r"}

        def get_failed_recving(self) -> set[str]:
            calls.append("failed")
            return {"f"}

        def get_block_ids_with_load_errors(self):  # type: ignore[no-untyped-def]
            calls.append("errors")
            return {(0, 3)}

        def get_stats(self) -> dict[str, int | float]:
            calls.append("stats")
            return {"n": 1}

        def shutdown(self) -> None: ...

    ctx = ConnectorContext(spec=load_spec("tiny-gqa"), topology=ParallelTopology(tp_size=2),
                           config=ConnectorConfig("x", KVRole.BOTH), num_blocks=(4,),
                           rank=ParallelTopology(tp_size=2, tp_rank=1), worker_index=1)
    worker = W(ctx)
    with pytest.raises(ContractError, match="no metadata bound"):
        _ = worker.connector_metadata
    ctx.events.append(BlockRemoved(block_hashes=(b"h",)))
    out = worker.collect_output(frozenset())
    assert calls == ["get_finished", "failed", "errors", "stats"]
    assert out.worker_index == 1 and out.finished_recving == {"r", "f"}
    assert out.failed_recving == {"f"} and out.invalid_block_ids == {(0, 3)}
    assert out.events == (BlockRemoved(block_hashes=(b"h",)),) and out.stats == {"n": 1}
