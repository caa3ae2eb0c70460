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

Where each piece of state lives (one owner each; this module builds the parts,
routes between them and runs the step loop in order, and re-exports the names
others import from here):

* :mod:`kvbridge.engine.config` -- :class:`EngineConfig`;
* :mod:`kvbridge.engine.host_memory` -- the KV cache's size and whether this host
  can hold it (checked before anything is allocated);
* :mod:`kvbridge.engine.records` -- :class:`StepReport`, :class:`HookCall`;
* :mod:`kvbridge.engine.blocks` -- :class:`~kvbridge.engine.blocks.BlockSpace`:
  the block pools, quarantined blocks, blocks reported invalid;
* :mod:`kvbridge.engine.lifecycle` -- :class:`~kvbridge.engine.lifecycle.Lifecycle`:
  the live requests by id, how a request ends (free now, delay the free, hold
  while receiving), results not yet taken, the requests finished since the last
  step;
* :mod:`kvbridge.engine.scheduling` -- :class:`~kvbridge.engine.scheduling.Scheduler`:
  phase 1, the waiting and running queues;
* :mod:`kvbridge.engine.loads` -- :class:`~kvbridge.engine.loads.Loads`: what
  phases 4 and 5 do with the aggregated output (load errors -> recompute,
  finished transfers), the loads started this step, finished receives, the
  engine-side timeouts;
* :mod:`kvbridge.engine.checks` -- :class:`~kvbridge.engine.checks.ContentChecks`:
  verification of loaded KV against the reference content;
* :mod:`kvbridge.engine.hook_log` -- :class:`~kvbridge.engine.hook_log.HookLog`:
  ``hook_log`` and ``output_log``;
* :mod:`kvbridge.engine.outlet` -- :class:`~kvbridge.engine.outlet.EventOutlet`:
  the event sink, the engine's own publisher, the kept ``events``;
* here -- :class:`Engine`, the facade: construction (connector halves, handshake
  metadata, the aggregator, the parts), the client API, the step loop (phases 2,
  3, the aggregation of 4, 6 and 7), inspection and shutdown. It owns the
  identity (config, spec, topology, engine id, role), the ranks and connector
  halves, ``step_id``, ``step_hooks`` and the ``steps`` / ``tokens_computed``
  counters; the other state attributes it shows (``requests``, ``waiting``,
  ``pools``, ...) are read-only views of the parts'. A part changes only its own
  attributes (``tests/engine/test_state_owners.py`` checks it).
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
from kvbridge.engine.blocks import BlockSpace
from kvbridge.engine.checks import ContentChecks
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.content import next_token
from kvbridge.engine.control import ControlLimits
from kvbridge.engine.devices import rank_device
from kvbridge.engine.hook_log import HookLog
from kvbridge.engine.host_memory import (
    BLOCK_OVERHEAD_BYTES,
    HOST_MEMORY_FRACTION,
    available_memory_bytes,
    cgroup_memory_room,
    check_host_memory,
    kv_cache_bytes,
)
from kvbridge.engine.kv_events import EngineEventsConfig, active_publishing
from kvbridge.engine.lifecycle import Lifecycle
from kvbridge.engine.loads import Loads
from kvbridge.engine.outlet import EventOutlet
from kvbridge.engine.records import HookCall, StepReport
from kvbridge.engine.request import EngineRequest, RequestResult, RequestSpec, RequestState
from kvbridge.engine.scheduling import Scheduler
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


#: the order of the engine's counters in :meth:`Engine.stats` (each part owns some)
_COUNTER_ORDER = (
    "steps", "preemptions", "tokens_computed", "local_hit_tokens", "external_tokens",
    "recomputed_tokens", "failed_loads", "remote_kv_timeouts", "lookup_timeouts",
    "lookups_deferred", "stray_finished_sending", "stray_finished_recving",
    "stray_invalid_blocks", "verified_bytes", "mismatched_bytes", "aborted", "finished",
)


class Engine:
    """A paged-KV engine with all its ranks in this process. Not thread-safe.

    A facade over parts that each own their state (see the module docstring):
    :class:`~kvbridge.engine.blocks.BlockSpace`,
    :class:`~kvbridge.engine.lifecycle.Lifecycle`,
    :class:`~kvbridge.engine.scheduling.Scheduler`,
    :class:`~kvbridge.engine.loads.Loads`,
    :class:`~kvbridge.engine.checks.ContentChecks`,
    :class:`~kvbridge.engine.hook_log.HookLog` and
    :class:`~kvbridge.engine.outlet.EventOutlet`. It routes the client calls and the
    connector's outputs to them and runs their phases in step order.
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
        keep = (event_sink is None and events is None if keep_events is None
                else keep_events)
        publishing = active_publishing() if event_sink is None and events is None else None
        if publishing is not None:
            events = publishing.assign()
        publisher: KVEventPublisher | None = None
        if events is not None:
            if event_sink is not None:
                raise ConfigError("events", "give either an event sink or an events config")
            config = replace(config, enable_kv_cache_events=True)
            publisher = events.make_publisher()
            event_sink = publisher
        self._outlet = EventOutlet(
            event_sink, publisher, keep=keep,
            close_timeout_s=events.close_timeout_s if events is not None else 0.0)
        try:
            self._start(config)
        except BaseException:
            self._outlet.abandon()
            raise
        if publishing is not None and publisher is not None:
            name = {KVRole.PRODUCER: "producer", KVRole.CONSUMER: "consumer"}.get(
                self.role, "engine") if self.role is not None else "engine"
            publishing.record(name, self.engine_id, publisher.endpoint,
                              publisher.replay_endpoint)

    def _start(self, config: EngineConfig) -> None:
        self._config = config
        self.spec = config.spec
        self.sizes = config.topology.sizes()
        self.dcp_size = self.sizes.dcp_size
        self.num_regions = len(self.spec.regions)
        tokens_per_block = tuple(r.tokens_per_key(self.dcp_size) for r in self.spec.regions)
        check_host_memory(config)  # before any pool or tensor exists
        self.engine_id = (config.connector.engine_id if config.connector is not None
                          else config.engine_id or uuid.uuid4().hex[:16])
        self.role: KVRole | None = config.connector.role if config.connector else None
        self.step_id = 0
        self._counts = {"steps": 0, "tokens_computed": 0}
        self._worker_stats: dict[str, int | float] = {}
        #: called as ``hook(engine, step)`` after ``build_connector_meta``, before the
        #: workers run (fault injection and tests)
        self.step_hooks: list[Callable[[Engine, SchedulerStep], None]] = []
        self._shut_down = False
        self._hooks = HookLog(config.record_hooks)
        self._blocks = BlockSpace(config.num_blocks, tokens_per_block,
                                  prefix_caching=config.enable_prefix_caching,
                                  emit_events=config.enable_kv_cache_events,
                                  sorted_allocation=config.sorted_allocation)
        self.scheduler_connector: SchedulerConnector | None = None
        #: one per rank, in ``topology.ranks()`` order (index = worker index)
        self.workers: list[Worker] = []
        self.aggregator: OutputAggregator | None = None
        self._start_ranks(config, tuple(config.num_blocks for _ in self.spec.regions))
        self._book = Lifecycle(self._blocks, self.scheduler_connector, self._record)
        self._checks = ContentChecks(self.workers, verify_loads=config.verify_loads,
                                     engine_id=self.engine_id)
        self._loads = Loads(self._blocks, self._book, self._checks, self._end,
                            fail_on_error=(config.connector is not None
                                           and config.connector.load_failure_policy
                                           is LoadFailurePolicy.FAIL),
                            timeout_s=config.remote_kv_timeout_s, engine_id=self.engine_id)
        self._scheduler = Scheduler(self._blocks, self._loads, self.scheduler_connector,
                                    self._record,
                                    max_num_batched_tokens=config.max_num_batched_tokens,
                                    max_num_seqs=config.max_num_seqs)

    def _start_ranks(self, config: EngineConfig, num_blocks: tuple[int, ...]) -> None:
        """The workers (each rank's KV tensors) and, with a connector, both its halves,
        the handshake metadata and the output aggregator."""
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
        return {"device": rank_device(self._config.device, worker_index),
                "host_guard": self._config.kv_host_guard}

    def _record(self, side: str, worker: int | None, hook: str, request_id: str | None) -> None:
        """The hook recorder every part calls: stamps the current step."""
        self._hooks.record(self.step_id, side, worker, hook, request_id)

    def _end(self, req: EngineRequest, state: RequestState) -> None:
        """The one way a request ends: out of its queue, its finished receive dropped,
        then :meth:`Lifecycle.finish` (blocks held while a receive may still write them)."""
        self._scheduler.remove(req)
        had_finished_receive = self._loads.forget_receive(req.request_id)
        receiving = req.state is RequestState.WAITING_FOR_REMOTE_KVS and not had_finished_receive
        self._book.finish(req, state, receiving=receiving)

    # ------------------------------------------------------------------ views of the parts

    @property
    def config(self) -> EngineConfig:
        """The settings this engine runs with (:meth:`set_verify_loads` changes one)."""
        return self._config

    @property
    def pools(self) -> list[BlockPool]:
        """One block pool per region (owned by :class:`BlockSpace`)."""
        return self._blocks.pools

    @property
    def tokens_per_block(self) -> tuple[int, ...]:
        """Tokens one block of region r covers (``block_size * dcp_size`` if token-sharded)."""
        return self._blocks.tokens_per_block

    @property
    def requests(self) -> dict[str, EngineRequest]:
        """Every live request (not yet released) by id (owned by :class:`Lifecycle`)."""
        return self._book.requests

    @property
    def results(self) -> list[RequestResult]:
        """Results of finished requests not yet taken (:meth:`pop_results`)."""
        return self._book.results

    @property
    def waiting(self) -> deque[EngineRequest]:
        """FIFO: waiting, preempted (at the front), waiting for a lookup or for remote KV."""
        return self._scheduler.waiting

    @property
    def running(self) -> list[EngineRequest]:
        return self._scheduler.running

    @property
    def loads_started(self) -> set[str]:
        """Requests whose connector load (``num_external_tokens > 0``) starts this step."""
        return self._loads.started

    @property
    def hook_log(self) -> list[HookCall]:
        """Every connector hook call (kept when ``record_hooks``)."""
        return self._hooks.calls

    @hook_log.setter
    def hook_log(self, calls: list[HookCall]) -> None:
        self._hooks.replace_calls(calls)

    @property
    def output_log(self) -> list[ConnectorOutput]:
        """Each step's aggregated connector output (kept when ``record_hooks``)."""
        return self._hooks.outputs

    @property
    def events(self) -> list[KVEvent]:
        """The KV events published so far, when kept (``keep_events``)."""
        return self._outlet.events

    @property
    def keep_events(self) -> bool:
        return self._outlet.keep

    @property
    def event_sink(self) -> EventSink | None:
        return self._outlet.sink

    @property
    def publisher(self) -> KVEventPublisher | None:
        """The publisher this engine bound itself (``events=``), closed by :meth:`shutdown`."""
        return self._outlet.publisher

    # ------------------------------------------------------------------ client API

    @property
    def max_request_tokens(self) -> int:
        """Tokens of KV one request can ever hold: what the smallest region's pool holds.

        A request needing more (``len(prompt) + max_tokens - 1``) could never be
        scheduled, and FIFO scheduling would then starve every request behind it."""
        return self._blocks.max_request_tokens

    def control_limits(self) -> ControlLimits:
        """What one control message to this engine may carry (``kvbridge.engine.control``)."""
        return ControlLimits.for_pools(self._config.num_blocks, self.tokens_per_block)

    def set_verify_loads(self, enabled: bool) -> None:
        """Verify loaded KV against the reference content from now on (or stop)."""
        self._config = replace(self._config, verify_loads=enabled)
        self._checks.set_verify_loads(enabled)

    def check_request(self, spec: RequestSpec) -> None:
        """Raise (naming the field) if :meth:`add_request` would refuse ``spec``; no effect."""
        if self._shut_down:
            raise ContractError("engine", "add_request after shutdown")
        if spec.request_id in self._book.requests:
            raise ConfigError("request_id", f"duplicate request id {spec.request_id!r}")
        needed = len(spec.prompt) + spec.max_tokens - 1
        if needed > self.max_request_tokens:
            raise ConfigError("prompt" if len(spec.prompt) > self.max_request_tokens
                              else "max_tokens",
                              f"request {spec.request_id!r} needs the KV of {needed} tokens; "
                              f"this engine's block pool holds {self.max_request_tokens} "
                              f"(num_blocks {self._config.num_blocks}): it could never run")
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
        request.queue(time.monotonic())
        self._book.admit(request)
        self._scheduler.enqueue(request)

    def abort(self, request_id: str) -> bool:
        """Abort a request (between steps). False if it is unknown or already finished."""
        request = self._book.requests.get(request_id)
        if request is None or request.state.finished:
            return False
        self._end(request, RequestState.FINISHED_ABORTED)
        return True

    def has_unfinished_requests(self) -> bool:
        return self._scheduler.has_requests()

    def has_pending_transfers(self) -> bool:
        """Delayed frees or receives of aborted requests still outstanding."""
        return self._book.has_pending_transfers()

    def has_work(self) -> bool:
        return self.has_unfinished_requests() or self.has_pending_transfers()

    def pop_results(self) -> list[RequestResult]:
        return self._book.pop_results()

    def run_until_done(self, *, max_steps: int = 100_000, timeout_s: float = 120.0,
                       idle_sleep_s: float = 0.0005) -> list[RequestResult]:
        """Step until no request and no pending transfer is left (bounded)."""
        deadline = time.monotonic() + timeout_s
        steps = 0
        while self.has_work():
            if steps >= max_steps or time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.engine_id}: still busy after {steps} steps "
                                   f"({len(self.waiting)} waiting, {len(self.running)} running, "
                                   f"{self._book.num_delayed()} delayed frees)")
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
        self._counts["steps"] += 1
        self._loads.begin_step()
        items, preempted = self._scheduler.schedule()
        finished_prev = self._book.take_finished_ids()

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
            self._hooks.keep_output(output)
            # cumulative snapshots: the latest one is the total
            self._worker_stats = output.merged_stats()
            invalidated = self._loads.handle_sync_errors(items, output)
            self._record("scheduler", None, "update_connector_output", None)
            self.scheduler_connector.update_connector_output(output)
            self._loads.handle_finished_transfers(output)
            connector_events.extend(output.events)

        finished: list[str] = []
        num_tokens = 0
        for req, n, _ in items:
            if req.request_id in invalidated or req.state.finished:
                continue
            self._loads.settle_sync(req)
            req.advance(n)
            num_tokens += n
            self._blocks.cache_full_blocks(req)
            if req.num_computed_tokens == req.num_tokens:
                req.append_token(next_token(req.update_seeds()))
                req.update_hashes(self.spec, self.dcp_size)
                if len(req.output) >= req.spec.max_tokens:
                    self._end(req, RequestState.FINISHED_LENGTH)
                    finished.append(req.request_id)
        self._counts["tokens_computed"] += num_tokens
        self._loads.check_timeouts(list(self._scheduler.waiting), time.monotonic())
        if self.scheduler_connector is not None:
            self._record("scheduler", None, "take_events", None)
            connector_events.extend(self.scheduler_connector.take_events())
        self._outlet.publish(self._blocks.take_events() + connector_events)
        return StepReport(self.step_id, len(items), num_tokens, frozenset(preempted),
                          tuple(finished), output)

    # ------------------------------------------------------------------ inspection

    def stats(self) -> dict[str, object]:
        counts: dict[str, int] = {**self._counts, **self._scheduler.counts, **self._loads.counts,
                                  **self._checks.counts, **self._book.counts}
        out: dict[str, object] = {name: counts.pop(name) for name in _COUNTER_ORDER}
        out.update(counts)  # a counter a part added after the order was written
        out.update(self._book.stats(time.monotonic(), self._config.remote_kv_timeout_s))
        out["quarantined_blocks"] = self._blocks.num_quarantined
        out["blocks_used"] = self._blocks.num_used()
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
        if self._scheduler.has_requests():
            problems.append(f"{len(self.waiting)} waiting, {len(self.running)} running requests")
        problems.extend(self._book.problems())
        problems.extend(self._blocks.problems())
        if self.aggregator is not None:
            pending = self.aggregator.pending()
            if pending["sending"] or pending["recving"]:
                problems.append(f"half-reported transfers: {pending}")
        timeouts = self._loads.counts
        if timeouts["remote_kv_timeouts"]:
            problems.append(f"{timeouts['remote_kv_timeouts']} engine-side remote KV timeouts")
        if timeouts["lookup_timeouts"]:
            problems.append(f"{timeouts['lookup_timeouts']} engine-side lookup timeouts")
        return problems

    def verify_request_blocks(self, request_id: str, start: int, end: int) -> tuple[int, int]:
        """Verify tokens ``[start, end)`` of a live request on every rank."""
        return self._checks.verify_tokens(self._book.requests[request_id], start, end)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block that no request references; returns how many.

        Events (published at once, as their own batch): ``AllBlocksCleared``
        when no cached block is left in any pool (vLLM's successful reset),
        else a ``BlockRemoved`` per pool for the hashes forgotten.
        """
        count, clears_all = self._blocks.drop_unreferenced()
        events = self._blocks.take_events()
        if clears_all and self._config.enable_kv_cache_events:
            events.append(AllBlocksCleared())
        self._outlet.publish(events)
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
        self._outlet.close()  # logs what it abandons

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def engines_idle_problems(engines: Iterable[Engine]) -> list[str]:
    return [f"{engine.engine_id}: {p}" for engine in engines for p in engine.idle_problems()]
