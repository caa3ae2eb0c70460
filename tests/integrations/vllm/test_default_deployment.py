"""kvbridge NIXL in vLLM's default deployment: engine core and worker in separate processes.

The other tests run each engine in one process (faster start-up on 2 cores);
here the scheduler half and the worker half of the connector live in
different processes, so the step metadata, the handshake metadata and the
worker results cross vLLM's own IPC.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvbridge.integrations.vllm import configs
from kvbridge.integrations.vllm import harness as h

pytestmark = pytest.mark.vllm


def test_pull_pd_with_worker_processes_matches_colocated(tiny_model: Path,
                                                         server_logs: Path) -> None:
    specs = configs.pair_specs(str(tiny_model), "multiproc",
                             configs.kvbridge_nixl_config("kv_producer"),
                             configs.kvbridge_nixl_config("kv_consumer"))
    prompts = [h.make_prompts(1, n, seed=4000 + n)[0] for n in (100, 64)]
    with h.server_group(server_logs / "multiproc") as group:
        producer, consumer = group.start(*(replace(s, in_process=False) for s in specs),
                                         timeout_s=500)
        decoded = [h.disaggregated(producer, consumer, p, 8)[1].token_ids for p in prompts]
        metrics = consumer.metrics()
        producer.reset_prefix_cache()
        colocated = [producer.complete(p, 8).token_ids for p in prompts]
    assert decoded == colocated
    assert h.prompt_token_sources(metrics) == (0, sum(len(p) for p in prompts))
