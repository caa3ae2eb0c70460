"""Pure index math of the NIXL connector: who notifies whom, and prepared-list rows.

Descriptor lists are prepared **once** per (local rank, plan) and per remote
rank, never per request. A list is the plan's descriptors times every block:
row ``base_row[j] + block_id`` is descriptor ``j`` of the block ``block_id``
(``base_row[j] = sum of num_blocks of the descriptors before j``). A request
then becomes two int32 index arrays, built with numpy from its block ids.

Notification targets: every producer rank that holds a request's blocks must
hear from consumer ranks exactly ``expected`` times. A consumer rank notifies
each producer rank it reads from (its plan's sources); a producer rank that no
consumer rank reads from (e.g. producer TP 4 -> consumer TP 1 of an MLA model,
where rank 0 is read and ranks 1..3 only hold copies) is assigned to consumer
rank ``producer_rank % consumer_world``, which sends it a no-read release.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvbridge.layouts import LayerMemory, LayoutError, RankPlan, TransferPlan

IntArray = npt.NDArray[np.int64]


def notify_targets(plan: TransferPlan) -> dict[int, tuple[int, ...]]:
    """Consumer rank index -> producer rank indices it notifies (sources first)."""
    targets: dict[int, set[int]] = {r.consumer_rank: set(r.sources) for r in plan.ranks}
    covered = set().union(*targets.values()) if targets else set()
    world = plan.consumer.world_size
    for producer_rank in range(plan.producer.world_size):
        if producer_rank not in covered:
            targets[producer_rank % world].add(producer_rank)
    return {c: tuple(sorted(p)) for c, p in targets.items()}


def expected_notifs(targets: Mapping[int, Sequence[int]], producer_rank: int) -> int:
    """How many consumer ranks notify ``producer_rank`` (>= 1 for every producer rank)."""
    return sum(1 for ranks in targets.values() if producer_rank in ranks)


@dataclass(frozen=True, eq=False)
class DescTable:
    """Rows of one prepared list: ``rows[base_row[j] + b]`` is descriptor ``j`` of block ``b``.

    ``regions[j]`` is the spec region of descriptor ``j`` (whose block ids index it),
    ``num_blocks[j]`` bounds its block ids.
    """

    rows: npt.NDArray[np.uint64]  # (N, 2) addr, len
    base_row: IntArray
    num_blocks: IntArray
    regions: IntArray
    layers: IntArray

    @property
    def num_descs(self) -> int:
        return int(self.base_row.shape[0])

    def indices(self, which: IntArray, block_ids: Sequence[Sequence[int]] | Sequence[IntArray],
                side: str) -> npt.NDArray[np.int32]:
        """Row indices of descriptors ``which`` for every block of the request.

        ``block_ids[r]`` are the request's block ids of region ``r``; they are
        bounds-checked against the registered block count (a bad id from a peer
        is refused here, before anything is posted).
        """
        parts = []
        for j in which.tolist():
            ids = np.asarray(block_ids[int(self.regions[j])], dtype=np.int64)
            if ids.size == 0:
                continue
            bound = int(self.num_blocks[j])
            if ids.min() < 0 or ids.max() >= bound:
                raise LayoutError(f"{side}_block_ids",
                                  f"block id out of range [0, {bound}): min {int(ids.min())}, "
                                  f"max {int(ids.max())} (region {int(self.regions[j])})")
            parts.append(self.base_row[j] + ids)
        if not parts:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate(parts).astype(np.int32)


def build_table(regions: IntArray, layers: IntArray, offsets: IntArray, lengths: IntArray,
                memory: Mapping[int, LayerMemory], side: str) -> DescTable:
    """Rows for descriptors ``(region, layer, offset-in-block, length)`` over every block.

    Raises LayoutError when a descriptor would leave its block (offset + length
    past the block stride) or its layer has no memory.
    """
    nb = np.empty(layers.shape[0], dtype=np.int64)
    parts = []
    for j, (layer, offset, length) in enumerate(zip(layers.tolist(), offsets.tolist(),
                                                    lengths.tolist(), strict=True)):
        mem = memory.get(int(layer))
        if mem is None:
            raise LayoutError(f"{side}_memory", f"no registered memory for layer {layer}")
        if offset < 0 or length <= 0 or offset + length > mem.block_stride:
            raise LayoutError(f"{side}_memory",
                              f"descriptor [{offset}, {offset + length}) of layer {layer} "
                              f"leaves its block of {mem.block_stride} bytes")
        nb[j] = mem.num_blocks
        rows = np.empty((mem.num_blocks, 2), dtype=np.uint64)
        rows[:, 0] = (np.uint64(mem.base_addr + offset)
                      + np.arange(mem.num_blocks, dtype=np.uint64) * np.uint64(mem.block_stride))
        rows[:, 1] = length
        parts.append(rows)
    base = np.zeros(layers.shape[0], dtype=np.int64)
    if layers.shape[0] > 1:
        base[1:] = np.cumsum(nb)[:-1]
    rows_all = (np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.uint64))
    return DescTable(rows_all, base, nb, regions.astype(np.int64), layers.astype(np.int64))


def consumer_table(rank_plan: RankPlan, memory: Mapping[int, LayerMemory]) -> DescTable:
    """The consumer rank's side of every descriptor of its plan (pull: READ destinations)."""
    return build_table(rank_plan.regions, rank_plan.layers, rank_plan.consumer_offsets,
                       rank_plan.lengths, memory, "consumer")


def producer_table(rank_plan: RankPlan, memory: Mapping[int, LayerMemory]) -> DescTable:
    """The producer side of ``rank_plan``'s descriptors (use ``for_producer`` first)."""
    return build_table(rank_plan.regions, rank_plan.layers, rank_plan.producer_offsets,
                       rank_plan.lengths, memory, "producer")


def pull_indices(rank_plan: RankPlan, local: DescTable, remote: DescTable, producer_rank: int,
                 consumer_block_ids: Sequence[Sequence[int]],
                 producer_block_ids: Sequence[Sequence[int]],
                 ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """(local rows, remote rows) of one consumer rank's READ from ``producer_rank``.

    ``local`` is :func:`consumer_table` of the whole rank plan; ``remote`` is
    :func:`producer_table` of ``rank_plan.for_producer(producer_rank)`` on that
    producer's memory (its descriptors in the same order).
    """
    which = np.flatnonzero(rank_plan.producer_ranks == producer_rank)
    lidx = local.indices(which, consumer_block_ids, "consumer")
    ridx = remote.indices(np.arange(which.shape[0]), producer_block_ids, "producer")
    return lidx, ridx


def check_block_lists(consumer_block_ids: Sequence[Sequence[int]],
                      producer_block_ids: Sequence[Sequence[int]]) -> None:
    if len(consumer_block_ids) != len(producer_block_ids):
        raise LayoutError("block_ids", f"expected {len(consumer_block_ids)} regions, "
                                       f"got {len(producer_block_ids)}")
    for r, (c, p) in enumerate(zip(consumer_block_ids, producer_block_ids, strict=True)):
        if len(c) != len(p):
            raise LayoutError(f"block_ids[{r}]", f"{len(c)} consumer blocks but {len(p)} "
                                                 f"producer blocks")
