"""The tier runner: a ``Tier``'s three calls, run for a scheduler that never blocks.

A :class:`TierRunner` composes one secondary tier (``kvbridge.offload.tier``) with
what every tier needs around it, and is what ``OffloadManager`` holds:

* lookups go through the runner's ``LookupCache`` (probes batched, one batch per
  ``step``; results applied in ``drain_results`` on the scheduler thread); with
  ``remember_present``, a key the runner's own jobs stored or loaded lately starts as
  a hit with no probe (a bounded memory, scheduler thread only);
* ``submit_load``/``submit_store`` run jobs on separate read and write pools, so
  reads (promotions, which a request waits for) are never queued behind writes
  (cascades, which nobody waits for). A job is cut into parts of at least the
  tier's ``load_part_blocks``/``store_part_blocks``, one per thread of its pool
  (fs, one file per block: one request's promotion uses every read thread); the
  parts' results make one record for the job (a failure stops its own part only:
  blocks of the other parts still load, and the engine uses the prefix before the
  first failure). With ``hold_below_bytes``, jobs too small to cut and smaller than
  that wait for the next ``step`` (or ``flush_jobs``), which hands them to at most one
  drainer per thread. Each drainer takes the burst's jobs until none is left, so a
  burst of hundreds of one-chunk jobs (vLLM submits one per request, all in one step)
  costs a pool hand-off per thread, not per job, and a job stuck in the kernel holds
  up only its own drainer (the others take the rest). With ``hold_loads``, every load
  waits for the step the same way (each part of a cut one too), whatever its size.
  Held jobs of a tier whose ``merge_load_blocks``/``merge_store_blocks`` allows it
  share a call, each job keeping its own outcome;
* ``get_finished_jobs`` (scheduler thread) reports each job once and, for a failed
  load, flips exactly the failed keys to a miss with ``mark_miss``: the runner
  corrects its own cache from its own jobs; the manager has no failure callback.
  The leading keys loaded before the failure are reported as ``successful_keys``
  and are kept; a block that failed its digests fails alone (the tier checks the
  rest of the batch: ``BatchIOError.skipped``); a stored copy the tier removed
  (``StoredCopyError.deleted``) is a REMOVED event, counted by its ``Removal``.

Digests: a store job carries each key's layer digests (``kvbridge.offload.blockdigest``;
the CPU slot's, taken when the engine's bytes landed there) and the tier stores them
with the block; a load checks the bytes that landed against the stored digests
(``verify`` policy) before the block counts as loaded, and reports the digests it read
(``JobResult.digests``) so the CPU slot keeps them. A mismatch is a failed load of
exactly that block, through the same path as any other.

Deadlines and fences (a stuck or abandoned call never wedges a request, and never
lets a buffer be reused while something may still write into it):

* a probe verdict still unknown ``probe_timeout_s`` after it was asked for is a miss
  (``LookupCache.expire``, in ``drain_results``); the manager turns a promotion still
  running ``load_timeout_s`` after it started into a miss for every request waiting
  on it;
* probes, reads and writes run on ``StuckAwarePool`` threads: a call stuck for longer
  than its deadline gets a replacement thread, so the jobs of other keys go on;
* a job is reported finished only once none of its I/O can still touch its buffers
  (the primary slots). A tier whose blocking call can be abandoned while still
  running (obj: a Mooncake get that timed out) raises ``BatchIOError`` with a
  ``fence``; the job's completion is then held back until ``fence()`` is True, so
  its slots stay WRITING (never handed to another key) until the abandoned call
  provably ended.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from kvbridge.offload.async_lookup import LookupCache, ProbeRunner
from kvbridge.offload.blockdigest import DigestMismatchError, LayerDigests
from kvbridge.offload.tier import BlockBuffers, Tier, join_buffers
from kvbridge.offload.types import (
    BatchIOError,
    EventKind,
    JobKind,
    JobResult,
    OffloadError,
    OffloadEvent,
    OffloadKey,
    Removal,
    RequestId,
    StoredCopyError,
    TierStats,
)
from kvbridge.offload.workers import StuckAwarePool

logger = logging.getLogger(__name__)

#: default deadlines of a tier (seconds): a lookup verdict, a promotion
DEFAULT_PROBE_TIMEOUT_S = 5.0
DEFAULT_LOAD_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class _Done:
    job_id: int
    kind: JobKind
    ok: bool
    #: positions (in the job's key order) of the keys that failed
    failed: frozenset[int] = frozenset()
    #: keys whose stored copy the tier removed, each with why
    deleted: tuple[tuple[OffloadKey, Removal], ...] = ()
    #: True once no I/O of the job can touch its buffers any more (None: already true)
    fence: Callable[[], bool] | None = None
    #: loads: per successful key, the digests stored with it (empty: the tier keeps none)
    digests: tuple[LayerDigests | None, ...] = ()
    #: keys whose bytes did not match their stored digests
    mismatches: int = 0


@dataclass(frozen=True)
class _Held:
    """A job run whole on one thread (too small to cut), waiting for its pool or a drainer."""

    kind: JobKind
    job_id: int
    keys: tuple[OffloadKey, ...]
    buffers: BlockBuffers
    digests: Sequence[LayerDigests | None] | None


@dataclass(frozen=True)
class _HeldPart:
    """A part of a cut job, waiting for a drainer (``hold_loads``); run as it is."""

    kind: JobKind
    run: Callable[[], None]


class _Gather:
    """The parts of a split job: when the last one ends, one record for the whole job.

    Block positions are the job's (a part's are offset by where it starts); the
    digests of the loaded keys stay in key order; the job's fence, if any part has
    one, passes when every part's has.
    """

    def __init__(self, job_id: int, kind: JobKind, num_parts: int, num_keys: int,
                 finish: Callable[[_Done], None]) -> None:
        #: keys of the whole job (what a part's log lines count against)
        self.num_keys = num_keys
        self._job_id = job_id
        self._kind = kind
        self._finish = finish
        self._lock = threading.Lock()
        self._left = num_parts
        self._parts: list[tuple[int, _Done]] = []

    def add(self, start: int, part: _Done) -> None:
        with self._lock:
            self._parts.append((start, part))
            self._left -= 1
            if self._left:
                return
            parts = sorted(self._parts, key=lambda p: p[0])
        fences = [p.fence for _, p in parts if p.fence is not None]
        self._finish(_Done(
            self._job_id, self._kind, all(p.ok for _, p in parts),
            frozenset(start + i for start, p in parts for i in p.failed),
            tuple(d for _, p in parts for d in p.deleted),
            None if not fences else (lambda: all(fence() for fence in fences)),
            tuple(d for _, p in parts for d in p.digests),
            sum(p.mismatches for _, p in parts)))


def _positive_seconds(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 \
            or not math.isfinite(value):
        raise OffloadError(name, f"expected a positive, finite number of seconds, got {value!r}")
    return float(value)


def split_job(num_keys: int, num_threads: int, min_part: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` parts a job of ``num_keys`` runs as: one per thread of its
    pool, each of at least ``min_part`` blocks where the job has that many; else one
    (``WHOLE_JOB``: always one)."""
    num_parts = min(num_threads, num_keys // max(1, min_part))
    if num_parts < 2:
        return [(0, num_keys)]
    size = -(-num_keys // num_parts)
    return [(start, min(start + size, num_keys)) for start in range(0, num_keys, size)]


class TierRunner:
    """One tier's calls on read, write and probe threads; see the module docstring.

    ``read_threads``/``write_threads``: the pools jobs run on; ``probe_timeout_s``: a
    verdict unknown this long after it was asked for is a miss; ``load_timeout_s``: a
    promotion running this long is a miss for the requests waiting on it (and the age
    at which a stuck I/O thread is replaced).
    """

    def __init__(self, tier: Tier, *, read_threads: int = 2, write_threads: int = 1,
                 probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
                 load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic,
                 remember_present: int = 0, hold_below_bytes: int = 0,
                 hold_loads: bool = False) -> None:
        if read_threads <= 0 or write_threads <= 0:
            raise OffloadError("threads", "expected at least one read and one write thread")
        #: the tier whose calls this runner runs
        self.tier = tier
        self.name = tier.name
        self.block_bytes = tier.block_bytes
        self.medium = tier.medium
        self.locality = tier.locality
        #: a verdict unknown this long after it was asked for is a miss
        self.probe_timeout_s = _positive_seconds("probe_timeout_s", probe_timeout_s)
        #: a promotion (load) running this long is a miss for the requests waiting on it
        self.load_timeout_s = _positive_seconds("load_timeout_s", load_timeout_s)
        self.clock = clock
        self.cache = LookupCache()
        if isinstance(remember_present, bool) or not isinstance(remember_present, int) \
                or remember_present < 0:
            raise OffloadError("remember_present", f"expected a count >= 0 of keys, got "
                               f"{remember_present!r}")
        #: keys this runner's own jobs stored or loaded, newest last, at most
        #: ``remember_present`` (scheduler thread only): a lookup of one starts as a hit
        #: without a probe. A copy removed behind the runner's back (another process,
        #: ``fsck``) is then a failed load that flips the key to a miss, as a probe that
        #: raced the removal would be; a failed load or a removal forgets the key.
        self.remember_present = remember_present
        self._present: OrderedDict[OffloadKey, None] = OrderedDict()
        #: jobs of fewer bytes wait for the next ``step``/``flush_jobs`` (see the module
        #: docstring; 0: none waits). Larger ones start at once: their I/O outweighs a
        #: pool hand-off, and a store held to the step's end would start later for nothing
        self.hold_below_bytes = hold_below_bytes
        #: every load (and each part of a cut one) waits for the step, whatever its size:
        #: for a scheduler that submits its loads just before the step (vLLM's tiering
        #: submits promotions right before its tiers' ``on_schedule_end``)
        self.hold_loads = hold_loads
        self._held: list[_Held | _HeldPart] = []
        self.stats = TierStats()
        self._stats_lock = threading.Lock()
        self._done: queue.SimpleQueue[_Done] = queue.SimpleQueue()
        self._done_event = threading.Event()
        self._job_keys: dict[int, tuple[JobKind, tuple[OffloadKey, ...]]] = {}
        #: completions held back until their fence says the I/O ended
        self._fenced: list[_Done] = []
        self._events: list[OffloadEvent] = []
        name = tier.name
        self._read_pool = StuckAwarePool(f"kvbridge-{name}-rd", read_threads,
                                         self.load_timeout_s, clock=clock)
        self._write_pool = StuckAwarePool(f"kvbridge-{name}-wr", write_threads,
                                          self.load_timeout_s, clock=clock)
        self._runner = ProbeRunner(self._probe_counted, name, on_result=self._done_event.set,
                                   stuck_after_s=self.probe_timeout_s, clock=clock)
        self._closed = False

    def attach_primary(self, buffer: memoryview) -> None:
        """The primary tier's slot memory, handed to the tier (called once by the manager)."""
        self.tier.attach_primary(buffer)

    # -- scheduler thread ---------------------------------------------------
    def lookup(self, request_id: RequestId, key: OffloadKey) -> bool | None:
        """Cached verdict (None: probe pending). Never blocks."""
        return self.cache.lookup(request_id, key, self.clock(), key in self._present)

    def _remember(self, keys: Sequence[OffloadKey]) -> None:
        if not self.remember_present:
            return
        present = self._present
        for key in keys:
            present[key] = None
            present.move_to_end(key)
        while len(present) > self.remember_present:
            present.popitem(last=False)

    def step(self) -> None:
        """Start held jobs; send this step's probe batch (at most one) to the prober;
        replace stuck threads."""
        self.flush_jobs()
        batch = self.cache.take_batch()
        if batch:
            self._runner.submit(batch)
        self._runner.check()
        self._read_pool.check()
        self._write_pool.check()

    def drain_results(self) -> None:
        """Apply finished probes to the cache; verdicts past the deadline become misses
        (scheduler thread only)."""
        self.cache.apply_results(self._runner.drain())
        if self.cache.num_unknown:
            expired = self.cache.expire(self.clock(), self.probe_timeout_s)
            if expired:
                logger.warning("%s: %d lookup(s) unanswered after %.1f s (probe_timeout_s): "
                               "treated as misses", self.name, len(expired),
                               self.probe_timeout_s)

    def release_request(self, request_id: RequestId) -> None:
        self.cache.release(request_id)

    def submit_load(self, job_id: int, keys: Sequence[OffloadKey], buffers: BlockBuffers) -> None:
        self._submit(JobKind.LOAD, job_id, keys, buffers)

    def submit_store(self, job_id: int, keys: Sequence[OffloadKey], buffers: BlockBuffers,
                     digests: Sequence[LayerDigests | None] | None = None) -> None:
        """Store ``buffers`` under ``keys``; ``digests``: per key, the layer digests of its
        bytes taken where they were written (None: the tier takes them, unless ``off``)."""
        if digests is not None and len(digests) != len(keys):
            raise OffloadError("digests", f"expected {len(keys)} digest entries, "
                               f"got {len(digests)}")
        self._submit(JobKind.STORE, job_id, keys, buffers, digests)

    def _submit(self, kind: JobKind, job_id: int, keys: Sequence[OffloadKey],
                buffers: BlockBuffers,
                digests: Sequence[LayerDigests | None] | None = None) -> None:
        if self._closed:
            raise OffloadError("tier", f"{self.name} is shut down")
        if len(keys) != len(buffers):
            raise OffloadError("buffers", f"expected {len(keys)} buffer lists, got {len(buffers)}")
        if job_id in self._job_keys:   # a real check: python -O keeps it
            raise OffloadError("job_id", f"job {job_id} is still in flight on {self.name}; "
                               "use a new id per job")
        self._job_keys[job_id] = (kind, tuple(keys))
        pool = self._read_pool if kind is JobKind.LOAD else self._write_pool
        frozen = tuple(keys)
        parts = split_job(len(frozen), pool.num_threads,
                          self.tier.load_part_blocks if kind is JobKind.LOAD
                          else self.tier.store_part_blocks)
        hold = self.hold_loads and kind is JobKind.LOAD
        if len(parts) == 1:
            held = _Held(kind, job_id, frozen, buffers, digests)
            if hold or len(frozen) * self.block_bytes < self.hold_below_bytes:
                self._held.append(held)
            else:
                pool.submit(functools.partial(self._run_held, held))
            return
        gather = _Gather(job_id, kind, len(parts), len(frozen), self._finish)
        for start, end in parts:
            part_keys = frozen[start:end]
            part_buffers = buffers[start:end]
            part_digests = None if digests is None else digests[start:end]
            run = functools.partial(self._run_part, gather, start, job_id, kind,
                                    part_keys, part_buffers, part_digests)
            if hold:
                self._held.append(_HeldPart(kind, run))
            else:
                pool.submit(run)

    def flush_jobs(self) -> None:
        """Hand the held jobs (and held parts) to their pools: per pool, at most one
        drainer per thread, each taking the next until none is left (scheduler thread)."""
        if not self._held:
            return
        held, self._held = self._held, []
        for kind, pool in ((JobKind.LOAD, self._read_pool), (JobKind.STORE, self._write_pool)):
            burst = deque(h for h in held if h.kind is kind)
            drainers = min(pool.num_threads, len(burst))
            # jobs the tier lets share a call: up to its block budget, and no more jobs
            # per call than leaves every drainer some (a short burst keeps its parallelism)
            budget = (self.tier.merge_load_blocks if kind is JobKind.LOAD
                      else self.tier.merge_store_blocks)
            most = -(-len(burst) // drainers) if drainers else 1
            for _ in range(drainers):
                pool.submit(functools.partial(self._drain_burst, burst, budget, most))

    def _drain_burst(self, burst: deque[_Held | _HeldPart], budget: int = 1,
                     most: int = 1) -> None:
        """Worker thread: run the burst's jobs and parts until another drainer or this one
        took the last (``popleft`` is atomic). With ``budget`` > 1, whole jobs of up to
        ``budget`` blocks in all (at most ``most`` jobs) share one tier call
        (``_run_joined``)."""
        while True:
            try:
                item = burst.popleft()
            except IndexError:
                return
            if isinstance(item, _HeldPart):
                item.run()
                continue
            group = [item]
            blocks = len(item.keys)
            while budget > 1 and len(group) < most:
                try:
                    held = burst.popleft()
                except IndexError:
                    break
                if isinstance(held, _HeldPart) or blocks + len(held.keys) > budget:
                    burst.appendleft(held)   # the next call's (or another drainer's)
                    break
                group.append(held)
                blocks += len(held.keys)
            if len(group) == 1:
                self._run_held(group[0])
            else:
                self._run_joined(group)

    def _run_joined(self, group: list[_Held]) -> None:
        """Worker thread: several jobs of one kind in one tier call; each job gets the
        record it would have had alone. Jobs after a failure that stopped the call (inside
        an earlier job) were never reached: they run in the next call, not failed, unless
        the failure may still touch their buffers (a fence: they fail with it)."""
        kind = group[0].kind
        while group:
            keys = tuple(k for h in group for k in h.keys)
            loaded: list[LayerDigests | None] = []
            try:
                if kind is JobKind.LOAD:
                    self.tier.load(keys, join_buffers([h.buffers for h in group]), loaded)
                else:
                    self.tier.store(keys, join_buffers([h.buffers for h in group]),
                                    [d for h in group
                                     for d in (h.digests or [None] * len(h.keys))])
                failure: BatchIOError | None = None
            except BatchIOError as exc:
                failure = exc
            except BaseException as exc:  # a bug in a tier must still finish the jobs
                logger.exception("%s %s jobs %s failed: %s", self.name, kind.value,
                                 [h.job_id for h in group], exc)
                for h in group:
                    self._finish(_Done(h.job_id, kind, False, frozenset(range(len(h.keys)))))
                return
            stop = len(keys) if failure is None else failure.num_succeeded
            skipped = {} if failure is None else failure.skipped
            digests = iter(loaded)   # loads: one per block that loaded, in order
            start = 0
            rest: list[_Held] = []
            for n, h in enumerate(group):
                end = start + len(h.keys)
                if failure is not None and stop < start and failure.fence is None:
                    rest = group[n:]     # never reached: the next call's
                    break
                own_skipped = {i - start: c for i, c in skipped.items() if start <= i < end}
                reached = min(max(stop - start, 0), len(h.keys))
                ok = [next(digests) for i in range(reached) if i not in own_skipped] \
                    if kind is JobKind.LOAD else []
                if failure is None or (reached == len(h.keys) and not own_skipped):
                    self._finish(_Done(h.job_id, kind, True, digests=tuple(ok)))
                else:
                    cause = failure.cause if reached < len(h.keys) else \
                        own_skipped[min(own_skipped)]
                    own = BatchIOError(reached, cause, failure.fence, own_skipped)
                    self._finish(self._failed(kind, h.job_id, h.keys, own, ok, 0,
                                              len(h.keys)))
                start = end
            group = rest

    def _run_held(self, held: _Held) -> None:
        """Worker thread: one whole job, posted when it ends."""
        self._finish(self._run_job(held.kind, held.job_id, held.keys, held.buffers,
                                   held.digests))

    def _run_part(self, gather: _Gather, start: int, job_id: int, kind: JobKind,
                  keys: tuple[OffloadKey, ...], buffers: BlockBuffers,
                  digests: Sequence[LayerDigests | None] | None) -> None:
        """Worker thread: one part of a split job; the last part to end posts the job."""
        gather.add(start, self._run_job(kind, job_id, keys, buffers, digests, start,
                                        gather.num_keys))

    def _finish(self, done: _Done) -> None:
        self._done.put(done)
        self._done_event.set()

    def _run_job(self, kind: JobKind, job_id: int, keys: tuple[OffloadKey, ...],
                 buffers: BlockBuffers,
                 digests: Sequence[LayerDigests | None] | None = None, offset: int = 0,
                 total: int | None = None) -> _Done:
        """Worker thread: run the batch (a job, or the part of a split job that starts at
        block ``offset`` of ``total``); its record, in the batch's own block positions."""
        total = len(keys) if total is None else total
        loaded: list[LayerDigests | None] = []
        try:
            if kind is JobKind.LOAD:
                self.tier.load(keys, buffers, loaded)
            else:
                self.tier.store(keys, buffers,
                                [None] * len(keys) if digests is None else digests)
            return _Done(job_id, kind, True, digests=tuple(loaded))
        except BatchIOError as exc:
            return self._failed(kind, job_id, keys, exc, loaded, offset, total)
        except BaseException as exc:  # a bug in a tier must still finish the job
            logger.exception("%s %s job %d failed: %s", self.name, kind.value, job_id, exc)
            return _Done(job_id, kind, False, frozenset(range(len(keys))))

    def _failed(self, kind: JobKind, job_id: int, keys: tuple[OffloadKey, ...],
                exc: BatchIOError, loaded: Sequence[LayerDigests | None], offset: int,
                total: int) -> _Done:
        """The record of a batch that raised ``exc`` (positions: the batch's own)."""
        stop = exc.num_succeeded
        causes: dict[int, BaseException] = dict(exc.skipped)
        if stop < len(keys):
            causes[stop] = exc.cause
        deleted = tuple((keys[i], cause.removal) for i, cause in sorted(causes.items())
                        if isinstance(cause, StoredCopyError) and cause.deleted)
        # one line per failed block: tier, job, block position, and the cause (its
        # path / key / layer for a digest mismatch)
        for i, cause in sorted(exc.skipped.items()):
            logger.warning("%s %s job %d: block %d of %d failed (the batch went on): %s",
                           self.name, kind.value, job_id, offset + i, total, cause)
        if stop < len(keys):
            logger.warning("%s %s job %d failed at block %d of %d: %s", self.name,
                           kind.value, job_id, offset + stop, total, exc.cause)
        failed = frozenset(exc.skipped) | frozenset(range(stop, len(keys)))
        return _Done(job_id, kind, False, failed, deleted, exc.fence, tuple(loaded),
                     sum(isinstance(c, DigestMismatchError) for c in causes.values()))

    def wait_for_finished(self, timeout_s: float) -> bool:
        """Block until a job or probe may have finished since the last ``get_finished_jobs``
        (tests, benchmarks, shutdown; the scheduler never waits). True if one did."""
        return self._done_event.wait(timeout_s)

    def get_finished_jobs(self) -> list[JobResult]:
        """Finished jobs, each once; failed loads correct this tier's lookup cache."""
        self._done_event.clear()   # before draining: a job finishing now sets it again
        ready: list[_Done] = []
        if self._fenced:
            still: list[_Done] = []
            for held in self._fenced:
                (ready if self._fence_passed(held) else still).append(held)
            self._fenced = still
        while True:
            try:
                done = self._done.get_nowait()
            except queue.Empty:
                break
            if done.fence is not None and not self._fence_passed(done):
                self.stats.jobs_fenced += 1
                logger.warning("%s %s job %d: an abandoned call may still touch its buffers; "
                               "its slots stay reserved until it provably ended", self.name,
                               done.kind.value, done.job_id)
                self._fenced.append(done)
                continue
            ready.append(done)
        results: list[JobResult] = []
        for done in ready:
            kind, keys = self._job_keys.pop(done.job_id)
            ok_keys = tuple(k for i, k in enumerate(keys) if i not in done.failed)
            failed = tuple(k for i, k in enumerate(keys) if i in done.failed)
            self._remember(ok_keys)
            if failed and kind is JobKind.LOAD:
                for key in failed:
                    self._present.pop(key, None)
            if kind is JobKind.LOAD:
                self.stats.loads_ok += len(ok_keys)
                self.stats.digest_mismatches += done.mismatches
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
            for deleted_key, reason in done.deleted:
                self._present.pop(deleted_key, None)
                if reason is Removal.QUARANTINE:
                    self.stats.files_quarantined += 1
                else:
                    self.stats.files_deleted += 1
                self._events.append(OffloadEvent(EventKind.REMOVED, (deleted_key,),
                                                 self.name, self.medium, self.locality))
            results.append(JobResult(done.job_id, done.ok,
                                     ok_keys if not done.ok else keys, done.digests))
        return results

    def _fence_passed(self, done: _Done) -> bool:
        if done.fence is None:
            return True
        try:
            return bool(done.fence())
        except Exception:
            logger.exception("%s: fence of job %d raised; keeping its slots reserved",
                             self.name, done.job_id)
            return False

    @property
    def num_jobs_fenced(self) -> int:
        """Finished jobs held back because an abandoned call may still touch their slots."""
        return len(self._fenced)

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
        verdicts = self.tier.probe(keys)
        with self._stats_lock:
            self.stats.probes += len(keys)
            self.stats.probe_batches += 1
        return verdicts

    def stats_snapshot(self) -> dict[str, object]:
        """The runner's and the tier's counters as one dict."""
        with self._stats_lock:
            out = asdict(self.stats)
        out.update(self.tier.counters.snapshot())
        out["probe_timeouts"] = self.cache.probe_timeouts
        out["lookup_known_hits"] = self.cache.num_known_hits
        out["lookup_invariant_violations"] = self.cache.invariant_violations
        out["stuck_thread_replacements"] = (self._runner.pool.replacements
                                            + self._read_pool.replacements
                                            + self._write_pool.replacements)
        return out

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop the prober, wait for in-flight jobs (their buffers stay valid until then),
        then close the tier.

        Bounded: each pool waits at most ``timeout_s`` (default: ``load_timeout_s``);
        a thread still inside a stuck call is left behind (daemon) and logged.
        """
        if self._closed:
            return
        # held jobs start now: the pools finish what they were given before they close
        self.flush_jobs()
        self._closed = True
        wait = self.load_timeout_s if timeout_s is None else timeout_s
        self._runner.close(min(wait, self.probe_timeout_s))
        self._read_pool.close(wait)
        self._write_pool.close(wait)
        self.tier.close()
