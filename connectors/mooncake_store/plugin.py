"""The ``mooncake_store`` plugin: registry entry, settings parsing, conformance cases."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from kvbridge.connectors.api import (
    ConnectorContext,
    ConnectorPlugin,
    SchedulerConnector,
    WorkerConnector,
)
from kvbridge.connectors.config import ConnectorConfig, KVRole
from kvbridge.connectors.mooncake_store import clients
from kvbridge.connectors.mooncake_store.scheduler import MooncakeStoreScheduler
from kvbridge.connectors.mooncake_store.settings import MooncakeStoreSettings, parse_settings
from kvbridge.connectors.mooncake_store.worker import MooncakeStoreWorker
from kvbridge.connectors.testing import CaseEnv, CaseKind, ConformanceCase
from kvbridge.layouts import ParallelTopology

CONNECTOR = "mooncake_store"


class MooncakeStorePlugin(ConnectorPlugin):
    name = CONNECTOR
    description = ("blocks go to and come from a Mooncake distributed store under namespaced "
                   "keys: zero-copy batch put/get, asynchronous lookups, failures are misses")
    supported_roles = frozenset(KVRole)
    backends = ("torch", "mooncake")

    @classmethod
    def parse_extra(cls, extra: Mapping[str, Any]) -> MooncakeStoreSettings:
        return parse_settings(extra)

    @classmethod
    def create_scheduler(cls, ctx: ConnectorContext) -> SchedulerConnector:
        return MooncakeStoreScheduler(ctx)

    @classmethod
    def create_worker(cls, ctx: ConnectorContext) -> WorkerConnector:
        return MooncakeStoreWorker(ctx)

    @classmethod
    def conformance_cases(cls) -> tuple[ConformanceCase, ...]:
        return conformance_cases()


def _remove_loading_blocks(engine: Any, step: Any) -> None:
    """``break_loads``: delete from the store every block of the loads starting this step."""
    scheduler = engine.scheduler_connector
    assert isinstance(scheduler, MooncakeStoreScheduler)
    blocks: dict[int, list[bytes]] = {}
    for request_id in engine.loads_started:
        request = engine.requests.get(request_id)
        if request is None:
            continue
        for region, hashes in enumerate(request.hashes):
            blocks.setdefault(region, []).extend(hashes)
    scheduler.remove_blocks(blocks)


def _leaks() -> list[str]:
    return [f"Mooncake client still open: {key}" for key in clients.live_keys()]


def conformance_cases() -> tuple[ConformanceCase, ...]:
    """A PD pair with async loads (hybrid, TP 2) and a kv_both engine with sync loads
    (MLA, TP 2 x DCP 2), each against a ``mooncake_master`` of its own."""

    def case(role_pair: bool, extra: dict[str, Any]) -> Callable[
            [Path], AbstractContextManager[CaseEnv]]:
        @contextmanager
        def setup(tmp: Path) -> Iterator[CaseEnv]:
            import kvbridge.backends  # noqa: F401  (Mooncake env defaults)
            from kvbridge.backends.mooncake.master import MooncakeMaster

            with MooncakeMaster(log_path=tmp / "mooncake_master.log") as master:
                settings = {"master_address": master.rpc_address,
                            "metadata_server": master.metadata_url,
                            "global_segment_size": 32 << 20, "local_buffer_size": 4 << 20,
                            "op_timeout_s": 3.0, **extra}
                if role_pair:
                    yield CaseEnv(
                        producer=ConnectorConfig(CONNECTOR, KVRole.PRODUCER, extra=settings),
                        consumer=ConnectorConfig(CONNECTOR, KVRole.CONSUMER, extra=settings),
                        break_loads=_remove_loading_blocks,
                        async_loads=bool(settings.get("load_async", True)),
                        check_released=_leaks)
                else:
                    yield CaseEnv(consumer=ConnectorConfig(CONNECTOR, KVRole.BOTH, extra=settings),
                                  break_loads=_remove_loading_blocks,
                                  async_loads=bool(settings.get("load_async", True)),
                                  check_released=_leaks)
        return setup

    return (
        ConformanceCase("mooncake_store-pd-async", CaseKind.PD, case(True, {}),
                        model="tiny-hybrid", producer_topology=ParallelTopology(tp_size=2),
                        consumer_topology=ParallelTopology(tp_size=2),
                        backends=("mooncake.store",)),
        ConformanceCase("mooncake_store-single-dcp-sync", CaseKind.SINGLE,
                        case(False, {"load_async": False}), model="tiny-mla",
                        consumer_topology=ParallelTopology(tp_size=2, dcp_size=2),
                        backends=("mooncake.store",)),
    )
