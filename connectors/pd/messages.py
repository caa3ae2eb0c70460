"""Notification records exchanged between transport agents (the data-path control messages).

The transport delivers an opaque byte string with a transfer (after its data) or on its
own (``send_notif``). kvbridge puts one small msgpack map in it: ``{"v": 1,
"t": kind, ...}``. Decoding is strict (known kind, exact keys, types and
ranges checked) and raises :class:`NotifError` naming the field; a peer can
send nothing but plain msgpack scalars, lists, maps and bytes (never pickle).

Kinds (``C`` = consumer rank, ``P`` = producer rank):

* ``hello`` C->P: the consumer rank's encoded ``AgentMetadata`` (so the
  producer can add it as a transport peer to answer, and in push mode write to it),
  sealed when a cluster secret is configured (:mod:`kvbridge.auth`; a producer
  with one ignores any other hello, so only a member becomes its peer).
* ``read`` C->P (pull): the notification of a READ (or a standalone "I will not
  read" with ``read=False``: full prefix hit, abort). ``expected`` is how many
  consumer ranks will notify this producer rank for the request.
* ``begin`` C->P (pull): sent just before a READ is posted: "confirm the
  hold and keep it ``lease_s`` more". The answer lets the consumer finish the
  request as soon as the READ is done, without waiting for the ``ack`` of its
  ``read`` (see ``held``). Optional ``dig``/``alg``: the producer block ids,
  per region, whose digests (``layouts.digests``, algorithm ``alg``) the
  consumer asks for; sent only to a producer whose handshake advertised ``alg``.
  With a slice algorithm (``alg = "xxh3-64-slices"`` or
  ``"torch-mix64-v1-slices"``) every asked digest is a slice digest: over the
  bytes this consumer rank reads of the block from this producer rank
  (``connectors.pd.verify``); ``held`` and ``pushed`` answer in the same algorithm.
* ``held`` P->C (pull): the answer to ``begin``. ``ok=True`` promises that the
  blocks stay held (not freed, not reused) for at least ``lease_s`` seconds
  after the producer got the ``begin``, whatever else happens short of the
  producer process dying; so a READ the consumer saw complete within
  ``lease_s`` of *sending* the ``begin`` read good bytes. ``ok=False`` (lease
  expired, not held yet, unknown) promises nothing: the consumer waits for the
  ``ack`` of its ``read``, which decides. Optional ``dig``/``alg``: the
  digests asked for in the ``begin``, per region in the order asked, packed
  (8 bytes each); absent when the producer could not take them (not held, a
  block id it does not hold), which the consumer counts as unverified.
* ``ack`` P->C: the producer's verdict on one ``read`` or ``register``:
  ``ok=False`` means the lease had expired or the request is unknown, so the
  bytes read may be stale and the consumer must fail the request closed.
* ``heartbeat`` C->P: renew the leases of the listed producer request ids.
* ``register`` C->P (push): the consumer's block ids to write into, from
  block index ``start[r]`` of each region on.
* ``pushed`` P->C (push): every write of this producer rank for the request is
  done (``ok``), or it will not come (``ok=False``). Optional ``dig``/``alg``:
  when the ``register`` named a digest algorithm (``alg``), the digests of the
  producer blocks written, per region, one for each registered block in order.

Sealed params (:mod:`kvbridge.connectors.sealing`): ``begin`` and ``read`` carry
``rec``, the 16-byte digest of the sealed params the consumer loads (a
producer answers only the record it sealed); a push ``register`` carries
``chain``, the consumer's 32-byte prompt chain (a producer writes only to the
prompt it computed). Both optional on the wire, absent when empty.

Who may send what (checked by the worker, not here): a producer acts on the
C->P kinds only from an agent that said ``hello``, naming that hello's rank
as ``consumer_rank``, with the ``expected`` count the producer computes for the
consumer's topology; a consumer acts on P->C kinds only from the agent of
the producer rank its session handshook with.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgpack

NOTIF_VERSION = 1
MAX_NOTIF_BYTES = 1 << 20
MAX_IDS = 1 << 20


class NotifError(ValueError):
    """A notification that does not follow the schema; ``field`` names what was wrong."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"notif.{field}: {reason}")
        self.field = field
        self.reason = reason


class NotifKind(str, enum.Enum):
    HELLO = "hello"
    READ = "read"
    ACK = "ack"
    HEARTBEAT = "heartbeat"
    REGISTER = "register"
    PUSHED = "pushed"
    BEGIN = "begin"
    HELD = "held"


@dataclass(frozen=True)
class Hello:
    agent: bytes  # encode_agent(AgentMetadata) of the sender rank


@dataclass(frozen=True)
class ReadDone:
    request_id: str  # the producer's request id
    consumer_rank: int
    expected: int  # consumer ranks that notify this producer rank for the request
    read: bool = True  # False: released without reading (prefix hit, abort)
    #: the digest of the sealed params this consumer loads (``sealing.record_digest``)
    record: bytes = b""


@dataclass(frozen=True)
class Ack:
    request_id: str
    producer_rank: int
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class Heartbeat:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Register:
    request_id: str  # the producer's request id
    consumer_rank: int
    expected: int  # consumer ranks that register with this producer rank
    start: tuple[int, ...]  # first block index per region
    block_ids: tuple[tuple[int, ...], ...]  # consumer block ids from ``start`` on, per region
    cancel: bool = False  # the consumer will not take the KV (prefix hit, abort)
    algorithm: str = ""  # ask for digests of the written blocks in ``pushed`` (to verify them)
    #: the consumer's prompt chain over the tokens it takes (``sealing.prompt_chain``)
    chain: bytes = b""


@dataclass(frozen=True)
class Pushed:
    request_id: str
    producer_rank: int
    ok: bool
    reason: str = ""
    #: packed digests per region of every block written, in registered order (the consumer checks them)
    digests: tuple[bytes, ...] = ()
    algorithm: str = ""


@dataclass(frozen=True)
class Begin:
    request_id: str  # the producer's request id
    consumer_rank: int
    #: producer block ids per region whose digests the consumer asks for (empty: none)
    digest_ids: tuple[tuple[int, ...], ...] = ()
    algorithm: str = ""  # the digest algorithm asked for (with ``digest_ids``)
    #: the digest of the sealed params this consumer loads (``sealing.record_digest``)
    record: bytes = b""


@dataclass(frozen=True)
class Held:
    request_id: str
    producer_rank: int
    ok: bool
    lease_s: float  # ok: held at least this long after the producer got the ``begin``
    reason: str = ""
    #: packed digests per region, in the order the ``begin`` asked (empty: none taken)
    digests: tuple[bytes, ...] = ()
    algorithm: str = ""


Notif = Hello | ReadDone | Ack | Heartbeat | Register | Pushed | Begin | Held


def encode(msg: Notif) -> bytes:
    body: dict[str, Any]
    if isinstance(msg, Hello):
        body = {"t": NotifKind.HELLO.value, "agent": bytes(msg.agent)}
    elif isinstance(msg, ReadDone):
        body = {"t": NotifKind.READ.value, "rid": msg.request_id, "cr": msg.consumer_rank,
                "n": msg.expected, "read": msg.read}
        if msg.record:
            body["rec"] = bytes(msg.record)
    elif isinstance(msg, Ack):
        body = {"t": NotifKind.ACK.value, "rid": msg.request_id, "pr": msg.producer_rank,
                "ok": msg.ok, "why": msg.reason}
    elif isinstance(msg, Heartbeat):
        body = {"t": NotifKind.HEARTBEAT.value, "rids": list(msg.request_ids)}
    elif isinstance(msg, Register):
        body = {"t": NotifKind.REGISTER.value, "rid": msg.request_id, "cr": msg.consumer_rank,
                "n": msg.expected, "start": list(msg.start),
                "ids": [list(g) for g in msg.block_ids], "cancel": msg.cancel}
        if msg.algorithm:
            body["alg"] = msg.algorithm
        if msg.chain:
            body["chain"] = bytes(msg.chain)
    elif isinstance(msg, Pushed):
        body = {"t": NotifKind.PUSHED.value, "rid": msg.request_id, "pr": msg.producer_rank,
                "ok": msg.ok, "why": msg.reason}
        if msg.digests:
            body["dig"] = [bytes(d) for d in msg.digests]
            body["alg"] = msg.algorithm
    elif isinstance(msg, Begin):
        body = {"t": NotifKind.BEGIN.value, "rid": msg.request_id, "cr": msg.consumer_rank}
        if msg.digest_ids:  # absent unless asked: a producer before digests reads it as ever
            body["dig"] = [list(g) for g in msg.digest_ids]
            body["alg"] = msg.algorithm
        if msg.record:
            body["rec"] = bytes(msg.record)
    elif isinstance(msg, Held):
        body = {"t": NotifKind.HELD.value, "rid": msg.request_id, "pr": msg.producer_rank,
                "ok": msg.ok, "for": float(msg.lease_s), "why": msg.reason}
        if msg.digests:
            body["dig"] = [bytes(d) for d in msg.digests]
            body["alg"] = msg.algorithm
    else:  # pragma: no cover - the union is closed
        raise TypeError(f"not a notification: {msg!r}")
    body["v"] = NOTIF_VERSION
    return msgpack.packb(body, use_bin_type=True)


#: keys a kind may carry besides its own (digests: optional, so a message without them is
#: the bytes it always was): both or neither
_OPTIONAL = {NotifKind.BEGIN: {"dig", "alg"}, NotifKind.HELD: {"dig", "alg"},
             NotifKind.PUSHED: {"dig", "alg"}, NotifKind.REGISTER: {"alg"}}
#: keys a kind may carry alone (absent from a peer with nothing to say): the sealed
#: record's digest, the prompt chain of a push registration
_SOLO = {NotifKind.BEGIN: {"rec"}, NotifKind.READ: {"rec"}, NotifKind.REGISTER: {"chain"}}
MAX_REGIONS = 64
RECORD_BYTES = 16
CHAIN_BYTES = 32

_KEYS = {
    NotifKind.HELLO: {"agent"},
    NotifKind.READ: {"rid", "cr", "n", "read"},
    NotifKind.ACK: {"rid", "pr", "ok", "why"},
    NotifKind.HEARTBEAT: {"rids"},
    NotifKind.REGISTER: {"rid", "cr", "n", "start", "ids", "cancel"},
    NotifKind.PUSHED: {"rid", "pr", "ok", "why"},
    NotifKind.BEGIN: {"rid", "cr"},
    NotifKind.HELD: {"rid", "pr", "ok", "for", "why"},
}


def _int(obj: dict[str, Any], key: str, lo: int = 0, hi: int = 1 << 31) -> int:
    value = obj[key]
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value < hi:
        raise NotifError(key, f"expected an integer in [{lo}, {hi}), got {value!r}")
    return value


def _str(obj: dict[str, Any], key: str, allow_empty: bool = False) -> str:
    value = obj[key]
    if not isinstance(value, str) or (not value and not allow_empty) or len(value) > 1024:
        raise NotifError(key, f"expected a string of 1..1024 chars, got {value!r:.80}")
    return value


def _bool(obj: dict[str, Any], key: str) -> bool:
    value = obj[key]
    if not isinstance(value, bool):
        raise NotifError(key, f"expected a boolean, got {value!r}")
    return value


def _seconds(obj: dict[str, Any], key: str) -> float:
    value = obj[key]
    if (not isinstance(value, int | float) or isinstance(value, bool)
            or not 0.0 <= value <= 1e6):
        raise NotifError(key, f"expected seconds in [0, 1e6], got {value!r}")
    return float(value)


def _int_list(value: object, field: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_IDS:
        raise NotifError(field, "expected a list of integers")
    for i, x in enumerate(value):
        if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < (1 << 31):
            raise NotifError(f"{field}[{i}]", f"expected an integer >= 0, got {x!r}")
    return tuple(value)


def _fixed_bytes(obj: dict[str, Any], key: str, size: int) -> bytes:
    """An optional key of exactly ``size`` bytes; b"" when absent."""
    if key not in obj:
        return b""
    value = obj[key]
    if not isinstance(value, bytes) or len(value) != size:
        raise NotifError(key, f"expected {size} bytes, got {type(value).__name__}"
                              f"{f' of {len(value)}' if isinstance(value, bytes) else ''}")
    return value


def _digest_lists(obj: dict[str, Any]) -> tuple[tuple[bytes, ...], str]:
    """The optional ``dig``/``alg`` of an answer: packed digests per region."""
    if "dig" not in obj:
        return (), ""
    packed = obj["dig"]
    if not isinstance(packed, list) or not 0 < len(packed) <= MAX_REGIONS or any(
            not isinstance(d, bytes) or len(d) % 8 for d in packed):
        raise NotifError("dig", f"expected 1..{MAX_REGIONS} byte strings of 8-byte digests")
    return tuple(packed), _str(obj, "alg")


def decode(data: bytes) -> Notif:
    """Parse one notification; raises :class:`NotifError` naming the field."""
    if len(data) > MAX_NOTIF_BYTES:
        raise NotifError("size", f"{len(data)} bytes exceed {MAX_NOTIF_BYTES}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types for garbage
        raise NotifError("bytes", f"not msgpack: {exc!r}") from None
    if not isinstance(obj, dict):
        raise NotifError("bytes", f"expected a map, got {type(obj).__name__}")
    if obj.get("v") != NOTIF_VERSION:
        raise NotifError("v", f"expected version {NOTIF_VERSION}, got {obj.get('v')!r}")
    try:
        kind = NotifKind(obj.get("t"))
    except ValueError:
        raise NotifError("t", f"unknown kind {obj.get('t')!r}") from None
    keys = set(obj) - {"v", "t"} - _SOLO.get(kind, set())
    optional = _OPTIONAL.get(kind, set())
    if keys - optional != _KEYS[kind] or 0 < len(keys & optional) < len(optional):
        missing = sorted((_KEYS[kind] | (optional if keys & optional else set())) - keys)
        extra = sorted(keys - _KEYS[kind] - optional)
        name = (missing or extra)[0]
        raise NotifError(name, "missing" if missing else f"unknown key for kind {kind.value}")
    if kind is NotifKind.HELLO:
        agent = obj["agent"]
        if not isinstance(agent, bytes) or not agent:
            raise NotifError("agent", "expected non-empty bytes")
        return Hello(agent)
    if kind is NotifKind.READ:
        return ReadDone(_str(obj, "rid"), _int(obj, "cr"), _int(obj, "n", 1), _bool(obj, "read"),
                        _fixed_bytes(obj, "rec", RECORD_BYTES))
    if kind is NotifKind.ACK:
        return Ack(_str(obj, "rid"), _int(obj, "pr"), _bool(obj, "ok"),
                   _str(obj, "why", allow_empty=True))
    if kind is NotifKind.PUSHED:
        return Pushed(_str(obj, "rid"), _int(obj, "pr"), _bool(obj, "ok"),
                      _str(obj, "why", allow_empty=True), *_digest_lists(obj))
    if kind is NotifKind.BEGIN:
        ids: tuple[tuple[int, ...], ...] = ()
        if "dig" in obj:
            groups = obj["dig"]
            if not isinstance(groups, list) or not 0 < len(groups) <= MAX_REGIONS:
                raise NotifError("dig", f"expected 1..{MAX_REGIONS} block-id lists")
            ids = tuple(_int_list(g, f"dig[{i}]") for i, g in enumerate(groups))
            if sum(len(g) for g in ids) > MAX_IDS:
                raise NotifError("dig", f"more than {MAX_IDS} block ids")
        return Begin(_str(obj, "rid"), _int(obj, "cr"), ids, _str(obj, "alg") if ids else "",
                     _fixed_bytes(obj, "rec", RECORD_BYTES))
    if kind is NotifKind.HELD:
        held = Held(_str(obj, "rid"), _int(obj, "pr"), _bool(obj, "ok"), _seconds(obj, "for"),
                    _str(obj, "why", allow_empty=True), *_digest_lists(obj))
        if held.ok and held.lease_s <= 0:
            raise NotifError("for", "an ok answer must promise a positive time")
        return held
    if kind is NotifKind.HEARTBEAT:
        rids = obj["rids"]
        if not isinstance(rids, list) or len(rids) > MAX_IDS:
            raise NotifError("rids", "expected a list of request ids")
        for i, rid in enumerate(rids):
            if not isinstance(rid, str) or not rid:
                raise NotifError(f"rids[{i}]", f"expected a request id, got {rid!r}")
        return Heartbeat(tuple(rids))
    start = _int_list(obj["start"], "start")
    groups = obj["ids"]
    if not isinstance(groups, list) or len(groups) != len(start):
        raise NotifError("ids", f"expected {len(start)} block-id lists (one per region)")
    ids = tuple(_int_list(g, f"ids[{i}]") for i, g in enumerate(groups))
    return Register(_str(obj, "rid"), _int(obj, "cr"), _int(obj, "n", 1), start, ids,
                    _bool(obj, "cancel"), _str(obj, "alg") if "alg" in obj else "",
                    _fixed_bytes(obj, "chain", CHAIN_BYTES))
