"""Store connectors in real vLLM (CPU) on the hybrid model: a sliding window's null blocks.

vLLM's block tables name the null block (id 0) where a request holds no block:
the leading positions of a sliding-window group that the window dropped. A
request loading external tokens gets it at the positions its window will not
attend (``num_computed - window + 1`` tokens skipped), and a running request's
positions turn into it as its window moves on (chunked prefill).

One engine per store connector (``offloading``, CPU tier only; ``mooncake_store``
against a real master, every block's digest checked), both ``kv_both``, the
hybrid model (window 64, blocks of 32, float32) with chunks of 64 tokens, so a
150-token prompt is prefilled over three steps and its window drops two blocks
before it finishes. After it was stored and vLLM's prefix cache reset:

* a 140-token prompt sharing its first 128 tokens loads them; its window will
  not attend the first two sliding-window positions, which vLLM gives the null
  block: nothing is loaded there (loads into them wrote two blocks into one; the
  Mooncake store's digest of the one that landed first failed, and vLLM
  recomputed all 140 tokens);
* a 70-token prompt sharing its first 64 tokens loads the two sliding-window
  blocks the long prompt's window had dropped: were the null block's bytes ever
  stored under their keys, its run would be apart from the reference;
* the 150-token prompt again loads its 128 tokens.

Each run equals its reference (``harness.compare_greedy``: computed by the
same engine under a cache salt of its own, so from no stored block), and vLLM
counts every matched token under ``external_kv_transfer``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvbridge.integrations.vllm import harness as h
from tests.integrations.conftest import require_vllm_env

pytestmark = pytest.mark.vllm

MAX_TOKENS = 6
TOP = 5
#: nats: a run on right KV is bit-equal to its reference here, one on wrong KV apart by far more
TOLERANCE = 0.05
BLOCK = 32
EXTERNAL = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
SEEDS = {"offloading": 4101, "mooncake_store": 4102}
SERVER = {"block_size": BLOCK, "dtype": "float32",
          # chunked prefill: the long prompt's window drops blocks while it is prefilled
          "extra_args": ("--max-num-batched-tokens", "64")}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, server_logs: Path,
            mooncake_master: Any) -> Iterator[dict[str, h.VllmServer]]:
    require_vllm_env()
    from kvbridge.integrations.vllm.tiny_model import ensure_tiny_model

    model = str(ensure_tiny_model("hybrid", tmp_path_factory.mktemp("tiny-hybrid")))
    stores = {
        "offloading": {"kvbridge_connector": "offloading", "cpu_blocks": 64},
        "mooncake_store": {"kvbridge_connector": "mooncake_store",
                           "master_address": mooncake_master.rpc_address,
                           "metadata_server": mooncake_master.metadata_url,
                           "global_segment_size": 64 << 20, "local_buffer_size": 16 << 20,
                           "verify": "full"},
    }
    env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "WARNING"}
    specs = [h.ServerSpec(f"nullblocks-{name}", model, h.free_port(), core=core, env=env,
                          kv_transfer_config={"kv_connector": "KVBridgeConnector",
                                              "kv_role": "kv_both",
                                              "kv_load_failure_policy": "recompute",
                                              "kv_connector_extra_config": extra},
                          **SERVER)
             for core, (name, extra) in enumerate(stores.items())]
    with h.server_group(server_logs / "store-null-blocks") as group:
        started = group.start(*specs, timeout_s=600)
        yield dict(zip(stores, started, strict=True))


def _reference(server: h.VllmServer, prompt: list[int]) -> h.Completion:
    """The prompt computed from scratch: a cache salt of its own hashes its blocks apart
    from every stored one (vLLM's prefix cache and the connectors' keys alike)."""
    out = server.post("/v1/completions", {
        "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, "logprobs": TOP,
        "return_tokens_as_token_ids": True, "cache_salt": uuid.uuid4().hex})
    choice = out["choices"][0]
    tops = (choice.get("logprobs") or {}).get("top_logprobs") or ()
    return h.Completion(token_ids=tuple(int(t) for t in choice["token_ids"]),
                        kv_transfer_params=None, latency_s=0.0,
                        top_logprobs=tuple({int(k.rpartition(":")[2]): float(v)
                                            for k, v in t.items()} if t else None
                                           for t in tops))


@pytest.mark.parametrize("store", ["offloading", "mooncake_store"])
def test_null_blocks_are_neither_stored_nor_loaded(engines: dict[str, h.VllmServer],
                                                   store: str) -> None:
    server = engines[store]
    long = h.make_prompts(1, 150, seed=SEEDS[store])[0]
    # 140 tokens: loads 128, its window skips 65 of them (two null blocks);
    # 70 tokens: loads 64, attends both sliding-window blocks the long prompt dropped
    prompts = {"shorter, null blocks": long[:140], "short, dropped blocks": long[:70],
               "same": long}
    references = {name: _reference(server, p) for name, p in prompts.items()}
    server.complete(long, 1)  # stored as it is prefilled, in chunks of 64
    for name, prompt in prompts.items():
        server.reset_prefix_cache()
        before = server.metrics()
        got = server.complete(prompt, MAX_TOKENS, logprobs=TOP)
        after = server.metrics()
        result = h.compare_greedy(got, references[name], TOLERANCE)
        loaded = after.get(EXTERNAL, 0) - before.get(EXTERNAL, 0)
        print(f"{store} {name} ({len(prompt)} tokens): {loaded:.0f} loaded, "
              f"{result.max_apart:.2e} nats apart, diverged at {result.diverged_at}")
        assert result.within(TOLERANCE), (
            f"{store}: {name} prompt ({len(prompt)} tokens) {result.max_apart:.3g} nats from "
            f"its reference (tokens {got.token_ids}, reference {references[name].token_ids}); "
            f"log {server.log_path}")
        want = (len(prompt) // BLOCK) * BLOCK
        assert loaded == want, (
            f"{store}: {name} prompt ({len(prompt)} tokens): {loaded:.0f} tokens loaded, "
            f"expected {want}; log {server.log_path}:\n{server.log_tail()}")
