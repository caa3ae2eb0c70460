"""One replay request and its reply, as a state machine (sans-I/O).

A subscriber that lost batches asks the publisher's replay endpoint for a range
of sequence numbers and reads the reply. :class:`ReplayExchange` makes every
decision of that one exchange and touches no socket: the caller sends
:attr:`~ReplayExchange.request`, waits for a reply message no later than
:attr:`~ReplayExchange.deadline`, and feeds each message it receives to
:meth:`~ReplayExchange.on_frames` (or :meth:`~ReplayExchange.on_timeout` when the
deadline passed first) until :attr:`~ReplayExchange.result` is set.

The reply kinds it tells apart (the wire is :mod:`~kvbridge.events.frames`):

- a kvbridge publisher's ``ReplayInfo`` header (its incarnation, what its ring
  holds, whether the asked-for incarnation matched), then the batches, then the
  end marker;
- a vLLM publisher, which reads the extended request as a huge start seq and
  answers with the end marker alone: the exchange falls back to the plain 8-byte
  request (:class:`Resend`) and goes on reading, under the same deadline;
- an end marker without a header from a publisher known to speak the extension,
  or from any publisher when the request was sealed with the cluster secret: a
  refusal (busy, or another secret), a failed replay;
- a frame that does not parse (:class:`Malformed`; counted against the bounds,
  never fatal).

Bounds (a replay endpoint is a peer; a hostile or broken one must not cost
memory or stall the caller): a kvbridge publisher is asked for at most
``max_pending_batches`` sequence numbers; at most ``max_pending_batches + 2``
messages (the header and the end marker) and ``max_pending_bytes`` bytes are kept
(so at most ``max_pending_batches + 2`` batches, from a publisher that sends
neither header nor end marker in time).
Past either bound the exchange ends: a reply that was answering in order (a plain
publisher, or a kvbridge one whose header matched) and already gave batches is
*truncated* (the caller asks again from where it now is), anything else failed.
Batches outside the asked range, or not after the last one kept, are dropped
(and still counted against the bounds), so what :attr:`ReplayResult.batches`
holds is strictly increasing and inside ``[start, end)``.

Every exchange ends within its deadline: :attr:`~ReplayExchange.deadline` is
fixed when it is made (``now + timeout_s``) and the fallback does not extend it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .errors import EventDecodeError
from .frames import (
    ReplayInfo,
    ReplayRequest,
    encode_replay_request,
    encode_seq,
    parse_replay_reply,
)


class ExchangeEnd(enum.Enum):
    """How an exchange ended: what the caller does with its replay connection."""

    #: The end marker of an answered request: failures in a row reset to zero.
    SUCCEEDED = "succeeded"
    #: Timed out, overran a bound without progress, or refused: back off, and
    #: discard the connection (late replies to it must never be read as a new answer).
    FAILED = "failed"
    #: Cut at a bound after batches arrived in order: discard the connection (the
    #: rest of this reply is unread), no backoff (this round made progress).
    TRUNCATED = "truncated"
    #: A vLLM publisher answered an empty-range probe: it has no incarnation.
    PROBE_ONLY = "probe_only"


class ExchangeFailure(enum.Enum):
    TIMEOUT = "timeout"
    OVERRUN = "overrun"
    REFUSED = "refused"


@dataclass
class ReplayResult:
    """What one exchange gave: the header (kvbridge publishers), the batches in order."""

    info: ReplayInfo | None
    #: (seq, payload, topic or None), seq strictly increasing, inside the asked range
    batches: list[tuple[int, bytes, bytes | None]] = field(default_factory=list)
    complete: bool = False
    #: Why the reply is incomplete (None when complete or truncated).
    failure: str | None = None
    #: Fewer batches came than the caller's range holds (a chunk): ask again.
    truncated: bool = False


@dataclass(frozen=True)
class Malformed:
    """A reply message that did not parse; the exchange goes on."""

    reason: str


@dataclass(frozen=True)
class Resend:
    """Send ``frame`` (a plain, unsealed 8-byte request) and go on reading."""

    frame: bytes


ReplyStep = Malformed | Resend | None


class ReplayExchange:
    """One replay request of ``[start, end)`` (``end=None``: up to the newest batch).

    ``extended``: speak kvbridge's extension (with the incarnation); ``sealed``:
    the request is sealed with a cluster secret (only a kvbridge publisher can
    answer, so an end marker alone is a refusal); ``publisher_supports_incarnation``
    and ``incarnation``: what the subscriber knows of the publisher so far; the
    exchange updates both as it learns (the caller keeps them, whatever the end).
    """

    def __init__(self, start: int, end: int | None, *, now: float, timeout_s: float,
                 max_pending_batches: int, max_pending_bytes: int, extended: bool,
                 sealed: bool, publisher_supports_incarnation: bool | None,
                 incarnation: int | None) -> None:
        self.start = start
        self.end = end
        self.max_pending_batches = max_pending_batches
        self.max_pending_bytes = max_pending_bytes
        self.extended = extended
        self._sealed = sealed
        self.publisher_supports_incarnation = publisher_supports_incarnation
        self.incarnation = incarnation
        # A kvbridge publisher is asked for no more than one reply may hold; the
        # caller asks again for the rest (a vLLM publisher replays to its newest).
        asked_end = end
        if end is None or end - start > max_pending_batches:
            asked_end = start + max_pending_batches
        #: The first request to send; sealed by the caller when ``extended``.
        self.request = (
            encode_replay_request(ReplayRequest(start_seq=start, end_seq=asked_end,
                                                incarnation=incarnation))
            if extended else encode_seq(start)
        )
        #: No reply is waited for past this instant (the caller's monotonic clock).
        self.deadline = now + timeout_s
        self._info: ReplayInfo | None = None
        self._batches: list[tuple[int, bytes, bytes | None]] = []
        self._num_replies = 0
        self._num_bytes = 0
        #: Set once the exchange is over; nothing is fed after that.
        self.result: ReplayResult | None = None
        self.ending: ExchangeEnd | None = None
        self.failure_kind: ExchangeFailure | None = None

    @property
    def num_pending(self) -> int:
        """Batches held so far (never more than ``max_pending_batches + 2``)."""
        return len(self._batches)

    @property
    def pending_bytes(self) -> int:
        """Bytes of the messages read so far (never more than ``max_pending_bytes``
        once a message is kept)."""
        return self._num_bytes

    def on_timeout(self) -> None:
        """The deadline passed with no message to read."""
        self._check_open()
        self._finish(ReplayResult(self._info, self._batches, failure="replay timed out"),
                     ExchangeEnd.FAILED, ExchangeFailure.TIMEOUT)

    def on_frames(self, frames: list[bytes]) -> ReplyStep:
        """One reply message (the DEALER's delimiter frame may still be on it)."""
        self._check_open()
        self._num_replies += 1
        self._num_bytes += sum(len(frame) for frame in frames)
        if (self._num_replies > self.max_pending_batches + 2
                or self._num_bytes > self.max_pending_bytes):
            # +2: the info header and the end marker.
            failure = (
                f"replay reply exceeded the subscriber's pending bound "
                f"(max_pending_batches={self.max_pending_batches}, "
                f"max_pending_bytes={self.max_pending_bytes})"
            )
            in_order = not self.extended or (self._info is not None and self._info.matched)
            if self._batches and in_order:
                # A plain (vLLM) publisher replays up to its newest batch, and a
                # kvbridge one (ReplayInfo first) up to max_pending_batches of any
                # size: an honest large gap is cut here, then asked for again from
                # the next seq (max_replay_chunks bounds the rounds per gap).
                self._finish(ReplayResult(self._info, self._batches, truncated=True),
                             ExchangeEnd.TRUNCATED, ExchangeFailure.OVERRUN)
            else:
                self._finish(ReplayResult(self._info, self._batches, failure=failure),
                             ExchangeEnd.FAILED, ExchangeFailure.OVERRUN)
            return None
        if frames and frames[0] == b"":
            frames = frames[1:]
        try:
            reply = parse_replay_reply(frames)
        except EventDecodeError as exc:
            return Malformed(str(exc))
        if reply.info is not None:
            self._info = reply.info
            self.publisher_supports_incarnation = True
            if reply.info.matched:
                self.incarnation = reply.info.incarnation
            return None
        if reply.end:
            return self._on_end()
        if reply.seq < self.start or (self.end is not None and reply.seq >= self.end):
            return None  # not asked for (counted against the bounds above)
        if self._batches and reply.seq <= self._batches[-1][0]:
            return None  # a reply stream goes forward only
        self._batches.append((reply.seq, reply.payload, reply.topic))
        return None

    def _on_end(self) -> ReplyStep:
        info = self._info
        if self.extended and info is None and self._sealed:
            self._finish(ReplayResult(None, self._batches, failure=(
                "replay refused by the publisher (busy, or it is not configured with "
                "this cluster secret)")), ExchangeEnd.FAILED, ExchangeFailure.REFUSED)
            return None
        if self.extended and info is None and self.publisher_supports_incarnation:
            # This publisher answered with ReplayInfo before: an end marker alone is
            # a refusal (too many replays under way), not a vLLM publisher. Keep the
            # extended protocol; back off.
            self._finish(ReplayResult(None, self._batches,
                                      failure="replay refused by the publisher (busy)"),
                         ExchangeEnd.FAILED, ExchangeFailure.REFUSED)
            return None
        if self.extended and info is None:
            # A vLLM publisher read our request as an out-of-range seq.
            self.publisher_supports_incarnation = False
            if self.end is not None and self.end <= self.start:
                self._finish(ReplayResult(None, self._batches, complete=True),
                             ExchangeEnd.PROBE_ONLY, None)
                return None
            self.extended = False
            return Resend(encode_seq(self.start))
        # A kvbridge publisher caps each reply (and so do we, by asking for at most
        # max_pending_batches): more may follow when this reply stopped short of the
        # caller's range (not just of the chunk asked for) and of what it holds.
        truncated = False
        if info is not None and self._batches:
            limit = info.next_seq if self.end is None else min(self.end, info.next_seq)
            truncated = self._batches[-1][0] + 1 < limit
        self._finish(ReplayResult(info, self._batches, complete=True, truncated=truncated),
                     ExchangeEnd.SUCCEEDED, None)
        return None

    def _finish(self, result: ReplayResult, ending: ExchangeEnd,
                failure_kind: ExchangeFailure | None) -> None:
        self.result = result
        self.ending = ending
        self.failure_kind = failure_kind

    def _check_open(self) -> None:
        if self.result is not None:
            raise RuntimeError("replay exchange already ended: nothing more is read for it")
