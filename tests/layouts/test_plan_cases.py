"""Transfer plans: the specific cases operators and connector authors rely on."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvbridge.layouts import LayoutError, ParallelTopology, load_spec
from kvbridge.layouts.plan import (
    LayerMemory,
    absolute_descriptors,
    plan_transfer,
    rank_at,
    rank_index,
    rank_memory,
)


def topo(text: str) -> ParallelTopology:
    return ParallelTopology.parse(text)


def test_same_topology_is_one_whole_block_per_layer_from_the_same_rank() -> None:
    spec = load_spec("tiny-gqa")
    plan = plan_transfer(spec, topo("tp=2,pp=2"), topo("tp=2,pp=2"))
    for rank_plan in plan.ranks:
        shape = spec.rank_shapes(rank_plan.consumer)[0]
        assert rank_plan.sources == (rank_plan.consumer_rank,)
        assert rank_plan.num_descriptors == len(shape.layer_ids)  # K and V coalesced
        assert rank_plan.raw_count == len(shape.layer_ids) * 2 * shape.num_heads
        assert all(d.length == shape.block_bytes_per_layer and d.producer_offset == 0
                   for d in rank_plan.descriptors)


def test_layers_are_never_coalesced_together() -> None:
    plan = plan_transfer(load_spec("tiny-gqa"), topo("tp=1"), topo("tp=1"))
    layers = [d.layer for d in plan.ranks[0].descriptors]
    assert layers == [0, 1, 2, 3]


def test_consumer_tp_larger_reads_a_head_sub_slice_of_one_producer_rank() -> None:
    spec = load_spec("tiny-gqa")  # 8 KV heads, HND
    plan = plan_transfer(spec, topo("tp=2"), topo("tp=4"))
    head_bytes = 16 * 32 * 2
    for rank_plan in plan.ranks:
        c = rank_plan.consumer.tp_rank
        assert rank_plan.sources == (c // 2,)
        layer0 = [d for d in rank_plan.descriptors if d.layer == 0]
        # K heads then V heads of the producer's 4: this consumer takes 2 of each.
        assert [(d.producer_offset, d.consumer_offset, d.length) for d in layer0] == [
            ((c % 2) * 2 * head_bytes, 0, 2 * head_bytes),
            ((4 + (c % 2) * 2) * head_bytes, 2 * head_bytes, 2 * head_bytes),
        ]


def test_producer_tp_larger_gathers_from_several_producer_ranks() -> None:
    plan = plan_transfer(load_spec("tiny-gqa"), topo("tp=8"), topo("tp=2"))
    assert [r.sources for r in plan.ranks] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_replicated_gqa_heads_are_read_once_and_spread_over_replicas() -> None:
    spec = load_spec("tiny-hybrid")  # attn: 4 KV heads -> TP 8 holds each head twice
    plan = plan_transfer(spec, topo("tp=8"), topo("tp=2"))
    attn = [sorted({d.producer_rank for d in r.descriptors if d.region == 0})
            for r in plan.ranks]
    # Each consumer reads each of its 2 heads once; the two consumers use different replicas.
    assert attn == [[0, 2], [5, 7]]
    for r in plan.ranks:
        assert r.bytes_per_block == sum(s.block_bytes for s in spec.rank_shapes(r.consumer))


def test_replicate_region_read_whole_from_one_rank_spread_across_ranks() -> None:
    spec = load_spec("tiny-mla")
    plan = plan_transfer(spec, topo("tp=2"), topo("tp=4"))
    assert [r.sources for r in plan.ranks] == [(0,), (1,), (0,), (1,)]
    whole = spec.rank_shapes(topo("tp=4"))[0].block_bytes_per_layer
    assert all(d.length == whole for r in plan.ranks for d in r.descriptors)


def test_pp_stages_intersect_layer_ranges() -> None:
    spec = load_spec("tiny-mla")  # 4 layers
    plan = plan_transfer(spec, topo("tp=2,pp=4"), topo("tp=1,pp=2"))
    producer = plan.producer
    by_layer = {d.layer: rank_at(producer, d.producer_rank) for d in plan.ranks[0].descriptors}
    assert sorted(by_layer) == [0, 1]  # consumer stage 0 holds layers 0-1 only
    assert [by_layer[layer].pp_rank for layer in (0, 1)] == [0, 1]
    assert sorted(d.layer for d in plan.ranks[1].descriptors) == [2, 3]


def test_dcp_consumer_reads_producer_ranks_of_its_own_dcp_rank() -> None:
    spec = load_spec("tiny-gqa")
    plan = plan_transfer(spec, topo("tp=8,dcp=4"), topo("tp=4,dcp=4"))
    for rank_plan in plan.ranks:
        for source in rank_plan.sources:
            assert rank_at(plan.producer, source).dcp_rank == rank_plan.consumer.dcp_rank
    # DCP rank 3 is planned like rank 0 (never forgotten).
    assert plan.ranks[3].bytes_per_block == plan.ranks[0].bytes_per_block > 0


def test_nhd_heterogeneous_tp_uses_per_token_descriptors() -> None:
    spec = load_spec("tiny-gqa-nhd")  # block_size 16
    same = plan_transfer(spec, topo("tp=2"), topo("tp=2"))
    assert same.ranks[0].num_descriptors == 4  # whole block per layer, like HND
    hetero = plan_transfer(spec, topo("tp=2"), topo("tp=4"))
    assert hetero.ranks[0].num_descriptors == 4 * 2 * 16  # layers x K|V x tokens
    assert all(d.length == 2 * 32 * 2 for d in hetero.ranks[0].descriptors)  # 2 heads


def test_stats_and_dict_shape() -> None:
    spec = load_spec("tiny-hybrid")
    plan = plan_transfer(spec, topo("tp=4,pp=2"), topo("tp=2"))
    stats = plan.stats()
    total = sum(s.block_bytes for c in topo("tp=2").ranks() for s in spec.rank_shapes(c))
    assert stats.total_bytes_per_block == total
    data = plan.to_dict()
    assert data["total_bytes_per_block"] == total
    assert data["producer"] == "tp=4,pp=2,dcp=1,pcp=1"
    assert len(data["ranks"]) == 2
    rank0 = data["ranks"][0]
    assert set(rank0) == {"consumer_rank", "consumer", "sources", "bytes_per_block",
                          "descriptors_before_coalescing", "descriptors"}
    assert rank0["descriptors"] <= rank0["descriptors_before_coalescing"]
    assert {s["name"] for s in rank0["sources"]} == {"tp0/pp0", "tp1/pp0", "tp0/pp1",
                                                     "tp1/pp1"}


def test_for_producer_partitions_the_plan() -> None:
    plan = plan_transfer(load_spec("tiny-hybrid"), topo("tp=2,pp=2"), topo("tp=4"))
    total = 0
    for producer in plan.producer.ranks():
        for consumer_rank, sub in plan.for_producer(producer).items():
            assert set(sub.sources) == {rank_index(producer)}
            assert consumer_rank == sub.consumer_rank
            total += sub.bytes_per_block
    assert total == plan.stats().total_bytes_per_block


@pytest.mark.parametrize(("producer", "consumer", "field", "hint"), [
    ("tp=4,dcp=2", "tp=4,dcp=1", "consumer.dcp_size", "same dcp_size"),
    ("tp=4,dcp=1", "tp=4,dcp=4", "consumer.dcp_size", "same dcp_size"),
    ("tp=2,pcp=2", "tp=2", "consumer.pcp_size", "same pcp_size"),
    ("tp=3", "tp=2", "producer.tp_size", "8 KV heads"),
    ("tp=2", "tp=6,dcp=2", "consumer.tp_size", "head groups"),
    ("tp=1", "tp=1,pp=5", "consumer.pp_size", "5 pipeline stages"),
])
def test_refusals_name_the_field(producer: str, consumer: str, field: str, hint: str) -> None:
    with pytest.raises(LayoutError) as info:
        plan_transfer(load_spec("tiny-gqa"), topo(producer), topo(consumer))
    assert info.value.field == field
    assert hint in str(info.value)


# --------------------------------------------------------------------------- addresses


def _alloc(spec_name: str, topology: ParallelTopology, num_blocks: int,
           rng: np.random.Generator | None) -> tuple[dict[int, np.ndarray], dict[int, LayerMemory]]:
    spec = load_spec(spec_name)
    buffers: dict[int, np.ndarray] = {}
    for shape in spec.rank_shapes(topology):
        for layer in shape.layer_ids:
            size = num_blocks * shape.block_bytes_per_layer
            buffers[layer] = (rng.integers(0, 256, size, dtype=np.uint8) if rng is not None
                              else np.zeros(size, dtype=np.uint8))
    addrs = {layer: buf.ctypes.data for layer, buf in buffers.items()}
    return buffers, rank_memory(spec, topology, addrs, num_blocks)


@pytest.mark.parametrize(("name", "producer_text", "consumer_text"), [
    ("tiny-hybrid", "tp=4,pp=2", "tp=2"),
    ("tiny-gqa-nhd", "tp=4,pp=2", "tp=2"),
    ("tiny-mla", "tp=2,dcp=2,pcp=2", "tp=4,dcp=2,pp=2,pcp=2"),
    ("tiny-gqa", "tp=1", "tp=8"),
])
def test_absolute_descriptors_move_the_right_bytes_in_real_memory(
        name: str, producer_text: str, consumer_text: str) -> None:
    spec = load_spec(name)
    producer, consumer = topo(producer_text), topo(consumer_text)
    plan = plan_transfer(spec, producer, consumer)
    rng = np.random.default_rng(7)
    num_blocks = 6
    p_bufs: dict[int, dict[int, np.ndarray]] = {}
    p_mem: dict[int, dict[int, LayerMemory]] = {}
    for p in producer.ranks():
        p_bufs[rank_index(p)], p_mem[rank_index(p)] = _alloc(name, p, num_blocks, rng)
    producer_ids = [4, 0, 5]
    consumer_ids = [1, 3, 2]
    for rank_plan in plan.ranks:
        c_bufs, c_mem = _alloc(name, rank_plan.consumer, num_blocks, None)
        arrays = absolute_descriptors(rank_plan, c_mem, p_mem, consumer_ids, producer_ids)
        assert [a.producer_rank for a in arrays] == list(rank_plan.sources)
        for a in arrays:
            assert a.consumer.dtype == np.uint64 and a.consumer.shape[1] == 2
            assert np.array_equal(a.consumer[:, 1], a.producer[:, 1])
            assert np.all(np.diff(a.layers) >= 0)
            for (dst, n), (src, _) in zip(a.consumer.tolist(), a.producer.tolist(),
                                          strict=True):
                ctypes.memmove(dst, src, n)
        assert sum(a.total_bytes for a in arrays) == rank_plan.bytes_per_block * 3
        # Expected: the single-block descriptors applied block by block.
        for p_id, c_id in zip(producer_ids, consumer_ids, strict=True):
            for d in rank_plan.descriptors:
                src_buf = p_bufs[d.producer_rank][d.layer]
                stride_p = p_mem[d.producer_rank][d.layer].block_stride
                stride_c = c_mem[d.layer].block_stride
                got = c_bufs[d.layer][c_id * stride_c + d.consumer_offset:][:d.length]
                want = src_buf[p_id * stride_p + d.producer_offset:][:d.length]
                assert np.array_equal(got, want)
        untouched = set(range(num_blocks)) - set(consumer_ids)
        for layer, buf in c_bufs.items():
            stride = c_mem[layer].block_stride
            for b in untouched:
                assert not buf[b * stride:(b + 1) * stride].any()


def test_absolute_descriptors_filters_by_layer_and_producer() -> None:
    spec = load_spec("tiny-gqa")
    plan = plan_transfer(spec, topo("tp=2"), topo("tp=1"))
    c_mem = {layer: LayerMemory(1 << 20, 16384, 4) for layer in range(4)}
    p_mem = {r: {layer: LayerMemory((r + 2) << 20, 8192, 4) for layer in range(4)}
             for r in range(2)}
    only = absolute_descriptors(plan.ranks[0], c_mem, p_mem, [0, 1], [2, 3], layers=[2],
                                producer_ranks=[1])
    assert len(only) == 1 and only[0].producer_rank == 1
    assert only[0].layers.tolist() == [2, 2, 2, 2]
    # Producer 1 holds heads 4..7 (4 KiB of K then 4 KiB of V per block); rows are
    # descriptor-major (K then V), then block.
    p_base, c_base = 3 << 20, 1 << 20
    assert only[0].producer.tolist() == [
        [p_base + 2 * 8192, 4096], [p_base + 3 * 8192, 4096],
        [p_base + 2 * 8192 + 4096, 4096], [p_base + 3 * 8192 + 4096, 4096]]
    assert only[0].consumer.tolist() == [
        [c_base + 4096, 4096], [c_base + 16384 + 4096, 4096],
        [c_base + 12288, 4096], [c_base + 16384 + 12288, 4096]]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"consumer_block_ids": [4], "producer_block_ids": [0]}, "consumer_block_ids"),
    ({"consumer_block_ids": [0], "producer_block_ids": [-1]}, "producer_block_ids"),
    ({"consumer_block_ids": [0, 1], "producer_block_ids": [0]}, "producer_block_ids"),
])
def test_absolute_descriptors_bounds_checks(kwargs: dict[str, list[int]], field: str) -> None:
    plan = plan_transfer(load_spec("tiny-gqa"), topo("tp=1"), topo("tp=1"))
    mem = {layer: LayerMemory(4096, 16384, 4) for layer in range(4)}
    with pytest.raises(LayoutError) as info:
        absolute_descriptors(plan.ranks[0], mem, {0: mem}, **kwargs)
    assert info.value.field == field


def test_absolute_descriptors_refuses_memory_smaller_than_the_spec() -> None:
    plan = plan_transfer(load_spec("tiny-gqa"), topo("tp=1"), topo("tp=1"))
    small = {layer: LayerMemory(4096, 1024, 4) for layer in range(4)}
    good = {layer: LayerMemory(4096, 16384, 4) for layer in range(4)}
    with pytest.raises(LayoutError) as info:
        absolute_descriptors(plan.ranks[0], good, {0: small}, [0], [0])
    assert info.value.field == "producer_memory"
    with pytest.raises(LayoutError) as info:
        absolute_descriptors(plan.ranks[0], good, {}, [0], [0])
    assert info.value.field == "producer_memory"
