"""ZMQ frames of the event stream: sequence numbers, live frames and the replay protocol.

Owns ``SEQ_BYTES``, ``END_SEQ`` and the 8-byte sequence frame, the live
``[topic, seq, payload]`` frames, and both replay protocols: vLLM's (an 8-byte
start sequence; ``[topic, seq, payload]`` or pre-#45177 ``[seq, payload]``
replies; the end marker) and kvbridge's extension (``REPLAY_MAGIC``, the
``ReplayRequest`` with an incarnation, the ``ReplayInfo`` answer header). Pure
functions: building and parsing frames, no sockets.

May not touch: the payload inside a frame (encoded and decoded by
:mod:`~kvbridge.events.encoding` and :mod:`~kvbridge.events.fast_decoding`),
sockets, sequencing decisions (:mod:`~kvbridge.events.sequencer`), sealing
(:mod:`kvbridge.auth`, applied by publisher and subscriber around these bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from .decoding import _int
from .errors import EventDecodeError

SEQ_BYTES = 8
END_SEQ = -1
END_SEQ_BYTES = END_SEQ.to_bytes(SEQ_BYTES, "big", signed=True)
#: Starts every kvbridge replay-extension frame. The leading NUL keeps it apart
#: from any plausible topic and makes vLLM read it as an out-of-range sequence.
REPLAY_MAGIC = b"\x00kvbridge-replay/1"


# ---------------------------------------------------------------- sequence numbers


def encode_seq(seq: int) -> bytes:
    """8-byte big-endian signed, as vLLM writes it (``seq.to_bytes(8, "big")``)."""
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def decode_seq(frame: bytes, field: str = "seq") -> int:
    if len(frame) != SEQ_BYTES:
        raise EventDecodeError(field, f"expected {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


# ---------------------------------------------------------------- frames


def pub_frames(topic: bytes, seq: int, payload: bytes) -> tuple[bytes, bytes, bytes]:
    return (topic, encode_seq(seq), payload)


@dataclass(frozen=True)
class LiveFrame:
    topic: bytes
    seq: int
    payload: bytes


def parse_pub_frames(frames: Sequence[bytes]) -> LiveFrame:
    """``[topic, seq, payload]`` as a SUB socket receives it."""
    if len(frames) != 3:
        raise EventDecodeError("frames", f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    return LiveFrame(bytes(frames[0]), decode_seq(frames[1], "frames[1] (seq)"), bytes(frames[2]))


@dataclass(frozen=True)
class ReplayInfo:
    """The kvbridge publisher's answer header: who it is and what its ring holds."""

    incarnation: int
    oldest_seq: int
    next_seq: int
    matched: bool


@dataclass(frozen=True)
class ReplayRequest:
    start_seq: int
    end_seq: int | None = None  # exclusive; None: up to the newest batch
    incarnation: int | None = None  # None: any incarnation


def encode_replay_request(request: ReplayRequest) -> bytes:
    return REPLAY_MAGIC + msgpack.packb(
        {
            "incarnation": request.incarnation,
            "start_seq": request.start_seq,
            "end_seq": request.end_seq,
        }
    )


def parse_replay_request(frame: bytes) -> ReplayRequest:
    """A ROUTER request payload: vLLM's 8-byte start seq, or the kvbridge extension."""
    if frame.startswith(REPLAY_MAGIC):
        try:
            body = msgpack.unpackb(frame[len(REPLAY_MAGIC) :], raw=False)
        except Exception as exc:
            raise EventDecodeError("replay_request", f"not valid msgpack ({type(exc).__name__}"
                                   f"{': ' + str(exc) if str(exc) else ''})") from exc
        if not isinstance(body, dict):
            raise EventDecodeError("replay_request", "expected a map")
        start = _int(body.get("start_seq"), "replay_request", "start_seq")
        end = _int(body.get("end_seq"), "replay_request", "end_seq", optional=True)
        inc = _int(body.get("incarnation"), "replay_request", "incarnation", optional=True)
        return ReplayRequest(start_seq=start or 0, end_seq=end, incarnation=inc)
    # vLLM reads the request unsigned; accept both 8-byte readings identically.
    if len(frame) != SEQ_BYTES:
        raise EventDecodeError("replay_request", f"expected {SEQ_BYTES}-byte start sequence")
    return ReplayRequest(start_seq=int.from_bytes(frame, "big", signed=True))


def encode_replay_info(info: ReplayInfo) -> bytes:
    return msgpack.packb(
        {
            "incarnation": info.incarnation,
            "oldest_seq": info.oldest_seq,
            "next_seq": info.next_seq,
            "matched": info.matched,
        }
    )


def decode_replay_info(frame: bytes) -> ReplayInfo:
    try:
        body = msgpack.unpackb(frame, raw=False)
    except Exception as exc:
        raise EventDecodeError("replay_info", f"not valid msgpack ({type(exc).__name__}"
                                   f"{': ' + str(exc) if str(exc) else ''})") from exc
    if not isinstance(body, dict):
        raise EventDecodeError("replay_info", "expected a map")
    return ReplayInfo(
        incarnation=_int(body.get("incarnation"), "replay_info", "incarnation") or 0,
        oldest_seq=_int(body.get("oldest_seq"), "replay_info", "oldest_seq") or 0,
        next_seq=_int(body.get("next_seq"), "replay_info", "next_seq") or 0,
        matched=bool(body.get("matched")),
    )


@dataclass(frozen=True)
class ReplayReply:
    """One message a replay client receives (delimiter already stripped).

    Exactly one of: ``info`` (kvbridge header), ``end`` (end marker), or a batch
    (``seq`` + ``payload``).
    """

    info: ReplayInfo | None = None
    end: bool = False
    seq: int = END_SEQ
    payload: bytes = b""
    topic: bytes | None = None


def replay_batch_frames(topic: bytes | None, seq: int, payload: bytes) -> tuple[bytes, ...]:
    """One replayed batch as the publisher sends it (after the client's identity and
    delimiter): ``[topic, seq, payload]``, or ``[seq, payload]`` when ``topic`` is
    None (vLLM before PR #45177)."""
    if topic is None:
        return (encode_seq(seq), payload)
    return (topic, encode_seq(seq), payload)


def replay_end_frames(with_topic: bool = True) -> tuple[bytes, ...]:
    """The end marker of a replay: ``[b"", END_SEQ, b""]`` (or ``[END_SEQ, b""]``)."""
    return (b"", END_SEQ_BYTES, b"") if with_topic else (END_SEQ_BYTES, b"")


def parse_replay_reply(frames: Sequence[bytes]) -> ReplayReply:
    """Any replay reply shape: ``[MAGIC, info]``, ``[topic, seq, payload]``,
    ``[seq, payload]`` (pre-#45177), or the end markers of both."""
    if len(frames) == 2 and frames[0] == REPLAY_MAGIC:
        return ReplayReply(info=decode_replay_info(frames[1]))
    if len(frames) == 3:
        topic, seq_frame, payload = frames
    elif len(frames) == 2:
        topic, (seq_frame, payload) = None, frames
    else:
        raise EventDecodeError("replay_reply", f"expected 2 or 3 frames, got {len(frames)}")
    seq = decode_seq(seq_frame, "replay_reply.seq")
    if seq == END_SEQ:
        return ReplayReply(end=True)
    return ReplayReply(seq=seq, payload=bytes(payload), topic=None if topic is None else bytes(topic))
