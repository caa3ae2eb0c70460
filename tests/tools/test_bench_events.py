"""`kvbridge events bench`'s measuring code: engine-like batches, and raw pyzmq, the codec
alone and kvbridge's publisher/subscriber moving them, every event received."""

from __future__ import annotations

import itertools

import pytest

from kvbridge.events import BlockStored
from kvbridge.tools.bench.events import engine_like_batches, run_events_bench


def test_bench_reports_both_paths_and_their_ratio() -> None:
    result = run_events_bench(num_events=640, batch_sizes=(16,), timeout_s=60.0)
    row = result["results"]["16"]
    assert row["batches"] == 40 and row["events"] == 640
    assert row["raw"]["received_events"] == 640
    assert row["kvbridge"]["received_events"] == 640
    assert row["kvbridge"]["lost_batches"] == 0
    assert row["encode_events_per_s"] > 0 and row["decode_events_per_s"] > 0
    assert row["ratio"] == pytest.approx(
        row["kvbridge"]["events_per_s"] / row["raw"]["events_per_s"]
    )
    # CPU per batch of both sides (sender + receiver process), and its ratio.
    cpu = {side: row[side]["sender_cpu_us_per_batch"] + row[side]["receiver_cpu_us_per_batch"]
           for side in ("raw", "kvbridge")}
    assert cpu["raw"] > 0 and cpu["kvbridge"] > 0
    assert row["cpu_ratio"] == pytest.approx(cpu["raw"] / cpu["kvbridge"])


def test_engine_like_batches_shape() -> None:
    batches = engine_like_batches(100, 16)
    assert [len(b) for b in batches] == [16] * 6 + [4]
    stored = [e for b in batches for e in b if isinstance(e, BlockStored)]
    assert all(len(e.token_ids) == len(e.block_hashes) * e.block_size for e in stored)
    # Stores chain: each run's parent is the previous run's last block.
    assert all(b.parent_block_hash == a.block_hashes[-1] for a, b in itertools.pairwise(stored))


def test_bench_reports_the_codec_alone_between_raw_and_kvbridge() -> None:
    """The codec run encodes every batch in the sender and decodes every payload in
    the receiver (it counts the decoded events), with no publisher or subscriber."""
    result = run_events_bench(num_events=320, batch_sizes=(16,), timeout_s=60.0)
    row = result["results"]["16"]
    codec = row["codec"]
    assert codec["received_batches"] == 20 and codec["received_events"] == 320
    assert codec["sender_cpu_us_per_batch"] > 0 and codec["receiver_cpu_us_per_batch"] > 0
    assert row["codec_ratio"] == pytest.approx(
        codec["events_per_s"] / row["raw"]["events_per_s"]
    )
    assert row["ratio_vs_codec"] == pytest.approx(
        row["kvbridge"]["events_per_s"] / codec["events_per_s"]
    )
