"""vLLM's real KV cache formats, built by vLLM's own allocator, described by kvbridge to the byte.

Every case allocates KV caches with vLLM's ``allocate_kv_cache`` (the code the
model runner calls) from vLLM's own spec classes, fills them through the
reading of vLLM's attention code (GPU: ``kv.transpose(1, 2).split(head_size,
-1)``; CPU: ``view(B, H, 2 * N, D).chunk(2, dim=2)``; MLA: the latent row),
hands them to the adapter, executes the transfer plan's descriptors between a
producer and a consumer engine of other TP sizes, and reads the consumer's
caches back the way vLLM's attention would. The refused formats are asserted to
fail at start-up with the message naming the setting.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.conftest import require_vllm_env

pytestmark = pytest.mark.vllm

HEADS, HEAD, TOKENS, BLOCKS, LAYERS = 4, 8, 16, 6, 2


@pytest.fixture(scope="module")
def v() -> Any:
    require_vllm_env()
    return load_vllm()


def load_vllm() -> Any:
    """vLLM's allocator, spec classes and layouts (also used by ``nixl_format_peer.py``)."""
    import torch
    from vllm.v1 import kv_cache_interface as kvi
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    class NS:
        pass

    ns = NS()
    ns.torch, ns.kvi, ns.Layout, ns.allocate = torch, kvi, KVCacheLayout, allocate_kv_cache
    return ns


def _config(v: Any, specs: dict[str, Any], layout: Any, groups: list[list[str]],
            num_blocks: int = BLOCKS) -> Any:
    """A KVCacheConfig the way vLLM's ``get_kv_cache_config_from_groups`` builds one: one
    backing buffer; every group's layers laid out from byte 0, so layer j of each group
    aliases the same bytes (the hybrid allocator)."""
    kvi = v.kvi
    page = max(s.page_size_bytes for s in specs.values())
    n = max(len(g) for g in groups)
    tensors = []
    for names in groups:
        fixed = page * n if layout.is_block_outermost else None
        layer_stride, block_stride, _, _, _ = kvi.compute_layout_strides(
            specs[names[0]], num_blocks, len(names), layout,
            fixed_strides=(None, fixed, None, None, None))
        tensors.append(kvi.KVCacheTensor(size=page * num_blocks * n, layers=names,
                                         layer_stride=layer_stride, block_stride=block_stride))
    group_specs = [kvi.KVCacheGroupSpec(names, specs[names[0]]) for names in groups]
    return kvi.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                             kv_cache_groups=group_specs)


def _full(v: Any, heads: int, dtype: Any = None, block: int = TOKENS, **kw: Any) -> Any:
    return v.kvi.FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=HEAD,
                                   dtype=dtype or v.torch.float16, **kw)


def _adapter(v: Any, config: Any, device: str, layout: str, tp: int, cache_dtype: str = "auto"):
    from kvbridge.integrations.vllm.connector import _group_info
    from kvbridge.integrations.vllm.layout import VllmFormat, build_spec

    groups = [_group_info(i, g, HEADS, cache_dtype) for i, g in enumerate(config.kv_cache_groups)]
    return build_spec("m", groups, VllmFormat(device, layout, cache_dtype), tp)


def _engine(v: Any, device: str, layout_name: str, tp: int, make_specs, cache_dtype="auto",
            kernel: int | None = None):
    """Per TP rank: vLLM's allocated caches, the adapter's views and LayerMemory.

    ``kernel``: the attention backend's kernel block size; vLLM then views every
    manager block as kernel blocks (``allocate_kv_cache(kernel_block_sizes=...)``)."""
    from kvbridge.connectors.api import KVCaches
    from kvbridge.integrations.vllm.layout import kvbridge_view
    from kvbridge.layouts import ParallelTopology
    from kvbridge.layouts.plan import LayerMemory

    layout = v.Layout[layout_name]
    ranks = []
    for rank in range(tp):
        specs, groups = make_specs(HEADS // tp)
        config = _config(v, specs, layout, groups)
        kernels = None if kernel is None else [kernel] * len(groups)
        caches = v.allocate(config, v.torch.device("cpu"), layout, kernel_block_sizes=kernels)
        adapter = _adapter(v, config, device, layout_name, tp, cache_dtype)
        topology = ParallelTopology(tp_size=tp, tp_rank=rank)
        shapes = adapter.spec.rank_shapes(topology)
        views, memory = {}, {}
        for shape in shapes:
            for lid in shape.layer_ids:
                name = next(n for n, i in adapter.layer_ids.items() if i == lid)
                view = kvbridge_view(caches[name], shape.region, shape.tensor_shape(BLOCKS),
                                     name, layout_name, manager_blocks=BLOCKS)
                views[lid] = view
        kv = KVCaches(shapes, tuple(BLOCKS for _ in shapes), views)
        for lid in views:
            memory[lid] = LayerMemory(int(views[lid].data_ptr()), kv.block_stride(lid), BLOCKS)
        ranks.append({"caches": caches, "adapter": adapter, "memory": memory, "kv": kv,
                      "topology": topology})
    return ranks


def _move(producer: list[dict], consumer: list[dict], p_ids: list[int], c_ids: list[int]):
    from kvbridge.layouts import ParallelTopology
    from kvbridge.layouts.plan import absolute_descriptors, plan_transfer

    spec = producer[0]["adapter"].spec
    assert spec.fingerprint() == consumer[0]["adapter"].spec.fingerprint()
    plan = plan_transfer(spec, ParallelTopology(tp_size=len(producer)),
                         ParallelTopology(tp_size=len(consumer)))
    for index, rank in enumerate(consumer):
        for d in absolute_descriptors(plan.for_consumer(index), rank["memory"],
                                      {i: r["memory"] for i, r in enumerate(producer)},
                                      c_ids, p_ids):
            for (c_addr, length), (p_addr, _) in zip(d.consumer, d.producer, strict=True):
                ctypes.memmove(int(c_addr), int(p_addr), int(length))


def _kv_of(tensor: Any, device: str, layout: str) -> tuple[Any, Any]:
    """K and V as (blocks, heads, tokens, head) the way vLLM's attention reads the view."""
    if device == "cpu":  # cpu_attn.py
        b, h, n, _ = tensor.shape
        k, val = tensor.view(b, h, n * 2, -1).chunk(2, dim=2)
        return k, val
    k, val = tensor.transpose(1, 2).split(HEAD, dim=-1)  # flash_attn.py: (B, N, H, D)
    return k.transpose(1, 2), val.transpose(1, 2)


def _dense(heads: int, dtype_name: str = "float16", block: int = TOKENS):
    def make(v: Any, local: int):
        dtype = getattr(v.torch, dtype_name)
        specs = {f"model.layers.{i}.attn": _full(v, local, dtype, block)
                 for i in range(LAYERS)}
        return specs, [list(specs)]
    return make


CASES = [("cuda", "LBNHC"), ("cuda", "LBHNC"), ("cpu", "LBHNC")]


P_IDS, C_IDS = [5, 1, 3], [2, 4, 1]


def dense_engine(v: Any, device: str, layout: str, tp: int, block: int = TOKENS,
                 kernel: int | None = None) -> list[dict]:
    make = _dense(HEADS, block=block)
    return _engine(v, device, layout, tp, lambda n: make(v, n), kernel=kernel)


def _as_kernel_blocks(x: Any, ratio: int) -> Any:
    """Manager blocks ``(B, H, M, D)`` as the attention reads them through a kernel-block
    table: manager block b is kernel blocks ``b*R .. b*R+R-1`` of ``M / R`` tokens each."""
    b, h, m, d = x.shape
    return x.reshape(b, h, ratio, m // ratio, d).transpose(1, 2).reshape(b * ratio, h,
                                                                         m // ratio, d)


def fill_dense(v: Any, producer: list[dict], device: str, layout: str,
               block: int = TOKENS) -> Any:
    """Write one seeded logical K/V (global heads) into every producer rank through vLLM's
    own reading of the view (kernel blocks, where vLLM split the blocks); returns it (the
    same in every process)."""
    torch = v.torch
    tp = len(producer)
    gen = torch.Generator().manual_seed(3)
    logical = torch.randn(LAYERS, 2, BLOCKS, HEADS, block, HEAD, generator=gen).half()
    for r, rank in enumerate(producer):
        lo, n = r * HEADS // tp, HEADS // tp
        for lay in range(LAYERS):
            k, val = _kv_of(rank["caches"][f"model.layers.{lay}.attn"], device, layout)
            ratio = k.shape[0] // BLOCKS
            k.copy_(_as_kernel_blocks(logical[lay, 0, :, lo:lo + n], ratio))
            val.copy_(_as_kernel_blocks(logical[lay, 1, :, lo:lo + n], ratio))
    return logical


def check_dense(v: Any, consumer: list[dict], device: str, layout: str, logical: Any) -> None:
    """Each consumer rank's heads, read the way vLLM's attention reads them (through the
    kernel-block table where vLLM split the blocks), are the producer's blocks ``P_IDS``
    in blocks ``C_IDS``."""
    torch = v.torch
    tp = len(consumer)
    for r, rank in enumerate(consumer):
        lo, n = r * HEADS // tp, HEADS // tp
        for lay in range(LAYERS):
            k, val = _kv_of(rank["caches"][f"model.layers.{lay}.attn"], device, layout)
            ratio = k.shape[0] // BLOCKS
            for p, c in zip(P_IDS, C_IDS, strict=True):
                got_k, got_v = k[c * ratio:(c + 1) * ratio], val[c * ratio:(c + 1) * ratio]
                want = logical[lay, :, p:p + 1, lo:lo + n]
                assert torch.equal(got_k, _as_kernel_blocks(want[0], ratio)), (r, lay, p, c)
                assert torch.equal(got_v, _as_kernel_blocks(want[1], ratio)), (r, lay, p, c)


@pytest.mark.parametrize(("device", "layout"), CASES, ids=[f"{d}-{lay}" for d, lay in CASES])
@pytest.mark.parametrize(("p_tp", "c_tp"), [(2, 1), (1, 2)])
def test_dense_formats_move_each_head_to_the_byte(v, device: str, layout: str, p_tp: int,
                                                  c_tp: int) -> None:
    producer = dense_engine(v, device, layout, p_tp)
    consumer = dense_engine(v, device, layout, c_tp)
    logical = fill_dense(v, producer, device, layout)
    _move(producer, consumer, P_IDS, C_IDS)
    check_dense(v, consumer, device, layout, logical)
    region = producer[0]["adapter"].spec.regions[0]
    assert region.interior.value == ("head_kv" if device == "cpu" else "token_kv")


def test_fp8_cache_is_uint8_storage_moved_as_bytes(v) -> None:
    torch = v.torch
    make = _dense(HEADS, "uint8")
    producer = _engine(v, "cuda", "LBHNC", 2, lambda n: make(v, n), cache_dtype="fp8")
    consumer = _engine(v, "cuda", "LBHNC", 1, lambda n: make(v, n), cache_dtype="fp8")
    region = producer[0]["adapter"].spec.regions[0]
    assert region.dtype == "float8_e4m3fn" and region.elem_bytes == 1
    assert dict(producer[0]["adapter"].spec.engine_format)["cache_dtype"] == "fp8"
    for r, rank in enumerate(producer):
        for lay in range(LAYERS):
            t = rank["caches"][f"model.layers.{lay}.attn"]
            t.copy_(torch.randint(0, 255, t.shape, dtype=torch.uint8,
                                  generator=torch.Generator().manual_seed(r * 10 + lay)))
    _move(producer, consumer, [0, 4], [3, 5])
    for lay in range(LAYERS):
        got = consumer[0]["caches"][f"model.layers.{lay}.attn"]
        for r, rank in enumerate(producer):
            src = rank["caches"][f"model.layers.{lay}.attn"]
            assert torch.equal(got[3, r * 2:(r + 1) * 2], src[0])
            assert torch.equal(got[5, r * 2:(r + 1) * 2], src[4])


def test_scaled_fp8_formats_are_refused_by_name() -> None:
    require_vllm_env()
    from kvbridge.integrations.vllm.layout import AdapterConfigError, kvbridge_dtype

    for name in ("fp8_per_token_head", "nvfp4", "turboquant_k8v4", "fp8_ds_mla"):
        with pytest.raises(AdapterConfigError) as info:
            kvbridge_dtype("torch.uint8", name)
        assert info.value.field == "kv_cache_dtype" and name in str(info.value)
        assert "scaled/quantized" in info.value.reason


def test_mla_padded_pages_replicate_key_only_latent(v) -> None:
    """MLA: one 576-wide latent per token, head_size_v 0, pages padded to 64 bytes more:
    a key-only REPLICATE region, block stride from the tensor, bytes to the byte."""
    torch = v.torch
    latent = 576

    def make(local: int):
        page = TOKENS * latent * 2
        specs = {f"model.layers.{i}.self_attn.attn": v.kvi.MLAAttentionSpec(
            block_size=TOKENS, num_kv_heads=1, head_size=latent, dtype=torch.float16,
            page_size_padded=page + 64) for i in range(LAYERS)}
        return specs, [list(specs)]

    producer = _engine(v, "cpu", "LBNHC", 2, make)
    consumer = _engine(v, "cpu", "LBNHC", 1, make)
    region = producer[0]["adapter"].spec.regions[0]
    assert region.key_only and region.layout.value == "replicate" and region.head_dim == latent
    stride = producer[0]["kv"].block_stride(0)
    assert stride == TOKENS * latent * 2 + 64  # the padded page, not the block's bytes
    gen = torch.Generator().manual_seed(5)
    for rank in producer:
        for lay in range(LAYERS):
            t = rank["caches"][f"model.layers.{lay}.self_attn.attn"]
            t.copy_(torch.randn(t.shape, generator=gen).half())
    _move(producer, consumer, [1, 2], [4, 0])
    for lay in range(LAYERS):
        got = consumer[0]["caches"][f"model.layers.{lay}.self_attn.attn"]
        src = producer[0]["caches"][f"model.layers.{lay}.self_attn.attn"]  # rank 0 serves TP1
        assert torch.equal(got[4], src[1]) and torch.equal(got[0], src[2])


def test_hybrid_groups_alias_one_backing_storage_registered_once(v) -> None:
    """Full-attention and sliding-window groups: layer j of each group aliases slot j's
    bytes; one region per group, the handshake accepts the aliases, one storage span."""
    torch = v.torch
    from kvbridge.handshake.schema import AgentMetadata

    def make(local: int):
        full = {f"model.layers.{i}.attn": _full(v, local) for i in (1, 3)}
        window = {f"model.layers.{i}.attn": v.kvi.SlidingWindowSpec(
            block_size=TOKENS, num_kv_heads=local, head_size=HEAD, dtype=torch.float16,
            sliding_window=32) for i in (0, 2)}
        return {**full, **window}, [list(window), list(full)]

    producer = _engine(v, "cpu", "LBHNC", 1, make)
    consumer = _engine(v, "cpu", "LBHNC", 1, make)
    adapter = producer[0]["adapter"]
    assert [r.name for r in adapter.spec.regions] == ["g0-sliding_window", "g1-full_attention"]
    assert not adapter.spec.regions[0].token_sharded
    caches = producer[0]["caches"]
    assert caches["model.layers.0.attn"].data_ptr() == caches["model.layers.1.attn"].data_ptr()
    assert len(producer[0]["kv"].backing_spans()) == 1
    addrs = {lid: int(t.data_ptr()) for lid, t in producer[0]["kv"].layers.items()}
    AgentMetadata.build("e", "a", b"", adapter.spec, producer[0]["topology"], addrs, BLOCKS)
    # per-group block ids: the window group's block 2 and the full group's block 4
    for name in caches:
        t = caches[name]
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).half())
    _move(producer, consumer, [2, 4], [1, 3])
    got, src = consumer[0]["caches"], producer[0]["caches"]
    for name in src:
        assert torch.equal(got[name][1], src[name][2]) and torch.equal(got[name][3], src[name][4])


@pytest.mark.parametrize("layout", ["BLHNC", "BLNHC", "BHLNC", "LHBNC"])
def test_block_outermost_and_head_outer_layouts_are_refused_naming_the_setting(
        v, layout: str) -> None:
    from kvbridge.integrations.vllm.layout import AdapterConfigError

    make = _dense(HEADS)
    with pytest.raises(AdapterConfigError) as info:
        _engine(v, "cuda", layout, 1, lambda n: make(v, n))
    assert info.value.field == "kv_cache_layout"
    assert layout in info.value.reason and "VLLM_KV_CACHE_LAYOUT=LBHNC" in info.value.reason


#: (producer kernel block, consumer kernel block) for 64-token manager blocks; 64 = no split.
SPLITS = [(16, 32), (16, 64), (64, 16)]


@pytest.mark.parametrize(("p_kernel", "c_kernel"), SPLITS, ids=[f"k{p}to{c}" for p, c in SPLITS])
@pytest.mark.parametrize(("p_tp", "c_tp"), [(2, 1), (1, 2)])
def test_kernel_block_split_views_move_manager_blocks_to_the_byte(
        v, p_kernel: int, c_kernel: int, p_tp: int, c_tp: int) -> None:
    """64-token manager blocks viewed by vLLM as 64 / kernel kernel blocks (LBNHC): kvbridge
    regroups them into manager blocks, so manager block ids move, engines with different
    splits (or none) pair, and each kernel block reads what the attention expects."""
    producer = dense_engine(v, "cuda", "LBNHC", p_tp, block=64, kernel=p_kernel)
    consumer = dense_engine(v, "cuda", "LBNHC", c_tp, block=64, kernel=c_kernel)
    view = producer[0]["caches"]["model.layers.0.attn"]
    assert view.shape[0] == BLOCKS * 64 // p_kernel and view.shape[2] == p_kernel
    assert producer[0]["kv"].num_blocks == (BLOCKS,)
    assert producer[0]["kv"].block_stride(0) == 64 * (HEADS // p_tp) * 2 * HEAD * 2
    logical = fill_dense(v, producer, "cuda", "LBNHC", block=64)
    _move(producer, consumer, P_IDS, C_IDS)
    check_dense(v, consumer, "cuda", "LBNHC", logical)


def test_kernel_block_split_mla_latent_moves_to_the_byte(v) -> None:
    """MLA (one latent row per token) split 64 -> 4 x 16: one head, so the kernel pages are
    one manager page; a consumer without the split reads the same bytes."""
    torch = v.torch
    latent = 576

    def make(local: int):
        specs = {f"model.layers.{i}.self_attn.attn": v.kvi.MLAAttentionSpec(
            block_size=64, num_kv_heads=1, head_size=latent, dtype=torch.float16)
            for i in range(LAYERS)}
        return specs, [list(specs)]

    producer = _engine(v, "cuda", "LBHNC", 1, make, kernel=16)
    consumer = _engine(v, "cuda", "LBHNC", 2, make)
    gen = torch.Generator().manual_seed(9)
    for lay in range(LAYERS):
        t = producer[0]["caches"][f"model.layers.{lay}.self_attn.attn"]
        assert tuple(t.shape) == (BLOCKS * 4, 1, 16, latent)
        t.copy_(torch.randn(t.shape, generator=gen).half())
    _move(producer, consumer, [1, 5], [4, 0])
    for lay in range(LAYERS):
        src = producer[0]["caches"][f"model.layers.{lay}.self_attn.attn"]  # kernel blocks
        for rank in consumer:  # REPLICATE: every consumer rank gets the latent
            got = rank["caches"][f"model.layers.{lay}.self_attn.attn"]  # (B, 1, 64, latent)
            for p, c in ((1, 4), (5, 0)):
                want = src[p * 4:(p + 1) * 4].transpose(0, 1).reshape(1, 64, latent)
                assert torch.equal(got[c], want), (lay, p, c)


def test_kernel_block_split_head_major_pages_are_refused_naming_the_settings(v) -> None:
    """LBHNC with several heads per rank: a split manager block is 4 head-major kernel
    pages, not one LBHNC page; refused at start-up naming LBNHC and --block-size 16."""
    from kvbridge.integrations.vllm.layout import AdapterConfigError

    with pytest.raises(AdapterConfigError) as info:
        dense_engine(v, "cuda", "LBHNC", 1, block=64, kernel=16)
    assert info.value.field == "block_size"
    assert "VLLM_KV_CACHE_LAYOUT=LBNHC" in info.value.reason
    assert "--block-size 16" in info.value.reason and "4 kernel blocks" in info.value.reason


def test_mamba_groups_are_refused_naming_the_layer_kind(v) -> None:
    from kvbridge.integrations.vllm.layout import (
        AdapterConfigError,
        GroupInfo,
        GroupKind,
        VllmFormat,
        build_spec,
    )

    group = GroupInfo(0, GroupKind.UNSUPPORTED, "MambaSpec", ("model.layers.0.mixer",),
                      1, 1, 1, "float32")
    with pytest.raises(AdapterConfigError) as info:
        build_spec("m", [group], VllmFormat("cpu", "LBHNC", "auto"))
    assert info.value.field == "kv_cache_config.kv_cache_groups[0]"
    assert "Mamba / linear-attention state" in info.value.reason


# --------------------------------------------------------------------------- over real NIXL

PEER = Path(__file__).with_name("nixl_format_peer.py")


def _read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line:
                return line
        if proc.poll() is not None:
            break
    raise AssertionError(f"producer process gave no metadata (rc {proc.poll()})")


NIXL_CASES = [("cuda", "LBNHC", 2, 1), ("cpu", "LBHNC", 1, 2), ("cuda", "LBHNC", 2, 1)]


@pytest.mark.parametrize(("device", "layout", "p_tp", "c_tp"), NIXL_CASES,
                         ids=[f"{d}-{lay}-tp{p}to{c}" for d, lay, p, c in NIXL_CASES])
def test_nixl_reads_vllm_allocated_blocks_from_another_process(v, device: str, layout: str,
                                                               p_tp: int, c_tp: int) -> None:
    """The producer ranks live in another process (``nixl_format_peer.py``), with vLLM's
    allocator and the adapter's views, registered with NIXL as the worker does (each backing
    storage once); this process READs the plan's descriptors over NIXL (UCX) and checks
    every head as vLLM's attention reads it."""
    _nixl_read_case(v, device, layout, p_tp, c_tp)


KERNEL_NIXL_CASES = [(2, 1, 16, 32), (1, 2, 16, None)]


@pytest.mark.parametrize(("p_tp", "c_tp", "p_kernel", "c_kernel"), KERNEL_NIXL_CASES,
                         ids=[f"tp{p}to{c}-k{pk}to{ck or 64}"
                              for p, c, pk, ck in KERNEL_NIXL_CASES])
def test_nixl_reads_kernel_split_blocks_from_another_process(
        v, p_tp: int, c_tp: int, p_kernel: int, c_kernel: int | None) -> None:
    """Kernel block splitting over real NIXL: the producer process's vLLM split its 64-token
    manager blocks into kernel blocks of ``p_kernel`` tokens (LBNHC), the consumer's into
    ``c_kernel`` (or not at all); manager block ids are read and every kernel block holds
    what the consumer's attention reads through its kernel-block table."""
    _nixl_read_case(v, "cuda", "LBNHC", p_tp, c_tp, block=64, p_kernel=p_kernel,
                    c_kernel=c_kernel)


def _nixl_read_case(v: Any, device: str, layout: str, p_tp: int, c_tp: int,
                    block: int = TOKENS, p_kernel: int | None = None,
                    c_kernel: int | None = None) -> None:
    from kvbridge.backends.nixl import NixlTransport, XferState
    from kvbridge.layouts import ParallelTopology
    from kvbridge.layouts.plan import LayerMemory, absolute_descriptors, plan_transfer

    env = dict(os.environ, UCX_MODULES=os.environ.get("UCX_MODULES", "^ib"))
    args = json.dumps({"device": device, "layout": layout, "tp": p_tp, "block": block,
                       "kernel": p_kernel})
    proc = subprocess.Popen([sys.executable, str(PEER), args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    transports: list[Any] = []
    try:
        peers_info = json.loads(_read_line(proc, 180.0))
        consumer = dense_engine(v, device, layout, c_tp, block=block, kernel=c_kernel)
        spec = consumer[0]["adapter"].spec
        assert peers_info["fingerprint"] == spec.fingerprint()
        producer_memory = {int(i): {int(lid): LayerMemory(*m) for lid, m in info["memory"].items()}
                           for i, info in enumerate(peers_info["ranks"])}
        plan = plan_transfer(spec, ParallelTopology(tp_size=p_tp), ParallelTopology(tp_size=c_tp))
        for index, rank in enumerate(consumer):
            transport = NixlTransport(f"kvb-test-c{index}")
            transports.append(transport)
            transport.register_regions(rank["kv"].backing_spans())
            peers = {i: transport.add_peer(info["name"], bytes.fromhex(info["agent"]))
                     for i, info in enumerate(peers_info["ranks"])}
            for d in absolute_descriptors(plan.for_consumer(index), rank["memory"],
                                          producer_memory, C_IDS, P_IDS):
                local = transport.prepare_local_descs(d.consumer)
                remote = transport.prepare_remote(peers[d.producer_rank], d.producer)
                rows = list(range(d.consumer.shape[0]))
                xfer = transport.post("READ", local, rows, remote, rows, deadline_s=60.0)
                assert transport.wait(xfer) is XferState.DONE
        logical = fill_dense(v, dense_engine(v, device, layout, p_tp, block=block,
                                             kernel=p_kernel), device, layout, block=block)
        check_dense(v, consumer, device, layout, logical)
    finally:
        if proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write("done\n")
                proc.stdin.flush()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        for transport in transports:
            transport.close(strict=False)
