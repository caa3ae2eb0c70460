"""Phase 1 of the engine's step: which requests run this step, with which blocks.

:class:`Scheduler` is the one owner, in :class:`~kvbridge.engine.core.Engine`, of the
two queues (``waiting``: FIFO, preempted requests at the front, and requests
waiting for a lookup or for remote KV; ``running``) and of the ``preemptions``,
``local_hit_tokens`` and ``lookups_deferred`` counters.

A step schedules running requests first (preempting the most recent ones when
blocks run out), then waiting ones in FIFO order: local prefix-cache lookup,
``get_num_new_matched_tokens`` (``None``: the request stays in WAITING_FOR_LOOKUP
and is asked again next step), all-or-nothing allocation in every region,
``update_state_after_alloc``; an async load parks the request in
WAITING_FOR_REMOTE_KVS until its receive finished (then
:meth:`~kvbridge.engine.loads.Loads.finish_remote` turns it into computed tokens).

Its context: the block space (allocation, prefix hits), the loads (which receives
finished, which loads start), the scheduler connector's two lookup/allocation
hooks and the hook recorder.

May not touch: what a load's result means (:mod:`kvbridge.engine.loads`), the
rest of the step (connector metadata, workers, events: :mod:`kvbridge.engine.core`)
or how a request ends (:mod:`kvbridge.engine.lifecycle`).
"""

from __future__ import annotations

import time
from collections import deque

from kvbridge.connectors import ContractError, SchedulerConnector
from kvbridge.engine.blocks import BlockSpace
from kvbridge.engine.loads import Loads, StepItem
from kvbridge.engine.request import EngineRequest, RequestState
from kvbridge.engine.worker import HookRecorder


class Scheduler:
    """Scheduling and block allocation of one engine step. Not thread-safe."""

    def __init__(self, blocks: BlockSpace, loads: Loads, connector: SchedulerConnector | None,
                 record: HookRecorder, *, max_num_batched_tokens: int,
                 max_num_seqs: int) -> None:
        self._blocks = blocks
        self._loads = loads
        self._connector = connector
        self._record = record
        self._max_num_batched_tokens = max_num_batched_tokens
        self._max_num_seqs = max_num_seqs
        #: FIFO: waiting, preempted (at the front), waiting for a lookup or for remote KV
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.counts = {"preemptions": 0, "local_hit_tokens": 0, "lookups_deferred": 0}

    def enqueue(self, req: EngineRequest) -> None:
        self.waiting.append(req)

    def remove(self, req: EngineRequest) -> None:
        """Take ``req`` out of whichever queue holds it (it is ending)."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)

    def has_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[StepItem], set[str]]:
        """This step's ``(request, tokens, first time scheduled)`` and the ids preempted."""
        preempted: set[str] = set()
        items: list[StepItem] = []
        self._schedule_running(items, preempted)
        if not preempted:
            self._schedule_waiting(items)
        return items, preempted

    def _schedule_running(self, items: list[StepItem], preempted: set[str]) -> None:
        budget = self._max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                index += 1
                continue
            while not self._blocks.allocate_for(req, req.num_computed_tokens + n):
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
        self.counts["preemptions"] += 1
        self._blocks.free_preempted(req)
        req.preempt(time.monotonic())
        self.waiting.appendleft(req)

    def _schedule_waiting(self, items: list[StepItem]) -> None:
        budget = self._max_num_batched_tokens - sum(n for _, n, _ in items)
        skipped: deque[EngineRequest] = deque()
        while self.waiting and budget > 0 and len(self.running) < self._max_num_seqs:
            req = self.waiting.popleft()
            from_remote = False
            if req.state is RequestState.WAITING_FOR_REMOTE_KVS:
                if not self._loads.receive_done(req.request_id):
                    skipped.append(req)
                    continue
                if not self._loads.finish_remote(req):
                    continue  # failed with the FAIL policy: finished
                from_remote = True
            if req.num_computed_tokens == 0 and not any(req.block_ids):
                local, hit_blocks = self._blocks.local_hit(req)
            else:
                local, hit_blocks = req.num_computed_tokens, None
            ext, load_async = 0, False
            connector = self._connector
            if connector is not None and not from_remote and not req.connector_done:
                self._record("scheduler", None, "get_num_new_matched_tokens", req.request_id)
                matched, load_async = connector.get_num_new_matched_tokens(req.view(local), local)
                if matched is None:
                    self.counts["lookups_deferred"] += 1
                    req.defer_lookup(time.monotonic())
                    skipped.append(req)
                    continue
                if matched < 0 or local + matched > req.num_tokens:
                    raise ContractError("get_num_new_matched_tokens",
                                        f"request {req.request_id}: {matched} new tokens after "
                                        f"{local} computed of {req.num_tokens}")
                ext = matched
            if hit_blocks is not None:
                self._blocks.take_hit(req, hit_blocks)
            if load_async and ext > 0:
                if not self._blocks.allocate_for(req, local + ext):
                    self._blocks.undo_hit(req, hit_blocks)
                    self.waiting.appendleft(req)
                    break
                if hit_blocks is not None:
                    req.take_local_hit(local)
                    self.counts["local_hit_tokens"] += local
                self._record("scheduler", None, "update_state_after_alloc", req.request_id)
                assert connector is not None
                connector.update_state_after_alloc(req.view(local), req.frozen_block_ids(), ext)
                self._loads.start_async(req)
                req.await_remote(local, ext, time.monotonic())
                skipped.append(req)
                continue
            if local + ext >= req.num_tokens:
                ext = max(0, req.num_tokens - 1 - local)  # recompute the last token
            n = min(req.num_tokens - local - ext, budget)
            if not self._blocks.allocate_for(req, local + ext + n):
                self._blocks.undo_hit(req, hit_blocks)
                self.waiting.appendleft(req)
                break
            if hit_blocks is not None:
                req.take_local_hit(local)
                self.counts["local_hit_tokens"] += local
            if connector is not None and not from_remote and not req.connector_done:
                self._record("scheduler", None, "update_state_after_alloc", req.request_id)
                connector.update_state_after_alloc(req.view(local), req.frozen_block_ids(), ext)
            if ext:
                self._loads.start_sync(req, local, ext)
            is_new = req.state in (RequestState.WAITING, RequestState.PREEMPTED,
                                   RequestState.WAITING_FOR_LOOKUP) or from_remote
            req.run(local + ext)
            self.running.append(req)
            items.append((req, n, is_new))
            budget -= n
        # requests that could not start keep their place ahead of later arrivals
        self.waiting.extendleft(reversed(skipped))
