"""Cross-instance reuse, the every-namespace hit rule, and KV events, on a real mooncake_master."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvbridge.backends.mooncake import MooncakeStoreClient
from kvbridge.connectors import ConnectorConfig, KVRole
from kvbridge.connectors.mooncake_store import MooncakeStoreScheduler, store_key
from kvbridge.connectors.mooncake_store.records import digest_key_prefix
from kvbridge.engine.core import Engine, EngineConfig
from kvbridge.engine.workload import check_outputs, make_requests, run_workload
from kvbridge.events import BlockRemoved, BlockStored
from kvbridge.layouts import ParallelTopology, hash_blocks, load_spec, namespace_for


def engine(model: str, topology: ParallelTopology, role: KVRole, extra: dict[str, Any],
           engine_id: str | None = None) -> Engine:
    connector = ConnectorConfig("mooncake_store", role, extra=extra,
                                **({"engine_id": engine_id} if engine_id else {}))
    return Engine(EngineConfig(load_spec(model), topology, num_blocks=96, connector=connector))


def test_instance_b_hits_what_instance_a_stored(held_store: tuple[dict[str, Any], Any]) -> None:
    """Two engines with their own store clients (client_scope=engine): B loads A's blocks."""
    extra = {**held_store[0], "client_scope": "engine"}
    topology = ParallelTopology(tp_size=2)
    requests = make_requests(3, prompt_tokens=90, max_tokens=2, seed=7, prefix="xinst")
    a = engine("tiny-hybrid", topology, KVRole.PRODUCER, extra)
    b = engine("tiny-hybrid", topology, KVRole.CONSUMER, extra)
    try:
        stored = run_workload(requests, engine=a, shutdown=False)
        assert stored.failed_requests == 0
        assert stored.engine_stats["worker_stats"]["blocks_saved"] > 0  # type: ignore[index]
        loaded = run_workload(requests, engine=b, shutdown=False)
        b_stats = b.stats()
    finally:
        b.shutdown()
        a.shutdown()
    assert loaded.failed_requests == 0 and loaded.mismatched_bytes == 0
    assert all(r.num_external_tokens > 0 for r in loaded.results)
    assert loaded.verified_bytes > 0
    worker = b_stats["worker_stats"]
    assert isinstance(worker, dict) and worker["get_bytes"] > 0 and worker["put_keys"] == 0


def _external(eng: Engine, prompt: tuple[int, ...], request_id: str) -> int:
    from kvbridge.engine.request import RequestSpec

    eng.reset_prefix_cache()
    eng.add_request(RequestSpec(request_id, prompt, max_tokens=1))
    (result,) = eng.run_until_done(timeout_s=60)
    assert result.mismatched_bytes == 0
    assert not check_outputs([result], [RequestSpec(request_id, prompt, max_tokens=1)])
    return result.num_external_tokens


def test_missing_dcp_rank_namespace_is_a_miss(
        held_store: tuple[dict[str, Any], MooncakeStoreClient]) -> None:
    """Under DCP 2 a block is a hit only if DCP rank 1's part exists too."""
    extra, client = held_store
    spec = load_spec("tiny-gqa")
    topology = ParallelTopology(tp_size=2, dcp_size=2)
    (spec_req,) = make_requests(1, prompt_tokens=4 * 32 + 5, max_tokens=1, seed=11, prefix="dcp")
    hashes = hash_blocks(spec_req.prompt, 32)
    assert len(hashes) == 4
    dcp1 = namespace_for(spec, "attn", topology.with_rank(tp_rank=1))
    assert dcp1.dcp_rank == 1
    eng = engine("tiny-gqa", topology, KVRole.BOTH, extra)
    try:
        assert _external(eng, spec_req.prompt, "dcp-store") == 0  # first time: computed, stored
        assert _external(eng, spec_req.prompt, "dcp-all") == 4 * 32
        # drop one layer of DCP rank 1's part of block 2: blocks 0 and 1 still hit
        (gone,) = client.remove([store_key(dcp1, 3, hashes[2])], force=True)
        assert gone.ok
        assert _external(eng, spec_req.prompt, "dcp-partial") == 2 * 32
        # (that run recomputed and stored block 2 again); now break block 0
        (gone,) = client.remove([store_key(dcp1, 0, hashes[0])], force=True)
        assert gone.ok
        assert _external(eng, spec_req.prompt, "dcp-none") == 0
    finally:
        eng.shutdown()


def test_stored_and_removed_events(held_store: tuple[dict[str, Any],
                                                     MooncakeStoreClient]) -> None:
    extra, client = held_store
    spec = load_spec("tiny-gqa")
    topology = ParallelTopology(tp_size=2)
    (req,) = make_requests(1, prompt_tokens=3 * 16 + 3, max_tokens=1, seed=23, prefix="ev")
    hashes = hash_blocks(req.prompt, 16)
    eng = engine("tiny-gqa", topology, KVRole.BOTH, extra)
    try:
        eng.add_request(req)
        eng.run_until_done(timeout_s=60)
        stored = [e for e in eng.events if isinstance(e, BlockStored)]
        assert [e.block_hashes[0] for e in stored] == hashes
        assert all(e.medium == "STORAGE" and e.locality == "REMOTE" and e.group_idx == 0
                   and e.block_size == 16 for e in stored)
        assert stored[1].parent_block_hash == hashes[0]
        assert stored[2].token_ids == req.prompt[32:48]
        eng.events.clear()
        # a block lost behind the connector's back shows up as removed at the next lookup
        for tp_rank in range(2):
            ns = namespace_for(spec, "attn", topology.with_rank(tp_rank=tp_rank))
            client.remove([store_key(ns, layer, hashes[1]) for layer in range(4)], force=True)
        assert _external(eng, req.prompt, "ev-again") == 16
        removed = [e for e in eng.events if isinstance(e, BlockRemoved)]
        assert [e.block_hashes for e in removed] == [(hashes[1],)]
        assert removed[0].medium == "STORAGE" and removed[0].locality == "REMOTE"
        eng.events.clear()
        # explicit removal through the connector
        scheduler = eng.scheduler_connector
        assert isinstance(scheduler, MooncakeStoreScheduler)
        # two TP namespaces x (four layer objects + one digest record)
        assert scheduler.remove_blocks({0: [hashes[2]]}) == 2 * (4 + 1)
        events = scheduler.take_events()
        assert events == [BlockRemoved(block_hashes=(hashes[2],), medium="STORAGE",
                                       group_idx=0, locality="REMOTE")]
        records = [digest_key_prefix(namespace_for(spec, "attn", topology.with_rank(
            tp_rank=tp_rank))) + hashes[2].hex() for tp_rank in range(2)]
        assert client.batch_exists(records) == [False, False]
        assert _external(eng, req.prompt, "ev-third") == 2 * 16
    finally:
        eng.shutdown()
    assert eng.stats()["worker_stats"]["put_failures"] == 0  # type: ignore[index]


def test_partial_block_behind_a_last_layer_lookup_is_a_load_error(
        held_store: tuple[dict[str, Any], MooncakeStoreClient]) -> None:
    """``lookup_every_layer: false`` checks one key per namespace: a block missing another
    layer passes the lookup, fails at load time, and is recomputed (never wrong bytes)."""
    extra, client = held_store
    spec = load_spec("tiny-gqa")
    topology = ParallelTopology()
    (req,) = make_requests(1, prompt_tokens=3 * 16 + 3, max_tokens=1, seed=29, prefix="part")
    hashes = hash_blocks(req.prompt, 16)
    eng = engine("tiny-gqa", topology, KVRole.BOTH, {**extra, "lookup_every_layer": False})
    try:
        eng.add_request(req)
        eng.run_until_done(timeout_s=60)
        ns = namespace_for(spec, "attn", topology)
        (gone,) = client.remove([store_key(ns, 0, hashes[1])], force=True)
        assert gone.ok
        eng.reset_prefix_cache()
        again = replace(req, request_id="part-again")
        eng.add_request(again)
        (result,) = eng.run_until_done(timeout_s=60)
        stats = eng.stats()
    finally:
        eng.shutdown()
    assert not check_outputs([result], [again])
    assert result.num_external_tokens == 16      # block 0 loaded and verified
    assert result.num_recomputed_tokens == 2 * 16  # blocks 1 and 2 recomputed
    assert result.mismatched_bytes == 0 and result.verified_bytes > 0
    assert stats["failed_loads"] == 1
    worker = stats["worker_stats"]
    assert isinstance(worker, dict) and worker["load_not_found"] == 1
