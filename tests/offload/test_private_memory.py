"""PrivateMemory: the buffers O_DIRECT reads land in are process-private, huge-page
advised and aligned, kept from children, and unmapped only when nothing views them.

What the kernel made of the mapping is read back from ``/proc/self/smaps`` (its flags),
not taken from what the code asked for."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from kvbridge.offload.cpu import SlotMemory
from kvbridge.offload.private_memory import PrivateMemory, huge_page_bytes

THP = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")


def vma_of(address: int) -> dict[str, str]:
    """The smaps entry (its fields, and ``VmFlags``) of the mapping holding ``address``."""
    entry: dict[str, str] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if entry is not None:
                    break
                start, end = (int(x, 16) for x in head.split("-"))
                if start <= address < end:
                    entry = {"range": head, "perms": line.split()[1]}
            elif entry is not None:
                name, _, value = line.partition(":")
                entry[name] = value.strip()
    assert entry is not None, f"no mapping holds {address:#x}"
    return entry


def test_a_large_buffer_is_private_aligned_and_advised() -> None:
    huge = huge_page_bytes()
    memory = PrivateMemory(3 * huge + 4096)
    try:
        assert len(memory.view) == 3 * huge + 4096
        assert memory.address() % huge == 0
        assert not any(memory.view[:: 4096])           # zeroed
        memory.view[-1] = 7
        vma = vma_of(memory.address())
        assert vma["perms"][3] == "p"                  # MAP_PRIVATE, not shmem
        flags = vma["VmFlags"].split()
        assert "dc" in flags                           # MADV_DONTFORK
        if THP:
            assert memory.huge and "hg" in flags       # MADV_HUGEPAGE
    finally:
        assert memory.close()
    assert memory.closed


def test_a_small_buffer_is_private_and_page_aligned() -> None:
    memory = PrivateMemory(3 * mmap.PAGESIZE)
    try:
        assert memory.address() % mmap.PAGESIZE == 0
        assert not memory.huge
        assert vma_of(memory.address())["perms"][3] == "p"
    finally:
        assert memory.close()


def test_close_with_a_view_still_out_leaves_the_memory_to_it() -> None:
    memory = PrivateMemory(huge_page_bytes())
    array = np.frombuffer(memory.view, dtype=np.uint8)
    array[:4] = (1, 2, 3, 4)
    assert not memory.close()                          # the array still views it
    assert memory.closed
    assert array[:4].tolist() == [1, 2, 3, 4]          # still mapped, still readable
    assert memory.close()                              # a second close is a no-op


def test_bad_size_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        PrivateMemory(0)


def test_slot_memory_without_a_path_is_private() -> None:
    memory = SlotMemory(4, huge_page_bytes())
    try:
        memory.view(3)[:] = b"\x05" * huge_page_bytes()
        tensor = memory.as_tensor()
        assert tuple(tensor.shape) == (4, huge_page_bytes())
        assert int(tensor[3, -1]) == 5
        del tensor
        vma = vma_of(memory._address())
        assert vma["perms"][3] == "p"
        assert memory._address() % huge_page_bytes() == 0
    finally:
        memory.close()
