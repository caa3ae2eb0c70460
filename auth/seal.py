"""Sealed messages: the wire form of an authenticated request or reply.

Layout (version 1, 60 bytes of header, then the body unchanged)::

    magic    4   b"KVA1"
    sent_ms  8   sender's wall clock, ms since the epoch, uint64 big-endian
    nonce   16   random per message
    tag     32   HMAC-SHA256(key, "kvbridge-auth-v1" 0 label 0 len(bound) bound
                             magic sent_ms nonce body)

``label`` names the socket and direction (:class:`Label`), so a request for
one socket cannot be replayed to another, nor a reply passed off as a request.
``bound`` is empty for a request and the request's nonce for its reply: a
reply proves the server holds the secret *and* answers this request. The key
is derived from the cluster secret (:class:`~kvbridge.auth.secret.Secret`).

A server opens a request with :meth:`ClusterAuth.open_request`: the tag must
match (constant-time compare), ``sent_ms`` must be within ``max_skew_s`` of
its clock, and the nonce must be new inside the window. Only requests with a
valid tag are remembered, so a stranger cannot fill the window; a window full
of live nonces (sustained > capacity / window requests per second) refuses
with a retryable reason instead of forgetting one early.
"""

from __future__ import annotations

import enum
import hmac
import secrets
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass

from kvbridge.auth.secret import Secret

MAGIC = b"KVA1"
_HEAD = struct.Struct(">4sQ16s")
NONCE_BYTES = 16
TAG_BYTES = 32
HEADER_BYTES = _HEAD.size + TAG_BYTES
_DOMAIN = b"kvbridge-auth-v1\0"
#: Largest difference between a request's clock and the server's, in seconds.
MAX_SKEW_S = 60.0
#: Nonces a server remembers at once (each ~100 bytes): 2**18 in two windows is
#: ~2,000 authenticated requests a second, sustained, before "busy".
NONCE_WINDOW_CAPACITY = 1 << 18


class Label(bytes, enum.Enum):
    """Which socket (and direction) a sealed message is for."""

    SIDE_CHANNEL = b"side-channel"
    CONTROL = b"control"
    EVENTS_REPLAY = b"events-replay"
    NIXL_HELLO = b"nixl-hello"
    #: the same label under a transport-neutral name (an alias: one value on the wire,
    #: which kept the name of the first PD transport)
    PEER_HELLO = b"nixl-hello"


class AuthError(Exception):
    """A message that does not authenticate. ``reason`` says why (never secret)."""

    def __init__(self, reason: str, *, retryable: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retryable = retryable


@dataclass(frozen=True)
class Sealed:
    """An opened message: its body, its nonce (a reply is bound to it), its clock."""

    body: bytes
    nonce: bytes
    sent_ms: int


def is_sealed(data: bytes) -> bool:
    """Whether ``data`` starts like a sealed message (not whether it authenticates)."""
    return len(data) >= HEADER_BYTES and data[:4] == MAGIC


def _tag(secret: Secret, label: bytes, bound: bytes, head: bytes, body: bytes) -> bytes:
    return secret.mac(_DOMAIN, label, b"\0", bytes([len(bound)]), bound, head, body)


def seal(secret: Secret, label: bytes, body: bytes, *, bound: bytes = b"",
         sent_ms: int | None = None, nonce: bytes | None = None) -> tuple[bytes, bytes]:
    """``(wire bytes, nonce)`` of ``body`` sealed for ``label``."""
    nonce = secrets.token_bytes(NONCE_BYTES) if nonce is None else nonce
    if len(nonce) != NONCE_BYTES or len(bound) > 255:
        raise ValueError("nonce must be 16 bytes and bound at most 255")
    sent = int(time.time() * 1000) if sent_ms is None else sent_ms
    head = _HEAD.pack(MAGIC, sent, nonce)
    return head + _tag(secret, label, bound, head, body) + body, nonce


def open_sealed(secret: Secret, label: bytes, data: bytes, *, bound: bytes = b"") -> Sealed:
    """The body of a sealed message whose tag matches; raises :class:`AuthError`."""
    if len(data) < HEADER_BYTES or data[:4] != MAGIC:
        raise AuthError("authentication required: the message is not sealed with the "
                        "cluster secret")
    head, tag, body = data[:_HEAD.size], data[_HEAD.size:HEADER_BYTES], data[HEADER_BYTES:]
    if not hmac.compare_digest(tag, _tag(secret, label, bound, head, body)):
        raise AuthError("authentication failed: the tag does not match (a different "
                        "cluster secret, or the message was changed)")
    _, sent_ms, nonce = _HEAD.unpack(head)
    return Sealed(body, nonce, sent_ms)


class NonceWindow:
    """Nonces seen in the last ``2 * max_skew_s`` seconds, at most ``capacity``."""

    def __init__(self, max_skew_s: float = MAX_SKEW_S,
                 capacity: int = NONCE_WINDOW_CAPACITY) -> None:
        self.max_skew_s = max_skew_s
        self.capacity = capacity
        self._seen: set[bytes] = set()
        self._order: deque[tuple[float, bytes]] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, nonce: bytes, sent_ms: int, now_s: float) -> None:
        """Raise :class:`AuthError` unless the clock is in the window and ``nonce`` is new."""
        skew = sent_ms / 1000.0 - now_s
        if abs(skew) > self.max_skew_s:
            raise AuthError(f"clock skew {skew:+.0f} s exceeds {self.max_skew_s:.0f} s: "
                            "synchronise the hosts' clocks (NTP)")
        with self._lock:
            horizon = now_s - 2 * self.max_skew_s
            while self._order and self._order[0][0] < horizon:
                self._seen.discard(self._order.popleft()[1])
            if nonce in self._seen:
                raise AuthError("replayed request: this nonce was already used")
            if len(self._seen) >= self.capacity:
                raise AuthError("busy: too many authenticated requests in the clock "
                                "window; retry", retryable=True)
            self._seen.add(nonce)
            self._order.append((now_s, nonce))


class ClusterAuth:
    """Both ends of sealed request/reply exchanges for one secret.

    Servers: :meth:`open_request` then :meth:`seal_reply`. Clients:
    :meth:`seal_request` then :meth:`open_reply` with the nonce it returned.
    Thread-safe (the nonce window has a lock).
    """

    def __init__(self, secret: Secret, *, max_skew_s: float = MAX_SKEW_S,
                 capacity: int = NONCE_WINDOW_CAPACITY) -> None:
        self.secret = secret
        self.window = NonceWindow(max_skew_s, capacity)

    def seal_request(self, label: Label, body: bytes) -> tuple[bytes, bytes]:
        return seal(self.secret, label.value, body)

    def open_request(self, label: Label, data: bytes, *, now_s: float | None = None) -> Sealed:
        opened = open_sealed(self.secret, label.value, data)
        self.window.admit(opened.nonce, opened.sent_ms,
                          time.time() if now_s is None else now_s)
        return opened

    def seal_reply(self, label: Label, request_nonce: bytes, body: bytes) -> bytes:
        return seal(self.secret, label.value + b"/reply", body, bound=request_nonce)[0]

    def open_reply(self, label: Label, request_nonce: bytes, data: bytes) -> bytes:
        if not is_sealed(data):
            raise AuthError("the peer answered without authentication: it has no cluster "
                            "secret configured, or it is not a member")
        return open_sealed(self.secret, label.value + b"/reply", data,
                           bound=request_nonce).body

    def __repr__(self) -> str:
        return f"ClusterAuth({self.secret!r})"
