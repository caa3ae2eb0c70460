"""Failures are misses: a master killed mid-run and restarted, with requests still flowing;
wrong bytes under a key are caught by the digest check and recomputed.

Real ``mooncake_master`` (a fresh one for the tests that kill it). A producer
and a consumer engine in this process share the store; the consumer's loads
are broken by killing the master right when they start. The digest cases
(verified KV) run a ``kv_both`` engine on the shared master and overwrite a
stored object with another block's bytes through a real store client.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import pytest
import torch

from kvbridge.backends.mooncake import ClientStats, MooncakeStoreClient
from kvbridge.backends.mooncake.master import MooncakeMaster
from kvbridge.connectors import ConnectorConfig, KVRole
from kvbridge.connectors.mooncake_store import clients, store_key
from kvbridge.connectors.mooncake_store import worker as store_worker
from kvbridge.connectors.mooncake_store.records import digest_key_prefix
from kvbridge.connectors.mooncake_store.verify import RankDigests
from kvbridge.engine.core import Engine, EngineConfig
from kvbridge.engine.request import RequestSpec
from kvbridge.engine.workload import check_outputs, make_requests, run_workload
from kvbridge.layouts import ParallelTopology, hash_blocks, load_spec, namespace_for
from kvbridge.layouts.digests import TORCH_ALGORITHM, sample_selected
from tests.connectors.guarded_kv import guard_engine_kv, host_engine_kv
from tests.connectors.mooncake_store.conftest import store_extra


def client_stats(master: MooncakeMaster) -> ClientStats:
    """The summed counters of the pooled clients of ``master`` (the real clients the
    connector halves share): which path answered each call. Waits (bounded) until no
    call is running first, so a call abandoned earlier cannot count in a later phase."""
    with clients._lock:
        pooled = [e.client for k, e in clients._entries.items()
                  if k.master_address == master.rpc_address]
    assert all(c.wait_idle(30.0) for c in pooled), "a Mooncake call still running after 30 s"
    stats = [c.stats() for c in pooled]
    assert stats, "no pooled client for this master"
    return ClientStats(*(sum(getattr(s, f) for s in stats) for f in (
        "calls", "keys", "key_errors", "timeouts", "unreachable")))


def pair(master: MooncakeMaster, **overrides: Any) -> tuple[Engine, Engine]:
    extra = store_extra(master, **{"op_timeout_s": 1.5, "reconnect_interval_s": 0.2, **overrides})
    spec = load_spec("tiny-gqa")
    topology = ParallelTopology(tp_size=2)
    producer = Engine(EngineConfig(spec, topology, num_blocks=96, connector=ConnectorConfig(
        "mooncake_store", KVRole.PRODUCER, extra=extra)))
    consumer = Engine(EngineConfig(spec, topology, num_blocks=96, connector=ConnectorConfig(
        "mooncake_store", KVRole.CONSUMER, extra=extra)))
    return producer, consumer


class KillOnLoad:
    """Consumer step hook: SIGKILL the master in the first step in which loads start."""

    def __init__(self, master: MooncakeMaster) -> None:
        self.master = master
        self.fired_on: set[str] = set()

    def __call__(self, engine: Engine, step: object) -> None:
        if not self.fired_on and engine.loads_started:
            self.fired_on = set(engine.loads_started)
            self.master.kill()


def test_master_killed_mid_run_then_restarted(mooncake_master_fresh: MooncakeMaster) -> None:
    master = mooncake_master_fresh
    producer, consumer = pair(master)
    try:
        # 1. healthy: everything the producer stored is loaded by the consumer
        healthy = run_workload(make_requests(3, prompt_tokens=70, max_tokens=2, seed=1,
                                             prefix="up"), engine=producer, consumer=consumer,
                               shutdown=False)
        assert healthy.failed_requests == 0 and healthy.mismatched_bytes == 0
        assert all(r.num_external_tokens > 0 for r in healthy.results)

        # 2. the master dies as the consumer's loads start: loads fail, requests recompute
        killer = KillOnLoad(master)
        broken = run_workload(make_requests(3, prompt_tokens=70, max_tokens=2, seed=2,
                                            prefix="kill"), engine=producer, consumer=consumer,
                              shutdown=False, consumer_step_hook=killer, timeout_s=60)
        consumer.step_hooks.clear()
        assert killer.fired_on, "no load started, so the master was never killed"
        assert broken.failed_requests == 0, "every request must finish with the right output"
        assert broken.mismatched_bytes == 0
        assert broken.recomputed_tokens > 0
        assert consumer.stats()["failed_loads"] >= len(killer.fired_on)

        # 3. master still down: lookups miss, puts fail and are dropped, nothing hangs
        before = client_stats(master)
        down = run_workload(make_requests(2, prompt_tokens=70, max_tokens=2, seed=3,
                                          prefix="down"), engine=producer, consumer=consumer,
                            shutdown=False, timeout_s=60)
        assert down.failed_requests == 0 and down.external_tokens == 0
        producer_workers = producer.stats()["worker_stats"]
        assert isinstance(producer_workers, dict) and producer_workers["put_failures"] > 0
        # bounded: every call was refused by the fail-fast reachability check; none went
        # to Mooncake (~4.4 s per call to a dead master) to be cut off by op_timeout_s
        after = client_stats(master)
        assert after.unreachable > before.unreachable, (before, after)
        assert after.timeouts == before.timeouts, (before, after)

        # 4. master back (empty, same ports): the clients re-mount by themselves and
        #    later requests hit again, without restarting the engines
        master.restart()
        deadline = time.monotonic() + 30
        rounds = 0
        while True:
            rounds += 1
            again = run_workload(make_requests(2, prompt_tokens=70, max_tokens=2,
                                               seed=100 + rounds, prefix=f"back{rounds}"),
                                 engine=producer, consumer=consumer, shutdown=False,
                                 timeout_s=60)
            assert again.failed_requests == 0 and again.mismatched_bytes == 0
            if again.external_tokens > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert again.external_tokens > 0, f"no hit within {rounds} rounds after the restart"
        assert again.verified_bytes > 0
        for eng in (producer, consumer):
            assert eng.idle_problems() == []
    finally:
        consumer.shutdown()
        producer.shutdown()
    assert not [k for k in clients.live_keys() if k.master_address == master.rpc_address]


def test_stalled_master_costs_timeouts_not_hangs(mooncake_master_fresh: MooncakeMaster) -> None:
    """SIGSTOP: the master's ports still accept, nothing answers; every call is bounded."""
    master = mooncake_master_fresh
    producer, consumer = pair(master, op_timeout_s=0.5, abandon_grace_s=0.5)
    try:
        warm = run_workload(make_requests(1, prompt_tokens=40, max_tokens=1, seed=5,
                                          prefix="warm"), engine=producer, consumer=consumer,
                            shutdown=False)
        assert warm.failed_requests == 0
        before = client_stats(master)
        master.pause()
        try:
            stalled = run_workload(make_requests(2, prompt_tokens=40, max_tokens=2, seed=6,
                                                 prefix="stall"), engine=producer,
                                   consumer=consumer, shutdown=False, timeout_s=60)
        finally:
            master.resume()
        assert stalled.failed_requests == 0 and stalled.external_tokens == 0
        # bounded: the ports still accept, so the check passes and the client's own
        # deadline (op_timeout_s) answered the stalled calls (timeout_s=60: a hang guard)
        assert client_stats(master).timeouts > before.timeouts
        producer_workers = producer.stats()["worker_stats"]
        assert isinstance(producer_workers, dict) and producer_workers["put_failures"] > 0
        connector_stats = consumer.stats()["connector_stats"]
        assert isinstance(connector_stats, dict)
        assert connector_stats["lookup_failures"] + connector_stats["lookup_timeouts"] > 0
        # keys of puts that timed out may have been written later from reused blocks:
        # once the master answers again and the client is idle, they are removed
        assert producer_workers["put_timeouts"] > 0
        deadline = time.monotonic() + 20
        removed = 0
        while not removed and time.monotonic() < deadline:
            run_workload(make_requests(1, prompt_tokens=20, max_tokens=1, seed=7,
                                       prefix=f"after{time.monotonic_ns()}"),
                         engine=producer, consumer=consumer, shutdown=False, timeout_s=60)
            stats = producer.stats()["worker_stats"]
            assert isinstance(stats, dict)
            removed = int(stats["orphans_removed"])
            time.sleep(0.1)
        assert removed > 0
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_pipelined_load_stops_asking_after_a_timed_out_part(
        mooncake_master_fresh: MooncakeMaster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load cut into parts (``PIPELINE_MIN_BYTES`` lowered) whose master stalls as it
    starts: the first part's get and the one started beside it time out within their
    deadlines, the parts after them are never asked for, every block of that rank is a
    load error, and the engine recomputes them (output still right)."""
    monkeypatch.setattr(store_worker, "PIPELINE_MIN_BYTES", 1)
    master = mooncake_master_fresh
    extra = store_extra(master, op_timeout_s=0.5, abandon_grace_s=0.2, load_async=False,
                        reconnect_interval_s=0.2)
    engine = _both(extra)
    (request,) = make_requests(1, prompt_tokens=4 * _BLOCK_TOKENS + 3, max_tokens=2, seed=44,
                               prefix="pipeline-stall")
    rank0 = engine.workers[0].connector
    assert isinstance(rank0, store_worker.MooncakeStoreWorker)
    real_load = rank0._load

    def stalled_load(request_id: str, blocks: Any) -> Any:
        master.pause()
        try:
            return real_load(request_id, blocks)
        finally:
            master.resume()

    try:
        engine.add_request(request)
        assert not check_outputs(engine.run_until_done(timeout_s=60), [request])
        before = rank0.get_stats()
        rank0._load = stalled_load  # type: ignore[method-assign]
        result = _load_again(engine, request, "pipeline-stalled")  # output still right
        after = rank0.get_stats()
    finally:
        engine.shutdown()
    assert result.num_external_tokens == 0 and result.num_recomputed_tokens > 0
    assert after["get_timeouts"] - before["get_timeouts"] == 1
    assert after["get_calls"] - before["get_calls"] == 2  # parts 3 and 4 never asked for
    assert after["load_errors"] - before["load_errors"] == 4
    assert after["blocks_verified"] == before["blocks_verified"]


# --------------------------------------------------------------------------- verified KV
# Issue 18: an object overwritten with another key's bytes (a real upsert of another
# block's bytes under the victim key, after the real store) is caught by the digest
# check on load: only the affected blocks are recomputed and the engine's reference
# check still finds every loaded byte right.

_BLOCK_TOKENS = 16  # tiny-gqa
_TOPOLOGY = ParallelTopology(tp_size=2)


def _both(extra: dict[str, Any]) -> Engine:
    return Engine(EngineConfig(load_spec("tiny-gqa"), _TOPOLOGY, num_blocks=96,
                               connector=ConnectorConfig("mooncake_store", KVRole.BOTH,
                                                         extra=extra)))


def _namespace(tp_rank: int) -> Any:
    return namespace_for(load_spec("tiny-gqa"), "attn", _TOPOLOGY.with_rank(tp_rank=tp_rank))


def _overwrite(client: MooncakeStoreClient, victim: str, source: str) -> None:
    """Store ``source``'s bytes under ``victim`` (both existing objects of equal size)."""
    (size,) = [r.nbytes for r in client.batch_get_into(
        [source], [_SCRATCH.data_ptr()], [_SCRATCH.numel()], exact_size=False)]
    assert size > 0, f"{source} not in the store"
    original = torch.zeros(size, dtype=torch.uint8)
    ptr = int(original.data_ptr())
    client.register_buffer(ptr, size)
    try:
        (got,) = client.batch_get_into([victim], [ptr], [size])
        assert got.ok, got
        assert not torch.equal(original, _SCRATCH[:size]), "victim and source hold the same bytes"
        (put,) = client.batch_upsert_from([victim], [_SCRATCH.data_ptr()], [size])
        assert put.ok, put
        (got,) = client.batch_get_into([victim], [ptr], [size])
        assert got.ok and torch.equal(original, _SCRATCH[:size]), "the overwrite did not land"
    finally:
        client.unregister_buffer(ptr)


_SCRATCH = torch.zeros(1 << 20, dtype=torch.uint8)


def _scratch_registered(client: MooncakeStoreClient) -> None:
    if int(_SCRATCH.data_ptr()) not in client.registered_buffers:
        client.register_buffer(int(_SCRATCH.data_ptr()), _SCRATCH.numel())


def _load_again(engine: Engine, request: RequestSpec, request_id: str) -> Any:
    engine.reset_prefix_cache()
    again = replace(request, request_id=request_id)
    engine.add_request(again)
    (result,) = engine.run_until_done(timeout_s=60)
    assert not check_outputs([result], [again]), "output differs from the reference"
    return result


def _worker_stats(engine: Engine) -> dict[str, Any]:
    stats = engine.stats()["worker_stats"]
    assert isinstance(stats, dict)
    return stats


@pytest.mark.parametrize(("parts", "algorithm", "guarded"),
                         [(1, "auto", False), (4, "auto", False), (1, TORCH_ALGORITHM, False),
                          (1, "auto", True), (4, "auto", True)],
                         ids=["one-get", "pipelined", "torch-mix64", "staged", "staged-pipelined"])
def test_overwritten_object_is_detected_and_only_its_blocks_recomputed(
        held_store: tuple[dict[str, Any], MooncakeStoreClient], parts: int, algorithm: str,
        guarded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pipelined``: parts of one block each, every get started while the block
    before is hashed (``PIPELINE_MIN_BYTES`` lowered: tiny-gqa blocks are small).
    ``torch-mix64``: the digests a rank with KV in device memory takes (on the
    tensors' device: here the CPU), put and checked the same way. ``staged``: the
    KV refuses host access as device KV does: puts and gets go through the staging
    buffer, digests are ``torch-mix64-v1`` on the KV's device."""
    extra, client = held_store
    if parts > 1:
        monkeypatch.setattr(store_worker, "PIPELINE_MIN_BYTES", 1)
    if guarded:
        guard_engine_kv(monkeypatch)
    else:
        host_engine_kv(monkeypatch)
    _scratch_registered(client)
    # distinct prompts per case: the module's store keeps every other test's keys
    seed = (200 if guarded else 40) + parts + (10 if algorithm != "auto" else 0)
    (request,) = make_requests(1, prompt_tokens=4 * _BLOCK_TOKENS + 3, max_tokens=2,
                               seed=seed, prefix=f"digest-full-{parts}-{algorithm}-{guarded}")
    hashes = hash_blocks(request.prompt, _BLOCK_TOKENS)
    engine = _both({**extra, "verify_algorithm": algorithm})  # verify: full is the default
    try:
        engine.add_request(request)
        assert not check_outputs(engine.run_until_done(timeout_s=60), [request])
        assert _load_again(engine, request, "digest-clean").num_external_tokens == 4 * 16
        clean = _worker_stats(engine)
        assert clean["digest_mismatches"] == 0 and clean["blocks_verified"] == 2 * 4
        assert clean["get_calls"] == 2 * parts  # one load of 4 blocks on each of 2 ranks

        # TP rank 1's layer 2 of block 2 now holds block 0's bytes (a real upsert)
        ns = _namespace(1)
        victim = store_key(ns, 2, hashes[2])
        _overwrite(client, victim, store_key(ns, 2, hashes[0]))
        result = _load_again(engine, request, "digest-caught")
        stats = _worker_stats(engine)
        assert result.mismatched_bytes == 0 and result.verified_bytes > 0
        # blocks 0 and 1 stay loaded; block 2 (and what follows it) is recomputed
        assert result.num_external_tokens == 2 * _BLOCK_TOKENS
        assert result.num_recomputed_tokens == 2 * _BLOCK_TOKENS
        assert stats["digest_mismatches"] - clean["digest_mismatches"] == 1
        assert stats["load_errors"] - clean["load_errors"] == 1  # that block, that rank only
        assert stats["blocks_verified"] - clean["blocks_verified"] == 2 * 4 - 1
        assert engine.stats()["failed_loads"] == 1
        # the block's keys on that rank (4 layers and its record) were removed, so the
        # recomputed block was stored again and the next load is clean
        assert stats["corrupt_keys_removed"] - clean["corrupt_keys_removed"] == 4 + 1
        healed = _load_again(engine, request, "digest-healed")
        assert healed.num_external_tokens == 4 * _BLOCK_TOKENS and healed.mismatched_bytes == 0
        assert _worker_stats(engine)["digest_mismatches"] == stats["digest_mismatches"]
        if guarded:  # every KV byte went through staging, digests taken on the device
            final = _worker_stats(engine)
            assert final["kv_staged"] == 2 and final["staged_get_bytes"] > 0
            for w in engine.workers:
                assert isinstance(w.connector, store_worker.MooncakeStoreWorker)
                assert w.connector.digests is not None
                assert w.connector.digests.algorithm == TORCH_ALGORITHM
        else:
            assert "kv_staged" not in _worker_stats(engine)
    finally:
        engine.shutdown()
    assert engine.idle_problems() == []


def test_verification_off_does_not_check(
        held_store: tuple[dict[str, Any], MooncakeStoreClient]) -> None:
    """The same fault with ``verify: off``: no record is put or fetched, nothing is
    checked, and the wrong bytes reach the engine (whose reference check is what catches
    them here)."""
    extra, client = held_store
    _scratch_registered(client)
    (request,) = make_requests(1, prompt_tokens=3 * _BLOCK_TOKENS + 3, max_tokens=1, seed=43,
                               prefix="digest-off")
    hashes = hash_blocks(request.prompt, _BLOCK_TOKENS)
    engine = _both({**extra, "verify": "off", "load_async": False})
    try:
        engine.add_request(request)
        engine.run_until_done(timeout_s=60)
        ns = _namespace(0)
        _overwrite(client, store_key(ns, 1, hashes[1]), store_key(ns, 1, hashes[0]))
        engine.reset_prefix_cache()
        engine.add_request(replace(request, request_id="digest-off-again"))
        (result,) = engine.run_until_done(timeout_s=60)
        stats = _worker_stats(engine)
    finally:
        engine.shutdown()
    assert result.num_external_tokens == 3 * _BLOCK_TOKENS
    assert result.mismatched_bytes > 0
    assert stats["blocks_unchecked"] == stats["blocks_loaded"] == 2 * 3
    assert stats["blocks_verified"] == stats["digest_mismatches"] == stats["load_errors"] == 0
    assert stats["blocks_digested"] == 0  # a writer with verify off takes no digests


def test_sample_checks_the_chosen_blocks_only(
        held_store: tuple[dict[str, Any], MooncakeStoreClient]) -> None:
    """``verify: sample``: the deterministic choice of blocks is checked (a fault there is
    caught), the others are not (a fault there reaches the engine)."""
    extra, client = held_store
    _scratch_registered(client)
    fraction = 0.5
    (request,) = make_requests(1, prompt_tokens=8 * _BLOCK_TOKENS + 3, max_tokens=1, seed=47,
                               prefix="digest-sample")
    hashes = hash_blocks(request.prompt, _BLOCK_TOKENS)
    caught_id = "digest-sample-again"
    chosen = [i for i in range(8) if sample_selected(caught_id, 0, i, fraction)]
    skipped = [i for i in range(8) if i not in chosen]
    assert chosen and skipped, "pick another request id: the sample must split the blocks"
    engine = _both({**extra, "verify": "sample", "verify_sample": fraction})
    try:
        engine.add_request(request)
        engine.run_until_done(timeout_s=60)
        ns = _namespace(0)
        source = store_key(ns, 0, hashes[7 if chosen[0] != 7 else 6])
        _overwrite(client, store_key(ns, 0, hashes[chosen[0]]), source)
        result = _load_again(engine, request, caught_id)
        stats = _worker_stats(engine)
    finally:
        engine.shutdown()
    assert result.num_external_tokens == chosen[0] * _BLOCK_TOKENS
    assert result.mismatched_bytes == 0
    assert stats["digest_mismatches"] == 1
    # both ranks checked the same blocks
    assert stats["blocks_verified"] + stats["digest_mismatches"] == 2 * len(chosen)
    assert stats["blocks_unchecked"] == 2 * len(skipped)


def test_missing_record_is_served_unverified_or_failed(
        held_store: tuple[dict[str, Any], MooncakeStoreClient]) -> None:
    """A block stored without a digest record (as an older version stores it): loaded and
    counted unverified by default, a load error with ``verify_allow_unverified: false``."""
    extra, client = held_store
    (request,) = make_requests(1, prompt_tokens=3 * _BLOCK_TOKENS + 3, max_tokens=1, seed=53,
                               prefix="digest-missing")
    hashes = hash_blocks(request.prompt, _BLOCK_TOKENS)
    record = digest_key_prefix(_namespace(1)) + hashes[1].hex()
    for allow in (True, False):
        engine = _both({**extra, "verify_allow_unverified": allow})
        try:
            if allow:
                engine.add_request(request)
                engine.run_until_done(timeout_s=60)
            (gone,) = client.remove([record], force=True)
            # the second time still absent: a block loaded unverified is not stored again
            assert gone.ok if allow else gone.not_found, gone
            result = _load_again(engine, request, f"digest-missing-{allow}")
            stats = _worker_stats(engine)
        finally:
            engine.shutdown()
        assert stats["digests_missing"] == 1 and result.mismatched_bytes == 0
        if allow:
            assert result.num_external_tokens == 3 * _BLOCK_TOKENS
            assert stats["blocks_unverified"] == 1 and stats["load_errors"] == 0
            assert stats["blocks_verified"] == 2 * 3 - 1
        else:
            assert result.num_external_tokens == 1 * _BLOCK_TOKENS
            assert stats["blocks_unverified"] == 0 and stats["load_errors"] == 1
            assert stats["corrupt_keys_removed"] == 0  # a missing record is not corruption


def test_foreign_or_malformed_record_is_a_failed_load(
        held_store: tuple[dict[str, Any], MooncakeStoreClient]) -> None:
    """A record moved from another block (right size, wrong key) and a record replaced by a
    layer object's bytes (wrong size) both fail their blocks; neither is trusted."""
    extra, client = held_store
    _scratch_registered(client)
    (request,) = make_requests(1, prompt_tokens=3 * _BLOCK_TOKENS + 3, max_tokens=1, seed=59,
                               prefix="digest-foreign")
    hashes = hash_blocks(request.prompt, _BLOCK_TOKENS)
    engine = _both(extra)
    try:
        engine.add_request(request)
        engine.run_until_done(timeout_s=60)
        rank0, rank1 = (digest_key_prefix(_namespace(r)) for r in range(2))
        _overwrite(client, rank0 + hashes[1].hex(), rank0 + hashes[0].hex())
        malformed = rank1 + hashes[2].hex()
        (gone,) = client.remove([malformed], force=True)
        assert gone.ok, gone
        (size,) = [r.nbytes for r in client.batch_get_into(
            [store_key(_namespace(1), 0, hashes[2])], [_SCRATCH.data_ptr()],
            [_SCRATCH.numel()], exact_size=False)]
        (put,) = client.batch_put_from([malformed], [_SCRATCH.data_ptr()], [size])
        assert put.ok, put
        result = _load_again(engine, request, "digest-foreign-again")
        stats = _worker_stats(engine)
    finally:
        engine.shutdown()
    assert result.num_external_tokens == _BLOCK_TOKENS and result.mismatched_bytes == 0
    assert stats["digest_records_invalid"] == 2 and stats["digest_mismatches"] == 0
    assert stats["digest_records_foreign"] == 1   # the moved one; the other is malformed
    assert stats["load_errors"] == 2
    assert stats["corrupt_keys_removed"] == 2 * (4 + 1)


def _device_reader(engine: Engine, client: MooncakeStoreClient) -> list[Any]:
    """Give each worker of ``engine`` the digests a rank with KV in device memory has
    (no host view: ``torch-mix64-v1`` only), registered like the worker's own; returns
    the buffers to unregister and the tables replaced (alive until the engine's
    shutdown unregisters them)."""
    from kvbridge.connectors.mooncake_store.worker import MooncakeStoreWorker

    buffers: list[Any] = []
    for w in engine.workers:
        worker = w.connector
        assert isinstance(worker, MooncakeStoreWorker)
        digests = RankDigests(worker.plans, owner=w.caches, tensors=w.caches.layers,
                              on_host=False)
        assert digests.algorithms == (TORCH_ALGORITHM,)
        client.register_buffer(digests.buffer_ptr, digests.buffer.nbytes)
        buffers.append((digests.buffer_ptr, worker.digests))
        worker.digests = digests
    return buffers


def test_records_are_checked_with_the_algorithm_they_name(
        held_store: tuple[dict[str, Any], MooncakeStoreClient],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer taking ``torch-mix64-v1`` digests (as a rank with KV in device memory
    does) and a reader with the host default: the reader checks those records with
    ``torch-mix64-v1`` and catches an overwritten object. A reader that can take
    ``torch-mix64-v1`` only (KV in device memory) serves a host writer's XXH3-64
    records unverified, or fails them with ``verify_allow_unverified: false``."""
    host_engine_kv(monkeypatch)  # host writers (the device reader is made below)
    extra, client = held_store
    _scratch_registered(client)
    torch_req, host_req = make_requests(2, prompt_tokens=3 * _BLOCK_TOKENS + 3, max_tokens=1,
                                        seed=71, prefix="digest-algorithms")
    writer = _both({**extra, "verify_algorithm": TORCH_ALGORITHM})
    try:
        writer.add_request(torch_req)
        assert not check_outputs(writer.run_until_done(timeout_s=60), [torch_req])
    finally:
        writer.shutdown()
    reader = _both(extra)
    try:
        clean = _load_again(reader, torch_req, "digest-algorithms-clean")
        stats = _worker_stats(reader)
        assert clean.num_external_tokens == 3 * _BLOCK_TOKENS
        assert stats["blocks_verified"] == 2 * 3 and stats["digest_mismatches"] == 0
        hashes = hash_blocks(torch_req.prompt, _BLOCK_TOKENS)
        ns = _namespace(0)
        _overwrite(client, store_key(ns, 1, hashes[1]), store_key(ns, 1, hashes[0]))
        caught = _load_again(reader, torch_req, "digest-algorithms-caught")
        assert caught.num_external_tokens == 1 * _BLOCK_TOKENS and caught.mismatched_bytes == 0
        assert _worker_stats(reader)["digest_mismatches"] == 1
        reader.add_request(host_req)  # stored with XXH3-64 records (this engine's default)
        assert not check_outputs(reader.run_until_done(timeout_s=60), [host_req])
    finally:
        reader.shutdown()
    for allow in (True, False):
        device = _both({**extra, "verify_allow_unverified": allow})
        buffers = _device_reader(device, client)
        try:
            result = _load_again(device, host_req, f"digest-algorithms-device-{allow}")
            stats = _worker_stats(device)
        finally:
            device.shutdown()
            for ptr, _replaced in buffers:
                client.unregister_buffer(ptr)
        assert result.mismatched_bytes == 0 and stats["blocks_verified"] == 0
        if allow:
            assert result.num_external_tokens == 3 * _BLOCK_TOKENS
            assert stats["blocks_unverified"] == stats["digests_missing"] == 2 * 3
        else:
            assert result.num_external_tokens == 0 and stats["load_errors"] >= 1
            assert stats["blocks_unverified"] == 0


def test_kv_without_host_digests_is_stored_without_records_and_loaded_unverified(
        held_store: tuple[dict[str, Any], MooncakeStoreClient]) -> None:
    """A worker without digest tables puts no records and loads unverified, counted
    (here the workers' tables are dropped)."""
    from kvbridge.connectors.mooncake_store.worker import MooncakeStoreWorker

    extra, client = held_store
    (request,) = make_requests(1, prompt_tokens=2 * _BLOCK_TOKENS + 3, max_tokens=1, seed=61,
                               prefix="digest-device")
    hashes = hash_blocks(request.prompt, _BLOCK_TOKENS)
    engine = _both(extra)
    try:
        for w in engine.workers:
            assert isinstance(w.connector, MooncakeStoreWorker)
            assert w.connector.digests is not None  # host KV: digested
            w.connector.digests = None
        engine.add_request(request)
        engine.run_until_done(timeout_s=60)
        records = [digest_key_prefix(_namespace(r)) + h.hex() for r in range(2) for h in hashes]
        assert client.batch_exists(records) == [False] * len(records)
        result = _load_again(engine, request, "digest-device-again")
        stats = _worker_stats(engine)
    finally:
        engine.shutdown()
    assert result.num_external_tokens == 2 * _BLOCK_TOKENS and result.mismatched_bytes == 0
    assert stats["blocks_digested"] == stats["blocks_verified"] == 0
    assert stats["blocks_unverified"] == stats["digests_missing"] == 2 * 2
