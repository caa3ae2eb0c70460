"""`kvbridge bench` as one suite: every path, kvbridge against the raw library, same run.

Paths (``PATHS``):

* ``nixl``     -- the NIXL connector's pull load vs a raw NIXL READ of the same held
  blocks (:mod:`kvbridge.tools.bench_nixl`); limit: torch copy of the same bytes.
* ``nixl-scale`` -- set-up at a real cache size (default 64 layers x 100,000 blocks):
  register, handshake document, both sides' lists, first transfer to a new peer, each
  timed with its peak memory, vs raw NIXL doing the same
  (:mod:`kvbridge.tools.bench_nixl_scale`).
* ``mooncake`` -- the mooncake_store connector's put/get vs Mooncake's own
  ``batch_put_from``/``batch_get_into`` (:mod:`kvbridge.connectors.mooncake_store.bench`).
* ``offload``  -- the fs tier's store/load vs plain sequential file I/O
  (:mod:`kvbridge.offload.bench`); limit: memcpy of the same bytes.
* ``events``   -- KV events through kvbridge's publisher/subscriber vs raw pyzmq PUB/SUB
  of the same frames (:mod:`kvbridge.events.bench`); limit: memcpy of the payload bytes.
* ``lookup``   -- scheduler-side lookup latency: the offload manager's lookup per key
  (fs tier idle and busy) vs a plain ``os.stat`` probe of as many block files; the
  async path's round trip (lookup -> probes on the worker pool -> MISS verdict) vs the
  synchronous ``os.stat`` it replaces; the Mooncake client's ``batch_exists`` vs the
  raw ``batch_is_exist`` of the same keys.
* ``auth``     -- the cluster secret's cost (:mod:`kvbridge.tools.bench_auth`): here
  "kvbridge" is with a secret and "raw" without, same run: a side-channel fetch
  (full and conditional) and the NIXL connector's load with both engines sealed.
* ``digests``  -- ``torch-mix64-v1`` block digests (tensor reductions on the KV's own
  device: what GPU memory is verified with) vs ``xxh3-64`` (the C hash of host memory)
  on the same bytes (:mod:`kvbridge.tools.bench_digests`); limit: torch copy.

Every path returns rows of one shape (:func:`row`), so the table, the JSON file
and the plot treat them alike::

    {"path", "case", "op", "unit", "num_blocks", "block_bytes", "total_bytes",
     "kvbridge", "raw", "raw_name", "ratio", "limit", "limit_name", "verified"}

``ratio`` is kvbridge / raw for throughputs (higher is better, 1.0 = as fast as
the library) and raw / kvbridge for latencies (so it reads the same way); nixl
and mooncake report their own interleaved/paired-per-round ratio, which is more
robust on a busy machine than the ratio of the two medians. A path
whose backend is not installed is reported as skipped with the reason; a path
that raised is reported as failed (exit code 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from kvbridge.tools.progress import Progress

GB = 1e9
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30}

#: (num_blocks, block_bytes) per path when --pattern is not given
DEFAULT_PATTERNS: dict[str, tuple[tuple[int, int], ...]] = {
    "nixl": ((64, 2 << 20), (256, 256 << 10), (4096, 16 << 10)),
    "mooncake": ((64, 2 << 20), (256, 256 << 10), (4096, 16 << 10)),
    "offload": ((32, 2 << 20), (128, 256 << 10)),
    "nixl-scale": ((100_000, 16),),  # blocks per layer x bytes of one layer's block
    "auth": ((64, 2 << 20),),  # the NIXL transfer measured with and without a secret
    "digests": ((4096, 16 << 10), (32, 2 << 20)),
}
#: --quick: small enough for a test or a smoke run (seconds, not minutes)
QUICK_PATTERNS: dict[str, tuple[tuple[int, int], ...]] = {
    "nixl": ((16, 64 << 10),),
    "mooncake": ((16, 64 << 10),),
    "offload": ((8, 64 << 10),),
    "nixl-scale": ((2000, 16),),
    "auth": ((16, 64 << 10),),
    "digests": ((64, 16 << 10),),
}


class Skipped(Exception):
    """The path's backend is not available here (reported, not a failure)."""


def parse_pattern(text: str) -> tuple[int, int]:
    """``"64x2MiB"`` -> ``(64, 2097152)``; ValueError naming the expected form."""
    count, sep, size = text.strip().partition("x")
    digits = size.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = size[len(digits):].lower()
    if not sep or not count.isdigit() or not digits.isdigit() or unit not in _UNITS:
        raise ValueError(f"--pattern: expected NUMxSIZE such as 64x2MiB or 4096x16384, "
                         f"got {text!r}")
    num_blocks, block_bytes = int(count), int(digits) * _UNITS[unit]
    if num_blocks < 1 or block_bytes < 1:
        raise ValueError(f"--pattern: needs >= 1 block of >= 1 byte, got {text!r}")
    return num_blocks, block_bytes


def row(path: str, case: str, op: str, unit: str, kvbridge: float, raw: float, raw_name: str,
        *, num_blocks: int | None = None, block_bytes: int | None = None,
        limit: float | None = None, limit_name: str | None = None,
        verified: bool = True, lower_is_better: bool = False,
        ratio: float | None = None) -> dict[str, Any]:
    """One result row. ``ratio`` overrides kvbridge/raw of the two figures when the path
    measures better itself (e.g. the median of per-round paired ratios)."""
    if ratio is None and lower_is_better:
        ratio = raw / kvbridge if kvbridge > 0 else 0.0
    elif ratio is None:
        ratio = kvbridge / raw if raw > 0 else 0.0
    return {"path": path, "case": case, "op": op, "unit": unit,
            "num_blocks": num_blocks, "block_bytes": block_bytes,
            "total_bytes": num_blocks * block_bytes if num_blocks and block_bytes else None,
            "kvbridge": round(kvbridge, 4), "raw": round(raw, 4), "raw_name": raw_name,
            "ratio": round(ratio, 3),
            "limit": round(limit, 4) if limit is not None else None, "limit_name": limit_name,
            "verified": verified}


def memcpy_gbps(nbytes: int, repeats: int = 9) -> float:
    """GB/s of the best of ``repeats`` contiguous torch copies of ``nbytes``.

    The limit column of every path. Best, not median: it is the physical bound
    the machine reached in this run; medians of sub-millisecond copies on a busy
    2-core machine measure the scheduler, not the memory."""
    import torch

    src = torch.ones(max(1, nbytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in, untimed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / min(times) / GB


def size_label(nbytes: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    return f"{nbytes}B"


# ---------------------------------------------------------------- paths


def bench_nixl(patterns: Sequence[tuple[int, int]], iters: int, quick: bool,
               block_order: str = "sorted") -> dict[str, Any]:
    try:
        from kvbridge.backends.nixl import load_nixl_api

        load_nixl_api()
    except Exception as exc:
        raise Skipped(f"NIXL cannot load: {exc}") from None
    from kvbridge.tools.bench_nixl import run_nixl_bench

    raw = run_nixl_bench(tuple(patterns), iters=iters, block_order=block_order)
    rows = [row("nixl", f"{p['num_blocks']}x{size_label(p['block_bytes'])}", "READ", "GB/s",
                p["kvbridge_gbps"], p["raw_nixl_gbps"], "raw NIXL READ",
                num_blocks=p["num_blocks"], block_bytes=p["block_bytes"],
                limit=memcpy_gbps(p["num_blocks"] * p["block_bytes"]), limit_name="torch copy",
                ratio=p.get("kvbridge_over_raw"),
                verified=not p.get("mismatched_bytes") and bool(p.get("verified_bytes", 1))
                and p.get("raw_matches_connector", True) is not False)
            for p in raw["patterns"]]
    return {"rows": rows, "detail": raw}


SCALE_STEPS = (("register", "register"), ("prepare_lists", "prepare lists"),
               ("first_transfer", "first transfer"))


def bench_nixl_scale(patterns: Sequence[tuple[int, int]], quick: bool, layers: int | None,
                     per_block: bool) -> dict[str, Any]:
    try:
        from kvbridge.backends.nixl import load_nixl_api

        load_nixl_api()
    except Exception as exc:
        raise Skipped(f"NIXL cannot load: {exc}") from None
    from kvbridge.tools.bench_nixl_scale import run_nixl_scale_bench

    num_layers = layers or (8 if quick else 64)
    rows, reports = [], []
    for num_blocks, block_bytes in patterns:
        rep = run_nixl_scale_bench(num_layers, num_blocks, block_bytes, per_block=per_block)
        reports.append(rep)
        kvb, raw = rep["kvbridge"], rep["raw_nixl"]
        ok = bool(kvb["verified"] and raw["verified"])
        case = f"{num_layers}Lx{num_blocks}x{size_label(block_bytes)}"
        def scale_row(op: str, unit: str, kvbridge: float, raw_value: float, raw_name: str,
                      case: str = case, ok: bool = ok, num_blocks: int = num_blocks,
                      block_bytes: int = block_bytes) -> dict[str, Any]:
            return row("nixl-scale", case, op, unit, kvbridge, raw_value, raw_name,
                       num_blocks=num_layers * num_blocks, block_bytes=block_bytes,
                       verified=ok, lower_is_better=True)

        for key, label in SCALE_STEPS:
            rows.append(scale_row(label, "ms", kvb["ms"][key], raw["ms"][key], "raw NIXL"))
        rows.append(scale_row("set-up total", "ms", sum(kvb["ms"].values()),
                              sum(raw["ms"].values()), "raw NIXL"))
        rows.append(scale_row("handshake doc", "bytes", kvb["handshake_doc_bytes"],
                              raw["agent_metadata_bytes"], "raw NIXL agent metadata"))
    return {"rows": rows, "detail": {"scale": reports}}


def format_scale_detail(detail: dict[str, Any]) -> str:
    """Per step: ms and peak MiB of each side (and of per-block lists if they ran)."""
    lines = []
    for rep in detail["scale"]:
        sides = [k for k in ("kvbridge", "raw_nixl", "kvbridge_per_block") if k in rep]
        lines.append(f"{rep['num_layers']} layers x {rep['num_blocks']} blocks x "
                     f"{rep['block_bytes']} B per rank; first transfer: "
                     f"{rep['request_blocks']} blocks of every layer")
        lines.append(f"{'step':>16} " + " ".join(f"{s + ' ms':>22} {'peak MiB':>9}"
                                                 for s in sides))
        for step in ("register", "handshake_doc", "prepare_lists", "first_transfer"):
            cells = []
            for side in sides:
                peak = rep[side]["peak_mib"][step]
                cells.append(f"{rep[side]['ms'][step]:22.2f} "
                             f"{'-' if peak is None else f'{peak:.1f}':>9}")
            lines.append(f"{step:>16} " + " ".join(cells))
        for side in sides:
            extra = ""
            if "list_rows" in rep[side]:
                extra = (f", {rep[side]['list_rows']} list rows for "
                         f"{rep[side]['descriptors']} descriptors, handshake document "
                         f"{rep[side]['handshake_doc_bytes']} B")
            lines.append(f"{side}: agent metadata {rep[side]['agent_metadata_bytes']} B{extra}; "
                         f"verified {rep[side]['verified']}")
    lines.append("peak MiB: resident memory above the step's start (VmHWM), NIXL's own "
                 "allocations included")
    return "\n".join(lines)


def _mooncake_available() -> None:
    try:
        from kvbridge.backends.mooncake import import_store_class
        from kvbridge.backends.mooncake_master import find_master_binary

        import_store_class()
        find_master_binary()
    except Exception as exc:
        raise Skipped(f"Mooncake is not usable here: {exc}") from None


def bench_mooncake(patterns: Sequence[tuple[int, int]], iters: int, quick: bool,
                   master: str | None = None, metadata: str | None = None) -> dict[str, Any]:
    _mooncake_available()
    from kvbridge.connectors.mooncake_store.bench import run_bench

    raw = run_bench(tuple(patterns), rounds=max(1, iters), master_address=master,
                    metadata_server=metadata)
    rows = []
    for p in raw["patterns"]:
        for op in ("put", "get"):
            rows.append(row("mooncake", f"{p['num_blocks']}x{size_label(p['block_bytes'])}", op,
                            "GB/s", p["connector"][f"{op}_gbps"], p["raw"][f"{op}_gbps"],
                            f"raw batch_{op}_{'from' if op == 'put' else 'into'}",
                            num_blocks=p["num_blocks"], block_bytes=p["block_bytes"],
                            limit=memcpy_gbps(p["num_blocks"] * p["block_bytes"]),
                            limit_name="torch copy", ratio=p["ratio"][op],
                            verified=bool(p["verified"]) and not p.get("mismatched_bytes")))
    return {"rows": rows, "detail": raw}


def bench_offload(patterns: Sequence[tuple[int, int]], iters: int, quick: bool,
                  directory: str | None = None) -> dict[str, Any]:
    from kvbridge.offload.bench import run_offload_bench, run_verify_bench

    rows, details = [], []
    for num_blocks, block_bytes in patterns:
        result = run_offload_bench(directory, num_blocks=num_blocks, block_bytes=block_bytes,
                                   batch_blocks=min(8, num_blocks), rounds=max(1, iters),
                                   lookup_iterations=20 if quick else 100)
        # verified KV: the fs and CPU paths with verification off, sampled and full
        layers = next(n for n in (32, 16, 8, 4, 2, 1) if block_bytes % n == 0)
        result["verify"] = run_verify_bench(directory, modes=("off", "sample", "full"),
                                            num_blocks=num_blocks, block_bytes=block_bytes,
                                            num_layers=layers, batch_blocks=min(8, num_blocks),
                                            rounds=max(1, iters))
        details.append(result)
        limit = memcpy_gbps(num_blocks * block_bytes)
        verify = result["verify"]
        assert isinstance(verify, dict)
        ok = bool(result["verified"]) and not result["failed_jobs"] and \
            bool(verify["verified"]) and not verify["failed_jobs"]
        for op, plain in (("store", "plain file write"), ("load", "plain file read")):
            side = result[op]
            assert isinstance(side, dict)
            rows.append(row("offload", f"{num_blocks}x{size_label(block_bytes)}", op, "GB/s",
                            side["tier_gbps"], side["plain_gbps"],
                            f"{plain} ({result['io_mode']})", num_blocks=num_blocks,
                            block_bytes=block_bytes, limit=limit, limit_name="torch copy",
                            verified=ok))
    return {"rows": rows, "detail": details}


def bench_events(num_events: int, batch_sizes: Sequence[int]) -> dict[str, Any]:
    from kvbridge.events.bench import run_events_bench

    raw = run_events_bench(num_events, tuple(batch_sizes))
    rows = []
    for size, r in raw["results"].items():
        payload = float(r["payload_bytes_mean"]) * r["batches"]  # bytes on the wire
        limit = memcpy_gbps(max(1, int(payload))) * GB / max(1.0, payload) * num_events
        kvb = r["kvbridge"]
        rows.append(row("events", f"batch {size}", "pub->sub", "events/s", kvb["events_per_s"],
                        r["raw"]["events_per_s"], "raw pyzmq PUB/SUB", limit=limit,
                        limit_name="memcpy of the payload",
                        verified=kvb["received_events"] == num_events
                        and not kvb["lost_batches"]))
    return {"rows": rows, "detail": raw}


def bench_auth(patterns: Sequence[tuple[int, int]], iters: int, quick: bool
               ) -> dict[str, Any]:
    """The cluster secret on and off (kvbridge = with it, raw = without), same run."""
    from kvbridge.tools.bench_auth import handshake_times, nixl_with_and_without, seal_open_us

    times = handshake_times(20 if quick else 200)
    rows = [row("auth", f"handshake {kind}", "fetch", "ms", times["on"][kind],
                times["off"][kind], "no secret", lower_is_better=True)
            for kind in ("full", "conditional")]
    seal_us = seal_open_us(2000 if quick else 20_000)
    detail: dict[str, Any] = {"handshake_ms": times, "seal_open_us": round(seal_us, 2)}
    try:
        from kvbridge.backends.nixl import load_nixl_api

        load_nixl_api()
    except Exception as exc:
        detail["nixl"] = f"skipped: NIXL cannot load: {exc}"
        return {"rows": rows, "detail": detail}
    nixl = nixl_with_and_without(patterns, iters)
    for off, on in zip(nixl["off"], nixl["on"], strict=True):
        rows.append(row("auth", f"{off['num_blocks']}x{size_label(off['block_bytes'])}",
                        "READ", "GB/s", on["kvbridge_gbps"], off["kvbridge_gbps"],
                        "connector without a secret", num_blocks=off["num_blocks"],
                        block_bytes=off["block_bytes"],
                        limit=memcpy_gbps(off["num_blocks"] * off["block_bytes"]),
                        limit_name="torch copy",
                        verified=not on.get("mismatched_bytes")
                        and not off.get("mismatched_bytes")))
    detail["nixl"] = nixl
    return {"rows": rows, "detail": detail}


def _stat_probe_us(num_keys: int, iterations: int) -> dict[str, float]:
    """Per-key µs of ``os.stat`` on existing and absent block files: a synchronous probe."""
    with tempfile.TemporaryDirectory(prefix="kvb-lookup-") as root:
        half = max(1, num_keys // 2)
        paths = [os.path.join(root, f"{i:016x}.blk") for i in range(num_keys)]
        for p in paths[:half]:
            with open(p, "wb") as handle:
                handle.write(b"\0" * 64)
        samples = []
        for _ in range(iterations):
            t0 = time.perf_counter_ns()
            for p in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.stat(p)
            samples.append((time.perf_counter_ns() - t0) / 1000 / num_keys)
    samples.sort()
    return {"median": statistics.median(samples),
            "p99": samples[min(len(samples) - 1, int(len(samples) * 0.99))]}


def bench_digests(patterns: Sequence[tuple[int, int]], iters: int) -> dict[str, Any]:
    """torch-mix64-v1 (the digests of GPU memory) against xxh3-64 on the same bytes."""
    from kvbridge.tools.bench_digests import digest_rates

    detail = [digest_rates(nb, bb, iters=iters) for nb, bb in patterns]
    rows = [row("digests", f"{d['num_blocks']}x{size_label(d['block_bytes'])}",
                "torch-mix64-v1", "GB/s", d["torch_mix64_gbps"], d["xxh3_gbps"], "xxh3-64",
                num_blocks=d["num_blocks"], block_bytes=d["block_bytes"],
                limit=memcpy_gbps(d["num_blocks"] * d["block_bytes"]), limit_name="torch copy",
                verified=d["same_on_cpu"])
            for d in detail]
    return {"rows": rows, "detail": detail}


def bench_lookup(quick: bool, master: str | None = None,
                 metadata: str | None = None) -> dict[str, Any]:
    from kvbridge.offload.bench import _lookup_latency

    keys, iterations = (16, 30) if quick else (64, 400)
    rows: list[dict[str, Any]] = []
    detail: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvb-lookup-") as root:
        latency = _lookup_latency(os.path.join(root, "lat"), keys, iterations, True, 60.0)
    detail["offload_manager"] = latency
    stat = _stat_probe_us(keys, iterations)
    detail["os_stat_per_key_us"] = stat
    for phase in ("idle", "busy"):
        lat = latency[f"{phase}_per_key_us"]
        assert isinstance(lat, dict)
        rows.append(row("lookup", f"offload, tier {phase}, {keys} keys", "lookup", "us/key",
                        float(lat["median"]), stat["median"], "os.stat per key (sync probe)",
                        lower_is_better=True))
    with tempfile.TemporaryDirectory(prefix="kvb-lookup-") as root:
        verdict = _offload_async_verdict(os.path.join(root, "async"), keys,
                                         10 if quick else 50)
    detail["offload_async_verdict"] = verdict
    rows.append(row("lookup", f"offload async miss verdict, {keys} keys", "verdict",
                    "us/lookup", verdict["verdict_us"], verdict["stat_us"],
                    "os.stat of the same files", lower_is_better=True,
                    verified=verdict["all_miss"]))
    try:
        _mooncake_available()
    except Skipped as exc:
        detail["mooncake"] = {"skipped": str(exc)}
        return {"rows": rows, "detail": detail}
    detail["mooncake"] = _mooncake_exists(keys, iterations, master, metadata)
    m = detail["mooncake"]
    rows.append(row("lookup", f"mooncake exists, {keys} keys", "exists", "us/key",
                    m["client_per_key_us"], m["raw_per_key_us"], "raw batch_is_exist",
                    lower_is_better=True, verified=m["agree"]))
    return {"rows": rows, "detail": detail}


def _offload_async_verdict(root: str, num_keys: int, iterations: int) -> dict[str, Any]:
    """Time from a lookup of keys the fs tier does not hold to its MISS verdict.

    The fs tier answers asynchronously: the first ``lookup`` enqueues probes
    (RETRY) and returns at once; ``step`` (once per scheduler step) applies the
    worker pool's answers. The figure is the whole round trip, stepped in a tight
    loop, against the synchronous ``os.stat`` of the same block files that the
    scheduler thread does *not* have to pay.
    """
    from kvbridge.offload.cpu import CpuTier
    from kvbridge.offload.fs import FsTier
    from kvbridge.offload.manager import OffloadManager
    from kvbridge.offload.types import LookupStatus

    block_bytes = 4096
    tier = FsTier(root, block_bytes, "a5a5a5a5a5a5a5a5", use_o_direct=False,
                  read_threads=2, write_threads=2)
    manager = OffloadManager(CpuTier(num_keys + 8, block_bytes), [tier])
    verdict_us: list[float] = []
    all_miss = True
    try:
        for it in range(iterations):
            keys = [b"async|%d|%d" % (it, i) for i in range(num_keys)]
            request_id = f"verdict-{it}"
            start = time.perf_counter_ns()
            deadline = time.monotonic() + 10.0
            while True:
                result = manager.lookup(request_id, keys)
                if result.ready or time.monotonic() > deadline:
                    break
                manager.step()
            verdict_us.append((time.perf_counter_ns() - start) / 1000)
            all_miss = all_miss and result.status is LookupStatus.MISS
            manager.request_finished(request_id)
        paths = [os.path.join(root, f"{i:016x}.missing") for i in range(num_keys)]
        stat_us: list[float] = []
        for _ in range(iterations):
            start = time.perf_counter_ns()
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.stat(path)
            stat_us.append((time.perf_counter_ns() - start) / 1000)
    finally:
        manager.shutdown()
    return {"keys": num_keys, "iterations": iterations,
            "verdict_us": statistics.median(verdict_us),
            "verdict_us_max": max(verdict_us), "stat_us": statistics.median(stat_us),
            "all_miss": all_miss}


def _mooncake_exists(num_keys: int, iterations: int, master: str | None,
                     metadata: str | None) -> dict[str, Any]:
    from kvbridge.backends.mooncake import MooncakeConfig, MooncakeStoreClient
    from kvbridge.backends.mooncake_master import MooncakeMaster

    with contextlib.ExitStack() as stack:
        if master is None:
            started = stack.enter_context(MooncakeMaster())
            master, metadata = started.rpc_address, started.metadata_url
        assert metadata is not None
        client = stack.enter_context(MooncakeStoreClient(MooncakeConfig(
            master, metadata, global_segment_size=32 << 20, local_buffer_size=16 << 20,
            op_timeout_s=30.0)))
        raw = client.raw_store
        keys = [f"kvb-lookup-bench-{os.getpid()}-{i}" for i in range(num_keys)]
        half = max(1, num_keys // 2)
        for key in keys[:half]:
            raw.put(key, b"x" * 64)
        times: dict[str, list[float]] = {"raw": [], "client": []}
        agree = True
        for it in range(iterations):
            order = ("raw", "client") if it % 2 == 0 else ("client", "raw")
            for side in order:
                t0 = time.perf_counter_ns()
                if side == "raw":
                    codes = list(raw.batch_is_exist(keys))
                else:
                    found = client.batch_exists(keys)
                times[side].append((time.perf_counter_ns() - t0) / 1000 / num_keys)
            agree = agree and [c == 1 for c in codes] == list(found)
        for key in keys[:half]:
            with contextlib.suppress(Exception):
                raw.remove(key)
    return {"raw_per_key_us": statistics.median(times["raw"]),
            "client_per_key_us": statistics.median(times["client"]), "agree": agree,
            "keys": num_keys, "iterations": iterations}


PATHS = ("nixl", "nixl-scale", "mooncake", "offload", "events", "lookup", "auth", "digests")


def run_suite(names: Sequence[str], *, patterns: Sequence[tuple[int, int]] | None = None,
              iters: int = 5, quick: bool = False, events: int | None = None,
              batch_sizes: Sequence[int] = (16, 64), master: str | None = None,
              metadata: str | None = None, directory: str | None = None,
              block_order: str = "sorted", layers: int | None = None,
              per_block: bool = False,
              progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the named paths; returns ``{"machine", "paths": {name: {...}}, "rows": [...]}``.

    Each ``paths[name]`` is ``{"status": "ok"|"skipped"|"failed", "seconds", "rows",
    "detail"|"reason"}``; ``rows`` of every ok path are also concatenated at the top.
    With one path, the fields of its own report (``detail``) are copied to the top
    level too (e.g. ``patterns`` of the nixl bench), without overriding the suite's.
    """
    say = progress or (lambda _text: None)
    out: dict[str, Any] = {"machine": machine_info(), "quick": quick, "iters": iters,
                           "paths": {}, "rows": []}
    for index, name in enumerate(names):
        say(f"{name} ({index + 1}/{len(names)})")
        chosen = tuple(patterns) if patterns else (QUICK_PATTERNS if quick
                                                   else DEFAULT_PATTERNS).get(name, ())
        started = time.monotonic()
        try:
            if name == "nixl":
                result = bench_nixl(chosen, iters, quick, block_order)
            elif name == "nixl-scale":
                result = bench_nixl_scale(chosen, quick, layers, per_block)
            elif name == "mooncake":
                result = bench_mooncake(chosen, iters, quick, master, metadata)
            elif name == "offload":
                result = bench_offload(chosen, iters, quick, directory)
            elif name == "events":
                result = bench_events(events or (2000 if quick else 50_000), batch_sizes)
            elif name == "lookup":
                result = bench_lookup(quick, master, metadata)
            elif name == "auth":
                result = bench_auth(chosen, iters, quick)
            elif name == "digests":
                result = bench_digests(chosen, iters)
            else:
                raise ValueError(f"unknown bench path {name!r}; expected one of {PATHS}")
            entry: dict[str, Any] = {"status": "ok", **result}
            out["rows"].extend(result["rows"])
        except Skipped as exc:
            entry = {"status": "skipped", "reason": str(exc), "rows": []}
        except Exception as exc:  # one path's failure must not hide the others' numbers
            entry = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}", "rows": []}
        entry["seconds"] = round(time.monotonic() - started, 2)
        out["paths"][name] = entry
    if len(names) == 1 and isinstance(out["paths"][names[0]].get("detail"), dict):
        # one path: its own report's fields also at the top level, as the per-path
        # benches printed them before the suite (scripts reading "patterns" keep working)
        for key, value in out["paths"][names[0]]["detail"].items():
            out.setdefault(key, value)
    return out


def machine_info() -> dict[str, Any]:
    return {"python": platform.python_version(), "cpus": os.cpu_count(),
            "platform": platform.platform(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                   time.gmtime())}


def suite_ok(report: dict[str, Any]) -> bool:
    return (all(p["status"] != "failed" for p in report["paths"].values())
            and all(r["verified"] for r in report["rows"]))


# ---------------------------------------------------------------- rendering


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.2f}"


def format_table(report: dict[str, Any]) -> str:
    head = ("path", "case", "op", "unit", "kvbridge", "raw", "ratio", "limit", "vs", "ok")
    lines_rows = [head]
    for r in report["rows"]:
        lines_rows.append((r["path"], r["case"], r["op"], r["unit"], _num(r["kvbridge"]),
                           _num(r["raw"]), f"{r['ratio']:.2f}", _num(r["limit"]),
                           r["raw_name"], "yes" if r["verified"] else "NO"))
    widths = [max(len(str(x[i])) for x in lines_rows) for i in range(len(head))]
    numeric = {4, 5, 6, 7}
    lines = ["  ".join(str(c).rjust(w) if i in numeric else str(c).ljust(w)
                       for i, (c, w) in enumerate(zip(x, widths, strict=True))).rstrip()
             for x in lines_rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for name, entry in report["paths"].items():
        if entry["status"] != "ok":
            lines.append(f"{name}: {entry['status']}: {entry['reason']}")
    lines.append("ratio = kvbridge / raw (latency rows: raw / kvbridge); limit = memory copy of "
                 "the same bytes, in the row's unit; every number from this run")
    return "\n".join(lines)


def format_markdown(report: dict[str, Any]) -> str:
    """The suite's table as markdown, headed by the machine and the date it ran on (the
    README's performance table is this, rendered from a saved ``--json`` report)."""
    machine = report.get("machine", {})
    lines = [f"Measured {str(machine.get('time', '?'))[:10]} on {machine.get('cpus', '?')} CPUs, "
             f"{machine.get('platform', '?')}, Python {machine.get('python', '?')}"
             + (" (`--quick`: smoke sizes)" if report.get("quick") else "") + ":", "",
             "| path | case | op | unit | kvbridge | raw | ratio | limit | raw is |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in report["rows"]:
        lines.append(f"| {r['path']} | {r['case']} | {r['op']} | {r['unit']} | "
                     f"{_num(r['kvbridge'])} | {_num(r['raw'])} | {r['ratio']:.2f} | "
                     f"{_num(r['limit'])} | {r['raw_name']}"
                     + ("" if r["verified"] else " (NOT verified)") + " |")
    for name, entry in report["paths"].items():
        if entry["status"] != "ok":
            lines.append(f"\n{name}: {entry['status']}: {entry.get('reason', '')}")
    return "\n".join(lines)


def slim_report(report: dict[str, Any]) -> dict[str, Any]:
    """What :func:`format_markdown` reads: the machine, each path's status, the rows."""
    return {"machine": report.get("machine", {}), "quick": report.get("quick", False),
            "paths": {name: {key: entry[key] for key in ("status", "reason") if key in entry}
                      for name, entry in report["paths"].items()},
            "rows": report["rows"]}


def format_nixl_detail(detail: dict[str, Any]) -> str:
    """The nixl path's own columns (raw READ into a fresh buffer and into the KV cache)."""
    head = (f"{'pattern':>16} {'raw NIXL':>9} {'raw->KV':>9} {'kvbridge':>9} {'torch cp':>9} "
            f"{'kvb/raw':>8} {'paired':>6} {'kvb/rawKV':>9} {'raw/mcpy':>9} {'descs':>6} "
            f"{'runs':>5}"
            f"  (GB/s, READ)")
    lines = [head]
    for p in detail["patterns"]:
        label = f"{p['num_blocks']}x{size_label(p['block_bytes'])}"
        lines.append(f"{label:>16} {p['raw_nixl_gbps']:9.3f} "
                     f"{p['raw_nixl_into_kv_cache_gbps']:9.3f} {p['kvbridge_gbps']:9.3f} "
                     f"{p['torch_copy_gbps']:9.3f} {p['kvbridge_over_raw']:8.3f} "
                     f"{p.get('kvbridge_over_raw_paired', 0.0):6.3f} "
                     f"{p['kvbridge_over_raw_same_destination']:9.3f} "
                     f"{p['raw_over_memcpy']:9.3f} {p.get('kvbridge_descriptors', 0):6d} "
                     f"{p.get('kvbridge_descriptor_runs', 0):5d}")
    lines.append(f"block order: {detail.get('block_order', 'sorted')}; paired: median of the "
                 f"per-iteration kvb/raw ratios; runs: the descriptors NIXL merged the "
                 f"connector's into")
    lines.append("")
    lines.append(f"{'pattern':>16} {'verify off':>10} {'sample':>9} {'full':>9} "
                 f"{'sample/off':>10} {'full/off':>9} {'checked':>8} {'check':>8} {'take':>8}"
                 f"  (GB/s, READ; */off: paired)")
    for p in detail["patterns"]:
        if "verify_full_over_off" not in p:
            continue
        label = f"{p['num_blocks']}x{size_label(p['block_bytes'])}"
        lines.append(f"{label:>16} {p['kvbridge_verify_off_gbps']:10.3f} "
                     f"{p['kvbridge_gbps']:9.3f} {p['kvbridge_verify_full_gbps']:9.3f} "
                     f"{p['verify_sample_over_off']:10.3f} {p['verify_full_over_off']:9.3f} "
                     f"{p['blocks_verified']:8d} {_num(p['consumer_digest_gbps']):>8} "
                     f"{_num(p['producer_digest_gbps']):>8}")
    lines.append("sample: the default (the kvbridge column above); checked: blocks the "
                 "consumer verified; check / take: digest GB/s on the consumer / the producer "
                 "(its digests are taken as a hold starts)")
    return "\n".join(lines)


def format_offload_verify(details: list[dict[str, Any]]) -> str:
    """The offload path's verification table: each path's GB/s per verify mode, over off."""
    lines = [f"{'pattern':>16} {'path':<10} {'off':>8} {'sample':>8} {'full':>8} "
             f"{'sample/off':>10} {'full/off':>9}  (GB/s; lookup: us per block checked)"]
    for d in details:
        v = d.get("verify")
        if not isinstance(v, dict):
            continue
        label = f"{v['num_blocks']}x{size_label(v['block_bytes'])}"
        for path in ("fs_store", "fs_load", "cpu_store", "cpu_load"):
            g, r = v["gbps"], v["ratio_of_off"]
            lines.append(f"{label:>16} {path:<10} {g['off'][path]:8.3f} {g['sample'][path]:8.3f}"
                         f" {g['full'][path]:8.3f} {r['sample'][path]:10.3f} "
                         f"{r['full'][path]:9.3f}")
        us = v["cpu_lookup_us_per_block"]
        lines.append(f"{label:>16} {'lookup':<10} {us['off']:8.2f} {us['sample']:8.2f} "
                     f"{us['full']:8.2f}")
    lines.append(f"fs I/O: {details[0]['verify']['io_mode'] if details else '-'}; "
                 f"{details[0]['verify']['num_layers'] if details else '-'} layer digests per "
                 f"block; lookup: scheduler-thread time of a CPU-tier lookup that checks slots")
    return "\n".join(lines)


def format_details(report: dict[str, Any]) -> str | None:
    """A path's own table after the suite's, when exactly one path ran (or None)."""
    if len(report["paths"]) != 1:
        return None
    name, entry = next(iter(report["paths"].items()))
    detail = entry.get("detail")
    if entry["status"] == "ok" and name == "offload" and isinstance(detail, list):
        return format_offload_verify(detail)
    if entry["status"] != "ok" or not isinstance(detail, dict):
        return None
    if name == "nixl":
        return format_nixl_detail(detail)
    if name == "nixl-scale":
        return format_scale_detail(detail)
    if name == "mooncake":
        from kvbridge.connectors.mooncake_store.bench import format_report

        return str(format_report(detail))
    return None


def plot(report: dict[str, Any], path: str) -> None:
    """Throughput (GB/s) against block size, one line per path and op; raw dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'kvbridge[plot]' "
                          "(or pip install matplotlib)") from None
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in report["rows"]:
        if r["unit"] == "GB/s" and r["block_bytes"]:
            series.setdefault((r["path"], r["op"]), []).append(r)
    fig, ax = plt.subplots(figsize=(8, 5))
    limit_points: dict[int, float] = {}
    for (name, op), rows in sorted(series.items()):
        rows = sorted(rows, key=lambda x: x["block_bytes"])
        xs = [x["block_bytes"] for x in rows]
        line = ax.plot(xs, [x["kvbridge"] for x in rows], marker="o",
                       label=f"{name} {op} (kvbridge)")[0]
        ax.plot(xs, [x["raw"] for x in rows], marker="x", linestyle="--",
                color=line.get_color(), label=f"{name} {op} ({rows[0]['raw_name']})")
        for x in rows:
            if x["limit"] is not None:
                limit_points[x["block_bytes"]] = max(limit_points.get(x["block_bytes"], 0.0),
                                                     x["limit"])
    if limit_points:
        xs = sorted(limit_points)
        ax.plot(xs, [limit_points[x] for x in xs], linestyle=":", color="black",
                label="memcpy (same bytes)")
    ax.set_xscale("log", base=2)
    sizes = sorted({x["block_bytes"] for rows in series.values() for x in rows})
    if sizes:
        ax.set_xticks(sizes, [size_label(n) for n in sizes])
    ax.set_xlabel("block size (bytes)")
    ax.set_ylabel("GB/s")
    ax.set_title("kvbridge vs raw library, same bytes, same run")
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- CLI


EPILOG = """\
examples:
  kvbridge bench all --json results.json --plot results.png   # every path, one file
  kvbridge bench nixl                    # NIXL connector vs raw NIXL READ vs torch copy
  kvbridge bench nixl --block-order vllm # the same with vLLM's block order
  kvbridge bench nixl-scale              # set-up at 64 layers x 100,000 blocks vs raw NIXL
  kvbridge bench nixl-scale --layers 32 --pattern 50000x64 --per-block
  kvbridge bench mooncake --pattern 64x2MiB --iters 9 --json
  kvbridge bench offload --dir /mnt/nvme # fs tier vs plain file I/O
  kvbridge bench events                  # KV events/s vs raw pyzmq
  kvbridge bench lookup                  # scheduler-side lookup latency per key
  kvbridge bench all --quick             # small sizes: a smoke run in seconds
  kvbridge bench all --report docs/bench.json --markdown   # the README's table, rendered

--json [FILE] prints (or writes to FILE) {"machine", "quick", "iters", "paths":
{NAME: {"status": ok|skipped|failed, "seconds", "rows", "detail"|"reason"}},
"rows": [{"path", "case", "op", "unit", "num_blocks", "block_bytes",
"total_bytes", "kvbridge", "raw", "raw_name", "ratio", "limit", "limit_name",
"verified"}]}. --plot needs matplotlib (pip install 'kvbridge[plot]').

exit codes: 0 ok (skipped paths included), 1 a path failed or moved wrong
bytes, 2 usage error
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=("all", *PATHS), metavar="PATH",
                        help=f"all, or one of: {', '.join(PATHS)}")
    parser.add_argument("--pattern", action="append", metavar="NUMxSIZE",
                        help="blocks x block size, e.g. 64x2MiB (repeatable; nixl, mooncake, "
                             "offload, digests; default: a few block sizes)")
    parser.add_argument("--iters", type=int, default=5, metavar="N",
                        help="timed iterations / rounds per case (default 5)")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and few iterations (smoke run)")
    parser.add_argument("--events", type=int, default=None, metavar="N",
                        help="events per batch size (events; default 50000, --quick 2000)")
    parser.add_argument("--batch-sizes", default="16,64", metavar="N,N",
                        help="events per batch (events; default 16,64)")
    parser.add_argument("--master", metavar="HOST:PORT",
                        help="a running mooncake_master (default: start one; needs --metadata)")
    parser.add_argument("--metadata", metavar="URL",
                        help="its HTTP metadata server, e.g. http://127.0.0.1:8080/metadata")
    parser.add_argument("--dir", default=None, metavar="DIR",
                        help="where the offload path creates its temp store")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="print JSON (or write it to FILE)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw GB/s against block size for each path (needs matplotlib)")
    parser.add_argument("--block-order", choices=("sorted", "vllm"), default="sorted",
                        help="nixl: how both engines hand out blocks: sorted (ascending per "
                             "request, the reference engine's default) or vllm (free-queue "
                             "order, which runs downwards after frees)")
    parser.add_argument("--layers", type=int, default=None, metavar="N",
                        help="nixl-scale: layers per rank (default 64, --quick 8); --pattern "
                             "gives blocks per layer x bytes of one layer's block")
    parser.add_argument("--per-block", action="store_true",
                        help="nixl-scale: also prepare per-block lists (one row per block and "
                             "layer: slow and memory-hungry at real sizes)")
    parser.add_argument("--progress", action="store_true",
                        help="progress on stderr even when it is not a terminal")
    parser.add_argument("--markdown", action="store_true",
                        help="print the table as markdown, headed by the machine and date")
    parser.add_argument("--report", metavar="FILE.json",
                        help="render a report saved with --json instead of running (PATH "
                             "all: every path in it; a name: that path's rows)")


def run(args: argparse.Namespace) -> int:
    try:
        patterns = [parse_pattern(p) for p in args.pattern] if args.pattern else None
        sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
        if not sizes or min(sizes) < 1:
            raise ValueError("--batch-sizes: expected positive integers")
    except ValueError as exc:
        print(f"kvbridge bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.iters < 1 or (args.events is not None and args.events < 1):
        print("kvbridge bench: --iters and --events must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    if args.layers is not None and args.layers < 1:
        print("kvbridge bench: --layers must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    if (args.master is None) != (args.metadata is None):
        print("kvbridge bench: --master and --metadata go together", file=sys.stderr)
        return EXIT_USAGE
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("kvbridge bench: --plot needs matplotlib: pip install 'kvbridge[plot]' "
                  "(or pip install matplotlib)", file=sys.stderr)
            return EXIT_USAGE
    names = PATHS if args.name == "all" else (args.name,)
    if args.report:
        try:
            with open(args.report) as handle:
                saved = json.load(handle)
            saved["rows"] = [r for r in saved["rows"] if r["path"] in names]
            saved["paths"] = {k: v for k, v in saved["paths"].items() if k in names}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(f"kvbridge bench: --report {args.report}: not a saved bench report: {exc}",
                  file=sys.stderr)
            return EXIT_USAGE
        print(format_markdown(saved) if args.markdown else format_table(saved))
        return EXIT_OK if suite_ok(saved) else EXIT_FAILURE
    progress = Progress("bench", force=args.progress)
    report = run_suite(names, patterns=patterns, iters=args.iters, quick=args.quick,
                       events=args.events, batch_sizes=sizes, master=args.master,
                       metadata=args.metadata, directory=args.dir,
                       block_order=args.block_order, layers=args.layers,
                       per_block=args.per_block, progress=progress.update)
    progress.done()
    if args.json == "-":
        print(json.dumps(report, indent=2))
    elif args.markdown:
        print(format_markdown(report))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=2)
    else:
        print(format_table(report))
        details = format_details(report)
        if details:
            print()
            print(details)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=2)
            print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"plotted {args.plot}", file=sys.stderr if args.json == "-" else sys.stdout)
    for name, entry in report["paths"].items():
        if entry["status"] == "failed":
            print(f"kvbridge bench {name}: failed: {entry['reason']}", file=sys.stderr)
    return EXIT_OK if suite_ok(report) else EXIT_FAILURE


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmark suite: kvbridge against the raw library and memcpy",
        description="Run one path of the suite, or all: kvbridge against the raw library "
                    "doing the same bytes in the same run, plus the memory-copy limit.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)
