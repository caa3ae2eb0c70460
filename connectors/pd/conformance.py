"""The PD connector's conformance cases, for any adapter (run by
``tests/connectors/test_conformance.py`` through each adapter's plugin).

Both engines run in the test process, one transport per rank, the adapter named
by its connector name. ``break_loads`` injects a vanished peer into the consumer
ranks (:func:`~kvbridge.connectors.pd.faults.fail_next_loads`): the loads ordered
in that step lose their peers (the adapter's ``remove_peer``) just before posting,
and must come back as failed receives with their block ids.
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

#: the producer's lease in the cases: a failed load's blocks (whose consumer lost its
#: peer, so no release reaches the producer) are freed when it runs out, and the
#: failed_load case runs until they are; heartbeats (every lease / 3) keep the loads
#: that do run leased
LEASE_S = 10.0


def _break_loads(engine: Any, step: Any) -> None:
    from kvbridge.connectors.pd.faults import fail_next_loads

    for worker in engine.workers:
        fail_next_loads(worker.connector)


def _setup(connector: str, mode: TransferMode
           ) -> Callable[[Path], AbstractContextManager[CaseEnv]]:
    @contextmanager
    def setup(tmp: Path) -> Iterator[CaseEnv]:
        extra = {"mode": mode.value, "transfer_timeout_s": 10.0, "lease_s": LEASE_S}
        yield CaseEnv(producer=ConnectorConfig(connector, KVRole.PRODUCER, extra=extra),
                      consumer=ConnectorConfig(connector, KVRole.CONSUMER, extra=extra),
                      break_loads=_break_loads, async_loads=True)
    return setup


def pd_cases(connector: str, backends: tuple[str, ...]) -> tuple[ConformanceCase, ...]:
    """The cases of the PD connector ``connector`` (its plugin name), which needs
    ``backends`` (skipped, or failed under ``KVBRIDGE_REQUIRE_BACKENDS=1``, without)."""
    pull, push = TransferMode.PULL, TransferMode.PUSH
    return (
        ConformanceCase(f"{connector}-pull-gqa-tp1-tp2", CaseKind.PD, _setup(connector, pull),
                        model="tiny-gqa", consumer_topology=ParallelTopology(tp_size=2),
                        mode=pull, backends=backends, num_blocks=64),
        ConformanceCase(f"{connector}-push-hybrid-tp2-tp1", CaseKind.PD,
                        _setup(connector, push), model="tiny-hybrid",
                        producer_topology=ParallelTopology(tp_size=2), mode=push,
                        backends=backends, num_blocks=64),
        # two consumer ranks notify the one producer rank: every count they send is 2
        ConformanceCase(f"{connector}-push-gqa-tp1-tp2", CaseKind.PD, _setup(connector, push),
                        model="tiny-gqa", consumer_topology=ParallelTopology(tp_size=2),
                        mode=push, backends=backends, num_blocks=64),
    )
