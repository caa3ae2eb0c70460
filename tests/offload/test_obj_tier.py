"""obj tier against a real mooncake_master: cascade, promotion, failed-load correction."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from kvbridge.offload.cpu import CpuTier
from kvbridge.offload.manager import OffloadManager
from kvbridge.offload.testing import block_content
from kvbridge.offload.types import EventKind, LookupResult, LookupStatus
from tests.conftest import require

require("mooncake.store", "Mooncake (mooncake-transfer-engine-non-cuda)")

from kvbridge.backends.mooncake import MooncakeConfig, MooncakeStoreClient  # noqa: E402
from kvbridge.offload.obj import ObjTier, run_obj_tier  # noqa: E402

BLOCK = 64 * 1024
MiB = 1 << 20


@pytest.fixture(scope="module")
def client(mooncake_client) -> MooncakeStoreClient:
    return mooncake_client


@pytest.fixture
def manager(client) -> Iterator[OffloadManager]:
    fingerprint = uuid.uuid4().hex[:16]            # a namespace per test
    m = OffloadManager(CpuTier(4, BLOCK), [run_obj_tier(ObjTier(client, BLOCK, fingerprint))])
    yield m
    m.shutdown()
    assert client.registered_buffers == {}       # the slot memory was unregistered


def key(i: int) -> bytes:
    return b"obj|" + str(i).encode()


def store(m: OffloadManager, keys: list[bytes]) -> None:
    spec = m.prepare_store("w", keys)
    for k, slot in zip(spec.keys, spec.slots, strict=True):
        m.primary.view(slot)[:] = block_content(k, BLOCK)
    m.complete_store(spec.keys)
    m.request_finished("w")
    assert m.wait_idle(30)


def settle(m: OffloadManager, request_id: str, keys: list[bytes]) -> LookupResult:
    for _ in range(5000):
        result = m.lookup(request_id, keys)
        if result.ready:
            return result
        m.step()
        time.sleep(0.001)
    raise AssertionError("no final verdict")


def test_cascade_then_promotion_from_mooncake(manager) -> None:
    keys = [key(i) for i in range(3)]
    store(manager, keys)
    tier = manager.secondaries[0]
    assert tier.stats.stores_ok == 3
    store(manager, [key(100 + i) for i in range(4)])   # evict the first three from CPU
    assert not any(k in manager.primary for k in keys)
    result = settle(manager, "r1", keys)
    assert result == LookupResult(LookupStatus.HIT, 3)
    spec = manager.prepare_load("r1", keys)
    assert [bytes(manager.primary.view(s)) for s in spec.slots] == [
        block_content(k, BLOCK) for k in keys]
    manager.complete_load("r1", keys)
    manager.request_finished("r1")
    assert manager.stats()["hits_by_tier"] == {"obj": 3}
    stored = [e for e in manager.take_events() if e.kind is EventKind.STORED and e.tier == "obj"]
    assert stored and all(e.medium == "STORAGE" and e.locality == "REMOTE" for e in stored)


def test_object_gone_between_probe_and_load_is_a_miss_without_retry(manager, client) -> None:
    keys = [key(i) for i in range(2)]
    store(manager, keys)
    store(manager, [key(100 + i) for i in range(4)])
    tier = manager.secondaries[0]
    # probe first (verdict True), then the object disappears before the load
    for _ in range(5000):
        if all(tier.cache.peek(k) for k in keys):
            break
        for k in keys:
            tier.lookup("r1", k)
        tier.step()
        tier.drain_results()
        time.sleep(0.001)
    removed = client.remove([tier.tier.object_name(key(1))], force=True)
    assert removed[0].ok
    result = settle(manager, "r1", keys)
    assert result == LookupResult(LookupStatus.HIT, 1)     # key 0 kept, key 1 recomputed
    assert manager.failed_loads("r1") == (key(1),)
    loads = tier.stats.loads_ok + tier.stats.loads_failed
    for _ in range(20):
        assert manager.lookup("r1", keys) == LookupResult(LookupStatus.HIT, 1)
        manager.step()
    assert tier.stats.loads_ok + tier.stats.loads_failed == loads
    assert tier.cache.num_enqueued == 2           # keys 0 and 1, once each


def test_short_object_is_removed_but_a_missing_one_removes_nothing(manager, client,
                                                                   monkeypatch) -> None:
    tier = manager.secondaries[0]
    short = bytearray(b"s" * (BLOCK // 2))
    import numpy as np
    ptr = int(np.frombuffer(short, dtype=np.uint8).ctypes.data)
    assert client.batch_put_from([tier.tier.object_name(key(7))], [ptr], [len(short)])[0].ok
    result = settle(manager, "r1", [key(7)])
    assert result == LookupResult(LookupStatus.MISS, 0)
    assert tier.stats.files_deleted == 1 and tier.stats.loads_failed == 1
    assert client.batch_exists([tier.tier.object_name(key(7))]) == [False]
    removed = [e for e in manager.take_events() if e.kind is EventKind.REMOVED and e.tier == "obj"]
    assert [e.keys for e in removed] == [(key(7),)]

    # a missing object (gone between the probe and the load): a miss that removes nothing,
    # seen on the real client (every remove the tier asks for is recorded)
    store(manager, [key(8)])
    store(manager, [key(100 + i) for i in range(4)])   # evict key 8 from the CPU tier
    for _ in range(5000):
        if tier.cache.peek(key(8)):
            break
        tier.lookup("r2", key(8))
        tier.step()
        tier.drain_results()
        time.sleep(0.001)
    assert tier.cache.peek(key(8)) is True
    assert client.remove([tier.tier.object_name(key(8))], force=True)[0].ok
    asked: list[list[str]] = []
    real_remove = client.remove

    def recorded_remove(names, *args, **kwargs):
        asked.append(list(names))
        return real_remove(names, *args, **kwargs)

    monkeypatch.setattr(client, "remove", recorded_remove)
    manager.take_events()
    failed_before = tier.stats.loads_failed
    result = settle(manager, "r2", [key(8)])
    assert result == LookupResult(LookupStatus.MISS, 0)
    assert manager.failed_loads("r2") == (key(8),)
    assert tier.stats.loads_failed == failed_before + 1       # the load was tried, and failed
    assert asked == [], "a missing object must not be removed (it may be written again)"
    assert tier.stats.files_deleted == 1                      # still only the short one
    assert not [e for e in manager.take_events()
                if e.kind is EventKind.REMOVED and e.tier == "obj"]


def test_timed_out_get_never_lands_in_a_slot_given_to_another_key(mooncake_master_fresh) -> None:
    """A get abandoned at its timeout keeps running inside Mooncake. Its slot must stay
    reserved until the client is idle again: otherwise the slot goes to key B, the late
    get writes A's bytes into it once the master resumes, and B serves (and cascades)
    A's bytes under B's key."""
    master = mooncake_master_fresh
    config = MooncakeConfig(master.rpc_address, master.metadata_url,
                            global_segment_size=64 * MiB, local_buffer_size=16 * MiB,
                            op_timeout_s=0.5)
    with MooncakeStoreClient(config) as client:
        tier = run_obj_tier(ObjTier(client, BLOCK, uuid.uuid4().hex[:16]), load_timeout_s=1.0,
                            probe_timeout_s=60.0)
        m = OffloadManager(CpuTier(1, BLOCK), [tier])   # one slot: any reuse is that slot
        a, b, filler = key(1), key(2), key(3)
        try:
            store(m, [a])
            store(m, [filler])                           # evicts a from CPU; a is in Mooncake
            for _ in range(5000):                        # a's verdict (True) while the master answers
                tier.lookup("r1", a)
                tier.step()
                tier.drain_results()
                if tier.cache.peek(a):
                    break
                time.sleep(0.001)
            assert tier.cache.peek(a) is True
            master.pause()
            try:
                assert m.lookup("r1", [a]).status is LookupStatus.HIT_PENDING  # the get starts
                deadline = time.monotonic() + 30
                while client.stats().timeouts == 0 and time.monotonic() < deadline:
                    m.step()
                    time.sleep(0.01)
                assert client.stats().timeouts >= 1          # abandoned, still inside Mooncake
                assert settle(m, "r1", [a]) == LookupResult(LookupStatus.MISS, 0)
                m.request_finished("r1")
                spec = m.prepare_store("w2", [b])            # another key wants the slot
                for k, slot in zip(spec.keys, spec.slots, strict=True):
                    m.primary.view(slot)[:] = block_content(k, BLOCK)
                m.complete_store(spec.keys)
                m.request_finished("w2")
                m.step()
            finally:
                master.resume()
            assert client.wait_idle(30)
            assert m.wait_idle(30)
            for k, slot in m.primary._slots.items():         # every block holds its own bytes
                assert bytes(m.primary.view(slot.index)) == block_content(k, BLOCK), k
            assert tier.stats.jobs_fenced == 1
            # the slot is free again: b is stored and served with b's bytes
            store(m, [b])
            assert settle(m, "r3", [b]) == LookupResult(LookupStatus.HIT, 1)
            spec = m.prepare_load("r3", [b])
            assert bytes(m.primary.view(spec.slots[0])) == block_content(b, BLOCK)
            m.complete_load("r3", [b])
            m.request_finished("r3")
            # and every object in Mooncake holds its own key's bytes
            staging = bytearray(BLOCK)
            import numpy as np
            ptr = int(np.frombuffer(staging, dtype=np.uint8).ctypes.data)
            for k in (a, b, filler):
                got = client.batch_get_into([tier.tier.object_name(k)], [ptr], [BLOCK])[0]
                if got.ok:
                    assert bytes(staging) == block_content(k, BLOCK), k
        finally:
            m.shutdown()


# ---- verified KV: a digest object beside each block object ---------------------------------

def _put_bytes(client, name: str, data: bytes) -> None:
    import numpy as np

    buf = bytearray(data)
    ptr = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)
    assert client.batch_put_from([name], [ptr], [len(buf)])[0].ok


def _evict(m: OffloadManager, tag: int) -> None:
    store(m, [key(1000 * tag + i) for i in range(m.primary.num_slots)])


def test_another_keys_bytes_under_an_object_name_are_detected_and_removed(manager,
                                                                          client) -> None:
    tier = manager.secondaries[0]
    a, b = key(1), key(2)
    store(manager, [a, b])
    assert client.batch_exists([tier.tier.digest_name(a), tier.tier.digest_name(b)]) == [True, True]
    _evict(manager, 1)
    # a's block object overwritten with b's bytes (remove + put: puts never overwrite)
    assert client.remove([tier.tier.object_name(a)], force=True)[0].ok
    _put_bytes(client, tier.tier.object_name(a), block_content(b, BLOCK))
    manager.take_events()
    result = settle(manager, "r", [a, b])                 # one batch: a fails alone
    assert result == LookupResult(LookupStatus.MISS, 0)
    assert manager.failed_loads("r") == (a,) and manager.primary.is_ready(b)
    assert tier.stats.digest_mismatches == 1 and tier.stats.files_deleted == 1
    assert client.batch_exists([tier.tier.object_name(a), tier.tier.digest_name(a)]) == [False, False]
    removed = [e.keys for e in manager.take_events()
               if e.kind is EventKind.REMOVED and e.tier == "obj"]
    assert removed == [(a,)]
    manager.request_finished("r")
    # b is untouched and verified; a recomputed and stored again loads verified
    store(manager, [a])
    _evict(manager, 2)
    assert settle(manager, "r2", [a, b]) == LookupResult(LookupStatus.HIT, 2)
    spec = manager.prepare_load("r2", [a, b])
    assert [bytes(manager.primary.view(s)) for s in spec.slots] == [
        block_content(a, BLOCK), block_content(b, BLOCK)]
    manager.complete_load("r2", [a, b])
    assert tier.tier.counters.loads_verified >= 2


def test_a_block_without_its_digest_object_is_served_unverified_and_counted(manager,
                                                                            client) -> None:
    tier = manager.secondaries[0]
    store(manager, [key(5)])
    _evict(manager, 3)
    assert client.remove([tier.tier.digest_name(key(5))], force=True)[0].ok   # evicted apart
    assert settle(manager, "r", [key(5)]) == LookupResult(LookupStatus.HIT, 1)
    assert tier.tier.counters.loads_unverified == 1 and tier.stats.digest_mismatches == 0
    assert manager.primary.digests_of(key(5)) is None


def test_verify_off_puts_no_digest_objects(client) -> None:
    from kvbridge.layouts.digests import DigestMode, VerifyPolicy

    off = VerifyPolicy(DigestMode.OFF)
    tier = run_obj_tier(ObjTier(client, BLOCK, uuid.uuid4().hex[:16], verify=off))
    m = OffloadManager(CpuTier(4, BLOCK, verify=off), [tier])
    try:
        store(m, [key(9)])
        assert client.batch_exists([tier.tier.object_name(key(9)),
                                    tier.tier.digest_name(key(9))]) == [True, False]
        _evict(m, 4)
        assert settle(m, "r", [key(9)]) == LookupResult(LookupStatus.HIT, 1)
        assert tier.tier.counters.loads_verified == tier.tier.counters.loads_unverified == 0
    finally:
        m.shutdown()
