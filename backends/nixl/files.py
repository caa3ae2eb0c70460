"""Batched file reads into host memory through NIXL's POSIX backend (io_uring).

The fs tier reads one file per block. A request's blocks of 256 KiB read one
at a time from Python (``open``, ``readv``, ``close`` per block on a few
threads) came at 0.5-0.8 of one sequential read of the same bytes on an
O_DIRECT ext4 disk; read by io_uring submissions of ~4 MiB, at 0.6-0.9, in
the same runs (docs/offload.md). :class:`FileReader` makes those submissions:
the caller opens the files (so it checks what it opens), and one ``start``
moves every ``(fd, offset) -> address`` segment of a batch.

One reader per thread: each owns a NIXL agent with only the POSIX backend (no
progress or listener thread), the host memory it may read into (registered
once), and a page-aligned scratch area for what has no home of its own (the
block headers). A failed or refused read raises :class:`FileReadError`; the
caller then reads those files the plain way, which names the file at fault.

NIXL has no way to cancel a transfer. A read whose disk stalls keeps its
thread until the kernel answers, like a blocked ``readv`` (the fs tier's
stuck-thread pool covers both); the memory it reads into stays valid because
the job it belongs to is not reported until then.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbridge.backends.nixl.load import load_nixl_api

#: ``io_uring`` submission queue of each reader (NIXL's POSIX ``kernel_queue_size``)
QUEUE_DEPTH = 256
#: segments per NIXL transfer (a larger batch is read as several)
MAX_SEGMENTS = QUEUE_DEPTH
#: polls of a transfer's state before the reader starts sleeping between them
_SPIN_POLLS = 50
_POLL_SLEEP_S = 50e-6
_names = itertools.count(1)


class FileReadError(OSError):
    """A batched read failed or was refused (the caller reads those files one by one)."""


class PendingRead:
    """One submitted batch of reads (``FileReader.start``)."""

    def __init__(self, agent: Any, file_reg: object, num_segments: int) -> None:
        self._agent = agent
        self._file_reg: object | None = file_reg
        self.handle: object | None = None
        self.state = "PROC"
        self.num_segments = num_segments

    def wait(self) -> None:
        """Until every read of the batch ended; raises ``FileReadError`` if one failed.
        Releases the request and the files' registration either way (once)."""
        if self._file_reg is None:
            return
        try:
            polls = 0
            while self.state not in ("DONE", "ERR"):
                polls += 1
                if polls > _SPIN_POLLS:
                    time.sleep(_POLL_SLEEP_S)
                self.state = self._agent.check_xfer_state(self.handle)
        except Exception as exc:
            self.state = "ERR"
            raise FileReadError(f"io_uring read of {self.num_segments} segments: {exc!r}"
                                ) from exc
        finally:
            self.release()
        if self.state == "ERR":
            raise FileReadError(f"io_uring read of {self.num_segments} segments failed")

    def release(self) -> None:
        if self.handle is not None:
            with contextlib.suppress(Exception):  # released or not, deregister next
                self._agent.release_xfer_handle(self.handle)
            self.handle = None
        if self._file_reg is not None:
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(self._file_reg, backends=["POSIX"])
            self._file_reg = None


class FileReader:
    """Reads segments of open files into registered host memory, one io_uring batch a call.

    ``memory``: the ``(address, length)`` ranges reads may land in (registered
    with the backend once; a segment elsewhere is refused). ``scratch_bytes``:
    a page-aligned buffer of the reader's own (``scratch`` / ``scratch_address``)
    that reads may also land in.
    """

    def __init__(self, memory: Sequence[tuple[int, int]], scratch_bytes: int) -> None:
        self._agent: object | None = None
        self._regs: list[object] = []
        self._ranges: list[tuple[int, int]] = []
        self._scratch_map = mmap.mmap(-1, max(mmap.PAGESIZE, scratch_bytes))
        self.scratch: memoryview | None = memoryview(self._scratch_map)
        self.scratch_address = int(np.frombuffer(self._scratch_map, np.uint8).ctypes.data)
        self.name = f"kvbridge-files-{os.getpid()}-{next(_names)}"
        try:
            api = load_nixl_api()
            config = api.nixl_agent_config(enable_prog_thread=False,
                                           enable_listen_thread=False, backends=[])
            agent = api.nixl_agent(self.name, config)
            self._agent = agent
            agent.create_backend("POSIX", {"use_uring": "true",
                                           "kernel_queue_size": str(QUEUE_DEPTH)})
            ranges = [(int(a), int(n)) for a, n in memory if n > 0]
            ranges.append((self.scratch_address, len(self._scratch_map)))
            self._ranges = sorted(ranges)
            self._regs.append(agent.register_memory(
                [(a, n, 0, "") for a, n in self._ranges], "DRAM", backends=["POSIX"]))
        except Exception as exc:
            self.close()
            raise FileReadError(f"NIXL POSIX (io_uring) reader unavailable: {exc!r}") from exc

    def covers(self, address: int, length: int) -> bool:
        """Whether ``[address, address + length)`` lies in one registered range."""
        return any(a <= address and address + length <= a + n for a, n in self._ranges)

    def read(self, segments: Sequence[tuple[int, int, int, int]]) -> None:
        """Read every ``(fd, file offset, address, length)`` segment; all or an error."""
        self.start(segments).wait()

    def start(self, segments: Sequence[tuple[int, int, int, int]]) -> PendingRead:
        """Submit the reads of ``segments`` (at most ``MAX_SEGMENTS``); ``wait`` on the result.

        Raises ``FileReadError`` when the backend refuses the batch (nothing is then in
        flight). The caller keeps the files open and the memory valid until ``wait``
        returned.
        """
        agent: Any = self._agent
        if agent is None:
            raise FileReadError("the reader is closed")
        if len(segments) > MAX_SEGMENTS:
            raise ValueError(f"{len(segments)} segments in one read, at most {MAX_SEGMENTS}")
        extent: dict[int, int] = {}
        for fd, off, _addr, length in segments:
            extent[fd] = max(extent.get(fd, 0), off + length)
        local = np.array([(addr, length, 0) for _fd, _off, addr, length in segments],
                         dtype=np.uint64).reshape(-1, 3)
        remote = np.array([(off, length, fd) for fd, off, _addr, length in segments],
                          dtype=np.uint64).reshape(-1, 3)
        try:
            file_reg = agent.register_memory([(0, n, fd, "") for fd, n in extent.items()],
                                             "FILE", backends=["POSIX"])
        except Exception as exc:
            raise FileReadError(f"registering {len(extent)} files: {exc!r}") from exc
        pending = PendingRead(agent, file_reg, len(segments))
        try:
            pending.handle = agent.initialize_xfer(
                "READ", agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, "FILE"), self.name, backends=["POSIX"])
            pending.state = agent.transfer(pending.handle)
        except Exception as exc:
            pending.release()
            raise FileReadError(f"io_uring read of {len(segments)} segments: {exc!r}") from exc
        return pending

    def close(self) -> None:
        """Deregister the memory and drop the agent (idempotent)."""
        agent: Any = self._agent
        for reg in self._regs:
            with contextlib.suppress(Exception):  # closing: nothing else to do about it
                agent.deregister_memory(reg, backends=["POSIX"])
        self._regs = []
        self._agent = None
        if self.scratch is not None:
            self.scratch.release()
            self.scratch = None
            self._scratch_map.close()
