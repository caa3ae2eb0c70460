"""Block-file I/O of the fs tier: one file per block, atomic stores, the deletion policy.

Every system call goes through an ``FsIO`` object so that fault injection
(``kvbridge.offload.faults``) wraps the real calls instead of replacing them.

Deletion policy (the only place a block file is deleted on a load):

* a *provable short read* — the file ended (read returned 0 at EOF) before
  ``block_bytes`` — deletes the file: stores are atomic (temp file + rename),
  so a short file can only be corruption. A failed delete is logged and does
  not hide the short read;
* open errors (ENOENT, ELOOP, EMFILE, ...), read errors (EIO) and close errors
  leave the file: a transient fault must not destroy data;
* a close error after a full read is not a load failure (logged, counted);
* a file *longer* than ``block_bytes`` (no correct writer leaves one) fails the
  load with EFBIG: its bytes are never served; it is kept (counted towards
  quarantine, like EIO);
* something that is *not a regular file* in a block's place (a directory, a
  FIFO, a device, a symlink) is provably not a block: the tier never makes
  one. Block files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked with
  ``fstat`` before any read, so a FIFO cannot hang a read thread and a symlink
  is never followed out of the store (its open fails with ELOOP: a failed load,
  counted towards quarantine). A directory, FIFO or device found by a load is
  removed (a directory only if empty; and only if a block file has not been
  renamed into its place meanwhile); a symlink is unlinked, never its target,
  by a store or by quarantine. Probes ``lstat`` and
  answer "absent" for anything but a regular file, and a store replaces such
  an entry (or fails) instead of taking it for a stored block.

Repeated failures of a regular file that are never provably short (EIO,
EISDIR...) are the fs tier's business (quarantine, ``FsTier``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count

import numpy as np

from kvbridge.offload.types import NotRegularFileError, ShortReadError

logger = logging.getLogger(__name__)

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
O_NOFOLLOW: int = getattr(os, "O_NOFOLLOW", 0)
O_NONBLOCK: int = getattr(os, "O_NONBLOCK", 0)
#: alignment O_DIRECT needs for buffer addresses, lengths and file offsets
DIRECT_ALIGN = 4096
TEMP_SUFFIX = ".tmp"

_temp_counter = count()


class FsIO:
    """The system calls of the fs tier (the real ones; faults wrap this)."""

    def open_read(self, path: str, direct: bool) -> int:
        """Open a block file for reading; never follows a symlink, never blocks on a FIFO.

        Raises ``NotRegularFileError`` when the entry is not a regular file
        (checked with ``fstat`` on the opened descriptor, so it is the file read).
        """
        flags = os.O_RDONLY | O_NOFOLLOW | O_NONBLOCK | (O_DIRECT if direct else 0)
        fd = os.open(path, flags)   # a symlink: ELOOP (a transient-looking error, kept)
        try:
            mode = os.fstat(fd).st_mode
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise NotRegularFileError(path, describe_mode(mode))
        return fd

    def readv(self, fd: int, views: list[memoryview]) -> int:
        return os.readv(fd, views)

    def file_size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def close(self, fd: int) -> None:
        os.close(fd)

    def open_write(self, path: str, direct: bool) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (O_DIRECT if direct else 0)
        return os.open(path, flags, 0o644)

    def writev(self, fd: int, views: list[memoryview]) -> int:
        return os.writev(fd, views)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def remove(self, path: str) -> None:
        os.remove(path)

    def exists(self, path: str) -> bool:
        """Whether anything is at ``path`` (not following a symlink)."""
        return os.path.lexists(path)

    def is_block_file(self, path: str) -> bool:
        """Whether ``path`` is a regular file (``lstat``: a symlink is not one)."""
        try:
            return stat.S_ISREG(os.lstat(path).st_mode)
        except FileNotFoundError:
            return False
        except NotADirectoryError:
            return False

    def lstat_mode(self, path: str) -> int | None:
        """``st_mode`` of ``path`` itself (None when nothing is there)."""
        try:
            return os.lstat(path).st_mode
        except FileNotFoundError:
            return None

    def rmdir(self, path: str) -> None:
        os.rmdir(path)


def describe_mode(mode: int) -> str:
    """What kind of entry ``mode`` is, in words (for errors and fsck findings)."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"not a regular file (mode {mode:o})"


def remove_entry(io: FsIO, path: str, *, keep_regular: bool = False) -> bool:
    """Remove whatever is at ``path`` without following it: unlink a file, FIFO or symlink
    (never its target), rmdir an empty directory. True if nothing is there any more.

    ``keep_regular``: the caller found something that is not a regular file there; if a
    regular file is there now (another writer renamed a block into place meanwhile), it
    is a block: leave it and return False.
    """
    try:
        mode = io.lstat_mode(path)
        if mode is None:
            return True
        if keep_regular and stat.S_ISREG(mode):
            return False
        if stat.S_ISDIR(mode):
            io.rmdir(path)
        else:
            io.remove(path)
        return True
    except FileNotFoundError:
        return True
    except OSError as exc:
        logger.warning("could not remove %s: %s", path, exc)
        return False


@dataclass
class LoadOutcome:
    close_error: bool = False


def byte_views(views: Sequence[memoryview]) -> list[memoryview]:
    """Flat unsigned-byte views (``readv``/``writev`` and slicing work in bytes)."""
    return [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]


def _advance(views: list[memoryview], done: int) -> list[memoryview]:
    """The views that remain after ``done`` bytes were transferred."""
    out: list[memoryview] = []
    for view in views:
        if done >= len(view):
            done -= len(view)
            continue
        out.append(view[done:] if done else view)
        done = 0
    return out


def direct_ok(views: Sequence[memoryview]) -> bool:
    """Whether O_DIRECT may be used with these buffers (page-aligned address and length)."""
    for view in views:
        if len(view) % DIRECT_ALIGN:
            return False
        if np.frombuffer(view, dtype=np.uint8).ctypes.data % DIRECT_ALIGN:
            return False
    return True


def probe_o_direct(directory: str, io: FsIO | None = None) -> bool:
    """Whether ``directory``'s file system accepts O_DIRECT writes and reads.

    Probed once per directory by the tier (tmpfs and some overlay setups answer
    EINVAL); the caller falls back to buffered I/O when this says False.
    """
    if not O_DIRECT:
        return False
    io = io or FsIO()
    path = os.path.join(directory, f".odirect-probe.{os.getpid()}.{next(_temp_counter)}{TEMP_SUFFIX}")
    buf = mmap.mmap(-1, DIRECT_ALIGN)
    view = memoryview(buf)
    try:
        fd = io.open_write(path, direct=True)
        try:
            io.writev(fd, [view])
        finally:
            io.close(fd)
        fd = io.open_read(path, direct=True)
        try:
            io.readv(fd, [view])
        finally:
            io.close(fd)
        return True
    except OSError as exc:
        logger.info("O_DIRECT not usable in %s (%s); using buffered I/O", directory, exc)
        return False
    finally:
        view.release()
        buf.close()
        with contextlib.suppress(OSError):
            os.remove(path)


def load_block(io: FsIO, path: str, views: Sequence[memoryview], block_bytes: int,
               direct: bool) -> LoadOutcome:
    """Read one block file into ``views`` (``block_bytes`` in all).

    Raises ``ShortReadError`` (with ``deleted`` set) on a provable short read,
    the ``OSError`` of open/read otherwise; see the module's deletion policy.
    """
    views = byte_views(views)
    total_view_bytes = sum(len(v) for v in views)
    if total_view_bytes != block_bytes:
        raise ValueError(f"buffers hold {total_view_bytes} bytes, block_bytes is {block_bytes}")
    outcome = LoadOutcome()
    fd: int | None = None
    loaded = False
    try:
        try:
            fd = io.open_read(path, direct)
        except NotRegularFileError as exc:
            exc.deleted = remove_entry(io, path, keep_regular=True)
            raise
        done = 0
        remaining = views
        while done < block_bytes:
            n = io.readv(fd, remaining)
            if n > 0:
                done += n
                if done >= block_bytes:
                    break
                # a partial read is normal (signals, >2 GiB); EOF is what proves shortness
                if io.file_size(fd) > done:
                    remaining = _advance(views, done)
                    continue
            # n == 0, or the file is no longer than what we have: EOF before a full block
            short = ShortReadError(path, block_bytes, done)
            short.deleted = _remove_short(io, path)
            raise short
        if io.file_size(fd) > block_bytes:
            # the tier writes exactly block_bytes: a longer file is not this key's block
            raise OSError(errno.EFBIG, f"{path} is longer than block_bytes={block_bytes}: "
                          "not a block file (its bytes are not served)")
        loaded = True
        return outcome
    finally:
        if fd is not None:
            try:
                io.close(fd)
            except OSError as exc:
                outcome.close_error = True
                if loaded:
                    logger.warning("close of %s failed after a full read (load kept): %s",
                                   path, exc)
                else:
                    logger.warning("close of %s failed after a failed read: %s", path, exc)


def _remove_short(io: FsIO, path: str) -> bool:
    try:
        io.remove(path)
        return True
    except FileNotFoundError:
        return True  # someone else removed it: it is gone either way
    except OSError as exc:
        logger.warning("could not remove short block file %s: %s", path, exc)
        return False


def temp_path_for(path: str) -> str:
    return f"{path}.{os.getpid()}.{threading.get_ident()}.{next(_temp_counter)}{TEMP_SUFFIX}"


def store_block(io: FsIO, path: str, views: Sequence[memoryview], block_bytes: int,
                direct: bool, fsync: bool = False) -> bool:
    """Write one block file atomically; False if it already existed (that is success).

    The bytes go to a temp file in the same directory which is then renamed
    over ``path``, so a reader sees either no file or a complete one. On any
    error the temp file is removed and the error raised. Only a regular file
    counts as "already stored": anything else in its place (a directory, a
    FIFO, a symlink) is removed first, and if that fails the store fails.
    """
    mode = io.lstat_mode(path)
    if mode is not None:
        if stat.S_ISREG(mode):
            return False
        if not remove_entry(io, path):
            raise NotRegularFileError(path, describe_mode(mode) + " that cannot be removed")
    views = byte_views(views)
    if sum(len(v) for v in views) != block_bytes:
        raise ValueError(f"buffers do not hold block_bytes={block_bytes}")
    tmp = temp_path_for(path)
    fd = io.open_write(tmp, direct)
    try:
        try:
            done = 0
            remaining = views
            while done < block_bytes:
                n = io.writev(fd, remaining)
                if n <= 0:
                    raise OSError(errno.EIO, f"write of {tmp} made no progress")
                done += n
                remaining = _advance(views, done)
            if fsync:
                io.fsync(fd)
        finally:
            io.close(fd)  # a close error on write may mean lost data: a store failure
        io.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            io.remove(tmp)
        raise
    return True
