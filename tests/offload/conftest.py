"""Fixtures of the offload tests: a temp store and tiers/managers that are always shut down."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvbridge.offload.cpu import CpuTier
from kvbridge.offload.faults import FaultyFsIO
from kvbridge.offload.fs import DEFAULT_READ_THREADS, DEFAULT_WRITE_THREADS, FsTier
from kvbridge.offload.fs_layout import FileMapper
from kvbridge.offload.manager import OffloadManager
from kvbridge.offload.runner import TierRunner

BLOCK_BYTES = 4096
FINGERPRINT = "0123456789abcdef"


@pytest.fixture
def store_dir(tmp_path) -> str:
    return str(tmp_path / "store")


#: keyword arguments of ``make_fs`` that go to the runner, not the tier
RUNNER_KWARGS = ("read_threads", "write_threads", "probe_timeout_s", "load_timeout_s",
                 "remember_present")


@pytest.fixture
def make_fs(store_dir) -> Iterator[Callable[..., TierRunner]]:
    """An fs tier run by its runner (defaults: the test store, 4 KiB blocks, a fixed
    fingerprint, the fs tier's thread counts). ``faults=FaultPlan``: the tier's I/O is a
    ``FaultyFsIO`` of that plan (around ``io=`` if given); ``clock`` goes to both."""
    runners: list[TierRunner] = []
    injectors: list[FaultyFsIO] = []

    def factory(**kwargs: object) -> TierRunner:
        kwargs.setdefault("root", store_dir)
        kwargs.setdefault("block_bytes", BLOCK_BYTES)
        kwargs.setdefault("fingerprint", FINGERPRINT)
        run: dict[str, object] = {"read_threads": DEFAULT_READ_THREADS,
                                  "write_threads": DEFAULT_WRITE_THREADS}
        run.update({name: kwargs.pop(name) for name in RUNNER_KWARGS if name in kwargs})
        if "clock" in kwargs:
            run["clock"] = kwargs["clock"]
        plan = kwargs.pop("faults", None)
        if plan is not None:
            root = str(kwargs["root"])
            mapper = FileMapper(root, str(kwargs["fingerprint"]))
            injector = FaultyFsIO(plan, mapper.path, kwargs.get("io"),  # type: ignore[arg-type]
                                  root=root)
            injectors.append(injector)
            kwargs["io"] = injector
        runner = TierRunner(FsTier(**kwargs), **run)  # type: ignore[arg-type]
        runners.append(runner)
        return runner

    yield factory
    for runner in runners:
        runner.shutdown()
    for injector in injectors:
        injector.close_injector()


@pytest.fixture
def make_manager(make_fs) -> Iterator[Callable[..., OffloadManager]]:
    """OffloadManager factory: CPU tier of ``num_slots`` plus (by default) one fs tier."""
    managers: list[OffloadManager] = []

    def factory(num_slots: int = 8, policy: str = "lru", fs: bool = True,
                **fs_kwargs: object) -> OffloadManager:
        tiers = [make_fs(**fs_kwargs)] if fs else []
        manager = OffloadManager(CpuTier(num_slots, BLOCK_BYTES, policy), tiers)
        managers.append(manager)
        return manager

    yield factory
    for manager in managers:
        manager.shutdown()


@pytest.fixture(scope="module")
def mooncake_client(mooncake_master) -> Iterator[object]:
    """A Mooncake client of the shared master (64 MiB segment), one per test module."""
    from kvbridge.backends.mooncake import MooncakeConfig, MooncakeStoreClient

    config = MooncakeConfig(mooncake_master.rpc_address, mooncake_master.metadata_url,
                            global_segment_size=64 << 20, local_buffer_size=16 << 20,
                            op_timeout_s=10.0)
    with MooncakeStoreClient(config) as store_client:
        yield store_client
