"""A Mooncake batch call in flight: :class:`PendingBatch` (and :class:`Failed`).

``MooncakeStoreClient.start_batch_put_from`` / ``start_batch_get_into`` submit a
batch call to the client's worker threads (one call, or one per part of a batch
cut into concurrent calls) and return a :class:`PendingBatch` at once; its
:meth:`~PendingBatch.results` waits for the calls until the deadline set when
they were submitted. What waiting and counting mean is the client's
(``collect``: one call's raw codes or a uniform failure, counted; ``count``:
per-key results counted): this module knows the parts and the deadline only.
Pure bookkeeping over ``concurrent.futures``: nothing of Mooncake is imported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvbridge.backends.mooncake.results import KeyResult

#: the client's wait for one call: ``(op, num_keys, future, deadline) -> raw codes |
#: Failed`` (a timeout or a broken call: the same result for every key, counted)
Collect = Callable[[str, int, "Future[Any]", float], "list[int] | Failed"]
#: the client's count of per-key results (errors), returning them unchanged
Count = Callable[[list[KeyResult]], list[KeyResult]]


@dataclass(frozen=True)
class Failed:
    """A call that was not made or not waited for: the same result for every key."""

    results: list[KeyResult]


class PendingBatch:
    """A batch call running on the client's worker threads: one call, or one per part
    of a batch cut into concurrent calls (contiguous slices of its keys).

    :meth:`results` waits for it until ``op_timeout_s`` after it was started
    (then every key of a part not returned is ``TIMEOUT`` and that call is
    abandoned, as for the blocking calls) and returns the per-key results in
    key order; it may be called again (the same list) and from one thread at a
    time.
    """

    def __init__(self, collect: Collect, count: Count, op: str, num_keys: int,
                 parts: list[tuple[slice, Future[Any]]], done: list[int] | Failed | None,
                 interpret: Callable[[list[int], slice], list[KeyResult]] | None,
                 timeout_s: float) -> None:
        self._collect, self._count = collect, count
        self._op, self._num_keys = op, num_keys
        self._parts, self._raw = parts, done
        self._interpret = interpret
        self._deadline = time.monotonic() + timeout_s
        self._results: list[KeyResult] | None = None

    def done(self) -> bool:
        """Have the calls returned (or were they never made)? Never waits."""
        return all(fut.done() for _, fut in self._parts)

    def raw(self) -> list[int] | Failed:
        """The raw codes of a call that was not cut (see ``MooncakeStoreClient._split``)."""
        if self._raw is None:
            assert len(self._parts) == 1, "a cut batch has per-key results only"
            self._raw = self._collect(self._op, self._num_keys, self._parts[0][1],
                                      self._deadline)
        return self._raw

    def results(self) -> list[KeyResult]:
        if self._results is not None:
            return self._results
        assert self._interpret is not None, "a raw call has no per-key results"
        if self._raw is not None or len(self._parts) <= 1:
            raw = self.raw()
            self._results = (raw.results if isinstance(raw, Failed) else
                             self._count(self._interpret(raw, slice(0, self._num_keys))))
            return self._results
        out: list[KeyResult] = []
        for part, fut in self._parts:
            raw = self._collect(self._op, part.stop - part.start, fut, self._deadline)
            out += (raw.results if isinstance(raw, Failed) else
                    self._count(self._interpret(raw, part)))
        self._results = out
        return out
