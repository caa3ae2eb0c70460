"""Hostile ``kv_transfer_params`` against a real kvbridge P/D pair in vLLM (CPU build).

One producer and one consumer with ``KVBridgeNixlConnector`` (pull), deployed as
docs/vllm.md ("The front door") recommends for an engine that takes params from
clients: a cluster secret on both, the consumer with kvbridge's admission gate
(``--logits-processors`` :data:`~kvbridge.integrations.vllm.front_door.GATE`) and
``kv_load_failure_policy: recompute``, in vLLM's default multi-process deployment
(where the deeply nested rows would kill its engine core). Each row takes a real producer record (or
none) and breaks it one way, sends it with a prompt to the consumer, and asserts:

* the answer is HTTP 400 naming the field (refused at the API server, before the
  engine sees it), or HTTP 200 with exactly the consumer's own local answer for
  that prompt (computed once, the consumer alone with no params; its prefix cache
  is reset afterwards so no row is served from it);
* a refusal the consumer's connector counts shows on its ``/metrics``;
* a good disaggregated request sent at the same time completes with its own text;
* the engine lives: a following plain request answers as before.

The rows that tamper with a sealed record, or send another prompt's, need
sealed, prompt-bound params (a producer that seals; a consumer that checks the
seal with the cluster secret and the prompt chain with its own tokens).
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvbridge.auth import new_secret
from kvbridge.integrations.vllm import configs
from kvbridge.integrations.vllm import harness as h
from kvbridge.integrations.vllm.front_door import GATE

pytestmark = pytest.mark.vllm

MAX_TOKENS = 4
PROMPT_TOKENS = 96  # three blocks of 32
REFUSED = h.REFUSED_PARAMS
by_reason = h.refused_params_by


@dataclass
class Deployment:
    producer: h.VllmServer
    consumer: h.VllmServer
    consumer_engine_id: str
    consumer_port: int
    #: the consumer's own answer per prompt (tuple of token ids)
    local: dict[tuple[int, ...], tuple[int, ...]]

    def fresh(self, prompt: list[int]) -> dict[str, Any]:
        """What the producer returns for ``prompt`` (a real, held record), a copy."""
        first = self.producer.complete(prompt, 1, h.producer_params())
        assert first.kv_transfer_params and "kvbridge" in first.kv_transfer_params
        return copy.deepcopy(first.kv_transfer_params)


@dataclass(frozen=True)
class Row:
    name: str
    #: (deployment, the prompt sent, another prompt) -> the kv_transfer_params sent
    build: Callable[[Deployment, list[int], list[int]], object]
    #: refused at the API server: HTTP 400 naming this field
    door_field: str | None = None
    #: answered locally and counted: the consumer's refusal counter grows, and one of
    #: these reasons (``refused_params_<reason>``) when any is given
    refusal: tuple[str, ...] | None = None


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"x": 1}
    for _ in range(depth - 1):
        value = {"x": value}
    return value


def changed(field: str, value: object) -> Callable[[Deployment, list[int], list[int]], object]:
    def build(d: Deployment, prompt: list[int], _other: list[int]) -> object:
        params = d.fresh(prompt)
        params["kvbridge"][field] = value
        return params
    return build


def edited(edit: Callable[[dict[str, Any], Deployment], None],
           ) -> Callable[[Deployment, list[int], list[int]], object]:
    def build(d: Deployment, prompt: list[int], _other: list[int]) -> object:
        params = d.fresh(prompt)
        edit(params["kvbridge"], d)
        return params
    return build


def _sealed_field(record: dict[str, Any], field: str) -> str:
    assert field in record, (f"the producer's params carry no {field!r}: an unsealed "
                             f"record (version {record.get('version')})")
    return str(record[field])


def _flip_hex(record: dict[str, Any], field: str) -> None:
    text = _sealed_field(record, field)
    record[field] = text[:-1] + ("0" if text[-1] != "0" else "1")


def _shift_ids(record: dict[str, Any], _d: Deployment) -> None:
    record["block_ids"] = [[b + 7 for b in group] for group in record["block_ids"]]


def _this_consumer(record: dict[str, Any], d: Deployment) -> None:
    record["producer_engine_id"] = d.consumer_engine_id
    record["producer_port"] = d.consumer_port


def _more_ids_than_the_prompt_needs(record: dict[str, Any], _d: Deployment) -> None:
    record["block_ids"] = [group + group * 4 for group in record["block_ids"]]


def _push_record(record: dict[str, Any], d: Deployment) -> None:
    record.update(mode="push", consumer_engine_id=d.consumer_engine_id,
                  consumer_host=h.LOOPBACK, consumer_port=d.consumer_port)


def _another_prompts(d: Deployment, _prompt: list[int], other: list[int]) -> object:
    return d.fresh(other)


def _replayed(d: Deployment, prompt: list[int], _other: list[int]) -> object:
    params = d.fresh(prompt)
    used = d.consumer.complete(prompt, MAX_TOKENS, params)
    assert used.token_ids == d.local[tuple(prompt)]
    d.consumer.reset_prefix_cache()  # the replay must reach the connector, not the cache
    return params


def _with_deep_router_data(d: Deployment, prompt: list[int], _other: list[int]) -> object:
    params = d.fresh(prompt)
    params["router"] = nested(500)
    return params


def _oversized_extra(record: dict[str, Any], _d: Deployment) -> None:
    record["extra"] = {"blob": "x" * (10 << 20)}


def _million_ids(record: dict[str, Any], _d: Deployment) -> None:
    record["block_ids"] = [list(range(1_000_000))]


def _one_huge_id(record: dict[str, Any], _d: Deployment) -> None:
    record["block_ids"][0][0] = 2**63 - 1


def _huge_tp(record: dict[str, Any], _d: Deployment) -> None:
    record["producer_topology"]["tp_size"] = 2**40


KVB = "kv_transfer_params.kvbridge"
SEAL = ("seal",)
ROWS = [
    # forged or borrowed params: refused by the consumer (seal / prompt chain), recomputed
    Row("block_ids_shifted_by_7", edited(_shift_ids), refusal=SEAL),
    Row("another_prompts_params", _another_prompts, refusal=("prompt",)),
    Row("unknown_producer_engine_id", changed("producer_engine_id", "nobody-engine"),
        refusal=SEAL),
    Row("another_producer_request_id", changed("producer_request_id", "cmpl-not-this-one"),
        refusal=SEAL),
    Row("replayed_after_use", _replayed, refusal=("replay",)),
    Row("closed_producer_port", changed("producer_port", h.free_port()), refusal=SEAL),
    Row("another_loopback_host", changed("producer_host", "127.0.0.2"), refusal=SEAL),
    Row("this_consumer_named_as_producer", edited(_this_consumer), refusal=SEAL),
    Row("changed_seal", edited(lambda r, _d: _flip_hex(r, "seal")), refusal=SEAL),
    Row("changed_prompt_chain", edited(lambda r, _d: _flip_hex(r, "prompt_chain")),
        refusal=("seal", "prompt")),
    # bounded by the request in the engine: recomputed, counted by field
    Row("num_tokens_past_the_prompt", changed("num_tokens", 10**9),
        refusal=("num_tokens", "seal")),
    Row("more_ids_than_the_prompt_needs", edited(_more_ids_than_the_prompt_needs),
        refusal=("block_ids", "seal")),
    Row("push_record_on_a_pull_consumer", edited(_push_record), refusal=()),
    # nothing for kvbridge: recomputed, nothing to count
    Row("no_kvbridge_record", lambda _d, _p, _o: {"do_remote_prefill": True}),
    # refused at the API server, naming the field
    Row("params_not_a_mapping", lambda _d, _p, _o: "not params", door_field="kv_transfer_params"),
    Row("kvbridge_not_a_mapping", lambda _d, _p, _o: {"do_remote_prefill": True,
                                                      "kvbridge": [1, 2, 3]}, door_field=KVB),
    Row("version_99", changed("version", 99), door_field=f"{KVB}.version"),
    Row("tp_size_2_40", edited(_huge_tp), door_field=f"{KVB}.producer_topology.tp_size"),
    Row("negative_num_tokens", changed("num_tokens", -5), door_field=f"{KVB}.num_tokens"),
    Row("one_id_2_63_minus_1", edited(_one_huge_id), door_field=f"{KVB}.block_ids[0][0]"),
    Row("a_million_ids", edited(_million_ids), door_field=f"{KVB}.block_ids[0]"),
    Row("extra_of_10_mb", edited(_oversized_extra), door_field=f"{KVB}.extra"),
    # these kill vLLM's engine when they get to it (docs/vllm.md, "The front door")
    Row("extra_nested_500_deep", changed("extra", nested(500)), door_field=f"{KVB}.extra.x"),
    Row("router_data_nested_500_deep", _with_deep_router_data,
        door_field="kv_transfer_params.router"),
]


def _prompts(index: int) -> tuple[list[int], list[int], list[int]]:
    """(the prompt sent, another prompt, the concurrent good request's prompt) of a row."""
    return tuple(h.make_prompts(1, PROMPT_TOKENS, seed=seed + index)[0]  # type: ignore[return-value]
                 for seed in (9000, 9500, 9900))


LIVE_PROMPT = h.make_prompts(1, 40, seed=31337)[0]


@pytest.fixture(scope="module")
def deployment(tiny_model: Path, server_logs: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    secret = tmp_path_factory.mktemp("hostile") / "cluster.secret"
    new_secret(secret)
    consumer_id, consumer_port = f"cons-{uuid.uuid4().hex[:8]}", h.free_port()
    producer_config = configs.kvbridge_nixl_config("kv_producer",
                                                 extra={"auth_secret_file": str(secret)})
    consumer_config = {**configs.kvbridge_nixl_config(
        "kv_consumer", extra={"auth_secret_file": str(secret), "port": consumer_port}),
        "engine_id": consumer_id, "kv_load_failure_policy": "recompute"}
    producer, consumer = configs.pair_specs(str(tiny_model), "hostile", producer_config,
                                          consumer_config)
    # the consumer in vLLM's default deployment (engine core and worker in their own
    # processes): there a request nested a few hundred levels deep kills the engine
    # core (its step is pickled for the worker), so the gate's 400 is what keeps it up
    consumer = dataclasses.replace(consumer, extra_args=("--logits-processors", GATE),
                                   in_process=False)
    with h.server_group(server_logs / "hostile") as group:
        started = group.start(producer, consumer, timeout_s=600)
        d = Deployment(started[0], started[1], consumer_id, consumer_port, {})
        for prompt in [LIVE_PROMPT] + [p for i in range(len(ROWS))
                                       for p in (_prompts(i)[0], _prompts(i)[2])]:
            d.local[tuple(prompt)] = d.consumer.complete(prompt, MAX_TOKENS).token_ids
        d.consumer.reset_prefix_cache()
        yield d


def _grown(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_hostile_params_are_refused_or_recomputed_and_others_go_on(deployment: Deployment,
                                                                    row: Row) -> None:
    d = deployment
    prompt, other, good_prompt = _prompts(ROWS.index(row))
    params = row.build(d, prompt, other)
    good_params = d.fresh(good_prompt)
    before = d.consumer.metrics()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        good = pool.submit(d.consumer.complete, good_prompt, MAX_TOKENS, good_params)
        status, answer = d.consumer.try_complete(prompt, MAX_TOKENS, params)
        good_answer = good.result(timeout=180)

    if row.door_field is not None:
        assert status == 400, f"{row.name}: HTTP {status}: {answer}"
        assert row.door_field in str(answer), answer
    else:
        assert status == 200, f"{row.name}: HTTP {status}: {answer}"
        assert isinstance(answer, h.Completion)
        assert answer.token_ids == d.local[tuple(prompt)], \
            f"{row.name}: the consumer answered from KV that is not this prompt's"
    assert good_answer.token_ids == d.local[tuple(good_prompt)]
    # the engine lives and still answers as before
    assert d.consumer.complete(LIVE_PROMPT, MAX_TOKENS).token_ids == d.local[tuple(LIVE_PROMPT)]
    after = d.consumer.metrics() if row.refusal is None else \
        d.consumer.metrics_once_grown(before, REFUSED)
    if row.refusal is not None:
        assert _grown(before, after, REFUSED) >= 1, {k: v for k, v in after.items()
                                                     if "refused" in k}
        if row.refusal:
            assert sum(_grown(before, after, by_reason(r)) for r in row.refusal) >= 1, {
                k: v for k, v in after.items() if "refused" in k}
    elif row.door_field is not None:
        assert _grown(before, after, REFUSED) == 0  # the engine never saw it
