"""Block-file I/O of the fs tier: one file per block, atomic stores, the deletion policy.

Every system call goes through an ``FsIO`` object so that fault injection
(``kvbridge.offload.faults``) wraps the real calls instead of replacing them.

Deletion policy (what a load deletes; this module and ``FsTier`` -- its
digest check and quarantine -- are the only places a load deletes a block file):

* a *provable short read* — the file ended (read returned 0 at EOF) before
  its header + ``block_bytes`` (and it is not a headerless format-1 file, see
  below) — deletes the file: stores are atomic (temp file + rename),
  so a short file can only be corruption. A failed delete is logged and does
  not hide the short read;
* open errors (ENOENT, ELOOP, EMFILE, ...), read errors (EIO) and close errors
  leave the file: a transient fault must not destroy data;
* a close error after a full read is not a load failure (logged, counted);
* a file *longer* than its header + ``block_bytes`` (no correct writer leaves one) fails the
  load with EFBIG: its bytes are never served; it is kept (counted towards
  quarantine, like EIO);
* a file of the full size whose block header is torn (bad magic or header
  checksum), names another key, or whose bytes do not match the layer digests
  in its header (checked by the tier, ``FsTier.load_batch``), is provable
  corruption: stores are atomic and write the header with the bytes it
  digests, so no correct writer leaves one. It is removed (a REMOVED event);
* a headerless file of exactly ``block_bytes`` (format 1, before block
  headers) or a header of another format version or geometry is not
  provably broken: the load fails (a miss, counted towards quarantine, so it
  is eventually removed and written again in this format), the file is kept;
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

Block file format 2: a header of ``header_bytes`` (a multiple of 4096, so the
block's bytes stay page aligned for O_DIRECT), then the ``block_bytes`` of the
block. Header, little-endian: magic ``KVBLOCK\0``, u32 format (2), u32
header_bytes, u64 block_bytes, u32 num_layers, u32 flags (bit 0: digests
present), 16 bytes blake2b-128 of the key, u64 block digest, num_layers u64
layer digests, u64 XXH3-64 of all the header bytes before it; zero padding.

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
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count

import numpy as np

from kvbridge.layouts.digests import combine, digest_bytes, pack
from kvbridge.offload.types import NotRegularFileError, ShortReadError

logger = logging.getLogger(__name__)

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
O_NOFOLLOW: int = getattr(os, "O_NOFOLLOW", 0)
O_NONBLOCK: int = getattr(os, "O_NONBLOCK", 0)
#: alignment O_DIRECT needs for buffer addresses, lengths and file offsets
DIRECT_ALIGN = 4096
TEMP_SUFFIX = ".tmp"

_temp_counter = count()

#: block file format: 1 = the bare block bytes, 2 = a header with the digests, then the bytes
BLOCK_FORMAT = 2
BLOCK_MAGIC = b"KVBLOCK\0"
#: magic, format, header_bytes, block_bytes, num_layers, flags, key hash, block digest
_HEADER_FIXED = struct.Struct("<8sIIQII16sQ")
HEADER_FLAG_DIGESTS = 1
#: no header is longer (bounds what a reader allocates for a header named in a file)
MAX_BLOCK_HEADER_BYTES = 64 * 1024
MAX_HEADER_LAYERS = (MAX_BLOCK_HEADER_BYTES - _HEADER_FIXED.size - 8) // 8


def block_header_bytes(num_layers: int) -> int:
    """Header size of a block file with ``num_layers`` layer digests (4096-aligned)."""
    need = _HEADER_FIXED.size + 8 * num_layers + 8
    return -(-need // DIRECT_ALIGN) * DIRECT_ALIGN


class BadBlockHeaderError(OSError):
    """A full-size block file whose header is not one this version reads.

    ``corrupt``: provably broken (torn header: bad magic or checksum; another
    key's block): the file is removed. Otherwise (another format version or
    geometry) the file is kept and the load fails.
    """

    def __init__(self, path: str, reason: str, corrupt: bool) -> None:
        super().__init__(errno.EPROTO, f"{path}: {reason}")
        self.path = path
        self.reason = reason
        self.corrupt = corrupt
        self.deleted = False
        self.removal_reason = "corrupt" if corrupt else "format"


class ForeignKeyError(BadBlockHeaderError):
    """A well-formed block header (or obj-tier digest object) made for another key.

    The header names its key by hash; a reader compares that with the hash of the
    key it asked for, so a block copied or renamed under another key's name is
    never served for that key, whatever the verify policy. Provable corruption
    (no correct writer leaves one): the entry is removed like a torn header.
    """

    def __init__(self, path: str, stored: bytes, wanted: bytes) -> None:
        super().__init__(path, f"the block of key hash {stored.hex()}, not {wanted.hex()}",
                         True)


class LegacyBlockError(OSError):
    """A headerless block file (format 1): no digests to check; the load fails, the file
    is kept (quarantine removes it in time, so it is written again with a header)."""

    removal_reason = "legacy"

    def __init__(self, path: str) -> None:
        super().__init__(errno.EPROTO, f"{path} is a format-1 block file (no header, no "
                         "digests): not served")
        self.path = path
        self.deleted = False


@dataclass(frozen=True)
class BlockHeader:
    header_bytes: int
    block_bytes: int
    num_layers: int
    key_hash: bytes
    #: None: written with verification off (no digests)
    layer_digests: tuple[int, ...] | None


def encode_block_header(block_bytes: int, key_hash: bytes, num_layers: int,
                        layer_digests: Sequence[int] | None) -> bytes:
    """The header of a block file (``block_header_bytes(num_layers)`` bytes)."""
    if not 1 <= num_layers <= MAX_HEADER_LAYERS or len(key_hash) != 16:
        raise ValueError(f"header of {num_layers} layers / key hash of {len(key_hash)} bytes")
    header_bytes = block_header_bytes(num_layers)
    flags = 0
    digests: Sequence[int] = (0,) * num_layers
    block_digest = 0
    if layer_digests is not None:
        if len(layer_digests) != num_layers:
            raise ValueError(f"{len(layer_digests)} layer digests for {num_layers} layers")
        flags |= HEADER_FLAG_DIGESTS
        digests = layer_digests
        block_digest = combine(layer_digests)
    body = _HEADER_FIXED.pack(BLOCK_MAGIC, BLOCK_FORMAT, header_bytes, block_bytes, num_layers,
                              flags, key_hash, block_digest) + pack(digests)
    body += struct.pack("<Q", digest_bytes(body))
    return body + bytes(header_bytes - len(body))


def compact_header_bytes(num_layers: int) -> int:
    """The header without its padding (what the obj tier stores beside a block)."""
    return _HEADER_FIXED.size + 8 * num_layers + 8


def decode_block_header(path: str, data: bytes | memoryview) -> BlockHeader:
    """Parse and check a block header (``data``: the header, its padding optional).

    Raises ``BadBlockHeaderError``; ``corrupt`` says whether it is provably torn.
    """
    if len(data) < _HEADER_FIXED.size:
        raise BadBlockHeaderError(path, "header truncated", True)
    magic, fmt, header_bytes, block_bytes, num_layers, flags, key_hash, block_digest = \
        _HEADER_FIXED.unpack_from(data)
    if magic != BLOCK_MAGIC:
        raise BadBlockHeaderError(path, "no block header magic (torn header)", True)
    if fmt != BLOCK_FORMAT:
        raise BadBlockHeaderError(path, f"block format {fmt}, this version reads "
                                  f"{BLOCK_FORMAT}", False)
    end = _HEADER_FIXED.size + 8 * num_layers
    if not 1 <= num_layers <= MAX_HEADER_LAYERS \
            or header_bytes != block_header_bytes(num_layers) or end + 8 > len(data):
        raise BadBlockHeaderError(path, f"header of {header_bytes} bytes for {num_layers} "
                                  "layers is not one this version writes (torn header)", True)
    (checksum,) = struct.unpack_from("<Q", data, end)
    if digest_bytes(data[:end]) != checksum:
        raise BadBlockHeaderError(path, "header checksum mismatch (torn header)", True)
    digests = struct.unpack_from(f"<{num_layers}Q", data, _HEADER_FIXED.size)
    if flags & HEADER_FLAG_DIGESTS:
        if combine(digests) != block_digest:
            raise BadBlockHeaderError(path, "block digest does not combine its layer digests",
                                      True)
        layers: tuple[int, ...] | None = tuple(digests)
    else:
        layers = None
    return BlockHeader(header_bytes, block_bytes, num_layers, bytes(key_hash), layers)


class HeaderBuffer:
    """A page-aligned buffer for one block header (O_DIRECT needs the alignment)."""

    def __init__(self, nbytes: int) -> None:
        self._mmap = mmap.mmap(-1, nbytes)
        self.view = memoryview(self._mmap)

    def close(self) -> None:
        self.view.release()
        self._mmap.close()


class FsIO:
    """The system calls of the fs tier (the real ones; faults wrap this)."""

    def open_read(self, path: str, direct: bool) -> int:
        """Open a block file for reading; never follows a symlink, never blocks on a FIFO.

        Raises ``NotRegularFileError`` when the entry is not a regular file
        (checked with ``fstat`` on the opened descriptor, so it is the file read).
        """
        return self.open_read_sized(path, direct)[0]

    def open_read_sized(self, path: str, direct: bool) -> tuple[int, int]:
        """``open_read``, and the size of the file opened (from the same ``fstat``)."""
        flags = os.O_RDONLY | O_NOFOLLOW | O_NONBLOCK | (O_DIRECT if direct else 0)
        fd = os.open(path, flags)   # a symlink: ELOOP (a transient-looking error, kept)
        try:
            st = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise NotRegularFileError(path, describe_mode(st.st_mode))
        return fd, st.st_size

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
    #: the block file's header (format 2), checked against the key and the geometry
    header: BlockHeader | None = None


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


def buffer_address(view: memoryview) -> int:
    """The address of a buffer's first byte (for registering it, or checking alignment)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def direct_ok(views: Sequence[memoryview]) -> bool:
    """Whether O_DIRECT may be used with these buffers (page-aligned address and length)."""
    for view in views:
        if len(view) % DIRECT_ALIGN:
            return False
        if buffer_address(view) % DIRECT_ALIGN:
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
               direct: bool, header: memoryview, key_hash: bytes,
               num_layers: int) -> LoadOutcome:
    """Read one block file (format 2) into ``header`` and ``views`` (``block_bytes`` in all).

    ``header``: a buffer of ``block_header_bytes(num_layers)`` (page aligned for O_DIRECT);
    the header read into it is checked against ``key_hash``, ``block_bytes`` and
    ``num_layers`` (not the digests: the caller checks the bytes against them).
    Raises ``ShortReadError`` (with ``deleted`` set) on a provable short read,
    ``BadBlockHeaderError`` / ``LegacyBlockError`` for a header this version does not
    serve (``deleted`` set when provably torn), the ``OSError`` of open/read otherwise;
    see the module's deletion policy.
    """
    views = byte_views(views)
    total_view_bytes = sum(len(v) for v in views)
    if total_view_bytes != block_bytes:
        raise ValueError(f"buffers hold {total_view_bytes} bytes, block_bytes is {block_bytes}")
    header = header if header.format == "B" and header.ndim == 1 else header.cast("B")
    file_bytes = len(header) + block_bytes
    targets = [header, *views]
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
        remaining = targets
        while done < file_bytes:
            n = io.readv(fd, remaining)
            if n > 0:
                done += n
                if done >= file_bytes:
                    break
                # a partial read is normal (signals, >2 GiB); EOF is what proves shortness
                if io.file_size(fd) > done:
                    remaining = _advance(targets, done)
                    continue
            # n == 0, or the file is no longer than what we have: EOF before a full block
            if done == block_bytes and bytes(header[:len(BLOCK_MAGIC)]) != BLOCK_MAGIC:
                raise LegacyBlockError(path)   # a format-1 file: kept
            short = ShortReadError(path, file_bytes, done)
            short.deleted = _remove_short(io, path)
            raise short
        if io.file_size(fd) > file_bytes:
            # the tier writes exactly header + block_bytes: a longer file is not this block
            raise OSError(errno.EFBIG, f"{path} is longer than its header + block_bytes="
                          f"{block_bytes}: not a block file (its bytes are not served)")
        outcome.header = check_block_header(io, path, header, key_hash, block_bytes, num_layers)
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


def check_block_header(io: FsIO, path: str, header: bytes | memoryview, key_hash: bytes,
                       block_bytes: int, num_layers: int) -> BlockHeader:
    """The header read from a full-size block file, checked against the block it should be.

    Raises ``BadBlockHeaderError``; a provably torn one (or another key's) is removed
    first (``deleted`` set), one of another format or geometry is kept.
    """
    try:
        parsed = decode_block_header(path, header)
        if parsed.key_hash != key_hash:
            raise ForeignKeyError(path, parsed.key_hash, key_hash)
        if parsed.block_bytes != block_bytes or parsed.num_layers != num_layers:
            raise BadBlockHeaderError(path, f"{parsed.num_layers} layers of "
                                      f"{parsed.block_bytes} bytes in all, expected "
                                      f"{num_layers} of {block_bytes}", False)
    except BadBlockHeaderError as exc:
        if exc.corrupt:
            exc.deleted = remove_entry(io, path)
        raise
    return parsed


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
                direct: bool, header: memoryview, fsync: bool = False) -> bool:
    """Write one block file (``header``, then the block's bytes) atomically; False if it
    already existed (that is success). ``header``: page aligned when ``direct``.

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
    views = [header if header.format == "B" else header.cast("B"), *views]
    file_bytes = block_bytes + len(views[0])
    tmp = temp_path_for(path)
    fd = io.open_write(tmp, direct)
    try:
        try:
            done = 0
            remaining = views
            while done < file_bytes:
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
