"""The wire format: round trips, vLLM byte compatibility, validation errors."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from kvbridge.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    EventWireFormat,
    Locality,
    Medium,
    decode_batch,
    encode_batch,
)
from kvbridge.events.wire import (
    END_SEQ,
    MAX_EXTRA_KEYS_DEPTH,
    REPLAY_MAGIC,
    ReplayInfo,
    ReplayRequest,
    decode_seq,
    encode_replay_info,
    encode_replay_request,
    encode_seq,
    parse_pub_frames,
    parse_replay_reply,
    parse_replay_request,
)
from tests.conftest import missing_backend

U64_MAX = (1 << 64) - 1


def every_event_type() -> list[Any]:
    """One of each event type, with optional fields both unset and set."""
    return [
        BlockStored(
            block_hashes=(1, U64_MAX),
            parent_block_hash=None,
            token_ids=tuple(range(32)),
            block_size=16,
        ),
        BlockStored(
            block_hashes=(b"\x01" * 32,),
            parent_block_hash=b"\x02" * 32,
            token_ids=tuple(range(16)),
            block_size=16,
            lora_id=3,
            medium=Medium.CPU,
            lora_name="adapter-a",
            extra_keys=(("salt",), None),
            group_idx=1,
            kv_cache_spec_kind="full_attention",
            kv_cache_spec_sliding_window=128,
            locality=Locality.REMOTE,
            ownership="fs",
        ),
        BlockStored(
            block_hashes=(7,),
            parent_block_hash=6,
            token_ids=(),
            block_size=16,
            medium=Medium.STORAGE,
            locality=Locality.LOCAL,
        ),
        BlockRemoved(block_hashes=(1, 2, 3)),
        BlockRemoved(block_hashes=(9,), medium=Medium.STORAGE, group_idx=2, locality="LOCAL"),
        AllBlocksCleared(),
    ]


@pytest.mark.parametrize("wire_format", list(EventWireFormat))
def test_round_trip_every_event_type(wire_format: EventWireFormat) -> None:
    batch = EventBatch(ts=1234.5, events=tuple(every_event_type()), data_parallel_rank=3)
    decoded = decode_batch(encode_batch(batch, wire_format))
    assert decoded == batch
    assert decoded.events[1].medium == "CPU" and decoded.events[1].locality == "REMOTE"


def test_enum_fields_travel_as_plain_strings() -> None:
    event = BlockRemoved(block_hashes=(1,), medium=Medium.CPU, locality=Locality.LOCAL)
    assert type(event.medium) is str and type(event.locality) is str
    raw = msgpack.unpackb(encode_batch(EventBatch(0.0, (event,), 0)))
    assert raw[1][0]["medium"] == "CPU" and raw[1][0]["locality"] == "LOCAL"


# ---------------------------------------------------------------- independent decoder


def vllm_layout_decode(payload: bytes) -> dict[str, Any]:
    """A decoder written from vLLM's field layout only (not kvbridge's code):
    batch = [ts, events, dp_rank]; an event is a map with a "type" key (vLLM >=
    #42892) or an array whose first element is the tag (older vLLM)."""
    ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
    stored_fields = [
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
    ]
    removed_fields = ["block_hashes", "medium", "group_idx", "locality", "ownership"]
    out = []
    for event in events:
        if isinstance(event, dict):
            out.append(dict(event))
            continue
        tag, values = event[0], event[1:]
        names = {"BlockStored": stored_fields, "BlockRemoved": removed_fields}.get(tag, [])
        out.append({"type": tag, **dict(zip(names, values, strict=False))})
    return {"ts": ts, "events": out, "data_parallel_rank": dp_rank}


@pytest.mark.parametrize("wire_format", list(EventWireFormat))
def test_independent_decoder_reads_vllm_layout(wire_format: EventWireFormat) -> None:
    events = every_event_type()
    got = vllm_layout_decode(encode_batch(EventBatch(2.0, tuple(events), 0), wire_format))
    assert got["ts"] == 2.0 and got["data_parallel_rank"] == 0
    stored, full, storage, removed, removed2, cleared = got["events"]
    assert stored["type"] == "BlockStored"
    assert stored["block_hashes"] == [1, U64_MAX]
    assert stored["parent_block_hash"] is None
    assert stored["token_ids"] == list(range(32)) and stored["block_size"] == 16
    assert stored["lora_id"] is None and stored["medium"] == "GPU" and stored["lora_name"] is None
    assert full["medium"] == "CPU" and full["group_idx"] == 1 and full["locality"] == "REMOTE"
    assert full["kv_cache_spec_kind"] == "full_attention"
    assert full["kv_cache_spec_sliding_window"] == 128 and full["ownership"] == "fs"
    assert full["block_hashes"] == [b"\x01" * 32] and full["parent_block_hash"] == b"\x02" * 32
    assert storage["medium"] == "STORAGE" and storage["locality"] == "LOCAL"
    assert removed["type"] == "BlockRemoved" and removed["block_hashes"] == [1, 2, 3]
    assert removed2["group_idx"] == 2 and removed2["locality"] == "LOCAL"
    assert cleared["type"] == "AllBlocksCleared"
    if wire_format is EventWireFormat.MAP:
        # omit_defaults: optional fields that are None do not appear at all.
        assert "group_idx" not in stored and "locality" not in stored
        assert set(removed) == {"type", "block_hashes", "medium"}


# ---------------------------------------------------------------- msgspec oracle


try:
    import msgspec
except ImportError:  # the oracle tests skip; the independent decoder above still runs
    msgspec = None

if msgspec is not None:
    # vLLM's structs as of main 2026-09 (map events, array batch). Module level:
    # msgspec resolves the (string) annotations through module globals.

    class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class VKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        pass

    class VBlockStored(VKVCacheEvent, tag="BlockStored"):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
        pass

    class VKVEventBatch(VEventBatch):
        events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]

    # vLLM before #42892: array_like events (fields through #40984).

    class LKVCacheEvent(
        msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True
    ):
        pass

    class LBlockStored(LKVCacheEvent, tag="BlockStored"):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class LBlockRemoved(LKVCacheEvent, tag="BlockRemoved"):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None

    class LAllBlocksCleared(LKVCacheEvent, tag="AllBlocksCleared"):
        pass

    class LKVEventBatch(VEventBatch):
        events: list[LBlockStored | LBlockRemoved | LAllBlocksCleared]


def _vllm_structs() -> dict[str, Any]:
    if msgspec is None:
        missing_backend("msgspec (the vLLM wire oracle) not installed: pip install msgspec "
                        "(test extra)")
    return {"msgspec": msgspec, "Batch": VKVEventBatch, "Stored": VBlockStored,
            "Removed": VBlockRemoved, "Cleared": VAllBlocksCleared}


def _legacy_vllm_structs() -> dict[str, Any]:
    if msgspec is None:
        missing_backend("msgspec (the vLLM wire oracle) not installed: pip install msgspec "
                        "(test extra)")
    return {"msgspec": msgspec, "Batch": LKVEventBatch, "Stored": LBlockStored,
            "Removed": LBlockRemoved, "Cleared": LAllBlocksCleared}


def _to_vllm(structs: dict[str, Any], event: Any, legacy: bool = False) -> Any:
    if isinstance(event, BlockStored):
        kwargs: dict[str, Any] = dict(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=None if event.extra_keys is None else list(event.extra_keys),
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
        )
        if not legacy:
            kwargs.update(locality=event.locality, ownership=event.ownership)
        return structs["Stored"](**kwargs)
    if isinstance(event, BlockRemoved):
        kwargs = dict(block_hashes=list(event.block_hashes), medium=event.medium,
                      group_idx=event.group_idx)
        if not legacy:
            kwargs.update(locality=event.locality, ownership=event.ownership)
        return structs["Removed"](**kwargs)
    return structs["Cleared"]()


def test_map_encoding_is_byte_identical_to_vllm_msgspec() -> None:
    structs = _vllm_structs()
    events = every_event_type()
    ours = encode_batch(EventBatch(1.25, tuple(events), 0), EventWireFormat.MAP)
    theirs = structs["msgspec"].msgpack.encode(
        structs["Batch"](ts=1.25, events=[_to_vllm(structs, e) for e in events],
                         data_parallel_rank=0)
    )
    assert ours == theirs


def test_vllm_msgspec_decoder_reads_our_map_batches() -> None:
    structs = _vllm_structs()
    events = every_event_type()
    payload = encode_batch(EventBatch(9.0, tuple(events), 1), EventWireFormat.MAP)
    decoded = structs["msgspec"].msgpack.decode(payload, type=structs["Batch"])
    assert decoded.ts == 9.0 and decoded.data_parallel_rank == 1
    assert [type(e).__name__ for e in decoded.events] == [
        "VBlockStored", "VBlockStored", "VBlockStored", "VBlockRemoved", "VBlockRemoved",
        "VAllBlocksCleared",
    ]
    assert decoded.events[1].locality == "REMOTE" and decoded.events[1].group_idx == 1
    assert decoded.events[0].block_hashes == [1, U64_MAX]
    # ... and kvbridge reads what vLLM's own encoder writes.
    again = structs["msgspec"].msgpack.encode(decoded)
    assert decode_batch(again) == EventBatch(9.0, tuple(events), 1)


def test_legacy_array_encoding_matches_old_vllm() -> None:
    structs = _legacy_vllm_structs()
    msgspec = structs["msgspec"]
    # Without the post-array-era fields the bytes are identical ...
    plain = [e for e in every_event_type() if getattr(e, "locality", None) is None
             and getattr(e, "ownership", None) is None]
    ours = encode_batch(EventBatch(3.0, tuple(plain), 0), EventWireFormat.ARRAY)
    theirs = msgspec.msgpack.encode(
        structs["Batch"](ts=3.0, events=[_to_vllm(structs, e, legacy=True) for e in plain],
                         data_parallel_rank=0)
    )
    assert ours == theirs
    # ... and with locality/ownership appended an old decoder still reads them.
    payload = encode_batch(EventBatch(3.0, tuple(every_event_type()), 0), EventWireFormat.ARRAY)
    decoded = msgspec.msgpack.decode(payload, type=structs["Batch"])
    assert len(decoded.events) == 6 and decoded.events[1].group_idx == 1


def test_map_events_with_unknown_keys_are_tolerated() -> None:
    payload = msgpack.packb(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU", "future": 1}], 0]
    )
    assert decode_batch(payload).events == (BlockRemoved(block_hashes=(5,), medium="CPU"),)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        (b"\xc1", "payload"),
        (msgpack.packb({"x": 1}), "payload.ts"),
        (msgpack.packb([1.0]), "payload"),
        (msgpack.packb(["x", [], 0]), "payload.ts"),
        (msgpack.packb([1.0, "nope", 0]), "payload.events"),
        (msgpack.packb([1.0, [], "r"]), "payload.data_parallel_rank"),
        (msgpack.packb([1.0, [{"block_hashes": [1]}], 0]), "events[0].type"),
        (msgpack.packb([1.0, [{"type": "Nope"}], 0]), "events[0].type"),
        (msgpack.packb([1.0, [{"type": "BlockRemoved"}], 0]), "events[0].block_hashes"),
        (
            msgpack.packb([1.0, [["AllBlocksCleared"], ["BlockRemoved", [1, "h"], None]], 0]),
            "events[1].block_hashes[1]",
        ),
        (
            msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                  "parent_block_hash": None, "token_ids": [1, 2.5],
                                  "block_size": 2}], 0]),
            "events[0].token_ids[1]",
        ),
        (
            msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                  "parent_block_hash": None, "token_ids": [],
                                  "block_size": "16"}], 0]),
            "events[0].block_size",
        ),
        (
            msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                  "parent_block_hash": None, "token_ids": [],
                                  "block_size": 16, "medium": 3}], 0]),
            "events[0].medium",
        ),
    ],
)
def test_decode_errors_name_the_field(payload: bytes, field: str) -> None:
    with pytest.raises(EventDecodeError) as info:
        decode_batch(payload)
    assert info.value.field == field


def _deep(depth: int, as_map: bool) -> Any:
    """An ``extra_keys`` value nesting ``depth`` levels (itself the first)."""
    value: Any = "x"
    for _ in range(depth - 1):
        value = {"k": value} if as_map else [value]
    return [value]


@pytest.mark.parametrize("as_map", [False, True], ids=["arrays", "maps"])
@pytest.mark.parametrize("event_form", ["map", "array"])
def test_extra_keys_nesting_is_bounded(as_map: bool, event_form: str) -> None:
    """Nested beyond MAX_EXTRA_KEYS_DEPTH: a decode error naming the field, in both
    event encodings, arrays or maps inside (600 levels raised RecursionError)."""
    def payload(depth: int) -> bytes:
        extra = _deep(depth, as_map)
        if event_form == "map":
            event: Any = {"type": "BlockStored", "block_hashes": [1],
                          "parent_block_hash": None, "token_ids": [], "block_size": 16,
                          "extra_keys": extra}
        else:
            event = ["BlockStored", [1], None, [], 16, None, None, None, extra]
        return msgpack.packb([1.0, [["AllBlocksCleared"], event], 0], use_bin_type=True)

    assert decode_batch(payload(MAX_EXTRA_KEYS_DEPTH)).events[1].extra_keys is not None
    for depth in (MAX_EXTRA_KEYS_DEPTH + 1, 600):
        with pytest.raises(EventDecodeError) as info:
            decode_batch(payload(depth))
        assert info.value.field == "events[1].extra_keys"
        assert f"deeper than {MAX_EXTRA_KEYS_DEPTH} levels" in info.value.reason


# ---------------------------------------------------------------- frames


def test_seq_frames() -> None:
    assert encode_seq(1) == b"\x00" * 7 + b"\x01"
    assert encode_seq(END_SEQ) == b"\xff" * 8
    assert decode_seq(encode_seq(2**40)) == 2**40
    with pytest.raises(EventDecodeError):
        decode_seq(b"\x00")
    live = parse_pub_frames([b"kv", encode_seq(5), b"p"])
    assert (live.topic, live.seq, live.payload) == (b"kv", 5, b"p")
    with pytest.raises(EventDecodeError):
        parse_pub_frames([b"kv", encode_seq(5)])


def test_replay_request_forms() -> None:
    # vLLM's: the 8-byte start sequence.
    assert parse_replay_request(encode_seq(17)) == ReplayRequest(start_seq=17)
    ext = ReplayRequest(start_seq=3, end_seq=9, incarnation=42)
    frame = encode_replay_request(ext)
    assert frame.startswith(REPLAY_MAGIC) and len(frame) != 8
    assert parse_replay_request(frame) == ext
    # A vLLM publisher reads the extension frame as a sequence it never reached.
    assert int.from_bytes(frame, "big") > 2**63
    with pytest.raises(EventDecodeError):
        parse_replay_request(b"\x00\x01")


def test_replay_reply_forms() -> None:
    info = ReplayInfo(incarnation=7, oldest_seq=2, next_seq=10, matched=True)
    assert parse_replay_reply([REPLAY_MAGIC, encode_replay_info(info)]).info == info
    with_topic = parse_replay_reply([b"kv", encode_seq(4), b"payload"])
    assert (with_topic.seq, with_topic.payload, with_topic.topic) == (4, b"payload", b"kv")
    legacy = parse_replay_reply([encode_seq(4), b"payload"])
    assert (legacy.seq, legacy.topic) == (4, None)
    assert parse_replay_reply([b"", encode_seq(END_SEQ), b""]).end
    assert parse_replay_reply([encode_seq(END_SEQ), b""]).end
    with pytest.raises(EventDecodeError):
        parse_replay_reply([b"a", b"b", b"c", b"d"])


def test_extra_keys_maps_whose_keys_collide_as_strings_decode() -> None:
    # keys 0 and "0" both freeze to "0"; their values (True, None) do not compare: the
    # decoder sorted (key, value) pairs and raised TypeError on one hostile batch
    payload = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                    "parent_block_hash": None, "token_ids": [1],
                                    "block_size": 1, "extra_keys": [{"0": True, 0: None}]}],
                             0])
    (event,) = decode_batch(payload).events
    assert event.extra_keys == ((("0", True), ("0", None)),)
