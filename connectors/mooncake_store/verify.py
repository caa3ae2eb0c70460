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
over many blocks so that a batch costs one Python-level pass per layer. KV in
device memory has no host view: its digests are ``torch-mix64-v1``
(:class:`kvbridge.layouts.torch_digests.TorchBlockDigester`, a few kernels per
layer on the tensors' own device), which a host rank can take too (the same
bytes give the same digest on any device), so a reader checks a record with
the algorithm the record names whenever it can (:attr:`RankDigests.algorithms`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvbridge.connectors.mooncake_store.records import RecordTable, record_bytes
from kvbridge.layouts.digests import ALGORITHM, TORCH_ALGORITHM, digest_fast, host_view


class RankDigests:
    """Record tables and block digests of one rank (``plans``: the worker's region plans).

    ``owner`` keeps the KV tensors alive as long as the views into them.
    ``tensors`` (layer id -> KV tensor, any device) make ``torch-mix64-v1``
    digests possible; ``on_host``: the KV is in host memory, readable through
    host views (XXH3-64). ``algorithm``: what this rank's records are digested
    with (default: XXH3-64 on host, ``torch-mix64-v1`` otherwise); it must be one
    of :attr:`algorithms` (ValueError).
    """

    def __init__(self, plans: Sequence[Any], owner: object = None, *,
                 tensors: Mapping[int, Any] | None = None, on_host: bool = True,
                 algorithm: str | None = None) -> None:
        self._owner = owner
        #: the algorithms this rank can take digests with, its records' first
        self.algorithms: tuple[str, ...] = tuple(
            a for a, ok in ((ALGORITHM, on_host), (TORCH_ALGORITHM, tensors is not None)) if ok)
        self.algorithm = algorithm or (self.algorithms[0] if self.algorithms else "")
        if self.algorithm not in self.algorithms:
            raise ValueError(f"digests with {self.algorithm or 'no algorithm'!r} need "
                             + ("the KV in host memory" if self.algorithm == ALGORITHM
                                else "the KV tensors") + f"; this rank can take "
                             f"{list(self.algorithms)}")
        if self.algorithm != self.algorithms[0]:
            self.algorithms = (self.algorithm,
                               *(a for a in self.algorithms if a != self.algorithm))
        self._tensors = tensors
        self._torch: Any = None  # TorchBlockDigester, made on first use
        self._torch_region: dict[int, int] = {}
        sizes = [2 * plan.num_blocks * record_bytes(len(plan.layers)) if plan.layers else 0
                 for plan in plans]
        #: every table of the rank in one allocation (one buffer registration)
        self.buffer = np.zeros(max(1, sum(sizes)), dtype=np.uint8)
        self.save: dict[int, RecordTable] = {}
        self.load: dict[int, RecordTable] = {}
        self._views: dict[int, list[tuple[memoryview, int, int]]] = {}
        self._plans = {plan.region_index: plan for plan in plans if plan.layers}
        offset = 0
        for plan, size in zip(plans, sizes, strict=True):
            if not size:
                continue
            layers = len(plan.layers)
            block_bytes = plan.layers[0].block_nbytes
            half = size // 2
            for tables, start in ((self.save, offset), (self.load, offset + half)):
                table = RecordTable(self.buffer[start:start + half], layers, block_bytes,
                                    plan.num_blocks, self.algorithm)
                table.reset_headers()
                tables[plan.region_index] = table
            offset += size
            if on_host:
                self._views[plan.region_index] = [
                    (host_view(slot.base_ptr, (plan.num_blocks - 1) * slot.block_stride
                               + slot.block_nbytes), slot.block_stride, slot.block_nbytes)
                    for slot in plan.layers]

    @property
    def buffer_ptr(self) -> int:
        return int(self.buffer.ctypes.data)

    def layer_digests(self, region_index: int, block_ids: Sequence[int],
                      algorithm: str | None = None) -> np.ndarray:
        """``(len(block_ids), layers)`` uint64: the digest of each block's span in each
        layer, with ``algorithm`` (default: this rank's; one of :attr:`algorithms`).

        Block ids must be in range (the worker's ``gather`` checked them).
        """
        algorithm = algorithm or self.algorithm
        if algorithm == TORCH_ALGORITHM:
            return self._torch_digester().layer_digests_of(self._torch_region[region_index],
                                                           block_ids)
        if algorithm != ALGORITHM or region_index not in self._views:
            raise ValueError(f"this rank cannot take {algorithm!r} digests of region "
                             f"{region_index} (it can: {list(self.algorithms)})")
        digest = digest_fast
        columns = [[digest(view[b * stride:b * stride + nbytes]) for b in block_ids]
                   for view, stride, nbytes in self._views[region_index]]
        return np.array(columns, dtype=np.uint64).T.reshape(len(block_ids), len(columns))

    def _torch_digester(self) -> Any:
        if self._torch is None:
            from kvbridge.layouts.torch_digests import TensorSpan, TorchBlockDigester

            if self._tensors is None:
                raise ValueError("torch-mix64-v1 digests need the KV tensors")
            spans = {slot.layer_id: TensorSpan(self._tensors[slot.layer_id], slot.block_stride,
                                               slot.block_nbytes, plan.num_blocks)
                     for plan in self._plans.values() for slot in plan.layers}
            regions = []
            for position, (index, plan) in enumerate(self._plans.items()):
                self._torch_region[index] = position
                regions.append([slot.layer_id for slot in plan.layers])
            self._torch = TorchBlockDigester(spans, regions)
        return self._torch
