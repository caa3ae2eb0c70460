"""Scheduler half of the offloading connector: the connector hooks over ``OffloadManager``.

Mapping (one manager per slot pool, see :mod:`.parts`)::

    get_num_new_matched_tokens -> manager.lookup per (region, pool); None while any
                                  verdict is HIT_PENDING or RETRY (promotion or probe
                                  in flight: "ask again next step")
    update_state_after_alloc   -> manager.prepare_load of the blocks to load; pins of
                                  counted blocks that are not loaded are dropped
                                  (also of positions whose block id is the engine's
                                  null block: counted, never copied into)
    build_connector_meta       -> manager.prepare_store of the blocks computed this
                                  step (never from the null block), then
                                  manager.step() (finish tier jobs, probes)
    update_connector_output    -> complete_load / complete_store of this step's copies
                                  (the workers copy synchronously inside the step)
    request_finished           -> manager.request_finished (pins, lookup references)

Why loads are synchronous and never fail for the store's sake: a lookup
reports HIT only for blocks ready in CPU memory and pinned for the request,
so the worker's copy is a memcpy inside the step. A block that exists only in
a secondary tier is promoted into CPU first; if that promotion fails, the
tier flips exactly the failed keys to a miss (``mark_miss``) and the manager
remembers the failure for every waiting request, so the next lookup returns
the prefix before the failed block and the engine recomputes it -- once. No
request can loop on a failed load (the livelock of the seed report).

A block of region ``r`` is a hit only if every part (every namespace of
``lookup_namespaces``) is ready. Keys are ``BlockKey.to_bytes()``:
namespace + chained block hash.

Stats are counted where the outcome is known: ``hit_blocks`` (and the
per-tier ``hits_<tier>``) are blocks whose copy into the engine succeeded,
counted in ``update_connector_output``; a copy the worker reports in
``invalid_block_ids`` counts in ``load_blocks_failed`` instead. An engine
asking again for the same request (a lookup repeated before it is scheduled)
counts nothing again.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvbridge.connectors.api import (
    BlockIds,
    ConnectorContext,
    ConnectorMetadata,
    ConnectorOutput,
    ConnectorRequest,
    SchedulerConnector,
    SchedulerStep,
    block_range,
)
from kvbridge.connectors.errors import ConfigError, ContractError
from kvbridge.connectors.offloading.io_hook import installed_fs_io_factory
from kvbridge.connectors.offloading.parts import Part, PartTable, build_part_table, pool_fingerprint
from kvbridge.connectors.offloading.settings import OffloadSettings
from kvbridge.connectors.params import TransferParams
from kvbridge.events import BlockRemoved, BlockStored, KVEvent
from kvbridge.layouts import BlockHash, KVCacheSpec
from kvbridge.offload import CpuTier, FsTier, OffloadManager, TierRunner
from kvbridge.offload.runner import DEFAULT_LOAD_TIMEOUT_S, DEFAULT_PROBE_TIMEOUT_S
from kvbridge.offload.types import EventKind, OffloadEvent

logger = logging.getLogger(__name__)

#: ``(part_index, region_index, block_id, pool, slot)``: copy one part of one block
CopyItem = tuple[int, int, int, int, int]

#: process-local registry of the CPU tiers of live schedulers: the workers of the
#: same engine find the slot memory here (token carried in the metadata)
_POOLS: dict[str, tuple[CpuTier, ...]] = {}
_POOLS_LOCK = threading.Lock()


def pools_of(token: str) -> tuple[CpuTier, ...] | None:
    with _POOLS_LOCK:
        return _POOLS.get(token)


@dataclass(frozen=True)
class OffloadMetadata(ConnectorMetadata):
    """One step's copies. ``loads``: slot -> engine block (before compute), per request;
    ``stores``: engine block -> slot (after compute). Workers copy the items whose
    part they read (loads) or write (stores)."""

    pools_token: str
    loads: Mapping[str, tuple[CopyItem, ...]] = field(default_factory=dict)
    stores: tuple[CopyItem, ...] = ()
    #: per pool ``(path, num_slots, slot bytes)`` when the slots are file-backed
    shared_pools: tuple[tuple[str, int, int], ...] = ()


@dataclass
class _BlockInfo:
    parent: BlockHash | None
    token_ids: tuple[int, ...]


def _manager_request_id(request_id: str, region_index: int) -> str:
    # one manager request per region: a lookup's final verdict unpins every key of the
    # request it did not count, so two regions must not share one
    return f"{request_id}\x00{region_index}"


def build_managers(spec: KVCacheSpec, table: PartTable, settings: OffloadSettings,
                   shm_paths: tuple[str, ...] = ()) -> tuple[list[OffloadManager], Any]:
    """One manager per pool (CPU tier + secondaries); returns ``(managers, obj client)``.

    ``shm_paths``: per pool, the file backing its CPU slots (empty: anonymous memory).
    The fs tiers make their system calls through the real I/O, or through what the
    factory of an enclosing :func:`~kvbridge.connectors.offloading.io_hook.fs_io_factory`
    block makes (tests, the demo).
    """
    client = None
    make_io = installed_fs_io_factory()
    managers: list[OffloadManager] = []
    try:
        if settings.obj is not None:
            import kvbridge.backends  # noqa: F401  (env defaults before any client)
            from kvbridge.backends.mooncake import MooncakeConfig, MooncakeStoreClient
            try:
                config = MooncakeConfig(**settings.obj)
            except (TypeError, ValueError) as exc:
                raise ConfigError("kv_connector_extra_config.obj", str(exc)) from None
            client = MooncakeStoreClient.connect(config)
        for pool, nbytes in enumerate(table.pool_bytes):
            fingerprint = pool_fingerprint(spec, nbytes)
            # one digest per layer span of a slot, so a mismatch names the layer
            layers = table.pool_layers(pool)
            secondaries: list[TierRunner] = []
            if settings.fs_dir is not None:
                fs = FsTier(settings.fs_dir, nbytes, fingerprint,
                            use_o_direct=settings.fs_o_direct,
                            io=None if make_io is None else make_io(settings.fs_dir, fingerprint),
                            quarantine_after=settings.fs_quarantine_after,
                            verify=settings.fs_verify, num_layers=layers,
                            io_engine=settings.fs_io_engine)
                secondaries.append(TierRunner(
                    fs, read_threads=settings.fs_read_threads,
                    write_threads=settings.fs_write_threads,
                    probe_timeout_s=(DEFAULT_PROBE_TIMEOUT_S if settings.probe_timeout_s is None
                                     else settings.probe_timeout_s),
                    load_timeout_s=(DEFAULT_LOAD_TIMEOUT_S if settings.load_timeout_s is None
                                    else settings.load_timeout_s)))
            if client is not None:
                from kvbridge.offload.obj import ObjTier, run_obj_tier
                secondaries.append(run_obj_tier(
                    ObjTier(client, nbytes, fingerprint, verify=settings.verify,
                            num_layers=layers),
                    probe_timeout_s=settings.probe_timeout_s,
                    load_timeout_s=settings.load_timeout_s))
            shm_path = shm_paths[len(managers)] if shm_paths else None
            managers.append(OffloadManager(CpuTier(settings.cpu_blocks, nbytes, settings.policy,
                                                   shm_path=shm_path, verify=settings.verify,
                                                   num_layers=layers), secondaries))
    except BaseException:
        for manager in managers:
            manager.shutdown()
        if client is not None:
            client.close()
        raise
    return managers, client


class OffloadingScheduler(SchedulerConnector):
    """Scheduler half: see the module docstring."""

    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        settings: OffloadSettings = ctx.extra
        self.settings = settings
        self.table = build_part_table(ctx.spec, ctx.topology)
        self.token = uuid.uuid4().hex
        shm_paths: tuple[str, ...] = ()
        if settings.shm_dir is not None:
            shm_paths = tuple(os.path.join(settings.shm_dir, f"kvbridge-offload-{self.token}-{i}")
                              for i in range(len(self.table.pool_bytes)))
        self.managers, self._client = build_managers(ctx.spec, self.table, settings, shm_paths)
        #: what a worker in another process maps: per pool (path, num_slots, slot bytes)
        self.shared_pools = tuple((path, settings.cpu_blocks, nbytes) for path, nbytes
                                  in zip(shm_paths, self.table.pool_bytes, strict=False))
        with _POOLS_LOCK:
            _POOLS[self.token] = tuple(m.primary for m in self.managers)
        self._by_prefix = {p.prefix: p for p in self.table.parts}
        # per request: what the last final lookup counted, per (region, pool): the keys
        self._counted: dict[str, dict[tuple[int, int], list[bytes]]] = {}
        self._loads: dict[str, tuple[CopyItem, ...]] = {}
        #: this step's loads: (pool, mreq, keys, per key the engine block it is copied to)
        self._load_keys: list[tuple[int, str, list[bytes], dict[bytes, set[tuple[int, int]]]]] = []
        self._step_stores: dict[str, list[tuple[int, list[bytes]]]] = {}
        self._step_loaded_blocks: dict[str, set[tuple[int, int]]] = {}
        self._block_info: OrderedDict[tuple[int, BlockHash], _BlockInfo] = OrderedDict()
        self._info_limit = 4 * settings.cpu_blocks * max(1, len(self.table.parts)) + 4096
        # per tier name: (region, hash) -> parts present; announced once all are
        self._tier_parts: dict[str, dict[tuple[int, BlockHash], set[int]]] = {}
        self._lookups: dict[str, int] = {}
        self._copy_errors_seen: int | float = 0
        self._stats: dict[str, int] = {
            "lookups": 0, "lookups_deferred": 0, "hit_blocks": 0, "load_blocks": 0,
            "load_parts": 0, "store_parts": 0, "store_parts_failed": 0,
            "max_lookups_per_request": 0, "loads_failed_in_engine": 0,
            "failed_load_blocks": 0, "load_blocks_failed": 0,
        }
        #: tests: when a list, every final lookup appends ``(request_id, region, block_index,
        #: matched_tokens)`` for each block whose promotion failed while the request waited
        self.failed_load_log: list[tuple[str, int, int, int]] | None = None
        self._closed = False

    # ------------------------------------------------------------------ lookups

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        self._stats["lookups"] += 1
        n = self._lookups[rid] = self._lookups.get(rid, 0) + 1
        self._stats["max_lookups_per_request"] = max(self._stats["max_lookups_per_request"], n)
        pending = False
        counted: dict[tuple[int, int], list[bytes]] = {}
        tokens: list[int] = []
        block_tokens: list[int] = []
        for r, parts in enumerate(self.table.region_parts):
            t = self.ctx.block_tokens(r)
            block_tokens.append(t)
            start = num_computed_tokens // t
            hashes = request.block_hashes[r][start:]
            if not parts:
                tokens.append(len(request.token_ids))
                continue
            hits = len(hashes)
            for pool in sorted({p.pool for p in parts}):
                pool_parts = [p for p in parts if p.pool == pool]
                keys = [p.key(h) for h in hashes for p in pool_parts]
                result = self.managers[pool].lookup(_manager_request_id(rid, r), keys)
                if not result.ready:
                    pending = True
                    continue
                blocks = result.num_blocks // len(pool_parts)
                counted[(r, pool)] = keys[:result.num_blocks]
                hits = min(hits, blocks)
            tokens.append((start + hits) * t)
        if pending:
            self._stats["lookups_deferred"] += 1
            return None, False
        step = 1
        for t in block_tokens:
            step = step * t // _gcd(step, t)
        matched = min(tokens) // step * step
        new = max(0, matched - num_computed_tokens)
        self._counted[rid] = counted
        self._note_failed_loads(request, num_computed_tokens, matched)
        # hit_blocks is counted when the copy into the engine succeeded
        # (update_connector_output), not here: the engine may ask again, or the copy fail
        return new, False

    def _note_failed_loads(self, request: ConnectorRequest, num_computed_tokens: int,
                           matched: int) -> None:
        """Count blocks a failed promotion turned into recomputes (a stat; a log for tests)."""
        rid = request.request_id
        for r, parts in enumerate(self.table.region_parts):
            if not parts:
                continue
            failed: set[bytes] = set()
            for manager in self.managers:
                failed.update(manager.failed_loads(_manager_request_id(rid, r)))
            if not failed:
                continue
            t = self.ctx.block_tokens(r)
            start = num_computed_tokens // t
            for index in range(start, len(request.block_hashes[r])):
                if any(p.key(request.block_hashes[r][index]) in failed for p in parts):
                    self._stats["failed_load_blocks"] += 1
                    if self.failed_load_log is not None:
                        self.failed_load_log.append((rid, r, index, matched))

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        counted = self._counted.pop(rid, {})
        start = request.num_computed_tokens
        if num_external_tokens and not counted:
            raise ContractError("num_external_tokens", f"request {rid}: {num_external_tokens} "
                                "tokens to load without a final lookup in this step")
        items: list[CopyItem] = []
        for (r, pool), keys in counted.items():
            manager = self.managers[pool]
            mreq = _manager_request_id(rid, r)
            pool_parts = self.table.pool_region_parts(pool, r)
            t = self.ctx.block_tokens(r)
            span = block_range(t, start, start + num_external_tokens)
            have = set(keys)
            wanted = [p.key(request.block_hashes[r][i]) for i in span for p in pool_parts]
            if not have.issuperset(wanted):
                raise ContractError("num_external_tokens",
                                    f"request {rid}: {num_external_tokens} tokens from token "
                                    f"{start} include blocks the lookup did not report")
            # positions the engine gave no block (a sliding window's prefix it will not
            # attend) are counted but never copied into: that block is no request's
            null = self.ctx.null_block_id
            indices = [i for i in span if block_ids[r][i] != null]
            load_keys = [p.key(request.block_hashes[r][i]) for i in indices for p in pool_parts]
            loading = set(load_keys)
            unused = [k for k in keys if k not in loading]
            if unused:
                manager.complete_load(mreq, unused)  # drop the pins of blocks not loaded
            if not load_keys:
                continue
            spec = manager.prepare_load(mreq, load_keys)
            slot_of = dict(zip(spec.keys, spec.slots, strict=True))
            block_of: dict[bytes, set[tuple[int, int]]] = {}
            for i in indices:
                for part in pool_parts:
                    key = part.key(request.block_hashes[r][i])
                    items.append((part.index, r, block_ids[r][i], pool, slot_of[key]))
                    block_of.setdefault(key, set()).add((r, block_ids[r][i]))
            self._load_keys.append((pool, mreq, load_keys, block_of))
            self._stats["load_parts"] += len(load_keys)
        if items:
            self._loads[rid] = self._loads.get(rid, ()) + tuple(items)
            self._stats["load_blocks"] += len({(r, b) for _, r, b, _, _ in items})

    # ------------------------------------------------------------------ per step

    def build_connector_meta(self, step: SchedulerStep) -> OffloadMetadata:
        stores: list[CopyItem] = []
        self._step_stores = {}
        for item in step.scheduled:
            request = item.request
            rid = request.request_id
            end = item.num_computed_tokens + item.num_scheduled_tokens
            for r, parts in enumerate(self.table.region_parts):
                t = self.ctx.block_tokens(r)
                hashes = request.block_hashes[r]
                first, last = item.num_computed_tokens // t, min(end // t, len(hashes))
                if first >= last or not parts:
                    continue
                for index in range(first, last):
                    self._remember_block(request, r, index)
                # never a position the engine holds no block at: the null block's bytes
                # are no block's, and stored under its key they would poison it
                ids = item.block_ids[r]
                indices = [i for i in range(first, min(last, len(ids)))
                           if ids[i] != self.ctx.null_block_id]
                for pool in sorted({p.pool for p in parts}):
                    pool_parts = [p for p in parts if p.pool == pool]
                    where = {p.key(hashes[i]): (p, i) for i in indices for p in pool_parts}
                    spec = self.managers[pool].prepare_store(rid, list(where))
                    if not spec.keys:
                        continue
                    for key, slot in zip(spec.keys, spec.slots, strict=True):
                        part, i = where[key]
                        stores.append((part.index, r, item.block_ids[r][i], pool, slot))
                    self._step_stores.setdefault(rid, []).append((pool, list(spec.keys)))
                    self._stats["store_parts"] += len(spec.keys)
        for manager in self.managers:
            manager.step()
        meta = OffloadMetadata(self.token, self._loads, tuple(stores), self.shared_pools)
        self._step_loaded_blocks = {rid: {(r, b) for _, r, b, _, _ in items}
                                    for rid, items in self._loads.items()}
        self._loads = {}
        return meta

    def update_connector_output(self, output: ConnectorOutput) -> None:
        invalid = set(output.invalid_block_ids)
        for pool, mreq, keys, block_of in self._load_keys:
            # a key whose copy into any engine block failed is no hit (the engine recomputes)
            failed = [key for key in keys if block_of.get(key, set()) & invalid]
            self.managers[pool].complete_load(mreq, keys, success=failed or True)
        self._load_keys = []
        # workers count failed store copies cumulatively: a new one fails the step's stores
        copy_errors = output.merged_stats().get("store_copy_errors", 0)
        stores_ok = copy_errors == self._copy_errors_seen
        self._copy_errors_seen = copy_errors
        for blocks in self._step_loaded_blocks.values():
            bad = blocks & invalid
            if bad:
                self._stats["loads_failed_in_engine"] += 1
                self._stats["load_blocks_failed"] += len(bad)
            self._stats["hit_blocks"] += len(blocks) - len(bad)
        for rid, batches in self._step_stores.items():
            # blocks computed in a step whose load failed are computed on bad KV: drop them
            ok = stores_ok and not (self._step_loaded_blocks.get(rid, set()) & invalid)
            for pool, keys in batches:
                self.managers[pool].complete_store(keys, success=ok)
                if not ok:
                    self._stats["store_parts_failed"] += len(keys)
        self._step_stores = {}
        self._step_loaded_blocks = {}

    def request_finished(self, request: ConnectorRequest,
                         block_ids: BlockIds) -> tuple[bool, TransferParams | None]:
        rid = request.request_id
        self._counted.pop(rid, None)
        self._lookups.pop(rid, None)
        for manager in self.managers:
            for r in range(len(self.table.region_parts)):
                manager.request_finished(_manager_request_id(rid, r))
        return False, None

    # ------------------------------------------------------------------ events

    def _remember_block(self, request: ConnectorRequest, r: int, index: int) -> None:
        hashes = request.block_hashes[r]
        key = (r, hashes[index])
        if key in self._block_info:
            self._block_info.move_to_end(key)
            return
        t = self.ctx.block_tokens(r)
        self._block_info[key] = _BlockInfo(hashes[index - 1] if index else None,
                                           request.token_ids[index * t:(index + 1) * t])
        while len(self._block_info) > self._info_limit:
            self._block_info.popitem(last=False)

    def _convert(self, event: OffloadEvent) -> list[KVEvent]:
        """Tier events are per part key; a block is announced on a tier once all its
        parts are there, and withdrawn when the first of them leaves (or when a part
        of a block this engine never saw stored leaves: e.g. a torn file of an earlier
        run, which a router may still index). A part stored twice counts once."""
        present = self._tier_parts.setdefault(event.tier, {})
        out: list[KVEvent] = []
        for key in event.keys:
            part: Part | None = self._by_prefix.get(key[:-32])
            if part is None:
                continue
            r, block_hash = part.region_index, key[-32:]
            need = len(self.table.region_parts[r])
            parts = present.get((r, block_hash))
            was_full = parts is not None and len(parts) == need
            if event.kind is EventKind.STORED:
                parts = present.setdefault((r, block_hash), set())
                parts.add(part.index)
                if len(parts) == need and not was_full:
                    info = self._block_info.get((r, block_hash))
                    out.append(BlockStored(
                        block_hashes=(block_hash,),
                        parent_block_hash=info.parent if info else None,
                        token_ids=info.token_ids if info else (),
                        block_size=self.ctx.block_tokens(r), medium=event.medium,
                        group_idx=r, locality=event.locality))
            else:
                if parts is not None:
                    parts.discard(part.index)
                    if not parts:
                        del present[(r, block_hash)]
                if was_full or parts is None:
                    out.append(BlockRemoved(block_hashes=(block_hash,), medium=event.medium,
                                            group_idx=r, locality=event.locality))
        return out

    def take_events(self) -> list[KVEvent]:
        for manager in self.managers:
            for event in manager.take_events():
                self.ctx.events.extend(self._convert(event))
        return self.ctx.events.take()

    # ------------------------------------------------------------------ inspection

    def get_stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self._stats)
        for manager in self.managers:
            stats = manager.stats()
            for name in ("promotions_started", "promotions_ok", "promotions_failed",
                         "promotions_timed_out", "engine_loads_failed",
                         "stores_ok", "stores_failed", "stores_skipped_no_slot",
                         "cascades_ok", "cascades_failed"):
                value = stats[name]
                assert isinstance(value, int)
                out[name] = out.get(name, 0) + value
            hits = stats["hits_by_tier"]
            assert isinstance(hits, dict)
            for tier_name in [manager.primary.name] + [t.name for t in manager.secondaries]:
                out.setdefault(f"hits_{tier_name}", 0)
            for tier, count in hits.items():
                out[f"hits_{tier}"] = out.get(f"hits_{tier}", 0) + count
            primary = stats["primary"]
            assert isinstance(primary, dict)
            out["cpu_evictions"] = out.get("cpu_evictions", 0) + primary["evictions"]
            for stat in ("loads_verified", "loads_unverified", "digest_mismatches",
                         "corrupt_removed"):
                out[f"cpu_{stat}"] = out.get(f"cpu_{stat}", 0) + primary[stat]
            tiers = stats["tiers"]
            assert isinstance(tiers, dict)
            for name, tier in tiers.items():
                for stat in ("loads_failed", "files_deleted", "files_quarantined",
                             "close_errors_ignored", "jobs_fenced", "probe_timeouts",
                             "stuck_thread_replacements", "loads_verified",
                             "loads_unverified", "digest_mismatches", "foreign_key_loads",
                             "lookup_invariant_violations"):
                    if stat in tier:
                        out[f"{name}_{stat}"] = out.get(f"{name}_{stat}", 0) + tier[stat]
        return out

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Finish every tier job (cascades to fs/obj) -- tests and the demo, never the
        scheduler loop."""
        return all(m.wait_idle(timeout_s) for m in self.managers)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _POOLS_LOCK:
            _POOLS.pop(self.token, None)
        for manager in self.managers:
            try:
                manager.shutdown()
            except Exception:
                logger.exception("offloading: manager shutdown failed")
        if self._client is not None:
            self._client.close()


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a

