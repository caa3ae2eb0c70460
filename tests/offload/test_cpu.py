"""Primary tier: slots, reference counts, never evicting a pinned or in-flight slot, events."""

from __future__ import annotations

import pytest

from kvbridge.offload.cpu import CpuTier, SlotState
from kvbridge.offload.types import EventKind, OffloadError


def k(i: int) -> bytes:
    return b"k%d" % i


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_pinned_writing_and_in_flight_slots_are_never_evicted(policy) -> None:
    tier = CpuTier(3, 4096, policy)
    try:
        a, b, c = tier.allocate([k(0), k(1), k(2)], SlotState.WRITING_STORE)
        tier.mark_ready([k(0), k(1)])              # k2 stays WRITING (in-flight write)
        tier.pin(k(0), "req")                      # k0 pinned by a request
        tier.add_io_ref(k(1))                      # k1 read by a cascade job
        assert tier.allocate([k(3)], SlotState.WRITING_STORE) == []   # nothing may leave
        assert tier.evictions == 0 and set(tier._slots) == {k(0), k(1), k(2)}
        tier.drop_io_ref(k(1))
        made = tier.allocate([k(3)], SlotState.WRITING_STORE)
        assert [s.key for s in made] == [k(3)] and made[0].index == b.index
        assert k(1) not in tier and tier.evictions == 1
        events = tier.take_events()
        assert [(e.kind, e.keys) for e in events] == [
            (EventKind.STORED, (k(0), k(1))), (EventKind.REMOVED, (k(1),))]
        assert all(e.medium == "CPU" and e.tier == "cpu" for e in events)
        assert tier.take_events() == []
    finally:
        tier.close()


def test_allocate_is_best_effort_and_skips_resident_keys() -> None:
    tier = CpuTier(2, 64)
    try:
        tier.allocate([k(0)], SlotState.WRITING_STORE)
        made = tier.allocate([k(0), k(1), k(2)], SlotState.WRITING_STORE)
        assert [s.key for s in made] == [k(1)]    # k0 resident, k2 has no room (all WRITING)
    finally:
        tier.close()


def test_discard_frees_a_failed_write_and_reports_waiters() -> None:
    tier = CpuTier(1, 64)
    try:
        tier.allocate([k(0)], SlotState.WRITING_PROMOTION)
        tier.pin(k(0), "r1")
        assert tier.discard([k(0)]) == ["r1"]
        assert k(0) not in tier and tier.num_free == 1
        assert tier.take_events() == []            # never announced, nothing to remove
    finally:
        tier.close()


def test_slot_views_share_one_buffer_and_tensor_view_aliases_it() -> None:
    tier = CpuTier(2, 4096)
    try:
        (slot,) = tier.allocate([k(0)], SlotState.WRITING_STORE)
        tier.view(slot.index)[:4] = b"abcd"
        tensor = tier.as_tensor()
        assert tuple(tensor.shape) == (2, 4096)
        assert bytes(tensor[slot.index, :4].numpy()) == b"abcd"
        del tensor
    finally:
        tier.close()


def test_bad_sizes_are_rejected_naming_the_field() -> None:
    with pytest.raises(OffloadError, match="num_slots"):
        CpuTier(0, 64)
    with pytest.raises(OffloadError, match="block_bytes"):
        CpuTier(1, 0)


def test_shared_slot_memory_is_seen_by_an_attached_mapping(tmp_path) -> None:
    from kvbridge.offload.cpu import SlotMemory

    path = str(tmp_path / "slots")
    tier = CpuTier(2, 4096, shm_path=path)
    worker = SlotMemory.attach(path, 2, 4096)
    try:
        (slot,) = tier.allocate([k(0)], SlotState.WRITING_STORE)
        worker.view(slot.index)[:5] = b"hello"          # the worker fills the slot
        assert bytes(tier.view(slot.index)[:5]) == b"hello"
        with pytest.raises(OffloadError, match="path"):
            SlotMemory.attach(path, 3, 4096)
    finally:
        worker.close()
        tier.close()
    assert not (tmp_path / "slots").exists()            # the creator removed it
