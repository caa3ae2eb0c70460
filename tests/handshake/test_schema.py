"""Schema: round trips, header-first decoding and strict, field-naming rejection."""

from __future__ import annotations

import random
from dataclasses import replace

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.handshake import (
    MAX_MESSAGE_BYTES,
    AgentMetadata,
    CompatHeader,
    ErrorReply,
    HandshakeError,
    MetadataReply,
    MetadataRequest,
    RegionMemory,
    RequestKind,
    ServerClock,
    StatusReply,
    TransferMode,
    check_agent,
    decode_agent,
    decode_engine,
    decode_header,
    decode_reply,
    decode_request,
    encode_agent,
    encode_engine,
    encode_reply,
    encode_request,
)
from kvbridge.handshake.codec import PROTOCOL_VERSION
from kvbridge.handshake.example import example_rank
from kvbridge.layouts import MemoryOrder, ParallelTopology, load_spec


def _doc(make_store, **kw) -> bytes:
    return encode_engine(make_store(**kw).snapshot())


def _mutate_map(data: bytes, edit) -> bytes:
    obj = msgpack.unpackb(data, raw=False)
    edit(obj)
    return msgpack.packb(obj, use_bin_type=True)


def _mutate_body(doc: bytes, edit) -> bytes:
    def outer(obj):
        body = msgpack.unpackb(obj["body"], raw=False)
        edit(body)
        obj["body"] = msgpack.packb(body, use_bin_type=True)
    return _mutate_map(doc, outer)


def test_engine_document_round_trip_keeps_every_rank(make_store):
    store = make_store(model="tiny-hybrid", tp=2, pp=2)
    snapshot = store.snapshot()
    decoded = decode_engine(encode_engine(snapshot), expected=store.header)
    assert decoded == snapshot
    assert [m.rank.describe() for m in decoded.ranks] == [
        "pp0/pcp0/tp0", "pp0/pcp0/tp1", "pp1/pcp0/tp0", "pp1/pcp0/tp1"]
    assert decoded.missing_ranks() == []
    # the planner's view of memory: one LayerMemory per layer on the rank's stage
    memory = decoded.memory_by_rank()
    assert sorted(memory[0]) == [0, 1] and sorted(memory[3]) == [2, 3]


def test_agent_record_round_trip_includes_spec():
    spec = load_spec("tiny-mla")
    meta = example_rank(spec, ParallelTopology(tp_size=2, tp_rank=1), "e")
    decoded = decode_agent(encode_agent(meta))
    assert decoded == meta and decoded.spec == spec


def test_requests_and_replies_round_trip():
    clock = ServerClock(1.5, 2.5)
    for request in (MetadataRequest(7), MetadataRequest(8, RequestKind.PING),
                    MetadataRequest(9, RequestKind.GET, None, 1, None, "abc", 4)):
        assert decode_request(encode_request(request)) == request
    for reply in (MetadataReply(1, clock, b"doc"),
                  StatusReply(2, clock, "e", "inc", 3, True),
                  ErrorReply(3, clock, "pp_rank", "out of range", retryable=True)):
        assert decode_reply(encode_reply(reply)) == reply


def test_header_is_checked_before_the_body_is_read(make_store):
    local = make_store()
    remote_doc = _doc(make_store, model="tiny-gqa-nhd")
    garbage_body = _mutate_map(remote_doc, lambda o: o.__setitem__("body", b"\xc1garbage"))
    with pytest.raises(HandshakeError) as info:
        decode_engine(garbage_body, expected=local.header)
    assert info.value.field == "fingerprint.model"  # not "body": the body was never parsed
    assert decode_header(garbage_body).model == "tiny-gqa-nhd"
    with pytest.raises(HandshakeError) as info:
        decode_engine(garbage_body)
    assert info.value.field == "body"


def test_fingerprint_ignores_plan_time_fields_but_not_the_model_format():
    spec = load_spec("tiny-gqa")
    base = CompatHeader.from_spec(spec, TransferMode.PULL)
    other_block = replace(spec.regions[0], block_size=32)
    other_order = replace(spec.regions[0], memory_order=MemoryOrder.NHD)
    for region in (other_block, other_order):
        assert CompatHeader.from_spec(replace(spec, regions=(region,)),
                                      TransferMode.PULL).fingerprint == base.fingerprint
    other_dtype = replace(spec.regions[0], dtype="bfloat16")
    assert CompatHeader.from_spec(replace(spec, regions=(other_dtype,)),
                                  TransferMode.PULL).fingerprint != base.fingerprint
    assert CompatHeader.from_spec(spec, TransferMode.PUSH).fingerprint != base.fingerprint


def test_incompatible_header_error_names_the_field(make_store):
    local = make_store()
    spec = load_spec("tiny-gqa")
    wider = replace(spec, regions=(replace(spec.regions[0], head_dim=64),))
    remote = CompatHeader.from_spec(wider, TransferMode.PULL)
    store_doc = _doc(make_store)
    forged = _mutate_map(store_doc, lambda o: o.__setitem__(
        "header", {"protocol_version": PROTOCOL_VERSION, "fingerprint": remote.fingerprint,
                   **remote.compat_map()}))
    with pytest.raises(HandshakeError) as info:
        decode_engine(forged, expected=local.header)
    assert info.value.field == "fingerprint.regions[attn].head_dim"
    # without an expectation the header decodes, then the body's spec contradicts it
    with pytest.raises(HandshakeError) as info:
        decode_engine(forged)
    assert info.value.field == "body.spec"


@pytest.mark.parametrize(("edit", "field"), [
    (lambda o: o.__setitem__("v", PROTOCOL_VERSION + 1), "protocol_version"),
    (lambda o: o.__setitem__("extra", 1), "extra"),
    (lambda o: o.pop("body"), "body"),
    (lambda o: o["header"].__setitem__("fingerprint", "0" * 16), "header.fingerprint"),
    (lambda o: o["header"].__setitem__("num_layers", "4"), "header.num_layers"),
    (lambda o: o["header"].__setitem__("transfer_mode", "teleport"), "header.transfer_mode"),
    (lambda o: o["header"]["regions"][0].__setitem__("key_only", 0),
     "header.regions[0].key_only"),
])
def test_malformed_document_envelope_names_the_field(make_store, edit, field):
    with pytest.raises(HandshakeError) as info:
        decode_engine(_mutate_map(_doc(make_store), edit))
    assert info.value.field == field


def _set_region(index, key, value):
    return lambda b: b["ranks"][0]["regions"][index].__setitem__(key, value)


@pytest.mark.parametrize(("edit", "field"), [
    (_set_region(0, "block_bytes_per_layer", 4096), "body.ranks[0].regions[0].block_bytes_per_layer"),
    (_set_region(0, "base_addrs", [1 << 40]), "body.ranks[0].regions[0].base_addrs"),
    (_set_region(0, "base_addrs", [0, 1 << 40, 2 << 40, 3 << 40]),
     "body.ranks[0].regions[0].base_addrs[0]"),
    (_set_region(0, "base_addrs", [(1 << 64) - 4096, 1 << 40, 2 << 40, 3 << 40]),
     "body.ranks[0].regions[0].base_addrs[0]"),
    (_set_region(0, "base_addrs", [1 << 40, (1 << 40) + 4096, 2 << 40, 3 << 40]),
     "body.ranks[0].regions[0].base_addrs[1]"),
    (_set_region(0, "base_addrs", [-5, 1, 2, 3]), "body.ranks[0].regions[0].base_addrs[0]"),
    (_set_region(0, "memory_order", "NHD"), "body.ranks[0].regions[0].memory_order"),
    (_set_region(0, "block_size", 32), "body.ranks[0].regions[0].block_size"),
    (_set_region(0, "num_blocks", -1), "body.ranks[0].regions[0].num_blocks"),
    (_set_region(0, "name", "other"), "body.ranks[0].regions[0].name"),
    (lambda b: b["ranks"][0].__setitem__("agent_blob", "text"), "body.ranks[0].agent_blob"),
    (lambda b: b["ranks"][0].__setitem__("agent_blob", b"x" * (300 * 1024)),
     "body.ranks[0].agent_blob"),
    (lambda b: b["ranks"][0].__setitem__("engine_id", "other"), "body.ranks[0].engine_id"),
    (lambda b: b["ranks"][0].__setitem__("generation", True), "body.ranks[0].generation"),
    (lambda b: b["ranks"][1].__setitem__("topology", b["ranks"][0]["topology"]),
     "body.ranks[1].topology"),
    (lambda b: b["ranks"][0]["topology"].__setitem__("tp_rank", 9),
     "body.ranks[0].topology.tp_rank"),
    (lambda b: b["topology"].__setitem__("tp_size", 4), "body.ranks[0].topology"),
    (lambda b: b["topology"].__setitem__("tp_rank", 1), "body.topology"),
    (lambda b: b["ranks"][0].__setitem__("spec", {}), "body.ranks[0].spec"),
    (lambda b: b.__setitem__("generation", 0), "body.generation"),
    (lambda b: b.__setitem__("incarnation", ""), "body.incarnation"),
])
def test_malformed_rank_metadata_names_the_field(make_store, edit, field):
    with pytest.raises(HandshakeError) as info:
        decode_engine(_mutate_body(_doc(make_store), edit))
    assert info.value.field == field


def test_protocol_version_is_checked_first_on_every_record():
    for decode in (decode_request, decode_reply, decode_agent, decode_engine):
        with pytest.raises(HandshakeError) as info:
            decode(msgpack.packb({"kind": "ping", "id": 1}))
        assert info.value.field == "protocol_version"
        with pytest.raises(HandshakeError) as info:
            decode(msgpack.packb({"v": PROTOCOL_VERSION + 1, "anything": "else"}))
        assert info.value.field == "protocol_version" and f"v{PROTOCOL_VERSION + 1}" in info.value.reason


def test_size_and_type_limits():
    with pytest.raises(HandshakeError) as info:
        decode_reply(b"\x00" * (MAX_MESSAGE_BYTES + 1))
    assert info.value.field == "message" and "exceeds" in info.value.reason
    with pytest.raises(HandshakeError) as info:
        decode_request(b"\xc1")
    assert info.value.field == "message"
    ext = msgpack.packb({"v": PROTOCOL_VERSION, "kind": "ping", "id": msgpack.ExtType(5, b"x")})
    with pytest.raises(HandshakeError) as info:
        decode_request(ext)
    assert info.value.field == "id"
    with pytest.raises(HandshakeError) as info:
        decode_request(msgpack.packb({"v": PROTOCOL_VERSION, "kind": "get", "id": 1, "known_generation": 3}))
    assert info.value.field == "known_incarnation"
    with pytest.raises(HandshakeError) as info:
        decode_reply(msgpack.packb({"v": PROTOCOL_VERSION, "kind": "status", "id": 1, "wall": float("nan"),
                                    "mono": 0.0, "engine_id": "e", "incarnation": "i",
                                    "generation": 1, "unchanged": False}))
    assert info.value.field == "wall"


def test_check_agent_refuses_memory_that_disagrees_with_the_spec():
    spec = load_spec("tiny-gqa")
    meta = example_rank(spec, ParallelTopology(tp_size=2), "e")
    check_agent(meta)
    wrong = replace(meta, regions=(replace(meta.regions[0], block_bytes_per_layer=123),))
    with pytest.raises(HandshakeError) as info:
        check_agent(wrong)
    assert info.value.field == "regions[0].block_bytes_per_layer"
    assert isinstance(meta.regions[0], RegionMemory)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_mutation_of_a_document_is_decoded_or_refused_with_a_handshake_error(data):
    spec = load_spec("tiny-hybrid")
    topology = ParallelTopology(tp_size=2, pp_size=2)
    ranks = tuple(example_rank(spec, t, "e") for t in topology.ranks())
    header = CompatHeader.from_spec(spec, TransferMode.PULL)
    from kvbridge.handshake import EngineMetadata
    doc = bytearray(encode_engine(EngineMetadata(header, "e", "inc", 4, spec, topology, ranks)))
    rng = random.Random(data.draw(st.integers(0, 2**32)))
    for _ in range(data.draw(st.integers(1, 8))):
        op = rng.randrange(3)
        pos = rng.randrange(len(doc))
        if op == 0:
            doc[pos] ^= 1 << rng.randrange(8)
        elif op == 1:
            del doc[pos:pos + rng.randrange(1, 16)]
        else:
            doc[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
    try:
        decoded = decode_engine(bytes(doc))
    except HandshakeError as exc:
        assert exc.field  # always names something
    else:  # a surviving mutation must still be a self-consistent document
        for rank in decoded.ranks:
            check_agent(rank)


def test_build_from_layer_addresses_matches_the_spec():
    spec = load_spec("tiny-hybrid")
    topology = ParallelTopology(tp_size=2, pp_size=2, tp_rank=1, pp_rank=1)
    meta = AgentMetadata.build("e", "agent", b"blob", spec, topology,
                               {2: 0x10000, 3: 0x90000}, num_blocks=8)
    assert [r.base_addrs for r in meta.regions] == [(0x10000,), (0x90000,)]
    assert meta.layer_memory()[3].block_stride == meta.regions[1].block_bytes_per_layer
    with pytest.raises(HandshakeError) as info:
        AgentMetadata.build("e", "agent", b"", spec, topology, {2: 0x10000}, num_blocks=8)
    assert info.value.field == "layer_addrs"
    with pytest.raises(HandshakeError) as info:  # layer 2's 8 blocks overlap layer 3
        AgentMetadata.build("e", "agent", b"", spec, topology, {2: 0x10000, 3: 0x10100},
                            num_blocks=8)
    assert info.value.field == "regions[1].base_addrs[0]"
