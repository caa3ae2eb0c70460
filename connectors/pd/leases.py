"""Producer-side lease bookkeeping: which held requests may still be read, pure and clocked.

A producer rank *holds* a finished request's blocks (pull: until the consumer
ranks read them; push: until it has written them) under a **lease**: a
deadline ``lease_s`` after the hold, pushed back by every consumer heartbeat
or notification. Three ways out, each observable:

* **completed** -- every expected consumer rank has notified (``settle``):
  the blocks are freed and the request is reported in ``finished_sending``;
* **expired** -- the deadline passed first (``expire``): the blocks are freed
  anyway, ``expiries`` counts it, and the request id is remembered so that a
  notification arriving later is recognised as **late** (``late_notifs``) and
  answered ``ok=False``: the consumer must not trust what it read;
* a notification for an id this rank has never held is **early** (the
  consumer can be faster than the producer's next step) and is kept for
  ``early_grace_s``; if no hold comes in that time it is **unknown**.

A consumer about to read asks for a **guarantee** (``guarantee``): if the
request is held, the lease is pushed back to at least ``now + lease_s`` and
that promise is returned. A hold ends only by completion (every expected
consumer rank notified, each after its own read) or expiry (its deadline,
never before a promise given), so the promise holds; ``guaranteed_until`` is
the latest promise given, which a shutting-down worker must honour (keep the
memory alive) too.

A hold of sealed params (:mod:`kvbridge.connectors.sealing`) carries the
digest of the record its producer sealed, and is **claimed** by the first
consumer engine that names it correctly: a notification or ``begin`` whose
record differs, from another engine, or a second ``begin`` of one consumer
rank is **refused** (never counted toward completion, never promised).

Invariants: a request id is reported completed or expired at most once; a
notification is counted toward completion only while the lease is live; every
notification gets exactly one :class:`Verdict` (now, or when its early wait
ends). Nothing here does I/O or reads a clock: every call takes ``now``.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

#: How many expired / completed request ids are remembered to classify late notifications.
REMEMBERED_IDS = 65536


class VerdictKind(str, enum.Enum):
    OK = "ok"  # counted while the lease was live
    DUPLICATE = "duplicate"  # that consumer rank already notified; still fine
    LATE = "late"  # the lease had expired: the blocks may have been reused
    UNKNOWN = "unknown"  # never held here (or held by an earlier incarnation)
    REFUSED = "refused"  # not the sealed record, or the hold is another engine's


@dataclass(frozen=True)
class Verdict:
    """The answer to one notification of ``consumer_rank`` (sender ``peer``)."""

    request_id: str
    consumer_rank: int
    peer: str
    kind: VerdictKind
    reason: str = ""  # REFUSED: why

    @property
    def ok(self) -> bool:
        return self.kind in (VerdictKind.OK, VerdictKind.DUPLICATE)


@dataclass
class Hold:
    request_id: str
    deadline: float
    held_at: float
    expected: int | None = None  # consumer ranks; learnt from the first notification
    notified: set[int] = field(default_factory=set)
    record: bytes = b""  # digest of the sealed params (empty: nothing sealed, push)
    engine: str | None = None  # the consumer engine that claimed it
    begun: set[int] = field(default_factory=set)  # consumer ranks that sent ``begin``

    @property
    def complete(self) -> bool:
        return self.expected is not None and len(self.notified) >= self.expected


@dataclass
class LeaseStats:
    holds: int = 0
    completed: int = 0
    expiries: int = 0
    renewals: int = 0
    late_notifs: int = 0
    unknown_notifs: int = 0
    duplicate_notifs: int = 0
    early_notifs: int = 0
    guarantees: int = 0
    guarantees_refused: int = 0
    refused: int = 0  # notifications and begins not for the sealed record / its engine


class LeaseTable:
    """Leases of one producer rank. Not thread-safe (one owner: the worker connector)."""

    def __init__(self, lease_s: float = 30.0, early_grace_s: float = 10.0) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s: expected > 0, got {lease_s!r}")
        self.lease_s = lease_s
        self.early_grace_s = early_grace_s
        self._holds: dict[str, Hold] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # request id -> "expired"|"completed"
        self._early: dict[str, list[tuple[float, int, int, str, bytes, str]]] = {}
        self._done: list[str] = []
        self._expired: list[str] = []
        self.stats = LeaseStats()
        #: the latest time (this table's clock) until which a hold was promised
        self.guaranteed_until = float("-inf")

    # ------------------------------------------------------------------ holds

    def hold(self, request_id: str, now: float, record: bytes = b"") -> list[Verdict]:
        """Start holding ``request_id`` (``record``: the digest of the params sealed for
        it); returns verdicts for notifications that came early."""
        if request_id in self._holds:
            return []
        self._ended.pop(request_id, None)  # a re-used id starts a new life
        self._holds[request_id] = Hold(request_id, now + self.lease_s, now, record=record)
        self.stats.holds += 1
        out = []
        for _at, consumer_rank, expected, peer, rec, engine in self._early.pop(request_id, []):
            verdict = self.notify(request_id, consumer_rank, expected, peer, now,
                                  record=rec, engine=engine)
            if verdict is not None:
                out.append(verdict)
        return out

    def _admit(self, hold: Hold, record: bytes, engine: str) -> str:
        """Why ``engine`` may not act on ``hold`` with ``record`` ("" if it may)."""
        if hold.record and record != hold.record:
            self.stats.refused += 1
            return (f"the params are not the ones this producer sealed for request "
                    f"{hold.request_id[:64]!r}" if record else
                    "unsealed: this request's params were sealed; name their record")
        if hold.engine is None:
            hold.engine = engine
        elif engine != hold.engine:
            self.stats.refused += 1
            return f"held for another consumer engine ({hold.engine[:64]!r}): a hold is used once"
        return ""

    def renew(self, request_id: str, now: float) -> bool:
        hold = self._holds.get(request_id)
        if hold is None:
            return False
        hold.deadline = max(hold.deadline, now + self.lease_s)
        self.stats.renewals += 1
        return True

    def notify(self, request_id: str, consumer_rank: int, expected: int, peer: str,
               now: float, *, record: bytes = b"", engine: str = "") -> Verdict | None:
        """A consumer rank of ``engine`` says it is done with (read, or released)
        ``request_id``, whose sealed params it names by ``record``.

        None: the id is not held yet (early); its verdict comes from :meth:`hold`
        or, after ``early_grace_s``, from :meth:`expire`."""
        hold = self._holds.get(request_id)
        if hold is None:
            ended = self._ended.get(request_id)
            if ended == "expired":
                self.stats.late_notifs += 1
                return Verdict(request_id, consumer_rank, peer, VerdictKind.LATE)
            if ended == "completed":
                self.stats.duplicate_notifs += 1
                return Verdict(request_id, consumer_rank, peer, VerdictKind.UNKNOWN)
            self.stats.early_notifs += 1
            self._early.setdefault(request_id, []).append((now, consumer_rank, expected, peer,
                                                           record, engine))
            return None  # answered when the hold arrives, or UNKNOWN after early_grace_s
        refused = self._admit(hold, record, engine)
        if refused:
            return Verdict(request_id, consumer_rank, peer, VerdictKind.REFUSED, refused)
        if consumer_rank in hold.notified:
            self.stats.duplicate_notifs += 1
            return Verdict(request_id, consumer_rank, peer, VerdictKind.DUPLICATE)
        hold.expected = expected if hold.expected is None else max(hold.expected, expected)
        hold.notified.add(consumer_rank)
        hold.deadline = max(hold.deadline, now + self.lease_s)
        if hold.complete:
            del self._holds[request_id]
            self._remember(request_id, "completed")
            self._done.append(request_id)
            self.stats.completed += 1
        return Verdict(request_id, consumer_rank, peer, VerdictKind.OK)

    def guarantee(self, request_id: str, now: float, *, record: bytes = b"", engine: str = "",
                  consumer_rank: int = 0) -> tuple[float | None, str]:
        """Consumer rank ``consumer_rank`` of ``engine`` is about to read ``request_id``
        (its sealed params named by ``record``): promise the hold.

        Returns ``(lease_s, "")`` when held: the deadline is now at least
        ``now + lease_s`` and the blocks stay held until then unless every
        expected consumer rank notified (each one after its read). Otherwise
        ``(None, reason)``: expired, completed, not held (yet), or refused (not
        the sealed record, another engine's hold, a rank's second ``begin``) --
        no promise; the consumer then relies on the verdict of its read
        notification (refused too, when the ``begin`` was).
        """
        hold = self._holds.get(request_id)
        if hold is None:
            self.stats.guarantees_refused += 1
            ended = self._ended.get(request_id)
            if ended == "expired":
                return None, "lease expired"
            if ended == "completed":
                return None, "already completed"
            return None, "not held (yet)"
        refused = self._admit(hold, record, engine)
        if not refused and consumer_rank in hold.begun:
            self.stats.refused += 1
            refused = f"consumer rank {consumer_rank} already began this hold: a hold is used once"
        if refused:
            self.stats.guarantees_refused += 1
            return None, f"refused: {refused}"
        hold.begun.add(consumer_rank)
        until = now + self.lease_s
        hold.deadline = max(hold.deadline, until)
        self.guaranteed_until = max(self.guaranteed_until, until)
        self.stats.guarantees += 1
        return self.lease_s, ""

    def expire(self, now: float) -> list[Verdict]:
        """End every lease past its deadline; returns UNKNOWN verdicts of early waits that ran out."""
        for request_id, hold in list(self._holds.items()):
            if now >= hold.deadline:
                del self._holds[request_id]
                self._remember(request_id, "expired")
                self._expired.append(request_id)
                self.stats.expiries += 1
        out = []
        for request_id, waits in list(self._early.items()):
            keep = [w for w in waits if now - w[0] < self.early_grace_s]
            for _at, consumer_rank, _n, peer, _rec, _engine in waits:
                if now - _at >= self.early_grace_s:
                    self.stats.unknown_notifs += 1
                    out.append(Verdict(request_id, consumer_rank, peer, VerdictKind.UNKNOWN))
            if keep:
                self._early[request_id] = keep
            else:
                del self._early[request_id]
        return out

    def take_finished(self) -> tuple[list[str], list[str]]:
        """``(completed, expired)`` request ids since the last call (each reported once)."""
        done, expired = self._done, self._expired
        self._done, self._expired = [], []
        return done, expired

    # ------------------------------------------------------------------ inspection

    def held(self) -> list[str]:
        return list(self._holds)

    def is_held(self, request_id: str) -> bool:
        return request_id in self._holds

    def ended(self, request_id: str) -> str | None:
        """``"expired"``, ``"completed"`` or None (held, or never seen / forgotten)."""
        return self._ended.get(request_id)

    def num_early(self) -> int:
        return sum(len(v) for v in self._early.values())

    def _remember(self, request_id: str, how: str) -> None:
        self._ended[request_id] = how
        self._ended.move_to_end(request_id)
        while len(self._ended) > REMEMBERED_IDS:
            self._ended.popitem(last=False)
