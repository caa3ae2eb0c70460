"""fsck: reports every kind of finding, repairs only what is provably broken; the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from kvbridge.offload.fs_layout import FileMapper
from kvbridge.offload.fsck import FindingKind, StoreUnreadableError, fsck
from kvbridge.tools.cli import main
from tests.conftest import assert_figures, missing_backend

FP = "0123456789abcdef"
OTHER_FP = "fedcba9876543210"
BLOCK = 4096


def k(i: int) -> bytes:
    return b"ns|" + str(i).encode()


def write_block(tier, key: bytes, data: bytes) -> str:
    """A block file as the tier writes it (format 2, digests in its header)."""
    tier.store([key], [[memoryview(bytearray(data))]], [None])
    return tier.path(key)


@pytest.fixture
def messy_store(make_fs, store_dir):
    """A store with good blocks and one file of every finding kind."""
    tier = make_fs().tier
    mapper = FileMapper(store_dir, FP)
    paths = {}
    for i in range(3):
        write_block(tier, k(i), b"x" * BLOCK)
    paths["short"] = mapper.path(k(3))
    with open(paths["short"], "wb") as fh:
        fh.write(b"x" * (BLOCK // 2))
    paths["oversize"] = write_block(tier, k(4), b"x" * BLOCK)
    with open(paths["oversize"], "ab") as fh:
        fh.write(b"x")
    paths["orphan"] = mapper.path(k(5)) + ".1.2.3.tmp"
    with open(paths["orphan"], "wb") as fh:
        fh.write(b"x" * 10)
    old = time.time() - 3600
    os.utime(paths["orphan"], (old, old))
    paths["young"] = mapper.path(k(6)) + ".1.2.4.tmp"
    with open(paths["young"], "wb") as fh:
        fh.write(b"x")
    paths["unknown_layout"] = FileMapper(store_dir, OTHER_FP).path(k(7))
    with open(paths["unknown_layout"], "wb") as fh:
        fh.write(b"x" * 7)
    digest = FileMapper.key_hash(k(8))
    wrong_dir = "00" if digest[:2] != "00" else "01"
    paths["misplaced"] = os.path.join(store_dir, wrong_dir, f"{digest}.{FP}.kvb")
    os.rename(write_block(tier, k(8), b"x" * BLOCK), paths["misplaced"])
    paths["unknown_file"] = os.path.join(store_dir, "ab", "notes.txt")
    with open(paths["unknown_file"], "w") as fh:
        fh.write("hello")
    return tier, paths


def kinds(report) -> dict[FindingKind, list[str]]:
    out: dict[FindingKind, list[str]] = {}
    for f in report.findings:
        out.setdefault(f.kind, []).append(f.path)
    return out


def test_fsck_reports_each_kind(messy_store, store_dir) -> None:
    _, paths = messy_store
    report = fsck(store_dir)
    found = kinds(report)
    assert report.layouts == {FP: BLOCK}
    assert report.blocks_ok == 3
    assert found[FindingKind.SHORT_BLOCK] == [paths["short"]]
    assert found[FindingKind.OVERSIZE_BLOCK] == [paths["oversize"]]
    assert found[FindingKind.ORPHAN_TEMP] == [paths["orphan"]]
    assert found[FindingKind.TEMP_IN_PROGRESS] == [paths["young"]]
    assert found[FindingKind.UNKNOWN_LAYOUT] == [paths["unknown_layout"]]
    assert found[FindingKind.MISPLACED] == [paths["misplaced"]]
    assert found[FindingKind.UNKNOWN_FILE] == [paths["unknown_file"]]
    assert not report.ok and all(os.path.exists(p) for p in paths.values())   # no repair


def test_fsck_repair_deletes_only_provably_broken(messy_store, store_dir) -> None:
    _, paths = messy_store
    report = fsck(store_dir, repair=True)
    repaired = {f.path for f in report.findings if f.repaired}
    assert repaired == {paths["short"], paths["oversize"], paths["orphan"]}
    for name in ("short", "oversize", "orphan"):
        assert not os.path.exists(paths[name])
    for name in ("young", "unknown_layout", "misplaced", "unknown_file"):
        assert os.path.exists(paths[name]), name
    again = fsck(store_dir)
    assert not {FindingKind.SHORT_BLOCK, FindingKind.OVERSIZE_BLOCK,
                FindingKind.ORPHAN_TEMP} & set(kinds(again))
    assert again.blocks_ok == 3


def test_fsck_with_fingerprint_reports_other_layouts_as_foreign(make_fs, store_dir) -> None:
    make_fs()
    other = make_fs(fingerprint=OTHER_FP).tier
    write_block(other, k(0), b"x" * BLOCK)
    assert fsck(store_dir).ok                              # both layouts are known
    report = fsck(store_dir, fingerprint=FP, repair=True)
    assert [f.kind for f in report.findings] == [FindingKind.FOREIGN_LAYOUT]
    assert os.path.exists(other.path(k(0)))                # never repaired


def test_fsck_of_a_clean_store_written_by_the_tier_is_ok(make_manager, store_dir) -> None:
    m = make_manager(num_slots=4)
    spec = m.prepare_store("w", [k(i) for i in range(4)])
    m.complete_store(spec.keys)
    assert m.wait_idle()
    report = fsck(store_dir)
    assert report.ok and report.blocks_ok == 4 and report.findings == []


def test_cli_fsck_exit_codes_and_json(messy_store, store_dir, capsys) -> None:
    assert main(["offload", "fsck", store_dir]) == 1
    out = capsys.readouterr().out
    assert "short_block" in out and "--repair" in out
    assert main(["offload", "fsck", store_dir, "--repair", "--json"]) == 1   # notes remain
    data = json.loads(capsys.readouterr().out)
    assert data["repaired"] == 3 and data["counts"]["short_block"] == 1
    assert main(["offload", "fsck", os.path.join(store_dir, "nope")]) == 2
    assert main(["offload", "fsck", store_dir, "--fingerprint", "XYZ"]) == 2
    assert main(["offload"]) == 2


#: runs the CLI as an unprivileged user: root reads a directory whatever its mode, so the
#: parser (and every module it imports) is built first, then root drops to ``nobody``
_AS_NOBODY = """
import os, sys
from kvbridge.tools import cli
import kvbridge.offload.fsck
cli.build_parser()
if os.geteuid() == 0:
    try:
        os.setgid(65534)
        os.setuid(65534)
    except OSError as exc:
        sys.exit(f"cannot drop privileges: {exc}")
sys.exit(cli.main(sys.argv[1:]))
"""


def test_cli_fsck_of_a_store_it_cannot_read_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    """Before: a PermissionError traceback (and a file given as PATH: "does not exist")."""
    outer = tempfile.mkdtemp(prefix="kvb-fsck-")   # not under pytest's root-only tmp dir
    try:
        os.chmod(outer, 0o755)
        store = os.path.join(outer, "store")
        os.mkdir(store, 0o700)
        with open(os.path.join(store, "layout-0123456789abcdef.json"), "w") as fh:
            fh.write("{}")
        if os.geteuid() != 0:
            os.chmod(store, 0)           # its owner cannot list it either
        proc = subprocess.run([sys.executable, "-c", _AS_NOBODY, "offload", "fsck", store],
                              capture_output=True, text=True, timeout=120)
        if proc.stderr.startswith("cannot drop privileges"):
            missing_backend(proc.stderr.strip())
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == (f"kvbridge offload fsck: PATH: store directory {store!r}: "
                               "cannot list it (Permission denied); run fsck as a user that "
                               "can read the store\n"), proc.stderr
        assert proc.stdout == ""
    finally:
        os.chmod(os.path.join(outer, "store"), 0o700)
        shutil.rmtree(outer)
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"x")
    assert main(["offload", "fsck", str(a_file)]) == 2
    assert capsys.readouterr().err == (f"kvbridge offload fsck: PATH: store directory "
                                       f"{str(a_file)!r}: a regular file, not a directory\n")
    with pytest.raises(StoreUnreadableError, match="does not exist"):
        fsck(str(tmp_path / "nope"))


def test_cli_fsck_clean_store_exits_zero(make_fs, store_dir, capsys) -> None:
    make_fs()
    assert main(["offload", "fsck", store_dir]) == 0
    assert capsys.readouterr().out.strip().endswith("ok")


def test_cli_bench_small_run(tmp_path, capsys) -> None:
    code = main(["offload", "bench", "--dir", str(tmp_path), "--blocks", "4",
                 "--block-kib", "64", "--batch", "2", "--rounds", "2", "--lookups", "30",
                 "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["verified"] is True and data["failed_jobs"] == 0
    assert data["bytes"] == 4 * 64 * 1024
    for name in ("store", "load"):  # well-formed figures, no claim about their size
        assert_figures(data[name], ("tier_gbps", "plain_gbps"))
    lookup = data["lookup"]
    assert_figures(lookup["busy_per_key_us"], ("median",))
    assert lookup["busy_store_jobs"] > 0
    assert os.listdir(tmp_path) == []                      # temp store removed
    assert data["tier_reads"] == "batched (io_uring)"      # 64 KiB blocks: auto batches


def test_cli_bench_reads_one_by_one_when_told(tmp_path, capsys) -> None:
    code = main(["offload", "bench", "--dir", str(tmp_path), "--blocks", "4",
                 "--block-kib", "64", "--batch", "2", "--rounds", "1", "--lookups", "5",
                 "--io-engine", "python"])
    out = capsys.readouterr().out
    assert code == 0 and "tier reads one by one (readv)" in out
    assert "verified: True, failed jobs: 0" in out


def test_cli_bench_refuses_a_missing_dir_in_one_line(tmp_path, capsys) -> None:
    missing = tmp_path / "not-there"
    code = main(["offload", "bench", "--dir", str(missing), "--blocks", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip() == (f"kvbridge offload bench: {missing}: no such directory "
                           f"(the bench's temp store goes inside it)")
    assert not missing.exists()


# ---- what a disk or an operator can leave in the store (no hangs, no unbounded reads) ----

def test_fsck_neither_hangs_on_a_fifo_header_nor_reads_dev_zero(make_fs, store_dir) -> None:
    make_fs()
    os.mkfifo(os.path.join(store_dir, f"layout-{OTHER_FP}.json"))
    third = "aaaabbbbccccdddd"
    os.symlink("/dev/zero", os.path.join(store_dir, f"layout-{third}.json"))
    fourth = "1111222233334444"
    with open(os.path.join(store_dir, f"layout-{fourth}.json"), "wb") as fh:
        fh.write(b" " * (2 << 20) + b"{}")            # whitespace-padded JSON, far too big
    report = fsck(store_dir)
    bad = {os.path.basename(f.path): f.detail for f in report.findings
           if f.kind is FindingKind.BAD_HEADER}
    assert set(bad) == {f"layout-{fp}.json" for fp in (OTHER_FP, third, fourth)}
    assert "FIFO" in bad[f"layout-{OTHER_FP}.json"]
    assert "symbolic link" in bad[f"layout-{third}.json"]
    assert "larger than" in bad[f"layout-{fourth}.json"]
    assert report.layouts == {FP: BLOCK} and not report.ok


def test_fsck_reports_symlinked_and_unreadable_fanout_dirs(make_fs, store_dir, tmp_path) -> None:
    make_fs()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.rmdir(os.path.join(store_dir, "3c"))
    os.symlink(elsewhere, os.path.join(store_dir, "3c"))
    unreadable = os.path.join(store_dir, "7f")

    def listdir(path: str) -> list[str]:              # the real call, failing as EACCES would
        if path == unreadable:
            raise PermissionError(13, "Permission denied", path)
        return os.listdir(path)

    report = fsck(store_dir, listdir=listdir, repair=True)
    found = kinds(report)
    assert found[FindingKind.SYMLINKED_DIR] == [os.path.join(store_dir, "3c")]
    assert found[FindingKind.UNREADABLE_DIR] == [unreadable]
    assert not report.ok and not any(f.repaired for f in report.findings)
    assert os.path.islink(os.path.join(store_dir, "3c")) and elsewhere.is_dir()
    if os.geteuid() != 0:                             # a real EACCES where permissions bind
        os.chmod(unreadable, 0)
        try:
            assert kinds(fsck(store_dir))[FindingKind.UNREADABLE_DIR] == [unreadable]
        finally:
            os.chmod(unreadable, 0o755)


def test_fsck_finds_and_repairs_non_regular_entries_under_block_names(make_fs, store_dir,
                                                                      tmp_path) -> None:
    tier = make_fs().tier
    target = tmp_path / "target.bin"
    target.write_bytes(b"t" * BLOCK)
    os.mkfifo(tier.path(k(0)))
    os.mkdir(tier.path(k(1)))                          # empty: removable
    os.makedirs(os.path.join(tier.path(k(2)), "inside"))   # not empty: kept
    os.symlink(target, tier.path(k(3)))
    report = fsck(store_dir, repair=True)
    found = kinds(report)
    assert sorted(found[FindingKind.NOT_REGULAR]) == sorted(tier.path(k(i)) for i in range(4))
    repaired = {f.path for f in report.findings if f.repaired}
    assert repaired == {tier.path(k(0)), tier.path(k(1)), tier.path(k(3))}
    assert not os.path.lexists(tier.path(k(3))) and target.read_bytes() == b"t" * BLOCK
    assert os.path.isdir(tier.path(k(2))) and not report.ok


def test_fsck_repair_keeps_a_block_stored_over_a_non_regular_entry_after_the_scan(
        make_fs, store_dir, monkeypatch) -> None:
    """Between the scan (a FIFO under a block name) and the repair, a running tier stores
    that block (renames a regular file over the FIFO): repair must not delete the block."""
    import kvbridge.offload.fsck as fsck_module
    from kvbridge.offload.fs_io import FsIO

    tier = make_fs().tier
    path = tier.path(k(0))
    os.mkfifo(path)
    renamed: list[str] = []

    class StoreDuringRepair(FsIO):
        def lstat_mode(self, p: str) -> int | None:
            if p == path and not renamed:
                tmp = path + ".9.9.9.tmp"
                with open(tmp, "wb") as fh:
                    fh.write(b"b" * BLOCK)
                os.rename(tmp, path)
                renamed.append(p)
            return super().lstat_mode(p)

    monkeypatch.setattr(fsck_module, "FsIO", StoreDuringRepair)
    report = fsck(store_dir, repair=True)
    assert renamed == [path]                         # the store did land between the two
    assert [f.path for f in report.findings if f.kind is FindingKind.NOT_REGULAR] == [path]
    assert os.path.isfile(path)
    with open(path, "rb") as fh:
        assert fh.read() == b"b" * BLOCK


# ---- verified KV: digests of block files --------------------------------------------------

def flip_byte(path: str, offset_from_end: int) -> None:
    """Change one byte inside the file; its size is unchanged (a torn block of the right size)."""
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.seek(size - offset_from_end)
        byte = fh.read(1)
        fh.seek(size - offset_from_end)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert os.path.getsize(path) == size


def test_fsck_finds_a_corrupt_block_reports_it_dry_and_repairs_only_it(make_fs,
                                                                        store_dir) -> None:
    tier = make_fs(num_layers=4).tier
    good = [write_block(tier, k(i), os.urandom(BLOCK)) for i in range(3)]
    bad = write_block(tier, k(9), os.urandom(BLOCK))
    flip_byte(bad, BLOCK // 4 + 1)                     # inside layer 2 of 4
    report = fsck(store_dir)                           # dry run: reported, kept
    found = kinds(report)
    assert found == {FindingKind.DIGEST_MISMATCH: [bad]}
    assert "layer 2" in report.findings[0].detail
    assert report.blocks_ok == 3 and report.blocks_verified == 3 and not report.ok
    assert os.path.exists(bad)
    report = fsck(store_dir, repair=True)
    assert [f.path for f in report.findings if f.repaired] == [bad]
    assert not os.path.exists(bad) and all(os.path.exists(p) for p in good)
    assert fsck(store_dir).ok
    # --no-digests reads no block bytes: a corrupt block's header and size are fine
    bad = write_block(tier, k(10), os.urandom(BLOCK))
    flip_byte(bad, 1)
    assert fsck(store_dir, digests=False).ok
    assert kinds(fsck(store_dir))[FindingKind.DIGEST_MISMATCH] == [bad]


def test_fsck_torn_header_and_another_keys_bytes_are_corrupt(make_fs, store_dir) -> None:
    tier = make_fs().tier
    torn = write_block(tier, k(0), os.urandom(BLOCK))
    with open(torn, "r+b") as fh:                      # a byte of the header's digests
        fh.seek(60)
        fh.write(b"\x00\x01")
    theirs = write_block(tier, k(1), os.urandom(BLOCK))
    ours = tier.path(k(2))
    with open(theirs, "rb") as src, open(ours, "wb") as dst:
        dst.write(src.read())                          # k(1)'s block under k(2)'s name
    report = fsck(store_dir, repair=True)
    assert sorted(kinds(report)[FindingKind.CORRUPT_HEADER]) == sorted([torn, ours])
    assert not os.path.exists(torn) and not os.path.exists(ours) and os.path.exists(theirs)


def test_fsck_legacy_and_unverified_blocks_are_reported_not_removed(make_fs, store_dir) -> None:
    from kvbridge.layouts.digests import DigestMode, VerifyPolicy

    tier = make_fs().tier
    legacy = tier.path(k(0))
    with open(legacy, "wb") as fh:                     # format 1: the bare block bytes
        fh.write(b"x" * BLOCK)
    off = make_fs(verify=VerifyPolicy(DigestMode.OFF)).tier
    write_block(off, k(1), os.urandom(BLOCK))           # written with verification off
    report = fsck(store_dir, repair=True)
    assert kinds(report) == {FindingKind.LEGACY_BLOCK: [legacy]}
    assert not report.findings[0].broken and os.path.exists(legacy)
    assert report.blocks_unverified == 1 and report.blocks_ok == 1


def test_fsck_repair_keeps_a_block_stored_again_after_the_scan(make_fs, store_dir, tmp_path,
                                                                monkeypatch) -> None:
    import kvbridge.offload.fsck as fsck_module

    tier = make_fs().tier
    bad = write_block(tier, k(0), os.urandom(BLOCK))
    flip_byte(bad, 1)
    elsewhere = make_fs(root=str(tmp_path / "elsewhere")).tier
    judged = fsck_module._judge_block

    def judge_then_store(*args, **kwargs):
        finding = judged(*args, **kwargs)
        # a writer renames a good block of the key over the corrupt one (a new inode)
        os.rename(write_block(elsewhere, k(0), os.urandom(BLOCK)), bad)
        return finding

    monkeypatch.setattr(fsck_module, "_judge_block", judge_then_store)
    report = fsck(store_dir, repair=True)
    assert [f.kind for f in report.findings] == [FindingKind.DIGEST_MISMATCH]
    assert not report.findings[0].repaired and "replaced since the scan" in \
        report.findings[0].detail
    monkeypatch.undo()
    assert os.path.exists(bad) and fsck(store_dir).ok


def test_cli_fsck_verifies_digests_and_says_so(make_fs, store_dir, capsys) -> None:
    tier = make_fs().tier
    bad = write_block(tier, k(0), os.urandom(BLOCK))
    write_block(tier, k(1), os.urandom(BLOCK))
    flip_byte(bad, 100)
    assert main(["offload", "fsck", store_dir]) == 1
    out = capsys.readouterr().out
    assert "digest_mismatch" in out and "BROKEN" in out and os.path.exists(bad)
    assert main(["offload", "fsck", store_dir, "--no-digests"]) == 0
    capsys.readouterr()
    assert main(["offload", "fsck", store_dir, "--repair", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["repaired"] == 1 and data["counts"] == {"digest_mismatch": 1}
    assert data["blocks_verified"] == 1 and not os.path.exists(bad)
    with pytest.raises(SystemExit):
        main(["offload", "fsck", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "verif" in help_text and "digest" in help_text and "--no-digests" in help_text


def test_cli_bench_measures_verification_against_off(tmp_path, capsys) -> None:
    code = main(["offload", "bench", "--dir", str(tmp_path), "--blocks", "4",
                 "--block-kib", "64", "--batch", "2", "--rounds", "2", "--lookups", "10",
                 "--verify", "sample,full", "--layers", "4", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    verify = data["verify"]
    assert verify["modes"] == ["off", "sample", "full"]     # off: always, the baseline
    assert verify["verified"] is True and verify["failed_jobs"] == 0
    assert verify["num_layers"] == 4 and verify["bytes"] == 4 * 64 * 1024
    for mode in verify["modes"]:                           # well-formed, no claim on size
        assert_figures(verify["gbps"][mode], ("fs_store", "fs_load", "cpu_store", "cpu_load"))
        assert_figures(verify["ratio_of_off"][mode], ("fs_store", "fs_load", "cpu_store",
                                                       "cpu_load"))
    assert set(verify["ratio_of_off"]["off"].values()) == {1.0}
    assert_figures(verify["cpu_lookup_us_per_block"], ("off", "sample", "full"))
    assert os.listdir(tmp_path) == []
    assert main(["offload", "bench", "--verify", "paranoid"]) == 2
    main(["offload", "bench", "--dir", str(tmp_path), "--blocks", "2", "--block-kib", "16",
          "--batch", "1", "--rounds", "1", "--lookups", "5", "--verify", "full",
          "--layers", "2"])
    out = capsys.readouterr().out
    assert "ratio of off" in out and "cpu_load" in out
