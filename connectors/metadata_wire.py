"""msgpack encoding of connector metadata, for adapters whose engine moves it between processes.

kvbridge's own engine hands the scheduler's :class:`ConnectorMetadata` object to
its workers in-process. An engine adapter (vLLM) must move it through the
engine's own channels, which pickle what they carry; so the adapter sends only
the ``bytes`` made here, and never a kvbridge object.

The codec is driven by the metadata dataclass's declared field types (no
per-connector code): ints, floats, bools, strs, bytes, enums, ``X | None``,
``tuple[X, ...]``, fixed tuples, ``frozenset``, ``Mapping``, nested frozen
dataclasses, :class:`TransferParams` (its versioned dict form), KV events (the
events wire map form) and, where a field is typed ``ConnectorMetadata`` (the
multi connector's children), any connector's metadata, tagged by class.

Invariants: ``decode_metadata(encode_metadata(m)) == m`` for every metadata
made of those types; decoding accepts only dataclass subclasses of
:class:`ConnectorMetadata` already imported in this process (a tag never
imports a module), checks every value against the declared type, and raises
:class:`MetadataWireError` naming the field path on the first mismatch.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any

import msgpack

from kvbridge.connectors.api import ConnectorMetadata
from kvbridge.connectors.errors import KVBridgeError, TransferParamsError
from kvbridge.connectors.params import TransferParams
from kvbridge.events import BlockRemoved, BlockStored, EventDecodeError, decode_event, event_to_wire

#: Version of the envelope ``[version, tag, fields]``; the only one read.
METADATA_WIRE_VERSION = 1

_EVENT_TYPES = (BlockStored, BlockRemoved)


class MetadataWireError(KVBridgeError, ValueError):
    """Connector metadata cannot be encoded, or bytes are not valid encoded metadata."""


#: Classes that moved keep the tag they had on the wire (a tag is part of the bytes two
#: processes of one version exchange, and of the golden vectors): the PD core's metadata
#: was the NIXL connector's before the core became transport-neutral.
_MOVED_TAGS = {
    "kvbridge.connectors.pd.scheduler:PdMetadata": "kvbridge.connectors.nixl.scheduler:NixlMetadata",
}


def _tag(cls: type) -> str:
    tag = f"{cls.__module__}:{cls.__qualname__}"
    return _MOVED_TAGS.get(tag, tag)


def _known_classes() -> dict[str, type[ConnectorMetadata]]:
    """Every imported metadata class that the codec can build (the base and dataclasses)."""
    found: dict[str, type[ConnectorMetadata]] = {_tag(ConnectorMetadata): ConnectorMetadata}
    stack = list(ConnectorMetadata.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if dataclasses.is_dataclass(cls):
            found[_tag(cls)] = cls
    return found


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """``(name, resolved type)`` of each init field of dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init)


def _is_union(origin: Any) -> bool:
    return origin is typing.Union or origin is types.UnionType


# --------------------------------------------------------------------------- encode


def _encode(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any or tp is object:
        return _plain(value, path)
    if _is_union(origin):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise MetadataWireError(path, f"unsupported union type {tp!r}")
        return _encode(value, rest[0], path)
    if origin is tuple:
        if not isinstance(value, tuple):
            raise MetadataWireError(path, f"expected a tuple, got {type(value).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return [_encode(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)]
        if len(value) != len(args):
            raise MetadataWireError(path, f"expected {len(args)} items, got {len(value)}")
        return [_encode(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True))]
    if origin in (frozenset, set):
        if not isinstance(value, (set, frozenset)):
            raise MetadataWireError(path, f"expected a set, got {type(value).__name__}")
        # a set has no order: one canonical order on the wire (by each element's msgpack
        # bytes), so equal metadata encodes to equal bytes whatever PYTHONHASHSEED or
        # insertion order made the set iterate in
        items = [_encode(v, args[0], f"{path}[]") for v in value]
        return sorted(items, key=lambda item: msgpack.packb(item, use_bin_type=True))
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise MetadataWireError(path, f"expected a mapping, got {type(value).__name__}")
        key_tp, val_tp = args if args else (Any, Any)
        return {_encode(k, key_tp, f"{path}.<key>"): _encode(v, val_tp, f"{path}[{k!r}]")
                for k, v in value.items()}
    if not isinstance(tp, type):
        raise MetadataWireError(path, f"unsupported field type {tp!r}")
    if tp is ConnectorMetadata or (issubclass(tp, ConnectorMetadata)
                                   and not dataclasses.is_dataclass(tp)):
        if not isinstance(value, tp):
            raise MetadataWireError(path, f"expected {tp.__name__}, got {type(value).__name__}")
        return _envelope(value, path)
    exact = isinstance(value, tp) and not (tp is int and isinstance(value, bool))
    widened = tp is float and isinstance(value, int) and not isinstance(value, bool)
    if not (exact or widened):
        raise MetadataWireError(path, f"expected {tp.__name__}, got {type(value).__name__}")
    if tp is TransferParams:
        return value.to_dict()
    if issubclass(tp, _EVENT_TYPES):
        return event_to_wire(value)
    if issubclass(tp, enum.Enum):
        return _plain(value.value, path)
    if dataclasses.is_dataclass(tp):
        return {name: _encode(getattr(value, name), ftp, f"{path}.{name}")
                for name, ftp in _fields(tp)}
    if tp in (int, float, bool, str, bytes):
        return value
    raise MetadataWireError(path, f"unsupported field type {tp.__name__}")


def _plain(value: Any, path: str) -> Any:
    """A value of a field typed ``Any``: must already be msgpack-native."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        return {_plain(k, f"{path}.<key>"): _plain(v, f"{path}[{k!r}]") for k, v in value.items()}
    raise MetadataWireError(path, f"expected a msgpack-native value, got {type(value).__name__}")


def _envelope(meta: ConnectorMetadata, path: str) -> list[Any]:
    cls = type(meta)
    if cls is ConnectorMetadata:
        return [METADATA_WIRE_VERSION, _tag(cls), {}]
    if not dataclasses.is_dataclass(cls):
        raise MetadataWireError(path, f"{cls.__name__} must be a dataclass to cross processes")
    fields = {name: _encode(getattr(meta, name), ftp, f"{path}.{name}")
              for name, ftp in _fields(cls)}
    return [METADATA_WIRE_VERSION, _tag(cls), fields]


def encode_metadata(meta: ConnectorMetadata) -> bytes:
    """The msgpack bytes of ``meta``; raises :class:`MetadataWireError` naming a bad field."""
    if not isinstance(meta, ConnectorMetadata):
        raise MetadataWireError("metadata", f"expected a ConnectorMetadata, "
                                            f"got {type(meta).__name__}")
    packed: bytes = msgpack.packb(_envelope(meta, "metadata"), use_bin_type=True)
    return packed


# --------------------------------------------------------------------------- decode


def _decode(raw: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any or tp is object:
        return raw
    if _is_union(origin):
        if raw is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise MetadataWireError(path, f"unsupported union type {tp!r}")
        return _decode(raw, rest[0], path)
    if origin is tuple:
        if not isinstance(raw, list):
            raise MetadataWireError(path, f"expected an array, got {type(raw).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(v, args[0], f"{path}[{i}]") for i, v in enumerate(raw))
        if len(raw) != len(args):
            raise MetadataWireError(path, f"expected {len(args)} items, got {len(raw)}")
        return tuple(_decode(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(raw, args, strict=True)))
    if origin in (frozenset, set):
        if not isinstance(raw, list):
            raise MetadataWireError(path, f"expected an array, got {type(raw).__name__}")
        return frozenset(_decode(v, args[0], f"{path}[]") for v in raw)
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(raw, dict):
            raise MetadataWireError(path, f"expected a map, got {type(raw).__name__}")
        key_tp, val_tp = args if args else (Any, Any)
        return {_decode(k, key_tp, f"{path}.<key>"): _decode(v, val_tp, f"{path}[{k!r}]")
                for k, v in raw.items()}
    if not isinstance(tp, type):
        raise MetadataWireError(path, f"unsupported field type {tp!r}")
    if tp is ConnectorMetadata or (issubclass(tp, ConnectorMetadata)
                                   and not dataclasses.is_dataclass(tp)):
        meta = _open(raw, path)
        if not isinstance(meta, tp):
            raise MetadataWireError(path, f"expected {tp.__name__}, got {type(meta).__name__}")
        return meta
    if tp is TransferParams:
        try:
            return TransferParams.from_dict(raw)
        except TransferParamsError as exc:
            inner = exc.field.removeprefix("transfer_params").lstrip(".")
            raise MetadataWireError(f"{path}.{inner}" if inner else path, exc.reason) from None
    if issubclass(tp, _EVENT_TYPES):
        try:
            event = decode_event(raw, path)
        except EventDecodeError as exc:
            raise MetadataWireError(path, str(exc)) from None
        if not isinstance(event, tp):
            raise MetadataWireError(path, f"expected {tp.__name__}, got {type(event).__name__}")
        return event
    if issubclass(tp, enum.Enum):
        try:
            return tp(raw)
        except ValueError:
            raise MetadataWireError(path, f"expected one of {[m.value for m in tp]}, "
                                          f"got {raw!r}") from None
    if dataclasses.is_dataclass(tp):
        return _build(tp, raw, path)
    if tp is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if tp in (int, float, bool, str, bytes):
        if not isinstance(raw, tp) or (tp is int and isinstance(raw, bool)):
            raise MetadataWireError(path, f"expected {tp.__name__}, got {type(raw).__name__}")
        return raw
    raise MetadataWireError(path, f"unsupported field type {tp.__name__}")


def _build(cls: type, raw: Any, path: str) -> Any:
    if not isinstance(raw, dict):
        raise MetadataWireError(path, f"expected a map, got {type(raw).__name__}")
    fields = _fields(cls)
    names = {name for name, _ in fields}
    unknown = sorted(str(k) for k in raw if k not in names)
    if unknown:
        raise MetadataWireError(f"{path}.{unknown[0]}", f"unknown field of {cls.__name__}")
    missing = sorted(names - raw.keys())
    if missing:
        raise MetadataWireError(f"{path}.{missing[0]}", "missing")
    kwargs = {name: _decode(raw[name], ftp, f"{path}.{name}") for name, ftp in fields}
    try:
        return cls(**kwargs)
    except KVBridgeError as exc:
        raise MetadataWireError(f"{path}.{exc.field}", exc.reason) from None
    except (TypeError, ValueError) as exc:
        raise MetadataWireError(path, f"invalid {cls.__name__}: {exc}") from None


def _open(raw: Any, path: str) -> ConnectorMetadata:
    if not isinstance(raw, list) or len(raw) != 3:
        raise MetadataWireError(path, "expected an array [version, tag, fields]")
    version, tag, fields = raw
    if version != METADATA_WIRE_VERSION or isinstance(version, bool):
        raise MetadataWireError(f"{path}.version", f"expected {METADATA_WIRE_VERSION}, "
                                                   f"got {version!r}")
    if not isinstance(tag, str):
        raise MetadataWireError(f"{path}.tag", f"expected a str, got {type(tag).__name__}")
    cls = _known_classes().get(tag)
    if cls is None:
        raise MetadataWireError(f"{path}.tag", f"unknown metadata class {tag!r} (its connector "
                                               f"is not loaded in this process)")
    if cls is ConnectorMetadata:
        if fields != {}:
            raise MetadataWireError(f"{path}.fields", "expected an empty map")
        return ConnectorMetadata()
    meta: ConnectorMetadata = _build(cls, fields, path)
    return meta


def decode_metadata(data: bytes) -> ConnectorMetadata:
    """Inverse of :func:`encode_metadata`; raises :class:`MetadataWireError` naming the field."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MetadataWireError("metadata", f"expected bytes, got {type(data).__name__}")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError) as exc:
        raise MetadataWireError("metadata", f"not valid msgpack: {exc}") from None
    return _open(raw, "metadata")
