"""Fault injection around the real fs tier I/O (per key or per rate, seeded).

``FaultyFsIO`` wraps a real ``FsIO`` and is handed to a tier as its I/O
(``FsTier(io=...)``; the offloading connector gets one through
``kvbridge.connectors.offloading.io_hook``, one per tier from a
:class:`FaultInjectors`). Only opens of block files (``*.kvb``) are faulted:
the tier's O_DIRECT probe file and everything else pass through. Every fault
goes through the real code path of the tier, and most are produced by the
kernel itself:

* SHORT_READ  — the real block file is truncated to half (a torn block) just
  before it is opened, so the tier sees a genuine EOF before ``block_bytes``.
* ELOOP       — the open is redirected to a real symlink loop, so the kernel
  answers ELOOP (this holds as root, unlike ``chmod 000``); the block file is
  left as it was.
* EIO         — the file is opened for real, then the read raises EIO.
* CLOSE_ERROR — the file is read and closed for real, then close raises EIO
  (after a full read this is *not* a load failure).
* SLOW        — the open sleeps ``slow_s`` first.
* CORRUPT     — one byte of the block's bytes in the real file is changed
  just before it is opened (its last byte, XOR 0xFF; the size and the
  header are unchanged: a torn block of the right size, what only the
  digest check sees). Once per file (path and inode), so a file is never
  flipped back; a block stored again (a new file) is corrupted again.

Decisions are deterministic: a per-key fault fires on every open of that key's
file; a rate fault is drawn from ``(seed, name, nth open of that file)``, where
``name`` is the file's path under the store root (``FaultyFsIO(root=...)``), so
neither thread interleaving nor where the store lives (a fresh temp directory
per run) changes which opens fail. Drawn from the absolute path, every new
directory was a new draw: a seed picked for its mix of faults gave, in an estimated
one run in two thousand, one kind only or none.

``FailingWriteIO`` is the write side, for tests: the stores of listed block paths fail
with EIO when their temp file is opened (nothing written).
"""

from __future__ import annotations

import enum
import errno
import hashlib
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvbridge.offload.fs_io import FsIO
from kvbridge.offload.fs_layout import BLOCK_SUFFIX, FileMapper
from kvbridge.offload.types import OffloadError, OffloadKey


class FaultKind(enum.Enum):
    SHORT_READ = "short_read"
    ELOOP = "eloop"
    EIO = "eio"
    CLOSE_ERROR = "close_error"
    SLOW = "slow"
    CORRUPT = "corrupt"


#: kinds that make a load fail (CLOSE_ERROR after a full read and SLOW do not; CORRUPT
#: does when the tier verifies digests)
LOAD_FAILURE_KINDS = frozenset({FaultKind.SHORT_READ, FaultKind.ELOOP, FaultKind.EIO,
                                FaultKind.CORRUPT})
ALL_KINDS: tuple[FaultKind, ...] = tuple(FaultKind)


@dataclass(frozen=True)
class FaultPlan:
    """Which opens of block files fail, and how.

    ``per_key`` faults fire on every open of that key's file; otherwise each
    open fails with probability ``rate`` and a kind drawn from ``kinds``.
    """

    per_key: Mapping[OffloadKey, FaultKind] = field(default_factory=dict)
    rate: float = 0.0
    kinds: tuple[FaultKind, ...] = ALL_KINDS
    seed: int = 0
    slow_s: float = 0.005

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise OffloadError("rate", f"expected a probability in [0, 1], got {self.rate}")
        if self.rate and not self.kinds:
            raise OffloadError("kinds", "expected at least one fault kind with a rate > 0")
        if self.slow_s < 0:
            raise OffloadError("slow_s", f"expected >= 0 seconds, got {self.slow_s}")

    def draw(self, path: str, nth: int) -> FaultKind | None:
        """The rate fault for the ``nth`` open of ``path`` (pure, deterministic).

        ``path`` is the file's name as the plan sees it: ``FaultyFsIO`` passes the
        path under the store root, so the draw does not depend on the directory."""
        if not self.rate:
            return None
        digest = hashlib.blake2b(f"{self.seed}:{path}:{nth}".encode(), digest_size=16).digest()
        u = int.from_bytes(digest[:8], "little") / 2.0**64
        if u >= self.rate:
            return None
        return self.kinds[int.from_bytes(digest[8:], "little") % len(self.kinds)]


@dataclass(frozen=True)
class InjectedFault:
    path: str
    kind: FaultKind


class FaultyFsIO(FsIO):
    """``FsIO`` that injects the faults of ``plan`` into reads of block files.

    ``root``: the store directory; rate faults are drawn from a file's path under it
    (None: from the path as given).
    """

    def __init__(self, plan: FaultPlan, path_of: Callable[[OffloadKey], str],
                 inner: FsIO | None = None, root: str | None = None) -> None:
        self.plan = plan
        self.root = root
        self.inner = inner or FsIO()
        self._per_path = {path_of(key): kind for key, kind in plan.per_key.items()}
        self._lock = threading.Lock()
        self._opens: dict[str, int] = {}
        self._fd_faults: dict[int, FaultKind] = {}
        #: (path, inode) of every file CORRUPT changed
        self._corrupted: set[tuple[str, int]] = set()
        self.injected: list[InjectedFault] = []
        self._loop_dir = tempfile.mkdtemp(prefix="kvbridge-faults-")
        # removed by close_injector, or when the injector is collected or the process exits
        self._remove_loop = weakref.finalize(self, shutil.rmtree, self._loop_dir, True)
        self.loop_path = os.path.join(self._loop_dir, "loop-a")
        os.symlink(os.path.join(self._loop_dir, "loop-b"), self.loop_path)
        os.symlink(self.loop_path, os.path.join(self._loop_dir, "loop-b"))

    def _decide(self, path: str) -> FaultKind | None:
        if not path.endswith(BLOCK_SUFFIX):
            return None    # not a block file (the tier's O_DIRECT probe): never faulted
        with self._lock:
            nth = self._opens.get(path, 0)
            self._opens[path] = nth + 1
        kind = self._per_path.get(path)
        if kind is None:
            name = path if self.root is None else os.path.relpath(path, self.root)
            kind = self.plan.draw(name, nth)
        if kind is not None:
            with self._lock:
                self.injected.append(InjectedFault(path, kind))
        return kind

    def open_read(self, path: str, direct: bool) -> int:
        kind = self._decide(path)
        if kind is FaultKind.SLOW:
            time.sleep(self.plan.slow_s)
        elif kind is FaultKind.ELOOP:
            return self.inner.open_read(self.loop_path, direct)  # raises ELOOP for real
        elif kind is FaultKind.SHORT_READ:
            try:
                size = os.stat(path).st_size
                os.truncate(path, size // 2)
            except OSError:
                pass  # the open below reports what is wrong with the file
        elif kind is FaultKind.CORRUPT:
            self._corrupt(path)
        fd = self.inner.open_read(path, direct)
        if kind in (FaultKind.EIO, FaultKind.CLOSE_ERROR):
            with self._lock:
                self._fd_faults[fd] = kind
        return fd

    def open_read_sized(self, path: str, direct: bool) -> tuple[int, int]:
        fd = self.open_read(path, direct)
        return fd, self.inner.file_size(fd)

    def _corrupt(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return  # the open below reports what is wrong with the file
        try:
            st = os.fstat(fd)
            with self._lock:
                if (path, st.st_ino) in self._corrupted or st.st_size == 0:
                    return
                self._corrupted.add((path, st.st_ino))
            last = os.pread(fd, 1, st.st_size - 1)
            os.pwrite(fd, bytes([last[0] ^ 0xFF]), st.st_size - 1)
        finally:
            os.close(fd)

    def readv(self, fd: int, views: list[memoryview]) -> int:
        with self._lock:
            kind = self._fd_faults.get(fd)
        if kind is FaultKind.EIO:
            raise OSError(errno.EIO, "injected I/O error")
        return self.inner.readv(fd, views)

    def close(self, fd: int) -> None:
        with self._lock:
            kind = self._fd_faults.pop(fd, None)
        self.inner.close(fd)
        if kind is FaultKind.CLOSE_ERROR:
            raise OSError(errno.EIO, "injected close error")

    # everything else is the real call
    def file_size(self, fd: int) -> int:
        return self.inner.file_size(fd)

    def open_write(self, path: str, direct: bool) -> int:
        return self.inner.open_write(path, direct)

    def writev(self, fd: int, views: list[memoryview]) -> int:
        return self.inner.writev(fd, views)

    def fsync(self, fd: int) -> None:
        self.inner.fsync(fd)

    def rename(self, src: str, dst: str) -> None:
        self.inner.rename(src, dst)

    def remove(self, path: str) -> None:
        self.inner.remove(path)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def is_block_file(self, path: str) -> bool:
        return self.inner.is_block_file(path)

    def lstat_mode(self, path: str) -> int | None:
        return self.inner.lstat_mode(path)

    def rmdir(self, path: str) -> None:
        self.inner.rmdir(path)

    def injected_kinds(self) -> dict[FaultKind, int]:
        with self._lock:
            out: dict[FaultKind, int] = {}
            for fault in self.injected:
                out[fault.kind] = out.get(fault.kind, 0) + 1
            return out

    def close_injector(self) -> None:
        """Remove the symlink loop directory."""
        self._remove_loop()


class FailingWriteIO(FsIO):
    """The real ``FsIO``, except that the temp file of a store to a path in ``fail``
    cannot be made (EIO, before anything is written): a failed write the tier must
    report as that block's (``FaultyFsIO`` faults reads only)."""

    def __init__(self, fail: set[str] | None = None) -> None:
        #: block paths (``FsTier.block_path``) whose stores fail
        self.fail: set[str] = set() if fail is None else fail

    def open_write(self, path: str, direct: bool) -> int:
        if any(path.startswith(f + ".") for f in self.fail):
            raise OSError(errno.EIO, "injected write error")
        return super().open_write(path, direct)


class FaultInjectors:
    """Makes one :class:`FaultyFsIO` of ``plan`` per fs tier, as an
    ``io_hook.FsIOFactory``: called with a tier's store directory and fingerprint.

    Keeps what it made, so the test or demo that owns it can count the faults of
    every tier (:meth:`injected_kinds`) and remove their symlink loops (:meth:`close`).
    """

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self._lock = threading.Lock()
        self.made: list[FaultyFsIO] = []

    def __call__(self, root: str, fingerprint: str) -> FaultyFsIO:
        io = FaultyFsIO(self.plan, FileMapper(root, fingerprint).path, root=root)
        with self._lock:
            self.made.append(io)
        return io

    def injected_kinds(self) -> dict[FaultKind, int]:
        """Faults injected so far by every tier's I/O, by kind."""
        out: dict[FaultKind, int] = {}
        with self._lock:
            made = list(self.made)
        for io in made:
            for kind, count in io.injected_kinds().items():
                out[kind] = out.get(kind, 0) + count
        return out

    def close(self) -> None:
        with self._lock:
            made, self.made = self.made, []
        for io in made:
            io.close_injector()
