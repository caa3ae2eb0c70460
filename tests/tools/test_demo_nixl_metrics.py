"""The NIXL demo's summary metrics: exact percentiles and the busy-time union."""

from __future__ import annotations

import pytest

from kvbridge.tools.demo.nixl import busy_seconds, exact_percentile


def test_exact_percentile_is_nearest_rank_of_observed_values() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert exact_percentile(values, 0.5) == 50.0
    assert exact_percentile(values, 0.9) == 90.0
    assert exact_percentile(values, 0.99) == 99.0
    assert exact_percentile([7.5, 1.0, 3.0], 0.5) == 3.0
    assert exact_percentile([7.5, 1.0, 3.0], 0.99) == 7.5
    assert exact_percentile([4.0], 0.01) == 4.0
    assert exact_percentile([], 0.5) is None


def test_busy_seconds_counts_overlap_once() -> None:
    # 16 loads started together, finishing at different times: busy = the longest
    assert busy_seconds([(10.0, 10.0 + d) for d in (0.1, 0.12, 0.08)]) == pytest.approx(0.12)
    # disjoint intervals add, a gap is not busy
    assert busy_seconds([(0.0, 1.0), (2.0, 2.5)]) == pytest.approx(1.5)
    # chained overlaps merge, order does not matter
    assert busy_seconds([(1.5, 3.0), (0.0, 1.0), (0.5, 2.0)]) == pytest.approx(3.0)
    assert busy_seconds([]) == 0.0
