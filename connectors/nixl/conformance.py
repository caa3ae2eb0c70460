"""The NIXL connector's conformance cases (run by ``tests/connectors/test_conformance.py``).

Both engines run in the test process with real NIXL agents (one per rank).
``break_loads`` injects a vanished peer into the consumer ranks
(:func:`~kvbridge.connectors.nixl.faults.fail_next_loads`): the loads
ordered in that step lose their NIXL peers (``remove_remote_agent``) just
before posting, and must come back as failed receives with their block ids.
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
        yield CaseEnv(producer=ConnectorConfig("nixl", KVRole.PRODUCER, extra=extra),
                      consumer=ConnectorConfig("nixl", KVRole.CONSUMER, extra=extra),
                      break_loads=_break_loads, async_loads=True)
    return setup


def cases() -> tuple[ConformanceCase, ...]:
    return (
        ConformanceCase("nixl-pull-gqa-tp1-tp2", CaseKind.PD, _setup(TransferMode.PULL),
                        model="tiny-gqa", consumer_topology=ParallelTopology(tp_size=2),
                        mode=TransferMode.PULL, backends=("nixl_cu12",), num_blocks=64),
        ConformanceCase("nixl-push-hybrid-tp2-tp1", CaseKind.PD, _setup(TransferMode.PUSH),
                        model="tiny-hybrid", producer_topology=ParallelTopology(tp_size=2),
                        mode=TransferMode.PUSH, backends=("nixl_cu12",), num_blocks=64),
        # two consumer ranks notify the one producer rank: every count they send is 2
        ConformanceCase("nixl-push-gqa-tp1-tp2", CaseKind.PD, _setup(TransferMode.PUSH),
                        model="tiny-gqa", consumer_topology=ParallelTopology(tp_size=2),
                        mode=TransferMode.PUSH, backends=("nixl_cu12",), num_blocks=64),
    )
