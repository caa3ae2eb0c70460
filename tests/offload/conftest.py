"""Fixtures of the offload tests: a temp store and tiers/managers that are always shut down."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvbridge.offload.cpu import CpuTier
from kvbridge.offload.fs import FsTier
from kvbridge.offload.manager import OffloadManager

BLOCK_BYTES = 4096
FINGERPRINT = "0123456789abcdef"


@pytest.fixture
def store_dir(tmp_path) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def make_fs(store_dir) -> Iterator[Callable[..., FsTier]]:
    """FsTier factory (defaults: the test store, 4 KiB blocks, a fixed fingerprint)."""
    tiers: list[FsTier] = []

    def factory(**kwargs: object) -> FsTier:
        kwargs.setdefault("root", store_dir)
        kwargs.setdefault("block_bytes", BLOCK_BYTES)
        kwargs.setdefault("fingerprint", FINGERPRINT)
        tier = FsTier(**kwargs)  # type: ignore[arg-type]
        tiers.append(tier)
        return tier

    yield factory
    for tier in tiers:
        tier.shutdown()


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
