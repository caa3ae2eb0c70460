"""A block stored under another prompt's key is never served to this one (fs and obj tiers).

The offloading connector's store keys are the part's namespace plus the chained
block hash the engine computed from the request's own tokens, so the API gives
no way to name another prompt's block. These tests go under the API: they move
prompt B's stored block to the name prompt A's block has in the store (a file
rename in the fs tier's directory, Mooncake puts of B's objects under A's names
for the obj tier) and check that A's load refuses it, counts it, removes it, and
recomputes: the reference engine checks every loaded byte against A's own KV.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbridge.connectors import ConnectorConfig, KVRole
from kvbridge.connectors.offloading import OffloadingScheduler, build_part_table, pool_fingerprint
from kvbridge.engine.core import Engine, EngineConfig
from kvbridge.engine.request import RequestResult, RequestSpec
from kvbridge.engine.workload import check_outputs, make_requests
from kvbridge.layouts import ParallelTopology, hash_blocks, load_spec
from kvbridge.offload.fs_io import block_header_bytes, decode_block_header
from kvbridge.offload.fs_layout import FileMapper
from kvbridge.offload.obj import OBJECT_ROOT
from tests.conftest import require

MODEL = "tiny-gqa"
BLOCK_TOKENS = 16
PROMPT_BLOCKS = 4
MAX_STEPS = 400  # per run: a livelock would spin far beyond this
VICTIM = 2       # the block of A whose stored copy is replaced by B's


def _engine(**settings: Any) -> Engine:
    extra: dict[str, Any] = {"cpu_blocks": 64, "fs_o_direct": False, **settings}
    return Engine(EngineConfig(load_spec(MODEL), ParallelTopology(), num_blocks=128,
                               connector=ConnectorConfig("offloading", KVRole.BOTH,
                                                         extra=extra)))


def _run(engine: Engine, specs: list[RequestSpec]) -> list[RequestResult]:
    for spec in specs:
        engine.add_request(spec)
    steps = 0
    while engine.has_work():
        assert steps < MAX_STEPS, f"not done after {MAX_STEPS} steps: {engine.stats()}"
        if engine.step().num_scheduled == 0:
            time.sleep(0.001)  # only promotions or probes in flight
        steps += 1
    results = engine.pop_results()
    assert not check_outputs(results, specs), "an output differs from the reference"
    return results


def _stats(engine: Engine) -> dict[str, int | float]:
    scheduler = engine.scheduler_connector
    assert isinstance(scheduler, OffloadingScheduler)
    return scheduler.get_stats()


def _keys(spec: RequestSpec) -> list[bytes]:
    """The store keys of ``spec``'s full prompt blocks, from its own tokens only."""
    (part,) = build_part_table(load_spec(MODEL), ParallelTopology()).parts
    return [part.key(h) for h in hash_blocks(spec.prompt, BLOCK_TOKENS)]


def _fingerprint() -> str:
    (part,) = build_part_table(load_spec(MODEL), ParallelTopology()).parts
    return pool_fingerprint(load_spec(MODEL), part.block_bytes)


def _prompts(seed: int) -> tuple[RequestSpec, RequestSpec]:
    a, b = make_requests(2, prompt_tokens=PROMPT_BLOCKS * BLOCK_TOKENS, max_tokens=2,
                         seed=seed, prefix=f"prov-{seed}")
    assert a.prompt[:BLOCK_TOKENS] != b.prompt[:BLOCK_TOKENS]  # no block in common
    return a, b


def _again(spec: RequestSpec, tag: str) -> RequestSpec:
    return RequestSpec(f"{spec.request_id}-{tag}", spec.prompt, max_tokens=spec.max_tokens)


# ------------------------------------------------------------------------------- fs tier

@pytest.mark.parametrize("verify", ["full", "off"])
def test_fs_block_renamed_to_another_prompts_name_is_refused(tmp_path: Path,
                                                             verify: str) -> None:
    """B's block file renamed over A's: the header names B's key, so A's load refuses it
    (whatever ``verify`` says: the key check is not a digest check), removes it, counts it,
    and A recomputes from that block; the recomputed block is stored again under A's name."""
    a, b = _prompts(9031)
    with _engine(fs_dir=str(tmp_path), verify=verify) as first:
        _run(first, [a, b])
    mapper = FileMapper(str(tmp_path), _fingerprint())
    paths_a = [mapper.path(k) for k in _keys(a)]
    paths_b = [mapper.path(k) for k in _keys(b)]
    # the files are exactly the ones the prompts' own tokens name, and none is shared
    assert all(os.path.isfile(p) for p in paths_a + paths_b)
    assert not set(paths_a) & set(paths_b)
    os.replace(paths_b[VICTIM], paths_a[VICTIM])

    with _engine(fs_dir=str(tmp_path), verify=verify) as second:  # empty CPU tier
        (result,) = _run(second, [_again(a, "moved")])
        stats = _stats(second)
        engine_stats = second.stats()
    assert result.num_external_tokens == VICTIM * BLOCK_TOKENS  # blocks 0, 1 only
    assert stats["fs_foreign_key_loads"] == 1 and stats["fs_files_deleted"] == 1
    assert stats["fs_digest_mismatches"] == 0 and stats["promotions_failed"] >= 1
    # the reference engine checked every loaded byte against A's own KV
    assert engine_stats["mismatched_bytes"] == 0 and engine_stats["verified_bytes"] > 0
    # the recompute stored A's block again, under A's name, with A's key in its header
    layers = len(load_spec(MODEL).rank_shapes(ParallelTopology())[0].layer_ids)
    with open(paths_a[VICTIM], "rb") as f:
        header = decode_block_header(paths_a[VICTIM], f.read(block_header_bytes(layers)))
    assert header.key_hash == FileMapper.key_hash_bytes(_keys(a)[VICTIM])


def test_fs_bytes_of_another_prompt_under_this_header_fail_their_digests(
        tmp_path: Path) -> None:
    """B's bytes behind A's own header (a writer that put the wrong bytes under the right
    name): the layer digests in A's header refuse them; counted as a digest mismatch."""
    a, b = _prompts(9032)
    with _engine(fs_dir=str(tmp_path)) as first:   # the fs tier checks every block
        _run(first, [a, b])
    mapper = FileMapper(str(tmp_path), _fingerprint())
    path_a, path_b = (mapper.path(_keys(s)[VICTIM]) for s in (a, b))
    layers = len(load_spec(MODEL).rank_shapes(ParallelTopology())[0].layer_ids)
    hdr = block_header_bytes(layers)
    with open(path_a, "rb") as fa, open(path_b, "rb") as fb:
        forged = fa.read(hdr) + fb.read()[hdr:]
    with open(path_a + ".forged", "wb") as f:
        f.write(forged)
    os.replace(path_a + ".forged", path_a)

    with _engine(fs_dir=str(tmp_path)) as second:
        (result,) = _run(second, [_again(a, "forged")])
        stats = _stats(second)
        engine_stats = second.stats()
    assert result.num_external_tokens == VICTIM * BLOCK_TOKENS
    assert stats["fs_digest_mismatches"] == 1 and stats["fs_foreign_key_loads"] == 0
    assert stats["fs_files_deleted"] == 1
    assert engine_stats["mismatched_bytes"] == 0 and engine_stats["verified_bytes"] > 0


# ------------------------------------------------------------------------------ obj tier

def _get_object(client: Any, name: str) -> bytes:
    """The bytes of object ``name`` (at most 1 MiB: tiny-gqa blocks are KiBs)."""
    buf = np.zeros(1 << 20, dtype=np.uint8)
    ptr = int(buf.ctypes.data)
    client.register_buffer(ptr, buf.nbytes)
    try:
        (got,) = client.batch_get_into([name], [ptr], [buf.nbytes], exact_size=False)
        assert got.ok and got.nbytes > 0, (name, got)
        return buf[:got.nbytes].tobytes()
    finally:
        client.unregister_buffer(ptr)


def _put_object(client: Any, name: str, data: bytes) -> None:
    """Replace object ``name`` by ``data`` (Mooncake puts never overwrite: remove first)."""
    client.remove([name], force=True)
    buf = np.frombuffer(bytearray(data), dtype=np.uint8)
    ptr = int(buf.ctypes.data)
    client.register_buffer(ptr, len(data))
    try:
        (put,) = client.batch_put_from([name], [ptr], [len(data)])
        assert put.ok, (name, put)
    finally:
        client.unregister_buffer(ptr)


@pytest.mark.parametrize("moved", ["block-and-digests", "block-only"])
def test_obj_objects_copied_to_another_prompts_names_are_refused(mooncake_master: Any,
                                                                 moved: str) -> None:
    """``block-and-digests``: B's block object and its digest object put under A's names;
    the digest object names B's key: refused (``foreign_key_loads``), checked for every
    block under the default ``sample`` policy. ``block-only``: B's bytes beside A's digest
    object: refused by the digests (``verify: full`` here, so this block is checked)."""
    require("mooncake.store")
    from kvbridge.backends.mooncake import MooncakeConfig, MooncakeStoreClient

    obj = {"master_address": mooncake_master.rpc_address,
           "metadata_server": mooncake_master.metadata_url,
           "global_segment_size": 0, "local_buffer_size": 16 << 20}
    verify = {"verify": "full"} if moved == "block-only" else {}
    # the objects live in the segment of a client that outlives both engines (a store node)
    holder = MooncakeStoreClient.connect(MooncakeConfig(
        mooncake_master.rpc_address, mooncake_master.metadata_url,
        global_segment_size=64 << 20, local_buffer_size=0))
    with holder:
        a, b = _prompts(9033 if moved == "block-only" else 9034)  # keys no other test stores (the master is shared)
        with _engine(obj=obj, **verify) as first:
            _run(first, [a, b])
        prefix = f"{OBJECT_ROOT}{_fingerprint()}/"
        names_a, names_b = ([prefix + FileMapper.key_hash(k) for k in _keys(s)]
                            for s in (a, b))
        # the objects are exactly the ones the prompts' own tokens name, none shared
        assert all(holder.batch_exists(names_a + names_b))
        assert not set(names_a) & set(names_b)
        _put_object(holder, names_a[VICTIM], _get_object(holder, names_b[VICTIM]))
        if moved == "block-and-digests":
            _put_object(holder, names_a[VICTIM] + ".dg",
                        _get_object(holder, names_b[VICTIM] + ".dg"))
        with _engine(obj=obj, **verify) as second:
            (result,) = _run(second, [_again(a, "moved")])
            stats = _stats(second)
            engine_stats = second.stats()
        # both objects were removed; the recompute stored A's block again under its names
        restored = decode_block_header("dg", _get_object(holder, names_a[VICTIM] + ".dg"))
    assert result.num_external_tokens == VICTIM * BLOCK_TOKENS
    assert stats["obj_files_deleted"] == 1 and stats["promotions_failed"] >= 1
    if moved == "block-and-digests":
        assert stats["obj_foreign_key_loads"] == 1 and stats["obj_digest_mismatches"] == 0
    else:
        assert stats["obj_digest_mismatches"] == 1 and stats["obj_foreign_key_loads"] == 0
    assert engine_stats["mismatched_bytes"] == 0 and engine_stats["verified_bytes"] > 0
    assert restored.key_hash == FileMapper.key_hash_bytes(_keys(a)[VICTIM])
