"""The side channel's request and replies: MetadataRequest, then a metadata, status or error reply.

Owns :class:`RequestKind`, :class:`MetadataRequest` (rank selection, the
conditional GET), :func:`peek_request_id` for a malformed request's error reply,
:class:`ServerClock` and the replies (:class:`MetadataReply`,
:class:`StatusReply`, :class:`ErrorReply`), each with one encode and one decode
function. A ``MetadataReply`` carries the engine document as opaque bytes: it is
decoded by :func:`kvbridge.handshake.document.decode_engine`, never here.

May not touch: the engine document, header or rank records
(:mod:`~kvbridge.handshake.document`, :mod:`~kvbridge.handshake.header`,
:mod:`~kvbridge.handshake.agent`), sockets, retries or clocks beyond carrying
the server's (those are :mod:`~kvbridge.handshake.server` and
:mod:`~kvbridge.handshake.client`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack

from kvbridge.handshake.agent import RankKey
from kvbridge.handshake.codec import (
    MAX_MESSAGE_BYTES,
    MAX_NAME_CHARS,
    MAX_REQUEST_BYTES,
    PROTOCOL_VERSION,
    U64_MAX,
    _check_int,
    _pack,
    _printable,
    _Reader,
    _short,
    _versioned,
)
from kvbridge.handshake.errors import HandshakeError

# --------------------------------------------------------------------------- requests


class RequestKind(str, Enum):
    GET = "get"  # metadata of the selected ranks (or "unchanged")
    PING = "ping"  # identity, generation and clock only


@dataclass(frozen=True)
class MetadataRequest:
    """Ask a server for metadata.

    Selection: each of ``pp_rank``, ``tp_rank``, ``pcp_rank`` is a number or None
    (= every value). ``tp_rank=1`` alone asks for TP rank 1 of every pipeline
    stage (the PP-aware aggregation a consumer rank needs); all None asks for
    the whole engine. With ``known_incarnation`` and ``known_generation`` set
    (both or neither), a server whose incarnation and generation are unchanged
    answers with a small StatusReply(unchanged=True) instead of the document.
    """

    request_id: int
    kind: RequestKind = RequestKind.GET
    pp_rank: int | None = None
    tp_rank: int | None = None
    pcp_rank: int | None = None
    known_incarnation: str | None = None
    known_generation: int | None = None

    def selects(self, key: RankKey) -> bool:
        return ((self.pp_rank is None or self.pp_rank == key.pp_rank)
                and (self.tp_rank is None or self.tp_rank == key.tp_rank)
                and (self.pcp_rank is None or self.pcp_rank == key.pcp_rank))


_RANK_LIMIT = 1 << 16


def encode_request(request: MetadataRequest) -> bytes:
    _check_int(request.request_id, "request_id", 0, U64_MAX)
    out: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": RequestKind(request.kind).value,
                           "id": request.request_id}
    if request.kind is RequestKind.GET:
        out.update(pp=request.pp_rank, tp=request.tp_rank, pcp=request.pcp_rank,
                   known_incarnation=request.known_incarnation,
                   known_generation=request.known_generation)
    return _pack(out)


def decode_request(data: bytes, max_bytes: int = MAX_REQUEST_BYTES) -> MetadataRequest:
    obj = _versioned(data, "message", max_bytes)
    kind_reader = _Reader(obj, "", ("v", "kind", "id"),
                          ("pp", "tp", "pcp", "known_incarnation", "known_generation"))
    kind = kind_reader.get_enum("kind", RequestKind)
    if kind is RequestKind.PING:
        r = _Reader(obj, "", ("v", "kind", "id"))
        return MetadataRequest(r.get_int("id"), kind)
    r = kind_reader
    known_incarnation = r.opt_str("known_incarnation", 64)
    known_generation = r.opt_int("known_generation")
    if (known_incarnation is None) != (known_generation is None):
        raise HandshakeError("known_generation" if known_generation is None
                             else "known_incarnation",
                             "known_incarnation and known_generation go together")
    return MetadataRequest(r.get_int("id"), kind, r.opt_int("pp", 0, _RANK_LIMIT),
                           r.opt_int("tp", 0, _RANK_LIMIT), r.opt_int("pcp", 0, _RANK_LIMIT),
                           known_incarnation, known_generation)


def peek_request_id(data: bytes) -> int:
    """Best-effort request id of a malformed request (0 when there is none)."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False) if \
            0 < len(data) <= MAX_REQUEST_BYTES else None
    except Exception:
        return 0
    if isinstance(obj, dict):
        value = obj.get("id")
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= U64_MAX:
            return value
    return 0


# --------------------------------------------------------------------------- replies


@dataclass(frozen=True)
class ServerClock:
    """The server's clocks when it built the reply (seconds)."""

    wall_s: float  # time.time()
    monotonic_s: float  # time.monotonic() of the server process (its own epoch)


@dataclass(frozen=True)
class MetadataReply:
    request_id: int
    clock: ServerClock
    engine_doc: bytes  # an engine document; decode with decode_engine()


@dataclass(frozen=True)
class StatusReply:
    request_id: int
    clock: ServerClock
    engine_id: str
    incarnation: str
    generation: int
    unchanged: bool  # answer to a conditional GET whose known state is current


@dataclass(frozen=True)
class ErrorReply:
    request_id: int
    clock: ServerClock
    field: str  # the request field the server rejected
    message: str
    retryable: bool = False  # e.g. a rank that has not registered yet


Reply = MetadataReply | StatusReply | ErrorReply


def encode_reply(reply: Reply) -> bytes:
    out: dict[str, Any] = {"v": PROTOCOL_VERSION, "id": reply.request_id,
                           "wall": reply.clock.wall_s, "mono": reply.clock.monotonic_s}
    if isinstance(reply, MetadataReply):
        out.update(kind="metadata", engine=reply.engine_doc)
    elif isinstance(reply, StatusReply):
        out.update(kind="status", engine_id=reply.engine_id, incarnation=reply.incarnation,
                   generation=reply.generation, unchanged=reply.unchanged)
    else:
        out.update(kind="error", field=_printable(reply.field, MAX_NAME_CHARS),
                   message=_printable(reply.message, 4096), retryable=reply.retryable)
    return _pack(out)


def decode_reply(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Reply:
    obj = _versioned(data, "message", max_bytes)
    common = ("v", "kind", "id", "wall", "mono")
    kind = _Reader(obj, "", common, ("engine", "engine_id", "incarnation", "generation",
                                     "unchanged", "field", "message", "retryable")).raw("kind")
    if kind == "metadata":
        r = _Reader(obj, "", common + ("engine",))
        return MetadataReply(r.get_int("id"), ServerClock(r.get_float("wall"), r.get_float("mono")),
                             r.get_bytes("engine", max_bytes))
    if kind == "status":
        r = _Reader(obj, "", common + ("engine_id", "incarnation", "generation", "unchanged"))
        return StatusReply(r.get_int("id"), ServerClock(r.get_float("wall"), r.get_float("mono")),
                           r.get_str("engine_id"), r.get_str("incarnation", 64), r.get_int("generation"),
                           r.get_bool("unchanged"))
    if kind == "error":
        r = _Reader(obj, "", common + ("field", "message", "retryable"))
        return ErrorReply(r.get_int("id"), ServerClock(r.get_float("wall"), r.get_float("mono")),
                          r.get_str("field", MAX_NAME_CHARS, allow_empty=True),
                          r.get_str("message", 4096, allow_empty=True), r.get_bool("retryable"))
    raise HandshakeError("kind", f"expected 'metadata', 'status' or 'error', got {_short(kind)}")
