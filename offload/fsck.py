"""Check (and carefully repair) an fs-tier store directory.

What is *provably broken* (and the only thing ``repair`` deletes):

* a block file of a known layout whose size differs from the header's
  ``block_bytes`` — stores are atomic, so no correct writer leaves one;
* a temp file older than ``min_temp_age_s`` — a store in progress renames its
  temp file within milliseconds; an old one is an orphan of a crashed writer.

Everything else is reported and left alone: block files of a layout with no
header or of another fingerprint than the one asked for, files in the wrong
fan-out directory, unknown files, unreadable headers, young temp files (a
writer may still be working on them).
"""

from __future__ import annotations

import enum
import json
import os
import time
from dataclasses import dataclass, field

from kvbridge.offload.fs import BLOCK_NAME_RE, HEADER_NAME_RE, FileMapper
from kvbridge.offload.fs_io import TEMP_SUFFIX


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


BROKEN = frozenset({FindingKind.SHORT_BLOCK, FindingKind.OVERSIZE_BLOCK, FindingKind.ORPHAN_TEMP})


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


def _read_headers(root: str, report: FsckReport) -> None:
    for name in sorted(os.listdir(root)):
        match = HEADER_NAME_RE.match(name)
        if not match:
            continue
        path = os.path.join(root, name)
        try:
            with open(path) as fh:
                data = json.load(fh)
            block_bytes = data["block_bytes"]
            if data.get("fingerprint") != match.group(1) or not isinstance(block_bytes, int) \
                    or block_bytes <= 0:
                raise ValueError("fingerprint or block_bytes do not match the file name")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            report.findings.append(Finding(FindingKind.BAD_HEADER, path, str(exc)))
            continue
        report.layouts[match.group(1)] = block_bytes


def fsck(root: str, *, repair: bool = False, fingerprint: str | None = None,
         min_temp_age_s: float = 60.0, now: float | None = None) -> FsckReport:
    """Scan ``root``; with ``repair``, delete only provably broken files."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"store directory {root!r} does not exist")
    now = time.time() if now is None else now
    report = FsckReport(root=root)
    _read_headers(root, report)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if rel == "." and (HEADER_NAME_RE.match(name) or name.startswith(".odirect-probe")):
                if name.startswith(".odirect-probe"):
                    _check_temp(path, now, min_temp_age_s, report)
                continue
            if name.endswith(TEMP_SUFFIX):
                _check_temp(path, now, min_temp_age_s, report)
                continue
            match = BLOCK_NAME_RE.match(name)
            if not match:
                report.findings.append(Finding(FindingKind.UNKNOWN_FILE, path,
                                               "not a block, header or temp file name"))
                continue
            _check_block(path, rel, match.group(1), match.group(2), fingerprint, report)
    if repair:
        for finding in report.findings:
            if finding.broken:
                try:
                    os.remove(finding.path)
                    finding.repaired = True
                except FileNotFoundError:
                    finding.repaired = True
                except OSError as exc:
                    finding.detail += f"; repair failed: {exc}"
    return report


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
