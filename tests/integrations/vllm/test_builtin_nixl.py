"""vLLM's own NixlConnector doing prefill/decode on CPU: the baseline kvbridge is held to.

Two real API servers (producer pinned to core 0, consumer to core 1), the
producer prefills with ``max_tokens=1`` and ``do_remote_decode``, its returned
params go to the consumer. The consumer's greedy tokens must equal a colocated
run of the same engine, its prompt tokens must all come by transfer, and a
negative control (prompt A with prompt B's params) must change the output.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.integrations.vllm import harness as h

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
# Lengths on and off block boundaries (block size 32), all distinct prompts.
PROMPT_LENGTHS = (100, 64, 150, 33)


def builtin_nixl_config(role: str) -> dict[str, object]:
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}


@pytest.fixture(scope="module")
def builtin_pair(tiny_model: Path, server_logs: Path) -> Iterator[tuple[h.VllmServer, h.VllmServer]]:
    with h.server_group(server_logs / "builtin-nixl") as group:
        producer, consumer = group.start(
            h.ServerSpec("producer", str(tiny_model), h.free_port(), core=0,
                         kv_transfer_config=builtin_nixl_config("kv_producer"),
                         env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(h.free_port())}),
            h.ServerSpec("consumer", str(tiny_model), h.free_port(), core=1,
                         kv_transfer_config=builtin_nixl_config("kv_consumer"),
                         env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(h.free_port())}),
            timeout_s=400,
        )
        yield producer, consumer


def _prompts(seed: int) -> list[list[int]]:
    out = []
    for i, length in enumerate(PROMPT_LENGTHS):
        out.extend(h.make_prompts(1, length, seed=seed * 100 + i))
    return out


def test_pd_through_vllm_nixl_matches_colocated(builtin_pair) -> None:
    producer, consumer = builtin_pair
    prompts = _prompts(seed=1)
    before = consumer.metrics()
    disagg = [h.disaggregated(producer, consumer, p, MAX_TOKENS)[1] for p in prompts]
    after = consumer.metrics()

    producer.reset_prefix_cache()
    colocated = [producer.complete(p, MAX_TOKENS) for p in prompts]
    for prompt, got, want in zip(prompts, disagg, colocated, strict=True):
        assert len(got.token_ids) == MAX_TOKENS
        assert got.token_ids == want.token_ids, f"prompt of {len(prompt)} tokens diverged"

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    total = sum(len(p) for p in prompts)
    assert delta("vllm:prompt_tokens_by_source_total{source=local_compute}") == 0
    assert delta("vllm:prompt_tokens_by_source_total{source=external_kv_transfer}") == total
    assert delta("vllm:nixl_bytes_transferred_count") >= len(prompts)


def test_negative_control_other_prompts_kv_changes_output(builtin_pair) -> None:
    producer, consumer = builtin_pair
    prompt_a, prompt_b = h.make_prompts(2, 96, seed=4242)
    params_b = producer.complete(prompt_b, 1, h.producer_params()).kv_transfer_params
    assert params_b
    wrong = consumer.complete(prompt_a, MAX_TOKENS, params_b)
    right = producer.complete(prompt_a, MAX_TOKENS)
    assert wrong.token_ids != right.token_ids
