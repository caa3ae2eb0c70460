"""Slice digests of head slices at heterogeneous TP, the pure part: for every
topology pair, the producer's slice digest of what one consumer rank reads from it
equals the consumer's slice digest of what landed, after a naive copy of every
descriptor of the plan; a byte flipped after the producer's digest changes exactly
the slices of the consumer ranks that received it; and the per-load tally counts
each consumer block once, whatever its number of sources."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbridge.connectors.pd.verify import (
    DigestAsk,
    answered_slice_algorithm,
    check_slices,
    count_slices,
    pick_slice_algorithm,
    plan_ask,
    plan_slice_check,
    producer_slice_plan,
    take_hold_digests,
    take_slice_digests,
    whole_block_regions,
)
from kvbridge.layouts import KVCacheSpec, ParallelTopology, load_spec
from kvbridge.layouts.digests import (
    ALGORITHM,
    SLICE_ALGORITHM,
    TORCH_ALGORITHM,
    TORCH_SLICE_ALGORITHM,
    BlockDigester,
    Digester,
    DigestMode,
    LayerSpan,
    VerifyPolicy,
    pack,
)
from kvbridge.layouts.plan import TransferPlan, plan_consumer_rank, plan_transfer, rank_at
from kvbridge.layouts.torch_digests import TensorSpan, TorchBlockDigester

NUM_BLOCKS = 6
PRODUCER_IDS = (3, 1, 4)
CONSUMER_IDS = (0, 2, 5)


def _t(tp: int, pp: int = 1) -> ParallelTopology:
    return ParallelTopology(tp_size=tp, pp_size=pp)


PAIRS = [(model, _t(p), _t(c)) for model in ("tiny-gqa", "tiny-gqa-nhd", "tiny-hybrid")
         for p, c in ((1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2))]
PAIRS += [("tiny-hybrid", _t(1), _t(8)), ("tiny-hybrid", _t(8), _t(2)),
          ("tiny-gqa", _t(1, 2), _t(2)), ("tiny-mla", _t(2), _t(1))]


class Rank:
    """One rank's KV tensors as numpy buffers (one per layer) and their digester
    (``algorithm``: XXH3-64's, or ``torch-mix64-v1``'s over the same memory)."""

    def __init__(self, spec: KVCacheSpec, topology: ParallelTopology, rng: np.random.Generator
                 | None, algorithm: str = ALGORITHM) -> None:
        self.shapes = spec.rank_shapes(topology)
        self.buffers: dict[int, np.ndarray] = {}
        self.stride: dict[int, int] = {}
        for shape in self.shapes:
            for layer in shape.layer_ids:
                size = NUM_BLOCKS * shape.block_bytes_per_layer
                self.buffers[layer] = (rng.integers(0, 256, size, dtype=np.uint8) if rng
                                       else np.zeros(size, dtype=np.uint8))
                self.stride[layer] = shape.block_bytes_per_layer
        spans = {layer: LayerSpan(buf.ctypes.data, self.stride[layer], self.stride[layer],
                                  NUM_BLOCKS) for layer, buf in self.buffers.items()}
        self.digester: Digester = BlockDigester(spans, [s.layer_ids for s in self.shapes],
                                                owner=self.buffers)
        if algorithm == TORCH_ALGORITHM:
            self.digester = TorchBlockDigester(
                {layer: TensorSpan(torch.from_numpy(buf), self.stride[layer],
                                   self.stride[layer], NUM_BLOCKS)
                 for layer, buf in self.buffers.items()}, [s.layer_ids for s in self.shapes])

    def block_ids(self, ids: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [ids if s.layer_ids else () for s in self.shapes]


def _copy(plan: TransferPlan, producers: list[Rank], consumers: list[Rank]) -> None:
    """Every descriptor of the plan, byte by byte into the consumer ranks (the oracle)."""
    for c, rank_plan in enumerate(plan.ranks):
        for d in rank_plan.descriptors:
            src, dst = producers[d.producer_rank], consumers[c]
            for pb, cb in zip(PRODUCER_IDS, CONSUMER_IDS, strict=True):
                a = pb * src.stride[d.layer] + d.producer_offset
                b = cb * dst.stride[d.layer] + d.consumer_offset
                dst.buffers[d.layer][b:b + d.length] = src.buffers[d.layer][a:a + d.length]


def _producer_slices(spec: KVCacheSpec, producer: ParallelTopology, consumer_rank:
                     ParallelTopology, p: int, rank: Rank) -> tuple[dict[int, int], ...]:
    """What producer rank ``p`` answers to ``consumer_rank``: the worker's steps."""
    sub = plan_consumer_rank(spec, producer, consumer_rank).for_producer(p)
    plan = producer_slice_plan(sub, p, [s.block_bytes_per_layer for s in rank.shapes],
                               [s.layer_ids for s in rank.shapes])
    block_ids = rank.block_ids(PRODUCER_IDS)
    held = take_hold_digests(rank.digester, block_ids)
    return take_slice_digests(rank.digester, plan, block_ids, held)


@pytest.mark.parametrize("algorithm", [ALGORITHM, TORCH_ALGORITHM])
@pytest.mark.parametrize(("model", "producer", "consumer"), PAIRS,
                         ids=[f"{m}-tp{p.tp_size}pp{p.pp_size}-tp{c.tp_size}"
                              for m, p, c in PAIRS])
def test_both_sides_hash_the_same_bytes_and_a_flip_fails_exactly_its_readers(
        model: str, producer: ParallelTopology, consumer: ParallelTopology,
        algorithm: str) -> None:
    """With either slice algorithm (``xxh3-64-slices``, ``torch-mix64-v1-slices``: the
    digester of its block algorithm)."""
    spec = load_spec(model)
    plan = plan_transfer(spec, producer, consumer)
    rng = np.random.default_rng(7)
    producers = [Rank(spec, rank_at(producer, p), rng, algorithm)
                 for p in range(producer.world_size)]
    consumers = [Rank(spec, rank_at(consumer, c), None, algorithm)
                 for c in range(consumer.world_size)]
    _copy(plan, producers, consumers)
    answers: dict[tuple[int, int], tuple[dict[int, int], ...]] = {}
    checks = {}
    for c, rank_plan in enumerate(plan.ranks):
        me = rank_at(consumer, c)
        local = [s.block_bytes_per_layer for s in spec.rank_shapes(me)]
        whole = {p: whole_block_regions(
            rank_plan, p, local, [s.block_bytes_per_layer for s in producers[p].shapes],
            [s.layer_ids for s in producers[p].shapes]) for p in rank_plan.sources}
        check = plan_slice_check(rank_plan, whole, rank_plan.sources)
        checks[c] = check
        # every region is checked: whole from one producer rank, or by slices
        regions = set(np.unique(rank_plan.regions).tolist())
        assert check.regions | set().union(*whole.values()) == regions and not check.why
        for p in rank_plan.sources:
            answers[c, p] = _producer_slices(spec, producer, me, p, producers[p])
            for r in check.regions_of(p):
                have = consumers[c].digester.slice_digests(check.ranges[p][r], CONSUMER_IDS)
                assert have == [answers[c, p][r][b] for b in PRODUCER_IDS], (c, p, r)
    if model != "tiny-mla":  # a SPLIT region: somewhere it is read as head slices
        assert any(check.regions for check in checks.values())

    # one byte flipped in a producer block after its digests: exactly the consumer ranks
    # that receive it see their slice of that block differ, nothing else does
    p = producer.world_size - 1
    layer = producers[p].shapes[0].layer_ids[-1]  # region 0: the SPLIT one (or MLA's)
    offset = PRODUCER_IDS[1] * producers[p].stride[layer] + producers[p].stride[layer] // 3
    clean = [{k: v.copy() for k, v in rank.buffers.items()} for rank in consumers]
    producers[p].buffers[layer][offset] ^= 0x20
    _copy(plan, producers, consumers)
    hit = 0
    for c, check in checks.items():
        for q in plan.ranks[c].sources:
            for r in check.regions_of(q):
                have = consumers[c].digester.slice_digests(check.ranges[q][r], CONSUMER_IDS)
                want = [answers[c, q][r][b] for b in PRODUCER_IDS]
                landed = q == p and any(
                    not np.array_equal(clean[c][lay], consumers[c].buffers[lay])
                    for lay, _ in check.ranges[q][r])
                expected = [i == 1 and landed for i in range(len(PRODUCER_IDS))]
                assert [h != w for h, w in zip(have, want, strict=True)] == expected, (c, q)
                hit += landed
    receivers = [c for c in checks if any(not np.array_equal(clean[c][lay], buf)
                                          for lay, buf in consumers[c].buffers.items())]
    # every consumer rank the flipped byte reached saw it (MLA: checked whole instead)
    assert hit == (0 if model == "tiny-mla" else len(receivers))


def test_the_slice_algorithm_is_the_consumers_first_that_a_producer_offers() -> None:
    """The consumer picks its session's slice algorithm from its own preference order;
    a producer rank predicts the same pick from the consumer's handshake, whenever it
    is one the consumer will ask (it offers the pick)."""
    host = (ALGORITHM, SLICE_ALGORITHM, TORCH_ALGORITHM, TORCH_SLICE_ALGORITHM)
    gpu = (TORCH_ALGORITHM, TORCH_SLICE_ALGORITHM)
    mine_host = (SLICE_ALGORITHM, TORCH_SLICE_ALGORITHM)
    assert pick_slice_algorithm(mine_host, {0: host, 1: host}) == SLICE_ALGORITHM
    assert pick_slice_algorithm(mine_host, {0: gpu, 1: gpu}) == TORCH_SLICE_ALGORITHM
    assert pick_slice_algorithm((TORCH_SLICE_ALGORITHM,), {0: host}) == TORCH_SLICE_ALGORITHM
    assert pick_slice_algorithm((TORCH_SLICE_ALGORITHM,), {0: (ALGORITHM, SLICE_ALGORITHM)}) \
        is None  # an XXH3-only producer and a GPU consumer: nothing in common
    assert pick_slice_algorithm(mine_host, {0: (ALGORITHM,)}) is None  # an older kvbridge
    # the producer's prediction, from the consumer's offer (its preference order)
    assert answered_slice_algorithm(host, (SLICE_ALGORITHM, TORCH_SLICE_ALGORITHM)) \
        == SLICE_ALGORITHM
    assert answered_slice_algorithm(host, (TORCH_SLICE_ALGORITHM,)) == TORCH_SLICE_ALGORITHM
    assert answered_slice_algorithm(gpu, (SLICE_ALGORITHM,)) is None
    for consumer, producers in ((host, (host, gpu)), (gpu, (host, host)), (host, (gpu, gpu))):
        mine = tuple(a for a in consumer if a.endswith("-slices"))
        picked = pick_slice_algorithm(mine, dict(enumerate(producers)))
        for offer in producers:
            if picked in offer:
                assert answered_slice_algorithm(
                    consumer, tuple(a for a in offer if a.endswith("-slices"))) == picked


def test_a_slice_of_whole_layer_blocks_is_the_block_digest() -> None:
    """TP 2 -> 1: a producer rank's whole head slice is read, so its slice digest is its
    block digest (nothing more is hashed at hold start), while the consumer hashes
    the two separate ranges where it landed in its own block."""
    spec = load_spec("tiny-gqa")
    sub = plan_consumer_rank(spec, _t(2), _t(1)).for_producer(1)
    shapes = spec.rank_shapes(rank_at(_t(2), 1))
    plan = producer_slice_plan(sub, 1, [s.block_bytes_per_layer for s in shapes],
                               [s.layer_ids for s in shapes])
    assert plan.whole == frozenset({0}) and not plan.needed
    # TP 1 -> 2: a sub-slice (the K and the V half of each layer): hashed
    sub = plan_consumer_rank(spec, _t(1), rank_at(_t(2), 1)).for_producer(0)
    shapes = spec.rank_shapes(_t(1))
    plan = producer_slice_plan(sub, 0, [s.block_bytes_per_layer for s in shapes],
                               [s.layer_ids for s in shapes])
    assert plan.whole == frozenset() and plan.needed
    half = shapes[0].block_bytes_per_layer // 4
    assert all(ranges == ((half, half), (3 * half, half)) for _, ranges in plan.layers[0])


def _ask(slices: frozenset[int], sources: frozenset[int], ids: tuple[int, ...]) -> DigestAsk:
    ask = plan_ask(VerifyPolicy(DigestMode.FULL), "r", frozenset(), (ids,), (ids,), slices)
    from dataclasses import replace
    return replace(ask, slice_sources={0: sources})


def test_count_slices_counts_each_block_once_whatever_its_sources() -> None:
    ids = (10, 11, 12, 13)
    both = frozenset({0, 1})
    asks = {0: _ask(frozenset({0}), both, ids), 1: _ask(frozenset({0}), both, ids)}
    assert asks[0].algorithm == SLICE_ALGORITHM and asks[0].wanted == (4,)
    assert asks[0].whole_blocks == 0 and asks[0].unverified == 0
    every = [(0, b) for b in ids]
    # both sources matched everything: four blocks verified (not eight)
    assert count_slices(asks, {0: every, 1: every}, set()) == (4, 0)
    # block 11 failed from both sources: one mismatch, neither verified nor unverified
    part = [(0, b) for b in ids if b != 11]
    assert count_slices(asks, {0: part, 1: part}, {(0, 11)}) == (3, 0)
    # source 1 sent no digests: its parts are unchecked, each block once unverified
    assert count_slices(asks, {0: every}, set()) == (0, 4)
    # no slice region asked: the ask is the one it always was
    plain = plan_ask(VerifyPolicy(DigestMode.FULL), "r", frozenset({0}), (ids,), (ids,))
    assert plain.algorithm == ALGORITHM and plain.slices == frozenset() and plain.wanted == (4,)


def test_check_slices_reads_a_malformed_answer_as_every_block_failed() -> None:
    buf = np.arange(4 * 64, dtype=np.uint8)
    digester = BlockDigester({0: LayerSpan(buf.ctypes.data, 64, 64, 4)}, [(0,)], owner=buf)
    ranges = ((0, ((8, 8), (32, 8))),)
    from dataclasses import replace
    ask = replace(_ask(frozenset({0}), frozenset({0}), (1, 3)), slice_ranges={0: ranges})
    good = pack(digester.slice_digests(ranges, [1, 3]))
    assert check_slices(ask, (good,), digester) == ([(0, 1), (0, 3)], [])
    assert check_slices(ask, (good[:8],), digester) == ([], [(0, 1), (0, 3)])
    flipped = pack([digester.slice_digests(ranges, [1])[0], 0])
    assert check_slices(ask, (flipped,), digester) == ([(0, 1)], [(0, 3)])
