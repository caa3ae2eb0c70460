"""Sequence bookkeeping of a subscriber: gaps, duplicates, restarts (sans-I/O).

The subscriber feeds every live and replayed sequence number through a
``SequenceTracker`` and acts on the verdict; the tracker never touches a socket,
so every ordering case is unit-testable.

Invariants:

- ``expected`` is the next sequence number to hand to the application; every
  delivered seq is exactly ``expected`` at the time it is delivered, so the
  application sees a strictly increasing, duplicate-free stream within one
  publisher incarnation.
- A live seq at or below the highest live seq seen so far means the live stream
  went backwards: the publisher restarted (a PUB stream never repeats itself).
  A live seq below ``expected`` but above that high-water mark was already
  delivered by a replay: a duplicate, dropped.
- A gap ``[expected, seq)`` is filled by replay or declared lost; either way
  ``expected`` moves past it, so a gap is reported at most once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class LiveVerdict(enum.Enum):
    DELIVER = "deliver"  # seq == expected (or the first seq of a stream)
    GAP = "gap"  # seq > expected: replay [expected, seq) first, then deliver
    DUPLICATE = "duplicate"  # already delivered through a replay
    RESTART = "restart"  # the live stream went backwards


class ReplayVerdict(enum.Enum):
    DELIVER = "deliver"
    DUPLICATE = "duplicate"
    LOST_BEFORE = "lost_before"  # [expected, seq) is gone from the ring; then deliver seq


@dataclass(frozen=True)
class Gap:
    start_seq: int
    end_seq: int  # exclusive

    @property
    def num_batches(self) -> int:
        return self.end_seq - self.start_seq


class SequenceTracker:
    """Decides what to do with each sequence number of one publisher incarnation.

    ``start_seq=None`` accepts whatever seq arrives first (a live tail);
    ``start_seq=0`` treats anything before the first live seq as a gap to replay
    (a late joiner that wants the whole history the publisher still buffers).
    """

    def __init__(self, start_seq: int | None = None) -> None:
        self.expected: int | None = start_seq
        self.live_high = -1

    def reset(self, start_seq: int | None) -> None:
        """A new publisher incarnation: forget everything about the old one."""
        self.expected = start_seq
        self.live_high = -1

    def on_live(self, seq: int) -> LiveVerdict:
        if seq <= self.live_high:
            return LiveVerdict.RESTART
        self.live_high = seq
        if self.expected is None or seq == self.expected:
            return LiveVerdict.DELIVER
        if seq > self.expected:
            return LiveVerdict.GAP
        return LiveVerdict.DUPLICATE

    def in_order_live(self, seq: int) -> bool:
        """The common case of ``on_live`` in one test: True when ``seq`` is the one
        expected next (or the first of a live tail), recorded as seen live exactly
        as ``on_live`` would (its verdict: DELIVER). False: nothing is recorded, and
        ``on_live`` decides."""
        if seq > self.live_high and (seq == self.expected or self.expected is None):
            self.live_high = seq
            return True
        return False

    def gap_before(self, seq: int) -> Gap:
        assert self.expected is not None and seq > self.expected
        return Gap(self.expected, seq)

    def on_replayed(self, seq: int) -> ReplayVerdict:
        if self.expected is None or seq == self.expected:
            return ReplayVerdict.DELIVER
        if seq < self.expected:
            return ReplayVerdict.DUPLICATE
        return ReplayVerdict.LOST_BEFORE

    def delivered(self, seq: int) -> None:
        """Record that ``seq`` went to the application."""
        assert self.expected is None or seq >= self.expected, (seq, self.expected)
        self.expected = seq + 1

    def skip_to(self, seq: int) -> Gap | None:
        """Give up on everything before ``seq``; returns the range declared lost."""
        if self.expected is None or seq <= self.expected:
            if self.expected is None:
                self.expected = seq
            return None
        lost = Gap(self.expected, seq)
        self.expected = seq
        return lost
