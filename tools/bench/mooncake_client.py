"""``kvbridge mooncake bench``: raw Mooncake batch put/get against :class:`MooncakeStoreClient`.

Same bytes, same run. The comparison isolates what the client adds (validation, reachability
check, worker-thread hand-off, result objects): both sides use the *same*
``MooncakeDistributedStore`` instance, the same registered source and
destination tensors, keys of the same length, and alternate which goes first
in each round. A ``torch`` copy of the same bytes is reported as the physical
limit (memcpy). Each round's get is verified byte for byte outside the timing.
"""

from __future__ import annotations

import logging
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from kvbridge.backends.mooncake import MooncakeConfig, MooncakeStoreClient
from kvbridge.backends.mooncake.master import master_endpoint
from kvbridge.tools.bench.rows import gbps, memcpy_seconds, paired_ratio, size_label

logger = logging.getLogger(__name__)

DEFAULT_PATTERNS: tuple[tuple[int, int], ...] = ((64, 2 << 20), (4096, 16 << 10))
MiB = 1 << 20


def run_mooncake_bench(
    patterns: Sequence[tuple[int, int]] = DEFAULT_PATTERNS,
    *,
    rounds: int = 7,
    master_address: str | None = None,
    metadata_server: str | None = None,
) -> dict[str, Any]:
    """Measure put/get GB/s of raw ``batch_put_from``/``batch_get_into`` and of the client.

    ``patterns`` are ``(num_blocks, block_bytes)``. Starts a local
    ``mooncake_master`` unless ``master_address``/``metadata_server`` are given.
    Returns a JSON-ready dict: per pattern the median GB/s of each side over
    ``rounds`` timed rounds (after one warm-up), ``ratio`` (client / raw: the
    median of per-round paired ratios, plus ratio of medians and of best
    rounds), and ``memcpy_gbps``. Blocks go into this client's own segment (a one-process
    store), which is what the ratio is about; remote-segment throughput over
    TCP is much lower (docs/backends.md, "Mooncake store").
    """
    import torch

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    for num_blocks, block_bytes in patterns:
        if num_blocks < 1 or block_bytes < 1:
            raise ValueError(f"pattern must be (num_blocks >= 1, block_bytes >= 1), got {(num_blocks, block_bytes)}")
    max_bytes = max(n * b for n, b in patterns)
    segment_bytes = max(32 * MiB, 3 * max_bytes)
    report: dict[str, Any] = {"rounds": rounds, "segment_bytes": segment_bytes, "patterns": []}
    with master_endpoint(master_address, metadata_server) as (rpc, meta, local_master):
        report["master"] = rpc
        report["local_master"] = local_master
        config = MooncakeConfig(
            rpc, meta, global_segment_size=segment_bytes, local_buffer_size=64 * MiB,
            op_timeout_s=60.0,
        )
        with MooncakeStoreClient(config) as client:
            raw = client.raw_store
            for num_blocks, block_bytes in patterns:
                report["patterns"].append(
                    _bench_pattern(torch, client, raw, num_blocks, block_bytes, rounds)
                )
    return report


def _bench_pattern(
    torch: Any, client: MooncakeStoreClient, raw: Any, num_blocks: int, block_bytes: int, rounds: int
) -> dict[str, Any]:
    total = num_blocks * block_bytes
    src = torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    client.register_buffer(src.data_ptr(), src.nbytes)
    client.register_buffer(dst.data_ptr(), dst.nbytes)
    src_ptrs = [src.data_ptr() + i * block_bytes for i in range(num_blocks)]
    dst_ptrs = [dst.data_ptr() + i * block_bytes for i in range(num_blocks)]
    sizes = [block_bytes] * num_blocks
    times: dict[str, dict[str, list[float]]] = {
        "raw": {"put": [], "get": []}, "client": {"put": [], "get": []}
    }
    failures: dict[str, int] = {"raw": 0, "client": 0}

    def raw_put(keys: list[str]) -> bool:
        return all(c == 0 for c in raw.batch_put_from(keys, src_ptrs, sizes))

    def raw_get(keys: list[str]) -> bool:
        return all(c == block_bytes for c in raw.batch_get_into(keys, dst_ptrs, sizes))

    def client_put(keys: list[str]) -> bool:
        return all(r.ok for r in client.batch_put_from(keys, src_ptrs, sizes))

    def client_get(keys: list[str]) -> bool:
        return all(r.ok for r in client.batch_get_into(keys, dst_ptrs, sizes))

    sides: dict[str, tuple[Callable[[list[str]], bool], Callable[[list[str]], bool]]] = {
        "raw": (raw_put, raw_get), "client": (client_put, client_get),
    }
    try:
        for round_index in range(rounds + 1):  # round 0 warms up and is not recorded
            order = ("raw", "client") if round_index % 2 == 0 else ("client", "raw")
            for side in order:
                put, get = sides[side]
                # Same-length keys on both sides: key handling costs the same.
                tag = uuid.uuid4().hex[:12]
                keys = [f"kvbridge-bench/{tag}/{i:06d}" for i in range(num_blocks)]
                dst.zero_()
                t0 = time.perf_counter()
                put_ok = put(keys)
                t1 = time.perf_counter()
                get_ok = get(keys)
                t2 = time.perf_counter()
                verified = put_ok and get_ok and bool(torch.equal(src, dst))
                if not verified:
                    failures[side] += 1
                    logger.warning("bench %s round %d: put_ok=%s get_ok=%s bytes equal=%s",
                                   side, round_index, put_ok, get_ok, torch.equal(src, dst))
                client.remove(keys, force=True)
                if round_index > 0:
                    times[side]["put"].append(t1 - t0)
                    times[side]["get"].append(t2 - t1)
        memcpy_s = memcpy_seconds(src, dst, rounds)
    finally:
        client.unregister_buffer(src.data_ptr())
        client.unregister_buffer(dst.data_ptr())

    def side_report(side: str) -> dict[str, float]:
        put_s, get_s = times[side]["put"], times[side]["get"]
        return {
            "put_gbps": gbps(total, statistics.median(put_s)),
            "get_gbps": gbps(total, statistics.median(get_s)),
            "put_gbps_best": gbps(total, min(put_s)),
            "get_gbps_best": gbps(total, min(get_s)),
        }

    raw_r, client_r = side_report("raw"), side_report("client")
    return {
        "num_blocks": num_blocks,
        "block_bytes": block_bytes,
        "total_bytes": total,
        "raw": raw_r,
        "client": client_r,
        # Headline: the median over rounds of each round's paired ratio (raw and
        # client run back to back in a round, so slow drifts of machine load
        # cancel). Also the ratio of medians and of best rounds, for comparison.
        "ratio": {
            "put": paired_ratio(times["raw"]["put"], times["client"]["put"]),
            "get": paired_ratio(times["raw"]["get"], times["client"]["get"]),
            "put_of_medians": client_r["put_gbps"] / raw_r["put_gbps"],
            "get_of_medians": client_r["get_gbps"] / raw_r["get_gbps"],
            "put_best": client_r["put_gbps_best"] / raw_r["put_gbps_best"],
            "get_best": client_r["get_gbps_best"] / raw_r["get_gbps_best"],
        },
        "memcpy_gbps": gbps(total, statistics.median(memcpy_s)),
        "failed_rounds": failures,
        "verified": failures["raw"] == 0 and failures["client"] == 0,
    }


def format_report(report: dict[str, Any]) -> str:
    """A plain-text table of :func:`run_mooncake_bench`'s result (``kvbridge mooncake bench``)."""
    lines = [
        f"Mooncake store, one process (blocks in the client's own segment), master "
        f"{report['master']}, {report['rounds']} rounds; GB/s are medians, ratio = median of "
        "per-round client/raw",
        f"{'pattern':>16} {'op':>4} {'raw GB/s':>9} {'client GB/s':>12} {'ratio':>6} "
        f"{'best ratio':>10} {'memcpy GB/s':>12} {'verified':>8}",
    ]
    for p in report["patterns"]:
        name = f"{p['num_blocks']} x {size_label(p['block_bytes'])}"
        for op in ("put", "get"):
            lines.append(
                f"{name:>16} {op:>4} {p['raw'][op + '_gbps']:9.2f} {p['client'][op + '_gbps']:12.2f} "
                f"{p['ratio'][op]:6.2f} {p['ratio'][op + '_best']:10.2f} {p['memcpy_gbps']:12.2f} "
                f"{'yes' if p['verified'] else 'NO':>8}"
            )
    return "\n".join(lines)
