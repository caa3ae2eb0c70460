"""The reference engine publishes its KV events: block pool (GPU), connectors, once per step.

Real ZMQ publisher and subscriber on 127.0.0.1; a subscriber that applies the
stream must end with exactly the engine's cached blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvbridge.connectors import (
    BlockIds,
    ConnectorConfig,
    ConnectorContext,
    ConnectorMetadata,
    ConnectorOutput,
    ConnectorPlugin,
    ConnectorRequest,
    KVCaches,
    KVRole,
    OutputAggregator,
    SchedulerConnector,
    SchedulerStep,
    TransferParams,
    WorkerConnector,
    WorkerOutput,
    registry,
)
from kvbridge.engine import Engine, EngineConfig, RequestSpec, make_requests
from kvbridge.engine.kv_events import EngineEventsConfig
from kvbridge.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CollectingEventSink,
    GapLost,
    KVEvent,
    KVEventSubscriber,
    ReceivedBatch,
    SubscriberConfig,
)
from kvbridge.layouts import ParallelTopology, hash_blocks, load_spec

LOCAL_ANY = "tcp://127.0.0.1:*"


def _receive_all(sub: KVEventSubscriber, next_seq: int, timeout_s: float = 10.0,
                 ) -> list[tuple[int, tuple[KVEvent, ...]]]:
    """Batches ``[0, next_seq)`` in order (bounded); fails on a lost batch."""
    out: list[tuple[int, tuple[KVEvent, ...]]] = []
    for item in sub.items(idle_timeout_s=timeout_s):
        assert not isinstance(item, GapLost), item
        if isinstance(item, ReceivedBatch):
            out.append((item.seq, item.batch.events))
            if item.seq + 1 >= next_seq:
                break
    assert [seq for seq, _ in out] == list(range(next_seq))
    return out


class _Index:
    """What a router builds from the stream: per (medium, group) the resident hashes."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[str | None, int | None], set[Any]] = {}
        self.stored: list[BlockStored] = []

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self.stored.append(event)
            present = self.blocks.setdefault((event.medium, event.group_idx), set())
            new = set(event.block_hashes)
            assert not new & present, "stored twice without a removal in between"
            present |= new
        elif isinstance(event, BlockRemoved):
            present = self.blocks.setdefault((event.medium, event.group_idx), set())
            gone = set(event.block_hashes)
            assert gone <= present, "removed a block never announced"
            present -= gone
        else:
            assert isinstance(event, AllBlocksCleared)
            for key in [k for k in self.blocks if k[0] == "GPU"]:
                del self.blocks[key]


def _run(engine: Engine, specs: list[RequestSpec]) -> None:
    for spec in specs:
        engine.add_request(spec)
    engine.run_until_done(timeout_s=60)


def test_block_pool_events_reach_a_live_subscriber() -> None:
    spec = load_spec("tiny-gqa")
    events = EngineEventsConfig(LOCAL_ANY, LOCAL_ANY)
    # 6 blocks of 16 tokens: the second round evicts the first round's cached blocks
    engine = Engine(EngineConfig(spec, num_blocks=6, max_num_seqs=1), events=events)
    try:
        assert engine.publisher is not None and engine.config.enable_kv_cache_events
        sub = KVEventSubscriber(SubscriberConfig(engine.publisher.endpoint,
                                                 engine.publisher.replay_endpoint, start_seq=0))
        try:
            first = make_requests(2, prompt_tokens=40, max_tokens=2, seed=1, prefix="a")
            _run(engine, first)
            cached_after_first = engine.pools[0].cached_hashes()
            second = make_requests(2, prompt_tokens=70, max_tokens=1, seed=2, prefix="b")
            _run(engine, second)
            cached_before_reset = engine.pools[0].cached_hashes()
            assert engine.reset_prefix_cache() == len(cached_before_reset)
            batches = _receive_all(sub, engine.publisher.stats.next_seq)
        finally:
            sub.close()
    finally:
        engine.shutdown()
    index = _Index()
    seen_all_cached_before_reset = False
    for _, batch in batches:
        for event in batch:
            index.apply(event)
        if index.blocks.get(("GPU", 0)) == cached_before_reset:
            seen_all_cached_before_reset = True
    assert seen_all_cached_before_reset  # the stream tracked the pool exactly
    assert isinstance(batches[-1][1][-1], AllBlocksCleared) and ("GPU", 0) not in index.blocks
    # every stored event is self-describing: hashes chain, token ids and sizes match
    requests = {s.request_id: s for s in first + second}
    by_hash: dict[Any, tuple[Any, tuple[int, ...]]] = {}
    for spec_ in requests.values():
        # the engine caches blocks of prompt + generated tokens; the prompt's are enough here
        hashes = hash_blocks(spec_.prompt, 16)
        for i, h in enumerate(hashes):
            by_hash[h] = (hashes[i - 1] if i else None, spec_.prompt[i * 16:(i + 1) * 16])
    announced: set[Any] = set()
    for event in index.stored:
        assert event.medium == "GPU" and event.locality == "LOCAL" and event.group_idx == 0
        assert event.block_size == 16 and len(event.token_ids) == 16 * len(event.block_hashes)
        for i, block_hash in enumerate(event.block_hashes):
            announced.add(block_hash)
            parent: Any = event.parent_block_hash if i == 0 else event.block_hashes[i - 1]
            if block_hash in by_hash:
                assert (parent, tuple(event.token_ids[i * 16:(i + 1) * 16])) == by_hash[block_hash]
    assert set(by_hash) <= announced  # every full prompt block was announced
    assert cached_after_first <= announced
    removed = {h for _, batch in batches for e in batch if isinstance(e, BlockRemoved)
               for h in e.block_hashes}
    assert cached_after_first - cached_before_reset <= removed  # evictions were announced
    assert engine.pools[0].num_evicted >= len(removed) > 0


def test_reset_with_referenced_blocks_removes_only_the_unreferenced() -> None:
    sink = CollectingEventSink()
    engine = Engine(EngineConfig(load_spec("tiny-gqa"), num_blocks=16,
                                 enable_kv_cache_events=True), sink)
    try:
        done, running = make_requests(2, prompt_tokens=33, max_tokens=8, seed=3)
        _run(engine, [done])
        engine.add_request(running)
        engine.step()  # the running request's prompt blocks are cached and referenced
        before = engine.pools[0].cached_hashes()
        dropped = engine.reset_prefix_cache()
        kept = engine.pools[0].cached_hashes()
        assert kept and dropped == len(before - kept)
        last = sink.batches[-1]
        assert last == (BlockRemoved(tuple(engine_hashes_of(before - kept, sink)), "GPU", 0,
                                     "LOCAL"),)
        engine.run_until_done(timeout_s=30)
    finally:
        engine.shutdown()
    assert not any(isinstance(e, AllBlocksCleared) for e in sink.events)
    # no events without enable_kv_cache_events (vLLM's default): connector events only
    quiet = Engine(EngineConfig(load_spec("tiny-gqa"), num_blocks=16))
    _run(quiet, make_requests(1, prompt_tokens=40, max_tokens=1))
    quiet.reset_prefix_cache()
    assert quiet.events == []
    quiet.shutdown()


def engine_hashes_of(hashes: set[Any], sink: CollectingEventSink) -> list[Any]:
    """``hashes`` in the order they were announced (the pool drops in cache order)."""
    order = [h for e in sink.events if isinstance(e, BlockStored) for h in e.block_hashes]
    return sorted(hashes, key=order.index)


def test_cache_salt_is_in_extra_keys_and_events_batch_once_per_step() -> None:
    sink = CollectingEventSink()
    engine = Engine(EngineConfig(load_spec("tiny-gqa"), num_blocks=16,
                                 max_num_batched_tokens=32, enable_kv_cache_events=True), sink)
    try:
        spec = RequestSpec("salted", tuple(range(1, 65)), max_tokens=1, cache_salt="tenant-a")
        engine.add_request(spec)
        steps = 0
        while engine.has_work():
            before = len(sink.batches)
            engine.step()
            steps += 1
            assert len(sink.batches) - before <= 1  # at most one batch per step
            assert steps < 50
    finally:
        engine.shutdown()
    stored = [e for e in sink.events if isinstance(e, BlockStored)]
    # a 32-token budget computes two blocks per step: two runs, the second chained to the first
    assert [len(e.block_hashes) for e in stored] == [2, 2]
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]
    assert stored[0].parent_block_hash is None
    assert stored[0].extra_keys == (("tenant-a",), ("tenant-a",))
    assert stored[1].token_ids == tuple(range(33, 65))
    assert [h for e in stored for h in e.block_hashes] == \
        hash_blocks(spec.prompt, 16, extra_keys=("tenant-a",))


def test_shared_storage_events_once_across_tp2_ranks(tmp_path: Path) -> None:
    events = EngineEventsConfig(LOCAL_ANY, LOCAL_ANY)
    config = EngineConfig(load_spec("tiny-gqa"), topology=ParallelTopology(tp_size=2),
                          num_blocks=32, connector=ConnectorConfig(
                              "shared_storage", KVRole.BOTH, extra={"path": str(tmp_path)}))
    engine = Engine(config, events=events)
    specs = make_requests(3, prompt_tokens=48, shared_prefix_tokens=16, max_tokens=1, seed=4)
    try:
        assert engine.publisher is not None
        with KVEventSubscriber(SubscriberConfig(engine.publisher.endpoint,
                                                engine.publisher.replay_endpoint,
                                                start_seq=0)) as sub:
            _run(engine, specs)
            batches = _receive_all(sub, engine.publisher.stats.next_seq)
    finally:
        engine.shutdown()
    stored = [e for _, batch in batches for e in batch if isinstance(e, BlockStored)]
    storage = [h for e in stored if e.medium == "STORAGE" for h in e.block_hashes]
    gpu = [h for e in stored if e.medium == "GPU" for h in e.block_hashes]
    expected = {h for s in specs for h in hash_blocks(s.prompt, 16)}
    assert len(expected) == 7  # 3 requests x 3 blocks, the first block shared
    assert sorted(storage) == sorted(expected)  # each block once, not once per rank
    assert set(gpu) == expected and len(gpu) == len(expected)


# ------------------------------------------------------------------ worker-side events


@dataclass(frozen=True)
class _Meta(ConnectorMetadata):
    stored: tuple[BlockStored, ...] = ()


class _Scheduler(SchedulerConnector):
    """Announces, through the workers, every full block computed this step."""

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, step: SchedulerStep) -> _Meta:
        stored = []
        for item in step.scheduled:
            end = item.num_computed_tokens + item.num_scheduled_tokens
            for r in range(len(item.block_ids)):
                t = self.ctx.block_tokens(r)
                hashes = item.request.block_hashes[r]
                for i in range(item.num_computed_tokens // t, min(end // t, len(hashes))):
                    stored.append(BlockStored(
                        (hashes[i],), hashes[i - 1] if i else None,
                        item.request.token_ids[i * t:(i + 1) * t], t, medium="STORAGE",
                        group_idx=r, locality="LOCAL"))
        return _Meta(tuple(stored))

    def request_finished(self, request: ConnectorRequest,
                         block_ids: BlockIds) -> tuple[bool, TransferParams | None]:
        return False, None


class _Worker(WorkerConnector):
    """Reports the blocks of the regions it holds; the last rank one step late."""

    def register_kv_caches(self, caches: KVCaches) -> None:
        self.held = {r for r, shape in enumerate(caches.shapes) if shape.layer_ids}
        self.late: list[BlockStored] = []

    def start_load_kv(self) -> None: ...
    def wait_for_layer_load(self, layer_id: int) -> None: ...
    def save_kv_layer(self, layer_id: int, kv_layer: Any) -> None: ...

    def wait_for_save(self) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, _Meta)
        mine = [e for e in meta.stored if e.group_idx in self.held]
        if self.ctx.worker_index == self.ctx.num_workers - 1:
            self.ctx.events.extend(self.late)
            self.late = mine
        else:
            self.ctx.events.extend(mine)

    def get_finished(self, finished_request_ids: frozenset[str]) -> tuple[set[str], set[str]]:
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[tuple[int, int]]:
        return set()

    def shutdown(self) -> None: ...


class _WorkerEventsPlugin(ConnectorPlugin):
    name = "test-worker-events"

    @classmethod
    def create_scheduler(cls, ctx: ConnectorContext) -> SchedulerConnector:
        return _Scheduler(ctx)

    @classmethod
    def create_worker(cls, ctx: ConnectorContext) -> WorkerConnector:
        return _Worker(ctx)


@pytest.fixture
def worker_events_plugin() -> Iterator[str]:
    registry.register(_WorkerEventsPlugin)
    yield _WorkerEventsPlugin.name
    registry.unregister(_WorkerEventsPlugin.name)


@pytest.mark.parametrize("model,topology", [("tiny-gqa", ParallelTopology(tp_size=2)),
                                            ("tiny-hybrid", ParallelTopology(pp_size=4))])
def test_worker_events_published_once_every_holder_reported(
        worker_events_plugin: str, model: str, topology: ParallelTopology) -> None:
    spec = load_spec(model)
    sink = CollectingEventSink()
    engine = Engine(EngineConfig(spec, topology=topology, num_blocks=32,
                                 connector=ConnectorConfig(worker_events_plugin, KVRole.BOTH)),
                    sink)
    specs = make_requests(2, prompt_tokens=40, max_tokens=1, seed=6)
    try:
        _run(engine, specs)
        assert engine.aggregator is not None
        assert engine.aggregator.num_pending_events > 0  # the late rank has not reported
        engine.step()  # the late rank reports the last step's blocks
        assert engine.aggregator.num_pending_events == 0
    finally:
        engine.shutdown()
    stored = [(e.group_idx, h) for e in sink.events if isinstance(e, BlockStored)
              for h in e.block_hashes]
    expected = [(r, h) for s in specs for r in range(len(spec.regions))
                for h in hash_blocks(s.prompt, 16)]
    assert sorted(stored) == sorted(expected)  # once per block and region, not per rank


def test_output_aggregator_counts_reports_per_holder() -> None:
    a = BlockStored((b"a",), None, (1,), 1, medium="STORAGE", group_idx=0)
    b = BlockRemoved((b"b",), medium="STORAGE", group_idx=1)
    cleared = AllBlocksCleared()
    agg = OutputAggregator(3, holders=[frozenset({0, 1}), frozenset({2})])

    def step(*outputs: WorkerOutput) -> ConnectorOutput:
        return agg.aggregate(list(outputs))

    # rank 0 reports `a` twice before rank 1 reports it once: one complete round
    assert step(WorkerOutput(0, events=(a, a)), WorkerOutput(2, events=(a,))).events == ()
    assert step(WorkerOutput(1, events=(a,))).events == (a,)
    assert agg.num_pending_events == 1
    assert step(WorkerOutput(1, events=(a,))).events == (a,)
    # group 1 is held by rank 2 alone; reports of other ranks do not count
    assert step(WorkerOutput(0, events=(b,)), WorkerOutput(2, events=(b,))).events == (b,)
    # events without a group need every rank
    assert step(WorkerOutput(0, events=(cleared,)), WorkerOutput(1, events=(cleared,))).events \
        == ()
    assert step(WorkerOutput(2, events=(cleared,))).events == (cleared,)
    assert agg.num_pending_events == 0
    with pytest.raises(ValueError, match="holders"):
        OutputAggregator(2, holders=[frozenset({2})])
