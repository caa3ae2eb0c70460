"""The CLI-facing pieces: ``kvbridge demo --connector mooncake`` and the connector bench."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvbridge.backends.mooncake.master import MooncakeMaster
from kvbridge.tools.cli import main
from tests.conftest import assert_figures


def test_demo_through_the_store(mooncake_master: MooncakeMaster,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """Two engine processes, the shared master given with --master/--metadata."""
    rc = main(["demo", "--connector", "mooncake", "--master", mooncake_master.rpc_address,
               "--metadata", mooncake_master.metadata_url, "--requests", "4",
               "--model", "tiny-mla", "--producer", "tp=2", "--consumer", "tp=2",
               "--kv-config", json.dumps({"global_segment_size": 16 << 20,
                                          "local_buffer_size": 4 << 20}),
               "--timeout", "120", "--json"])
    summary: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert rc == 0, summary
    assert summary["connector"] == "mooncake" and summary["requests"] == 4
    assert summary["failed_requests"] == 0 and summary["mismatched_bytes"] == 0
    assert summary["external_tokens"] > 0 and summary["verified_bytes"] > 0
    assert summary["bytes"] > 0 and summary["put_bytes"] > 0 and summary["load_errors"] == 0
    assert summary["idle_problems"] == {"producer": [], "consumer": []}


def test_demo_rejects_metadata_without_master(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--connector", "mooncake", "--metadata", "http://127.0.0.1:1/metadata"])
    assert rc == 2
    assert "--metadata needs --master" in capsys.readouterr().err


def test_bench_reports_both_sides_verified(mooncake_master: MooncakeMaster) -> None:
    from kvbridge.tools.bench.mooncake import format_report, run_bench

    report = run_bench([(8, 64 << 10), (64, 16 << 10)], rounds=2,
                       master_address=mooncake_master.rpc_address,
                       metadata_server=mooncake_master.metadata_url)
    assert [(p["num_blocks"], p["block_bytes"]) for p in report["patterns"]] == [
        (8, 64 << 10), (64, 16 << 10)]
    for pattern in report["patterns"]:
        assert pattern["verified"], pattern["failed_rounds"]
        assert pattern["mismatched_bytes"] == 0
        for side in ("raw", "connector"):  # well-formed figures, no claim about their size
            assert_figures(pattern[side], ("put_gbps", "get_gbps"))
        assert_figures(pattern["ratio"], ("put", "get"))
        # the connector's get with each verification mode, and its ratio to verify off
        assert set(pattern["verify"]) == {"off", "sample", "full"}
        for mode in ("off", "sample", "full"):
            assert_figures(pattern["verify"][mode], ("put_gbps", "get_gbps"))
            assert_figures(pattern["verify_ratio"][mode], ("put", "get"))
        assert pattern["connector"] == pattern["verify"]["sample"]  # the default
    text = format_report(report)
    assert "64x16KiB" in text and "v:sample" in text and "/ verify off" in text


def test_bench_with_layers_puts_one_object_per_layer(mooncake_master: MooncakeMaster) -> None:
    from kvbridge.tools.bench.mooncake import format_report, run_bench

    report = run_bench([(8, 16 << 10)], rounds=1, layers=3, verify_modes=("full",),
                       master_address=mooncake_master.rpc_address,
                       metadata_server=mooncake_master.metadata_url)
    (pattern,) = report["patterns"]
    assert pattern["verified"] and pattern["mismatched_bytes"] == 0
    assert pattern["layers"] == 3 and pattern["total_bytes"] == 3 * 8 * (16 << 10)
    assert set(pattern["verify"]) == {"full", "sample"}  # the default always
    assert pattern["verify_ratio"] == {}  # no "off" to divide by
    assert "8x16KiBx3L" in format_report(report)


def test_bench_of_guarded_kv_runs_the_staged_path(mooncake_master: MooncakeMaster) -> None:
    """KV that refuses host access (as on a GPU) is put and got through staging; the raw
    side moves pinned host copies of the same bytes; both verified byte for byte."""
    from kvbridge.tools.bench.mooncake import format_report, run_bench

    report = run_bench([(8, 16 << 10)], rounds=1, layers=2, verify_modes=("full",),
                       guard=True, master_address=mooncake_master.rpc_address,
                       metadata_server=mooncake_master.metadata_url)
    (pattern,) = report["patterns"]
    assert pattern["staged"] is True and report["guard"] is True
    assert pattern["verified"] and pattern["mismatched_bytes"] == 0
    for side in ("raw", "connector"):
        assert_figures(pattern[side], ("put_gbps", "get_gbps"))
    assert "staged" in format_report(report)
    plain = run_bench([(8, 16 << 10)], rounds=1, verify_modes=("off",),
                      master_address=mooncake_master.rpc_address,
                      metadata_server=mooncake_master.metadata_url)
    assert plain["patterns"][0]["staged"] is False
