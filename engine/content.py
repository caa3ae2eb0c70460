"""The deterministic KV content function, the next-token function, and byte verification.

The reference engine does not run a model. The KV it "computes" for a token is
a pure function of

    (prefix seed of the token, layer id, k-or-v index, *global* head, dim)

where the prefix seed of position ``p`` chains every token id of ``[0, p]``
(so equal prefixes give equal KV, as in a real model, and any change earlier in
the prompt changes every later value). Everything is in *global* coordinates
(global head, global token position), so a receiver with any TP / PP / DCP
layout can compute exactly what each of its slots must hold and verify every
byte it got from a producer with a different layout.

Values are small integers that every KV dtype represents exactly (fp16,
bf16, fp32, fp8, int8), so casting never rounds and bytes compare exactly.
Arithmetic is vectorised int64 torch; no product exceeds 2**62.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvbridge.layouts import KVCacheSpec, MemoryOrder, ParallelTopology, RankRegionShape

_P = 2_147_483_647  # 2**31 - 1, prime
_SEED0 = 1_234_567
VOCAB_SIZE = 32_000

# Half-open integer range [-_RANGE[d], _RANGE[d]) per dtype: exactly representable.
_HALF_RANGE = {
    "float32": 1 << 20,
    "float16": 1024,
    "bfloat16": 128,
    "float8_e4m3fn": 8,
    "float8_e5m2": 4,
    "int8": 128,
}
_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def extend_prefix_seeds(seeds: list[int], token_ids: Sequence[int]) -> list[int]:
    """Extend ``seeds`` (prefix seeds of ``token_ids[:len(seeds)]``) to all of ``token_ids``."""
    value = seeds[-1] if seeds else _SEED0
    for token in token_ids[len(seeds):]:
        value = (value * 1_000_003 + (int(token) % _P) + 7) % _P
        seeds.append(value)
    return seeds


def prefix_seeds(token_ids: Sequence[int]) -> list[int]:
    return extend_prefix_seeds([], token_ids)


def next_token(seeds: Sequence[int]) -> int:
    """The token an engine generates after a prefix whose last prefix seed is ``seeds[-1]``."""
    value = seeds[-1]
    value = (value * 48_271 + len(seeds)) % _P
    value ^= value >> 11
    return value % VOCAB_SIZE


def reference_output(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """The tokens any correct engine generates for ``prompt`` (what tests compare to)."""
    seeds = prefix_seeds(prompt)
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(max_tokens):
        token = next_token(seeds)
        out.append(token)
        tokens.append(token)
        extend_prefix_seeds(seeds, tokens)
    return out


_M31 = (1 << 31) - 1


def _mix(seed: torch.Tensor, layer: int, kv: torch.Tensor, head: torch.Tensor,
         dim: torch.Tensor) -> torch.Tensor:
    """A 31-bit multiply-xorshift hash of the coordinates (bit masks, no division:
    ``%`` on int64 is slow on CPU). Inputs < 2**31; every product < 2**62."""
    small = (layer * 0x9E3779B1 + kv * 0x85EBCA77 + head * 0xC2B2AE3D + dim * 0x27D4EB2F) & _M31
    x = (seed + small) & _M31
    x = (x * 0x2C1B3C6D) & _M31
    x = x ^ (x >> 15)
    x = (x * 0x297A2D39) & _M31
    return x ^ (x >> 12)


def block_positions(shape: RankRegionShape, rank: ParallelTopology, block_index: torch.Tensor,
                    dcp_size: int) -> torch.Tensor:
    """Global token position of every slot: shape ``(num_blocks, block_size)``.

    ``block_index`` are indices into the request's block list (block ``i``
    covers tokens ``[i * T, (i + 1) * T)``, ``T = tokens_per_key(dcp_size)``).
    Under DCP a token-sharded block slot ``j`` of DCP rank ``d`` holds virtual
    token ``j * dcp_size + d``.
    """
    region = shape.region
    tokens_per_block = region.tokens_per_key(dcp_size)
    slots = torch.arange(region.block_size, dtype=torch.int64)
    if region.token_sharded and dcp_size > 1:
        slots = slots * dcp_size + rank.dcp_rank
    return block_index.to(torch.int64)[:, None] * tokens_per_block + slots[None, :]


def expected_blocks(shape: RankRegionShape, rank: ParallelTopology, dcp_size: int, layer: int,
                    block_index: torch.Tensor, seeds: torch.Tensor) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
    """Expected content of blocks ``block_index`` of one layer, in the rank's tensor layout.

    Returns ``(values, positions)``: values of shape ``(n, num_kv, *block_shape)``
    in the region's dtype, and the global token position of each slot
    ``(n, block_size)``. Slots at or beyond ``len(seeds)`` are filled with the
    last seed's content and must be masked by the caller.
    """
    region = shape.region
    positions = block_positions(shape, rank, block_index, dcp_size)
    clamped = positions.clamp(max=max(len(seeds) - 1, 0))
    token_seed = seeds[clamped] if len(seeds) else torch.zeros_like(clamped)
    kv = torch.arange(region.num_kv, dtype=torch.int64)
    heads = torch.arange(shape.head_start, shape.head_start + shape.num_heads, dtype=torch.int64)
    dims = torch.arange(region.head_dim, dtype=torch.int64)
    # (n, kv, heads, tokens, dim): HND order; NHD is a permutation of it.
    mixed = _mix(token_seed[:, None, None, :, None], layer, kv[None, :, None, None, None],
                 heads[None, None, :, None, None], dims[None, None, None, None, :])
    if region.dtype == "uint8":
        values = mixed & 255
    else:
        half = _HALF_RANGE[region.dtype]  # a power of two: the range is a bit mask
        values = (mixed & (2 * half - 1)) - half
    out = values.to(torch_dtype(region.dtype))
    if region.memory_order is MemoryOrder.NHD:
        out = out.permute(0, 1, 3, 2, 4)
    return out.contiguous(), positions


def _token_mask(shape: RankRegionShape, positions: torch.Tensor, start: int,
                end: int) -> torch.Tensor:
    """Boolean mask broadcastable to ``(n, num_kv, *block_shape)`` selecting tokens in range."""
    mask = (positions >= start) & (positions < end)  # (n, tokens)
    if shape.region.memory_order is MemoryOrder.HND:
        return mask[:, None, None, :, None]
    return mask[:, None, :, None, None]


def _slot_range(shape: RankRegionShape, rank: ParallelTopology, dcp_size: int,
                block_index: int, start: int, end: int) -> tuple[int, int]:
    """Slots ``[lo, hi)`` of block ``block_index`` that hold tokens in ``[start, end)``.

    Contiguous because a block's slots hold increasing token positions.
    """
    region = shape.region
    base = block_index * region.tokens_per_key(dcp_size)
    lo_tok = max(start - base, 0)
    hi_tok = min(end - base, region.tokens_per_key(dcp_size))
    if region.token_sharded and dcp_size > 1:
        d = rank.dcp_rank
        lo = max(0, -(-(lo_tok - d) // dcp_size))
        hi = max(0, -(-(hi_tok - d) // dcp_size))
        return min(lo, region.block_size), min(hi, region.block_size)
    return lo_tok, hi_tok


def fill_tokens(tensor: torch.Tensor, shape: RankRegionShape, rank: ParallelTopology,
                dcp_size: int, layer: int, block_ids: Sequence[int], seeds: torch.Tensor,
                start: int, end: int) -> None:
    """Write the content of tokens ``[start, end)`` of one layer into ``tensor`` in place.

    ``block_ids`` is the request's whole block list of this region; only the
    blocks holding the range are touched, and inside them only the range's
    slots (other tokens of a shared block keep their bytes).
    """
    if end <= start:
        return
    tokens_per_block = shape.region.tokens_per_key(dcp_size)
    first = start // tokens_per_block
    last = -(-end // tokens_per_block)
    index = torch.arange(first, last, dtype=torch.int64)
    values, _ = expected_blocks(shape, rank, dcp_size, layer, index, seeds)
    values = values.to(tensor.device)  # one copy to the KV's device, then slices of it
    hnd = shape.region.memory_order is MemoryOrder.HND
    for offset, block_index in enumerate(range(first, last)):
        lo, hi = _slot_range(shape, rank, dcp_size, block_index, start, end)
        if hi <= lo:
            continue
        block = tensor[block_ids[block_index]]
        if hnd:
            block[:, :, lo:hi, :] = values[offset, :, :, lo:hi, :]
        else:
            block[:, lo:hi, :, :] = values[offset, :, lo:hi, :, :]


def verify_blocks(layers: Mapping[int, torch.Tensor], shapes: Sequence[RankRegionShape],
                  spec: KVCacheSpec, rank: ParallelTopology, dcp_size: int,
                  block_ids: Sequence[Sequence[int]], token_ids: Sequence[int], start: int,
                  end: int) -> tuple[int, int]:
    """Check every byte of tokens ``[start, end)`` of one request on one rank.

    ``layers`` are the rank's KV tensors by layer id, ``block_ids[r]`` the
    request's block list of region ``r``. Returns ``(verified_bytes,
    mismatched_bytes)``: bytes compared, and bytes of elements that differ from
    the content function.
    """
    del spec  # the shapes carry everything; kept for a self-describing signature
    if end <= start:
        return 0, 0
    seeds = torch.as_tensor(prefix_seeds(token_ids[:end]), dtype=torch.int64)
    verified = mismatched = 0
    for region_index, shape in enumerate(shapes):
        if not shape.layer_ids:
            continue
        tokens_per_block = shape.region.tokens_per_key(dcp_size)
        first = start // tokens_per_block
        last = -(-end // tokens_per_block)
        ids_list = list(block_ids[region_index][first:last])
        if len(ids_list) != last - first:
            raise ValueError(f"block_ids[{region_index}]: {len(ids_list)} blocks for tokens "
                             f"[{start}, {end}), expected {last - first}")
        index = torch.arange(first, last, dtype=torch.int64)
        elem = shape.region.elem_bytes
        for layer in shape.layer_ids:
            values, positions = expected_blocks(shape, rank, dcp_size, layer, index, seeds)
            mask = _token_mask(shape, positions, start, end).expand_as(values)
            tensor = layers[layer]
            # one gather on the KV's device, then one copy to the host: device KV is
            # never read in place by the host
            ids = torch.tensor(ids_list, dtype=torch.int64, device=tensor.device)
            got = tensor.index_select(0, ids).cpu()
            equal = _bitwise_equal(got, values)
            selected = int(mask.sum())
            bad = int((mask & ~equal).sum())
            verified += selected * elem
            mismatched += bad * elem
    return verified, mismatched


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise bit equality (NaN-safe; -0.0 differs from 0.0, as bytes do)."""
    size = a.element_size()
    int_type = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return a.contiguous().view(int_type) == b.contiguous().view(int_type)
