"""Worker half of the offloading connector: memcpy between the engine's KV and CPU slots.

A slot of pool ``p`` holds one part of one block: this rank's bytes of the
block across its layers of the region, layer after layer in layer order
(``RankRegionShape.block_bytes``). Loads run in ``start_load_kv`` (before any
layer is computed), stores in ``wait_for_save`` (after every layer of the step
is computed); both finish inside the step, so the scheduler completes them in
``update_connector_output`` of the same step.

The slot memory is the scheduler's CPU tier, found through a process-local
registry by the token in the metadata when the worker runs in the scheduler's
process; otherwise (setting ``shm_dir``) the worker maps the tier's backing
files named in the metadata (``SlotMemory.attach``). A load that cannot copy
(no slot memory, a failed copy, or one injected by :mod:`.faults` around this
worker) reports its blocks in ``get_block_ids_with_load_errors``; the engine
then recomputes from the first bad token.

Copies are batched (:mod:`.copier`): per (region, pool) of a step, the blocks
are gathered on the source device, copied across once per run of consecutive
slots and scattered on the destination, as a block swap does. With KV on a CUDA
device they run ``non_blocking`` on the device's dedicated copy stream, ordered
after the compute stream, to and from slot memory this worker pinned
(``SlotMemory.pin``, unpinned when the memory closes); each batch is
synchronised (bounded, ``FENCE_TIMEOUT_S``) before ``start_load_kv`` or
``wait_for_save`` returns, so the scheduler hears of a load or store only once
its bytes landed. Host KV (plain, or guarded as device KV is) runs the same
path without a stream and without pinning. A batch that fails is retried
block by block (blocking copies) to isolate the bad block, except one whose
device did not finish in time (``copy_timeouts``): a blocking copy would wait
on the stuck device without a bound, so all its blocks fail (loads are
recomputed, stores dropped).

Stores are issued only after the kernels that wrote the KV finished:
``wait_for_save`` records a fence (:mod:`kvbridge.backends.device.fence`) and waits
for it, at most ``FENCE_TIMEOUT_S``, before copying; if it has not passed, the
step's stores count as copy errors (the scheduler then fails them). The copy
stream is ordered after the compute stream as well; the fence keeps the rule
on the host side and costs nothing on host memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from kvbridge.backends.device.copy import is_cuda
from kvbridge.backends.device.fence import FENCE_TIMEOUT_S, Fence, record_fence, wait_fence
from kvbridge.connectors.api import BlockRef, ConnectorContext, KVCaches, WorkerConnector
from kvbridge.connectors.errors import ContractError
from kvbridge.connectors.offloading.copier import CopyTimeout, SlotCopier
from kvbridge.connectors.offloading.parts import build_part_table
from kvbridge.connectors.offloading.scheduler import CopyItem, OffloadMetadata, pools_of
from kvbridge.offload.cpu import SlotMemory

logger = logging.getLogger(__name__)


class OffloadingWorker(WorkerConnector):
    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        assert ctx.rank is not None
        table = build_part_table(ctx.spec, ctx.topology)
        parts = table.rank_parts(ctx.spec, ctx.rank)
        #: part index -> region index, for the parts this rank reads / writes
        self.read_parts = {part.index: r for r, (part, _) in parts.items()}
        self.write_parts = {part.index: r for r, (part, writer) in parts.items() if writer}
        self.caches: KVCaches | None = None
        self._fence_tensors: list[torch.Tensor] = []
        self._slots: dict[str, list[torch.Tensor]] = {}
        self._memories: list[SlotMemory] = []
        self._invalid: set[BlockRef] = set()
        #: records the fence of a step's stores (device KV is read only after the kernels that
        #: wrote it finished); a test may stand in for it
        self.record_fence: Callable[[Any], Fence] = record_fence
        self._copiers: dict[torch.device, SlotCopier] = {}
        #: the KV lives on a CUDA device: the slot memory is pinned when first used
        self._pin_slots = False
        self._stats = {"load_copies": 0, "store_copies": 0, "load_bytes": 0, "store_bytes": 0,
                       "load_copy_errors": 0, "store_copy_errors": 0,
                       "store_fence_timeouts": 0, "copy_batches": 0, "copy_timeouts": 0,
                       "slot_bytes_pinned": 0}

    def register_kv_caches(self, caches: KVCaches) -> None:
        self.caches = caches
        devices: dict[str, Any] = {}
        for tensor in caches.layers.values():
            devices.setdefault(str(tensor.device), tensor)
        self._fence_tensors = list(devices.values())  # one KV tensor per device
        self._pin_slots = any(is_cuda(tensor.device) for tensor in self._fence_tensors)

    def _pool_tensors(self, meta: OffloadMetadata) -> list[torch.Tensor]:
        token = meta.pools_token
        tensors = self._slots.get(token)
        if tensors is None:
            tiers = pools_of(token)
            if tiers is not None:  # the scheduler half is in this process
                memories = [tier.memory for tier in tiers]
            elif meta.shared_pools:  # map the scheduler's file-backed slots
                self._close_memories()
                self._memories = [SlotMemory.attach(path, num_slots, nbytes)
                                  for path, num_slots, nbytes in meta.shared_pools]
                memories = self._memories
            else:
                raise ContractError("pools_token", "no CPU tier of this engine in this process "
                                    "and no shm_dir: run the worker in the scheduler's process "
                                    "or set shm_dir")
            if self._pin_slots:  # asynchronous copies at the copy engine's speed
                self._stats["slot_bytes_pinned"] = sum(m.nbytes for m in memories if m.pin())
            tensors = [m.as_tensor() for m in memories]  # type: ignore[misc]
            self._slots = {token: tensors}
        return tensors

    def _close_memories(self) -> None:
        for memory in self._memories:
            memory.close()
        self._memories = []

    def _block_bytes(self, region: int, block_id: int) -> list[torch.Tensor]:
        assert self.caches is not None
        return [tensor[block_id].view(-1).view(torch.uint8)
                for _, tensor in self.caches.region_layers(region)]

    def _copy(self, item: CopyItem, pools: list[torch.Tensor], load: bool) -> int:
        _, region, block_id, pool, slot = item
        row = pools[pool][slot]
        offset = 0
        for block in self._block_bytes(region, block_id):
            size = block.numel()
            if load:
                block.copy_(row[offset:offset + size])
            else:
                row[offset:offset + size].copy_(block)
            offset += size
        if offset != row.numel():
            raise ContractError("slot", f"slot of {row.numel()} bytes for a part of "
                                        f"{offset} bytes (region {region})")
        return offset

    def _copy_batch(self, items: list[CopyItem], pools: list[torch.Tensor], load: bool) -> int:
        """All ``items`` at once: per (region, pool), one batched copy (:mod:`.copier`:
        gather on the source device, one copy across, scatter on the destination),
        instead of one small copy per block and layer. Raises on any problem; the
        caller then copies item by item to isolate it."""
        assert self.caches is not None
        groups: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        for _, region, block_id, pool, slot in items:
            blocks, slots = groups.setdefault((region, pool), ([], []))
            blocks.append(block_id)
            slots.append(slot)
        total = 0
        for (region, pool), (blocks, slots) in groups.items():
            layers = [tensor.view(tensor.shape[0], -1).view(torch.uint8)
                      for _, tensor in self.caches.region_layers(region)]
            slot_bytes = pools[pool].shape[1]
            if sum(layer.shape[1] for layer in layers) != slot_bytes:
                raise ContractError("slot", f"slot of {slot_bytes} bytes for a part of "
                                            f"{sum(x.shape[1] for x in layers)} bytes")
            total += self._copier(layers[0].device).copy(layers, pools[pool], blocks, slots,
                                                         load=load)
            self._stats["copy_batches"] += 1
        return total

    def _copier(self, device: torch.device) -> SlotCopier:
        copier = self._copiers.get(device)
        if copier is None:
            copier = self._copiers[device] = SlotCopier(device)
        return copier

    def start_load_kv(self) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, OffloadMetadata)
        if not meta.loads:
            return
        try:
            pools = self._pool_tensors(meta)
        except ContractError as exc:
            logger.error("offloading worker %s: %s", self.ctx.worker_index, exc)
            for items in meta.loads.values():
                self._invalid |= {(r, b) for p, r, b, _, _ in items if p in self.read_parts}
            return
        mine = [(request_id, item) for request_id, items in meta.loads.items()
                for item in items if item[0] in self.read_parts]
        if mine:
            self._load_blocks(mine, pools)

    def _load_blocks(self, mine: list[tuple[str, CopyItem]], pools: list[torch.Tensor]) -> None:
        """Copy the slots of ``mine`` (request id, item) into the engine's KV; a block
        whose copy fails is reported (``_load_failed``), the others still load. The
        seam :mod:`.faults` wraps to fail chosen blocks before this copy sees them."""
        try:
            self._stats["load_bytes"] += self._copy_batch([i for _, i in mine], pools, True)
            self._stats["load_copies"] += len(mine)
            return
        except CopyTimeout as exc:  # the device is stuck: a blocking retry would hang
            self._stats["copy_timeouts"] += 1
            for request_id, item in mine:
                self._load_failed(request_id, item, exc)
            return
        except (RuntimeError, ContractError) as exc:
            logger.debug("offloading worker %s: batched load failed (%s); copying block by "
                         "block", self.ctx.worker_index, exc)
        for request_id, item in mine:
            try:
                nbytes = self._copy(item, pools, load=True)
            except (OSError, RuntimeError, ContractError) as exc:
                self._load_failed(request_id, item, exc)
                continue
            self._stats["load_copies"] += 1
            self._stats["load_bytes"] += nbytes

    def _load_failed(self, request_id: str, item: CopyItem, exc: BaseException) -> None:
        logger.warning("offloading worker %s: load of block %d (region %d) for %s failed: %s",
                       self.ctx.worker_index, item[2], item[1], request_id, exc)
        self._invalid.add((item[1], item[2]))
        self._stats["load_copy_errors"] += 1

    def wait_for_layer_load(self, layer_id: int) -> None:
        return None  # every load of the step finished in start_load_kv

    def save_kv_layer(self, layer_id: int, kv_layer: torch.Tensor) -> None:
        return None  # a slot holds all layers of a block: copied in wait_for_save

    def wait_for_save(self) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, OffloadMetadata)
        if not meta.stores:
            return
        try:
            pools = self._pool_tensors(meta)
        except ContractError as exc:
            logger.error("offloading worker %s: %s", self.ctx.worker_index, exc)
            self._stats["store_copy_errors"] += 1
            return
        mine = [item for item in meta.stores if item[0] in self.write_parts]
        if not mine:
            return
        if not self._kv_written():
            logger.error("offloading worker %s: the kernels writing this step's KV did not "
                         "finish within %.1f s; %d block stores dropped",
                         self.ctx.worker_index, FENCE_TIMEOUT_S, len(mine))
            self._stats["store_fence_timeouts"] += 1
            self._stats["store_copy_errors"] += len(mine)
            return
        try:
            self._stats["store_bytes"] += self._copy_batch(mine, pools, False)
            self._stats["store_copies"] += len(mine)
            return
        except CopyTimeout as exc:  # the device is stuck: a blocking retry would hang
            logger.error("offloading worker %s: %s; %d block stores dropped",
                         self.ctx.worker_index, exc, len(mine))
            self._stats["copy_timeouts"] += 1
            self._stats["store_copy_errors"] += len(mine)
            return
        except (RuntimeError, ContractError) as exc:
            logger.debug("offloading worker %s: batched store failed (%s); copying block by "
                         "block", self.ctx.worker_index, exc)
        for item in mine:
            try:
                nbytes = self._copy(item, pools, load=False)
            except (RuntimeError, ContractError) as exc:
                logger.error("offloading worker %s: store of block %d (region %d) failed: %s",
                             self.ctx.worker_index, item[2], item[1], exc)
                self._stats["store_copy_errors"] += 1
                continue
            self._stats["store_copies"] += 1
            self._stats["store_bytes"] += nbytes

    def _kv_written(self) -> bool:
        """Wait (bounded) until the kernels queued so far on every KV device finished."""
        fences = [self.record_fence(tensor) for tensor in self._fence_tensors]
        return all(wait_fence(fence, FENCE_TIMEOUT_S) for fence in fences)

    def get_finished(self, finished_request_ids: frozenset[str]) -> tuple[set[str], set[str]]:
        return set(), set()  # loads and stores finish inside the step

    def get_block_ids_with_load_errors(self) -> set[BlockRef]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def get_stats(self) -> dict[str, int | float]:
        return dict(self._stats)

    def shutdown(self) -> None:
        self._slots = {}  # drop the tensors first: they export the mappings
        self._close_memories()
        self.caches = None
