"""Transfer params bounded by the request they came with, against a real producer and NIXL.

A decode engine's client chooses the params it sends. Whatever their sizes, the
consumer answers in bounded time: params that do not fit the request (more
tokens than its prompt, more block ids than those tokens need, an id past any
cache) are refused before anything is allocated or looked up, the request
recomputes locally, the refusal is counted by field, and a correct request
beside it still loads its KV. An id that fits the request but not the
producer's announced cache fails that request alone, before any READ.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from kvbridge.connectors import TransferParamsError
from kvbridge.connectors.params import TransferParams, normalize_block_ids
from kvbridge.connectors.pd.scheduler import REFUSAL_COUNTERS
from kvbridge.engine.workload import check_outputs, make_requests
from kvbridge.integrations.vllm.request_view import PARAMS_KEY, parse_transfer_params
from kvbridge.layouts import load_spec
from kvbridge.layouts.limits import MAX_BLOCK_ID, MAX_PARAMS_BLOCK_IDS
from tests.conftest import require
from tests.connectors.nixl.test_faults import (
    MODEL,
    Stepper,
    _consumer,
    _prefill,
    _producer,
    _shutdown_clean,
    _worker_totals,
)


@pytest.fixture(autouse=True)
def _nixl() -> None:
    require("nixl_cu12", "NIXL (nixl-cu12)")


def _ids(params: TransferParams, region: int, ids: list[int]) -> TransferParams:
    groups = [list(g) for g in params.block_ids]
    groups[region] = ids
    return replace(params, block_ids=tuple(tuple(g) for g in groups))


def _block_tokens() -> int:
    return load_spec(MODEL).regions[0].block_size


# each row: (name, how the producer's real params are altered, field, counter)
ROWS = [
    ("huge-id", lambda p: _ids(p, 0, [*p.block_ids[0][:-1], 2**63 - 1]),
     "transfer_params.block_ids[0][{last}]", REFUSAL_COUNTERS["block_id"]),
    ("million-ids", lambda p: _ids(p, 0, list(range(1_000_000))),
     "transfer_params.block_ids[0]", REFUSAL_COUNTERS["block_ids"]),
    ("extra-ids", lambda p: _ids(p, 0, [*p.block_ids[0], *p.block_ids[0]]),
     "transfer_params.block_ids[0]", REFUSAL_COUNTERS["block_ids"]),
    ("tokens-over-prompt", lambda p: replace(p, num_tokens=p.num_tokens + 1),
     "transfer_params.num_tokens", REFUSAL_COUNTERS["num_tokens"]),
]


def test_params_past_the_request_are_refused_and_the_request_recomputes(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvbridge.connectors.pd.scheduler")
    producer = _producer()
    consumer = _consumer()
    stepper = Stepper(consumer)
    try:
        specs = make_requests(2 * len(ROWS), prompt_tokens=48, max_tokens=2, seed=33,
                              prefix="bounds")
        params = {s.request_id: _prefill(producer, s).transfer_params for s in specs}
        sched = consumer.scheduler_connector
        assert sched is not None
        for index, (name, alter, field, counter) in enumerate(ROWS):
            bad, good = specs[2 * index], specs[2 * index + 1]
            real = params[bad.request_id]
            assert real is not None
            hostile = alter(real)
            before = sched.get_stats()
            consumer.add_request(replace(bad, transfer_params=hostile))
            consumer.add_request(replace(good, transfer_params=params[good.request_id]))
            stepper.until(lambda b=bad, g=good: {b.request_id, g.request_id}
                          <= set(stepper.results), 60, f"{name}: both requests finished")
            results = [stepper.results[bad.request_id], stepper.results[good.request_id]]
            assert check_outputs(results, [bad, good]) == [], name
            assert results[0].num_external_tokens == 0, name  # refused: recomputed
            assert results[1].num_external_tokens > 0, name  # its neighbour loaded its KV
            after = sched.get_stats()
            want = field.format(last=len(real.block_ids[0]) - 1)
            assert sched.last_refused_field == want, name
            assert after[counter] == before[counter] + 1, name
            assert after["refused_params"] == before["refused_params"] + 1, name
            assert any(want in r.getMessage() for r in caplog.records), name
        # refused before any load was ordered: no worker saw a failed load
        assert stepper.failed == set()
        totals = _worker_totals(consumer)
        assert sum(t["loads_done"] for t in totals) == len(ROWS)
        assert sum(t["loads_failed"] for t in totals) == 0
    finally:
        producer.close()
        _shutdown_clean(consumer)


#: a forged id reaches the worker's own check only without a cluster secret: with one,
#: the consumer's scheduler refuses the record before any I/O (test_sealed_params.py)
@pytest.mark.plaintext
def test_an_id_past_the_producers_announced_cache_fails_its_request_only(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvbridge.connectors.pd.worker")
    producer = _producer()
    consumer = _consumer()
    stepper = Stepper(consumer)
    try:
        bad, good = make_requests(2, prompt_tokens=48, max_tokens=2, seed=34, prefix="cache")
        params = {s.request_id: _prefill(producer, s).transfer_params for s in (bad, good)}
        real = params[bad.request_id]
        assert real is not None
        # within the request's bounds (and MAX_BLOCK_ID), past the producer's cache
        hostile = _ids(real, 0, [*real.block_ids[0][:-1], MAX_BLOCK_ID])
        consumer.add_request(replace(bad, transfer_params=hostile))
        consumer.add_request(replace(good, transfer_params=params[good.request_id]))
        stepper.until(lambda: {bad.request_id, good.request_id} <= set(stepper.results), 60,
                      "both requests finished")
        assert stepper.failed == {bad.request_id}
        results = [stepper.results[bad.request_id], stepper.results[good.request_id]]
        assert check_outputs(results, [bad, good]) == []
        assert results[1].num_external_tokens > 0 and results[1].num_recomputed_tokens == 0
        totals = _worker_totals(consumer)
        assert sum(t["requests_refused"] for t in totals) == 1
        assert sum(t["sessions_dropped"] for t in totals) == 0
        failed = [r.getMessage() for r in caplog.records if bad.request_id in r.getMessage()]
        assert any("producer_block_ids[0]" in m and "announced cache" in m for m in failed), \
            failed
        sched = consumer.scheduler_connector
        assert sched is not None and sched.get_stats()["refused_params"] == 0
    finally:
        producer.close()
        _shutdown_clean(consumer)


def _wire(**changes: object) -> dict[str, object]:
    return {"version": 2, "mode": "pull", "producer_engine_id": "p", "producer_host": "h",
            "producer_port": 1, "producer_request_id": "r", "block_ids": [[0, 1, 2]],
            "producer_topology": {"tp_size": 1, "pp_size": 1, "dcp_size": 1, "pcp_size": 1},
            "num_tokens": 48, **changes}


def test_negative_ids_are_refused_at_the_edge_naming_the_field() -> None:
    with pytest.raises(TransferParamsError) as info:
        TransferParams.from_dict(_wire(block_ids=[[0, -1, 2]]))
    assert info.value.field == "transfer_params.block_ids[0][1]"
    # the vLLM edge ignores them: the request recomputes
    assert parse_transfer_params({PARAMS_KEY: _wire(block_ids=[[0, -1, 2]])}) == (None, False)


def test_a_list_past_the_global_bound_is_refused_on_its_length() -> None:
    # every id is bad too: the length, checked first, is what names the field
    oversized = [[-1] * (MAX_PARAMS_BLOCK_IDS + 1)]
    with pytest.raises(TransferParamsError) as info:
        normalize_block_ids(oversized)
    assert info.value.field == "transfer_params.block_ids[0]"
    assert "at most" in info.value.reason
    split = [[0] * (MAX_PARAMS_BLOCK_IDS // 2), [0] * (MAX_PARAMS_BLOCK_IDS // 2 + 1)]
    with pytest.raises(TransferParamsError) as info:
        normalize_block_ids(split)
    assert info.value.field == "transfer_params.block_ids[1]"
    with pytest.raises(TransferParamsError) as info:
        normalize_block_ids([[]] * 65)
    assert info.value.field == "transfer_params.block_ids"


def test_check_request_bounds_each_field() -> None:
    params = TransferParams.from_dict(_wire())
    tokens = [_block_tokens()]
    params.check_request(48, tokens)  # the prompt's own params pass
    cases = [
        (replace(params, num_tokens=49), "transfer_params.num_tokens"),
        (replace(params, block_ids=((0, 1, 2, 3, 4),)), "transfer_params.block_ids[0]"),
        (replace(params, block_ids=((0, MAX_BLOCK_ID + 1),)), "transfer_params.block_ids[0][1]"),
    ]
    for bad, field in cases:
        with pytest.raises(TransferParamsError) as info:
            bad.check_request(48, tokens)
        assert info.value.field == field
    replace(params, block_ids=((0, MAX_BLOCK_ID),)).check_request(48, tokens)
