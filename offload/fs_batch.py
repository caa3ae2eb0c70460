"""Batched reads of the fs tier's block files (io_uring through NIXL's POSIX backend).

See "Batched reads" in :mod:`kvbridge.offload.fs`. Here: the readers of a tier
(one per I/O thread, :class:`Readers`), the probe that decides whether a tier
batches, and one chunk of a load (:func:`start_chunk`, :class:`Chunk`): its
files, opened and checked for size, and the submission that reads them, in
flight while the chunk before it is checked. What a chunk needs of its tier is
:class:`ChunkFiles` (the tier's I/O, sizes, paths and counters), so this module
does not know the tier.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvbridge.backends.nixl.files import MAX_SEGMENTS, FileReader, FileReadError, PendingRead
from kvbridge.offload.fs_io import O_DIRECT, FsIO, buffer_address, byte_views, direct_ok
from kvbridge.offload.tier import BlockBuffers, IOCounters
from kvbridge.offload.types import OffloadKey

logger = logging.getLogger(__name__)

#: how a tier reads its block files (:mod:`kvbridge.offload.fs`, "Batched reads")
IO_ENGINES = ("auto", "uring", "python")
#: blocks per batched read at most (each block's header lands in the reader's scratch)
BATCH_BLOCKS = 64
#: ``auto`` batches only block files up to this size: at 1 MiB both ways read at
#: ~1.0 of a sequential read, at 2 MiB batched reads came at 0.79-0.86 against
#: 0.93 one by one (docs/offload.md)
BATCH_MAX_FILE_BYTES = 1 << 20
#: bytes per batched read (:func:`chunk_blocks`)
BATCH_BYTES = 4 << 20
#: a batched load job is split into parts of at least this many blocks: a
#: submission has a fixed cost (registering the files, the NIXL request), and
#: parts of 2 blocks of 256 KiB read no faster batched than one by one
BATCH_MIN_PART = 8


def chunk_blocks(file_bytes: int) -> int:
    """Blocks per batched read: ~``BATCH_BYTES`` (two in flight per thread: one is
    checked while the next is read), at most ``BATCH_BLOCKS``."""
    return max(1, min(BATCH_BLOCKS, BATCH_BYTES // file_bytes))


def probe(root: str, memory: Sequence[tuple[int, int]]) -> str | None:
    """Read one page of a new file under ``root`` through a reader; None when that
    worked, else why not."""
    path = os.path.join(root, f".kvbridge-uring-probe.{os.getpid()}.{threading.get_ident()}")
    reader = None
    try:
        reader = FileReader(memory, mmap.PAGESIZE)
        data = os.urandom(mmap.PAGESIZE)
        with open(path, "wb") as fh:
            fh.write(data)
        fd = os.open(path, os.O_RDONLY | O_DIRECT)
        try:
            reader.read([(fd, 0, reader.scratch_address, len(data))])
        finally:
            os.close(fd)
        assert reader.scratch is not None
        if bytes(reader.scratch[:len(data)]) != data:
            return "a probe read returned other bytes"
        return None
    except (OSError, FileReadError) as exc:
        return str(exc)
    finally:
        if reader is not None:
            reader.close()
        with contextlib.suppress(OSError):
            os.remove(path)


@dataclass(frozen=True)
class ChunkFiles:
    """What a batched read needs of the tier whose block files it reads."""

    #: the tier's name (log lines)
    name: str
    #: the system calls the tier makes
    io: FsIO
    header_bytes: int
    block_bytes: int
    #: a key's block file; raises (an ``OSError``) when the file may not be opened
    block_path: Callable[[OffloadKey], str]
    counters: IOCounters


class Readers:
    """A tier's readers, one per I/O thread (made on a thread's first batched load)."""

    def __init__(self, name: str, memory: Sequence[tuple[int, int]], header_bytes: int,
                 count: Callable[[str], None]) -> None:
        self.name = name
        self.memory = list(memory)
        self.header_bytes = header_bytes
        self._count = count
        self._readers: dict[int, FileReader] = {}
        self._lock = threading.Lock()
        self._closed = False

    def get(self) -> FileReader | None:
        """This thread's reader; None: read one by one (no reader could be made)."""
        ident = threading.get_ident()
        reader = self._readers.get(ident)
        if reader is not None or self._closed:
            return reader
        try:
            # two halves of scratch: the chunk being checked, and the one being read
            reader = FileReader(self.memory, 2 * BATCH_BLOCKS * self.header_bytes)
        except FileReadError as exc:
            self._count("batched_reader_failures")
            logger.warning("%s: no batched reader on this thread, reading one by one: %s",
                           self.name, exc)
            return None
        with self._lock:
            self._readers[ident] = reader
        return reader

    def close(self) -> None:
        with self._lock:
            self._closed = True
            readers, self._readers = self._readers, {}
        for reader in readers.values():
            reader.close()


class Chunk:
    """One batched read of a load (:func:`start_chunk`): its files and its submission."""

    def __init__(self, files: ChunkFiles, reader: FileReader, scratch_offset: int) -> None:
        self.files = files
        self.reader = reader
        self.scratch_offset = scratch_offset
        #: (block position, open fd) of each file in the submission, in scratch order
        self.opened: list[tuple[int, int]] = []
        self.pending: PendingRead | None = None
        self.ok = True
        self.closed = False

    def failed(self, exc: FileReadError) -> None:
        self.ok = False
        self.files.counters.count("batched_read_failures")
        logger.debug("%s: batched read of %d blocks failed, reading them one by one: %s",
                     self.files.name, len(self.opened), exc)

    def finish(self) -> dict[int, bytes]:
        """Wait for the reads; block position -> its header, for the files that landed."""
        try:
            if self.pending is not None:
                try:
                    self.pending.wait()
                except FileReadError as exc:
                    self.failed(exc)
                else:
                    self.files.counters.count("batched_reads")
                self.pending = None
            if not self.ok:
                return {}
            scratch = self.reader.scratch
            assert scratch is not None
            hb = self.files.header_bytes
            base = self.scratch_offset
            # copies of the whole page (another geometry's header may be longer than
            # ours): the scratch is read into again by the chunk after next
            return {i: bytes(scratch[base + slot * hb:base + (slot + 1) * hb])
                    for slot, (i, _fd) in enumerate(self.opened)}
        finally:
            self.close_files()

    def close_files(self) -> None:
        if self.closed:
            return
        self.closed = True
        for _i, fd in self.opened:
            try:
                self.files.io.close(fd)
            except OSError:
                self.files.counters.close_error()


def start_chunk(files: ChunkFiles, reader: FileReader, keys: Sequence[OffloadKey],
                buffers: BlockBuffers, start: int, count: int, half: int) -> Chunk:
    """Submit the batched read of blocks ``start..start+count`` (headers into scratch
    half ``half``). Left out (read one by one later): a file that does not open or is
    not exactly header + block bytes, a buffer outside the reader's memory or not
    aligned for O_DIRECT; the whole chunk when the backend refuses it."""
    hb = files.header_bytes
    file_bytes = hb + files.block_bytes
    got = Chunk(files, reader, half * BATCH_BLOCKS * hb)
    base = reader.scratch_address + got.scratch_offset
    segments: list[tuple[int, int, int, int]] = []
    try:
        for i in range(start, min(start + count, len(keys))):
            views = byte_views(buffers[i])
            if len(segments) + 1 + len(views) > MAX_SEGMENTS:
                break   # the rest of the chunk is read one by one
            addresses = [buffer_address(v) for v in views]
            if not direct_ok(views) or not all(
                    reader.covers(a, len(v)) for a, v in zip(addresses, views, strict=True)):
                continue
            try:
                # block_path: never opened through a refused fan-out directory
                fd, size = files.io.open_read_sized(files.block_path(keys[i]), True)
            except OSError:
                continue   # the one-by-one read says what is wrong
            if size != file_bytes:
                files.io.close(fd)
                continue
            segments.append((fd, 0, base + len(got.opened) * hb, hb))
            got.opened.append((i, fd))
            offset = hb
            for a, v in zip(addresses, views, strict=True):
                segments.append((fd, offset, a, len(v)))
                offset += len(v)
        got.pending = reader.start(segments) if segments else None
    except FileReadError as exc:
        got.failed(exc)
    except BaseException:
        got.close_files()
        raise
    return got
