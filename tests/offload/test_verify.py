"""Verified KV in the offload tiers: digests taken where the bytes land, checked before a
block counts as loaded; a mismatch is a failed load of exactly that block.

Real files and real system calls; corruption is made by changing bytes of the real
block file (or the real CPU slot) with its size unchanged, or by the fault injector's
CORRUPT kind, which does the same just before the tier opens the file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from kvbridge.layouts.digests import DigestMode, VerifyPolicy, combine
from kvbridge.offload.blockdigest import layer_digests
from kvbridge.offload.cpu import CpuTier
from kvbridge.offload.faults import FaultKind, FaultPlan, FaultyFsIO
from kvbridge.offload.fs import DEFAULT_READ_THREADS, DEFAULT_WRITE_THREADS, FsTier
from kvbridge.offload.fs_io import decode_block_header
from kvbridge.offload.fs_layout import FileMapper
from kvbridge.offload.manager import OffloadManager
from kvbridge.offload.runner import TierRunner
from kvbridge.offload.testing import block_content
from kvbridge.offload.types import EventKind, LookupResult, LookupStatus
from tests.offload.test_deadlines import settle

BLOCK = 4096
LAYERS = 4
FP = "d1d2d3d4d5d6d7d8"
OFF = VerifyPolicy(DigestMode.OFF)
STRICT = VerifyPolicy(DigestMode.FULL, allow_unverified=False)


def k(i: int) -> bytes:
    return b"vk|%d" % i


def make(tmp_path, *, verify: VerifyPolicy = VerifyPolicy(DigestMode.FULL), cpu_verify: VerifyPolicy | None = None,
         slots: int = 4, faults: FaultPlan | None = None,
         quarantine_after: int = 3) -> tuple[OffloadManager, TierRunner]:
    root = str(tmp_path / "store")
    io = None if faults is None else FaultyFsIO(faults, FileMapper(root, FP).path, root=root)
    tier = TierRunner(FsTier(root, BLOCK, FP, use_o_direct=False, verify=verify,
                             num_layers=LAYERS, io=io, quarantine_after=quarantine_after,
                             clock=lambda: 0.0),
                      read_threads=DEFAULT_READ_THREADS, write_threads=DEFAULT_WRITE_THREADS,
                      clock=lambda: 0.0)
    primary = CpuTier(slots, BLOCK, verify=verify if cpu_verify is None else cpu_verify,
                      num_layers=LAYERS)
    return OffloadManager(primary, [tier], clock=lambda: 0.0), tier


@pytest.fixture
def env(tmp_path) -> Iterator[tuple[OffloadManager, TierRunner]]:
    m, tier = make(tmp_path)
    yield m, tier
    m.shutdown()


def compute(m: OffloadManager, request_id: str, keys: list[bytes]) -> None:
    spec = m.prepare_store(request_id, keys)
    for key, slot in zip(spec.keys, spec.slots, strict=True):
        m.primary.view(slot)[:] = block_content(key, BLOCK)
    m.complete_store(spec.keys)
    assert m.wait_idle()
    m.request_finished(request_id)


_fills = iter(range(10**9))


def evict(m: OffloadManager) -> None:
    compute(m, "fill", [b"fill|%d" % next(_fills) for _ in range(m.primary.num_slots)])


def flip(path: str, offset: int) -> None:
    """XOR one byte at ``offset`` of the file (its size unchanged)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x5A]))
    assert os.path.getsize(path) == size


def removed(m: OffloadManager, tier_name: str) -> list[tuple[bytes, ...]]:
    return [e.keys for e in m.take_events()
            if e.kind is EventKind.REMOVED and e.tier == tier_name]


def copied(m: OffloadManager, request_id: str, keys: list[bytes]) -> list[bytes]:
    """What the engine would copy out of the slots of the HIT prefix (then unpinned)."""
    result = m.lookup(request_id, keys)
    spec = m.prepare_load(request_id, keys[:result.num_blocks])
    out = [bytes(m.primary.view(slot)) for slot in spec.slots]
    m.complete_load(request_id, spec.keys)
    return out


# ---- fs tier -------------------------------------------------------------------------------

def test_store_writes_the_cpu_slots_layer_digests_into_the_block_file(env) -> None:
    m, tier = env
    compute(m, "w", [k(0)])
    with open(tier.tier.path(k(0)), "rb") as fh:
        data = fh.read()
    header = decode_block_header(tier.tier.path(k(0)), data)
    payload = memoryview(data)[header.header_bytes:]
    assert header.num_layers == LAYERS and len(payload) == BLOCK
    assert header.layer_digests == layer_digests([payload], LAYERS)
    assert header.layer_digests == m.primary.digests_of(k(0))
    assert len(header.layer_digests) == LAYERS and combine(header.layer_digests) != 0


def test_a_torn_block_of_the_right_size_fails_only_that_block_and_is_removed(
        env, caplog) -> None:
    m, tier = env
    keys = [k(0), k(1), k(2)]
    compute(m, "w", keys)
    evict(m)
    path = tier.tier.path(k(1))
    header_bytes = tier.tier.header_bytes
    flip(path, header_bytes + 2 * (BLOCK // LAYERS) + 7)     # inside layer 2
    removed(m, "fs")
    with caplog.at_level(logging.WARNING, logger="kvbridge.offload.runner"):
        result = settle(m, "r", keys)
    # exactly k(1) failed: k(0) and k(2) (after it in the same batch) were loaded,
    # verified and kept; the request's prefix ends at k(1) (the engine recomputes from
    # its first token), and k(2) waits READY in CPU memory
    assert result == LookupResult(LookupStatus.HIT, 1)
    assert m.failed_loads("r") == (k(1),)
    assert m.primary.is_ready(k(0)) and m.primary.is_ready(k(2))
    assert k(1) not in m.primary
    assert tier.stats.loads_ok == 2 and tier.stats.loads_failed == 1
    assert not os.path.exists(path)                           # provable corruption: removed
    assert os.path.exists(tier.tier.path(k(0))) and os.path.exists(tier.tier.path(k(2)))
    assert tier.stats.digest_mismatches == 1 and tier.stats.files_deleted == 1
    assert tier.tier.counters.loads_verified == 2
    assert removed(m, "fs") == [(k(1),)]
    # logged once, with the ids needed to debug: tier, file, key, layer
    lines = [r.getMessage() for r in caplog.records if "digest mismatch" in r.getMessage()]
    assert len(lines) == 1
    assert "fs" in lines[0] and k(1).hex() in lines[0] and "layer 2" in lines[0]
    assert path in lines[0]
    # the request loads what verified and recomputes the rest; never a hit again
    assert copied(m, "r", keys) == [block_content(k(0), BLOCK)]
    m.request_finished("r")
    assert settle(m, "r2", [k(1)]) == LookupResult(LookupStatus.MISS, 0)
    m.request_finished("r2")
    compute(m, "r3", [k(1)])                                   # recomputed: stored again
    evict(m)
    assert settle(m, "r4", keys[:2]) == LookupResult(LookupStatus.HIT, 2)
    assert copied(m, "r4", keys[:2]) == [block_content(key, BLOCK) for key in keys[:2]]


def test_the_fault_injectors_corrupt_kind_goes_through_the_real_load(tmp_path) -> None:
    m, tier = make(tmp_path, faults=FaultPlan(per_key={k(0): FaultKind.CORRUPT}))
    try:
        compute(m, "w", [k(0), k(1)])
        evict(m)
        size = os.path.getsize(tier.tier.path(k(0)))
        assert settle(m, "r", [k(0), k(1)]) == LookupResult(LookupStatus.MISS, 0)
        assert m.failed_loads("r") == (k(0),) and m.primary.is_ready(k(1))
        assert isinstance(tier.tier.io, FaultyFsIO)
        assert tier.tier.io.injected_kinds() == {FaultKind.CORRUPT: 1}
        assert not os.path.exists(tier.tier.path(k(0))) and tier.stats.digest_mismatches == 1
        assert size == os.path.getsize(tier.tier.path(k(1)))         # the size was never the clue
    finally:
        m.shutdown()


def test_corrupt_blocks_fail_alone_and_a_real_io_error_still_stops_the_batch(tmp_path) -> None:
    plan = FaultPlan(per_key={k(0): FaultKind.CORRUPT, k(2): FaultKind.CORRUPT,
                              k(4): FaultKind.EIO})
    m, tier = make(tmp_path, faults=plan, slots=8)
    try:
        keys = [k(i) for i in range(6)]
        compute(m, "w", keys)
        evict(m)
        removed(m, "fs")
        assert settle(m, "r", keys) == LookupResult(LookupStatus.MISS, 0)
        # k0 and k2 failed their digests (alone: k1 and k3 loaded); k4's EIO stopped the
        # batch (k4 and k5 not loaded: the seed's rule for a failure that is not provable)
        assert m.failed_loads("r") == (k(0), k(2), k(4), k(5))
        assert [m.primary.is_ready(key) for key in keys] == [False, True, False, True, False,
                                                              False]
        assert tier.stats.digest_mismatches == 2 and tier.stats.files_deleted == 2
        assert sorted(removed(m, "fs")) == [(k(0),), (k(2),)]
        assert [os.path.exists(tier.tier.path(key)) for key in keys] == [False, True, False, True,
                                                                    True, True]
    finally:
        m.shutdown()


def test_another_keys_block_under_this_name_is_a_failed_load_and_removed(env) -> None:
    m, tier = env
    compute(m, "w", [k(0), k(1)])
    evict(m)
    with open(tier.tier.path(k(0)), "rb") as src:
        theirs = src.read()
    with open(tier.tier.path(k(1)), "wb") as dst:
        dst.write(theirs)                                      # k(0)'s bytes under k(1)
    assert settle(m, "r", [k(1)]) == LookupResult(LookupStatus.MISS, 0)
    assert m.failed_loads("r") == (k(1),)
    assert not os.path.exists(tier.tier.path(k(1))) and tier.stats.files_deleted == 1


def test_verify_off_takes_no_digests_and_checks_nothing(tmp_path) -> None:
    m, tier = make(tmp_path, verify=OFF)
    try:
        compute(m, "w", [k(0)])
        assert m.primary.digests_of(k(0)) is None               # nothing hashed on store
        with open(tier.tier.path(k(0)), "rb") as fh:
            header = decode_block_header(tier.tier.path(k(0)), fh.read())
        assert header.layer_digests is None                    # and none written
        evict(m)
        flip(tier.tier.path(k(0)), tier.tier.header_bytes + 5)
        assert settle(m, "r", [k(0)]) == LookupResult(LookupStatus.HIT, 1)
        served = copied(m, "r", [k(0)])[0]
        assert served != block_content(k(0), BLOCK)            # off means not checked
        assert tier.tier.counters.loads_verified == tier.stats.digest_mismatches == 0
        assert tier.tier.counters.loads_unverified == 0
        assert m.primary.loads_verified == m.primary.digest_mismatches == 0
    finally:
        m.shutdown()


def test_a_block_stored_without_digests_is_served_counted_or_refused(tmp_path) -> None:
    writer, tier = make(tmp_path / "a", verify=OFF)
    try:
        compute(writer, "w", [k(0)])
    finally:
        writer.shutdown()
    m, tier = make(tmp_path / "a")                           # full, unverified allowed
    try:
        assert settle(m, "r", [k(0)]) == LookupResult(LookupStatus.HIT, 1)
        assert copied(m, "r", [k(0)]) == [block_content(k(0), BLOCK)]
        assert tier.tier.counters.loads_unverified == 1 and m.primary.loads_unverified == 1
    finally:
        m.shutdown()
    m, tier = make(tmp_path / "a", verify=STRICT)            # refused: a failed load, kept
    try:
        assert settle(m, "r", [k(0)]) == LookupResult(LookupStatus.MISS, 0)
        assert m.failed_loads("r") == (k(0),) and os.path.exists(tier.tier.path(k(0)))
    finally:
        m.shutdown()


def test_a_format_1_block_file_is_a_miss_kept_then_quarantined_never_a_crash(tmp_path) -> None:
    m, tier = make(tmp_path, quarantine_after=2)
    try:
        path = tier.tier.path(k(0))
        with open(path, "wb") as fh:                           # what version 1 wrote
            fh.write(block_content(k(0), BLOCK))
        for r in range(2):
            assert settle(m, f"r{r}", [k(0)]) == LookupResult(LookupStatus.MISS, 0)
            m.request_finished(f"r{r}")
            assert os.path.exists(path) is (r == 0)           # kept, until quarantine
        assert tier.stats.files_deleted == 0 and tier.stats.files_quarantined == 1
        assert tier.tier.counters.extra["legacy_format_loads"] == 2
        compute(m, "w", [k(0)])                                # written again, format 2
        with open(path, "rb") as fh:
            assert decode_block_header(path, fh.read()).layer_digests is not None
    finally:
        m.shutdown()


def test_sample_mode_checks_a_deterministic_subset(tmp_path) -> None:
    sample = VerifyPolicy(DigestMode.SAMPLE, sample_fraction=0.5)
    m, tier = make(tmp_path, verify=sample, slots=16)
    try:
        keys = [k(i) for i in range(12)]
        compute(m, "w", keys)
        evict(m)
        assert settle(m, "r", keys) == LookupResult(LookupStatus.HIT, 12)
        checked = tier.tier.counters.loads_verified
        assert 0 < checked < 12
        m.request_finished("r")
    finally:
        m.shutdown()
    m, tier = make(tmp_path, verify=sample, slots=16)         # another process, same choice
    try:
        assert settle(m, "r", keys) == LookupResult(LookupStatus.HIT, 12)
        assert tier.tier.counters.loads_verified == checked
    finally:
        m.shutdown()


# ---- CPU tier ------------------------------------------------------------------------------

def test_a_cpu_slot_corrupted_after_store_is_detected_and_removed(env, caplog) -> None:
    m, tier = env
    keys = [k(0), k(1), k(2)]
    compute(m, "w", keys)
    slot = m.primary.get(k(1))
    assert slot is not None
    m.primary.view(slot.index)[BLOCK - 1] ^= 0x01               # after the store landed
    m.take_events()
    with caplog.at_level(logging.WARNING, logger="kvbridge.offload.manager"):
        assert m.lookup("r", keys) == LookupResult(LookupStatus.HIT, 1)
    assert m.failed_loads("r") == (k(1),)
    assert m.primary.digest_mismatches == 1 and k(1) not in m.primary
    assert removed(m, "cpu") == [(k(1),)]
    line = [r.getMessage() for r in caplog.records if "digest mismatch" in r.getMessage()]
    assert len(line) == 1 and "cpu" in line[0] and k(1).hex() in line[0]
    assert "layer 3" in line[0]
    assert copied(m, "r", keys) == [block_content(k(0), BLOCK)]
    m.request_finished("r")
    # never a hit again from CPU; the fs copy (good bytes) is what the next request loads
    assert settle(m, "r2", keys) == LookupResult(LookupStatus.HIT, 3)
    assert copied(m, "r2", keys) == [block_content(key, BLOCK) for key in keys]
    assert m.primary.loads_verified >= 3


def test_a_corrupt_slot_pinned_by_another_request_is_removed_once_released(env) -> None:
    m, _ = env
    compute(m, "w", [k(0)])
    assert m.lookup("a", [k(0)]) == LookupResult(LookupStatus.HIT, 1)   # a pins it
    slot = m.primary.get(k(0))
    assert slot is not None
    m.primary.view(slot.index)[0] ^= 0xFF
    assert m.lookup("b", [k(0)]).num_blocks == 0
    assert m.failed_loads("b") == (k(0),) and k(0) in m.primary      # a still pins it
    assert m.lookup("c", [k(0)]).num_blocks == 0                      # never counted again
    m.take_events()
    m.request_finished("a")
    assert k(0) not in m.primary and removed(m, "cpu") == [(k(0),)]
    assert m.primary.digest_mismatches == 1


def test_a_promoted_slot_keeps_the_files_digests_and_is_checked_again(env) -> None:
    m, tier = env
    compute(m, "w", [k(0)])
    stored = m.primary.digests_of(k(0))
    evict(m)
    assert settle(m, "r", [k(0)]) == LookupResult(LookupStatus.HIT, 1)
    assert m.primary.digests_of(k(0)) == stored
    m.request_finished("r")
    slot = m.primary.get(k(0))
    assert slot is not None
    m.primary.view(slot.index)[100] ^= 0x10
    assert m.lookup("r2", [k(0)]).num_blocks == 0 and m.failed_loads("r2") == (k(0),)


def test_cpu_verify_off_checks_nothing(tmp_path) -> None:
    m, _ = make(tmp_path, verify=OFF)
    try:
        compute(m, "w", [k(0)])
        slot = m.primary.get(k(0))
        assert slot is not None
        m.primary.view(slot.index)[0] ^= 0xFF
        assert m.lookup("r", [k(0)]) == LookupResult(LookupStatus.HIT, 1)
        assert m.primary.loads_verified == m.primary.digest_mismatches == 0
    finally:
        m.shutdown()
