"""Interior formats (where K and V sit in a block) and block strides, checked to the byte.

Each case fills every producer rank's memory from one logical K/V array (global
heads), executes the plan's absolute descriptors as byte copies between flat
buffers, and decodes every consumer rank's memory with the format's own reading
(GPU: ``cell.split(head_dim)``; CPU: each head's K rows then V rows): it must
equal the logical K/V of the heads that rank holds, for every block moved.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.layouts import (
    Interior,
    KVCacheSpec,
    LayoutError,
    MemoryOrder,
    ParallelTopology,
    RegionLayout,
    RegionSpec,
)
from kvbridge.layouts.plan import LayerMemory, absolute_descriptors, plan_transfer

HEADS, TOKENS, DIM, LAYERS, BLOCKS = 4, 8, 4, 2, 5


def _spec(interior: Interior, order: MemoryOrder) -> KVCacheSpec:
    return KVCacheSpec("m", (RegionSpec("attn", RegionLayout.SPLIT, tuple(range(LAYERS)),
                                        block_size=TOKENS, num_kv_heads=HEADS, head_dim=DIM,
                                        dtype="float16", memory_order=order,
                                        interior=interior),))


def _encode(kv: np.ndarray, interior: Interior, order: MemoryOrder) -> np.ndarray:
    """``kv`` (blocks, 2, heads, tokens, dim) -> the per-layer tensor of the format."""
    if interior is Interior.KV_OUTER:
        return kv if order is MemoryOrder.HND else kv.transpose(0, 1, 3, 2, 4)
    if interior is Interior.HEAD_KV:  # (blocks, heads, 2 * tokens, dim): K rows, V rows
        return kv.transpose(0, 2, 1, 3, 4).reshape(kv.shape[0], kv.shape[2], -1, DIM)
    cells = kv.transpose(0, 2, 3, 1, 4)  # (blocks, heads, tokens, 2, dim)
    if order is MemoryOrder.NHD:
        cells = cells.transpose(0, 2, 1, 3, 4)
    return cells.reshape(*cells.shape[:3], 2 * DIM)


def _decode(tensor: np.ndarray, interior: Interior, order: MemoryOrder) -> np.ndarray:
    """The format's own reading back to (blocks, 2, heads, tokens, dim)."""
    if interior is Interior.KV_OUTER:
        return tensor if order is MemoryOrder.HND else tensor.transpose(0, 1, 3, 2, 4)
    if interior is Interior.HEAD_KV:  # vLLM CPU: view (B, H, 2N, D).chunk(2, dim=2)
        k, v = np.split(tensor.reshape(tensor.shape[0], tensor.shape[1], -1, DIM), 2, axis=2)
        return np.stack([k, v], axis=1)
    if order is MemoryOrder.NHD:  # vLLM GPU: kv.transpose(1, 2) -> (B, H, N, 2D)
        tensor = tensor.transpose(0, 2, 1, 3)
    k, v = np.split(tensor, 2, axis=-1)  # .split(head_size, -1)
    return np.stack([k, v], axis=1)


class _Rank:
    """One rank's memory: one flat byte buffer, layer l at ``l * layer_span``, padded blocks."""

    def __init__(self, spec: KVCacheSpec, topology: ParallelTopology, pad: int) -> None:
        self.shape = spec.rank_shapes(topology)[0]
        self.stride = self.shape.block_bytes_per_layer + pad
        self.span = self.stride * BLOCKS
        self.buf = np.zeros(self.span * LAYERS, dtype=np.uint8)
        self.base = self.buf.ctypes.data

    def memory(self) -> dict[int, LayerMemory]:
        return {lay: LayerMemory(self.base + lay * self.span, self.stride, BLOCKS)
                for lay in range(LAYERS)}

    def block(self, layer: int, block: int) -> np.ndarray:
        start = layer * self.span + block * self.stride
        return self.buf[start:start + self.shape.block_bytes_per_layer]


def _run(interior: Interior, order: MemoryOrder, producer: str, consumer: str,
         pad: int = 0) -> None:
    spec = _spec(interior, order)
    p_sizes, c_sizes = ParallelTopology.parse(producer), ParallelTopology.parse(consumer)
    rng = np.random.default_rng(7)
    logical = rng.integers(0, 60000, size=(LAYERS, BLOCKS, 2, HEADS, TOKENS, DIM)
                           ).astype(np.uint16)
    p_ranks = {i: _Rank(spec, t, pad) for i, t in enumerate(p_sizes.ranks())}
    for rank in p_ranks.values():
        lo, n = rank.shape.head_start, rank.shape.num_heads
        for lay in range(LAYERS):
            for b in range(BLOCKS):
                enc = _encode(logical[lay, b:b + 1, :, lo:lo + n], interior, order)
                rank.block(lay, b)[:] = np.ascontiguousarray(enc).view(np.uint8).ravel()
    plan = plan_transfer(spec, p_sizes, c_sizes)
    p_ids, c_ids = [4, 0, 2], [1, 3, 0]
    for index, topology in enumerate(c_sizes.ranks()):
        mine = _Rank(spec, topology, pad + 3)  # consumer padding differs on purpose
        for d in absolute_descriptors(plan.for_consumer(index), mine.memory(),
                                      {i: r.memory() for i, r in p_ranks.items()},
                                      c_ids, p_ids):
            for (c_addr, length), (p_addr, _) in zip(d.consumer, d.producer, strict=True):
                src = p_ranks[d.producer_rank]
                s, t = int(p_addr) - src.base, int(c_addr) - mine.base
                mine.buf[t:t + int(length)] = src.buf[s:s + int(length)]
        lo, n = mine.shape.head_start, mine.shape.num_heads
        for lay in range(LAYERS):
            for p_id, c_id in zip(p_ids, c_ids, strict=True):
                raw = mine.block(lay, c_id).view(np.uint16)
                got = _decode(raw.reshape(1, *mine.shape.tensor_shape(1)[1:]), interior, order)
                assert np.array_equal(got[0], logical[lay, p_id, :, lo:lo + n]), (
                    f"{interior.value}/{order.value} {producer}->{consumer}: consumer rank "
                    f"{index} layer {lay} block {c_id} differs")


CASES = [(Interior.TOKEN_KV, MemoryOrder.HND), (Interior.TOKEN_KV, MemoryOrder.NHD),
         (Interior.HEAD_KV, MemoryOrder.HND), (Interior.KV_OUTER, MemoryOrder.HND),
         (Interior.KV_OUTER, MemoryOrder.NHD)]


@pytest.mark.parametrize(("interior", "order"), CASES,
                         ids=[f"{i.value}-{o.value}" for i, o in CASES])
@pytest.mark.parametrize(("producer", "consumer"), [("tp=1", "tp=1"), ("tp=2", "tp=1"),
                                                    ("tp=1", "tp=2"), ("tp=4", "tp=2")])
def test_every_interior_moves_the_right_heads_to_the_byte(interior: Interior,
                                                          order: MemoryOrder, producer: str,
                                                          consumer: str) -> None:
    _run(interior, order, producer, consumer)


@pytest.mark.parametrize(("interior", "order"), CASES[:3], ids=["token_kv-HND",
                                                               "token_kv-NHD", "head_kv-HND"])
def test_padded_pages_block_stride_larger_than_block_bytes(interior: Interior,
                                                           order: MemoryOrder) -> None:
    _run(interior, order, "tp=2", "tp=1", pad=64)


def test_head_split_token_kv_hnd_is_one_run_per_head() -> None:
    plan = plan_transfer(_spec(Interior.TOKEN_KV, MemoryOrder.HND),
                         ParallelTopology.parse("tp=2"), ParallelTopology.parse("tp=1"))
    layer0 = [d for d in plan.ranks[0].descriptors if d.layer == 0]
    head_bytes = TOKENS * 2 * DIM * 2
    # two producer ranks, two heads each: one descriptor per producer rank and layer
    assert [(d.producer_rank, d.consumer_offset, d.length) for d in layer0] == [
        (0, 0, 2 * head_bytes), (1, 2 * head_bytes, 2 * head_bytes)]


def test_interiors_change_the_fingerprint_and_round_trip() -> None:
    gpu = _spec(Interior.TOKEN_KV, MemoryOrder.HND)
    cpu = _spec(Interior.HEAD_KV, MemoryOrder.HND)
    native = _spec(Interior.KV_OUTER, MemoryOrder.HND)
    assert len({gpu.fingerprint(), cpu.fingerprint(), native.fingerprint()}) == 3
    assert "interior" not in native.to_dict()["regions"][0]  # old fingerprints unchanged
    for spec in (gpu, cpu, native):
        assert KVCacheSpec.from_dict(spec.to_dict()) == spec


def test_engine_format_is_part_of_the_fingerprint_and_bounded() -> None:
    base = _spec(Interior.TOKEN_KV, MemoryOrder.HND)
    a = KVCacheSpec("m", base.regions, (("attn_backend", "FLASH_ATTN"), ("cache_dtype", "auto")))
    b = KVCacheSpec("m", base.regions, (("attn_backend", "FLASH_ATTN"), ("cache_dtype", "fp8")))
    assert a.fingerprint() != b.fingerprint() != base.fingerprint()
    assert KVCacheSpec.from_dict(a.to_dict()) == a
    with pytest.raises(LayoutError) as info:
        KVCacheSpec("m", base.regions, tuple((f"k{i}", "v") for i in range(9)))
    assert info.value.field == "engine_format"


def test_refused_interior_combinations_name_the_field() -> None:
    with pytest.raises(LayoutError) as info:
        RegionSpec("mla", RegionLayout.REPLICATE, (0,), 16, 1, 576, "float16", key_only=True,
                   interior=Interior.TOKEN_KV)
    assert info.value.field == "interior"
    with pytest.raises(LayoutError) as info:
        RegionSpec("a", RegionLayout.SPLIT, (0,), 16, 2, 64, "float16",
                   memory_order=MemoryOrder.NHD, interior=Interior.HEAD_KV)
    assert info.value.field == "interior" and "HND" in info.value.reason
    with pytest.raises(LayoutError) as info:
        RegionSpec.from_dict({"name": "a", "layout": "split", "layer_ids": [0], "block_size": 16,
                              "num_kv_heads": 2, "head_dim": 64, "dtype": "float16",
                              "interior": "k_then_v"})
    assert info.value.field == "region.interior"
