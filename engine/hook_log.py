"""The record of the connector hooks an engine called, and of its aggregated outputs.

:class:`HookLog` is the one owner of ``hook_log`` and ``output_log`` of
:class:`~kvbridge.engine.core.Engine` (kept only with ``record_hooks``): every part
that calls a connector hook records it here, through the one recorder callable the
engine hands it (:data:`~kvbridge.engine.worker.HookRecorder`), which stamps the
step. The conformance suite reads the log to check the documented hook order.

May not touch: anything the hooks do; it only records.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvbridge.connectors import ConnectorOutput
from kvbridge.engine.records import HookCall


class HookLog:
    """Hook calls and connector outputs of one engine, in call order."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.calls: list[HookCall] = []
        #: each step's aggregated connector output
        self.outputs: list[ConnectorOutput] = []

    def record(self, step: int, side: str, worker: int | None, hook: str,
               request_id: str | None) -> None:
        if self.enabled:
            self.calls.append(HookCall(step, side, worker, hook, request_id))

    def keep_output(self, output: ConnectorOutput) -> None:
        if self.enabled:
            self.outputs.append(output)

    def replace_calls(self, calls: Iterable[HookCall]) -> None:
        """Put a given log in place (to check the hook-order checker on a made-up log)."""
        self.calls = list(calls)
