"""The direct-I/O memory bench: every kind of memory writes and reads back the same bytes
(checked by the bench, and here a changed read is caught), its CLI refuses bad input, and
a directory without O_DIRECT is a clear refusal, not a number."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvbridge.offload.fs_io import probe_o_direct
from kvbridge.tools.bench import direct_memory
from tests.conftest import assert_figures


def _direct_dir(tmp_path: Path) -> str:
    """A directory where O_DIRECT works: the test's own, else /var/tmp (tmpfs /tmp)."""
    for candidate in (str(tmp_path), "/var/tmp"):
        if probe_o_direct(candidate):
            return candidate
    pytest.skip("no directory here takes O_DIRECT (not a backend: a file system)")


def test_every_kind_moves_the_same_bytes(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    where = _direct_dir(tmp_path)
    out = tmp_path / "report.json"
    assert direct_memory.main(["--files", "6", "--size", "64K", "--threads", "3",
                               "--rounds", "1", "--dir", where, "--json", str(out)]) == 0
    report = json.loads(out.read_text())["direct_memory"]
    assert report["verified"] is True
    assert set(report["median"]) == set(direct_memory.KINDS)
    for kind in direct_memory.KINDS:
        assert_figures(report["median"][kind], ["write", "read", "write_cpu_us",
                                                "read_cpu_us"])
        assert report["median"][kind]["read"] > 0
    assert report["ratio"]["shared"] == {"write": 1.0, "read": 1.0}
    if report["disk_stat"] is not None:
        # O_DIRECT bypasses the page cache: every file read reached the disk at least once
        for kind in direct_memory.KINDS:
            assert report["median"][kind]["read_requests"] >= 1.0
    assert "every read verified byte for byte" in capsys.readouterr().out
    assert not [p for p in os.listdir(where) if p.startswith("kvbridge-direct-")]


def test_a_read_that_brings_other_bytes_fails_the_run(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    where = _direct_dir(tmp_path)
    real_read = direct_memory._read

    def read_then_flip(path: str, view: memoryview) -> None:
        real_read(path, view)
        if path.endswith(os.path.join("kvbridge-2", "3.bin")):   # round 2, one file
            view[100] ^= 0xFF

    monkeypatch.setattr(direct_memory, "_read", read_then_flip)
    report = direct_memory.run(where, files=4, size=16 << 10, threads=2, rounds=2)
    assert report["verified"] is False


@pytest.mark.parametrize("argv, message", [
    (["--size", "1000"], "multiple of 4096"),
    (["--size", "2X"], "expected a size"),
    (["--files", "0"], "--files must be positive"),
    (["--files", "4096", "--size", "2M"], "at most"),
    (["--dir", "/nonexistent/kvbridge"], "no such directory"),
])
def test_bad_input_is_refused(argv: list[str], message: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        direct_memory.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_directory_without_o_direct_is_refused(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(direct_memory, "probe_o_direct", lambda directory: False)
    assert direct_memory.main(["--dir", str(tmp_path)]) == 2
    assert "O_DIRECT is not supported" in capsys.readouterr().err


def test_the_disk_statistics_file_is_the_directorys_device(tmp_path: Path) -> None:
    path = direct_memory.disk_stat_path(str(tmp_path))
    if path is None:       # tmpfs or overlay: no block device, and no request counts
        assert direct_memory._completed(None) is None
        return
    dev = os.stat(tmp_path).st_dev
    assert path == f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
    counts = direct_memory._completed(path)
    assert counts is not None and min(counts) >= 0
