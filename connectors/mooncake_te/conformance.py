"""The ``mooncake_te`` connector's conformance cases: NIXL's cases, over TE.

The same models, topologies and modes as :mod:`kvbridge.connectors.nixl.conformance`,
both engines in the test process, one transfer engine per rank. ``break_loads``
is the same fault (:func:`~kvbridge.connectors.nixl.faults.fail_next_loads`):
it removes the doomed loads' peers through the transport protocol
(``remove_peer``), which this adapter implements too, so the loads fail through
the adapter's own path (a send to a removed peer raises).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from kvbridge.connectors.config import ConnectorConfig, KVRole
from kvbridge.connectors.params import TransferMode
from kvbridge.connectors.testing import CaseEnv, CaseKind, ConformanceCase
from kvbridge.layouts import ParallelTopology


def _break_loads(engine: Any, step: Any) -> None:
    from kvbridge.connectors.nixl.faults import fail_next_loads

    for worker in engine.workers:
        fail_next_loads(worker.connector)


def _setup(mode: TransferMode) -> Callable[[Path], AbstractContextManager[CaseEnv]]:
    @contextmanager
    def setup(tmp: Path) -> Iterator[CaseEnv]:
        extra = {"mode": mode.value, "transfer_timeout_s": 10.0, "lease_s": 30.0}
        yield CaseEnv(producer=ConnectorConfig("mooncake_te", KVRole.PRODUCER, extra=extra),
                      consumer=ConnectorConfig("mooncake_te", KVRole.CONSUMER, extra=extra),
                      break_loads=_break_loads, async_loads=True)
    return setup


def cases() -> tuple[ConformanceCase, ...]:
    backends = ("mooncake.engine",)
    return (
        ConformanceCase("mooncake_te-pull-gqa-tp1-tp2", CaseKind.PD, _setup(TransferMode.PULL),
                        model="tiny-gqa", consumer_topology=ParallelTopology(tp_size=2),
                        mode=TransferMode.PULL, backends=backends, num_blocks=64),
        ConformanceCase("mooncake_te-push-hybrid-tp2-tp1", CaseKind.PD, _setup(TransferMode.PUSH),
                        model="tiny-hybrid", producer_topology=ParallelTopology(tp_size=2),
                        mode=TransferMode.PUSH, backends=backends, num_blocks=64),
        ConformanceCase("mooncake_te-push-gqa-tp1-tp2", CaseKind.PD, _setup(TransferMode.PUSH),
                        model="tiny-gqa", consumer_topology=ParallelTopology(tp_size=2),
                        mode=TransferMode.PUSH, backends=backends, num_blocks=64),
    )
