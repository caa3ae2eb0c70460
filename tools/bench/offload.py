"""Benchmark of the offload store: fs tier vs plain file I/O, and lookup latency under load.

Every figure is measured in the same run as what it is compared with:

* **store/load GB/s** of the fs tier (jobs of ``batch_blocks`` blocks on its
  thread pools, files of ``block_bytes``, temp + rename per block) against a
  plain sequential write/read of the same bytes into one file, in the same I/O
  mode (O_DIRECT when the tier uses it, buffered otherwise); ``ratio`` = tier / plain.
* **lookup latency** on the scheduler thread, per key (call time / keys), while
  the fs tier's threads are busy storing and loading: median and p99.
* **verification cost** (``verify_modes``, ``run_verify_bench``): the fs tier's
  store and load jobs, and the CPU tier's store and load paths through the
  manager (the engine's bytes copied into a slot and ``complete_store``, which
  digests them; ``lookup``, which checks them, and the copy out), each with
  the verify policy off, sample and full, rounds alternating the order;
  ``ratio_of_off`` = throughput with the mode / throughput with verification
  off (1.0: free; 0.8: 20% slower); ``cpu_lookup_us_per_block``: the
  scheduler-thread time of the lookup that checks the CPU slots, per block.

The tier of the store/load rows uses the tiers' default policy (``full``):
its figures include taking and checking the digests.
"""

from __future__ import annotations

import os
import statistics
import time

from kvbridge.layouts.digests import DigestMode, VerifyPolicy
from kvbridge.offload.cpu import CpuTier
from kvbridge.offload.fs import DEFAULT_READ_THREADS, DEFAULT_WRITE_THREADS, FsTier
from kvbridge.offload.fs_io import O_DIRECT
from kvbridge.offload.manager import OffloadManager
from kvbridge.offload.runner import TierRunner
from kvbridge.offload.testing import bench_workdir, block_content
from kvbridge.offload.types import JobResult, OffloadError
from kvbridge.tools.bench.rows import GB, percentiles


def _gbps(nbytes: int, seconds: float) -> float:
    """GB/s rounded for the report; 0.0 for a zero time rather than an infinity in JSON."""
    return round(nbytes / seconds / GB, 3) if seconds > 0 else 0.0


def _plain_write(path: str, buf: memoryview, direct: bool) -> float:
    """Seconds to write ``buf`` to one new file as one sequential stream (8 MiB syscalls)."""
    flags = O_DIRECT if direct else 0
    chunk = 8 << 20
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
    try:
        for off in range(0, len(buf), chunk):
            piece = buf[off:off + chunk]
            done = 0
            while done < len(piece):
                done += os.write(fd, piece[done:])
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _plain_read(path: str, buf: memoryview, direct: bool) -> float:
    """Seconds to read the file back into ``buf`` as one sequential stream."""
    flags = O_DIRECT if direct else 0
    chunk = 8 << 20
    start = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        for off in range(0, len(buf), chunk):
            piece = buf[off:off + chunk]
            done = 0
            while done < len(piece):
                n = os.readv(fd, [piece[done:]])
                if n <= 0:
                    raise OSError(f"unexpected EOF reading {path}")
                done += n
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _wait_jobs(tier: TierRunner, job_ids: set[int], timeout_s: float) -> list[JobResult]:
    results: list[JobResult] = []
    deadline = time.monotonic() + timeout_s
    while job_ids:
        for result in tier.get_finished_jobs():
            job_ids.discard(result.job_id)
            results.append(result)
        if not job_ids:
            break
        if time.monotonic() > deadline:
            raise OffloadError("bench", f"{len(job_ids)} jobs unfinished after {timeout_s} s")
        tier.wait_for_finished(0.05)
    return results


def _timed_jobs(tier: TierRunner, kind: str, keys: list[bytes], batches: list[list[int]],
                buffers: list[list[memoryview]], job_id: int, timeout_s: float
                ) -> tuple[float, int, int]:
    """Store or load every batch through the tier's jobs and wait for them: (seconds,
    failed jobs, the last job id used)."""
    submit = tier.submit_store if kind == "store" else tier.submit_load
    start = time.perf_counter()
    ids = set()
    for batch in batches:
        job_id += 1
        ids.add(job_id)
        submit(job_id, [keys[i] for i in batch], [buffers[i] for i in batch])
    failed = sum(not res.success for res in _wait_jobs(tier, ids, timeout_s))
    return time.perf_counter() - start, failed, job_id


def run_offload_bench(directory: str | None = None, *, num_blocks: int = 64,
                      block_bytes: int = 1 << 20, batch_blocks: int = 8, rounds: int = 3,
                      read_threads: int = DEFAULT_READ_THREADS,
                      write_threads: int = DEFAULT_WRITE_THREADS, use_o_direct: bool = True,
                      lookup_keys: int = 64, lookup_iterations: int = 400,
                      timeout_s: float = 300.0, io_engine: str = "auto") -> dict[str, object]:
    """Run the benchmark in a temp dir under ``directory``; returns a JSON-able dict.

    ``rounds`` alternate plain and tier runs (fresh files and keys each round,
    so a store never finds its destination already there; who goes first
    alternates; every timed phase starts after an untimed ``os.sync``); the
    medians are reported, which keeps one noisy round on a shared machine
    from deciding.
    """
    if min(num_blocks, block_bytes, batch_blocks, rounds, lookup_keys, lookup_iterations) <= 0:
        raise OffloadError("bench", "num_blocks, block_bytes, batch_blocks, rounds, lookup_keys and "
                           "lookup_iterations must be positive")
    total = num_blocks * block_bytes
    samples: dict[str, list[float]] = {"plain_write": [], "plain_read": [], "store": [],
                                       "load": []}
    failures = 0
    verified = True
    with bench_workdir(directory) as work:
        primary = CpuTier(num_blocks, block_bytes)
        fs = FsTier(os.path.join(work, "store"), block_bytes, "be7c4be7c4be7c4b",
                    use_o_direct=use_o_direct, io_engine=io_engine)
        tier = TierRunner(fs, read_threads=read_threads, write_threads=write_threads)
        tier.attach_primary(primary.buffer)   # as the offload manager does
        io_mode = "O_DIRECT" if fs.o_direct else "buffered"
        tier_reads = "batched (io_uring)" if fs.batched else "one by one (readv)"
        try:
            seed = block_content(b"bench-seed", block_bytes)
            for i in range(num_blocks):
                view = primary.view(i)
                view[:] = seed
                view[:8] = i.to_bytes(8, "little")   # distinct blocks, cheap to make
            expected = bytes(primary.buffer)
            buffers = [[primary.view(i)] for i in range(num_blocks)]
            batches = [list(range(s, min(s + batch_blocks, num_blocks)))
                       for s in range(0, num_blocks, batch_blocks)]
            job_id = 0
            for r in range(rounds):
                plain = os.path.join(work, f"plain-{r}.bin")
                keys = [b"bench|%d|%d" % (r, i) for i in range(num_blocks)]

                def tier_run(kind: str, keys: list[bytes] = keys) -> float:
                    nonlocal job_id, failures
                    seconds, failed, job_id = _timed_jobs(tier, kind, keys, batches, buffers,
                                                          job_id, timeout_s)
                    failures += failed
                    return seconds

                # alternate who goes first, and start every timed phase with no dirty
                # pages left by the previous one (os.sync, not timed)
                first_plain = r % 2 == 0
                for phase in (("plain_write", "store") if first_plain else ("store", "plain_write")):
                    os.sync()
                    if phase == "store":
                        samples["store"].append(tier_run("store"))
                    else:
                        samples["plain_write"].append(
                            _plain_write(plain, primary.buffer, fs.o_direct))
                for phase in (("plain_read", "load") if first_plain else ("load", "plain_read")):
                    os.sync()
                    primary.buffer[:] = bytes(total)   # reads must really refill the slots
                    if phase == "load":
                        samples["load"].append(tier_run("load"))
                        verified = verified and bytes(primary.buffer) == expected
                    else:
                        samples["plain_read"].append(
                            _plain_read(plain, primary.buffer, fs.o_direct))
                os.remove(plain)
        finally:
            tier.shutdown()
            primary.close()

        latency = lookup_latency(os.path.join(work, "lat"), lookup_keys, lookup_iterations,
                                  use_o_direct, timeout_s)

    med = {name: statistics.median(values) for name, values in samples.items()}

    def gbps(seconds: float) -> float:
        return _gbps(total, seconds)

    return {
        "bytes": total, "num_blocks": num_blocks, "block_bytes": block_bytes,
        "batch_blocks": batch_blocks, "rounds": rounds, "io_mode": io_mode,
        "tier_reads": tier_reads,
        "threads": {"read": read_threads, "write": write_threads},
        "store": {"tier_gbps": gbps(med["store"]), "plain_gbps": gbps(med["plain_write"]),
                  "ratio": round(med["plain_write"] / med["store"], 3)},
        "load": {"tier_gbps": gbps(med["load"]), "plain_gbps": gbps(med["plain_read"]),
                 "ratio": round(med["plain_read"] / med["load"], 3)},
        "rounds_gbps": {name: [gbps(v) for v in values] for name, values in samples.items()},
        "failed_jobs": failures, "verified": verified,
        "lookup": latency,
    }


def run_verify_bench(directory: str | None = None, *, modes: tuple[str, ...] = ("off", "full"),
                     num_blocks: int = 64, block_bytes: int = 1 << 20, num_layers: int = 32,
                     batch_blocks: int = 8, rounds: int = 3, use_o_direct: bool = True,
                     timeout_s: float = 300.0) -> dict[str, object]:
    """GB/s of the fs and CPU tiers' store and load paths per verify mode; ratios of ``off``.

    Every mode runs in every round (the order rotates per round), on fresh keys;
    medians are reported. Loads are checked byte for byte after the timing.
    """
    parsed = []
    for mode in modes:
        try:
            parsed.append(DigestMode(mode))
        except ValueError:
            raise OffloadError("verify", f"expected modes among "
                               f"{[m.value for m in DigestMode]}, got {mode!r}") from None
    if DigestMode.OFF not in parsed:
        parsed.insert(0, DigestMode.OFF)   # the baseline every ratio is taken against
    if min(num_blocks, block_bytes, batch_blocks, rounds, num_layers) <= 0 \
            or block_bytes % num_layers:
        raise OffloadError("bench", "num_blocks, block_bytes, batch_blocks, rounds and "
                           "num_layers must be positive, block_bytes a multiple of num_layers")
    total = num_blocks * block_bytes
    paths = ("fs_store", "fs_load", "cpu_store", "cpu_load", "cpu_lookup")
    samples: dict[str, dict[str, list[float]]] = {m.value: {p: [] for p in paths}
                                                   for m in parsed}
    verified = True
    failures = 0
    seed = block_content(b"verify-bench-seed", block_bytes)
    source = bytearray(total)
    for i in range(num_blocks):
        source[i * block_bytes:(i + 1) * block_bytes] = seed
        source[i * block_bytes:i * block_bytes + 8] = i.to_bytes(8, "little")
    src = memoryview(source)
    io_mode = "buffered"
    with bench_workdir(directory) as work:
        for r in range(rounds):
            order = parsed[r % len(parsed):] + parsed[:r % len(parsed)]
            for mode in order:
                policy = VerifyPolicy(mode)
                primary = CpuTier(num_blocks, block_bytes, verify=policy, num_layers=num_layers)
                fs = FsTier(os.path.join(work, f"{mode.value}-{r}"), block_bytes,
                            "5e1f5e1f5e1f5e1f", use_o_direct=use_o_direct, verify=policy,
                            num_layers=num_layers)
                tier = TierRunner(fs, read_threads=DEFAULT_READ_THREADS,
                                  write_threads=DEFAULT_WRITE_THREADS)
                tier.attach_primary(primary.buffer)   # as the offload manager does
                io_mode = "O_DIRECT" if fs.o_direct else "buffered"
                try:
                    times, ok, failed = _verify_round(primary, tier, src, num_blocks,
                                                      block_bytes, batch_blocks, r, timeout_s)
                finally:
                    tier.shutdown()
                    primary.close()
                verified = verified and ok
                failures += failed
                for path, seconds in times.items():
                    samples[mode.value][path].append(seconds)
    med = {m: {p: statistics.median(v) for p, v in by.items()} for m, by in samples.items()}

    def gbps(seconds: float) -> float:
        return _gbps(total, seconds)

    off = med[DigestMode.OFF.value]
    return {
        "modes": [m.value for m in parsed], "bytes": total, "num_blocks": num_blocks,
        "block_bytes": block_bytes, "num_layers": num_layers, "rounds": rounds,
        "io_mode": io_mode,
        "gbps": {m: {p: gbps(t) for p, t in by.items() if p != "cpu_lookup"}
                 for m, by in med.items()},
        "ratio_of_off": {m: {p: round(off[p] / t, 3) if t > 0 else 0.0 for p, t in by.items()
                             if p != "cpu_lookup"}
                         for m, by in med.items()},
        # scheduler-thread time of the lookup that checks the CPU slots (a part of cpu_load)
        "cpu_lookup_us_per_block": {m: round(by["cpu_lookup"] / num_blocks * 1e6, 2)
                                    for m, by in med.items()},
        "verified": verified, "failed_jobs": failures,
    }


def _verify_round(primary: CpuTier, tier: TierRunner, src: memoryview, num_blocks: int,
                  block_bytes: int, batch_blocks: int, r: int,
                  timeout_s: float) -> tuple[dict[str, float], bool, int]:
    """One round of one mode: CPU store/load through a manager (no secondary tier, so
    nothing else runs), then fs store/load jobs from/into the same slots."""
    manager = OffloadManager(primary, [])
    keys = [b"vb|%d|%d" % (r, i) for i in range(num_blocks)]
    times: dict[str, float] = {}
    primary.buffer[:] = bytes(len(primary.buffer))   # fault the slot pages in, untimed
    out = bytearray(b"\xff") * len(src)              # and the copy-out target's
    start = time.perf_counter()
    spec = manager.prepare_store("store", keys)
    for i, slot in enumerate(spec.slots):      # the worker's copy engine -> slot
        primary.view(slot)[:] = src[i * block_bytes:(i + 1) * block_bytes]
    manager.complete_store(spec.keys)          # digests them (unless off)
    times["cpu_store"] = time.perf_counter() - start
    start = time.perf_counter()
    result = manager.lookup("load", keys)      # checks them (unless off)
    times["cpu_lookup"] = time.perf_counter() - start
    load = manager.prepare_load("load", keys[:result.num_blocks])
    for i, slot in enumerate(load.slots):      # the worker's copy slot -> engine
        out[i * block_bytes:(i + 1) * block_bytes] = primary.view(slot)
    manager.complete_load("load", load.keys)
    manager.request_finished("load")
    times["cpu_load"] = time.perf_counter() - start
    ok = result.num_blocks == num_blocks and out == src
    buffers = [[primary.view(i)] for i in range(num_blocks)]
    batches = [list(range(s, min(s + batch_blocks, num_blocks)))
               for s in range(0, num_blocks, batch_blocks)]
    failures = 0
    job_id = 0
    for kind in ("store", "load"):
        os.sync()
        if kind == "load":
            primary.buffer[:] = bytes(len(primary.buffer))   # loads must really refill
        times[f"fs_{kind}"], failed, job_id = _timed_jobs(tier, kind, keys, batches, buffers,
                                                          job_id, timeout_s)
        failures += failed
    ok = ok and bytes(primary.buffer) == bytes(src)
    return times, ok, failures


def lookup_latency(root: str, num_keys: int, iterations: int, use_o_direct: bool,
                    timeout_s: float) -> dict[str, object]:
    """Per-key lookup time (µs) on this (the scheduler) thread, tier idle and tier busy.

    Each lookup is a new request for ``num_keys`` keys: half ready in CPU memory
    (hits, pinned), half never stored (their probes are enqueued: RETRY), then
    the request finishes and its lookup entries are dropped. The idle figures,
    taken in the same run, show how much of the tail is this machine's
    scheduling noise rather than the busy tier.
    """
    block_bytes = 256 << 10
    busy_blocks = 16
    half = max(1, num_keys // 2)
    primary = CpuTier(busy_blocks + num_keys + 8, block_bytes)
    tier = TierRunner(FsTier(root, block_bytes, "1a7e1c1a7e1c1a7e", use_o_direct=use_o_direct),
                      read_threads=2, write_threads=2)
    manager = OffloadManager(primary, [tier])
    try:
        hot = [b"hot|%d" % i for i in range(half)]
        spec = manager.prepare_store("setup", hot)
        manager.complete_store(spec.keys)
        cold = [b"cold|%d" % i for i in range(num_keys - half)]   # never stored: misses
        keys = hot + cold
        manager.wait_idle(timeout_s)
        busy_keys = [b"busy|%d" % i for i in range(busy_blocks)]
        busy_spec = manager.prepare_store("busy", busy_keys)
        busy_views = manager.slot_buffers(busy_spec.slots)
        job_id = 1 << 40
        busy_jobs = 0
        out: dict[str, object] = {"keys_per_lookup": len(keys), "iterations": iterations}
        for phase in ("idle", "busy"):
            per_key_us: list[float] = []
            for it in range(iterations):
                if phase == "busy" and tier.num_jobs_in_flight < 4:
                    # keep the tier's threads busy: store jobs of fresh keys, 2 blocks each
                    ids = [it % busy_blocks, (it + 1) % busy_blocks]
                    tier.submit_store(job_id, [busy_keys[i] + b"|%d" % it for i in ids],
                                      [busy_views[i] for i in ids])
                    job_id += 1
                    busy_jobs += 1
                request_id = f"lat-{phase}-{it}"
                start = time.perf_counter_ns()
                manager.lookup(request_id, keys)
                elapsed = time.perf_counter_ns() - start
                per_key_us.append(elapsed / 1000 / len(keys))
                manager.request_finished(request_id)
                tier.get_finished_jobs()        # bench-owned jobs: not the manager's
                tier.drain_results()
                tier.step()
            out[f"{phase}_per_key_us"] = percentiles(per_key_us, 3)
        out["busy_store_jobs"] = busy_jobs
        deadline = time.monotonic() + timeout_s
        while tier.num_jobs_in_flight and time.monotonic() < deadline:
            tier.get_finished_jobs()
            time.sleep(0.001)
        manager.complete_store(busy_spec.keys)
        return out
    finally:
        manager.shutdown()
