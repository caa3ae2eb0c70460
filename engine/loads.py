"""What the engine does with the connector's loads, and their load and transfer reports.

:class:`Loads` is the one owner, in :class:`~kvbridge.engine.core.Engine`, of:

* the loads starting this step (``loads_started``: request ids whose connector load,
  ``num_external_tokens > 0``, starts now);
* the receives that finished (request id -> failed) and are not yet turned into
  tokens, and the receives the engine gave up on (their late ``finished_recving``
  is dropped);
* the counters of loads and transfer reports: ``external_tokens``,
  ``recomputed_tokens``, ``failed_loads``, ``remote_kv_timeouts``,
  ``lookup_timeouts``, ``stray_*``.

What it does:

* synchronous loads: blocks a step's output names invalid send the affected
  requests' ``num_computed_tokens`` back to the first invalid token (recompute,
  never trust the bytes), or fail them under ``LoadFailurePolicy.FAIL``;
* asynchronous loads: a finished receive becomes computed tokens (up to its
  first invalid token; a failed receive that names no block trusts none);
* ``finished_recving`` / ``finished_sending``: release waiting requests, aborted
  receives and delayed frees (held by :class:`~kvbridge.engine.lifecycle.Lifecycle`);
  count stray reports;
* bounds: a request waiting for remote KV, or for a lookup, longer than
  ``remote_kv_timeout_s`` is recomputed by the engine itself, its blocks
  quarantined (a late transfer could still write them).

Its context: the block space (invalid marks, quarantine), the request table (held
blocks, releases), the content checks (verify what a load brought), and ``end``:
how the engine ends a request (out of the queues, then ``Lifecycle.finish``).

May not touch: scheduling and allocation (:mod:`kvbridge.engine.scheduling`), the
connector's hooks (it reads only the aggregated :class:`ConnectorOutput` the step
loop hands it), events and the step loop (:mod:`kvbridge.engine.core`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from kvbridge.connectors import ConnectorOutput
from kvbridge.engine.blocks import BlockRef, BlockSpace
from kvbridge.engine.checks import ContentChecks
from kvbridge.engine.lifecycle import Lifecycle
from kvbridge.engine.request import EngineRequest, RequestState

logger = logging.getLogger(__name__)

#: how the engine ends a request: out of its queue, then ``Lifecycle.finish``
EndRequest = Callable[[EngineRequest, RequestState], None]

#: one scheduled request of a step: (request, tokens to compute, first time scheduled)
StepItem = tuple[EngineRequest, int, bool]


class Loads:
    """Load results and transfer completions of one engine. Not thread-safe."""

    def __init__(self, blocks: BlockSpace, book: Lifecycle, checks: ContentChecks,
                 end: EndRequest, *, fail_on_error: bool, timeout_s: float,
                 engine_id: str) -> None:
        """``fail_on_error``: a failed load fails its request (``LoadFailurePolicy.FAIL``)
        instead of recomputing; ``timeout_s``: ``remote_kv_timeout_s``."""
        self._blocks = blocks
        self._book = book
        self._checks = checks
        self._end = end
        self._fail_on_error = fail_on_error
        self._timeout_s = timeout_s
        self._engine_id = engine_id
        #: requests whose connector load starts this step
        self.started: set[str] = set()
        #: receives that finished (request id -> failed), not yet turned into tokens
        self._recv_done: dict[str, bool] = {}
        #: receives the engine gave up on (timed out): their late ``finished_recving`` is dropped
        self._ignore_recv: set[str] = set()
        self.counts = {
            "external_tokens": 0, "recomputed_tokens": 0, "failed_loads": 0,
            "remote_kv_timeouts": 0, "lookup_timeouts": 0, "stray_finished_sending": 0,
            "stray_finished_recving": 0, "stray_invalid_blocks": 0,
        }

    # ------------------------------------------------------------------ starting loads

    def begin_step(self) -> None:
        self.started = set()

    def start_async(self, req: EngineRequest) -> None:
        self.started.add(req.request_id)

    def start_sync(self, req: EngineRequest, start: int, num_tokens: int) -> None:
        """A load of tokens ``[start, start + num_tokens)`` runs in this step's forward."""
        self.started.add(req.request_id)
        req.start_sync_load(start, num_tokens)
        self.counts["external_tokens"] += num_tokens

    def receive_done(self, request_id: str) -> bool:
        """Whether the request's async receive finished (its tokens are not taken yet)."""
        return request_id in self._recv_done

    def forget_receive(self, request_id: str) -> bool:
        """The request ends: drop its finished receive. Whether there was one."""
        return self._recv_done.pop(request_id, None) is not None

    # ------------------------------------------------------------------ load results

    def handle_sync_errors(self, items: list[StepItem], output: ConnectorOutput) -> set[str]:
        """Apply the invalid blocks of a step's output to its sync loads. Returns the
        requests whose tokens of this step are discarded."""
        refs = set(output.invalid_block_ids)
        self._blocks.mark_invalid(refs)
        invalidated: set[str] = set()
        claimed: set[BlockRef] = set()
        for req, _n, _ in items:
            if req.sync_load is None:
                continue
            start, end = req.sync_load
            claimed |= self._blocks.owned(req) & refs
            first = self._blocks.first_invalid_token(req, start, end, refs)
            if first is None:
                continue
            invalidated.add(req.request_id)
            self.counts["failed_loads"] += 1
            lost = end - first
            self.counts["recomputed_tokens"] += lost
            self.counts["external_tokens"] -= lost
            logger.warning("engine %s: request %s: load of tokens [%d, %d) failed from token %d; "
                           "recomputing", self._engine_id, req.request_id, start, end, first)
            self._checks.verify_load(req, start, first)
            req.fail_sync_load(first)  # tokens computed this step are discarded too
            if self._fail_on_error:
                req.fail(f"load of tokens [{first}, {end}) failed")
                self._end(req, RequestState.FINISHED_ERROR)
        if not refs:
            return invalidated
        stray = refs - claimed - self._book.receiving_blocks()
        self.counts["stray_invalid_blocks"] += len(stray)
        # refs of sync loads are consumed now; async ones wait for finished_recving
        self._blocks.unmark_invalid(claimed | stray)
        return invalidated

    def settle_sync(self, req: EngineRequest) -> None:
        """A sync load whose tokens were kept: verify them; the load is over."""
        if req.sync_load is not None:
            self._checks.verify_load(req, *req.sync_load)
            req.end_sync_load()

    def finish_remote(self, req: EngineRequest) -> bool:
        """Turn a finished async receive into computed tokens. False if the request ended."""
        failed = self._recv_done.pop(req.request_id)
        start = req.num_computed_tokens
        end = start + req.pending_external_tokens
        refs = self._blocks.claim_invalid(req)
        first = self._blocks.first_invalid_token(req, start, end, refs)
        if failed and first is None:
            first = start  # failed without naming blocks: trust none of them
        valid_end = end if first is None else first
        if first is not None:
            self.counts["failed_loads"] += 1
            self.counts["recomputed_tokens"] += end - first
            logger.warning("engine %s: request %s: async load of tokens [%d, %d) failed from "
                           "token %d; recomputing", self._engine_id, req.request_id, start, end,
                           first)
            if self._fail_on_error:
                req.fail(f"load of tokens [{first}, {end}) failed")
                req.end_remote_load(valid_end, keep=False)  # the receive is over
                self._end(req, RequestState.FINISHED_ERROR)
                return False
        self._checks.verify_load(req, start, valid_end)
        self.counts["external_tokens"] += valid_end - start
        req.end_remote_load(valid_end, keep=True)
        self._blocks.cache_full_blocks(req)
        return True

    def handle_finished_transfers(self, output: ConnectorOutput) -> None:
        for request_id in output.finished_recving:
            req = self._book.requests.get(request_id)
            if self._book.receive_ended(request_id):
                pass  # aborted while receiving: its blocks went back
            elif request_id in self._ignore_recv:
                self._ignore_recv.discard(request_id)
            elif req is not None and req.state is RequestState.WAITING_FOR_REMOTE_KVS:
                self._recv_done[request_id] = request_id in output.failed_recving
            else:
                self.counts["stray_finished_recving"] += 1
                logger.warning("engine %s: finished_recving for %s, which is not receiving",
                               self._engine_id, request_id)
        for request_id in output.finished_sending:
            if not self._book.send_ended(request_id):
                self.counts["stray_finished_sending"] += 1
                logger.warning("engine %s: finished_sending for %s, whose free was not delayed",
                               self._engine_id, request_id)

    # ------------------------------------------------------------------ bounds

    def check_timeouts(self, waiting: Iterable[EngineRequest], now: float) -> None:
        """Give up on receives and lookups older than ``remote_kv_timeout_s``."""
        timeout = self._timeout_s
        for req in waiting:
            if (req.state is RequestState.WAITING_FOR_REMOTE_KVS
                    and req.request_id not in self._recv_done
                    and now - req.waiting_since > timeout):
                self.counts["remote_kv_timeouts"] += 1
                logger.error("engine %s: request %s waited %.1f s for remote KV; the connector "
                             "never reported it: recomputing, quarantining its blocks",
                             self._engine_id, req.request_id, now - req.waiting_since)
                self._blocks.quarantine_after(req, req.num_computed_tokens)
                req.give_up_remote()
                self._ignore_recv.add(req.request_id)
            elif (req.state is RequestState.WAITING_FOR_LOOKUP
                    and now - req.waiting_since > timeout):
                self.counts["lookup_timeouts"] += 1
                logger.error("engine %s: request %s: the connector answered 'ask again' for "
                             "%.1f s; treating it as a miss", self._engine_id, req.request_id,
                             now - req.waiting_since)
                req.give_up_lookup()
        # aborted while receiving and the receive never ended: never reuse its blocks
        for request_id in self._book.expire_held_receives(now, timeout):
            self.counts["remote_kv_timeouts"] += 1
            logger.error("engine %s: aborted request %s: its receive never finished; "
                         "quarantining its blocks", self._engine_id, request_id)
            self._ignore_recv.add(request_id)
