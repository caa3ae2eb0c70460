"""Asynchronous existence lookup of a secondary tier.

Two halves:

* ``LookupCache`` — pure state machine, scheduler thread only. It caches one
  verdict per key (None = probe in flight, True = present, False = absent),
  refcounted by the requests that asked. A new entry is enqueued for probing
  exactly once; ``take_batch`` hands the queued keys to the prober (one batch
  per scheduler step); ``apply_results`` settles them.
* ``ProbeRunner`` — background threads that run the tier's blocking probe
  function on each batch and queue the results; ``drain`` hands them back to
  the scheduler thread, the only thread that touches the cache.

Invariants (the failed-load livelock, vLLM #49176, comes from breaking them):

* **enqueue once**: an entry is probed at most once in its lifetime, so a
  second result for it is a bug. ``apply_results`` checks it for real (not
  with ``assert``, which ``python -O`` strips): the duplicate is dropped,
  counted in ``invariant_violations`` and logged as an error. A stale True
  arriving after ``mark_miss`` would otherwise send the request back to a
  doomed promotion forever.
* **mark_miss sticks**: ``mark_miss`` flips a verdict to False without a
  re-probe and without removing the entry (the reverse index stays consistent);
  it stays False until no request references the entry.
* Results carry the entry's generation: a result for an entry that was cleaned
  up (and possibly re-created, hence re-enqueued) is dropped, never applied to
  the new entry.
* **bounded**: the cache keeps state only for keys some live request
  references; ``release`` of the last reference forgets the key entirely
  (``num_enqueued`` is a plain total; per-key histories are the business of an
  ``on_enqueue`` observer, e.g. a test).
* **deadline**: a verdict still unknown ``probe_timeout_s`` after its probe was
  enqueued settles as a miss (``expire``, counted in ``probe_timeouts``), so a
  stuck ``stat`` never keeps a request waiting; a late True cannot revive it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvbridge.offload.types import OffloadKey, RequestId
from kvbridge.offload.workers import StuckAwarePool

logger = logging.getLogger(__name__)

#: (key, generation) pairs to probe
ProbeBatch = tuple[tuple[OffloadKey, int], ...]
#: (key, generation, present)
ProbeResult = tuple[OffloadKey, int, bool]


@dataclass
class _Entry:
    generation: int
    #: when the probe was enqueued (the caller's monotonic clock), for the deadline
    enqueued_at: float = 0.0
    result: bool | None = None
    probe_outstanding: bool = True
    refs: set[RequestId] = field(default_factory=set)


class LookupCache:
    """Cached probe verdicts per key, refcounted by request (pure, single-threaded)."""

    def __init__(self, on_enqueue: Callable[[OffloadKey], None] | None = None) -> None:
        self._entries: dict[OffloadKey, _Entry] = {}
        self._by_request: dict[RequestId, set[OffloadKey]] = {}
        self._queued: list[tuple[OffloadKey, int]] = []
        #: entries whose verdict is unknown, in enqueue order (oldest first)
        self._unknown: dict[OffloadKey, None] = {}
        self._next_generation = 0
        #: called with each key enqueued for a probe (observers such as tests keep
        #: per-key histories; the cache itself forgets released keys)
        self.on_enqueue = on_enqueue
        #: probes enqueued in all (every new entry is enqueued exactly once, unless the
        #: caller knew it present: ``num_known_hits``)
        self.num_enqueued = 0
        self.num_known_hits = 0
        #: second results for one entry (dropped; a bug if ever non-zero)
        self.invariant_violations = 0
        #: verdicts settled as a miss because their probe outlived the deadline
        self.probe_timeouts = 0

    def lookup(self, request_id: RequestId, key: OffloadKey, now: float = 0.0,
               known_present: bool = False) -> bool | None:
        """Cached verdict for ``key``; None while unknown (first call enqueues a probe).

        ``now``: the caller's monotonic clock, recorded for ``expire``.
        ``known_present``: the caller saw this key stored or loaded itself; a new entry
        then starts as a hit, with no probe (an existing entry keeps its verdict: a
        ``mark_miss`` still sticks). ``num_known_hits`` counts them.
        """
        entry = self._entries.get(key)
        if entry is None:
            self._next_generation += 1
            entry = _Entry(generation=self._next_generation, enqueued_at=now)
            self._entries[key] = entry
            if known_present:
                entry.result = True
                entry.probe_outstanding = False
                self.num_known_hits += 1
            else:
                self._queued.append((key, entry.generation))
                self._unknown[key] = None
                self.num_enqueued += 1
                if self.on_enqueue is not None:
                    self.on_enqueue(key)
        if request_id not in entry.refs:
            entry.refs.add(request_id)
            self._by_request.setdefault(request_id, set()).add(key)
        return entry.result

    def peek(self, key: OffloadKey) -> bool | None:
        """Verdict without creating an entry or a reference."""
        entry = self._entries.get(key)
        return None if entry is None else entry.result

    def take_batch(self) -> ProbeBatch:
        """Keys enqueued since the last call (each exactly once)."""
        batch, self._queued = tuple(self._queued), []
        return batch

    def apply_results(self, results: Iterable[ProbeResult]) -> None:
        for key, generation, present in results:
            entry = self._entries.get(key)
            if entry is None or entry.generation != generation:
                continue  # cleaned up while the probe ran: nobody wants it
            if not entry.probe_outstanding:
                # a real check, not an assert: python -O must not remove it
                self.invariant_violations += 1
                logger.error("lookup entry received a second probe result (generation %d); "
                             "the enqueue-once invariant is broken and could reopen the "
                             "failed-load livelock; result dropped", generation)
                continue
            entry.probe_outstanding = False
            if entry.result is None:
                entry.result = present
                self._unknown.pop(key, None)
            # else: mark_miss settled it first; a late True must not revive it

    def mark_miss(self, keys: Iterable[OffloadKey]) -> None:
        """Force cached verdicts to False after a failed load (no re-probe).

        Keys without an entry are skipped: nobody references them, and the next
        lookup probes afresh (the short-read file is gone by then).
        """
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None:
                entry.result = False
                self._unknown.pop(key, None)

    def expire(self, now: float, timeout_s: float) -> list[OffloadKey]:
        """Settle as a miss every verdict still unknown ``timeout_s`` after its enqueue.

        The probe may still answer later; that answer is then ignored (like after
        ``mark_miss``). Returns the keys settled.
        """
        expired: list[OffloadKey] = []
        for key in self._unknown:   # oldest first: stop at the first one in time
            if now - self._entries[key].enqueued_at < timeout_s:
                break
            expired.append(key)
        for key in expired:
            del self._unknown[key]
            self._entries[key].result = False
        self.probe_timeouts += len(expired)
        return expired

    @property
    def num_unknown(self) -> int:
        """Entries whose verdict is not known yet."""
        return len(self._unknown)

    def release(self, request_id: RequestId) -> None:
        """Drop the request's references; entries nobody references are removed."""
        for key in self._by_request.pop(request_id, ()):
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.refs.discard(request_id)
            if not entry.refs:
                del self._entries[key]
                self._unknown.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def num_requests(self) -> int:
        return len(self._by_request)


class ProbeRunner:
    """Runs ``probe(keys) -> list[bool]`` on background threads, batch by batch.

    ``submit`` and ``drain`` never block the caller on I/O. A probe function
    that raises answers the whole batch "absent" (best effort: the block is
    recomputed) and is logged. One stuck probe does not hold the batches of
    other keys: the threads are a ``StuckAwarePool`` (a thread stuck for over
    ``stuck_after_s`` is replaced while batches wait); the stuck batch's keys
    are settled as misses by the cache's deadline (``LookupCache.expire``).
    """

    def __init__(self, probe: Callable[[Sequence[OffloadKey]], Sequence[bool]], name: str,
                 on_result: Callable[[], None] | None = None, *, num_threads: int = 1,
                 stuck_after_s: float = 5.0, max_extra_threads: int = 4,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._probe = probe
        self._on_result = on_result
        self._submitted = 0
        self._drained = 0
        self._results: queue.SimpleQueue[list[ProbeResult]] = queue.SimpleQueue()
        self._pool = StuckAwarePool(f"kvbridge-probe-{name}", num_threads, stuck_after_s,
                                    max_extra_threads, clock)
        self._closed = False
        self._count_lock = threading.Lock()
        self.batches_run = 0

    def submit(self, batch: ProbeBatch) -> None:
        if batch and not self._closed:
            self._submitted += 1
            self._pool.submit(lambda: self._run(batch))

    def check(self) -> None:
        """Replace stuck probe threads while batches wait (scheduler step; never blocks)."""
        self._pool.check()

    def drain(self) -> list[ProbeResult]:
        out: list[ProbeResult] = []
        while True:
            try:
                out.extend(self._results.get_nowait())
                self._drained += 1
            except queue.Empty:
                return out

    @property
    def batches_in_flight(self) -> int:
        """Batches submitted whose results were not drained yet (caller's thread)."""
        return self._submitted - self._drained

    @property
    def pool(self) -> StuckAwarePool:
        return self._pool

    def _run(self, batch: ProbeBatch) -> None:
        keys = [key for key, _ in batch]
        try:
            verdicts = list(self._probe(keys))
            if len(verdicts) != len(keys):
                raise ValueError(f"probe returned {len(verdicts)} verdicts for {len(keys)} keys")
        except Exception:
            logger.exception("probe of %d keys failed; answering absent", len(keys))
            verdicts = [False] * len(keys)
        with self._count_lock:
            self.batches_run += 1
        self._results.put([(key, gen, bool(v))
                           for (key, gen), v in zip(batch, verdicts, strict=True)])
        if self._on_result is not None:
            self._on_result()

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the probe threads (bounded wait); True if none is still inside a probe."""
        if self._closed:
            return True
        self._closed = True
        return self._pool.close(timeout_s)
