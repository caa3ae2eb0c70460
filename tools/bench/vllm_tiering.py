"""kvbridge's fs tier beside vLLM's own fs tier, both as secondary tiers of vLLM's manager.

Owns the benchmark only; it may not change either tier. Per case (chunk size, chunks
per request) and per round, each tier gets a fresh vLLM ``TieringOffloadingManager``
(``TieringOffloadingSpec`` with one secondary tier: vLLM's ``fs`` with its defaults,
or ``KvbridgeFsTier`` with its defaults, ``verify: full``), over the same directory,
and the manager is driven as vLLM's scheduler drives it:

* warm-up (untimed): the same store and load on other chunks, so both tiers run as a
  server does after its first requests (memory touched, threads started);
* store: requests of ``batch`` chunks each; the worker's GPU->CPU copy is this script
  writing the chunk rows; ``complete_store`` cascades one job per request into the
  tier; timed until every job finished (``has_pending_work`` false);
* lookup: after ``reset_cache`` (the CPU copies go), each request looks its chunks up
  until no verdict is RETRY: the time to a verdict (``lookup_ms``, median over
  requests), the scheduler-thread time per ``lookup`` call (``lookup_us``) and in all
  of them (``lookup_sum_ms``: a tier that answers at once is asked fewer times, so
  its calls are fewer and each does more of the manager's work, a promotion's start
  included; the sum compares what the scheduler spent, and grows with the load's
  duration: every request is asked again on each pass until its chunks are loaded);
* load: from then until every chunk is a HIT in the CPU tier (one promotion job per
  request); every loaded byte is compared with what was stored;
* time to first byte after a restart: a new manager (new engine id) over the same
  directory, from its construction until the first chunk of a stored request is a HIT.

``os.sync`` (untimed) before each timed phase. Medians over rounds; ratio = kvbridge /
vLLM (GB/s; for times, vLLM's time over kvbridge's: > 1 means kvbridge is faster).

Before the first case a small case of both tiers runs untimed (what their first
store, load and restart import or build lazily) and the heap is frozen (``vllm.utils.gc_utils.freeze_gc_heap``), as vLLM's
``EngineCore`` does after its start-up: else a full garbage collection walks the
~600,000 objects of vLLM's and torch's imports, 0.3-0.6 s on a 2-core machine with the
GIL held, on whichever thread allocates, and lands in one tier's timed window by chance
(the 0.4-0.9 s "stalls" measured before; a server never pays them).
Run inside the vLLM venv::

    .venv-vllm/bin/python -m kvbridge.tools.bench.vllm_tiering --quick
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from kvbridge.offload.testing import bench_workdir
from kvbridge.tools.bench.render import write_json

GB = 1e9
MODULE = "kvbridge.integrations.vllm.tiering"
#: tier name -> its secondary_tiers entry, less root_dir
TIERS: dict[str, dict[str, Any]] = {
    "vllm": {"type": "fs"},
    "kvbridge": {"type": "KvbridgeFsTier", "module_path": MODULE, "verify": "full"},
}
#: (chunk bytes, chunks) of the full and the quick run
CASES = ((2 << 20, 64), (256 << 10, 256), (16 << 10, 1024))
QUICK_CASES = ((2 << 20, 16), (256 << 10, 64), (16 << 10, 256))
BATCHES = (1, 8)


def _key(tag: str, i: int) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(hashlib.sha256(f"{tag}|{i}".encode()).digest(), 0)


def _content(i: int, nbytes: int) -> bytes:
    return hashlib.shake_128(b"bench-tiering|%d" % i).digest(nbytes)


class _Driver:
    """vLLM's scheduler-side calls on a fresh TieringOffloadingManager."""

    def __init__(self, tier: dict[str, Any], chunk_bytes: int, num_chunks: int,
                 timeout_s: float) -> None:
        import numpy as np
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingGroupConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(16, ("bench.layer",), 0),),
            worker_kv_bytes_per_block=chunk_bytes, enable_kv_cache_events=False,
            extra_config={"cpu_bytes_to_use": num_chunks * chunk_bytes,
                          "secondary_tiers": [dict(tier)]},
            engine_id=uuid.uuid4().hex, model=OffloadingModelConfig("bench", "bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True))
        self.manager: Any = TieringOffloadingSpec(config).get_manager()
        view = self.manager.primary_tier.get_kv_memoryview()
        self.rows: Any = np.frombuffer(view, dtype=np.uint8).reshape(view.shape)
        self.timeout_s = timeout_s
        self._n = 0

    def ctx(self) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        self._n += 1
        ctx = ReqContext(req_id=f"bench-{self._n}")
        self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def pending(self, what: str, deadline: float) -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} unfinished after {self.timeout_s} s")
        time.sleep(0.0002)
        self.step()

    def store(self, requests: list[list[bytes]], payloads: dict[bytes, bytes]) -> float:
        """Seconds until every request's chunks are stored in the tier."""
        deadline = time.monotonic() + self.timeout_s
        start = time.perf_counter()
        for keys in requests:
            ctx = self.ctx()
            out = self.manager.prepare_store(keys, ctx)
            for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                self.rows[int(chunk)] = memoryview(payloads[key])
            self.manager.complete_store(out.keys_to_store, ctx)
            self.manager.on_request_finished(ctx)
        self.step()
        while self.manager.has_pending_work():
            self.pending("stores", deadline)
        return time.perf_counter() - start

    def lookup_and_load(self, requests: list[list[bytes]]
                        ) -> tuple[list[float], list[float], float, list[Any]]:
        """Per request the seconds to a verdict; per lookup call its seconds; the seconds
        until every chunk is a HIT; the contexts (still open)."""
        from vllm.v1.kv_offload.base import LookupResult

        deadline = time.monotonic() + self.timeout_s
        ctxs = [self.ctx() for _ in requests]
        verdict_s: list[float | None] = [None] * len(requests)
        call_s: list[float] = []
        done = [False] * len(requests)
        start = time.perf_counter()
        while not all(done):
            for r, (ctx, keys) in enumerate(zip(ctxs, requests, strict=True)):
                if done[r]:
                    continue
                results = []
                for key in keys:
                    t = time.perf_counter()
                    results.append(self.manager.lookup(key, ctx))
                    call_s.append(time.perf_counter() - t)
                if verdict_s[r] is None and LookupResult.RETRY not in results:
                    verdict_s[r] = time.perf_counter() - start
                if LookupResult.MISS in results:
                    raise RuntimeError(f"a stored chunk missed: {results}")
                done[r] = all(v is LookupResult.HIT for v in results)
            if not all(done):
                self.pending("loads", deadline)
        total = time.perf_counter() - start
        return [v or 0.0 for v in verdict_s], call_s, total, ctxs

    def verify(self, requests: list[list[bytes]], ctxs: list[Any],
               payloads: dict[bytes, bytes]) -> bool:
        ok = True
        for keys, ctx in zip(requests, ctxs, strict=True):
            spec = self.manager.prepare_load(keys, ctx)
            for key, chunk in zip(keys, spec.chunk_ids, strict=True):
                ok = ok and self.rows[int(chunk)].tobytes() == payloads[key]
            self.manager.complete_load(keys, ctx)
            self.manager.on_request_finished(ctx)
        return ok

    def first_hit(self, keys: list[bytes]) -> None:
        from vllm.v1.kv_offload.base import LookupResult

        deadline = time.monotonic() + self.timeout_s
        ctx = self.ctx()
        while self.manager.lookup(keys[0], ctx) is not LookupResult.HIT:
            self.pending("the first chunk", deadline)
        self.manager.on_request_finished(ctx)

    def close(self) -> None:
        self.rows = None
        self.manager.shutdown()


def run_case(directory: str, chunk_bytes: int, num_chunks: int, batch: int, rounds: int,
             timeout_s: float = 300.0,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """One case: both tiers, ``rounds`` rounds (tier order alternating); a JSON-able row."""
    samples: dict[str, dict[str, list[float]]] = {
        t: {"store": [], "load": [], "lookup_ms": [], "lookup_us": [], "lookup_sum_ms": [],
            "ttfb_ms": []}
        for t in TIERS}
    verified = True
    names = list(TIERS)
    for r in range(rounds):
        for name in names[r % 2:] + names[:r % 2]:
            tag = f"{name}|{chunk_bytes}|{batch}|{r}|{uuid.uuid4().hex}"
            keys = [_key(tag, i) for i in range(num_chunks)]
            payloads = {k: _content(i, chunk_bytes) for i, k in enumerate(keys)}
            requests = [keys[s:s + batch] for s in range(0, num_chunks, batch)]
            tier = dict(TIERS[name], root_dir=directory)
            driver = _Driver(tier, chunk_bytes, num_chunks, timeout_s)
            try:
                # untimed, the same pattern on other chunks: a server's steady state
                # (memory of both tiers touched once, threads started)
                warm = [_key(tag + "|warm", i) for i in range(num_chunks)]
                warm_requests = [warm[s:s + batch] for s in range(0, num_chunks, batch)]
                driver.store(warm_requests, {k: _content(i, chunk_bytes)
                                             for i, k in enumerate(warm)})
                driver.manager.reset_cache()
                verified = driver.verify(
                    warm_requests, driver.lookup_and_load(warm_requests)[3],
                    {k: _content(i, chunk_bytes) for i, k in enumerate(warm)}) and verified
                driver.manager.reset_cache()
                os.sync()
                store_s = driver.store(requests, payloads)
                driver.manager.reset_cache()
                os.sync()
                verdicts, calls, load_s, ctxs = driver.lookup_and_load(requests)
                verified = driver.verify(requests, ctxs, payloads) and verified
            finally:
                driver.close()
            os.sync()
            start = time.perf_counter()
            again = _Driver(tier, chunk_bytes, num_chunks, timeout_s)
            try:
                again.first_hit(requests[0])
                ttfb = time.perf_counter() - start
            finally:
                again.close()
            total = num_chunks * chunk_bytes
            by = samples[name]
            by["store"].append(total / store_s / GB)
            by["load"].append(total / load_s / GB)
            by["lookup_ms"].append(statistics.median(verdicts) * 1e3)
            by["lookup_us"].append(statistics.mean(calls) * 1e6)
            by["lookup_sum_ms"].append(sum(calls) * 1e3)
            by["ttfb_ms"].append(ttfb * 1e3)
        if progress is not None:
            progress(f"round {r + 1}/{rounds}")
    # unrounded: a small case's GB/s on a loaded machine rounds to 0
    med = {t: {m: statistics.median(v) for m, v in by.items()} for t, by in samples.items()}

    def ratio_of(metric: str) -> float:
        better, worse = (("kvbridge", "vllm") if metric in ("store", "load")
                         else ("vllm", "kvbridge"))
        return med[better][metric] / med[worse][metric] if med[worse][metric] else 0.0

    ratio = {m: ratio_of(m) for m in med["vllm"]}
    return {"chunk_bytes": chunk_bytes, "num_chunks": num_chunks, "batch": batch,
            "rounds": rounds, "median": med, "ratio": ratio, "verified": verified}


def settle_heap(directory: str) -> None:
    """Run a small case of both tiers (untimed: what their first store, load and restart
    import or build lazily), then freeze the heap, as vLLM's engine freezes its own
    after start-up (see the module docstring)."""
    from vllm.utils.gc_utils import freeze_gc_heap

    where = os.path.join(directory, "settle")
    os.makedirs(where, exist_ok=True)
    run_case(where, 16 << 10, 8, 4, rounds=1)
    freeze_gc_heap()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvbridge.tools.bench.vllm_tiering",
        description="kvbridge's fs tier (KvbridgeFsTier, verify full) beside vLLM's own fs "
                    "tier, each a secondary tier of vLLM's TieringOffloadingManager, on the "
                    "same chunks and directory: store and load GB/s, lookup latency, time "
                    "to first byte after a restart; every load checked byte for byte. "
                    "Needs vLLM (the python of the venv `make test-vllm` builds).")
    parser.add_argument("--quick", action="store_true",
                        help="fewer chunks per case and one round (a smoke run)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per case (medians; default 3, --quick 1)")
    parser.add_argument("--dir", default=None, help="where the stores go (default: the "
                        "system temp dir; use the disk you offload to)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="print JSON (or write it to FILE)")
    args = parser.parse_args(argv)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    if rounds <= 0:
        parser.error("--rounds must be positive")
    if args.dir is not None and not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir}: no such directory")
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("kvbridge: vLLM is not importable here; run this with the python of the vLLM "
              "venv (`make setup-vllm` builds .venv-vllm)", file=sys.stderr)
        return 2
    rows = []
    with bench_workdir(args.dir, "kvbridge-tiering-") as work:
        settle_heap(work)
        for chunk_bytes, num_chunks in (QUICK_CASES if args.quick else CASES):
            for batch in BATCHES:
                print(f"tiering: {num_chunks} x {chunk_bytes >> 10} KiB, {batch} per job ...",
                      file=sys.stderr)
                case_dir = os.path.join(work, f"{chunk_bytes}-{batch}")
                os.makedirs(case_dir)
                rows.append(run_case(case_dir, chunk_bytes, num_chunks, batch, rounds,
                                     progress=lambda m: print("  " + m, file=sys.stderr)))
    if args.json is not None:
        write_json({"tiering_vs_vllm_fs": rows}, args.json)
    if args.json != "-":
        print(f"{'chunk':>8} {'job':>3} {'metric':>16} {'vLLM fs':>9} {'kvbridge':>9} "
              f"{'ratio':>6}   (ratio > 1: kvbridge better)")
        units = {"store": "GB/s", "load": "GB/s", "lookup_ms": "ms", "lookup_us": "us",
                 "lookup_sum_ms": "ms", "ttfb_ms": "ms"}
        for row in rows:
            chunk = f"{row['chunk_bytes'] >> 10}KiB"
            for metric, unit in units.items():
                m = row["median"]
                print(f"{chunk:>8} {row['batch']:>3} {metric + ' ' + unit:>16} "
                      f"{m['vllm'][metric]:>9.3f} {m['kvbridge'][metric]:>9.3f} "
                      f"{row['ratio'][metric]:>6.2f}")
        ok = all(r["verified"] for r in rows)
        print("every load verified byte for byte" if ok else "BYTES DIFFER")
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
