"""Checks of the KV an engine holds against the reference content.

:class:`ContentChecks` owns whether loaded tokens are verified (``verify_loads``)
and the engine's ``verified_bytes`` / ``mismatched_bytes`` counters. A load's
tokens are checked on every rank once the load is settled (a sync load in the step
it ran, an async one when its receive finished), and the bytes are added to the
request's own counts too.

May not touch: what a mismatch means for the request (the bytes are reported,
the request is not failed), the workers' tensors (it calls ``Worker.verify``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvbridge.engine.request import EngineRequest
from kvbridge.engine.worker import Worker

logger = logging.getLogger(__name__)


class ContentChecks:
    """KV content verification over the ranks of one engine."""

    def __init__(self, workers: Sequence[Worker], *, verify_loads: bool, engine_id: str) -> None:
        self._workers = tuple(workers)
        self.verify_loads = verify_loads
        self._engine_id = engine_id
        self.counts = {"verified_bytes": 0, "mismatched_bytes": 0}

    def set_verify_loads(self, enabled: bool) -> None:
        self.verify_loads = enabled

    def verify_load(self, req: EngineRequest, start: int, end: int) -> None:
        """Check loaded tokens ``[start, end)`` (when ``verify_loads``); counted on the
        request and here."""
        if not self.verify_loads or end <= start:
            return
        for worker in self._workers:
            verified, mismatched = worker.verify(req.block_ids, req.token_ids, start, end)
            req.add_verified(verified, mismatched)
            self.counts["verified_bytes"] += verified
            self.counts["mismatched_bytes"] += mismatched
        if req.mismatched_bytes:
            logger.error("engine %s: request %s: %d mismatched bytes in loaded tokens [%d, %d)",
                         self._engine_id, req.request_id, req.mismatched_bytes, start, end)

    def verify_tokens(self, req: EngineRequest, start: int, end: int) -> tuple[int, int]:
        """``(verified_bytes, mismatched_bytes)`` of tokens ``[start, end)`` on every rank
        (an inspection: counted nowhere)."""
        verified = mismatched = 0
        for worker in self._workers:
            v, m = worker.verify(req.block_ids, req.token_ids, start, end)
            verified += v
            mismatched += m
        return verified, mismatched
