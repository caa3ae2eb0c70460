"""The side-by-side benchmark of kvbridge's fs tier and vLLM's own fs tier runs, and is honest.

No timing is asserted: the test checks that both real tiers stored and loaded every
block (byte for byte), that the report's ratios are the ratios of its own figures,
and that the CLI's exit status says when a load failed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integrations.conftest import require_vllm_env

pytestmark = pytest.mark.vllm


def test_both_tiers_move_the_same_blocks_and_every_load_is_checked(tmp_path: Path) -> None:
    require_vllm_env()
    from kvbridge.tools.bench.vllm_fs import TIERS, run_fs_vs_vllm

    report = run_fs_vs_vllm(str(tmp_path), num_blocks=12, block_bytes=64 << 10,
                            batch_blocks=4, rounds=2, num_layers=4)
    assert report["verified"] is True and report["failed_jobs"] == 0
    assert set(report["gbps"]) == set(TIERS)
    for tier, by_op in report["rounds_gbps"].items():
        assert [len(by_op[op]) for op in ("store", "load")] == [2, 2], tier
        assert all(g > 0 for op in ("store", "load") for g in by_op[op])
    # the ratio is vLLM's median time over kvbridge's, i.e. kvbridge GB/s over vLLM GB/s
    for tier in ("kvbridge", "kvbridge_verify_off"):
        for op in ("store", "load"):
            expected = report["gbps"][tier][op] / report["gbps"]["vllm"][op]
            assert report["ratio_of_vllm"][tier][op] == pytest.approx(expected, rel=0.02)
    # the temp stores are gone
    assert list(tmp_path.iterdir()) == []


def test_cli_writes_json_and_validates_its_arguments(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    require_vllm_env()
    from kvbridge.tools.bench.vllm_fs import main

    out = tmp_path / "fs.json"
    assert main(["--pattern", "8x64KiB", "--rounds", "1", "--layers", "2", "--batch", "4",
                 "--dir", str(tmp_path), "--json", str(out)]) == 0
    (case,) = json.loads(out.read_text())["fs_vs_vllm"]
    assert case["num_blocks"] == 8 and case["block_bytes"] == 64 << 10 and case["verified"]
    assert "every load verified byte for byte" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--pattern", "8xlots"])
    with pytest.raises(SystemExit):
        main(["--rounds", "0"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["--dir", str(tmp_path / "not-there")])
    assert "--dir " + str(tmp_path / "not-there") + ": no such directory" in \
        capsys.readouterr().err


def test_block_hashes_spread_vllms_files_as_real_ones_do() -> None:
    """vLLM's fs tier puts a block file in a directory named by the first five hex
    digits of its block hash: the bench's hashes must spread them (readable ones put
    every file in one warm directory, which flattered vLLM's stores)."""
    require_vllm_env()
    from kvbridge.tools.bench.vllm_fs import block_hash

    hashes = [block_hash(b"vllm|0", i) for i in range(128)]
    assert all(len(h) == 32 for h in hashes) and len(set(hashes)) == 128
    assert len({h.hex()[:5] for h in hashes}) >= 120
    assert block_hash(b"vllm|0", 7) == block_hash(b"vllm|0", 7) != block_hash(b"vllm|1", 7)
