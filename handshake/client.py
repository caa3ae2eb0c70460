"""The handshake client: bounded, retried requests and a validated result cache.

Every attempt uses a fresh socket with linger 0 that is closed before the
attempt returns, so a peer that never answers leaves nothing behind (a REQ
socket that timed out would be stuck in its send/recv state machine). It is a
ZMQ STREAM socket speaking ZMTP as a DEALER (:mod:`kvbridge.handshake.zmtp`),
so a reply is bounded as a whole message, not only per frame.
A call takes at most ``(retries + 1) * timeout_s`` plus the backoff sleeps,
each capped at ``max_backoff_s``.

Cache: per address and rank selection, the client keeps the last engine
metadata it decoded, valid for the peer's ``(engine_id, incarnation,
generation)``. A fetch sends the cached incarnation and generation; the server
answers "unchanged" (a few dozen bytes) while both are current, and the full
document otherwise. A larger generation (a rank re-registered its memory) or a
new incarnation or engine id (the peer restarted at the same address)
replaces the entry and is counted in :class:`ClientStats`.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from dataclasses import dataclass, field

import zmq

from kvbridge.auth import AuthError, ClusterAuth, Label, is_sealed
from kvbridge.handshake.address import parse_address, zmq_endpoint
from kvbridge.handshake.errors import HandshakeError, HandshakeTimeout
from kvbridge.handshake.schema import (
    MAX_MESSAGE_BYTES,
    CompatHeader,
    EngineMetadata,
    ErrorReply,
    MetadataReply,
    MetadataRequest,
    Reply,
    RequestKind,
    ServerClock,
    StatusReply,
    check_compatible,
    decode_engine,
    decode_reply,
    encode_request,
)
from kvbridge.handshake.zmtp import ZmtpConnection, ZmtpError, encode_message, server_greeting

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClockEstimate:
    """NTP-style estimate of the peer's wall clock relative to ours.

    ``offset_s`` = peer wall clock - our wall clock, assuming the reply was
    stamped halfway through the round trip; the true offset lies within
    ``offset_s +- uncertainty_s`` (half the round trip).
    """

    offset_s: float
    rtt_s: float
    uncertainty_s: float

    @classmethod
    def from_exchange(cls, sent_wall_s: float, received_wall_s: float, rtt_s: float,
                      server: ServerClock) -> ClockEstimate:
        midpoint = sent_wall_s + (received_wall_s - sent_wall_s) / 2
        return cls(server.wall_s - midpoint, rtt_s, rtt_s / 2)

    def to_local(self, remote_wall_s: float) -> float:
        """A peer wall-clock time (e.g. a lease deadline) on our wall clock."""
        return remote_wall_s - self.offset_s

    def to_remote(self, local_wall_s: float) -> float:
        return local_wall_s + self.offset_s


@dataclass(frozen=True)
class FetchResult:
    metadata: EngineMetadata
    rtt_s: float  # of the last (successful) attempt
    clock: ClockEstimate
    cached: bool  # the server said "unchanged" and the cached document was returned
    attempts: int


@dataclass(frozen=True)
class PingResult:
    status: StatusReply
    rtt_s: float
    clock: ClockEstimate
    attempts: int


@dataclass
class ClientStats:
    requests: int = 0
    attempts: int = 0
    timeouts: int = 0
    cache_hits: int = 0
    invalidated_generation: int = 0  # peer re-registered memory
    invalidated_restart: int = 0  # new incarnation or engine id at the same address


_Selection = tuple[int | None, int | None, int | None]


def _selected_count(request: MetadataRequest, metadata: EngineMetadata) -> int:
    """How many ranks of the peer's topology ``request`` selects (arithmetic: never a
    loop over the ranks a peer claims)."""
    count = 1
    sizes = metadata.topology
    for chosen, size in ((request.pp_rank, sizes.pp_size), (request.tp_rank, sizes.tp_size),
                         (request.pcp_rank, sizes.pcp_size)):
        count *= size if chosen is None else int(chosen < size)
    return count


@dataclass
class _CacheEntry:
    metadata: EngineMetadata


@dataclass
class HandshakeClient:
    """Fetch engine metadata from handshake servers.

    ``expected``: our own CompatHeader; when set, a peer whose header differs is
    refused with a HandshakeError naming the first differing field before its
    body is read. Thread-safe (one lock around the cache; requests run
    concurrently).

    ``auth``: the cluster secret's seal. Every attempt is sealed afresh (a
    retried request is a new nonce) and a reply counts only if it is sealed
    bound to it: a server without the secret is refused as not a member.
    """

    timeout_s: float = 2.0
    retries: int = 2
    backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    expected: CompatHeader | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES
    context: zmq.Context | None = None
    stats: ClientStats = field(default_factory=ClientStats)
    auth: ClusterAuth | None = None

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise HandshakeError("timeout_s", f"expected > 0, got {self.timeout_s!r}")
        if not isinstance(self.retries, int) or self.retries < 0:
            raise HandshakeError("retries", f"expected an integer >= 0, got {self.retries!r}")
        self._ctx = self.context or zmq.Context.instance()
        self._cache: dict[tuple[str, _Selection], _CacheEntry] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(random.getrandbits(32) << 16)

    # ------------------------------------------------------------------ public

    def fetch(self, address: str, *, pp_rank: int | None = None, tp_rank: int | None = None,
              pcp_rank: int | None = None, expected: CompatHeader | None = None,
              use_cache: bool = True) -> FetchResult:
        """Metadata of the selected ranks of the engine at ``address`` (``HOST:PORT``).

        All selectors None = the whole engine; ``tp_rank=t`` alone = TP rank t of
        every pipeline stage. Raises HandshakeError (HandshakeTimeout when the
        peer never answered).
        """
        expected = expected or self.expected
        host, port = parse_address(address)
        key = (f"{host}:{port}", (pp_rank, tp_rank, pcp_rank))
        with self._lock:
            entry = self._cache.get(key) if use_cache else None
        known = entry.metadata if entry is not None else None
        request_id = next(self._ids)
        request = MetadataRequest(
            request_id, RequestKind.GET, pp_rank, tp_rank, pcp_rank,
            known.incarnation if known else None, known.generation if known else None)
        reply, rtt, clock, attempts = self._exchange(host, port, request)
        if isinstance(reply, StatusReply):
            if not reply.unchanged or known is None or reply.engine_id != known.engine_id \
                    or reply.incarnation != known.incarnation \
                    or reply.generation != known.generation:
                raise HandshakeError("kind", "peer answered a metadata request with a status "
                                             "that does not match what we asked about")
            self.stats.cache_hits += 1
            if expected is not None:
                check_compatible(expected, known.header)
            return FetchResult(known, rtt, clock, True, attempts)
        assert isinstance(reply, MetadataReply)
        metadata = decode_engine(reply.engine_doc, expected, self.max_message_bytes)
        got = [m.rank for m in metadata.ranks]  # distinct and sorted (decode_engine)
        wanted = _selected_count(request, metadata)
        if len(got) != wanted or not all(request.selects(k) for k in got):
            raise HandshakeError("ranks", f"peer sent ranks {[k.describe() for k in got[:8]]} "
                                          f"({len(got)}) for a request of {wanted} rank(s) "
                                          f"(pp {request.pp_rank}, tp {request.tp_rank}, "
                                          f"pcp {request.pcp_rank}; None = all)")
        self._remember(key, known, metadata)
        return FetchResult(metadata, rtt, clock, False, attempts)

    def ping(self, address: str) -> PingResult:
        """Identity, generation and clock of the engine at ``address`` (no metadata)."""
        host, port = parse_address(address)
        reply, rtt, clock, attempts = self._exchange(
            host, port, MetadataRequest(next(self._ids), RequestKind.PING))
        if not isinstance(reply, StatusReply):
            raise HandshakeError("kind", "peer answered a ping with something else")
        return PingResult(reply, rtt, clock, attempts)

    def cached(self, address: str, *, pp_rank: int | None = None, tp_rank: int | None = None,
               pcp_rank: int | None = None) -> EngineMetadata | None:
        """What the cache holds for this address and selection, without any I/O."""
        host, port = parse_address(address)
        with self._lock:
            entry = self._cache.get((f"{host}:{port}", (pp_rank, tp_rank, pcp_rank)))
        return entry.metadata if entry else None

    def invalidate(self, address: str | None = None) -> int:
        """Drop cached metadata of ``address`` (every address if None); returns entries."""
        with self._lock:
            if address is None:
                count = len(self._cache)
                self._cache.clear()
                return count
            host, port = parse_address(address)
            keys = [k for k in self._cache if k[0] == f"{host}:{port}"]
            for k in keys:
                del self._cache[k]
            return len(keys)

    def close(self) -> None:
        """Nothing stays open between calls; this only drops the cache."""
        self.invalidate()

    def __enter__(self) -> HandshakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _remember(self, key: tuple[str, _Selection], known: EngineMetadata | None,
                  metadata: EngineMetadata) -> None:
        if known is not None:
            if (metadata.engine_id != known.engine_id
                    or metadata.incarnation != known.incarnation):
                self.stats.invalidated_restart += 1
                logger.info("handshake: peer %s restarted (incarnation %s -> %s); cached "
                            "metadata dropped", key[0], known.incarnation, metadata.incarnation)
            elif metadata.generation != known.generation:
                self.stats.invalidated_generation += 1
                logger.info("handshake: peer %s re-registered (generation %d -> %d); cached "
                            "metadata replaced", key[0], known.generation, metadata.generation)
        with self._lock:
            self._cache[key] = _CacheEntry(metadata)

    def _exchange(self, host: str, port: int, request: MetadataRequest
                  ) -> tuple[Reply, float, ClockEstimate, int]:
        """One request with retries; returns (reply, rtt, clock estimate, attempts)."""
        self.stats.requests += 1
        payload = encode_request(request)
        endpoint = zmq_endpoint(host, port)
        last_error: HandshakeError | None = None
        for attempt in range(1, self.retries + 2):
            if attempt > 1:
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 2))
                time.sleep(delay * (0.5 + random.random() / 2))
            self.stats.attempts += 1
            outcome = self._attempt(endpoint, host, payload, request.request_id)
            if isinstance(outcome, HandshakeError):
                if outcome.field == "auth":  # another try cannot have another secret
                    raise outcome
                last_error = outcome
                continue
            reply, rtt, clock = outcome
            if isinstance(reply, ErrorReply):
                error = HandshakeError(reply.field or "request",
                                       f"peer {host}:{port} refused the request: "
                                       f"{reply.message}")
                if reply.retryable:
                    last_error = error
                    continue
                raise error
            return reply, rtt, clock, attempt
        assert last_error is not None
        if isinstance(last_error, HandshakeTimeout):
            raise HandshakeTimeout(f"no answer from {host}:{port} after {self.retries + 1} "
                                   f"attempt(s) of {self.timeout_s:g}s each")
        raise last_error

    def _attempt(self, endpoint: str, host: str, payload: bytes, request_id: int
                 ) -> tuple[Reply, float, ClockEstimate] | HandshakeError:
        # A STREAM socket and our own ZMTP framing (kvbridge.handshake.zmtp), not a
        # DEALER: libzmq bounds frames but not messages, so a hostile server could
        # make a DEALER buffer frames of an endless message until the deadline.
        sock = self._ctx.socket(zmq.STREAM)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 64)
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
            sent_wall = time.time()
            sent = time.monotonic()
            deadline = sent + self.timeout_s
            sock.connect(endpoint)
            conn = ZmtpConnection(self.max_message_bytes + 4096, 4, peer_types=(b"ROUTER",))
            peer_id: bytes | None = None
            asked = False
            nonce = b""
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sock.poll(max(1, int(remaining * 1000)), zmq.POLLIN):
                    self.stats.timeouts += 1
                    return HandshakeTimeout(f"no answer from {endpoint} within "
                                            f"{self.timeout_s:g}s")
                ident, data = sock.recv_multipart(zmq.NOBLOCK)
                if peer_id is None:  # connected (an empty chunk announces it): greet
                    peer_id = ident
                    sock.send_multipart([peer_id, server_greeting(b"DEALER")])
                    if not data:
                        continue
                if not data:  # the server closed the connection
                    return HandshakeError("address", f"{endpoint} closed the connection")
                try:
                    messages = conn.feed(data)
                except ZmtpError as exc:
                    return HandshakeError("message", f"{endpoint} broke the protocol: {exc}")
                if not asked and conn.peer_socket_type is not None:
                    # libzmq refuses data before its own READY went out: ask only now
                    asked = True
                    sent_wall = time.time()
                    sent = time.monotonic()
                    wire, nonce = (payload, b"") if self.auth is None else \
                        self.auth.seal_request(Label.SIDE_CHANNEL, payload)
                    sock.send_multipart([peer_id, encode_message([wire])])
                for frames in messages:
                    received = time.monotonic()
                    received_wall = time.time()
                    opened = self._open(endpoint, frames[-1], nonce)
                    if isinstance(opened, HandshakeError):
                        return opened
                    reply = decode_reply(opened, self.max_message_bytes + 4096)
                    if self.auth is not None and opened is frames[-1]:
                        # unsealed: only the server's refusal of our request is worth reading
                        if isinstance(reply, ErrorReply) and reply.field == "auth":
                            return HandshakeError("auth", f"peer {endpoint} refused the "
                                                          f"request: {reply.message}")
                        return HandshakeError("auth", f"{endpoint} answered without "
                                                      "authentication: it has no cluster "
                                                      "secret, or it is not a member")
                    if reply.request_id != request_id:
                        logger.debug("handshake: ignoring a reply to request %d",
                                     reply.request_id)
                        continue
                    rtt = received - sent
                    return reply, rtt, ClockEstimate.from_exchange(sent_wall, received_wall,
                                                                   rtt, reply.clock)
        except zmq.ZMQError as exc:
            return HandshakeError("address", f"cannot talk to {endpoint}: {exc}")
        finally:
            sock.close(linger=0)

    def _open(self, endpoint: str, data: bytes, nonce: bytes) -> bytes | HandshakeError:
        """The reply body: ``data`` itself unless we seal and it is sealed (then checked)."""
        if self.auth is None or not is_sealed(data):
            return data
        try:
            return self.auth.open_reply(Label.SIDE_CHANNEL, nonce, data)
        except AuthError as exc:
            return HandshakeError("auth", f"{endpoint}: {exc.reason}")
