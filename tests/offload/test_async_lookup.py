"""Async lookup: enqueue once (checked), bounded state, deadlines, mark_miss without re-probe, cleanup, generations."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

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
    assert cache.take_batch() == () and cache.num_enqueued == 1


def test_second_result_for_a_settled_key_is_dropped_counted_and_logged(caplog) -> None:
    cache = LookupCache()
    cache.lookup("r1", k(0))
    ((key, gen),) = cache.take_batch()
    cache.mark_miss([k(0)])
    cache.apply_results([(key, gen, False)])
    cache.apply_results([(key, gen, True)])       # a duplicate, stale True
    assert cache.peek(k(0)) is False               # not revived
    assert cache.invariant_violations == 1
    assert "enqueue-once" in caplog.text


def test_enqueue_once_check_survives_python_dash_O() -> None:
    """The check is not an ``assert``: ``python -O`` (which strips asserts) keeps it."""
    check = textwrap.dedent("""
        try:
            assert False
        except AssertionError:
            raise SystemExit("asserts are on: this run would prove nothing")
        from kvbridge.offload.async_lookup import LookupCache
        cache = LookupCache()
        cache.lookup("r1", b"k")
        ((key, gen),) = cache.take_batch()
        cache.mark_miss([key])
        cache.apply_results([(key, gen, True)])
        cache.apply_results([(key, gen, True)])
        print(cache.invariant_violations, cache.peek(key))
    """)
    out = subprocess.run([sys.executable, "-O", "-c", check], env=dict(os.environ),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "False"]


def test_released_keys_leave_no_state_behind() -> None:
    """20,000 requests of 4 fresh keys each: once released, the cache holds nothing."""
    cache = LookupCache()
    for r in range(20_000):
        rid = f"r{r}"
        for i in range(4):
            cache.lookup(rid, b"%d|%d" % (r, i))
        cache.apply_results((key, gen, i % 2 == 0)
                            for i, (key, gen) in enumerate(cache.take_batch()))
        cache.release(rid)
    assert cache.num_enqueued == 80_000
    assert len(cache) == 0 and cache.num_requests == 0 and cache.num_unknown == 0
    leftovers = {name: len(value) for name, value in vars(cache).items()
                 if isinstance(value, dict | list | set | tuple) and len(value)}
    assert leftovers == {}, leftovers


def test_unknown_verdicts_expire_as_misses_and_late_answers_cannot_revive() -> None:
    cache = LookupCache()
    assert cache.lookup("r1", k(0), now=100.0) is None
    assert cache.lookup("r1", k(1), now=102.0) is None
    batch = cache.take_batch()
    assert cache.expire(now=104.0, timeout_s=5.0) == []
    assert cache.expire(now=105.0, timeout_s=5.0) == [k(0)]   # k(1) is younger
    assert cache.lookup("r1", k(0), now=105.0) is False
    cache.apply_results([(key, gen, True) for key, gen in batch])   # the stuck probe answers
    assert cache.peek(k(0)) is False and cache.peek(k(1)) is True
    assert cache.probe_timeouts == 1 and cache.num_unknown == 0


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
    assert cache.num_enqueued == 2


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
