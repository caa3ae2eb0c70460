"""The raw NIXL benchmark runs end to end on small patterns and verifies the bytes it moved."""

from __future__ import annotations

import pytest

from tests.conftest import assert_figures, require

require("torch")
require("nixl_cu12._api", "NIXL")

from kvbridge.backends.nixl_bench import run_nixl_raw_bench  # noqa: E402


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_bench_reports_all_three_ways_and_verifies(op: str) -> None:
    out = run_nixl_raw_bench(((4, 256 << 10), (64, 4 << 10)), op=op, min_iters=2, min_time_s=0.05)
    assert out["op"] == op and len(out["patterns"]) == 2
    for row, (nb, bb) in zip(out["patterns"], ((4, 256 << 10), (64, 4 << 10)), strict=True):
        assert (row["num_blocks"], row["block_bytes"], row["total_bytes"]) == (nb, bb, nb * bb)
        assert row["verified"] is True, row
        assert row["adapter_leaks"] == 0, row
        assert row["iters"] >= 2, row
        # the figures are well-formed; their size is `kvbridge bench`'s business, not a test's
        assert_figures(row, ("raw_nixl_gbps", "adapter_gbps", "torch_copy_gbps",
                             "adapter_over_raw", "raw_over_memcpy"))


def test_bench_rejects_unknown_op() -> None:
    with pytest.raises(ValueError, match="READ or WRITE"):
        run_nixl_raw_bench(((1, 4096),), op="COPY")
