"""How a connector plugs into the conformance suite: the :class:`ConformanceCase` record.

A plugin returns its cases from ``ConnectorPlugin.conformance_cases()``; the
suite (``kvbridge.engine.conformance``, run by ``tests/connectors/
test_conformance.py`` for every registered connector) drives real reference
engines with them. This module holds only data and callbacks, so connectors can
build cases without importing the engine.

A case says what to run (one engine, or a producer/consumer pair), on which
model and topologies, and provides ``setup(tmp_dir)``: a context manager that
starts whatever the connector needs (a ``mooncake_master``, a directory ...)
and yields a :class:`CaseEnv` with the connector configs, plus an optional
``break_loads`` callback the suite calls on the loading engine between
scheduling and execution of each step of the failed-load scenario: it must make
the loads that start in that step fail (delete the files, kill the peer,
remove the keys ...). On exit the context manager tears everything down.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.connectors.config import ConnectorConfig, KVRole
from kvbridge.connectors.params import TransferMode
from kvbridge.layouts import ParallelTopology


class CaseKind(str, enum.Enum):
    PD = "pd"          # producer engine + consumer engine + router
    SINGLE = "single"  # one engine that stores, then (after a prefix-cache reset) loads


#: ``break_loads(engine, step)``: called on the loading engine after the
#: step's metadata is built and before its workers run. ``engine`` is a
#: ``kvbridge.engine.Engine``; ``step`` the step's ``SchedulerStep``.
BreakLoads = Callable[[Any, Any], None]


@dataclass(frozen=True)
class CaseEnv:
    """What ``ConformanceCase.setup`` yields.

    ``producer``: the producer engine's connector config (PD cases; None for
    SINGLE). ``consumer``: the consumer's (PD) or the single engine's config.
    ``break_loads``: see :data:`BreakLoads`; None skips the failed-load
    scenario for this case (say why in ``skip_reason``).
    ``async_loads``: True if this connector loads across steps, so a failed
    load must also show up in ``failed_recving``.
    ``check_released``: optional leak check run after shutdown.
    """

    consumer: ConnectorConfig
    producer: ConnectorConfig | None = None
    break_loads: BreakLoads | None = None
    async_loads: bool = False
    skip_reason: str = ""
    #: called after both engines shut down (still inside ``setup``): returns leaks found
    #: (registrations, handles, sockets the connector still holds), empty when clean
    check_released: Callable[[], list[str]] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ConformanceCase:
    """One way of running a connector through the suite.

    ``backends`` are module names the case needs (``"nixl_cu12"``,
    ``"mooncake.store"``): the test imports them with ``require`` so a missing
    backend skips locally and fails in CI.
    """

    name: str
    kind: CaseKind
    setup: Callable[[Path], AbstractContextManager[CaseEnv]]
    model: str = "tiny-gqa"
    producer_topology: ParallelTopology = field(default_factory=ParallelTopology)
    consumer_topology: ParallelTopology = field(default_factory=ParallelTopology)
    mode: TransferMode = TransferMode.PULL
    backends: tuple[str, ...] = ()
    num_blocks: int = 128


def _delete_block_files(root: Path) -> Callable[[Any, Any], None]:
    def break_loads(engine: Any, step: Any) -> None:
        for path in root.rglob("*.kv"):
            path.unlink(missing_ok=True)
    return break_loads


def shared_storage_cases() -> tuple[ConformanceCase, ...]:
    """The reference connector's cases: PD sync, PD with async loads/saves/lookups,
    a heterogeneous-TP single engine."""

    def pd(extra: dict[str, Any]) -> Callable[[Path], AbstractContextManager[CaseEnv]]:
        @contextmanager
        def setup(tmp: Path) -> Iterator[CaseEnv]:
            store = tmp / "store"
            store.mkdir(parents=True, exist_ok=True)
            yield CaseEnv(
                producer=ConnectorConfig("shared_storage", KVRole.PRODUCER,
                                         extra={"path": str(store), **extra}),
                consumer=ConnectorConfig("shared_storage", KVRole.CONSUMER,
                                         extra={"path": str(store), **extra}),
                break_loads=_delete_block_files(store),
                async_loads=bool(extra.get("load_async")))
        return setup

    @contextmanager
    def single(tmp: Path) -> Iterator[CaseEnv]:
        store = tmp / "store"
        store.mkdir(parents=True, exist_ok=True)
        yield CaseEnv(consumer=ConnectorConfig("shared_storage", KVRole.BOTH,
                                               extra={"path": str(store), "save_async": True}),
                      break_loads=_delete_block_files(store))

    return (
        ConformanceCase("shared_storage-pd-sync", CaseKind.PD, pd({})),
        ConformanceCase("shared_storage-pd-async", CaseKind.PD,
                        pd({"load_async": True, "lookup_async": True}),
                        model="tiny-hybrid", producer_topology=ParallelTopology(tp_size=2),
                        consumer_topology=ParallelTopology(tp_size=2)),
        ConformanceCase("shared_storage-single-dcp", CaseKind.SINGLE, single,
                        model="tiny-mla", consumer_topology=ParallelTopology(tp_size=2,
                                                                             dcp_size=2)),
    )
