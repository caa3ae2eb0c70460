"""What the engine does with the connector's load and transfer reports.

Owns, for :class:`~kvbridge.engine.core.Engine` (through :class:`LoadHandling`):

* synchronous loads: blocks a step's output names invalid send the affected
  requests' ``num_computed_tokens`` back to the first invalid token (recompute,
  never trust the bytes), or fail them under ``LoadFailurePolicy.FAIL``;
* asynchronous loads: a finished receive becomes computed tokens (up to its
  first invalid token; a failed receive that names no block trusts none);
* verification of loaded tokens against the reference content (``verify_loads``);
* ``finished_recving`` / ``finished_sending``: release waiting requests, aborted
  receives and delayed frees; count stray reports;
* bounds: a request waiting for remote KV, or for a lookup, longer than
  ``remote_kv_timeout_s`` is recomputed by the engine itself, its blocks
  quarantined (a late transfer could still write them).

May not touch: scheduling and allocation (:mod:`kvbridge.engine.scheduling`), the
connector's hooks (it reads only the aggregated :class:`ConnectorOutput` the step
loop hands it), events and the step loop (:mod:`kvbridge.engine.core`).
"""

from __future__ import annotations

import logging
import time

from kvbridge.connectors import ConnectorOutput, LoadFailurePolicy
from kvbridge.engine.request import EngineRequest, RequestState
from kvbridge.engine.state import EngineState

logger = logging.getLogger(__name__)


class LoadHandling(EngineState):
    """Load results and transfer completions, applied to the engine's state."""

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
