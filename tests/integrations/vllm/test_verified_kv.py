"""Verified KV in real vLLM (CPU build): a corrupted NIXL transfer is recomputed.

A kvbridge producer whose KV memory gets one byte flipped after it took its
digests (``faults/kvbridge_fault_corrupt_producer.py``, loaded by vLLM through
``kv_connector_module_path``) serves a kvbridge consumer with ``verify: full`` (the
default samples 1/16 of the blocks) and ``kv_load_failure_policy: recompute``. The consumer's real
READ moves the wrong byte; its digest check fails that block, vLLM recomputes
from it, and the greedy output equals the colocated run. A consumer with ``verify: off`` takes the wrong byte: its KV is
not what the producer computed (the control that the fault is real).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbridge.integrations.vllm import configs
from kvbridge.integrations.vllm import harness as h

pytestmark = pytest.mark.vllm

FAULTS = Path(__file__).with_name("faults")
LOCAL = "vllm:prompt_tokens_by_source_total{source=local_compute}"
FAILED = "vllm:kvbridge_num_failed_transfers_total"  # a prometheus counter
BLOCK = 32  # the harness's block size; the fault hits block 2, tokens [64, 96)


@pytest.fixture(scope="module")
def servers(tiny_model: Path, server_logs: Path) -> Iterator[tuple[h.VllmServer, ...]]:
    model = str(tiny_model)
    producer_config = {"kv_connector": "CorruptingNixlConnector", "kv_role": "kv_producer",
                       "kv_connector_module_path": "kvbridge_fault_corrupt_producer",
                       "kv_connector_extra_config": {}}
    # vLLM fails a request whose load failed unless told to recompute (its default is
    # kv_load_failure_policy=fail: the request then ends with an error, nothing wrong served)
    consumer_config = {**configs.kvbridge_nixl_config("kv_consumer", extra={"verify": "full"}),
                       "kv_load_failure_policy": "recompute"}
    producer, consumer = configs.pair_specs(model, "corrupt", producer_config, consumer_config)
    producer = h.ServerSpec(producer.name, producer.model, producer.port, core=0,
                            kv_transfer_config=producer_config,
                            # the fault module first, then whatever kvbridge the run imports
                            # (a source tree on PYTHONPATH stays ahead of the installed one)
                            env={"PYTHONPATH": os.pathsep.join(
                                filter(None, (str(FAULTS), os.environ.get("PYTHONPATH"))))})
    unchecked = h.ServerSpec("unverified-consumer", model, h.free_port(), core=1,
                             kv_transfer_config=configs.kvbridge_nixl_config(
                                 "kv_consumer", extra={"verify": "off"}))
    with h.server_group(server_logs / "verified-kv") as group:
        yield tuple(group.start(producer, consumer, unchecked, timeout_s=600))


def test_a_corrupted_transfer_is_recomputed_and_matches_colocated(servers) -> None:
    producer, consumer, unchecked = servers
    prompt = h.make_prompts(1, 150, seed=4242)[0]
    before = consumer.metrics()
    first, got = h.disaggregated(producer, consumer, prompt, 8)
    after = consumer.metrics()
    assert first.kv_transfer_params and "kvbridge" in first.kv_transfer_params
    producer.reset_prefix_cache()
    want = producer.complete(prompt, 8)
    assert got.token_ids == want.token_ids
    # the corrupted block failed its check: vLLM computed it and what follows it (this
    # vLLM recomputes a request in failed_recving from its first token)
    assert after.get(FAILED, 0) - before.get(FAILED, 0) >= 1, {
        k: v for k, v in after.items() if "kvbridge" in k}
    recomputed = after.get(LOCAL, 0) - before.get(LOCAL, 0)
    assert len(prompt) - 2 * BLOCK <= recomputed <= len(prompt), recomputed
    log = consumer.log_path.read_text(errors="replace")
    assert "digest mismatch in 1 of" in log


def test_without_verification_the_corrupted_byte_is_used(servers) -> None:
    """The control: the same fault reaches a consumer with ``verify: off`` unnoticed
    (no failed transfer, no recompute), so the check above is what caught it."""
    producer, _consumer, unchecked = servers
    prompt = h.make_prompts(1, 150, seed=4343)[0]
    before = unchecked.metrics()
    h.disaggregated(producer, unchecked, prompt, 8)
    after = unchecked.metrics()
    assert after.get(FAILED, 0) - before.get(FAILED, 0) == 0
    assert after.get(LOCAL, 0) - before.get(LOCAL, 0) == 0
