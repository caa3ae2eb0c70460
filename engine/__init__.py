"""A reference paged-KV engine that drives connectors the way a serving engine does.

In-process: :class:`Engine` (one engine, all its ranks) and
:func:`run_workload` (one engine, or a producer/consumer pair with an
in-process router). Multi-process: :mod:`kvbridge.engine.harness` runs each
engine in its own process, controlled with msgpack over ZeroMQ.
"""

from kvbridge.engine.content import reference_output, verify_blocks
from kvbridge.engine.core import Engine, EngineConfig, HookCall, StepReport
from kvbridge.engine.request import RequestResult, RequestSpec, RequestState

__all__ = [
    "Engine",
    "EngineConfig",
    "HookCall",
    "RequestResult",
    "RequestSpec",
    "RequestState",
    "StepReport",
    "reference_output",
    "verify_blocks",
]
