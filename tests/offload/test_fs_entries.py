"""fs tier against what a disk or an operator can leave in a block's place.

A file whose every read fails (quarantined, removed, then written again), a
FIFO (never hangs a load or shutdown), a directory (never taken for a stored
block), a symlink (never followed out of the store). Everything is real files
and real system calls; ``BadSectorIO`` wraps the real ``FsIO`` and fails the
reads of one file until that file is removed, as a bad sector would.
"""

from __future__ import annotations

import errno
import itertools
import os
from collections.abc import Iterator

import pytest

from kvbridge.offload.cpu import CpuTier
from kvbridge.offload.fs import DEFAULT_READ_THREADS, DEFAULT_WRITE_THREADS, FsTier
from kvbridge.offload.fs_io import FsIO
from kvbridge.offload.manager import OffloadManager
from kvbridge.offload.runner import TierRunner
from kvbridge.offload.testing import block_content, block_file_payload
from kvbridge.offload.types import EventKind, LookupResult, LookupStatus
from tests.offload.test_deadlines import settle, wait_for

BLOCK = 4096
FP = "e0e1e2e3e4e5e6e7"


def k(i: int) -> bytes:
    return b"fe|%d" % i


class BadSectorIO(FsIO):
    """Reads of the files in ``bad`` fail with EIO (the file opens fine) until removed."""

    def __init__(self) -> None:
        self.bad: set[str] = set()
        self._bad_fds: set[int] = set()
        self.errno = errno.EIO

    def open_read(self, path: str, direct: bool) -> int:
        fd = super().open_read(path, direct)
        if path in self.bad:
            self._bad_fds.add(fd)
        return fd

    def readv(self, fd: int, views: list[memoryview]) -> int:
        if fd in self._bad_fds:
            raise OSError(self.errno, os.strerror(self.errno))
        return super().readv(fd, views)

    def close(self, fd: int) -> None:
        self._bad_fds.discard(fd)
        super().close(fd)

    def remove(self, path: str) -> None:
        super().remove(path)
        self.bad.discard(path)     # the bad sectors went with the file


@pytest.fixture
def setup(tmp_path) -> Iterator[tuple[OffloadManager, TierRunner, BadSectorIO]]:
    io = BadSectorIO()
    # a clock that never moves: no deadline can pass on a slow machine (not tested here)
    tier = TierRunner(FsTier(str(tmp_path / "store"), BLOCK, FP, use_o_direct=False, io=io,
                             quarantine_after=3, clock=lambda: 0.0),
                      read_threads=DEFAULT_READ_THREADS, write_threads=DEFAULT_WRITE_THREADS,
                      clock=lambda: 0.0)
    m = OffloadManager(CpuTier(2, BLOCK), [tier], clock=lambda: 0.0)
    yield m, tier, io
    m.shutdown()


def compute(m: OffloadManager, request_id: str, keys: list[bytes]) -> None:
    """The engine computed ``keys`` for ``request_id``: store them (cascade to fs)."""
    spec = m.prepare_store(request_id, keys)
    for key, slot in zip(spec.keys, spec.slots, strict=True):
        m.primary.view(slot)[:] = block_content(key, BLOCK)
    m.complete_store(spec.keys)
    assert m.wait_idle()


_fills = itertools.count()


def evict(m: OffloadManager) -> None:
    """Push every block out of the CPU tier (fresh filler keys each time)."""
    compute(m, "fill", [b"fill|%d" % next(_fills) for _ in range(m.primary.num_slots)])
    m.request_finished("fill")


def fs_events(m: OffloadManager) -> list[tuple[EventKind, tuple[bytes, ...]]]:
    return [(e.kind, e.keys) for e in m.take_events() if e.tier == "fs"]


def verdict_true(tier: TierRunner, request_id: str, key: bytes) -> None:
    """Settle ``key``'s verdict (True) in the tier's cache for ``request_id``."""
    def known() -> bool:
        tier.lookup(request_id, key)
        tier.step()
        tier.drain_results()
        return tier.cache.peek(key) is not None
    wait_for(known, "a verdict")
    assert tier.cache.peek(key) is True


def test_a_configuration_fault_never_quarantines_a_block(setup) -> None:
    """EINVAL (O_DIRECT refused by the file system, say) is not the file's fault: the
    load fails and is a miss, but the block is never counted towards quarantine."""
    m, tier, io = setup
    compute(m, "w", [k(0)])
    m.request_finished("w")
    evict(m)
    io.bad.add(tier.tier.path(k(0)))
    io.errno = errno.EINVAL
    for r in range(5):
        assert settle(m, f"r{r}", [k(0)]) == LookupResult(LookupStatus.MISS, 0)
        m.request_finished(f"r{r}")
    assert tier.stats.loads_failed == 5
    assert tier.stats.files_quarantined == 0
    assert os.path.exists(tier.tier.path(k(0)))


def test_a_block_failing_every_read_is_quarantined_removed_and_written_again(setup) -> None:
    m, tier, io = setup
    compute(m, "w", [k(0)])
    m.request_finished("w")
    evict(m)
    io.bad.add(tier.tier.path(k(0)))
    fs_events(m)
    for r in range(3):               # one failed load per new request (never a retry within one)
        assert settle(m, f"r{r}", [k(0)]) == LookupResult(LookupStatus.MISS, 0)
        m.request_finished(f"r{r}")
        assert os.path.exists(tier.tier.path(k(0))) is (r < 2)
    assert tier.stats.loads_failed == 3 and tier.stats.files_quarantined == 1
    assert tier.stats.files_deleted == 0           # not a provable short read
    assert (EventKind.REMOVED, (k(0),)) in fs_events(m)
    # a later request computes the block again; its store writes a fresh file
    assert settle(m, "r3", [k(0)]) == LookupResult(LookupStatus.MISS, 0)
    compute(m, "r3", [k(0)])
    m.request_finished("r3")
    assert (EventKind.STORED, (k(0),)) in fs_events(m)
    evict(m)
    assert settle(m, "r4", [k(0)]) == LookupResult(LookupStatus.HIT, 1)
    spec = m.prepare_load("r4", [k(0)])
    assert bytes(m.primary.view(spec.slots[0])) == block_content(k(0), BLOCK)
    m.complete_load("r4", [k(0)])
    m.request_finished("r4")


def test_a_success_in_between_resets_the_count(setup) -> None:
    m, tier, io = setup
    compute(m, "w", [k(0)])
    m.request_finished("w")
    for r in range(4):
        evict(m)
        if r != 2:
            io.bad.add(tier.tier.path(k(0)))
        else:
            io.bad.clear()
        expect = LookupResult(LookupStatus.HIT, 1) if r == 2 else LookupResult(LookupStatus.MISS, 0)
        assert settle(m, f"r{r}", [k(0)]) == expect
        m.request_finished(f"r{r}")
    assert tier.stats.files_quarantined == 0 and os.path.exists(tier.tier.path(k(0)))


def test_a_fifo_in_place_of_a_block_hangs_neither_the_load_nor_shutdown(setup) -> None:
    m, tier, _ = setup
    compute(m, "w", [k(0), k(1)])
    m.request_finished("w")
    evict(m)
    # probed while it was a block file, then a FIFO takes its place before the load
    verdict_true(tier, "r1", k(0))
    os.remove(tier.tier.path(k(0)))
    os.mkfifo(tier.tier.path(k(0)))
    assert settle(m, "r1", [k(0)]) == LookupResult(LookupStatus.MISS, 0)
    assert not os.path.lexists(tier.tier.path(k(0)))     # provably not a block: removed
    assert tier.stats.files_deleted == 1
    assert (EventKind.REMOVED, (k(0),)) in fs_events(m)
    # a FIFO found by a probe is simply absent
    os.remove(tier.tier.path(k(1)))
    os.mkfifo(tier.tier.path(k(1)))
    assert settle(m, "r2", [k(1)]) == LookupResult(LookupStatus.MISS, 0)
    m.request_finished("r1")
    m.request_finished("r2")
    tier.shutdown(timeout_s=5.0)                     # returns: no thread is inside a read
    # this tier's read threads (other tiers' idle threads share the name prefix)
    assert not [t.name for t in tier._read_pool._threads if t.is_alive()]


def test_a_directory_in_place_of_a_block_is_replaced_or_fails_the_store(setup) -> None:
    m, tier, _ = setup
    os.mkdir(tier.tier.path(k(0)))                        # empty: removed, the block written
    fs_events(m)
    compute(m, "w", [k(0)])
    assert os.path.isfile(tier.tier.path(k(0)))
    assert block_file_payload(tier.tier.path(k(0))) == block_content(k(0), BLOCK)
    assert (EventKind.STORED, (k(0),)) in fs_events(m)
    os.makedirs(os.path.join(tier.tier.path(k(1)), "something"))   # not empty: the store fails
    compute(m, "w", [k(1)])
    assert os.path.isdir(tier.tier.path(k(1)))
    assert tier.stats.stores_failed == 1
    assert all(keys != (k(1),) for kind, keys in fs_events(m) if kind is EventKind.STORED)
    m.request_finished("w")
    evict(m)
    assert settle(m, "r1", [k(1)]) == LookupResult(LookupStatus.MISS, 0)  # never "stored"


def test_a_symlinked_block_is_never_followed_out_of_the_store(setup, tmp_path) -> None:
    m, tier, _ = setup
    outside = tmp_path / "outside.bin"
    secret = b"S" * BLOCK                            # exactly a block's size
    outside.write_bytes(secret)
    compute(m, "w", [k(0), k(1)])
    m.request_finished("w")
    evict(m)
    os.remove(tier.tier.path(k(0)))
    os.symlink(outside, tier.tier.path(k(0)))
    assert settle(m, "r1", [k(0)]) == LookupResult(LookupStatus.MISS, 0)   # lstat: absent
    # probed as a file, swapped for a symlink before the load: the open refuses it
    verdict_true(tier, "r2", k(1))
    os.remove(tier.tier.path(k(1)))
    os.symlink(outside, tier.tier.path(k(1)))
    assert settle(m, "r2", [k(1)]) == LookupResult(LookupStatus.MISS, 0)
    assert tier.stats.loads_failed == 1
    assert all(bytes(m.primary.view(s.index)) != secret for s in m.primary._slots.values())
    # a store replaces the link itself, never writes through it
    m.request_finished("r1")
    m.request_finished("r2")
    compute(m, "w2", [k(0)])
    assert os.path.isfile(tier.tier.path(k(0))) and not os.path.islink(tier.tier.path(k(0)))
    assert outside.read_bytes() == secret


class StoredMeanwhileIO(FsIO):
    """The real I/O; right after the load's open found a FIFO in ``path``'s place, another
    writer (a second engine sharing the store) renames a complete block file over it."""

    def __init__(self) -> None:
        self.path: str | None = None
        self.block = b""

    def lstat_mode(self, path: str) -> int | None:
        if path == self.path:
            self.path = None
            tmp = path + ".other-writer.tmp"
            with open(tmp, "wb") as fh:
                fh.write(self.block)
            os.rename(tmp, path)
        return super().lstat_mode(path)


def test_a_block_stored_over_a_fifo_during_the_load_is_not_removed(tmp_path) -> None:
    io = StoredMeanwhileIO()
    tier = TierRunner(FsTier(str(tmp_path / "store"), BLOCK, FP, use_o_direct=False, io=io,
                             clock=lambda: 0.0),
                      read_threads=DEFAULT_READ_THREADS, write_threads=DEFAULT_WRITE_THREADS,
                      clock=lambda: 0.0)
    m = OffloadManager(CpuTier(2, BLOCK), [tier], clock=lambda: 0.0)
    try:
        compute(m, "w", [k(0)])
        m.request_finished("w")
        evict(m)
        verdict_true(tier, "r1", k(0))
        with open(tier.tier.path(k(0)), "rb") as fh:
            stored = fh.read()                          # what the other writer writes
        os.remove(tier.tier.path(k(0)))
        os.mkfifo(tier.tier.path(k(0)))
        io.block, io.path = stored, tier.tier.path(k(0))
        fs_events(m)
        assert settle(m, "r1", [k(0)]) == LookupResult(LookupStatus.MISS, 0)
        assert io.path is None                          # the other writer did run
        # the FIFO the load saw is gone; the block file that replaced it is kept
        assert os.path.isfile(tier.tier.path(k(0)))
        assert block_file_payload(tier.tier.path(k(0))) == block_content(k(0), BLOCK)
        assert tier.stats.files_deleted == 0
        assert not [keys for kind, keys in fs_events(m) if kind is EventKind.REMOVED]
        m.request_finished("r1")
        evict(m)
        assert settle(m, "r2", [k(0)]) == LookupResult(LookupStatus.HIT, 1)
        m.request_finished("r2")
    finally:
        m.shutdown()


def test_failures_of_a_removed_file_do_not_count_against_the_file_stored_after_it(setup) -> None:
    """Quarantine counts failed loads of one file in a row: a file stored afresh (the old
    one was removed, e.g. by an operator or fsck) starts from zero, not from the old
    file's failures."""
    m, tier, io = setup
    compute(m, "w", [k(0)])
    m.request_finished("w")
    path = tier.tier.path(k(0))
    for r in range(2):                               # two failed loads of the old file
        evict(m)
        io.bad.add(path)
        assert settle(m, f"r{r}", [k(0)]) == LookupResult(LookupStatus.MISS, 0)
        m.request_finished(f"r{r}")
    assert tier.stats.loads_failed == 2 and os.path.exists(path)
    os.remove(path)                                  # an operator removes the bad file
    io.bad.discard(path)
    assert settle(m, "r2", [k(0)]) == LookupResult(LookupStatus.MISS, 0)   # absent: no load
    compute(m, "r2", [k(0)])                         # recomputed: a fresh file is stored
    m.request_finished("r2")
    evict(m)
    io.bad.add(path)                                 # one failed load of the new file
    assert settle(m, "r3", [k(0)]) == LookupResult(LookupStatus.MISS, 0)
    m.request_finished("r3")
    assert tier.stats.loads_failed == 3
    assert tier.stats.files_quarantined == 0 and os.path.exists(path)


def test_a_block_file_longer_than_a_block_is_never_served(setup) -> None:
    """The tier writes exactly block_bytes per file (fsck calls anything longer broken):
    a longer file under a block's name is not that key's block, so its first block_bytes
    are never served; the failed load counts towards quarantine."""
    m, tier, _ = setup
    compute(m, "w", [k(0)])
    m.request_finished("w")
    evict(m)
    path = tier.tier.path(k(0))
    with open(path, "ab") as fh:                     # the right bytes, then some more
        fh.write(b"x")
    assert settle(m, "r1", [k(0)]) == LookupResult(LookupStatus.MISS, 0)
    assert m.failed_loads("r1") == (k(0),)
    assert tier.stats.loads_failed == 1 and tier.stats.loads_ok == 0
    assert os.path.exists(path)                      # not provably short: kept (quarantine)
    m.request_finished("r1")
