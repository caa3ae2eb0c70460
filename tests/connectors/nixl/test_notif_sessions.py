"""Notifications belong to sessions, against a served producer and real NIXL.

A producer rank acts on a consumer's notification (``read``, ``begin``,
``heartbeat``, ``register``) only when its sender said hello, names the
consumer rank that hello described, and expects the count of notifying ranks
the producer computes for that consumer's topology. Before, a stranger's
``read`` released a held request at once (the real consumer's READ then came
too late) and every ``begin`` of an agent that never said hello queued an
answer forever.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace

import torch

from kvbridge.auth import ClusterAuth, Label, Secret, resolve_auth
from kvbridge.backends.nixl import NixlTransport
from kvbridge.connectors.params import TransferParams
from kvbridge.connectors.pd import messages
from kvbridge.connectors.pd.worker import MAX_DEFERRED_PER_AGENT
from kvbridge.engine.harness import EngineProcess
from kvbridge.engine.request import RequestSpec
from kvbridge.engine.workload import make_requests
from kvbridge.handshake import AgentMetadata, EngineMetadata, HandshakeClient, encode_agent
from kvbridge.layouts import ParallelTopology, load_spec
from tests.connectors.nixl.nixl_helpers import member_hello
from tests.connectors.nixl.test_faults import (
    MODEL,
    Stepper,
    _check_output,
    _consumer,
    _prefill,
    _producer,
    _producer_worker_stats,
    _shutdown_clean,
    _wait_producer,
    _worker_totals,
)

#: short, so that deferred stranger messages are rejected within the test
GRACE_S = 1.0


def _producer_doc(producer: EngineProcess) -> EngineMetadata:
    assert producer.endpoint is not None
    return HandshakeClient(timeout_s=5.0, auth=resolve_auth()).fetch(f"127.0.0.1:{producer.endpoint[1]}").metadata


def _held_request(producer: EngineProcess, rogue: NixlTransport, seed: int, prefix: str
                  ) -> tuple[RequestSpec, TransferParams, list[str]]:
    """A request the producer prefilled and holds, and the rogue's peers of its ranks."""
    (spec,) = make_requests(1, prompt_tokens=48, max_tokens=2, seed=seed, prefix=prefix)
    params = _prefill(producer, spec).transfer_params
    assert params is not None
    peers = [rogue.add_peer(rank.agent_name, rank.agent_blob)
             for rank in _producer_doc(producer).ranks]
    return spec, params, peers


def _send_all(rogue: NixlTransport, peers: list[str], notifs: list[messages.Notif]) -> None:
    for peer in peers:
        for notif in notifs:
            rogue.send_notif(peer, messages.encode(notif))
            rogue.get_notifs()  # progresses the rogue agent: the notification goes out


_ticks = iter(range(1_000_000))


def _wait_rejected(producer: EngineProcess, rogue: NixlTransport, at_least: int,
                   timeout_s: float) -> int:
    """Wait for the producer's ``notifs_rejected``, progressing the rogue agent meanwhile
    (worker stats reach the engine when it steps: a tiny local request makes it step)."""
    deadline = time.monotonic() + timeout_s
    while (got := _producer_worker_stats(producer).get("notifs_rejected", 0)) < at_least:
        assert time.monotonic() < deadline, f"notifs_rejected {got} < {at_least} " \
                                            f"after {timeout_s} s"
        rogue.get_notifs()
        producer.submit([RequestSpec(f"tick-{next(_ticks)}", (1, 2, 3), max_tokens=1)])
        time.sleep(0.05)
        producer.results()
    return int(got)


def _load_and_check(consumer_stepper: Stepper, spec: RequestSpec,
                    params: TransferParams) -> None:
    consumer_stepper.engine.add_request(replace(spec, transfer_params=params))
    consumer_stepper.until(lambda: spec.request_id in consumer_stepper.results, 60,
                           "the real consumer's load")
    loaded = consumer_stepper.results[spec.request_id]
    _check_output(loaded, spec)
    # every prompt block arrived by the READ: the hold outlived the stranger's "done"
    assert loaded.num_external_tokens > 0 and loaded.num_recomputed_tokens == 0
    assert consumer_stepper.failed == set()


def test_a_strangers_notifications_release_nothing_and_queue_nothing() -> None:
    producer = _producer(early_grace_s=GRACE_S)
    consumer = _consumer()
    stepper = Stepper(consumer)
    rogue = NixlTransport(f"kvb-stranger-{uuid.uuid4().hex[:8]}")
    try:
        spec, params, peers = _held_request(producer, rogue, 31, "stranger")
        rid = params.producer_request_id
        flood = 500
        _send_all(rogue, peers, [messages.ReadDone(rid, 7, 1), messages.ReadDone(rid, 0, 1),
                                 messages.Heartbeat((rid,))]
                  + [messages.Begin(rid, 0)] * flood)
        per_rank = 3 + flood
        assert per_rank > MAX_DEFERRED_PER_AGENT  # so most are refused without a queue
        _wait_rejected(producer, rogue, 1, 60)  # they arrived
        _load_and_check(stepper, spec, params)
        assert sum(t["loads_done"] for t in _worker_totals(consumer)) == 1
        # all of it, once the grace for a hello that never comes has passed
        assert _wait_rejected(producer, rogue, len(peers) * per_rank, 60) == \
            len(peers) * per_rank
        assert _producer_worker_stats(producer).get("bad_notifs", 0) == 0
    finally:
        rogue.close(strict=False)
        producer.close()
        _shutdown_clean(consumer)


def test_an_unauthenticated_agents_read_notifications_are_rejected_at_once() -> None:
    """Before: a ``read`` from an agent whose hello did not authenticate (sealed with
    another secret; or sealed at all, for a rank without one) was kept, uncounted, for a
    hello that had already come, and only counted once ``early_grace_s`` passed. With a
    grace far longer than this test waits, each must now be counted as it arrives (a read
    before any hello: as deferred at once, then rejected with the hello)."""
    producer = _producer(early_grace_s=600.0)
    rogue = NixlTransport(f"kvb-forger-{uuid.uuid4().hex[:8]}")
    memory = torch.zeros(1 << 20, dtype=torch.uint8)
    rogue.register_regions([memory])
    try:
        spec, params, peers = _held_request(producer, rogue, 33, "forger")
        rid = params.producer_request_id
        spec_model = load_spec(MODEL)
        me = ParallelTopology(tp_size=1)
        shape = spec_model.rank_shapes(me)[0]
        layer_addrs = {layer: memory.data_ptr() + i * shape.block_bytes_per_layer
                       for i, layer in enumerate(shape.layer_ids)}
        doc = encode_agent(AgentMetadata.build("forger", rogue.name, rogue.agent_metadata(),
                                               spec_model, me, layer_addrs, 1))
        # never this cluster's secret: another one where the rank has one, any where not
        other = ClusterAuth(Secret.from_value("not-the-cluster-secret-0123456789abcdef"))
        hello = messages.Hello(other.seal_request(Label.NIXL_HELLO, doc)[0])
        reads = [messages.ReadDone(rid, 0, 1), messages.ReadDone(rid, 0, 1, read=False)]
        _send_all(rogue, peers, [messages.ReadDone(rid, 0, 1), hello, *reads])
        # per producer rank: the read before the hello, the hello, the two after it
        assert _wait_rejected(producer, rogue, 4 * len(peers), 60) == 4 * len(peers)
        stats = _producer_worker_stats(producer)
        # the read that came before the hello was counted as it arrived: deferred
        assert stats["notifs_deferred"] == len(peers) and stats.get("bad_notifs", 0) == 0
        assert stats["notifs_rejected"] == 4 * len(peers)
    finally:
        rogue.close(strict=False)
        producer.close()


def test_a_peer_cannot_speak_for_another_consumer_rank_or_miscount_the_ranks() -> None:
    spec_model = load_spec(MODEL)
    producer = _producer(early_grace_s=GRACE_S)
    consumer = _consumer()
    stepper = Stepper(consumer)
    rogue = NixlTransport(f"kvb-claimer-{uuid.uuid4().hex[:8]}")
    memory = torch.zeros(1 << 20, dtype=torch.uint8)
    rogue.register_regions([memory])
    try:
        spec, params, peers = _held_request(producer, rogue, 32, "claims")
        rid = params.producer_request_id
        # a well-formed hello: consumer rank 0 of a TP 1 engine, as the real consumer is
        me = ParallelTopology(tp_size=1)
        shape = spec_model.rank_shapes(me)[0]
        layer_addrs = {layer: memory.data_ptr() + i * shape.block_bytes_per_layer
                       for i, layer in enumerate(shape.layer_ids)}
        meta = AgentMetadata.build("claimer", rogue.name, rogue.agent_metadata(),
                                   spec_model, me, layer_addrs, 1)
        hello = member_hello(encode_agent(meta))
        # rank 0 notifies both producer ranks of a TP 1 consumer: each expects 1
        _send_all(rogue, peers, [hello, messages.ReadDone(rid, 3, 1),
                                 messages.ReadDone(rid, 0, 9), messages.Begin(rid, 5)])
        _wait_rejected(producer, rogue, 1, 60)  # they arrived
        _load_and_check(stepper, spec, params)
        assert _wait_rejected(producer, rogue, 3 * len(peers), 60) == 3 * len(peers)
    finally:
        rogue.close(strict=False)
        producer.close()
        _shutdown_clean(consumer)


def _helds(rogue: NixlTransport, want: int, timeout_s: float) -> list[messages.Held]:
    """The ``held`` answers the rogue agent receives, until ``want`` came (bounded)."""
    got: list[messages.Held] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want:
        assert time.monotonic() < deadline, f"{len(got)} of {want} held answers"
        for batch in rogue.get_notifs().values():
            for data in batch:
                msg = messages.decode(data)
                if isinstance(msg, messages.Held):
                    got.append(msg)
        time.sleep(0.01)
    return got


def test_begins_not_naming_the_sealed_record_get_nothing_and_early_asks_are_bounded() -> None:
    """A peer's ``begin`` for a held request that does not name the params the producer
    sealed for it (this one names none) is refused: no promise, no digests (nothing is
    hashed for it), and it does not claim the hold. A ``begin`` for a request not held
    (yet), with digest asks or without, waits for its hold, then is answered without a
    promise after ``early_grace_s``. The real consumer's load beside it is unharmed."""
    spec_model = load_spec(MODEL)
    producer = _producer(early_grace_s=GRACE_S)
    consumer = _consumer()
    stepper = Stepper(consumer)
    rogue = NixlTransport(f"kvb-asker-{uuid.uuid4().hex[:8]}")
    memory = torch.zeros(1 << 20, dtype=torch.uint8)
    rogue.register_regions([memory])
    try:
        spec, params, peers = _held_request(producer, rogue, 33, "asks")
        rid = params.producer_request_id
        me = ParallelTopology(tp_size=1)
        shape = spec_model.rank_shapes(me)[0]
        layer_addrs = {layer: memory.data_ptr() + i * shape.block_bytes_per_layer
                       for i, layer in enumerate(shape.layer_ids)}
        meta = AgentMetadata.build("asker", rogue.name, rogue.agent_metadata(),
                                   spec_model, me, layer_addrs, 1)
        held_ids = params.block_ids[0]
        stray = max(held_ids) + 1
        # the producer's first block algorithm: XXH3-64 on host KV, the torch one on
        # KV that is not host-readable (a GPU, or the host-access guard)
        alg = _producer_doc(producer).ranks[0].digests[0]
        _send_all(rogue, peers, [
            member_hello(encode_agent(meta)),
            messages.Begin(rid, 0, ((held_ids[0], stray),), alg),   # no record: refused
            messages.Begin(rid, 0, ((held_ids[0],),), alg),         # refused too
            messages.Begin("never-held", 0, ((1, 2, 3),), alg),     # waits, bounded
            messages.Begin("never-held", 0)])                        # waits too
        answers = _helds(rogue, 4 * len(peers), 60)
        by_rid: dict[str, list[messages.Held]] = {}
        for held in answers:
            by_rid.setdefault(held.request_id, []).append(held)
        assert len(by_rid[rid]) == 2 * len(peers)
        assert all(not h.ok and not h.digests and h.reason.startswith("refused: unsealed")
                   for h in by_rid[rid])
        assert len(by_rid["never-held"]) == 2 * len(peers)
        assert all(not h.ok and not h.digests and "not held" in h.reason
                   for h in by_rid["never-held"])
        _wait_producer(producer, "begins_before_hold", 2 * len(peers), 20)
        stats = _producer_worker_stats(producer)  # both waited for a hold (none came)
        assert stats["begins_before_hold"] == 2 * len(peers)
        assert stats["holds_promised"] == 0
        assert stats["holds_promise_refused"] == stats["holds_refused"] == 2 * len(peers)
        assert stats["digests_served"] == 0
        _load_and_check(stepper, spec, params)
        totals = _worker_totals(consumer)  # TP 2 -> 1: head slices, checked with slice digests
        assert sum(t["digest_mismatches"] for t in totals) == 0
    finally:
        rogue.close(strict=False)
        producer.close()
        _shutdown_clean(consumer)
