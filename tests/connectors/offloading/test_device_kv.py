"""The offloading connector with KV the host may not read (as KV in GPU memory), on CPU.

The engine's KV is guarded (:mod:`tests.connectors.guarded_kv`): any host-only
access by the connector raises, and the batched copy path
(:mod:`kvbridge.connectors.offloading.copier`: gather, one copy across per run
of slots, scatter) must carry every byte; the engine checks each loaded byte.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvbridge.connectors.offloading import copier as copier_module
from kvbridge.connectors.offloading.copier import (
    SlotCopier,
    gather_rows,
    scatter_rows,
    slot_runs,
)
from kvbridge.connectors.offloading.worker import OffloadingWorker
from kvbridge.engine.workload import make_requests
from kvbridge.layouts import ParallelTopology
from kvbridge.layouts.kv_memory import HostAccessError, guard_host_access
from kvbridge.offload.cpu import SlotMemory
from tests.connectors.guarded_kv import guard_engine_kv
from tests.connectors.offloading.test_engine import _again, _engine, _run


@pytest.mark.parametrize(("model", "topology", "tiers"), [
    ("tiny-gqa", ParallelTopology(), "cpu"),
    ("tiny-mla", ParallelTopology(tp_size=2), "cpu"),
    ("tiny-hybrid", ParallelTopology(tp_size=2), "cpu+fs"),
])
def test_guarded_kv_round_trips_through_the_batched_copies(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str,
        topology: ParallelTopology, tiers: str) -> None:
    made = guard_engine_kv(monkeypatch)
    specs = make_requests(4, prompt_tokens=80, shared_prefix_tokens=16, max_tokens=2,
                          seed=31, prefix=f"guarded-{model}")
    fs_dir = tmp_path / "fs" if tiers == "cpu+fs" else None
    with _engine(fs_dir, model=model, topology=topology) as engine:
        assert made and len(made) == len(engine.workers)
        _run(engine, specs)
        engine.reset_prefix_cache()
        results, _ = _run(engine, _again(specs, "again"))
        stats = engine.stats()
    # every loaded byte was checked by the engine, and the loads came through the tier
    assert stats["mismatched_bytes"] == 0 and stats["verified_bytes"] > 0
    assert all(r.num_external_tokens > 0 for r in results)
    copies = stats["worker_stats"]
    assert isinstance(copies, dict)
    # the batched path carried every copy: no fallback to block-by-block copies (a host
    # access inside the batch would raise HostAccessError and fall back, or fail)
    assert copies["load_copy_errors"] == 0 and copies["store_copy_errors"] == 0
    assert copies["copy_batches"] > 0 and copies["load_copies"] > 0
    assert copies["load_bytes"] > 0 and copies["store_bytes"] > 0
    assert copies["slot_bytes_pinned"] == 0  # host KV: nothing pinned


def test_a_host_access_in_the_batched_path_would_not_go_unnoticed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard is live in the worker: the same engine, with a copy that reads the KV
    through numpy, fails every batch (and the block-by-block fallback takes over)."""
    guard_engine_kv(monkeypatch)
    seen: list[BaseException] = []
    real = SlotCopier.copy

    def peeking(self: SlotCopier, layers: list[torch.Tensor], *args: object,
                **kwargs: object) -> int:
        try:
            layers[0].numpy()
        except HostAccessError as exc:
            seen.append(exc)
            raise
        return real(self, layers, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SlotCopier, "copy", peeking)
    specs = make_requests(2, prompt_tokens=48, max_tokens=2, seed=32, prefix="peek")
    with _engine(None) as engine:
        _run(engine, specs)
        stats = engine.stats()
    copies = stats["worker_stats"]
    assert isinstance(copies, dict)
    assert seen and copies["copy_batches"] == 0 and copies["store_copies"] > 0


def test_slot_copier_moves_exact_bytes_in_bounded_rounds() -> None:
    """Scattered blocks, slots in several runs, rounds cut by ``max_gather_bytes``:
    the slots hold exactly each block's layers in order, and loading them back into
    empty (guarded) KV restores every block."""
    rng = random.Random(7)
    layer_bytes = [256, 768, 512]  # unequal layers: the slot offsets must add up
    num_blocks, slot_bytes = 40, sum(layer_bytes)
    generator = torch.Generator().manual_seed(7)
    kv = [guard_host_access(torch.randint(0, 256, (num_blocks, n), dtype=torch.uint8,
                                          generator=generator)) for n in layer_bytes]
    blocks = rng.sample(range(num_blocks), 17)
    slots = [0, 1, 2, 3, 9, 10, 4, 30, 31, 32, 33, 34, 12, 5, 6, 7, 20]
    memory = SlotMemory(36, slot_bytes)
    try:
        pool: torch.Tensor = memory.as_tensor()  # type: ignore[assignment]
        copier = SlotCopier("cpu", max_gather_bytes=5 * slot_bytes)
        assert copier.copy(kv, pool, blocks, slots, load=False) == 17 * slot_bytes
        assert copier.rounds == 4  # 17 blocks, 5 per round
        for block, slot in zip(blocks, slots, strict=True):
            expected = torch.cat([layer[block].cpu() for layer in kv])
            assert torch.equal(pool[slot], expected)
        target = [guard_host_access(torch.zeros_like(layer.cpu())) for layer in kv]
        copier.copy(target, pool, blocks, slots, load=True)
        for layer, back in zip(kv, target, strict=True):
            for block in range(num_blocks):
                want = layer[block].cpu() if block in blocks else torch.zeros_like(
                    layer[block].cpu())
                assert torch.equal(back[block].cpu(), want), block
        del pool
    finally:
        memory.close()


def test_slot_runs_cover_the_slots_in_order() -> None:
    assert slot_runs([]) == []
    assert slot_runs([4]) == [(0, 4, 1)]
    assert slot_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]


@pytest.mark.parametrize("kernels", [True, False], ids=["index-kernels", "row-copies"])
def test_gather_and_scatter_rows_agree_in_both_forms(kernels: bool) -> None:
    """The GPU form (``index_select`` / ``index_copy_``) and the host form (row copies)
    of the copier's gather and scatter move the same bytes; run here on guarded KV."""
    generator = torch.Generator().manual_seed(11)
    layers = [guard_host_access(torch.randint(0, 256, (12, n), dtype=torch.uint8,
                                              generator=generator)) for n in (64, 192)]
    blocks = [7, 0, 11, 3]
    rows = torch.empty((4, 256), dtype=torch.uint8)
    gather_rows(layers, blocks, rows, kernels=kernels)
    for j, block in enumerate(blocks):
        assert torch.equal(rows[j].cpu(), torch.cat([x[block].cpu() for x in layers]))
    target = [guard_host_access(torch.zeros((12, n), dtype=torch.uint8)) for n in (64, 192)]
    scatter_rows(target, blocks, rows, kernels=kernels)
    for layer, back in zip(layers, target, strict=True):
        for block in range(12):
            want = layer[block].cpu() if block in blocks else torch.zeros_like(
                layer[block].cpu())
            assert torch.equal(back[block].cpu(), want)


def test_a_device_that_never_finishes_fails_the_batch_without_blocking_retries(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy stream that does not finish in time (a stuck GPU) drops the step's stores:
    no block-by-block retry (a blocking copy would wait on the device without a bound),
    and the next round recomputes what was never stored, byte for byte."""
    guard_engine_kv(monkeypatch)
    monkeypatch.setattr(copier_module, "finish", lambda device, timeout_s: False)
    retried: list[object] = []
    real_one = OffloadingWorker._copy

    def one(self: OffloadingWorker, *args: Any, **kwargs: Any) -> int:
        retried.append(args)
        return real_one(self, *args, **kwargs)

    monkeypatch.setattr(OffloadingWorker, "_copy", one)
    specs = make_requests(2, prompt_tokens=48, max_tokens=2, seed=33, prefix="stuck")
    with _engine(None) as engine:
        _run(engine, specs)
        engine.reset_prefix_cache()
        results, _ = _run(engine, _again(specs, "again"))
        stats = engine.stats()
    copies = stats["worker_stats"]
    assert isinstance(copies, dict)
    assert copies["copy_timeouts"] > 0 and copies["store_copies"] == 0
    assert copies["store_copy_errors"] > 0 and not retried
    assert all(r.num_external_tokens == 0 for r in results)  # nothing was stored
    assert stats["mismatched_bytes"] == 0
