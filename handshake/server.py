"""The handshake server: a sans-I/O metadata store and a thin ZMQ socket around it.

:class:`MetadataStore` is the protocol: it holds one engine's per-rank
metadata, stamps generations, and turns request bytes into reply bytes with
:meth:`MetadataStore.handle_request`, a pure function of its state and the
clock that never raises. :class:`HandshakeServer` owns a ZMQ STREAM socket (ZMTP
framing in :mod:`kvbridge.handshake.zmtp`, bounded per message) and only
moves messages between the socket and ``handle_request``, either on its own
thread (:meth:`start` / :meth:`stop`) or when its owner calls :meth:`poll`.

Invariants:

* A malformed request of any shape gets exactly one error reply naming the
  field, and the server goes on serving (nothing a peer sends can raise out of
  the loop).
* ``generation`` only grows: every publish or withdrawal of a rank bumps it,
  and a published rank carries the generation of its publication. A client
  that saw ``(incarnation, generation)`` may reuse what it saw as long as both
  are unchanged.
* ``incarnation`` is random per store, i.e. per engine process start, so a
  client tells a restarted engine at the same address from the old one.
* With a cluster secret (``auth``, :mod:`kvbridge.auth`) a request that is not
  sealed with it, is replayed, or comes from a clock outside the window gets
  one unsealed ``auth`` error reply and nothing else: no metadata, no status,
  not even whether a rank registered. Replies to members are sealed, bound to
  their request. Without a secret the server binds loopback only, unless its
  owner passes ``insecure_no_auth``.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import zmq

from kvbridge.auth import HEADER_BYTES, AuthError, ClusterAuth, Label, check_bind, is_sealed
from kvbridge.handshake.address import format_address, zmq_endpoint
from kvbridge.handshake.errors import HandshakeError
from kvbridge.handshake.schema import (
    MAX_REQUEST_BYTES,
    AgentMetadata,
    CompatHeader,
    EngineMetadata,
    ErrorReply,
    MetadataReply,
    MetadataRequest,
    RankKey,
    Reply,
    RequestKind,
    ServerClock,
    StatusReply,
    TransferMode,
    check_agent,
    decode_request,
    encode_engine,
    encode_reply,
    peek_request_id,
)
from kvbridge.handshake.zmtp import (
    ZmtpConnection,
    ZmtpError,
    encode_message,
    server_greeting,
)
from kvbridge.layouts import KVCacheSpec, LayoutError, ParallelTopology

logger = logging.getLogger(__name__)

_Selection = tuple[int | None, int | None, int | None]

#: Largest message (all its frames) a peer may send: requests are a few dozen bytes;
#: up to this size an oversized request still gets an error reply naming it.
MAX_FRAME_BYTES = 4 * MAX_REQUEST_BYTES
#: Most frames in one request message (a REQ peer's delimiter, the payload, slack).
MAX_REQUEST_FRAMES = 4
#: Most peer connections served at once; one more is disconnected at once.
MAX_CONNECTIONS = 1024

#: At most one traceback per this many seconds for requests that hit a bug of ours.
INTERNAL_ERROR_LOG_INTERVAL_S = 60.0


class MetadataStore:
    """One engine's handshake state and the sans-I/O request handler.

    Thread-safe: workers (or the connector) may :meth:`publish` while a server
    thread calls :meth:`handle_request`.
    """

    def __init__(self, engine_id: str, spec: KVCacheSpec, topology: ParallelTopology,
                 transfer_mode: TransferMode = TransferMode.PULL, *,
                 incarnation: str | None = None,
                 auth: ClusterAuth | None = None,
                 wall_clock: Callable[[], float] = time.time,
                 monotonic_clock: Callable[[], float] = time.monotonic) -> None:
        try:
            spec.validate_topology(topology)
        except LayoutError as exc:
            raise HandshakeError(exc.field, exc.reason) from None
        if not isinstance(engine_id, str) or not engine_id or not engine_id.isprintable() \
                or len(engine_id) > 256:
            raise HandshakeError("engine_id", f"expected a printable name of 1..256 chars, "
                                              f"got {engine_id!r}")
        self.engine_id = engine_id
        self.spec = spec
        self.topology = topology.sizes()
        self.header = CompatHeader.from_spec(spec, TransferMode(transfer_mode))
        self.incarnation = incarnation or secrets.token_hex(8)
        self._wall = wall_clock
        self._mono = monotonic_clock
        self._lock = threading.Lock()
        self._ranks: dict[RankKey, AgentMetadata] = {}
        self._generation = 0
        self._doc_cache: dict[_Selection, tuple[int, bytes]] = {}
        #: the cluster secret's seal (None: unauthenticated, loopback only)
        self.auth = auth
        #: requests refused because they did not authenticate
        self.auth_refused = 0
        #: requests that hit a bug of ours (answered "internal error"; rate-limited log)
        self.internal_errors = 0
        self._last_internal_log = -math.inf

    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    @property
    def fingerprint(self) -> str:
        return self.header.fingerprint

    def publish(self, meta: AgentMetadata) -> AgentMetadata:
        """Add or replace one rank's metadata; returns it stamped with the new generation.

        Call it when a rank registers (or re-registers) its KV memory. Raises a
        HandshakeError naming the field if the metadata is inconsistent with
        this engine (other engine id, spec or topology sizes) or with itself.
        """
        if meta.engine_id != self.engine_id:
            raise HandshakeError("engine_id", f"{meta.engine_id!r} published to the store of "
                                              f"{self.engine_id!r}")
        if meta.spec != self.spec:
            raise HandshakeError("spec", "differs from the spec this store serves")
        if meta.topology.sizes() != self.topology:
            raise HandshakeError("topology", f"sizes {meta.topology.describe()} differ from "
                                             f"the engine's {self.topology.describe()}")
        check_agent(meta)
        with self._lock:
            self._generation += 1
            stamped = replace(meta, generation=self._generation)
            self._ranks[stamped.rank] = stamped
            self._doc_cache.clear()
        logger.debug("handshake: published %s of %s at generation %d",
                     stamped.rank.describe(), self.engine_id, stamped.generation)
        return stamped

    def withdraw(self, pp_rank: int = 0, tp_rank: int = 0, pcp_rank: int = 0) -> bool:
        """Forget one rank (it deregistered its memory); bumps the generation."""
        with self._lock:
            removed = self._ranks.pop(RankKey(pp_rank, pcp_rank, tp_rank), None)
            if removed is not None:
                self._generation += 1
                self._doc_cache.clear()
        return removed is not None

    def registered(self) -> list[RankKey]:
        with self._lock:
            return sorted(self._ranks)

    def snapshot(self, pp_rank: int | None = None, tp_rank: int | None = None,
                 pcp_rank: int | None = None) -> EngineMetadata:
        """The engine metadata of the selected ranks (only those registered)."""
        probe = MetadataRequest(0, RequestKind.GET, pp_rank, tp_rank, pcp_rank)
        with self._lock:
            ranks = tuple(m for k, m in sorted(self._ranks.items()) if probe.selects(k))
            generation = self._generation
        return EngineMetadata(self.header, self.engine_id, self.incarnation, generation,
                              self.spec, self.topology, ranks)

    # ------------------------------------------------------------------ protocol

    def clock(self) -> ServerClock:
        return ServerClock(self._wall(), self._mono())

    def handle_request(self, data: bytes) -> bytes:
        """Reply bytes for request bytes. Never raises; errors become an ErrorReply."""
        return self.answer(data)[1]

    def answer(self, data: bytes) -> tuple[Reply, bytes]:
        """The typed reply to wire bytes and the bytes to send (sealed for a member).

        With a secret, ``data`` must be a sealed request; anything else is answered
        by an unsealed ``auth`` error that says nothing about this engine.
        Without one, a sealed request is refused too (the client would refuse
        our unsealed answer anyway), naming why.
        """
        auth = self.auth
        sealed = is_sealed(data)
        if auth is None:
            if sealed:
                reply: Reply = ErrorReply(peek_request_id(data[HEADER_BYTES:]), self.clock(),
                                          "auth",
                                          "this engine has no cluster secret configured")
                return reply, encode_reply(reply)
            reply = self.respond(data)
            return reply, encode_reply(reply)
        try:
            opened = auth.open_request(Label.SIDE_CHANNEL, data)
        except AuthError as exc:
            self.auth_refused += 1
            rid = peek_request_id(data[HEADER_BYTES:] if sealed else data)
            reply = ErrorReply(rid, self.clock(), "auth", exc.reason, retryable=exc.retryable)
            return reply, encode_reply(reply)
        reply = self.respond(opened.body)
        return reply, auth.seal_reply(Label.SIDE_CHANNEL, opened.nonce, encode_reply(reply))

    def respond(self, data: bytes) -> Reply:
        """The typed reply to request bytes. Never raises."""
        try:
            return self._reply(data)
        except Exception as exc:  # a bug of ours must not kill the server either
            self.internal_errors += 1
            now = self._mono()
            if now - self._last_internal_log >= INTERNAL_ERROR_LOG_INTERVAL_S:
                # a peer repeating the request that hits the bug must not flood the log
                self._last_internal_log = now
                logger.error("handshake: internal error answering a request (%d so far; "
                             "logged at most every %.0f s)", self.internal_errors,
                             INTERNAL_ERROR_LOG_INTERVAL_S, exc_info=True)
            return ErrorReply(peek_request_id(data), self.clock(), "server",
                              f"internal error: {type(exc).__name__}")

    def _reply(self, data: bytes) -> Reply:
        try:
            request = decode_request(data, MAX_REQUEST_BYTES)
        except HandshakeError as exc:
            return ErrorReply(peek_request_id(data), self.clock(), exc.field, exc.reason)
        if request.kind is RequestKind.PING:
            with self._lock:
                generation = self._generation
            return StatusReply(request.request_id, self.clock(), self.engine_id,
                               self.incarnation, generation, unchanged=False)
        for name, value, size in (("pp_rank", request.pp_rank, self.topology.pp_size),
                                  ("tp_rank", request.tp_rank, self.topology.tp_size),
                                  ("pcp_rank", request.pcp_rank, self.topology.pcp_size)):
            if value is not None and value >= size:
                return ErrorReply(request.request_id, self.clock(), name,
                                  f"{value} out of range: engine {self.engine_id!r} has "
                                  f"{self.topology.describe()}")
        selection: _Selection = (request.pp_rank, request.tp_rank, request.pcp_rank)
        wanted = [RankKey.of(t) for t in self.topology.ranks() if request.selects(RankKey.of(t))]
        with self._lock:
            generation = self._generation
            missing = [k for k in wanted if k not in self._ranks]
            cached = self._doc_cache.get(selection)
        if missing:
            return ErrorReply(request.request_id, self.clock(), "ranks",
                              f"rank(s) {', '.join(k.describe() for k in missing[:8])} of "
                              f"engine {self.engine_id!r} have not registered yet",
                              retryable=True)
        if (request.known_incarnation == self.incarnation
                and request.known_generation == generation):
            return StatusReply(request.request_id, self.clock(), self.engine_id,
                               self.incarnation, generation, unchanged=True)
        if cached is not None and cached[0] == generation:
            doc = cached[1]
        else:
            snapshot = self.snapshot(*selection)
            try:
                doc = encode_engine(snapshot)
            except HandshakeError as exc:
                return ErrorReply(request.request_id, self.clock(), exc.field, exc.reason)
            with self._lock:
                if self._generation == snapshot.generation:
                    self._doc_cache[selection] = (snapshot.generation, doc)
        return MetadataReply(request.request_id, self.clock(), doc)


class HandshakeServer:
    """Serves one :class:`MetadataStore` to DEALER and REQ peers over a ZMQ STREAM socket.

    libzmq owns TCP; the ZMTP framing is :mod:`kvbridge.handshake.zmtp`, so that a
    whole message, not only a frame, is bounded (a ROUTER would hold the frames of
    a message a peer never finishes without limit). Per connection the server holds
    at most one message in progress of ``MAX_FRAME_BYTES`` in ``MAX_REQUEST_FRAMES``
    frames; a peer that exceeds it, breaks the protocol or is one connection too
    many (``MAX_CONNECTIONS``) is disconnected. The reply goes back with the
    envelope the request came with (a REQ peer's empty delimiter). Use either
    ``start()`` (own thread) or ``bind()`` + ``poll()`` (the owner's loop), not both.
    A store without a secret is served on loopback only: ``bind`` raises
    :class:`~kvbridge.auth.BindRefused` for another host unless ``insecure_no_auth``.
    """

    def __init__(self, store: MetadataStore, host: str = "127.0.0.1", port: int = 0, *,
                 context: zmq.Context | None = None, poll_interval_s: float = 0.05,
                 bind_retry_s: float = 1.0, insecure_no_auth: bool = False) -> None:
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise HandshakeError("port", f"expected 0..65535 (0 = any free port), got {port!r}")
        self.store = store
        self.host = host
        self.insecure_no_auth = insecure_no_auth
        self._requested_port = port
        self._context = context or zmq.Context.instance()
        self._poll_interval_s = poll_interval_s
        self._bind_retry_s = bind_retry_s
        self._socket: zmq.Socket | None = None
        self._port: int | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        self._peers: dict[bytes, ZmtpConnection] = {}
        #: counters a test or the CLI can read (only the serving thread writes them)
        self.requests_served = 0
        self.error_replies = 0
        self.replies_dropped = 0
        self.peers_dropped = 0  # disconnected for a protocol error or an exceeded bound

    # ------------------------------------------------------------------ addresses

    @property
    def port(self) -> int:
        if self._port is None:
            raise HandshakeError("port", "server is not bound yet; call start() or bind()")
        return self._port

    @property
    def address(self) -> str:
        """``HOST:PORT`` that clients connect to."""
        return format_address(self.host, self.port)

    @property
    def connections(self) -> int:
        """Peer connections open now."""
        return len(self._peers)

    # ------------------------------------------------------------------ owner-polled mode

    def bind(self) -> int:
        """Create and bind the socket in the calling thread; returns the bound port."""
        try:
            check_bind(self.host, self.store.auth is not None, self.insecure_no_auth,
                       "the side channel")
        except ValueError as exc:
            raise HandshakeError("host", str(exc)) from None
        if self._socket is not None:
            return self.port
        sock = self._context.socket(zmq.STREAM)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            # libzmq queues what it read from TCP per connection, in chunks of up to
            # 8 KiB; a small queue keeps that bounded while this thread is busy
            sock.setsockopt(zmq.RCVHWM, 64)
            if ":" in self.host:
                sock.setsockopt(zmq.IPV6, 1)
            if self._requested_port == 0:
                sock.bind(zmq_endpoint(self.host, "*"))
            else:
                self._bind_fixed(sock)
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._port = int(endpoint.rsplit(":", 1)[1])
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise HandshakeError("port", f"cannot bind {self.host}:{self._requested_port}: "
                                         f"{exc}") from None
        self._socket = sock
        logger.info("handshake: engine %s serving on %s", self.store.engine_id, self.address)
        return self._port

    def _bind_fixed(self, sock: zmq.Socket) -> None:
        # ZMQ closes a socket's listener asynchronously, so a server restarted on the
        # same port right after stop() can briefly see EADDRINUSE: retry, bounded.
        deadline = time.monotonic() + self._bind_retry_s
        while True:
            try:
                sock.bind(zmq_endpoint(self.host, self._requested_port))
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() >= deadline:
                    raise
                time.sleep(0.02)

    def poll(self, timeout_s: float = 0.0, max_requests: int = 256) -> int:
        """Serve what is pending (waiting up to ``timeout_s`` for the first); returns the
        number of requests answered."""
        sock = self._socket
        if sock is None:
            raise HandshakeError("server", "not bound; call bind() first")
        served = 0
        if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return 0
        for _ in range(4 * max_requests):  # reads, not requests: bounded either way
            if served >= max_requests:
                break
            try:
                peer_id, data = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            except ValueError:  # not [id, data]: cannot come from a STREAM socket
                continue
            served += self._receive(sock, peer_id, data)
        return served

    def _receive(self, sock: zmq.Socket, peer_id: bytes, data: bytes) -> int:
        conn = self._peers.get(peer_id)
        if conn is None:
            if not data:  # a new connection (an empty chunk announces it)
                if len(self._peers) >= MAX_CONNECTIONS:
                    self._disconnect(sock, peer_id, "too many connections")
                    return 0
                self._peers[peer_id] = ZmtpConnection(MAX_FRAME_BYTES, MAX_REQUEST_FRAMES)
                self._send(sock, peer_id, server_greeting())
            return 0
        if not data:  # the peer disconnected
            del self._peers[peer_id]
            return 0
        try:
            messages = conn.feed(data)
        except ZmtpError as exc:
            self._disconnect(sock, peer_id, str(exc))
            return 0
        for frames in messages:
            self._serve(sock, peer_id, frames)
        return len(messages)

    def _disconnect(self, sock: zmq.Socket, peer_id: bytes, reason: str) -> None:
        self._peers.pop(peer_id, None)
        self.peers_dropped += 1
        logger.debug("handshake: disconnecting a peer: %s", reason)
        self._send(sock, peer_id, b"")  # an empty send closes a STREAM connection

    def _send(self, sock: zmq.Socket, peer_id: bytes, data: bytes) -> bool:
        try:
            sock.send_multipart([peer_id, data], zmq.NOBLOCK)
            return True
        except zmq.Again:  # peer not reading (high-water mark): drop, never block
            return False
        except zmq.ZMQError as exc:
            logger.debug("handshake: send to a peer failed: %s", exc)
            return False

    def _serve(self, sock: zmq.Socket, peer_id: bytes, frames: list[bytes]) -> None:
        # frames = [envelope..., b""], payload. A REQ peer adds the empty delimiter,
        # a DEALER peer usually does not; reply with the same envelope.
        try:
            split = frames.index(b"") + 1
        except ValueError:
            split = 0
        envelope, body = frames[:split], frames[split:]
        reply: Reply
        if len(body) == 1:
            reply, out = self.store.answer(body[0])
        else:
            reply = ErrorReply(0, self.store.clock(), "frames",
                               f"expected one payload frame, got {len(body)}")
            out = encode_reply(reply)
        self.requests_served += 1
        if isinstance(reply, ErrorReply):
            self.error_replies += 1
            logger.debug("handshake: rejected a request: %s: %s", reply.field, reply.message)
        if not self._send(sock, peer_id, encode_message([*envelope, out])):
            self.replies_dropped += 1

    # ------------------------------------------------------------------ thread mode

    def start(self, bind_timeout_s: float = 5.0) -> HandshakeServer:
        """Serve on a daemon thread; returns once bound (raises if binding failed)."""
        if self._thread is not None:
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvbridge-handshake",
                                        daemon=True)
        self._thread.start()
        if not self._bound.wait(bind_timeout_s):
            raise HandshakeError("port", "server thread did not bind in time")
        if self._bind_error is not None:
            self._thread.join(1.0)
            self._thread = None
            raise self._bind_error
        return self

    def _run(self) -> None:
        try:
            self.bind()
        except BaseException as exc:
            self._bind_error = exc
            self._bound.set()
            return
        self._bound.set()
        try:
            while not self._stop.is_set():
                try:
                    self.poll(self._poll_interval_s)
                except zmq.ZMQError as exc:
                    if self._stop.is_set():
                        break
                    logger.warning("handshake: socket error, continuing: %s", exc)
        finally:
            self._close_socket()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop serving and close the socket; joins the thread for at most ``timeout_s``."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                logger.warning("handshake: server thread did not stop within %.1fs", timeout_s)
        else:
            self._close_socket()
        self._bound.clear()

    def _close_socket(self) -> None:
        sock, self._socket = self._socket, None
        self._peers.clear()
        if sock is not None:
            sock.close(linger=0)

    def __enter__(self) -> HandshakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
