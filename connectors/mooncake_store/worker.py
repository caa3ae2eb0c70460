"""Worker half of the Mooncake store connector: zero-copy puts and gets of one rank's blocks.

A block of one layer is ``tensor[block_id]``, one contiguous slice: one store
object (see :mod:`.keys`). Where the host can read the KV
(:func:`kvbridge.layouts.kv_memory.host_readable`), every backing storage of the
rank's KV tensors is registered with the store client at ``register_kv_caches``
(once: vLLM's hybrid groups alias one storage) and each object
moves straight between the tensor and the store (zero-copy). KV the host cannot
read (GPU memory, or KV guarded as such) is never registered: its puts and gets
go through a bounded host staging buffer (:mod:`.staging`; pinned on a GPU,
``staging_bytes``), gathered and scattered on the KV's device on a copy stream,
and its digests are ``torch-mix64-v1`` taken on that device. The stats say so
(``kv_staged``, ``staged_put_bytes``, ``staged_get_bytes``, ``staging_rounds``).

* **Saves** run inside ``wait_for_save`` as one batch put per step: the
  engine may overwrite a block once the step ends, and a put reads the
  tensor directly. Only the designated writer of a de-duplicated namespace
  puts (``write_targets``); the others have nothing to write. A failed put is
  counted (``put_failures``) and dropped; its block is simply not in the
  store. A put that timed out may still be reading the tensor: the step waits
  at most ``abandon_grace_s`` for it; if it is still running then, its keys are
  removed once the client is idle again (they could hold later bytes).
  The put reads device memory outside every CUDA stream, so it is issued only
  once the kernels that wrote the step's KV finished: a fence per device
  (:mod:`kvbridge.backends.device.fence`), waited on at most ``op_timeout_s``; if it
  has not passed then, the step's puts are dropped (``put_fence_timeouts``).
  On host memory the fence has passed already.
* **Loads** run on this rank's load thread (``load_async``, the default) or
  inside ``start_load_kv``. Every key a block needs must arrive in full, or
  the block is reported in ``get_block_ids_with_load_errors`` (and the
  request in ``failed_recving`` for async loads); the engine recomputes it.
  Every request the scheduler told this rank to load is reported finished,
  also when this rank holds none of its layers.
* **Digests** (so a reader never calls wrong bytes loaded): every block put (unless ``verify`` is off) goes with a digest record of this
  rank's part of it (:mod:`.records`: XXH3-64 of the block's bytes in each
  layer for KV in host memory, ``torch-mix64-v1`` on the tensors' device for
  KV in device memory, taken from the tensor after the fence while the
  zero-copy put of the same bytes runs), under a companion key put by a second call beside the KV
  put. A load gets the records of the blocks its policy checks (``verify``:
  every block, a deterministic sample, or none) in a call of their own beside
  the KV gets, and once a block's bytes landed digests them in place and
  compares before it reports the block loaded. A load checked in full is cut
  into up to ``PIPELINE_PARTS`` gets of consecutive blocks, each started while
  the blocks of the part before are hashed (XXH3 releases the GIL, as do the
  store's calls), so hashing hides behind the transfer. A mismatch or a record that is not this key's is a load error of
  exactly that block (the engine recomputes it; blocks before it stay
  loaded), counted (``digest_mismatches``, ``digest_records_invalid``; of those,
  records made for another key -- a block copied under this one's keys -- also in
  ``digest_records_foreign``),
  logged once per load with the engine, request, block and key, and the
  block's keys on this rank are removed (force) so the recomputed block can
  be stored again (a put keeps an existing key's value). A block stored
  without a record (an older version, a writer with ``verify`` off), or whose
  record names an algorithm this rank cannot take (XXH3-64 read into device
  memory), is loaded unverified and counted (``blocks_unverified``) or, with
  ``verify_allow_unverified`` false, is a load error.
* **Bounded**: each Mooncake call is bounded by the client (reachability
  check first, then ``op_timeout_s``). After a *timed-out* get the rank waits
  at most ``abandon_grace_s`` for the abandoned call before reporting, so a
  late write cannot land in a block the engine already gave to someone else.

This file owns :class:`MooncakeStoreWorker`: the client and its buffer
registrations, the load thread, the save and load calls with their
timeouts, orphans and stats, and the one log line per failed load. Beside it,
importable from here as before: :mod:`.plans` (region plans and batch
gathering, pure) and :mod:`.load_verify` (which blocks a load checks and what
the check found, pure). It may not grow key arithmetic or digest comparison
back in; the engine-facing half, the scheduler, is :mod:`.scheduler`.
"""

from __future__ import annotations

import bisect
import logging
import operator
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvbridge.backends.device.fence import Fence, record_fence, wait_fence
from kvbridge.backends.mooncake import KeyStatus, McStatus, MooncakeStoreClient, PendingBatch
from kvbridge.connectors.api import BlockRef, ConnectorContext, KVCaches, WorkerConnector
from kvbridge.connectors.errors import ConfigError, ContractError
from kvbridge.connectors.load_outcomes import LoadOutcomes
from kvbridge.connectors.mooncake_store import clients
from kvbridge.connectors.mooncake_store.load_verify import Verified, checked_blocks, verify_blocks
from kvbridge.connectors.mooncake_store.metadata import LoadBlock, SaveBlock, StoreMetadata
from kvbridge.connectors.mooncake_store.plans import Batch, RegionPlan, build_plans, gather
from kvbridge.connectors.mooncake_store.plans import LayerSlot as LayerSlot
from kvbridge.connectors.mooncake_store.records import digests_of_keys
from kvbridge.connectors.mooncake_store.scheduler import pool_key
from kvbridge.connectors.mooncake_store.settings import MooncakeStoreSettings
from kvbridge.connectors.mooncake_store.staging import BatchCall, StagedKV
from kvbridge.connectors.mooncake_store.verify import RankDigests
from kvbridge.layouts.digests import DigestMode
from kvbridge.layouts.kv_memory import all_host_readable

logger = logging.getLogger(__name__)

#: A load checked in full is cut into up to this many gets, each running while the blocks
#: of the one before are hashed; no part is smaller than PIPELINE_MIN_BYTES (a batch
#: call has a fixed cost). ``kvbridge bench mooncake`` measures the effect (its v:full row).
PIPELINE_PARTS = 4
PIPELINE_MIN_BYTES = 4 << 20

_STATUS = operator.attrgetter("status")
_NBYTES = operator.attrgetter("nbytes")

#: Upper bounds (ms) of the load-latency histogram in the worker stats (``load_ms_le_<b>``).
LATENCY_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000)


class MooncakeStoreWorker(WorkerConnector):
    """One per rank."""

    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        settings: MooncakeStoreSettings = ctx.extra
        self.settings = settings
        if ctx.rank is None:
            raise ContractError("rank", "a worker half needs its rank")
        self.rank = ctx.rank
        self._pool_key = pool_key(settings, ctx.engine_id)
        self.client: MooncakeStoreClient | None = None
        self.plans: tuple[RegionPlan, ...] = ()
        self._registered: list[int] = []
        #: where the KV's puts and gets go: the client itself (zero-copy, host-readable
        #: KV) or the staging buffer (:mod:`.staging`, KV the host cannot read)
        self._kv_io: MooncakeStoreClient | StagedKV | None = None
        self.staged: StagedKV | None = None
        #: one KV tensor per device: the fences of a step's puts are recorded on them
        self._fence_tensors: list[Any] = []
        #: records the fence of a step's puts (device KV is read only after the kernels that
        #: wrote it finished); a test may stand in for it
        self.record_fence: Callable[[Any], Fence] = record_fence
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[str, tuple[LoadBlock, ...]] | None] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None
        self._outcomes = LoadOutcomes()
        self._orphans: list[str] = []  # keys of timed-out puts, removed once idle
        self._policy = settings.verify_policy
        #: record tables and in-place digests (host memory: XXH3-64; device: torch-mix64-v1)
        self.digests: RankDigests | None = None
        self._stats: dict[str, int | float] = {
            "put_calls": 0, "put_keys": 0, "put_bytes": 0, "put_time_s": 0.0,
            "blocks_saved": 0, "put_failures": 0, "put_timeouts": 0, "orphans_removed": 0,
            "put_fence_timeouts": 0,
            "get_calls": 0, "get_keys": 0, "get_bytes": 0, "get_time_s": 0.0,
            "blocks_loaded": 0, "load_errors": 0, "load_not_found": 0, "get_timeouts": 0,
            "abandoned_gets": 0,
            "blocks_digested": 0, "digest_time_s": 0.0,
            "blocks_verified": 0, "blocks_unverified": 0, "blocks_unchecked": 0,
            "digest_mismatches": 0, "digest_records_invalid": 0,
            "digest_records_foreign": 0, "digests_missing": 0,
            "verify_time_s": 0.0, "corrupt_keys_removed": 0,
            **{f"load_ms_le_{b}": 0 for b in LATENCY_BUCKETS_MS}, "load_ms_le_inf": 0,
        }
        self._closed = False

    # ------------------------------------------------------------------ registration

    def register_kv_caches(self, caches: KVCaches) -> None:
        plans = build_plans(caches, self.ctx, self.rank)
        on_host = all_host_readable(caches.layers.values())
        chosen = self.settings.verify_algorithm
        try:
            digests = RankDigests(plans, owner=caches, tensors=caches.layers, on_host=on_host,
                                  algorithm=None if chosen == "auto" else chosen)
        except ValueError as exc:  # xxh3-64 asked for KV in device memory
            raise ConfigError("kv_connector_extra_config.verify_algorithm", str(exc)) from None
        if not on_host:
            self._check_staging(plans)
        client = clients.acquire(self._pool_key, self.settings.client_config())
        self.client = client
        try:
            if on_host:  # zero-copy: the store reads and writes the KV tensors themselves
                # once per backing storage: vLLM's hybrid groups put layer i of every
                # group on the same bytes, and a second registration is refused
                buffers = caches.backing_spans()
                self._kv_io = client
            else:  # the store may not touch the KV: everything goes through staging
                kv_bytes = sum(t.numel() * t.element_size() for t in caches.layers.values())
                staged = StagedKV(client, caches.layers.values(),
                                  # never more than the KV itself, each way
                                  staging_bytes=min(self.settings.staging_bytes, 2 * kv_bytes),
                                  timeout_s=self.settings.op_timeout_s,
                                  abandon_grace_s=self.settings.abandon_grace_s)
                buffers = staged.buffers
                self._kv_io = self.staged = staged
            if digests is not None:
                buffers.append((digests.buffer_ptr, digests.buffer.nbytes))
            for ptr, nbytes in buffers:
                client.register_buffer(ptr, nbytes)
                self._registered.append(ptr)
        except BaseException:
            self._release_client()
            raise
        self.plans = plans
        self.digests = digests
        devices: dict[str, Any] = {}
        for tensor in caches.layers.values():
            devices.setdefault(str(getattr(tensor, "device", "cpu")), tensor)
        self._fence_tensors = list(devices.values())
        if self.settings.load_async:
            self._thread = threading.Thread(
                target=self._run_loads, daemon=True,
                name=f"kvb-mooncake-load-{self.ctx.engine_id[:8]}-{self.ctx.worker_index}")
            self._thread.start()

    def _check_staging(self, plans: Sequence[RegionPlan]) -> None:
        """Every object (one layer of one block) must fit in a staging round."""
        largest = max((slot.block_nbytes for plan in plans for slot in plan.layers), default=0)
        if largest > self.settings.staging_bytes // 2:
            raise ConfigError("kv_connector_extra_config.staging_bytes",
                              f"a block of one layer is {largest} bytes; staging rounds are "
                              f"half of staging_bytes ({self.settings.staging_bytes // 2}): "
                              f"set staging_bytes to at least {2 * largest}")

    def _release_client(self) -> None:
        client, self.client = self.client, None
        if client is None:
            return
        for ptr in self._registered:
            try:
                client.unregister_buffer(ptr)
            except Exception as exc:  # keep releasing the rest
                logger.warning("mooncake store: unregister 0x%x failed: %r", ptr, exc)
        self._registered.clear()
        clients.release(self._pool_key)

    # ------------------------------------------------------------------ loads

    def start_load_kv(self) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, StoreMetadata)
        for request_id, blocks in meta.loads.items():
            if self._thread is not None:
                self._jobs.put((request_id, blocks))
                continue
            self._outcomes.add_invalid(self._load(request_id, blocks))

    def wait_for_layer_load(self, layer_id: int) -> None:
        return None  # synchronous loads completed in start_load_kv; async ones across steps

    def _run_loads(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            request_id, blocks = job
            try:
                failed = self._load(request_id, blocks)
            except Exception:  # never leave a request waiting: fail all of its blocks
                logger.exception("mooncake store: load for %s crashed", request_id)
                failed = {(b.region_index, b.block_id) for b in blocks}
            self._outcomes.finish(request_id, failed)

    def _load(self, request_id: str, blocks: Sequence[LoadBlock]) -> set[BlockRef]:
        """Get every key of ``blocks`` into its tensor slot (and, in a call beside it, the
        digest records the policy checks into their slots), verify; the blocks that failed.

        A load checked in full of many bytes is cut into up to ``PIPELINE_PARTS``
        gets of consecutive blocks; each part's get runs while the part before it is
        hashed, so the check hides behind the transfer.
        """
        bounds = self._parts(blocks)
        parts: list[tuple[int, Batch]] = []
        out_of_range: set[int] = set()
        for start, stop in bounds:
            part, bad = gather(self.plans, blocks[start:stop], writers_only=False)
            if start:
                part.owners[:] = [o + start for o in part.owners]
            parts.append((start, part))
            out_of_range |= {i + start for i in bad}
        failed: set[BlockRef] = {(blocks[i].region_index, blocks[i].block_id)
                                 for i in out_of_range}
        if out_of_range:  # never write outside the tensors
            logger.error("mooncake store: %s: %d block ids outside their regions",
                         request_id, len(out_of_range))
        addressed = {o for _, part in parts for o in part.owners}
        if not addressed:
            return failed
        client = self.client
        if client is None:
            return failed | {(b.region_index, b.block_id) for b in blocks}
        checked, unchecked = checked_blocks(self._policy, request_id, blocks, addressed)
        outcome = Verified()
        started = time.perf_counter()
        # the records in a call of their own, beside the KV gets (the store's cost is
        # per key: a record is one more key per block and rank)
        records = self._record_batch(blocks, checked)
        records_pending = (client.start_batch_get_into(records.keys, records.ptrs,
                                                       records.sizes) if records.keys else None)
        kv_io = self._kv_io
        assert kv_io is not None
        pending: list[BatchCall] = [kv_io.start_batch_get_into(parts[0][1].keys,
                                                               parts[0][1].ptrs,
                                                               parts[0][1].sizes)]
        try:
            timed_out, not_found, first_error, verify_s = self._land_parts(
                blocks, bounds, parts, pending, checked, records, records_pending, failed,
                outcome)
        finally:  # never leave (even on an error) with a get still writing into the KV
            for call in (*pending, *([records_pending] if records_pending else [])):
                call.results()
        num_keys = sum(len(part.keys) for _, part in parts[:len(pending)])
        nbytes = sum(sum(map(_NBYTES, call.results())) for call in pending)
        if records_pending is not None:
            record_results = records_pending.results()
            num_keys += len(record_results)
            nbytes += sum(map(_NBYTES, record_results))
            if list(map(_STATUS, record_results)).count(KeyStatus.OK) != len(record_results):
                timed_out = timed_out or any(r.code == McStatus.TIMEOUT for r in record_results)
        elapsed = time.perf_counter() - started
        abandoned = False
        if timed_out and not client.wait_idle(self.settings.abandon_grace_s):
            abandoned = True
            logger.error("mooncake store: %s: a timed-out get is still running after %.1f s; "
                         "its blocks are reported failed anyway", request_id,
                         self.settings.abandon_grace_s)
        if first_error is not None:
            logger.warning("mooncake store rank %s: load for %s: %d of %d blocks failed "
                           "(first: %s)", self.ctx.worker_index, request_id,
                           len(failed - outcome.failed), len(blocks), first_error)
        self._log_verify(request_id, outcome, len(checked))
        loaded = (len(addressed) if not failed else
                  len({(blocks[i].region_index, blocks[i].block_id) for i in addressed}
                      - failed))
        with self._lock:
            s = self._stats
            s["get_calls"] += len(pending)
            s["get_keys"] += num_keys
            s["get_bytes"] += nbytes
            s["get_time_s"] += elapsed
            s["blocks_loaded"] += loaded
            s["load_errors"] += len(failed)
            s["load_not_found"] += not_found
            s["get_timeouts"] += int(timed_out)
            s["abandoned_gets"] += int(abandoned)
            s[_bucket(elapsed * 1000.0)] += 1
            s["blocks_verified"] += outcome.verified
            s["blocks_unverified"] += outcome.unverified
            s["blocks_unchecked"] += unchecked
            s["digest_mismatches"] += outcome.mismatches
            s["digest_records_invalid"] += outcome.invalid
            s["digest_records_foreign"] += outcome.foreign
            s["digests_missing"] += outcome.missing
            s["verify_time_s"] += verify_s
        if outcome.corrupt_keys:
            self._remove_corrupt(request_id, outcome.corrupt_keys)
        return failed

    def _land_parts(self, blocks: Sequence[LoadBlock], bounds: Sequence[tuple[int, int]],
                    parts: Sequence[tuple[int, Batch]], pending: list[BatchCall],
                    checked: Sequence[int], records: Batch,
                    records_pending: PendingBatch | None, failed: set[BlockRef],
                    outcome: Verified) -> tuple[bool, int, Any, float]:
        """Wait for each part's get in turn (starting the next one first), add the
        blocks that did not arrive to ``failed`` and verify those that did into
        ``outcome``; ``(timed out, not found, first error, verify seconds)``. After a
        get that timed out no further part is asked for (its blocks fail)."""
        kv_io = self._kv_io
        assert kv_io is not None
        timed_out, not_found, first_error, verify_s = False, 0, None, 0.0
        for n, (_, part) in enumerate(parts):
            if n + 1 < len(parts) and not timed_out:  # the next get runs while this one is hashed
                following = parts[n + 1][1]
                pending.append(kv_io.start_batch_get_into(following.keys, following.ptrs,
                                                          following.sizes))
            if n >= len(pending):  # a get before timed out: the rest are not asked for
                failed |= {(blocks[i].region_index, blocks[i].block_id) for i in part.owners}
                continue
            results = pending[n].results()
            if list(map(_STATUS, results)).count(KeyStatus.OK) != len(results):  # else: all ok
                for index, result in enumerate(results):
                    if result.status is KeyStatus.OK:
                        continue
                    block = blocks[part.owners[index]]
                    failed.add((block.region_index, block.block_id))
                    not_found += result.not_found
                    timed_out = timed_out or result.code == McStatus.TIMEOUT
                    first_error = first_error or result
            lo, hi = bounds[n]
            first, last = bisect.bisect_left(checked, lo), bisect.bisect_left(checked, hi)
            if first < last:
                record_results = records_pending.results() if records_pending else []
                verify_started = time.perf_counter()
                outcome.absorb(verify_blocks(
                    self.plans, self.digests, self._policy, blocks, checked[first:last],
                    records.keys[first:last], record_results[first:last], failed))
                failed |= outcome.failed
                verify_s += time.perf_counter() - verify_started
        return timed_out, not_found, first_error, verify_s

    def _parts(self, blocks: Sequence[LoadBlock]) -> list[tuple[int, int]]:
        """``[start, stop)`` of the consecutive blocks each get of a load asks for."""
        count = len(blocks)
        if (count < 2 or self.digests is None or self._policy.mode is not DigestMode.FULL
                or not self.plans):
            return [(0, count)]
        plan = self.plans[blocks[0].region_index]
        per_block = sum(slot.block_nbytes for slot in plan.layers)
        parts = max(1, min(PIPELINE_PARTS, count, count * per_block // PIPELINE_MIN_BYTES))
        edges = [count * k // parts for k in range(parts + 1)]
        return list(zip(edges[:-1], edges[1:], strict=True))

    def _record_batch(self, blocks: Sequence[LoadBlock], checked: Sequence[int]) -> Batch:
        """The gets of the digest records of the ``checked`` blocks, into their slots."""
        digests = self.digests
        if not checked or digests is None:
            return Batch([], [], [], [])
        plans, tables = self.plans, digests.load
        if len({block.region_index for block in blocks}) == 1:  # the usual load: one region
            region = blocks[0].region_index
            prefix, table = plans[region].digest_prefix, tables[region]
            chosen = [blocks[i] for i in checked]
            base, size = table.base_ptr, table.record_bytes
            return Batch([prefix + block.block_hash.hex() for block in chosen],
                         [base + block.block_id * size for block in chosen],
                         [size] * len(chosen), list(checked))
        return Batch([plans[blocks[i].region_index].digest_prefix
                      + blocks[i].block_hash.hex() for i in checked],
                     [tables[blocks[i].region_index].slot_ptr(blocks[i].block_id)
                      for i in checked],
                     [tables[blocks[i].region_index].record_bytes for i in checked],
                     list(checked))

    def _log_verify(self, request_id: str, out: Verified, num_checked: int) -> None:
        """The one line per load naming the first block that failed its check."""
        if out.first is not None:
            block, key, what = out.first
            logger.error("mooncake store engine %s rank %s: request %s: %d of %d checked "
                         "blocks failed digest verification and are recomputed (first: region "
                         "%d block %d, key %s: %s)", self.ctx.engine_id, self.ctx.worker_index,
                         request_id, len(out.failed), num_checked, block.region_index,
                         block.block_id, key, what)

    def _remove_corrupt(self, request_id: str, keys: list[str]) -> None:
        """Delete the keys of blocks that failed verification: a put keeps an existing
        key's value, so until they are gone the block could never be stored right again."""
        client = self.client
        if client is None:
            return
        results = client.remove(keys, force=True)
        removed = sum(1 for r in results if r.ok)
        if removed != len(keys):
            logger.warning("mooncake store: %s: removed %d of %d keys of blocks that failed "
                           "verification", request_id, removed, len(keys))
        with self._lock:
            self._stats["corrupt_keys_removed"] += removed

    # ------------------------------------------------------------------ saves

    def save_kv_layer(self, layer_id: int, kv_layer: object) -> None:
        return None  # the step's blocks are put together in wait_for_save

    def wait_for_save(self) -> None:
        meta = self.connector_metadata
        assert isinstance(meta, StoreMetadata)
        saves = meta.saves
        if not saves:
            return
        batch, out_of_range = gather(self.plans, saves, writers_only=True)
        if out_of_range:
            bad = saves[min(out_of_range)]
            raise ContractError("saves.block_id", f"block {bad.block_id} outside region "
                                                  f"{bad.region_index}'s "
                                                  f"{self.plans[bad.region_index].num_blocks}"
                                                  f" blocks")
        keys, ptrs, sizes, owners = batch.keys, batch.ptrs, batch.sizes, batch.owners
        failed: set[int] = set()
        if keys and not self._kv_written():
            failed = set(owners)
            with self._lock:
                self._stats["put_fence_timeouts"] += 1
                self._stats["put_failures"] += len(failed)
            logger.error("mooncake store rank %s: the kernels writing this step's KV did not "
                         "finish within %.1f s (op_timeout_s); %d block puts dropped",
                         self.ctx.worker_index, self.settings.op_timeout_s, len(failed))
        elif keys:
            client, kv_io = self.client, self._kv_io
            assert client is not None and kv_io is not None, \
                "register_kv_caches runs before any step"
            started = time.perf_counter()
            pending = kv_io.start_batch_put_from(keys, ptrs, sizes)
            # after the fence, while the KV put runs: digests of the bytes put, and their
            # records' put beside it (a writer with verify off puts none: its readers load
            # those blocks unverified, counted)
            records = Batch([], [], [], [])
            try:
                if self.digests is not None and self._policy.enabled:
                    records = self._records(saves, batch)
                    record_results = client.batch_put_from(records.keys, records.ptrs,
                                                           records.sizes)
            finally:  # never leave (even on an error) with the KV put still reading
                results = pending.results()
            if records.keys:
                results = results + record_results
                keys, owners = keys + records.keys, owners + records.owners
            elapsed = time.perf_counter() - started
            orphans: list[str] = []
            ok_status = KeyStatus.OK
            if list(map(_STATUS, results)).count(ok_status) != len(results):  # else: all ok
                for index, result in enumerate(results):
                    if result.status is not ok_status:
                        failed.add(owners[index])
                        if result.code == McStatus.TIMEOUT:
                            orphans.append(keys[index])
            nbytes = sum(map(_NBYTES, results))
            if orphans and client.wait_idle(self.settings.abandon_grace_s):
                # the abandoned put ended before the engine could reuse its blocks:
                # whatever it stored was read from unchanged memory
                orphans = []
            if failed:
                first_error = next(r for r in results if not r.ok)
                logger.warning("mooncake store rank %s: %d of %d block puts failed (first: %s); "
                               "dropped", self.ctx.worker_index, len(failed),
                               len(set(owners)), first_error)
            with self._lock:
                s = self._stats
                s["put_calls"] += 1
                s["put_keys"] += len(keys)
                s["put_bytes"] += nbytes
                s["put_time_s"] += elapsed
                s["blocks_saved"] += len(set(owners)) - len(failed)
                s["put_failures"] += len(failed)
                s["put_timeouts"] += int(bool(orphans))
                self._orphans.extend(orphans)
        # this rank's part of each other block is in the store (or it has none to write)
        if failed:
            self.ctx.events.extend([save.event for i, save in enumerate(saves)
                                    if i not in failed])
        else:
            self.ctx.events.extend([save.event for save in saves])

    def _records(self, saves: Sequence[SaveBlock], batch: Batch) -> Batch:
        """Digest the blocks of ``batch`` in place: the batch of their digest records."""
        digests = self.digests
        assert digests is not None
        started = time.perf_counter()
        by_region: dict[int, list[int]] = {}
        for i in sorted(set(batch.owners)):
            by_region.setdefault(saves[i].region_index, []).append(i)
        records = Batch([], [], [], [])
        for region_index, indices in by_region.items():
            prefix = self.plans[region_index].digest_prefix
            table = digests.save[region_index]
            ids = [saves[i].block_id for i in indices]
            record_keys = [prefix + saves[i].block_hash.hex() for i in indices]
            table.write(ids, digests_of_keys(record_keys),
                        digests.layer_digests(region_index, ids))
            records.keys.extend(record_keys)
            records.ptrs.extend([table.slot_ptr(b) for b in ids])
            records.sizes.extend([table.record_bytes] * len(ids))
            records.owners.extend(indices)
        with self._lock:
            self._stats["blocks_digested"] += sum(map(len, by_region.values()))
            self._stats["digest_time_s"] += time.perf_counter() - started
        return records

    def _kv_written(self) -> bool:
        """Wait (bounded) until the kernels queued so far on every KV device finished."""
        fences = [self.record_fence(tensor) for tensor in self._fence_tensors]
        if all(fence.done() for fence in fences):  # host memory: no clock read, no wait
            return True
        deadline = time.monotonic() + self.settings.op_timeout_s
        return all(wait_fence(fence, max(0.0, deadline - time.monotonic())) for fence in fences)

    def _remove_orphans(self) -> None:
        client = self.client
        if not self._orphans or client is None or not client.wait_idle(0):
            return
        orphans, self._orphans = self._orphans, []
        results = client.remove(orphans, force=True)
        with self._lock:
            self._stats["orphans_removed"] += sum(1 for r in results if r.ok or r.not_found)

    # ------------------------------------------------------------------ reporting

    def get_finished(self, finished_request_ids: frozenset[str]) -> tuple[set[str], set[str]]:
        self._remove_orphans()
        return set(), self._outcomes.snapshot()  # the load thread may finish meanwhile

    def get_failed_recving(self) -> set[str]:
        return self._outcomes.take_failed_recving()

    def get_block_ids_with_load_errors(self) -> set[BlockRef]:
        return self._outcomes.take_invalid_blocks()

    def get_stats(self) -> dict[str, int | float]:
        with self._lock:
            stats = dict(self._stats)
        if self.staged is not None:
            stats.update(self.staged.snapshot())
        return stats

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(self.settings.op_timeout_s + self.settings.abandon_grace_s + 1.0)
            if self._thread.is_alive():
                logger.warning("mooncake store: load thread still busy at shutdown")
        self._release_client()


def _bucket(ms: float) -> str:
    for bound in LATENCY_BUCKETS_MS:
        if ms <= bound:
            return f"load_ms_le_{bound}"
    return "load_ms_le_inf"


def latency_percentile(stats: dict[str, int | float], q: float) -> float | None:
    """Upper bound (ms) of the bucket holding quantile ``q`` of the load latencies in ``stats``."""
    counts = [(b, int(stats.get(f"load_ms_le_{b}", 0))) for b in LATENCY_BUCKETS_MS]
    counts.append((float("inf"), int(stats.get("load_ms_le_inf", 0))))  # type: ignore[arg-type]
    total = sum(c for _, c in counts)
    if not total:
        return None
    seen = 0
    for bound, count in counts:
        seen += count
        if seen >= q * total:
            return float(bound)
    return None
