"""Private anonymous memory for the buffers that O_DIRECT reads land in and writes leave from.

Why: ``mmap.mmap(-1, n)`` maps *shared* anonymous memory (Python's default flags are
MAP_SHARED), which Linux backs with shmem pages: no transparent huge pages (shmem's own
setting, ``shmem_enabled``, is usually ``never``) and pages scattered in physical
memory. A direct read or write hands the disk one segment per physically contiguous
run, so scattered pages split a 2 MiB transfer into hundreds of segments, and
virtio-blk takes at most ``max_segments`` (254 here) per request. Measured on the
2-core VM (/var/tmp, ext4; ``python -m kvbridge.tools.bench.direct_memory``, 64 files
of 2 MiB, 32 threads, six runs): a file took 1.8-2.0 disk requests from shared memory
and one from this memory, and reads into this memory were 1.49-1.71x and writes
1.28-1.38x as fast, CPU per read 189-238 -> 131-167 us (docs/backends.md).

A :class:`PrivateMemory` is a MAP_PRIVATE mapping, advised ``MADV_HUGEPAGE`` and
aligned to the huge page size when it is that large, and ``MADV_DONTFORK``: a child
process gets none of it (I/O threads may write it at any time; a child never needs
it, and copy-on-write pages under a read in flight are a hazard we never want).
Where the kernel refuses an advice (no THP support), the memory works without it.

Owns: the mapping and its aligned view. May not: be shared with another process
(use a file under /dev/shm for that, as :class:`~kvbridge.offload.cpu.SlotMemory`
does with a path).
"""

from __future__ import annotations

import mmap

from kvbridge.offload.fs_io import buffer_address

#: where the kernel says how large a transparent huge page is
_HPAGE_PMD_SIZE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
_DEFAULT_HUGE_BYTES = 2 << 20


def huge_page_bytes() -> int:
    """The transparent huge page size (2 MiB on x86-64), or 2 MiB if unknown."""
    try:
        with open(_HPAGE_PMD_SIZE) as f:
            size = int(f.read().strip())
    except (OSError, ValueError):
        return _DEFAULT_HUGE_BYTES
    return size if size > 0 and size & (size - 1) == 0 else _DEFAULT_HUGE_BYTES


def _advise(mapping: mmap.mmap, option: int | None, start: int, length: int) -> bool:
    if option is None or length <= 0:
        return False
    try:
        mapping.madvise(option, start, length)
    except (OSError, ValueError):
        return False
    return True


class PrivateMemory:
    """``nbytes`` of zeroed, page-aligned, process-private memory (``view``).

    When ``nbytes`` is at least one huge page, ``view`` starts on a huge page boundary
    (the mapping is one huge page larger) and the range is advised for huge pages.
    Pages are allocated on first touch. ``close`` unmaps, unless a view of it is still
    exported (then the garbage collector unmaps it later).
    """

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"expected a positive size, got {nbytes}")
        huge = huge_page_bytes()
        pad = huge if nbytes >= huge else 0
        self._map: mmap.mmap | None = mmap.mmap(
            -1, nbytes + pad, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20))
        self._whole = memoryview(self._map)
        skew = -buffer_address(self._whole) % huge if pad else 0
        #: whether the kernel took the huge page advice (False: no THP, or too small)
        self.huge = bool(pad) and _advise(self._map, getattr(mmap, "MADV_HUGEPAGE", None),
                                          skew, nbytes)
        _advise(self._map, getattr(mmap, "MADV_DONTFORK", None), 0, nbytes + pad)
        self.view: memoryview = self._whole[skew:skew + nbytes]

    def address(self) -> int:
        """The address of ``view``'s first byte."""
        return buffer_address(self.view)

    @property
    def closed(self) -> bool:
        return self._map is None

    def close(self) -> bool:
        """Unmap; False (mapping kept until the garbage collector frees it) when a view
        of it is still exported elsewhere."""
        if self._map is None:
            return True
        mapping, self._map = self._map, None
        try:
            self.view.release()
            self._whole.release()
            mapping.close()
        except BufferError:
            return False
        return True
