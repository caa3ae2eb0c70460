"""kvbridge NIXL in real vLLM with a cluster secret.

Both engines get ``auth_secret_file`` in ``kv_connector_extra_config``: the
disaggregated output still equals the colocated one with every prompt token
transferred, and a client without the secret gets nothing from the producer's
side channel while one with it gets every rank's metadata.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbridge.auth import ClusterAuth, Secret, new_secret
from kvbridge.handshake import HandshakeClient, HandshakeError
from kvbridge.integrations.vllm import configs
from kvbridge.integrations.vllm import harness as h

pytestmark = pytest.mark.vllm


def test_pd_with_a_cluster_secret_matches_colocated_and_refuses_strangers(
        tiny_model: Path, server_logs: Path, tmp_path: Path) -> None:
    secret = tmp_path / "cluster.secret"
    new_secret(secret)
    side_port = h.free_port()
    producer_extra = {"auth_secret_file": str(secret), "port": side_port}
    specs = configs.pair_specs(str(tiny_model), "auth",
                             configs.kvbridge_nixl_config("kv_producer", extra=producer_extra),
                             configs.kvbridge_nixl_config("kv_consumer",
                                                        extra={"auth_secret_file": str(secret)}))
    prompts = [h.make_prompts(1, n, seed=5000 + n)[0] for n in (80, 48)]
    with h.server_group(server_logs / "auth") as group:
        producer, consumer = group.start(*specs, timeout_s=500)
        decoded = [h.disaggregated(producer, consumer, p, 8)[1].token_ids for p in prompts]
        metrics = consumer.metrics()
        address = f"127.0.0.1:{side_port}"
        with pytest.raises(HandshakeError, match="authentication required"):
            HandshakeClient(timeout_s=10, retries=0).fetch(address)
        member = HandshakeClient(timeout_s=10, retries=0,
                                 auth=ClusterAuth(Secret.from_file(secret)))
        assert member.fetch(address).metadata.ranks
        producer.reset_prefix_cache()
        colocated = [producer.complete(p, 8).token_ids for p in prompts]
    assert decoded == colocated
    assert h.prompt_token_sources(metrics) == (0, sum(len(p) for p in prompts))
