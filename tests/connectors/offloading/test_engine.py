"""The offloading connector in the reference engine: fs hits byte for byte, parts,
injected load failures (real fs faults), KV events, the Mooncake obj tier."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from kvbridge.connectors import ConnectorConfig, KVRole
from kvbridge.connectors.offloading import (
    OffloadingScheduler,
    OffloadingWorker,
    build_part_table,
    pool_fingerprint,
)
from kvbridge.connectors.offloading.faults import install_load_faults
from kvbridge.connectors.offloading.io_hook import fs_io_factory
from kvbridge.connectors.offloading.scheduler import _POOLS, _POOLS_LOCK
from kvbridge.engine.core import Engine, EngineConfig
from kvbridge.engine.request import EngineRequest, RequestResult, RequestSpec, RequestState
from kvbridge.engine.workload import check_outputs, make_requests
from kvbridge.events import BlockRemoved, BlockStored
from kvbridge.layouts import ParallelTopology, load_spec
from kvbridge.offload.faults import FaultInjectors, FaultKind, FaultPlan
from kvbridge.offload.fs_io import block_header_bytes
from kvbridge.offload.fs_layout import FileMapper
from tests.conftest import require

MAX_STEPS = 400  # per run: a livelock would spin far beyond this


def _engine(fs_dir: Path | None, *, model: str = "tiny-gqa",
            topology: ParallelTopology | None = None, faults: FaultPlan | None = None,
            **extra: Any) -> Engine:
    """``faults``: the fs tiers' I/O injects them (real fs faults, through the test hook)."""
    settings: dict[str, Any] = {"cpu_blocks": 64, "fs_o_direct": False, **extra}
    if fs_dir is not None:
        settings["fs_dir"] = str(fs_dir)
    config = EngineConfig(load_spec(model), topology or ParallelTopology(), num_blocks=128,
                          connector=ConnectorConfig("offloading", KVRole.BOTH, extra=settings))
    if faults is None:
        return Engine(config)
    with fs_io_factory(FaultInjectors(faults)):
        return Engine(config)


def _run(engine: Engine, specs: list[RequestSpec]) -> tuple[list[RequestResult], int]:
    for spec in specs:
        engine.add_request(spec)
    steps = 0
    while engine.has_work():
        assert steps < MAX_STEPS, f"not done after {MAX_STEPS} steps: {engine.stats()}"
        if engine.step().num_scheduled == 0:
            time.sleep(0.001)  # only promotions or probes in flight
        steps += 1
    results = engine.pop_results()
    assert not check_outputs(results, specs)
    assert all(r.state is RequestState.FINISHED_LENGTH for r in results)
    return results, steps


def _scheduler(engine: Engine) -> OffloadingScheduler:
    scheduler = engine.scheduler_connector
    assert isinstance(scheduler, OffloadingScheduler)
    return scheduler


def _computed_once(engine: Engine, results: list[RequestResult]) -> None:
    """Without preemption every token is computed exactly once: loaded or computed."""
    stats = engine.stats()
    assert stats["preemptions"] == 0
    expected = sum(r.num_prompt_tokens + len(r.output) - 1 - r.num_local_hit_tokens
                   - r.num_external_tokens for r in results)
    assert stats["tokens_computed"] == expected


def _again(specs: list[RequestSpec], tag: str) -> list[RequestSpec]:
    return [RequestSpec(f"{s.request_id}-{tag}", s.prompt, max_tokens=s.max_tokens)
            for s in specs]


def _block_files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*.kvb")}


def test_restarted_engine_loads_every_block_from_fs_byte_for_byte(tmp_path: Path) -> None:
    specs = make_requests(6, prompt_tokens=64, shared_prefix_tokens=32, max_tokens=2, seed=1)
    with _engine(tmp_path) as first:
        _run(first, specs)
    # shutdown finished the cascades: every distinct full block is a file
    spec = load_spec("tiny-gqa")
    block_bytes = spec.rank_shapes(ParallelTopology())[0].block_bytes
    files = _block_files(tmp_path)
    # each file: its block header (format 2: the layer digests), then the block's bytes
    layers = len(spec.rank_shapes(ParallelTopology())[0].layer_ids)
    assert files and all(p.stat().st_size == block_header_bytes(layers) + block_bytes
                         for p in files)
    with _engine(tmp_path) as second:  # empty CPU tier: everything comes from fs
        results, _ = _run(second, _again(specs, "again"))
        stats = _scheduler(second).get_stats()
        engine_stats = second.stats()
    assert stats.get("hits_cpu", 0) + stats["hits_fs"] == stats["load_parts"]
    assert stats["hits_fs"] > 0 and stats["promotions_failed"] == 0
    assert sum(r.num_external_tokens for r in results) > 0
    # every loaded token verified against the content function, none mismatched
    per_token = block_bytes // 16
    assert engine_stats["verified_bytes"] == engine_stats["external_tokens"] * per_token
    assert engine_stats["mismatched_bytes"] == 0


def test_a_block_is_a_hit_only_if_every_part_hits(tmp_path: Path) -> None:
    model, topology = "tiny-gqa", ParallelTopology(tp_size=2)
    spec = load_spec(model)
    specs = make_requests(2, prompt_tokens=80, max_tokens=2, seed=2)
    with _engine(tmp_path, model=model, topology=topology) as first:
        _run(first, specs)
    table = build_part_table(spec, topology)
    assert len(table.parts) == 2
    # remove rank 1's part of block 2 of the first request
    request = EngineRequest(specs[0], 1)
    request.update_hashes(spec, 1)
    part = table.parts[1]
    mapper = FileMapper(str(tmp_path), pool_fingerprint(spec, part.block_bytes))
    os.remove(mapper.path(part.key(request.hashes[0][2])))
    with _engine(tmp_path, model=model, topology=topology) as second:
        results, _ = _run(second, _again(specs, "again"))
        assert second.stats()["mismatched_bytes"] == 0
    by_id = {r.request_id: r for r in results}
    assert by_id[f"{specs[0].request_id}-again"].num_external_tokens == 2 * 16
    assert by_id[f"{specs[1].request_id}-again"].num_external_tokens == 79


@pytest.mark.parametrize("kind", ["short_read", "eloop", "eio", "corrupt"])
def test_failed_fs_loads_recompute_once_and_never_loop(tmp_path: Path, kind: str) -> None:
    specs = make_requests(8, prompt_tokens=64, shared_prefix_tokens=48, max_tokens=2, seed=3)
    with _engine(tmp_path) as first:
        _run(first, specs)
    files_before = _block_files(tmp_path)
    faults = FaultPlan(rate=1.0, kinds=(FaultKind(kind),), seed=1)
    with _engine(tmp_path, faults=faults) as second:
        scheduler = _scheduler(second)
        scheduler.failed_load_log = []
        results, steps = _run(second, _again(specs, "again"))
        stats = scheduler.get_stats()
        _computed_once(second, results)
        log = list(scheduler.failed_load_log)
        assert second.stats()["mismatched_bytes"] == 0
        second.step()  # publish the last tier events
        withdrawn = [e for e in second.events
                     if isinstance(e, BlockRemoved) and e.medium == "STORAGE"]
    assert stats["promotions_failed"] > 0 and stats["hits_fs"] == 0
    assert sum(r.num_external_tokens for r in results) == 0  # nothing came through
    # each failed block was recomputed, by each request that waited for it, once
    assert log and len(log) == len(set(log))
    assert all(matched <= index * 16 for _, _, index, matched in log)
    # no key is promoted again after its failure: at most one attempt per stored block
    assert stats["promotions_started"] <= len(files_before)
    assert steps < MAX_STEPS
    if kind == "corrupt":   # a changed byte in a full-size file: only the digests see it
        # each job's first bad block failed its digests and was removed (the rest of a
        # batch after it is not loaded: the request recomputes from the first bad token)
        assert 0 < stats["fs_digest_mismatches"] == stats["fs_files_deleted"]
    if kind in ("short_read", "corrupt"):
        assert stats["fs_files_deleted"] > 0  # provably torn: deleted
        # a router that indexed the earlier run's events learns the block is gone
        assert len(withdrawn) == stats["fs_files_deleted"]
    else:
        assert not withdrawn
        assert _block_files(tmp_path) == files_before  # transient: every file kept


def test_without_verification_a_corrupt_block_reaches_the_engine(tmp_path: Path) -> None:
    """The same corruption with ``verify: off``: the engine's own byte check catches what the
    tiers no longer do (so the ``corrupt`` case above is the digests' work)."""
    specs = make_requests(3, prompt_tokens=64, max_tokens=2, seed=4)
    with _engine(tmp_path, verify="off") as first:
        _run(first, specs)
    faults = FaultPlan(rate=1.0, kinds=(FaultKind("corrupt"),), seed=1)
    with _engine(tmp_path, verify="off", faults=faults) as second:
        for spec in _again(specs, "again"):
            second.add_request(spec)
        steps = 0
        while second.has_work() and steps < MAX_STEPS:
            if second.step().num_scheduled == 0:
                time.sleep(0.001)
            steps += 1
        second.pop_results()
        stats = _scheduler(second).get_stats()
        assert second.stats()["mismatched_bytes"] > 0
    assert stats["hits_fs"] > 0 and stats["promotions_failed"] == 0
    assert stats["fs_digest_mismatches"] == stats["fs_loads_verified"] == 0


def test_a_cpu_slot_corrupted_in_the_engine_is_recomputed_byte_for_byte() -> None:
    specs = make_requests(4, prompt_tokens=64, shared_prefix_tokens=32, max_tokens=2, seed=6)
    with _engine(None, verify="full") as engine:  # the CPU tier's default samples
        _run(engine, specs)
        primary = _scheduler(engine).managers[0].primary
        for key in list(primary._slots):                # one byte of every stored block
            slot = primary.get(key)
            assert slot is not None
            primary.view(slot.index)[len(primary.view(slot.index)) // 2] ^= 0x01
        results, _ = _run(engine, _again(specs, "again"))
        stats = _scheduler(engine).get_stats()
        engine_stats = engine.stats()
        # the same requests once more: the recomputed blocks were stored again, and load
        again, _ = _run(engine, _again(specs, "third"))
        later = _scheduler(engine).get_stats()
        final_stats = engine.stats()
    # each block the engine asked the connector for failed its digests and was recomputed
    assert stats["cpu_digest_mismatches"] == len(specs) and stats["hits_cpu"] == 0
    assert stats["cpu_corrupt_removed"] == stats["cpu_digest_mismatches"]
    assert sum(r.num_external_tokens for r in results) == 0
    assert engine_stats["mismatched_bytes"] == 0
    assert sum(r.num_external_tokens for r in again) > 0 and later["hits_cpu"] == len(specs)
    assert later["cpu_loads_verified"] == len(specs)
    assert final_stats["mismatched_bytes"] == 0 and final_stats["verified_bytes"] > 0


def test_close_error_after_a_full_read_is_a_hit(tmp_path: Path) -> None:
    specs = make_requests(3, prompt_tokens=64, max_tokens=2, seed=4)
    with _engine(tmp_path) as first:
        _run(first, specs)
    faults = FaultPlan(rate=1.0, kinds=(FaultKind("close_error"),), seed=1)
    with _engine(tmp_path, faults=faults) as second:
        results, _ = _run(second, _again(specs, "again"))
        stats = _scheduler(second).get_stats()
        assert second.stats()["mismatched_bytes"] == 0
    assert stats["promotions_failed"] == 0 and stats["hits_fs"] == 12
    assert stats["fs_close_errors_ignored"] == 12
    assert sum(r.num_external_tokens for r in results) == 3 * 63


def test_kv_events_per_tier(tmp_path: Path) -> None:
    specs = make_requests(6, prompt_tokens=64, max_tokens=2, seed=5)
    with _engine(tmp_path, cpu_blocks=8) as engine:
        for spec in specs:  # one at a time: a step stores at most as many blocks as slots
            _run(engine, [spec])
            assert _scheduler(engine).wait_idle()
        engine.step()  # publish the last cascades' events
        assert _scheduler(engine).get_stats()["stores_skipped_no_slot"] == 0
        events = list(engine.events)
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    media = {(e.medium, e.locality) for e in stored}
    assert media == {("CPU", "LOCAL"), ("STORAGE", "LOCAL")}
    cpu = [e for e in stored if e.medium == "CPU"]
    assert all(len(e.token_ids) == e.block_size == 16 and e.group_idx == 0 for e in cpu)
    # chained: each block's parent is the previous block of its request
    by_hash = {e.block_hashes[0]: e for e in cpu}
    assert any(e.parent_block_hash in by_hash for e in cpu)
    fs_hashes = {e.block_hashes[0] for e in stored if e.medium == "STORAGE"}
    assert fs_hashes == set(by_hash)  # every block cascaded to fs once
    assert removed and all(e.medium == "CPU" for e in removed)  # evicted from 8 slots


def test_obj_tier_serves_a_restarted_engine(tmp_path: Path, mooncake_master: Any) -> None:
    require("mooncake.store")
    from kvbridge.backends.mooncake import MooncakeConfig, MooncakeStoreClient

    obj = {"master_address": mooncake_master.rpc_address,
           "metadata_server": mooncake_master.metadata_url,
           "global_segment_size": 0, "local_buffer_size": 16 << 20}
    # the objects live in the segment of a client that outlives both engines (a store node)
    holder = MooncakeStoreClient.connect(MooncakeConfig(
        mooncake_master.rpc_address, mooncake_master.metadata_url,
        global_segment_size=64 << 20, local_buffer_size=0))
    specs = make_requests(3, prompt_tokens=64, max_tokens=2, seed=6)
    try:
        with _engine(None, obj=obj) as first:
            _run(first, specs)
        second = _engine(None, obj=obj)
    except BaseException:
        holder.close()
        raise
    with holder, second:
        results, _ = _run(second, _again(specs, "obj"))
        stats = _scheduler(second).get_stats()
        assert second.stats()["mismatched_bytes"] == 0
    assert stats["hits_obj"] == 12
    assert sum(r.num_external_tokens for r in results) == 3 * 63


def test_worker_maps_file_backed_slots_when_the_scheduler_is_elsewhere(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    specs = make_requests(3, prompt_tokens=64, max_tokens=2, seed=7)
    with _engine(None, shm_dir=str(shm)) as engine:
        scheduler = _scheduler(engine)
        # as if the workers ran in another process: no in-process registry entry
        with _POOLS_LOCK:
            del _POOLS[scheduler.token]
        assert [p.name for p in shm.iterdir()] == [f"kvbridge-offload-{scheduler.token}-0"]
        _run(engine, specs)
        engine.reset_prefix_cache()
        results, _ = _run(engine, _again(specs, "again"))
        assert engine.stats()["mismatched_bytes"] == 0
        assert engine.stats()["worker_stats"]["load_copies"] == 12
    assert sum(r.num_external_tokens for r in results) == 3 * 63
    assert not list(shm.iterdir())  # the scheduler removed its backing file


def test_a_batch_failing_part_way_keeps_the_blocks_loaded_before(tmp_path: Path) -> None:
    spec = load_spec("tiny-gqa")
    specs = make_requests(1, prompt_tokens=80, max_tokens=2, seed=8)  # 5 full blocks
    with _engine(tmp_path) as first:
        _run(first, specs)
    request = EngineRequest(specs[0], 1)
    request.update_hashes(spec, 1)
    part = build_part_table(spec, ParallelTopology()).parts[0]
    bad = part.key(request.hashes[0][2])
    faults = FaultPlan(per_key={bad: FaultKind.EIO})
    with _engine(tmp_path, faults=faults, fs_read_threads=2) as second:
        scheduler = _scheduler(second)
        scheduler.failed_load_log = []
        results, _ = _run(second, _again(specs, "again"))
        stats = scheduler.get_stats()
        _computed_once(second, results)
        assert second.stats()["mismatched_bytes"] == 0
        log = list(scheduler.failed_load_log)
    # one promotion job of 5 blocks, in two parts ([0, 1, 2], [3, 4]: one per read
    # thread), failed at block 2: blocks 0 and 1 are kept and loaded, block 2 fails and
    # with it everything after (a prefix cannot skip it), though blocks 3 and 4 loaded
    assert stats["promotions_ok"] == 4 and stats["promotions_failed"] == 1
    assert results[0].num_external_tokens == 2 * 16
    assert log[0][2] == 2 and log[0][3] == 2 * 16


def test_requests_arriving_after_a_failed_load_do_not_retry_it(tmp_path: Path) -> None:
    """The seed report's livelock: the stale 'in fs' verdict must not be served again.

    A long request waits on a promotion that fails (EIO, the file stays); while it
    still references the lookup entry, later requests with the same prefix arrive.
    They must see a miss at once (``mark_miss``), not start the doomed load again.
    """
    shared = make_requests(1, prompt_tokens=64, max_tokens=2, seed=9)[0]
    with _engine(tmp_path) as first:
        _run(first, [shared])
    faults = FaultPlan(rate=1.0, kinds=(FaultKind("eio"),), seed=1)
    with _engine(tmp_path, faults=faults) as second:
        scheduler = _scheduler(second)
        long = RequestSpec("long", shared.prompt, max_tokens=40)
        second.add_request(long)
        steps = 0
        while not scheduler.get_stats()["promotions_failed"]:
            assert steps < MAX_STEPS
            if second.step().num_scheduled == 0:
                time.sleep(0.001)
            steps += 1
        started = scheduler.get_stats()["promotions_started"]
        late = [RequestSpec(f"late-{i}", shared.prompt, max_tokens=2) for i in range(4)]
        results, _ = _run(second, late)
        stats = scheduler.get_stats()
    assert "long" in {r.request_id for r in results}  # it finished too
    assert stats["promotions_started"] == started  # nobody tried the failed blocks again
    late_results = [r for r in results if r.request_id.startswith("late-")]
    assert all(r.num_external_tokens == 0 for r in late_results)


def test_failed_worker_copies_are_not_counted_as_hits() -> None:
    """Only blocks the worker really copied into the engine are hits; a copy that failed
    (reported in invalid_block_ids, then recomputed) counts in load_blocks_failed."""
    specs = make_requests(3, prompt_tokens=64, max_tokens=2, seed=11)
    with _engine(None) as engine:                  # CPU tier only
        _run(engine, specs)
        engine.reset_prefix_cache()                # next run must load from the offload store
        worker = engine.workers[0].connector
        assert isinstance(worker, OffloadingWorker)
        install_load_faults(worker).fail_next_loads(3)
        results, _ = _run(engine, _again(specs, "again"))
        stats = _scheduler(engine).get_stats()
        copies = engine.stats()["worker_stats"]
        assert engine.stats()["mismatched_bytes"] == 0
    assert isinstance(copies, dict)
    assert copies["load_copy_errors"] == 3 and copies["load_copies"] > 0
    assert stats["load_blocks_failed"] == 3
    assert stats["hit_blocks"] == copies["load_copies"]        # tp=1: one part per block
    assert stats["hits_cpu"] == copies["load_copies"]
    assert stats["engine_loads_failed"] == 3
    assert sum(r.num_external_tokens for r in results) > 0


def test_load_faults_wrap_one_worker_and_fail_exactly_one_step() -> None:
    """Fault injection is a wrapper around one worker (the production class has none of
    it): armed for a step, every load of that step fails and counts as failed, never as
    a hit; later steps load through the real copy again."""
    assert not any(hasattr(OffloadingWorker, name) for name in (
        "fail_next_loads", "fail_loads_of_next_step", "inject_fault_next_loads"))
    specs = make_requests(2, prompt_tokens=64, max_tokens=2, seed=12)
    with _engine(None) as engine:
        _run(engine, specs)
        worker = engine.workers[0].connector
        assert isinstance(worker, OffloadingWorker)
        faults = install_load_faults(worker)
        assert install_load_faults(worker) is faults  # installed once per worker
        engine.reset_prefix_cache()
        faults.fail_loads_of_next_step()
        _run(engine, _again(specs, "failed"))
        failed = engine.stats()["worker_stats"]
        assert isinstance(failed, dict)
        failed = dict(failed)  # a copy: the counters go on
        stats = _scheduler(engine).get_stats()
        assert failed["load_copy_errors"] > 0
        assert stats["load_blocks_failed"] == failed["load_copy_errors"]
        assert stats["hit_blocks"] == failed["load_copies"]  # tp=1: one part per block
        engine.reset_prefix_cache()
        results, _ = _run(engine, _again(specs, "healthy"))
        after = engine.stats()["worker_stats"]
        assert engine.stats()["mismatched_bytes"] == 0
    assert isinstance(after, dict)
    assert after["load_copy_errors"] == failed["load_copy_errors"]  # the fault was one step
    assert after["load_copies"] > failed["load_copies"]
    assert sum(r.num_external_tokens for r in results) > 0
