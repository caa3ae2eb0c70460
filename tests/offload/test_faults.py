"""Fault injection: deterministic plans, each kind through the real I/O path."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

import pytest

from kvbridge.offload import FsTier
from kvbridge.offload.faults import ALL_KINDS, FaultKind, FaultPlan, FaultyFsIO
from kvbridge.offload.fs_io import encode_block_header, load_block, store_block
from kvbridge.offload.fs_layout import FileMapper
from kvbridge.offload.types import BatchIOError, OffloadError, ShortReadError

BLOCK = 4096
KEY_HASH = bytes(range(16))
#: a block file header without digests (format 2)
HDR = memoryview(encode_block_header(BLOCK, KEY_HASH, 1, None))


def test_rate_plan_is_deterministic_and_near_its_rate() -> None:
    plan = FaultPlan(rate=0.05, seed=3)
    draws = [plan.draw(f"/store/{i}.kvb", 0) for i in range(4000)]
    assert draws == [plan.draw(f"/store/{i}.kvb", 0) for i in range(4000)]
    hits = [d for d in draws if d is not None]
    assert 120 <= len(hits) <= 280                  # 5% of 4000 = 200, generous bounds
    assert set(hits) == set(ALL_KINDS)              # every kind is drawn
    other_seed = [FaultPlan(rate=0.05, seed=4).draw(f"/store/{i}.kvb", 0) for i in range(4000)]
    assert other_seed != draws
    assert FaultPlan().draw("/x", 0) is None


def test_plan_validation_names_the_field() -> None:
    with pytest.raises(OffloadError, match="rate"):
        FaultPlan(rate=1.5)
    with pytest.raises(OffloadError, match="kinds"):
        FaultPlan(rate=0.1, kinds=())
    with pytest.raises(OffloadError, match="slow_s"):
        FaultPlan(slow_s=-1)


@pytest.mark.parametrize("kind, errno_, kept", [
    (FaultKind.ELOOP, errno.ELOOP, True),
    (FaultKind.EIO, errno.EIO, True),
    (FaultKind.SHORT_READ, None, False),
])
def test_each_failing_kind_through_the_real_load_path(tmp_path, kind, errno_, kept) -> None:
    path = str(tmp_path / "blk.kvb")
    data = memoryview(bytearray(os.urandom(BLOCK)))
    io = FaultyFsIO(FaultPlan(per_key={b"k": kind}), lambda key: path)
    try:
        assert store_block(io, path, [data], BLOCK, direct=False, header=HDR)
        with pytest.raises(OSError) as info:
            load_block(io, path, [memoryview(bytearray(BLOCK))], BLOCK, direct=False,
                       header=memoryview(bytearray(len(HDR))), key_hash=KEY_HASH, num_layers=1)
        if errno_ is None:
            assert isinstance(info.value, ShortReadError) and info.value.deleted
        else:
            assert info.value.errno == errno_
        assert os.path.exists(path) is kept
        assert [f.kind for f in io.injected] == [kind]
    finally:
        io.close_injector()
    assert not os.path.exists(io.loop_path)             # the symlink loop is cleaned up


@pytest.mark.parametrize("kind", [FaultKind.CLOSE_ERROR, FaultKind.SLOW])
def test_non_failing_kinds_still_load_the_bytes(tmp_path, kind) -> None:
    path = str(tmp_path / "blk.kvb")
    data = bytes(os.urandom(BLOCK))
    io = FaultyFsIO(FaultPlan(per_key={b"k": kind}, slow_s=0.001), lambda key: path)
    try:
        store_block(io, path, [memoryview(bytearray(data))], BLOCK, direct=False, header=HDR)
        out = memoryview(bytearray(BLOCK))
        outcome = load_block(io, path, [out], BLOCK, direct=False,
                             header=memoryview(bytearray(len(HDR))), key_hash=KEY_HASH,
                             num_layers=1)
        assert bytes(out) == data
        assert outcome.close_error is (kind is FaultKind.CLOSE_ERROR)
        assert [f.kind for f in io.injected] == [kind]
    finally:
        io.close_injector()


def _fault_outcomes(root: Path, plan: FaultPlan, keys: list[bytes]) -> list[tuple[str, str]]:
    """Store ``keys`` in a fresh fs tier under ``root``, load each twice; per open that
    failed: (the block file's path under ``root``, the injected kind)."""
    block_bytes = 4096
    fingerprint = "0123456789abcdef"
    injector = FaultyFsIO(plan, FileMapper(str(root), fingerprint).path, root=str(root))
    tier = FsTier(str(root), block_bytes, fingerprint, use_o_direct=False, io=injector)
    try:
        tier.store(keys, [[memoryview(bytearray(block_bytes))] for _ in keys], [None] * len(keys))
        for _ in range(2):
            for key in keys:
                with contextlib.suppress(BatchIOError):   # injected: recorded below
                    tier.load([key], [[memoryview(bytearray(block_bytes))]], [])
        return [(os.path.relpath(f.path, root), f.kind.value) for f in injector.injected]
    finally:
        tier.close()
        injector.close_injector()


def test_the_seed_not_the_store_directory_decides_which_loads_fail(tmp_path: Path) -> None:
    """The chaos tests (tests/connectors/offloading/test_chaos.py) rely on ``seed`` for
    their mix of failed loads, and their store is a fresh temp directory each run: the
    fault draws must not depend on that directory. (They hashed the absolute path: every
    run drew afresh, and an estimated one run in two thousand injected a single kind,
    or nothing, and failed.)"""
    plan = FaultPlan(rate=0.2, kinds=(FaultKind.EIO, FaultKind.ELOOP), seed=3)
    keys = [f"block-{i}".encode() for i in range(64)]
    here = _fault_outcomes(tmp_path / "a", plan, keys)
    elsewhere = _fault_outcomes(tmp_path / "some" / "other-dir", plan, keys)
    assert here == elsewhere
    assert {kind for _, kind in here} == {"eio", "eloop"}   # faults fired, of both kinds
    assert len(here) < 2 * len(keys)                         # and not every load failed
