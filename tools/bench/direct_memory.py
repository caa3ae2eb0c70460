"""Where O_DIRECT I/O lands: the same writes and reads with four kinds of host memory.

Owns the benchmark only; it may not change a tier. A direct read or write hands the
disk one segment per physically contiguous run of the buffer's pages, so the same
system calls on the same files can move at different speeds depending on what memory
the buffer is. The kinds, each ``files * size`` bytes:

* ``shared``: ``mmap.mmap(-1, n)``, Python's default anonymous mapping (MAP_SHARED:
  shmem pages, never transparent huge pages);
* ``shm``: a ``/dev/shm`` file mapped MAP_SHARED and populated up front (what vLLM's
  CPU tier is, and kvbridge's CPU tier when workers share it by path);
* ``private``: MAP_PRIVATE anonymous memory, 4 KiB pages;
* ``kvbridge``: :class:`~kvbridge.offload.private_memory.PrivateMemory` (MAP_PRIVATE,
  ``MADV_HUGEPAGE``, huge page aligned): the vLLM tiers' arena and kvbridge's own CPU
  slots.

Per round, in rotating order, each kind writes ``files`` new files of ``size`` bytes
from its buffer (``threads`` threads, one ``O_DIRECT`` write each), then, with its
buffer zeroed, reads them back (one ``O_DIRECT`` ``preadv`` each) and every byte is
compared with what was written. An untimed round first touches every buffer, as a
server's memory is after its first requests; ``os.sync`` before each timed phase.
Medians over rounds; ratio = kind / ``shared`` (> 1: faster than Python's default).

    python -m kvbridge.tools.bench.direct_memory --dir /mnt/nvme
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvbridge.offload.fs_io import probe_o_direct
from kvbridge.offload.private_memory import PrivateMemory
from kvbridge.offload.testing import bench_workdir
from kvbridge.tools.bench.render import write_json
from kvbridge.tools.bench.rows import parse_size

GB = 1e9
KINDS = ("shared", "shm", "private", "kvbridge")
#: at most this much memory per kind (the bench holds every kind's buffer at once)
MAX_KIND_BYTES = 4 << 30


class _Buffer:
    """One kind's ``nbytes`` (``view``) and how to let it go."""

    def __init__(self, view: memoryview, close: Callable[[], object],
                 huge: bool = False) -> None:
        self.view = view
        self._close = close
        #: advised for (and so, where the kernel has them, on) transparent huge pages
        self.huge = huge

    def close(self) -> None:
        try:
            self.view.release()
            self._close()
        except BufferError:   # an array of it is still out (an error mid-round): the GC
            pass


def _shared(nbytes: int) -> _Buffer:
    mapping = mmap.mmap(-1, nbytes)
    return _Buffer(memoryview(mapping), mapping.close)


def _shm(nbytes: int) -> _Buffer:
    path = f"/dev/shm/kvbridge-direct-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
    finally:
        os.close(fd)
        os.unlink(path)
    populate = getattr(mmap, "MADV_POPULATE_WRITE", 23)
    try:
        mapping.madvise(populate)
    except OSError:   # before Linux 5.14: touch it instead
        mapping[:] = bytes(nbytes)
    return _Buffer(memoryview(mapping), mapping.close)


def _private(nbytes: int) -> _Buffer:
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20))
    return _Buffer(memoryview(mapping), mapping.close)


def _kvbridge(nbytes: int) -> _Buffer:
    memory = PrivateMemory(nbytes)
    return _Buffer(memory.view[:], memory.close, memory.huge)


MAKERS: dict[str, Callable[[int], _Buffer]] = {
    "shared": _shared, "shm": _shm, "private": _private, "kvbridge": _kvbridge}


def _run(jobs: int, threads: int, one: Callable[[int], None]) -> tuple[float, float]:
    """``one(i)`` for every i < ``jobs`` on ``threads`` threads: (seconds, CPU seconds of
    the process). The first error of any thread is raised."""
    lock = threading.Lock()
    state = {"next": 0}
    errors: list[BaseException] = []

    def worker() -> None:
        while not errors:
            with lock:
                i = state["next"]
                state["next"] += 1
            if i >= jobs:
                return
            try:
                one(i)
            except BaseException as exc:   # reported by the caller, not lost in a thread
                errors.append(exc)

    pool = [threading.Thread(target=worker, name=f"direct-{n}") for n in range(threads)]
    cpu = time.process_time()
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return elapsed, time.process_time() - cpu


def _write(path: str, view: memoryview) -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        done = 0
        while done < len(view):
            n = os.pwrite(fd, view[done:], done)
            if n <= 0:
                raise OSError(f"{path}: a write made no progress at {done} bytes")
            done += n
    finally:
        os.close(fd)


def _read(path: str, view: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        n = os.preadv(fd, [view], 0)
        if n != len(view):
            raise OSError(f"{path}: read {n} of {len(view)} bytes")
    finally:
        os.close(fd)


@contextmanager
def _buffers(nbytes: int) -> Iterator[dict[str, _Buffer]]:
    made: dict[str, _Buffer] = {}
    try:
        for kind in KINDS:
            made[kind] = MAKERS[kind](nbytes)
        yield made
    finally:
        for buffer in made.values():
            buffer.close()


def disk_stat_path(directory: str) -> str | None:
    """The statistics file of the block device holding ``directory``
    (``/sys/dev/block/MAJOR:MINOR/stat``), or None (tmpfs, overlay, NFS: no such device)."""
    dev = os.stat(directory).st_dev
    path = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"
    return path if os.path.exists(path) else None


def _completed(stat_path: str | None) -> tuple[int, int] | None:
    """(reads, writes) the device completed so far (its requests, every process's)."""
    if stat_path is None:
        return None
    try:
        with open(stat_path) as f:
            fields = f.read().split()
        return int(fields[0]), int(fields[4])
    except (OSError, ValueError, IndexError):
        return None


def _one_kind(where: str, view: memoryview, pattern: np.ndarray, files: int, size: int,
              threads: int, stat_path: str | None) -> tuple[dict[str, float], bool]:
    """``files`` files written from ``view`` into a new directory ``where``, read back
    into it zeroed, compared with ``pattern`` and removed: the figures (GB/s, CPU per
    file, and disk requests per file where the device says), and whether every byte
    came back."""
    array = np.frombuffer(view, dtype=np.uint8)
    array[:] = pattern
    os.makedirs(where)
    paths = [os.path.join(where, f"{i}.bin") for i in range(files)]
    figures: dict[str, float] = {}
    try:
        for op in ("write", "read"):
            if op == "read":
                array[:] = 0                   # reads must really refill it
            os.sync()
            one: Callable[[str, memoryview], None] = _write if op == "write" else _read

            def each(i: int, one: Callable[[str, memoryview], None] = one) -> None:
                one(paths[i], view[i * size:(i + 1) * size])

            before = _completed(stat_path)
            seconds, cpu = _run(files, threads, each)
            after = _completed(stat_path)
            figures[op] = files * size / seconds / GB
            figures[f"{op}_cpu_us"] = cpu / files * 1e6
            if before is not None and after is not None:
                column = 0 if op == "read" else 1
                figures[f"{op}_requests"] = (after[column] - before[column]) / files
        same = bool(np.array_equal(array, pattern))
    finally:
        del array
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
        os.rmdir(where)
    return figures, same


def run(directory: str, files: int, size: int, threads: int, rounds: int,
        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every kind, ``rounds`` timed rounds after one untimed; a JSON-able report.
    ``*_requests``: the disk's requests per file (absent where the directory is on no
    block device; every process's requests count, so a busy disk inflates them)."""
    total = files * size
    pattern = np.random.default_rng(20261205).integers(0, 256, total, dtype=np.uint8)
    stat_path = disk_stat_path(directory)
    samples: dict[str, dict[str, list[float]]] = {k: {} for k in KINDS}
    verified = True
    with _buffers(total) as buffers:
        huge = buffers["kvbridge"].huge
        for r in range(rounds + 1):
            order = KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]
            for kind in order:
                figures, same = _one_kind(os.path.join(directory, f"{kind}-{r}"),
                                          buffers[kind].view, pattern, files, size,
                                          threads, stat_path)
                verified = verified and same
                if r == 0:
                    continue                   # untimed: every buffer touched once
                for metric, value in figures.items():
                    samples[kind].setdefault(metric, []).append(value)
            if progress is not None and r:
                progress(f"round {r}/{rounds}")
    median = {k: {m: statistics.median(v) for m, v in by.items()} for k, by in samples.items()}
    ratio = {k: {op: median[k][op] / median["shared"][op] for op in ("write", "read")}
             for k in KINDS}
    return {"files": files, "size": size, "threads": threads, "rounds": rounds,
            "median": median, "ratio": ratio, "verified": verified,
            "huge_pages": huge, "disk_stat": stat_path}


def _size(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size like 2M or 256K") from None
    if value <= 0 or value % mmap.PAGESIZE:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive multiple of "
                                         f"{mmap.PAGESIZE} bytes (O_DIRECT needs it)")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvbridge.tools.bench.direct_memory",
        description="The same O_DIRECT writes and reads of block files, landing in four "
                    "kinds of host memory: Python's default shared anonymous mmap, a "
                    "populated /dev/shm mapping, private memory, and kvbridge's "
                    "PrivateMemory (private, huge pages). GB/s, CPU and the disk's "
                    "requests per file, every read checked byte for byte; ratio against "
                    "the shared mmap.")
    parser.add_argument("--files", type=int, default=64, help="files per round (default 64)")
    parser.add_argument("--size", type=_size, default=2 << 20,
                        help="bytes per file, a multiple of 4 KiB (default 2M)")
    parser.add_argument("--threads", type=int, default=32,
                        help="I/O threads, each one file at a time (default 32)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--dir", default=None, help="where the files go (default: the "
                        "system temp dir; use the disk you offload to)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="print JSON (or write it to FILE)")
    args = parser.parse_args(argv)
    for name in ("files", "threads", "rounds"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive")
    if args.files * args.size > MAX_KIND_BYTES:
        parser.error(f"--files x --size is {args.files * args.size} bytes; at most "
                     f"{MAX_KIND_BYTES} (four buffers of it are held at once)")
    if args.dir is not None and not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir}: no such directory")
    with bench_workdir(args.dir, "kvbridge-direct-") as work:
        if not probe_o_direct(work):
            print(f"kvbridge: O_DIRECT is not supported in {os.path.dirname(work)} (tmpfs "
                  f"and overlayfs refuse it); pass --dir on a disk", file=sys.stderr)
            return 2
        print(f"direct I/O: {args.files} x {args.size >> 10} KiB, {args.threads} threads, "
              f"{args.rounds} rounds ...", file=sys.stderr)
        report = run(work, args.files, args.size, args.threads, args.rounds,
                     progress=lambda m: print("  " + m, file=sys.stderr))
    if args.json is not None:
        write_json({"direct_memory": report}, args.json)
    if args.json != "-":
        def requests(m: dict[str, float], op: str) -> str:
            value = m.get(f"{op}_requests")
            return "-" if value is None else f"{value:.1f}"

        print(f"{'memory':>9} {'write GB/s':>10} {'ratio':>6} {'CPU us':>7} {'reqs':>5} "
              f"{'read GB/s':>10} {'ratio':>6} {'CPU us':>7} {'reqs':>5}   (ratio: against "
              f"shared; reqs: disk requests per file)")
        for kind in KINDS:
            m, r = report["median"][kind], report["ratio"][kind]
            print(f"{kind:>9} {m['write']:>10.2f} {r['write']:>6.2f} {m['write_cpu_us']:>7.0f} "
                  f"{requests(m, 'write'):>5} {m['read']:>10.2f} {r['read']:>6.2f} "
                  f"{m['read_cpu_us']:>7.0f} {requests(m, 'read'):>5}")
        print(f"kvbridge's memory on huge pages: {'yes' if report['huge_pages'] else 'no'}; "
              + ("every read verified byte for byte" if report["verified"]
                 else "BYTES DIFFER"))
    return 0 if report["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
