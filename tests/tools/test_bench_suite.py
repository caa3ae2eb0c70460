"""`kvbridge bench` as one suite: one row shape for every path, one JSON file, a plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvbridge.backends.mooncake.master import MooncakeMaster
from kvbridge.tools.bench import suite as bench_suite
from kvbridge.tools.cli import EXIT_OK, EXIT_USAGE, main
from tests.conftest import assert_figures, require

ROW_KEYS = {"path", "case", "op", "unit", "num_blocks", "block_bytes", "total_bytes",
            "kvbridge", "raw", "raw_name", "ratio", "limit", "limit_name", "verified"}


def test_all_paths_write_one_json_file(tmp_path: Path, mooncake_master: MooncakeMaster,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "all", "--quick", "--iters", "1", "--events", "320",
               "--batch-sizes", "16", "--dir", str(tmp_path), "--json", str(out),
               "--master", mooncake_master.rpc_address,
               "--metadata", mooncake_master.metadata_url])
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert rc == EXIT_OK, report["paths"]
    assert set(report["paths"]) == set(bench_suite.PATHS)
    assert "machine" in report and report["quick"] is True
    for name, entry in report["paths"].items():
        assert entry["status"] == "ok" and entry["rows"], (name, entry.get("reason"))
    for row in report["rows"]:
        assert set(row) == ROW_KEYS
        # figures only well-formed: speeds and ratios are for `kvbridge bench`, not tests
        assert row["verified"] is True, row
        assert_figures(row, ("kvbridge", "raw", "ratio"))
        if row["unit"] == "GB/s":  # a throughput row moved bytes, compared with a memcpy
            assert_figures(row, ("limit",))
            assert row["block_bytes"] > 0 and row["total_bytes"] == row["num_blocks"] * row[
                "block_bytes"] > 0
    assert {r["op"] for r in report["rows"] if r["path"] == "offload"} == {"store", "load"}
    assert any(r["unit"] == "us/lookup" for r in report["rows"])
    assert {r["op"] for r in report["rows"] if r["path"] == "mooncake"} == {"put", "get"}
    assert any(r["op"] == "exists" for r in report["rows"])  # mooncake lookup, same master
    for pattern in report["paths"]["nixl"]["detail"]["patterns"]:  # bytes read and checked
        assert pattern["verified_bytes"] > 0 and pattern["mismatched_bytes"] == 0, pattern
    assert "ratio" in text and "nixl" in text and f"wrote {out}" in text


def _row(path: str, op: str, block_bytes: int, gbps: float) -> dict[str, object]:
    return bench_suite.row(path, f"8x{block_bytes}", op, "GB/s", gbps, gbps * 1.1, "raw",
                           num_blocks=8, block_bytes=block_bytes, limit=10.0,
                           limit_name="torch copy")


def test_plot_draws_throughput_against_block_size(tmp_path: Path) -> None:
    require("matplotlib", "matplotlib (pip install 'kvbridge[plot]')")
    rows = [_row(p, op, b, g) for p, op in (("nixl", "READ"), ("offload", "load"))
            for b, g in ((16 << 10, 1.0), (2 << 20, 3.0))]
    rows.append(bench_suite.row("lookup", "k", "lookup", "us/key", 1.0, 2.0, "stat",
                                lower_is_better=True))  # not a throughput: not drawn
    png = tmp_path / "bench.png"
    bench_suite.plot({"rows": rows, "paths": {}}, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_without_matplotlib_says_how_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if missing
    assert main(["bench", "events", "--plot", "x.png"]) == EXIT_USAGE
    assert "pip install 'kvbridge[plot]'" in capsys.readouterr().err


def test_one_path_prints_json_with_its_own_fields(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "events", "--events", "320", "--batch-sizes", "16", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == EXIT_OK
    assert list(report["paths"]) == ["events"]
    assert report["rows"][0]["unit"] == "events/s"
    assert report["results"]["16"]["kvbridge"]["received_events"] == 320  # events' own report


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "nixl", "--pattern", "64"]) == EXIT_USAGE
    assert main(["bench", "nixl", "--iters", "0"]) == EXIT_USAGE
    assert main(["bench", "mooncake", "--master", "127.0.0.1:1"]) == EXIT_USAGE
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "no-such-path"])
    assert exit_info.value.code == EXIT_USAGE
    assert "NUMxSIZE" in capsys.readouterr().err


def test_patterns_rows_and_table() -> None:
    assert bench_suite.parse_pattern("64x2MiB") == (64, 2 << 20)
    assert bench_suite.parse_pattern("4096x16384") == (4096, 16384)
    for bad in ("64", "0x1KiB", "4x2XB", "ax1"):
        with pytest.raises(ValueError, match="NUMxSIZE|>= 1 block"):
            bench_suite.parse_pattern(bad)
    fast = bench_suite.row("p", "c", "op", "GB/s", 9.0, 10.0, "raw", num_blocks=2,
                           block_bytes=4)
    slow = bench_suite.row("p", "c", "op", "us/key", 2.0, 1.0, "raw", lower_is_better=True)
    assert fast["ratio"] == 0.9 and fast["total_bytes"] == 8 and slow["ratio"] == 0.5
    table = bench_suite.format_table({"rows": [fast, slow], "paths": {
        "x": {"status": "skipped", "reason": "no backend"}}})
    assert "x: skipped: no backend" in table and "0.90" in table
    assert not bench_suite.suite_ok({"rows": [{**fast, "verified": False}], "paths": {}})
    assert not bench_suite.suite_ok({"rows": [], "paths": {"y": {"status": "failed"}}})


def _saved_report(tmp_path: Path, verified: bool = True) -> Path:
    rows = [bench_suite.row("offload", "8x64KiB", "store", "GB/s", 1.5, 2.0, "plain write",
                            num_blocks=8, block_bytes=64 << 10, limit=9.0, limit_name="copy",
                            verified=verified),
            bench_suite.row("events", "batch 16", "pub->sub", "events/s", 1000.0, 2000.0,
                            "raw pyzmq")]
    report = {"machine": {"time": "2026-12-01T21:51:52Z", "cpus": 2, "platform": "Linux-x",
                          "python": "3.11.7"}, "quick": False,
              "paths": {"offload": {"status": "ok", "rows": rows[:1]},
                        "events": {"status": "ok", "rows": rows[1:]},
                        "mooncake": {"status": "skipped", "reason": "no wheel", "rows": []}},
              "rows": rows}
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(bench_suite.slim_report(report)))
    return path


def test_report_renders_a_saved_run_as_markdown_naming_the_machine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = _saved_report(tmp_path)
    assert main(["bench", "all", "--report", str(saved), "--markdown"]) == EXIT_OK
    text = capsys.readouterr().out
    assert text.startswith("Measured 2026-12-01 on 2 CPUs, Linux-x, Python 3.11.7:")
    assert "| offload | 8x64KiB | store | GB/s | 1.500 | 2.000 | 0.75 | 9.000 | plain write |" \
        in text
    assert "mooncake: skipped: no wheel" in text
    assert main(["bench", "events", "--report", str(saved), "--markdown"]) == EXIT_OK
    one = capsys.readouterr().out
    assert "| events |" in one and "| offload |" not in one and "mooncake" not in one


def test_report_of_unverified_rows_exits_1_and_bad_files_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = _saved_report(tmp_path, verified=False)
    assert main(["bench", "all", "--report", str(saved), "--markdown"]) == 1
    assert "(NOT verified)" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["bench", "all", "--report", str(bad)]) == EXIT_USAGE
    assert "not a saved bench report" in capsys.readouterr().err
