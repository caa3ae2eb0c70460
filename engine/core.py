"""The reference engine: a scheduler step loop that drives a connector like a serving engine.

One :class:`Engine` = one scheduler + all worker ranks of one engine instance,
in one process, single-threaded. ``step()`` runs one engine step:

1. **schedule** -- running requests first (preempting the most recent ones
   when blocks run out), then waiting ones in FIFO order: local prefix-cache
   lookup, ``get_num_new_matched_tokens`` (``None``: the request stays in
   WAITING_FOR_LOOKUP and is asked again next step), allocation,
   ``update_state_after_alloc``; an async load parks the request in
   WAITING_FOR_REMOTE_KVS until it is in ``finished_recving``;
2. ``build_connector_meta`` (exactly once per step);
3. **execute** every rank: bind, ``start_load_kv``, per layer
   ``wait_for_layer_load`` -> compute -> ``save_kv_layer``, ``wait_for_save``,
   ``get_finished`` & co., clear;
4. **aggregate** the ranks' outputs; load errors -> the affected requests'
   ``num_computed_tokens`` go back to the first invalid token (recompute,
   never trust the bytes); ``update_connector_output``;
5. finished receives release their waiting requests; finished sends free
   delayed blocks;
6. **advance** computed tokens, cache full blocks by their chained hash, sample
   the next token (deterministic), finish requests at ``max_tokens``:
   ``request_finished`` -> free now or delay the free;
7. ``take_events``; publish the step's KV events as one batch.

KV events, published once per step to the ``event_sink``: first the block
pools' (with ``enable_kv_cache_events``; medium GPU, locality LOCAL, as vLLM's
block pool: ``BlockStored`` when full blocks become findable by their hash,
``BlockRemoved`` when a cached hash is evicted for reuse or forgotten,
``AllBlocksCleared`` when :meth:`Engine.reset_prefix_cache` cleared them all),
then the workers' connector events once every rank holding the block reported
them (:class:`~kvbridge.connectors.OutputAggregator`), then the scheduler
connector's. A reset between steps publishes its events at once.

Bounded by construction: a request waiting for remote KV longer than
``remote_kv_timeout_s`` is failed by the engine itself (its blocks are
quarantined, never reused, because a late transfer could still write them),
and counted in ``stats()["remote_kv_timeouts"]`` -- a correct connector never
lets that happen, which the conformance suite checks.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import torch

from kvbridge.connectors import (
    ConfigError,
    ConnectorConfig,
    ConnectorContext,
    ConnectorMetadata,
    ConnectorOutput,
    ContractError,
    EventBuffer,
    KVRole,
    LoadFailurePolicy,
    OutputAggregator,
    RoleError,
    ScheduledRequest,
    SchedulerConnector,
    SchedulerStep,
    WorkerConnector,
    WorkerOutput,
    registry,
)
from kvbridge.engine.block_pool import BlockPool
from kvbridge.engine.content import next_token
from kvbridge.engine.control import ControlLimits
from kvbridge.engine.kv_events import EngineEventsConfig, active_publishing
from kvbridge.engine.request import (
    EngineRequest,
    RequestResult,
    RequestSpec,
    RequestState,
    blocks_needed,
    common_hit_tokens,
)
from kvbridge.engine.worker import ComputeItem, Worker
from kvbridge.events import AllBlocksCleared, EventSink, KVEvent, KVEventPublisher
from kvbridge.layouts import KVCacheSpec, ParallelTopology

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one reference engine. ``num_blocks`` is per region (every rank)."""

    spec: KVCacheSpec
    topology: ParallelTopology = field(default_factory=ParallelTopology)
    num_blocks: int = 256
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    connector: ConnectorConfig | None = None
    enable_prefix_caching: bool = True
    verify_loads: bool = True
    remote_kv_timeout_s: float = 60.0
    engine_id: str | None = None
    record_hooks: bool = False
    #: emit the block pools' KV events (medium GPU), as vLLM's ``enable_kv_cache_events``;
    #: connector events are always collected
    enable_kv_cache_events: bool = False
    #: hand each allocation's blocks out in ascending id order (True), or in the free
    #: queue's order as vLLM does (False). The blocks chosen are the same either way
    #: (least recently freed first); only their order in the request differs. Sorted,
    #: a request's blocks form contiguous runs, so a NIXL transfer merges them
    #: (measured 4096 x 16 KiB: ~2x the bandwidth); vLLM's order, after a request
    #: freed its blocks tail first, runs downwards and nothing merges.
    sorted_allocation: bool = True

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ConfigError("num_blocks", f"expected >= 1, got {self.num_blocks}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens", "expected >= 1")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", "expected >= 1")
        self.spec.validate_topology(self.topology)


#: Bytes of bookkeeping per block and region besides its KV (block pool lists, hashes).
BLOCK_OVERHEAD_BYTES = 256
#: Share of the host's available memory one engine's KV cache may take.
HOST_MEMORY_FRACTION = 0.8


def kv_cache_bytes(config: EngineConfig) -> int:
    """Bytes an engine of ``config`` allocates for its KV cache, every rank and region,
    plus its block pools' bookkeeping (the reference engine keeps every rank in memory)."""
    per_block = 0
    for rank in config.topology.sizes().ranks():
        per_block += sum(shape.block_bytes for shape in config.spec.rank_shapes(rank))
    return config.num_blocks * (per_block + BLOCK_OVERHEAD_BYTES * len(config.spec.regions))


def available_memory_bytes(root: str = "/") -> int:
    """What this host could give a new allocation now: ``MemAvailable`` (Linux), else
    all physical memory; at most what this process's cgroup still allows (its memory
    limit less its usage, cgroup v2 or v1: a container's limit is often far below the
    host's memory). ``root``: where ``proc`` and ``sys`` are looked up (tests)."""
    have: int | None = None
    try:
        with open(os.path.join(root, "proc/meminfo")) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    have = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if have is None:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    room = cgroup_memory_room(root)
    return have if room is None else min(have, room)


def cgroup_memory_room(root: str = "/") -> int | None:
    """Bytes this process's memory cgroup still allows (limit - usage), None if unlimited
    or unknown. Reads the cgroup of ``/proc/self/cgroup`` under ``/sys/fs/cgroup``."""
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            entries = [line.strip().split(":", 2) for line in f if line.strip()]
    except OSError:
        return None
    base = os.path.join(root, "sys/fs/cgroup")
    for entry in entries:
        if len(entry) != 3:
            continue
        _hierarchy, controllers, path = entry
        if controllers == "":  # v2: one unified hierarchy
            pairs = [(os.path.join(base, path.lstrip("/")), "memory.max", "memory.current")]
        elif "memory" in controllers.split(","):
            pairs = [(os.path.join(base, "memory", path.lstrip("/")),
                      "memory.limit_in_bytes", "memory.usage_in_bytes")]
        else:
            continue
        for directory, limit_file, usage_file in pairs:
            try:
                with open(os.path.join(directory, limit_file)) as f:
                    limit_text = f.read().strip()
                with open(os.path.join(directory, usage_file)) as f:
                    usage = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if limit_text == "max":
                return None
            try:
                limit = int(limit_text)
            except ValueError:
                continue
            if limit >= 1 << 60:  # v1's "unlimited" (a page-rounded LONG_MAX)
                return None
            return max(0, limit - usage)
    return None


def check_host_memory(config: EngineConfig) -> None:
    """Refuse (``num_blocks`` named) a KV cache this host could not hold, before any of
    it is allocated: too many blocks must be a usage error, not an engine that
    allocates until the machine runs out."""
    need = kv_cache_bytes(config)
    have = int(available_memory_bytes() * HOST_MEMORY_FRACTION)
    if need > have:
        raise ConfigError("num_blocks", f"{config.num_blocks} blocks of this model on "
                                        f"{config.topology.sizes().describe()} need "
                                        f"{need / 2**30:.1f} GiB of KV memory; this host can "
                                        f"give {have / 2**30:.1f} GiB "
                                        f"({HOST_MEMORY_FRACTION:.0%} of what is available): "
                                        f"use fewer blocks, ranks or a smaller model")


@dataclass(frozen=True)
class HookCall:
    step: int
    side: str  # "scheduler" or "worker"
    worker: int | None
    hook: str
    request_id: str | None


@dataclass(frozen=True)
class StepReport:
    step_id: int
    num_scheduled: int
    num_tokens: int
    preempted: frozenset[str]
    finished: tuple[str, ...]
    output: ConnectorOutput | None


class Engine:
    """A paged-KV engine with all its ranks in this process. Not thread-safe."""

    def __init__(self, config: EngineConfig, event_sink: EventSink | None = None, *,
                 events: EngineEventsConfig | None = None,
                 keep_events: bool | None = None) -> None:
        """``event_sink`` (e.g. a ``kvbridge.events.KVEventPublisher``) gets each step's
        KV events as one batch; without one they accumulate in ``self.events``
        (``keep_events`` decides; default: when neither a sink nor ``events`` is given).

        ``events``: the engine binds its own publisher there (closed by
        :meth:`shutdown`) and turns ``enable_kv_cache_events`` on; so does an
        engine built without either inside
        :func:`kvbridge.engine.kv_events.publish_engine_events` (at the next
        engine's endpoints; such an engine still keeps its events, for the
        summary of the command that built it).
        """
        #: events also go to ``self.events``
        self.keep_events = (event_sink is None and events is None if keep_events is None
                            else keep_events)
        publishing = active_publishing() if event_sink is None and events is None else None
        if publishing is not None:
            events = publishing.assign()
        self.publisher: KVEventPublisher | None = None
        if events is not None:
            if event_sink is not None:
                raise ConfigError("events", "give either an event sink or an events config")
            config = replace(config, enable_kv_cache_events=True)
            self.publisher = events.make_publisher()
            event_sink = self.publisher
        self._close_timeout_s = events.close_timeout_s if events is not None else 0.0
        try:
            self._start(config, event_sink)
        except BaseException:
            if self.publisher is not None:
                self.publisher.close(timeout_s=0)
            raise
        if publishing is not None and self.publisher is not None:
            name = {KVRole.PRODUCER: "producer", KVRole.CONSUMER: "consumer"}.get(
                self.role, "engine") if self.role is not None else "engine"
            publishing.record(name, self.engine_id, self.publisher.endpoint,
                              self.publisher.replay_endpoint)

    def _start(self, config: EngineConfig, event_sink: EventSink | None) -> None:
        self.config = config
        self.event_sink = event_sink
        self.spec = config.spec
        self.sizes = config.topology.sizes()
        self.dcp_size = self.sizes.dcp_size
        self.num_regions = len(self.spec.regions)
        self.tokens_per_block = tuple(r.tokens_per_key(self.dcp_size) for r in self.spec.regions)
        num_blocks = tuple(config.num_blocks for _ in self.spec.regions)
        check_host_memory(config)  # before any pool or tensor exists
        self.engine_id = (config.connector.engine_id if config.connector is not None
                          else config.engine_id or uuid.uuid4().hex[:16])
        self.role: KVRole | None = config.connector.role if config.connector else None
        self.pools = [BlockPool(n, block_size=t, group_idx=r,
                                emit_events=config.enable_kv_cache_events,
                                sorted_allocation=config.sorted_allocation)
                      for r, (n, t) in enumerate(zip(num_blocks, self.tokens_per_block,
                                                     strict=True))]
        self.hook_log: list[HookCall] = []
        #: each step's aggregated connector output (kept when ``record_hooks``)
        self.output_log: list[ConnectorOutput] = []
        #: called as ``hook(engine, step)`` after ``build_connector_meta``, before the
        #: workers run (fault injection and tests)
        self.step_hooks: list[Callable[[Engine, SchedulerStep], None]] = []
        #: requests whose connector load (``num_external_tokens > 0``) starts this step
        self.loads_started: set[str] = set()
        self.step_id = 0
        self.requests: dict[str, EngineRequest] = {}
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.results: list[RequestResult] = []
        self.events: list[KVEvent] = []
        self._finished_since_last_step: set[str] = set()
        self._delayed: dict[str, tuple[EngineRequest, float]] = {}  # delayed frees
        self._free_on_recv: dict[str, EngineRequest] = {}  # aborted while receiving
        self._recv_done: dict[str, bool] = {}  # request id -> failed
        self._ignore_recv: set[str] = set()
        self._invalid_refs: set[tuple[int, int]] = set()
        self._quarantined: list[tuple[int, int]] = []
        self._stats: dict[str, int] = {
            "steps": 0, "preemptions": 0, "tokens_computed": 0, "local_hit_tokens": 0,
            "external_tokens": 0, "recomputed_tokens": 0, "failed_loads": 0,
            "remote_kv_timeouts": 0, "lookup_timeouts": 0, "lookups_deferred": 0,
            "stray_finished_sending": 0,
            "stray_finished_recving": 0, "stray_invalid_blocks": 0, "verified_bytes": 0,
            "mismatched_bytes": 0, "aborted": 0, "finished": 0,
        }
        self._worker_stats: dict[str, int | float] = {}
        self.scheduler_connector: SchedulerConnector | None = None
        self.workers: list[Worker] = []
        self.aggregator: OutputAggregator | None = None
        self._shut_down = False
        ranks = list(self.sizes.ranks())
        if config.connector is None:
            self.workers = [Worker(self.spec, self.sizes, rank, index, num_blocks, None)
                            for index, rank in enumerate(ranks)]
            return
        resolved = registry.resolve(config.connector)  # raises before anything exists
        created_workers: list[WorkerConnector] = []
        try:
            base = dict(spec=self.spec, topology=self.sizes, config=config.connector,
                        num_blocks=num_blocks, extra=resolved.extra)
            sched_ctx = ConnectorContext(**base, events=EventBuffer())
            self._record("scheduler", None, "create_scheduler", None)
            self.scheduler_connector = resolved.plugin.create_scheduler(sched_ctx)
            for index, rank in enumerate(ranks):
                ctx = ConnectorContext(**base, events=EventBuffer(),
                                       rank=rank, worker_index=index)
                self._record("worker", index, "create_worker", None)
                worker_connector = resolved.plugin.create_worker(ctx)
                created_workers.append(worker_connector)
                self.workers.append(Worker(self.spec, self.sizes, rank, index, num_blocks,
                                           worker_connector, self._record))
            metadata = {}
            for worker in self.workers:
                assert worker.connector is not None
                blob = worker.connector.get_handshake_metadata()
                if blob is not None:
                    metadata[worker.worker_index] = blob
            self._record("scheduler", None, "set_handshake_metadata", None)
            self.scheduler_connector.set_handshake_metadata(metadata)
        except BaseException:
            for connector in created_workers:
                try:
                    connector.shutdown()
                except Exception:
                    logger.exception("shutdown after a failed engine start")
            if self.scheduler_connector is not None:
                self.scheduler_connector.shutdown()
            raise
        # a worker event of region r completes once every rank holding r's layers reported it
        holders = [frozenset(w.worker_index for w in self.workers
                             if self.spec.rank_shapes(w.rank)[r].layer_ids)
                   for r in range(self.num_regions)]
        self.aggregator = OutputAggregator(len(self.workers), holders=holders)

    # ------------------------------------------------------------------ client API

    def _record(self, side: str, worker: int | None, hook: str, request_id: str | None) -> None:
        if self.config.record_hooks:
            self.hook_log.append(HookCall(self.step_id, side, worker, hook, request_id))

    @property
    def max_request_tokens(self) -> int:
        """Tokens of KV one request can ever hold: what the smallest region's pool holds.

        A request needing more (``len(prompt) + max_tokens - 1``) could never be
        scheduled, and FIFO scheduling would then starve every request behind it."""
        return min(pool.num_blocks * t for pool, t in zip(self.pools, self.tokens_per_block,
                                                          strict=True))

    def control_limits(self) -> ControlLimits:
        """What one control message to this engine may carry (``kvbridge.engine.control``)."""
        return ControlLimits.for_pools(self.config.num_blocks, self.tokens_per_block)

    def check_request(self, spec: RequestSpec) -> None:
        """Raise (naming the field) if :meth:`add_request` would refuse ``spec``; no effect."""
        if self._shut_down:
            raise ContractError("engine", "add_request after shutdown")
        if spec.request_id in self.requests:
            raise ConfigError("request_id", f"duplicate request id {spec.request_id!r}")
        needed = len(spec.prompt) + spec.max_tokens - 1
        if needed > self.max_request_tokens:
            raise ConfigError("prompt" if len(spec.prompt) > self.max_request_tokens
                              else "max_tokens",
                              f"request {spec.request_id!r} needs the KV of {needed} tokens; "
                              f"this engine's block pool holds {self.max_request_tokens} "
                              f"(num_blocks {self.config.num_blocks}): it could never run")
        if spec.transfer_params is not None:
            if self.scheduler_connector is None:
                raise RoleError("transfer_params", f"request {spec.request_id!r} carries "
                                "transfer params but this engine has no connector")
            spec.transfer_params.check_regions(self.num_regions)
        if spec.remote_decode and (self.role is None or not self.role.is_producer):
            raise RoleError("remote_decode", f"request {spec.request_id!r} asks for a remote "
                            f"decode; that needs a connector with role kv_producer "
                            f"(this engine: {self.role.value if self.role else 'none'})")

    def add_request(self, spec: RequestSpec) -> None:
        """Queue a request. Validated first: nothing is queued if it is refused."""
        self.check_request(spec)
        request = EngineRequest(spec, self.num_regions)
        request.update_hashes(self.spec, self.dcp_size)
        request.waiting_since = time.monotonic()
        self.requests[spec.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Abort a request (between steps). False if it is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None or request.state.finished:
            return False
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, RequestState.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_transfers(self) -> bool:
        """Delayed frees or receives of aborted requests still outstanding."""
        return bool(self._delayed or self._free_on_recv)

    def has_work(self) -> bool:
        return self.has_unfinished_requests() or self.has_pending_transfers()

    def pop_results(self) -> list[RequestResult]:
        results, self.results = self.results, []
        return results

    def run_until_done(self, *, max_steps: int = 100_000, timeout_s: float = 120.0,
                       idle_sleep_s: float = 0.0005) -> list[RequestResult]:
        """Step until no request and no pending transfer is left (bounded)."""
        deadline = time.monotonic() + timeout_s
        steps = 0
        while self.has_work():
            if steps >= max_steps or time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.engine_id}: still busy after {steps} steps "
                                   f"({len(self.waiting)} waiting, {len(self.running)} running, "
                                   f"{len(self._delayed)} delayed frees)")
            report = self.step()
            steps += 1
            if report.num_scheduled == 0 and idle_sleep_s:
                time.sleep(idle_sleep_s)
        return self.pop_results()

    # ------------------------------------------------------------------ the step

    def step(self) -> StepReport:
        if self._shut_down:
            raise ContractError("engine", "step after shutdown")
        self.step_id += 1
        self._stats["steps"] += 1
        self.loads_started = set()
        preempted: set[str] = set()
        items: list[tuple[EngineRequest, int, bool]] = []
        self._schedule_running(items, preempted)
        if not preempted:
            self._schedule_waiting(items)
        finished_prev = frozenset(self._finished_since_last_step)
        self._finished_since_last_step = set()

        metadata: ConnectorMetadata | None = None
        connector_events: list[KVEvent] = []
        if self.scheduler_connector is not None:
            step = SchedulerStep(
                step_id=self.step_id,
                scheduled=tuple(ScheduledRequest(req.view(), req.frozen_block_ids(),
                                                 req.num_computed_tokens, n, is_new)
                                for req, n, is_new in items),
                finished_request_ids=finished_prev,
                preempted_request_ids=frozenset(preempted))
            self._record("scheduler", None, "build_connector_meta", None)
            metadata = self.scheduler_connector.build_connector_meta(step)
            if not isinstance(metadata, ConnectorMetadata):
                raise ContractError("build_connector_meta",
                                    f"expected a ConnectorMetadata, got {type(metadata).__name__}")
            for hook in self.step_hooks:
                hook(self, step)

        compute = []
        for req, n, _ in items:
            seeds = torch.as_tensor(req.update_seeds(), dtype=torch.int64)
            compute.append(ComputeItem(req.request_id, req.frozen_block_ids(), seeds,
                                       req.num_computed_tokens, req.num_computed_tokens + n))
        outputs: list[WorkerOutput] = []
        for worker in self.workers:
            out = worker.execute(metadata, compute, finished_prev)
            if out is not None:
                outputs.append(out)

        output: ConnectorOutput | None = None
        invalidated: set[str] = set()
        if self.aggregator is not None and self.scheduler_connector is not None:
            output = self.aggregator.aggregate(outputs)
            if self.config.record_hooks:
                self.output_log.append(output)
            self._add_worker_stats(output)
            invalidated = self._handle_sync_load_errors(items, output)
            self._record("scheduler", None, "update_connector_output", None)
            self.scheduler_connector.update_connector_output(output)
            self._handle_finished_transfers(output)
            connector_events.extend(output.events)

        finished: list[str] = []
        num_tokens = 0
        for req, n, _ in items:
            if req.request_id in invalidated or req.state.finished:
                continue
            if req.sync_load is not None:
                self._verify_load(req, *req.sync_load)
                req.sync_load = None
            req.num_computed_tokens += n
            num_tokens += n
            self._cache_full_blocks(req)
            if req.num_computed_tokens == req.num_tokens:
                req.token_ids.append(next_token(req.update_seeds()))
                req.update_hashes(self.spec, self.dcp_size)
                if len(req.output) >= req.spec.max_tokens:
                    self.running.remove(req)
                    self._finish(req, RequestState.FINISHED_LENGTH)
                    finished.append(req.request_id)
        self._stats["tokens_computed"] += num_tokens
        self._check_remote_timeouts()
        if self.scheduler_connector is not None:
            self._record("scheduler", None, "take_events", None)
            connector_events.extend(self.scheduler_connector.take_events())
        self._publish(self._take_pool_events() + connector_events)
        return StepReport(self.step_id, len(items), num_tokens, frozenset(preempted),
                          tuple(finished), output)

    # ------------------------------------------------------------------ scheduling

    def _allocate_for(self, req: EngineRequest, total_tokens: int) -> bool:
        """Grow every region's block list to cover ``total_tokens``; all or nothing."""
        needs = [blocks_needed(total_tokens, t) - len(req.block_ids[r])
                 for r, t in enumerate(self.tokens_per_block)]
        if any(need > self.pools[r].num_free for r, need in enumerate(needs)):
            return False
        for r, need in enumerate(needs):
            if need > 0:
                req.block_ids[r].extend(self.pools[r].allocate(need))
        return True

    def _schedule_running(self, items: list[tuple[EngineRequest, int, bool]],
                          preempted: set[str]) -> None:
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                index += 1
                continue
            while not self._allocate_for(req, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is req:
                    break
            if req.request_id in preempted:
                break
            items.append((req, n, False))
            budget -= n
            index += 1

    def _preempt(self, req: EngineRequest) -> None:
        self._stats["preemptions"] += 1
        for r, ids in enumerate(req.block_ids):
            self.pools[r].free(ids)
        req.block_ids = [[] for _ in range(self.num_regions)]
        req.num_computed_tokens = 0
        req.state = RequestState.PREEMPTED
        req.waiting_since = time.monotonic()
        self.waiting.appendleft(req)

    def _local_hit(self, req: EngineRequest) -> tuple[int, list[list[int]]]:
        if not self.config.enable_prefix_caching:
            return 0, [[] for _ in range(self.num_regions)]
        found = [self.pools[r].find_prefix(req.hashes[r]) for r in range(self.num_regions)]
        tokens = common_hit_tokens([len(f) for f in found], self.tokens_per_block)
        # at least one token must be computed to produce the next token
        while tokens >= req.num_tokens and tokens > 0:
            tokens = common_hit_tokens([tokens // t - 1 for t in self.tokens_per_block],
                                       self.tokens_per_block)
        blocks = [f[:tokens // t] for f, t in zip(found, self.tokens_per_block, strict=True)]
        return tokens, blocks

    def _schedule_waiting(self, items: list[tuple[EngineRequest, int, bool]]) -> None:
        budget = self.config.max_num_batched_tokens - sum(n for _, n, _ in items)
        skipped: deque[EngineRequest] = deque()
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            from_remote = False
            if req.state is RequestState.WAITING_FOR_REMOTE_KVS:
                if req.request_id not in self._recv_done:
                    skipped.append(req)
                    continue
                if not self._finish_remote_load(req):
                    continue  # failed with the FAIL policy: finished
                from_remote = True
            if req.num_computed_tokens == 0 and not any(req.block_ids):
                local, hit_blocks = self._local_hit(req)
            else:
                local, hit_blocks = req.num_computed_tokens, None
            ext, load_async = 0, False
            connector = self.scheduler_connector
            if connector is not None and not from_remote and not req.connector_done:
                self._record("scheduler", None, "get_num_new_matched_tokens", req.request_id)
                matched, load_async = connector.get_num_new_matched_tokens(req.view(local), local)
                if matched is None:
                    self._stats["lookups_deferred"] += 1
                    if req.state is not RequestState.WAITING_FOR_LOOKUP:
                        req.waiting_since = time.monotonic()
                    req.state = RequestState.WAITING_FOR_LOOKUP
                    skipped.append(req)
                    continue
                if matched < 0 or local + matched > req.num_tokens:
                    raise ContractError("get_num_new_matched_tokens",
                                        f"request {req.request_id}: {matched} new tokens after "
                                        f"{local} computed of {req.num_tokens}")
                ext = matched
            if hit_blocks is not None:
                for r, ids in enumerate(hit_blocks):
                    self.pools[r].touch(ids)
                    req.block_ids[r] = list(ids)
            if load_async and ext > 0:
                if not self._allocate_for(req, local + ext):
                    self._undo_hit(req, hit_blocks)
                    self.waiting.appendleft(req)
                    break
                if hit_blocks is not None:
                    req.num_local_hit_tokens = local
                    self._stats["local_hit_tokens"] += local
                req.num_computed_tokens = local
                req.pending_external_tokens = ext
                self._record("scheduler", None, "update_state_after_alloc", req.request_id)
                assert connector is not None
                connector.update_state_after_alloc(req.view(local), req.frozen_block_ids(), ext)
                self.loads_started.add(req.request_id)
                req.state = RequestState.WAITING_FOR_REMOTE_KVS
                req.waiting_since = time.monotonic()
                skipped.append(req)
                continue
            if local + ext >= req.num_tokens:
                ext = max(0, req.num_tokens - 1 - local)  # recompute the last token
            n = min(req.num_tokens - local - ext, budget)
            if not self._allocate_for(req, local + ext + n):
                self._undo_hit(req, hit_blocks)
                self.waiting.appendleft(req)
                break
            if hit_blocks is not None:
                req.num_local_hit_tokens = local
                self._stats["local_hit_tokens"] += local
            if connector is not None and not from_remote and not req.connector_done:
                self._record("scheduler", None, "update_state_after_alloc", req.request_id)
                connector.update_state_after_alloc(req.view(local), req.frozen_block_ids(), ext)
            if ext:
                self.loads_started.add(req.request_id)
                req.sync_load = (local, local + ext)
                req.num_external_tokens += ext
                self._stats["external_tokens"] += ext
            is_new = req.state in (RequestState.WAITING, RequestState.PREEMPTED,
                                   RequestState.WAITING_FOR_LOOKUP) or from_remote
            req.num_computed_tokens = local + ext
            req.state = RequestState.RUNNING
            self.running.append(req)
            items.append((req, n, is_new))
            budget -= n
        # requests that could not start keep their place ahead of later arrivals
        self.waiting.extendleft(reversed(skipped))

    def _undo_hit(self, req: EngineRequest, hit_blocks: list[list[int]] | None) -> None:
        if hit_blocks is None:
            return
        for r in range(self.num_regions):
            self.pools[r].free(req.block_ids[r])
            req.block_ids[r] = []

    # ------------------------------------------------------------------ loads

    def _first_invalid_token(self, req: EngineRequest, start: int, end: int,
                             refs: set[tuple[int, int]]) -> int | None:
        """First token in ``[start, end)`` held by a block in ``refs`` (None: all valid)."""
        first: int | None = None
        for r, t in enumerate(self.tokens_per_block):
            ids = req.block_ids[r]
            for index in range(start // t, min(len(ids), -(-end // t))):
                if (r, ids[index]) in refs:
                    token = max(start, index * t)
                    first = token if first is None else min(first, token)
                    break
        return first

    def _handle_sync_load_errors(self, items: list[tuple[EngineRequest, int, bool]],
                                 output: ConnectorOutput) -> set[str]:
        refs = set(output.invalid_block_ids)
        self._invalid_refs |= refs
        invalidated: set[str] = set()
        claimed: set[tuple[int, int]] = set()
        for req, _n, _ in items:
            if req.sync_load is None:
                continue
            start, end = req.sync_load
            own = {(r, b) for r, ids in enumerate(req.block_ids) for b in ids}
            claimed |= own & refs
            first = self._first_invalid_token(req, start, end, refs)
            if first is None:
                continue
            invalidated.add(req.request_id)
            self._stats["failed_loads"] += 1
            lost = end - first
            req.num_recomputed_tokens += lost
            req.num_external_tokens -= lost
            self._stats["recomputed_tokens"] += lost
            self._stats["external_tokens"] -= lost
            logger.warning("engine %s: request %s: load of tokens [%d, %d) failed from token %d; "
                           "recomputing", self.engine_id, req.request_id, start, end, first)
            self._verify_load(req, start, first)
            req.sync_load = None
            req.num_computed_tokens = first  # tokens computed this step are discarded too
            if self.config.connector is not None and \
                    self.config.connector.load_failure_policy is LoadFailurePolicy.FAIL:
                self.running.remove(req)
                req.error = f"load of tokens [{first}, {end}) failed"
                self._finish(req, RequestState.FINISHED_ERROR)
        if not refs:
            return invalidated
        waiting_blocks = {(r, b) for req in self.requests.values()
                          if req.state is RequestState.WAITING_FOR_REMOTE_KVS
                          for r, ids in enumerate(req.block_ids) for b in ids}
        waiting_blocks |= {(r, b) for req in self._free_on_recv.values()
                           for r, ids in enumerate(req.block_ids) for b in ids}
        stray = refs - claimed - waiting_blocks
        self._stats["stray_invalid_blocks"] += len(stray)
        # refs of sync loads are consumed now; async ones wait for finished_recving
        self._invalid_refs -= claimed | stray
        return invalidated

    def _finish_remote_load(self, req: EngineRequest) -> bool:
        """Turn a finished async receive into computed tokens. False if the request ended."""
        failed = self._recv_done.pop(req.request_id)
        start = req.num_computed_tokens
        end = start + req.pending_external_tokens
        own = {(r, b) for r, ids in enumerate(req.block_ids) for b in ids}
        refs = self._invalid_refs & own
        self._invalid_refs -= refs
        first = self._first_invalid_token(req, start, end, refs)
        if failed and first is None:
            first = start  # failed without naming blocks: trust none of them
        valid_end = end if first is None else first
        req.pending_external_tokens = 0
        if first is not None:
            self._stats["failed_loads"] += 1
            lost = end - first
            req.num_recomputed_tokens += lost
            self._stats["recomputed_tokens"] += lost
            logger.warning("engine %s: request %s: async load of tokens [%d, %d) failed from "
                           "token %d; recomputing", self.engine_id, req.request_id, start, end,
                           first)
            if self.config.connector is not None and \
                    self.config.connector.load_failure_policy is LoadFailurePolicy.FAIL:
                req.error = f"load of tokens [{first}, {end}) failed"
                req.state = RequestState.WAITING  # the receive is over
                self._finish(req, RequestState.FINISHED_ERROR)
                return False
        self._verify_load(req, start, valid_end)
        req.num_external_tokens += valid_end - start
        self._stats["external_tokens"] += valid_end - start
        req.num_computed_tokens = min(valid_end, req.num_tokens - 1)
        self._cache_full_blocks(req)
        req.state = RequestState.WAITING
        return True

    def _verify_load(self, req: EngineRequest, start: int, end: int) -> None:
        if not self.config.verify_loads or end <= start:
            return
        for worker in self.workers:
            verified, mismatched = worker.verify(req.block_ids, req.token_ids, start, end)
            req.verified_bytes += verified
            req.mismatched_bytes += mismatched
            self._stats["verified_bytes"] += verified
            self._stats["mismatched_bytes"] += mismatched
        if req.mismatched_bytes:
            logger.error("engine %s: request %s: %d mismatched bytes in loaded tokens [%d, %d)",
                         self.engine_id, req.request_id, req.mismatched_bytes, start, end)

    def _cache_full_blocks(self, req: EngineRequest) -> None:
        if not self.config.enable_prefix_caching:
            return
        # what besides the tokens went into each block's hash (see update_hashes)
        extra: tuple[object, ...] | None = (req.spec.cache_salt,) if req.spec.cache_salt \
            else None
        for r, t in enumerate(self.tokens_per_block):
            full = min(req.num_computed_tokens // t, len(req.hashes[r]), len(req.block_ids[r]))
            self.pools[r].cache_full_blocks(req.block_ids[r], req.hashes[r], req.token_ids,
                                            full, extra)

    def _take_pool_events(self) -> list[KVEvent]:
        return [event for pool in self.pools for event in pool.take_events()]

    def _publish(self, events: list[KVEvent]) -> None:
        """One batch to the sink (and ``self.events`` when kept); nothing when empty."""
        if not events:
            return
        if self.event_sink is not None:
            self.event_sink.publish(events)
        if self.keep_events:
            self.events.extend(events)

    def _handle_finished_transfers(self, output: ConnectorOutput) -> None:
        for request_id in output.finished_recving:
            req = self.requests.get(request_id)
            if request_id in self._free_on_recv:
                held = self._free_on_recv.pop(request_id)
                self._release(held)
            elif request_id in self._ignore_recv:
                self._ignore_recv.discard(request_id)
            elif req is not None and req.state is RequestState.WAITING_FOR_REMOTE_KVS:
                self._recv_done[request_id] = request_id in output.failed_recving
            else:
                self._stats["stray_finished_recving"] += 1
                logger.warning("engine %s: finished_recving for %s, which is not receiving",
                               self.engine_id, request_id)
        for request_id in output.finished_sending:
            held_entry = self._delayed.pop(request_id, None)
            if held_entry is not None:
                self._release(held_entry[0])
            else:
                self._stats["stray_finished_sending"] += 1
                logger.warning("engine %s: finished_sending for %s, whose free was not delayed",
                               self.engine_id, request_id)

    def _check_remote_timeouts(self) -> None:
        timeout = self.config.remote_kv_timeout_s
        now = time.monotonic()
        for req in list(self.waiting):
            if (req.state is RequestState.WAITING_FOR_REMOTE_KVS
                    and req.request_id not in self._recv_done
                    and now - req.waiting_since > timeout):
                self._stats["remote_kv_timeouts"] += 1
                logger.error("engine %s: request %s waited %.1f s for remote KV; the connector "
                             "never reported it: recomputing, quarantining its blocks",
                             self.engine_id, req.request_id, now - req.waiting_since)
                local = req.num_computed_tokens
                for r, t in enumerate(self.tokens_per_block):
                    keep = local // t
                    self._quarantine(r, req.block_ids[r][keep:])
                    req.block_ids[r] = req.block_ids[r][:keep]
                req.num_recomputed_tokens += req.pending_external_tokens
                req.pending_external_tokens = 0
                req.state = RequestState.WAITING
                req.connector_done = True
                self._ignore_recv.add(req.request_id)
                req.sync_load = None
            elif (req.state is RequestState.WAITING_FOR_LOOKUP
                    and now - req.waiting_since > timeout):
                self._stats["lookup_timeouts"] += 1
                logger.error("engine %s: request %s: the connector answered 'ask again' for "
                             "%.1f s; treating it as a miss", self.engine_id, req.request_id,
                             now - req.waiting_since)
                req.connector_done = True
                req.state = RequestState.WAITING
        for request_id, req in list(self._free_on_recv.items()):
            if now - req.waiting_since > timeout:
                # aborted while receiving and the receive never ended: never reuse its blocks
                self._stats["remote_kv_timeouts"] += 1
                logger.error("engine %s: aborted request %s: its receive never finished; "
                             "quarantining its blocks", self.engine_id, request_id)
                del self._free_on_recv[request_id]
                self._ignore_recv.add(request_id)
                for r, ids in enumerate(req.block_ids):
                    self._quarantine(r, ids)
                req.block_ids = [[] for _ in range(self.num_regions)]
                self.requests.pop(request_id, None)

    def _quarantine(self, region: int, block_ids: list[int]) -> None:
        """Keep blocks referenced forever: a late transfer may still write them."""
        self._quarantined.extend((region, b) for b in block_ids)

    # ------------------------------------------------------------------ finishing

    def _finish(self, req: EngineRequest, state: RequestState) -> None:
        receiving = (req.state is RequestState.WAITING_FOR_REMOTE_KVS
                     and req.request_id not in self._recv_done)
        self._recv_done.pop(req.request_id, None)
        req.state = state
        self._stats["aborted" if state is RequestState.FINISHED_ABORTED else "finished"] += 1
        delay = False
        if self.scheduler_connector is not None:
            self._record("scheduler", None, "request_finished", req.request_id)
            delay, params = self.scheduler_connector.request_finished(
                req.view(), req.frozen_block_ids())
            req.transfer_params_out = params
        self._finished_since_last_step.add(req.request_id)
        if receiving:
            self._free_on_recv[req.request_id] = req  # a transfer may still write them
        elif delay:
            self._delayed[req.request_id] = (req, time.monotonic())
        else:
            self._release(req)
        self.results.append(req.result())

    def _release(self, req: EngineRequest) -> None:
        for r, ids in enumerate(req.block_ids):
            self.pools[r].free(ids)
            self._invalid_refs -= {(r, b) for b in ids}
        req.block_ids = [[] for _ in range(self.num_regions)]
        self.requests.pop(req.request_id, None)

    # ------------------------------------------------------------------ inspection

    def _add_worker_stats(self, output: ConnectorOutput) -> None:
        # cumulative snapshots: the latest one is the total
        self._worker_stats = output.merged_stats()

    def stats(self) -> dict[str, object]:
        out: dict[str, object] = dict(self._stats)
        out["delayed_frees_pending"] = len(self._delayed)
        now = time.monotonic()
        out["delayed_frees_overdue"] = sum(
            1 for _, since in self._delayed.values()
            if now - since > self.config.remote_kv_timeout_s)
        out["receives_pending_after_abort"] = len(self._free_on_recv)
        out["quarantined_blocks"] = len(self._quarantined)
        out["blocks_used"] = [pool.num_used for pool in self.pools]
        out["worker_stats"] = dict(self._worker_stats)
        if self.scheduler_connector is not None:
            out["connector_stats"] = self.scheduler_connector.get_stats()
        return out

    def idle_problems(self) -> list[str]:
        """Why this engine is not cleanly idle (empty list when it is).

        Idle means: no request waiting or running, no delayed free or pending
        receive, every block's reference count 0, the aggregator holds no
        half-reported request, and no engine-side timeout ever fired.
        """
        problems = []
        if self.waiting or self.running:
            problems.append(f"{len(self.waiting)} waiting, {len(self.running)} running requests")
        if self._delayed:
            problems.append(f"delayed frees not released: {sorted(self._delayed)[:5]}")
        if self._free_on_recv:
            problems.append(f"aborted receives not finished: {sorted(self._free_on_recv)[:5]}")
        for r, pool in enumerate(self.pools):
            pool.check()
            expected_used = sum(1 for q in self._quarantined if q[0] == r)
            if pool.num_used != expected_used:
                problems.append(f"region {r}: {pool.num_used} blocks still referenced")
        if self.aggregator is not None:
            pending = self.aggregator.pending()
            if pending["sending"] or pending["recving"]:
                problems.append(f"half-reported transfers: {pending}")
        if self._stats["remote_kv_timeouts"]:
            problems.append(f"{self._stats['remote_kv_timeouts']} engine-side remote KV timeouts")
        if self._stats["lookup_timeouts"]:
            problems.append(f"{self._stats['lookup_timeouts']} engine-side lookup timeouts")
        return problems

    def verify_request_blocks(self, request_id: str, start: int, end: int) -> tuple[int, int]:
        """Verify tokens ``[start, end)`` of a live request on every rank."""
        req = self.requests[request_id]
        verified = mismatched = 0
        for worker in self.workers:
            v, m = worker.verify(req.block_ids, req.token_ids, start, end)
            verified += v
            mismatched += m
        return verified, mismatched

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request references; returns how many.

        Events (published at once, as their own batch): ``AllBlocksCleared``
        when no cached block is left in any pool (vLLM's successful reset),
        else a ``BlockRemoved`` per pool for the hashes forgotten.
        """
        clears_all = all(pool.num_cached == len(pool.unreferenced_cached())
                         for pool in self.pools)
        count = sum(len(pool.drop_unreferenced(emit=not clears_all)) for pool in self.pools)
        events = self._take_pool_events()
        if clears_all and self.config.enable_kv_cache_events:
            events.append(AllBlocksCleared())
        self._publish(events)
        return count

    def endpoint(self) -> tuple[str, int] | None:
        if self.scheduler_connector is None:
            return None
        return self.scheduler_connector.endpoint()

    def shutdown(self) -> None:
        """Shut every connector half down (workers first). Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        for worker in self.workers:
            worker.shutdown()
        if self.scheduler_connector is not None:
            self._record("scheduler", None, "shutdown", None)
            try:
                self.scheduler_connector.shutdown()
            except Exception:
                logger.exception("engine %s: scheduler connector shutdown failed", self.engine_id)
        if self.publisher is not None:
            self.publisher.close(timeout_s=self._close_timeout_s)  # logs what it abandons

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def engines_idle_problems(engines: Iterable[Engine]) -> list[str]:
    return [f"{engine.engine_id}: {p}" for engine in engines for p in engine.idle_problems()]
