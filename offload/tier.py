"""The secondary-tier interface: async lookup, batch jobs, self-correction.

A secondary tier (``fs``, ``obj``) implements three blocking functions that
run on its own threads — ``probe_batch``, ``load_batch``, ``store_batch`` —
and inherits the scheduler-side bookkeeping from ``SecondaryTier``:

* lookups go through the tier's own ``LookupCache`` (probes batched, one batch
  per ``step``; results applied in ``drain_results`` on the scheduler thread);
* ``submit_load``/``submit_store`` run jobs on separate read and write pools,
  so reads (promotions, which a request waits for) are never queued behind
  writes (cascades, which nobody waits for);
* ``get_finished_jobs`` (scheduler thread) reports each job once and, for a
  failed load, flips exactly the failed keys to a miss with ``mark_miss`` —
  the tier corrects its own cache from its own jobs; the manager has no
  failure callback. The leading keys loaded before the failure are reported
  as ``successful_keys`` and are kept.

Buffers (``BlockBuffers``): for each key, the list of memoryviews its block is
read into or written from, in order; their lengths add up to ``block_bytes``.
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from kvbridge.events.schema import Locality, Medium
from kvbridge.offload.async_lookup import LookupCache, ProbeRunner
from kvbridge.offload.types import (
    BatchIOError,
    EventKind,
    JobKind,
    JobResult,
    OffloadError,
    OffloadEvent,
    OffloadKey,
    RequestId,
    ShortReadError,
    TierStats,
)

logger = logging.getLogger(__name__)

#: per key, the views its block bytes are read into / written from
BlockBuffers = Sequence[Sequence[memoryview]]


@dataclass(frozen=True)
class _Done:
    job_id: int
    kind: JobKind
    ok: bool
    num_succeeded: int
    deleted_key: OffloadKey | None = None


class SecondaryTier(abc.ABC):
    """Base of every secondary tier; subclasses implement the three blocking calls."""

    medium: str = Medium.STORAGE.value
    locality: str = Locality.LOCAL.value

    def __init__(self, name: str, block_bytes: int, read_threads: int = 2, write_threads: int = 1
                 ) -> None:
        if block_bytes <= 0:
            raise OffloadError("block_bytes", f"expected a positive size, got {block_bytes}")
        if read_threads <= 0 or write_threads <= 0:
            raise OffloadError("threads", "expected at least one read and one write thread")
        self.name = name
        self.block_bytes = block_bytes
        self.cache = LookupCache()
        self.stats = TierStats()
        self._stats_lock = threading.Lock()
        self._done: queue.SimpleQueue[_Done] = queue.SimpleQueue()
        self._done_event = threading.Event()
        self._job_keys: dict[int, tuple[JobKind, tuple[OffloadKey, ...]]] = {}
        self._events: list[OffloadEvent] = []
        self._read_pool = ThreadPoolExecutor(read_threads, thread_name_prefix=f"kvbridge-{name}-rd")
        self._write_pool = ThreadPoolExecutor(write_threads,
                                              thread_name_prefix=f"kvbridge-{name}-wr")
        self._runner = ProbeRunner(self._probe_counted, name, on_result=self._done_event.set)
        self._closed = False

    # -- blocking calls, run on the tier's threads --------------------------
    @abc.abstractmethod
    def probe_batch(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """Whether each key is stored (may block on I/O; background thread)."""

    @abc.abstractmethod
    def load_batch(self, keys: Sequence[OffloadKey], buffers: BlockBuffers) -> None:
        """Fill ``buffers`` from the stored blocks, in key order.

        Raises ``BatchIOError(num_succeeded, cause)`` at the first failing key;
        the keys before it were loaded completely.
        """

    @abc.abstractmethod
    def store_batch(self, keys: Sequence[OffloadKey], buffers: BlockBuffers) -> None:
        """Store ``buffers`` under ``keys`` (``BatchIOError`` as for loads)."""

    def attach_primary(self, buffer: memoryview) -> None:  # noqa: B027 (optional hook)
        """The primary tier's slot memory (every buffer a job gets lies in it).

        Called once by the manager; a tier that registers memory for zero-copy
        transfers (obj) registers it here and unregisters it at shutdown.
        """

    # -- scheduler thread ---------------------------------------------------
    def lookup(self, request_id: RequestId, key: OffloadKey) -> bool | None:
        """Cached verdict (None: probe pending). Never blocks."""
        return self.cache.lookup(request_id, key)

    def step(self) -> None:
        """Send this step's probe batch (at most one) to the prober."""
        batch = self.cache.take_batch()
        if batch:
            self._runner.submit(batch)

    def drain_results(self) -> None:
        """Apply finished probes to the cache (scheduler thread only)."""
        self.cache.apply_results(self._runner.drain())

    def release_request(self, request_id: RequestId) -> None:
        self.cache.release(request_id)

    def submit_load(self, job_id: int, keys: Sequence[OffloadKey], buffers: BlockBuffers) -> None:
        self._submit(JobKind.LOAD, job_id, keys, buffers)

    def submit_store(self, job_id: int, keys: Sequence[OffloadKey], buffers: BlockBuffers) -> None:
        self._submit(JobKind.STORE, job_id, keys, buffers)

    def _submit(self, kind: JobKind, job_id: int, keys: Sequence[OffloadKey],
                buffers: BlockBuffers) -> None:
        if self._closed:
            raise OffloadError("tier", f"{self.name} is shut down")
        if len(keys) != len(buffers):
            raise OffloadError("buffers", f"expected {len(keys)} buffer lists, got {len(buffers)}")
        assert job_id not in self._job_keys, "job id reused while in flight"
        self._job_keys[job_id] = (kind, tuple(keys))
        pool = self._read_pool if kind is JobKind.LOAD else self._write_pool
        pool.submit(self._run_job, kind, job_id, tuple(keys), buffers)

    def _run_job(self, kind: JobKind, job_id: int, keys: tuple[OffloadKey, ...],
                 buffers: BlockBuffers) -> None:
        """Worker thread: run the batch and post exactly one completion record."""
        done = _Done(job_id, kind, True, len(keys))
        try:
            if kind is JobKind.LOAD:
                self.load_batch(keys, buffers)
            else:
                self.store_batch(keys, buffers)
        except BatchIOError as exc:
            deleted = None
            if isinstance(exc.cause, ShortReadError) and getattr(exc.cause, "deleted", False):
                deleted = keys[exc.num_succeeded]
            logger.warning("%s %s job %d failed at block %d of %d: %s", self.name, kind.value,
                           job_id, exc.num_succeeded, len(keys), exc.cause)
            done = _Done(job_id, kind, False, exc.num_succeeded, deleted)
        except BaseException as exc:  # a bug in a tier must still finish the job
            logger.exception("%s %s job %d failed: %s", self.name, kind.value, job_id, exc)
            done = _Done(job_id, kind, False, 0)
        self._done.put(done)
        self._done_event.set()

    def wait_for_finished(self, timeout_s: float) -> bool:
        """Block until a job or probe may have finished since the last ``get_finished_jobs``
        (tests, benchmarks, shutdown; the scheduler never waits). True if one did."""
        return self._done_event.wait(timeout_s)

    def get_finished_jobs(self) -> list[JobResult]:
        """Finished jobs, each once; failed loads correct this tier's lookup cache."""
        self._done_event.clear()   # before draining: a job finishing now sets it again
        results: list[JobResult] = []
        while True:
            try:
                done = self._done.get_nowait()
            except queue.Empty:
                return results
            kind, keys = self._job_keys.pop(done.job_id)
            ok_keys = keys[:done.num_succeeded]
            failed = keys[done.num_succeeded:]
            if kind is JobKind.LOAD:
                self.stats.loads_ok += len(ok_keys)
                if not done.ok:
                    # the request recomputes these; no re-probe while it references them
                    self.cache.mark_miss(failed)
                    self.stats.loads_failed += len(failed)
                    self.stats.load_jobs_failed += 1
            else:
                self.stats.stores_ok += len(ok_keys)
                self.stats.stores_failed += len(failed)
                if ok_keys:
                    self._events.append(OffloadEvent(EventKind.STORED, ok_keys, self.name,
                                                     self.medium, self.locality))
            if done.deleted_key is not None:
                self.stats.files_deleted += 1
                self._events.append(OffloadEvent(EventKind.REMOVED, (done.deleted_key,),
                                                 self.name, self.medium, self.locality))
            results.append(JobResult(done.job_id, done.ok,
                                     ok_keys if not done.ok else keys))

    @property
    def num_jobs_in_flight(self) -> int:
        return len(self._job_keys)

    @property
    def num_probes_in_flight(self) -> int:
        """Probe batches sent whose results were not applied yet."""
        return self._runner.batches_in_flight

    def take_events(self) -> list[OffloadEvent]:
        events, self._events = self._events, []
        return events

    def _probe_counted(self, keys: Sequence[OffloadKey]) -> list[bool]:
        verdicts = self.probe_batch(keys)
        with self._stats_lock:
            self.stats.probes += len(keys)
            self.stats.probe_batches += 1
        return verdicts

    def stats_snapshot(self) -> dict[str, object]:
        """The counters as a dict, read under the lock the I/O threads count under."""
        with self._stats_lock:
            return asdict(self.stats)

    def count(self, name: str, n: int = 1) -> None:
        """Thread-safe counter in ``stats.extra`` (for I/O threads)."""
        with self._stats_lock:
            self.stats.extra[name] = self.stats.extra.get(name, 0) + n

    def shutdown(self) -> None:
        """Stop the prober and wait for in-flight jobs (their buffers stay valid until then)."""
        if self._closed:
            return
        self._closed = True
        self._runner.close()
        self._read_pool.shutdown(wait=True)
        self._write_pool.shutdown(wait=True)
