"""Offloading stores copy a step's KV to the CPU slots only after the kernels that
wrote it finished (else the slots would hold stale bytes).

``wait_for_save`` waits (bounded) for a fence before the copies.
:class:`~tests.connectors.late_kernels.LateKernels` stands in for the CUDA
event: the KV holds stale bytes until the fence's ``done()`` passed; a copy
made earlier would put them in the slots and the reloading round would report
mismatched bytes. A fence that never passes drops the step's stores (copy
errors: the scheduler fails them) instead of offloading stale bytes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvbridge.backends.device.fence import DONE, record_fence, wait_fence
from kvbridge.connectors.offloading.worker import OffloadingWorker
from kvbridge.engine.workload import make_requests
from tests.connectors import late_kernels
from tests.connectors.offloading.test_engine import _again, _engine, _run


def _workers(engine: Any) -> list[tuple[OffloadingWorker, Any]]:
    out = []
    for w in engine.workers:
        assert isinstance(w.connector, OffloadingWorker)
        out.append((w.connector, w.caches))
    return out


def _log_stores(worker: OffloadingWorker, fences: list[Any], log: list[bool]) -> None:
    """Record, for every store copy the worker makes, whether every fence had passed."""
    real_batch, real_one = worker._copy_batch, worker._copy

    def batch(items: Any, pools: Any, load: bool) -> int:
        if not load:
            log.append(all(f.passed for f in fences))
        return real_batch(items, pools, load)

    def one(item: Any, pools: Any, load: bool) -> int:
        if not load:
            log.append(all(f.passed for f in fences))
        return real_one(item, pools, load)

    worker._copy_batch = batch  # type: ignore[method-assign]
    worker._copy = one  # type: ignore[method-assign]


def test_wait_fence() -> None:
    assert record_fence(torch.zeros(3)) is DONE and wait_fence(DONE, 0.0)
    late = late_kernels.LateKernels([torch.zeros(4)], polls=3)
    assert wait_fence(late, 30.0) and late.polls == 3
    never = late_kernels.NeverDone()
    assert not wait_fence(never, 0.01) and never.polls > 1


def test_stores_wait_for_the_kernels_that_wrote_the_kv() -> None:
    specs = make_requests(3, prompt_tokens=64, max_tokens=2, seed=15, prefix="storefence")
    fences: list[late_kernels.LateKernels] = []
    stores: list[bool] = []
    with _engine(None) as engine:  # CPU tier only
        for worker, caches in _workers(engine):
            late_kernels.install(worker, caches.layers.values(), polls=4, log=fences)
            _log_stores(worker, fences, stores)
        _run(engine, specs)
        assert stores and all(stores), "a store copied the KV before its kernels finished"
        assert fences and all(f.passed and f.polls >= 4 for f in fences)
        engine.reset_prefix_cache()  # the next run loads from the CPU tier
        results, _ = _run(engine, _again(specs, "again"))
        stats = engine.stats()
    assert stats["mismatched_bytes"] == 0 and stats["verified_bytes"] > 0
    assert all(r.num_external_tokens > 0 for r in results)
    copies = stats["worker_stats"]
    assert isinstance(copies, dict)
    assert copies["store_fence_timeouts"] == 0 and copies["store_copy_errors"] == 0


def test_a_fence_that_never_passes_drops_the_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvbridge.connectors.offloading.worker.FENCE_TIMEOUT_S", 0.02)
    specs = make_requests(2, prompt_tokens=48, max_tokens=2, seed=16, prefix="hungstore")
    fences: list[late_kernels.NeverDone] = []
    stores: list[bool] = []
    with _engine(None) as engine:
        for worker, _ in _workers(engine):
            def record(_tensor: Any) -> late_kernels.NeverDone:
                fence = late_kernels.NeverDone()
                fences.append(fence)
                return fence

            worker.record_fence = record  # type: ignore[method-assign]
            _log_stores(worker, [], stores)
        _run(engine, specs)
        engine.reset_prefix_cache()
        results, _ = _run(engine, _again(specs, "again"))
        stats = engine.stats()
    assert stores == [], "a store copied although the KV's kernels never finished"
    assert fences and all(f.polls > 1 for f in fences)
    copies = stats["worker_stats"]
    assert isinstance(copies, dict)
    assert copies["store_fence_timeouts"] > 0 and copies["store_copies"] == 0
    assert copies["store_copy_errors"] > 0
    assert all(r.num_external_tokens == 0 for r in results)  # nothing offloaded: recomputed
