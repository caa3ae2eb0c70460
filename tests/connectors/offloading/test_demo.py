"""`kvbridge demo --connector offload`: hits per tier, failed loads, verified bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, main
from kvbridge.tools.commands.demo import format_summary
from kvbridge.tools.demo.offload import format_details


def test_demo_json_reports_fs_hits_and_verified_bytes(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    code = main(["demo", "--connector", "offload", "--offload-dir", str(store),
                 "--requests", "12", "--rounds", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == EXIT_OK
    assert out["requests"] == 36 and out["failed_requests"] == 0
    assert out["mismatched_bytes"] == 0 and out["verified_bytes"] > 0
    assert out["hit_blocks_by_tier"]["cpu"] > 0 and out["hit_blocks_by_tier"]["fs"] > 0
    assert out["failed_loads"] == 0 and out["recomputed_blocks"] == 0
    assert out["events"]["CPU/LOCAL"]["stored"] > 0
    assert out["events"]["STORAGE/LOCAL"]["stored"] > 0
    assert list(store.rglob("*.kvb"))  # the directory given is the fs tier, kept


def test_demo_with_injected_faults_recomputes_and_verifies(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--connector", "offload", "--requests", "24", "--rounds", "3",
                 "--inject-faults", "0.3", "--seed", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == EXIT_OK
    # faults were injected and loads failed ...
    assert sum(out["injected_faults"].values()) > 0 and out["failed_loads"] > 0
    # ... and the demo recomputed those blocks: every request finished with the right
    # output and every loaded byte checked, so no failed load was trusted
    assert out["recomputed_blocks"] > 0
    assert out["failed_requests"] == 0 and out["wrong_outputs"] == 0
    assert out["mismatched_bytes"] == 0 and out["verified_bytes"] > 0
    assert out["hit_blocks_by_tier"]["cpu"] + out["hit_blocks_by_tier"]["fs"] > 0
    text = format_summary(out) + "\n" + format_details(out)  # what the demo prints
    assert "hits by tier" in text and f"failed loads    {out['failed_loads']}" in text
    assert f"recomputed blocks {out['recomputed_blocks']}" in text
    assert "mismatched      0" in text


def test_demo_rejects_a_bad_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--connector", "offload", "--inject-faults", "1.5"]) == EXIT_USAGE
    assert "inject_faults" in capsys.readouterr().err


def test_demo_that_verified_nothing_fails(capsys: pytest.CaptureFixture[str]) -> None:
    """Prompts shorter than a block: nothing is stored or loaded, so nothing is verified."""
    code = main(["demo", "--connector", "offload", "--prompt-tokens", "4", "--requests", "2",
                 "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["failed_requests"] == 0 and out["verified_bytes"] == 0
    assert code == EXIT_FAILURE
