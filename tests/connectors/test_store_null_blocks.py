"""The store connectors (offloading, Mooncake store) never copy into nor out of the
engine's null block (``ConnectorContext.null_block_id``: vLLM's block id 0, named
where a request holds no block, as a sliding window's dropped prefix).

Measured on real vLLM (hybrid model, window 64, blocks of 32): a request loading
128 external tokens gets the null block at the first two sliding-window positions
(65 tokens its window will not attend). Both connectors loaded into it: two
blocks into one, which the Mooncake store's digest check of the block that
landed first refused, so vLLM recomputed the prompt (a store of the null
block's bytes under a block's key would poison every later request attending
that block). ``tests/integrations/vllm/test_store_null_blocks.py`` runs it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvbridge.connectors import ConnectorConfig, ConnectorContext, ConnectorRequest, KVRole
from kvbridge.connectors.mooncake_store.plugin import MooncakeStorePlugin
from kvbridge.connectors.mooncake_store.scheduler import MooncakeStoreScheduler
from kvbridge.connectors.offloading.plugin import OffloadingPlugin
from kvbridge.connectors.offloading.scheduler import OffloadingScheduler, OffloadMetadata
from kvbridge.connectors.outputs import ConnectorOutput
from kvbridge.connectors.step import ScheduledRequest, SchedulerStep
from kvbridge.layouts import ParallelTopology, hash_blocks, load_spec

MODEL = "tiny-hybrid"  # two regions, blocks of 16 tokens
NULL = 0
PROMPT = tuple(range(7, 157))  # 150 tokens: 9 full blocks per region
FULL = len(PROMPT) // 16


def _ctx(name: str, extra: dict[str, object], parsed: object,
         null_block_id: int | None = NULL) -> ConnectorContext:
    spec = load_spec(MODEL)
    return ConnectorContext(spec=spec, topology=ParallelTopology(),
                            config=ConnectorConfig(name, KVRole.BOTH, extra=extra),
                            num_blocks=tuple(64 for _ in spec.regions), extra=parsed,
                            null_block_id=null_block_id)


def _request(rid: str, num_computed: int = 0) -> ConnectorRequest:
    hashes = tuple(tuple(hash_blocks(PROMPT, 16)) for _ in range(2))
    return ConnectorRequest(rid, PROMPT, len(PROMPT), hashes, num_computed_tokens=num_computed)


def _ids(base: int, nulls: int) -> tuple[tuple[int, ...], ...]:
    """Per region the request's blocks; region 0 (the sliding window's) names the null
    block at its first ``nulls`` positions."""
    n = -(-len(PROMPT) // 16)
    return (tuple(NULL if i < nulls else base + i for i in range(n)),
            tuple(base + 20 + i for i in range(n)))


def _step(rid: str, ids: tuple[tuple[int, ...], ...], computed: int, scheduled: int,
          ) -> SchedulerStep:
    item = ScheduledRequest(_request(rid, computed), ids, computed, scheduled, is_new=True)
    return SchedulerStep(step_id=1, scheduled=(item,))


@pytest.fixture
def offloading() -> Iterator[OffloadingScheduler]:
    extra: dict[str, object] = {"cpu_blocks": 64}
    sched = OffloadingPlugin.create_scheduler(
        _ctx("offloading", extra, OffloadingPlugin.parse_extra(extra)))
    assert isinstance(sched, OffloadingScheduler)
    yield sched
    sched.shutdown()


@pytest.fixture
def mooncake() -> Iterator[MooncakeStoreScheduler]:
    # never connects: storing and loading plans need no store (lookups would)
    extra: dict[str, object] = {"master_address": "127.0.0.1:9",
                                "metadata_server": "http://127.0.0.1:9/metadata"}
    sched = MooncakeStorePlugin.create_scheduler(
        _ctx("mooncake_store", extra, MooncakeStorePlugin.parse_extra(extra)))
    assert isinstance(sched, MooncakeStoreScheduler)
    yield sched
    sched.shutdown()


def _offload_stored(sched: OffloadingScheduler, ids: tuple[tuple[int, ...], ...]) -> OffloadMetadata:
    meta = sched.build_connector_meta(_step("w", ids, 0, len(PROMPT)))
    sched.update_connector_output(ConnectorOutput())
    return meta


def test_offloading_never_stores_the_null_block(offloading: OffloadingScheduler) -> None:
    meta = _offload_stored(offloading, _ids(10, nulls=2))
    stored = {(r, b) for _, r, b, _, _ in meta.stores}
    assert (0, NULL) not in stored
    assert stored == {(0, 10 + i) for i in range(2, FULL)} | {(1, 30 + i) for i in range(FULL)}
    # the two positions are not in the store: a lookup of the prompt finds no block of
    # region 0 (its chain starts with them), so nothing is loaded
    assert offloading.get_num_new_matched_tokens(_request("r"), 0) == (0, False)


def test_offloading_never_loads_into_the_null_block(offloading: OffloadingScheduler) -> None:
    _offload_stored(offloading, _ids(10, nulls=0))
    request = _request("r")
    matched, _ = offloading.get_num_new_matched_tokens(request, 0)
    assert matched == FULL * 16
    offloading.update_state_after_alloc(request, _ids(40, nulls=2), matched)
    meta = offloading.build_connector_meta(SchedulerStep(step_id=2, scheduled=()))
    loads = {(r, b) for _, r, b, _, _ in meta.loads["r"]}
    assert loads == {(0, 40 + i) for i in range(2, FULL)} | {(1, 60 + i) for i in range(FULL)}
    offloading.update_connector_output(ConnectorOutput())
    stats = offloading.get_stats()
    # counted as copied: the blocks really copied, not the two null positions
    assert stats["load_blocks"] == stats["hit_blocks"] == 2 * FULL - 2


def test_offloading_without_a_null_block_id_copies_every_block() -> None:
    extra: dict[str, object] = {"cpu_blocks": 64}
    sched = OffloadingPlugin.create_scheduler(
        _ctx("offloading", extra, OffloadingPlugin.parse_extra(extra), null_block_id=None))
    assert isinstance(sched, OffloadingScheduler)
    try:  # kvbridge's own engine: block 0 is a block like any other
        meta = _offload_stored(sched, _ids(10, nulls=2))
        assert sum(1 for _, r, b, _, _ in meta.stores if (r, b) == (0, 0)) == 2
    finally:
        sched.shutdown()


def test_mooncake_store_never_saves_the_null_block(mooncake: MooncakeStoreScheduler) -> None:
    meta = mooncake.build_connector_meta(_step("w", _ids(10, nulls=2), 0, len(PROMPT)))
    saved = {(s.region_index, s.block_id) for s in meta.saves}
    assert saved == {(0, 10 + i) for i in range(2, FULL)} | {(1, 30 + i) for i in range(FULL)}
    assert mooncake.get_stats()["save_blocks"] == 2 * FULL - 2


def test_mooncake_store_never_loads_into_the_null_block(mooncake: MooncakeStoreScheduler) -> None:
    request = _request("r")
    mooncake.update_state_after_alloc(request, _ids(40, nulls=2), FULL * 16)
    meta = mooncake.build_connector_meta(SchedulerStep(step_id=1, scheduled=()))
    loads = [(b.region_index, b.block_id) for b in meta.loads["r"]]
    assert loads == [(0, 40 + i) for i in range(2, FULL)] + [(1, 60 + i) for i in range(FULL)]
    assert mooncake.get_stats()["load_blocks"] == 2 * FULL - 2
