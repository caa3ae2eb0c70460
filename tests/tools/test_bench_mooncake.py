"""`kvbridge bench mooncake`'s measuring code: the mooncake_store connector's put/get against
raw Mooncake batch calls on the same bytes, per verification mode, staged or not."""

from __future__ import annotations

from kvbridge.backends.mooncake.master import MooncakeMaster
from kvbridge.tools.bench.mooncake import format_report, run_bench
from tests.conftest import assert_figures


def test_bench_reports_both_sides_verified(mooncake_master: MooncakeMaster) -> None:
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
