"""Golden wire vectors: fixed reference bytes of every format two kvbridge
versions exchange.

A prefill and a decode engine may run different kvbridge versions; they only
interoperate if both encode and decode the same bytes. Each vector below is a
reference value plus the bytes checked into ``tests/golden/vectors/``. The test
checks, for each:

1. the current encoder turns the reference value into exactly those bytes;
2. the current decoder reads those bytes back to the reference value;
3. re-encoding the decoded value gives the same bytes again.

Formats covered: handshake documents (engine document, one rank's agent
record, requests and replies), NIXL notifications (``connectors.pd.messages``,
every kind), the engine control protocol (``engine.control``: submit, results,
abort, the ops without fields), connector metadata (``connectors.metadata_wire``),
transfer params (JSON and msgpack of ``to_dict()``), KV events (both event wire
forms, the live frames, the replay extension), store key strings
(``layouts.namespaces``) and chained block hashes (``layouts.hashing``). Block digests
(``layouts.digests``) have their own vectors, checked by ``tests/layouts/test_digests.py``
(and ``test_slice_digests.py``).

Regenerating (deliberately)
---------------------------
``KVBRIDGE_REGEN_GOLDEN=1 .venv/bin/python -m pytest -q tests/golden`` rewrites
every vector file from the current encoders (off by default). A regenerated
file is a wire-format change: peers on the previous kvbridge version no longer
read it (or read it differently). Regenerate only together with a version bump
of that format (``PROTOCOL_VERSION``, ``METADATA_WIRE_VERSION``,
``TRANSFER_PARAMS_VERSION``, ``NAMESPACE_VERSION``, ``HASH_VERSION``,
``NOTIF_VERSION``) or a
deliberate, compatible addition, and say so in the commit message.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from kvbridge.auth import Label, Secret
from kvbridge.auth.seal import open_sealed, seal
from kvbridge.connectors import ConnectorMetadata, TransferMode, TransferParams, sealing
from kvbridge.connectors.metadata_wire import decode_metadata, encode_metadata
from kvbridge.connectors.mooncake_store.metadata import LoadBlock, SaveBlock, StoreMetadata
from kvbridge.connectors.mooncake_store.records import (
    RecordTable,
    RecordVerdict,
    digest_key_prefix,
    record_bytes,
    record_dtype,
)
from kvbridge.connectors.mooncake_store.records import key_digest as record_key_digest
from kvbridge.connectors.multi import MultiMetadata
from kvbridge.connectors.offloading.scheduler import OffloadMetadata
from kvbridge.connectors.pd import messages as notifs
from kvbridge.connectors.pd.scheduler import (
    HoldOrder,
    LoadOrder,
    PdMetadata,
    PushOrder,
    ReleaseOrder,
)
from kvbridge.connectors.shared_storage import StorageMetadata
from kvbridge.engine import control
from kvbridge.engine.request import RequestSpec
from kvbridge.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventWireFormat,
    decode_batch,
    encode_batch,
)
from kvbridge.events.wire import (
    REPLAY_MAGIC,
    LiveFrame,
    ReplayInfo,
    ReplayReply,
    ReplayRequest,
    decode_replay_info,
    encode_replay_info,
    encode_replay_request,
    encode_seq,
    parse_pub_frames,
    parse_replay_reply,
    parse_replay_request,
    pub_frames,
    replay_batch_frames,
    replay_end_frames,
)
from kvbridge.handshake import (
    AgentMetadata,
    CompatHeader,
    EngineMetadata,
    ErrorReply,
    MetadataReply,
    MetadataRequest,
    RegionMemory,
    RequestKind,
    ServerClock,
    StatusReply,
    decode_agent,
    decode_engine,
    decode_reply,
    decode_request,
    encode_agent,
    encode_engine,
    encode_reply,
    encode_request,
)
from kvbridge.handshake import TransferMode as HandshakeTransferMode
from kvbridge.layouts import (
    KVCacheSpec,
    MemoryOrder,
    ParallelTopology,
    RegionLayout,
    RegionSpec,
)
from kvbridge.layouts.digests import ALGORITHMS, DIGEST_VERSION
from kvbridge.layouts.hashing import hash_blocks, root_hash
from kvbridge.layouts.namespaces import BlockKey, KeyNamespace, namespace_for
from kvbridge.offload.fs_io import (
    BlockHeader,
    block_header_bytes,
    compact_header_bytes,
    decode_block_header,
    encode_block_header,
)
from kvbridge.offload.fs_layout import FileMapper

VECTORS_DIR = Path(__file__).parent / "vectors"
#: Set to 1 to rewrite the vector files (a wire-format change; see the docstring).
REGEN = os.environ.get("KVBRIDGE_REGEN_GOLDEN") == "1"


@dataclass(frozen=True)
class Vector:
    """One reference value and how its format encodes and decodes it."""

    name: str  # file name under vectors/ (".hex": binary as hex; ".txt": text)
    value: Callable[[], Any]
    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]
    #: How a decoded value is compared with the reference (default: ==).
    same: Callable[[Any, Any], bool] = lambda a, b: bool(a == b)


# ---------------------------------------------------------------- reference values


def _spec() -> KVCacheSpec:
    # Two regions of different layouts (full attention, replicated state): every
    # per-region field of the handshake header and of key namespaces is exercised.
    return KVCacheSpec("golden-model", (
        RegionSpec("attn", RegionLayout.SPLIT, (0, 2), block_size=16, num_kv_heads=4,
                   head_dim=32, dtype="float16"),
        RegionSpec("state", RegionLayout.REPLICATE, (1, 3), block_size=16, num_kv_heads=2,
                   head_dim=64, dtype="float32", key_only=True, token_sharded=False,
                   memory_order=MemoryOrder.NHD),
    ))


_ENGINE_TOPOLOGY = ParallelTopology(tp_size=2)


def _rank(tp_rank: int) -> AgentMetadata:
    spec = _spec()
    topology = ParallelTopology(tp_size=2, tp_rank=tp_rank)
    num_blocks = 8
    regions = []
    cursor = 0x7F00_0000_0000 + (tp_rank << 32)
    for shape in spec.rank_shapes(topology):
        addrs = []
        for _ in shape.layer_ids:
            addrs.append(cursor)
            cursor += 1 << 24  # 16 MiB apart: never overlapping
        regions.append(RegionMemory(shape.region.name, tuple(addrs), shape.block_bytes_per_layer,
                                    num_blocks, shape.region.memory_order,
                                    shape.region.block_size))
    return AgentMetadata("golden-producer", f"golden-producer-tp{tp_rank}",
                         b"golden-agent-blob-" + bytes([tp_rank]) * 4, topology,
                         tuple(regions), spec, generation=1 + tp_rank)


def _engine() -> EngineMetadata:
    spec = _spec()
    return EngineMetadata(CompatHeader.from_spec(spec, HandshakeTransferMode.PULL),
                          "golden-producer", "0123456789abcdef", 3, spec, _ENGINE_TOPOLOGY,
                          (_rank(0), _rank(1)))


_CLOCK = ServerClock(wall_s=1_767_225_600.25, monotonic_s=4242.5)


def _params_pull() -> TransferParams:
    return TransferParams(mode=TransferMode.PULL, producer_engine_id="golden-producer",
                          producer_host="127.0.0.1", producer_port=5600,
                          producer_request_id="req-1", block_ids=((1, 2, 3), (4,)),
                          producer_topology=ParallelTopology(tp_size=2, pp_size=2),
                          num_tokens=40, consumer_request_id="dec-1",
                          spec_fingerprint="0123456789abcdef",
                          extra={"lease_s": 30.0, "note": "x", "flag": True, "n": 7,
                                 "none": None})


#: the cluster secret of the sealed vectors (a test value, never a real one)
_GOLDEN_SECRET = Secret.from_value("golden-cluster-secret-0123456789", "golden")


def _params_sealed() -> TransferParams:
    """Pull params as a producer with the cluster secret returns them: every sealed
    field fixed (a real producer draws ``hold_id`` and ``incarnation`` at random)."""
    chain = sealing.prompt_chain(list(range(100, 140)), 40)
    return sealing.sealed(_GOLDEN_SECRET, dataclasses.replace(
        _params_pull(), hold_id="00112233445566778899aabbccddeeff",
        incarnation="0123456789abcdef", prompt_chain=chain.hex(), seal_key="cluster"))


def _prompt_chains() -> list[tuple[str, int, str, str]]:
    """(tokens, num_tokens, cache salt, chain hex): full links only, a partial last
    link, a salt, and nothing at all."""
    cases = [(list(range(32)), 32, ""), (list(range(40)), 37, ""), (list(range(40)), 40, "s1"),
             ([7, 8], 0, "")]
    return [(" ".join(map(str, t)), n, salt,
             sealing.prompt_chain(t, n, salt or None).hex()) for t, n, salt in cases]


def _chains_text(rows: list[tuple[str, int, str, str]]) -> bytes:
    return "".join(f"{t}|{n}|{salt}|{h}\n" for t, n, salt, h in rows).encode()


def _chains_parse(data: bytes) -> list[tuple[str, int, str, str]]:
    rows = []
    for line in data.decode().splitlines():
        tokens, n, salt, chain = line.split("|")
        rows.append((tokens, int(n), salt, chain))
    return rows


def _sealed_notifs() -> list[notifs.Notif]:
    """The sealed-params fields: a ``begin`` and ``read`` naming the record's digest, a
    push ``register`` naming the prompt chain (all optional keys)."""
    return [
        notifs.Begin("req-1", 1, record=bytes(range(16))),
        notifs.ReadDone("req-1", 0, 2, True, bytes(range(16, 32))),
        notifs.Register("req-2", 1, 2, (0,), ((7, 8),), chain=bytes(range(32))),
    ]


def _params_push() -> TransferParams:
    return TransferParams(mode=TransferMode.PUSH, producer_engine_id="golden-producer",
                          producer_host="127.0.0.1", producer_port=5600,
                          producer_request_id="req-2", block_ids=(),
                          producer_topology=ParallelTopology(tp_size=4, dcp_size=2),
                          num_tokens=33, consumer_engine_id="golden-consumer",
                          consumer_host="127.0.0.1", consumer_port=5700,
                          consumer_request_id="dec-2")


def _stored_event() -> BlockStored:
    return BlockStored(block_hashes=(b"\x01" * 8, b"\x02" * 8), parent_block_hash=b"\x00" * 8,
                       token_ids=tuple(range(4)), block_size=2, medium="CPU")


def _nixl() -> PdMetadata:
    params = _params_pull()
    return PdMetadata(
        step_id=7,
        loads=(LoadOrder("c1", params, ((4, 5), (6,)), ((1, 2), (3,)), (0, 0)),
               LoadOrder("c2", params, ((),), ((),), (1,), error="refused")),
        releases=(ReleaseOrder("c3", _params_pull()),),
        holds=(HoldOrder("p1", ((1, 2), ()), push=True),),
        pushes=(PushOrder("p2", params, ((9,),), end=16, final=False),),
        heartbeats=(params,),
        cancels=("c4",),
        drops=("p5", "p6"),
    )


def _store() -> StoreMetadata:
    return StoreMetadata(loads={"r": (LoadBlock(0, 3, b"\xaa" * 16), LoadBlock(1, 4, b"\xbb"))},
                         saves=(SaveBlock(0, 5, b"\x01" * 8, _stored_event()),))


def _offload() -> OffloadMetadata:
    return OffloadMetadata(pools_token="tok", loads={"r": ((0, 0, 3, 0, 11), (1, 0, 3, 1, 12))},
                           stores=((0, 1, 2, 0, 5),), shared_pools=(("/dev/shm/x", 8, 4096),))


def _storage() -> StorageMetadata:
    # One element in the frozenset: a set's iteration order (so its encoding) of
    # several strings depends on PYTHONHASHSEED.
    return StorageMetadata(loads={"a": ((0, 1, b"\x02" * 32),)}, saves={"b": ((1, 2, b"\x03"),)},
                           delayed=frozenset({"b"}))


def _multi() -> MultiMetadata:
    return MultiMetadata(children=(_nixl(), _offload(), ConnectorMetadata()), delayed={"r": 2})


def _same_base(a: Any, b: Any) -> bool:
    # The base ConnectorMetadata has no fields and no __eq__: equal when of the same class.
    return type(a) is type(b) is ConnectorMetadata


def _same_multi(a: Any, b: Any) -> bool:
    return (type(a) is type(b) is MultiMetadata and a.delayed == b.delayed
            and len(a.children) == len(b.children)
            and all(_same_base(x, y) if type(x) is ConnectorMetadata else x == y
                    for x, y in zip(a.children, b.children, strict=True)))


def _events_batch() -> EventBatch:
    """Every event type, every optional field set somewhere, int and bytes hashes."""
    return EventBatch(ts=1_767_225_600.5, data_parallel_rank=1, events=(
        BlockStored(block_hashes=(11, 12), parent_block_hash=None,
                    token_ids=tuple(range(100, 132)), block_size=16),
        BlockStored(block_hashes=(b"\xab" * 32,), parent_block_hash=b"\xcd" * 32,
                    token_ids=tuple(range(16)), block_size=16, lora_id=3, medium="STORAGE",
                    lora_name="adapter", extra_keys=(("salt", 1), None, (b"mm", "h")),
                    group_idx=1, kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=128, locality="REMOTE", ownership="OWNED"),
        BlockStored(block_hashes=(2**64 - 1,), parent_block_hash=0, token_ids=(),
                    block_size=16, medium="CPU", locality="LOCAL"),
        BlockRemoved(block_hashes=(11, 12), medium="GPU"),
        BlockRemoved(block_hashes=(b"\xab" * 32,), medium="STORAGE", group_idx=1,
                     locality="REMOTE", ownership="OWNED"),
        AllBlocksCleared(),
    ))


_TOKENS = tuple(range(1000, 1050))  # 3 full blocks of 16, and a partial one


def _namespaces() -> list[KeyNamespace]:
    spec = _spec()
    out = []
    for tp_rank in range(2):
        topology = ParallelTopology(tp_size=2, tp_rank=tp_rank)
        for region in ("attn", "state"):
            out.append(namespace_for(spec, region, topology))
    return out


def _block_keys() -> list[BlockKey]:
    hashes = hash_blocks(_TOKENS, 16)
    return [ns.key(h) for ns in _namespaces() for h in hashes]


# ---------------------------------------------------------------- codecs of the vectors


def _pack(value: Any) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def _lines(values: list[str]) -> bytes:
    return "".join(v + "\n" for v in values).encode("utf-8")


def _unlines(data: bytes) -> list[str]:
    return data.decode("utf-8").splitlines()


def _live_frames() -> LiveFrame:
    return LiveFrame(b"kv-events", 42, encode_batch(EventBatch(1.0, (AllBlocksCleared(),), 0)))


def _frames_encode(frame: LiveFrame) -> bytes:
    """The multipart message a PUB socket sends, as a msgpack array of its frames."""
    return _pack(list(pub_frames(frame.topic, frame.seq, frame.payload)))


def _frames_decode(data: bytes) -> LiveFrame:
    return parse_pub_frames(msgpack.unpackb(data, raw=True))


def _replay_stream() -> list[ReplayReply]:
    """What a kvbridge publisher answers to an extension request (current form)."""
    info = ReplayInfo(incarnation=1_767_225_600_000_000_000, oldest_seq=2, next_seq=4,
                      matched=True)
    payload = encode_batch(EventBatch(1.0, (AllBlocksCleared(),), 0))
    return [ReplayReply(info=info), ReplayReply(seq=2, payload=payload, topic=b"kv-events"),
            ReplayReply(seq=3, payload=payload, topic=b"kv-events"), ReplayReply(end=True)]


def _replay_stream_encode(replies: list[ReplayReply], with_topic: bool = True) -> bytes:
    messages: list[list[bytes]] = []
    for reply in replies:
        if reply.info is not None:
            messages.append([REPLAY_MAGIC, encode_replay_info(reply.info)])
        elif reply.end:
            messages.append(list(replay_end_frames(with_topic)))
        else:
            topic = reply.topic if with_topic else None
            messages.append(list(replay_batch_frames(topic, reply.seq, reply.payload)))
    return _pack(messages)


def _replay_stream_decode(data: bytes) -> list[ReplayReply]:
    return [parse_replay_reply(frames) for frames in msgpack.unpackb(data, raw=True)]


def _legacy_replay_stream() -> list[ReplayReply]:
    # Pre-#45177 replies carry no topic frame.
    payload = encode_batch(EventBatch(1.0, (AllBlocksCleared(),), 0))
    return [ReplayReply(seq=7, payload=payload), ReplayReply(end=True)]


def _hash_chain_encode(value: dict[str, Any]) -> bytes:
    lines = [f"root {value['root'].hex()}"]
    lines += [f"block{i} {h.hex()}" for i, h in enumerate(value["blocks"])]
    lines += [f"salted{i} {h.hex()}" for i, h in enumerate(value["salted"])]
    return _lines(lines)


def _hash_chain_decode(data: bytes) -> dict[str, Any]:
    out: dict[str, Any] = {"root": b"", "blocks": [], "salted": []}
    for line in _unlines(data):
        label, digest = line.split(" ")
        if label == "root":
            out["root"] = bytes.fromhex(digest)
        else:
            out["blocks" if label.startswith("block") else "salted"].append(
                bytes.fromhex(digest))
    return out


def _hash_chain() -> dict[str, Any]:
    # The decoded file is compared with these, computed by the current code: a
    # change in HASH_VERSION, the seed, token packing or extra-key packing shows.
    return {"root": root_hash(), "blocks": hash_blocks(_TOKENS, 16),
            "salted": hash_blocks(_TOKENS[:32], 16, extra_keys=("salt", 7, b"mm"),
                                  seed=b"tenant-a")}


# Stored records that name their key: what one kvbridge version writes into a store
# and another reads. A reader compares the key hash in them with the key it asked for.
_RECORD_DIGESTS = (0x0123456789ABCDEF, 0xFEDCBA9876543210)


def _block_header() -> BlockHeader:
    """The fs tier's block header (format 2) without its page padding: the obj tier's
    ``.dg`` object, and the first bytes of every fs block file."""
    key = _block_keys()[0].to_bytes()
    return BlockHeader(block_header_bytes(2), 8192, 2, FileMapper.key_hash_bytes(key),
                       _RECORD_DIGESTS)


def _block_header_encode(header: BlockHeader) -> bytes:
    return encode_block_header(header.block_bytes, header.key_hash, header.num_layers,
                               header.layer_digests)[:compact_header_bytes(header.num_layers)]


def _record() -> dict[str, Any]:
    """The Mooncake store connector's digest record (``D1``) of one block of one namespace."""
    key = digest_key_prefix(_namespaces()[0]) + hash_blocks(_TOKENS, 16)[0].hex()
    return {"magic": b"KVBD", "record_version": 1, "digest_version": DIGEST_VERSION,
            "algorithm": 1, "num_layers": 2, "block_bytes": 4096,
            "key_digest": record_key_digest(key), "layer_digests": _RECORD_DIGESTS}


def _record_encode(value: dict[str, Any]) -> bytes:
    buffer = np.zeros(record_bytes(value["num_layers"]), dtype=np.uint8)
    table = RecordTable(buffer, value["num_layers"], value["block_bytes"], 1,
                        ALGORITHMS[value["algorithm"] - 1])
    table.reset_headers()
    table.write([0], [value["key_digest"]], np.array([value["layer_digests"]], dtype="<u8"))
    return buffer.tobytes()


def _record_decode(data: bytes) -> dict[str, Any]:
    num_layers = (len(data) - 32) // 8
    (record,) = np.frombuffer(data, dtype=record_dtype(num_layers))
    return {"magic": bytes(record["magic"]),
            **{name: int(record[name]) for name in (
                "record_version", "digest_version", "algorithm", "num_layers",
                "block_bytes", "key_digest")},
            "layer_digests": tuple(int(d) for d in record["layer_digests"])}


VECTORS = [
    # handshake
    Vector("handshake_engine_document.hex", _engine, encode_engine, decode_engine),
    Vector("handshake_agent.hex", lambda: _rank(1), encode_agent, decode_agent),
    # a rank whose KV is in CUDA memory: the memory type and device a peer prepares with
    Vector("handshake_agent_vram.hex",
           lambda: dataclasses.replace(_rank(0), mem_type="VRAM", device_id=3), encode_agent,
           decode_agent),
    # a rank that computes block digests for consumers that ask (verified KV)
    Vector("handshake_agent_digests.hex",
           lambda: dataclasses.replace(_rank(1), digests=("xxh3-64",)), encode_agent,
           decode_agent),
    Vector("handshake_request_get.hex",
           lambda: MetadataRequest(17, RequestKind.GET, pp_rank=None, tp_rank=1, pcp_rank=0,
                                   known_incarnation="0123456789abcdef", known_generation=3),
           encode_request, decode_request),
    Vector("handshake_request_get_all.hex", lambda: MetadataRequest(18), encode_request,
           decode_request),
    Vector("handshake_request_ping.hex", lambda: MetadataRequest(19, RequestKind.PING),
           encode_request, decode_request),
    Vector("handshake_reply_metadata.hex",
           lambda: MetadataReply(17, _CLOCK, encode_engine(_engine())), encode_reply,
           decode_reply),
    Vector("handshake_reply_status.hex",
           lambda: StatusReply(18, _CLOCK, "golden-producer", "0123456789abcdef", 3, True),
           encode_reply, decode_reply),
    Vector("handshake_reply_error.hex",
           lambda: ErrorReply(19, _CLOCK, "tp", "rank tp=5 not in this engine", True),
           encode_reply, decode_reply),
    # connector metadata
    Vector("metadata_base.hex", ConnectorMetadata, encode_metadata, decode_metadata,
           _same_base),
    Vector("metadata_nixl.hex", _nixl, encode_metadata, decode_metadata),
    Vector("metadata_mooncake_store.hex", _store, encode_metadata, decode_metadata),
    Vector("metadata_offloading.hex", _offload, encode_metadata, decode_metadata),
    Vector("metadata_shared_storage.hex", _storage, encode_metadata, decode_metadata),
    Vector("metadata_multi.hex", _multi, encode_metadata, decode_metadata, _same_multi),
    # transfer params (the router carries to_dict() as JSON or msgpack)
    Vector("transfer_params_pull.json.txt", _params_pull, lambda p: p.to_json().encode(),
           TransferParams.from_json),
    Vector("transfer_params_push.json.txt", _params_push, lambda p: p.to_json().encode(),
           TransferParams.from_json),
    Vector("transfer_params_pull.msgpack.hex", _params_pull, lambda p: _pack(p.to_dict()),
           lambda data: TransferParams.from_dict(msgpack.unpackb(data, raw=False))),
    Vector("transfer_params_sealed.json.txt", _params_sealed, lambda p: p.to_json().encode(),
           TransferParams.from_json),
    Vector("prompt_chains.txt", _prompt_chains, _chains_text, _chains_parse),
    Vector("nixl_notifications_sealed.hex", _sealed_notifs,
           lambda ms: _pack([notifs.encode(m) for m in ms]),
           lambda data: [notifs.decode(b) for b in msgpack.unpackb(data)]),
    # KV events
    Vector("events_batch_map.hex", _events_batch,
           lambda b: encode_batch(b, EventWireFormat.MAP), decode_batch),
    Vector("events_batch_array.hex", _events_batch,
           lambda b: encode_batch(b, EventWireFormat.ARRAY), decode_batch),
    Vector("events_live_frames.hex", _live_frames, _frames_encode, _frames_decode),
    Vector("events_replay_request_plain.hex", lambda: ReplayRequest(start_seq=5),
           lambda r: encode_seq(r.start_seq), parse_replay_request),
    Vector("events_replay_request_ext.hex",
           lambda: ReplayRequest(start_seq=5, end_seq=9, incarnation=1_767_225_600_000_000_000),
           encode_replay_request, parse_replay_request),
    Vector("events_replay_reply_stream.hex", _replay_stream, _replay_stream_encode,
           _replay_stream_decode),
    Vector("events_replay_reply_legacy.hex", _legacy_replay_stream,
           lambda replies: _replay_stream_encode(replies, with_topic=False),
           _replay_stream_decode),
    Vector("events_replay_info.hex",
           lambda: ReplayInfo(incarnation=1_767_225_600_000_000_000, oldest_seq=2, next_seq=10,
                              matched=True),
           encode_replay_info, decode_replay_info),
    # store keys and block hashes
    Vector("key_namespaces.txt", _namespaces, lambda ns: _lines([n.encode() for n in ns]),
           lambda data: [KeyNamespace.parse(line) for line in _unlines(data)]),
    Vector("block_keys.txt", _block_keys, lambda ks: _lines([k.to_str() for k in ks]),
           lambda data: [BlockKey.from_str(line) for line in _unlines(data)]),
    Vector("block_keys_bytes.hex", lambda: _block_keys()[:2],
           lambda ks: _pack([k.to_bytes() for k in ks]),
           lambda data: [BlockKey.from_bytes(b) for b in msgpack.unpackb(data)]),
    Vector("block_hash_chain.txt", _hash_chain, _hash_chain_encode, _hash_chain_decode),
    # stored digest records, each naming the key it was made for
    Vector("offload_block_header.hex", _block_header, _block_header_encode,
           lambda data: decode_block_header("golden", data)),
    Vector("mooncake_digest_record.hex", _record, _record_encode, _record_decode),
]
_BY_NAME = {v.name: v for v in VECTORS}


# ---------------------------------------------------------------- notifications, control


def _notifs() -> list[notifs.Notif]:
    return [
        notifs.Hello(b"golden-agent-record"),
        notifs.ReadDone("req-1", 1, 2),
        notifs.ReadDone("req-1", 0, 2, read=False),
        notifs.Ack("req-1", 3, True),
        notifs.Ack("req-1", 3, False, "lease expired on producer rank 3"),
        notifs.Heartbeat(("req-1", "req-2")),
        notifs.Register("req-2", 1, 2, (0, 4), ((7, 8, 9), (10,))),
        notifs.Register("req-2", 1, 2, (0, 0), ((), ()), cancel=True),
        notifs.Pushed("req-2", 0, True),
        notifs.Begin("req-1", 1),
        notifs.Held("req-1", 3, True, 29.5),
        notifs.Held("req-1", 3, False, 0.0, "not held (yet)"),
    ]


_TOKEN = "0123456789abcdef" * 4
_CONTROL_LIMITS = control.ControlLimits.for_pools(1024, [16])


def _control() -> list[control.ControlMessage]:
    params = _params_pull()
    return [
        control.Submit((RequestSpec("r-1", (1, 2, 3), max_tokens=2),
                        RequestSpec("r-2", (5, 6), max_tokens=1, transfer_params=params,
                                    cache_salt="tenant-a"))),
        control.Submit((RequestSpec("r-3", (2**63 - 1,), max_tokens=1,
                                    remote_decode=True),), _TOKEN),
        control.Results(_TOKEN),
        control.Abort("r-1", _TOKEN),
        control.Info(), control.Stats(), control.TransferRecords(),
        control.ResetPrefixCache(), control.Shutdown(),
    ]


def _digest_notifs() -> list[notifs.Notif]:
    """The digest fields of ``begin``/``held``: optional, so the kinds
    without them (``nixl_notifications.hex``) are the bytes they always were."""
    return [
        notifs.Begin("req-1", 1, ((3, 4, 5), ()), "xxh3-64"),
        notifs.Held("req-1", 3, True, 29.5, "",
                    (bytes(range(24)), b""), "xxh3-64"),
        notifs.Register("req-2", 1, 2, (0, 4), ((7, 8, 9), (10,)), algorithm="xxh3-64"),
        notifs.Pushed("req-2", 0, True, "", (bytes(range(8, 32)), bytes(8)), "xxh3-64"),
    ]


def _slice_notifs() -> list[notifs.Notif]:
    """Slice digests (head slices at another TP): the same optional fields
    with ``alg = "xxh3-64-slices"`` (asked only of a producer that lists it)."""
    return [
        notifs.Begin("req-3", 0, ((6, 7), (8,)), "xxh3-64-slices"),
        notifs.Held("req-3", 1, True, 29.5, "", (bytes(range(16)), bytes(8)),
                    "xxh3-64-slices"),
        notifs.Register("req-4", 1, 1, (0, 2), ((1, 2), (3,)), algorithm="xxh3-64-slices"),
        notifs.Pushed("req-4", 0, True, "", (bytes(range(16)), bytes(8)), "xxh3-64-slices"),
    ]


VECTORS += [
    # a rank that also takes slice digests (what a current kvbridge with host KV offers)
    Vector("handshake_agent_slices.hex",
           lambda: dataclasses.replace(_rank(0), digests=("xxh3-64", "xxh3-64-slices")),
           encode_agent, decode_agent),
    Vector("nixl_notifications_slices.hex", _slice_notifs,
           lambda ms: _pack([notifs.encode(m) for m in ms]),
           lambda data: [notifs.decode(b) for b in msgpack.unpackb(data)]),
]

VECTORS += [
    Vector("nixl_notifications.hex", _notifs,
           lambda ms: _pack([notifs.encode(m) for m in ms]),
           lambda data: [notifs.decode(b) for b in msgpack.unpackb(data)]),
    Vector("nixl_notifications_digests.hex", _digest_notifs,
           lambda ms: _pack([notifs.encode(m) for m in ms]),
           lambda data: [notifs.decode(b) for b in msgpack.unpackb(data)]),
    Vector("control_messages.hex", _control,
           lambda ms: _pack([control.encode_message(m) for m in ms]),
           lambda data: [control.decode_frames([b], _CONTROL_LIMITS)
                         for b in msgpack.unpackb(data)]),
]


# ----------------------------------------------------- sealed messages (the cluster secret)

_SEAL_SECRET = Secret.from_value("golden-cluster-secret-0123456789", "golden")
_SEAL_LABELS = [Label.SIDE_CHANNEL, Label.CONTROL, Label.EVENTS_REPLAY, Label.NIXL_HELLO]


def _sealed() -> list[tuple[bytes, bytes, int, bytes]]:
    """(label, body, sent_ms, nonce) of one request per socket, then a side-channel reply
    bound to the first request's nonce (label "side-channel/reply")."""
    rows = [(label.value, f"body of {label.value.decode()}".encode(), 1_767_225_600_000 + i,
             bytes([i]) * 16) for i, label in enumerate(_SEAL_LABELS)]
    return [*rows, (b"side-channel/reply", b"reply body", 1_767_225_600_100, bytes([9]) * 16)]


def _seal_encode(rows: list[tuple[bytes, bytes, int, bytes]]) -> bytes:
    bound = [b""] * len(_SEAL_LABELS) + [rows[0][3]]
    return _pack([seal(_SEAL_SECRET, label, body, bound=b, sent_ms=sent, nonce=nonce)[0]
                  for (label, body, sent, nonce), b in zip(rows, bound, strict=True)])


def _seal_decode(data: bytes) -> list[tuple[bytes, bytes, int, bytes]]:
    wires = msgpack.unpackb(data)
    labels = [label.value for label in _SEAL_LABELS] + [b"side-channel/reply"]
    bound = [b""] * len(_SEAL_LABELS)
    out = []
    for wire, label in zip(wires, labels, strict=True):
        opened = open_sealed(_SEAL_SECRET, label, wire,
                             bound=bound[0] if len(out) < len(bound) else out[0][3])
        out.append((label, opened.body, opened.sent_ms, opened.nonce))
    return out


VECTORS += [Vector("auth_sealed.hex", _sealed, _seal_encode, _seal_decode)]
_BY_NAME = {v.name: v for v in VECTORS}


# ---------------------------------------------------------------- file format


def _to_file(name: str, data: bytes) -> str:
    if name.endswith(".hex"):
        hexed = data.hex()
        return "".join(hexed[i:i + 64] + "\n" for i in range(0, len(hexed), 64))
    return data.decode("utf-8")


def _from_file(name: str, text: str) -> bytes:
    if name.endswith(".hex"):
        return bytes.fromhex("".join(text.split()))
    return text.encode("utf-8")


def _golden(vector: Vector, encoded: bytes) -> bytes:
    path = VECTORS_DIR / vector.name
    if REGEN:
        # A regeneration is a wire-version change (module docstring).
        VECTORS_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(_to_file(vector.name, encoded), encoding="utf-8")
    if not path.exists():
        raise AssertionError(
            f"{path} is missing: a new vector is created with KVBRIDGE_REGEN_GOLDEN=1 "
            f"(and checked in)")
    return _from_file(vector.name, path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("vector", VECTORS, ids=[v.name for v in VECTORS])
def test_golden_vector(vector: Vector) -> None:
    value = vector.value()
    encoded = vector.encode(value)
    golden = _golden(vector, encoded)
    assert encoded == golden, (
        f"{vector.name}: this kvbridge encodes the reference value differently from the "
        f"checked-in bytes, so peers on other versions disagree with it. If the change is "
        f"deliberate, bump the format's version and regenerate (KVBRIDGE_REGEN_GOLDEN=1).")
    decoded = vector.decode(golden)
    assert vector.same(decoded, value), (
        f"{vector.name}: the checked-in bytes decode to another value")
    assert vector.encode(decoded) == golden, f"{vector.name}: decode+encode is not the identity"


def test_every_vector_file_is_checked() -> None:
    """A stale file left behind by a removed vector would be silently unchecked."""
    names = {v.name for v in VECTORS}
    assert len(names) == len(VECTORS)
    on_disk = {p.name for p in VECTORS_DIR.iterdir() if p.is_file()}
    # block digests are not a message: tests/layouts/test_digests.py and
    # test_torch_digests.py check their files (test_slice_digests.py the slice digests',
    # both algorithms)
    assert on_disk - {"block_digests.txt", "block_digests_torch_mix64.txt",
                      "slice_digests.txt", "slice_digests_torch_mix64.txt"} == names


def test_events_vectors_are_the_formats_vllm_reads() -> None:
    """The two event forms differ where they must: tagged maps vs positional arrays."""
    batch = _events_batch()
    as_map = msgpack.unpackb(_golden(_BY_NAME["events_batch_map.hex"],
                                     encode_batch(batch, EventWireFormat.MAP)))
    as_array = msgpack.unpackb(_golden(_BY_NAME["events_batch_array.hex"],
                                       encode_batch(batch, EventWireFormat.ARRAY)))
    assert as_map[0] == as_array[0] == batch.ts and as_map[2] == as_array[2] == 1
    assert [e["type"] for e in as_map[1]] == [e[0] for e in as_array[1]] == [
        "BlockStored", "BlockStored", "BlockStored", "BlockRemoved", "BlockRemoved",
        "AllBlocksCleared"]
    # omit_defaults: the first event has none of the optional fields set.
    assert "extra_keys" not in as_map[1][0] and len(as_array[1][0]) == 12


def test_transfer_params_json_is_what_a_router_forwards() -> None:
    text = _golden(_BY_NAME["transfer_params_pull.json.txt"], _params_pull().to_json().encode())
    data = json.loads(text)
    assert list(data)[0] == "version" and data["version"] == 2 and data["mode"] == "pull"


def test_the_stored_records_name_the_key_they_were_made_for() -> None:
    """A reader of the checked-in record accepts it for its own key only."""
    value = _record()
    golden = _golden(_BY_NAME["mooncake_digest_record.hex"], _record_encode(value))
    table = RecordTable(np.frombuffer(bytearray(golden), dtype=np.uint8), 2, 4096, 1)
    digests = np.array([value["layer_digests"]], dtype="<u8")
    assert table.failures([0], [value["key_digest"]], digests) == []
    other = digest_key_prefix(_namespaces()[0]) + hash_blocks(_TOKENS, 16)[1].hex()
    ((_, check),) = table.failures([0], [record_key_digest(other)], digests)
    assert check.verdict is RecordVerdict.FOREIGN
    header = decode_block_header("golden", _golden(_BY_NAME["offload_block_header.hex"],
                                                   _block_header_encode(_block_header())))
    assert header.key_hash == FileMapper.key_hash_bytes(_block_keys()[0].to_bytes())
    assert header.key_hash != FileMapper.key_hash_bytes(_block_keys()[1].to_bytes())
