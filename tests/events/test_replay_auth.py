"""The events replay ROUTER with a cluster secret: a member's subscriber
repairs a gap by replay; a vLLM-protocol client, a kvbridge subscriber without the secret
or with another one get the end marker alone (nothing replayed), counted by the publisher.
"""

from __future__ import annotations

import pytest
import zmq

from kvbridge.auth import BindRefused, ClusterAuth, Secret
from kvbridge.events import (
    KVEventPublisher,
    KVEventSubscriber,
    PublisherConfig,
    SubscriberConfig,
)
from kvbridge.events.wire import END_SEQ
from tests.events.test_pubsub import batches_of, collect, step_events

AUTH = ClusterAuth(Secret.from_value("events-replay-secret-0123456789"))


def _publisher() -> KVEventPublisher:
    pub = KVEventPublisher(PublisherConfig(topic="t"), auth=AUTH)
    for i in range(20):
        pub.publish(step_events(i))
    assert pub.flush()
    return pub


def test_a_member_replays_and_strangers_get_nothing(caplog: pytest.LogCaptureFixture) -> None:
    pub = _publisher()
    try:
        config = SubscriberConfig(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint,
                                  topic="t", start_seq=0, replay_timeout_s=5.0)
        with KVEventSubscriber(config, auth=AUTH) as member:
            got = batches_of(collect(member, 20))
            assert [b.seq for b in got] == list(range(20)) and all(b.replayed for b in got)
        for auth in (None, ClusterAuth(Secret.from_value("another-secret-0123456789ab"))):
            with KVEventSubscriber(config, auth=auth) as stranger:
                items = [item for _ in range(40) if (item := stranger.get(0.05)) is not None]
                assert not batches_of(items)  # nothing replayed to it
                if auth is not None:  # a sealing subscriber says the publisher refused it
                    assert "replay refused by the publisher" in caplog.text
        # vLLM's own replay protocol: an 8-byte start seq answered by the end marker alone
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        try:
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            assert int.from_bytes(frames[2], "big", signed=True) == END_SEQ
        finally:
            dealer.close(linger=0)
        assert pub.stats.unauthenticated_replay_requests >= 3
        assert pub.stats.replayed_batches == 20  # the member's, no one else's
    finally:
        pub.close(timeout_s=1.0)


def test_a_non_loopback_replay_endpoint_needs_a_secret() -> None:
    with pytest.raises(BindRefused, match="replay endpoint"):
        KVEventPublisher(PublisherConfig(replay_endpoint="tcp://0.0.0.0:*"))
