"""The KV-event wire format, byte-compatible with vLLM's ZMQ event publisher.

Pure functions only (no sockets): encode/decode a batch, build/parse frames.

Followed revision
-----------------
vLLM ``main`` as of 2026-09 (``vllm/distributed/kv_events.py``), i.e. after

- PR #42892 (merged 2026-06-09, released in v0.23+): event structs dropped
  ``array_like=True``; each event is a msgpack **map** tagged by a ``"type"`` key,
  encoded by msgspec with ``omit_defaults=True``; the outer ``EventBatch`` stays a
  positional array ``[ts, events, data_parallel_rank]``;
- PR #48281 (v0.26) ``locality`` and PR #52067 ``ownership`` as trailing optional
  fields of ``BlockStored``/``BlockRemoved``; PR #48123 ``medium="STORAGE"``;
- PR #45177 (merged 2026-06-10): replay replies carry the topic frame.

``EventWireFormat.ARRAY`` produces the older encoding (vLLM before #42892):
each event a positional array whose first element is the tag, every field
present, as msgspec encodes ``array_like`` structs. kvbridge's decoder reads both.

Encoding (MAP, the default)::

    multipart  [topic, seq (8-byte big-endian signed), payload]
    payload    [ts: float64, events: [event...], data_parallel_rank: int | nil]
    BlockStored   {"type": "BlockStored", "block_hashes", "parent_block_hash",
                   "token_ids", "block_size", "lora_id", "medium", "lora_name",
                   then only when not None: "extra_keys", "group_idx",
                   "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                   "locality", "ownership"}
    BlockRemoved  {"type": "BlockRemoved", "block_hashes", "medium",
                   then only when not None: "group_idx", "locality", "ownership"}
    AllBlocksCleared {"type": "AllBlocksCleared"}

Keys appear in declaration order, so the bytes equal msgspec's encoding of
vLLM's own structs (tests check this against msgspec).

Speed: MAP batches are encoded by msgspec, and decoded and type-checked by
msgspec into typed structs (C, no per-field Python); batches with ``extra_keys``
are too when every ``extra_keys`` value is an array of nil, scalars and arrays of
them, at most 3 levels deep, without maps or bin values (what vLLM and kvbridge's
engine send: a cache salt, LoRA name or multimodal hashes per block), which
msgspec hands over as the tuples the Python checks freeze them into. Anything
those typed decoders reject (maps, bin values or deeper nesting in ``extra_keys``
included) and the ARRAY encoding
go through the Python checks below, which stay the reference: they produce every
error message, and tests check that the paths accept the same batches with the
same values.
Block hashes are ints (uint64) or bytes (msgpack bin). ``extra_keys`` may nest
arrays/maps at most ``MAX_EXTRA_KEYS_DEPTH`` (32) levels deep; deeper is a decode
error naming the field (the whole batch is rejected). Reference bytes of every
form live in ``tests/golden/vectors/events_*``.

Replay (vLLM protocol): a client (REQ or DEALER) sends one frame, the 8-byte
start sequence; the publisher's ROUTER answers ``[topic, seq, payload]`` for
every buffered batch with ``seq >= start``, then ``[b"", END_SEQ, b""]``
(``END_SEQ`` = -1). ``replay_includes_topic=False`` gives the pre-#45177 replies
``[seq, payload]`` / ``[END_SEQ, b""]``.

kvbridge extension (incarnations): a request frame that starts with
``REPLAY_MAGIC`` followed by a msgpack map ``{"incarnation", "start_seq",
"end_seq"}``. A kvbridge publisher first answers ``[REPLAY_MAGIC, info]`` where
``info`` is ``{"incarnation", "oldest_seq", "next_seq", "matched"}``, then (only
when ``matched``) the batches in ``[start_seq, end_seq)`` and the end marker. A
vLLM publisher reads the frame as a huge start sequence and answers with the
end marker alone, which tells the client to fall back to the plain protocol.
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import msgspec

from .errors import EventDecodeError
from .schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    freeze_value,
)

SEQ_BYTES = 8
END_SEQ = -1
END_SEQ_BYTES = END_SEQ.to_bytes(SEQ_BYTES, "big", signed=True)
#: Starts every kvbridge replay-extension frame. The leading NUL keeps it apart
#: from any plausible topic and makes vLLM read it as an out-of-range sequence.
REPLAY_MAGIC = b"\x00kvbridge-replay/1"

TAG_KEY = "type"
_U64_MAX = (1 << 64) - 1


class EventWireFormat(enum.Enum):
    """How events inside a batch are encoded."""

    MAP = "map"  # vLLM >= PR #42892 (v0.23+): tagged maps, omit defaults
    ARRAY = "array"  # vLLM before PR #42892: tagged positional arrays


# ---------------------------------------------------------------- sequence numbers


def encode_seq(seq: int) -> bytes:
    """8-byte big-endian signed, as vLLM writes it (``seq.to_bytes(8, "big")``)."""
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def decode_seq(frame: bytes, field: str = "seq") -> int:
    if len(frame) != SEQ_BYTES:
        raise EventDecodeError(field, f"expected {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


# ---------------------------------------------------------------- encoding


def _stored_map(event: BlockStored) -> dict[str, Any]:
    out: dict[str, Any] = {
        TAG_KEY: "BlockStored",
        "block_hashes": list(event.block_hashes),
        "parent_block_hash": event.parent_block_hash,
        "token_ids": list(event.token_ids),
        "block_size": event.block_size,
        "lora_id": event.lora_id,
        "medium": event.medium,
        "lora_name": event.lora_name,
    }
    # Fields with a default in vLLM's struct: omitted when None (omit_defaults).
    for name in (
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
    ):
        value = getattr(event, name)
        if value is not None:
            out[name] = value
    return out


def _removed_map(event: BlockRemoved) -> dict[str, Any]:
    out: dict[str, Any] = {
        TAG_KEY: "BlockRemoved",
        "block_hashes": list(event.block_hashes),
        "medium": event.medium,
    }
    for name in ("group_idx", "locality", "ownership"):
        value = getattr(event, name)
        if value is not None:
            out[name] = value
    return out


def _stored_array(event: BlockStored) -> list[Any]:
    # Every field of the last array-era struct (through sliding_window), as msgspec
    # writes array_like structs; locality/ownership postdate that era and are
    # appended only when set (array decoders ignore extra trailing elements).
    out: list[Any] = [
        "BlockStored",
        list(event.block_hashes),
        event.parent_block_hash,
        list(event.token_ids),
        event.block_size,
        event.lora_id,
        event.medium,
        event.lora_name,
        event.extra_keys,
        event.group_idx,
        event.kv_cache_spec_kind,
        event.kv_cache_spec_sliding_window,
    ]
    if event.locality is not None or event.ownership is not None:
        out.append(event.locality)
    if event.ownership is not None:
        out.append(event.ownership)
    return out


def _removed_array(event: BlockRemoved) -> list[Any]:
    out: list[Any] = ["BlockRemoved", list(event.block_hashes), event.medium, event.group_idx]
    if event.locality is not None or event.ownership is not None:
        out.append(event.locality)
    if event.ownership is not None:
        out.append(event.ownership)
    return out


def event_to_wire(event: KVEvent, wire_format: EventWireFormat = EventWireFormat.MAP) -> Any:
    """The msgpack-ready object for one event."""
    if wire_format is EventWireFormat.MAP:
        if isinstance(event, BlockStored):
            return _stored_map(event)
        if isinstance(event, BlockRemoved):
            return _removed_map(event)
        if isinstance(event, AllBlocksCleared):
            return {TAG_KEY: "AllBlocksCleared"}
    else:
        if isinstance(event, BlockStored):
            return _stored_array(event)
        if isinstance(event, BlockRemoved):
            return _removed_array(event)
        if isinstance(event, AllBlocksCleared):
            return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {type(event).__name__}")


# The MAP encoding is produced by msgspec from these structs: they declare vLLM's
# fields in vLLM's order with vLLM's defaults (the first seven BlockStored fields
# and BlockRemoved's medium have none, so they are always written; the rest are
# omitted when None), which is exactly ``event_to_wire``'s map, encoded in C.


class _EncStored(msgspec.Struct, tag_field=TAG_KEY, tag="BlockStored", omit_defaults=True,
                 gc=False):
    block_hashes: Any
    parent_block_hash: Any
    token_ids: Any
    block_size: Any
    lora_id: Any
    medium: Any
    lora_name: Any
    extra_keys: Any = None
    group_idx: Any = None
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: Any = None
    locality: Any = None
    ownership: Any = None


class _EncRemoved(msgspec.Struct, tag_field=TAG_KEY, tag="BlockRemoved", omit_defaults=True,
                  gc=False):
    block_hashes: Any
    medium: Any
    group_idx: Any = None
    locality: Any = None
    ownership: Any = None


class _EncCleared(msgspec.Struct, tag_field=TAG_KEY, tag="AllBlocksCleared", gc=False):
    pass


_ENC_CLEARED = _EncCleared()
_MSGSPEC_ENCODER = msgspec.msgpack.Encoder()
_STORED_ATTRS = operator.attrgetter(
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "ownership",
)
_REMOVED_ATTRS = operator.attrgetter("block_hashes", "medium", "group_idx", "locality",
                                     "ownership")


def _enc_structs(events: Sequence[KVEvent]) -> list[Any]:
    out: list[Any] = []
    append = out.append
    for event in events:
        kind = type(event)
        if kind is BlockStored:
            append(_EncStored(*_STORED_ATTRS(event)))
        elif kind is BlockRemoved:
            append(_EncRemoved(*_REMOVED_ATTRS(event)))
        elif kind is AllBlocksCleared:
            append(_ENC_CLEARED)
        else:
            append(event_to_wire(event))  # a subclass: the generic path (or its TypeError)
    return out


def encode_events(
    ts: float,
    events: Sequence[KVEvent],
    data_parallel_rank: int | None,
    wire_format: EventWireFormat = EventWireFormat.MAP,
) -> bytes:
    """The msgpack payload ``[ts, [event...], data_parallel_rank]``."""
    if wire_format is EventWireFormat.MAP:
        return _MSGSPEC_ENCODER.encode(
            (float(ts), _enc_structs(events), data_parallel_rank)
        )
    return msgpack.packb(
        [float(ts), [event_to_wire(e, wire_format) for e in events], data_parallel_rank],
        use_bin_type=True,
    )


def encode_batch(batch: EventBatch, wire_format: EventWireFormat = EventWireFormat.MAP) -> bytes:
    return encode_events(batch.ts, batch.events, batch.data_parallel_rank, wire_format)


# ---------------------------------------------------------------- decoding


# Field paths are built only when an error is raised: decoding is on the hot path.
# Type checks of whole arrays run in C: ``{int}.issuperset(map(type, values))``
# (exact types, so bool and float token ids are rejected).
_INT_TYPE = frozenset((int,))
_HASH_TYPES = frozenset((int, bytes))


def _path(where: str, name: str) -> str:
    if not where:
        return name
    return f"{where}.{name}" if name else where


def _check_hash(value: object, where: str, name: str) -> int | bytes:
    if type(value) is int or type(value) is bytes:
        return value
    raise EventDecodeError(
        _path(where, name), f"expected int or bytes block hash, got {type(value).__name__}"
    )


def _typed_array(value: object, where: str, name: str, what: str,
                 item_types: frozenset[type], item: str) -> tuple[Any, ...]:
    """``value`` as a tuple when it is an array of exactly ``item_types``.

    The error names the array (``expected array of <what>``) or its first bad
    element (``<name>[i]: expected <item>``). msgpack cannot carry ints beyond
    64 bits, so the type check is the whole check.
    """
    if type(value) is not tuple and type(value) is not list:
        raise EventDecodeError(
            _path(where, name), f"expected array of {what}, got {type(value).__name__}"
        )
    if item_types.issuperset(map(type, value)):
        return tuple(value)
    for i, element in enumerate(value):
        if type(element) not in item_types:
            raise EventDecodeError(
                _path(where, f"{name}[{i}]"), f"expected {item}, got {type(element).__name__}"
            )
    raise AssertionError("unreachable")


def _hashes(value: object, where: str, name: str) -> tuple[int | bytes, ...]:
    return _typed_array(value, where, name, "block hashes", _HASH_TYPES,
                        "int or bytes block hash")


def _int(value: object, where: str, name: str, optional: bool = False) -> int | None:
    if type(value) is int or (value is None and optional):
        return value
    want = "int or nil" if optional else "int"
    raise EventDecodeError(_path(where, name), f"expected {want}, got {type(value).__name__}")


def _str(value: object, where: str, name: str) -> str | None:
    if value is None or type(value) is str:
        return value
    raise EventDecodeError(_path(where, name), f"expected str or nil, got {type(value).__name__}")


def _token_ids(value: object, where: str, name: str) -> tuple[int, ...]:
    return _typed_array(value, where, name, "token ids", _INT_TYPE, "int")


#: Deepest array/map nesting accepted in ``extra_keys`` (the field itself is level 1).
#: vLLM sends a list of per-block key tuples (depth 2 or 3); a hostile peer could
#: nest hundreds of levels deep, and freezing such a value recursively would raise
#: ``RecursionError`` instead of a decode error. The bound is checked without
#: recursion before anything recurses.
MAX_EXTRA_KEYS_DEPTH = 32


def _check_nesting(value: object, where: str, name: str, limit: int) -> None:
    """Raise ``EventDecodeError`` when arrays/maps in ``value`` nest deeper than ``limit``."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        kind = type(item)
        if kind is tuple or kind is list:
            children: Any = item
        elif kind is dict:
            assert isinstance(item, dict)
            children = [part for pair in item.items() for part in pair]
        else:
            continue
        if depth > limit:
            raise EventDecodeError(
                _path(where, name),
                f"nested deeper than {limit} levels of arrays/maps; the batch is rejected "
                "(check the publisher's extra_keys)",
            )
        stack.extend((child, depth + 1) for child in children)


def _extra_keys(value: object, where: str, name: str) -> tuple[object, ...] | None:
    if value is None:
        return None
    if type(value) is not tuple and type(value) is not list:
        raise EventDecodeError(_path(where, name), f"expected array or nil, got {type(value).__name__}")
    _check_nesting(value, where, name, MAX_EXTRA_KEYS_DEPTH)
    frozen = freeze_value(value)
    assert isinstance(frozen, tuple)
    return frozen


_T = TypeVar("_T")


def _built(cls: type[_T], **fields: Any) -> _T:
    """A record from already validated, normalized fields, without running the
    dataclass ``__init__``/``__post_init__`` (one ``object.__setattr__`` per
    field dominates decoding otherwise). Only for values the checks above
    produced: tuples, plain ``str``s, frozen ``extra_keys``."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


_STORED_ORDER = (
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
)
_STORED_REQUIRED = frozenset(("block_hashes", "parent_block_hash", "token_ids", "block_size"))
_REMOVED_ORDER = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_REMOVED_REQUIRED = frozenset(("block_hashes",))


def _fields(raw: object, where: str) -> tuple[str, dict[str, Any]]:
    """(tag, fields by name) from either encoding; unknown map keys are ignored."""
    if type(raw) is dict:
        tag = raw.get(TAG_KEY)
        if type(tag) is not str:
            raise EventDecodeError(_path(where, TAG_KEY), "missing or non-string event tag")
        return tag, raw
    if type(raw) is list or type(raw) is tuple:
        if not raw or not isinstance(raw[0], str):
            raise EventDecodeError(_path(where, "[0]"), "missing or non-string event tag")
        tag = raw[0]
        order = {"BlockStored": _STORED_ORDER, "BlockRemoved": _REMOVED_ORDER}.get(tag, ())
        # Extra trailing elements beyond the known fields are ignored (forward compat).
        return tag, dict(zip(order, raw[1:], strict=False))
    raise EventDecodeError(where, f"expected event map or array, got {type(raw).__name__}")


def decode_event(raw: object, where: str = "event") -> KVEvent:
    """One event from either encoding; ``where`` prefixes field names in errors."""
    tag, f = _fields(raw, where)
    get = f.get
    if tag == "BlockStored":
        if not f.keys() >= _STORED_REQUIRED:
            missing = sorted(_STORED_REQUIRED - f.keys())[0]
            raise EventDecodeError(_path(where, missing), "required field missing")
        parent = f["parent_block_hash"]
        return _built(
            BlockStored,
            block_hashes=_hashes(f["block_hashes"], where, "block_hashes"),
            parent_block_hash=(
                None if parent is None else _check_hash(parent, where, "parent_block_hash")
            ),
            token_ids=_token_ids(f["token_ids"], where, "token_ids"),
            block_size=_int(f["block_size"], where, "block_size") or 0,
            lora_id=_int(get("lora_id"), where, "lora_id", optional=True),
            medium=_str(get("medium"), where, "medium"),
            lora_name=_str(get("lora_name"), where, "lora_name"),
            extra_keys=_extra_keys(get("extra_keys"), where, "extra_keys"),
            group_idx=_int(get("group_idx"), where, "group_idx", optional=True),
            kv_cache_spec_kind=_str(get("kv_cache_spec_kind"), where, "kv_cache_spec_kind"),
            kv_cache_spec_sliding_window=_int(
                get("kv_cache_spec_sliding_window"),
                where,
                "kv_cache_spec_sliding_window",
                optional=True,
            ),
            locality=_str(get("locality"), where, "locality"),
            ownership=_str(get("ownership"), where, "ownership"),
        )
    if tag == "BlockRemoved":
        if "block_hashes" not in f:
            raise EventDecodeError(_path(where, "block_hashes"), "required field missing")
        return _built(
            BlockRemoved,
            block_hashes=_hashes(f["block_hashes"], where, "block_hashes"),
            medium=_str(get("medium"), where, "medium"),
            group_idx=_int(get("group_idx"), where, "group_idx", optional=True),
            locality=_str(get("locality"), where, "locality"),
            ownership=_str(get("ownership"), where, "ownership"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise EventDecodeError(_path(where, TAG_KEY), f"unknown event type {tag!r}")


# ---------------------------------------------------------------- typed fast path
#
# msgspec decodes and type-checks a MAP batch in C, into these structs. They accept
# a subset of what the checks above accept (same exact types: no bool for int, no
# str for bytes, finite ts checked below; unknown keys ignored; the same required
# fields), and yield the same values. The first decoder takes batches without
# extra_keys; the second (``_decode_typed_keyed``) also takes extra_keys of the
# shapes ``_ExtraKeys`` spells, which msgspec yields as nested tuples: exactly what
# ``freeze_value`` makes of them, and within MAX_EXTRA_KEYS_DEPTH. Anything else --
# a msgspec error, a non-finite ts, extra_keys with maps, bin or ext values or deeper
# nesting (frozen and depth-checked by the Python path), array-form events, a
# map-form batch -- is decoded by the Python path, which accepts or names the
# offending field exactly as it always did.


class _DecStored(msgspec.Struct, tag_field=TAG_KEY, tag="BlockStored", gc=False):
    block_hashes: tuple[int | bytes, ...]
    parent_block_hash: int | bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: None = None  # non-nil: _DecStoredKeyed (or the Python path) decides
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None


#: A msgpack scalar inside ``extra_keys`` (exact types, as the Python path keeps them).
#: Not bytes: msgspec unions hold one str-like type (bin values go the Python path).
_KeyScalar = bool | int | float | str | None
#: The ``extra_keys`` the keyed decoder takes: arrays nested at most 3 deep (the field
#: itself is level 1), no maps.
_ExtraKeys = tuple[_KeyScalar | tuple[_KeyScalar | tuple[_KeyScalar, ...], ...], ...]
assert MAX_EXTRA_KEYS_DEPTH >= 3


class _DecStoredKeyed(_DecStored, tag="BlockStored", gc=False):
    # Same fields in the same order; only extra_keys widens (mypy: narrower in the base).
    extra_keys: _ExtraKeys | None = None  # type: ignore[assignment]


class _DecRemoved(msgspec.Struct, tag_field=TAG_KEY, tag="BlockRemoved", gc=False):
    block_hashes: tuple[int | bytes, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _DecCleared(msgspec.Struct, tag_field=TAG_KEY, tag="AllBlocksCleared", gc=False):
    pass


class _DecBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: tuple[_DecStored | _DecRemoved | _DecCleared, ...]
    data_parallel_rank: int | None = None


class _DecBatchKeyed(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: tuple[_DecStoredKeyed | _DecRemoved | _DecCleared, ...]
    data_parallel_rank: int | None = None


_MSGSPEC_DECODER = msgspec.msgpack.Decoder(_DecBatch)
_MSGSPEC_DECODER_KEYED = msgspec.msgpack.Decoder(_DecBatchKeyed)
_struct_asdict = msgspec.structs.asdict
_new = object.__new__
_set = object.__setattr__


def _decode_typed(payload: bytes) -> EventBatch | None:
    """The batch via msgspec, or None (extra_keys, anything msgspec rejects): the
    keyed decoder or the Python path decides."""
    try:
        typed = _MSGSPEC_DECODER.decode(payload)
    except Exception:  # DecodeError, ValidationError, RecursionError: Python path
        return None
    return _typed_records(typed)


def _decode_typed_keyed(payload: bytes) -> EventBatch | None:
    """``_decode_typed`` for batches whose ``extra_keys`` have the ``_ExtraKeys``
    shape; None when the Python path must decide."""
    try:
        typed = _MSGSPEC_DECODER_KEYED.decode(payload)
    except Exception:  # DecodeError, ValidationError, RecursionError: Python path
        return None
    return _typed_records(typed)


def _typed_records(typed: _DecBatch | _DecBatchKeyed) -> EventBatch | None:
    if not math.isfinite(typed.ts):
        return None
    events: list[KVEvent] = []
    append = events.append
    for struct in typed.events:
        record: KVEvent
        kind = type(struct)
        if kind is _DecStored or kind is _DecStoredKeyed:
            record = _new(BlockStored)
        elif kind is _DecRemoved:
            record = _new(BlockRemoved)
        else:
            append(AllBlocksCleared())
            continue
        # Same fields, validated values (tuples, plain str): no dataclass __init__.
        _set(record, "__dict__", _struct_asdict(struct))
        append(record)
    batch = _new(EventBatch)
    _set(batch, "__dict__", {"ts": typed.ts, "events": tuple(events),
                             "data_parallel_rank": typed.data_parallel_rank})
    return batch


def decode_batch(payload: bytes) -> EventBatch:
    """Parse and validate one payload (either event encoding).

    Raises ``EventDecodeError`` naming the first offending field; never returns a
    partially decoded batch. MAP batches are decoded and checked by msgspec (those
    with ``extra_keys`` by the keyed decoder, when their shape allows); the rest
    (and every error) by the Python checks.
    """
    batch = _decode_typed(payload)
    if batch is None:
        batch = _decode_typed_keyed(payload)
        if batch is None:
            return _decode_batch_checked(payload)
    return batch


def _decode_batch_checked(payload: bytes) -> EventBatch:
    """``decode_batch`` by the Python checks alone (the reference behaviour)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise EventDecodeError("payload", f"not valid msgpack ({exc})") from exc
    if isinstance(raw, dict):
        # A map-encoded EventBatch (not what vLLM sends, but cheap to accept).
        raw = (raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank"))
    if type(raw) is not tuple or len(raw) < 2:
        raise EventDecodeError("payload", "expected array [ts, events, data_parallel_rank]")
    ts = raw[0]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise EventDecodeError("payload.ts", f"expected finite number, got {ts!r}")
    events_raw = raw[1]
    if type(events_raw) is not tuple:
        raise EventDecodeError("payload.events", f"expected array, got {type(events_raw).__name__}")
    dp_rank = _int(raw[2] if len(raw) > 2 else None, "payload", "data_parallel_rank", optional=True)
    try:
        events = tuple([decode_event(e, "") for e in events_raw])
    except EventDecodeError:
        # Redo the failing event with its index in the path (errors are rare).
        for i, e in enumerate(events_raw):
            try:
                decode_event(e, "")
            except EventDecodeError as exc:
                raise EventDecodeError(
                    f"events[{i}]" + (f".{exc.field}" if exc.field else ""), exc.reason
                ) from exc
        raise
    return EventBatch(ts=float(ts), events=events, data_parallel_rank=dp_rank)


# ---------------------------------------------------------------- frames


def pub_frames(topic: bytes, seq: int, payload: bytes) -> tuple[bytes, bytes, bytes]:
    return (topic, encode_seq(seq), payload)


@dataclass(frozen=True)
class LiveFrame:
    topic: bytes
    seq: int
    payload: bytes


def parse_pub_frames(frames: Sequence[bytes]) -> LiveFrame:
    """``[topic, seq, payload]`` as a SUB socket receives it."""
    if len(frames) != 3:
        raise EventDecodeError("frames", f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    return LiveFrame(bytes(frames[0]), decode_seq(frames[1], "frames[1] (seq)"), bytes(frames[2]))


@dataclass(frozen=True)
class ReplayInfo:
    """The kvbridge publisher's answer header: who it is and what its ring holds."""

    incarnation: int
    oldest_seq: int
    next_seq: int
    matched: bool


@dataclass(frozen=True)
class ReplayRequest:
    start_seq: int
    end_seq: int | None = None  # exclusive; None: up to the newest batch
    incarnation: int | None = None  # None: any incarnation


def encode_replay_request(request: ReplayRequest) -> bytes:
    return REPLAY_MAGIC + msgpack.packb(
        {
            "incarnation": request.incarnation,
            "start_seq": request.start_seq,
            "end_seq": request.end_seq,
        }
    )


def parse_replay_request(frame: bytes) -> ReplayRequest:
    """A ROUTER request payload: vLLM's 8-byte start seq, or the kvbridge extension."""
    if frame.startswith(REPLAY_MAGIC):
        try:
            body = msgpack.unpackb(frame[len(REPLAY_MAGIC) :], raw=False)
        except Exception as exc:
            raise EventDecodeError("replay_request", f"not valid msgpack ({exc})") from exc
        if not isinstance(body, dict):
            raise EventDecodeError("replay_request", "expected a map")
        start = _int(body.get("start_seq"), "replay_request", "start_seq")
        end = _int(body.get("end_seq"), "replay_request", "end_seq", optional=True)
        inc = _int(body.get("incarnation"), "replay_request", "incarnation", optional=True)
        return ReplayRequest(start_seq=start or 0, end_seq=end, incarnation=inc)
    # vLLM reads the request unsigned; accept both 8-byte readings identically.
    if len(frame) != SEQ_BYTES:
        raise EventDecodeError("replay_request", f"expected {SEQ_BYTES}-byte start sequence")
    return ReplayRequest(start_seq=int.from_bytes(frame, "big", signed=True))


def encode_replay_info(info: ReplayInfo) -> bytes:
    return msgpack.packb(
        {
            "incarnation": info.incarnation,
            "oldest_seq": info.oldest_seq,
            "next_seq": info.next_seq,
            "matched": info.matched,
        }
    )


def decode_replay_info(frame: bytes) -> ReplayInfo:
    try:
        body = msgpack.unpackb(frame, raw=False)
    except Exception as exc:
        raise EventDecodeError("replay_info", f"not valid msgpack ({exc})") from exc
    if not isinstance(body, dict):
        raise EventDecodeError("replay_info", "expected a map")
    return ReplayInfo(
        incarnation=_int(body.get("incarnation"), "replay_info", "incarnation") or 0,
        oldest_seq=_int(body.get("oldest_seq"), "replay_info", "oldest_seq") or 0,
        next_seq=_int(body.get("next_seq"), "replay_info", "next_seq") or 0,
        matched=bool(body.get("matched")),
    )


@dataclass(frozen=True)
class ReplayReply:
    """One message a replay client receives (delimiter already stripped).

    Exactly one of: ``info`` (kvbridge header), ``end`` (end marker), or a batch
    (``seq`` + ``payload``).
    """

    info: ReplayInfo | None = None
    end: bool = False
    seq: int = END_SEQ
    payload: bytes = b""
    topic: bytes | None = None


def replay_batch_frames(topic: bytes | None, seq: int, payload: bytes) -> tuple[bytes, ...]:
    """One replayed batch as the publisher sends it (after the client's identity and
    delimiter): ``[topic, seq, payload]``, or ``[seq, payload]`` when ``topic`` is
    None (vLLM before PR #45177)."""
    if topic is None:
        return (encode_seq(seq), payload)
    return (topic, encode_seq(seq), payload)


def replay_end_frames(with_topic: bool = True) -> tuple[bytes, ...]:
    """The end marker of a replay: ``[b"", END_SEQ, b""]`` (or ``[END_SEQ, b""]``)."""
    return (b"", END_SEQ_BYTES, b"") if with_topic else (END_SEQ_BYTES, b"")


def parse_replay_reply(frames: Sequence[bytes]) -> ReplayReply:
    """Any replay reply shape: ``[MAGIC, info]``, ``[topic, seq, payload]``,
    ``[seq, payload]`` (pre-#45177), or the end markers of both."""
    if len(frames) == 2 and frames[0] == REPLAY_MAGIC:
        return ReplayReply(info=decode_replay_info(frames[1]))
    if len(frames) == 3:
        topic, seq_frame, payload = frames
    elif len(frames) == 2:
        topic, (seq_frame, payload) = None, frames
    else:
        raise EventDecodeError("replay_reply", f"expected 2 or 3 frames, got {len(frames)}")
    seq = decode_seq(seq_frame, "replay_reply.seq")
    if seq == END_SEQ:
        return ReplayReply(end=True)
    return ReplayReply(seq=seq, payload=bytes(payload), topic=None if topic is None else bytes(topic))
