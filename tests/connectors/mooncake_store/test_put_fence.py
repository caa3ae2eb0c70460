"""A step's Mooncake puts are issued only after the kernels that wrote its KV finished
(GPU KV is read outside every CUDA stream), on a real mooncake_master.

The put reads the registered tensors directly, outside every CUDA stream, so
``wait_for_save`` waits (bounded) for a fence before ``batch_put_from``. Here
:class:`~tests.connectors.late_kernels.LateKernels` stands in for the CUDA
event: the KV holds stale bytes until the fence's ``done()`` passed; a put
issued earlier would store them and the reloading round would report
mismatched bytes. On host memory the fence is the no-op ``DONE``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from kvbridge.backends.device.fence import DONE, record_fence
from kvbridge.connectors import ConnectorConfig, KVRole
from kvbridge.connectors.mooncake_store.worker import MooncakeStoreWorker
from kvbridge.engine.core import Engine, EngineConfig
from kvbridge.engine.workload import check_outputs, make_requests
from kvbridge.layouts import ParallelTopology, load_spec
from tests.connectors import late_kernels
from tests.connectors.mooncake_store.conftest import run_again_from_store


class PutLog:
    """Wraps the worker's real client: for each put (``batch_put_from``, and
    ``start_batch_put_from``, the KV's), whether every fence recorded so far had
    passed when it was issued."""

    def __init__(self, client: Any, fences: list[Any]) -> None:
        self._client = client
        self._fences = fences
        self.puts: list[bool] = []

    def batch_put_from(self, *args: Any, **kwargs: Any) -> Any:
        self.puts.append(all(f.passed for f in self._fences))
        return self._client.batch_put_from(*args, **kwargs)

    def start_batch_put_from(self, *args: Any, **kwargs: Any) -> Any:
        self.puts.append(all(f.passed for f in self._fences))
        return self._client.start_batch_put_from(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _engine(extra: dict[str, Any]) -> Engine:
    connector = ConnectorConfig("mooncake_store", KVRole.BOTH, extra=extra)
    return Engine(EngineConfig(load_spec("tiny-gqa"), ParallelTopology(tp_size=2),
                               num_blocks=96, connector=connector))


def _workers(engine: Engine) -> list[tuple[MooncakeStoreWorker, Any]]:
    out = []
    for w in engine.workers:
        assert isinstance(w.connector, MooncakeStoreWorker)
        out.append((w.connector, w.caches))
    return out


def test_host_kv_fence_is_done() -> None:
    assert record_fence(torch.zeros(2, 8)) is DONE


def test_puts_wait_for_the_kernels_that_wrote_the_kv(
        held_store: tuple[dict[str, Any], Any]) -> None:
    requests = make_requests(2, prompt_tokens=80, max_tokens=2, seed=15, prefix="putfence")
    engine = _engine({**held_store[0], "load_async": False})
    fences: list[late_kernels.LateKernels] = []
    logs: list[PutLog] = []
    try:
        for worker, caches in _workers(engine):
            late_kernels.install(worker, caches.layers.values(), polls=4, log=fences)
            log = PutLog(worker.client, fences)
            worker.client = log  # type: ignore[assignment]
            logs.append(log)
        for spec in requests:
            engine.add_request(spec)
        first = engine.run_until_done(timeout_s=60)
        assert not check_outputs(first, requests)
        puts = [ok for log in logs for ok in log.puts]
        assert puts and all(puts), "a put was issued before the KV's kernels finished"
        assert fences and all(f.passed and f.polls >= 4 for f in fences)

        again, second = run_again_from_store(engine, requests)
        stats = engine.stats()
    finally:
        for (worker, _), log in zip(_workers(engine), logs, strict=False):
            worker.client = log._client
        engine.shutdown()
    assert not check_outputs(second, again)
    assert stats["mismatched_bytes"] == 0 and stats["verified_bytes"] > 0
    assert all(r.num_external_tokens > 0 for r in second)
    worker_stats = stats["worker_stats"]
    assert isinstance(worker_stats, dict)
    assert worker_stats["put_fence_timeouts"] == 0 and worker_stats["put_failures"] == 0


def test_a_fence_that_never_passes_drops_the_puts_within_op_timeout(
        held_store: tuple[dict[str, Any], Any]) -> None:
    requests = make_requests(1, prompt_tokens=48, max_tokens=2, seed=16, prefix="hungfence")
    engine = _engine({**held_store[0], "load_async": False})
    fences: list[late_kernels.NeverDone] = []
    try:
        for worker, _ in _workers(engine):
            worker.settings = replace(worker.settings, op_timeout_s=0.05)

            def record(_tensor: Any) -> late_kernels.NeverDone:
                fence = late_kernels.NeverDone()
                fences.append(fence)
                return fence

            worker.record_fence = record  # type: ignore[method-assign]
            real = worker.client
            assert real is not None

            def no_put(*args: Any, **kwargs: Any) -> Any:
                raise AssertionError("put issued although the KV's kernels never finished")

            worker.client = PutLog(real, [])  # type: ignore[assignment]
            worker.client.batch_put_from = no_put  # type: ignore[union-attr,method-assign]
            worker.client.start_batch_put_from = no_put  # type: ignore[union-attr,method-assign]
        for spec in requests:
            engine.add_request(spec)
        first = engine.run_until_done(timeout_s=60)
        stats = engine.stats()
    finally:
        for worker, _ in _workers(engine):
            if isinstance(worker.client, PutLog):
                worker.client = worker.client._client
        engine.shutdown()
    assert not check_outputs(first, requests)
    assert fences and all(f.polls > 1 for f in fences)
    worker_stats = stats["worker_stats"]
    assert isinstance(worker_stats, dict)
    assert worker_stats["put_fence_timeouts"] > 0 and worker_stats["put_failures"] > 0
    assert worker_stats["put_calls"] == 0 and worker_stats["blocks_saved"] == 0
