"""One rank's digest records in memory, and digests of its blocks straight from its KV tensors.

The worker half registers :attr:`RankDigests.buffer` with its store client, so
records are put from and got into it zero-copy like the KV itself. Each region
this rank holds layers of has two :class:`~.records.RecordTable` (one slot per
local block id): one the saves write before their put, one the loads get into.
Two, because a put abandoned after a timeout may still read its slots while a
later load lands in the same block ids (the load table is written only by this
rank's one load path: the load thread, or ``start_load_kv`` when loads are
synchronous, never both).

Memory: ``2 * num_blocks * (32 + 8 * layers)`` bytes per region, e.g. 10,000
blocks of 40 layers: 7 MB, against the KV's hundreds of GB.

Digests are XXH3-64 (:func:`kvbridge.layouts.digests.digest_bytes`) of each
block's span in each layer tensor, read in place through a host view:
:meth:`layer_digests` equals :class:`kvbridge.layouts.digests.BlockDigester`'s
``layer_digests`` for the same block (a test checks it), one layer at a time
over many blocks so that a batch costs one Python-level pass per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbridge.connectors.mooncake_store.records import RecordTable, record_bytes
from kvbridge.layouts.digests import digest_fast, host_view


class RankDigests:
    """Record tables and block digests of one rank (``plans``: the worker's region plans).

    ``owner`` keeps the KV tensors alive as long as the views into them. Only
    for host memory: the caller checks that every KV tensor is on the CPU.
    """

    def __init__(self, plans: Sequence[Any], owner: object = None) -> None:
        self._owner = owner
        sizes = [2 * plan.num_blocks * record_bytes(len(plan.layers)) if plan.layers else 0
                 for plan in plans]
        #: every table of the rank in one allocation (one buffer registration)
        self.buffer = np.zeros(max(1, sum(sizes)), dtype=np.uint8)
        self.save: dict[int, RecordTable] = {}
        self.load: dict[int, RecordTable] = {}
        self._views: dict[int, list[tuple[memoryview, int, int]]] = {}
        offset = 0
        for plan, size in zip(plans, sizes, strict=True):
            if not size:
                continue
            layers = len(plan.layers)
            block_bytes = plan.layers[0].block_nbytes
            half = size // 2
            for tables, start in ((self.save, offset), (self.load, offset + half)):
                table = RecordTable(self.buffer[start:start + half], layers, block_bytes,
                                    plan.num_blocks)
                table.reset_headers()
                tables[plan.region_index] = table
            offset += size
            self._views[plan.region_index] = [
                (host_view(slot.base_ptr, (plan.num_blocks - 1) * slot.block_stride
                           + slot.block_nbytes), slot.block_stride, slot.block_nbytes)
                for slot in plan.layers]

    @property
    def buffer_ptr(self) -> int:
        return int(self.buffer.ctypes.data)

    def layer_digests(self, region_index: int, block_ids: Sequence[int]) -> np.ndarray:
        """``(len(block_ids), layers)`` uint64: XXH3-64 of each block's span in each layer.

        Block ids must be in range (the worker's ``gather`` checked them).
        """
        digest = digest_fast
        columns = [[digest(view[b * stride:b * stride + nbytes]) for b in block_ids]
                   for view, stride, nbytes in self._views[region_index]]
        return np.array(columns, dtype=np.uint64).T.reshape(len(block_ids), len(columns))
