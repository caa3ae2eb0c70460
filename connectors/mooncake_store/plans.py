"""Where one rank's blocks live and which keys they go under: region plans and batch gathering.

Owns :class:`LayerSlot` and :class:`RegionPlan` (per region: the block count,
whether this rank is its designated writer, each layer's key prefix and block
addresses, the digest-record prefix), :func:`build_plans` (from the KV tensors,
checking they are block-major and contiguous) and :func:`gather` (the keys,
pointers and sizes of one batch call for a set of blocks, and the blocks whose
id lies outside their region, which are never addressed). Pure: the worker
(:mod:`.worker`) makes the calls.

May not touch: the store client, the load thread, stats or digests (nothing
here does I/O, locks or reads the KV's bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge.connectors.api import ConnectorContext, KVCaches
from kvbridge.connectors.errors import ContractError
from kvbridge.connectors.mooncake_store.keys import layer_key_prefix
from kvbridge.connectors.mooncake_store.metadata import LoadBlock, SaveBlock
from kvbridge.connectors.mooncake_store.records import digest_key_prefix
from kvbridge.layouts import ParallelTopology, namespace_for, write_targets


@dataclass(frozen=True)
class LayerSlot:
    """Where one layer's blocks live in memory, and its key prefix in the store."""

    layer_id: int
    prefix: str
    base_ptr: int
    block_stride: int  # bytes from one block to the next (== block_nbytes: block-major)
    block_nbytes: int


@dataclass(frozen=True)
class RegionPlan:
    """What this rank stores and loads of one region (no layers: nothing on this stage)."""

    region_index: int
    num_blocks: int
    is_writer: bool
    layers: tuple[LayerSlot, ...]
    digest_prefix: str = ""  # key prefix of this namespace's digest records (see .records)


def build_plans(caches: KVCaches, ctx: ConnectorContext, rank: ParallelTopology,
                ) -> tuple[RegionPlan, ...]:
    """Pure: key prefixes and block addresses of every region on ``rank``."""
    writers = {t.region: t.is_writer for t in write_targets(ctx.spec, rank)}
    plans = []
    for index, shape in enumerate(caches.shapes):
        slots = []
        digest_prefix = ""
        if shape.layer_ids:
            namespace = namespace_for(ctx.spec, shape.region, rank)
            digest_prefix = digest_key_prefix(namespace)
            for layer_id in shape.layer_ids:
                tensor = caches.layers[layer_id]
                if not tensor.is_contiguous():
                    raise ContractError(f"kv_caches.layers[{layer_id}]",
                                        "expected a contiguous block-major tensor")
                stride = tensor.stride(0) * tensor.element_size()
                if stride != shape.block_bytes_per_layer:
                    raise ContractError(f"kv_caches.layers[{layer_id}]",
                                        f"expected {shape.block_bytes_per_layer} bytes per "
                                        f"block, got a stride of {stride}")
                slots.append(LayerSlot(layer_id, layer_key_prefix(namespace, layer_id),
                                       int(tensor.data_ptr()), stride,
                                       shape.block_bytes_per_layer))
        plans.append(RegionPlan(index, caches.num_blocks[index],
                                writers.get(shape.region.name, False), tuple(slots),
                                digest_prefix))
    return tuple(plans)


@dataclass
class Batch:
    """Keys, addresses and sizes of one batch call; ``owners[k]``: index of key k's block."""

    keys: list[str]
    ptrs: list[int]
    sizes: list[int]
    owners: list[int]


def gather(plans: Sequence[RegionPlan], blocks: Sequence[LoadBlock | SaveBlock], *,
           writers_only: bool) -> tuple[Batch, set[int]]:
    """Pure: the batch for ``blocks`` (grouped by region, then layer) and the indices of
    blocks whose id lies outside their region (never addressed).

    Blocks of regions this rank holds no layer of (or, with ``writers_only``, does
    not write) contribute no key. Built with comprehensions, no per-block Python
    loop beyond them: 4096 blocks of one layer cost ~1 ms.
    """
    by_region: dict[int, list[int]] = {}
    if len({block.region_index for block in blocks}) == 1:  # the usual step: one region
        by_region[blocks[0].region_index] = list(range(len(blocks)))
    else:
        for index, block in enumerate(blocks):
            by_region.setdefault(block.region_index, []).append(index)
    batch = Batch([], [], [], [])
    out_of_range: set[int] = set()
    for region_index, indices in by_region.items():
        plan = plans[region_index]
        if not plan.layers or (writers_only and not plan.is_writer):
            continue
        chosen = blocks if len(indices) == len(blocks) else [blocks[i] for i in indices]
        ids = [block.block_id for block in chosen]
        if min(ids) < 0 or max(ids) >= plan.num_blocks:
            bad = {i for i, b in zip(indices, ids, strict=True) if not 0 <= b < plan.num_blocks}
            out_of_range |= bad
            indices = [i for i in indices if i not in bad]
            chosen = [blocks[i] for i in indices]
            ids = [block.block_id for block in chosen]
        if len(plan.layers) == 1:  # one pass: no intermediate list of digests
            prefix = plan.layers[0].prefix
            batch.keys.extend([prefix + block.block_hash.hex() for block in chosen])
        else:
            digests = [block.block_hash.hex() for block in chosen]
            batch.keys.extend([slot.prefix + d for slot in plan.layers for d in digests])
        for slot in plan.layers:
            base, stride = slot.base_ptr, slot.block_stride
            batch.ptrs.extend([base + b * stride for b in ids])
            batch.sizes.extend([slot.block_nbytes] * len(ids))
            batch.owners.extend(indices)
    return batch, out_of_range
