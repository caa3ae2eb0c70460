"""Server: the sans-I/O handler directly, then the ROUTER on a thread (fuzzed)."""

from __future__ import annotations

import random
from dataclasses import replace

import msgpack
import pytest
import zmq

from kvbridge.handshake import (
    ErrorReply,
    HandshakeError,
    HandshakeServer,
    MetadataReply,
    MetadataRequest,
    MetadataStore,
    RequestKind,
    StatusReply,
    TransferMode,
    decode_engine,
    decode_reply,
    encode_request,
)
from kvbridge.handshake.codec import PROTOCOL_VERSION
from kvbridge.handshake.example import example_rank
from kvbridge.layouts import ParallelTopology, load_spec


def _ask(store: MetadataStore, request: MetadataRequest):
    return decode_reply(store.handle_request(encode_request(request)))


def test_get_all_one_rank_and_pp_aggregation(make_store):
    store = make_store(model="tiny-hybrid", tp=2, pp=2)
    whole = _ask(store, MetadataRequest(1))
    assert isinstance(whole, MetadataReply) and whole.request_id == 1
    assert len(decode_engine(whole.engine_doc).ranks) == 4
    one = decode_engine(_ask(store, MetadataRequest(2, pp_rank=1, tp_rank=0)).engine_doc)
    assert [m.rank.describe() for m in one.ranks] == ["pp1/pcp0/tp0"]
    stages = decode_engine(_ask(store, MetadataRequest(3, tp_rank=1)).engine_doc)
    assert [m.rank.describe() for m in stages.ranks] == ["pp0/pcp0/tp1", "pp1/pcp0/tp1"]
    # each stage holds its own layers; together they cover the model
    layers = sorted(layer for m in stages.ranks for layer in m.layer_memory())
    assert layers == [0, 1, 2, 3]


def test_reply_carries_clock_and_identity(make_store):
    ticks = iter(range(100, 200))
    store = MetadataStore("e", load_spec("tiny-gqa"), ParallelTopology(), incarnation="inc-1",
                          wall_clock=lambda: 1000.0 + next(ticks), monotonic_clock=lambda: 5.0)
    reply = _ask(store, MetadataRequest(9, RequestKind.PING))
    assert isinstance(reply, StatusReply)
    assert (reply.engine_id, reply.incarnation, reply.generation) == ("e", "inc-1", 0)
    assert reply.clock.wall_s == 1100.0 and reply.clock.monotonic_s == 5.0


def test_errors_name_the_field_and_unregistered_ranks_are_retryable(make_store):
    store = make_store(tp=2)
    bad = _ask(store, MetadataRequest(4, tp_rank=2))
    assert isinstance(bad, ErrorReply) and bad.field == "tp_rank" and bad.request_id == 4
    assert not bad.retryable
    empty = MetadataStore("e", load_spec("tiny-gqa"), ParallelTopology(tp_size=2))
    empty.publish(example_rank(empty.spec, ParallelTopology(tp_size=2, tp_rank=0), "e"))
    partial = _ask(empty, MetadataRequest(5))
    assert isinstance(partial, ErrorReply) and partial.field == "ranks" and partial.retryable
    assert "pp0/pcp0/tp1" in partial.message
    assert isinstance(_ask(empty, MetadataRequest(6, tp_rank=0)), MetadataReply)
    garbage = decode_reply(store.handle_request(msgpack.packb({"v": PROTOCOL_VERSION, "kind": "get",
                                                               "id": 77, "pp": "x"})))
    assert isinstance(garbage, ErrorReply) and garbage.field == "pp" and garbage.request_id == 77


def test_generation_grows_on_publish_and_withdraw_and_drives_unchanged(make_store):
    store = make_store(tp=2)
    assert store.generation == 2
    first = _ask(store, MetadataRequest(1))
    same = _ask(store, MetadataRequest(2, known_incarnation=store.incarnation,
                                       known_generation=2))
    assert isinstance(same, StatusReply) and same.unchanged
    stamped = store.publish(example_rank(store.spec, ParallelTopology(tp_size=2, tp_rank=1),
                                         store.engine_id, num_blocks=128))
    assert stamped.generation == 3 == store.generation
    newer = _ask(store, MetadataRequest(3, known_incarnation=store.incarnation,
                                        known_generation=2))
    assert isinstance(newer, MetadataReply) and newer.engine_doc != first.engine_doc
    assert decode_engine(newer.engine_doc).rank(tp_rank=1).regions[0].num_blocks == 128
    other_incarnation = _ask(store, MetadataRequest(4, known_incarnation="old",
                                                    known_generation=3))
    assert isinstance(other_incarnation, MetadataReply)
    assert store.withdraw(tp_rank=1) and store.generation == 4
    assert isinstance(_ask(store, MetadataRequest(5)), ErrorReply)


def test_publish_refuses_foreign_or_inconsistent_metadata(make_store):
    store = make_store(tp=2)
    spec = store.spec
    with pytest.raises(HandshakeError) as info:
        store.publish(example_rank(spec, ParallelTopology(tp_size=2), "someone-else"))
    assert info.value.field == "engine_id"
    with pytest.raises(HandshakeError) as info:
        store.publish(example_rank(spec, ParallelTopology(tp_size=4), store.engine_id))
    assert info.value.field == "topology"
    meta = example_rank(spec, ParallelTopology(tp_size=2), store.engine_id)
    with pytest.raises(HandshakeError) as info:
        store.publish(replace(meta, regions=(replace(meta.regions[0], num_blocks=0),)))
    assert info.value.field == "regions[0].num_blocks"
    with pytest.raises(HandshakeError) as info:
        MetadataStore("e", spec, ParallelTopology(tp_size=3))
    assert info.value.field == "topology.tp_size"


def test_owner_polled_server_answers_a_req_socket(make_store):
    server = HandshakeServer(make_store(), "127.0.0.1", 0)
    port = server.bind()
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    try:
        req.connect(f"tcp://127.0.0.1:{port}")
        req.send(encode_request(MetadataRequest(11, RequestKind.PING)))
        served = 0
        for _ in range(100):  # bounded: up to 100 x 50 ms
            served += server.poll(0.05)
            if served:
                break
        assert served == 1
        assert req.poll(2000)
        reply = decode_reply(req.recv())
        assert isinstance(reply, StatusReply) and reply.request_id == 11
    finally:
        req.close(linger=0)
        server.stop()


def _fuzz_messages(rng: random.Random, valid: bytes, count: int) -> list[list[bytes]]:
    """Random, mutated and structurally wrong requests (each a list of frames)."""
    keys = ["v", "kind", "id", "pp", "tp", "pcp", "known_incarnation", "known_generation"]
    values = [None, True, -1, 0, 1, 2**64 - 1, 1.5, float("inf"), "", "get", "ping", "x" * 300,
              b"\x00", [], {}, [1, 2], {"a": 1}, 2**40]
    out: list[list[bytes]] = []
    for _ in range(count):
        kind = rng.randrange(7)
        if kind == 0:
            frames = [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))]
        elif kind == 1:
            data = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                pos = rng.randrange(len(data))
                data[pos] = rng.randrange(256)
            frames = [bytes(data)]
        elif kind == 2:
            cut = rng.randrange(len(valid))
            frames = [valid[:cut] + valid[cut + 1:] if rng.random() < 0.5 else valid[:cut]]
        elif kind == 3:
            obj = {rng.choice(keys): rng.choice(values) for _ in range(rng.randrange(0, 9))}
            if rng.random() < 0.7:
                obj["v"] = 1
            frames = [msgpack.packb(obj, use_bin_type=True)]
        elif kind == 4:
            frames = [msgpack.packb(rng.choice(values + [[valid], {1: 2}]),
                                    use_bin_type=True)]
        elif kind == 5:
            frames = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4)))
                      for _ in range(rng.randrange(2, 4))]
            if rng.random() < 0.3:
                frames[0] = b""
        else:
            frames = [b"\x91" * rng.randrange(1, 9000)]  # deep nesting / oversized
        out.append(frames)
    return out


def test_fuzzed_server_answers_every_message_and_keeps_serving(make_store, serve):
    store = make_store(model="tiny-hybrid", tp=2, pp=2)
    server = serve(store)
    valid = encode_request(MetadataRequest(123456, tp_rank=1))
    messages = _fuzz_messages(random.Random(20261130), valid, 10_000)
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{server.address}")
    window, sent, received, errors = 200, 0, 0, 0
    try:
        while received < len(messages):
            while sent < len(messages) and sent - received < window:
                dealer.send_multipart(messages[sent])
                sent += 1
            assert dealer.poll(5000), f"server stopped answering after {received} replies"
            frames = dealer.recv_multipart()
            reply = decode_reply(frames[-1])  # every reply is itself well-formed
            if isinstance(reply, ErrorReply):
                errors += 1
                assert reply.field, "an error reply must name the field"
            received += 1
        assert received == sent == 10_000
        assert errors > 9_000  # nearly all were refused, one reply each
        assert server.requests_served == 10_000 and server.replies_dropped == 0
        dealer.send(valid)
        assert dealer.poll(5000)
        reply = decode_reply(dealer.recv_multipart()[-1])
        assert isinstance(reply, MetadataReply) and reply.request_id == 123456
        assert len(decode_engine(reply.engine_doc, expected=store.header).ranks) == 2
    finally:
        dealer.close(linger=0)


def test_stop_is_bounded_and_frees_the_port(make_store, serve):
    store = make_store(mode=TransferMode.PUSH)
    server = serve(store)
    port = server.port
    server.stop(timeout_s=2.0)
    again = serve(store, port=port)  # the same port binds again at once
    assert again.port == port
