"""Failure paths of the NIXL connector with a real producer process and real NIXL.

The producer engine runs in a child process (``kvbridge.engine.harness``); the
consumer engine runs in the test process so its ranks' counters and NIXL
transport can be inspected. Covered: a producer killed mid-transfer (and
restarted at the same address with a new incarnation), a lease that expires
before the read (the late read is refused and the request fails closed), an
abort before scheduling and a full prefix hit (both still free the producer's
blocks at once), loads finishing on the producer's promise to hold (and a
shut-down producer keeping promised memory alive), and no leaked
registration, handle or thread at the end.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest

from kvbridge.connectors import KVRole, TransferMode
from kvbridge.engine.content import reference_output
from kvbridge.engine.core import Engine
from kvbridge.engine.harness import EngineProcess
from kvbridge.engine.request import RequestResult, RequestSpec, RequestState
from kvbridge.engine.workload import make_requests
from kvbridge.layouts import ParallelTopology
from tests.conftest import free_port, require
from tests.connectors.nixl.nixl_helpers import nixl_config

MODEL = "tiny-gqa"
PULL = TransferMode.PULL


@pytest.fixture(autouse=True)
def _nixl() -> None:
    require("nixl_cu12", "NIXL (nixl-cu12)")


def _producer(**extra: Any) -> EngineProcess:
    return EngineProcess(nixl_config(MODEL, KVRole.PRODUCER, ParallelTopology(tp_size=2), PULL,
                                     **extra), name="producer", call_timeout_s=20)


def _consumer(**extra: Any) -> Engine:
    return Engine(nixl_config(MODEL, KVRole.CONSUMER, ParallelTopology(tp_size=1), PULL,
                              **extra))


def _prefill(producer: EngineProcess, spec: RequestSpec, timeout_s: float = 30) -> RequestResult:
    producer.submit([replace(spec, remote_decode=True, max_tokens=1, transfer_params=None)])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for result in producer.results():
            assert result.state is RequestState.FINISHED_LENGTH, result
            assert result.transfer_params is not None
            return result
        time.sleep(0.01)
    raise AssertionError(f"producer did not prefill {spec.request_id} in {timeout_s} s")


class Stepper:
    """Steps the in-process consumer, collecting every reported load-error block."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.invalid: set[tuple[int, int]] = set()
        self.failed: set[str] = set()
        self.results: dict[str, RequestResult] = {}

    def step(self) -> None:
        report = self.engine.step()
        if report.output is not None:
            self.invalid |= set(report.output.invalid_block_ids)
            self.failed |= set(report.output.failed_recving)
        for result in self.engine.pop_results():
            self.results[result.request_id] = result

    def until(self, cond: Callable[[], bool], timeout_s: float, what: str) -> float:
        start = time.monotonic()
        while not cond():
            assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
            self.step()
            time.sleep(0.002)
        return time.monotonic() - start


def _posted(engine: Engine) -> int:
    """NIXL transfers the consumer's ranks posted so far (the real transports' counters)."""
    return sum(w.connector.transport.counters().posted  # type: ignore[union-attr]
               for w in engine.workers)


def _worker_totals(engine: Engine) -> list[dict[str, Any]]:
    return [w.connector.totals() for w in engine.workers]  # type: ignore[union-attr]


def _producer_worker_stats(producer: EngineProcess) -> dict[str, Any]:
    return dict(producer.stats()["stats"]["worker_stats"])


_ticks = iter(range(1_000_000))


def _wait_producer(producer: EngineProcess, key: str, at_least: int, timeout_s: float) -> None:
    """Wait for a producer worker counter. Worker stats reach the engine when it steps,
    and an idle engine does not: a tiny local request makes it step."""
    deadline = time.monotonic() + timeout_s
    while _producer_worker_stats(producer).get(key, 0) < at_least:
        assert time.monotonic() < deadline, f"producer {key} < {at_least} after {timeout_s} s"
        producer.submit([RequestSpec(f"tick-{next(_ticks)}", (1, 2, 3), max_tokens=1)])
        time.sleep(0.05)
        producer.results()


def _check_output(result: RequestResult, spec: RequestSpec) -> None:
    assert result.state is RequestState.FINISHED_LENGTH, result
    assert list(result.output) == reference_output(spec.prompt, spec.max_tokens)
    assert result.mismatched_bytes == 0


@pytest.fixture
def no_thread_leak() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while True:
        extra = [t.name for t in threading.enumerate() if t not in before and t.is_alive()
                 and not t.name.startswith(("pydevd", "ThreadPoolExecutor"))]
        if not extra or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not extra, f"threads left: {extra}"


def _shutdown_clean(engine: Engine) -> None:
    engine.shutdown()
    for worker in engine.workers:
        final = worker.connector._final_counters  # type: ignore[union-attr]
        assert final.live == 0, final


def test_peer_killed_mid_transfer_then_restarted(no_thread_leak: None,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    engine_id = f"prod-{port}"
    extra = {"port": port, "transfer_timeout_s": 3.0, "revalidate_s": 0.2}
    specs = make_requests(3, prompt_tokens=48, max_tokens=2, seed=11, prefix="kill")
    consumer = _consumer(transfer_timeout_s=3.0, revalidate_s=0.2)
    stepper = Stepper(consumer)
    try:
        producer = EngineProcess(replace(nixl_config(MODEL, KVRole.PRODUCER,
                                                     ParallelTopology(tp_size=2), PULL, **extra),
                                         engine_id=engine_id), name="producer")
        try:
            first = _prefill(producer, specs[0])
            consumer.add_request(replace(specs[0], transfer_params=first.transfer_params))
            stepper.until(lambda: specs[0].request_id in stepper.results, 30, "warm-up load")
            _check_output(stepper.results[specs[0].request_id], specs[0])

            second = _prefill(producer, specs[1])
            os.kill(producer._proc.pid, signal.SIGSTOP)  # no acks from now on
            rid = specs[1].request_id
            posted_before = _posted(consumer)
            consumer.add_request(replace(specs[1], transfer_params=second.transfer_params))
            stepper.until(lambda: consumer.requests.get(rid) is not None and
                          consumer.requests[rid].state is RequestState.WAITING_FOR_REMOTE_KVS,
                          10, "load started")
            expected_blocks = {(r, b) for r, ids in enumerate(consumer.requests[rid].block_ids)
                               for b in ids}
            # posted: the transport counts a post more than the warm-up's (whose `transfers`
            # made the old "any transfers" check true before this READ existed)
            stepper.until(lambda: _posted(consumer) > posted_before, 30, "READ posted")
            os.kill(producer._proc.pid, signal.SIGKILL)
            producer._proc.wait(timeout=10)
            # a hang guard only; the outcome is which path failed the load (logged by the
            # worker): the READ's disconnect or the load's own 3 s deadline
            stepper.until(lambda: rid in stepper.failed, 60, "failure reported")
            reasons = [r.getMessage().rsplit(" reason=", 1)[-1] for r in caplog.records
                       if r.getMessage().startswith("pd load failed")
                       and f" request={rid} " in r.getMessage()]
            assert len(reasons) == 1 and reasons[0].startswith(
                ("READ FAILED", "READ TIMED_OUT", "deadline passed")), reasons
            assert expected_blocks <= stepper.invalid
            assert stepper.invalid <= expected_blocks, "only the failed request's blocks"
            stepper.until(lambda: rid in stepper.results, 30, "recompute")
            _check_output(stepper.results[rid], specs[1])
            assert stepper.results[rid].num_recomputed_tokens > 0
        finally:
            producer.close()
        totals = _worker_totals(consumer)
        assert sum(t["loads_failed"] for t in totals) == 1
        assert all(t["in_flight"] == 0 for t in totals)

        # the same engine id at the same address, a new process (new incarnation)
        restarted = EngineProcess(replace(nixl_config(MODEL, KVRole.PRODUCER,
                                                      ParallelTopology(tp_size=2), PULL, **extra),
                                          engine_id=engine_id), name="producer-2")
        try:
            third = _prefill(restarted, specs[2])
            consumer.add_request(replace(specs[2], transfer_params=third.transfer_params))
            stepper.until(lambda: specs[2].request_id in stepper.results, 30, "load after restart")
            result = stepper.results[specs[2].request_id]
            _check_output(result, specs[2])
            assert result.num_external_tokens > 0 and result.num_recomputed_tokens == 0
            totals = _worker_totals(consumer)
            assert sum(t["handshakes"] for t in totals) >= 2, totals
            assert sum(t["loads_done"] for t in totals) == 2
            stepper.until(lambda: not restarted.stats()["idle_problems"], 10, "producer freed")
        finally:
            restarted.close()
        assert not consumer.idle_problems()
    finally:
        _shutdown_clean(consumer)


def test_lease_expiry_then_late_read_fails_closed(no_thread_leak: None) -> None:
    producer = _producer(lease_s=1.0)
    consumer = _consumer()
    stepper = Stepper(consumer)
    try:
        spec = make_requests(1, prompt_tokens=48, max_tokens=2, seed=12, prefix="late")[0]
        result = _prefill(producer, spec)
        _wait_producer(producer, "lease_expiries", 2, 20)  # both producer ranks expired
        assert not producer.stats()["idle_problems"], "expired blocks must be freed"
        consumer.add_request(replace(spec, transfer_params=result.transfer_params))
        stepper.until(lambda: consumer.requests.get(spec.request_id) is not None and
                      consumer.requests[spec.request_id].state
                      is RequestState.WAITING_FOR_REMOTE_KVS, 10, "load started")
        blocks = {(r, b) for r, ids in enumerate(consumer.requests[spec.request_id].block_ids)
                  for b in ids}
        stepper.until(lambda: spec.request_id in stepper.results, 30, "request finished")
        assert spec.request_id in stepper.failed, "a late read must fail the request"
        assert stepper.invalid == blocks
        final = stepper.results[spec.request_id]
        _check_output(final, spec)  # recomputed, never trusted
        assert final.num_recomputed_tokens > 0 and final.num_external_tokens == 0
        _wait_producer(producer, "late_notifs", 1, 10)
        stats = _producer_worker_stats(producer)
        assert stats["lease_expiries"] == 2 and stats["late_notifs"] >= 1
        assert sum(t["loads_failed"] for t in _worker_totals(consumer)) == 1
    finally:
        producer.close()
        _shutdown_clean(consumer)


def test_abort_before_scheduling_and_full_prefix_hit_free_at_once(no_thread_leak: None) -> None:
    producer = _producer(lease_s=120.0)
    consumer = _consumer()
    stepper = Stepper(consumer)
    try:
        # abort before the consumer ever schedules the request
        spec = make_requests(1, prompt_tokens=48, max_tokens=2, seed=13, prefix="abort")[0]
        result = _prefill(producer, spec)
        consumer.add_request(replace(spec, transfer_params=result.transfer_params))
        assert consumer.abort(spec.request_id)
        deadline = time.monotonic() + 20
        while producer.stats()["idle_problems"]:
            assert time.monotonic() < deadline, "producer still holds an aborted request"
            stepper.step()
            time.sleep(0.01)
        _wait_producer(producer, "finished_sending", 2, 10)
        assert not producer.stats()["idle_problems"]

        # full prefix hit: the consumer already has more of the prompt than the producer sent
        prompt = make_requests(1, prompt_tokens=80, max_tokens=2, seed=14)[0].prompt
        local = RequestSpec("hit-local", prompt, max_tokens=1)
        consumer.add_request(local)
        stepper.until(lambda: "hit-local" in stepper.results, 30, "local run")
        remote = _prefill(producer, RequestSpec("hit-remote", prompt[:48], max_tokens=2))
        params = remote.transfer_params
        assert params is not None and params.num_tokens == 48
        hit = RequestSpec("hit", prompt, max_tokens=2, transfer_params=params)
        consumer.add_request(hit)
        stepper.until(lambda: "hit" in stepper.results, 30, "prefix-hit request")
        final = stepper.results["hit"]
        _check_output(final, hit)
        assert final.num_local_hit_tokens >= 48 and final.num_external_tokens == 0
        deadline = time.monotonic() + 20
        while producer.stats()["idle_problems"]:
            assert time.monotonic() < deadline, "producer still holds a prefix-hit request"
            stepper.step()
            time.sleep(0.01)
        _wait_producer(producer, "finished_sending", 4, 10)
        stats = _producer_worker_stats(producer)
        assert stats.get("lease_expiries", 0) == 0
        totals = _worker_totals(consumer)
        assert sum(t["releases_sent"] for t in totals) >= 2
        assert sum(t["loads_failed"] for t in totals) == 0
        assert not consumer.idle_problems() and not producer.stats()["idle_problems"]
    finally:
        producer.close()
        _shutdown_clean(consumer)


def test_heartbeats_renew_the_lease_of_a_queued_request(no_thread_leak: None) -> None:
    """A consumer request that waits for free blocks longer than the lease keeps the
    producer's blocks alive by heartbeats, and then loads them (no expiry, no late read)."""
    lease_s = 1.5  # long enough that a loaded box still gets the first heartbeat in
    producer = _producer(lease_s=lease_s)
    # a local "hog" takes 47 of 48 blocks at once (its whole prompt in one step) and keeps
    # them for 15 decode steps: the remote request (3 blocks) is matched but cannot be
    # allocated until the hog finishes, so only heartbeats keep the producer's lease
    consumer = Engine(nixl_config(MODEL, KVRole.CONSUMER, ParallelTopology(), PULL,
                                  num_blocks=48, heartbeat_s=0.1))
    stepper = Stepper(consumer)
    try:
        prompt = make_requests(1, prompt_tokens=46 * 16 + 1, seed=15)[0].prompt
        consumer.add_request(RequestSpec("hog", prompt, max_tokens=15))
        stepper.step()
        spec = make_requests(1, prompt_tokens=48, max_tokens=2, seed=16, prefix="hb")[0]
        result = _prefill(producer, spec)
        consumer.add_request(replace(spec, transfer_params=result.transfer_params))
        deadline = time.monotonic() + 120  # a hang guard, not a speed claim
        steps = 0
        while spec.request_id not in stepper.results:
            assert time.monotonic() < deadline
            stepper.step()
            steps += 1
            time.sleep(0.25)  # slow decode: the hog outlives the lease
        final = stepper.results[spec.request_id]
        _check_output(final, spec)
        assert final.num_external_tokens > 0 and final.num_recomputed_tokens == 0
        # the lease was exercised, by construction rather than by a clock: the request got
        # its blocks only once the hog had finished (>= 15 decode steps, each followed by a
        # 0.25 s sleep: 3.75 s, over 1.5 leases), so only heartbeats kept the producer's hold
        assert list(stepper.results).index("hog") < list(stepper.results).index(spec.request_id)
        assert steps >= 15, steps
        _wait_producer(producer, "finished_sending", 2, 10)
        stats = _producer_worker_stats(producer)
        assert stats.get("lease_expiries", 0) == 0 and stats.get("late_notifs", 0) == 0
        assert sum(t["heartbeats_sent"] for t in _worker_totals(consumer)) > 0
        assert "hog" in stepper.results
    finally:
        producer.close()
        _shutdown_clean(consumer)


def test_load_finishes_on_the_producers_promise_without_waiting_for_its_ack(
        no_thread_leak: None) -> None:
    """Each consumer rank asks its producer ranks to promise the hold (``begin``) before
    its READ; a READ that ends inside the promise completes the load at once, and the
    acks that come later agree (none contradicts a promise)."""
    producer = _producer(lease_s=60.0)
    consumer = _consumer()
    stepper = Stepper(consumer)
    try:
        specs = make_requests(3, prompt_tokens=48, max_tokens=2, seed=21, prefix="promise")
        for spec in specs:
            result = _prefill(producer, spec)
            consumer.add_request(replace(spec, transfer_params=result.transfer_params))
            stepper.until(lambda s=spec: s.request_id in stepper.results, 30, "load")
            _check_output(stepper.results[spec.request_id], spec)
            assert stepper.results[spec.request_id].num_external_tokens > 0
        _wait_producer(producer, "finished_sending", 2 * len(specs), 20)  # acks came too
        stats = _producer_worker_stats(producer)
        assert stats["holds_promised"] == 2 * len(specs)  # each producer rank, each load
        stepper.step()
        totals = _worker_totals(consumer)
        assert sum(t["loads_done"] for t in totals) == len(specs)
        assert sum(t["loads_done_on_promise"] for t in totals) >= 1
        assert sum(t["promises_contradicted"] for t in totals) == 0
    finally:
        producer.close()
        _shutdown_clean(consumer)


def test_a_shut_down_producer_keeps_promised_memory_until_the_promise_ends() -> None:
    """A consumer may still be reading under a promise when the producer's engine shuts
    down in a living process: the KV tensors stay allocated (and unchanged) until the
    promise runs out, then they are let go."""
    import gc
    import weakref

    from kvbridge.connectors.pd import worker as nixl_worker

    engine = Engine(nixl_config(MODEL, KVRole.PRODUCER, ParallelTopology(), PULL,
                                lease_s=0.3))
    connector = engine.workers[0].connector
    assert isinstance(connector, nixl_worker.PdWorker)
    refs = [weakref.ref(t) for t in engine.workers[0].caches.layers.values()]
    now = time.monotonic()
    connector.leases.hold("held-req", now)
    assert connector.leases.guarantee("held-req", now) == (0.3, "")
    engine.shutdown()
    del engine, connector
    gc.collect()
    assert all(r() is not None for r in refs), "promised memory freed at shutdown"
    time.sleep(0.35)
    nixl_worker.keep_alive([], 0.0)  # any later call drops what ran out
    gc.collect()
    assert all(r() is None for r in refs), "memory kept after its promise ended"


def test_a_load_failed_between_the_reporting_hooks_is_reported_once() -> None:
    """The pump thread may fail a load between ``get_finished`` and ``get_failed_recving``
    of one step: that load belongs to the next step's report, whole (reported now it
    would reach the engine as finished twice)."""
    consumer = _consumer()
    try:
        worker = consumer.workers[0].connector
        assert worker is not None
        assert worker.get_finished(frozenset()) == (set(), set())
        with worker.pump.lock:  # what a failed load does on the pump thread
            worker.loads._done_recving.add("r")
            worker.loads._failed_recving.add("r")
        assert worker.get_failed_recving() == set()
        out = worker.collect_output(frozenset())
        assert out.finished_recving == {"r"} and out.failed_recving == {"r"}
        again = worker.collect_output(frozenset())
        assert not again.finished_recving and not again.failed_recving
    finally:
        _shutdown_clean(consumer)
