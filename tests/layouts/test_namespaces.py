"""Key namespaces: enumeration, de-duplication rules and the key encoding."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.layouts import (
    KVCacheSpec,
    LayoutError,
    ParallelTopology,
    RegionLayout,
    load_spec,
    preset_names,
)
from kvbridge.layouts.hashing import hash_blocks
from kvbridge.layouts.namespaces import (
    BlockKey,
    KeyNamespace,
    block_keys,
    lookup_namespaces,
    namespace_for,
    write_targets,
)


def topo(text: str) -> ParallelTopology:
    return ParallelTopology.parse(text)


def valid(spec: KVCacheSpec, topology: ParallelTopology) -> bool:
    try:
        spec.validate_topology(topology)
    except LayoutError:
        return False
    return True


def content(spec: KVCacheSpec, region_index: int, rank: ParallelTopology) -> tuple[Any, ...]:
    """What bytes a rank holds of a region for one block (identical tuple = identical bytes)."""
    shape = spec.rank_shapes(rank)[region_index]
    token_shard = rank.dcp_rank if shape.region.token_sharded and rank.dcp_size > 1 else None
    return (shape.layer_ids, shape.head_start, shape.num_heads, token_shard, rank.pcp_rank)


def check_topology(name: str, sizes: ParallelTopology) -> None:
    spec = load_spec(name)
    lookup = lookup_namespaces(spec, sizes)
    assert len(set(lookup)) == len(lookup)
    writers: dict[KeyNamespace, list[ParallelTopology]] = defaultdict(list)
    members: dict[KeyNamespace, set[tuple[Any, ...]]] = defaultdict(set)
    by_content: dict[tuple[Any, ...], set[KeyNamespace]] = defaultdict(set)
    for rank in sizes.ranks():
        targets = write_targets(spec, rank)
        for target in targets:
            index = [r.name for r in spec.regions].index(target.region)
            ns = target.namespace
            assert ns in lookup, "a rank writes a namespace lookups never check"
            assert (ns.tp_size, ns.dcp_size, ns.pp_size, ns.pcp_size) == (
                sizes.tp_size, sizes.dcp_size, sizes.pp_size, sizes.pcp_size)
            assert ns.pp_rank == rank.pp_rank and ns.pcp_rank == rank.pcp_rank
            members[ns].add(content(spec, index, rank))
            by_content[(target.region, *content(spec, index, rank))].add(ns)
            if target.is_writer:
                writers[ns].append(rank)
            assert target.tokens_per_key == spec.regions[index].tokens_per_key(sizes.dcp_size)
    # Every namespace holds one kind of bytes, and exactly one rank writes it.
    for ns in lookup:
        assert len(members[ns]) == 1, f"{ns} shared by ranks holding different bytes"
        assert len(writers[ns]) == 1, f"{ns} has writers {writers[ns]}"
        assert writers[ns][0].tp_rank == ns.tp_rank
    # Every rank region part is covered (members is built from all ranks).
    assert set(members) == set(lookup)
    for (region_name, *_), namespaces in by_content.items():
        region = spec.region(region_name)
        if sizes.dcp_size == 1 or region.layout is RegionLayout.REPLICATE:
            assert len(namespaces) == 1, "identical bytes stored twice"
    for region in spec.regions:
        of_region = [ns for ns in lookup if ns.region == region.name]
        if region.token_sharded and sizes.dcp_size > 1:
            assert {ns.dcp_rank for ns in of_region} == set(range(sizes.dcp_size))
        if region.layout is RegionLayout.SPLIT and sizes.dcp_size > 1:
            assert len(of_region) == sizes.tp_size * sizes.pcp_size * len(
                {ns.pp_rank for ns in of_region})  # no head de-duplication under DCP


def test_namespaces_grid_every_preset() -> None:
    count = 0
    for name in preset_names():
        spec = load_spec(name)
        for tp, dcp, pp, pcp in itertools.product((1, 2, 3, 4, 8, 16), (1, 2, 4), (1, 2, 4),
                                                  (1, 2)):
            if tp % dcp:
                continue
            sizes = ParallelTopology(tp_size=tp, dcp_size=dcp, pp_size=pp, pcp_size=pcp)
            if not valid(spec, sizes):
                with pytest.raises(LayoutError):
                    lookup_namespaces(spec, sizes)
                continue
            check_topology(name, sizes)
            count += 1
    assert count > 100


@pytest.mark.parametrize(("name", "sizes", "expected"), [
    ("tiny-gqa", "tp=2", [(0, 0), (1, 0)]),
    ("tiny-gqa", "tp=16", [(t, 0) for t in range(0, 16, 2)]),  # 8 heads, each held twice
    ("tiny-gqa", "tp=16,dcp=2", [(t, t % 2) for t in range(16)]),  # no de-dup under DCP
    ("tiny-mla", "tp=8", [(0, 0)]),  # MLA stored once
    ("tiny-mla", "tp=8,dcp=4", [(0, 0), (1, 1), (2, 2), (3, 3)]),  # once per DCP rank
])
def test_namespace_counts(name: str, sizes: str, expected: list[tuple[int, int]]) -> None:
    lookup = lookup_namespaces(load_spec(name), topo(sizes))
    assert [(ns.tp_rank, ns.dcp_rank) for ns in lookup] == expected


def test_hybrid_under_dcp_and_pp() -> None:
    spec = load_spec("tiny-hybrid")
    lookup = lookup_namespaces(spec, topo("tp=4,dcp=2,pp=2"))
    attn = [ns for ns in lookup if ns.region == "attn"]
    state = [ns for ns in lookup if ns.region == "state"]
    assert len(attn) == 8  # 4 TP ranks x 2 stages, DCP ranks 1 and 3 included
    assert [(ns.tp_rank, ns.pp_rank) for ns in state] == [(0, 0), (0, 1)]  # not token-sharded
    rank = topo("tp=4,dcp=2,pp=2").with_rank(tp_rank=3, pp_rank=1)
    targets = {t.region: t for t in write_targets(spec, rank)}
    assert targets["attn"].is_writer and targets["attn"].namespace.dcp_rank == 1
    assert not targets["state"].is_writer and targets["state"].namespace.tp_rank == 0
    assert targets["attn"].tokens_per_key == 32 and targets["state"].tokens_per_key == 16


def test_replicated_heads_designated_writer() -> None:
    spec = load_spec("tiny-hybrid")  # attn has 4 KV heads
    sizes = topo("tp=8")
    flags = [write_targets(spec, r)[0].is_writer for r in sizes.ranks()]
    assert flags == [True, False] * 4
    assert namespace_for(spec, "attn", sizes.with_rank(tp_rank=5)).tp_rank == 4


def test_namespace_for_a_stage_without_the_region_is_refused() -> None:
    spec = load_spec("tiny-hybrid")  # 4 layers; pp=4 puts only layer 1 (state) on stage 1
    with pytest.raises(LayoutError) as info:
        namespace_for(spec, "attn", topo("tp=1,pp=4").with_rank(pp_rank=1))
    assert info.value.field == "region"
    assert [t.region for t in write_targets(spec, topo("tp=1,pp=4").with_rank(pp_rank=1))] \
        == ["state"]


def test_fingerprint_separates_layouts() -> None:
    a = load_spec("tiny-gqa")
    b = KVCacheSpec.from_dict({**a.to_dict(), "regions": [
        {**a.regions[0].to_dict(), "dtype": "bfloat16"}]})
    sizes = topo("tp=2")
    assert lookup_namespaces(a, sizes)[0] != lookup_namespaces(b, sizes)[0]
    assert lookup_namespaces(a, sizes)[0].fingerprint == a.fingerprint()


names = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(names, names, st.integers(1, 16), st.sampled_from((1, 2, 4)), st.integers(1, 4),
       st.integers(1, 3), st.binary(min_size=32, max_size=32), st.data())
def test_key_round_trip(model: str, region: str, tp_mult: int, dcp: int, pp: int, pcp: int,
                        digest: bytes, data: st.DataObject) -> None:
    tp = tp_mult * dcp
    tp_rank = data.draw(st.integers(0, tp - 1))
    ns = KeyNamespace(model, "0123456789abcdef", region, tp_rank, tp, data.draw(
        st.integers(0, pcp - 1)), pcp, tp_rank % dcp, dcp, data.draw(st.integers(0, pp - 1)), pp)
    assert KeyNamespace.parse(ns.encode()) == ns
    key = ns.key(digest)
    text = key.to_str()
    assert text.isascii() and text.count(":") == 8
    assert BlockKey.from_str(text) == key
    assert BlockKey.from_bytes(key.to_bytes()) == key
    assert key.to_bytes().endswith(b":" + digest)


def test_keys_from_real_hashes_and_per_region_hashes() -> None:
    spec = load_spec("tiny-hybrid")
    sizes = topo("tp=2,dcp=2")
    lookup = lookup_namespaces(spec, sizes)
    tokens = list(range(64))
    per_region = {r.name: hash_blocks(tokens, r.tokens_per_key(sizes.dcp_size))[0]
                  for r in spec.regions}
    keys = block_keys(lookup, per_region)
    assert len(keys) == len(lookup) == 3  # attn tp0, attn tp1 (dcp 1), state once
    assert {k.block_hash for k in keys if k.namespace.region == "state"} == {per_region["state"]}
    assert per_region["attn"] != per_region["state"]  # 32 tokens vs 16 tokens per key
    with pytest.raises(LayoutError) as info:
        block_keys(lookup, {"attn": per_region["attn"]})
    assert info.value.field == "block_hash"


@pytest.mark.parametrize(("text", "field"), [
    ("kvb2:m:0123456789abcdef:r:tp0-1:pcp0-1:dcp0-1:pp0-1", "namespace.version"),
    ("kvb1:m:0123456789abcdef:r:tp0-1:pcp0-1:dcp0-1", "namespace"),
    ("kvb1:m:0123456789abcdef:r:tp2-2:pcp0-1:dcp0-1:pp0-1", "namespace.tp_rank"),
    ("kvb1:m:0123456789abcdef:r:tp0-2:pcp0-1:dcp1-2:pp0-1", "namespace.dcp_rank"),
    ("kvb1:m:XYZ:r:tp0-1:pcp0-1:dcp0-1:pp0-1", "namespace.fingerprint"),
    ("kvb1:m:0123456789abcdef:r:pp0-1:pcp0-1:dcp0-1:tp0-1", "namespace.tp"),
    ("kvb1::0123456789abcdef:r:tp0-1:pcp0-1:dcp0-1:pp0-1", "namespace.model"),
])
def test_namespace_parse_errors_name_the_field(text: str, field: str) -> None:
    with pytest.raises(LayoutError) as info:
        KeyNamespace.parse(text)
    assert info.value.field == field


def test_key_parse_errors() -> None:
    ns = "kvb1:m:0123456789abcdef:r:tp0-1:pcp0-1:dcp0-1:pp0-1"
    with pytest.raises(LayoutError) as info:
        BlockKey.from_str(ns + ":abcd")
    assert info.value.field == "key.block_hash"
    with pytest.raises(LayoutError) as info:
        BlockKey.from_str(ns + ":" + "zz" * 32)
    assert info.value.field == "key.block_hash"
    with pytest.raises(LayoutError) as info:
        BlockKey.from_bytes(b"short")
    assert info.value.field == "key"
    with pytest.raises(LayoutError) as info:
        KeyNamespace.parse(ns).key(b"x" * 31)
    assert info.value.field == "block_hash"
