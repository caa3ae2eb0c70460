"""Put/get round trips through a real mooncake_master, verified to the byte by the engine.

Each case runs a ``kv_both`` engine: round 1 computes and stores every block,
the local prefix cache is reset, round 2 (same prompts, new ids) must load
every stored block from the store; the connector checks every loaded block
against its digest record, and the engine checks every loaded byte against
the content function.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest

from kvbridge.connectors import ConnectorConfig, KVRole
from kvbridge.engine.core import Engine, EngineConfig
from kvbridge.engine.workload import check_outputs, make_requests
from kvbridge.events import BlockStored
from kvbridge.layouts import ParallelTopology, hash_blocks, load_spec
from tests.connectors.mooncake_store.conftest import run_again_from_store

TOPOLOGIES = {"tp2": ParallelTopology(tp_size=2),
              "tp2dcp2": ParallelTopology(tp_size=2, dcp_size=2),
              "pp2": ParallelTopology(pp_size=2)}


def both_engine(model: str, topology: ParallelTopology, extra: dict[str, Any],
                **config: Any) -> Engine:
    connector = ConnectorConfig("mooncake_store", KVRole.BOTH, extra=extra)
    return Engine(EngineConfig(load_spec(model), topology, num_blocks=96, connector=connector,
                               **config))


CASES = [pytest.param(model, topology, True, id=f"{model}-{topology}-async")
         for model in ("tiny-gqa", "tiny-mla", "tiny-hybrid") for topology in ("tp2", "tp2dcp2")]
# PP: every stage stores and loads its own layers; a hit needs every stage's keys
CASES.append(pytest.param("tiny-hybrid", "pp2", True, id="tiny-hybrid-pp2-async"))
CASES.append(pytest.param("tiny-hybrid", "tp2dcp2", False, id="tiny-hybrid-tp2dcp2-sync"))


@pytest.mark.parametrize(("model", "topology", "load_async"), CASES)
def test_store_then_load_verified(model: str, topology: str, load_async: bool,
                                  held_store: tuple[dict[str, Any], Any]) -> None:
    extra = {**held_store[0], "load_async": load_async}
    seed = zlib.crc32(f"{model}-{topology}-{load_async}".encode())
    requests = make_requests(3, prompt_tokens=100, shared_prefix_tokens=32, max_tokens=2,
                             seed=seed, prefix="rt")
    engine = both_engine(model, TOPOLOGIES[topology], extra)
    try:
        for spec in requests:
            engine.add_request(spec)
        first = engine.run_until_done(timeout_s=60)
        assert not check_outputs(first, requests)
        # one BlockStored per distinct block, once every rank (writers or not, every
        # pipeline stage) stored its part
        spec = load_spec(model)
        expected = {(r, h) for r, region in enumerate(spec.regions) for s in requests
                    for h in hash_blocks(s.prompt,
                                         region.tokens_per_key(TOPOLOGIES[topology].dcp_size))}
        stored = [(e.group_idx, e.block_hashes[0]) for e in engine.events
                  if isinstance(e, BlockStored)]
        assert len(stored) == len(set(stored)) and set(stored) == expected
        again, second = run_again_from_store(engine, requests)
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert not check_outputs(second, again)
    worker = stats["worker_stats"]
    assert isinstance(worker, dict)
    assert worker["put_failures"] == 0 and worker["load_errors"] == 0
    assert worker["blocks_saved"] > 0 and worker["get_bytes"] > 0
    # verify: full (store_extra): every block loaded was checked against its digest record
    assert worker["blocks_digested"] > 0
    assert worker["blocks_verified"] == worker["blocks_loaded"] > 0
    assert worker["blocks_unverified"] == worker["blocks_unchecked"] == 0
    assert worker["digest_mismatches"] == worker["digest_records_invalid"] == 0
    for result in second:
        # every full key but the one holding the last prompt token came from the store
        assert result.num_external_tokens > 0, result
        assert result.num_recomputed_tokens == 0
        assert result.verified_bytes > 0
        assert result.mismatched_bytes == 0
    assert engine.idle_problems() == []
