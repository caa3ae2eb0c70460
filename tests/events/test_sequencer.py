"""SequenceTracker: the pure ordering rules of the subscriber."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.events import Gap, LiveVerdict, ReplayVerdict, SequenceTracker


def test_live_tail_starts_anywhere() -> None:
    tracker = SequenceTracker(None)
    assert tracker.on_live(41) is LiveVerdict.DELIVER
    tracker.delivered(41)
    assert tracker.on_live(42) is LiveVerdict.DELIVER


def test_gap_then_replay_then_duplicates() -> None:
    tracker = SequenceTracker(0)
    assert tracker.on_live(0) is LiveVerdict.DELIVER
    tracker.delivered(0)
    assert tracker.on_live(4) is LiveVerdict.GAP
    assert tracker.gap_before(4) == Gap(1, 4)
    for seq in (1, 2, 3):
        assert tracker.on_replayed(seq) is ReplayVerdict.DELIVER
        tracker.delivered(seq)
    assert tracker.on_replayed(2) is ReplayVerdict.DUPLICATE
    tracker.delivered(4)
    assert tracker.on_live(5) is LiveVerdict.DELIVER


def test_late_joiner_catch_up_makes_queued_live_batches_duplicates() -> None:
    tracker = SequenceTracker(0)
    for seq in range(10):  # catch-up replay delivered 0..9
        assert tracker.on_replayed(seq) is ReplayVerdict.DELIVER
        tracker.delivered(seq)
    assert tracker.on_live(7) is LiveVerdict.DUPLICATE
    assert tracker.on_live(10) is LiveVerdict.DELIVER


def test_live_stream_going_backwards_is_a_restart() -> None:
    tracker = SequenceTracker(None)
    for seq in range(5):
        assert tracker.on_live(seq) is LiveVerdict.DELIVER
        tracker.delivered(seq)
    assert tracker.on_live(2) is LiveVerdict.RESTART
    tracker.reset(0)
    assert tracker.on_live(2) is LiveVerdict.GAP
    assert tracker.gap_before(2) == Gap(0, 2)


def test_ring_eviction_is_lost_once() -> None:
    tracker = SequenceTracker(0)
    assert tracker.on_replayed(5) is ReplayVerdict.LOST_BEFORE
    assert tracker.skip_to(5) == Gap(0, 5)
    tracker.delivered(5)
    assert tracker.skip_to(6) is None  # nothing left to declare lost


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=60), st.data())
def test_any_drop_pattern_delivers_each_seq_exactly_once(dropped: list[bool], data: st.DataObject) -> None:
    """Live delivery with arbitrary drops, repaired by full replays, yields 0..n-1 once each."""
    n = len(dropped)
    tracker = SequenceTracker(0)
    delivered: list[int] = []
    for seq in range(n):
        if dropped[seq] and seq != n - 1:
            continue
        verdict = tracker.on_live(seq)
        if verdict is LiveVerdict.GAP:
            gap = tracker.gap_before(seq)
            # The replay may start early (duplicates) and overshoot (ignored by caller).
            start = data.draw(st.integers(0, gap.start_seq))
            for replayed in range(start, gap.end_seq):
                rv = tracker.on_replayed(replayed)
                if rv is ReplayVerdict.DELIVER:
                    tracker.delivered(replayed)
                    delivered.append(replayed)
                else:
                    assert rv is ReplayVerdict.DUPLICATE
            verdict = LiveVerdict.DELIVER
        if verdict is LiveVerdict.DELIVER:
            tracker.delivered(seq)
            delivered.append(seq)
    assert delivered == list(range(n))


@settings(max_examples=200, deadline=None)
@given(st.none() | st.integers(-2, 5), st.lists(st.integers(-3, 12), max_size=30))
def test_in_order_live_is_on_lives_deliver_verdict(start: int | None, seqs: list[int]) -> None:
    """The subscriber's one-test fast path: ``in_order_live`` is True exactly when
    ``on_live`` says DELIVER, and leaves the tracker as ``on_live`` would (when
    False it records nothing, and ``on_live`` then decides)."""
    fast, reference = SequenceTracker(start), SequenceTracker(start)
    for seq in seqs:
        verdict = reference.on_live(seq)
        if fast.in_order_live(seq):
            assert verdict is LiveVerdict.DELIVER
        else:
            assert fast.on_live(seq) is verdict
            assert verdict is not LiveVerdict.DELIVER
        assert (fast.expected, fast.live_high) == (reference.expected, reference.live_high)
        if verdict is LiveVerdict.DELIVER:
            fast.delivered(seq)
            reference.delivered(seq)
        elif verdict is LiveVerdict.GAP:
            assert fast.skip_to(seq) == reference.skip_to(seq)
            fast.delivered(seq)
            reference.delivered(seq)
        elif verdict is LiveVerdict.RESTART:
            fast.reset(None)
            reference.reset(None)
