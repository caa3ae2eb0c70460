"""Worker threads that one stuck call cannot wedge: the probe and read pools of a tier.

A tier's probes and reads run blocking calls (``stat``, ``read``, a Mooncake
get) that can hang: an NFS server gone, a FIFO in place of a file, a stalled
master. With a fixed pool of one probe thread and two read threads, one such
call would hold every later lookup or load of *other* keys behind it.

``StuckAwarePool`` keeps up to ``num_threads`` *healthy* threads (started as jobs
arrive and find no idle thread, then kept): a thread whose
current job has run longer than ``stuck_after_s`` is considered stuck and no
longer counts, and ``check`` (called on every ``submit`` and on every tier
step) starts a replacement, up to ``max_extra_threads`` beyond
``num_threads``. A thread that comes back from a stuck call and finds enough
healthy threads exits, so the pool shrinks back by itself. Threads are daemon
threads: a call stuck forever never holds up interpreter exit.

What the pool does not do is abandon the work itself: the caller's deadline
(the lookup cache's probe deadline, the manager's load deadline) turns a late
answer into a miss, and the buffers of a stuck read stay reserved until the
read returns (see ``SecondaryTier``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class StuckAwarePool:
    """Daemon threads running ``fn()`` jobs in FIFO order; see the module docstring."""

    def __init__(self, name: str, num_threads: int, stuck_after_s: float,
                 max_extra_threads: int = 4,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if stuck_after_s <= 0:
            raise ValueError(f"stuck_after_s must be > 0 seconds, got {stuck_after_s}")
        if max_extra_threads < 0:
            raise ValueError(f"max_extra_threads must be >= 0, got {max_extra_threads}")
        self.name = name
        self.num_threads = num_threads
        self.stuck_after_s = stuck_after_s
        self.max_extra_threads = max_extra_threads
        self._clock = clock
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        #: per live thread: when its current job started (None: idle)
        self._started: dict[int, float | None] = {}
        self._threads: list[threading.Thread] = []
        self._next_index = 0
        self._closed = False
        self._pending = 0
        #: replacement threads started because others were stuck (a counter for stats)
        self.replacements = 0
        # threads start on demand (``submit``): a tier opened for one request (a restart's
        # first load) does not first start every thread of its pools

    def _start_thread_locked(self) -> None:
        # forget threads that ended (a replaced thread exits when its stuck call returns):
        # the list holds live threads only, never every thread ever started
        self._threads = [t for t in self._threads if t.is_alive()]
        index = self._next_index
        self._next_index += 1
        thread = threading.Thread(target=self._run, args=(index,), daemon=True,
                                  name=f"{self.name}-{index}")
        self._started[index] = None
        self._threads.append(thread)
        thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            self._pending += 1
            idle = sum(1 for t in self._started.values() if t is None)
            if self._pending > idle and len(self._started) < self.num_threads:
                self._start_thread_locked()
        self._jobs.put(fn)
        self.check()

    def check(self) -> None:
        """Start replacements for stuck threads while work waits (never blocks)."""
        with self._lock:
            if self._closed:
                return
            now = self._clock()
            stuck = sum(1 for t in self._started.values()
                        if t is not None and now - t >= self.stuck_after_s)
            healthy = len(self._started) - stuck
            # only a stuck thread is replaced here; ``submit`` grows the pool up to
            # ``num_threads`` as work arrives
            while (stuck and healthy < self.num_threads and self._pending
                   and len(self._started) < self.num_threads + self.max_extra_threads):
                logger.warning("%s: %d thread(s) stuck for over %.1f s; starting a "
                               "replacement", self.name, stuck, self.stuck_after_s)
                self._start_thread_locked()
                self.replacements += 1
                healthy += 1

    @property
    def num_stuck(self) -> int:
        now = self._clock()
        with self._lock:
            return sum(1 for t in self._started.values()
                       if t is not None and now - t >= self.stuck_after_s)

    @property
    def num_threads_alive(self) -> int:
        with self._lock:
            return len(self._started)

    def _run(self, index: int) -> None:
        while True:
            fn = self._jobs.get()
            if fn is None:
                with self._lock:
                    self._started.pop(index, None)
                return
            with self._lock:
                self._pending -= 1
                self._started[index] = self._clock()
            try:
                fn()
            except BaseException:  # the job reports its own failure; never kill the thread
                logger.exception("%s: job raised", self.name)
            with self._lock:
                self._started[index] = None
                now = self._clock()
                stuck = sum(1 for t in self._started.values()
                            if t is not None and now - t >= self.stuck_after_s)
                if len(self._started) - stuck > self.num_threads:
                    del self._started[index]   # a replacement took this thread's place
                    return

    def close(self, timeout_s: float) -> bool:
        """Stop taking jobs; finish queued ones; wait up to ``timeout_s``. True if all ended."""
        with self._lock:
            if not self._closed:
                self._closed = True
                for _ in self._started:
                    self._jobs.put(None)
        deadline = time.monotonic() + timeout_s
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            logger.warning("%s: %d thread(s) still inside a call at shutdown: %s", self.name,
                           len(alive), alive)
        return not alive
