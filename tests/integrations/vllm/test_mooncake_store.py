"""kvbridge's Mooncake store connector inside real vLLM: prefill on one engine, decode on another.

A real ``mooncake_master`` on 127.0.0.1 (the shared session fixture of
``tests/conftest.py``). The producer (``kv_producer``) stores the blocks it
computes; the consumer (``kv_consumer``) finds them by their chained hashes
and loads them. The router sends the same prompt to both; no transfer params
are needed (the store is addressed by content). The consumer's tokens must
equal a colocated run and its full prompt blocks must come from the store.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.integrations.vllm import configs
from kvbridge.integrations.vllm import harness as h

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
EXTERNAL = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"


@pytest.fixture(scope="module")
def mooncake_pair(tiny_model: Path, server_logs: Path, mooncake_master) -> Iterator[tuple]:
    extra = {"master_address": mooncake_master.rpc_address,
             "metadata_server": mooncake_master.metadata_url,
             "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20}

    def config(role: str) -> dict[str, object]:
        return {"kv_connector": "KVBridgeMooncakeStoreConnector", "kv_role": role,
                "kv_connector_extra_config": dict(extra)}

    producer, consumer = configs.pair_specs(str(tiny_model), "mooncake", config("kv_producer"),
                                          config("kv_consumer"))
    env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "WARNING"}
    producer = h.ServerSpec(**{**producer.__dict__, "env": env})
    consumer = h.ServerSpec(**{**consumer.__dict__, "env": env})
    with h.server_group(server_logs / "mooncake") as group:
        yield tuple(group.start(producer, consumer, timeout_s=400))


def test_pd_through_mooncake_store_matches_colocated(mooncake_pair) -> None:
    producer, consumer = mooncake_pair
    prompts = [h.make_prompts(1, n, seed=7000 + n)[0] for n in (100, 150)]
    for prompt in prompts:
        producer.complete(prompt, 1)  # puts finish inside the step, before the response
    before = consumer.metrics()
    decoded = [consumer.complete(p, MAX_TOKENS).token_ids for p in prompts]
    after = consumer.metrics()
    producer.reset_prefix_cache()
    colocated = [producer.complete(p, MAX_TOKENS).token_ids for p in prompts]
    assert decoded == colocated
    loaded = after.get(EXTERNAL, 0) - before.get(EXTERNAL, 0)
    assert loaded == sum((len(p) // 32) * 32 for p in prompts)
