"""Property tests of the lookup's prefix scan: the pure machine, then the manager.

``PrefixScan`` is fed what each key looks like (its slot in CPU memory, whether
its bytes verify, the secondary tiers' verdicts, how many promotions started) and
compared with a naive oracle: the scan written as one plain loop. Whatever the
answers, it never counts a key after the first one that ends the prefix (a miss,
a failed load, a slot being written, a corrupt one, an expired promotion), and
asks nothing about keys after it.

The manager is then driven through random stores, evictions, corrupted block
files (a real short read on disk), lookups, steps and finishes, over a real fs
tier: a block whose load failed is never reported as a hit again until it is
stored anew (and never again to a request that waited for the failed load), and
every reported prefix is ready in CPU memory.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvbridge.offload.cpu import SlotState
from kvbridge.offload.fs_layout import FileMapper
from kvbridge.offload.manager import OffloadManager
from kvbridge.offload.prefix_scan import (
    Act,
    Ask,
    PrefixScan,
    PrimaryState,
    SecondaryVerdict,
    StopReason,
)
from kvbridge.offload.types import LookupResult, LookupStatus


@dataclass(frozen=True)
class KeyView:
    primary: PrimaryState
    verifies: bool
    secondary: SecondaryVerdict
    tier: int


_key_view = st.builds(
    KeyView,
    primary=st.sampled_from(list(PrimaryState)),
    verifies=st.booleans(),
    secondary=st.sampled_from(list(SecondaryVerdict)),
    tier=st.integers(0, 2),
)


def run_scan(views: list[KeyView], started: int
             ) -> tuple[PrefixScan, list[tuple[int, Act]], list[tuple[Ask, int]]]:
    """Answer the scan from ``views``; ``started``: promotions that start (capped: 0
    is none, no free slot)."""
    scan = PrefixScan(len(views))
    acts: list[tuple[int, Act]] = []
    asked: list[tuple[Ask, int]] = []
    while scan.ask is not Ask.DONE:
        if scan.ask is Ask.PROMOTE:
            asked.append((Ask.PROMOTE, -1))
            scan.promoted(min(started, len(scan.to_promote)) > 0)
            continue
        position = scan.position
        view = views[position]
        asked.append((scan.ask, position))
        if scan.ask is Ask.PRIMARY:
            act = scan.primary(view.primary)
        elif scan.ask is Ask.VERIFY:
            act = scan.verified(view.verifies)
        else:
            scan.secondary(view.secondary, view.tier)
            act = Act.NOTHING
        if act is not Act.NOTHING:
            acts.append((position, act))
    return scan, acts, asked


def oracle(views: list[KeyView], started: int
           ) -> tuple[LookupResult, list[tuple[int, Act]], list[tuple[int, int]]]:
    """The scan as one plain loop (what ``OffloadManager.lookup`` did inline)."""
    num_ready = 0
    gap = in_flight = unknown = False
    acts: list[tuple[int, Act]] = []
    to_promote: list[tuple[int, int]] = []
    for position, view in enumerate(views):
        state = view.primary
        if state is PrimaryState.FAILED or state is PrimaryState.WRITING_STORE:
            break
        if state is PrimaryState.PROMOTION_EXPIRED:
            acts.append((position, Act.GIVE_UP))
            break
        if state is not PrimaryState.ABSENT:
            if unknown:
                continue
            if state is PrimaryState.READY and not gap and not view.verifies:
                break
            acts.append((position, Act.PIN))
            if state is PrimaryState.PROMOTING:
                gap = in_flight = True
            elif not gap:
                num_ready += 1
            continue
        if view.secondary is SecondaryVerdict.UNKNOWN:
            unknown = True
            continue
        if view.secondary is SecondaryVerdict.MISS:
            break
        if not unknown:
            to_promote.append((position, view.tier))
            gap = True
    if to_promote and min(started, len(to_promote)) > 0:
        in_flight = True
    if unknown:
        return LookupResult(LookupStatus.RETRY, num_ready), acts, to_promote
    if in_flight:
        return LookupResult(LookupStatus.HIT_PENDING, num_ready), acts, to_promote
    if num_ready:
        return LookupResult(LookupStatus.HIT, num_ready), acts, to_promote
    return LookupResult(LookupStatus.MISS, 0), acts, to_promote


@settings(max_examples=500, deadline=None)
@given(views=st.lists(_key_view, max_size=12), started=st.integers(0, 12))
def test_the_scan_matches_the_plain_loop_and_never_counts_past_a_stop(
    views: list[KeyView], started: int,
) -> None:
    scan, acts, asked = run_scan(views, started)
    expected, expected_acts, expected_promote = oracle(views, started)
    assert scan.outcome == expected
    assert acts == expected_acts
    assert scan.to_promote == expected_promote
    stop = scan.stopped_at
    assert stop is not None and scan.stop_reason is not None
    # nothing is asked about a key after the one that ended the prefix
    assert all(position <= stop for ask, position in asked if ask is not Ask.PROMOTE)
    # never a hit after a miss: every counted key was answered READY and verified,
    # and lies before the stop (the stop itself is never counted unless END)
    assert scan.num_ready <= stop
    for position in range(scan.num_ready):
        assert views[position].primary is PrimaryState.READY and views[position].verifies
    if scan.stop_reason is StopReason.FAILED:
        assert views[stop].primary is PrimaryState.FAILED
    # a key whose load failed for this request is never pinned, counted or promoted
    failed = {i for i, view in enumerate(views) if view.primary is PrimaryState.FAILED}
    assert not failed & {position for position, _ in acts}
    assert not failed & {position for position, _ in scan.to_promote}
    assert not failed & set(range(scan.num_ready))


def test_an_answer_to_a_question_not_asked_raises() -> None:
    scan = PrefixScan(2)
    with pytest.raises(RuntimeError, match="answered verify while it asks primary"):
        scan.verified(True)
    assert scan.primary(PrimaryState.ABSENT) is Act.NOTHING
    with pytest.raises(RuntimeError, match="asks secondary"):
        scan.primary(PrimaryState.READY)
    with pytest.raises(ValueError, match="tier"):
        scan.secondary(SecondaryVerdict.HIT)
    scan.secondary(SecondaryVerdict.MISS)
    assert scan.ask is Ask.DONE and scan.stop_reason is StopReason.MISS
    assert scan.outcome == LookupResult(LookupStatus.MISS, 0)
    with pytest.raises(RuntimeError, match="asks done"):
        scan.primary(PrimaryState.READY)
    assert PrefixScan(0).outcome == LookupResult(LookupStatus.MISS, 0)


# ------------------------------------------------------------ the manager

NUM_KEYS = 5
FINGERPRINT = "0123456789abcdef"


def key(i: int) -> bytes:
    return b"scan|%d" % i


@dataclass(frozen=True)
class Round:
    """One round of the engine: maybe a store, maybe pressure, maybe a torn file, then a
    request asks for a prefix until it settles, maybe finishes."""

    request: int
    num_keys: int
    store: bool
    evict: bool
    corrupt: int | None
    finish: bool


_rounds = st.lists(
    st.builds(Round, request=st.integers(0, 1), num_keys=st.integers(1, NUM_KEYS),
              store=st.booleans(), evict=st.booleans(),
              corrupt=st.none() | st.integers(0, NUM_KEYS - 1),
              finish=st.sampled_from([False, False, True])),
    min_size=2, max_size=8,
)


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rounds=_rounds, slots=st.integers(2, 6))
# a request saw k1's load fail; k1 is stored anew: a hit for others, never for it
@example(rounds=[Round(0, 2, store=True, evict=True, corrupt=1, finish=False),
                 Round(0, 2, store=True, evict=False, corrupt=None, finish=False),
                 Round(1, 2, store=False, evict=False, corrupt=None, finish=True)], slots=2)
def test_a_failed_load_is_never_a_hit_again_until_stored_anew(
    make_manager: Callable[..., OffloadManager], rounds: list[Round], slots: int,
) -> None:
    # a fresh store per example (the fixture's managers are shut down at the end too)
    with tempfile.TemporaryDirectory() as root:
        m = make_manager(num_slots=slots, root=root, fingerprint=FINGERPRINT)
        try:
            _drive(m, FileMapper(root, FINGERPRINT), rounds, slots)
        finally:
            m.shutdown()


def _drive(m: OffloadManager, files: FileMapper, rounds: list[Round], slots: int) -> None:
    generation = dict.fromkeys(range(3), 0)
    live: set[str] = set()
    #: per key: the round of its last failed load and of its last completed store
    failed_at: dict[bytes, int] = {}
    stored_at: dict[bytes, int] = {}
    #: per request: keys whose load failed while it waited (never a hit for it again)
    failed_for: dict[str, set[bytes]] = {}
    fillers = 0
    for index, one in enumerate(rounds):
        rid = f"r{one.request}.{generation[one.request]}"
        keys = [key(i) for i in range(one.num_keys)]
        if one.store:
            spec = m.prepare_store(f"w{index}", keys)
            m.complete_store(spec.keys)
            for stored in spec.keys:
                stored_at[stored] = index
            m.request_finished(f"w{index}")
        assert m.wait_idle()
        if one.evict:
            spec = m.prepare_store("filler", [b"filler|%d" % (fillers + i) for i in range(slots)])
            fillers += slots
            m.complete_store(spec.keys)
            assert m.wait_idle()
        if one.corrupt is not None:
            path = files.path(key(one.corrupt))
            if os.path.exists(path):
                with open(path, "r+b") as f:
                    f.truncate(7)  # a torn file: its next load is a short read
        # ask every step until the verdict is final (a promotion runs meanwhile)
        live.add(rid)
        for _ in range(50):
            result = m.lookup(rid, keys)
            _check_hits(m, rid, keys[:result.num_blocks], failed_for, failed_at, stored_at)
            if result.ready:
                break
            assert m.wait_idle()
            _note_failures(m, live, index, failed_for, failed_at)
        else:
            raise AssertionError(f"{rid} never settled")
        # the engine copies the hits out, which unpins them (evictable again)
        spec = m.prepare_load(rid, keys[:result.num_blocks])
        m.complete_load(rid, spec.keys)
        if one.finish:
            m.request_finished(rid)
            live.discard(rid)
            failed_for.pop(rid, None)
            generation[one.request] += 1
    assert m.wait_idle()
    for rid in sorted(live):
        m.request_finished(rid)
    assert m.wait_idle()
    assert all(not slot.pinned_by for slot in m.primary._slots.values())


def _check_hits(m: OffloadManager, rid: str, hits: list[bytes], failed_for: dict[str, set[bytes]],
                failed_at: dict[bytes, int], stored_at: dict[bytes, int]) -> None:
    for hit in hits:
        # the reported prefix is ready in CPU memory, pinned for the request
        slot = m.primary.get(hit)
        assert slot is not None and slot.state is SlotState.READY
        assert rid in slot.pinned_by
        assert hit not in failed_for.get(rid, set()), "a failed load was a hit again"
        if hit in failed_at:
            assert stored_at.get(hit, -1) > failed_at[hit], (
                "a block whose load failed was a hit before it was stored anew")


def _note_failures(m: OffloadManager, live: set[str], index: int,
                   failed_for: dict[str, set[bytes]], failed_at: dict[bytes, int]) -> None:
    for request in live:
        for failed in m.failed_loads(request):
            if failed not in failed_for.setdefault(request, set()):
                failed_for[request].add(failed)
                failed_at[failed] = index
