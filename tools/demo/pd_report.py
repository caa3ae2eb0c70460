"""What the two-engine (prefill -> decode) demos share: the routing loop and the report.

Both demos route the same workload between a producer and a consumer engine
process with :class:`kvbridge.tools.demo.nixl.Router` (to this module, any
:class:`Routes`), wait for every request under one deadline, and report the
same request-level fields; only where the moved bytes are counted (which
worker's stats) and the connector-specific counters differ. Keeping the loop
and the common fields here means the keys ``kvbridge demo`` prints (see
:mod:`kvbridge.tools.commands.demo`) mean the same for every connector. (Not named
``demo_*``: cmd_demo takes those for connector demos.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kvbridge.tools.lazy import lazy

if TYPE_CHECKING:
    from kvbridge.connectors import KVRole
    from kvbridge.engine.core import EngineConfig
    from kvbridge.engine.request import RequestResult, RequestSpec, RequestState
else:
    RequestState = lazy("kvbridge.engine.request", "RequestState")

PROGRESS_EVERY_S = 0.5


class Routes(Protocol):
    """What :func:`route_all` needs of a router. Stated here so that this module,
    which ``demo_nixl`` imports, need not import ``demo_nixl`` back for its type."""

    results: dict[str, RequestResult]

    def submit(self, specs: list[RequestSpec]) -> None: ...
    def poll(self) -> int: ...
    @property
    def done(self) -> bool: ...


def check_connector_settings(make_config: Callable[[KVRole], EngineConfig]) -> None:
    """Parse the producer's and the consumer's connector settings here, before any
    process starts: a bad ``--kv-config`` is a usage error (ConfigError naming the
    setting), not an engine process that dies before it is ready."""
    from kvbridge.connectors import KVRole, registry

    for role in (KVRole.PRODUCER, KVRole.CONSUMER):
        config = make_config(role).connector
        assert config is not None
        registry.resolve(config)


def route_all(router: Routes, requests: list[RequestSpec], timeout_s: float,
              progress: Callable[[str], None] | None) -> float:
    """Submit ``requests`` and poll ``router`` until each has a result; returns elapsed seconds.

    Raises ``TimeoutError`` naming how many finished when ``timeout_s`` passes first.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    router.submit(requests)
    last_line = 0.0
    while not router.done:
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo: {len(router.results)}/{len(requests)} requests done "
                               f"after {timeout_s} s")
        if router.poll() == 0:
            time.sleep(0.005)
        now = time.monotonic()
        if progress is not None and now - last_line > PROGRESS_EVERY_S:
            last_line = now
            failed = sum(1 for r in router.results.values()
                         if r.state is not RequestState.FINISHED_LENGTH)
            progress(f"{len(router.results)}/{len(requests)} requests done, {failed} failed, "
                     f"{sum(r.verified_bytes for r in router.results.values()) / 1e6:.1f} MB "
                     f"verified, {now - start:.1f} s")
    return time.monotonic() - start


def request_fields(results: list[RequestResult], wrong: list[str], elapsed: float,
                   nbytes: int, busy_s: float) -> dict[str, Any]:
    """The summary keys every two-engine demo reports alike.

    A request failed when it did not finish normally, produced a wrong output,
    or recomputed tokens it should have loaded. ``nbytes`` and ``busy_s`` are
    the moving side's transferred bytes and time spent transferring.
    """
    failed = [r for r in results if r.state is not RequestState.FINISHED_LENGTH
              or r.request_id in wrong or r.num_recomputed_tokens > 0]
    return {
        "requests": len(results),
        "failed_requests": len(failed),
        "wrong_outputs": len(wrong),
        "verified_bytes": sum(r.verified_bytes for r in results),
        "mismatched_bytes": sum(r.mismatched_bytes for r in results),
        "external_tokens": sum(r.num_external_tokens for r in results),
        "recomputed_tokens": sum(r.num_recomputed_tokens for r in results),
        "elapsed_s": round(elapsed, 3),
        "throughput_gbps": round(nbytes / max(elapsed, 1e-9) / 1e9, 4),
        "transfer_gbps": round(nbytes / busy_s / 1e9, 4) if busy_s else None,
    }


def idle_problems(producer_stats: dict[str, Any],
                  consumer_stats: dict[str, Any]) -> dict[str, list[Any]]:
    """Each engine's leftover state once idle (leaked blocks, pending transfers)."""
    return {"producer": producer_stats.get("idle_problems", []),
            "consumer": consumer_stats.get("idle_problems", [])}
