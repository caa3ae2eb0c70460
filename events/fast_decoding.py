"""The typed (msgspec) fast path of batch decoding, and :func:`decode_batch`.

Owns the msgspec structs a MAP batch is decoded and type-checked into (in C),
the keyed variant for ``extra_keys`` of the shapes vLLM sends, their conversion
into kvbridge's records without running dataclass ``__init__``, and
:func:`decode_batch`, which tries them in turn and hands everything they
reject to the reference checks (:mod:`~kvbridge.events.decoding`).

May not touch: what is valid. This path accepts a subset of what the reference
accepts and yields the same values; it never raises a decode error of its own
(every error message comes from the reference). Nor encoding, frames or sockets.
"""

from __future__ import annotations

import math

import msgspec

from .decoding import MAX_EXTRA_KEYS_DEPTH, _decode_batch_checked
from .encoding import TAG_KEY
from .schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)

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
