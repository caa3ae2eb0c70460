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

Where each part lives (one idea per file; this module builds the engine and runs
the step loop, and re-exports the names others import from here):

* :mod:`kvbridge.engine.config` -- :class:`EngineConfig`;
* :mod:`kvbridge.engine.host_memory` -- the KV cache's size and whether this host
  can hold it (checked before anything is allocated);
* :mod:`kvbridge.engine.records` -- :class:`StepReport`, :class:`HookCall`;
* :mod:`kvbridge.engine.state` -- the bookkeeping the phases share, and how a
  request ends (free now, delay the free, hold while receiving);
* :mod:`kvbridge.engine.scheduling` -- phase 1;
* :mod:`kvbridge.engine.loads` -- what phases 4 and 5 do with the aggregated
  output (load errors -> recompute, finished transfers) and the engine-side
  timeouts;
* here -- construction (connector halves, handshake metadata, the aggregator),
  the client API, phases 2, 3, the aggregation of 4, 6 and 7 (metadata, workers,
  advance, events), inspection and shutdown. May not touch what the modules
  above own.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import torch

from kvbridge.connectors import (
    ConfigError,
    ConnectorContext,
    ConnectorMetadata,
    ConnectorOutput,
    ContractError,
    EventBuffer,
    KVRole,
    OutputAggregator,
    RoleError,
    ScheduledRequest,
    SchedulerStep,
    WorkerConnector,
    WorkerOutput,
    registry,
)
from kvbridge.engine.block_pool import BlockPool
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.content import next_token
from kvbridge.engine.control import ControlLimits
from kvbridge.engine.devices import rank_device
from kvbridge.engine.host_memory import (
    BLOCK_OVERHEAD_BYTES,
    HOST_MEMORY_FRACTION,
    available_memory_bytes,
    cgroup_memory_room,
    check_host_memory,
    kv_cache_bytes,
)
from kvbridge.engine.kv_events import EngineEventsConfig, active_publishing
from kvbridge.engine.records import HookCall, StepReport
from kvbridge.engine.request import EngineRequest, RequestResult, RequestSpec, RequestState
from kvbridge.engine.scheduling import Scheduling
from kvbridge.engine.worker import ComputeItem, Worker
from kvbridge.events import AllBlocksCleared, EventSink, KVEvent, KVEventPublisher

__all__ = [  # the engine, and what other modules import from here since before the split
    "BLOCK_OVERHEAD_BYTES",
    "HOST_MEMORY_FRACTION",
    "Engine",
    "EngineConfig",
    "HookCall",
    "StepReport",
    "available_memory_bytes",
    "cgroup_memory_room",
    "check_host_memory",
    "engines_idle_problems",
    "kv_cache_bytes",
]

logger = logging.getLogger(__name__)


class Engine(Scheduling):
    """A paged-KV engine with all its ranks in this process. Not thread-safe.

    Its phases are its bases, one module each (see the module docstring):
    :class:`~kvbridge.engine.scheduling.Scheduling` ->
    :class:`~kvbridge.engine.loads.LoadHandling` ->
    :class:`~kvbridge.engine.state.EngineState`.
    """

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
        self.hook_log = []
        #: each step's aggregated connector output (kept when ``record_hooks``)
        self.output_log: list[ConnectorOutput] = []
        #: called as ``hook(engine, step)`` after ``build_connector_meta``, before the
        #: workers run (fault injection and tests)
        self.step_hooks: list[Callable[[Engine, SchedulerStep], None]] = []
        self.loads_started = set()
        self.step_id = 0
        self.requests = {}
        self.waiting = deque()
        self.running = []
        self.results = []
        self.events: list[KVEvent] = []
        self._finished_since_last_step = set()
        self._delayed = {}  # delayed frees
        self._free_on_recv = {}  # aborted while receiving
        self._recv_done = {}  # request id -> failed
        self._ignore_recv = set()
        self._invalid_refs = set()
        self._quarantined = []
        self._stats = {
            "steps": 0, "preemptions": 0, "tokens_computed": 0, "local_hit_tokens": 0,
            "external_tokens": 0, "recomputed_tokens": 0, "failed_loads": 0,
            "remote_kv_timeouts": 0, "lookup_timeouts": 0, "lookups_deferred": 0,
            "stray_finished_sending": 0,
            "stray_finished_recving": 0, "stray_invalid_blocks": 0, "verified_bytes": 0,
            "mismatched_bytes": 0, "aborted": 0, "finished": 0,
        }
        self._worker_stats: dict[str, int | float] = {}
        self.scheduler_connector = None
        self.workers = []
        self.aggregator: OutputAggregator | None = None
        self._shut_down = False
        ranks = list(self.sizes.ranks())
        if config.connector is None:
            self.workers = [Worker(self.spec, self.sizes, rank, index, num_blocks, None,
                                   **self._placement(index))
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
                                           worker_connector, self._record,
                                           **self._placement(index)))
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

    def _placement(self, worker_index: int) -> dict[str, Any]:
        """Where rank ``worker_index``'s KV lives (``device`` setting) and whether it is
        guarded against host reads."""
        return {"device": rank_device(self.config.device, worker_index),
                "host_guard": self.config.kv_host_guard}

    # ------------------------------------------------------------------ client API

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

    # ------------------------------------------------------------------ events

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
