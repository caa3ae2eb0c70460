"""Sealed, prompt-bound transfer params against real engines and real NIXL.

An API client of the consumer chooses the params a request carries. Each row
changes a producer's real params the way such a client could, and checks that
the request's answer is its own (the reference engine checks every KV byte it
holds against its own prompt: ``mismatched_bytes``), that the refusal is
counted with its reason, and that the neighbour loading its own KV beside it is
unharmed. Refusals on the consumer's scheduler happen before any load is
ordered; what only the producer can tell (without a cluster secret) fails the
load closed: its blocks are load errors and recompute.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvbridge.auth import new_secret
from kvbridge.connectors import KVRole
from kvbridge.connectors.params import TransferParams
from kvbridge.connectors.pd.scheduler import REFUSAL_COUNTERS
from kvbridge.connectors.sealing import prompt_chain
from kvbridge.engine.harness import EngineProcess
from kvbridge.engine.request import RequestSpec
from kvbridge.engine.workload import check_outputs, make_requests
from kvbridge.layouts import ParallelTopology, load_spec
from tests.conftest import require
from tests.connectors.nixl.nixl_helpers import nixl_config
from tests.connectors.nixl.test_faults import (
    MODEL,
    Stepper,
    _check_output,
    _consumer,
    _prefill,
    _producer,
    _shutdown_clean,
    _wait_producer,
    _worker_totals,
)
from tests.connectors.nixl.test_hostile_peers import PUSH, _results


@pytest.fixture(autouse=True)
def _nixl() -> None:
    require("nixl_cu12", "NIXL (nixl-cu12)")


def _other_prompt(p: TransferParams, other: TransferParams, _spec: RequestSpec) -> TransferParams:
    return other


def _unsealed(p: TransferParams, _other: TransferParams, _spec: RequestSpec) -> TransferParams:
    return replace(p, seal=None)


def _engine_key(p: TransferParams, _other: TransferParams, _spec: RequestSpec) -> TransferParams:
    return replace(p, seal_key="engine")


def _other_blocks(p: TransferParams, other: TransferParams, _spec: RequestSpec
                  ) -> TransferParams:
    """This prompt's record naming another held request's blocks (a shift in range)."""
    return replace(p, block_ids=other.block_ids)


def _forged_chain(p: TransferParams, other: TransferParams, spec: RequestSpec
                  ) -> TransferParams:
    """Another request's hold, with this prompt's chain written in (anyone can compute
    a chain: it is a hash of the tokens)."""
    return replace(other, prompt_chain=prompt_chain(spec.prompt, other.num_tokens).hex())


#: (name, alteration, refused on the consumer's scheduler under field (None: by the
#: producer, the load fails closed)) -- without a cluster secret
ROWS_ENGINE_KEY = [
    ("other-prompt", _other_prompt, "transfer_params.prompt_chain"),
    ("unsealed", _unsealed, "transfer_params.seal"),
    ("other-blocks", _other_blocks, None),
    ("forged-chain", _forged_chain, None),
]
#: with a cluster secret every forged record is refused before any load is ordered
ROWS_CLUSTER = [
    ("other-prompt", _other_prompt, "transfer_params.prompt_chain"),  # a true seal
    ("unsealed", _unsealed, "transfer_params.seal"),
    ("engine-key", _engine_key, "transfer_params.seal_key"),
    ("other-blocks", _other_blocks, "transfer_params.seal"),
    ("forged-chain", _forged_chain, "transfer_params.seal"),
]


def _counter(field: str) -> str:
    name = field.removeprefix("transfer_params.")
    return REFUSAL_COUNTERS["seal" if name.startswith("seal") else name]


@pytest.mark.parametrize("cluster", [False, True], ids=["engine-key", "cluster-secret"])
def test_params_not_sealed_for_this_prompt_are_never_served(
        cluster: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # each case chooses its key itself (``make test-auth`` sets a secret for everything)
    monkeypatch.delenv("KVBRIDGE_SECRET", raising=False)
    monkeypatch.delenv("KVBRIDGE_SECRET_FILE", raising=False)
    extra: dict[str, Any] = {}
    if cluster:
        secret_file = tmp_path / "cluster.secret"
        new_secret(secret_file)
        extra["auth_secret_file"] = str(secret_file)
    rows = ROWS_CLUSTER if cluster else ROWS_ENGINE_KEY
    producer = _producer(**extra)
    consumer = _consumer(**extra)
    stepper = Stepper(consumer)
    try:
        specs = make_requests(3 * len(rows), prompt_tokens=48, max_tokens=2, seed=51,
                              prefix=f"sealed-{int(cluster)}")
        sched = consumer.scheduler_connector
        assert sched is not None
        failed_closed = 0
        for index, (name, alter, field) in enumerate(rows):
            # prefilled per row: the producer's 32 blocks hold a few requests at once
            bad, good, victim = specs[3 * index:3 * index + 3]
            params = {s.request_id: _prefill(producer, s).transfer_params
                      for s in (bad, good, victim)}
            assert all(p is not None and p.seal_key == ("cluster" if cluster else "engine")
                       for p in params.values())
            real, other = params[bad.request_id], params[victim.request_id]
            assert real is not None and other is not None
            before = sched.get_stats()
            consumer.add_request(replace(bad, transfer_params=alter(real, other, bad)))
            consumer.add_request(replace(good, transfer_params=params[good.request_id]))
            stepper.until(lambda b=bad, g=good: {b.request_id, g.request_id}
                          <= set(stepper.results), 60, f"{name}: both requests finished")
            results = [stepper.results[bad.request_id], stepper.results[good.request_id]]
            # every KV byte each engine holds is checked against its own prompt
            assert check_outputs(results, [bad, good]) == [], name
            assert results[0].mismatched_bytes == 0, name
            assert results[1].num_external_tokens > 0, name  # its neighbour loaded its KV
            after = sched.get_stats()
            if field is not None:  # refused before anything was allocated or read
                assert results[0].num_external_tokens == 0, name
                assert sched.last_refused_field == field, name
                assert after[_counter(field)] == before[_counter(field)] + 1, name
                assert bad.request_id not in stepper.failed, name
            else:  # the producer refused the record: the load failed closed
                failed_closed += 1
                assert bad.request_id in stepper.failed, name
                assert results[0].num_recomputed_tokens > 0, name
                assert after["refused_params"] == before["refused_params"], name
                _wait_producer(producer, "holds_refused", failed_closed, 20)
            # the victim's hold was not claimed by the forged record: still its own
            consumer.add_request(replace(victim, transfer_params=other))
            stepper.until(lambda v=victim: v.request_id in stepper.results, 60,
                          f"{name}: the victim's own load")
            loaded = stepper.results[victim.request_id]
            _check_output(loaded, victim)
            assert loaded.num_external_tokens > 0 and loaded.num_recomputed_tokens == 0, name
        totals = _worker_totals(consumer)
        assert sum(t["loads_done"] for t in totals) == 2 * len(rows)
    finally:
        producer.close()
        _shutdown_clean(consumer)


def test_a_hold_is_loaded_once() -> None:
    """The same prompt sent twice with one request's params: the second request is
    refused on the consumer (a hold is used once) and recomputes; a second consumer
    engine replaying them is refused by the producer (the hold is the first one's)."""
    producer = _producer()
    consumer = _consumer()
    other = _consumer()
    stepper, other_stepper = Stepper(consumer), Stepper(other)
    try:
        (spec,) = make_requests(1, prompt_tokens=48, max_tokens=2, seed=52, prefix="once")
        params = _prefill(producer, spec).transfer_params
        consumer.add_request(replace(spec, transfer_params=params))
        stepper.until(lambda: spec.request_id in stepper.results, 60, "the first load")
        assert stepper.results[spec.request_id].num_external_tokens > 0
        again = replace(spec, request_id="once-again", transfer_params=params)
        consumer.add_request(again)
        stepper.until(lambda: again.request_id in stepper.results, 60, "the replay")
        _check_output(stepper.results[again.request_id], again)
        assert stepper.results[again.request_id].num_external_tokens == 0
        sched = consumer.scheduler_connector
        assert sched is not None and sched.get_stats()["refused_params_replay"] == 1
        assert sched.last_refused_field == "transfer_params.hold_id"
        # another consumer engine: it cannot know the hold was used; the producer can
        other.add_request(replace(spec, request_id="once-elsewhere", transfer_params=params))
        other_stepper.until(lambda: "once-elsewhere" in other_stepper.results, 60,
                            "the replay on another engine")
        replayed = other_stepper.results["once-elsewhere"]
        _check_output(replayed, spec)
        assert replayed.mismatched_bytes == 0 and replayed.num_recomputed_tokens > 0
        assert other_stepper.failed == {"once-elsewhere"}
    finally:
        producer.close()
        _shutdown_clean(consumer)
        _shutdown_clean(other)


def test_push_writes_only_to_a_register_of_the_same_prompt() -> None:
    """Push params name a producer request. A consumer request of another prompt naming
    it first gets nothing written (the producer compares the register's prompt chain
    with its own, before any WRITE) and recomputes; the request the push was for is
    then refused on the consumer (that producer request is already another's) and
    recomputes too: no request decodes on KV of another prompt."""
    producer = EngineProcess(nixl_config(MODEL, KVRole.PRODUCER, ParallelTopology(tp_size=1),
                                         PUSH), name="producer", call_timeout_s=20)
    consumer = EngineProcess(nixl_config(MODEL, KVRole.CONSUMER, ParallelTopology(tp_size=1),
                                         PUSH), name="consumer", call_timeout_s=20)
    try:
        assert producer.endpoint is not None and consumer.endpoint is not None
        mine, theirs = make_requests(2, prompt_tokens=48, max_tokens=2, seed=53, prefix="pc")
        spec_fp = load_spec(MODEL).fingerprint()

        def push_params(request: RequestSpec, producer_rid: str) -> TransferParams:
            assert producer.endpoint is not None and consumer.endpoint is not None
            return TransferParams(
                mode=PUSH, producer_engine_id=producer.engine_id,
                producer_host=producer.endpoint[0], producer_port=producer.endpoint[1],
                producer_request_id=producer_rid, block_ids=(),
                producer_topology=ParallelTopology(tp_size=1), num_tokens=len(request.prompt),
                consumer_engine_id=consumer.engine_id, consumer_host=consumer.endpoint[0],
                consumer_port=consumer.endpoint[1], consumer_request_id=request.request_id,
                spec_fingerprint=spec_fp)

        consumer.submit([replace(theirs, transfer_params=push_params(theirs, mine.request_id))])
        time.sleep(0.5)  # the hostile register is at the producer first
        params = push_params(mine, mine.request_id)
        consumer.submit([replace(mine, transfer_params=params)])
        producer.submit([replace(mine, remote_decode=True, max_tokens=1,
                                 transfer_params=params)])
        done = _results(consumer, {mine.request_id, theirs.request_id}, 60)
        for spec in (theirs, mine):
            _check_output(done[spec.request_id], spec)  # every KV byte is its own prompt's
            assert done[spec.request_id].num_external_tokens == 0, spec.request_id
        _wait_producer(producer, "registers_refused", 1, 20)
    finally:
        codes = (producer.close(), consumer.close())
    assert codes == (0, 0)
