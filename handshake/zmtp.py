"""The server side of ZMTP 3.0 (NULL security), sans-I/O, with every message bounded.

libzmq bounds a frame (``ZMQ_MAXMSGSIZE``) but not a message: a ROUTER holds
every frame of a multipart message until its last frame arrives, so a peer
that starts messages and never finishes them makes the server buffer without
limit. The handshake server therefore speaks ZMTP itself over a ZMQ STREAM
socket (libzmq still owns TCP) and frames each peer's bytes here:
:class:`ZmtpConnection` turns one connection's byte stream into complete
messages and refuses, by raising :class:`ZmtpError`, the first frame that would
take the message past ``max_message_bytes`` or ``max_frames``, before its body
is buffered. What one connection can make the server hold is thus one
message's bound plus a frame header.

The client (:class:`~kvbridge.handshake.client.HandshakeClient`) frames replies
the same way, so a hostile server cannot make it buffer more than one reply's
bound either. Only what the handshake needs is implemented: ZMTP 3.x greeting with the NULL
mechanism, the READY command (peer socket types DEALER, REQ and ROUTER), data
frames; other commands (e.g. PING, which needs heartbeats the clients never
enable) are read and ignored. Spec: https://rfc.zeromq.org/spec/23/ (ZMTP 3.0).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"
GREETING_BYTES = 64
#: Largest command (READY with its metadata) a peer may send, in bytes.
MAX_COMMAND_BYTES = 4096
#: Peer socket types a ROUTER-like server talks to (a DEALER-like client: ROUTER only).
PEER_SOCKET_TYPES = (b"DEALER", b"REQ", b"ROUTER")

_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04


class ZmtpError(ValueError):
    """The peer broke the protocol or a bound; the connection must be closed."""


def encode_frame(body: bytes, *, more: bool = False, command: bool = False) -> bytes:
    flags = (_MORE if more else 0) | (_COMMAND if command else 0)
    if len(body) > 255:
        return bytes([flags | _LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def encode_message(frames: list[bytes]) -> bytes:
    """One message as ZMTP frames (MORE on every frame but the last)."""
    last = len(frames) - 1
    return b"".join(encode_frame(f, more=i < last) for i, f in enumerate(frames))


def server_greeting(socket_type: bytes = b"ROUTER") -> bytes:
    """Our greeting (ZMTP 3.0, NULL, as-server 0) followed by our READY command,
    announcing ``socket_type`` (ROUTER for the server, DEALER for the client)."""
    greeting = SIGNATURE + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    name, value = b"Socket-Type", socket_type
    ready = (b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(value))
             + value)
    return greeting + encode_frame(ready, command=True)


def _parse_properties(data: bytes) -> dict[bytes, bytes]:
    props: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(data):
        size = data[pos]
        name = data[pos + 1:pos + 1 + size]
        pos += 1 + size
        if len(name) != size or pos + 4 > len(data):
            raise ZmtpError("truncated READY property")
        (value_size,) = struct.unpack_from(">I", data, pos)
        pos += 4
        value = data[pos:pos + value_size]
        if len(value) != value_size:
            raise ZmtpError("truncated READY property value")
        pos += value_size
        props[name.lower()] = value
    return props


@dataclass(frozen=True)
class Oversized:
    """A data message that went past ``max_message_bytes`` (``answer_oversized``).

    Reported as soon as the frame header that goes over arrives, so a server answers
    with its limit at once; the rest of the message (that frame's body and any frames
    after it) is then read and dropped as it arrives, never buffered, and the
    connection goes on with the next message. ``envelope``: the frames before the one
    that went over (a REQ peer's empty delimiter), for addressing the answer.
    """

    envelope: tuple[bytes, ...]
    #: the message's bytes as far as its frame headers announced them when it went over
    announced_bytes: int


class ZmtpConnection:
    """One peer connection: bytes in, complete messages (lists of frames) out.

    ``answer_oversized``: a message over ``max_message_bytes`` comes out of
    :meth:`feed_items` as :class:`Oversized` (its body skipped unread) instead of
    closing the connection; :meth:`feed` keeps refusing it with ``ZmtpError``.
    """

    def __init__(self, max_message_bytes: int, max_frames: int,
                 peer_types: tuple[bytes, ...] = PEER_SOCKET_TYPES, *,
                 answer_oversized: bool = False) -> None:
        self.max_message_bytes = max_message_bytes
        self.max_frames = max_frames
        self.peer_types = peer_types
        self.answer_oversized = answer_oversized
        self.peer_socket_type: bytes | None = None
        self._buf = bytearray()
        self._greeted = False
        self._frames: list[bytes] = []
        self._message_bytes = 0
        #: bytes of the current frame's body still to drop (an oversized message)
        self._skip = 0
        #: the frame being dropped has MORE set: its message goes on (dropped too)
        self._skip_more = False
        #: the current message went over the bound: its next frames are dropped
        self._dropping = False

    @property
    def buffered(self) -> int:
        """Bytes this connection holds now (a partial frame plus a partial message)."""
        return len(self._buf) + self._message_bytes

    def feed(self, data: bytes) -> list[list[bytes]]:
        """The messages ``data`` completes; raises ZmtpError (close the connection)."""
        out: list[list[bytes]] = []
        for item in self.feed_items(data):
            if isinstance(item, Oversized):
                raise ZmtpError(f"message of more than {self.max_message_bytes} bytes")
            out.append(item)
        return out

    def feed_items(self, data: bytes) -> list[list[bytes] | Oversized]:
        """The messages ``data`` completes, and an :class:`Oversized` for each message
        that went over the bound (``answer_oversized``), in the order they came;
        raises ZmtpError (close the connection)."""
        self._buf += data
        out: list[list[bytes] | Oversized] = []
        if not self._greeted:
            if len(self._buf) >= 1 and self._buf[0] != 0xFF:
                raise ZmtpError("not a ZMTP peer (bad signature)")
            if len(self._buf) >= 11 and (self._buf[9] & 0x01) != 0x01:
                raise ZmtpError("not a ZMTP peer (bad signature)")
            if len(self._buf) >= 11 and self._buf[10] < 3:
                raise ZmtpError(f"peer speaks ZMTP {self._buf[10]}.x; 3.0 or later is needed")
            if len(self._buf) < GREETING_BYTES:
                return out
            mechanism = bytes(self._buf[12:32]).rstrip(b"\x00")
            if mechanism != b"NULL":
                raise ZmtpError(f"security mechanism {mechanism[:20]!r}; only NULL is served")
            del self._buf[:GREETING_BYTES]
            self._greeted = True
        while True:
            if self._skip or self._dropping:
                if not self._drop():
                    return out
                continue
            frame = self._next_frame(out)
            if frame is None:
                if self._skip or self._dropping:
                    continue   # an oversized frame's header was read: drop what follows
                return out
            flags, body = frame
            if flags & _COMMAND:
                self._command(body)
                continue
            if self.peer_socket_type is None:
                raise ZmtpError("data frame before the READY command")
            self._frames.append(body)
            if not flags & _MORE:
                out.append(self._frames)
                self._frames = []
                self._message_bytes = 0

    def _drop(self) -> bool:
        """Drop what arrived of an oversized message; False when more must arrive."""
        buf = self._buf
        if self._skip:
            n = min(self._skip, len(buf))
            del buf[:n]
            self._skip -= n
            if self._skip:
                return False
            if not self._skip_more:     # that was the message's last frame
                self._dropping = False
                self._frames = []
                self._message_bytes = 0
            return True
        # between the frames of a message being dropped: the next frame's header
        if len(buf) < 2:
            return False
        flags = buf[0]
        if flags & ~(_MORE | _LONG):
            raise ZmtpError(f"frame flag bits {flags:#04x} inside a message")
        if flags & _LONG:
            if len(buf) < 9:
                return False
            (size,) = struct.unpack_from(">Q", buf, 1)
            del buf[:9]
        else:
            size = buf[1]
            del buf[:2]
        self._skip_more = bool(flags & _MORE)
        self._skip = size
        if not size and not self._skip_more:
            self._dropping = False
            self._frames = []
            self._message_bytes = 0
        return True

    def _next_frame(self, out: list[list[bytes] | Oversized]) -> tuple[int, bytes] | None:
        buf = self._buf
        if len(buf) < 2:
            return None
        flags = buf[0]
        if flags & ~(_MORE | _LONG | _COMMAND):
            raise ZmtpError(f"reserved frame flag bits set ({flags:#04x})")
        if flags & _LONG:
            if len(buf) < 9:
                return None
            (size,) = struct.unpack_from(">Q", buf, 1)
            header = 9
        else:
            size, header = buf[1], 2
        # the bound is checked on the header, before any of the body is buffered
        if flags & _COMMAND:
            if size > MAX_COMMAND_BYTES:
                raise ZmtpError(f"command of {size} bytes exceeds {MAX_COMMAND_BYTES}")
            if flags & _MORE:
                raise ZmtpError("a command frame with MORE set")
        else:
            if len(self._frames) + 1 > self.max_frames:
                raise ZmtpError(f"message of more than {self.max_frames} frames")
            if self._message_bytes + size > self.max_message_bytes:
                if not self.answer_oversized or self.peer_socket_type is None:
                    raise ZmtpError(f"message of more than {self.max_message_bytes} bytes")
                # answered now, its body dropped as it arrives (never buffered)
                out.append(Oversized(tuple(self._frames), self._message_bytes + size))
                del buf[:header]
                self._skip = size
                self._skip_more = bool(flags & _MORE)
                self._dropping = True
                if not size and not self._skip_more:
                    self._dropping = False
                    self._frames = []
                    self._message_bytes = 0
                return None
        if len(buf) < header + size:
            return None
        body = bytes(buf[header:header + size])
        del buf[:header + size]
        if not flags & _COMMAND:
            self._message_bytes += size
        return flags, body

    def _command(self, body: bytes) -> None:
        if not body or len(body) < 1 + body[0]:
            raise ZmtpError("malformed command")
        name = body[1:1 + body[0]]
        data = body[1 + body[0]:]
        if name == b"READY":
            if self.peer_socket_type is not None:
                raise ZmtpError("READY twice")
            socket_type = _parse_properties(data).get(b"socket-type", b"")
            if socket_type not in self.peer_types:
                raise ZmtpError(f"peer socket type {socket_type[:16]!r} is not one of "
                                f"{[t.decode() for t in self.peer_types]}")
            self.peer_socket_type = socket_type
        elif name == b"ERROR":
            raise ZmtpError("peer sent ERROR")
        elif self.peer_socket_type is None:
            raise ZmtpError(f"command {name[:16]!r} before READY")
        # anything else (PING without heartbeats asked for, ...) is ignored
