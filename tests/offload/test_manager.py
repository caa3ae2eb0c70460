"""Manager: verdicts, promotion, failed-load correction (no livelock), pinning, cascade, events."""

from __future__ import annotations

import os
import time

import pytest

from kvbridge.offload.cpu import SlotState
from kvbridge.offload.faults import FaultKind, FaultPlan
from kvbridge.offload.manager import OffloadManager
from kvbridge.offload.testing import block_content, block_file_payload
from kvbridge.offload.types import EventKind, LookupResult, LookupStatus, OffloadError

BLOCK = 4096


def k(i: int) -> bytes:
    return b"ns|" + str(i).encode()


def store(m: OffloadManager, request_id: str, keys: list[bytes]) -> None:
    spec = m.prepare_store(request_id, keys)
    for key, slot in zip(spec.keys, spec.slots, strict=True):
        m.primary.view(slot)[:] = block_content(key, BLOCK)
    m.complete_store(spec.keys)


def settle(m: OffloadManager, request_id: str, keys: list[bytes], max_steps: int = 2000
           ) -> tuple[LookupResult, list[LookupStatus]]:
    """Lookup every step until final; returns the verdict and the statuses seen."""
    seen = []
    for _ in range(max_steps):
        result = m.lookup(request_id, keys)
        seen.append(result.status)
        if result.ready:
            return result, seen
        m.step()
        time.sleep(0.001)
    raise AssertionError(f"no final verdict after {max_steps} steps: {seen[-5:]}")


def evict_all(m: OffloadManager, request_id: str = "filler") -> None:
    """Push every block out of the primary tier (they stay on disk)."""
    assert m.wait_idle()
    store(m, request_id, [b"filler|%d" % i for i in range(m.primary.num_slots)])
    assert m.wait_idle()


def test_primary_hit_and_miss(make_manager) -> None:
    m = make_manager(fs=False)
    keys = [k(i) for i in range(3)]
    assert m.lookup("r0", keys) == LookupResult(LookupStatus.MISS, 0)
    store(m, "r0", keys[:2])
    m.request_finished("r0")
    result = m.lookup("r1", keys)
    assert result == LookupResult(LookupStatus.HIT, 2)
    spec = m.prepare_load("r1", keys[:2])
    assert [bytes(m.primary.view(s)) for s in spec.slots] == [block_content(x, BLOCK)
                                                             for x in keys[:2]]
    m.complete_load("r1", keys[:2])
    with pytest.raises(OffloadError, match=r"keys\[0\]"):
        m.prepare_load("r1", [k(9)])
    m.request_finished("r1")
    assert all(not m.primary.get(x).pinned_by for x in keys[:2])


def test_secondary_hit_is_promoted_first(make_manager) -> None:
    m = make_manager(num_slots=4)
    keys = [k(i) for i in range(3)]
    store(m, "w", keys)
    m.request_finished("w")
    evict_all(m)
    assert not any(x in m.primary for x in keys)
    result, seen = settle(m, "r1", keys)
    assert result == LookupResult(LookupStatus.HIT, 3)
    assert seen[0] is LookupStatus.RETRY                 # probe in flight
    assert LookupStatus.HIT_PENDING in seen              # promotion in flight
    spec = m.prepare_load("r1", keys)
    assert [bytes(m.primary.view(s)) for s in spec.slots] == [block_content(x, BLOCK)
                                                             for x in keys]
    m.complete_load("r1", keys)
    m.request_finished("r1")
    stats = m.stats()
    assert stats["hits_by_tier"] == {"fs": 3}
    assert stats["promotions_ok"] == 3


def test_failed_promotion_is_a_miss_and_the_request_cannot_loop(make_manager) -> None:
    """The livelock of vLLM #49176: one bad file must not wedge the request."""
    m = make_manager(num_slots=4, faults=FaultPlan(per_key={k(1): FaultKind.ELOOP}))
    keys = [k(i) for i in range(3)]
    store(m, "w", keys)
    m.request_finished("w")
    evict_all(m)
    result, seen = settle(m, "r1", keys)
    # one job in two parts ([k0, k1], [k2]: one per read thread): k0 loaded before the
    # failure is kept; k1 failed; k2 loaded in its own part, but a prefix cannot skip k1
    assert result == LookupResult(LookupStatus.HIT, 1)
    assert m.failed_loads("r1") == (k(1),)
    assert m.wait_idle()
    fs = m.secondaries[0]
    assert fs.stats.probe_batches == 1                   # the whole prefix in one batch
    loads_before = fs.stats.loads_ok + fs.stats.loads_failed
    for _ in range(50):                                  # asking again changes nothing
        assert m.lookup("r1", keys) == LookupResult(LookupStatus.HIT, 1)
        m.step()
    assert fs.stats.loads_ok + fs.stats.loads_failed == loads_before
    assert fs.stats.probes == 3 and fs.stats.files_deleted == 0
    assert os.path.exists(fs.tier.path(k(1)))                 # transient: file kept
    stats = m.stats()
    assert stats["promotions_failed"] >= 1
    assert m.primary.get(k(1)) is None                   # its slot was freed


def test_other_request_sharing_the_entry_gets_miss_without_new_promotion(make_manager) -> None:
    m = make_manager(num_slots=4, faults=FaultPlan(per_key={k(0): FaultKind.EIO}))
    store(m, "w", [k(0)])
    m.request_finished("w")
    evict_all(m)
    result, _ = settle(m, "r1", [k(0)])
    assert result.status is LookupStatus.MISS
    started = m.stats()["promotions_started"]
    # r2 asks while r1 still references the entry: cached miss, no probe, no load
    assert m.lookup("r2", [k(0)]) == LookupResult(LookupStatus.MISS, 0)
    assert m.stats()["promotions_started"] == started
    assert m.secondaries[0].cache.num_enqueued == 1
    # once nobody references the entry it is cleaned up; a new request probes afresh
    m.request_finished("r1")
    m.request_finished("r2")
    assert k(0) not in m.secondaries[0].cache


def test_short_read_deletes_file_then_later_requests_miss(make_manager) -> None:
    m = make_manager(num_slots=4, faults=FaultPlan(per_key={k(0): FaultKind.SHORT_READ}))
    store(m, "w", [k(0)])
    m.request_finished("w")
    evict_all(m)
    fs = m.secondaries[0]
    result, _ = settle(m, "r1", [k(0)])
    assert result.status is LookupStatus.MISS and not os.path.exists(fs.tier.path(k(0)))
    m.request_finished("r1")
    result, _ = settle(m, "r2", [k(0)])                  # probed afresh: the file is gone
    assert result.status is LookupStatus.MISS
    assert fs.stats.loads_failed == 1                    # no second load attempt
    removed = [e for e in m.take_events() if e.kind is EventKind.REMOVED and e.tier == "fs"]
    assert removed and removed[0].keys == (k(0),)


def test_pinned_blocks_survive_store_pressure(make_manager) -> None:
    m = make_manager(num_slots=2, fs=False)
    store(m, "w", [k(0), k(1)])
    assert m.lookup("r1", [k(0)]) == LookupResult(LookupStatus.HIT, 1)   # pins k0
    spec = m.prepare_store("w2", [k(5), k(6)])
    assert spec.keys == (k(5),)                          # only k1 could be evicted
    m.complete_store(spec.keys)
    assert k(0) in m.primary and k(1) not in m.primary
    assert m.stats()["stores_skipped_no_slot"] == 1
    m.request_finished("r1")
    spec = m.prepare_store("w3", [k(6)])
    assert spec.keys == (k(6),) and k(0) not in m.primary


def test_store_cascades_to_fs_and_holds_slots_until_written(make_manager) -> None:
    m = make_manager(num_slots=2)
    store(m, "w", [k(0), k(1)])
    fs = m.secondaries[0]
    slot = m.primary.get(k(0))
    assert slot is not None and (slot.io_refs == 1 or m.num_jobs_in_flight == 0)
    assert m.wait_idle()
    assert m.primary.get(k(0)).io_refs == 0
    for key in (k(0), k(1)):
        assert block_file_payload(fs.tier.path(key)) == block_content(key, BLOCK)
    events = m.take_events()
    stored = {(e.tier, e.medium, key) for e in events if e.kind is EventKind.STORED
              for key in e.keys}
    assert stored == {("cpu", "CPU", k(0)), ("cpu", "CPU", k(1)),
                      ("fs", "STORAGE", k(0)), ("fs", "STORAGE", k(1))}
    assert m.stats()["cascades_ok"] == 2


def test_failed_store_frees_slots(make_manager) -> None:
    m = make_manager(num_slots=2, fs=False)
    spec = m.prepare_store("w", [k(0)])
    m.complete_store(spec.keys, success=False)
    assert k(0) not in m.primary and m.primary.num_free == 2
    with pytest.raises(OffloadError, match=r"keys\[0\]"):
        m.complete_store([k(0)])


def test_promotion_keys_are_held_while_pending(make_manager) -> None:
    m = make_manager(num_slots=3)
    store(m, "w", [k(0), k(1)])
    m.request_finished("w")
    evict_all(m)
    result = m.lookup("r1", [k(0), k(1)])
    assert result.status is LookupStatus.RETRY
    for _ in range(2000):
        m.step()
        result = m.lookup("r1", [k(0), k(1)])
        if result.status is LookupStatus.HIT_PENDING or result.ready:
            break
        time.sleep(0.001)
    for key in (k(0), k(1)):
        slot = m.primary.get(key)
        assert slot is not None and "r1" in slot.pinned_by
        assert slot.state in (SlotState.WRITING_PROMOTION, SlotState.READY)
    # store pressure cannot take the promoted slots
    spec = m.prepare_store("w2", [k(7), k(8)])
    assert len(spec.keys) <= 1
    m.complete_store(spec.keys)
    result, _ = settle(m, "r1", [k(0), k(1)])
    assert result == LookupResult(LookupStatus.HIT, 2)


def test_events_stats_and_shutdown(make_manager) -> None:
    m = make_manager(num_slots=2, policy="arc")
    store(m, "w", [k(0)])
    stats = m.stats()
    assert stats["primary"]["policy"] == "arc" and stats["stores_ok"] == 1
    assert "fs" in stats["tiers"]
    m.shutdown()
    with pytest.raises(OffloadError, match="manager"):
        m.lookup("r", [k(0)])
    m.shutdown()                                         # idempotent


def test_waiter_on_someone_elses_failed_promotion_recomputes_without_retry(make_manager) -> None:
    """r2 waited on r1's promotion; r1 is gone when it fails: r2 must not start another."""
    import errno
    import threading

    from kvbridge.offload.fs_io import FsIO

    gate = threading.Event()
    opens: list[str] = []

    class GatedEIO(FsIO):
        def open_read(self, path: str, direct: bool) -> int:
            if path.endswith(".kvb"):
                opens.append(path)
                gate.wait(10)
                raise OSError(errno.EIO, "disk error")
            return super().open_read(path, direct)

    m = make_manager(num_slots=4, io=GatedEIO())
    store(m, "w", [k(0)])
    m.request_finished("w")
    evict_all(m)
    try:
        for _ in range(2000):
            if m.lookup("r1", [k(0)]).status is LookupStatus.HIT_PENDING:
                break
            m.step()
            time.sleep(0.001)
        assert m.lookup("r2", [k(0)]).status is LookupStatus.HIT_PENDING   # waits on r1's load
        m.request_finished("r1")
    finally:
        gate.set()
    assert m.wait_idle()
    assert m.failed_loads("r2") == (k(0),)
    assert m.lookup("r2", [k(0)]) == LookupResult(LookupStatus.MISS, 0)
    for _ in range(20):
        m.step()
        assert m.lookup("r2", [k(0)]) == LookupResult(LookupStatus.MISS, 0)
    assert len(opens) == 1 and m.stats()["promotions_started"] == 1


def test_lookup_never_waits_for_io(make_manager) -> None:
    """With every probe and load stuck in the kernel, lookups still answer (RETRY/HIT_PENDING)."""
    import threading

    from kvbridge.offload.fs_io import FsIO

    gate = threading.Event()
    armed = threading.Event()

    class Stuck(FsIO):
        def is_block_file(self, path: str) -> bool:   # the probe's stat
            if armed.is_set():
                gate.wait(10)
            return super().is_block_file(path)

        def open_read(self, path: str, direct: bool) -> int:
            if armed.is_set() and path.endswith(".kvb"):
                gate.wait(10)
            return super().open_read(path, direct)

    # deadlines far beyond this test: it is about never blocking, not about giving up
    m = make_manager(num_slots=4, io=Stuck(), probe_timeout_s=600.0, load_timeout_s=600.0)
    store(m, "w", [k(0)])
    m.request_finished("w")
    evict_all(m)
    armed.set()
    try:
        statuses = set()
        for _ in range(200):
            statuses.add(m.lookup("r1", [k(0), k(1)]).status)
            m.step()
        assert statuses == {LookupStatus.RETRY}          # answered 200 times, probe still stuck
        assert not gate.is_set()
    finally:
        gate.set()
    result, _ = settle(m, "r1", [k(0), k(1)])
    assert result == LookupResult(LookupStatus.HIT, 1)


def test_touch_protects_a_block_from_lru_eviction(make_manager) -> None:
    m = make_manager(num_slots=2, fs=False)
    store(m, "w", [k(0)])
    store(m, "w", [k(1)])                 # LRU order: k0, k1
    m.touch([k(0)])                       # now k1, k0
    store(m, "w", [k(2)])
    assert k(0) in m.primary and k(1) not in m.primary


def test_asking_again_counts_a_hit_once_and_only_successful_copies_count(make_manager) -> None:
    m = make_manager(fs=False)
    keys = [k(0), k(1)]
    store(m, "w", keys)
    m.request_finished("w")
    for _ in range(5):                        # the engine asks again before scheduling it
        assert m.lookup("r1", keys) == LookupResult(LookupStatus.HIT, 2)
    assert m.stats()["hit_blocks_primary"] == 2
    m.prepare_load("r1", keys)
    m.complete_load("r1", keys, success=[k(1)])   # the copy of k(1) into the engine failed
    stats = m.stats()
    assert stats["hits_by_tier"] == {"cpu": 1} and stats["engine_loads_failed"] == 1
    m.request_finished("r1")
    assert m.lookup("r2", keys) == LookupResult(LookupStatus.HIT, 2)   # a new request counts
    assert m.stats()["hit_blocks_primary"] == 4
