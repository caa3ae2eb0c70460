"""`kvbridge bench nixl-cost`: the transport against raw NIXL (a handle re-posted, a handle
per transfer) and a torch copy, READ and WRITE, on small patterns; the bytes verified."""

from __future__ import annotations

import pytest

from tests.conftest import assert_figures, require

require("torch")
require("nixl_cu12._api", "NIXL")

from kvbridge.tools.bench.nixl_cost import (  # noqa: E402
    CostPattern,
    memory_needed,
    request_pattern,
    run_nixl_cost_bench,
)


def test_cost_bench_compares_each_way_per_transfer_and_verifies() -> None:
    small = request_pattern(64, layers=2)  # scattered: the remote order permuted
    assert (small.num_descs, small.desc_bytes, small.scattered) == (2 * 2 * 4, 8192, True)
    out = run_nixl_cost_bench((CostPattern("4x64KiB", 4, 64 << 10), small), min_iters=2,
                              min_time_s=0.05)
    assert [p["pattern"] for p in out["patterns"]] == ["4x64KiB", small.label]
    for p in out["patterns"]:
        assert p["verified"] is True and p["kvbridge_leaks"] == 0, p
        assert p["iters"] >= 2, p
        assert_figures(p, ("torch_copy_gbps",))
        assert set(p["ops"]) == {"READ", "WRITE"}
        for o in p["ops"].values():
            ways = ("raw_reused_handle", "raw_per_request", "kvbridge")
            assert_figures(o["gbps"], ways)
            assert_figures(o["one_desc_us"], ways)
            assert_figures(o, ("kvbridge_over_raw_per_request",
                               "kvbridge_over_raw_reused_handle"))


def test_request_pattern_is_one_ranks_kv_of_a_70b_prompt() -> None:
    p4k, p32k = request_pattern(4096), request_pattern(32768)
    # 80 layers x K,V x 256 blocks of 16 tokens x 2 heads (8 over TP 4) x 128 x bf16
    assert (p4k.num_descs, p4k.desc_bytes, p4k.total_bytes) == (40960, 8192, 320 << 20)
    assert (p32k.num_descs, p32k.total_bytes) == (327680, 2560 << 20)
    assert request_pattern(4096, tp=8).desc_bytes == 4096
    with pytest.raises(ValueError, match="do not split"):
        request_pattern(4096, tp=3)


def test_cost_bench_refuses_a_pattern_that_does_not_fit_before_allocating() -> None:
    big = request_pattern(32768)  # 2.5 GiB moved per rank at 80 layers
    host, device = memory_needed(big)
    assert host >= 3 * big.total_bytes and device == 0  # peer, local, copy at least
    with pytest.raises(ValueError, match=r"32k-tok L80 TP4 needs ~.* GiB of host memory.*--layers"):
        run_nixl_cost_bench((big,), host_available_bytes=host - 1)
