"""The records of ``kvbridge trace``: one :class:`TraceEvent` per thing that happened.

Owns: :class:`TraceEvent` (a frozen record; its kinds and their ``detail``
fields are listed in :mod:`kvbridge.tools.trace`), :class:`TraceRecorder` (the
thread-safe, append-only list the wrappers add to) and :class:`TraceError`.
Pure: no engine, connector or backend is imported here. May not touch: what
is recorded when (:mod:`kvbridge.tools.trace.instrument`) or how a request is
run (:mod:`kvbridge.tools.trace`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any


class TraceError(RuntimeError):
    """The engine cannot be traced (not a NIXL worker, or its internals moved)."""


@dataclass(frozen=True)
class TraceEvent:
    """One thing that happened. ``t_ms`` is milliseconds since the trace started."""

    t_ms: float
    side: str  # "producer", "consumer" or "router"
    rank: int | None
    kind: str
    request_id: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TraceRecorder:
    """Thread-safe, append-only event list (handshakes run on a worker's thread)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._start = clock()
        self._lock = threading.Lock()
        self.events: list[TraceEvent] = []

    def add(self, side: str, rank: int | None, kind: str, request_id: str | None = None, /,
            **detail: Any) -> TraceEvent:
        event = TraceEvent(round((self._clock() - self._start) * 1e3, 3), side, rank, kind,
                           request_id, detail)
        with self._lock:
            self.events.append(event)
        return event

    def snapshot(self) -> list[TraceEvent]:
        with self._lock:
            return sorted(self.events, key=lambda e: e.t_ms)

    def of_kind(self, kind: str) -> list[TraceEvent]:
        return [e for e in self.snapshot() if e.kind == kind]
