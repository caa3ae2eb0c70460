"""The adapter's description of vLLM KV groups and tensors in kvbridge's memory model (pure)."""

from __future__ import annotations

import pytest
import torch

from kvbridge.integrations.vllm.layout import (
    AdapterConfigError,
    GroupInfo,
    GroupKind,
    VllmFormat,
    build_spec,
    kvbridge_dtype,
    kvbridge_view,
    layer_number,
    memory_order_of,
)
from kvbridge.layouts import Interior, MemoryOrder, ParallelTopology, RegionLayout

pytestmark = pytest.mark.vllm

CPU = VllmFormat("cpu", "LBHNC", "auto")
GPU_NHD = VllmFormat("cuda", "LBNHC", "auto")


def _group(index: int = 0, kind: GroupKind = GroupKind.FULL, layers: tuple[str, ...] = (
        "model.layers.1.self_attn.attn", "model.layers.0.self_attn.attn")) -> GroupInfo:
    return GroupInfo(index, kind, "FullAttentionSpec", layers, 32, 2, 64, "float32")


def test_cpu_backend_is_a_head_kv_region_of_vllms_shape() -> None:
    adapter = build_spec("m", [_group()], CPU)
    region = adapter.spec.regions[0]
    assert region.interior is Interior.HEAD_KV and region.head_dim == 64
    assert region.layout is RegionLayout.SPLIT and not region.key_only
    assert adapter.layer_ids == {"model.layers.0.self_attn.attn": 0,
                                 "model.layers.1.self_attn.attn": 1}
    shape = adapter.spec.rank_shapes(ParallelTopology())[0]
    assert shape.tensor_shape(10) == (10, 2, 32, 128)  # vLLM's (B, H, N, K|V)
    assert shape.block_bytes_per_layer == 2 * 32 * 2 * 64 * 4
    assert dict(adapter.spec.engine_format) == {
        "engine": "vllm", "device": "cpu", "kv_cache_layout": "LBHNC", "cache_dtype": "auto",
        "attn_backend": "auto"}


def test_cpu_view_is_vllms_tensor_and_keeps_each_heads_k_then_v_bytes() -> None:
    adapter = build_spec("m", [_group()], CPU)
    full = adapter.spec.rank_shapes(ParallelTopology())[0]
    vllm_tensor = torch.arange(4 * 2 * 32 * 128, dtype=torch.float32).view(4, 2, 32, 128)
    view = kvbridge_view(vllm_tensor, full.region, full.tensor_shape(4), "l0", "LBHNC")
    assert view.data_ptr() == vllm_tensor.data_ptr() and view.shape == vllm_tensor.shape


def test_gpu_nhd_view_is_vllms_logical_view_transposed_without_a_copy() -> None:
    adapter = build_spec("m", [_group()], GPU_NHD)
    region = adapter.spec.regions[0]
    assert region.interior is Interior.TOKEN_KV and region.memory_order is MemoryOrder.NHD
    full = adapter.spec.rank_shapes(ParallelTopology())[0]
    # vLLM's LBNHC: logical (B, H, N, C) over memory (B, N, H, C)
    memory = torch.zeros(4, 32, 2, 128)
    logical = memory.permute(0, 2, 1, 3)
    view = kvbridge_view(logical, region, full.tensor_shape(4), "l0", "LBNHC")
    assert view.is_contiguous() and view.data_ptr() == memory.data_ptr()
    with pytest.raises(AdapterConfigError) as info:  # an HND tensor under an NHD promise
        kvbridge_view(memory.permute(0, 2, 1, 3).contiguous(), region, full.tensor_shape(4),
                      "l0", "LBNHC")
    assert info.value.field == "kv_cache_layout" and "LBNHC" in info.value.reason


def test_settings_kvbridge_cannot_serve_are_refused_naming_them() -> None:
    with pytest.raises(AdapterConfigError) as info:
        build_spec("m", [_group(kind=GroupKind.UNSUPPORTED)], CPU)
    assert info.value.field == "kv_cache_config.kv_cache_groups[0]"
    with pytest.raises(AdapterConfigError) as info:
        kvbridge_dtype("torch.float32", "int4")
    assert info.value.field == "kv_cache_dtype"
    assert kvbridge_dtype("torch.uint8", "fp8_e5m2") == "float8_e5m2"
    with pytest.raises(AdapterConfigError):
        layer_number("lm_head")
    with pytest.raises(AdapterConfigError) as info:
        memory_order_of("BLHNC")
    assert info.value.field == "kv_cache_layout" and "VLLM_KV_CACHE_LAYOUT" in info.value.reason
    assert memory_order_of("NHD") is MemoryOrder.NHD
    assert memory_order_of("LBNHC", num_kv_heads_local=1) is MemoryOrder.HND  # MLA


def test_groups_become_regions_in_order_with_global_layer_ids() -> None:
    full = _group(0, GroupKind.FULL, ("model.layers.0.attn", "model.layers.2.attn"))
    window = GroupInfo(1, GroupKind.SLIDING_WINDOW, "SlidingWindowSpec",
                       ("model.layers.1.attn", "model.layers.3.attn"), 32, 2, 64, "bfloat16")
    adapter = build_spec("m", [full, window], GPU_NHD)
    assert [r.layer_ids for r in adapter.spec.regions] == [(0, 2), (1, 3)]
    assert not adapter.spec.regions[1].token_sharded
    assert adapter.group_of_region == (0, 1)


def test_mla_group_is_a_key_only_replicated_latent() -> None:
    mla = GroupInfo(0, GroupKind.MLA, "MLAAttentionSpec", ("model.layers.0.self_attn.attn",),
                    16, 1, 576, "float16")
    region = build_spec("m", [mla], CPU, tp_size=2).spec.regions[0]
    assert region.key_only and region.layout is RegionLayout.REPLICATE
    assert region.interior is Interior.KV_OUTER and region.head_dim == 576


def test_connector_asks_vllm_for_hnd_except_for_mla_and_piecewise_only_for_push() -> None:
    from types import SimpleNamespace

    from tests.conftest import require

    connector = require("kvbridge.integrations.vllm.connector")
    cls = connector.KVBridgeNixlConnector
    def config(use_mla: bool, block_size: int = 16) -> SimpleNamespace:
        return SimpleNamespace(model_config=SimpleNamespace(use_mla=use_mla),
                               cache_config=SimpleNamespace(block_size=block_size))

    for block in (16, 32, 64, 8):
        assert cls.get_required_kvcache_layout(config(False, block)) == "LBHNC"
    # a block size some GPU backend splits into kernel blocks: LBNHC, which kvbridge
    # regroups at any split (LBHNC with several heads it would refuse at start-up)
    for block in (128, 48, 256):
        assert cls.get_required_kvcache_layout(config(False, block)) == "LBNHC"
    assert cls.get_required_kvcache_layout(config(True)) is None
    assert cls.get_required_kvcache_layout(config(True, 128)) is None
    assert cls.requires_piecewise_for_cudagraph({"mode": "push"})
    assert not cls.requires_piecewise_for_cudagraph({"mode": "pull"})
    assert not cls.requires_piecewise_for_cudagraph({})
