"""Hostile handshake input: nesting, absurd topology claims, multipart floods.

Each case is answered (or refused) with an error naming the field, costs bounded
memory and time, and the server goes on serving valid requests afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from kvbridge.auth import resolve_auth
from kvbridge.handshake import (
    EngineMetadata,
    ErrorReply,
    HandshakeClient,
    HandshakeError,
    HandshakeServer,
    MetadataReply,
    MetadataRequest,
    decode_engine,
    decode_reply,
    decode_request,
    diff_engines,
    encode_engine,
    encode_request,
)
from kvbridge.handshake import server as server_module
from kvbridge.handshake.schema import MAX_NESTING, MAX_RANKS, ServerClock, encode_reply
from kvbridge.layouts.limits import MAX_PARALLEL_SIZE
from tests.conftest import forged_topology, free_port, ready_line, stop_process


def _nested_kind(depth: int) -> bytes:
    # {"v": 1, "id": 7, "kind": [[[...nil...]]]}: built by hand, msgpack's packer
    # itself refuses to nest this deep
    return (b"\x83" + msgpack.packb("v") + msgpack.packb(1) + msgpack.packb("id")
            + msgpack.packb(7) + msgpack.packb("kind") + b"\x91" * depth + b"\xc0")


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 990])
def test_deeply_nested_kind_is_refused_naming_kind(depth: int) -> None:
    with pytest.raises(HandshakeError) as info:
        decode_request(_nested_kind(depth))
    assert info.value.field == "kind"
    assert "nested deeper" in info.value.reason


def test_nested_kind_gets_an_error_reply_without_a_traceback(make_store, caplog) -> None:
    store = make_store()
    caplog.set_level(logging.DEBUG, logger="kvbridge.handshake")
    for _ in range(20):
        reply = store.respond(_nested_kind(990))
        assert isinstance(reply, ErrorReply) and reply.request_id == 7
        assert reply.field == "kind" and "RecursionError" not in reply.message
    assert store.internal_errors == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    ok = store.respond(encode_request(MetadataRequest(5)))
    assert isinstance(ok, MetadataReply) and ok.request_id == 5


def test_an_internal_error_is_logged_once_not_per_request(make_store, caplog) -> None:
    store = make_store()

    def broken(*args: object, **kwargs: object) -> EngineMetadata:
        raise RuntimeError("injected bug")

    store.snapshot = broken  # type: ignore[method-assign]  # fault injection: a bug of ours
    caplog.set_level(logging.DEBUG, logger="kvbridge.handshake")
    for i in range(50):
        reply = store.respond(encode_request(MetadataRequest(i)))
        assert isinstance(reply, ErrorReply) and reply.field == "server"
    assert store.internal_errors == 50
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1, [r.getMessage() for r in caplog.records]


def _claiming(store, **sizes: int) -> bytes:
    """A schema-valid engine document of ``store``'s model claiming ``sizes`` (no ranks)."""
    meta = EngineMetadata(store.header, "claims", "c0ffee", 1, store.spec,
                          forged_topology(**sizes), ())
    return encode_engine(meta)


@pytest.mark.parametrize("sizes, field", [
    ({"tp_size": 2 ** 40}, "body.topology.tp_size"),
    ({"pp_size": 2 ** 33}, "body.topology.pp_size"),
    ({"tp_size": 64, "pp_size": 64, "pcp_size": 2}, "body.topology"),
])
def test_absurd_topology_claims_are_refused_by_the_decoder(make_store, sizes, field) -> None:
    store = make_store()
    with pytest.raises(HandshakeError) as info:
        decode_engine(_claiming(store, **sizes), expected=store.header)
    assert info.value.field == field
    limit = MAX_RANKS if field == "body.topology" else MAX_PARALLEL_SIZE
    assert str(limit) in info.value.reason


def test_diff_with_the_largest_allowed_claim_stays_cheap(make_store) -> None:
    # at the bound, a partial document lists a few missing ranks without walking
    # all of them, and the diff answers
    store = make_store()
    local = store.snapshot()
    remote = decode_engine(_claiming(store, tp_size=MAX_PARALLEL_SIZE,
                                     pp_size=MAX_RANKS // MAX_PARALLEL_SIZE),
                           expected=store.header)
    assert remote.missing_ranks(limit=8)[-1].tp_rank == 7
    report = diff_engines(local, remote)
    assert "remote.ranks" in report.fields() and not report.compatible


class _ClaimingServer:
    """A raw ROUTER answering every request with one fixed engine document."""

    def __init__(self, doc: bytes) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.doc = doc

    def answer(self, timeout_s: float) -> int:
        served = 0
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.sock.poll(50):
                continue
            frames = self.sock.recv_multipart()
            request = decode_request(frames[-1])
            self.sock.send_multipart([*frames[:-1], encode_reply(MetadataReply(
                request.request_id, ServerClock(time.time(), time.monotonic()), self.doc))])
            served += 1
        return served

    def close(self) -> None:
        self.sock.close(linger=0)


def test_client_refuses_a_peer_claiming_two_to_the_forty_ranks(make_store) -> None:
    import threading

    store = make_store()
    server = _ClaimingServer(_claiming(store, tp_size=2 ** 40))
    thread = threading.Thread(target=server.answer, args=(5.0,), daemon=True)
    thread.start()
    try:
        client = HandshakeClient(timeout_s=2.0, retries=0, expected=store.header)
        with pytest.raises(HandshakeError) as info:
            client.fetch(f"127.0.0.1:{server.port}")
        assert info.value.field == "body.topology.tp_size"
    finally:
        thread.join(10)
        server.close()


# --------------------------------------------------------------------- multipart floods


def _zmtp_dealer(port: int) -> socket.socket:
    """A raw ZMTP 3.0 peer (NULL mechanism, socket type DEALER) on 127.0.0.1."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    greeting = (b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00")
                + b"\x00" + b"\x00" * 31)
    name, value = b"Socket-Type", b"DEALER"
    body = b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    try:
        sock.sendall(greeting)
        sock.sendall(bytes([0x04, len(body)]) + body)
    except (BrokenPipeError, ConnectionResetError):
        pass  # a server that refuses the connection may close it before READY: callers see it
    return sock


def _closed_by_peer(sock: socket.socket, deadline: float) -> bool:
    """Read (and drop) what the server sends until it closes the connection or the
    deadline passes; True if it closed it."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        sock.settimeout(remaining)
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except OSError:  # reset: closed as well
            return True


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("frame_bytes, frames_per_peer", [
    (1 << 20, 1),  # one 1 MiB frame: past the frame bound
    (16 << 10, 256),  # 4 MiB in frames of 16 KiB each: past the message bound
])
def test_served_side_channel_holds_no_unfinished_multipart_messages(
        frame_bytes: int, frames_per_peer: int) -> None:
    """60 peers each start a multipart message and never finish it: the served
    engine's side channel disconnects each as soon as its message outgrows any
    request, instead of holding 60 x its size, and keeps serving."""
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "kvbridge.tools.cli", "serve", "--role",
                              "producer", "--port", str(port), "--control-port",
                              str(free_port()), "--json"], stdout=subprocess.PIPE, text=True)
    peers: list[socket.socket] = []
    try:
        ready = ready_line(serve)
        assert ready["side_channel"] == f"127.0.0.1:{port}"
        # a served engine takes the environment's cluster secret (make test-auth): so do we
        client = HandshakeClient(timeout_s=5.0, retries=1, auth=resolve_auth())
        before = client.fetch(f"127.0.0.1:{port}")
        rss_before = _rss_kib(serve.pid)
        # MORE | LONG, 8-byte size, then the body; the message is never finished
        frame = bytes([0x03]) + struct.pack(">Q", frame_bytes) + b"\x00" * frame_bytes
        for _ in range(60):
            peer = _zmtp_dealer(port)
            # the server may already have closed this connection: that is the point
            with contextlib.suppress(OSError):
                for _ in range(frames_per_peer):
                    peer.sendall(frame)
            peers.append(peer)
        closed = sum(_closed_by_peer(peer, deadline=time.monotonic() + 5.0) for peer in peers)
        after = client.fetch(f"127.0.0.1:{port}", use_cache=False)
        assert after.metadata.engine_id == before.metadata.engine_id
        assert closed == len(peers), f"only {closed} of {len(peers)} floods were cut off"
        grown_mib = (_rss_kib(serve.pid) - rss_before) / 1024
        assert grown_mib < 30, f"side channel holds {grown_mib:.0f} MiB of unfinished messages"
    finally:
        for peer in peers:
            peer.close()
        assert stop_process(serve) == 0


def test_connections_past_the_limit_are_closed_and_the_others_served(
        make_store, monkeypatch) -> None:
    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", 2)
    server = HandshakeServer(make_store(), "127.0.0.1", 0).start()
    peers = [_zmtp_dealer(server.port) for _ in range(2)]
    try:
        for peer in peers:  # both greeted: they hold the two places
            peer.settimeout(5)
            assert peer.recv(10)[:1] == b"\xff"
        extra = _zmtp_dealer(server.port)
        assert _closed_by_peer(extra, deadline=time.monotonic() + 5.0)
        extra.close()
        peers.pop().close()  # a place frees up: a client gets served again
        deadline = time.monotonic() + 10
        while True:
            try:
                HandshakeClient(timeout_s=1.0, retries=0).fetch(server.address)
                break
            except HandshakeError:
                assert time.monotonic() < deadline, "never served after a place freed up"
        assert server.peers_dropped >= 1
    finally:
        for peer in peers:
            peer.close()
        server.stop()


def test_oversized_request_frames_still_get_an_error_reply(make_store, serve) -> None:
    server = serve(make_store())
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{server.address}")
    try:
        dealer.send(b"\x91" * 9000)
        assert dealer.poll(5000)
        reply = decode_reply(dealer.recv_multipart()[-1])
        assert isinstance(reply, ErrorReply) and reply.field == "message"
        assert "exceeds" in reply.message
    finally:
        dealer.close(linger=0)


def test_client_cuts_off_a_server_streaming_an_endless_reply() -> None:
    """A hostile side channel answers with a multipart reply that never ends: the
    client refuses it once it outgrows any reply (a DEALER would have buffered its
    frames until the deadline), naming the message, well before its timeout."""
    import threading

    from kvbridge.handshake.zmtp import server_greeting

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    sent = {"bytes": 0}

    def hostile() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(10)
            conn.sendall(server_greeting(b"ROUTER"))
            conn.recv(4096)  # the client's greeting, READY and request
            frame = bytes([0x03]) + struct.pack(">Q", 64 << 10) + b"\x00" * (64 << 10)
            with contextlib.suppress(OSError):
                while sent["bytes"] < (256 << 20):
                    conn.sendall(frame)
                    sent["bytes"] += len(frame)

    thread = threading.Thread(target=hostile, daemon=True)
    thread.start()
    try:
        client = HandshakeClient(timeout_s=30.0, retries=0)
        with pytest.raises(HandshakeError) as info:
            client.fetch(f"127.0.0.1:{port}")
        assert info.value.field == "message" and "more than" in info.value.reason
        assert client.stats.timeouts == 0
        thread.join(30)
        assert not thread.is_alive()
        assert sent["bytes"] < (256 << 20), "the client read the endless reply to its end"
    finally:
        listener.close()
