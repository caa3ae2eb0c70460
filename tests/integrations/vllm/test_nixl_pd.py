"""Prefill/decode through NIXL inside real vLLM (CPU build): vLLM's connector and kvbridge's.

Four API servers run for this module: a producer and a consumer with vLLM's
own ``NixlConnector`` (the baseline), and a producer and a consumer with
``KVBridgeNixlConnector`` (the producer found by name through kvbridge's
``vllm.general_plugins`` entry point, the consumer through
``kv_connector_module_path``: both ways of loading it are exercised).
Producers are pinned to core 0, consumers to core 1.

For each pair: the producer prefills with ``max_tokens=1`` and
``do_remote_decode``; its returned params go to the consumer. The consumer's
greedy tokens must equal a colocated run (the producer engine with its prefix
cache reset, no connector involvement), its prompt tokens must all arrive by
transfer (vLLM's ``local_compute`` counter stays put). Prompt A sent with
prompt B's params changes the output of vLLM's connector (the harness's negative
control); kvbridge's consumer refuses them and answers A from A alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.integrations.vllm import configs
from kvbridge.integrations.vllm import harness as h
from kvbridge.tools.bench import vllm_pd

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
# Lengths on and off block boundaries (block size 32).
PROMPT_LENGTHS = (100, 64, 150, 33)
LOCAL = "vllm:prompt_tokens_by_source_total{source=local_compute}"
EXTERNAL = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"


@pytest.fixture(scope="module")
def servers(tiny_model: Path, server_logs: Path) -> Iterator[dict[str, vllm_pd.PairUnderTest]]:
    model = str(tiny_model)
    builtin = configs.pair_specs(model, "vllm", configs.builtin_nixl_config("kv_producer"),
                               configs.builtin_nixl_config("kv_consumer"),
                               builtin_side_channel=True)
    kvb = configs.pair_specs(model, "kvbridge", configs.kvbridge_nixl_config("kv_producer"),
                           configs.kvbridge_nixl_config("kv_consumer", module_path=True))
    with h.server_group(server_logs / "nixl-pd") as group:
        started = group.start(*builtin, *kvb, timeout_s=600)
        yield {"vllm": vllm_pd.PairUnderTest("vllm", started[0], started[1], "vllm:nixl"),
               "kvbridge": vllm_pd.PairUnderTest("kvbridge", started[2], started[3],
                                               "vllm:kvbridge")}


def _prompts(seed: int) -> list[list[int]]:
    return [h.make_prompts(1, n, seed=seed * 100 + i)[0] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.mark.parametrize("which", ["vllm", "kvbridge"])
def test_pd_matches_colocated_and_transfers_every_prompt_token(servers, which: str) -> None:
    pair = servers[which]
    prompts = _prompts(seed=1)
    before = pair.consumer.metrics()
    disagg = [h.disaggregated(pair.producer, pair.consumer, p, MAX_TOKENS) for p in prompts]
    after = pair.consumer.metrics()

    pair.producer.reset_prefix_cache()
    colocated = [pair.producer.complete(p, MAX_TOKENS) for p in prompts]
    for prompt, (first, got), want in zip(prompts, disagg, colocated, strict=True):
        assert len(got.token_ids) == MAX_TOKENS
        assert got.token_ids == want.token_ids, f"prompt of {len(prompt)} tokens diverged"
        assert got.token_ids[0] == first.token_ids[0]  # the producer's one token agrees too
        if which == "kvbridge":
            assert first.kv_transfer_params and "kvbridge" in first.kv_transfer_params

    total = sum(len(p) for p in prompts)
    assert after.get(LOCAL, 0) - before.get(LOCAL, 0) == 0
    assert after.get(EXTERNAL, 0) - before.get(EXTERNAL, 0) == total
    count = f"{pair.metric_prefix}_bytes_transferred_count"
    assert after.get(count, 0) - before.get(count, 0) >= len(prompts)


def test_negative_control_vllms_connector_decodes_on_other_prompts_kv(servers) -> None:
    """vLLM's own NixlConnector loads whatever blocks the params name: prompt A on
    prompt B's params changes the output (the harness can tell borrowed KV apart)."""
    pair = servers["vllm"]
    prompt_a, prompt_b = h.make_prompts(2, 96, seed=4242)
    params_b = pair.producer.complete(prompt_b, 1, h.producer_params()).kv_transfer_params
    assert params_b
    wrong = pair.consumer.complete(prompt_a, MAX_TOKENS, params_b)
    right = pair.producer.complete(prompt_a, MAX_TOKENS)
    assert wrong.token_ids != right.token_ids


def test_other_prompts_params_are_refused_and_the_prompt_recomputed(servers) -> None:
    """kvbridge's consumer refuses prompt B's params for prompt A (their prompt chain
    is not A's) before reading a byte: A's own answer, computed locally, and one
    refusal counted. That a correct request's KV is really used is shown above
    (every prompt token under ``external_kv_transfer``) and by
    ``test_verified_kv.py`` (a byte altered in transfer is caught by the digest)."""
    pair = servers["kvbridge"]
    prompt_a, prompt_b = h.make_prompts(2, 96, seed=4242)
    params_b = pair.producer.complete(prompt_b, 1, h.producer_params()).kv_transfer_params
    assert params_b
    before = pair.consumer.metrics()
    got = pair.consumer.complete(prompt_a, MAX_TOKENS, params_b)
    after = pair.consumer.metrics_once_grown(before, h.REFUSED_PARAMS)
    pair.consumer.reset_prefix_cache()
    own = pair.consumer.complete(prompt_a, MAX_TOKENS)
    assert got.token_ids == own.token_ids
    reason = h.refused_params_by("prompt")
    assert after.get(reason, 0) - before.get(reason, 0) == 1
    assert after.get(EXTERNAL, 0) - before.get(EXTERNAL, 0) == 0


def test_side_by_side_vllm_and_kvbridge_nixl(servers, server_logs: Path) -> None:
    report = vllm_pd.run_side_by_side([servers["vllm"], servers["kvbridge"]], num_prompts=6,
                                    prompt_tokens=256, max_tokens=4, seed=777)
    (server_logs / "side_by_side.json").write_text(json.dumps(report, indent=2))
    print("\n" + vllm_pd.format_table(report))  # noqa: T201 (shown with -s; also in the JSON)
    assert report["same_tokens"], "the two connectors produced different tokens"
    for name in ("vllm", "kvbridge"):
        row = report["connectors"][name]
        # NIXL's own telemetry of the READ, for both connectors
        assert row["read_samples"] >= 4, f"{name}: too few per-transfer samples"
        assert sum(v is not None for v in row["samples"]["ttft_s"]) >= 4
        # 256 tokens, 2 layers, 2 KV heads x 64 x fp32 x K,V: 8 blocks x 2 layers x 32 KiB
        assert row["median_xfer_bytes"] == 256 * 2 * 2 * 64 * 4 * 2
    for measure in ("ttft_s", "read_s"):  # paired per prompt: a spread, not one number
        ratio = report["ratio_kvbridge_over_vllm"][measure]
        assert ratio is not None and ratio["n"] >= 4
        assert ratio["min"] <= ratio["p25"] <= ratio["median"] <= ratio["p75"] <= ratio["max"]
