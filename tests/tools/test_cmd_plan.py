"""`kvbridge plan`: output, JSON shape and exit codes (through the real CLI entry point)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
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


# ------------------------------------------------- absurd input: usage errors, never hangs

#: a regression that loops over absurd sizes allocates as it goes: fail, not fill the host
AS_LIMIT_BYTES = 2 << 30


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT_BYTES, AS_LIMIT_BYTES))


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``kvbridge ARGV`` in its own bounded process (a hang is a failure, not a stuck run)."""
    try:
        return subprocess.run([sys.executable, "-m", "kvbridge.tools.cli", *argv],
                              capture_output=True, text=True, timeout=180,
                              preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"kvbridge {' '.join(argv)} did not finish") from exc


def _usage_error(*argv: str) -> str:
    proc = _cli(*argv)
    assert proc.returncode == EXIT_USAGE, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


def _spec_file(path: Path, **region: object) -> str:
    data = {"model": "m", "regions": [{
        "name": "attn", "layout": "split", "layer_ids": [0, 1, 2, 3], "block_size": 16,
        "num_kv_heads": 8, "head_dim": 32, "dtype": "float16", **region}]}
    path.write_text(json.dumps(data))
    return str(path)


def _plan(model: str, producer: str = "tp=1", consumer: str = "tp=2") -> tuple[str, ...]:
    return ("plan", "--model", model, "--producer", producer, "--consumer", consumer)


def test_absurd_sizes_are_usage_errors_not_hangs(tmp_path: Path) -> None:
    """Before: 1e9 heads and 200k layers planned for ever (a Python loop per head, per
    layer); block_size 1e9 was planned as if real."""
    err = _usage_error(*_plan(_spec_file(tmp_path / "h.json", num_kv_heads=10**9)))
    assert "regions[0].num_kv_heads: 1000000000 exceeds kvbridge's limit of" in err
    err = _usage_error(*_plan(_spec_file(tmp_path / "l.json", layer_ids=list(range(2000)))))
    assert "regions[0].layer_ids: expected a non-empty list of layer indices in [0, " in err
    err = _usage_error(*_plan(_spec_file(tmp_path / "big.json",
                                         layer_ids=list(range(200_000)))))
    assert "model: " in err and "larger than" in err
    err = _usage_error(*_plan(_spec_file(tmp_path / "b.json", block_size=10**9)))
    assert "regions[0].block_size: 1000000000 exceeds" in err
    err = _usage_error(*_plan("tiny-gqa", producer="tp=80000000"))
    assert "producer.tp_size: 80000000 exceeds kvbridge's limit of" in err


def test_a_pair_past_the_plan_bound_is_refused_and_the_largest_allowed_plans(
        tmp_path: Path) -> None:
    """Planning costs one vectorised step per layer and pair of overlapping ranks: the
    bound on layers x ranks keeps it finite; the largest pair within it plans."""
    model = _spec_file(tmp_path / "wide.json", layer_ids=list(range(256)), num_kv_heads=256)
    proc = _cli(*_plan(model, producer="tp=256", consumer="tp=1"))
    assert proc.returncode == EXIT_FAILURE, proc.stderr[-3000:]  # refused, as any pair
    err = proc.stderr  # this model cannot run on
    assert err.startswith("kvbridge plan: refused: producer: 256 layers x 256 ranks per stage")
    assert "exceed kvbridge's limit of 32768" in err
    model = _spec_file(tmp_path / "edge.json", layer_ids=list(range(128)), num_kv_heads=256)
    proc = _cli(*_plan(model, producer="tp=256", consumer="tp=1"), "--json")
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["descriptors"] == 128 * 2 * 256  # layers x K|V x heads


@pytest.mark.parametrize(("content", "expected"), [
    (b"[" * 100_000 + b"]" * 100_000, "JSON nested deeper than a spec is"),
    (b'{"model": "\xff\xfe", "regions": []}', "not UTF-8 text (byte 11)"),
    (json.dumps({"model": "m", "regions": [{
        "name": "attn", "layout": "split", "layer_ids": [0], "block_size": 16,
        "num_kv_heads": 8, "head_dim": 32, "dtype": "float16"}]}).replace(
        '"head_dim": 32', '"head_dim": 1' + "0" * 400).encode(),
     "regions[0].head_dim: an integer of 401 digits exceeds kvbridge's limit of"),
    (b'{"model": "m", "head_dim": 1' + b"0" * 5000 + b"}",
     "a number of thousands of digits"),
])
def test_a_malformed_spec_file_is_a_usage_error_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes,
        expected: str) -> None:
    """Before: RecursionError, UnicodeDecodeError, OverflowError and ValueError tracebacks."""
    path = tmp_path / "spec.json"
    path.write_bytes(content)
    assert main(list(_plan(str(path)))) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("kvbridge plan: ") and expected in err, err


def test_a_fifo_spec_is_refused_unread(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A FIFO would block the read for ever (no writer)."""
    path = tmp_path / "spec.json"
    os.mkfifo(path)
    assert main(list(_plan(str(path)))) == EXIT_USAGE
    assert "is not a regular file" in capsys.readouterr().err
