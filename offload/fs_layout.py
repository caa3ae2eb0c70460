"""The fs tier's directory layout: file names, the layout header, the fan-out directories.

Owns: how a key becomes a block file's path (:class:`FileMapper`: a hash of the key only,
so nothing a peer sends becomes a path), the ``layout-<fingerprint>.json`` header
(:func:`ensure_header`), the names ``fsck`` parses (``BLOCK_NAME_RE``,
``HEADER_NAME_RE``), and which fan-out directories blocks may go through
(:class:`Fanouts`: a real directory in its own place under the root, judged at open,
again every ``recheck_s`` and when a store makes a removed one). The layout is the
module docstring of :mod:`kvbridge.offload.fs`. May not touch: a block file's bytes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import stat
from collections.abc import Callable

from kvbridge.offload.fs_io import describe_mode
from kvbridge.offload.types import OffloadError, OffloadKey

logger = logging.getLogger(__name__)

BLOCK_SUFFIX = ".kvb"
#: format of the layout header; 2: block files carry a header with their digests
HEADER_FORMAT = 2
FINGERPRINT_RE = re.compile(r"^[0-9a-f]{8,64}$")
#: block file name: <hash>.<fingerprint>.kvb
BLOCK_NAME_RE = re.compile(r"^([0-9a-f]{32})\.([0-9a-f]{8,64})\.kvb$")
HEADER_NAME_RE = re.compile(r"^layout-([0-9a-f]{8,64})\.json$")
#: how often (seconds, at most) a tier judges its fan-out directories again
DEFAULT_FANOUT_RECHECK_S = 10.0


class FanoutRefusedError(OSError):
    """A block whose fan-out directory is not the store's own (a symlink, or a path
    that resolves outside the root): its store or load fails, alone, before any
    system call on its path; counted in ``fanout_refused``. Never counted towards
    quarantine, which would remove a file through that directory."""

    def __init__(self, directory: str, why: str) -> None:
        super().__init__(errno.EXDEV, why)
        self.directory = directory


def header_name(fingerprint: str) -> str:
    return f"layout-{fingerprint}.json"


class FileMapper:
    """Key -> block file path (hash of the key only)."""

    def __init__(self, root: str, fingerprint: str) -> None:
        if not FINGERPRINT_RE.match(fingerprint):
            raise OffloadError("fingerprint",
                               f"expected 8-64 lowercase hex digits, got {fingerprint!r}")
        self.root = root
        self.fingerprint = fingerprint

    @staticmethod
    def key_hash(key: OffloadKey) -> str:
        return hashlib.blake2b(key, digest_size=16).hexdigest()

    @staticmethod
    def key_hash_bytes(key: OffloadKey) -> bytes:
        """The 16 bytes a block header names its key by (``key_hash`` in hex)."""
        return hashlib.blake2b(key, digest_size=16).digest()

    def directory(self, key_hash: str) -> str:
        return os.path.join(self.root, key_hash[0:2])

    def all_directories(self) -> list[str]:
        return [os.path.join(self.root, f"{i:02x}") for i in range(256)]

    def path(self, key: OffloadKey) -> str:
        return self.path_of_hash(self.key_hash(key))

    def path_of_hash(self, key_hash: str) -> str:
        return os.path.join(self.directory(key_hash),
                            f"{key_hash}.{self.fingerprint}{BLOCK_SUFFIX}")


def ensure_header(root: str, fingerprint: str, block_bytes: int) -> None:
    """Create or check ``layout-<fp>.json``; a different block size is an error."""
    path = os.path.join(root, header_name(fingerprint))
    wanted = {"format": HEADER_FORMAT, "fingerprint": fingerprint, "block_bytes": block_bytes}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    else:
        # write-then-rename is overkill for a tiny file made once; O_EXCL decides who writes
        with os.fdopen(fd, "w") as fh:
            json.dump(wanted, fh)
        return
    try:
        with open(path) as fh:
            found = json.load(fh)
    except (OSError, ValueError) as exc:
        raise OffloadError("store_header", f"{path} unreadable: {exc}") from None
    if not isinstance(found, dict) or found.get("block_bytes") != block_bytes:
        got = found.get("block_bytes") if isinstance(found, dict) else found
        raise OffloadError("block_bytes",
                           f"store {root} holds fingerprint {fingerprint} with block_bytes={got}, "
                           f"expected {block_bytes}")


class Fanouts:
    """Per fan-out directory (index: the key hash's first byte), why blocks may not go
    through it (None: a real directory inside the root, made if missing).

    Judged once when made, then by :meth:`recheck` (a job's start) once ``recheck_s``
    passed since the last time (256 entries of one root scan: a directory swapped for a
    symlink while the tier runs is refused from then on), and by :meth:`rejudge` when a
    store finds its directory removed. A block's check is then a list index
    (:meth:`path`), no system call. Verdicts change on I/O threads too; each is one list
    item written whole, and a stale one is at worst a re-check late.
    """

    def __init__(self, mapper: FileMapper, name: str, recheck_s: float,
                 clock: Callable[[], float]) -> None:
        if not recheck_s >= 0:
            raise OffloadError("fanout_recheck_s", f"expected seconds >= 0, got {recheck_s!r}")
        self._mapper = mapper
        self._name = name
        self._clock = clock
        self.recheck_s = recheck_s
        self._real_root = os.path.realpath(mapper.root)
        self._refused: list[str | None] = self._judge_all([None] * 256)
        self._judged_at = clock()

    def path(self, key: OffloadKey) -> str:
        """``key``'s block file, or ``FanoutRefusedError`` when its fan-out directory is
        not the store's own."""
        digest = self._mapper.key_hash(key)
        why = self._refused[int(digest[:2], 16)]
        if why is not None:
            raise FanoutRefusedError(self._mapper.directory(digest), why)
        return self._mapper.path_of_hash(digest)

    def rejudge(self, key: OffloadKey) -> str | None:
        """Make ``key``'s fan-out directory again (removed behind the tier's back) and
        judge what is there now; why blocks may not go through it, or None."""
        digest = self._mapper.key_hash(key)
        why = self._refused[int(digest[:2], 16)] = self.judge(
            self._mapper.directory(digest), None)
        return why

    def recheck(self) -> None:
        """Judge every fan-out directory again if ``recheck_s`` passed (a job's start:
        one clock read per job, not per block)."""
        now = self._clock()
        if now - self._judged_at < self.recheck_s:
            return
        self._judged_at = now
        self._refused = self._judge_all(self._refused)

    def _judge_all(self, before: list[str | None]) -> list[str | None]:
        """Every fan-out directory's verdict (``judge``), from one scan of the root.

        A real directory (not a symlink: ``d_type`` from the scan, no ``lstat``) named
        ``ab`` directly in the root resolves to the root's own resolved path + ``ab`` by
        definition, so only the root is resolved again (one ``realpath``, which catches a
        root swapped for a symlink): 256 ``lstat`` + ``realpath`` calls were half of a
        restarted tier's time to its first loaded byte. A missing entry (made here), or
        anything else (a symlink, a file) is judged alone, by ``judge``."""
        directories = self._mapper.all_directories()
        real: set[str] = set()
        try:
            if os.path.realpath(self._mapper.root) == self._real_root:
                with os.scandir(self._mapper.root) as scan:
                    real = {entry.name for entry in scan
                            if len(entry.name) == 2 and entry.is_dir(follow_symlinks=False)}
        except OSError:
            real = set()   # judged one by one below, which names what is wrong
        verdicts: list[str | None] = []
        for index, (directory, was) in enumerate(zip(directories, before, strict=True)):
            if f"{index:02x}" in real:
                if was is not None:
                    logger.warning("%s: fan-out directory %s is the store's own again",
                                   self._name, directory)
                verdicts.append(None)
            else:
                verdicts.append(self.judge(directory, was))
        return verdicts

    def judge(self, directory: str, before: str | None) -> str | None:
        """Make ``directory`` if it is missing; why blocks may not go through it, or None.

        Only a real directory whose resolved path is its own place under the root is
        used: through a symlink (or anything that resolves elsewhere) the tier would
        read and write block files outside the store. Logged when the verdict changes
        from ``before``."""
        why: str | None = None
        try:
            os.mkdir(directory)
        except FileExistsError:
            pass
        except OSError as exc:
            why = f"cannot be made ({exc.strerror})"
        if why is None:
            try:
                mode = os.lstat(directory).st_mode
                resolved = os.path.realpath(directory)
            except OSError as exc:
                why = f"cannot be checked ({exc.strerror})"
            else:
                if stat.S_ISLNK(mode):
                    why = f"is a symlink to {resolved!r}, outside the store"
                elif not stat.S_ISDIR(mode):
                    why = f"is {describe_mode(mode)}, not a directory"
                elif resolved != os.path.join(self._real_root, os.path.basename(directory)):
                    why = f"resolves to {resolved!r}, outside the store"
        if why is not None:
            why = f"fan-out directory {directory} {why}: its blocks are neither stored nor " \
                  "loaded"
            if why != before:
                logger.warning("%s: %s", self._name, why)
        elif before is not None:
            logger.warning("%s: fan-out directory %s is the store's own again", self._name,
                           directory)
        return why
