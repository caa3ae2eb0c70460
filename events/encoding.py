"""Encoding KV events and batches into vLLM's msgpack payload (MAP or ARRAY form).

Owns ``TAG_KEY``, :class:`EventWireFormat`, the msgpack-ready object of one event
(:func:`event_to_wire`: the reference), and the payload encoders
(:func:`encode_events`, :func:`encode_batch`), whose MAP form is written by
msgspec from structs that declare vLLM's fields in vLLM's order. The format
itself is described in :mod:`kvbridge.events.wire`.

May not touch: decoding (:mod:`~kvbridge.events.decoding`,
:mod:`~kvbridge.events.fast_decoding`), frames, sequence numbers and replay
(:mod:`~kvbridge.events.frames`), sockets. The bytes are pinned by
``tests/golden/vectors/events_*`` and checked against msgspec's encoding of
vLLM's own structs.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
from typing import Any

import msgpack
import msgspec

from .schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)

TAG_KEY = "type"
_U64_MAX = (1 << 64) - 1


class EventWireFormat(enum.Enum):
    """How events inside a batch are encoded."""

    MAP = "map"  # vLLM >= PR #42892 (v0.23+): tagged maps, omit defaults
    ARRAY = "array"  # vLLM before PR #42892: tagged positional arrays


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
_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "ownership",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_STORED_ATTRS = operator.attrgetter(*_STORED_FIELDS)
_REMOVED_ATTRS = operator.attrgetter(*_REMOVED_FIELDS)
# The same fields read from the instance dict: one C lookup each, where getattr on a
# dataclass instance first searches the class MRO. A record whose dict lacks a field
# (its class default then applies) raises KeyError and is read by getattr instead.
_STORED_ITEMS = operator.itemgetter(*_STORED_FIELDS)
_REMOVED_ITEMS = operator.itemgetter(*_REMOVED_FIELDS)


def _enc_structs(events: Sequence[KVEvent]) -> list[Any]:
    out: list[Any] = []
    append = out.append
    for event in events:
        kind = type(event)
        if kind is BlockStored:
            try:
                append(_EncStored(*_STORED_ITEMS(event.__dict__)))
            except KeyError:
                append(_EncStored(*_STORED_ATTRS(event)))
        elif kind is BlockRemoved:
            try:
                append(_EncRemoved(*_REMOVED_ITEMS(event.__dict__)))
            except KeyError:
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
