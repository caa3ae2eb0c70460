"""Fault injection for the offloading worker: failed loads, installed around a real worker.

Owns: :class:`CopyFault` and :class:`LoadFaults`, which :func:`install_load_faults`
puts around one :class:`~kvbridge.connectors.offloading.worker.OffloadingWorker`
(tests and the conformance suite; production code never installs it). It
wraps that worker's ``start_load_kv`` (to take the "whole next step" flag as
the step starts) and its ``_load_blocks`` (the copy of a step's loads): each
block chosen to fail is reported through the worker's own ``_load_failed``, as
a failed DMA would be (nothing copied, one more ``load_copy_errors``, the block
in ``get_block_ids_with_load_errors``), and every other block goes through the
real copy. The scheduler then counts those blocks as failed loads, never as
hits, and the engine recomputes them.

May not touch: the worker's copies, stores or counters other than through
``_load_failed``; the scheduler.
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch

from kvbridge.connectors.offloading.scheduler import CopyItem
from kvbridge.connectors.offloading.worker import OffloadingWorker

#: a step's loads as the worker hands them to ``_load_blocks``: (request id, item)
Loads = list[tuple[str, CopyItem]]

# worker -> its faults; weak, so a worker shut down and dropped is not kept alive
# (a LoadFaults holds no reference to its worker: only the wrappers do)
_INSTALLED: weakref.WeakKeyDictionary[OffloadingWorker, LoadFaults] = weakref.WeakKeyDictionary()
_INSTALL_LOCK = threading.Lock()


class CopyFault(OSError):
    """An injected failure of one copy (:meth:`LoadFaults.fail_next_loads`)."""


class LoadFaults:
    """The armed faults of one worker's loads. Thread-safe: a test may arm them from its
    own thread while the engine steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fail_loads = 0  # block loads still to fail, in the order the worker meets them
        self._fail_step = False  # armed: every block load of the next step fails
        self._failing_step = False  # taken as the step being loaded started

    def fail_next_loads(self, count: int) -> None:
        """The next ``count`` block loads fail as a failed DMA would (nothing is copied;
        the blocks are reported as load errors)."""
        with self._lock:
            self._fail_loads += count

    def fail_loads_of_next_step(self) -> None:
        """Every block load of the next step fails (see :meth:`fail_next_loads`)."""
        with self._lock:
            self._fail_step = True

    #: the NIXL worker's name for its fault injection: the loads of the next step fail
    inject_fault_next_loads = fail_loads_of_next_step

    def _start_step(self) -> None:
        with self._lock:
            self._failing_step, self._fail_step = self._fail_step, False

    def _end_step(self) -> None:
        with self._lock:
            self._failing_step = False

    def _take(self) -> bool:
        """Whether the next block load fails (and one fewer is left to fail)."""
        with self._lock:
            injected = self._failing_step or self._fail_loads > 0
            if injected:
                self._fail_loads = max(0, self._fail_loads - 1)
            return injected


def install_load_faults(worker: OffloadingWorker) -> LoadFaults:
    """The :class:`LoadFaults` around ``worker``, installed on first use (once per worker)."""
    with _INSTALL_LOCK:
        faults = _INSTALLED.get(worker)
        if faults is None:
            faults = _INSTALLED[worker] = LoadFaults()
            _wrap(worker, faults)
        return faults


def _wrap(worker: OffloadingWorker, faults: LoadFaults) -> None:
    start_load_kv = worker.start_load_kv
    load_blocks = worker._load_blocks
    load_failed = worker._load_failed

    @functools.wraps(start_load_kv)
    def start() -> None:
        faults._start_step()
        try:
            start_load_kv()
        finally:
            faults._end_step()

    @functools.wraps(load_blocks)
    def load(mine: Loads, pools: list[torch.Tensor]) -> None:
        kept: Loads = []
        for request_id, item in mine:
            if faults._take():
                load_failed(request_id, item, CopyFault("injected copy fault"))
            else:
                kept.append((request_id, item))
        if kept:
            load_blocks(kept, pools)

    # instance attributes: this worker only; the class and every other worker stay as they are
    worker.start_load_kv = start  # type: ignore[method-assign]
    worker._load_blocks = load  # type: ignore[method-assign]
