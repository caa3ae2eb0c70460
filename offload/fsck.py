"""Check (and carefully repair) an fs-tier store directory.

What is *provably broken* (and the only thing ``repair`` deletes):

* a block file of a known layout whose size differs from its block header's
  size plus the layout header's ``block_bytes`` (shorter than
  ``block_bytes``, or a format-2 header on a file cut short, or longer) —
  stores are atomic, so no correct writer leaves one;
* a block file of the full size whose block header is torn (no magic, a bad
  checksum, a size it would not write) or names another key than its file
  name (``corrupt_header``);
* a block file of the full size whose bytes do not match the layer digests
  in its header (``digest_mismatch``, naming the first layer that differs):
  the writer digested the bytes it wrote in the same file, so the bytes
  changed since (a torn or rotted block). Checked unless ``digests=False``;
* a temp file older than ``min_temp_age_s`` — a store in progress renames its
  temp file within milliseconds; an old one is an orphan of a crashed writer;
* something that is not a regular file under a block file's name (a
  directory, FIFO, device or symlink) — the tier only renames regular files
  into place. Repair unlinks it (a symlink, never its target) or removes the
  directory if it is empty.

Repair removes a block file only if it is still the file the scan judged
(same inode and modification time): a store that renamed a new block over it
meanwhile is kept.

Everything else is reported and left alone: format-1 block files (exactly
``block_bytes``, no header: never served by this version, ``legacy_block``),
block files of another format version or geometry (``foreign_format``),
block files of a layout with no
header or of another fingerprint than the one asked for, files in the wrong
fan-out directory, unknown files and directories, unreadable headers, young
temp files (a writer may still be working on them), a fan-out directory that
cannot be listed or is a symlink (blocks would be written through it, out of
the store; maybe an operator's choice, so fsck reports it and never removes it).

Block files written with verification off carry no digests: they are counted
(``blocks_unverified``), not findings.

fsck never blocks and never reads without a bound: files are opened only
when ``lstat`` says they are regular files, with ``O_NOFOLLOW | O_NONBLOCK``
and an ``fstat`` check (a FIFO, a symlink to ``/dev/zero`` or a huge file is
a finding, not a hang); a layout header is read up to ``MAX_HEADER_BYTES``, a
block header up to ``MAX_BLOCK_HEADER_BYTES``, and a block's bytes one layer
span at a time, of a size fixed by the layout header and the block header
(bounded by ``MAX_SPAN_BYTES``) and checked against the file's size first.
"""

from __future__ import annotations

import enum
import errno
import json
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvbridge.layouts.digests import digest_bytes
from kvbridge.offload.fs_io import (
    BLOCK_MAGIC,
    MAX_BLOCK_HEADER_BYTES,
    O_NOFOLLOW,
    O_NONBLOCK,
    TEMP_SUFFIX,
    BadBlockHeaderError,
    FsIO,
    decode_block_header,
    describe_mode,
    remove_entry,
)
from kvbridge.offload.fs_layout import BLOCK_NAME_RE, HEADER_NAME_RE, FileMapper

#: a layout header is a few dozen bytes of JSON; anything longer is not one
MAX_HEADER_BYTES = 64 * 1024
#: the most fsck reads into memory at once: one layer span of one block
MAX_SPAN_BYTES = 1 << 30
FANOUT_NAME_RE = re.compile(r"^[0-9a-f]{2}$")


class FindingKind(enum.Enum):
    SHORT_BLOCK = "short_block"              # broken: smaller than block_bytes
    OVERSIZE_BLOCK = "oversize_block"        # broken: larger than block_bytes
    ORPHAN_TEMP = "orphan_temp"              # broken: temp file older than the grace period
    TEMP_IN_PROGRESS = "temp_in_progress"    # young temp file: a store may be running
    FOREIGN_LAYOUT = "foreign_layout"        # fingerprint differs from the one asked for
    UNKNOWN_LAYOUT = "unknown_layout"        # fingerprint without a layout header
    MISPLACED = "misplaced"                  # not in the fan-out dir its hash names
    BAD_HEADER = "bad_header"                # header unreadable or malformed
    UNKNOWN_FILE = "unknown_file"            # not a name the fs tier writes
    NOT_REGULAR = "not_regular"              # broken: a dir/FIFO/device/symlink as a block
    UNKNOWN_DIR = "unknown_dir"              # a directory the fs tier does not make
    UNREADABLE_DIR = "unreadable_dir"        # a fan-out directory that cannot be listed
    SYMLINKED_DIR = "symlinked_dir"          # a fan-out directory that is a symlink
    DIGEST_MISMATCH = "digest_mismatch"      # broken: bytes differ from the header's digests
    CORRUPT_HEADER = "corrupt_header"        # broken: torn block header, or another key's
    LEGACY_BLOCK = "legacy_block"            # format 1 (no header, no digests): not served
    FOREIGN_FORMAT = "foreign_format"        # another block format version or geometry
    UNREADABLE_BLOCK = "unreadable_block"    # open/read failed: unchecked (kept)
    ORPHAN_DIGEST = "orphan_digest"          # broken (obj tier): digests of no stored block


BROKEN = frozenset({FindingKind.SHORT_BLOCK, FindingKind.OVERSIZE_BLOCK, FindingKind.ORPHAN_TEMP,
                    FindingKind.NOT_REGULAR, FindingKind.DIGEST_MISMATCH,
                    FindingKind.CORRUPT_HEADER, FindingKind.ORPHAN_DIGEST})


@dataclass
class Finding:
    kind: FindingKind
    path: str
    detail: str
    repaired: bool = False
    #: block files: (inode, mtime ns) when judged; repair removes only that same file
    identity: tuple[int, int] | None = None

    @property
    def broken(self) -> bool:
        return self.kind in BROKEN

    def to_dict(self) -> dict[str, object]:
        return {"kind": self.kind.value, "path": self.path, "detail": self.detail,
                "broken": self.broken, "repaired": self.repaired}


@dataclass
class FsckReport:
    root: str
    layouts: dict[str, int] = field(default_factory=dict)   # fingerprint -> block_bytes
    blocks_ok: int = 0
    #: blocks whose bytes were checked against their digests (and matched)
    blocks_verified: int = 0
    #: blocks written without digests (verification off): sizes checked only
    blocks_unverified: int = 0
    findings: list[Finding] = field(default_factory=list)

    @property
    def problems(self) -> list[Finding]:
        """Findings left unrepaired (young temp files are not problems)."""
        return [f for f in self.findings
                if not f.repaired and f.kind is not FindingKind.TEMP_IN_PROGRESS]

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, object]:
        counts: dict[str, int] = {}
        for f in self.findings:
            counts[f.kind.value] = counts.get(f.kind.value, 0) + 1
        return {"root": self.root, "ok": self.ok, "layouts": self.layouts,
                "blocks_ok": self.blocks_ok, "blocks_verified": self.blocks_verified,
                "blocks_unverified": self.blocks_unverified, "counts": counts,
                "repaired": sum(f.repaired for f in self.findings),
                "findings": [f.to_dict() for f in self.findings]}


def read_header_bytes(path: str) -> bytes:
    """A header's bytes: only a regular file (not followed if a symlink), never
    blocking (a FIFO), at most ``MAX_HEADER_BYTES``. Raises OSError / ValueError."""
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise ValueError(f"{describe_mode(mode)}, not a header file")
    fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{describe_mode(mode)}, not a header file")
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_HEADER_BYTES:
            chunk = os.read(fd, MAX_HEADER_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"larger than {MAX_HEADER_BYTES} bytes, not a header")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _read_headers(root: str, names: list[str], report: FsckReport) -> None:
    for name in names:
        match = HEADER_NAME_RE.match(name)
        if not match:
            continue
        path = os.path.join(root, name)
        try:
            data = json.loads(read_header_bytes(path))
            block_bytes = data["block_bytes"]
            if data.get("fingerprint") != match.group(1) or not isinstance(block_bytes, int) \
                    or block_bytes <= 0:
                raise ValueError("fingerprint or block_bytes do not match the file name")
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            report.findings.append(Finding(FindingKind.BAD_HEADER, path, str(exc)))
            continue
        report.layouts[match.group(1)] = block_bytes


def fsck(root: str, *, repair: bool = False, fingerprint: str | None = None,
         min_temp_age_s: float = 60.0, now: float | None = None,
         listdir: Callable[[str], list[str]] = os.listdir, digests: bool = True) -> FsckReport:
    """Scan ``root``; with ``repair``, delete only provably broken entries.

    ``digests``: read every block file of a known layout and check its bytes
    against the layer digests in its header (False: headers and sizes only).

    ``listdir``: how a fan-out directory is listed (fault injection wraps ``os.listdir``;
    root can list a ``chmod 000`` directory, so tests cannot make one unreadable otherwise).
    """
    names = sorted(_list_store(root))
    now = time.time() if now is None else now
    report = FsckReport(root=root)
    _read_headers(root, names, report)
    for name in names:
        path = os.path.join(root, name)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue  # removed meanwhile
        except OSError as exc:
            report.findings.append(Finding(FindingKind.UNREADABLE_DIR, root,
                                           f"cannot stat {name} ({exc.strerror})"))
            continue
        if HEADER_NAME_RE.match(name):
            continue  # judged by _read_headers
        if FANOUT_NAME_RE.match(name):
            if stat.S_ISLNK(mode):
                report.findings.append(Finding(
                    FindingKind.SYMLINKED_DIR, path, f"a symlink to {os.readlink(path)!r}: "
                    "blocks would be read and written outside the store"))
                continue
            if stat.S_ISDIR(mode):
                _scan_fanout(root, name, fingerprint, now, min_temp_age_s, report, listdir,
                             digests)
                continue
        if stat.S_ISDIR(mode):
            report.findings.append(Finding(FindingKind.UNKNOWN_DIR, path,
                                           "not a directory the fs tier makes"))
            continue
        _check_entry(path, name, ".", mode, fingerprint, now, min_temp_age_s, report, digests)
    if repair:
        io = FsIO()
        for finding in report.findings:
            if finding.broken:
                # a non-regular entry may have been replaced by a stored block since the
                # scan: that block is kept
                not_regular = finding.kind is FindingKind.NOT_REGULAR
                if finding.identity is not None and _identity(finding.path) != finding.identity:
                    finding.detail += "; replaced since the scan (kept, not repaired)"
                    continue
                if remove_entry(io, finding.path, keep_regular=not_regular):
                    finding.repaired = True
                elif not_regular and stat.S_ISREG(io.lstat_mode(finding.path) or 0):
                    finding.detail += "; a regular file is there now (kept, not repaired)"
                else:
                    finding.detail += "; repair failed (see the log)"
    return report


class StoreUnreadableError(OSError):
    """The store directory itself cannot be checked: it is missing, not a directory,
    or cannot be listed (``reason`` says which). Nothing was scanned."""

    def __init__(self, root: str, reason: str, errno_: int | None = None) -> None:
        super().__init__(errno_, f"store directory {root!r}: {reason}")
        self.root = root
        self.reason = reason


def _list_store(root: str) -> list[str]:
    """The names in the store directory, or ``StoreUnreadableError`` saying why not."""
    try:
        mode = os.stat(root).st_mode
    except FileNotFoundError:
        raise StoreUnreadableError(root, "does not exist", errno.ENOENT) from None
    except OSError as exc:
        raise StoreUnreadableError(root, f"cannot read it ({exc.strerror})", exc.errno) \
            from None
    if not stat.S_ISDIR(mode):
        what = "a regular file" if stat.S_ISREG(mode) else describe_mode(mode)
        raise StoreUnreadableError(root, f"{what}, not a directory", errno.ENOTDIR)
    try:
        return os.listdir(root)
    except OSError as exc:
        # e.g. a directory this user may not read: say so instead of a traceback
        raise StoreUnreadableError(root, f"cannot list it ({exc.strerror}); run fsck as "
                                   "a user that can read the store", exc.errno) from None


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns)


def _scan_fanout(root: str, rel: str, fingerprint: str | None, now: float, min_temp_age_s: float,
                 report: FsckReport, listdir: Callable[[str], list[str]],
                 digests: bool) -> None:
    directory = os.path.join(root, rel)
    try:
        names = sorted(listdir(directory))
    except OSError as exc:
        report.findings.append(Finding(FindingKind.UNREADABLE_DIR, directory,
                                       f"cannot list it ({exc}); its blocks are unchecked"))
        return
    for name in names:
        path = os.path.join(directory, name)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        except OSError as exc:
            report.findings.append(Finding(FindingKind.UNREADABLE_DIR, directory,
                                           f"cannot stat {name} ({exc})"))
            continue
        if stat.S_ISDIR(mode) and not BLOCK_NAME_RE.match(name):
            report.findings.append(Finding(FindingKind.UNKNOWN_DIR, path,
                                           "not a directory the fs tier makes"))
            continue
        _check_entry(path, name, rel, mode, fingerprint, now, min_temp_age_s, report, digests)


def _check_entry(path: str, name: str, rel: str, mode: int, fingerprint: str | None, now: float,
                 min_temp_age_s: float, report: FsckReport, digests: bool) -> None:
    if rel == "." and name.startswith(".odirect-probe") or name.endswith(TEMP_SUFFIX):
        _check_temp(path, now, min_temp_age_s, report)
        return
    match = BLOCK_NAME_RE.match(name)
    if not match:
        report.findings.append(Finding(FindingKind.UNKNOWN_FILE, path,
                                       "not a block, header or temp file name"))
        return
    if not stat.S_ISREG(mode):
        report.findings.append(Finding(FindingKind.NOT_REGULAR, path,
                                       f"{describe_mode(mode)} under a block file's name"))
        return
    _check_block(path, rel, match.group(1), match.group(2), fingerprint, report, digests)


def _check_temp(path: str, now: float, min_age_s: float, report: FsckReport) -> None:
    try:
        age = now - os.lstat(path).st_mtime
    except FileNotFoundError:
        return  # renamed into place meanwhile
    if age >= min_age_s:
        report.findings.append(Finding(FindingKind.ORPHAN_TEMP, path,
                                       f"temp file {age:.0f} s old (>= {min_age_s:.0f} s)"))
    else:
        report.findings.append(Finding(FindingKind.TEMP_IN_PROGRESS, path,
                                       f"temp file {age:.1f} s old; a store may be running"))


def _check_block(path: str, rel: str, key_hash: str, fp: str, wanted_fp: str | None,
                 report: FsckReport, digests: bool) -> None:
    if wanted_fp is not None and fp != wanted_fp:
        report.findings.append(Finding(FindingKind.FOREIGN_LAYOUT, path,
                                       f"fingerprint {fp}, expected {wanted_fp}"))
        return
    block_bytes = report.layouts.get(fp)
    if block_bytes is None:
        report.findings.append(Finding(FindingKind.UNKNOWN_LAYOUT, path,
                                       f"no layout-{fp}.json header in the store"))
        return
    expected_dir = os.path.relpath(FileMapper(".", fp).directory(key_hash), ".")
    if rel != expected_dir:
        report.findings.append(Finding(FindingKind.MISPLACED, path,
                                       f"expected under {expected_dir}/"))
        return
    try:
        fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | O_NONBLOCK)
    except FileNotFoundError:
        return   # removed meanwhile
    except OSError as exc:
        report.findings.append(Finding(FindingKind.UNREADABLE_BLOCK, path, f"cannot open it "
                                       f"({exc}); unchecked"))
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):   # replaced since the lstat: judged next time
            return
        finding = _judge_block(fd, path, key_hash, st.st_size, block_bytes, digests, report)
    except OSError as exc:
        finding = Finding(FindingKind.UNREADABLE_BLOCK, path, f"read failed ({exc}); unchecked")
    finally:
        os.close(fd)
    if finding is None:
        report.blocks_ok += 1
        return
    if finding.broken:
        finding.identity = (st.st_ino, st.st_mtime_ns)
    report.findings.append(finding)


def _read_at(fd: int, nbytes: int, offset: int) -> bytes:
    """Exactly ``nbytes`` at ``offset`` (fewer only at EOF)."""
    chunks: list[bytes] = []
    done = 0
    while done < nbytes:
        chunk = os.pread(fd, nbytes - done, offset + done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def _judge_block(fd: int, path: str, key_hash: str, size: int, block_bytes: int, digests: bool,
                 report: FsckReport) -> Finding | None:
    """One regular block file of a known layout: the finding, or None when it is good."""
    if size < block_bytes:
        return Finding(FindingKind.SHORT_BLOCK, path, f"{size} bytes, block_bytes is "
                       f"{block_bytes}")
    magic = _read_at(fd, len(BLOCK_MAGIC), 0)
    if size == block_bytes and magic != BLOCK_MAGIC:
        return Finding(FindingKind.LEGACY_BLOCK, path, "format 1 (no header, no digests): "
                       "never served by this version; a load fails and it is written again")
    head = _read_at(fd, min(size, MAX_BLOCK_HEADER_BYTES), 0)
    try:
        header = decode_block_header(path, head)
    except BadBlockHeaderError as exc:
        if exc.corrupt and size == block_bytes:   # a header, cut short to block_bytes
            return Finding(FindingKind.SHORT_BLOCK, path, f"{size} bytes with a block header: "
                           "shorter than its header + block_bytes")
        kind = FindingKind.CORRUPT_HEADER if exc.corrupt else FindingKind.FOREIGN_FORMAT
        return Finding(kind, path, exc.reason)
    expected = header.header_bytes + block_bytes
    if size < expected:
        return Finding(FindingKind.SHORT_BLOCK, path, f"{size} bytes, header + block_bytes "
                       f"is {expected}")
    if size > expected:
        return Finding(FindingKind.OVERSIZE_BLOCK, path, f"{size} bytes, header + block_bytes "
                       f"is {expected}")
    if header.key_hash.hex() != key_hash:
        return Finding(FindingKind.CORRUPT_HEADER, path, f"the block of key hash "
                       f"{header.key_hash.hex()}, not of its file name's")
    if header.block_bytes != block_bytes or block_bytes % header.num_layers:
        return Finding(FindingKind.FOREIGN_FORMAT, path, f"header says {header.num_layers} "
                       f"layers of {header.block_bytes} bytes in all; the layout has "
                       f"block_bytes={block_bytes}")
    if header.layer_digests is None:
        report.blocks_unverified += 1
        return None
    if not digests:
        return None
    span = block_bytes // header.num_layers
    if span > MAX_SPAN_BYTES:
        return Finding(FindingKind.UNREADABLE_BLOCK, path, f"layer span of {span} bytes is "
                       f"larger than fsck reads ({MAX_SPAN_BYTES}); unchecked")
    for layer, want in enumerate(header.layer_digests):
        data = _read_at(fd, span, header.header_bytes + layer * span)
        if len(data) != span:
            return Finding(FindingKind.SHORT_BLOCK, path, "ended while its bytes were read")
        got = digest_bytes(data)
        if got != want:
            return Finding(FindingKind.DIGEST_MISMATCH, path, f"layer {layer}: digest "
                           f"{got:016x}, its header says {want:016x}")
    report.blocks_verified += 1
    return None
