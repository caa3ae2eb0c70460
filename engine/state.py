"""What one reference engine holds between steps, and the one way a request leaves it.

:class:`EngineState` is the base of :class:`~kvbridge.engine.core.Engine`. It
declares the bookkeeping every phase of a step shares (requests, queues, block
pools, the held and quarantined blocks, the counters) -- each field with its unit
and invariant -- and the few operations on it that every phase uses:

* :meth:`~EngineState._finish`: a request ends (length, abort, error); the
  scheduler connector's ``request_finished`` decides whether its blocks are freed
  now or held until ``finished_sending`` (a delayed free); a request still
  receiving keeps its blocks until its receive ends, because a transfer may still
  write them;
* :meth:`~EngineState._release`: blocks go back to the pools (the only place a
  finished request's blocks are freed);
* :meth:`~EngineState._quarantine`: blocks stay referenced forever (a late
  transfer may still write them);
* :meth:`~EngineState._cache_full_blocks`: full blocks become findable by their
  chained hash (prefix caching);
* :meth:`~EngineState._record`: one :class:`~kvbridge.engine.records.HookCall`.

Owns: those declarations and operations. May not touch: scheduling
(:mod:`kvbridge.engine.scheduling`), load results (:mod:`kvbridge.engine.loads`),
the step loop and building the engine (:mod:`kvbridge.engine.core`); the values
are set by ``Engine._start``.
"""

from __future__ import annotations

import time
from collections import deque

from kvbridge.connectors import SchedulerConnector
from kvbridge.engine.block_pool import BlockPool
from kvbridge.engine.config import EngineConfig
from kvbridge.engine.records import HookCall
from kvbridge.engine.request import EngineRequest, RequestResult, RequestState
from kvbridge.engine.worker import Worker


class EngineState:
    """The bookkeeping of one engine, shared by the phases of its step. Not thread-safe."""

    config: EngineConfig
    engine_id: str
    num_regions: int
    #: tokens one block of region r covers (``block_size * dcp_size`` if token-sharded)
    tokens_per_block: tuple[int, ...]
    #: one block pool per region, ``num_blocks`` blocks each
    pools: list[BlockPool]
    #: one per rank, in ``topology.ranks()`` order (index = worker index)
    workers: list[Worker]
    scheduler_connector: SchedulerConnector | None
    hook_log: list[HookCall]
    step_id: int
    #: requests whose connector load (``num_external_tokens > 0``) starts this step
    loads_started: set[str]
    #: every live request (not yet released) by id
    requests: dict[str, EngineRequest]
    #: FIFO: waiting, preempted (at the front), waiting for a lookup or for remote KV
    waiting: deque[EngineRequest]
    running: list[EngineRequest]
    #: results of finished requests not yet taken (``pop_results``)
    results: list[RequestResult]
    _stats: dict[str, int]
    #: finished since the last step: the next ``SchedulerStep.finished_request_ids``
    _finished_since_last_step: set[str]
    #: delayed frees: request id -> (request, since when, monotonic s); released on
    #: ``finished_sending``
    _delayed: dict[str, tuple[EngineRequest, float]]
    #: aborted while receiving: blocks kept until ``finished_recving``
    _free_on_recv: dict[str, EngineRequest]
    #: receives that finished (request id -> failed), not yet turned into tokens
    _recv_done: dict[str, bool]
    #: receives the engine gave up on (timed out): their late ``finished_recving`` is dropped
    _ignore_recv: set[str]
    #: ``(region, block_id)`` reported invalid and not yet claimed by a load
    _invalid_refs: set[tuple[int, int]]
    #: ``(region, block_id)`` never freed again (see :meth:`_quarantine`)
    _quarantined: list[tuple[int, int]]

    def _record(self, side: str, worker: int | None, hook: str, request_id: str | None) -> None:
        if self.config.record_hooks:
            self.hook_log.append(HookCall(self.step_id, side, worker, hook, request_id))

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

    def _quarantine(self, region: int, block_ids: list[int]) -> None:
        """Keep blocks referenced forever: a late transfer may still write them."""
        self._quarantined.extend((region, b) for b in block_ids)

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
