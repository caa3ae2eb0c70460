"""Scheduler half of the Mooncake store connector: asynchronous lookups, load and save plans.

Lookup life cycle of one request (a small state machine, keyed by request id):

1. ``get_num_new_matched_tokens`` with no lookup for the request's current
   start blocks: queue one batch existence check of every key the request's
   candidate blocks need (:class:`~.keys.RegionLookup`), answer ``None``.
2. Asked again while the check runs: ``None`` again; once it outlived
   ``lookup_timeout_s``: a miss (0 tokens), never a wait.
3. Answered: every region's leading run of blocks whose keys *all* exist,
   combined across regions (:func:`~.keys.matched_tokens`). A check that
   failed for any key (master unreachable, timeout) is a miss. The answer is
   kept until ``update_state_after_alloc`` or ``request_finished`` drops it.

KV events: workers emit ``BlockStored`` (medium STORAGE, locality REMOTE) for
every block they stored; the engine publishes it once every rank did. This
half remembers announced blocks (bounded) and emits ``BlockRemoved`` when a
lookup finds one of them gone (evicted, or lost with a restarted master) and
for blocks removed through :meth:`MooncakeStoreScheduler.remove_blocks`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvbridge.backends.mooncake import KeyStatus
from kvbridge.connectors.api import (
    BlockIds,
    ConnectorContext,
    ConnectorOutput,
    ConnectorRequest,
    SchedulerConnector,
    SchedulerStep,
    block_range,
)
from kvbridge.connectors.mooncake_store import clients
from kvbridge.connectors.mooncake_store.keys import (
    leading_hits,
    matched_tokens,
    missing_blocks,
    region_lookups,
)
from kvbridge.connectors.mooncake_store.lookup import ExistsAnswer, LookupThread
from kvbridge.connectors.mooncake_store.metadata import LoadBlock, SaveBlock, StoreMetadata
from kvbridge.connectors.mooncake_store.settings import ClientScope, MooncakeStoreSettings
from kvbridge.connectors.params import TransferParams
from kvbridge.events import BlockRemoved, BlockStored, Locality, Medium
from kvbridge.layouts import BlockHash

logger = logging.getLogger(__name__)

#: How many announced blocks the scheduler remembers for BlockRemoved detection.
ANNOUNCED_LIMIT = 1 << 16


def pool_key(settings: MooncakeStoreSettings, engine_id: str) -> clients.PoolKey:
    scope = "process" if settings.client_scope is ClientScope.PROCESS else f"engine:{engine_id}"
    return clients.PoolKey(settings.master_address, settings.metadata_server, scope)


@dataclass
class _PendingLookup:
    signature: tuple[tuple[int, ...], tuple[int, ...]]  # (start block per region, #hashes)
    future: Future[ExistsAnswer]
    submitted_at: float
    keys_per_region: tuple[int, ...]  # how many keys of the batch belong to each region
    answer: int | None = None  # tokens matched (absolute), once computed
    hits: tuple[int, ...] | None = None  # leading hit blocks per region (absolute)


def _covers(entry: _PendingLookup, signature: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    """True when an answered lookup still answers for ``signature``.

    The engine may ask again with more tokens computed locally (another
    request cached a shared prefix meanwhile): the old answer still holds if
    the hashes are the same and every region's new start lies within the
    blocks the old lookup found, from its own start on.
    """
    if entry.hits is None or entry.signature[1] != signature[1]:
        return False
    return all(old <= new <= hit for old, new, hit in
               zip(entry.signature[0], signature[0], entry.hits, strict=True))


class MooncakeStoreScheduler(SchedulerConnector):
    """One per engine; every hook runs on the scheduler thread."""

    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        settings: MooncakeStoreSettings = ctx.extra
        self.settings = settings
        self.regions = region_lookups(ctx.spec, ctx.topology,
                                      every_layer=settings.lookup_every_layer)
        # removal deletes every layer's key, whatever a lookup checks
        self._all_keys = (self.regions if settings.lookup_every_layer
                          else region_lookups(ctx.spec, ctx.topology))
        self.tokens_per_key = tuple(r.tokens_per_key for r in self.regions)
        self._lookups = LookupThread(settings, pool_key(settings, ctx.engine_id),
                                     name=f"kvb-mooncake-lookup-{ctx.engine_id[:8]}")
        self._pending: dict[str, _PendingLookup] = {}
        self._loads: dict[str, tuple[LoadBlock, ...]] = {}
        self._announced: OrderedDict[tuple[int, BlockHash], None] = OrderedDict()
        self._stats: dict[str, int] = {
            "lookups": 0, "lookup_keys": 0, "lookup_failures": 0, "lookup_timeouts": 0,
            "hit_blocks": 0, "hit_tokens": 0, "load_blocks": 0, "save_blocks": 0,
            "blocks_announced": 0, "blocks_removed": 0,
        }
        self._closed = False

    # ------------------------------------------------------------------ lookups

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.settings.lookup:
            return 0, False
        hashes = request.block_hashes
        starts = tuple(num_computed_tokens // t for t in self.tokens_per_key)
        if any(start >= len(h) for start, h in zip(starts, hashes, strict=True)):
            return 0, False  # some region has no full block to find: nothing can match
        signature = (starts, tuple(len(h) for h in hashes))
        entry = self._pending.get(request.request_id)
        if entry is not None and entry.signature != signature and not _covers(entry, signature):
            entry = None
        if entry is None:
            self._submit(request.request_id, signature, hashes)
            return None, False
        if entry.answer is None:
            if not entry.future.done():
                if time.monotonic() - entry.submitted_at <= self.settings.lookup_timeout_s:
                    return None, False
                self._stats["lookup_timeouts"] += 1
                logger.warning("mooncake store lookup for %s unanswered after %.1f s: a miss",
                               request.request_id, self.settings.lookup_timeout_s)
                entry.answer = num_computed_tokens
            else:
                entry.answer = self._evaluate(entry, entry.signature[0], hashes)
        new = max(0, entry.answer - num_computed_tokens)
        return new, self.settings.load_async and new > 0

    def _submit(self, request_id: str, signature: tuple[tuple[int, ...], tuple[int, ...]],
                hashes: Sequence[Sequence[BlockHash]]) -> None:
        keys: list[str] = []
        per_region = []
        for region, start in zip(self.regions, signature[0], strict=True):
            region_keys = region.keys(hashes[region.region_index][start:])
            per_region.append(len(region_keys))
            keys.extend(region_keys)
        self._stats["lookups"] += 1
        self._stats["lookup_keys"] += len(keys)
        self._pending[request_id] = _PendingLookup(signature, self._lookups.exists(keys),
                                                   time.monotonic(), tuple(per_region))

    def _evaluate(self, entry: _PendingLookup, starts: tuple[int, ...],
                  hashes: Sequence[Sequence[BlockHash]]) -> int:
        """Tokens (from 0) matched by the answered lookup; a failed check matches nothing new."""
        results = entry.future.result()
        start_tokens = min(s * t for s, t in zip(starts, self.tokens_per_key, strict=True))
        if results is None or any(r.status is KeyStatus.ERROR for r in results):
            self._stats["lookup_failures"] += 1
            return start_tokens
        hits = []
        offset = 0
        for region, start, count in zip(self.regions, starts, entry.keys_per_region,
                                        strict=True):
            exists = [r.ok for r in results[offset:offset + count]]
            offset += count
            per_block = len(region.prefixes)
            hits.append(start + leading_hits(exists, per_block))
            self._forget_missing(region.region_index,
                                 [hashes[region.region_index][start + i]
                                  for i in missing_blocks(exists, per_block)])
        entry.hits = tuple(hits)
        matched = matched_tokens(hits, self.tokens_per_key)
        new_blocks = sum(h - s for h, s in zip(hits, starts, strict=True))
        self._stats["hit_blocks"] += new_blocks
        self._stats["hit_tokens"] += max(0, matched - start_tokens)
        return max(matched, start_tokens)

    # ------------------------------------------------------------------ allocation, steps

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        self._pending.pop(request.request_id, None)
        if num_external_tokens == 0:
            return
        start = request.num_computed_tokens
        null = self.ctx.null_block_id
        jobs = []
        for r, ids in enumerate(block_ids):
            t = self.tokens_per_key[r]
            for index in block_range(t, start, start + num_external_tokens):
                # the engine gave no block where its sliding window will not attend: nothing
                # to load there (two such gets would land in one block, and fail its digest)
                if ids[index] != null:
                    jobs.append(LoadBlock(r, ids[index], request.block_hashes[r][index]))
        self._loads[request.request_id] = tuple(jobs)
        self._stats["load_blocks"] += len(jobs)

    def build_connector_meta(self, step: SchedulerStep) -> StoreMetadata:
        saves: list[SaveBlock] = []
        if self.ctx.role.is_producer:
            seen: set[tuple[int, BlockHash]] = set()
            for item in step.scheduled:
                end = item.num_computed_tokens + item.num_scheduled_tokens
                request = item.request
                for r, ids in enumerate(item.block_ids):
                    t = self.tokens_per_key[r]
                    hashes = request.block_hashes[r]
                    for index in range(item.num_computed_tokens // t,
                                       min(end // t, len(hashes), len(ids))):
                        # the null block's bytes are no block's: never under a block's key
                        if (r, hashes[index]) in seen or ids[index] == self.ctx.null_block_id:
                            continue
                        seen.add((r, hashes[index]))
                        saves.append(SaveBlock(r, ids[index], hashes[index],
                                               self._stored_event(request, r, index)))
            self._stats["save_blocks"] += len(saves)
        meta = StoreMetadata(loads=self._loads, saves=tuple(saves))
        self._loads = {}
        return meta

    def _stored_event(self, request: ConnectorRequest, region: int, index: int) -> BlockStored:
        t = self.tokens_per_key[region]
        hashes = request.block_hashes[region]
        return BlockStored(block_hashes=(hashes[index],),
                           parent_block_hash=hashes[index - 1] if index else None,
                           token_ids=request.token_ids[index * t:(index + 1) * t],
                           block_size=t, medium=Medium.STORAGE.value, group_idx=region,
                           locality=Locality.REMOTE.value)

    def update_connector_output(self, output: ConnectorOutput) -> None:
        for event in output.events:
            if (isinstance(event, BlockStored) and event.medium == Medium.STORAGE.value
                    and event.group_idx is not None):
                for block_hash in event.block_hashes:
                    if isinstance(block_hash, bytes):
                        self._announce(event.group_idx, block_hash)

    def request_finished(self, request: ConnectorRequest,
                         block_ids: BlockIds) -> tuple[bool, TransferParams | None]:
        # Puts finish inside the step (zero-copy from the KV tensors), loads report
        # finished_recving on every rank: nothing here needs the blocks any longer.
        self._pending.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ events, removal

    def _announce(self, region: int, block_hash: BlockHash) -> None:
        key = (region, block_hash)
        if key in self._announced:
            self._announced.move_to_end(key)
            return
        self._announced[key] = None
        self._stats["blocks_announced"] += 1
        if len(self._announced) > ANNOUNCED_LIMIT:
            self._announced.popitem(last=False)

    def _forget_missing(self, region: int, block_hashes: Sequence[BlockHash]) -> None:
        gone = [h for h in block_hashes if (region, h) in self._announced]
        for h in gone:
            del self._announced[(region, h)]
        if gone:
            self._stats["blocks_removed"] += len(gone)
            self.ctx.events.append(BlockRemoved(block_hashes=tuple(gone),
                                                medium=Medium.STORAGE.value, group_idx=region,
                                                locality=Locality.REMOTE.value))

    def remove_blocks(self, blocks: Mapping[int, Sequence[BlockHash]]) -> int:
        """Delete blocks (``region index -> block hashes``) from the store, every part of each
        (every layer object of every namespace, and each namespace's digest record).

        Synchronous (one bounded Mooncake call); for operators and fault
        injection. Emits ``BlockRemoved`` for blocks whose every key is now
        gone. Returns how many keys were deleted (0 when the store is unreachable).
        """
        keys: list[str] = []
        spans: list[tuple[int, BlockHash, int, int]] = []
        for region_index, hashes in blocks.items():
            region = self._all_keys[region_index]
            for block_hash in hashes:
                suffix = block_hash.hex()
                block_keys = [*region.keys([block_hash]),
                              *(p + suffix for p in region.record_prefixes)]
                spans.append((region_index, block_hash, len(keys), len(keys) + len(block_keys)))
                keys.extend(block_keys)
        if not keys:
            return 0
        results = self._lookups.call(lambda client: client.remove(keys, force=True))
        if results is None:
            return 0
        removed_by_region: dict[int, list[BlockHash]] = {}
        for region_index, block_hash, lo, hi in spans:
            if all(r.ok or r.not_found for r in results[lo:hi]):
                removed_by_region.setdefault(region_index, []).append(block_hash)
                self._announced.pop((region_index, block_hash), None)
        for region_index, hashes in removed_by_region.items():
            self._stats["blocks_removed"] += len(hashes)
            self.ctx.events.append(BlockRemoved(block_hashes=tuple(hashes),
                                                medium=Medium.STORAGE.value,
                                                group_idx=region_index,
                                                locality=Locality.REMOTE.value))
        return sum(1 for r in results if r.ok)

    def get_stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self._stats)
        out["lookups_pending"] = sum(1 for e in self._pending.values() if e.answer is None)
        out["client_setup_failures"] = self._lookups.setup_failures
        return out

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lookups.close()
