"""Format identity: engines of different KV formats refuse each other at the handshake.

A vLLM-CPU engine (``head_kv`` interior) and a vLLM-GPU engine (``token_kv``)
have blocks of the same size and shape that mean different things; an fp8 and
a bf16 engine differ in cache dtype. Each pair must be refused by the real
handshake (a ZeroMQ server on 127.0.0.1 and the client), with the differing
field and both values named, before any rank metadata is read.
"""

from __future__ import annotations

import pytest

from kvbridge.handshake import HandshakeError
from kvbridge.handshake.client import HandshakeClient
from kvbridge.handshake.schema import (
    AgentMetadata,
    CompatHeader,
    TransferMode,
    check_compatible,
    decode_agent,
    encode_agent,
)
from kvbridge.handshake.server import HandshakeServer, MetadataStore
from kvbridge.layouts import (
    Interior,
    KVCacheSpec,
    MemoryOrder,
    ParallelTopology,
    RegionLayout,
    RegionSpec,
)


def _vllm_spec(device: str, cache_dtype: str = "auto", dtype: str = "bfloat16",
               layout: str = "LBHNC") -> KVCacheSpec:
    interior = Interior.HEAD_KV if device == "cpu" else Interior.TOKEN_KV
    region = RegionSpec("g0-full_attention", RegionLayout.SPLIT, (0, 1), 16, 4, 64, dtype,
                        memory_order=MemoryOrder.HND, interior=interior)
    fmt = (("engine", "vllm"), ("device", device), ("kv_cache_layout", layout),
           ("cache_dtype", cache_dtype), ("attn_backend", "auto"))
    return KVCacheSpec("m", (region,), engine_format=fmt)


def _refusal(ours: KVCacheSpec, theirs: KVCacheSpec) -> HandshakeError:
    """Fetch ``theirs`` from a real handshake server while expecting ``ours``."""
    store = MetadataStore("peer", theirs, ParallelTopology())
    # a registered rank (addresses are only described, never touched here)
    store.publish(AgentMetadata.build("peer", "agent", b"", theirs, ParallelTopology(),
                                      {0: 1 << 20, 1: 2 << 20}, 4))
    client = HandshakeClient(timeout_s=5.0, retries=0,
                             expected=CompatHeader.from_spec(ours, TransferMode.PULL))
    with HandshakeServer(store, "127.0.0.1", 0).start() as server, \
            pytest.raises(HandshakeError) as info:
        client.fetch(server.address)
    return info.value


def test_cpu_producer_and_gpu_consumer_refuse_each_other_naming_both_values() -> None:
    error = _refusal(_vllm_spec("cuda"), _vllm_spec("cpu"))
    text = str(error)
    assert "interior" in text and "token_kv" in text and "head_kv" in text
    assert "engine_format.device" in text and "'cuda'" in text and "'cpu'" in text


def test_fp8_and_bf16_engines_refuse_each_other_naming_both_values() -> None:
    fp8 = _vllm_spec("cuda", cache_dtype="fp8", dtype="float8_e4m3fn")
    error = _refusal(_vllm_spec("cuda"), fp8)
    text = str(error)
    assert "engine_format.cache_dtype" in text and "'auto'" in text and "'fp8'" in text
    assert "dtype" in text and "bfloat16" in text and "float8_e4m3fn" in text


def test_same_format_is_accepted_and_layout_name_is_compared() -> None:
    check_compatible(CompatHeader.from_spec(_vllm_spec("cuda"), TransferMode.PULL),
                     CompatHeader.from_spec(_vllm_spec("cuda"), TransferMode.PULL))
    with pytest.raises(HandshakeError) as info:
        check_compatible(
            CompatHeader.from_spec(_vllm_spec("cuda"), TransferMode.PULL),
            CompatHeader.from_spec(_vllm_spec("cuda", layout="LBNHC"), TransferMode.PULL))
    assert "engine_format.kv_cache_layout" in str(info.value) and "LBNHC" in str(info.value)


def test_specs_without_engine_format_keep_their_header_fingerprint() -> None:
    plain = KVCacheSpec("m", (RegionSpec("attn", RegionLayout.SPLIT, (0,), 16, 2, 64,
                                         "float16"),))
    header = CompatHeader.from_spec(plain, TransferMode.PULL)
    assert "engine_format" not in header.compat_map()
    assert "interior" not in header.compat_map()["regions"][0]


def _two_regions() -> KVCacheSpec:
    window = RegionSpec("g0-sliding_window", RegionLayout.SPLIT, (0, 2), 16, 4, 64, "float16",
                        token_sharded=False, interior=Interior.HEAD_KV)
    full = RegionSpec("g1-full_attention", RegionLayout.SPLIT, (1, 3), 16, 4, 64, "float16",
                      interior=Interior.HEAD_KV)
    return KVCacheSpec("hybrid", (window, full))


def test_hybrid_groups_may_alias_exactly_and_nothing_else() -> None:
    """vLLM's hybrid allocator puts layer j of every group on the same bytes: accepted.
    Partial overlaps, or two layers of one region on the same bytes, stay refused."""
    spec, rank = _two_regions(), ParallelTopology()
    block = 4 * 16 * 64 * 2 * 2
    a, b = 1 << 20, (1 << 20) + 8 * block
    AgentMetadata.build("e", "x", b"", spec, rank, {0: a, 1: a, 2: b, 3: b}, 8)
    with pytest.raises(HandshakeError) as info:  # one region's two layers on one tensor
        AgentMetadata.build("e", "x", b"", spec, rank, {0: a, 2: a, 1: b, 3: b}, 8)
    assert "overlaps" in str(info.value)
    with pytest.raises(HandshakeError) as info:  # a shifted alias
        AgentMetadata.build("e", "x", b"", spec, rank, {0: a, 1: a + 64, 2: b, 3: b}, 8)
    assert "overlaps" in str(info.value)
    with pytest.raises(HandshakeError) as info:  # same start, different block stride
        AgentMetadata.build("e", "x", b"", spec, rank, {0: a, 1: a, 2: b, 3: b}, 8,
                            (block, block + 64))
    assert "overlaps" in str(info.value)


def test_padded_block_stride_travels_and_is_bounded() -> None:
    spec, rank = _two_regions(), ParallelTopology()
    block = 4 * 16 * 64 * 2 * 2
    meta = AgentMetadata.build("e", "x", b"", spec, rank,
                               {0: 1 << 20, 1: 1 << 20, 2: 2 << 20, 3: 2 << 20}, 8,
                               (block + 64, block + 64))
    assert meta.regions[0].to_map()["block_stride"] == block + 64
    assert all(m.block_stride == block + 64 for m in meta.layer_memory().values())
    assert decode_agent(encode_agent(meta)) == meta  # the stride travels on the wire
    with pytest.raises(HandshakeError) as info:
        AgentMetadata.build("e", "x", b"", spec, rank,
                            {0: 1 << 20, 1: 1 << 20, 2: 2 << 20, 3: 2 << 20}, 8,
                            (block - 2, block - 2))
    assert info.value.field.endswith("block_stride")
