"""Batched fs reads (io_uring through NIXL's POSIX backend) against reads one by one.

The batched path must not change what a load does: for every state a block file
can be in (good, torn of the right size, short, longer, another key's, another
format, missing, a FIFO), a tier that batches and a tier that reads one by one
load, fail, remove and count the same blocks. Everything is real: real files, the
real NIXL POSIX backend, real io_uring; the one injected fault truncates a real
file between its open and its read, so the kernel's short completion is what the
backend reports.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from kvbridge.backends.nixl.files import MAX_SEGMENTS, FileReader, FileReadError
from kvbridge.layouts.digests import DigestMode, VerifyPolicy
from kvbridge.offload.cpu import CpuTier
from kvbridge.offload.fs import DEFAULT_WRITE_THREADS, FsTier
from kvbridge.offload.fs_batch import BATCH_MIN_PART
from kvbridge.offload.fs_io import FsIO, encode_block_header
from kvbridge.offload.fs_layout import FileMapper
from kvbridge.offload.runner import TierRunner, split_job
from kvbridge.offload.testing import block_content
from kvbridge.offload.tier import WHOLE_JOB
from kvbridge.offload.types import BatchIOError, OffloadError

BLOCK = 4096
FP = "b0b1b2b3b4b5b6b7"


def k(i: int) -> bytes:
    return b"fb|%d" % i


def _address(buffer: mmap.mmap) -> int:
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)


# -- the reader --------------------------------------------------------------------


@pytest.fixture
def reader_env(tmp_path):
    memory = mmap.mmap(-1, 1 << 20)
    reader = FileReader([(_address(memory), len(memory))], 2 * mmap.PAGESIZE)
    yield reader, memory, tmp_path
    reader.close()
    memory.close()


def _file(tmp_path, name: str, data: bytes) -> int:
    path = tmp_path / name
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY | os.O_DIRECT)


def test_the_reader_reads_every_segment_where_it_is_told(reader_env) -> None:
    reader, memory, tmp_path = reader_env
    base = _address(memory)
    a = _file(tmp_path, "a", os.urandom(3 * 4096))
    b = _file(tmp_path, "b", os.urandom(4096))
    try:
        reader.read([(a, 4096, base + 8192, 8192), (b, 0, base, 4096),
                     (a, 0, reader.scratch_address, 4096)])
    finally:
        os.close(a)
        os.close(b)
    data_a = (tmp_path / "a").read_bytes()
    assert memory[8192:16384] == data_a[4096:]
    assert memory[:4096] == (tmp_path / "b").read_bytes()
    assert reader.scratch is not None and bytes(reader.scratch[:4096]) == data_a[:4096]


def test_the_reader_refuses_or_fails_what_it_cannot_read_whole(reader_env) -> None:
    reader, memory, tmp_path = reader_env
    base = _address(memory)
    fd = _file(tmp_path, "short", b"x" * 4096)
    try:
        with pytest.raises(FileReadError):            # the kernel completes it short
            reader.read([(fd, 0, base, 8192)])
        with pytest.raises(FileReadError):            # memory it was not given
            reader.read([(fd, 0, base + (1 << 20), 4096)])
        with pytest.raises(ValueError):
            reader.start([(fd, 0, base, 4096)] * (MAX_SEGMENTS + 1))
        reader.read([(fd, 0, base, 4096)])            # the reader is still usable
        assert memory[:4096] == b"x" * 4096
    finally:
        os.close(fd)
    assert reader.covers(base, 1 << 20) and not reader.covers(base, (1 << 20) + 1)
    reader.close()
    reader.close()                                    # idempotent
    with pytest.raises(FileReadError):
        reader.read([(0, 0, base, 4096)])


# -- the tier: the same outcome batched and one by one -----------------------------


def _tier(root, primary: CpuTier, engine: str, **kwargs: object) -> FsTier:
    """An fs tier (no runner: the tests call its ``load``/``store`` themselves), attached
    to ``primary`` as the runner would."""
    tier = FsTier(str(root), BLOCK, FP, io_engine=engine,
                  verify=VerifyPolicy(DigestMode.FULL), **kwargs)  # type: ignore[arg-type]
    tier.attach_primary(primary.buffer)
    return tier


def _damage(tier: FsTier, n: int) -> dict[int, str]:
    """Store ``n`` blocks, then leave block files in every state a load must handle."""
    primary_views = [memoryview(bytearray(block_content(k(i), BLOCK))) for i in range(n)]
    tier.store([k(i) for i in range(n)], [[v] for v in primary_views], [None] * n)
    states = {1: "torn", 3: "short", 5: "longer", 6: "other key", 8: "format 1",
              9: "missing", 11: "fifo", 12: "other layers"}
    for i, state in states.items():
        path = tier.path(k(i))
        if state == "torn":              # the right size, one byte of the block flipped
            with open(path, "r+b") as fh:
                fh.seek(tier.header_bytes + 100)
                byte = fh.read(1)
                fh.seek(tier.header_bytes + 100)
                fh.write(bytes([byte[0] ^ 0x5A]))
        elif state == "short":
            os.truncate(path, tier.header_bytes + BLOCK // 2)
        elif state == "longer":
            with open(path, "ab") as fh:
                fh.write(b"x" * 4096)
        elif state == "other key":
            with open(tier.path(k(0)), "rb") as src, open(path, "wb") as dst:
                dst.write(src.read())
        elif state == "format 1":        # headerless: block_bytes of KV, no digests
            with open(path, "wb") as fh:
                fh.write(block_content(k(i), BLOCK))
        elif state == "missing":
            os.remove(path)
        elif state == "fifo":
            os.remove(path)
            os.mkfifo(path)
        elif state == "other layers":    # a header of another geometry: kept, not served
            header = encode_block_header(BLOCK, tier.mapper.key_hash_bytes(k(i)), 2, None)
            with open(path, "wb") as fh:
                fh.write(header + block_content(k(i), BLOCK))
    return states


def _outcome(tier: FsTier, primary: CpuTier, n: int) -> dict[str, object]:
    """Load blocks one at a time from position ``start`` on, as a job would after each
    hard failure, and record what happened to each block."""
    result: dict[int, str] = {}
    start = 0
    keys = [k(i) for i in range(n)]
    while start < n:
        views = [[primary.view(i)] for i in range(start, n)]
        for view in views:
            view[0][:] = bytes(BLOCK)
        try:
            tier.load(keys[start:], views, [])
            failed_at, skipped = n - start, {}
        except BatchIOError as exc:
            failed_at, skipped = exc.num_succeeded, exc.skipped
        for j in range(start, min(start + failed_at, n)):
            if j - start in skipped:
                result[j] = type(skipped[j - start]).__name__
            else:
                ok = bytes(primary.view(j)) == block_content(k(j), BLOCK)
                result[j] = "loaded" if ok else "WRONG BYTES"
        if start + failed_at < n:
            result[start + failed_at] = "failed"
        start += failed_at + 1
    files = {i: (os.path.lexists(tier.path(k(i)))) for i in range(n)}
    counters = tier.counters
    return {"blocks": result, "files": files,
            "counts": (counters.loads_verified, counters.foreign_key_loads,
                       counters.extra.get("legacy_format_loads", 0),
                       counters.extra.get("foreign_format_loads", 0))}


def test_every_block_file_state_loads_the_same_batched_and_one_by_one(tmp_path) -> None:
    n = 14
    outcomes = {}
    for engine in ("python", "uring"):
        primary = CpuTier(n, BLOCK)
        tier = _tier(tmp_path / engine, primary, engine)
        try:
            assert tier.batched is (engine == "uring")
            states = _damage(tier, n)
            outcomes[engine] = _outcome(tier, primary, n)
            if engine == "uring":
                assert tier.counters.extra.get("batched_reads", 0) > 0
        finally:
            tier.close()
            primary.close()
    assert outcomes["uring"] == outcomes["python"]
    blocks = outcomes["uring"]["blocks"]
    assert isinstance(blocks, dict)
    for i in range(n):                                     # and that outcome is the right one
        if i not in states:
            assert blocks[i] == "loaded", (i, blocks[i])
    assert blocks[1] == "DigestMismatchError" and blocks[6] == "ForeignKeyError"
    assert outcomes["uring"]["counts"][1] == 1            # block 6: another key's header
    assert all(blocks[i] == "failed" for i in (3, 5, 8, 9, 11, 12))


class _TruncatingIO(FsIO):
    """Opens a block file, then truncates it to half (the size it reports is the whole):
    the batched read of that file completes short in the kernel."""

    def __init__(self) -> None:
        self.paths: set[str] = set()

    def open_read_sized(self, path: str, direct: bool) -> tuple[int, int]:
        fd, size = super().open_read_sized(path, direct)
        if path in self.paths:
            self.paths.discard(path)
            os.truncate(path, size // 2)
        return fd, size


def test_a_read_the_kernel_completes_short_falls_back_and_names_the_file(tmp_path) -> None:
    n = 6
    primary = CpuTier(n, BLOCK)
    tier = _tier(tmp_path / "s", primary, "uring")
    io = _TruncatingIO()
    tier.io = io      # the plain FsIO with one real fault between open and read
    try:
        tier.store([k(i) for i in range(n)],
                   [[memoryview(bytearray(block_content(k(i), BLOCK)))] for i in range(n)],
                   [None] * n)
        io.paths.add(tier.path(k(2)))
        with pytest.raises(BatchIOError) as info:
            tier.load([k(i) for i in range(n)], [[primary.view(i)] for i in range(n)], [])
        assert info.value.num_succeeded == 2                      # blocks 0 and 1 loaded
        assert type(info.value.cause).__name__ == "ShortReadError"
        assert not os.path.exists(tier.path(k(2)))                # provably short: removed
        assert tier.counters.extra.get("batched_read_failures") == 1
        for i in (0, 1):
            assert bytes(primary.view(i)) == block_content(k(i), BLOCK)
    finally:
        tier.close()
        primary.close()


def test_which_engine_a_tier_reads_with(tmp_path) -> None:
    from kvbridge.offload.faults import FaultPlan, FaultyFsIO

    primary = CpuTier(4, BLOCK)
    tiers = []
    try:
        auto = _tier(tmp_path / "a", primary, "auto")
        python = _tier(tmp_path / "p", primary, "python")
        faulty_root = str(tmp_path / "f")
        injector = FaultyFsIO(FaultPlan(rate=0.0), FileMapper(faulty_root, FP).path,
                              root=faulty_root)
        faulty = _tier(faulty_root, primary, "auto", io=injector)
        big = FsTier(str(tmp_path / "b"), 2 << 20, FP)
        tiers += [auto, python, faulty, big]
        big_primary = CpuTier(1, 2 << 20)
        try:
            big.attach_primary(big_primary.buffer)
            assert not big.batched           # 2 MiB block files: one by one is as fast
        finally:
            big.close()
            big_primary.close()
        assert auto.batched and auto.load_part_blocks == BATCH_MIN_PART
        assert not python.batched and python.load_part_blocks == 1
        assert not faulty.batched                # a fault plan wraps the plain calls
        buffered = FsTier(str(tmp_path / "u"), BLOCK, FP, use_o_direct=False,
                          io_engine="uring")
        tiers.append(buffered)
        with pytest.raises(OffloadError, match="io_engine"):
            buffered.attach_primary(primary.buffer)
        with pytest.raises(OffloadError, match="io_engine"):
            FsTier(str(tmp_path / "x"), BLOCK, FP, io_engine="aio")
    finally:
        for tier in tiers:
            tier.close()
        primary.close()


def test_a_batched_job_splits_into_parts_of_at_least_min_part_blocks(tmp_path) -> None:
    primary = CpuTier(4 * BATCH_MIN_PART, BLOCK)
    fs = _tier(tmp_path / "s", primary, "uring")
    tier = TierRunner(fs, read_threads=4, write_threads=DEFAULT_WRITE_THREADS)
    try:
        assert split_job(BATCH_MIN_PART, 4, fs.load_part_blocks) == [(0, BATCH_MIN_PART)]
        parts = split_job(4 * BATCH_MIN_PART, 4, fs.load_part_blocks)
        assert len(parts) == 4 and all(e - s == BATCH_MIN_PART for s, e in parts)
        assert split_job(64, 4, WHOLE_JOB) == [(0, 64)]                 # obj: one call a job
        assert split_job(8, 4, 1) == [(0, 2), (2, 4), (4, 6), (6, 8)]   # one by one: a part
        n = 4 * BATCH_MIN_PART                                          # per thread
        keys = [k(i) for i in range(n)]
        fs.store(keys, [[memoryview(bytearray(block_content(key, BLOCK)))] for key in keys],
                 [None] * n)
        tier.submit_load(1, keys, [[primary.view(i)] for i in range(n)])
        done = []
        while not done:
            tier.wait_for_finished(1.0)
            done = tier.get_finished_jobs()
        assert done[0].success
        assert all(bytes(primary.view(i)) == block_content(k(i), BLOCK) for i in range(n))
    finally:
        tier.shutdown()
        primary.close()
