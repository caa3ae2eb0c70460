"""A cluster secret on the NIXL connector, against a served producer.

With ``auth_secret_file`` configured on both engines, a stranger gets no
metadata from the side channel, and an agent that has the metadata anyway (a
leak: the test fetches it with the secret) does not become the producer's
peer: its hello, unsealed or sealed with another secret, is rejected, and so
is everything it sends after. The members' transfer beside it is correct to
the byte and read, not recomputed.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from kvbridge.auth import ClusterAuth, Label, Secret, new_secret
from kvbridge.backends.nixl import NixlTransport
from kvbridge.connectors.errors import ConfigError
from kvbridge.connectors.pd import messages
from kvbridge.connectors.pd.settings import PdSettings
from kvbridge.engine.workload import make_requests
from kvbridge.handshake import AgentMetadata, HandshakeClient, HandshakeError, encode_agent
from kvbridge.layouts import ParallelTopology, load_spec
from tests.connectors.nixl.test_faults import (
    MODEL,
    Stepper,
    _consumer,
    _prefill,
    _producer,
    _shutdown_clean,
    _worker_totals,
)
from tests.connectors.nixl.test_notif_sessions import (
    GRACE_S,
    _load_and_check,
    _send_all,
    _wait_rejected,
)


def test_members_transfer_and_a_stranger_gets_nothing(tmp_path: Path) -> None:
    secret_file = tmp_path / "cluster.secret"
    new_secret(secret_file)
    auth = ClusterAuth(Secret.from_file(secret_file))
    producer = _producer(early_grace_s=GRACE_S, auth_secret_file=str(secret_file))
    consumer = _consumer(auth_secret_file=str(secret_file))
    stepper = Stepper(consumer)
    rogue = NixlTransport(f"kvb-rogue-{uuid.uuid4().hex[:8]}")
    memory = torch.zeros(1 << 20, dtype=torch.uint8)
    rogue.register_regions([memory])
    try:
        assert producer.endpoint is not None
        address = f"127.0.0.1:{producer.endpoint[1]}"
        with pytest.raises(HandshakeError, match="authentication required"):
            HandshakeClient(timeout_s=5.0, retries=0).fetch(address)
        leaked = HandshakeClient(timeout_s=5.0, auth=auth).fetch(address).metadata
        (spec,) = make_requests(1, prompt_tokens=48, max_tokens=2, seed=41, prefix="auth")
        params = _prefill(producer, spec).transfer_params
        assert params is not None
        rid = params.producer_request_id
        peers = [rogue.add_peer(rank.agent_name, rank.agent_blob) for rank in leaked.ranks]
        spec_model, me = load_spec(MODEL), ParallelTopology(tp_size=1)
        shape = spec_model.rank_shapes(me)[0]
        layer_addrs = {layer: memory.data_ptr() + i * shape.block_bytes_per_layer
                       for i, layer in enumerate(shape.layer_ids)}
        doc = encode_agent(AgentMetadata.build("rogue", rogue.name, rogue.agent_metadata(),
                                               spec_model, me, layer_addrs, 1))
        wrong = ClusterAuth(Secret.from_value("not-the-cluster-secret-0123456789"))
        _send_all(rogue, peers, [
            messages.Hello(doc),                                             # unsealed
            messages.Hello(wrong.seal_request(Label.NIXL_HELLO, doc)[0]),    # another secret
            messages.ReadDone(rid, 0, 1), messages.Begin(rid, 0)])
        # two hellos per rank, then its two messages once the grace for a hello is over
        assert _wait_rejected(producer, rogue, 4 * len(peers), 60) == 4 * len(peers)
        assert rogue.get_notifs() == {}  # nothing was answered to it
        _load_and_check(stepper, spec, params)
        assert sum(t["loads_done"] for t in _worker_totals(consumer)) == 1
    finally:
        rogue.close(strict=False)
        producer.close()
        _shutdown_clean(consumer)


def test_the_secret_settings_are_checked_at_the_edge(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("too short\n")
    with pytest.raises(ConfigError, match="auth_secret_file.*at least 16"):
        PdSettings.parse({"auth_secret_file": str(short)}).cluster_auth()
    with pytest.raises(ConfigError, match="insecure_no_auth"):
        PdSettings.parse({"insecure_no_auth": "yes"})
    with pytest.raises(ConfigError, match="unknown setting"):
        PdSettings.parse({"auth_secret": "a value is never a setting"})
    good = tmp_path / "good"
    new_secret(good)
    settings = PdSettings.parse({"auth_secret_file": str(good), "insecure_no_auth": True})
    found = settings.cluster_auth()
    assert found is not None and found.secret.same_as(Secret.from_file(good))
    assert settings.serves_strangers
