"""Deadlines: one stuck stat or read turns into a miss, and does not wedge other keys.

The stuck call is a real fs-tier call held at its entry by a gate (``GatedIO``
wraps the real ``FsIO``: once the gate opens, the real system call runs). Time
is a ``ManualClock`` shared by the tier, its thread pools and the manager: a
deadline passes when the test moves the clock, never because the machine is
slow, so an unstuck call is never mistaken for a stuck one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvbridge.offload.cpu import CpuTier, SlotState
from kvbridge.offload.fs import DEFAULT_WRITE_THREADS, FsTier
from kvbridge.offload.fs_io import FsIO
from kvbridge.offload.manager import OffloadManager
from kvbridge.offload.runner import TierRunner
from kvbridge.offload.testing import block_content
from kvbridge.offload.types import LookupResult, LookupStatus, OffloadError

BLOCK = 4096
FP = "d0d1d2d3d4d5d6d7"


def k(i: int) -> bytes:
    return b"dl|%d" % i


class GatedIO(FsIO):
    """The real fs I/O; probes (stat) of ``held_probe`` paths and opens of ``held_read``
    paths wait for ``gate`` first (a stuck disk), then run for real."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.held_probe: set[str] = set()
        self.held_read: set[str] = set()
        self.entered = threading.Event()

    def _hold(self, path: str, held: set[str]) -> None:
        if path in held:
            self.entered.set()
            self.gate.wait(60)

    def is_block_file(self, path: str) -> bool:
        self._hold(path, self.held_probe)
        return super().is_block_file(path)

    def open_read(self, path: str, direct: bool) -> int:
        self._hold(path, self.held_read)
        return super().open_read(path, direct)


class ManualClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def wait_for(predicate: Callable[[], bool], what: str, step: Callable[[], None] | None = None,
             timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        if step is not None:
            step()
        time.sleep(0.005)


def settle(m: OffloadManager, request_id: str, keys: list[bytes]) -> LookupResult:
    result: list[LookupResult] = []

    def final() -> bool:
        result[:] = [m.lookup(request_id, keys)]
        return result[0].ready

    wait_for(final, f"a final verdict for {request_id}", m.step)
    return result[0]


@pytest.fixture
def gated(tmp_path) -> Iterator[tuple[OffloadManager, TierRunner, GatedIO, ManualClock]]:
    io = GatedIO()
    clock = ManualClock()
    tier = TierRunner(FsTier(str(tmp_path / "store"), BLOCK, FP, use_o_direct=False, io=io,
                             clock=clock),
                      read_threads=1, write_threads=DEFAULT_WRITE_THREADS, probe_timeout_s=5.0,
                      load_timeout_s=5.0, clock=clock)
    m = OffloadManager(CpuTier(4, BLOCK), [tier], clock=clock)
    yield m, tier, io, clock
    io.gate.set()
    m.shutdown()


def store_on_disk(m: OffloadManager, keys: list[bytes]) -> None:
    spec = m.prepare_store("w", keys)
    for key, slot in zip(spec.keys, spec.slots, strict=True):
        m.primary.view(slot)[:] = block_content(key, BLOCK)
    m.complete_store(spec.keys)
    m.request_finished("w")
    assert m.wait_idle()
    fill = m.prepare_store("fill", [b"fill|%d" % i for i in range(m.primary.num_slots)])
    m.complete_store(fill.keys)
    m.request_finished("fill")
    assert m.wait_idle()
    assert not any(key in m.primary for key in keys)


def test_stuck_probe_is_a_miss_by_the_deadline_and_other_keys_are_still_probed(gated) -> None:
    m, tier, io, clock = gated
    store_on_disk(m, [k(0), k(1)])
    io.held_probe.add(tier.tier.path(k(0)))
    assert m.lookup("r0", [k(0)]).status is LookupStatus.RETRY
    m.step()                                       # the probe of k(0) enters and sticks
    wait_for(io.entered.is_set, "the probe to enter the stuck call")
    for _ in range(20):                            # before the deadline: "ask again"
        assert m.lookup("r0", [k(0)]).status is LookupStatus.RETRY
        m.step()
    clock.advance(5.0)                             # probe_timeout_s passes
    assert settle(m, "r0", [k(0)]) == LookupResult(LookupStatus.MISS, 0)
    # the only probe thread is stuck: k(1) is probed by a replacement and hits
    assert settle(m, "r1", [k(1)]) == LookupResult(LookupStatus.HIT, 1)
    stats = tier.stats_snapshot()
    assert stats["probe_timeouts"] == 1 and stats["stuck_thread_replacements"] >= 1
    # the stuck stat returns True at last: too late, the verdict stays a miss
    io.gate.set()
    wait_for(lambda: tier.num_probes_in_flight == 0, "the stuck probe to return",
             tier.drain_results)
    assert m.lookup("r0", [k(0)]) == LookupResult(LookupStatus.MISS, 0)


def test_stuck_read_is_a_miss_by_the_deadline_and_its_slot_is_not_reused(gated) -> None:
    m, tier, io, clock = gated
    store_on_disk(m, [k(0), k(1)])
    io.held_read.add(tier.tier.path(k(0)))

    def reading() -> bool:                     # probed (not held), then the read sticks
        assert m.lookup("r1", [k(0)]).status in (LookupStatus.RETRY, LookupStatus.HIT_PENDING)
        return io.entered.is_set()

    wait_for(reading, "the read to enter the stuck call", m.step)
    for _ in range(20):                        # before the deadline: "ask again"
        assert m.lookup("r1", [k(0)]).status is LookupStatus.HIT_PENDING
        m.step()
    clock.advance(5.0)                         # load_timeout_s passes
    result = settle(m, "r1", [k(0)])
    assert result == LookupResult(LookupStatus.MISS, 0)
    assert m.failed_loads("r1") == (k(0),)
    assert m.stats()["promotions_timed_out"] == 1
    stuck_slot = m.primary.get(k(0))
    assert stuck_slot is not None and stuck_slot.state is SlotState.WRITING_PROMOTION
    # the only read thread is stuck: the load of k(1) runs on a replacement
    assert settle(m, "r2", [k(1)]) == LookupResult(LookupStatus.HIT, 1)
    spec = m.prepare_load("r2", [k(1)])
    assert bytes(m.primary.view(spec.slots[0])) == block_content(k(1), BLOCK)
    assert stuck_slot.index not in spec.slots
    m.complete_load("r2", [k(1)])
    # a store cannot take the stuck read's slot
    spec = m.prepare_store("w", [b"new|%d" % i for i in range(4)])
    assert stuck_slot.index not in spec.slots
    m.complete_store(spec.keys, success=False)
    # the read ends: its bytes are complete, so the block becomes READY and correct
    io.gate.set()
    assert m.wait_idle()
    slot = m.primary.get(k(0))
    assert slot is not None and slot.state is SlotState.READY
    assert bytes(m.primary.view(slot.index)) == block_content(k(0), BLOCK)
    # r1 gave up on it: it recomputes, never loads it
    assert m.lookup("r1", [k(0)]) == LookupResult(LookupStatus.MISS, 0)


def test_deadlines_are_validated(tmp_path) -> None:
    fs = FsTier(str(tmp_path), BLOCK, FP)
    for bad in (0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(OffloadError, match="probe_timeout_s"):
            TierRunner(fs, probe_timeout_s=bad)  # type: ignore[arg-type]


def test_a_pool_starts_its_threads_as_jobs_arrive_and_keeps_them() -> None:
    """No thread until a job comes (a restarted tier's first load does not wait for 16);
    one more per job that finds every thread busy, never more than ``num_threads``."""
    from kvbridge.offload.workers import StuckAwarePool

    pool = StuckAwarePool("kvbridge-test-lazy", 3, stuck_after_s=60.0)
    gates = [threading.Event() for _ in range(5)]
    ran: list[int] = []
    try:
        assert pool.num_threads_alive == 0
        pool.submit(lambda: ran.append(-1))
        wait_for(lambda: ran == [-1], "the first job")
        assert pool.num_threads_alive == 1
        pool.submit(lambda: ran.append(-2))      # the idle thread takes it: no new one
        wait_for(lambda: ran == [-1, -2], "the second job")
        assert pool.num_threads_alive == 1
        for i, gate in enumerate(gates):         # 5 blocking jobs: 3 threads, 2 wait
            pool.submit(lambda i=i, gate=gate: (gate.wait(60), ran.append(i)))
        wait_for(lambda: pool._pending == 2, "three jobs to start")
        assert pool.num_threads_alive == 3
        for gate in gates:
            gate.set()
        wait_for(lambda: sorted(ran) == [-2, -1, 0, 1, 2, 3, 4], "every job")
        assert pool.num_threads_alive == 3
    finally:
        for gate in gates:
            gate.set()
        assert pool.close(10.0)


def test_pool_replaces_a_stuck_thread_and_shrinks_back_when_it_returns() -> None:
    from kvbridge.offload.workers import StuckAwarePool

    clock = ManualClock()
    pool = StuckAwarePool("kvbridge-test-pool", 1, stuck_after_s=5.0, max_extra_threads=2,
                          clock=clock)
    gate = threading.Event()
    ran: list[str] = []
    try:
        pool.submit(lambda: gate.wait(60))
        wait_for(lambda: pool.num_threads_alive == 1 and pool.num_stuck == 0
                 and pool._pending == 0, "the first job to start")
        pool.submit(lambda: ran.append("queued before the deadline"))
        assert pool.num_threads_alive == 1         # not stuck yet: no replacement
        clock.advance(5.0)
        pool.check()                               # stuck now: a replacement runs the job
        wait_for(lambda: ran == ["queued before the deadline"], "the queued job")
        assert pool.replacements == 1 and pool.num_threads_alive == 2
        for _ in range(3):                         # more stuck calls: capped at 1 + 2 threads
            pool.submit(lambda: gate.wait(60))
            wait_for(lambda: pool._pending == 0 or pool.num_threads_alive == 3,
                     "the stuck job to start", pool.check)
            clock.advance(5.0)
            pool.check()
        assert pool.num_threads_alive == 3
        gate.set()                                 # every stuck call returns
        wait_for(lambda: pool.num_threads_alive == 1, "the pool to shrink back", pool.check)
    finally:
        gate.set()
        assert pool.close(10.0)


def test_pool_forgets_threads_that_ended_however_many_replacements_it_made() -> None:
    """Each stuck call that returns ends its thread; the pool must not keep every thread it
    ever started (a long-lived tier with a flaky disk would grow that list forever)."""
    from kvbridge.offload.workers import StuckAwarePool

    clock = ManualClock()
    pool = StuckAwarePool("kvbridge-test-forget", 1, stuck_after_s=5.0, max_extra_threads=2,
                          clock=clock)

    def live_threads() -> int:
        return sum(1 for t in threading.enumerate()
                   if t.name.startswith("kvbridge-test-forget-") and t.is_alive())

    try:
        for _ in range(20):
            gate = threading.Event()
            pool.submit(lambda gate=gate: gate.wait(60))
            wait_for(lambda: pool._pending == 0, "the stuck job to start")
            clock.advance(5.0)
            pool.submit(lambda: None)           # waits: a replacement is started for it
            wait_for(lambda: pool._pending == 0, "the queued job to start", pool.check)
            gate.set()                           # the stuck call returns: one thread ends
            wait_for(lambda: pool.num_threads_alive == 1 and live_threads() == 1,
                     "the pool to shrink back to one thread", pool.check)
        assert pool.replacements == 20
        assert len(pool._threads) <= pool.num_threads + pool.max_extra_threads
    finally:
        assert pool.close(10.0)
