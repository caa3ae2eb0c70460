"""A runner that holds small jobs until its step, then drains them on one task per thread.

vLLM submits one job per request and step, often of one chunk, hundreds in one step;
``TierRunner(hold_below_bytes=...)`` hands such a burst to at most one drainer per pool
thread instead of one pool hand-off per job. These tests pin what must not change with
it: every job is run and reported once with its own outcome, nothing runs before the
step, a job stuck in the kernel holds up only itself, and a shutdown runs what was held.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvbridge.offload.faults import FailingWriteIO
from kvbridge.offload.fs import FsTier
from kvbridge.offload.fs_io import FsIO
from kvbridge.offload.runner import TierRunner
from kvbridge.offload.testing import block_content
from kvbridge.offload.types import JobResult

BLOCK = 4096
FP = "4e1d4e1d4e1d4e1d"
#: jobs of one block are held; jobs of 2 blocks and more start at once
HOLD = 2 * BLOCK


def k(i: int) -> bytes:
    return b"held|%d" % i


class HeldReadIO(FsIO):
    """The real fs I/O; opening ``held`` for a read waits for ``gate`` (a stuck disk)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.held: set[str] = set()
        self.entered = threading.Event()

    def open_read(self, path: str, direct: bool) -> int:
        if path in self.held:
            self.entered.set()
            self.gate.wait(60)
        return super().open_read(path, direct)


class Slots:
    """``n`` block buffers in one byte array (the tier reads them buffered)."""

    def __init__(self, n: int) -> None:
        self.view = memoryview(bytearray(n * BLOCK))

    def __getitem__(self, i: int) -> memoryview:
        return self.view[i * BLOCK:(i + 1) * BLOCK]


def collect(runner: TierRunner, count: int, timeout_s: float = 30.0) -> dict[int, JobResult]:
    """``count`` job results (each job id once), stepping the runner meanwhile."""
    results: dict[int, JobResult] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < count:
        assert time.monotonic() < deadline, f"{len(results)} of {count} jobs reported"
        runner.step()
        for result in runner.get_finished_jobs():
            assert result.job_id not in results, f"job {result.job_id} reported twice"
            results[result.job_id] = result
        runner.wait_for_finished(0.05)
    return results


@pytest.fixture
def runner(tmp_path) -> Iterator[tuple[TierRunner, HeldReadIO, FsTier]]:
    io = HeldReadIO()
    tier = FsTier(str(tmp_path / "store"), BLOCK, FP, use_o_direct=False, io=io)
    run = TierRunner(tier, read_threads=3, write_threads=2, hold_below_bytes=HOLD,
                     load_timeout_s=5.0)
    yield run, io, tier
    io.gate.set()
    run.shutdown()


def store_blocks(run: TierRunner, keys: list[bytes], slots: Slots) -> None:
    for i, key in enumerate(keys):
        slots[i][:] = block_content(key, BLOCK)
        run.submit_store(100 + i, [key], [[slots[i]]])
    results = collect(run, len(keys))
    assert all(r.success for r in results.values())


def test_held_jobs_start_at_the_step_and_each_is_reported_once_with_its_bytes(runner) -> None:
    run, _, tier = runner
    keys = [k(i) for i in range(24)]
    src, dst = Slots(len(keys)), Slots(len(keys))
    for i, key in enumerate(keys):
        src[i][:] = block_content(key, BLOCK)
        run.submit_store(i, [key], [[src[i]]])
    # held: no thread has run them (no file), and nothing is reported
    time.sleep(0.2)
    assert run.get_finished_jobs() == []
    assert tier.probe(keys) == [False] * len(keys)
    assert run.num_jobs_in_flight == len(keys)
    stored = collect(run, len(keys))
    assert sorted(stored) == list(range(len(keys)))
    assert all(r.success for r in stored.values())
    assert tier.probe(keys) == [True] * len(keys)

    for i, key in enumerate(keys):
        run.submit_load(1000 + i, [key], [[dst[i]]])
    loaded = collect(run, len(keys))
    assert sorted(loaded) == [1000 + i for i in range(len(keys))]
    assert all(r.success and r.successful_keys == (keys[r.job_id - 1000],) for r in loaded.values())
    for i, key in enumerate(keys):
        assert bytes(dst[i]) == block_content(key, BLOCK), f"block {i} differs"
    assert run.num_jobs_in_flight == 0


def test_a_job_of_the_threshold_or_more_starts_without_a_step(runner) -> None:
    run, _, tier = runner
    keys = [k(100), k(101)]
    src = Slots(2)
    for i, key in enumerate(keys):
        src[i][:] = block_content(key, BLOCK)
    run.submit_store(7, keys, [[src[0]], [src[1]]])      # 2 blocks: HOLD bytes, not held
    deadline = time.monotonic() + 30
    results: list[JobResult] = []
    while not results:                                   # no step(): it must run anyway
        assert time.monotonic() < deadline, "a job at the threshold waited for a step"
        run.wait_for_finished(0.05)
        results = run.get_finished_jobs()
    assert [(r.job_id, r.success) for r in results] == [(7, True)]
    assert tier.probe(keys) == [True, True]


def test_with_hold_loads_every_load_and_part_waits_for_the_step(tmp_path) -> None:
    """``hold_loads``: a load of any size waits for the step, each part of a cut one too
    (vLLM submits promotions just before the step); a store at the threshold does not."""
    tier = CountingFsTier(str(tmp_path / "store"), BLOCK, FP, use_o_direct=False)
    tier.load_part_blocks = 2
    run = TierRunner(tier, read_threads=3, write_threads=1, hold_below_bytes=HOLD,
                     hold_loads=True)
    try:
        keys = [k(i) for i in range(7)]
        src = Slots(len(keys))
        for i, key in enumerate(keys):
            src[i][:] = block_content(key, BLOCK)
        run.submit_store(1, keys[:6], [[src[i]] for i in range(6)])   # not held: runs
        run.submit_store(2, keys[6:], [[src[6]]])                      # held
        first = run.get_finished_jobs()
        deadline = time.monotonic() + 30
        while not first:
            assert time.monotonic() < deadline, "a store at the threshold waited for a step"
            run.wait_for_finished(0.05)
            first = run.get_finished_jobs()
        assert [(r.job_id, r.success) for r in first] == [(1, True)]
        collect(run, 1)
        dst = Slots(len(keys))
        run.submit_load(10, keys[:6], [[dst[i]] for i in range(6)])   # 3 parts of 2
        run.submit_load(11, keys[6:], [[dst[6]]])
        assert not run.wait_for_finished(0.2)      # nothing runs before the step
        assert tier.calls == [] and run.get_finished_jobs() == []
        loaded = collect(run, 2)
        assert sorted(tier.calls) == [1, 2, 2, 2]
        assert all(r.success for r in loaded.values())
        assert loaded[10].successful_keys == tuple(keys[:6])
        for i, key in enumerate(keys):
            assert bytes(dst[i]) == block_content(key, BLOCK), f"block {i} differs"
    finally:
        run.shutdown()


def test_a_failed_job_in_a_burst_fails_alone(runner) -> None:
    run, _, _ = runner
    keys = [k(i) for i in range(6)]
    store_blocks(run, keys[:5], Slots(5))      # k(5) is never stored
    dst = Slots(len(keys))
    for i, key in enumerate(keys):
        run.submit_load(i, [key], [[dst[i]]])
    results = collect(run, len(keys))
    assert [results[i].success for i in range(6)] == [True] * 5 + [False]
    assert results[5].successful_keys == ()
    for i in range(5):
        assert bytes(dst[i]) == block_content(keys[i], BLOCK), f"block {i} differs"
    assert run.stats.load_jobs_failed == 1 and run.stats.loads_ok == 5


def test_a_job_stuck_in_the_kernel_holds_up_only_itself(runner) -> None:
    run, io, tier = runner
    keys = [k(i) for i in range(12)]
    slots = Slots(len(keys))
    store_blocks(run, keys, slots)
    io.held.add(tier.block_path(keys[0]))
    for i, key in enumerate(keys):      # the stuck one first: its drainer stays in it
        run.submit_load(i, [key], [[slots[i]]])
    run.step()
    assert io.entered.wait(10)
    done: dict[int, JobResult] = {}
    deadline = time.monotonic() + 30
    while len(done) < len(keys) - 1:
        assert time.monotonic() < deadline, f"only {sorted(done)} finished"
        done.update((r.job_id, r) for r in run.get_finished_jobs())
        run.wait_for_finished(0.05)
    assert sorted(done) == list(range(1, len(keys)))   # all but the stuck job
    assert all(r.success for r in done.values())
    io.gate.set()
    last = collect(run, 1)
    assert list(last) == [0] and last[0].success


def test_shutdown_runs_what_was_held(tmp_path) -> None:
    tier = FsTier(str(tmp_path / "store"), BLOCK, FP, use_o_direct=False)
    run = TierRunner(tier, read_threads=1, write_threads=1, hold_below_bytes=HOLD)
    keys = [k(i) for i in range(5)]
    slots = Slots(len(keys))
    for i, key in enumerate(keys):
        slots[i][:] = block_content(key, BLOCK)
        run.submit_store(i, [key], [[slots[i]]])
    run.shutdown()
    results = run.get_finished_jobs()
    assert sorted(r.job_id for r in results) == list(range(5))
    assert all(r.success for r in results)
    check = FsTier(str(tmp_path / "store"), BLOCK, FP, use_o_direct=False)
    assert check.probe(keys) == [True] * 5
    check.close()


class CountingFsTier(FsTier):
    """The real fs tier; records how many keys each ``load`` and ``store`` call carried."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.calls: list[int] = []
        self.store_calls: list[int] = []

    def load(self, keys, buffers, digests_out) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(len(keys))
        super().load(keys, buffers, digests_out)

    def store(self, keys, buffers, digests) -> None:  # type: ignore[no-untyped-def]
        self.store_calls.append(len(keys))
        super().store(keys, buffers, digests)


def test_small_stores_share_a_call_and_each_job_keeps_its_own_outcome(tmp_path) -> None:
    io = FailingWriteIO()
    tier = CountingFsTier(str(tmp_path / "store"), BLOCK, FP, use_o_direct=False, io=io)
    tier.merge_store_blocks = 4
    run = TierRunner(tier, read_threads=1, write_threads=1, hold_below_bytes=HOLD)
    try:
        keys = [k(i) for i in range(8)]
        io.fail.add(tier.block_path(keys[1]))
        src = Slots(len(keys))
        for i, key in enumerate(keys):
            src[i][:] = block_content(key, BLOCK)
            run.submit_store(i, [key], [[src[i]]])
        results = collect(run, len(keys))
        # one drainer: [0 1 2 3] stops at k(1)'s write; 2 and 3 were never reached and
        # go again in their own call, not failed; [4 5 6 7] in one call
        assert tier.store_calls == [4, 2, 4]
        assert {i for i, r in results.items() if not r.success} == {1}
        assert tier.probe(keys) == [i != 1 for i in range(8)]
        assert run.stats.stores_failed == 1 and run.stats.stores_ok == 7
        dst = Slots(len(keys))
        for i, key in enumerate(keys):
            if i != 1:
                run.submit_load(100 + i, [key], [[dst[i]]])
        loaded = collect(run, len(keys) - 1)
        assert all(r.success for r in loaded.values())
        for i in range(8):
            if i != 1:
                assert bytes(dst[i]) == block_content(keys[i], BLOCK), f"block {i} differs"
    finally:
        run.shutdown()


def test_small_loads_share_a_call_and_each_job_keeps_its_own_outcome(tmp_path) -> None:
    tier = CountingFsTier(str(tmp_path / "store"), BLOCK, FP, use_o_direct=False)
    tier.merge_load_blocks = 4
    run = TierRunner(tier, read_threads=1, write_threads=1, hold_below_bytes=HOLD)
    try:
        keys = [k(i) for i in range(8)]
        stored = [key for i, key in enumerate(keys) if i != 1]     # k(1): never stored
        store_blocks(run, stored, Slots(len(stored)))
        corrupt = tier.block_path(keys[5])                         # k(5): its bytes changed
        with open(corrupt, "r+b") as fh:
            fh.seek(tier.header_bytes + 100)
            fh.write(b"\xff" * 8)
        dst = Slots(len(keys))
        for i, key in enumerate(keys):
            run.submit_load(i, [key], [[dst[i]]])
        results = collect(run, len(keys))
        # one drainer: [0 1 2 3] stops at the missing k(1); 2 and 3 were never reached
        # and go again in their own call, not failed; [4 5 6 7] goes on past k(5)
        assert tier.calls == [4, 2, 4]
        assert {i for i, r in results.items() if not r.success} == {1, 5}
        for i in (0, 2, 3, 4, 6, 7):
            assert results[i].successful_keys == (keys[i],)
            assert bytes(dst[i]) == block_content(keys[i], BLOCK), f"block {i} differs"
            assert len(results[i].digests) == 1 and results[i].digests[0] is not None
        assert results[1].successful_keys == () and results[5].successful_keys == ()
        assert run.stats.digest_mismatches == 1 and run.stats.load_jobs_failed == 2
        assert run.stats.files_deleted == 1        # the corrupt copy, removed
    finally:
        run.shutdown()
