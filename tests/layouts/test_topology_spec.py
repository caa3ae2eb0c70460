"""Topology and spec validation: every error names the field and the rule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.layouts import (
    KVCacheSpec,
    LayoutError,
    ParallelTopology,
    RegionSpec,
    load_spec,
    preset_names,
)


@pytest.mark.parametrize(("kwargs", "field", "hint"), [
    ({"tp_size": 0}, "tp_size", ">= 1"),
    ({"pp_size": -1}, "pp_size", ">= 1"),
    ({"tp_size": 2, "tp_rank": 2}, "tp_rank", "[0, 2)"),
    ({"pp_size": 2, "pp_rank": 5}, "pp_rank", "[0, 2)"),
    ({"tp_size": 6, "dcp_size": 4}, "dcp_size", "multiple of dcp_size"),
    ({"tp_size": True}, "tp_size", ">= 1"),
])
def test_topology_errors(kwargs: dict[str, Any], field: str, hint: str) -> None:
    with pytest.raises(LayoutError) as info:
        ParallelTopology(**kwargs)
    assert info.value.field == field and hint in str(info.value)


@pytest.mark.parametrize(("text", "field"), [
    ("tp=4,bogus=1", "producer"),
    ("tp=x", "producer.tp"),
    ("tp=2,tp=4", "producer.tp"),
    ("tp=6,dcp=4", "producer.dcp_size"),
    ("tp=0", "producer.tp_size"),
])
def test_topology_parse_errors(text: str, field: str) -> None:
    with pytest.raises(LayoutError) as info:
        ParallelTopology.parse(text, "producer")
    assert info.value.field == field


def test_topology_dcp_carves_tp() -> None:
    t = ParallelTopology(tp_size=8, dcp_size=2, tp_rank=5)
    assert (t.dcp_rank, t.head_group, t.num_head_groups) == (1, 2, 4)
    assert len(list(ParallelTopology(tp_size=2, pp_size=3, pcp_size=2).ranks())) == 12
    assert ParallelTopology.parse("tp=4, pp=2").describe() == "tp=4,pp=2,dcp=1,pcp=1"


def _region(**over: Any) -> dict[str, Any]:
    base = {"name": "attn", "layout": "split", "layer_ids": [0, 1], "block_size": 16,
            "num_kv_heads": 4, "head_dim": 8, "dtype": "float16"}
    base.update(over)
    return base


@pytest.mark.parametrize(("regions", "field"), [
    ([_region(dtype="float13")], "regions[0].dtype"),
    ([_region(dtype=["float16"])], "regions[0].dtype"),  # unhashable: was a TypeError
    ([_region(layout="sideways")], "regions[0].layout"),
    ([_region(memory_order="DHN")], "regions[0].memory_order"),
    ([_region(block_size=0)], "regions[0].block_size"),
    ([_region(extra=1)], "regions[0].extra"),
    ([_region(layer_ids=[0, 0])], "regions[0].layer_ids"),
    ([_region(layer_ids=[0, 2])], "regions"),
    ([_region(), _region(name="b", layer_ids=[1, 2])], "regions[1].layer_ids"),
    ([_region(), _region(layer_ids=[2])], "regions[1].name"),
    ([{k: v for k, v in _region().items() if k != "head_dim"}], "regions[0].head_dim"),
    ([], "regions"),
])
def test_spec_errors_name_the_field(regions: list[dict[str, Any]], field: str) -> None:
    with pytest.raises(LayoutError) as info:
        KVCacheSpec.from_dict({"model": "m", "regions": regions})
    assert info.value.field == field


def test_spec_file_round_trip_and_errors(tmp_path: Path) -> None:
    spec = load_spec("tiny-hybrid")
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec.to_dict()))
    loaded = load_spec(str(path))
    assert loaded == spec and loaded.fingerprint() == spec.fingerprint()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(LayoutError) as info:
        load_spec(str(bad))
    assert info.value.field == "model" and "invalid JSON" in str(info.value)
    with pytest.raises(LayoutError) as info:
        load_spec("no-such-preset")
    assert info.value.field == "model" and "tiny-gqa" in str(info.value)


def test_unshardable_heads_name_tp_size() -> None:
    spec = load_spec("tiny-gqa")  # 8 KV heads
    with pytest.raises(LayoutError) as info:
        spec.validate_topology(ParallelTopology(tp_size=3), "consumer")
    assert info.value.field == "consumer.tp_size"
    with pytest.raises(LayoutError) as info:
        spec.validate_topology(ParallelTopology(pp_size=5), "producer")
    assert info.value.field == "producer.pp_size"


def test_rank_shapes_and_bytes() -> None:
    spec = load_spec("tiny-hybrid")
    attn, state = spec.rank_shapes(ParallelTopology(tp_size=2, tp_rank=1))
    assert (attn.head_start, attn.num_heads, attn.layer_ids) == (2, 2, (0, 2))
    assert attn.tensor_shape(10) == (10, 2, 2, 16, 32)
    assert attn.block_bytes_per_layer == 2 * 2 * 16 * 32 * 2
    assert (state.head_start, state.num_heads) == (0, 2)  # REPLICATE: every head
    assert state.tensor_shape(3) == (3, 1, 2, 16, 64)
    nhd = spec.rank_shapes(ParallelTopology())[0]
    assert nhd.block_shape == (4, 16, 32)
    assert load_spec("tiny-gqa-nhd").rank_shapes(ParallelTopology())[0].block_shape == (16, 8, 32)
    replicated = spec.rank_shapes(ParallelTopology(tp_size=8, tp_rank=3))[0]
    assert (replicated.head_start, replicated.num_heads) == (1, 1)
    for name in preset_names():
        assert load_spec(name).fingerprint() == load_spec(name).fingerprint()


def test_region_spec_direct_errors() -> None:
    with pytest.raises(LayoutError) as info:
        RegionSpec.from_dict(_region(key_only="yes"), "r")
    assert info.value.field == "r.key_only"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**20) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=3),
    max_leaves=6)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(_region())), json_values)
def test_spec_from_any_json_raises_only_layout_error(field: str, value: object) -> None:
    """A spec file with any value in any field loads or gets a LayoutError naming a field."""
    try:
        spec = KVCacheSpec.from_dict({"model": "m", "regions": [_region(**{field: value})]})
    except LayoutError as exc:
        assert exc.field.startswith(("regions", "model"))
    else:
        assert spec.regions[0].to_dict()[field] is not None


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30))
def test_topology_parse_any_text_raises_only_layout_error(text: str) -> None:
    try:
        ParallelTopology.parse(text, "consumer")
    except LayoutError as exc:
        assert exc.field.startswith("consumer")
