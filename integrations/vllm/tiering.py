"""kvbridge's fs and Mooncake object tiers as secondary tiers of vLLM's own tiering.

vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec`` keeps a CPU primary tier
and a list of secondary tiers, each a ``SecondaryTierManager`` chosen by class and
module path. These two are kvbridge's tiers behind that interface::

    "secondary_tiers": [
        {"type": "KvbridgeFsTier", "module_path": "kvbridge.integrations.vllm.tiering",
         "root_dir": "/mnt/nvme/kv"},
        {"type": "KvbridgeObjTier", "module_path": "kvbridge.integrations.vllm.tiering",
         "mooncake": {"master_address": "10.0.0.5:50051",
                      "metadata_server": "http://10.0.0.5:8080/metadata"}}]

What each adds to vLLM's own tiers (the tier underneath is
:class:`kvbridge.offload.fs.FsTier` or :class:`kvbridge.offload.obj.ObjTier`, run by a
:class:`kvbridge.offload.runner.TierRunner`):

* digests stored with every block and checked on load (``verify``: full for fs, sample
  for obj); a block that fails them fails alone, its stored copy is removed;
* quarantine (fs): a file whose every read fails is removed after ``quarantine_after``;
* deadlines: a lookup unanswered after ``probe_timeout_s`` is a miss, a load still
  running after ``load_timeout_s`` (a store after ``store_timeout_s``) is reported
  failed (vLLM has no deadline: an unreported job stalls its request forever);
* flip-to-miss: a failed load turns exactly its failed keys into misses in the tier's
  lookup cache, so the request recomputes instead of asking again forever;
* a namespace: vLLM's keys (block hash + group) carry no model or layout; these tiers
  prefix them with a fingerprint of the model, dtype, KV layout and chunk geometry, so
  two deployments sharing a directory or a Mooncake cluster never serve each other's
  bytes.

Promises to vLLM: nothing raises into vLLM after start-up (a failure is a failed job,
a miss, a log line and a count); every job is reported by its deadline; nothing on
the scheduler thread waits on I/O (``drain_jobs`` and ``shutdown`` wait, bounded, as
vLLM asks them to); and no I/O touches vLLM's slots after its job was reported (the
I/O runs on an arena of the tier's own: :mod:`kvbridge.integrations.vllm.bounce`).
An unknown config key, a bad value or an untested vLLM is a ``ConfigError`` at start.

Owns: the vLLM-facing tier objects, the vLLM version check, metric definitions and
events. Their config entries are parsed, and the key namespace made, by the pure
:mod:`kvbridge.integrations.vllm.tier_options`. May not touch: the tiers' own I/O
(``kvbridge.offload``).
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvbridge.connectors.errors import ConfigError
from kvbridge.connectors.offloading.io_hook import installed_fs_io_factory
from kvbridge.integrations.vllm.bounce import BounceArena, GatedTier, JobBlocks, JobGate
from kvbridge.integrations.vllm.tier_options import (
    COMMON_KEYS,
    FS_KEYS,
    FS_PART_MIN_BYTES,
    FS_READ_THREADS,
    FS_REMEMBER_PRESENT,
    FS_STORE_PART_MIN_BYTES,
    FS_WRITE_THREADS,
    HOLD_BELOW_BYTES,
    HOLD_LOADS,
    OBJ_KEYS,
    layout_fingerprint,
    layout_identity,
    option_where,
    parse_fs_options,
    parse_options,
)
from kvbridge.layouts.digests import DigestMode
from kvbridge.offload.fs import FsTier
from kvbridge.offload.runner import DEFAULT_LOAD_TIMEOUT_S, DEFAULT_PROBE_TIMEOUT_S, TierRunner
from kvbridge.offload.tier import Tier
from kvbridge.offload.types import EventKind

logger = logging.getLogger(__name__)

# ---- the vLLM versions these tiers are built for ------------------------------------
#: vLLM releases whose tier interface was checked: [lowest, first refused)
VLLM_RANGE = ((0, 32), (0, 34))
#: what the interface must look like (these changed several times in 2026); a vLLM
#: whose tier signatures differ is refused whatever its version says
_INIT_PARAMS = ("self", "offloading_spec", "primary_kv_view", "tier_type",
                "backpressure_detector")
_ABSTRACT = frozenset({"lookup", "submit_store", "submit_load", "get_finished_jobs",
                       "on_new_request", "drain_jobs"})
_JOB_FIELDS = ("job_id", "keys", "chunk_ids", "is_promotion", "req_context", "submit_time")
_RESULT_FIELDS = ("job_id", "success", "successful_keys", "transfer_time", "transfer_bytes")


def _release(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_vllm(version: str | None = None) -> None:
    """Refuse (``ConfigError``) a vLLM outside :data:`VLLM_RANGE` or whose tier interface
    differs from the one these tiers implement."""
    if version is None:
        import vllm
        version = str(getattr(vllm, "__version__", "unknown"))
    release = _release(version)
    low, high = VLLM_RANGE
    if release is None or not low <= release < high:
        raise ConfigError("vllm", f"kvbridge's vLLM tiers support vLLM {low[0]}.{low[1]} up to "
                                  f"(not including) {high[0]}.{high[1]}, found {version}; use "
                                  "a supported vLLM or a kvbridge built for this one")
    found = tuple(inspect.signature(SecondaryTierManager.__init__).parameters)
    abstract = frozenset(getattr(SecondaryTierManager, "__abstractmethods__", ()))
    job = tuple(getattr(TransferJob, "__dataclass_fields__", {}))
    result = tuple(getattr(JobResult, "__dataclass_fields__", {}))
    for what, want, got in (("SecondaryTierManager.__init__", _INIT_PARAMS, found),
                            ("SecondaryTierManager abstract methods", _ABSTRACT, abstract),
                            ("TransferJob fields", _JOB_FIELDS, job),
                            ("JobResult fields", _RESULT_FIELDS, result)):
        if want != got:
            raise ConfigError("vllm", f"vLLM {version}: {what} are {sorted(got)}, kvbridge's "
                                      f"tiers implement {sorted(want)}; this vLLM's tier "
                                      "interface is not supported")


# ---- the tiers -----------------------------------------------------------------------
class Metric:
    """kvbridge's own metric names (vLLM's ``vllm:kv_offload_tiering_*`` come from its
    manager, from what these tiers report per job)."""

    DIGEST_MISMATCHES = "kvbridge:kv_offload_tiering_digest_mismatches"
    QUARANTINED_BLOCKS = "kvbridge:kv_offload_tiering_quarantined_blocks"
    REMOVED_BLOCKS = "kvbridge:kv_offload_tiering_removed_blocks"
    DEADLINE_MISSES = "kvbridge:kv_offload_tiering_deadline_misses"


METRIC_DOCS = {
    Metric.DIGEST_MISMATCHES: "Blocks whose loaded bytes failed their stored digests "
                              "(failed alone, recomputed, stored copy removed), by tier.",
    Metric.QUARANTINED_BLOCKS: "Stored blocks removed after failing every read "
                               "quarantine_after times in a row, by tier.",
    Metric.REMOVED_BLOCKS: "Stored blocks removed as provably broken (short, torn, "
                           "digests), by tier.",
    Metric.DEADLINE_MISSES: "Lookups, loads and stores given up at their deadline "
                            "(a miss or a failed job, never a stall), by tier and op.",
}


@dataclass
class _Job:
    """A vLLM job in this tier: its keys, slots, gate and deadline (scheduler thread)."""

    job: TransferJob
    keys: tuple[OffloadKey, ...]
    deadline: float
    started: float
    slots: list[int] = field(default_factory=list)
    gate: JobGate = field(default_factory=JobGate)
    #: reported to vLLM already (given up at its deadline): the runner's late result
    #: only frees the arena slots
    reported: bool = False
    #: submitted to the runner (False: waiting for arena slots)
    running: bool = False


class KvbridgeTier(SecondaryTierManager):
    """A kvbridge tier (``make_tier``) behind vLLM's secondary-tier interface.

    Everything here runs on vLLM's scheduler thread and returns at once; the I/O runs
    on the runner's threads, on the tier's arena (see the module docstring).
    """

    medium: ClassVar[Medium] = Medium.STORAGE
    #: the tier's own config keys, and the verify mode it defaults to
    KEYS: ClassVar[tuple[str, ...]] = COMMON_KEYS
    DEFAULT_VERIFY: ClassVar[DigestMode] = DigestMode.FULL
    DEFAULT_LOCALITY: ClassVar[str] = "LOCAL"

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **options: Any) -> None:
        check_vllm()
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.options = parse_options(tier_type, options, self.KEYS, self.DEFAULT_VERIFY)
        self.locality = Locality(self.options.locality or self.DEFAULT_LOCALITY)
        block_bytes = self.block_size_bytes
        self.identity = layout_identity(offloading_spec, block_bytes, self.options.namespace)
        self.fingerprint = layout_fingerprint(self.identity)
        self._prefix = f"vllm/{self.fingerprint}/".encode()
        num_slots = self.options.bounce_bytes // block_bytes
        if num_slots < 1:
            raise ConfigError(option_where(tier_type, "bounce_bytes"),
                              f"{self.options.bounce_bytes} bytes hold no chunk of "
                              f"{block_bytes} bytes")
        self.arena = BounceArena(num_slots, block_bytes)
        self.events_enabled = self.options.enable_kv_events and bool(
            offloading_spec.kv_events_config.enable_kv_cache_events)
        if self.options.enable_kv_events and not self.events_enabled:
            logger.warning("%s: enable_kv_events is set but KV cache events are off "
                           "globally; no events", tier_type)
        self.runner: TierRunner | None = None
        self._jobs: dict[int, _Job] = {}
        self._waiting: deque[_Job] = deque()
        self._ready: list[JobResult] = []
        self._events: list[OffloadingEvent] = []
        self._reported_counts: dict[str, int] = {}
        self._deadline_misses: dict[str, int] = {"lookup": 0, "load": 0, "store": 0}
        self._deadline_reported: dict[str, int] = dict(self._deadline_misses)
        try:
            tier = self.make_tier(block_bytes, self.fingerprint)
            self.runner = self.make_runner(GatedTier(tier))
            self.runner.attach_primary(self.arena.buffer)
        except BaseException:
            if self.runner is not None:
                self.runner.shutdown(1.0)
            self.close_resources()
            self.arena.close()
            raise
        self.load_timeout_s = self.runner.load_timeout_s
        # one flat byte view of vLLM's slots (row c: chunk c's bytes); made last, so a
        # refused start leaves vLLM's region without an export of ours (it unmaps it)
        self._rows = primary_kv_view.cast("B") if primary_kv_view.ndim > 1 \
            else primary_kv_view
        logger.info("%s: kvbridge %s tier, fingerprint %s (%s), verify %s, arena %d chunks",
                    tier_type, tier.name, self.fingerprint, self.identity["model"],
                    self.options.verify.mode.value, num_slots)

    # -- what a concrete tier provides ------------------------------------------------
    def make_tier(self, block_bytes: int, fingerprint: str) -> Tier:
        raise NotImplementedError

    def make_runner(self, tier: Tier) -> TierRunner:
        raise NotImplementedError

    def close_resources(self) -> None:
        """Release what ``make_tier`` opened beside the tier (a client), after it closed."""

    # -- keys --------------------------------------------------------------------------
    def key(self, vllm_key: OffloadKey) -> bytes:
        """kvbridge's key of a vLLM key: namespace prefix + block hash + group."""
        return self._prefix + bytes(vllm_key)

    def vllm_key(self, key: bytes) -> OffloadKey:
        return key[len(self._prefix):]

    # -- lookups ---------------------------------------------------------------------------
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        runner = self.runner
        if runner is None:
            return LookupResult.MISS
        try:
            verdict = runner.lookup(req_context.req_id, self.key(key))
        except Exception:
            logger.exception("%s: lookup failed; a miss", self.tier_type)
            return LookupResult.MISS
        if verdict is None:
            return LookupResult.RETRY
        return LookupResult.HIT if verdict else LookupResult.MISS

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self.runner is not None:
            try:
                self.runner.release_request(req_context.req_id)
            except Exception:
                logger.exception("%s: releasing request %s failed", self.tier_type,
                                 req_context.req_id)

    def on_schedule_end(self, context: Any) -> None:
        """Start the jobs vLLM submitted this step (it submits promotions just before
        this, cascades during the step: one burst, see ``TierRunner.flush_jobs``); send
        this step's probe batch; apply finished probes (expired ones: misses)."""
        runner = self.runner
        if runner is None:
            return
        try:
            runner.step()
            self._drain_probes(runner)
        except Exception:
            logger.exception("%s: step failed", self.tier_type)

    def _drain_probes(self, runner: TierRunner) -> None:
        before = runner.cache.probe_timeouts
        runner.drain_results()
        self._deadline_misses["lookup"] += runner.cache.probe_timeouts - before

    # -- jobs ---------------------------------------------------------------------------
    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self.load_timeout_s)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self.options.store_timeout_s)

    def _submit(self, job: TransferJob, timeout_s: float) -> None:
        now = time.monotonic()
        try:
            keys = tuple(self.key(k) for k in job.keys)
            entry = _Job(job, keys, now + timeout_s, now)
        except Exception:
            logger.exception("%s: job %d refused", self.tier_type, job.job_id)
            self._ready.append(JobResult(job.job_id, False))
            return
        self._jobs[job.job_id] = entry
        if len(keys) > self.arena.num_slots:
            logger.warning("%s: job %d of %d chunks exceeds the arena (%d chunks, "
                           "bounce_bytes); failed", self.tier_type, job.job_id, len(keys),
                           self.arena.num_slots)
            self._report(entry, False)
            return
        self._waiting.append(entry)
        self._start_waiting()

    def _start_waiting(self) -> None:
        """Start waiting jobs in order while the arena has room (scheduler thread)."""
        while self._waiting:
            entry = self._waiting[0]
            if entry.reported:
                self._waiting.popleft()
                continue
            slots = self.arena.take(len(entry.keys))
            if slots is None:
                return
            self._waiting.popleft()
            entry.slots = slots
            self._start(entry)

    def _start(self, entry: _Job) -> None:
        runner = self.runner
        job = entry.job
        try:
            if runner is None:
                raise RuntimeError("the tier is shut down")
            block = self.block_size_bytes
            primary = [self._rows[int(c) * block:(int(c) + 1) * block] for c in job.chunk_ids]
            blocks = JobBlocks(entry.gate, [self.arena.view(s) for s in entry.slots], primary)
            if job.is_promotion:
                runner.submit_load(job.job_id, entry.keys, blocks)
            else:
                runner.submit_store(job.job_id, entry.keys, blocks)
            entry.running = True
        except Exception:
            logger.exception("%s: job %d could not start; failed", self.tier_type, job.job_id)
            self.arena.give(entry.slots)
            entry.slots = []
            self._report(entry, False)

    def _report(self, entry: _Job, success: bool,
                ok_keys: Iterable[bytes] | None = None) -> None:
        """The job's result for vLLM (once); a job still running keeps its arena slots."""
        if entry.reported:
            return
        entry.reported = True
        job = entry.job
        successful = None
        if not success and ok_keys is not None:
            kept = tuple(self.vllm_key(k) for k in ok_keys)
            successful = kept or None
        num_ok = len(entry.keys) if success else len(successful or ())
        self._ready.append(JobResult(job.job_id, success, successful,
                                     time.monotonic() - entry.started,
                                     num_ok * self.block_size_bytes))
        if not entry.running and not entry.slots:
            self._jobs.pop(job.job_id, None)

    def _collect(self) -> None:
        """Take the runner's finished jobs, give up jobs past their deadline, start waiting
        ones (scheduler thread; never waits)."""
        runner = self.runner
        if runner is None:
            return
        # jobs submitted outside a step end (none in vLLM 0.32/0.33) start here at the
        # latest, one poll later
        runner.flush_jobs()
        # vLLM polls jobs before the step's first lookup: verdicts that arrived since
        # the last step's end answer this step's lookups (not the next one's)
        self._drain_probes(runner)
        for result in runner.get_finished_jobs():
            entry = self._jobs.pop(result.job_id, None)
            if entry is None:
                continue
            self.arena.give(entry.slots)
            entry.slots = []
            entry.running = False
            if not entry.reported:
                self._report(entry, result.success, result.successful_keys)
        self._take_runner_events()
        now = time.monotonic()
        for entry in list(self._jobs.values()):
            if entry.reported or now < entry.deadline:
                continue
            if entry.running and not entry.gate.abandon():
                continue   # a copy runs now; it ends, and the job with it
            op = "load" if entry.job.is_promotion else "store"
            self._deadline_misses[op] += 1
            logger.warning("%s: %s job %d of %d chunks still running %.1f s after it "
                           "started; reported failed (its I/O goes on in the tier's own "
                           "buffers)", self.tier_type, op, entry.job.job_id, len(entry.keys),
                           now - entry.started)
            if entry.job.is_promotion:
                runner.cache.mark_miss(entry.keys)
            self._report(entry, False)
        self._start_waiting()

    def get_finished_jobs(self) -> Iterable[JobResult]:
        try:
            self._collect()
        except Exception:
            logger.exception("%s: collecting finished jobs failed", self.tier_type)
        ready, self._ready = self._ready, []
        return ready

    def has_pending_work(self) -> bool:
        return any(not entry.reported for entry in self._jobs.values())

    def drain_jobs(self) -> None:
        """Wait until every job is reported: finished, or given up at its deadline (its
        I/O then touches only the arena). Bounded by the latest deadline in flight."""
        for entry in list(self._waiting):   # queued, never started: cancelled
            self._report(entry, False)
        self._waiting.clear()
        latest = max((e.deadline for e in self._jobs.values() if not e.reported),
                     default=0.0)
        # past every deadline only a copy between memories can hold a job, and it ends;
        # this bound only keeps a bug from waiting forever
        give_up = max(latest, time.monotonic()) + 5.0
        while self.has_pending_work():
            try:
                self._collect()
            except Exception:
                logger.exception("%s: collecting finished jobs failed", self.tier_type)
            if not self.has_pending_work():
                break
            if time.monotonic() > give_up:
                for entry in list(self._jobs.values()):
                    if not entry.reported:
                        logger.error("%s: job %d still unreported %.1f s past its deadline; "
                                     "reported failed", self.tier_type, entry.job.job_id,
                                     time.monotonic() - entry.deadline)
                        entry.gate.abandon()
                        self._report(entry, False)
                break
            if self.runner is not None:
                self.runner.wait_for_finished(0.01)

    # -- events and metrics ---------------------------------------------------------------
    def _take_runner_events(self) -> None:
        runner = self.runner
        if runner is None:
            return
        events = runner.take_events()
        if not self.events_enabled:
            return
        for event in events:
            self._events.append(OffloadingEvent(
                keys=[self.vllm_key(k) for k in event.keys], medium=self.medium,
                removed=event.kind is EventKind.REMOVED, locality=self.locality,
                ownership=self.tier_type))

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]
                                 ) -> dict[str, OffloadingMetricMetadata]:
        labels = {Metric.DEADLINE_MISSES: ("tier", "op")}
        return {name: OffloadingCounterMetadata(documentation=doc,
                                                labelnames=labels.get(name, ("tier",)))
                for name, doc in METRIC_DOCS.items()}

    def stats(self) -> dict[str, object]:
        """The runner's and the tier's counters, and deadline misses by op (tests, logs)."""
        out: dict[str, object] = {} if self.runner is None else self.runner.stats_snapshot()
        out["deadline_misses"] = dict(self._deadline_misses)
        out["arena_free"] = self.arena.num_free
        return out

    def get_stats(self) -> OffloadingConnectorStats | None:
        if self.runner is None:
            return None
        snap = self.runner.stats_snapshot()
        stats = OffloadingConnectorStats()
        label = (self.tier_type,)
        for name, counter in ((Metric.DIGEST_MISMATCHES, "digest_mismatches"),
                              (Metric.QUARANTINED_BLOCKS, "files_quarantined"),
                              (Metric.REMOVED_BLOCKS, "files_deleted")):
            raw = snap.get(counter, 0)
            value = raw if isinstance(raw, int) else 0
            delta = value - self._reported_counts.get(counter, 0)
            self._reported_counts[counter] = value
            if delta:
                stats.increase_counter(name, delta, label)
        for op, value in self._deadline_misses.items():
            delta = value - self._deadline_reported[op]
            self._deadline_reported[op] = value
            if delta:
                stats.increase_counter(Metric.DEADLINE_MISSES, delta, (self.tier_type, op))
        return None if stats.is_empty() else stats

    # -- shutdown ----------------------------------------------------------------------
    def shutdown(self) -> None:
        """Report what runs (bounded), stop the runner (bounded), close the tier; the arena
        stays mapped if an abandoned call may still write it. Never raises."""
        runner = self.runner
        if runner is None:
            return
        try:
            self.drain_jobs()
        except Exception:
            logger.exception("%s: draining at shutdown failed", self.tier_type)
        self.runner = None
        try:
            runner.shutdown()
        except Exception:
            logger.exception("%s: stopping the runner failed", self.tier_type)
        # jobs the runner finished meanwhile give their slots back
        try:
            for result in runner.get_finished_jobs():
                entry = self._jobs.pop(result.job_id, None)
                if entry is not None:
                    self.arena.give(entry.slots)
        except Exception:
            logger.exception("%s: final collection failed", self.tier_type)
        try:
            self.close_resources()
        except Exception:
            logger.exception("%s: closing the tier's client failed", self.tier_type)
        self.arena.close()
        if not any(entry.running for entry in self._jobs.values()):
            # vLLM unmaps its slots after this; a view of ours would keep them exported
            self._rows.release()


class KvbridgeFsTier(KvbridgeTier):
    """kvbridge's fs tier (:class:`kvbridge.offload.fs.FsTier`) as a vLLM secondary tier.

    Keys beyond the common ones: ``root_dir`` (required), ``o_direct`` (true),
    ``io_engine`` ("python": one read per file; "auto"/"uring": batched io_uring reads
    through NIXL, :mod:`kvbridge.offload.fs`), ``quarantine_after`` (3), ``fsync`` (false).
    The tier's I/O is the real one, or what an enclosing
    :func:`kvbridge.connectors.offloading.io_hook.fs_io_factory` block makes (tests).
    """

    KEYS = FS_KEYS
    DEFAULT_VERIFY = DigestMode.FULL
    DEFAULT_LOCALITY = "LOCAL"

    def make_tier(self, block_bytes: int, fingerprint: str) -> Tier:
        fs = parse_fs_options(self.tier_type, self.options.own)
        make_io = installed_fs_io_factory()
        tier = FsTier(fs.root_dir, block_bytes, fingerprint, use_o_direct=fs.o_direct,
                      fsync=fs.fsync,
                      io=None if make_io is None else make_io(fs.root_dir, fingerprint),
                      quarantine_after=fs.quarantine_after, verify=self.options.verify,
                      io_engine=fs.io_engine)
        # batched reads (io_engine auto/uring) set their own load part size when the
        # arena attaches, after this
        file_bytes = tier.header_bytes + block_bytes
        tier.load_part_blocks = tier.merge_load_blocks = max(1, FS_PART_MIN_BYTES // file_bytes)
        tier.store_part_blocks = tier.merge_store_blocks = \
            max(1, FS_STORE_PART_MIN_BYTES // file_bytes)
        return tier

    def make_runner(self, tier: Tier) -> TierRunner:
        o = self.options
        return TierRunner(tier, read_threads=o.read_threads or FS_READ_THREADS,
                          write_threads=o.write_threads or FS_WRITE_THREADS,
                          probe_timeout_s=o.probe_timeout_s or DEFAULT_PROBE_TIMEOUT_S,
                          load_timeout_s=o.load_timeout_s or DEFAULT_LOAD_TIMEOUT_S,
                          remember_present=FS_REMEMBER_PRESENT,
                          hold_below_bytes=HOLD_BELOW_BYTES, hold_loads=HOLD_LOADS)


class KvbridgeObjTier(KvbridgeTier):
    """kvbridge's Mooncake object tier (:class:`kvbridge.offload.obj.ObjTier`) as a vLLM
    secondary tier. ``mooncake`` (required): the client config
    (:class:`kvbridge.backends.mooncake.MooncakeConfig` fields). Deadlines default to the
    client's ``op_timeout_s`` (:func:`kvbridge.offload.obj.default_deadlines`)."""

    KEYS = OBJ_KEYS
    DEFAULT_VERIFY = DigestMode.SAMPLE
    DEFAULT_LOCALITY = "REMOTE"
    _client: Any = None

    def make_tier(self, block_bytes: int, fingerprint: str) -> Tier:
        import kvbridge.backends  # noqa: F401  (env defaults before any client)
        from kvbridge.backends.mooncake import MooncakeConfig, MooncakeStoreClient
        from kvbridge.offload.obj import ObjTier

        where = option_where(self.tier_type, "mooncake")
        raw = self.options.own.get("mooncake")
        if not isinstance(raw, Mapping) or not all(isinstance(k, str) for k in raw):
            raise ConfigError(where, "expected a Mooncake client config object "
                                     "(master_address, metadata_server, ...)")
        try:
            config = MooncakeConfig(**raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(where, str(exc)) from None
        self._client = MooncakeStoreClient.connect(config)
        return ObjTier(self._client, block_bytes, fingerprint, verify=self.options.verify)

    def make_runner(self, tier: Tier) -> TierRunner:
        from kvbridge.offload.obj import DEFAULT_READ_THREADS as OBJ_READ
        from kvbridge.offload.obj import DEFAULT_WRITE_THREADS as OBJ_WRITE
        from kvbridge.offload.obj import default_deadlines

        probe_s, load_s = default_deadlines(self._client.config.op_timeout_s)
        o = self.options
        return TierRunner(tier, read_threads=o.read_threads or OBJ_READ,
                          write_threads=o.write_threads or OBJ_WRITE,
                          probe_timeout_s=o.probe_timeout_s or probe_s,
                          load_timeout_s=o.load_timeout_s or load_s,
                          hold_below_bytes=HOLD_BELOW_BYTES, hold_loads=HOLD_LOADS)

    def close_resources(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()


#: what a config's ``type`` names, with ``module_path`` this module
TIER_CLASSES: dict[str, Callable[..., KvbridgeTier]] = {
    "KvbridgeFsTier": KvbridgeFsTier, "KvbridgeObjTier": KvbridgeObjTier}
