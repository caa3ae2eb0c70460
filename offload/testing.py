"""A content function, a bench's temp store and a small request simulator for tests,
benchmarks and demos.

``bench_workdir`` lives here, not with the benches in ``kvbridge.tools.bench``,
because the vLLM benches under ``integrations/`` use it too and may not import
``tools``.

``RequestSimulator`` drives an ``OffloadManager`` the way an engine's scheduler
and worker do, in one thread: lookup every step until the verdict is final,
copy hit blocks out of primary slots (and verify their bytes), "compute" the
rest (write ``block_content`` into slots), store, finish. It records what a
test needs to prove the failed-load rules: per request, the keys it loaded,
the keys it computed and the keys whose promotion failed while it waited.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvbridge.offload.manager import OffloadManager
from kvbridge.offload.types import OffloadError, OffloadKey


def block_content(key: OffloadKey, nbytes: int) -> bytes:
    """Deterministic bytes of the block of ``key`` (differs per key)."""
    return hashlib.shake_128(b"kvbridge-block-content:" + key).digest(nbytes)


@contextlib.contextmanager
def bench_workdir(directory: str | None,
                  prefix: str = "kvbridge-offload-bench-") -> Iterator[str]:
    """A temp directory under ``directory`` (None: the system's), removed afterwards."""
    if directory is not None and not os.path.isdir(directory):
        raise OffloadError(directory, "no such directory (the bench's temp store goes "
                                      "inside it)")
    path = tempfile.mkdtemp(prefix=prefix, dir=directory)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class SimRequest:
    request_id: str
    keys: tuple[OffloadKey, ...]
    lookups: int = 0
    loaded: list[OffloadKey] = field(default_factory=list)
    computed: list[OffloadKey] = field(default_factory=list)
    failed_loads: tuple[OffloadKey, ...] = ()
    mismatched_bytes: int = 0
    stuck: bool = False
    done: bool = False


@dataclass
class SimReport:
    requests: list[SimRequest]
    steps: int
    wall_s: float

    @property
    def finished(self) -> int:
        return sum(r.done and not r.stuck for r in self.requests)

    @property
    def stuck(self) -> int:
        return sum(r.stuck for r in self.requests)

    @property
    def mismatched_bytes(self) -> int:
        return sum(r.mismatched_bytes for r in self.requests)

    def summary(self) -> dict[str, object]:
        return {
            "requests": len(self.requests), "finished": self.finished, "stuck": self.stuck,
            "steps": self.steps, "wall_s": round(self.wall_s, 3),
            "loaded_blocks": sum(len(r.loaded) for r in self.requests),
            "computed_blocks": sum(len(r.computed) for r in self.requests),
            "failed_loads": sum(len(r.failed_loads) for r in self.requests),
            "mismatched_bytes": self.mismatched_bytes,
        }


class RequestSimulator:
    """Runs requests through ``manager`` with up to ``max_concurrent`` in flight."""

    def __init__(self, manager: OffloadManager, max_concurrent: int = 8,
                 max_lookups_per_request: int = 2000, max_steps: int = 1_000_000,
                 idle_sleep_s: float = 0.0002,
                 after_step: Callable[[OffloadManager], None] | None = None) -> None:
        self.manager = manager
        self.block_bytes = manager.primary.block_bytes
        self.max_concurrent = max_concurrent
        self.max_lookups = max_lookups_per_request
        self.max_steps = max_steps
        self.idle_sleep_s = idle_sleep_s
        self.after_step = after_step

    def run(self, workload: Sequence[tuple[str, Sequence[OffloadKey]]]) -> SimReport:
        start = time.perf_counter()
        requests = [SimRequest(rid, tuple(keys)) for rid, keys in workload]
        queue = list(reversed(requests))
        active: list[SimRequest] = []
        steps = 0
        while (queue or active) and steps < self.max_steps:
            while queue and len(active) < self.max_concurrent:
                active.append(queue.pop())
            progressed = False
            for req in list(active):
                if self._advance(req):
                    active.remove(req)
                    progressed = True
            self.manager.step()
            if self.after_step is not None:
                self.after_step(self.manager)
            steps += 1
            if not progressed and active:
                time.sleep(self.idle_sleep_s)  # let the tier threads run
        for req in active + queue:  # step budget exhausted: report, never hang
            req.stuck = True
        return SimReport(requests, steps, time.perf_counter() - start)

    def _advance(self, req: SimRequest) -> bool:
        """One scheduler step for ``req``; True when it finished."""
        manager = self.manager
        req.lookups += 1
        result = manager.lookup(req.request_id, req.keys)
        if not result.ready:
            if req.lookups >= self.max_lookups:
                req.stuck = True
                req.done = True
                manager.request_finished(req.request_id)
                return True
            return False
        n = result.num_blocks
        if n:
            spec = manager.prepare_load(req.request_id, req.keys[:n])
            for key, slot in zip(spec.keys, spec.slots, strict=True):
                got = bytes(manager.primary.view(slot))
                want = block_content(key, self.block_bytes)
                if got != want:
                    req.mismatched_bytes += sum(a != b for a, b in zip(got, want, strict=True))
                req.loaded.append(key)
            manager.complete_load(req.request_id, spec.keys)
        rest = req.keys[n:]
        req.computed.extend(rest)
        store = manager.prepare_store(req.request_id, rest)
        for key, slot in zip(store.keys, store.slots, strict=True):
            manager.primary.view(slot)[:] = block_content(key, self.block_bytes)
        manager.complete_store(store.keys)
        req.failed_loads = manager.failed_loads(req.request_id)
        manager.request_finished(req.request_id)
        req.done = True
        return True


def block_file_payload(path: str) -> bytes:
    """The block bytes of an fs-tier block file (format 2: after its header)."""
    from kvbridge.offload.fs_io import decode_block_header

    with open(path, "rb") as fh:
        data = fh.read()
    return data[decode_block_header(path, data).header_bytes:]
