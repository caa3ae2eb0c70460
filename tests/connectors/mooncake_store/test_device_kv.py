"""The Mooncake store connector with KV the host may not read (as KV in GPU memory), on CPU.

The engine's KV is guarded (:mod:`tests.connectors.guarded_kv`): a host-only
access by the connector raises. Such KV is never registered with the store: puts
and gets go through the worker's staging buffer (:mod:`.staging`), cut into
rounds, and digests are ``torch-mix64-v1`` on the KV's device. The engine checks
every loaded byte; a real ``mooncake_master`` serves the store.
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from typing import Any

import pytest
import torch

from kvbridge.backends.mooncake import KeyStatus, McStatus, MooncakeStoreClient
from kvbridge.connectors import (
    ConfigError,
    ConnectorConfig,
    ConnectorContext,
    KVCaches,
    KVRole,
)
from kvbridge.connectors.mooncake_store.plugin import MooncakeStorePlugin
from kvbridge.connectors.mooncake_store.settings import parse_settings
from kvbridge.connectors.mooncake_store.staging import (
    StagedKV,
    adjacent_runs,
    gather_spans,
    scatter_spans,
)
from kvbridge.connectors.mooncake_store.worker import MooncakeStoreWorker
from kvbridge.engine.content import torch_dtype
from kvbridge.engine.workload import check_outputs, make_requests
from kvbridge.layouts import ParallelTopology, load_spec
from kvbridge.layouts.digests import TORCH_ALGORITHM
from kvbridge.layouts.kv_memory import guard_host_access
from tests.connectors.guarded_kv import guard_engine_kv, host_engine_kv, kv_pointers
from tests.connectors.mooncake_store.conftest import run_again_from_store, store_extra
from tests.connectors.mooncake_store.test_roundtrip import TOPOLOGIES, both_engine

#: small enough that every step's puts and every load's gets take several rounds
STAGING_BYTES = 48 << 10

CASES = [pytest.param("tiny-gqa", "tp2", True, id="tiny-gqa-tp2-async"),
         pytest.param("tiny-mla", "tp2dcp2", True, id="tiny-mla-tp2dcp2-async"),
         pytest.param("tiny-hybrid", "pp2", True, id="tiny-hybrid-pp2-async"),
         pytest.param("tiny-hybrid", "tp2dcp2", False, id="tiny-hybrid-tp2dcp2-sync")]


@pytest.mark.parametrize(("model", "topology", "load_async"), CASES)
def test_guarded_kv_is_staged_and_every_byte_verified(
        model: str, topology: str, load_async: bool, monkeypatch: pytest.MonkeyPatch,
        held_store: tuple[dict[str, Any], MooncakeStoreClient]) -> None:
    made = guard_engine_kv(monkeypatch)
    extra = {**held_store[0], "load_async": load_async, "staging_bytes": STAGING_BYTES}
    seed = zlib.crc32(f"staged-{model}-{topology}-{load_async}".encode())
    requests = make_requests(3, prompt_tokens=100, shared_prefix_tokens=32, max_tokens=2,
                             seed=seed, prefix="staged")
    engine = both_engine(model, TOPOLOGIES[topology], extra)
    try:
        workers = [w.connector for w in engine.workers]
        assert len(made) == len(workers) > 0
        # the KV itself is never registered with the store: only staging and records
        registered = {ptr for w in workers if isinstance(w, MooncakeStoreWorker)
                      for ptr in w._registered}
        assert registered and not registered & kv_pointers(made)
        assert not set(held_store[1].registered_buffers) & kv_pointers(made)
        for w in workers:
            assert isinstance(w, MooncakeStoreWorker) and w.staged is not None
            assert w.digests is not None and w.digests.algorithm == TORCH_ALGORITHM
        for spec in requests:
            engine.add_request(spec)
        first = engine.run_until_done(timeout_s=60)
        assert not check_outputs(first, requests)
        again, second = run_again_from_store(engine, requests)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert not check_outputs(second, again)
    assert all(r.num_external_tokens > 0 for r in second)
    assert stats["mismatched_bytes"] == 0 and stats["verified_bytes"] > 0
    worker = stats["worker_stats"]
    assert isinstance(worker, dict)
    # every rank staged; each byte the engine verified came through the staging buffer
    assert worker["kv_staged"] == len(made)
    assert worker["staged_put_bytes"] > 0
    assert worker["staged_get_bytes"] == stats["verified_bytes"]
    assert worker["staging_rounds"] > worker["put_calls"] + worker["get_calls"]
    assert worker["staging_copy_timeouts"] == 0
    # no host access failed a put or a load (the guard raises inside them if one is tried)
    assert worker["put_failures"] == 0 and worker["load_errors"] == 0
    assert worker["blocks_verified"] == worker["blocks_loaded"] > 0


def test_host_kv_keeps_the_zero_copy_path(
        monkeypatch: pytest.MonkeyPatch,
        held_store: tuple[dict[str, Any], MooncakeStoreClient]) -> None:
    host_engine_kv(monkeypatch)
    engine = both_engine("tiny-gqa", TOPOLOGIES["tp2"], held_store[0])
    try:
        for w in engine.workers:
            assert isinstance(w.connector, MooncakeStoreWorker) and w.connector.staged is None
            kv = {int(t.data_ptr()) for t in w.caches.layers.values()}
            assert kv <= set(w.connector._registered)
        assert "kv_staged" not in engine.stats()["worker_stats"]  # type: ignore[operator]
    finally:
        engine.shutdown()


def test_kv_tensors_sharing_one_storage_register_it_once(
        held_store: tuple[dict[str, Any], MooncakeStoreClient]) -> None:
    """vLLM's hybrid allocator puts layer i of every KV cache group on the same bytes;
    Mooncake refuses a second registration of an address (the engine failed to start)."""
    spec = load_spec("tiny-hybrid")
    rank = ParallelTopology()
    shapes = spec.rank_shapes(rank)
    num_blocks = tuple(8 for _ in shapes)
    layers: dict[int, torch.Tensor] = {}
    for index, shape in enumerate(shapes):
        shared = torch.zeros(shape.tensor_shape(num_blocks[index]),
                             dtype=torch_dtype(shape.region.dtype))
        for layer in shape.layer_ids:  # every layer of a region on one storage
            layers[layer] = shared.view(shared.shape)
    caches = KVCaches(shapes, num_blocks, layers)
    assert len(caches.backing_spans()) == len(shapes) < len(layers)
    config = ConnectorConfig("mooncake_store", KVRole.BOTH, extra=held_store[0])
    worker = MooncakeStorePlugin.create_worker(ConnectorContext(
        spec=spec, topology=rank, config=config, num_blocks=num_blocks,
        extra=parse_settings(held_store[0]), rank=rank, worker_index=0))
    assert isinstance(worker, MooncakeStoreWorker)
    try:
        worker.register_kv_caches(caches)
        kv = [ptr for ptr in worker._registered if ptr in kv_pointers([caches])]
        assert sorted(kv) == sorted(ptr for ptr, _ in caches.backing_spans())
    finally:
        worker.shutdown()


def test_a_block_larger_than_a_staging_round_is_refused_at_registration(
        monkeypatch: pytest.MonkeyPatch,
        held_store: tuple[dict[str, Any], MooncakeStoreClient]) -> None:
    guard_engine_kv(monkeypatch)
    with pytest.raises(ConfigError, match="staging_bytes"):
        both_engine("tiny-gqa", TOPOLOGIES["tp2"], {**held_store[0], "staging_bytes": 64})


def test_staging_bytes_setting_is_bounded(mooncake_master: Any) -> None:
    assert parse_settings(store_extra(mooncake_master)).staging_bytes == 256 << 20
    for bad in (1, -5, 1 << 40, "big"):
        with pytest.raises(ConfigError, match="staging_bytes"):
            parse_settings(store_extra(mooncake_master, staging_bytes=bad))


def test_staged_gets_land_only_the_keys_that_arrived(
        held_store: tuple[dict[str, Any], MooncakeStoreClient]) -> None:
    """Unaligned spans and rounds of two keys; a missing key in the middle of a round
    leaves its destination untouched, the others land exactly."""
    client = held_store[1]
    generator = torch.Generator().manual_seed(3)
    source = guard_host_access(torch.randint(0, 256, (4096,), dtype=torch.uint8,
                                             generator=generator))
    target = guard_host_access(torch.full((4096,), 7, dtype=torch.uint8))
    staged = StagedKV(client, [source, target], staging_bytes=2 * 700, timeout_s=5.0,
                      abandon_grace_s=1.0)
    for ptr, nbytes in staged.buffers:
        client.register_buffer(ptr, nbytes)
    try:
        base, dest = int(source.data_ptr()), int(target.data_ptr())
        spans = [(5, 300), (900, 333), (1500, 300), (3000, 256), (3600, 100)]
        keys = [f"staged-unit-{n}" for n in range(len(spans))]
        put = staged.start_batch_put_from(
            keys[:2] + keys[3:], [base + o for o, _ in spans[:2] + spans[3:]],
            [s for _, s in spans[:2] + spans[3:]]).results()
        assert all(r.ok for r in put), put
        got = staged.start_batch_get_into(keys, [dest + o for o, _ in spans],
                                          [s for _, s in spans]).results()
        assert [r.status for r in got] == [KeyStatus.OK, KeyStatus.OK, KeyStatus.NOT_FOUND,
                                           KeyStatus.OK, KeyStatus.OK]
        assert got[2].code == McStatus.OBJECT_NOT_FOUND
        expected = torch.full((4096,), 7, dtype=torch.uint8)
        plain = source.cpu()
        for n, (offset, size) in enumerate(spans):
            if n != 2:
                expected[offset:offset + size] = plain[offset:offset + size]
        assert torch.equal(target.cpu(), expected)
        stats = staged.snapshot()
        # 700-byte halves: puts 300+333 | 256+100, gets 300+333 | 300+256+100
        assert stats["staging_rounds"] == 2 + 2
        assert stats["staged_get_bytes"] == sum(s for n, (_, s) in enumerate(spans) if n != 2)
    finally:
        client.remove(keys, force=True)
        for ptr, _ in staged.buffers:
            client.unregister_buffer(ptr)


def test_gpu_form_of_staged_gather_and_scatter_on_guarded_kv() -> None:
    """The device kernels staging uses on a GPU (``index_select`` / ``index_copy_`` for
    whole rows, row by row otherwise), run here on guarded KV: the same bytes."""
    generator = torch.Generator().manual_seed(5)
    kv = guard_host_access(torch.randint(0, 256, (1024,), dtype=torch.uint8,
                                         generator=generator))
    plain = kv.cpu()
    for offsets, size in (([128, 0, 896], 128), ([5, 300, 77], 50)):  # rows; unaligned
        rows = gather_spans(kv, offsets, size, kv.device)
        assert torch.equal(rows.cpu(), torch.stack([plain[o:o + size] for o in offsets]))
        target = guard_host_access(torch.zeros(1024, dtype=torch.uint8))
        scatter_spans(target, offsets, size, rows, kv.device)
        expected = torch.zeros(1024, dtype=torch.uint8)
        for o in offsets:
            expected[o:o + size] = plain[o:o + size]
        assert torch.equal(target.cpu(), expected)
    # keys 0, 1, 3 arrived of four packed 10-byte keys: runs of adjacent staging bytes
    assert adjacent_runs([0, 1, 3], [0, 10, 20, 30], 10) == [(0, 2), (3, 1)]


def test_a_device_copy_that_never_finishes_fails_puts_and_loads(
        monkeypatch: pytest.MonkeyPatch,
        held_store: tuple[dict[str, Any], MooncakeStoreClient]) -> None:
    """A copy stream that does not finish in time (a stuck GPU): the step's puts are
    never made (nothing to read but unfinished bytes), counted; a load whose scatter
    did not finish reports its blocks failed and the engine recomputes them."""
    from kvbridge.connectors.mooncake_store import staging

    guard_engine_kv(monkeypatch)
    extra = {**held_store[0], "staging_bytes": STAGING_BYTES}
    requests = make_requests(2, prompt_tokens=70, max_tokens=2, seed=zlib.crc32(b"stuck"),
                             prefix="staged-stuck")
    engine = both_engine("tiny-gqa", TOPOLOGIES["tp2"], extra)
    try:
        monkeypatch.setattr(staging, "finish", lambda device, timeout_s: False)
        for spec in requests:
            engine.add_request(spec)
        assert not check_outputs(engine.run_until_done(timeout_s=60), requests)
        stuck = engine.stats()["worker_stats"]
        assert isinstance(stuck, dict)
        assert stuck["staging_copy_timeouts"] > 0 and stuck["blocks_saved"] == 0
        assert stuck["put_failures"] > 0 and stuck["staged_put_bytes"] == 0
        monkeypatch.undo()  # the device recovers: store, then load with a stuck scatter
        guard_engine_kv(monkeypatch)
        engine.reset_prefix_cache()
        again = [replace(s, request_id=s.request_id + "-stored") for s in requests]
        for spec in again:
            engine.add_request(spec)
        assert not check_outputs(engine.run_until_done(timeout_s=60), again)
        engine.reset_prefix_cache()
        monkeypatch.setattr(staging, "finish", lambda device, timeout_s: False)
        last = [replace(s, request_id=s.request_id + "-stuck-load") for s in requests]
        for spec in last:
            engine.add_request(spec)
        results = engine.run_until_done(timeout_s=60)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert not check_outputs(results, last)
    assert stats["mismatched_bytes"] == 0 and stats["failed_loads"] > 0
    worker = stats["worker_stats"]
    assert isinstance(worker, dict)
    assert worker["load_errors"] > 0 and worker["staging_copy_timeouts"] > stuck[
        "staging_copy_timeouts"]
