"""A block stored under another prompt's keys is never served to this one (Mooncake store).

The connector's keys are namespaces plus the chained block hashes the engine
computed from the request's own tokens, so no request can name another
prompt's block through the API. These tests go under the API, into the real
store: they put prompt B's stored objects (its layer objects, and its digest
record) under the keys prompt A's block has, and check that A's load refuses
them, counts why, removes the keys, and recomputes: the reference engine checks
every loaded byte against A's own KV, and the next run loads A's block again.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from kvbridge.backends.mooncake import MooncakeStoreClient
from kvbridge.connectors import ConnectorConfig, KVRole
from kvbridge.connectors.mooncake_store.keys import RegionLookup, region_lookups
from kvbridge.engine.core import Engine, EngineConfig
from kvbridge.engine.request import RequestResult, RequestSpec
from kvbridge.engine.workload import check_outputs, make_requests
from kvbridge.layouts import BlockHash, ParallelTopology, hash_blocks, load_spec

MODEL = "tiny-gqa"
BLOCK_TOKENS = 16
PROMPT_BLOCKS = 4
TOPOLOGY = ParallelTopology(tp_size=2)   # two namespaces: each rank's heads of a block
VICTIM = 2                               # the block of A whose objects are replaced by B's


def _engine(extra: dict[str, Any]) -> Engine:
    return Engine(EngineConfig(load_spec(MODEL), TOPOLOGY, num_blocks=96,
                               connector=ConnectorConfig("mooncake_store", KVRole.BOTH,
                                                         extra=extra)))


def _lookup() -> RegionLookup:
    (lookup,) = region_lookups(load_spec(MODEL), TOPOLOGY)
    return lookup


def _layer_keys(block_hash: BlockHash) -> list[str]:
    return _lookup().keys([block_hash])


def _record_keys(block_hash: BlockHash) -> list[str]:
    return [p + block_hash.hex() for p in _lookup().record_prefixes]


def _all_keys(spec: RequestSpec) -> list[str]:
    """Every key of ``spec``'s full prompt blocks, derived from its own tokens only."""
    return [k for h in hash_blocks(spec.prompt, BLOCK_TOKENS)
            for k in _layer_keys(h) + _record_keys(h)]


def _get_object(client: MooncakeStoreClient, name: str) -> bytes:
    buf = np.zeros(1 << 20, dtype=np.uint8)   # tiny-gqa's objects are KiBs
    ptr = int(buf.ctypes.data)
    client.register_buffer(ptr, buf.nbytes)
    try:
        (got,) = client.batch_get_into([name], [ptr], [buf.nbytes], exact_size=False)
        assert got.ok and got.nbytes > 0, (name, got)
        return buf[:got.nbytes].tobytes()
    finally:
        client.unregister_buffer(ptr)


def _put_object(client: MooncakeStoreClient, name: str, data: bytes) -> None:
    """Replace object ``name`` by ``data`` (a put keeps an existing key: remove first)."""
    client.remove([name], force=True)
    buf = np.frombuffer(bytearray(data), dtype=np.uint8)
    ptr = int(buf.ctypes.data)
    client.register_buffer(ptr, len(data))
    try:
        (put,) = client.batch_put_from([name], [ptr], [len(data)])
        assert put.ok, (name, put)
    finally:
        client.unregister_buffer(ptr)


def _run(engine: Engine, spec: RequestSpec, tag: str, *,
         check: bool = True) -> RequestResult:
    engine.reset_prefix_cache()   # the KV must come back from the store
    again = replace(spec, request_id=f"{spec.request_id}-{tag}")
    engine.add_request(again)
    (result,) = engine.run_until_done(timeout_s=60)
    if check:
        assert not check_outputs([result], [again]), "output differs from the reference"
    return result


def _worker_stats(engine: Engine) -> dict[str, Any]:
    stats = engine.stats()["worker_stats"]
    assert isinstance(stats, dict)
    return stats


def _delta(after: dict[str, Any], before: dict[str, Any], name: str) -> int:
    return int(after[name] - before[name])


@pytest.mark.parametrize("moved", ["layers-and-record", "layers-only", "record-removed"])
def test_another_prompts_objects_under_this_prompts_keys_are_refused(
        held_store: tuple[dict[str, Any], MooncakeStoreClient], moved: str) -> None:
    """On both ranks, block ``VICTIM`` of prompt A gets prompt B's bytes:

    ``layers-and-record``: B's layer objects and B's digest record under A's keys; the
    record names B's key: refused as a record of another key (``digest_records_foreign``).
    ``layers-only``: B's layer objects beside A's own record: refused by its digests.
    ``record-removed``: B's layer objects and no record, with ``verify_allow_unverified``
    false: refused as unverifiable (its negative control is the test below).
    """
    extra, client = held_store
    seed = {"layers-and-record": 9071, "layers-only": 9072, "record-removed": 9073}[moved]
    a, b = make_requests(2, prompt_tokens=PROMPT_BLOCKS * BLOCK_TOKENS + 3, max_tokens=2,
                         seed=seed, prefix=f"prov-{moved}")
    if moved == "record-removed":
        extra = {**extra, "verify_allow_unverified": False}
    hash_a = hash_blocks(a.prompt, BLOCK_TOKENS)[VICTIM]
    hash_b = hash_blocks(b.prompt, BLOCK_TOKENS)[VICTIM]
    engine = _engine(extra)
    try:
        for spec in (a, b):
            engine.add_request(spec)
        assert not check_outputs(engine.run_until_done(timeout_s=60), [a, b])
        # every key is the one the prompt's own tokens name, and the two share none
        keys_a, keys_b = _all_keys(a), _all_keys(b)
        assert all(client.batch_exists(keys_a + keys_b))
        assert not set(keys_a) & set(keys_b)

        for source, target in zip(_layer_keys(hash_b), _layer_keys(hash_a), strict=True):
            _put_object(client, target, _get_object(client, source))
        for source, target in zip(_record_keys(hash_b), _record_keys(hash_a), strict=True):
            if moved == "layers-and-record":
                _put_object(client, target, _get_object(client, source))
            elif moved == "record-removed":
                (gone,) = client.remove([target], force=True)
                assert gone.ok, gone
        before = _worker_stats(engine)
        result = _run(engine, a, "moved")
        after = _worker_stats(engine)
        later = [_run(engine, a, f"later-{n}") for n in range(2)]
    finally:
        engine.shutdown()
    ranks = TOPOLOGY.tp_size
    # blocks before the victim stay loaded; the victim and what follows are recomputed
    assert result.num_external_tokens == VICTIM * BLOCK_TOKENS
    assert result.mismatched_bytes == 0 and result.verified_bytes > 0  # only A's bytes
    assert _delta(after, before, "load_errors") == ranks
    foreign = _delta(after, before, "digest_records_foreign")
    mismatches = _delta(after, before, "digest_mismatches")
    missing = _delta(after, before, "digests_missing")
    if moved == "layers-and-record":
        assert (foreign, mismatches, missing) == (ranks, 0, 0)
        assert _delta(after, before, "digest_records_invalid") == ranks
    elif moved == "layers-only":
        assert (foreign, mismatches, missing) == (0, ranks, 0)
    else:
        assert (foreign, mismatches, missing) == (0, 0, ranks)
    if moved != "record-removed":   # provably wrong: every key of the block is removed
        assert _delta(after, before, "corrupt_keys_removed") == ranks * (
            len(_layer_keys(hash_a)) // ranks + 1)
    assert all(r.mismatched_bytes == 0 for r in later)
    if moved == "record-removed":
        # a missing record proves nothing, so the keys stayed; the recompute's put kept B's
        # layer objects (a put keeps an existing key) and put A's record beside them: the
        # next load's digests refuse them and remove the keys, and the run after it loads
        assert [r.num_external_tokens for r in later] == [VICTIM * BLOCK_TOKENS,
                                                          PROMPT_BLOCKS * BLOCK_TOKENS]
    else:   # the recompute stored A's own block again: the next runs load every full block
        assert [r.num_external_tokens for r in later] == [PROMPT_BLOCKS * BLOCK_TOKENS] * 2


def test_without_a_record_a_moved_block_is_served_when_unverified_loads_are_allowed(
        held_store: tuple[dict[str, Any], MooncakeStoreClient]) -> None:
    """The limit of the promise, and the control of ``record-removed`` above: layer objects
    carry no key, so B's bytes under A's keys with no record beside them are what an older
    writer's block looks like; under ``verify_allow_unverified`` true (the default) they are
    loaded, counted unverified, and the reference engine sees the wrong bytes."""
    extra, client = held_store
    a, b = make_requests(2, prompt_tokens=PROMPT_BLOCKS * BLOCK_TOKENS + 3, max_tokens=2,
                         seed=9074, prefix="prov-unverified")
    hash_a = hash_blocks(a.prompt, BLOCK_TOKENS)[VICTIM]
    hash_b = hash_blocks(b.prompt, BLOCK_TOKENS)[VICTIM]
    engine = _engine(extra)
    try:
        for spec in (a, b):
            engine.add_request(spec)
        assert not check_outputs(engine.run_until_done(timeout_s=60), [a, b])
        for source, target in zip(_layer_keys(hash_b), _layer_keys(hash_a), strict=True):
            _put_object(client, target, _get_object(client, source))
        client.remove(_record_keys(hash_a), force=True)
        before = _worker_stats(engine)
        result = _run(engine, a, "unverified", check=False)
        after = _worker_stats(engine)
    finally:
        engine.shutdown()
    assert result.num_external_tokens == PROMPT_BLOCKS * BLOCK_TOKENS
    assert _delta(after, before, "blocks_unverified") == TOPOLOGY.tp_size
    assert result.mismatched_bytes > 0
