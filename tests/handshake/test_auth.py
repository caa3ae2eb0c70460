"""The side channel with a cluster secret: members get metadata, strangers get nothing."""

from __future__ import annotations

import pytest

from kvbridge.auth import ClusterAuth, Label, Secret
from kvbridge.auth.seal import seal
from kvbridge.handshake import HandshakeClient, HandshakeError, HandshakeServer
from kvbridge.handshake.schema import (
    ErrorReply,
    MetadataReply,
    MetadataRequest,
    RequestKind,
    decode_reply,
    encode_request,
)

SECRET = Secret.from_value("cluster-secret-for-tests-0123456789", "test")


@pytest.fixture
def secured(make_store, serve):
    store = make_store()
    store.auth = ClusterAuth(SECRET)
    server = serve(store)
    return store, server, f"127.0.0.1:{server.port}"


def test_a_member_gets_the_metadata_and_the_cache_still_works(secured) -> None:
    store, _, address = secured
    with HandshakeClient(timeout_s=5, retries=0, auth=ClusterAuth(SECRET)) as client:
        first = client.fetch(address)
        assert len(first.metadata.ranks) == 2 and not first.cached
        again = client.fetch(address)  # the conditional request, sealed afresh
        assert again.cached
        assert client.ping(address).status.engine_id == "engine-a"
    assert store.auth_refused == 0


def test_a_client_without_the_secret_gets_an_auth_error_and_no_metadata(secured) -> None:
    store, server, address = secured
    with HandshakeClient(timeout_s=5, retries=2) as client:
        with pytest.raises(HandshakeError, match="authentication required") as err:
            client.fetch(address)
        assert err.value.field == "auth"
        assert client.stats.attempts == 1  # not retried: another try has no other secret
        with pytest.raises(HandshakeError, match="authentication required"):
            client.ping(address)  # not even whether the engine is there
    assert store.auth_refused == 2


def test_another_secret_is_refused_both_ways(secured) -> None:
    store, _, address = secured
    other = ClusterAuth(Secret.from_value("another-cluster-secret-0123456789"))
    with HandshakeClient(timeout_s=5, retries=0, auth=other) as client, \
            pytest.raises(HandshakeError, match="tag does not match"):
        client.fetch(address)
    assert store.auth_refused == 1


def test_a_server_without_the_secret_is_not_a_member(make_store, serve) -> None:
    server = serve(make_store())
    with HandshakeClient(timeout_s=5, retries=0, auth=ClusterAuth(SECRET)) as client, \
            pytest.raises(HandshakeError, match="no cluster secret configured"):
        client.fetch(f"127.0.0.1:{server.port}")


def test_the_sans_io_store_refuses_replays_stale_clocks_and_stray_bytes(make_store) -> None:
    store = make_store()
    auth = ClusterAuth(SECRET)
    store.auth = auth
    request = encode_request(MetadataRequest(7, RequestKind.GET))
    wire, nonce = auth.seal_request(Label.SIDE_CHANNEL, request)
    reply, out = store.answer(wire)
    assert isinstance(reply, MetadataReply)
    assert isinstance(decode_reply(auth.open_reply(Label.SIDE_CHANNEL, nonce, out)),
                      MetadataReply)
    replayed, out = store.answer(wire)  # a captured request sent again
    assert isinstance(replayed, ErrorReply) and "replayed" in replayed.message
    assert b"engine-a" not in out
    stale = seal(SECRET, Label.SIDE_CHANNEL.value, request, sent_ms=1_000)[0]
    old, _ = store.answer(stale)
    assert isinstance(old, ErrorReply) and "clock skew" in old.message
    for stray in (request, b"", b"KVA1" + bytes(100), bytes(range(256))):
        refused, out = store.answer(stray)
        assert isinstance(refused, ErrorReply) and refused.field == "auth"
        assert b"engine-a" not in out
    assert store.auth_refused == 6
    assert refused.request_id == 0
    named, _ = store.answer(request)
    assert named.request_id == 7  # a stranger's client matches the refusal to its request


def test_a_non_loopback_bind_without_a_secret_is_refused(make_store) -> None:
    server = HandshakeServer(make_store(), "0.0.0.0", 0)
    with pytest.raises(HandshakeError, match="refusing to listen on 0.0.0.0") as err:
        server.bind()
    assert err.value.field == "host"
    assert server._socket is None  # nothing was bound
