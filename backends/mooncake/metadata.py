"""Mooncake's HTTP metadata protocol, served by kvbridge on exactly the host it is given.

``mooncake_master``'s embedded HTTP metadata server listens on 0.0.0.0 whatever
``--http_metadata_server_host`` says (measured: docs/backends.md, "Mooncake store"), so
:class:`~kvbridge.backends.mooncake.master.MooncakeMaster` turns it off and runs
this server instead, bound to the master's configured host.

The protocol (Mooncake's ``mooncake/http_metadata_server.py``; what its clients
send was measured against this server, see the tests): one route,
``/metadata?key=K``.

- ``GET`` -> 200 with the stored bytes, or 404;
- ``PUT`` (body = value) -> 200; a second ``PUT`` of a key containing
  ``rpc_meta`` -> 400 (a transfer engine's RPC endpoint must not be taken over);
- ``DELETE`` -> 200, or 404;
- a missing or empty key -> 400, another path -> 404, another method -> 405.

Unlike Mooncake's server, every size is bounded *before* it is read
(:class:`MetadataLimits`): the request line and headers (the standard
library's limits), the key, each value (``Content-Length`` is required; a
chunked or oversized body is refused with 411/413 and the connection closed
without reading it), the total stored bytes and the number of keys (507), the
number of connections served at once (others are closed at accept), and the
time a connection may sit idle or mid-request (``request_timeout_s``).

:class:`MetadataStore` is the pure, synchronous core (no socket); the HTTP
handler is a thin adapter around it. :func:`main` is the entry point of the
child process the master manager starts: it serves a listening socket it
inherits (``--fd``), so the parent has bound the port, on the right host,
before the child exists, and a port conflict is the parent's error to report.
It imports only the standard library so the child starts quickly.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import logging
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any
from urllib.parse import parse_qs, urlsplit

logger = logging.getLogger(__name__)

MiB = 1 << 20
ROUTE = "/metadata"
#: A refused body read and dropped before closing, at most (bytes, seconds).
DRAIN_BYTES = 1 << 20
DRAIN_S = 1.0


@dataclass(frozen=True)
class MetadataLimits:
    """Bounds of one metadata server; every one is checked before the bytes are read.

    A transfer engine's entries are small (a segment descriptor with its
    buffers, an RPC endpoint: hundreds of bytes to a few KiB each), so the
    defaults leave room for thousands of clients and still cap the server's
    memory at ``max_total_bytes``.
    """

    max_key_bytes: int = 4096
    max_value_bytes: int = 16 * MiB
    max_total_bytes: int = 256 * MiB
    max_keys: int = 65536
    max_connections: int = 64
    request_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_key_bytes", "max_value_bytes", "max_total_bytes", "max_keys",
                     "max_connections"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MetadataLimits.{name} must be a positive int, got {value!r}")
        if not self.request_timeout_s > 0:
            raise ValueError("MetadataLimits.request_timeout_s must be > 0 seconds, "
                             f"got {self.request_timeout_s!r}")
        if self.max_value_bytes > self.max_total_bytes:
            raise ValueError("MetadataLimits.max_value_bytes must not exceed max_total_bytes")

    def argv(self) -> list[str]:
        """Command-line flags of :func:`main` that reproduce these limits."""
        return [f"--max-key-bytes={self.max_key_bytes}",
                f"--max-value-bytes={self.max_value_bytes}",
                f"--max-total-bytes={self.max_total_bytes}",
                f"--max-keys={self.max_keys}",
                f"--max-connections={self.max_connections}",
                f"--request-timeout-s={self.request_timeout_s}"]


class PutResult(enum.Enum):
    STORED = 200
    DUPLICATE_RPC_META = 400
    TOO_LARGE = 413
    FULL = 507


class MetadataStore:
    """Key -> bytes under :class:`MetadataLimits`; thread-safe, no I/O.

    Invariant: ``total_bytes`` is the sum of the stored values' lengths and
    never exceeds ``limits.max_total_bytes``; ``len(self)`` never exceeds
    ``limits.max_keys``; no value is longer than ``limits.max_value_bytes``.
    A refused put changes nothing.
    """

    def __init__(self, limits: MetadataLimits) -> None:
        self.limits = limits
        self._values: dict[str, bytes] = {}
        self._total_bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._values.get(key)

    def put(self, key: str, value: bytes) -> PutResult:
        if len(value) > self.limits.max_value_bytes:
            return PutResult.TOO_LARGE
        with self._lock:
            old = self._values.get(key)
            if old is not None and "rpc_meta" in key:
                return PutResult.DUPLICATE_RPC_META
            total = self._total_bytes - (len(old) if old is not None else 0) + len(value)
            if total > self.limits.max_total_bytes or (
                    old is None and len(self._values) >= self.limits.max_keys):
                return PutResult.FULL
            self._values[key] = value
            self._total_bytes = total
            assert 0 <= self._total_bytes <= self.limits.max_total_bytes
            return PutResult.STORED

    def delete(self, key: str) -> bool:
        with self._lock:
            old = self._values.pop(key, None)
            if old is None:
                return False
            self._total_bytes -= len(old)
            return True


class _Handler(BaseHTTPRequestHandler):
    """HTTP/1.1 adapter around :class:`MetadataStore` (keep-alive, as libcurl expects)."""

    protocol_version = "HTTP/1.1"
    server: MetadataHTTPServer

    def setup(self) -> None:
        super().setup()
        # bounds every read and write: an idle or stalled client loses its connection
        self.connection.settimeout(self.server.limits.request_timeout_s)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (stdlib's name)
        logger.debug("%s %s", self.address_string(), format % args)

    # ---- responses ----
    def _reply(self, status: int, body: bytes = b"", *, close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _key(self) -> str | None:
        """The request's key, or None after replying with the error."""
        parts = urlsplit(self.path)
        if parts.path != ROUTE:
            self._reply(404, b"not found", close=self._has_body())
            return None
        key = parse_qs(parts.query).get("key", [""])[0].strip()
        if not key:
            self._reply(400, b"metadata key is required", close=self._has_body())
            return None
        if len(key.encode("utf-8", "surrogateescape")) > self.server.limits.max_key_bytes:
            self._reply(414, b"metadata key too long", close=self._has_body())
            return None
        return key

    def _has_body(self) -> bool:
        # A body we will not read must not be parsed as the next request.
        return "Content-Length" in self.headers or "Transfer-Encoding" in self.headers

    def _body_length(self) -> int | None:
        """Content-Length when acceptable, else None after replying (and closing)."""
        if "Transfer-Encoding" in self.headers:
            self._reply(411, b"Content-Length required (no chunked bodies)", close=True)
            return None
        text = self.headers.get("Content-Length")
        if text is None or not text.isdigit():
            self._reply(411, b"Content-Length required", close=True)
            return None
        length = int(text)
        if length > self.server.limits.max_value_bytes:
            self.server.count("refused_too_large")
            self._reply(413, b"metadata value too large", close=True)
            self._drain(length)
            return None
        return length

    def _drain(self, length: int) -> None:
        """Read and drop up to :data:`DRAIN_BYTES` of a refused body, for at most
        :data:`DRAIN_S`: a socket closed with unread bytes is reset, and a client
        still sending its body would read the reset, not the answer."""
        todo = min(length, DRAIN_BYTES)
        deadline = time.monotonic() + DRAIN_S
        try:
            self.connection.settimeout(DRAIN_S)
            while todo > 0 and time.monotonic() < deadline:
                chunk = self.rfile.read1(min(todo, 1 << 16))
                if not chunk:
                    break
                todo -= len(chunk)
        except OSError:
            pass  # the client went away: nothing left to protect

    def handle_expect_100(self) -> bool:
        # Refuse an oversized body before the client sends it.
        if self.command == "PUT" and self._body_length() is None:
            return False
        return super().handle_expect_100()

    # ---- methods ----
    def do_GET(self) -> None:  # noqa: N802  (http.server's naming)
        key = self._key()
        if key is None:
            return
        value = self.server.store.get(key)
        if value is None:
            self._reply(404, b"metadata not found")
        else:
            self._reply(200, value)

    def do_PUT(self) -> None:  # noqa: N802
        length = self._body_length()
        if length is None:
            return
        key = self._key()
        if key is None:
            return
        value = self.rfile.read(length)
        if len(value) != length:
            self.close_connection = True  # the peer went away (or timed out) mid-body
            return
        result = self.server.store.put(key, value)
        if result is PutResult.STORED:
            self._reply(200, b"metadata updated")
        elif result is PutResult.DUPLICATE_RPC_META:
            self._reply(400, b"Duplicate rpc_meta key not allowed")
        elif result is PutResult.TOO_LARGE:  # not reached: the length was checked unread
            self._reply(413, b"metadata value too large")
        else:
            self.server.count("refused_full")
            self._reply(507, b"metadata store full")

    def do_DELETE(self) -> None:  # noqa: N802
        key = self._key()
        if key is None:
            return
        if self.server.store.delete(key):
            self._reply(200, b"metadata deleted")
        else:
            self._reply(404, b"metadata not found")

    def _not_allowed(self) -> None:
        self._reply(405, b"Method not allowed", close=True)

    do_POST = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed  # noqa: N815


class MetadataHTTPServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` with bounded connections and a prompt, leak-free close.

    Each connection has a thread; at most ``limits.max_connections`` are served
    at once and further ones are closed at accept. :meth:`close` stops the accept
    loop, shuts down every open connection (an idle keep-alive connection would
    otherwise hold its thread until ``request_timeout_s``), joins the threads
    and closes the listening socket.
    """

    daemon_threads = False
    block_on_close = True
    allow_reuse_address = True

    def __init__(self, listener: socket.socket, limits: MetadataLimits,
                 store: MetadataStore | None = None) -> None:
        super().__init__(listener.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = listener
        self.server_address = listener.getsockname()
        self.limits = limits
        self.store = store if store is not None else MetadataStore(limits)
        self.counters: dict[str, int] = {"refused_connections": 0, "refused_too_large": 0,
                                         "refused_full": 0}
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        self._serving: threading.Thread | None = None

    def count(self, name: str) -> None:
        with self._open_lock:
            self.counters[name] += 1

    def verify_request(self, request: Any, client_address: Any) -> bool:
        if not self._slots.acquire(blocking=False):
            self.count("refused_connections")
            return False
        with self._open_lock:
            self._open.add(request)
        return True

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open.discard(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that disconnects or times out mid-request is not a server error.
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            logger.debug("metadata connection from %s ended: %s", client_address, exc)
            return
        super().handle_error(request, client_address)

    def start(self) -> MetadataHTTPServer:
        """Serve in a (non-daemon) thread of this process until :meth:`close`."""
        self._serving = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1},
                                         name="kvbridge-mooncake-metadata")
        self._serving.start()
        return self

    def close(self) -> None:
        """Stop serving, end every connection, join every thread, close the socket. Idempotent."""
        if self._serving is not None:
            self.shutdown()
            self._serving.join()
            self._serving = None
        with self._open_lock:
            still_open = list(self._open)
        for conn in still_open:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self.server_close()  # joins the connection threads (block_on_close)


def bind_listener(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on exactly ``host:port`` (IPv4 or IPv6 literal, or a name).

    ``SO_REUSEADDR`` lets a restarted master take its port back while old
    connections sit in TIME_WAIT; it does not let two listeners share a port.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvbridge.backends.mooncake.metadata",
        description="Serve Mooncake's HTTP metadata protocol on an inherited listening socket.")
    parser.add_argument("--fd", type=int, required=True, help="listening socket inherited")
    defaults = MetadataLimits()
    parser.add_argument("--max-key-bytes", type=int, default=defaults.max_key_bytes)
    parser.add_argument("--max-value-bytes", type=int, default=defaults.max_value_bytes)
    parser.add_argument("--max-total-bytes", type=int, default=defaults.max_total_bytes)
    parser.add_argument("--max-keys", type=int, default=defaults.max_keys)
    parser.add_argument("--max-connections", type=int, default=defaults.max_connections)
    parser.add_argument("--request-timeout-s", type=float, default=defaults.request_timeout_s)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Child-process entry point: serve ``--fd`` until SIGTERM/SIGINT, then close cleanly."""
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    limits = MetadataLimits(args.max_key_bytes, args.max_value_bytes, args.max_total_bytes,
                            args.max_keys, args.max_connections, args.request_timeout_s)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s kvbridge-metadata %(levelname)s %(message)s")
    listener = socket.socket(fileno=args.fd)
    server = MetadataHTTPServer(listener, limits)
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    server.start()
    logger.info("serving Mooncake HTTP metadata on %s:%s (pid-inherited socket)",
                *server.server_address[:2])
    while not stop.wait(0.5):  # wakes to run the signal handler promptly
        pass
    server.close()
    logger.info("stopped; %d keys, %d bytes held; %s", len(server.store),
                server.store.total_bytes, server.counters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
