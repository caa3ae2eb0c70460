"""fs tier: hash-only names, atomic stores, the deletion policy, partial batches, self-correction.

Open failures use a real symlink loop (ELOOP), so these tests hold when run as root.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from kvbridge.offload.faults import FaultKind, FaultPlan, FaultyFsIO
from kvbridge.offload.fs_io import (
    TEMP_SUFFIX,
    FsIO,
    block_header_bytes,
    encode_block_header,
    load_block,
    store_block,
)
from kvbridge.offload.fs_layout import FileMapper
from kvbridge.offload.runner import TierRunner
from kvbridge.offload.testing import block_content
from kvbridge.offload.types import EventKind, JobResult, OffloadError, ShortReadError

BLOCK = 4096
#: a block file: its header (format 2, one layer), then BLOCK bytes
FILE_BYTES = block_header_bytes(1) + BLOCK
#: a header without digests, for store_block/load_block called directly
HDR = memoryview(encode_block_header(BLOCK, FileMapper.key_hash_bytes(b"direct"), 1, None))


def k(i: int) -> bytes:
    return b"ns|" + str(i).encode()


class Buffers:
    """Page-aligned block buffers (mmap), like primary slots."""

    def __init__(self, n: int) -> None:
        self.map = mmap.mmap(-1, n * BLOCK)
        self.view = memoryview(self.map)

    def block(self, i: int) -> memoryview:
        return self.view[i * BLOCK:(i + 1) * BLOCK]

    def lists(self, n: int) -> list[list[memoryview]]:
        return [[self.block(i)] for i in range(n)]


def finish(tier: TierRunner, job_id: int, timeout_s: float = 10.0) -> JobResult:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for result in tier.get_finished_jobs():
            assert result.job_id == job_id
            return result
        time.sleep(0.001)
    raise AssertionError(f"job {job_id} did not finish in {timeout_s} s")


def settle_lookup(tier: TierRunner, request_id: str, key: bytes, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    verdict = tier.lookup(request_id, key)
    tier.step()
    while verdict is None and time.monotonic() < deadline:
        time.sleep(0.001)
        tier.drain_results()
        verdict = tier.lookup(request_id, key)
    assert verdict is not None, "probe did not answer"
    return verdict


def store(tier: TierRunner, keys: list[bytes], job_id: int = 1) -> None:
    bufs = Buffers(len(keys))
    for i, key in enumerate(keys):
        bufs.block(i)[:] = block_content(key, BLOCK)
    tier.submit_store(job_id, keys, bufs.lists(len(keys)))
    assert finish(tier, job_id).success


def test_store_then_load_roundtrip_with_hash_only_names(make_fs, store_dir) -> None:
    tier = make_fs()
    evil = b"../../etc/passwd\x00" + k(0)
    store(tier, [evil, k(1)])
    path = tier.tier.path(evil)
    assert os.path.dirname(os.path.realpath(path)).startswith(os.path.realpath(store_dir))
    name = os.path.basename(path)
    digest = FileMapper.key_hash(evil)
    assert name == f"{digest}.{tier.tier.mapper.fingerprint}.kvb"
    assert path == os.path.join(store_dir, digest[:2], name)
    assert os.path.getsize(path) == FILE_BYTES
    bufs = Buffers(2)
    tier.submit_load(7, [evil, k(1)], bufs.lists(2))
    result = finish(tier, 7)
    assert result.success and result.successful_keys == (evil, k(1))
    assert bytes(bufs.block(0)) == block_content(evil, BLOCK)
    assert bytes(bufs.block(1)) == block_content(k(1), BLOCK)
    events = tier.take_events()
    assert [(e.kind, e.tier, e.medium, e.locality, e.keys) for e in events] == [
        (EventKind.STORED, "fs", "STORAGE", "LOCAL", (evil, k(1)))]


def test_store_is_atomic_and_existing_destination_is_success(tmp_path) -> None:
    path = str(tmp_path / "blk")
    data = memoryview(bytearray(block_content(k(0), BLOCK)))
    assert store_block(FsIO(), path, [data], BLOCK, direct=False, header=HDR) is True
    other = memoryview(bytearray(BLOCK))
    assert store_block(FsIO(), path, [other], BLOCK, direct=False,
                       header=HDR) is False  # kept, no rewrite
    with open(path, "rb") as fh:
        assert fh.read() == bytes(HDR) + bytes(data)
    assert os.listdir(tmp_path) == ["blk"]            # no temp file left behind

    class FailingRename(FsIO):
        def rename(self, src: str, dst: str) -> None:
            raise OSError(errno.EXDEV, "injected rename failure")

    with pytest.raises(OSError, match="rename"):
        store_block(FailingRename(), str(tmp_path / "blk2"), [data], BLOCK, direct=False,
                    header=HDR)
    assert os.listdir(tmp_path) == ["blk"]            # temp removed, nothing half-written

    # Atomic, observed: while the bytes are written (short writes: several calls), the
    # final name does not exist at all; it appears whole, by the rename. A store that
    # wrote the final file in place fails here.
    final = str(tmp_path / "blk3")
    seen: list[tuple[bool, int]] = []

    class Watching(FsIO):
        def writev(self, fd: int, views: list[memoryview]) -> int:
            seen.append((os.path.exists(final), os.fstat(fd).st_size))
            return super().writev(fd, [views[0][:1000]])

    assert store_block(Watching(), final, [data], BLOCK, direct=False, header=HDR) is True
    # header (4096 bytes) in 1000-byte writes, then the block's bytes
    assert seen == [(False, n) for n in (0, 1000, 2000, 3000, 4000, 4096, 5096, 6096, 7096,
                                         8096)]
    with open(final, "rb") as fh:
        assert fh.read() == bytes(HDR) + bytes(data)

    # A crash mid-write (no clean-up runs) leaves no final file: at most a temp file,
    # which the final name's readers never see (fsck removes it).
    crash = (
        "import os, sys\n"
        "from kvbridge.offload.fs_io import FsIO, store_block\n"
        "hdr = memoryview(bytearray(4096))\n"
        "class Crash(FsIO):\n"
        "    def writev(self, fd, views):\n"
        "        os.writev(fd, [views[0][:1000]])\n"
        "        os._exit(9)\n"
        "store_block(Crash(), sys.argv[1], [memoryview(bytearray(4096))], 4096, direct=False,\n"
        "            header=hdr)\n")
    died = subprocess.run([sys.executable, "-c", crash, str(tmp_path / "blk4")], timeout=120)
    assert died.returncode == 9
    assert not os.path.exists(tmp_path / "blk4")
    left = [n for n in os.listdir(tmp_path) if n.startswith("blk4")]
    assert len(left) == 1 and left[0].endswith(TEMP_SUFFIX), left


def test_o_direct_is_probed_once_with_buffered_fallback(make_fs, store_dir) -> None:
    """A file system that refuses O_DIRECT (EINVAL, like older tmpfs) gets buffered I/O."""
    direct_opens: list[str] = []

    class RefusesDirect(FsIO):
        def open_read(self, path: str, direct: bool) -> int:
            if direct:
                direct_opens.append(path)
                raise OSError(errno.EINVAL, "O_DIRECT not supported")
            return super().open_read(path, direct)

        def open_write(self, path: str, direct: bool) -> int:
            if direct:
                direct_opens.append(path)
                raise OSError(errno.EINVAL, "O_DIRECT not supported")
            return super().open_write(path, direct)

    tier = make_fs(io=RefusesDirect())
    assert tier.tier.o_direct is False
    assert len(direct_opens) == 1                        # probed once, for the store directory
    assert not [n for n in os.listdir(store_dir) if n.endswith(".tmp")]
    store(tier, [k(0)])                                  # buffered path works
    bufs = Buffers(1)
    tier.submit_load(2, [k(0)], bufs.lists(1))
    assert finish(tier, 2).success
    assert bytes(bufs.block(0)) == block_content(k(0), BLOCK)
    assert len(direct_opens) == 1                        # never tried again


def test_o_direct_used_when_supported_and_buffers_aligned(make_fs) -> None:
    modes: list[bool] = []

    class Recording(FsIO):
        def open_read(self, path: str, direct: bool) -> int:
            modes.append(direct)
            return super().open_read(path, direct)

    tier = make_fs(io=Recording())
    if not tier.tier.o_direct:
        pytest.skip("this file system refuses O_DIRECT")
    store(tier, [k(0)])
    modes.clear()
    aligned = Buffers(1)
    tier.submit_load(2, [k(0)], aligned.lists(1))
    assert finish(tier, 2).success
    unaligned = memoryview(bytearray(BLOCK + 1))[1:]
    tier.submit_load(3, [k(0)], [[unaligned]])
    assert finish(tier, 3).success and bytes(unaligned) == block_content(k(0), BLOCK)
    assert modes == [True, False]                        # unaligned buffer: buffered fallback


def test_provable_short_read_deletes_file_and_flips_verdict(make_fs) -> None:
    tier = make_fs()
    store(tier, [k(0)])
    assert settle_lookup(tier, "r1", k(0)) is True
    os.truncate(tier.tier.path(k(0)), BLOCK // 2)            # a torn block
    bufs = Buffers(1)
    tier.submit_load(2, [k(0)], bufs.lists(1))
    result = finish(tier, 2)
    assert not result.success and result.successful_keys == ()
    assert not os.path.exists(tier.tier.path(k(0)))
    assert tier.lookup("r1", k(0)) is False             # mark_miss, no re-probe
    assert tier.cache.take_batch() == ()
    assert tier.stats.files_deleted == 1 and tier.stats.loads_failed == 1
    removed = [e for e in tier.take_events() if e.kind is EventKind.REMOVED]
    assert removed and removed[0].keys == (k(0),)


def test_a_key_the_runner_stored_is_a_hit_without_a_probe_until_a_load_of_it_fails(
        make_fs) -> None:
    """remember_present: a key this runner stored starts as a hit (no probe, no RETRY);
    its file removed behind the runner's back makes the load fail, the key a miss for
    the request (no re-probe), and forgotten: a new request probes it afresh."""
    tier = make_fs(remember_present=2)
    keys = [k(0), k(1), k(2)]
    store(tier, keys)
    assert tier.lookup("r1", k(2)) is True and tier.lookup("r1", k(1)) is True
    assert tier.lookup("r1", k(0)) is None           # the oldest of 3 was forgotten (bound 2)
    assert [key for key, _ in tier.cache.take_batch()] == [k(0)]
    assert tier.stats_snapshot()["lookup_known_hits"] == 2
    os.remove(tier.tier.path(k(2)))                  # fsck or another process removed it
    bufs = Buffers(1)
    tier.submit_load(2, [k(2)], bufs.lists(1))
    assert not finish(tier, 2).success
    assert tier.lookup("r1", k(2)) is False          # mark_miss sticks, no re-probe
    assert tier.cache.take_batch() == ()
    tier.release_request("r1")
    assert tier.lookup("r2", k(2)) is None           # forgotten: probed again
    assert settle_lookup(tier, "r2", k(2)) is False
    tier.submit_load(3, [k(1)], bufs.lists(1))       # a load that succeeds keeps it known
    assert finish(tier, 3).success
    assert bytes(bufs.block(0)) == block_content(k(1), BLOCK)
    tier.release_request("r2")
    assert tier.lookup("r3", k(1)) is True


def test_failed_delete_does_not_hide_the_short_read(tmp_path) -> None:
    path = str(tmp_path / "blk")
    with open(path, "wb") as fh:
        fh.write(b"x" * 100)

    class CannotRemove(FsIO):
        def remove(self, p: str) -> None:
            raise OSError(errno.EROFS, "read-only file system")

    view = memoryview(bytearray(BLOCK))
    with pytest.raises(ShortReadError) as info:
        load_block(CannotRemove(), path, [view], BLOCK, direct=False,
                   header=memoryview(bytearray(len(HDR))), key_hash=bytes(16), num_layers=1)
    assert info.value.deleted is False and info.value.read_bytes == 100
    assert os.path.exists(path)


@pytest.mark.parametrize("kind", [FaultKind.ELOOP, FaultKind.EIO])
def test_transient_load_failure_leaves_the_file(make_fs, store_dir, kind) -> None:
    plan = FaultPlan(per_key={k(0): kind})
    tier = make_fs(faults=plan)
    store(tier, [k(0)])
    assert settle_lookup(tier, "r1", k(0)) is True
    bufs = Buffers(1)
    tier.submit_load(2, [k(0)], bufs.lists(1))
    result = finish(tier, 2)
    assert not result.success
    assert os.path.getsize(tier.tier.path(k(0))) == FILE_BYTES   # left intact
    assert tier.stats.files_deleted == 0
    assert tier.lookup("r1", k(0)) is False             # still a miss for this request
    assert isinstance(tier.tier.io, FaultyFsIO)
    assert tier.tier.io.injected_kinds() == {kind: 1}


def test_eloop_is_the_kernels_error(make_fs) -> None:
    tier = make_fs(faults=FaultPlan(per_key={k(0): FaultKind.ELOOP}))
    store(tier, [k(0)])
    with pytest.raises(OSError) as info:
        fs = tier.tier
        load_block(fs.io, fs.path(k(0)), [memoryview(bytearray(BLOCK))], BLOCK, False,
                   memoryview(bytearray(len(HDR))), FileMapper.key_hash_bytes(k(0)), 1)
    assert info.value.errno == errno.ELOOP


def test_close_error_after_full_read_is_not_a_load_failure(make_fs) -> None:
    tier = make_fs(faults=FaultPlan(per_key={k(0): FaultKind.CLOSE_ERROR}))
    store(tier, [k(0)])
    bufs = Buffers(1)
    tier.submit_load(2, [k(0)], bufs.lists(1))
    result = finish(tier, 2)
    assert result.success and result.successful_keys == (k(0),)
    assert bytes(bufs.block(0)) == block_content(k(0), BLOCK)
    assert tier.tier.counters.close_errors_ignored == 1 and os.path.exists(tier.tier.path(k(0)))


def test_batched_partial_load_failure_keeps_loaded_blocks(make_fs) -> None:
    # one read thread: the job is one part, which stops at its first failure
    tier = make_fs(faults=FaultPlan(per_key={k(2): FaultKind.EIO}), read_threads=1)
    keys = [k(i) for i in range(4)]
    store(tier, keys)
    for key in keys:
        assert settle_lookup(tier, "r1", key) is True
    bufs = Buffers(4)
    tier.submit_load(9, keys, bufs.lists(4))
    result = finish(tier, 9)
    assert not result.success and result.successful_keys == (k(0), k(1))
    for i in (0, 1):
        assert bytes(bufs.block(i)) == block_content(keys[i], BLOCK)
    assert [tier.lookup("r1", key) for key in keys] == [True, True, False, False]
    assert tier.stats.loads_ok == 2 and tier.stats.loads_failed == 2


def test_batched_load_first_block_fails_marks_whole_batch(make_fs) -> None:
    # one read thread: the job runs as one part, which stops at its first failure
    tier = make_fs(faults=FaultPlan(per_key={k(0): FaultKind.ELOOP}), read_threads=1)
    keys = [k(0), k(1)]
    store(tier, keys)
    for key in keys:
        settle_lookup(tier, "r1", key)
    tier.submit_load(3, keys, Buffers(2).lists(2))
    result = finish(tier, 3)
    assert not result.success and result.successful_keys == ()
    assert [tier.lookup("r1", key) for key in keys] == [False, False]


def test_a_job_runs_as_one_part_per_thread_and_a_failure_stays_in_its_part(make_fs) -> None:
    """8 blocks on 4 read threads: 4 parts of 2 run at once (a gate holds every read
    until 4 are inside it); with an EIO on block 2, blocks 2 and 3 (its part) fail
    only; positions, digests and bytes of the others are the job's."""
    inside = threading.Semaphore(0)
    release = threading.Event()
    peak = []

    class GatedReads(FsIO):
        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.now = 0
            self.armed = False     # the tier's O_DIRECT probe reads too: not gated

        def readv(self, fd: int, views: list[memoryview]) -> int:
            if not self.armed:
                return super().readv(fd, views)
            with self.lock:
                self.now += 1
                peak.append(self.now)
            inside.release()
            release.wait(10)
            try:
                return super().readv(fd, views)
            finally:
                with self.lock:
                    self.now -= 1

    gated = GatedReads()
    tier = make_fs(io=gated, read_threads=4)
    keys = [k(i) for i in range(8)]
    store(tier, keys)
    bufs = Buffers(8)
    gated.armed = True
    tier.submit_load(5, keys, bufs.lists(8))
    for _ in range(4):                       # four reads at once: four parts in flight
        assert inside.acquire(timeout=10)
    release.set()
    result = finish(tier, 5)
    assert max(peak) == 4 and result.success and len(result.digests) == 8
    for i in range(8):
        assert bytes(bufs.block(i)) == block_content(keys[i], BLOCK)

    faulty = make_fs(read_threads=4, faults=FaultPlan(per_key={k(2): FaultKind.EIO}))
    bufs = Buffers(8)
    faulty.submit_load(6, keys, bufs.lists(8))
    result = finish(faulty, 6)
    assert not result.success
    assert result.successful_keys == (k(0), k(1), k(4), k(5), k(6), k(7))
    assert len(result.digests) == 6
    for i in (0, 1, 4, 5, 6, 7):
        assert bytes(bufs.block(i)) == block_content(keys[i], BLOCK)
    tier = faulty
    assert tier.stats.loads_ok == 6 and tier.stats.loads_failed == 2
    assert tier.stats.load_jobs_failed == 1     # still one job


def test_reads_are_not_starved_by_writes(make_fs) -> None:
    """A load completes while every write thread is stuck in a store."""
    gate = threading.Event()

    class SlowWrites(FsIO):
        def writev(self, fd: int, views: list[memoryview]) -> int:
            gate.wait(10)
            return super().writev(fd, views)

    tier = make_fs(write_threads=1)
    store(tier, [k(0)])
    tier.tier.io = SlowWrites()
    try:
        bufs = Buffers(3)
        for i in range(2):
            bufs.block(i)[:] = block_content(k(10 + i), BLOCK)
        tier.submit_store(20, [k(10)], [[bufs.block(0)]])
        tier.submit_store(21, [k(11)], [[bufs.block(1)]])
        tier.submit_load(22, [k(0)], [[bufs.block(2)]])
        result = finish(tier, 22, timeout_s=5)
        assert result.success and bytes(bufs.block(2)) == block_content(k(0), BLOCK)
        assert tier.num_jobs_in_flight == 2
    finally:
        gate.set()
    deadline = time.monotonic() + 5
    finished: set[int] = set()
    while len(finished) < 2 and time.monotonic() < deadline:
        finished |= {r.job_id for r in tier.get_finished_jobs()}
        time.sleep(0.001)
    assert finished == {20, 21}


def test_header_rejects_another_block_size_and_bad_fingerprint(make_fs, store_dir) -> None:
    make_fs()
    with pytest.raises(OffloadError, match="block_bytes"):
        make_fs(block_bytes=8192)
    with pytest.raises(OffloadError, match="fingerprint"):
        make_fs(fingerprint="../x")
    other = make_fs(fingerprint="fedcba9876543210", block_bytes=8192)   # another layout: fine
    assert other.block_bytes == 8192


def _same_fanout(key: bytes, count: int, avoid: set[bytes]) -> list[bytes]:
    """``count`` keys whose block files share ``key``'s fan-out directory."""
    want = FileMapper.key_hash(key)[:2]
    found = [c for c in (b"fan|%d" % i for i in range(100_000))
             if FileMapper.key_hash(c)[:2] == want and c not in avoid]
    return found[:count]


def test_a_fanout_directory_that_is_a_symlink_is_refused_for_stores_and_loads(
        make_fs, store_dir, tmp_path) -> None:
    """Before: a fan-out directory replaced by a symlink stored and loaded block files
    outside the store root (fsck flagged the link; the tier used it)."""
    tier = make_fs()
    victim, other = k(0), next(k(i) for i in range(1, 999)
                               if FileMapper.key_hash(k(i))[:2] != FileMapper.key_hash(k(0))[:2])
    store(tier, [victim, other])
    tier.shutdown()
    fanout = os.path.dirname(tier.tier.path(victim))
    outside = str(tmp_path / "outside")
    shutil.move(fanout, outside)          # the victim's block file now lies outside the root
    os.symlink(outside, fanout)
    before = sorted(os.listdir(outside))
    assert before == [os.path.basename(tier.tier.path(victim))]

    tier = make_fs()
    assert settle_lookup(tier, "r1", victim) is False     # not even looked at
    assert settle_lookup(tier, "r1", other) is True
    bufs = Buffers(2)
    tier.submit_load(1, [victim, other], bufs.lists(2))
    result = finish(tier, 1)
    assert not result.success and result.successful_keys == (other,)   # the victim alone
    assert bytes(bufs.block(0)) == bytes(BLOCK)           # nothing read from outside
    assert bytes(bufs.block(1)) == block_content(other, BLOCK)
    new = _same_fanout(victim, 1, {victim})[0]
    bufs = Buffers(2)
    bufs.block(0)[:] = block_content(new, BLOCK)
    bufs.block(1)[:] = block_content(k(7), BLOCK)
    tier.submit_store(2, [new, k(7)], bufs.lists(2))
    result = finish(tier, 2)
    assert not result.success and result.successful_keys == (k(7),)
    assert sorted(os.listdir(outside)) == before          # nothing written outside
    assert tier.tier.counters.extra["fanout_refused"] == 2
    assert tier.stats.loads_failed == 1 and tier.stats.stores_failed == 1
    assert tier.stats.files_deleted == 0 and tier.stats.files_quarantined == 0
    assert os.path.islink(fanout)                         # the tier removes nothing of it


def test_a_fanout_directory_swapped_for_a_symlink_while_the_tier_runs_is_refused(
        make_fs, store_dir, tmp_path) -> None:
    tier = make_fs(fanout_recheck_s=0.0)   # judged again at every job
    keys = [k(0), *_same_fanout(k(0), 2, {k(0)})]
    store(tier, keys[:1])
    fanout = os.path.dirname(tier.tier.path(keys[0]))
    outside = str(tmp_path / "outside")
    shutil.move(fanout, outside)
    os.symlink(outside, fanout)
    bufs = Buffers(2)
    for i, key in enumerate(keys[1:]):
        bufs.block(i)[:] = block_content(key, BLOCK)
    tier.submit_store(3, keys[1:], bufs.lists(2))
    result = finish(tier, 3)
    assert not result.success and result.successful_keys == ()
    assert sorted(os.listdir(outside)) == [os.path.basename(tier.tier.path(keys[0]))]
    assert tier.tier.counters.extra["fanout_refused"] == 2
    # an operator puts a real directory back: the tier uses it again
    os.unlink(fanout)
    os.mkdir(fanout)
    tier.submit_store(4, keys[1:], bufs.lists(2))
    assert finish(tier, 4).success
    assert len(os.listdir(fanout)) == 2
