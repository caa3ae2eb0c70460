"""The content function is defined in global coordinates: any layout verifies any other."""

from __future__ import annotations

import pytest
import torch

from kvbridge.engine.content import (
    fill_tokens,
    prefix_seeds,
    reference_output,
    torch_dtype,
    verify_blocks,
)
from kvbridge.layouts import KVCacheSpec, MemoryOrder, ParallelTopology, load_spec


def _fill(spec: KVCacheSpec, topo: ParallelTopology, rank: ParallelTopology, tokens: list[int],
          num_blocks: int) -> dict[int, torch.Tensor]:
    """A rank's KV with tokens [0, len) written into blocks 0..n-1 (in order)."""
    seeds = torch.as_tensor(prefix_seeds(tokens), dtype=torch.int64)
    layers = {}
    for r, shape in enumerate(spec.rank_shapes(rank)):
        t = shape.region.tokens_per_key(topo.dcp_size)
        blocks = list(range(-(-len(tokens) // t)))
        for layer in shape.layer_ids:
            tensor = torch.zeros(shape.tensor_shape(num_blocks),
                                 dtype=torch_dtype(shape.region.dtype))
            # fill in two uneven chunks, as chunked prefill does
            fill_tokens(tensor, shape, rank, topo.dcp_size, layer, blocks, seeds, 0, 21)
            fill_tokens(tensor, shape, rank, topo.dcp_size, layer, blocks, seeds, 21,
                        len(tokens))
            layers[layer] = tensor
        del r
    return layers


TOKENS = list(range(1000, 1070))


@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny-hybrid", "tiny-mla", "tiny-gqa-nhd"])
def test_tp_shards_are_slices_of_the_tp1_tensor(preset: str) -> None:
    spec = load_spec(preset)
    whole = _fill(spec, ParallelTopology(), ParallelTopology(), TOKENS, 8)
    topo = ParallelTopology(tp_size=2)
    for rank in topo.ranks():
        part = _fill(spec, topo, rank, TOKENS, 8)
        for shape in spec.rank_shapes(rank):
            for layer in shape.layer_ids:
                heads = slice(shape.head_start, shape.head_start + shape.num_heads)
                if shape.region.memory_order is MemoryOrder.HND:
                    expected = whole[layer][:, :, heads]
                else:
                    expected = whole[layer][:, :, :, heads]
                assert torch.equal(part[layer], expected), (preset, rank, layer)


def test_dcp_rank_holds_interleaved_tokens_of_the_virtual_block() -> None:
    spec = load_spec("tiny-mla")  # REPLICATE, token-sharded
    whole = _fill(spec, ParallelTopology(), ParallelTopology(), TOKENS, 8)
    topo = ParallelTopology(tp_size=2, dcp_size=2)
    for rank in topo.ranks():
        part = _fill(spec, topo, rank, TOKENS, 8)
        for layer, tensor in part.items():
            # virtual block b (32 tokens) slot j of dcp rank d = global token 32b + 2j + d
            for b in range(2):
                for j in range(16):
                    token = 32 * b + 2 * j + rank.dcp_rank
                    if token >= len(TOKENS):
                        continue
                    src = whole[layer][token // 16, :, :, token % 16]
                    assert torch.equal(tensor[b, :, :, j], src)


@pytest.mark.parametrize("topo", [ParallelTopology(tp_size=2), ParallelTopology(pp_size=2),
                                  ParallelTopology(tp_size=2, dcp_size=2)])
def test_verify_counts_every_byte_and_catches_one_flipped_element(topo: ParallelTopology) -> None:
    spec = load_spec("tiny-hybrid")
    total_verified = 0
    for rank in topo.ranks():
        layers = _fill(spec, topo, rank, TOKENS, 8)
        shapes = spec.rank_shapes(rank)
        block_ids = [list(range(-(-len(TOKENS) // s.region.tokens_per_key(topo.dcp_size))))
                     for s in shapes]
        verified, mismatched = verify_blocks(layers, shapes, spec, rank, topo.dcp_size,
                                             block_ids, TOKENS, 0, len(TOKENS))
        assert mismatched == 0
        expected = sum(len(s.layer_ids) * s.region.num_kv * s.num_heads * s.region.head_dim
                       * s.region.elem_bytes for s in shapes)
        assert verified == expected * len(TOKENS) // topo.dcp_size or topo.dcp_size > 1
        total_verified += verified
        if layers:
            layer = min(layers)
            layers[layer].view(-1)[0] += 1  # one element of token 0
            _, bad = verify_blocks(layers, shapes, spec, rank, topo.dcp_size, block_ids,
                                   TOKENS, 0, len(TOKENS))
            if rank.dcp_rank == 0 or not spec.region_of_layer(layer).token_sharded:
                assert bad == layers[layer].element_size()
    assert total_verified > 0


def test_values_are_exact_in_every_dtype_and_differ_across_prefixes() -> None:
    spec = load_spec("tiny-hybrid")  # float16 and float32 regions
    a = _fill(spec, ParallelTopology(), ParallelTopology(), TOKENS, 8)
    b = _fill(spec, ParallelTopology(), ParallelTopology(), [999] + TOKENS[1:], 8)
    for layer in a:
        assert not torch.equal(a[layer], b[layer])  # the first token changes every value
        assert torch.isfinite(a[layer].float()).all()


def test_reference_output_is_deterministic_and_prefix_dependent() -> None:
    assert reference_output(TOKENS, 5) == reference_output(list(TOKENS), 5)
    assert reference_output(TOKENS, 5)[:3] == reference_output(TOKENS, 3)
    assert reference_output(TOKENS, 3) != reference_output([1] + TOKENS[1:], 3)
