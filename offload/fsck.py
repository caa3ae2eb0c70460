"""Check (and carefully repair) an fs-tier store directory.

What is *provably broken* (and the only thing ``repair`` deletes):

* a block file of a known layout whose size differs from the header's
  ``block_bytes`` — stores are atomic, so no correct writer leaves one;
* a temp file older than ``min_temp_age_s`` — a store in progress renames its
  temp file within milliseconds; an old one is an orphan of a crashed writer;
* something that is not a regular file under a block file's name (a
  directory, FIFO, device or symlink) — the tier only renames regular files
  into place. Repair unlinks it (a symlink, never its target) or removes the
  directory if it is empty.

Everything else is reported and left alone: block files of a layout with no
header or of another fingerprint than the one asked for, files in the wrong
fan-out directory, unknown files and directories, unreadable headers, young
temp files (a writer may still be working on them), a fan-out directory that
cannot be listed or is a symlink (blocks would be written through it, out of
the store; maybe an operator's choice, so fsck reports it and never removes it).

fsck never blocks and never reads without a bound: nothing is opened except
headers, and those only when ``lstat`` says they are regular files, with
``O_NOFOLLOW | O_NONBLOCK``, an ``fstat`` check and at most
``MAX_HEADER_BYTES`` read (a FIFO, a symlink to ``/dev/zero`` or a huge file
is a bad header, not a hang). Block files are judged by ``lstat`` alone.
"""

from __future__ import annotations

import enum
import json
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvbridge.offload.fs import BLOCK_NAME_RE, HEADER_NAME_RE, FileMapper
from kvbridge.offload.fs_io import (
    O_NOFOLLOW,
    O_NONBLOCK,
    TEMP_SUFFIX,
    FsIO,
    describe_mode,
    remove_entry,
)

#: a layout header is a few dozen bytes of JSON; anything longer is not one
MAX_HEADER_BYTES = 64 * 1024
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


BROKEN = frozenset({FindingKind.SHORT_BLOCK, FindingKind.OVERSIZE_BLOCK, FindingKind.ORPHAN_TEMP,
                    FindingKind.NOT_REGULAR})


@dataclass
class Finding:
    kind: FindingKind
    path: str
    detail: str
    repaired: bool = False

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
                "blocks_ok": self.blocks_ok, "counts": counts,
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
         listdir: Callable[[str], list[str]] = os.listdir) -> FsckReport:
    """Scan ``root``; with ``repair``, delete only provably broken entries.

    ``listdir``: how a fan-out directory is listed (fault injection wraps ``os.listdir``;
    root can list a ``chmod 000`` directory, so tests cannot make one unreadable otherwise).
    """
    if not os.path.isdir(root):
        raise FileNotFoundError(f"store directory {root!r} does not exist")
    now = time.time() if now is None else now
    report = FsckReport(root=root)
    names = sorted(os.listdir(root))
    _read_headers(root, names, report)
    for name in names:
        path = os.path.join(root, name)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue  # removed meanwhile
        if HEADER_NAME_RE.match(name):
            continue  # judged by _read_headers
        if FANOUT_NAME_RE.match(name):
            if stat.S_ISLNK(mode):
                report.findings.append(Finding(
                    FindingKind.SYMLINKED_DIR, path, f"a symlink to {os.readlink(path)!r}: "
                    "blocks would be read and written outside the store"))
                continue
            if stat.S_ISDIR(mode):
                _scan_fanout(root, name, fingerprint, now, min_temp_age_s, report, listdir)
                continue
        if stat.S_ISDIR(mode):
            report.findings.append(Finding(FindingKind.UNKNOWN_DIR, path,
                                           "not a directory the fs tier makes"))
            continue
        _check_entry(path, name, ".", mode, fingerprint, now, min_temp_age_s, report)
    if repair:
        io = FsIO()
        for finding in report.findings:
            if finding.broken:
                # a non-regular entry may have been replaced by a stored block since the
                # scan: that block is kept
                not_regular = finding.kind is FindingKind.NOT_REGULAR
                if remove_entry(io, finding.path, keep_regular=not_regular):
                    finding.repaired = True
                elif not_regular and stat.S_ISREG(io.lstat_mode(finding.path) or 0):
                    finding.detail += "; a regular file is there now (kept, not repaired)"
                else:
                    finding.detail += "; repair failed (see the log)"
    return report


def _scan_fanout(root: str, rel: str, fingerprint: str | None, now: float, min_temp_age_s: float,
                 report: FsckReport, listdir: Callable[[str], list[str]]) -> None:
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
        _check_entry(path, name, rel, mode, fingerprint, now, min_temp_age_s, report)


def _check_entry(path: str, name: str, rel: str, mode: int, fingerprint: str | None, now: float,
                 min_temp_age_s: float, report: FsckReport) -> None:
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
    _check_block(path, rel, match.group(1), match.group(2), fingerprint, report)


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


def _check_block(path: str, rel: str, digest: str, fp: str, wanted_fp: str | None,
                 report: FsckReport) -> None:
    if wanted_fp is not None and fp != wanted_fp:
        report.findings.append(Finding(FindingKind.FOREIGN_LAYOUT, path,
                                       f"fingerprint {fp}, expected {wanted_fp}"))
        return
    block_bytes = report.layouts.get(fp)
    if block_bytes is None:
        report.findings.append(Finding(FindingKind.UNKNOWN_LAYOUT, path,
                                       f"no layout-{fp}.json header in the store"))
        return
    expected_dir = os.path.relpath(FileMapper(".", fp).directory(digest), ".")
    if rel != expected_dir:
        report.findings.append(Finding(FindingKind.MISPLACED, path,
                                       f"expected under {expected_dir}/"))
        return
    try:
        size = os.lstat(path).st_size
    except FileNotFoundError:
        return
    if size < block_bytes:
        report.findings.append(Finding(FindingKind.SHORT_BLOCK, path,
                                       f"{size} bytes, block_bytes is {block_bytes}"))
    elif size > block_bytes:
        report.findings.append(Finding(FindingKind.OVERSIZE_BLOCK, path,
                                       f"{size} bytes, block_bytes is {block_bytes}"))
    else:
        report.blocks_ok += 1
