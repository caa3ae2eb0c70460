"""The sans-I/O ZMTP framing of the handshake server: messages out, bounds enforced."""

from __future__ import annotations

import struct

import pytest
import zmq

from kvbridge.handshake.zmtp import (
    MAX_COMMAND_BYTES,
    Oversized,
    ZmtpConnection,
    ZmtpError,
    encode_frame,
    encode_message,
    server_greeting,
)

GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 1]) + b"NULL".ljust(20, b"\x00")
            + b"\x00" * 32)


def _ready(socket_type: bytes = b"DEALER") -> bytes:
    name = b"Socket-Type"
    return encode_frame(b"\x05READY" + bytes([len(name)]) + name
                        + struct.pack(">I", len(socket_type)) + socket_type, command=True)


def _connected(max_bytes: int = 1000, max_frames: int = 3) -> ZmtpConnection:
    conn = ZmtpConnection(max_bytes, max_frames)
    assert conn.feed(GREETING + _ready()) == []
    return conn


def test_messages_come_out_whole_however_the_bytes_are_split() -> None:
    stream = GREETING + _ready() + encode_message([b"", b"abc"]) + encode_message([b"x" * 300])
    conn = ZmtpConnection(1000, 3)
    out = []
    for i in range(len(stream)):
        out += conn.feed(stream[i:i + 1])
    assert out == [[b"", b"abc"], [b"x" * 300]]
    assert conn.peer_socket_type == b"DEALER" and conn.buffered == 0


def test_a_message_past_its_byte_bound_is_refused_on_the_frame_header() -> None:
    conn = _connected(max_bytes=1000)
    conn.feed(encode_frame(b"a" * 600, more=True))
    # the header of a frame that would take the message past 1000 bytes is enough
    with pytest.raises(ZmtpError, match="more than 1000 bytes"):
        conn.feed(bytes([0x03]) + struct.pack(">Q", 1 << 40))
    assert conn.buffered <= 1000 + 9


def test_an_oversized_message_is_reported_at_its_header_then_dropped_unbuffered() -> None:
    """``answer_oversized`` (the engine's control port): the message that goes over is
    reported as soon as the header that takes it over arrives, its bytes are dropped
    as they come, however split, and the next message comes out whole."""
    conn = ZmtpConnection(1000, 3, answer_oversized=True)
    assert conn.feed_items(GREETING + _ready()) == []
    head = encode_frame(b"", more=True) + encode_frame(b"a" * 600, more=True)
    over = bytes([0x02]) + struct.pack(">Q", 5000)     # LONG, last frame, 5000 bytes
    got = conn.feed_items(head + over)
    assert got == [Oversized((b"", b"a" * 600), 5600)]
    body = b"z" * 5000
    out: list = []
    for i in range(0, len(body), 7):
        out += conn.feed_items(body[i:i + 7])
        assert conn.buffered <= 1000 + 9              # never the dropped body
    out += conn.feed_items(encode_message([b"", b"next"]))
    assert out == [[b"", b"next"]]
    # a dropped message whose frames go on (MORE): each is dropped up to the last one
    got = conn.feed_items(bytes([0x03]) + struct.pack(">Q", 2000) + b"x" * 2000
                          + encode_frame(b"y" * 10, more=True) + encode_frame(b"w")
                          + encode_message([b"after"]))
    assert got == [Oversized((), 2000), [b"after"]]
    # feed() (the handshake server and client) still refuses such a message
    plain = _connected(max_bytes=1000)
    with pytest.raises(ZmtpError, match="more than 1000 bytes"):
        plain.feed(over)


def test_a_message_past_its_frame_bound_is_refused() -> None:
    conn = _connected(max_frames=3)
    with pytest.raises(ZmtpError, match="more than 3 frames"):
        conn.feed(encode_frame(b"", more=True) * 4)


@pytest.mark.parametrize("stream, match", [
    (b"GET / HTTP/1.1\r\n", "bad signature"),
    (GREETING[:10] + bytes([2, 0]), "ZMTP 2"),
    (GREETING[:12] + b"CURVE".ljust(20, b"\x00") + b"\x00" * 32, "only NULL"),
    (GREETING + encode_frame(b"hi"), "before the READY"),
    (GREETING + _ready(b"PUB"), "is not one of"),
    (GREETING + bytes([0x06]) + struct.pack(">Q", MAX_COMMAND_BYTES + 1), "command of"),
    (GREETING + _ready() + bytes([0x10, 0]), "reserved"),
])
def test_protocol_errors_are_refused(stream: bytes, match: str) -> None:
    with pytest.raises(ZmtpError, match=match):
        ZmtpConnection(1000, 3).feed(stream)


def test_a_libzmq_dealer_reads_our_greeting_and_reply() -> None:
    # the other direction: what the server sends, read by a real libzmq DEALER over TCP
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{listener.getsockname()[1]}")
    conn_sock, _ = listener.accept()
    try:
        conn_sock.sendall(server_greeting())
        conn = ZmtpConnection(1000, 3)
        dealer.send_multipart([b"", b"ping"])
        conn_sock.settimeout(5)
        got: list[list[bytes]] = []
        while not got:
            got = conn.feed(conn_sock.recv(4096))
        assert got == [[b"", b"ping"]] and conn.peer_socket_type == b"DEALER"
        conn_sock.sendall(encode_message([b"", b"pong" * 100]))
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", b"pong" * 100]
    finally:
        dealer.close(linger=0)
        conn_sock.close()
        listener.close()
