"""The ``fs`` secondary tier: one file per block under a content-addressed path.

Store directory layout (its names and checks: :mod:`kvbridge.offload.fs_layout`, which
``fsck`` reads too)::

    ROOT/layout-<fingerprint>.json          header: format, fingerprint, block_bytes
    ROOT/ab/<32 hex>.<fingerprint>.kvb      one block: a header with its digests
                                            (format 2, ``fs_io``), then block_bytes
    ROOT/ab/<...>.kvb.<pid>.<tid>.<n>.tmp   a store in progress (or orphaned)

The 32 hex digits are blake2b-128 of the key and ``ab`` its first byte: a
file name is derived from the key's hash only, so nothing a peer sends becomes
a path. One level of 256 fan-out directories, made when the tier opens: a
deeper fan-out made lazily cost a directory creation (a journal commit) on
most stores of a young store, which halved store throughput in the benchmark;
ext4/xfs index large directories, so 256 of them hold millions of blocks. The fingerprint in the name lets ``fsck`` tell blocks
of another layout apart; several layouts may share one directory.

Nothing is read or written outside the root: a fan-out directory that is a
symlink, not a directory, or resolves anywhere but its own place under the
root is refused. Its verdict is taken when the tier opens (and makes the
directories), again when a store makes a removed one, and again at the start
of a job once ``fanout_recheck_s`` (10 s) passed, so a block's check is a list
index. A block behind a refused directory is absent to probes, and its store
or load fails alone, before any system call on its path (``fanout_refused``
in ``stats.extra``; never counted towards quarantine, whose removal would go
through the directory). A directory swapped for a symlink while the tier runs
is refused from the next re-check on; ``fsck`` reports it (``symlinked_dir``).

Digests: a store writes the block's layer digests (the CPU slot's, or taken
from the bytes it writes) into the header of the same file, so the rename
that publishes the bytes publishes their digests. A load checks the bytes
that landed against them (policy ``verify``: off, sample, full) before the
block counts as loaded; a mismatch on a full-size file is provable
corruption: the load of that block fails, alone (the rest of its batch is
loaded; the engine recomputes it), and the file is removed (``files_deleted``, ``digest_mismatches``, a REMOVED event).
A header that names another key (a block file renamed or copied under this
key's name) is refused the same way on every load, whatever ``verify`` says:
the key check costs a 16-byte compare (``foreign_key_loads``).
With ``verify`` off no block bytes are digested on store or load (the header
says "no digests"); such a file, read with verification on, is served and counted
(``loads_unverified``) unless the policy refuses unverified loads (then it is a
failed load, counted towards quarantine). A format-1 (headerless) file is never
served: a failed load (``legacy_format_loads``), counted towards quarantine, so
it is written again.

Quarantine: a regular block file whose every read fails without being
provably short (EIO, a bad sector, an unreadable inode) would be retried once
by every new request forever, and a later store would see it and skip. After
``quarantine_after`` failed loads in a row (each from a different lookup entry:
a failure is never retried while its entry lives), the file is removed
(``files_quarantined``, a REMOVED event) so a later store writes it again.
Errors that say nothing about the file (EMFILE, ENFILE, ENOMEM, EAGAIN, EINTR,
ENOENT) never count. A successful load clears the count, and so does a store
that writes a new file (the failures were the old file's). The counts live in
memory, bounded (``QUARANTINE_TRACKED`` keys, oldest forgotten first).

Reads and writes without the GIL (:mod:`kvbridge.offload.fs_fast`): where a load does
not batch (below) and the tier's I/O is the real ``FsIO``, a job part's files are
opened, checked and read into the destination by one call of the optional C extension
with the GIL released (``fast_read_calls``); a file it does not read in full is read
again the plain way (``fast_read_fallbacks``), so the outcome is the same; headers and
digests are checked after, as for any read. A store with the real ``FsIO`` builds every
header of its part first (digests as for a plain store), then one call of the
extension per ``FAST_SCRATCH_BYTES`` of headers stores the files (temp file, write,
optional fsync, close, rename; ``fast_write_calls``); a block it does not write or find
stored (an error, anything but a regular file in its place) is stored again the plain
way (``fast_write_fallbacks``), which names the fault and applies the policy. Without
the extension every block is read and written the plain way (logged once).

Batched reads (``io_engine``): with O_DIRECT and the primary tier's memory
attached, a load opens its files (checking each is a regular file of exactly
header + block bytes) and reads them all with one io_uring submission through
NIXL's POSIX backend (:mod:`kvbridge.backends.nixl.files`, one reader per I/O
thread), then checks headers and digests as a one-by-one read would. A file
that does not open or has the wrong size, and every file of a batch the
backend fails, is read the plain way (``open``/``readv``), which names what is
wrong with it: the outcome of a load (loaded, failed, removed, quarantined)
does not depend on the engine. A load job is split into parts of at least
``BATCH_MIN_PART`` blocks when batched (a part per thread otherwise). ``auto``
(the default) probes the backend once when the primary tier attaches and falls
back to plain reads, logged once; ``python`` never batches; ``uring`` fails
the attach when it cannot. A custom ``FsIO`` (a fault injector) wraps the plain
calls, so a tier given one reads the plain way. Stores never batch through io_uring: the
cost of a small block's store is creating and renaming its file, which one submission
does not save (measured in docs/offload.md); the extension above saves the Python
calls around it.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvbridge.layouts.digests import VerifyPolicy
from kvbridge.offload import fs_fast
from kvbridge.offload.blockdigest import (
    DEFAULT_VERIFY,
    DigestMismatchError,
    LayerDigests,
    layer_digests,
    verify_views,
    wants_key,
)
from kvbridge.offload.fs_batch import (
    BATCH_MAX_FILE_BYTES,
    BATCH_MIN_PART,
    IO_ENGINES,
    Chunk,
    ChunkFiles,
    Readers,
    chunk_blocks,
    probe,
    start_chunk,
)
from kvbridge.offload.fs_io import (
    BadBlockHeaderError,
    BlockHeader,
    ForeignKeyError,
    FsIO,
    HeaderBuffer,
    LegacyBlockError,
    LoadOutcome,
    block_header_bytes,
    buffer_address,
    byte_views,
    check_block_header,
    direct_ok,
    encode_block_header,
    load_block,
    probe_o_direct,
    remove_entry,
    store_block,
    temp_path_for,
)
from kvbridge.offload.fs_layout import (
    DEFAULT_FANOUT_RECHECK_S,
    FanoutRefusedError,
    Fanouts,
    FileMapper,
    ensure_header,
)
from kvbridge.offload.tier import BlockBuffers, Tier
from kvbridge.offload.types import (
    BatchIOError,
    NotRegularFileError,
    OffloadError,
    OffloadKey,
    Removal,
    ShortReadError,
    StoredCopyError,
)

logger = logging.getLogger(__name__)

#: I/O threads of the tier by default (reads: promotions, which a request waits for;
#: writes: stores, which nobody waits for). A job runs one part per thread of its pool
#: (``load_part_blocks``). Measured with ``python -m kvbridge.tools.bench.vllm_fs``
#: (docs/offload.md): more read threads speed a promotion; 4 write threads stored jobs
#: of 8 blocks of 256 KiB 1.3x faster than 2 on an O_DIRECT ext4 disk (block file
#: creation, not bytes, bounds them; 2 MiB blocks: no difference).
DEFAULT_READ_THREADS = 4
DEFAULT_WRITE_THREADS = 4
#: keys whose failed-load counts are remembered (oldest forgotten first)
QUARANTINE_TRACKED = 4096
#: header bytes a fast read lands, or a fast write takes, per call at most
#: (:mod:`kvbridge.offload.fs_fast`; a thread's scratch: bounds what it allocates
#: whatever the job's size)
FAST_SCRATCH_BYTES = 4 << 20
#: load errors that say nothing about the file itself: never counted towards quarantine.
#: EINVAL is a configuration fault (O_DIRECT on a file system or buffer that refuses it):
#: counting it would quarantine, one by one, every good block of a misconfigured store.
NOT_THE_FILES_FAULT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN,
                                 errno.EINTR, errno.ENOENT, errno.ENOBUFS, errno.EINVAL})


class QuarantinedError(StoredCopyError):
    """A block file failed ``failures`` loads in a row and was removed (``deleted``)."""

    removal = Removal.QUARANTINE

    def __init__(self, path: str, failures: int, cause: OSError, deleted: bool) -> None:
        super().__init__(cause.errno, f"{path}: {failures} failed loads in a row ({cause}); "
                         + ("removed" if deleted else "removal failed, kept"))
        self.path = path
        self.failures = failures
        self.cause = cause
        self.deleted = deleted


class FsTier(Tier):
    """Blocks as files under ``root``; see the module docstring for the layout.

    ``io``: the system calls the tier makes (a test or the demo passes a wrapper that
    injects faults, ``kvbridge.offload.faults.FaultyFsIO``); ``clock``: when the
    fan-out directories are judged again.
    """

    #: blocks are independent files: a job runs on every thread of its pool at once
    load_part_blocks = 1
    store_part_blocks = 1

    def __init__(self, root: str, block_bytes: int, fingerprint: str, *,
                 use_o_direct: bool = True, fsync: bool = False, io: FsIO | None = None,
                 name: str = "fs", quarantine_after: int = 3,
                 clock: Callable[[], float] = time.monotonic,
                 verify: VerifyPolicy = DEFAULT_VERIFY, num_layers: int = 1,
                 io_engine: str = "auto",
                 fanout_recheck_s: float = DEFAULT_FANOUT_RECHECK_S) -> None:
        if io_engine not in IO_ENGINES:
            raise OffloadError("io_engine", f"expected one of {', '.join(IO_ENGINES)}, "
                               f"got {io_engine!r}")
        self.mapper = FileMapper(root, fingerprint)
        super().__init__(name, block_bytes, verify=verify, num_layers=num_layers)
        self.root = root
        self.io = io or FsIO()
        self.clock = clock
        self._closed = False
        self.fsync = fsync
        if isinstance(quarantine_after, bool) or not isinstance(quarantine_after, int) \
                or quarantine_after < 1:
            raise OffloadError("quarantine_after", f"expected a count >= 1 of failed loads, "
                               f"got {quarantine_after!r}")
        #: failed loads in a row after which a block file is removed
        self.quarantine_after = quarantine_after
        self._failures: OrderedDict[OffloadKey, int] = OrderedDict()
        self._failures_lock = threading.Lock()
        #: bytes of a block file's header (before the block's bytes)
        self.header_bytes = block_header_bytes(self.num_layers)
        self._headers = threading.local()  # each I/O thread's header buffer (_header)
        os.makedirs(root, exist_ok=True)
        ensure_header(root, fingerprint, block_bytes)
        # probed once for the store directory (the fan-out dirs are on the same file system)
        self.o_direct = bool(use_o_direct) and probe_o_direct(root, self.io)
        #: which fan-out directories blocks may go through (judged now, made if missing)
        self.fanouts = Fanouts(self.mapper, name, fanout_recheck_s, clock)
        #: the engine asked for (``batched``: what loads use now)
        self.io_engine = io_engine
        self._readers: Readers | None = None
        fs_fast.log_fallback_once()

    @property
    def batched(self) -> bool:
        """Whether loads read their block files in batched io_uring submissions."""
        return self._readers is not None

    def attach_primary(self, buffer: memoryview) -> None:
        """Batched reads into the primary tier's slots, when ``io_engine`` allows them."""
        if self.io_engine == "python" or self._closed:
            return
        file_bytes = self.header_bytes + self.block_bytes
        why = ("the store directory refuses O_DIRECT" if not self.o_direct else
               "a custom FsIO wraps the plain I/O calls" if type(self.io) is not FsIO else
               f"block files of {file_bytes} bytes read as fast one by one (measured)"
               if self.io_engine == "auto" and file_bytes > BATCH_MAX_FILE_BYTES else None)
        memory = [(buffer_address(buffer), len(buffer))]
        if why is None:
            why = probe(self.root, memory)
        if why is None:
            self._readers = Readers(self.name, memory, self.header_bytes, self.counters.count)
            self.load_part_blocks = BATCH_MIN_PART
            return
        if self.io_engine == "uring":
            raise OffloadError("io_engine", f"{self.name}: batched reads unavailable: {why}")
        logger.info("%s: block files are read one by one (batched reads unavailable: %s)",
                    self.name, why)

    def path(self, key: OffloadKey) -> str:
        return self.mapper.path(key)

    def block_path(self, key: OffloadKey) -> str:
        """``key``'s block file, or ``FanoutRefusedError`` when its fan-out directory is
        not the store's own (the verdict taken when the directory was judged: a list
        index per block, no system call)."""
        return self.fanouts.path(key)

    def probe(self, keys: Sequence[OffloadKey]) -> list[bool]:
        # lstat: only a regular file is a block (a directory, FIFO or symlink is absent);
        # a block behind a refused fan-out directory is absent, and is not looked at
        self.fanouts.recheck()
        found: list[bool] = []
        for key in keys:
            try:
                path = self.block_path(key)
            except FanoutRefusedError:
                found.append(False)
                continue
            found.append(self.io.is_block_file(path))
        return found

    def load(self, keys: Sequence[OffloadKey], buffers: BlockBuffers,
             digests_out: list[LayerDigests | None]) -> None:
        """Load and (per ``verify``) check each block; ``digests_out`` gets, per loaded key,
        the digests stored with it (None: stored without). A block that is provably
        corrupt (digests, torn header) fails alone: the rest of the batch is loaded."""
        header = self._header()
        self.fanouts.recheck()
        #: blocks that failed on their own (provably corrupt, removed): the batch goes on
        corrupt: dict[int, OSError] = {}
        reader = self._readers.get() if self._readers is not None else None
        #: what a batched read needs of this tier (its I/O as it is now)
        files = ChunkFiles(self.name, self.io, self.header_bytes, self.block_bytes,
                           self.block_path, self.counters)
        chunk = chunk_blocks(self.header_bytes + self.block_bytes)
        #: block position -> its header, where a batched read already brought the file in
        landed: dict[int, bytes] = {}
        #: block position -> its path, where a fast read already made it
        paths: dict[int, str] = {}
        if reader is None and type(self.io) is FsIO and fs_fast.available():
            landed = self._read_fast(keys, buffers, paths)
        ahead: Chunk | None = None   # the next chunk's read, in flight while this one is checked
        try:
            for i, (key, views) in enumerate(zip(keys, buffers, strict=True)):
                if reader is not None and i % chunk == 0:
                    current = ahead or start_chunk(files, reader, keys, buffers, i, chunk, 0)
                    ahead = (start_chunk(files, reader, keys, buffers, i + chunk, chunk,
                                         (i // chunk + 1) % 2)
                             if i + chunk < len(keys) else None)
                    landed = current.finish()
                try:
                    path = paths.get(i) or self.block_path(key)
                except FanoutRefusedError as exc:
                    self.counters.count("fanout_refused")
                    corrupt[i] = exc      # this block's directory, not the store: go on
                    continue
                try:
                    got = landed.get(i)
                    if got is not None:
                        outcome = LoadOutcome(header=check_block_header(
                            self.io, path, got, self.mapper.key_hash_bytes(key),
                            self.block_bytes, self.num_layers))
                    else:
                        direct = self.o_direct and direct_ok(views)
                        outcome = load_block(self.io, path, views, self.block_bytes, direct,
                                             header.view, self.mapper.key_hash_bytes(key),
                                             self.num_layers)
                    assert outcome.header is not None
                    digests = self._check(key, path, views, outcome.header)
                except OSError as exc:
                    if isinstance(exc, LegacyBlockError):
                        self.counters.count("legacy_format_loads")     # format 1: no digests
                    elif isinstance(exc, BadBlockHeaderError) and not exc.corrupt:
                        self.counters.count("foreign_format_loads")
                    elif isinstance(exc, ForeignKeyError):
                        self.counters.foreign_key()
                    error = self._count_failure(key, path, exc)
                    if isinstance(exc, DigestMismatchError) or (
                            isinstance(exc, BadBlockHeaderError) and exc.corrupt):
                        corrupt[i] = error    # this block's file, not the store: go on
                        continue
                    raise BatchIOError(i, error, skipped=corrupt) from exc
                digests_out.append(digests)
                if self._failures:
                    with self._failures_lock:
                        self._failures.pop(key, None)
                if outcome.close_error:
                    self.counters.close_error()
        finally:
            if ahead is not None:
                ahead.finish()   # its reads land in this batch's buffers: never leave them
        if corrupt:
            raise BatchIOError(len(keys), corrupt[min(corrupt)], skipped=corrupt)

    def _read_fast(self, keys: Sequence[OffloadKey], buffers: BlockBuffers,
                   paths: dict[int, str]) -> dict[int, bytes]:
        """Read the blocks' files through the C extension (GIL released, one call per
        ``FAST_SCRATCH_BYTES`` of headers); block position -> its header, for the files
        read in full (``paths`` gets each path it made). The others (errors, odd files,
        refused directories) are left to the plain read, which names what is wrong and
        applies the deletion policy."""
        hb = self.header_bytes
        per_call = max(1, min(fs_fast.max_items(), FAST_SCRATCH_BYTES // hb))
        scratch = self._scratch(min(per_call, len(keys)) * hb)
        landed: dict[int, bytes] = {}
        for start in range(0, len(keys), per_call):
            positions: list[int] = []
            items: list[fs_fast.Item] = []
            for i in range(start, min(start + per_call, len(keys))):
                views = byte_views(buffers[i])
                if len(views) + 1 > fs_fast.max_buffers():
                    continue
                try:
                    path = self.block_path(keys[i])
                except FanoutRefusedError:
                    continue
                paths[i] = path
                slot = scratch.view[len(items) * hb:(len(items) + 1) * hb]
                # O_DIRECT where the tier uses it and the buffers allow it (checked in C)
                items.append((os.fsencode(path), self.o_direct, (slot, *views)))
                positions.append(i)
            if not items:
                continue
            statuses = fs_fast.read_files(items)
            self.counters.count("fast_read_calls")
            for n, (i, status) in enumerate(zip(positions, statuses, strict=True)):
                if status == fs_fast.READ_OK:
                    # a copy: the scratch is read into again by the next call
                    landed[i] = bytes(scratch.view[n * hb:(n + 1) * hb])
                else:
                    self.counters.count("fast_read_fallbacks")
        return landed

    def _scratch(self, nbytes: int) -> HeaderBuffer:
        """This thread's page-aligned header scratch for fast reads and writes, at least
        ``nbytes`` (bounded by ``FAST_SCRATCH_BYTES`` or one header), kept for the
        thread's life."""
        scratch: HeaderBuffer | None = getattr(self._headers, "scratch", None)
        if scratch is None or len(scratch.view) < nbytes:
            if scratch is not None:
                scratch.close()
            scratch = self._headers.scratch = HeaderBuffer(nbytes)
        return scratch

    def _check(self, key: OffloadKey, path: str, views: Sequence[memoryview],
               header: BlockHeader) -> LayerDigests | None:
        """The bytes in ``views`` against ``header``'s digests, as the policy says.

        Returns the stored digests (what the CPU slot keeps). A mismatch removes
        the file (a full-size file whose bytes are not what its writer digested is
        provably corrupt) and raises ``DigestMismatchError``.
        """
        policy = self.verify
        if not policy.enabled:
            return header.layer_digests
        if header.layer_digests is None:
            if not policy.allow_unverified:
                raise OSError(errno.EPROTO, f"{path} was stored without digests and the "
                              "verify policy refuses unverified loads")
            self.counters.unverified()
            return None
        if wants_key(policy, key):
            try:
                verify_views(self.name, path, key, header.layer_digests, views)
            except DigestMismatchError as exc:
                exc.deleted = remove_entry(self.io, path)
                raise
            self.counters.verified()
        return header.layer_digests

    def _count_failure(self, key: OffloadKey, path: str, exc: OSError) -> OSError:
        """Count a failed load of ``key``; quarantine (remove) the file at the threshold.

        Returns the error to report: ``exc`` itself, or a ``QuarantinedError``.
        """
        if isinstance(exc, ShortReadError | NotRegularFileError | DigestMismatchError) \
                or (isinstance(exc, BadBlockHeaderError) and exc.corrupt) \
                or exc.errno in NOT_THE_FILES_FAULT:
            with self._failures_lock:
                self._failures.pop(key, None)   # handled (removed) or not the file's fault
            return exc
        with self._failures_lock:
            failures = self._failures.pop(key, 0) + 1
            if failures < self.quarantine_after:
                self._failures[key] = failures
                while len(self._failures) > QUARANTINE_TRACKED:
                    self._failures.popitem(last=False)
                return exc
        deleted = remove_entry(self.io, path)
        logger.warning("%s: %s failed %d loads in a row (last: %s); %s", self.name, path,
                       failures, exc, "removed (quarantine)" if deleted else
                       "could not remove it")
        if not deleted:
            self.counters.count("quarantine_remove_failed")
        return QuarantinedError(path, failures, exc, deleted)

    def store(self, keys: Sequence[OffloadKey], buffers: BlockBuffers,
              digests: Sequence[LayerDigests | None]) -> None:
        """Write each block with a header holding its layer digests: ``digests[i]`` (taken
        where the bytes were written), else taken here; none with ``verify`` off."""
        header = self._header()
        self.fanouts.recheck()
        #: blocks refused for their fan-out directory: they fail alone, the batch goes on
        refused: dict[int, OSError] = {}
        #: block positions the extension stored (or found stored): done
        stored_fast: set[int] = set()
        if type(self.io) is FsIO and fs_fast.available():
            stored_fast = self._write_fast(keys, buffers, digests)
        for i, (key, views) in enumerate(zip(keys, buffers, strict=True)):
            if i in stored_fast:
                continue
            try:
                path = self.block_path(key)
            except FanoutRefusedError as exc:
                self.counters.count("fanout_refused")
                refused[i] = exc
                continue
            direct = self.o_direct and direct_ok(views)
            layers = digests[i]
            if layers is None and self.verify.enabled:
                layers = layer_digests(views, self.num_layers)
            if layers is not None and len(layers) != self.num_layers:
                raise BatchIOError(i, OSError(errno.EINVAL, f"{len(layers)} layer digests "
                                              f"for {self.num_layers} layers"))
            header.view[:] = encode_block_header(self.block_bytes,
                                                 self.mapper.key_hash_bytes(key),
                                                 self.num_layers, layers)
            try:
                try:
                    stored = store_block(self.io, path, views, self.block_bytes, direct,
                                         header.view, self.fsync)
                except FileNotFoundError:
                    # the fan-out directory was removed behind our back (an operator
                    # cleaning up): make it again, once, and judge what is there now
                    why = self.fanouts.rejudge(key)
                    if why is not None:
                        self.counters.count("fanout_refused")
                        refused[i] = FanoutRefusedError(os.path.dirname(path), why)
                        continue
                    stored = store_block(self.io, path, views, self.block_bytes, direct,
                                         header.view, self.fsync)
                if not stored:
                    self.counters.count("store_existing")
                elif self._failures:
                    # a new file: the failed loads of the one it replaces are not its own
                    with self._failures_lock:
                        self._failures.pop(key, None)
            except OSError as exc:
                raise BatchIOError(i, exc, skipped=refused) from exc
        if refused:
            raise BatchIOError(len(keys), refused[min(refused)], skipped=refused)

    def _write_fast(self, keys: Sequence[OffloadKey], buffers: BlockBuffers,
                    digests: Sequence[LayerDigests | None]) -> set[int]:
        """Store the blocks' files through the C extension (GIL released, one call per
        ``FAST_SCRATCH_BYTES`` of headers, each built here first into this thread's
        scratch); the positions it wrote or found stored. The others (errors, anything
        but a regular file in a block's place, refused directories, odd buffers) are
        left to the plain store, which names what is wrong and applies the policy.

        Headers are built up to the first block whose digests do not fit the layout,
        which the plain store refuses, failing the batch there as it would without the
        extension. A block the plain store fails stops the batch, but later blocks of
        the same call are already stored: complete files, as a later store would write."""
        hb = self.header_bytes
        per_call = max(1, min(fs_fast.max_items(), FAST_SCRATCH_BYTES // hb))
        scratch = self._scratch(min(per_call, len(keys)) * hb)
        done: set[int] = set()
        for start in range(0, len(keys), per_call):
            positions: list[int] = []
            items: list[fs_fast.WriteItem] = []
            valid = True
            for i in range(start, min(start + per_call, len(keys))):
                views = byte_views(buffers[i])
                if len(views) + 1 > fs_fast.max_buffers() \
                        or sum(len(v) for v in views) != self.block_bytes:
                    continue
                try:
                    path = self.block_path(keys[i])
                except FanoutRefusedError:
                    continue
                layers = digests[i]
                if layers is None and self.verify.enabled:
                    layers = layer_digests(views, self.num_layers)
                if layers is not None and len(layers) != self.num_layers:
                    valid = False
                    break
                slot = scratch.view[len(items) * hb:(len(items) + 1) * hb]
                slot[:] = encode_block_header(self.block_bytes,
                                              self.mapper.key_hash_bytes(keys[i]),
                                              self.num_layers, layers)
                # O_DIRECT where the tier uses it and the buffers allow it (checked in C)
                items.append((os.fsencode(path), os.fsencode(temp_path_for(path)),
                              self.o_direct, self.fsync, (slot, *views)))
                positions.append(i)
            if items:
                statuses = fs_fast.write_files(items)
                self.counters.count("fast_write_calls")
                for i, status in zip(positions, statuses, strict=True):
                    if status == fs_fast.EXISTED:
                        self.counters.count("store_existing")
                    elif status != fs_fast.WRITTEN:
                        self.counters.count("fast_write_fallbacks")
                        continue
                    elif self._failures:
                        # a new file: the failed loads of the one it replaces are not its own
                        with self._failures_lock:
                            self._failures.pop(keys[i], None)
                    done.add(i)
            if not valid:
                break
        return done

    def _header(self) -> HeaderBuffer:
        """This thread's header buffer, kept for the thread's life: an mmap and munmap
        per job part were ~8 % of the write threads' samples storing 256 KiB blocks
        (py-spy, 4 write threads; an unmap interrupts every core); store/plain went
        from 0.45 to 0.47 (medians of 6 alternating runs)."""
        header: HeaderBuffer | None = getattr(self._headers, "buffer", None)
        if header is None:
            header = self._headers.buffer = HeaderBuffer(self.header_bytes)
        return header

    def close(self) -> None:
        """Close the batched readers (the runner calls this once its jobs ended)."""
        self._closed = True
        if self._readers is not None:
            self._readers.close()
            self._readers = None
