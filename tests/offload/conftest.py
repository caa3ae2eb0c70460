"""Fixtures of the offload tests: a temp store, tiers that are always shut down."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import pytest

from kvbridge.offload.cpu import CpuTier
from kvbridge.offload.fs import FsTier
from kvbridge.offload.manager import OffloadManager

BLOCK_BYTES = 4096
FINGERPRINT = "0123456789abcdef"


def content(key: bytes, nbytes: int = BLOCK_BYTES) -> bytes:
    """The bytes a block of ``key`` holds (deterministic, differs per key)."""
    return hashlib.shake_128(b"kvbridge-test:" + key).digest(nbytes)


def key(i: int | str) -> bytes:
    return b"ns|" + str(i).encode()


@pytest.fixture
def make_fs(tmp_path) -> Iterator[Callable[..., FsTier]]:
    tiers: list[FsTier] = []

    def factory(**kwargs: object) -> FsTier:
        kwargs.setdefault("root", str(tmp_path / "store"))
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
