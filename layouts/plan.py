"""Transfer plans: which producer bytes fill which consumer bytes, for one block index.

A plan maps a producer engine's ranks onto a consumer engine's ranks for one
:class:`KVCacheSpec`. It is computed once per (spec, producer sizes, consumer
sizes) and applies to every block of every request: a request's block ``i``
on the producer (``producer_block_ids[i]``) fills block ``i`` on the consumer
(``consumer_block_ids[i]``) through the same descriptors. Block ids are the
engine's: every rank of one engine uses the same block id for a block.

Memory model (see :mod:`kvbridge.layouts.spec`): per region and per layer one
tensor ``(num_blocks, num_kv, *block_shape)``. A descriptor therefore names a
layer and byte offsets *within that layer's block* on each side; descriptors
never span two layers (separate tensors), and contiguous runs inside one block
are coalesced (when a consumer reads a producer's whole head slice, K and V
become one descriptor).

Rules, each enforced here so a wrong transfer is refused instead of posted:

* **DCP** must be equal on both sides (``consumer.dcp_size``): consumer DCP rank
  ``d`` reads from producer ranks of DCP rank ``d``, which hold the same token
  slots. **PCP** likewise (``consumer.pcp_size``): pcp rank ``p`` reads pcp rank ``p``.
* **PP**: each consumer rank gets descriptors only for its own layers, each from
  the producer stage holding that layer (layer-range intersection).
* **SPLIT** regions: each head the consumer rank holds is read exactly once, from
  one producer rank holding it (heterogeneous TP both ways). When the producer
  replicates heads (more head groups than KV heads) the replica is chosen by the
  consumer's head group, which spreads reads across the replicas.
* **REPLICATE** regions: the whole block from one producer rank, spread across
  ranks (consumer rank ``r`` reads producer TP rank ``r % producer_tp`` of the
  right stage; under DCP with a token-sharded region, the producer rank of the
  same DCP rank in head group ``consumer_head_group % producer_head_groups``).
* **NHD** order with heterogeneous TP: supported with per-token descriptors (a
  head slice is strided per token in NHD, so each ``(K|V, token)`` row of a
  source becomes one descriptor). This is correct but costs ``2 * block_size``
  descriptors per source and layer instead of 2; prefer HND for heterogeneous TP
  (``kvbridge plan`` shows the counts). With equal heads on both sides NHD blocks
  coalesce to one descriptor per layer like HND.

Ranks are identified by a flat index, :func:`rank_index`, in the order of
:meth:`ParallelTopology.ranks` (``(pp_rank * pcp_size + pcp_rank) * tp_size +
tp_rank``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.spec import (
    Interior,
    KVCacheSpec,
    MemoryOrder,
    RankRegionShape,
    RegionLayout,
)
from kvbridge.layouts.topology import ParallelTopology

logger = logging.getLogger(__name__)

IntArray = npt.NDArray[np.int64]
AddrArray = npt.NDArray[np.uint64]


def rank_index(topology: ParallelTopology) -> int:
    """Flat index of ``topology``'s rank, in :meth:`ParallelTopology.ranks` order."""
    return ((topology.pp_rank * topology.pcp_size + topology.pcp_rank) * topology.tp_size
            + topology.tp_rank)


def rank_at(sizes: ParallelTopology, index: int) -> ParallelTopology:
    """Inverse of :func:`rank_index` for an engine of ``sizes``."""
    if not 0 <= index < sizes.world_size:
        raise LayoutError("rank", f"expected a rank index in [0, {sizes.world_size}), "
                                  f"got {index}")
    tp_rank = index % sizes.tp_size
    rest = index // sizes.tp_size
    return sizes.with_rank(tp_rank=tp_rank, pp_rank=rest // sizes.pcp_size,
                           pcp_rank=rest % sizes.pcp_size)


def describe_rank(topology: ParallelTopology) -> str:
    """Short human name of one rank, e.g. ``tp1/pp0/dcp1`` (pcp shown only when > 1)."""
    text = f"tp{topology.tp_rank}/pp{topology.pp_rank}"
    if topology.dcp_size > 1:
        text += f"/dcp{topology.dcp_rank}"
    if topology.pcp_size > 1:
        text += f"/pcp{topology.pcp_rank}"
    return text


@dataclass(frozen=True)
class Descriptor:
    """One contiguous copy for one block index.

    ``producer_offset`` / ``consumer_offset`` are bytes within the block of
    ``layer`` on each side (add ``block_id * block_stride`` and the layer
    tensor's base address to get an absolute address).
    """

    producer_rank: int
    region: int  # index into spec.regions
    layer: int
    producer_offset: int
    consumer_offset: int
    length: int


@dataclass(frozen=True, eq=False)
class RankPlan:
    """Every descriptor one consumer rank needs for one block index.

    The arrays are parallel, coalesced, sorted by ``(producer_rank, layer,
    consumer_offset)``; no two descriptors overlap on the consumer side, and
    together they cover every byte of the rank's blocks on its stage exactly once.
    """

    consumer_rank: int
    consumer: ParallelTopology
    producer_ranks: IntArray
    regions: IntArray
    layers: IntArray
    producer_offsets: IntArray
    consumer_offsets: IntArray
    lengths: IntArray
    raw_count: int  # descriptors before coalescing (one per K|V head, or per token in NHD)

    @property
    def num_descriptors(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def bytes_per_block(self) -> int:
        return int(self.lengths.sum())

    @functools.cached_property
    def sources(self) -> tuple[int, ...]:
        """Producer rank indices this consumer rank reads from, ascending (computed once:
        the connector asks on every transfer)."""
        return tuple(int(r) for r in np.unique(self.producer_ranks))

    @property
    def descriptors(self) -> tuple[Descriptor, ...]:
        return tuple(
            Descriptor(int(p), int(g), int(lay), int(po), int(co), int(n))
            for p, g, lay, po, co, n in zip(self.producer_ranks, self.regions, self.layers,
                                            self.producer_offsets, self.consumer_offsets,
                                            self.lengths, strict=True)
        )

    def for_producer(self, producer_rank: int) -> RankPlan:
        """The subset read from one producer rank (what a push-mode producer writes).

        Its ``raw_count`` is -1: the uncoalesced count is only kept for whole plans.
        """
        mask = self.producer_ranks == producer_rank
        return RankPlan(self.consumer_rank, self.consumer, self.producer_ranks[mask],
                        self.regions[mask], self.layers[mask], self.producer_offsets[mask],
                        self.consumer_offsets[mask], self.lengths[mask], -1)


@dataclass(frozen=True)
class RankPlanStats:
    consumer_rank: int
    consumer: ParallelTopology
    sources: tuple[ParallelTopology, ...]
    bytes_per_block: int
    raw_descriptors: int
    descriptors: int

    def to_dict(self, producer: ParallelTopology) -> dict[str, Any]:
        return {
            "consumer_rank": self.consumer_rank,
            "consumer": _rank_dict(self.consumer),
            "sources": [dict(_rank_dict(s), rank=rank_index(s)) for s in self.sources],
            "bytes_per_block": self.bytes_per_block,
            "descriptors_before_coalescing": self.raw_descriptors,
            "descriptors": self.descriptors,
        }


def _rank_dict(t: ParallelTopology) -> dict[str, Any]:
    return {"name": describe_rank(t), "tp_rank": t.tp_rank, "pp_rank": t.pp_rank,
            "dcp_rank": t.dcp_rank, "pcp_rank": t.pcp_rank}


@dataclass(frozen=True)
class PlanStats:
    ranks: tuple[RankPlanStats, ...]

    @property
    def total_bytes_per_block(self) -> int:
        """Bytes moved per block index, all consumer ranks and regions together."""
        return sum(r.bytes_per_block for r in self.ranks)

    @property
    def total_raw_descriptors(self) -> int:
        return sum(r.raw_descriptors for r in self.ranks)

    @property
    def total_descriptors(self) -> int:
        return sum(r.descriptors for r in self.ranks)


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """Plan from every producer rank to every consumer rank for one spec."""

    spec: KVCacheSpec
    producer: ParallelTopology  # sizes only (ranks 0)
    consumer: ParallelTopology  # sizes only
    ranks: tuple[RankPlan, ...]  # index = consumer rank index

    def for_consumer(self, consumer: ParallelTopology | int) -> RankPlan:
        """The plan of one consumer rank (a topology with its ranks set, or an index)."""
        if isinstance(consumer, ParallelTopology):
            if consumer.sizes() != self.consumer:
                raise LayoutError("consumer", f"rank of {consumer.describe()} does not "
                                              f"belong to this plan's {self.consumer.describe()}")
            consumer = rank_index(consumer)
        if not 0 <= consumer < len(self.ranks):
            raise LayoutError("consumer_rank", f"expected [0, {len(self.ranks)}), got {consumer}")
        return self.ranks[consumer]

    def for_producer(self, producer: ParallelTopology | int) -> dict[int, RankPlan]:
        """Per consumer rank index, what one producer rank sends it (push mode)."""
        index = rank_index(producer) if isinstance(producer, ParallelTopology) else producer
        out: dict[int, RankPlan] = {}
        for rank_plan in self.ranks:
            sub = rank_plan.for_producer(index)
            if sub.num_descriptors:
                out[rank_plan.consumer_rank] = sub
        return out

    def stats(self) -> PlanStats:
        return PlanStats(tuple(
            RankPlanStats(r.consumer_rank, r.consumer,
                          tuple(rank_at(self.producer, s) for s in r.sources),
                          r.bytes_per_block, r.raw_count, r.num_descriptors)
            for r in self.ranks
        ))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (the shape ``kvbridge plan --json`` prints)."""
        stats = self.stats()
        return {
            "model": self.spec.model,
            "fingerprint": self.spec.fingerprint(),
            "producer": self.producer.describe(),
            "consumer": self.consumer.describe(),
            "total_bytes_per_block": stats.total_bytes_per_block,
            "descriptors_before_coalescing": stats.total_raw_descriptors,
            "descriptors": stats.total_descriptors,
            "ranks": [r.to_dict(self.producer) for r in stats.ranks],
        }


# --------------------------------------------------------------------------- planning


def plan_transfer(spec: KVCacheSpec, producer: ParallelTopology,
                  consumer: ParallelTopology) -> TransferPlan:
    """Plan every consumer rank's reads from the producer engine.

    Raises :class:`LayoutError` naming ``producer.*`` or ``consumer.*`` when
    the pair cannot be served (unshardable heads, too many stages, unequal DCP
    or PCP).
    """
    producer, consumer = _check_pair(spec, producer, consumer)
    stage_of = _stage_of_layer(spec, producer.pp_size)
    ranks = tuple(_plan_rank(spec, producer, c, stage_of) for c in consumer.ranks())
    return TransferPlan(spec, producer, consumer, ranks)


def plan_consumer_rank(spec: KVCacheSpec, producer: ParallelTopology,
                       consumer_rank: ParallelTopology) -> RankPlan:
    """The plan of one consumer rank alone: ``plan_transfer(...).for_consumer(rank)``.

    Costs one rank's planning whatever the consumer's world size, so a producer
    answering one consumer rank's ``hello`` never plans the ranks a peer merely
    claims to have. Raises LayoutError as :func:`plan_transfer` does.
    """
    producer, _ = _check_pair(spec, producer, consumer_rank)
    return _plan_rank(spec, producer, consumer_rank, _stage_of_layer(spec, producer.pp_size))


def _check_pair(spec: KVCacheSpec, producer: ParallelTopology, consumer: ParallelTopology
                ) -> tuple[ParallelTopology, ParallelTopology]:
    """Both engines' sizes, checked: each runs the model, and their DCP and PCP agree."""
    producer = producer.sizes()
    consumer = consumer.sizes()
    spec.validate_topology(producer, "producer")
    spec.validate_topology(consumer, "consumer")
    if producer.dcp_size != consumer.dcp_size:
        raise LayoutError(
            "consumer.dcp_size",
            f"consumer dcp_size {consumer.dcp_size} differs from producer dcp_size "
            f"{producer.dcp_size}; token shards only line up with equal DCP on both sides, "
            f"so run both engines with the same dcp_size",
        )
    if producer.pcp_size != consumer.pcp_size:
        raise LayoutError(
            "consumer.pcp_size",
            f"consumer pcp_size {consumer.pcp_size} differs from producer pcp_size "
            f"{producer.pcp_size}; kvbridge maps pcp rank p to pcp rank p only, so run "
            f"both engines with the same pcp_size",
        )
    return producer, consumer


def _stage_of_layer(spec: KVCacheSpec, pp_size: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for stage in range(pp_size):
        for layer in spec.stage_layers(pp_size, stage):
            out[layer] = stage
    return out


def _replicate_source(producer: ParallelTopology, consumer: ParallelTopology,
                      token_sharded: bool) -> int:
    """Producer TP rank a consumer rank reads a REPLICATE region from."""
    if token_sharded and producer.dcp_size > 1:
        group = consumer.head_group % producer.num_head_groups
        return group * producer.dcp_size + consumer.dcp_rank
    return consumer.tp_rank % producer.tp_size


def _split_source_group(num_heads: int, producer_groups: int, consumer_group: int,
                        head: int) -> int:
    """Producer head group a consumer reads ``head`` from (one replica when replicated)."""
    if num_heads % producer_groups == 0:
        return head // (num_heads // producer_groups)
    replicas = producer_groups // num_heads
    return head * replicas + consumer_group % replicas


def _raw_rows(shape_c: RankRegionShape, shape_p: RankRegionShape, head_lo: int,
              head_hi: int) -> tuple[IntArray, IntArray, int]:
    """Uncoalesced (producer_offset, consumer_offset) rows for heads [lo, hi), and row length."""
    region = shape_c.region
    tokens, dim, elem = region.block_size, region.head_dim, region.elem_bytes
    kv = np.arange(region.num_kv, dtype=np.int64)
    heads = np.arange(head_lo, head_hi, dtype=np.int64)
    if region.interior is not Interior.KV_OUTER:
        return _interior_rows(shape_c, shape_p, heads)
    if region.memory_order is MemoryOrder.HND:
        row = tokens * dim * elem
        p = (kv[:, None] * shape_p.num_heads + (heads - shape_p.head_start)[None, :]) * row
        c = (kv[:, None] * shape_c.num_heads + (heads - shape_c.head_start)[None, :]) * row
        return p.ravel(), c.ravel(), row
    row = dim * elem
    tok = np.arange(tokens, dtype=np.int64)
    kt = (kv[:, None] * tokens + tok[None, :])[:, :, None]
    p = (kt * shape_p.num_heads + (heads - shape_p.head_start)[None, None, :]) * row
    c = (kt * shape_c.num_heads + (heads - shape_c.head_start)[None, None, :]) * row
    return p.ravel(), c.ravel(), row


def _interior_rows(shape_c: RankRegionShape, shape_p: RankRegionShape, heads: IntArray,
                   ) -> tuple[IntArray, IntArray, int]:
    """Rows of vLLM's packed interiors: one ``head_dim`` row per (head, token, K|V).

    ``token_kv``: cell ``(h, n)`` (HND) or ``(n, h)`` (NHD) holds K then V, so
    element offset ``cell * 2 * dim + kv * dim``. ``head_kv`` (HND): head ``h``
    holds its K rows then its V rows, offset ``((h * 2 + kv) * tokens + n) * dim``.
    Coalescing merges them back into whole heads (or whole cells) where both
    sides are adjacent.
    """
    region = shape_c.region
    tokens, dim, elem = region.block_size, region.head_dim, region.elem_bytes
    kv = np.arange(2, dtype=np.int64)[None, None, :]
    tok = np.arange(tokens, dtype=np.int64)[None, :, None]

    def offsets(shape: RankRegionShape) -> IntArray:
        h = (heads - shape.head_start)[:, None, None]
        if region.interior is Interior.HEAD_KV:
            out = ((h * 2 + kv) * tokens + tok) * dim
        elif region.memory_order is MemoryOrder.HND:
            out = (h * tokens + tok) * 2 * dim + kv * dim
        else:
            out = (tok * shape.num_heads + h) * 2 * dim + kv * dim
        return (out * elem).ravel()

    return offsets(shape_p), offsets(shape_c), dim * elem


def _plan_rank(spec: KVCacheSpec, producer: ParallelTopology, consumer: ParallelTopology,
               stage_of: Mapping[int, int]) -> RankPlan:
    cols: list[tuple[int, int, int, IntArray, IntArray, int]] = []
    producer_shapes: dict[tuple[int, int], tuple[RankRegionShape, ...]] = {}

    def shapes_of(tp_rank: int, pp_rank: int) -> tuple[RankRegionShape, ...]:
        key = (tp_rank, pp_rank)
        if key not in producer_shapes:
            producer_shapes[key] = spec.rank_shapes(producer.with_rank(
                tp_rank=tp_rank, pp_rank=pp_rank, pcp_rank=consumer.pcp_rank))
        return producer_shapes[key]

    for region_index, shape_c in enumerate(spec.rank_shapes(consumer)):
        region = shape_c.region
        if not shape_c.layer_ids:
            continue
        # Runs of consecutive heads that come from the same producer TP rank.
        runs: list[tuple[int, int, int]] = []  # (producer tp rank, head_lo, head_hi)
        if region.layout is RegionLayout.REPLICATE:
            source = _replicate_source(producer, consumer, region.token_sharded)
            runs.append((source, 0, region.num_kv_heads))
        else:
            for head in range(shape_c.head_start, shape_c.head_start + shape_c.num_heads):
                group = _split_source_group(region.num_kv_heads, producer.num_head_groups,
                                            consumer.head_group, head)
                source = group * producer.dcp_size + consumer.dcp_rank
                if runs and runs[-1][0] == source and runs[-1][2] == head:
                    runs[-1] = (source, runs[-1][1], head + 1)
                else:
                    runs.append((source, head, head + 1))
        for layer in shape_c.layer_ids:
            pp_rank = stage_of[layer]
            for source, lo, hi in runs:
                shape_p = shapes_of(source, pp_rank)[region_index]
                # Invariant of the head assignment: the chosen source holds the heads.
                assert (shape_p.head_start <= lo and hi <= shape_p.head_start
                        + shape_p.num_heads and layer in shape_p.layer_ids), (source, lo, hi)
                p_off, c_off, row = _raw_rows(shape_c, shape_p, lo, hi)
                src = source + (pp_rank * producer.pcp_size + consumer.pcp_rank) \
                    * producer.tp_size
                cols.append((src, region_index, layer, p_off, c_off, row))
    return _coalesce(consumer, cols)


def _coalesce(consumer: ParallelTopology,
              cols: Sequence[tuple[int, int, int, IntArray, IntArray, int]]) -> RankPlan:
    if not cols:
        empty = np.zeros(0, dtype=np.int64)
        return RankPlan(rank_index(consumer), consumer, empty, empty, empty, empty, empty,
                        empty, 0)
    sizes = [c[3].shape[0] for c in cols]
    prank = np.repeat(np.array([c[0] for c in cols], dtype=np.int64), sizes)
    region = np.repeat(np.array([c[1] for c in cols], dtype=np.int64), sizes)
    layer = np.repeat(np.array([c[2] for c in cols], dtype=np.int64), sizes)
    length = np.repeat(np.array([c[5] for c in cols], dtype=np.int64), sizes)
    p_off = np.concatenate([c[3] for c in cols])
    c_off = np.concatenate([c[4] for c in cols])
    raw = int(length.shape[0])
    order = np.lexsort((c_off, layer, prank))
    prank, region, layer = prank[order], region[order], layer[order]
    p_off, c_off, length = p_off[order], c_off[order], length[order]
    # A row continues the previous one when both sides are byte-adjacent in the
    # same producer rank's same layer (layers are separate tensors: never merged).
    cont = ((prank[1:] == prank[:-1]) & (layer[1:] == layer[:-1])
            & (c_off[1:] == c_off[:-1] + length[:-1])
            & (p_off[1:] == p_off[:-1] + length[:-1]))
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    merged_length = np.add.reduceat(length, starts)
    return RankPlan(rank_index(consumer), consumer, prank[starts], region[starts],
                    layer[starts], p_off[starts], c_off[starts],
                    merged_length.astype(np.int64), raw)


# --------------------------------------------------------------------------- addresses


@dataclass(frozen=True)
class LayerMemory:
    """Where one layer's KV tensor of one rank sits: ``base_addr + block_id * block_stride``."""

    base_addr: int
    block_stride: int  # bytes from one block to the next (>= bytes of one block)
    num_blocks: int


def rank_memory(spec: KVCacheSpec, topology: ParallelTopology,
                base_addrs: Mapping[int, int], num_blocks: int) -> dict[int, LayerMemory]:
    """LayerMemory of every layer on ``topology``'s stage for densely packed tensors.

    ``base_addrs`` maps layer id to the data pointer of that layer's tensor.
    """
    out: dict[int, LayerMemory] = {}
    for shape in spec.rank_shapes(topology):
        for layer in shape.layer_ids:
            if layer not in base_addrs:
                raise LayoutError("base_addrs", f"missing the address of layer {layer}")
            out[layer] = LayerMemory(int(base_addrs[layer]), shape.block_bytes_per_layer,
                                     num_blocks)
    return out


@dataclass(frozen=True, eq=False)
class TransferDescriptors:
    """Absolute descriptors between one consumer rank and one producer rank.

    Row ``i`` of ``consumer`` and row ``i`` of ``producer`` are one copy of
    ``len`` bytes; columns are ``(addr, len)``, dtype uint64 (NIXL's dlist takes
    them with a device id column appended). Rows are ordered by descriptor
    (layer ascending), then by block, so ``layers`` is sorted and a per-layer
    push can slice it.
    """

    producer_rank: int
    consumer: AddrArray  # (N, 2)
    producer: AddrArray  # (N, 2)
    layers: IntArray  # (N,)

    @property
    def total_bytes(self) -> int:
        return int(self.consumer[:, 1].sum())


def _memory_columns(memory: Mapping[int, LayerMemory], layers: IntArray, side: str,
                    ) -> tuple[IntArray, IntArray, IntArray]:
    base = np.empty(layers.shape[0], dtype=np.int64)
    stride = np.empty_like(base)
    blocks = np.empty_like(base)
    cache: dict[int, LayerMemory] = {}
    for i, layer in enumerate(layers.tolist()):
        mem = cache.get(layer)
        if mem is None:
            if layer not in memory:
                raise LayoutError(f"{side}_memory", f"no registered memory for layer {layer}")
            mem = cache[layer] = memory[layer]
        base[i], stride[i], blocks[i] = mem.base_addr, mem.block_stride, mem.num_blocks
    return base, stride, blocks


def _check_ids(ids: IntArray, num_blocks: IntArray, side: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks.min(initial=2**62)):
        raise LayoutError(f"{side}_block_ids",
                          f"block id out of range [0, {int(num_blocks.min(initial=0))}): "
                          f"min {int(ids.min())}, max {int(ids.max())}")


def absolute_descriptors(
    rank_plan: RankPlan,
    consumer_memory: Mapping[int, LayerMemory],
    producer_memory: Mapping[int, Mapping[int, LayerMemory]],
    consumer_block_ids: Sequence[int] | IntArray,
    producer_block_ids: Sequence[int] | IntArray,
    *,
    layers: Collection[int] | None = None,
    producer_ranks: Collection[int] | None = None,
) -> list[TransferDescriptors]:
    """Absolute ``(addr, len)`` arrays for a request's blocks, one entry per producer rank.

    ``consumer_memory`` maps layer id to this consumer rank's layer tensor;
    ``producer_memory`` maps producer rank index to the same for that rank.
    Producer block ``producer_block_ids[i]`` fills consumer block
    ``consumer_block_ids[i]``. Block ids and descriptor extents are bounds
    checked against the given memory before anything is returned (a bad id from
    a peer becomes a LayoutError, never a wild address). ``layers`` and
    ``producer_ranks`` restrict the output (per-layer push, one peer).
    Vectorised: cost is O(descriptors) Python work plus numpy over blocks.
    """
    c_ids = np.asarray(consumer_block_ids, dtype=np.int64).ravel()
    p_ids = np.asarray(producer_block_ids, dtype=np.int64).ravel()
    if c_ids.shape != p_ids.shape:
        raise LayoutError("producer_block_ids", f"expected {c_ids.shape[0]} block ids (one per "
                                                f"consumer block), got {p_ids.shape[0]}")
    mask = np.ones(rank_plan.num_descriptors, dtype=bool)
    if layers is not None:
        mask &= np.isin(rank_plan.layers, np.fromiter(layers, dtype=np.int64))
    if producer_ranks is not None:
        mask &= np.isin(rank_plan.producer_ranks, np.fromiter(producer_ranks, dtype=np.int64))
    out: list[TransferDescriptors] = []
    for source in np.unique(rank_plan.producer_ranks[mask]).tolist():
        sel = mask & (rank_plan.producer_ranks == source)
        lay = rank_plan.layers[sel]
        length = rank_plan.lengths[sel]
        p_mem = producer_memory.get(source)
        if p_mem is None:
            raise LayoutError("producer_memory", f"no registered memory for producer rank "
                                                 f"{source}")
        c_base, c_stride, c_blocks = _memory_columns(consumer_memory, lay, "consumer")
        p_base, p_stride, p_blocks = _memory_columns(p_mem, lay, "producer")
        c_off, p_off = rank_plan.consumer_offsets[sel], rank_plan.producer_offsets[sel]
        if np.any(c_off + length > c_stride):
            raise LayoutError("consumer_memory", "a descriptor extends past the consumer's "
                                                 "block stride; memory smaller than the spec")
        if np.any(p_off + length > p_stride):
            raise LayoutError("producer_memory", "a descriptor extends past the producer's "
                                                 "block stride; memory smaller than the spec")
        _check_ids(c_ids, c_blocks, "consumer")
        _check_ids(p_ids, p_blocks, "producer")
        num = c_ids.shape[0]
        consumer = np.empty((lay.shape[0], num, 2), dtype=np.uint64)
        producer = np.empty((lay.shape[0], num, 2), dtype=np.uint64)
        # Addresses are computed in int64 (ids and offsets are checked >= 0 above) and
        # written straight into the uint64 output: no per-block temporaries.
        np.add((c_base + c_off)[:, None], c_stride[:, None] * c_ids[None, :],
               out=consumer[:, :, 0], casting="unsafe")
        np.add((p_base + p_off)[:, None], p_stride[:, None] * p_ids[None, :],
               out=producer[:, :, 0], casting="unsafe")
        consumer[:, :, 1] = length[:, None]
        producer[:, :, 1] = length[:, None]
        out.append(TransferDescriptors(int(source), consumer.reshape(-1, 2),
                                       producer.reshape(-1, 2), np.repeat(lay, num)))
    return out
