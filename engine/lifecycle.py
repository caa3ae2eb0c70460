"""Every live request of an engine, and the one way a request ends.

:class:`Lifecycle` is the one owner of the request table of
:class:`~kvbridge.engine.core.Engine`:

* ``requests``: every live request (not yet released) by id;
* the results of finished requests not yet taken (``pop_results``);
* the ids finished since the last step (the next
  ``SchedulerStep.finished_request_ids``);
* the held blocks of ended requests: a *delayed free* (the scheduler connector's
  ``request_finished`` asked to keep the blocks until ``finished_sending``), and a
  request *aborted while receiving* (a transfer may still write its blocks: they
  are kept until ``finished_recving``, or quarantined when that never comes);
* the ``aborted`` and ``finished`` counters.

:meth:`Lifecycle.finish` is where a request ends (length, abort, error): the
scheduler connector's ``request_finished`` decides whether its blocks are freed now
or held. :meth:`Lifecycle.release` is the only place a finished request's blocks
go back (through :class:`~kvbridge.engine.blocks.BlockSpace`).

May not touch: the queues (the caller takes the request out of them first:
:mod:`kvbridge.engine.scheduling`), whether a receive finished
(:mod:`kvbridge.engine.loads` says, and the caller passes ``receiving``), the
blocks themselves (:mod:`kvbridge.engine.blocks`).
"""

from __future__ import annotations

import time

from kvbridge.connectors import SchedulerConnector
from kvbridge.engine.blocks import BlockRef, BlockSpace
from kvbridge.engine.request import EngineRequest, RequestResult, RequestState
from kvbridge.engine.worker import HookRecorder


class Lifecycle:
    """The live requests of one engine and how they end. Not thread-safe."""

    def __init__(self, blocks: BlockSpace, connector: SchedulerConnector | None,
                 record: HookRecorder) -> None:
        self._blocks = blocks
        self._connector = connector
        self._record = record
        #: every live request (not yet released) by id
        self.requests: dict[str, EngineRequest] = {}
        #: results of finished requests not yet taken (``pop_results``)
        self.results: list[RequestResult] = []
        self._finished_since_last_step: set[str] = set()
        #: delayed frees: request id -> (request, since when, monotonic s); released on
        #: ``finished_sending``
        self._delayed: dict[str, tuple[EngineRequest, float]] = {}
        #: aborted while receiving: blocks kept until ``finished_recving``
        self._held_on_recv: dict[str, EngineRequest] = {}
        self.counts = {"aborted": 0, "finished": 0}

    def admit(self, req: EngineRequest) -> None:
        self.requests[req.request_id] = req

    def finish(self, req: EngineRequest, state: RequestState, *, receiving: bool) -> None:
        """``req`` ends in ``state``. ``receiving``: its receive has not ended, so a
        transfer may still write its blocks (they are held until it does)."""
        req.end(state)
        self.counts["aborted" if state is RequestState.FINISHED_ABORTED else "finished"] += 1
        delay = False
        if self._connector is not None:
            self._record("scheduler", None, "request_finished", req.request_id)
            delay, params = self._connector.request_finished(req.view(), req.frozen_block_ids())
            req.set_transfer_params_out(params)
        self._finished_since_last_step.add(req.request_id)
        if receiving:
            self._held_on_recv[req.request_id] = req  # a transfer may still write them
        elif delay:
            self._delayed[req.request_id] = (req, time.monotonic())
        else:
            self.release(req)
        self.results.append(req.result())

    def release(self, req: EngineRequest) -> None:
        """The request's blocks go back to the pools; it leaves the table."""
        self._blocks.release(req)
        self.requests.pop(req.request_id, None)

    def take_finished_ids(self) -> frozenset[str]:
        """The ids finished since the last call (once each)."""
        finished = frozenset(self._finished_since_last_step)
        self._finished_since_last_step = set()
        return finished

    def pop_results(self) -> list[RequestResult]:
        results, self.results = self.results, []
        return results

    # ------------------------------------------------------------------ held blocks

    def send_ended(self, request_id: str) -> bool:
        """``finished_sending``: release a delayed free. False if none was delayed."""
        held = self._delayed.pop(request_id, None)
        if held is None:
            return False
        self.release(held[0])
        return True

    def receive_ended(self, request_id: str) -> bool:
        """``finished_recving`` of a request aborted while receiving: release its
        blocks. False if it was not such a request."""
        held = self._held_on_recv.pop(request_id, None)
        if held is None:
            return False
        self.release(held)
        return True

    def expire_held_receives(self, now: float, timeout_s: float) -> list[str]:
        """Requests aborted while receiving whose receive has not ended ``timeout_s``
        after they began waiting: their blocks are quarantined (never reused: the
        transfer may still write them) and they leave the table. Their ids."""
        expired = []
        for request_id, req in list(self._held_on_recv.items()):
            if now - req.waiting_since > timeout_s:
                del self._held_on_recv[request_id]
                self._blocks.quarantine_all(req)
                self.requests.pop(request_id, None)
                expired.append(request_id)
        return expired

    def receiving_blocks(self) -> set[BlockRef]:
        """Blocks a receive may still report: those of requests waiting for remote KV
        and of requests aborted while receiving."""
        refs = {(r, b) for req in self.requests.values()
                if req.state is RequestState.WAITING_FOR_REMOTE_KVS
                for r, ids in enumerate(req.block_ids) for b in ids}
        refs |= {(r, b) for req in self._held_on_recv.values()
                 for r, ids in enumerate(req.block_ids) for b in ids}
        return refs

    # ------------------------------------------------------------------ inspection

    def has_pending_transfers(self) -> bool:
        """Delayed frees or receives of aborted requests still outstanding."""
        return bool(self._delayed or self._held_on_recv)

    def stats(self, now: float, timeout_s: float) -> dict[str, int]:
        return {
            "delayed_frees_pending": len(self._delayed),
            "delayed_frees_overdue": sum(1 for _, since in self._delayed.values()
                                         if now - since > timeout_s),
            "receives_pending_after_abort": len(self._held_on_recv),
        }

    def problems(self) -> list[str]:
        problems = []
        if self._delayed:
            problems.append(f"delayed frees not released: {sorted(self._delayed)[:5]}")
        if self._held_on_recv:
            problems.append(f"aborted receives not finished: {sorted(self._held_on_recv)[:5]}")
        return problems

    def num_delayed(self) -> int:
        return len(self._delayed)
