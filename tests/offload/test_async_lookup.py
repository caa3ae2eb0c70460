"""Async lookup: enqueue once (asserted), mark_miss without re-probe, cleanup, generations."""

from __future__ import annotations

import threading
import time

import pytest

from kvbridge.offload.async_lookup import LookupCache, ProbeRunner


def k(i: int) -> bytes:
    return b"k%d" % i


def test_a_key_is_enqueued_once_however_many_requests_ask() -> None:
    cache = LookupCache()
    assert cache.lookup("r1", k(0)) is None
    assert cache.lookup("r2", k(0)) is None
    assert cache.lookup("r1", k(0)) is None
    batch = cache.take_batch()
    assert [key for key, _ in batch] == [k(0)]
    assert cache.take_batch() == ()
    cache.apply_results([(k(0), batch[0][1], True)])
    assert cache.lookup("r3", k(0)) is True
    assert cache.take_batch() == () and cache.enqueue_count[k(0)] == 1


def test_second_result_for_a_settled_key_is_an_assertion() -> None:
    cache = LookupCache()
    cache.lookup("r1", k(0))
    ((key, gen),) = cache.take_batch()
    cache.apply_results([(key, gen, True)])
    with pytest.raises(AssertionError, match="enqueue-once"):
        cache.apply_results([(key, gen, True)])


def test_mark_miss_flips_verdict_without_reprobe_and_late_true_cannot_revive() -> None:
    cache = LookupCache()
    cache.lookup("r1", k(0))
    ((key, gen),) = cache.take_batch()
    cache.mark_miss([k(0)])                       # a failed load before the probe answered
    cache.apply_results([(key, gen, True)])       # the late True must not win
    assert cache.lookup("r1", k(0)) is False
    cache.lookup("r2", k(1))
    ((key1, gen1),) = cache.take_batch()
    cache.apply_results([(key1, gen1, True)])
    cache.mark_miss([k(1), k(99)])                # unknown keys are skipped
    assert cache.lookup("r2", k(1)) is False and k(99) not in cache
    assert cache.take_batch() == ()               # no re-probe
    assert cache.enqueue_count == {k(0): 1, k(1): 1}


def test_entries_live_while_referenced_and_results_of_cleaned_entries_are_dropped() -> None:
    cache = LookupCache()
    cache.lookup("r1", k(0))
    cache.lookup("r2", k(0))
    ((key, old_gen),) = cache.take_batch()
    cache.release("r1")
    assert k(0) in cache                          # r2 still references it
    cache.release("r2")
    assert k(0) not in cache and cache.num_requests == 0
    cache.lookup("r3", k(0))                      # a new entry: probed afresh
    ((_, new_gen),) = cache.take_batch()
    assert new_gen != old_gen
    cache.apply_results([(k(0), old_gen, False)])  # the old probe's answer: dropped
    assert cache.peek(k(0)) is None
    cache.apply_results([(k(0), new_gen, True)])
    assert cache.peek(k(0)) is True


def test_probe_runner_runs_batches_off_thread_and_answers_absent_on_error() -> None:
    seen: list[tuple[str, list[bytes]]] = []
    gate = threading.Event()

    def probe(keys):
        seen.append((threading.current_thread().name, list(keys)))
        gate.wait(5)
        if k(13) in keys:
            raise OSError("disk gone")
        return [key == k(1) for key in keys]

    runner = ProbeRunner(probe, "t")
    try:
        cache = LookupCache()
        for i in (1, 2):
            cache.lookup("r", k(i))
        runner.submit(cache.take_batch())
        # submit/drain never wait for the probe: it is held at the gate, so a drain that
        # waited would return its results (or hang until the gate's 5 s, then return them)
        assert runner.drain() == [] and not gate.is_set()
        gate.set()
        deadline = time.monotonic() + 5
        results = []
        while not results and time.monotonic() < deadline:
            results = runner.drain()
            time.sleep(0.001)
        cache.apply_results(results)
        assert cache.peek(k(1)) is True and cache.peek(k(2)) is False
        assert seen[0][0].startswith("kvbridge-probe-") and seen[0][1] == [k(1), k(2)]
        cache.lookup("r", k(13))
        runner.submit(cache.take_batch())
        deadline = time.monotonic() + 5
        results = []
        while not results and time.monotonic() < deadline:
            results = runner.drain()
            time.sleep(0.001)
        assert [r[2] for r in results] == [False]
    finally:
        runner.close()
