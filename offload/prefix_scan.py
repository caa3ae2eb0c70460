"""The prefix scan of one lookup, as a state machine fed what each key looks like
(sans-I/O).

``OffloadManager.lookup`` asks how many leading keys of a request are ready in
CPU memory. :class:`PrefixScan` makes every decision of that scan and reads
nothing itself: it asks one question at a time (:attr:`PrefixScan.ask`, about
the key at :attr:`PrefixScan.position`), the manager answers from its slots,
its secondary tiers' cached verdicts and its failed-load ledger, and the scan
says what to do with the key (:class:`Act`) and where the prefix ends.

The questions, in the order a key may be asked them::

    PRIMARY    -> primary(PrimaryState)            the key's slot in CPU memory
    VERIFY     -> verified(bool)                   READY, first of the prefix: do its
                                                   bytes match their digests?
    SECONDARY  -> secondary(SecondaryVerdict, i)   no slot: the secondary tiers'
                                                   verdicts, first unknown or hit
    PROMOTE    -> promoted(any_started)            after the scan: start loads of
                                                   :attr:`PrefixScan.to_promote`
    DONE                                           :attr:`PrefixScan.outcome`

Rules (the manager's docstring gives the reasons):

- The prefix ends at the first key that is a miss in every tier, is being
  stored, failed verification, or whose load failed while this request waited
  (``FAILED``: the livelock rule -- a request never retries a failed load, it
  recomputes the block, even if it is stored again meanwhile), or whose
  promotion is past its deadline (``PROMOTION_EXPIRED``: the request gives up
  on it, :attr:`Act.GIVE_UP`). Nothing after that point counts, ever: the scan
  never reports a hit after a miss.
- A READY key counts only while no key before it is missing from CPU memory
  (promoting, or to be promoted); such keys are pinned but not counted.
- While a secondary verdict is unknown the scan keeps going, only to batch the
  probes of this step: present keys after it are skipped, found keys are not
  promoted, and the answer is RETRY.
- Promotions start in key order; the answer is HIT_PENDING when any promotion
  this request waits for is running (or started now).

An answer to a question not asked raises ``RuntimeError``: the driver and the
machine can never disagree on which key is being looked at.
"""

from __future__ import annotations

import enum

from kvbridge.offload.types import LookupResult, LookupStatus


class PrimaryState(enum.Enum):
    """What the manager knows of one key in CPU memory, for this request."""

    #: its load failed while this request waited (promotion, deadline or digests)
    FAILED = "failed"
    #: no slot
    ABSENT = "absent"
    #: a slot being written by the engine: not readable yet
    WRITING_STORE = "writing_store"
    #: a promotion into the slot is running
    PROMOTING = "promoting"
    #: a promotion still running past its tier's load deadline
    PROMOTION_EXPIRED = "promotion_expired"
    READY = "ready"


class SecondaryVerdict(enum.Enum):
    """The secondary tiers' cached verdicts for one key, in tier order: the first
    tier whose verdict is unknown or a hit decides."""

    UNKNOWN = "unknown"  # a probe is in flight
    HIT = "hit"
    MISS = "miss"  # every tier said absent


class Ask(enum.Enum):
    PRIMARY = "primary"
    VERIFY = "verify"
    SECONDARY = "secondary"
    PROMOTE = "promote"
    DONE = "done"


class Act(enum.Enum):
    """What the driver does with the key it just answered for."""

    NOTHING = "nothing"
    #: hold the key's slot for the request (never evicted while pinned)
    PIN = "pin"
    #: the request stops waiting for this promotion: a failed load, recompute
    GIVE_UP = "give_up"


class StopReason(enum.Enum):
    END = "end"  # every key was scanned
    FAILED = "failed"
    NOT_READABLE = "not_readable"
    EXPIRED = "expired"
    CORRUPT = "corrupt"
    MISS = "miss"


# Enum members as module globals: the scan runs per key of every lookup on the
# scheduler thread, and a member looked up through its class costs a descriptor
# call each time (Python 3.11).
_FAILED = PrimaryState.FAILED
_ABSENT = PrimaryState.ABSENT
_WRITING_STORE = PrimaryState.WRITING_STORE
_PROMOTING = PrimaryState.PROMOTING
_PROMOTION_EXPIRED = PrimaryState.PROMOTION_EXPIRED
_READY = PrimaryState.READY
_UNKNOWN = SecondaryVerdict.UNKNOWN
_MISS = SecondaryVerdict.MISS
ASK_PRIMARY = Ask.PRIMARY
ASK_VERIFY = Ask.VERIFY
ASK_SECONDARY = Ask.SECONDARY
ASK_PROMOTE = Ask.PROMOTE
ASK_DONE = Ask.DONE
ACT_NOTHING = Act.NOTHING
ACT_PIN = Act.PIN
ACT_GIVE_UP = Act.GIVE_UP


class PrefixScan:
    """One lookup's scan over ``num_keys`` keys (a request's keys, in order)."""

    __slots__ = ("num_keys", "position", "ask", "num_ready", "to_promote", "stopped_at",
                 "stop_reason", "_gap", "_in_flight", "_unknown")

    def __init__(self, num_keys: int) -> None:
        if num_keys < 0:
            raise ValueError("num_keys: expected >= 0")
        self.num_keys = num_keys
        #: the key the current question is about
        self.position = 0
        self.ask = ASK_PRIMARY
        #: leading keys ready in CPU memory (the prefix reported as a hit)
        self.num_ready = 0
        #: (position, tier index) of keys to promote, in key order
        self.to_promote: list[tuple[int, int]] = []
        #: where and why the scan stopped (None while it runs)
        self.stopped_at: int | None = None
        self.stop_reason: StopReason | None = None
        self._gap = False        # a key before this one is not ready yet: stop counting
        self._in_flight = False  # a promotion this request waits for is running
        self._unknown = False    # a secondary verdict is still being probed
        if num_keys == 0:
            self._stop(StopReason.END)

    # ------------------------------------------------------------ answers

    def primary(self, state: PrimaryState) -> Act:
        if self.ask is not ASK_PRIMARY:
            self._wrong(ASK_PRIMARY)
        if state is _READY:  # the common case first
            if self._unknown:
                self._advance()  # only scanning to batch the probes of this step
                return ACT_NOTHING
            if not self._gap:
                self.ask = ASK_VERIFY
                return ACT_NOTHING
            return self._hold(state)
        if state is _FAILED:
            self._stop(StopReason.FAILED)  # recompute, never retry
            return ACT_NOTHING
        if state is _WRITING_STORE:
            self._stop(StopReason.NOT_READABLE)  # the prefix ends here (best effort)
            return ACT_NOTHING
        if state is _PROMOTION_EXPIRED:
            self._stop(StopReason.EXPIRED)  # a load past its deadline is a failed load
            return ACT_GIVE_UP
        if state is _ABSENT:
            self.ask = ASK_SECONDARY
            return ACT_NOTHING
        if self._unknown:
            self._advance()  # only scanning to batch the probes of this step
            return ACT_NOTHING
        return self._hold(state)  # PROMOTING

    def verified(self, ok: bool) -> Act:
        """Whether the READY key's bytes may count for this request; False is a
        failed load of exactly this key (the driver records it)."""
        if self.ask is not ASK_VERIFY:
            self._wrong(ASK_VERIFY)
        if not ok:
            self._stop(StopReason.CORRUPT)
            return ACT_NOTHING
        return self._hold(_READY)

    def secondary(self, verdict: SecondaryVerdict, tier: int | None = None) -> None:
        """``tier``: the index of the first tier that has the key (for HIT)."""
        if self.ask is not ASK_SECONDARY:
            self._wrong(ASK_SECONDARY)
        if verdict is _UNKNOWN:
            # keep going: every key of the prefix joins this step's probe batch,
            # instead of one key per step
            self._unknown = True
            self._advance()
            return
        if verdict is _MISS:
            self._stop(StopReason.MISS)
            return
        if tier is None or tier < 0:
            raise ValueError("tier: a hit names the tier that has the key")
        if not self._unknown:
            self.to_promote.append((self.position, tier))
            self._gap = True
        self._advance()

    def promoted(self, any_started: bool) -> None:
        """Whether the loads of ``to_promote`` started (a leading part of it, or none:
        no free slot)."""
        if self.ask is not ASK_PROMOTE:
            self._wrong(ASK_PROMOTE)
        if any_started:
            self._in_flight = True
        # (nothing started -- no free slot -- ends the prefix at the first key to promote)
        self.ask = ASK_DONE

    # ------------------------------------------------------------ the verdict

    @property
    def outcome(self) -> LookupResult:
        if self.ask is not ASK_DONE:
            self._wrong(ASK_DONE)
        if self._unknown:
            return LookupResult(LookupStatus.RETRY, self.num_ready)
        if self._in_flight:
            return LookupResult(LookupStatus.HIT_PENDING, self.num_ready)
        if self.num_ready:
            return LookupResult(LookupStatus.HIT, self.num_ready)
        return LookupResult(LookupStatus.MISS, 0)

    # ------------------------------------------------------------ internals

    def _hold(self, state: PrimaryState) -> Act:
        if state is _PROMOTING:
            self._gap = self._in_flight = True
        elif not self._gap:
            self.num_ready += 1
        self._advance()
        return ACT_PIN

    def _advance(self) -> None:
        self.position += 1
        if self.position >= self.num_keys:
            self._stop(StopReason.END)
        else:
            self.ask = ASK_PRIMARY

    def _stop(self, reason: StopReason) -> None:
        self.stopped_at = self.position
        self.stop_reason = reason
        self.ask = ASK_PROMOTE if self.to_promote else ASK_DONE

    def _wrong(self, ask: Ask) -> None:
        raise RuntimeError(f"prefix scan: answered {ask.value} while it asks "
                           f"{self.ask.value} (key {self.position})")
