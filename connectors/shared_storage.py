"""``shared_storage``: the reference connector -- one file per block in a shared directory.

It exists to prove the engine and the conformance suite, and as the smallest
complete example of the API (like vLLM's example connector). Every rank
writes its own part of each full block to

    {path}/{spec fingerprint}/{rank namespace}/{region}/{hash hex}.kv

(temp file + atomic rename), and a lookup counts a block as a hit only if the
file of *every* rank exists. Roles: ``kv_producer`` saves, ``kv_consumer``
loads, ``kv_both`` does both (e.g. prefix reuse across engine restarts).

Extra settings (``kv_connector_extra_config``):

* ``path`` (required): the directory.
* ``load_async`` (false): loads run on a worker thread across steps (the
  request waits in WAITING_FOR_REMOTE_KVS); otherwise inside the step.
* ``save_async`` (false): saves run on a worker thread; ``request_finished``
  delays the free until every rank has written the request's blocks.
* ``lookup_async`` (false): the first lookup of a request answers ``None``
  ("ask again next step"), as a store with a remote existence check would.

A file that is missing or short at load time is a load error: its block is
reported in ``get_block_ids_with_load_errors`` (and the request in
``failed_recving`` for async loads); the engine recomputes it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvbridge.connectors.api import (
    BlockIds,
    BlockRef,
    ConnectorContext,
    ConnectorMetadata,
    ConnectorPlugin,
    ConnectorRequest,
    KVCaches,
    SchedulerConnector,
    SchedulerStep,
    WorkerConnector,
    block_range,
)
from kvbridge.connectors.config import KVRole
from kvbridge.connectors.errors import ConfigError
from kvbridge.connectors.load_outcomes import LoadOutcomes
from kvbridge.connectors.params import TransferParams
from kvbridge.events import BlockStored, Medium
from kvbridge.layouts import BlockHash, ParallelTopology

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StorageSettings:
    path: Path
    load_async: bool = False
    save_async: bool = False
    lookup_async: bool = False


# (region index, local block id, block hash)
BlockJob = tuple[int, int, BlockHash]


@dataclass(frozen=True)
class StorageMetadata(ConnectorMetadata):
    loads: Mapping[str, tuple[BlockJob, ...]] = field(default_factory=dict)
    saves: Mapping[str, tuple[BlockJob, ...]] = field(default_factory=dict)
    delayed: frozenset[str] = frozenset()  # requests whose free waits for their saves


def rank_namespace(rank: ParallelTopology) -> str:
    """A rank's directory: its coordinates *and* the engine's sizes (a block's bytes
    depend on both)."""
    return (f"tp{rank.tp_rank}of{rank.tp_size}-dcp{rank.dcp_size}-pp{rank.pp_rank}of"
            f"{rank.pp_size}-pcp{rank.pcp_rank}of{rank.pcp_size}")


def block_file(root: Path, rank: ParallelTopology, region: str, block_hash: BlockHash) -> Path:
    return root / rank_namespace(rank) / region / f"{block_hash.hex()}.kv"


class SharedStorageScheduler(SchedulerConnector):
    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        settings: StorageSettings = ctx.extra
        self.settings = settings
        self.root = settings.path / ctx.spec.fingerprint()
        # ranks holding layers of each region (a PP stage may hold none of a region)
        self.region_ranks = [[rank for rank in ctx.topology.ranks()
                              if ctx.spec.rank_shapes(rank)[r].layer_ids]
                             for r in range(len(ctx.spec.regions))]
        self._asked: set[str] = set()  # async lookup: asked once already
        self._loads: dict[str, tuple[BlockJob, ...]] = {}
        self._saved: set[tuple[int, BlockHash]] = set()
        self._pending_saves: dict[str, int] = {}  # request -> save batches not yet acknowledged
        self._delayed: set[str] = set()
        self._stats = {"lookups": 0, "hit_blocks": 0, "load_blocks": 0, "save_blocks": 0}

    def _exists(self, region_index: int, block_hash: BlockHash) -> bool:
        name = self.ctx.spec.regions[region_index].name
        return all(block_file(self.root, rank, name, block_hash).exists()
                   for rank in self.region_ranks[region_index])

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.ctx.role.is_consumer:
            return 0, False
        if self.settings.lookup_async and request.request_id not in self._asked:
            self._asked.add(request.request_id)
            return None, False
        self._stats["lookups"] += 1
        hits = []
        tokens_per_block = []
        for r in range(len(self.ctx.spec.regions)):
            t = self.ctx.block_tokens(r)
            tokens_per_block.append(t)
            count = num_computed_tokens // t
            hashes = request.block_hashes[r]
            while count < len(hashes) and self._exists(r, hashes[count]):
                count += 1
            hits.append(count)
        step = 1
        for t in tokens_per_block:
            step = step * t // _gcd(step, t)
        matched = min(h * t for h, t in zip(hits, tokens_per_block, strict=True)) // step * step
        new = max(0, matched - num_computed_tokens)
        self._stats["hit_blocks"] += sum(hits)
        return new, self.settings.load_async and new > 0

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: BlockIds,
                                 num_external_tokens: int) -> None:
        self._asked.discard(request.request_id)
        if num_external_tokens == 0:
            return
        start = request.num_computed_tokens
        jobs = []
        for r, ids in enumerate(block_ids):
            t = self.ctx.block_tokens(r)
            for index in block_range(t, start, start + num_external_tokens):
                jobs.append((r, ids[index], request.block_hashes[r][index]))
        self._loads[request.request_id] = tuple(jobs)
        self._stats["load_blocks"] += len(jobs)

    def build_connector_meta(self, step: SchedulerStep) -> StorageMetadata:
        saves: dict[str, tuple[BlockJob, ...]] = {}
        if self.ctx.role.is_producer:
            for item in step.scheduled:
                jobs = []
                end = item.num_computed_tokens + item.num_scheduled_tokens
                for r, ids in enumerate(item.block_ids):
                    t = self.ctx.block_tokens(r)
                    hashes = item.request.block_hashes[r]
                    for index in range(item.num_computed_tokens // t, min(end // t, len(hashes))):
                        key = (r, hashes[index])
                        if key in self._saved:
                            continue
                        self._saved.add(key)
                        jobs.append((r, ids[index], hashes[index]))
                        self._emit_stored(item.request, r, index)
                if jobs:
                    saves[item.request.request_id] = tuple(jobs)
                    if self.settings.save_async:
                        rid = item.request.request_id
                        self._pending_saves[rid] = self._pending_saves.get(rid, 0) + 1
                    self._stats["save_blocks"] += len(jobs)
        meta = StorageMetadata(loads=self._loads, saves=saves,
                               delayed=frozenset(self._delayed))
        self._loads = {}
        self._delayed = set()
        return meta

    def _emit_stored(self, request: ConnectorRequest, region: int, index: int) -> None:
        t = self.ctx.block_tokens(region)
        hashes = request.block_hashes[region]
        self.ctx.events.append(BlockStored(
            block_hashes=(hashes[index],),
            parent_block_hash=hashes[index - 1] if index else None,
            token_ids=request.token_ids[index * t:(index + 1) * t],
            block_size=t, medium=Medium.STORAGE, group_idx=region))

    def request_finished(self, request: ConnectorRequest,
                         block_ids: BlockIds) -> tuple[bool, TransferParams | None]:
        self._asked.discard(request.request_id)
        self._loads.pop(request.request_id, None)
        if self._pending_saves.pop(request.request_id, 0):
            self._delayed.add(request.request_id)
            return True, None
        return False, None

    def get_stats(self) -> dict[str, int | float]:
        return dict(self._stats)


class SharedStorageWorker(WorkerConnector):
    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        settings: StorageSettings = ctx.extra
        self.settings = settings
        assert ctx.rank is not None
        self.rank = ctx.rank
        self.root = settings.path / ctx.spec.fingerprint()
        self.caches: KVCaches | None = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._outcomes = LoadOutcomes()  # get_finished's snapshot: a step's reports agree
        self._saves_in_flight: dict[str, list[Future[None]]] = {}
        self._waiting_delayed: set[str] = set()
        self._stats = {"blocks_loaded": 0, "blocks_saved": 0, "load_errors": 0,
                       "bytes_loaded": 0, "bytes_saved": 0}
        self._closed = False

    def register_kv_caches(self, caches: KVCaches) -> None:
        self.caches = caches
        if self.settings.load_async or self.settings.save_async:
            self._pool = ThreadPoolExecutor(max_workers=1,
                                            thread_name_prefix=f"kvb-storage-{self.rank.tp_rank}")

    def _layers(self, region: int) -> tuple[tuple[int, torch.Tensor], ...]:
        assert self.caches is not None
        return self.caches.region_layers(region)

    def _path(self, region: int, block_hash: BlockHash) -> Path:
        return block_file(self.root, self.rank, self.ctx.spec.regions[region].name, block_hash)

    def _load_blocks(self, request_id: str, jobs: tuple[BlockJob, ...]) -> set[BlockRef]:
        """Read every block of one request; returns the blocks that failed to load."""
        failed: set[BlockRef] = set()
        for region, block_id, block_hash in jobs:
            layers = self._layers(region)
            if not layers:
                continue  # this pipeline stage holds no layer of the region
            expected = sum(t[block_id].numel() * t.element_size() for _, t in layers)
            try:
                data = self._path(region, block_hash).read_bytes()
                if len(data) != expected:
                    raise OSError(f"short block file: {len(data)} of {expected} bytes")
            except OSError as exc:
                logger.warning("shared_storage rank %d: load of block %d (region %d) for %s "
                               "failed: %s", self.ctx.worker_index, block_id, region,
                               request_id, exc)
                failed.add((region, block_id))
                continue
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            offset = 0
            for _, tensor in layers:
                block = tensor[block_id]
                size = block.numel() * block.element_size()
                block.view(-1).view(torch.uint8).copy_(flat[offset:offset + size])
                offset += size
            with self._lock:
                self._stats["blocks_loaded"] += 1
                self._stats["bytes_loaded"] += expected
        return failed

    def _async_load(self, request_id: str, jobs: tuple[BlockJob, ...]) -> None:
        try:
            failed = self._load_blocks(request_id, jobs)
        except Exception:  # never leave the request waiting: fail it with all its blocks
            logger.exception("shared_storage: load for %s crashed", request_id)
            failed = {(region, block_id) for region, block_id, _ in jobs}
        with self._lock:
            self._stats["load_errors"] += len(failed)
        self._outcomes.finish(request_id, failed)

    def start_load_kv(self) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, StorageMetadata)
        for request_id, jobs in meta.loads.items():
            if self.settings.load_async:
                assert self._pool is not None
                self._pool.submit(self._async_load, request_id, jobs)
            else:
                failed = self._load_blocks(request_id, jobs)
                with self._lock:
                    self._stats["load_errors"] += len(failed)
                self._outcomes.add_invalid(failed)

    def wait_for_layer_load(self, layer_id: int) -> None:
        return None  # synchronous loads completed in start_load_kv

    def save_kv_layer(self, layer_id: int, kv_layer: torch.Tensor) -> None:
        return None  # a block file holds all layers: written in wait_for_save

    def _save_blocks(self, jobs: tuple[tuple[int, bytes, BlockHash], ...]) -> None:
        for region, data, block_hash in jobs:
            path = self._path(region, block_hash)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            with self._lock:
                self._stats["blocks_saved"] += 1
                self._stats["bytes_saved"] += len(data)

    def wait_for_save(self) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, StorageMetadata)
        for request_id, jobs in meta.saves.items():
            # Copy the bytes now: the engine may reuse the blocks after this step.
            batch = []
            for region, block_id, block_hash in jobs:
                layers = self._layers(region)
                if not layers:
                    continue
                # .cpu(): one copy off the device for GPU KV (none for host KV)
                data = b"".join(t[block_id].contiguous().view(-1).view(torch.uint8).cpu()
                                .numpy().tobytes() for _, t in layers)
                batch.append((region, data, block_hash))
            if self.settings.save_async:
                assert self._pool is not None
                future = self._pool.submit(self._save_blocks, tuple(batch))
                self._saves_in_flight.setdefault(request_id, []).append(future)
            else:
                self._save_blocks(tuple(batch))
        self._waiting_delayed |= meta.delayed

    def get_finished(self, finished_request_ids: frozenset[str]) -> tuple[set[str], set[str]]:
        done_sending = set()
        for request_id in list(self._waiting_delayed):
            futures = self._saves_in_flight.get(request_id, [])
            if all(f.done() for f in futures):
                for f in futures:
                    if f.exception() is not None:
                        logger.warning("shared_storage: save for %s failed: %s", request_id,
                                       f.exception())
                self._saves_in_flight.pop(request_id, None)
                self._waiting_delayed.discard(request_id)
                done_sending.add(request_id)
        # saves of requests that finished without a delay are fire-and-forget
        for request_id in list(self._saves_in_flight):
            if request_id not in self._waiting_delayed and \
                    all(f.done() for f in self._saves_in_flight[request_id]):
                del self._saves_in_flight[request_id]
        return done_sending, self._outcomes.snapshot()  # a load thread may finish meanwhile

    def get_failed_recving(self) -> set[str]:
        return self._outcomes.take_failed_recving()

    def get_block_ids_with_load_errors(self) -> set[BlockRef]:
        return self._outcomes.take_invalid_blocks()

    def get_stats(self) -> dict[str, int | float]:
        with self._lock:
            return dict(self._stats)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=False)


class SharedStoragePlugin(ConnectorPlugin):
    name = "shared_storage"
    description = "reference connector: one file per block in a shared directory"
    supported_roles = frozenset(KVRole)
    backends = ("torch",)

    @classmethod
    def parse_extra(cls, extra: Mapping[str, Any]) -> StorageSettings:
        known = {"path", "load_async", "save_async", "lookup_async"}
        for key in extra:
            if key not in known:
                raise ConfigError(f"kv_connector_extra_config.{key}",
                                  f"unknown setting; expected one of {sorted(known)}")
        if not isinstance(extra.get("path"), str) or not extra["path"]:
            raise ConfigError("kv_connector_extra_config.path",
                              "expected the storage directory (a non-empty string)")
        flags = {}
        for key in ("load_async", "save_async", "lookup_async"):
            value = extra.get(key, False)
            if not isinstance(value, bool):
                raise ConfigError(f"kv_connector_extra_config.{key}",
                                  f"expected true or false, got {value!r}")
            flags[key] = value
        return StorageSettings(Path(extra["path"]), **flags)

    @classmethod
    def create_scheduler(cls, ctx: ConnectorContext) -> SchedulerConnector:
        return SharedStorageScheduler(ctx)

    @classmethod
    def create_worker(cls, ctx: ConnectorContext) -> WorkerConnector:
        return SharedStorageWorker(ctx)

    @classmethod
    def conformance_cases(cls) -> tuple[Any, ...]:
        from kvbridge.connectors.testing import shared_storage_cases

        return shared_storage_cases()


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
