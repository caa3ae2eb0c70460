"""``front_door.check_kv_transfer_params``: what a kvbridge-enabled vLLM's API server refuses.

Pure logic, in the default suite. The same check behind real vLLM (HTTP 400
from the API server, the engine untouched) is in
``tests/integrations/vllm/test_hostile_params.py``.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest

from kvbridge.connectors import TransferParams
from kvbridge.connectors.params import TRANSFER_PARAMS_VERSION
from kvbridge.integrations.vllm.front_door import (
    MAX_EXTRA_CHARS,
    MAX_EXTRA_ENTRIES,
    MAX_PARAMS_DEPTH,
    FrontDoorError,
    check_kv_transfer_params,
    check_sampling_params,
)
from kvbridge.layouts.limits import MAX_PARAMS_BLOCK_IDS


def record(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "version": TRANSFER_PARAMS_VERSION, "mode": "pull", "producer_engine_id": "prod", "producer_host": "127.0.0.1",
        "producer_port": 7100, "producer_request_id": "req-1", "block_ids": [[3, 4, 5, 6]],
        "producer_topology": {"tp_size": 1, "pp_size": 1, "dcp_size": 1, "pcp_size": 1},
        "num_tokens": 100,
    }
    base.update(overrides)
    return base


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"x": 1}
    for _ in range(depth - 1):
        value = {"x": value}
    return value


def refused(raw: object) -> FrontDoorError:
    with pytest.raises(FrontDoorError) as info:
        check_kv_transfer_params(raw)
    assert isinstance(info.value, ValueError)  # what vLLM's admission hook turns into 400
    return info.value


def test_a_well_formed_record_and_foreign_params_pass() -> None:
    params = check_kv_transfer_params({"do_remote_prefill": True, "kvbridge": record()})
    assert isinstance(params, TransferParams) and params.block_ids == ((3, 4, 5, 6),)
    # vLLM's own connectors' params (no kvbridge record) are only depth-checked
    assert check_kv_transfer_params({"do_remote_decode": True, "remote_block_ids": [[1, 2]],
                                     "remote_engine_id": "e"}) is None
    assert check_kv_transfer_params(None) is None
    assert check_sampling_params(SimpleNamespace(extra_args=None)) is None


@pytest.mark.parametrize(("raw", "field"), [
    ([1, 2], "kv_transfer_params"),
    ({"kvbridge": [1, 2]}, "kv_transfer_params.kvbridge"),
    ({"kvbridge": "x" * 100}, "kv_transfer_params.kvbridge"),
    ({"kvbridge": record(version=99)}, "kv_transfer_params.kvbridge.version"),
    ({"kvbridge": record(version=1)}, "kv_transfer_params.kvbridge.version"),
    ({"kvbridge": record(num_tokens=-1)}, "kv_transfer_params.kvbridge.num_tokens"),
    ({"kvbridge": record(producer_topology={"tp_size": 2**40, "pp_size": 1, "dcp_size": 1,
                                            "pcp_size": 1})},
     "kv_transfer_params.kvbridge.producer_topology.tp_size"),
    ({"kvbridge": record(block_ids=[[2**63 - 1]])}, "kv_transfer_params.kvbridge.block_ids[0][0]"),
    ({"kvbridge": record(block_ids=[list(range(1_000_000))], num_tokens=96)},
     "kv_transfer_params.kvbridge.block_ids[0]"),
    ({"kvbridge": record(block_ids=[[0] * (MAX_PARAMS_BLOCK_IDS + 1)],
                         num_tokens=MAX_PARAMS_BLOCK_IDS + 1)},
     "kv_transfer_params.kvbridge.block_ids[0]"),
    ({"kvbridge": record(extra=nested(500))}, "kv_transfer_params.kvbridge.extra.x"),
    ({"kvbridge": record(extra={"blob": "x" * (MAX_EXTRA_CHARS + 1)})},
     "kv_transfer_params.kvbridge.extra"),
    ({"kvbridge": record(extra={f"k{i}": i for i in range(MAX_EXTRA_ENTRIES + 1)})},
     "kv_transfer_params.kvbridge.extra"),
    ({"kvbridge": record(surprise=1)}, "kv_transfer_params.kvbridge.surprise"),
])
def test_a_malformed_or_oversized_record_is_refused_naming_the_field(raw: object,
                                                                      field: str) -> None:
    error = refused(raw)
    assert error.field == field, str(error)
    assert str(error).startswith(field + ": ")


def test_nesting_past_the_bound_is_refused_anywhere_without_recursion() -> None:
    # deep enough that a recursive walk would die of RecursionError itself
    deep = nested(sys.getrecursionlimit() * 2)
    error = refused({"do_remote_prefill": False, "extra": deep})
    assert error.field == "kv_transfer_params.extra.x.x"  # the path stops growing at 4 levels
    assert "nested deeper than 16" in error.reason
    listed: list[Any] = [1]
    for _ in range(MAX_PARAMS_DEPTH):
        listed = [listed]
    assert refused({"other": listed}).field.startswith("kv_transfer_params.other[0]")
    # the bound itself passes: the whole params dict is level 1
    check_kv_transfer_params({"ok": nested(MAX_PARAMS_DEPTH - 1)})
    refused({"bad": nested(MAX_PARAMS_DEPTH)})


def test_sampling_params_are_read_where_vllm_keeps_them() -> None:
    bad = SimpleNamespace(extra_args={"kv_transfer_params": {"kvbridge": record(version=99)}})
    with pytest.raises(FrontDoorError, match=r"kvbridge\.version: unsupported version 99"):
        check_sampling_params(bad)
    good = SimpleNamespace(extra_args={"kv_transfer_params": {"kvbridge": record()}})
    assert check_sampling_params(good) is not None
