"""What the worker halves report after a step, and how the ranks' reports become one.

Owns: :class:`WorkerOutput` (one rank's report, validated on construction),
:class:`ConnectorOutput` (the engine-wide result given to
``update_connector_output``), :class:`OutputAggregator` (the stateful
combination across ranks and steps: a request is finished once every rank
reported it; a KV event once every rank holding its block did), and
:data:`BlockRef`. May not touch: a connector, an engine or the KV bytes; the
hooks that produce these are in :mod:`kvbridge.connectors.api`, which
re-exports everything here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvbridge.connectors.errors import ConfigError, ContractError
from kvbridge.events import KVEvent

#: A block of one region: ``(region_index, block_id)``. Load errors are reported as these.
BlockRef = tuple[int, int]

Stats = Mapping[str, int | float]


@dataclass(frozen=True)
class WorkerOutput:
    """What one rank reports after a step.

    ``failed_recving`` is always a subset of ``finished_recving`` (a failed
    receive is finished: enforced on construction). ``invalid_block_ids`` are
    local blocks whose load failed (their bytes must not be used).
    """

    worker_index: int
    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[BlockRef] = frozenset()
    stats: Stats = field(default_factory=dict)
    events: tuple[KVEvent, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "finished_sending", frozenset(self.finished_sending))
        object.__setattr__(self, "failed_recving", frozenset(self.failed_recving))
        object.__setattr__(self, "finished_recving",
                           frozenset(self.finished_recving) | self.failed_recving)
        refs = frozenset(self.invalid_block_ids)
        for ref in refs:
            if (not isinstance(ref, tuple) or len(ref) != 2
                    or not all(isinstance(x, int) and x >= 0 for x in ref)):
                raise ContractError("invalid_block_ids",
                                    f"expected (region_index, block_id) pairs, got {ref!r}")
        object.__setattr__(self, "invalid_block_ids", refs)
        object.__setattr__(self, "events", tuple(self.events))


@dataclass(frozen=True)
class ConnectorOutput:
    """The engine-wide result of one step, given to ``update_connector_output``.

    A request id appears in ``finished_sending`` / ``finished_recving`` once,
    in the step where the last participating rank reported it. It is in
    ``failed_recving`` if any rank reported it failed. ``invalid_block_ids``
    is the union over ranks, reported as soon as any rank reports it.
    ``worker_stats`` holds each rank's latest cumulative stats (index = worker).
    """

    finished_sending: frozenset[str] = frozenset()
    finished_recving: frozenset[str] = frozenset()
    failed_recving: frozenset[str] = frozenset()
    invalid_block_ids: frozenset[BlockRef] = frozenset()
    worker_stats: tuple[Stats, ...] = ()
    events: tuple[KVEvent, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids
                    or self.events)

    def merged_stats(self) -> dict[str, int | float]:
        """Sum of every numeric stat over ranks (engine-wide cumulative counters)."""
        total: dict[str, int | float] = {}
        for stats in self.worker_stats:
            for key, value in stats.items():
                total[key] = total.get(key, 0) + value
        return total


class OutputAggregator:
    """Combines the ranks' :class:`WorkerOutput` into one :class:`ConnectorOutput` per step.

    Stateful across steps: rank 0 may report a request finished in step 5 and
    rank 1 in step 6; the request is finished (once) in step 6. Invariant: a
    request is finished only when every one of ``num_workers`` ranks reported
    it; it is failed if any rank reported it failed.

    KV events (as vLLM aggregates worker events): an event is emitted once every
    rank that *holds* its block reported an equal event -- ``holders[g]`` are the
    worker indices holding layers of region (KV-cache group) ``g``, for events
    with ``group_idx == g``; all ranks for other events or without ``holders``.
    Reports from ranks outside the holders are ignored. Reports are counted, not
    just noted: an event that every holder reported ``k`` times is emitted ``k``
    times (a block stored, removed and stored again is announced twice), even
    when one rank reports both before another reports the first.
    """

    def __init__(self, num_workers: int,
                 holders: Sequence[frozenset[int]] | None = None) -> None:
        if num_workers < 1:
            raise ConfigError("num_workers", f"expected >= 1, got {num_workers}")
        self.num_workers = num_workers
        self._holders = tuple(frozenset(h) for h in holders) if holders is not None else ()
        everyone = frozenset(range(num_workers))
        for group, ranks in enumerate(self._holders):
            if not ranks or not ranks <= everyone:
                raise ConfigError("holders", f"group {group}: expected a non-empty subset of "
                                             f"worker indices 0..{num_workers - 1}, got "
                                             f"{sorted(ranks)}")
        self._everyone = everyone
        self._sending: dict[str, set[int]] = {}
        self._recving: dict[str, set[int]] = {}
        self._failed: set[str] = set()
        # event -> reports per worker index not yet matched by every holder (insertion
        # ordered: events complete in the order they were first reported)
        self._events: dict[KVEvent, dict[int, int]] = {}

    def aggregate(self, outputs: Sequence[WorkerOutput]) -> ConnectorOutput:
        sending_done: set[str] = set()
        recving_done: set[str] = set()
        invalid: set[BlockRef] = set()
        events: list[KVEvent] = []
        stats: list[Stats] = [{} for _ in range(self.num_workers)]
        for output in outputs:
            worker = output.worker_index
            if not 0 <= worker < self.num_workers:
                raise ContractError("worker_index", f"expected 0..{self.num_workers - 1}, "
                                                    f"got {worker}")
            stats[worker] = output.stats
            invalid |= output.invalid_block_ids
            self._failed |= output.failed_recving
            for request_id in output.finished_sending:
                if self._add(self._sending, request_id, worker):
                    sending_done.add(request_id)
            for request_id in output.finished_recving:
                if self._add(self._recving, request_id, worker):
                    recving_done.add(request_id)
            for event in output.events:
                if worker in self._holders_of(event):
                    counts = self._events.setdefault(event, {})
                    counts[worker] = counts.get(worker, 0) + 1
        events.extend(self._complete_events())
        failed = frozenset(recving_done & self._failed)
        self._failed -= recving_done
        return ConnectorOutput(
            finished_sending=frozenset(sending_done),
            finished_recving=frozenset(recving_done),
            failed_recving=failed,
            invalid_block_ids=frozenset(invalid),
            worker_stats=tuple(stats),
            events=tuple(events),
        )

    def _holders_of(self, event: KVEvent) -> frozenset[int]:
        group = getattr(event, "group_idx", None)
        if isinstance(group, int) and 0 <= group < len(self._holders):
            return self._holders[group]
        return self._everyone

    def _complete_events(self) -> list[KVEvent]:
        out: list[KVEvent] = []
        for event, counts in list(self._events.items()):
            holders = self._holders_of(event)
            rounds = min(counts.get(w, 0) for w in holders)
            if rounds == 0:
                continue
            out.extend([event] * rounds)
            left = {w: n - rounds for w, n in counts.items() if n > rounds}
            if left:
                self._events[event] = left
            else:
                del self._events[event]
        return out

    @property
    def num_pending_events(self) -> int:
        """Distinct worker events some holder has not reported yet."""
        return len(self._events)

    def _add(self, table: dict[str, set[int]], request_id: str, worker: int) -> bool:
        ranks = table.setdefault(request_id, set())
        ranks.add(worker)
        if len(ranks) == self.num_workers:
            del table[request_id]
            return True
        return False

    def pending(self) -> dict[str, dict[str, int]]:
        """Requests some but not all ranks reported: ``{"sending": {id: n}, "recving": ...}``."""
        return {"sending": {k: len(v) for k, v in self._sending.items()},
                "recving": {k: len(v) for k, v in self._recving.items()}}
