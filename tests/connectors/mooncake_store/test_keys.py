"""Pure key and lookup arithmetic of the Mooncake store connector (no store needed)."""

from __future__ import annotations

import pytest

from kvbridge.connectors import ConfigError
from kvbridge.connectors.mooncake_store import (
    leading_hits,
    matched_tokens,
    parse_settings,
    region_lookups,
    store_key,
)
from kvbridge.connectors.mooncake_store.keys import missing_blocks
from kvbridge.layouts import KeyNamespace, ParallelTopology, load_spec, namespace_for

H = bytes(range(32))


def test_store_key_names_namespace_layer_and_hash() -> None:
    spec = load_spec("tiny-gqa")
    ns = namespace_for(spec, "attn", ParallelTopology(tp_size=2, dcp_size=2).with_rank(tp_rank=1))
    key = store_key(ns, 3, H)
    namespace, layer, digest = key.rsplit(":", 2)
    assert KeyNamespace.parse(namespace) == ns
    assert layer == "L3" and bytes.fromhex(digest) == H
    assert ns.dcp_rank == 1 and ns.tp_rank == 1


def test_dcp_lookup_checks_every_dcp_rank_and_layer() -> None:
    spec = load_spec("tiny-gqa")
    (attn,) = region_lookups(spec, ParallelTopology(tp_size=2, dcp_size=2))
    namespaces = {KeyNamespace.parse(p.rsplit(":", 2)[0]) for p in attn.prefixes}
    assert {ns.dcp_rank for ns in namespaces} == {0, 1}
    assert len(attn.prefixes) == 2 * 4  # two DCP namespaces x four layers
    # one digest record per namespace (removal deletes them with the layer objects)
    assert [KeyNamespace.parse(p.rsplit(":", 2)[0]) for p in attn.record_prefixes] == sorted(
        namespaces, key=lambda ns: ns.dcp_rank)
    assert all(p.endswith(":D1:") for p in attn.record_prefixes)
    assert attn.tokens_per_key == 32    # token-sharded: block_size * dcp_size
    keys = attn.keys([H, H[::-1]])
    assert len(keys) == 16 and keys[0].endswith(H.hex()) and keys[8].endswith(H[::-1].hex())


def test_replicated_region_is_stored_once_without_dcp() -> None:
    spec = load_spec("tiny-mla")
    (mla,) = region_lookups(spec, ParallelTopology(tp_size=2))
    assert {KeyNamespace.parse(p.rsplit(":", 2)[0]).tp_rank for p in mla.prefixes} == {0}
    (mla_dcp,) = region_lookups(spec, ParallelTopology(tp_size=2, dcp_size=2))
    assert {KeyNamespace.parse(p.rsplit(":", 2)[0]).tp_rank for p in mla_dcp.prefixes} == {0, 1}


def test_pipeline_stages_each_contribute_their_layers() -> None:
    spec = load_spec("tiny-hybrid")
    attn, state = region_lookups(spec, ParallelTopology(pp_size=2))
    by_stage: dict[int, set[str]] = {}
    for prefix in attn.prefixes + state.prefixes:
        ns_text, layer = prefix.rstrip(":").rsplit(":", 1)
        by_stage.setdefault(KeyNamespace.parse(ns_text).pp_rank, set()).add(layer)
    assert by_stage == {0: {"L0", "L1"}, 1: {"L2", "L3"}}


def test_leading_hits_and_missing_blocks() -> None:
    exists = [True, True, True, False, True, True]  # 3 blocks of 2 keys
    assert leading_hits(exists, 2) == 1
    assert missing_blocks(exists, 2) == [1]
    assert leading_hits([True] * 4, 2) == 2
    assert leading_hits([], 2) == 0
    with pytest.raises(ValueError):
        leading_hits([True] * 3, 2)


def test_matched_tokens_floors_to_lcm_of_regions() -> None:
    assert matched_tokens([3], [16]) == 48
    assert matched_tokens([3, 5], [32, 16]) == 64   # 80 covered by state, 96 by attn -> 64
    assert matched_tokens([1, 1], [32, 16]) == 0    # 16 tokens is not a whole attn key


def test_settings_name_the_bad_key() -> None:
    base = {"master_address": "127.0.0.1:1", "metadata_server": "http://127.0.0.1:2/metadata"}
    settings = parse_settings({**base, "op_timeout_s": 2})
    assert settings.lookup_timeout_s == 3.0 and settings.load_async
    assert parse_settings(settings.to_extra()) == settings
    for bad, field in (({}, "master_address"), ({**base, "bogus": 1}, "bogus"),
                       ({**base, "op_timeout_s": 0}, "op_timeout_s"),
                       ({**base, "load_async": "yes"}, "load_async"),
                       ({**base, "client_scope": "node"}, "client_scope"),
                       ({**base, "global_segment_size": -1}, "global_segment_size")):
        with pytest.raises(ConfigError) as info:
            parse_settings(bad)
        assert field in info.value.field


def test_last_layer_lookup_checks_one_key_per_namespace() -> None:
    spec = load_spec("tiny-hybrid")
    attn, state = region_lookups(spec, ParallelTopology(tp_size=2, pp_size=2),
                                 every_layer=False)
    # attn: 2 TP namespaces x 2 stages, one layer each; state (replicated): 1 x 2 stages
    assert [p.rstrip(":").rsplit(":", 1)[1] for p in attn.prefixes] == ["L0", "L0", "L2", "L2"]
    assert [p.rstrip(":").rsplit(":", 1)[1] for p in state.prefixes] == ["L1", "L3"]


def test_gather_addresses_blocks_and_refuses_out_of_range_ids() -> None:
    from kvbridge.connectors.mooncake_store.metadata import LoadBlock
    from kvbridge.connectors.mooncake_store.worker import LayerSlot, RegionPlan, gather

    plans = (RegionPlan(0, 8, True, (LayerSlot(0, "a:L0:", 1000, 64, 64),
                                     LayerSlot(1, "a:L1:", 9000, 64, 64))),
             RegionPlan(1, 8, False, (LayerSlot(2, "b:L2:", 5000, 32, 32),)),
             RegionPlan(2, 8, True, ()))  # no layer of region 2 on this rank
    blocks = [LoadBlock(0, 3, H), LoadBlock(1, 2, H), LoadBlock(0, 8, H), LoadBlock(2, 1, H)]
    batch, out_of_range = gather(plans, blocks, writers_only=False)
    assert out_of_range == {2}  # block id 8 of an 8-block region is never addressed
    assert batch.keys == ["a:L0:" + H.hex(), "a:L1:" + H.hex(), "b:L2:" + H.hex()]
    assert batch.ptrs == [1000 + 3 * 64, 9000 + 3 * 64, 5000 + 2 * 32]
    assert batch.sizes == [64, 64, 32] and batch.owners == [0, 0, 1]
    writes, _ = gather(plans, blocks, writers_only=True)
    assert writes.owners == [0, 0]  # region 1 has another writer


def test_gather_of_one_region_matches_per_block_addresses() -> None:
    from kvbridge.connectors.mooncake_store.metadata import SaveBlock
    from kvbridge.connectors.mooncake_store.worker import LayerSlot, RegionPlan, gather
    from kvbridge.events import BlockStored

    event = BlockStored(block_hashes=(H,), parent_block_hash=None, token_ids=(), block_size=16)
    plans = (RegionPlan(0, 4, True, (LayerSlot(0, "a:L0:", 1000, 64, 64),
                                     LayerSlot(1, "a:L1:", 9000, 64, 64))),)
    hashes = [bytes([i]) * 32 for i in range(5)]
    blocks = [SaveBlock(0, b, h, event) for b, h in zip((2, 0, 4, 3, -1), hashes, strict=True)]
    batch, out_of_range = gather(plans, blocks, writers_only=True)
    assert out_of_range == {2, 4}  # ids 4 and -1 of a 4-block region
    kept = [(2, hashes[0]), (0, hashes[1]), (3, hashes[3])]
    assert batch.keys == ([f"a:L0:{h.hex()}" for _, h in kept]
                          + [f"a:L1:{h.hex()}" for _, h in kept])
    assert batch.ptrs == [1000 + b * 64 for b, _ in kept] + [9000 + b * 64 for b, _ in kept]
    assert batch.sizes == [64] * 6 and batch.owners == [0, 1, 3] * 2
    empty, none = gather(plans, [], writers_only=False)
    assert empty.keys == [] and none == set()
