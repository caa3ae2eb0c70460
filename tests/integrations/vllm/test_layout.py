"""The adapter's description of vLLM KV groups and tensors in kvbridge's memory model (pure)."""

from __future__ import annotations

import pytest
import torch

from kvbridge.integrations.vllm.layout import (
    AdapterConfigError,
    GroupInfo,
    GroupKind,
    TensorLayout,
    build_spec,
    kvbridge_dtype,
    kvbridge_view,
    layer_number,
)
from kvbridge.layouts import ParallelTopology, RegionLayout

pytestmark = pytest.mark.vllm


def _group(index: int = 0, kind: GroupKind = GroupKind.FULL, layers: tuple[str, ...] = (
        "model.layers.1.self_attn.attn", "model.layers.0.self_attn.attn")) -> GroupInfo:
    return GroupInfo(index, kind, "FullAttentionSpec", layers, 32, 2, 64, "float32")


def test_cpu_packed_layout_is_a_key_only_region_of_double_head_dim() -> None:
    adapter = build_spec("m", [_group()], TensorLayout.CPU_PACKED)
    region = adapter.spec.regions[0]
    assert region.key_only and region.head_dim == 128 and region.layout is RegionLayout.SPLIT
    assert adapter.layer_ids == {"model.layers.0.self_attn.attn": 0,
                                 "model.layers.1.self_attn.attn": 1}
    shape = adapter.spec.rank_shapes(ParallelTopology())[0]
    assert shape.tensor_shape(10) == (10, 1, 2, 32, 128)
    # the bytes of one block are the same as vLLM's (blocks, heads, tokens, 2*head) tensor
    assert shape.block_bytes_per_layer == 2 * 32 * 2 * 64 * 4


def test_cpu_packed_view_keeps_each_heads_k_then_v_bytes() -> None:
    adapter = build_spec("m", [_group()], TensorLayout.CPU_PACKED)
    shape = adapter.spec.rank_shapes(ParallelTopology(tp_size=2, tp_rank=1))[0]
    assert (shape.head_start, shape.num_heads) == (1, 1)
    vllm_tensor = torch.arange(4 * 2 * 32 * 128, dtype=torch.float32).view(4, 2, 32, 128)
    full = adapter.spec.rank_shapes(ParallelTopology())[0]
    view = kvbridge_view(vllm_tensor, TensorLayout.CPU_PACKED, full.tensor_shape(4), "l0")
    assert view.data_ptr() == vllm_tensor.data_ptr()
    # vLLM's CPU kernel: view (blocks, heads, 2*tokens, head) and chunk -> K, V
    k, v = vllm_tensor.view(4, 2, 64, 64).chunk(2, dim=2)
    head = view[3, 0, 1].reshape(-1)  # block 3, head 1: one contiguous run in kvbridge's view
    assert torch.equal(head[: 32 * 64], k[3, 1].reshape(-1))
    assert torch.equal(head[32 * 64:], v[3, 1].reshape(-1))


def test_wrong_tensor_shape_is_refused_naming_the_layout() -> None:
    adapter = build_spec("m", [_group()], TensorLayout.CPU_PACKED)
    full = adapter.spec.rank_shapes(ParallelTopology())[0]
    with pytest.raises(AdapterConfigError) as info:
        kvbridge_view(torch.zeros(4, 2, 2, 32, 64), TensorLayout.CPU_PACKED,
                      full.tensor_shape(4), "l0")
    assert info.value.field == "kv_cache_layout"


def test_settings_kvbridge_cannot_serve_are_refused_naming_them() -> None:
    with pytest.raises(AdapterConfigError) as info:
        build_spec("m", [_group()], TensorLayout.CPU_PACKED, dcp_size=2)
    assert info.value.field == "decode_context_parallel_size"
    with pytest.raises(AdapterConfigError) as info:
        build_spec("m", [_group(kind=GroupKind.UNSUPPORTED)], TensorLayout.CPU_PACKED)
    assert info.value.field == "kv_cache_config.kv_cache_groups[0]"
    with pytest.raises(AdapterConfigError) as info:
        kvbridge_dtype("torch.float32", "int4")
    assert info.value.field == "kv_cache_dtype"
    assert kvbridge_dtype("torch.uint8", "fp8_e5m2") == "float8_e5m2"
    with pytest.raises(AdapterConfigError):
        layer_number("lm_head")


def test_groups_become_regions_in_order_with_global_layer_ids() -> None:
    full = _group(0, GroupKind.FULL, ("model.layers.0.attn", "model.layers.2.attn"))
    window = GroupInfo(1, GroupKind.SLIDING_WINDOW, "SlidingWindowSpec",
                       ("model.layers.1.attn", "model.layers.3.attn"), 32, 2, 64, "bfloat16")
    adapter = build_spec("m", [full, window], TensorLayout.NATIVE_HND)
    assert [r.layer_ids for r in adapter.spec.regions] == [(0, 2), (1, 3)]
    assert not adapter.spec.regions[1].token_sharded
    assert adapter.group_of_region == (0, 1)
