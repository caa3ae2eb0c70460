"""A reference paged-KV engine that drives connectors the way a serving engine does.

In-process: :class:`Engine` (one engine, all its ranks) and
:func:`run_workload` (one engine, or a producer/consumer pair with an
in-process router). Multi-process: :mod:`kvbridge.engine.harness` runs each
engine in its own process, controlled with msgpack over ZeroMQ.
"""

from kvbridge.engine.content import reference_output, verify_blocks
from kvbridge.engine.core import Engine, EngineConfig, HookCall, StepReport
from kvbridge.engine.request import RequestResult, RequestSpec, RequestState
from kvbridge.engine.workload import (
    InProcessRouter,
    WorkloadResult,
    check_outputs,
    make_requests,
    run_workload,
)

__all__ = [
    "Engine",
    "EngineConfig",
    "HookCall",
    "InProcessRouter",
    "RequestResult",
    "RequestSpec",
    "RequestState",
    "StepReport",
    "WorkloadResult",
    "check_outputs",
    "make_requests",
    "reference_output",
    "run_workload",
    "verify_blocks",
]
