"""The reference decoder of KV events: Python checks that name the offending field.

Owns the field checks (exact types: no bool for an int, no str for bytes),
``MAX_EXTRA_KEYS_DEPTH`` and the iterative nesting bound of ``extra_keys``,
:func:`decode_event` for either encoding (MAP or ARRAY), and
``_decode_batch_checked``, the whole payload by these checks alone. Every
decode error message comes from here; :mod:`~kvbridge.events.fast_decoding`
must accept exactly what this accepts, with the same values (tests check it).

May not touch: encoding (:mod:`~kvbridge.events.encoding`, of which it uses only
``TAG_KEY``), the msgspec fast path, frames and replay
(:mod:`~kvbridge.events.frames`), sockets.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import msgpack

from .encoding import TAG_KEY
from .errors import EventDecodeError
from .schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    freeze_value,
)

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
