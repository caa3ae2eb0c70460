"""Strict msgpack reading shared by every handshake record: limits, version, field checks.

Owns the size and count limits of the handshake wire (``MAX_MESSAGE_BYTES``,
``MAX_RANKS``, ``MAX_NESTING``, ...), ``PROTOCOL_VERSION``, packing, the bounded
unpack (size first, then nesting), the protocol-version check of a top-level
record, and :class:`_Reader`, the typed access to one decoded map with exactly
the allowed keys, whose every failure is a :class:`HandshakeError` naming the
field.

May not touch: any record type (header, rank, engine document, request/reply:
:mod:`~kvbridge.handshake.header`, :mod:`~kvbridge.handshake.agent`,
:mod:`~kvbridge.handshake.document`, :mod:`~kvbridge.handshake.messages` build
on this module, never the other way round), sockets, or anything of
:mod:`kvbridge.layouts` beyond the limits it imports. Changing a limit here
changes what every peer accepts: the golden vectors in ``tests/golden`` pin the
bytes.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack

from kvbridge.handshake.errors import HandshakeError
from kvbridge.layouts import LayoutError, limits
from kvbridge.layouts.limits import MAX_WORLD_SIZE

#: 2: consumers name the sealed params they load (``begin``/``read`` carry the
#: record's digest, push ``register``s the prompt chain); a v1 consumer would be
#: refused by every hold, so it is refused at the handshake instead, saying why.
PROTOCOL_VERSION = 2

#: Largest message (request, reply or saved document) either side accepts, in bytes.
MAX_MESSAGE_BYTES = 1 << 20
#: Largest engine document: leaves room for the reply envelope around it.
MAX_DOCUMENT_BYTES = MAX_MESSAGE_BYTES - 4096
#: Largest request a server accepts, in bytes (requests are a few dozen bytes).
MAX_REQUEST_BYTES = 4096
MAX_NAME_CHARS = 256
MAX_BLOB_BYTES = 256 * 1024
#: Most ranks one engine may claim (tp_size * pp_size * pcp_size): the layouts bound
#: every ParallelTopology has (kvbridge.layouts.limits), checked here first so that the
#: error names the document's field and nothing loops over a peer's ranks before it.
MAX_RANKS = MAX_WORLD_SIZE
#: Deepest nesting of maps and lists a message may have (the deepest valid record,
#: an engine body's ``ranks[i].regions[j].base_addrs``, is 6 levels deep).
MAX_NESTING = 16
MAX_REGIONS = limits.MAX_REGIONS
MAX_LAYERS = 8192
#: Blocks per layer a rank may announce (prepared lists index rows with int32)
MAX_NUM_BLOCKS = limits.MAX_NUM_BLOCKS
# --- memory type per rank: where a rank's KV lives (a peer's descriptors must say it) ---
#: NIXL memory types a rank's KV may be in (host memory, pinned or not; CUDA memory)
MEM_TYPES = ("DRAM", "VRAM")
MAX_DEVICE_ID = 1 << 16
MAX_DIGEST_ALGORITHMS = 8
MAX_BLOCK_BYTES = 1 << 40
U64_MAX = (1 << 64) - 1


# --------------------------------------------------------------------------- helpers


def _pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: object, what: str, max_bytes: int) -> object:
    """Parse one msgpack object from ``data`` after bounding its size."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise HandshakeError(what, f"expected bytes, got {type(data).__name__}")
    size = len(data)
    if size > max_bytes:
        raise HandshakeError(what, f"message of {size} bytes exceeds the limit of "
                                   f"{max_bytes} bytes")
    if size == 0:
        raise HandshakeError(what, "empty message")
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        # FormatError and StackError carry no message: say what they mean
        raise HandshakeError(what, f"not a valid msgpack message ({type(exc).__name__}: "
                                   f"{str(exc) or 'bytes msgpack does not decode'})"
                             ) from None
    _check_nesting(obj, "" if what == "message" else what)
    return obj


def _check_nesting(obj: object, root: str) -> None:
    """Refuse maps and lists nested deeper than MAX_NESTING (iteratively: no recursion).

    Everything after decoding (``repr`` in an error message, comparisons) recurses
    over nested values, so a hostile depth is refused here, once, naming the field
    that holds it (``"kind"``, ``"body.ranks"``), before any of it is interpreted.
    """
    stack: list[tuple[object, int, str]] = [(obj, 0, root)]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, dict):
            children: Iterable[tuple[object, str]] = (
                (v, _join(where, str(k)[:64]) if depth < 3 else where)
                for k, v in value.items())
        elif isinstance(value, list):
            children = ((v, where) for v in value)
        else:
            continue
        if depth >= MAX_NESTING:
            raise HandshakeError(where or "message",
                                 f"nested deeper than {MAX_NESTING} levels of maps and lists; "
                                 f"no valid handshake record is")
        stack.extend((child, depth + 1, path) for child, path in children
                     if isinstance(child, dict | list))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _prefixed(path: str, exc: HandshakeError | LayoutError) -> HandshakeError:
    return HandshakeError(_join(path, exc.field), exc.reason)


class _Reader:
    """Typed access to one decoded msgpack map with exactly the allowed keys."""

    def __init__(self, obj: object, path: str, required: Iterable[str],
                 optional: Iterable[str] = ()) -> None:
        label = path or "message"
        if not isinstance(obj, dict):
            raise HandshakeError(label, f"expected a map, got {_kind(obj)}")
        required = tuple(required)
        allowed = set(required) | set(optional)
        for key in obj:
            if key not in allowed:
                raise HandshakeError(_join(path, str(key)[:64]),
                                     f"unknown field; expected {sorted(allowed)}")
        for key in required:
            if key not in obj:
                raise HandshakeError(_join(path, key), "missing")
        self.obj: dict[str, object] = obj
        self.path = path

    def where(self, key: str) -> str:
        return _join(self.path, key)

    def has(self, key: str) -> bool:
        return self.obj.get(key) is not None

    def raw(self, key: str) -> object:
        return self.obj.get(key)

    def get_int(self, key: str, lo: int = 0, hi: int = U64_MAX) -> int:
        return _check_int(self.obj.get(key), self.where(key), lo, hi)

    def opt_int(self, key: str, lo: int = 0, hi: int = U64_MAX) -> int | None:
        value = self.obj.get(key)
        return None if value is None else _check_int(value, self.where(key), lo, hi)

    def get_str(self, key: str, max_chars: int = MAX_NAME_CHARS, allow_empty: bool = False) -> str:
        return _check_str(self.obj.get(key), self.where(key), max_chars, allow_empty)

    def opt_str(self, key: str, max_chars: int = MAX_NAME_CHARS) -> str | None:
        value = self.obj.get(key)
        return None if value is None else _check_str(value, self.where(key), max_chars)

    def get_bytes(self, key: str, max_bytes: int, allow_empty: bool = False) -> bytes:
        value = self.obj.get(key)
        if not isinstance(value, bytes):
            raise HandshakeError(self.where(key), f"expected bytes, got {_kind(value)}")
        if len(value) > max_bytes:
            raise HandshakeError(self.where(key), f"{len(value)} bytes exceeds the limit of "
                                                  f"{max_bytes}")
        if not value and not allow_empty:
            raise HandshakeError(self.where(key), "expected non-empty bytes")
        return value

    def get_bool(self, key: str) -> bool:
        value = self.obj.get(key)
        if not isinstance(value, bool):
            raise HandshakeError(self.where(key), f"expected true or false, got {_kind(value)}")
        return value

    def get_float(self, key: str) -> float:
        value = self.obj.get(key)
        if isinstance(value, bool) or not isinstance(value, float | int):
            raise HandshakeError(self.where(key), f"expected a number, got {_kind(value)}")
        result = float(value)
        if not math.isfinite(result):
            raise HandshakeError(self.where(key), f"expected a finite number, got {result}")
        return result

    def get_list(self, key: str, max_items: int, min_items: int = 0) -> list[object]:
        value = self.obj.get(key)
        if not isinstance(value, list):
            raise HandshakeError(self.where(key), f"expected a list, got {_kind(value)}")
        if not min_items <= len(value) <= max_items:
            raise HandshakeError(self.where(key), f"expected {min_items}..{max_items} items, "
                                                  f"got {len(value)}")
        return value

    def get_enum(self, key: str, enum: type[Any]) -> Any:
        value = self.obj.get(key)
        choices = [m.value for m in enum]
        if not isinstance(value, str) or value not in choices:
            raise HandshakeError(self.where(key), f"expected one of {choices}, got "
                                                  f"{_short(value)}")
        return enum(value)


def _kind(value: object) -> str:
    return "nil" if value is None else type(value).__name__


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = 60
_REPR.maxother = 60


def _short(value: object) -> str:
    """A bounded ``repr`` for error messages (never recurses deeper than 3 levels)."""
    text = _REPR.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _printable(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` with anything non-printable escaped (for error replies)."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text[:max_chars]


def _check_int(value: object, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise HandshakeError(where, f"expected an integer, got {_kind(value)}")
    if not lo <= value <= hi:
        raise HandshakeError(where, f"expected an integer in [{lo}, {hi}], got {value}")
    return value


def _check_str(value: object, where: str, max_chars: int, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise HandshakeError(where, f"expected a string, got {_kind(value)}")
    if not value and not allow_empty:
        raise HandshakeError(where, "expected a non-empty string")
    if len(value) > max_chars:
        raise HandshakeError(where, f"string of {len(value)} chars exceeds {max_chars}")
    if not value.isprintable():
        raise HandshakeError(where, "contains non-printable characters")
    return value


def _versioned(data: object, what: str, max_bytes: int) -> dict[str, object]:
    """Unpack a top-level record and check its protocol version before anything else."""
    obj = _unpack(data, what, max_bytes)
    if not isinstance(obj, dict):
        raise HandshakeError(what, f"expected a map, got {_kind(obj)}")
    if "v" not in obj:
        raise HandshakeError("protocol_version", "missing (field 'v')")
    version = obj["v"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise HandshakeError("protocol_version", f"expected an integer protocol version, "
                                                 f"got {_kind(version)}")
    if version != PROTOCOL_VERSION:
        raise HandshakeError("protocol_version",
                             f"peer speaks handshake protocol v{version}, this kvbridge speaks "
                             f"v{PROTOCOL_VERSION}; run the same kvbridge version on both sides")
    return obj


def _top(data: object, what: str, max_bytes: int, required: Sequence[str],
         optional: Sequence[str] = ()) -> _Reader:
    return _Reader(_versioned(data, what, max_bytes), "", ("v", *required), optional)
