"""kvbridge NIXL in push mode inside real vLLM: the producer WRITEs into the consumer's blocks.

A router that pushes must know both kvbridge side channels and engine ids up
front (fixed in each engine's ``--kv-transfer-config``), sends the request to
the consumer first (it allocates and registers its block ids with the
producer), then to the producer (prefill, ``max_tokens=1``), concurrently.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.integrations.vllm import configs
from kvbridge.integrations.vllm import harness as h

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
LOCAL = "vllm:prompt_tokens_by_source_total{source=local_compute}"
EXTERNAL = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
FAILED = "vllm:kvbridge_num_failed_transfers_total"


@pytest.fixture(scope="module")
def push_pair(tiny_model: Path, server_logs: Path) -> Iterator[dict[str, object]]:
    ids = {"producer": f"prod-{uuid.uuid4().hex[:8]}", "consumer": f"cons-{uuid.uuid4().hex[:8]}"}
    ports = {"producer": h.free_port(), "consumer": h.free_port()}

    def config(role: str, who: str) -> dict[str, object]:
        cfg = configs.kvbridge_nixl_config(role, extra={"mode": "push", "port": ports[who]})
        cfg["engine_id"] = ids[who]
        if role == "kv_consumer":
            # a push the producer refuses (another prompt's) is a failed load here:
            # recomputed, not vLLM's default HTTP 500
            cfg["kv_load_failure_policy"] = "recompute"
        return cfg

    specs = configs.pair_specs(str(tiny_model), "push", config("kv_producer", "producer"),
                             config("kv_consumer", "consumer"))
    with h.server_group(server_logs / "nixl-push") as group:
        producer, consumer = group.start(*specs, timeout_s=400)
        yield {"producer": producer, "consumer": consumer, "ids": ids, "ports": ports}


def _params(pair: dict, prompt: list[int]) -> dict[str, object]:
    ids, ports = pair["ids"], pair["ports"]
    return h.kvbridge_push_params(
        producer_engine_id=ids["producer"], producer_port=ports["producer"],
        consumer_engine_id=ids["consumer"], consumer_port=ports["consumer"],
        request_id=f"router-{uuid.uuid4().hex[:12]}", num_tokens=len(prompt))


def test_push_pd_matches_colocated(push_pair) -> None:
    producer, consumer = push_pair["producer"], push_pair["consumer"]
    prompts = [h.make_prompts(1, n, seed=500 + n)[0] for n in (100, 64, 150)]
    before = consumer.metrics()
    results = [h.disaggregated_push(producer, consumer, p, MAX_TOKENS, _params(push_pair, p),
                                    timeout_s=120) for p in prompts]
    after = consumer.metrics()
    producer.reset_prefix_cache()
    for prompt, (_first, got) in zip(prompts, results, strict=True):
        want = producer.complete(prompt, MAX_TOKENS)
        assert got.token_ids == want.token_ids, f"prompt of {len(prompt)} tokens diverged"
    assert after.get(LOCAL, 0) - before.get(LOCAL, 0) == 0
    assert after.get(EXTERNAL, 0) - before.get(EXTERNAL, 0) == sum(len(p) for p in prompts)


def test_push_of_another_prompts_kv_is_refused_and_the_prompt_recomputed(push_pair) -> None:
    """The consumer decodes prompt A while the producer prefills prompt B under the
    same router id: the consumer's registration names A's prompt chain, so the
    producer refuses to write B's KV into it; the consumer counts a failed load,
    computes A itself and answers A's own text. That pushed KV is really used when
    it is the prompt's own: ``test_push_pd_matches_colocated`` (every prompt token
    under ``external_kv_transfer``)."""
    producer, consumer = push_pair["producer"], push_pair["consumer"]
    prompt_a, prompt_b = h.make_prompts(2, 96, seed=8888)
    params = _params(push_pair, prompt_a)
    import concurrent.futures

    before = consumer.metrics()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        decode = pool.submit(consumer.complete, prompt_a, MAX_TOKENS, {"kvbridge": params}, 120)
        producer.complete(prompt_b, 1, {"do_remote_decode": True, "kvbridge": params}, 120)
        got = decode.result(timeout=120)
    after = consumer.metrics_once_grown(before, FAILED)
    consumer.reset_prefix_cache()
    own = consumer.complete(prompt_a, MAX_TOKENS)
    assert got.token_ids == own.token_ids
    assert after.get(FAILED, 0) - before.get(FAILED, 0) >= 1, {
        k: v for k, v in after.items() if "kvbridge" in k}
    assert "refused: the consumer's prompt is not this request's prompt" in \
        consumer.log_path.read_text(errors="replace")
