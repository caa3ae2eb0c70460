"""The engine control protocol: typed messages, one validating decoder, bounds from the engine.

Every control message a client sends to :func:`kvbridge.engine.server.serve`
goes through :func:`decode_frames` (raw ZeroMQ frames) or :func:`decode_message`
(an already unpacked map), which return one of the frozen records below or raise
:class:`ProtocolError` naming the field (``requests[3].prompt[17]: ...``).
Nothing is queued, allocated or stepped for a message that does not decode.

The bounds come from the engine that serves the port (:class:`ControlLimits`):

* a request's tokens (``len(prompt) + max_tokens - 1``, the KV it ever holds)
  fit the smallest region's block pool, so a request that could never run is
  refused at ``submit`` instead of starving every request behind it;
* one ``submit`` carries at most ``max_submit_requests`` requests and
  ``max_submit_tokens`` prompt tokens (``SUBMIT_POOLS`` pools' worth);
* a frame is at most ``max_message_bytes``, the largest encoding of such a
  submit; the server sets it as the socket's ``MAXMSGSIZE``, so libzmq drops a
  bigger frame (and its connection) before it is buffered, and the decoder
  checks it again for frames that reach it another way;
* token ids are 64-bit (what the block hashes encode), ``0 <= id < 2**63``.

:class:`ControlCalls <kvbridge.engine.harness.ControlCalls>` splits a long
submit into messages that fit (the limits are in the ``info`` reply).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from kvbridge.connectors import TransferParams
from kvbridge.connectors.errors import KVBridgeError
from kvbridge.engine.owners import TOKEN_CHARS
from kvbridge.engine.request import MAX_TOKEN_ID, RequestSpec
from kvbridge.layouts import LayoutError

#: Requests in one ``submit`` message.
MAX_SUBMIT_REQUESTS = 1024
#: One ``submit`` carries at most this many block pools' worth of prompt tokens.
SUBMIT_POOLS = 8
#: Characters of a request id or a cache salt.
MAX_ID_CHARS = 256
#: Encoded bytes of one request beyond its prompt and block ids: the id, the
#: flags and the transfer params' fixed fields (engine ids, hosts, topology).
REQUEST_OVERHEAD_BYTES = 4096
#: Encoded bytes per prompt token: the token (msgpack uint64, 9 bytes) plus at
#: most one remote block id (uint32, 5 bytes) per region in its transfer params.
TOKEN_BYTES = 9
BLOCK_ID_BYTES = 5
#: The envelope of any message (op, keys, slack).
ENVELOPE_BYTES = 64 << 10


class ProtocolError(ValueError):
    """A control message that does not decode. ``field`` names what was wrong."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class ControlLimits:
    """What one control message may carry, derived from the engine that serves it."""

    max_request_tokens: int
    max_submit_requests: int
    max_submit_tokens: int
    max_message_bytes: int

    @classmethod
    def for_pools(cls, num_blocks: int, tokens_per_block: Sequence[int]) -> ControlLimits:
        """Limits for an engine with ``num_blocks`` blocks per region of these sizes."""
        max_request_tokens = min(num_blocks * t for t in tokens_per_block)
        max_submit_tokens = SUBMIT_POOLS * max_request_tokens
        per_token = TOKEN_BYTES + BLOCK_ID_BYTES * len(tokens_per_block)
        max_message_bytes = (ENVELOPE_BYTES + max_submit_tokens * per_token
                             + MAX_SUBMIT_REQUESTS * REQUEST_OVERHEAD_BYTES)
        return cls(max_request_tokens, MAX_SUBMIT_REQUESTS, max_submit_tokens,
                   max_message_bytes)

    def to_dict(self) -> dict[str, int]:
        return {"max_request_tokens": self.max_request_tokens,
                "max_submit_requests": self.max_submit_requests,
                "max_submit_tokens": self.max_submit_tokens,
                "max_message_bytes": self.max_message_bytes}

    @classmethod
    def from_dict(cls, data: object) -> ControlLimits:
        if not isinstance(data, Mapping):
            raise ProtocolError("limits", "expected a map")
        values = {}
        for name in ("max_request_tokens", "max_submit_requests", "max_submit_tokens",
                     "max_message_bytes"):
            values[name] = _int(data.get(name), f"limits.{name}", 1, 1 << 62)
        return cls(**values)


# ---------------------------------------------------------------------------- messages

@dataclass(frozen=True)
class Info:
    pass


@dataclass(frozen=True)
class Submit:
    requests: tuple[RequestSpec, ...]
    token: str | None = None  # None: a new owner (the reply carries its token)


@dataclass(frozen=True)
class Results:
    token: str  # the submitter's (kvbridge.engine.owners)


@dataclass(frozen=True)
class Abort:
    request_id: str
    token: str


@dataclass(frozen=True)
class Stats:
    pass


@dataclass(frozen=True)
class TransferRecords:
    pass


@dataclass(frozen=True)
class ResetPrefixCache:
    pass


@dataclass(frozen=True)
class Shutdown:
    pass


ControlMessage = (Info | Submit | Results | Abort | Stats | TransferRecords | ResetPrefixCache
                  | Shutdown)

_NO_FIELDS: dict[str, type[Info | Stats | TransferRecords | ResetPrefixCache | Shutdown]] = {
    "info": Info, "stats": Stats, "transfer_records": TransferRecords,
    "reset_prefix_cache": ResetPrefixCache, "shutdown": Shutdown,
}
OPS = tuple(sorted((*_NO_FIELDS, "submit", "results", "abort")))
_REQUEST_FIELDS = ("request_id", "prompt", "max_tokens", "transfer_params", "remote_decode",
                   "cache_salt")


def split_submit(specs: Sequence[RequestSpec],
                 limits: ControlLimits) -> list[list[RequestSpec]]:
    """``specs`` in order, as consecutive submits that each fit ``limits``."""
    chunks: list[list[RequestSpec]] = []
    tokens = 0
    for spec in specs:
        if (not chunks or len(chunks[-1]) >= limits.max_submit_requests
                or tokens + len(spec.prompt) > limits.max_submit_tokens):
            chunks.append([])
            tokens = 0
        chunks[-1].append(spec)
        tokens += len(spec.prompt)
    return chunks


# ---------------------------------------------------------------------------- encoding

def encode_message(message: ControlMessage) -> bytes:
    """The one frame of ``message`` (what :func:`decode_frames` reads back)."""
    body: dict[str, Any]
    if isinstance(message, Submit):
        body = {"op": "submit", "requests": [r.to_dict() for r in message.requests]}
        if message.token is not None:
            body["token"] = message.token
    elif isinstance(message, Results):
        body = {"op": "results", "token": message.token}
    elif isinstance(message, Abort):
        body = {"op": "abort", "request_id": message.request_id, "token": message.token}
    else:
        body = {"op": next(op for op, kind in _NO_FIELDS.items() if isinstance(message, kind))}
    return msgpack.packb(body, use_bin_type=True)


# ---------------------------------------------------------------------------- decoding

def decode_frames(frames: Sequence[bytes], limits: ControlLimits) -> ControlMessage:
    """One ZeroMQ message (all its frames) -> a typed control message."""
    if len(frames) != 1:
        raise ProtocolError("message", f"expected one frame (one msgpack map), got "
                                       f"{len(frames)}")
    raw = frames[0]
    if len(raw) > limits.max_message_bytes:
        raise ProtocolError("message", f"{len(raw)} bytes; this engine takes at most "
                                       f"{limits.max_message_bytes} per message (split the "
                                       f"submit)")
    try:
        # msgpack bounds every container, string and binary by the frame's length
        message = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types (ExtraData, StackError, ...)
        raise ProtocolError("message", f"not one msgpack map ({msgpack_refusal(exc)})"
                            ) from None
    return decode_message(message, limits)


def msgpack_refusal(exc: BaseException) -> str:
    """Why msgpack refused some bytes, in words: several of its errors carry no message
    (``FormatError`` on a type byte it never uses, ``StackError`` past its nesting
    limit), and a refusal must still say what was wrong with the body."""
    text = str(exc)
    if isinstance(exc, msgpack.FormatError):
        text = text or "a byte that is no msgpack type (e.g. 0xc1): not msgpack at all"
    elif isinstance(exc, msgpack.StackError):
        text = text or "containers nested deeper than msgpack decodes"
    elif isinstance(exc, msgpack.ExtraData):
        text = "bytes after the first msgpack object"
    return f"{type(exc).__name__}: {text or 'malformed'}"


def decode_message(message: object, limits: ControlLimits) -> ControlMessage:
    """An unpacked control map -> a typed control message (unknown keys are refused)."""
    if not isinstance(message, Mapping):
        raise ProtocolError("message", f"expected a map with a string 'op', got "
                                       f"{type(message).__name__}")
    op = message.get("op")
    if not isinstance(op, str):
        raise ProtocolError("op", "expected a map with a string 'op'")
    if op in _NO_FIELDS:
        _known(message, "message", ("op",))
        return _NO_FIELDS[op]()
    if op == "abort":
        _known(message, "message", ("op", "request_id", "token"))
        return Abort(_str(message.get("request_id"), "request_id"),
                     _token(message.get("token")))
    if op == "results":
        _known(message, "message", ("op", "token"))
        return Results(_token(message.get("token")))
    if op == "submit":
        _known(message, "message", ("op", "requests", "token"))
        token = message.get("token")
        return Submit(_requests(message.get("requests"), limits),
                      None if token is None else _token(token))
    raise ProtocolError("op", f"unknown op {op[:64]!r}; expected one of {list(OPS)}")


def _token(value: object) -> str:
    """A control client's token, by form (whether this engine issued it is the server's
    check): 64 lower-case hex characters, from the reply of its first ``submit``."""
    if not isinstance(value, str) or len(value) != TOKEN_CHARS or \
            value.strip("0123456789abcdef"):
        raise ProtocolError("token", f"expected the {TOKEN_CHARS} hex characters of the "
                                     f"token a submit reply gave, got {_show(value)}")
    return value


def _requests(raw: object, limits: ControlLimits) -> tuple[RequestSpec, ...]:
    if not isinstance(raw, list | tuple):
        raise ProtocolError("requests", f"expected a list of request maps, got "
                                        f"{type(raw).__name__}")
    if len(raw) > limits.max_submit_requests:
        raise ProtocolError("requests", f"{len(raw)} requests in one submit; at most "
                                        f"{limits.max_submit_requests} (split the submit)")
    specs: list[RequestSpec] = []
    total = 0
    for index, item in enumerate(raw):
        spec = decode_request(item, f"requests[{index}]", limits)
        total += len(spec.prompt)
        if total > limits.max_submit_tokens:
            raise ProtocolError("requests", f"more than {limits.max_submit_tokens} prompt "
                                            f"tokens in one submit (split the submit)")
        specs.append(spec)
    ids = [s.request_id for s in specs]
    if len(set(ids)) != len(ids):
        duplicate = next(i for i in ids if ids.count(i) > 1)
        raise ProtocolError("requests", f"duplicate request id {duplicate!r}")
    return tuple(specs)


def decode_request(data: object, field: str, limits: ControlLimits) -> RequestSpec:
    """One request map (:meth:`RequestSpec.to_dict`'s form), strictly typed and bounded."""
    if not isinstance(data, Mapping):
        raise ProtocolError(field, f"expected a request map, got {type(data).__name__}")
    _known(data, field, _REQUEST_FIELDS)
    request_id = _str(data.get("request_id"), f"{field}.request_id")
    prompt = data.get("prompt")
    if not isinstance(prompt, list | tuple) or not prompt:
        raise ProtocolError(f"{field}.prompt", "expected a non-empty list of token ids")
    if len(prompt) > limits.max_request_tokens:
        raise ProtocolError(f"{field}.prompt",
                            f"{len(prompt)} tokens; this engine's block pool holds at most "
                            f"{limits.max_request_tokens} tokens of one request (prompt + "
                            f"max_tokens - 1): it could never run")
    for position, token in enumerate(prompt):
        if type(token) is not int or not 0 <= token <= MAX_TOKEN_ID:
            raise ProtocolError(f"{field}.prompt[{position}]",
                                f"expected a token id in [0, 2**63), got {_show(token)}")
    max_tokens = _int(data.get("max_tokens", 4), f"{field}.max_tokens", 1,
                      limits.max_request_tokens)
    if len(prompt) + max_tokens - 1 > limits.max_request_tokens:
        raise ProtocolError(f"{field}.max_tokens",
                            f"{len(prompt)} prompt tokens + {max_tokens} new tokens need the "
                            f"KV of {len(prompt) + max_tokens - 1} tokens; this engine's block "
                            f"pool holds at most {limits.max_request_tokens}")
    remote_decode = data.get("remote_decode", False)
    if not isinstance(remote_decode, bool):
        raise ProtocolError(f"{field}.remote_decode", f"expected true or false, got "
                                                      f"{_show(remote_decode)}")
    cache_salt = data.get("cache_salt")
    if cache_salt is not None:
        cache_salt = _str(cache_salt, f"{field}.cache_salt")
    params = data.get("transfer_params")
    transfer_params = None
    if params is not None:
        try:
            transfer_params = TransferParams.from_dict(params)
        except (KVBridgeError, LayoutError) as exc:
            raise ProtocolError(f"{field}.{exc.field}", exc.reason) from None
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"{field}.transfer_params",
                                f"malformed ({type(exc).__name__}: {exc})") from None
    try:
        return RequestSpec(request_id=request_id, prompt=tuple(prompt), max_tokens=max_tokens,
                           transfer_params=transfer_params, remote_decode=remote_decode,
                           cache_salt=cache_salt)
    except ValueError as exc:  # RequestSpec's own checks (kept for in-process callers)
        raise ProtocolError(field, str(exc)) from None


def _known(data: Mapping[Any, Any], field: str, names: Sequence[str]) -> None:
    unknown = [k for k in data if k not in names]
    if unknown:
        key = unknown[0]
        raise ProtocolError(f"{field}.{key[:64] if isinstance(key, str) else _show(key)}",
                            f"unknown field; expected {list(names)}")


def _str(value: object, field: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        what = "missing" if value is None else f"got {_show(value)}"
        raise ProtocolError(field, f"expected a non-empty string of <= {MAX_ID_CHARS} "
                                   f"characters; {what}")
    return value


def _int(value: object, field: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(field, f"expected an integer in [{low}, {high}], got {_show(value)}")
    return value


def _show(value: object) -> str:
    """A short description of a hostile value (never its whole repr)."""
    if isinstance(value, int | float | bool) or value is None:
        text = repr(value)
        return text if len(text) <= 40 else f"an integer of {len(text)} digits"
    if isinstance(value, str):
        return repr(value[:40]) + ("..." if len(value) > 40 else "")
    return f"a {type(value).__name__}"
