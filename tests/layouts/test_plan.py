"""Transfer plans against a naive reassembly oracle.

The oracle builds, for one block index, what every rank holds of a global KV
tensor whose every element has a distinct id (layer, pcp rank, K|V, head,
virtual token, dim), straight from the memory model of kvbridge.layouts.spec,
and applies a plan descriptor by descriptor. Offsets are converted to elements
only after asserting they are element-aligned, so a matching element proves
every byte of it came from the right producer byte.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.layouts import (
    KVCacheSpec,
    LayoutError,
    MemoryOrder,
    ParallelTopology,
    RegionLayout,
    load_spec,
    preset_names,
)
from kvbridge.layouts.plan import TransferPlan, plan_transfer, rank_at
from kvbridge.layouts.spec import RankRegionShape


def rank_block_ids(spec: KVCacheSpec, topology: ParallelTopology, shape: RankRegionShape,
                   layer: int) -> np.ndarray:
    """Flat element ids of one block of ``layer`` on ``topology``'s rank."""
    r = shape.region
    dcp = topology.dcp_size
    vtokens = r.block_size * dcp  # virtual tokens per block under DCP
    kv = np.arange(r.num_kv)[:, None, None, None]
    heads = np.arange(shape.head_start, shape.head_start + shape.num_heads)
    slots = np.arange(r.block_size)
    tokens = slots * dcp + topology.dcp_rank if r.token_sharded else slots
    dim = np.arange(r.head_dim)[None, None, None, :]
    if r.memory_order is MemoryOrder.HND:
        h = heads[None, :, None, None]
        t = tokens[None, None, :, None]
    else:
        h = heads[None, None, :, None]
        t = tokens[None, :, None, None]
    base = (layer * topology.pcp_size + topology.pcp_rank) * r.num_kv
    ids = (((base + kv) * r.num_kv_heads + h) * vtokens + t) * r.head_dim + dim
    return np.ascontiguousarray(ids, dtype=np.int64).ravel()


def check_plan(plan: TransferPlan) -> None:
    """Apply ``plan`` to id-filled rank blocks and assert every consumer element is right."""
    spec = plan.spec
    producer_cache: dict[tuple[int, int], np.ndarray] = {}

    def producer_block(prank: int, region: int, layer: int) -> np.ndarray:
        key = (prank, layer)
        if key not in producer_cache:
            topo = rank_at(plan.producer, prank)
            shape = spec.rank_shapes(topo)[region]
            assert layer in shape.layer_ids, (prank, layer)
            producer_cache[key] = rank_block_ids(spec, topo, shape, layer)
        return producer_cache[key]

    assert len(plan.ranks) == plan.consumer.world_size
    for index, rank_plan in enumerate(plan.ranks):
        consumer = rank_at(plan.consumer, index)
        assert rank_plan.consumer == consumer and rank_plan.consumer_rank == index
        shapes = spec.rank_shapes(consumer)
        got: dict[int, np.ndarray] = {}
        writes: dict[int, np.ndarray] = {}
        expected: dict[int, np.ndarray] = {}
        for shape in shapes:
            for layer in shape.layer_ids:
                expected[layer] = rank_block_ids(spec, consumer, shape, layer)
                got[layer] = np.full_like(expected[layer], -1)
                writes[layer] = np.zeros_like(expected[layer])
        assert rank_plan.bytes_per_block == sum(s.block_bytes for s in shapes)
        for d in rank_plan.descriptors:
            region = spec.regions[d.region]
            elem = region.elem_bytes
            assert spec.region_of_layer(d.layer) is region
            assert d.length > 0
            assert d.producer_offset % elem == 0 and d.consumer_offset % elem == 0
            assert d.length % elem == 0
            assert d.layer in got, f"descriptor for layer {d.layer} not on consumer stage"
            src = producer_block(d.producer_rank, d.region, d.layer)
            dst = got[d.layer]
            po, co, n = d.producer_offset // elem, d.consumer_offset // elem, d.length // elem
            assert po + n <= src.shape[0] and co + n <= dst.shape[0]
            dst[co:co + n] = src[po:po + n]
            writes[d.layer][co:co + n] += 1
        for layer, exp in expected.items():
            assert np.array_equal(writes[layer], np.ones_like(exp)), \
                f"consumer rank {index} layer {layer}: some element written 0 or 2+ times"
            assert np.array_equal(got[layer], exp), \
                f"consumer rank {index} layer {layer}: wrong producer bytes"


# --------------------------------------------------------------------------- grid

SMALL_PRESETS = [name for name in preset_names() if name != "bench-gqa"]


def expected_refusal(spec: KVCacheSpec, producer: ParallelTopology,
                     consumer: ParallelTopology) -> str | None:
    """The field a correct planner must name when refusing this pair, else None."""
    for side, topo in (("producer", producer), ("consumer", consumer)):
        if topo.pp_size > spec.num_layers:
            return f"{side}.pp_size"
        groups = topo.tp_size // topo.dcp_size
        for region in spec.regions:
            heads = region.num_kv_heads
            if (region.layout is RegionLayout.SPLIT and heads % groups
                    and groups % heads):
                return f"{side}.tp_size"
    if producer.dcp_size != consumer.dcp_size:
        return "consumer.dcp_size"
    if producer.pcp_size != consumer.pcp_size:
        return "consumer.pcp_size"
    return None


def check_pair(name: str, producer: ParallelTopology, consumer: ParallelTopology) -> None:
    spec = load_spec(name)
    refusal = expected_refusal(spec, producer, consumer)
    if refusal is not None:
        with pytest.raises(LayoutError) as info:
            plan_transfer(spec, producer, consumer)
        assert info.value.field == refusal, str(info.value)
        return
    check_plan(plan_transfer(spec, producer, consumer))


def test_grid_exhaustive_small_presets() -> None:
    """Every preset except bench-gqa, TP {1,2,4,8}^2, PP {1,2,4}^2, equal DCP {1,2,4}."""
    count = 0
    for name in SMALL_PRESETS:
        for ptp, ctp, ppp, cpp, dcp in itertools.product(
                (1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4), (1, 2, 4), (1, 2, 4)):
            if ptp % dcp or ctp % dcp:
                continue
            check_pair(name, ParallelTopology(tp_size=ptp, pp_size=ppp, dcp_size=dcp),
                       ParallelTopology(tp_size=ctp, pp_size=cpp, dcp_size=dcp))
            count += 1
    assert count > 500


@st.composite
def topologies(draw: st.DrawFn, dcp: int | None = None,
               pcp: int | None = None) -> ParallelTopology:
    dcp_size = dcp if dcp is not None else draw(st.sampled_from((1, 2, 4)))
    tp_size = dcp_size * draw(st.integers(1, 8 // dcp_size))
    return ParallelTopology(tp_size=tp_size, pp_size=draw(st.integers(1, 4)),
                            dcp_size=dcp_size,
                            pcp_size=pcp if pcp is not None else draw(st.integers(1, 2)))


@st.composite
def pairs(draw: st.DrawFn) -> tuple[str, ParallelTopology, ParallelTopology]:
    name = draw(st.sampled_from(SMALL_PRESETS))
    producer = draw(topologies())
    if draw(st.integers(0, 9)) == 0:  # now and then an unequal DCP/PCP pair: must be refused
        consumer = draw(topologies())
    else:
        consumer = draw(topologies(dcp=producer.dcp_size, pcp=producer.pcp_size))
    return name, producer, consumer


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairs())
def test_grid_hypothesis_full(case: tuple[str, ParallelTopology, ParallelTopology]) -> None:
    """Any TP 1..8 (odd sizes too), PP 1..4, DCP {1,2,4}, PCP 1..2, every small preset."""
    check_pair(*case)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topologies(pcp=1), st.integers(1, 8), st.integers(1, 2))
def test_grid_bench_preset(producer: ParallelTopology, consumer_groups: int,
                           consumer_pp: int) -> None:
    """bench-gqa (32 heads, 64-token blocks) is big: fewer examples, same oracle."""
    dcp = producer.dcp_size
    check_pair("bench-gqa", producer, ParallelTopology(
        tp_size=dcp * max(1, consumer_groups // dcp), pp_size=consumer_pp, dcp_size=dcp))
