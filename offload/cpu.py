"""Primary tier: fixed-size CPU memory slots with reference counts.

The slot memory is one anonymous ``mmap`` (page aligned, so a slot whose size
is a multiple of the page size can be read or written with O_DIRECT, and the
whole buffer can be viewed as a torch tensor without a copy).

A slot is WRITING (a store from the engine or a promotion from a secondary
tier is filling it) or READY. It is *evictable* only when READY, pinned by no
request and read by no in-flight cascade job. Invariant: ``evict`` never
returns a pinned or in-flight slot (the policy is asked with ``can_evict``).
Scheduler-thread only; the slot bytes are touched by I/O threads but the
bookkeeping here is not.

Digests: beside each slot, the layer digests of its block
(``kvbridge.offload.blockdigest``; ``num_layers`` equal spans), taken when the
engine's bytes landed (``seal``) or carried up from the secondary tier the
block was promoted from (``set_digests``: the digests its writer took), and
handed to the secondary tiers with every cascade. ``check`` compares the
slot's bytes with them; a slot whose bytes do not match is *condemned*: no
lookup counts it again, and it is removed (a REMOVED event) as soon as no
request pins it and no job reads it.
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbridge.events.schema import Medium
from kvbridge.layouts.digests import VerifyPolicy
from kvbridge.offload.blockdigest import (
    DEFAULT_VERIFY,
    DigestMismatchError,
    LayerDigests,
    check_num_layers,
    first_mismatch,
    layer_digests,
)
from kvbridge.offload.fs_io import buffer_address
from kvbridge.offload.policy import EvictionPolicy, make_policy
from kvbridge.offload.private_memory import PrivateMemory
from kvbridge.offload.types import EventKind, OffloadError, OffloadEvent, OffloadKey

TIER_CPU = "cpu"


class SlotState(enum.Enum):
    WRITING_STORE = "writing_store"          # the engine is copying a computed block in
    WRITING_PROMOTION = "writing_promotion"  # a secondary tier is loading the block in
    READY = "ready"


@dataclass
class Slot:
    key: OffloadKey
    index: int
    state: SlotState
    #: requests holding this block (lookup hit or load in progress)
    pinned_by: set[str] = field(default_factory=set)
    #: in-flight jobs reading the slot (cascade to secondary tiers)
    io_refs: int = 0
    #: the tier a promoted block came from, until its first load (hit statistics)
    origin: str | None = None
    #: WRITING_PROMOTION only: when (manager clock) waiting requests give up on it
    deadline: float | None = None
    #: WRITING_PROMOTION only: the deadline passed (counted once)
    timed_out: bool = False
    #: its bytes failed their digest check: never counted again, removed once unreferenced
    corrupt: bool = False

    @property
    def evictable(self) -> bool:
        return self.state is SlotState.READY and not self.pinned_by and self.io_refs == 0


class SlotMemory:
    """``num_slots * block_bytes`` page-aligned bytes: private, or a shared file.

    Without ``path`` the slots are :class:`PrivateMemory` (advised for huge pages: the
    fs tier reads into them and writes from them with O_DIRECT, which wants physically
    contiguous pages). With ``path`` (e.g. under /dev/shm) the memory is a MAP_SHARED
    mapping of that file, so worker processes can ``SlotMemory.attach`` the same slots
    the scheduler-side tier manages; the creator removes the file on ``close``.

    A worker whose KV is on a CUDA device pins the mapping (:meth:`pin`, once,
    whichever worker asks first) so that its copies to and from the slots run
    asynchronously at the copy engine's speed; ``close`` unpins it. Host KV
    never pins.
    """

    def __init__(self, num_slots: int, block_bytes: int, path: str | None = None,
                 create: bool = True) -> None:
        if num_slots <= 0:
            raise OffloadError("num_slots", f"expected a positive count, got {num_slots}")
        if block_bytes <= 0:
            raise OffloadError("block_bytes", f"expected a positive size, got {block_bytes}")
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.path = path
        self._owner = create and path is not None
        nbytes = num_slots * block_bytes
        #: what ``buffer`` views: process-private memory, or the shared file's mapping
        self._private: PrivateMemory | None = None
        self._mmap: mmap.mmap | None = None
        if path is None:
            self._private = PrivateMemory(nbytes)
            self.buffer = self._private.view
        else:
            flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
            fd = os.open(path, flags, 0o600)
            try:
                if create:
                    os.ftruncate(fd, nbytes)
                elif os.fstat(fd).st_size != nbytes:
                    raise OffloadError("path", f"{path} holds {os.fstat(fd).st_size} bytes, "
                                       f"expected {nbytes}")
                self._mmap = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
            finally:
                os.close(fd)
            self.buffer = memoryview(self._mmap)
        self._pin_lock = threading.Lock()
        self.pinned = False

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.block_bytes

    def pin(self) -> bool:
        """Register the mapping with CUDA as pinned memory (idempotent); False if CUDA
        refused (logged; copies then run unpinned)."""
        from kvbridge.backends.device.copy import pin_host_memory

        with self._pin_lock:
            if not self.pinned:
                self.pinned = pin_host_memory(self._address(), self.nbytes)
            return self.pinned

    def _address(self) -> int:
        return buffer_address(self.buffer)

    @classmethod
    def attach(cls, path: str, num_slots: int, block_bytes: int) -> SlotMemory:
        """Map slots another process created (a worker attaching the scheduler's tier)."""
        return cls(num_slots, block_bytes, path, create=False)

    def view(self, index: int) -> memoryview:
        start = index * self.block_bytes
        return self.buffer[start:start + self.block_bytes]

    def as_tensor(self) -> object:
        """The slots as a torch uint8 tensor ``[num_slots, block_bytes]`` (no copy)."""
        import torch

        flat = torch.frombuffer(self.buffer, dtype=torch.uint8)
        return flat.view(self.num_slots, self.block_bytes)

    def close(self) -> None:
        """Unpin; unmap (if no view is still exported; else the GC unmaps later); remove
        our file."""
        with self._pin_lock:
            if self.pinned:
                from kvbridge.backends.device.copy import unpin_host_memory

                unpin_host_memory(self._address())
                self.pinned = False
        if self._private is not None:
            self._private.close()
        elif self._mmap is not None:
            try:
                self.buffer.release()
                self._mmap.close()
            except BufferError:
                pass
        if self._owner and self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
            self._owner = False


class CpuTier:
    """Slots of ``block_bytes`` each, ``num_slots`` of them, evicted by ``policy``.

    ``shm_path``: back the slots by a shared file there (see ``SlotMemory``).
    ``verify``: the policy of the store (the manager checks slots by it; ``off``:
    no digests are taken); ``num_layers``: equal layer spans of a block, one
    digest each.
    """

    name = TIER_CPU
    medium = Medium.CPU.value

    def __init__(self, num_slots: int, block_bytes: int, policy: str | EvictionPolicy = "lru",
                 shm_path: str | None = None, *, verify: VerifyPolicy = DEFAULT_VERIFY,
                 num_layers: int = 1) -> None:
        self.num_layers = check_num_layers(block_bytes, num_layers)
        self.verify = verify
        self.memory = SlotMemory(num_slots, block_bytes, shm_path)
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.policy = policy if isinstance(policy, EvictionPolicy) else make_policy(policy, num_slots)
        self._buffer = self.memory.buffer
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._slots: dict[OffloadKey, Slot] = {}
        self._events: list[OffloadEvent] = []
        self.evictions = 0
        #: per slot index: its layer digests, valid where ``_has_digests``
        self._digests = np.zeros((num_slots, self.num_layers), dtype="<u8")
        self._has_digests = np.zeros(num_slots, dtype=bool)
        #: blocks checked against their digests / without digests / that did not match
        self.loads_verified = 0
        self.loads_unverified = 0
        self.digest_mismatches = 0
        self.corrupt_removed = 0

    # -- memory -------------------------------------------------------------
    @property
    def buffer(self) -> memoryview:
        """The whole slot memory (``num_slots * block_bytes`` bytes)."""
        return self._buffer

    def view(self, index: int) -> memoryview:
        """Bytes of slot ``index`` (a view into the shared buffer, no copy)."""
        start = index * self.block_bytes
        return self._buffer[start:start + self.block_bytes]

    def as_tensor(self) -> object:
        """The slot memory as a torch uint8 tensor ``[num_slots, block_bytes]`` (no copy)."""
        return self.memory.as_tensor()

    # -- bookkeeping ---------------------------------------------------------
    def get(self, key: OffloadKey) -> Slot | None:
        return self._slots.get(key)

    def is_ready(self, key: OffloadKey) -> bool:
        slot = self._slots.get(key)
        return slot is not None and slot.state is SlotState.READY

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, keys: Sequence[OffloadKey], state: SlotState) -> list[Slot]:
        """Slots for the leading ``keys`` not yet resident, evicting as needed.

        Best effort: stops at the first key no slot can be found for (every
        resident block pinned or in flight) and returns the slots made so far,
        in key order. Keys already resident are skipped (the caller checks).
        """
        assert state is not SlotState.READY, "new slots start WRITING"
        made: list[Slot] = []
        evicted: list[OffloadKey] = []
        for key in keys:
            if key in self._slots:
                continue
            self.policy.admit(key)
            if not self._free:
                victim = self.policy.evict(self._can_evict)
                if victim is None:
                    break
                old = self._slots.pop(victim)
                assert old.evictable, "policy returned a pinned or in-flight slot"
                self._free.append(old.index)
                evicted.append(victim)
            slot = Slot(key=key, index=self._free.pop(), state=state)
            self._has_digests[slot.index] = False
            self._slots[key] = slot
            self.policy.insert(key)
            made.append(slot)
        if evicted:
            self.evictions += len(evicted)
            self._events.append(OffloadEvent(EventKind.REMOVED, tuple(evicted), TIER_CPU,
                                             self.medium))
        return made

    def _can_evict(self, key: OffloadKey) -> bool:
        slot = self._slots.get(key)
        return slot is not None and slot.evictable

    def mark_ready(self, keys: Iterable[OffloadKey]) -> None:
        """WRITING slots whose bytes are now complete become READY (emits STORED)."""
        done: list[OffloadKey] = []
        for key in keys:
            slot = self._slots[key]
            assert slot.state is not SlotState.READY, "slot completed twice"
            slot.state = SlotState.READY
            done.append(key)
        if done:
            self._events.append(OffloadEvent(EventKind.STORED, tuple(done), TIER_CPU,
                                             self.medium))

    def discard(self, keys: Iterable[OffloadKey]) -> list[str]:
        """Free WRITING slots whose write failed; returns the requests that had pinned them."""
        dropped_pins: list[str] = []
        for key in keys:
            slot = self._slots.pop(key, None)
            if slot is None:
                continue
            assert slot.state is not SlotState.READY, "discard is for failed writes only"
            assert slot.io_refs == 0, "a WRITING slot cannot be read by a job"
            dropped_pins.extend(slot.pinned_by)
            self.policy.remove(key)
            self._free.append(slot.index)
        return dropped_pins

    def pin(self, key: OffloadKey, request_id: str) -> None:
        self._slots[key].pinned_by.add(request_id)

    def unpin(self, key: OffloadKey, request_id: str) -> None:
        slot = self._slots.get(key)
        if slot is not None:
            slot.pinned_by.discard(request_id)
            if slot.corrupt and slot.evictable:
                self._drop_corrupt(slot)

    # -- digests --------------------------------------------------------------
    def seal(self, key: OffloadKey) -> LayerDigests:
        """Take the layer digests of ``key``'s slot bytes (they just landed) and keep them."""
        slot = self._slots[key]
        digests = layer_digests([self.view(slot.index)], self.num_layers)
        self._digests[slot.index] = digests
        self._has_digests[slot.index] = True
        return digests

    def set_digests(self, key: OffloadKey, digests: LayerDigests | None) -> None:
        """Keep ``digests`` (its writer's, from the tier it was promoted from) for ``key``."""
        index = self._slots[key].index
        if digests is None or len(digests) != self.num_layers:
            self._has_digests[index] = False
            return
        self._digests[index] = digests
        self._has_digests[index] = True

    def digests_of(self, key: OffloadKey) -> LayerDigests | None:
        index = self._slots[key].index
        if not self._has_digests[index]:
            return None
        return tuple(int(d) for d in self._digests[index])

    def check(self, key: OffloadKey) -> DigestMismatchError | None:
        """Compare ``key``'s slot bytes with its digests; the mismatch, or None.

        A slot without digests is not checked (None; the caller counts it unverified).
        """
        slot = self._slots[key]
        expected = self.digests_of(key)
        if expected is None:
            return None
        actual = layer_digests([self.view(slot.index)], self.num_layers)
        layer = first_mismatch(expected, actual)
        if layer is None:
            return None
        return DigestMismatchError(TIER_CPU, f"slot {slot.index}", key, layer, expected[layer],
                                   actual[layer])

    def condemn(self, key: OffloadKey) -> None:
        """``key``'s bytes are corrupt: never counted again; removed once unreferenced."""
        slot = self._slots[key]
        assert slot.state is SlotState.READY, "only READY slots are checked"
        slot.corrupt = True
        if slot.evictable:
            self._drop_corrupt(slot)

    def _drop_corrupt(self, slot: Slot) -> None:
        del self._slots[slot.key]
        self.policy.remove(slot.key)
        self._has_digests[slot.index] = False
        self._free.append(slot.index)
        self.corrupt_removed += 1
        self._events.append(OffloadEvent(EventKind.REMOVED, (slot.key,), TIER_CPU, self.medium))

    def add_io_ref(self, key: OffloadKey) -> None:
        slot = self._slots[key]
        assert slot.state is SlotState.READY, "only READY slots are read by jobs"
        slot.io_refs += 1

    def drop_io_ref(self, key: OffloadKey) -> None:
        slot = self._slots[key]
        assert slot.io_refs > 0, "io ref dropped twice"
        slot.io_refs -= 1
        if slot.corrupt and slot.evictable:
            self._drop_corrupt(slot)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            if key in self._slots:
                self.policy.access(key)

    def take_events(self) -> list[OffloadEvent]:
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        """Unmap the slots; if views are still exported (a tensor), the GC unmaps later."""
        self.memory.close()
