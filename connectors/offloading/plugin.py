"""The ``offloading`` plugin: a local tiered KV store (CPU, fs, obj) behind the connector API."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvbridge.connectors.api import (
    ConnectorContext,
    ConnectorPlugin,
    SchedulerConnector,
    WorkerConnector,
)
from kvbridge.connectors.config import ConnectorConfig, KVRole
from kvbridge.connectors.offloading.faults import install_load_faults
from kvbridge.connectors.offloading.scheduler import OffloadingScheduler
from kvbridge.connectors.offloading.settings import OffloadSettings, parse_settings
from kvbridge.connectors.offloading.worker import OffloadingWorker
from kvbridge.connectors.testing import CaseEnv, CaseKind, ConformanceCase
from kvbridge.layouts import ParallelTopology


class OffloadingPlugin(ConnectorPlugin):
    name = "offloading"
    description = ("local tiered KV store: CPU slots, then fs / Mooncake; prefix hits load, "
                   "new blocks store, failed loads recompute")
    # best effort reuse on one engine: it stores what it computes and loads what it finds
    supported_roles = frozenset({KVRole.BOTH})
    backends = ("torch",)

    @classmethod
    def parse_extra(cls, extra: Mapping[str, Any]) -> OffloadSettings:
        return parse_settings(extra)

    @classmethod
    def create_scheduler(cls, ctx: ConnectorContext) -> SchedulerConnector:
        return OffloadingScheduler(ctx)

    @classmethod
    def create_worker(cls, ctx: ConnectorContext) -> WorkerConnector:
        return OffloadingWorker(ctx)

    @classmethod
    def conformance_cases(cls) -> tuple[ConformanceCase, ...]:
        return offloading_cases()


def fail_worker_loads(engine: Any, step: Any) -> None:
    """``break_loads`` of the conformance suite: every copy into the engine this step fails."""
    for worker in engine.workers:
        connector = worker.connector
        if isinstance(connector, OffloadingWorker):
            install_load_faults(connector).fail_loads_of_next_step()


def offloading_cases() -> tuple[ConformanceCase, ...]:
    """CPU only (tiny-gqa), CPU + fs with TP 2 (tiny-hybrid: two regions), and a
    DCP case (tiny-mla) whose CPU tier is too small, so blocks come back from fs."""

    def setup(extra: dict[str, Any], fs: bool) -> Any:
        @contextmanager
        def make(tmp: Path) -> Iterator[CaseEnv]:
            settings = dict(extra)
            if fs:
                store = tmp / "offload"
                store.mkdir(parents=True, exist_ok=True)
                settings["fs_dir"] = str(store)
            yield CaseEnv(consumer=ConnectorConfig("offloading", KVRole.BOTH, extra=settings),
                          break_loads=fail_worker_loads)
        return make

    return (
        ConformanceCase("offloading-cpu", CaseKind.SINGLE, setup({}, fs=False)),
        ConformanceCase("offloading-fs-hybrid-tp2", CaseKind.SINGLE,
                        setup({"cpu_blocks": 64}, fs=True), model="tiny-hybrid",
                        consumer_topology=ParallelTopology(tp_size=2)),
        ConformanceCase("offloading-fs-small-cpu-dcp", CaseKind.SINGLE,
                        setup({"cpu_blocks": 4, "fs_o_direct": False}, fs=True),
                        model="tiny-mla",
                        consumer_topology=ParallelTopology(tp_size=2, dcp_size=2)),
    )


def multi_cases() -> tuple[ConformanceCase, ...]:
    """The ``multi`` connector's cases: shared_storage for PD plus offloading for reuse
    (the design's NIXL + offloading pairing without a NIXL backend), and offloading
    first with shared_storage behind it on one engine."""

    def children(store: Path, offload: Path, *, offload_first: bool) -> list[dict[str, Any]]:
        storage = {"connector": "shared_storage", "extra": {"path": str(store)}}
        offloading = {"connector": "offloading", "role": "kv_both",
                      "extra": {"cpu_blocks": 32, "fs_dir": str(offload),
                                "fs_o_direct": False}}
        return [offloading, storage] if offload_first else [storage, offloading]

    def dirs(tmp: Path) -> tuple[Path, Path]:
        store, offload = tmp / "store", tmp / "offload"
        store.mkdir(parents=True, exist_ok=True)
        offload.mkdir(parents=True, exist_ok=True)
        return store, offload

    def break_both(store: Path) -> Any:
        def break_loads(engine: Any, step: Any) -> None:
            for path in store.rglob("*.kv"):
                path.unlink(missing_ok=True)
            for worker in engine.workers:
                multi = worker.connector
                for child in getattr(multi, "children", ()):
                    if isinstance(child, OffloadingWorker):
                        install_load_faults(child).fail_loads_of_next_step()
        return break_loads

    @contextmanager
    def pd(tmp: Path) -> Iterator[CaseEnv]:
        store, offload = dirs(tmp)
        yield CaseEnv(
            producer=ConnectorConfig("multi", KVRole.PRODUCER, extra={
                "connectors": children(store, tmp / "offload-producer", offload_first=False)}),
            consumer=ConnectorConfig("multi", KVRole.CONSUMER, extra={
                "connectors": children(store, offload, offload_first=False)}),
            break_loads=break_both(store))

    @contextmanager
    def nixl_pd(tmp: Path) -> Iterator[CaseEnv]:
        from kvbridge.connectors.pd.conformance import LEASE_S

        _, offload = dirs(tmp)
        nixl = {"mode": "pull", "transfer_timeout_s": 10.0, "lease_s": LEASE_S}

        def pair(role: KVRole, fs_dir: Path) -> ConnectorConfig:
            return ConnectorConfig("multi", role, extra={"connectors": [
                {"connector": "nixl", "extra": nixl},
                {"connector": "offloading", "role": "kv_both",
                 "extra": {"cpu_blocks": 32, "fs_dir": str(fs_dir), "fs_o_direct": False}}]})

        def break_loads(engine: Any, step: Any) -> None:
            from kvbridge.connectors.pd.faults import fail_next_loads

            for worker in engine.workers:
                for child in getattr(worker.connector, "children", ()):
                    fail_next_loads(child)  # a NIXL child: its loads of the next step fail
                    if isinstance(child, OffloadingWorker):
                        install_load_faults(child).fail_loads_of_next_step()

        yield CaseEnv(producer=pair(KVRole.PRODUCER, tmp / "offload-producer"),
                      consumer=pair(KVRole.CONSUMER, offload), break_loads=break_loads,
                      async_loads=True)

    @contextmanager
    def single(tmp: Path) -> Iterator[CaseEnv]:
        store, offload = dirs(tmp)
        yield CaseEnv(consumer=ConnectorConfig("multi", KVRole.BOTH, extra={
            "connectors": children(store, offload, offload_first=True)}),
            break_loads=break_both(store))

    return (
        ConformanceCase("multi-storage+offloading-pd", CaseKind.PD, pd),
        ConformanceCase("multi-nixl+offloading-pd", CaseKind.PD, nixl_pd,
                        consumer_topology=ParallelTopology(tp_size=2),
                        backends=("nixl_cu12",), num_blocks=64),
        ConformanceCase("multi-offloading+storage-single-tp2", CaseKind.SINGLE, single,
                        model="tiny-hybrid", consumer_topology=ParallelTopology(tp_size=2)),
    )
