"""What the adapter hands to vLLM's (pickling) channels carries only msgpack bytes."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest

from kvbridge.connectors.metadata_wire import MetadataWireError
from kvbridge.connectors.offloading.scheduler import OffloadMetadata
from tests.conftest import require

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def connector() -> Any:
    return require("kvbridge.integrations.vllm.connector")


def _field_types(obj: object) -> dict[str, type]:
    return {f.name: type(getattr(obj, f.name)) for f in dataclasses.fields(obj)}  # type: ignore[arg-type]


def test_step_metadata_is_bytes_and_round_trips(connector: Any) -> None:
    inner = OffloadMetadata(pools_token="t", stores=((0, 1, 2, 0, 5),))
    meta = connector.KVBridgeVllmMetadata.pack(inner, {"kvb-1": "vllm-1-abc"})
    assert _field_types(meta) == {"wire": bytes}
    assert meta.unpack() == (inner, {"kvb-1": "vllm-1-abc"})
    bad = connector.KVBridgeVllmMetadata(msgpack.packb([b"\x93", {"a": 1}]))
    with pytest.raises(MetadataWireError) as info:
        bad.unpack()
    assert info.value.field == "connector_metadata.new_ids"


def test_worker_stats_travel_as_bytes_and_aggregate(connector: Any) -> None:
    one = connector.KVBridgeStats.packed({"transfer_duration": [0.5], "bytes_transferred": [2**20],
                                          "num_descriptors": [4], "failed": 0})
    two = connector.KVBridgeStats.packed({"transfer_duration": [0.25], "bytes_transferred": [2**20],
                                          "num_descriptors": [2], "failed": 1,
                                          "nixl_xfer_duration": [0.01, 0.02]})
    assert one.data == {} and isinstance(one.wire, bytes) and one.wire
    total = one.aggregate(two)
    assert total.reduce() == {"num_transfers": 2, "num_failed": 1,
                              "median_xfer_time_ms": 500.0, "total_mb": 2.0,
                              "num_refused_params": 0}
    assert total.to_dict()["num_descriptors"] == [4, 2]
    assert total.to_dict()["nixl_xfer_duration"] == [0.01, 0.02]  # NIXL's, per READ
    worse = connector.KVBridgeStats.packed({"nixl_xfer_duration": [True]})
    with pytest.raises(MetadataWireError, match="number list"):
        worse.is_empty()
    bad = connector.KVBridgeStats.packed({"transfer_duration": ["slow"]})
    with pytest.raises(MetadataWireError) as info:
        bad.is_empty()
    assert info.value.field == "kv_connector_stats.transfer_duration"


def test_scheduler_refusals_travel_as_deltas_and_add_to_the_workers(connector: Any) -> None:
    stats = require("kvbridge.integrations.vllm.stats")
    before = {"refused_params": 2, "refused_params_seal": 2, "loads_ordered": 9}
    now = {"refused_params": 5, "refused_params_seal": 2, "refused_params_prompt": 3,
           "loads_ordered": 12}
    grown = stats.refusal_deltas(now, before)
    assert grown == {"refused_params": 3, "refused_params_prompt": 3}  # nothing else
    assert stats.refusal_deltas(now, now) == {}
    scheduler = connector.KVBridgeStats.packed({"refused": grown})
    assert not scheduler.is_empty()  # a report with refusals only still reaches vLLM
    worker = connector.KVBridgeStats.packed({"transfer_duration": [0.5], "failed": 0,
                                             "refused": {"refused_params": 1}})
    total = worker.aggregate(scheduler)
    assert total.to_dict()["refused"] == {"refused_params": 4, "refused_params_prompt": 3}
    assert total.reduce()["num_refused_params"] == 4
    for refused in ({"refused_params": -1}, {"refused_params": "3"}, [1],
                    {f"refused_params_{i}": 1 for i in range(stats.MAX_REFUSAL_COUNTERS + 1)}):
        bad = connector.KVBridgeStats.packed({"refused": refused})
        with pytest.raises(MetadataWireError) as info:
            bad.is_empty()
        assert info.value.field == "kv_connector_stats.refused"
