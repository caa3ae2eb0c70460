"""Asynchronous existence lookup of a secondary tier.

Two halves:

* ``LookupCache`` — pure state machine, scheduler thread only. It caches one
  verdict per key (None = probe in flight, True = present, False = absent),
  refcounted by the requests that asked. A new entry is enqueued for probing
  exactly once; ``take_batch`` hands the queued keys to the prober (one batch
  per scheduler step); ``apply_results`` settles them.
* ``ProbeRunner`` — a background thread that runs the tier's blocking probe
  function on each batch and queues the results; ``drain`` hands them back to
  the scheduler thread, the only thread that touches the cache.

Invariants (the failed-load livelock, vLLM #49176, comes from breaking them):

* **enqueue once**: an entry is probed at most once in its lifetime, so a
  second result for it is a bug; ``apply_results`` asserts it. A stale True
  arriving after ``mark_miss`` would otherwise send the request back to a
  doomed promotion forever.
* **mark_miss sticks**: ``mark_miss`` flips a verdict to False without a
  re-probe and without removing the entry (the reverse index stays consistent);
  it stays False until no request references the entry.
* Results carry the entry's generation: a result for an entry that was cleaned
  up (and possibly re-created, hence re-enqueued) is dropped, never applied to
  the new entry.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvbridge.offload.types import OffloadKey, RequestId

logger = logging.getLogger(__name__)

#: (key, generation) pairs to probe
ProbeBatch = tuple[tuple[OffloadKey, int], ...]
#: (key, generation, present)
ProbeResult = tuple[OffloadKey, int, bool]


@dataclass
class _Entry:
    generation: int
    result: bool | None = None
    probe_outstanding: bool = True
    refs: set[RequestId] = field(default_factory=set)


class LookupCache:
    """Cached probe verdicts per key, refcounted by request (pure, single-threaded)."""

    def __init__(self) -> None:
        self._entries: dict[OffloadKey, _Entry] = {}
        self._by_request: dict[RequestId, set[OffloadKey]] = {}
        self._queued: list[tuple[OffloadKey, int]] = []
        self._next_generation = 0
        #: how many times each key was enqueued for a probe (tests check it)
        self.enqueue_count: dict[OffloadKey, int] = {}

    def lookup(self, request_id: RequestId, key: OffloadKey) -> bool | None:
        """Cached verdict for ``key``; None while unknown (first call enqueues a probe)."""
        entry = self._entries.get(key)
        if entry is None:
            self._next_generation += 1
            entry = _Entry(generation=self._next_generation)
            self._entries[key] = entry
            self._queued.append((key, entry.generation))
            self.enqueue_count[key] = self.enqueue_count.get(key, 0) + 1
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
            assert entry.probe_outstanding, (
                "lookup entry received a second probe result; the enqueue-once "
                "invariant is broken and could reopen the failed-load livelock")
            entry.probe_outstanding = False
            if entry.result is None:
                entry.result = present
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

    def release(self, request_id: RequestId) -> None:
        """Drop the request's references; entries nobody references are removed."""
        for key in self._by_request.pop(request_id, ()):
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.refs.discard(request_id)
            if not entry.refs:
                del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def num_requests(self) -> int:
        return len(self._by_request)


class ProbeRunner:
    """Runs ``probe(keys) -> list[bool]`` on a background thread, batch by batch.

    ``submit`` and ``drain`` never block the caller on I/O. A probe function
    that raises answers the whole batch "absent" (best effort: the block is
    recomputed) and is logged.
    """

    def __init__(self, probe: Callable[[Sequence[OffloadKey]], Sequence[bool]], name: str,
                 on_result: Callable[[], None] | None = None) -> None:
        self._probe = probe
        self._on_result = on_result
        self._submitted = 0
        self._drained = 0
        self._requests: queue.SimpleQueue[ProbeBatch | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[list[ProbeResult]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"kvbridge-probe-{name}",
                                        daemon=True)
        self._closed = False
        self.batches_run = 0
        self._thread.start()

    def submit(self, batch: ProbeBatch) -> None:
        if batch and not self._closed:
            self._submitted += 1
            self._requests.put(batch)

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

    def _run(self) -> None:
        while True:
            batch = self._requests.get()
            if batch is None:
                return
            keys = [key for key, _ in batch]
            try:
                verdicts = list(self._probe(keys))
                if len(verdicts) != len(keys):
                    raise ValueError(f"probe returned {len(verdicts)} verdicts for {len(keys)} keys")
            except Exception:
                logger.exception("probe of %d keys failed; answering absent", len(keys))
                verdicts = [False] * len(keys)
            self.batches_run += 1
            self._results.put([(key, gen, bool(v))
                               for (key, gen), v in zip(batch, verdicts, strict=True)])
            if self._on_result is not None:
                self._on_result()

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._requests.put(None)
        self._thread.join(timeout_s)
