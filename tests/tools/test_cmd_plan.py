"""`kvbridge plan`: output, JSON shape and exit codes (through the real CLI entry point)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbridge.layouts import ParallelTopology, load_spec
from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, main


def test_plan_text_lists_every_consumer_rank(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", "tiny-gqa", "--producer", "tp=4,pp=1",
               "--consumer", "tp=2,pp=1"])
    out = capsys.readouterr().out
    assert rc == EXIT_OK
    lines = out.splitlines()
    assert lines[0].startswith("model tiny-gqa")
    assert lines[2].split() == ["tp0/pp0", "tp0/pp0,", "tp1/pp0", "32768", "32", "->", "16"]
    assert lines[3].split()[0] == "tp1/pp0" and "tp2/pp0, tp3/pp0" in lines[3]
    assert "total per block index: 65536 bytes (64.0 KiB)" in out


def test_plan_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", "tiny-hybrid", "--producer", "tp=4,pp=2",
               "--consumer", "tp=2", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == EXIT_OK
    spec = load_spec("tiny-hybrid")
    expected = sum(s.block_bytes for r in ParallelTopology(tp_size=2).ranks()
                   for s in spec.rank_shapes(r))
    assert data["total_bytes_per_block"] == expected
    assert data["producer"] == "tp=4,pp=2,dcp=1,pcp=1"
    assert [r["consumer"]["name"] for r in data["ranks"]] == ["tp0/pp0", "tp1/pp0"]
    assert sum(r["bytes_per_block"] for r in data["ranks"]) == expected
    for rank in data["ranks"]:
        assert rank["descriptors"] <= rank["descriptors_before_coalescing"]
        assert {s["pp_rank"] for s in rank["sources"]} == {0, 1}
    assert "note" not in data


def test_plan_nhd_note(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", "tiny-gqa-nhd", "--producer", "tp=2", "--consumer", "tp=4",
               "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == EXIT_OK and "HND" in data["note"]
    assert data["descriptors"] == 4 * 4 * 2 * 16  # ranks x layers x K|V x tokens


def test_plan_from_spec_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(load_spec("tiny-mla").to_dict()))
    assert main(["plan", "--model", str(path), "--producer", "tp=2", "--consumer", "tp=4",
                 "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["model"] == "tiny-mla"


def test_refused_plan_exits_1_with_reason_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", "tiny-gqa", "--producer", "tp=4,dcp=2",
               "--consumer", "tp=2", "--json"])
    captured = capsys.readouterr()
    assert rc == EXIT_FAILURE
    assert captured.out == ""
    assert "consumer.dcp_size" in captured.err and "same dcp_size" in captured.err


@pytest.mark.parametrize("argv", [
    ["--producer", "tp=x", "--consumer", "tp=2"],
    ["--producer", "tp=6,dcp=4", "--consumer", "tp=2"],
    ["--producer", "tp=2", "--consumer", "bogus=1"],
])
def test_bad_topology_is_a_usage_error(argv: list[str],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "tiny-gqa", *argv]) == EXIT_USAGE
    assert "kvbridge plan:" in capsys.readouterr().err


def test_unknown_model_and_missing_argument(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "nope", "--producer", "tp=1",
                 "--consumer", "tp=1"]) == EXIT_USAGE
    assert "unknown preset" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["plan", "--model", "tiny-gqa", "--producer", "tp=1"])
    assert info.value.code == EXIT_USAGE


def test_help_has_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--help"])
    assert info.value.code == 0
    assert "kvbridge plan --model tiny-gqa --producer tp=4,pp=1" in capsys.readouterr().out
