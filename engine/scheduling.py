"""Phase 1 of the engine's step: which requests run this step, with which blocks.

Owns, for :class:`~kvbridge.engine.core.Engine` (through :class:`Scheduling`):
running requests first (preempting the most recent ones when blocks run out),
then waiting ones in FIFO order: local prefix-cache lookup,
``get_num_new_matched_tokens`` (``None``: the request stays in
WAITING_FOR_LOOKUP and is asked again next step), all-or-nothing allocation in
every region, ``update_state_after_alloc``; an async load parks the request in
WAITING_FOR_REMOTE_KVS until its receive finished (then it is turned into
computed tokens here, through :class:`~kvbridge.engine.loads.LoadHandling`).

May not touch: what a load's result means (:mod:`kvbridge.engine.loads`), the
rest of the step (connector metadata, workers, events: :mod:`kvbridge.engine.core`)
or how a request ends (:mod:`kvbridge.engine.state`). Calls only the scheduler
connector's two lookup/allocation hooks.
"""

from __future__ import annotations

import time
from collections import deque

from kvbridge.connectors import ContractError
from kvbridge.engine.loads import LoadHandling
from kvbridge.engine.request import (
    EngineRequest,
    RequestState,
    blocks_needed,
    common_hit_tokens,
)


class Scheduling(LoadHandling):
    """Scheduling and block allocation of one engine step.

    Built on :class:`LoadHandling` because scheduling a request whose async receive
    finished first turns the receive into computed tokens (``_finish_remote_load``).
    """

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
