"""The offloading connector's batched copies against a plain copy of the same bytes, on CPU."""

from __future__ import annotations

from kvbridge.tools.bench.offload_copy import render, run_copy_bench
from tests.conftest import assert_figures


def test_copy_bench_runs_on_cpu_and_verifies() -> None:
    row = run_copy_bench("cpu", num_blocks=8, block_bytes=64 << 10, layers=4, rounds=2)
    assert row["verified"] is True and row["slots_pinned"] is False
    assert_figures(row, ["store_gbps", "load_gbps", "plain_d2h_gbps", "plain_h2d_gbps",
                         "store_ratio", "load_ratio"])
    assert "offload copy store on cpu" in render(row)
