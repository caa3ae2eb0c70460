"""Push mode posts a layer's WRITE only after its fence passed (never stale bytes).

On a GPU the fence is a CUDA event recorded in ``save_kv_layer`` /
``wait_for_save``; here a fence that passes only when the test says so stands
in for it, on a real producer/consumer pair (both engines in this process,
real NIXL): while the fences are held nothing is written, whatever the
consumer registered; once they pass, the push completes and the consumer's
output is right. The host-memory fence is a no-op.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from kvbridge.backends.device.fence import DONE, record_fence
from kvbridge.connectors import KVRole, TransferMode
from kvbridge.engine.core import Engine
from kvbridge.engine.request import RequestState
from kvbridge.engine.workload import InProcessRouter, check_outputs, make_requests
from kvbridge.layouts import ParallelTopology
from tests.conftest import require
from tests.connectors.nixl.nixl_helpers import nixl_config

PUSH = TransferMode.PUSH


class HeldFence:
    """Passes only after :meth:`release`; remembers when."""

    def __init__(self, log: list[HeldFence]) -> None:
        self.released_at: float | None = None
        log.append(self)

    def done(self) -> bool:
        return self.released_at is not None

    def release(self) -> None:
        self.released_at = time.monotonic()


def test_host_memory_fence_is_a_no_op() -> None:
    assert record_fence(torch.zeros(4)) is DONE and DONE.done()
    assert record_fence(None) is DONE


def test_push_writes_wait_for_the_layer_fences() -> None:
    require("nixl_cu12", "NIXL (nixl-cu12)")
    producer = Engine(nixl_config("tiny-gqa", KVRole.PRODUCER, ParallelTopology(), PUSH))
    consumer = Engine(nixl_config("tiny-gqa", KVRole.CONSUMER, ParallelTopology(), PUSH))
    try:
        workers: list[Any] = [w.connector for w in producer.workers]
        fences: list[HeldFence] = []
        posted_at: list[float] = []  # when each WRITE was posted (the real post, wrapped)
        for w in workers:
            w.record_fence = lambda _tensor: HeldFence(fences)
            real_post = w.transport.post

            def post(*args: Any, _real: Any = real_post, **kwargs: Any) -> Any:
                posted_at.append(time.monotonic())
                return _real(*args, **kwargs)

            w.transport.post = post
        router = InProcessRouter(producer, consumer, PUSH)
        spec = make_requests(1, prompt_tokens=40, max_tokens=2, seed=3, prefix="fence")[0]
        router.submit(spec)

        def registered() -> bool:
            return any(job.targets for w in workers for job in w.push.jobs.values())

        deadline = time.monotonic() + 60
        while not (fences and registered() and router.producer_results):
            assert time.monotonic() < deadline, "prefill / consumer registration not seen"
            router.poll()
            time.sleep(0.002)
        for _ in range(50):  # the producer keeps stepping and pumping: still nothing posted
            router.poll()
            time.sleep(0.002)
        assert posted_at == [] and all(w.transport.counters().posted == 0 for w in workers)
        assert not router.results, "consumer finished without the pushed KV"
        jobs = [job for w in workers for job in w.push.jobs.values()]
        assert jobs and all(not job.layers_ready and job.fenced for job in jobs)

        for fence in fences:
            fence.release()
        released = max(f.released_at for f in fences if f.released_at is not None)
        deadline = time.monotonic() + 60
        while router.busy:
            assert time.monotonic() < deadline, "push did not finish after the fences passed"
            router.poll()
            time.sleep(0.002)
        assert posted_at and min(posted_at) >= released
        assert sum(w.transport.counters().posted for w in workers) == len(posted_at)
        (result,) = router.results
        assert result.state is RequestState.FINISHED_LENGTH, result
        assert check_outputs(router.results, [spec]) == []
        assert result.num_external_tokens > 0 and result.mismatched_bytes == 0
    finally:
        consumer.shutdown()
        producer.shutdown()


@pytest.mark.parametrize("engine_calls_save_per_layer", [True])
def test_fences_release_layers_in_order_of_completion(engine_calls_save_per_layer: bool
                                                      ) -> None:
    """The pure bookkeeping: only layers whose fence passed become ready."""
    from kvbridge.connectors.pd.push import PushSender
    from kvbridge.connectors.pd.worker import _PushJob

    job = _PushJob("r")
    log: list[HeldFence] = []
    a, b = HeldFence(log), HeldFence(log)
    job.fenced = [(a, frozenset({0})), (b, frozenset({1, 2}))]
    release = PushSender._release_fenced
    assert release(None, job) is False and job.layers_ready == set()  # type: ignore[arg-type]
    b.release()
    assert release(None, job) is True and job.layers_ready == {1, 2}  # type: ignore[arg-type]
    a.release()
    assert release(None, job) is True and job.layers_ready == {0, 1, 2}  # type: ignore[arg-type]
    assert job.fenced == [] and release(None, job) is False  # type: ignore[arg-type]


def test_a_consumer_cancel_while_the_fences_hold_ends_the_push_cancelled() -> None:
    """The consumer aborts a push load before any layer was written: the producer's
    push to that consumer rank goes FENCED -> CANCELLED at once (no WRITE is in
    flight), answers ``pushed`` not ok, and the request is forgotten (its lease got
    every answer): nothing is posted once the fences pass."""
    require("nixl_cu12", "NIXL (nixl-cu12)")
    from kvbridge.connectors.pd.send_state import SendState

    producer = Engine(nixl_config("tiny-gqa", KVRole.PRODUCER, ParallelTopology(), PUSH))
    consumer = Engine(nixl_config("tiny-gqa", KVRole.CONSUMER, ParallelTopology(), PUSH))
    try:
        workers: list[Any] = [w.connector for w in producer.workers]
        fences: list[HeldFence] = []
        for w in workers:
            w.record_fence = lambda _tensor: HeldFence(fences)
        router = InProcessRouter(producer, consumer, PUSH)
        spec = make_requests(1, prompt_tokens=40, max_tokens=2, seed=4, prefix="cancel")[0]
        router.submit(spec)

        def targets() -> list[Any]:
            return [t for w in workers for job in w.push.jobs.values()
                    for t in job.targets.values()]

        deadline = time.monotonic() + 60
        while not (fences and targets() and router.producer_results):
            assert time.monotonic() < deadline, "prefill / consumer registration not seen"
            router.poll()
            time.sleep(0.002)
        seen = targets()
        assert {t.state for t in seen} == {SendState.FENCED}
        assert consumer.abort(spec.request_id)
        deadline = time.monotonic() + 60
        while not all(t.state.terminal for t in seen) or consumer.has_work():
            assert time.monotonic() < deadline, "cancel not answered: " \
                f"{[t.state.value for t in seen]}, consumer busy {consumer.has_work()}"
            router.poll()
            time.sleep(0.002)
        assert {(t.state, t.error) for t in seen} == {(SendState.CANCELLED,
                                                       "cancelled by consumer")}
        for fence in fences:
            fence.release()
        for _ in range(50):  # the fences passed: a cancelled push still posts nothing
            router.poll()
            time.sleep(0.002)
        assert not any(w.push.jobs for w in workers)
        assert all(w.transport.counters().posted == 0 for w in workers)
        stats = [w.get_stats() for w in workers]
        assert sum(s["pushes_failed"] for s in stats) == len(seen)
        assert sum(s["pushes_done"] for s in stats) == 0
        (result,) = router.results
        assert result.state is RequestState.FINISHED_ABORTED
    finally:
        consumer.shutdown()
        producer.shutdown()
