"""Side by side: kvbridge's fs tier and vLLM's own fs secondary tier on the same blocks.

Owns the benchmark only; it may not change either tier. Both tiers run in this
process, on the same primary memory (one page-aligned buffer of ``num_blocks``
blocks; vLLM's ``FileSystemTierManager`` sees it as its primary KV view, kvbridge's
``FsTier`` as per-block views), in jobs of ``batch_blocks`` blocks, into fresh
directories of the same file system. vLLM's tier is the real
``vllm.v1.kv_offload.tiering.fs.manager.FileSystemTierManager`` (its thread pool,
its C batch I/O when vLLM ships it, its file layout), given a minimal offloading
spec of the fields it reads. Per round each tier stores every block and loads it
back (order alternates per round; an untimed ``os.sync`` and a zeroed buffer
before every timed phase, so loads really refill memory); after each load every
byte is compared with what was stored. Medians over the rounds are reported, and
the ratio kvbridge / vLLM (> 1: kvbridge faster).

Each tier runs with its own defaults (threads, O_DIRECT probe; kvbridge verifies
every block with its digests, ``verify=full``, which vLLM's tier does not do), and
kvbridge also with verification off, so the report shows what the digests cost.

Run inside the vLLM venv (``make test-vllm`` builds it)::

    .venv-vllm/bin/python -m kvbridge.tools.bench.vllm_fs --json
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvbridge.layouts.digests import DigestMode, VerifyPolicy
from kvbridge.offload.cpu import CpuTier
from kvbridge.offload.fs import DEFAULT_READ_THREADS, DEFAULT_WRITE_THREADS, FsTier
from kvbridge.offload.runner import TierRunner
from kvbridge.offload.testing import bench_workdir, block_content
from kvbridge.tools.bench.render import write_json
from kvbridge.tools.bench.rows import parse_size

GB = 1e9
#: the tiers compared: name -> kvbridge verify mode (None: vLLM's tier)
TIERS: dict[str, str | None] = {"vllm": None, "kvbridge": "full", "kvbridge_verify_off": "off"}


def _wait_jobs(tier: str, finished: Callable[[], Iterable[Any]], pending: set[int],
               wait: Callable[[], object], timeout_s: float) -> int:
    """Poll ``finished`` until no job of ``pending`` is left; returns the failed jobs."""
    failed = 0
    deadline = time.monotonic() + timeout_s
    while pending:
        for result in finished():
            pending.discard(result.job_id)
            failed += not result.success
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tier}: {len(pending)} jobs unfinished")
            wait()
    return failed


def block_hash(tag: bytes, index: int) -> bytes:
    """Block ``index``'s hash in a round: 32 random-looking bytes, as vLLM's prefix-cache
    block hashes are. Both tiers name files by it (vLLM by its hex, in directories of
    its first five hex digits; kvbridge by a hash of it), so both spread their files as
    in a real store: readable keys (``b"vllm|0|00000001"``) put all of vLLM's files in
    one directory, which made its stores look 1.4-2x faster than they are."""
    return hashlib.sha256(tag + b"|%08d" % index).digest()


def _vllm_spec(block_bytes: int) -> Any:
    """The fields of an ``OffloadingSpec`` that vLLM's fs tier reads (FileMapper, events)."""
    config = SimpleNamespace(
        groups=[SimpleNamespace(tokens_per_block=16, layer_names=["bench.layer"])],
        parallel=SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0,
                                 is_parallelism_agnostic=True),
        canonical_layout=False, kv_cache_layout=None, replicated_layout=False,
        model=SimpleNamespace(name="kvbridge-bench", dtype="bfloat16"),
        cache=SimpleNamespace(tokens_per_hash=16))
    return SimpleNamespace(config=config, blocks_per_chunk=1,
                           kv_events_config=SimpleNamespace(enable_kv_cache_events=False))


class _VllmRunner:
    """vLLM's ``FileSystemTierManager`` over the shared primary buffer."""

    def __init__(self, root: str, primary: CpuTier, num_blocks: int, block_bytes: int,
                 timeout_s: float) -> None:
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key
        from vllm.v1.kv_offload.tiering.base import TransferJob
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
        self._transfer_job = TransferJob
        self._make_key = make_offload_key
        self._ctx = ReqContext(req_id="bench")
        array = np.frombuffer(primary.buffer, dtype=np.uint8).reshape(num_blocks, block_bytes)
        self._view = array.data        # a (num_blocks, block_bytes) memoryview: strides[0] is the block
        self.tier = FileSystemTierManager(_vllm_spec(block_bytes), self._view, "fs", root)
        self.o_direct = bool(getattr(self.tier, "_use_o_direct", False))
        self._timeout_s = timeout_s
        self._job_id = 0

    def run(self, kind: str, tag: bytes, batches: list[list[int]]) -> int:
        """Store or load every batch as one job each; returns the failed jobs."""
        pending = set()
        for batch in batches:
            self._job_id += 1
            keys = [self._make_key(block_hash(tag, i), 0) for i in batch]
            job = self._transfer_job(job_id=self._job_id, keys=keys,
                                     chunk_ids=np.asarray(batch, dtype=np.int64),
                                     is_promotion=kind == "load", req_context=self._ctx)
            (self.tier.submit_store if kind == "store" else self.tier.submit_load)(job)
            pending.add(self._job_id)
        return _wait_jobs("vLLM fs tier", self.tier.get_finished_jobs, pending,
                          lambda: time.sleep(0.0002), self._timeout_s)

    def close(self) -> None:
        self.tier.shutdown()
        self._view.release()


class _KvbridgeRunner:
    """kvbridge's ``FsTier`` (its defaults) over the same primary buffer."""

    def __init__(self, root: str, primary: CpuTier, num_blocks: int, block_bytes: int,
                 mode: str, num_layers: int, timeout_s: float) -> None:
        fs = FsTier(root, block_bytes, "be7c4be7c4be7c4b",
                    verify=VerifyPolicy(DigestMode(mode)), num_layers=num_layers)
        self.tier = TierRunner(fs, read_threads=DEFAULT_READ_THREADS,
                               write_threads=DEFAULT_WRITE_THREADS)
        self.tier.attach_primary(primary.buffer)   # as the offload manager does
        self.o_direct = fs.o_direct
        self._buffers = [[primary.view(i)] for i in range(num_blocks)]
        self._timeout_s = timeout_s
        self._job_id = 0

    def run(self, kind: str, tag: bytes, batches: list[list[int]]) -> int:
        submit = self.tier.submit_store if kind == "store" else self.tier.submit_load
        pending = set()
        for batch in batches:
            self._job_id += 1
            submit(self._job_id, [block_hash(tag, i) for i in batch],
                   [self._buffers[i] for i in batch])
            pending.add(self._job_id)
        return _wait_jobs("kvbridge fs tier", self.tier.get_finished_jobs, pending,
                          lambda: self.tier.wait_for_finished(0.05), self._timeout_s)

    def close(self) -> None:
        self.tier.shutdown()


def run_fs_vs_vllm(directory: str | None = None, *, num_blocks: int = 128,
                   block_bytes: int = 256 << 10, batch_blocks: int = 8, rounds: int = 5,
                   num_layers: int = 32, timeout_s: float = 300.0,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Store and load the same blocks through both tiers; a JSON-able report."""
    if min(num_blocks, block_bytes, batch_blocks, rounds, num_layers) <= 0 \
            or block_bytes % 4096 or block_bytes % num_layers:
        raise ValueError("num_blocks, block_bytes, batch_blocks, rounds and num_layers must "
                         "be positive; block_bytes a multiple of 4096 and of num_layers")
    total = num_blocks * block_bytes
    samples: dict[str, dict[str, list[float]]] = {t: {"store": [], "load": []} for t in TIERS}
    failed = 0
    verified = True
    batches = [list(range(s, min(s + batch_blocks, num_blocks)))
               for s in range(0, num_blocks, batch_blocks)]
    with bench_workdir(directory, "kvbridge-fs-vs-vllm-") as work:
        primary = CpuTier(num_blocks, block_bytes)
        seed = block_content(b"fs-vs-vllm", block_bytes)
        for i in range(num_blocks):
            view = primary.view(i)
            view[:] = seed
            view[:8] = i.to_bytes(8, "little")
        expected = bytes(primary.buffer)
        runners: dict[str, _VllmRunner | _KvbridgeRunner] = {}
        try:
            for name, mode in TIERS.items():
                root = os.path.join(work, name)
                os.makedirs(root)
                runners[name] = (_VllmRunner(root, primary, num_blocks, block_bytes, timeout_s)
                                 if mode is None else
                                 _KvbridgeRunner(root, primary, num_blocks, block_bytes, mode,
                                                 num_layers, timeout_s))
            names = list(TIERS)
            for r in range(rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    tag = b"%s|%d" % (name.encode(), r)
                    runner = runners[name]
                    os.sync()
                    primary.buffer[:] = expected
                    start = time.perf_counter()
                    failed += runner.run("store", tag, batches)
                    samples[name]["store"].append(time.perf_counter() - start)
                    os.sync()
                    primary.buffer[:] = bytes(total)      # loads must really refill memory
                    start = time.perf_counter()
                    failed += runner.run("load", tag, batches)
                    samples[name]["load"].append(time.perf_counter() - start)
                    verified = verified and bytes(primary.buffer) == expected
                if progress is not None:
                    progress(f"round {r + 1}/{rounds} done")
            o_direct = {name: runner.o_direct for name, runner in runners.items()}
        finally:
            for runner in runners.values():
                runner.close()
            primary.buffer[:] = expected
            primary.close()

    def gbps(seconds: float) -> float:
        return round(total / seconds / GB, 3) if seconds > 0 else 0.0

    med = {t: {op: statistics.median(v) for op, v in by.items()} for t, by in samples.items()}
    ratio = {t: {op: round(med["vllm"][op] / med[t][op], 3) for op in ("store", "load")}
             for t in TIERS if t != "vllm"}
    return {
        "num_blocks": num_blocks, "block_bytes": block_bytes, "batch_blocks": batch_blocks,
        "rounds": rounds, "num_layers": num_layers, "bytes": total, "o_direct": o_direct,
        "gbps": {t: {op: gbps(s) for op, s in by.items()} for t, by in med.items()},
        "rounds_gbps": {t: {op: [gbps(s) for s in v] for op, v in by.items()}
                        for t, by in samples.items()},
        # > 1: kvbridge faster than vLLM's fs tier on the same blocks
        "ratio_of_vllm": ratio,
        "failed_jobs": failed, "verified": verified,
    }


def _pattern(text: str) -> tuple[int, int]:
    num, _, size = text.lower().partition("x")
    try:
        return int(num), parse_size(size)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected NUMxSIZE such as 128x256KiB, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvbridge.tools.bench.vllm_fs",
        description="kvbridge's fs tier against vLLM's own fs secondary tier "
                    "(vllm.v1.kv_offload.tiering.fs), storing and loading the same blocks "
                    "in the same run; every load checked byte for byte. Needs vLLM "
                    "(run it with the python of the venv `make test-vllm` builds).")
    parser.add_argument("--pattern", type=_pattern, action="append",
                        help="blocks x block size (repeatable; default 128x256KiB and "
                             "32x2MiB)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (medians; default 5)")
    parser.add_argument("--batch", type=int, default=8, help="blocks per job (default 8)")
    parser.add_argument("--layers", type=int, default=32,
                        help="layer digests per block on kvbridge's side (default 32)")
    parser.add_argument("--dir", default=None, help="where the temp stores go (default: "
                        "the system temp dir; use the disk you offload to)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="print JSON (or write it to FILE)")
    args = parser.parse_args(argv)
    if args.rounds <= 0 or args.batch <= 0 or args.layers <= 0:
        parser.error("--rounds, --batch and --layers must be positive")
    if args.dir is not None and not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir}: no such directory")
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("kvbridge: vLLM is not importable here; run this with the python of the vLLM "
              "venv (`make setup-vllm` builds .venv-vllm)", file=sys.stderr)
        return 2
    patterns = args.pattern or [(128, 256 << 10), (32, 2 << 20)]
    reports = []
    for num, size in patterns:
        print(f"fs vs vLLM: {num} x {size >> 10} KiB ...", file=sys.stderr)
        reports.append(run_fs_vs_vllm(args.dir, num_blocks=num, block_bytes=size,
                                      batch_blocks=args.batch, rounds=args.rounds,
                                      num_layers=args.layers,
                                      progress=lambda m: print("  " + m, file=sys.stderr)))
    if args.json is not None:
        write_json({"fs_vs_vllm": reports}, args.json)
    if args.json != "-":
        print(f"{'case':>12} {'op':>5} {'vLLM':>7} {'kvbridge':>9} {'ratio':>6} "
              f"{'verify off':>10} {'ratio':>6}   (GB/s; ratio = kvbridge / vLLM)")
        for rep in reports:
            case = f"{rep['num_blocks']}x{rep['block_bytes'] >> 10}KiB"
            for op in ("store", "load"):
                g = rep["gbps"]
                print(f"{case:>12} {op:>5} {g['vllm'][op]:>7.3f} {g['kvbridge'][op]:>9.3f} "
                      f"{rep['ratio_of_vllm']['kvbridge'][op]:>6.2f} "
                      f"{g['kvbridge_verify_off'][op]:>10.3f} "
                      f"{rep['ratio_of_vllm']['kvbridge_verify_off'][op]:>6.2f}")
        ok = all(r["verified"] and not r["failed_jobs"] for r in reports)
        print("every load verified byte for byte" if ok else "LOADS FAILED OR BYTES DIFFER")
    return 0 if all(r["verified"] and not r["failed_jobs"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
