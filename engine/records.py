"""The records an engine hands out about its steps: :class:`StepReport` (what one
``step()`` did) and :class:`HookCall` (one connector hook call, in ``hook_log`` when
``record_hooks`` is set).

Owns: these two immutable records. May not touch: the engine's state; they are
built by :mod:`kvbridge.engine.core` and :mod:`kvbridge.engine.hook_log` and only read
by callers (tests, the harness, the CLI).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.connectors import ConnectorOutput


@dataclass(frozen=True)
class HookCall:
    step: int
    side: str  # "scheduler" or "worker"
    worker: int | None
    hook: str
    request_id: str | None


@dataclass(frozen=True)
class StepReport:
    step_id: int
    num_scheduled: int
    num_tokens: int
    preempted: frozenset[str]
    finished: tuple[str, ...]
    output: ConnectorOutput | None
