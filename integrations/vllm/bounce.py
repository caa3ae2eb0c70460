"""Buffers of a vLLM tier's own, so a job can be reported at its deadline while its I/O runs on.

Why: vLLM's tiering manager hands a job's primary (CPU) slots back the moment the tier
reports the job, and a failed promotion's slots go to the next key at once. A kvbridge
tier reports every job by its deadline (vLLM has none: an unreported job stalls its
request forever), but a read or write stuck in the kernel cannot be cancelled, and a
Mooncake get abandoned at its timeout keeps running. So the I/O never touches vLLM's
slots: a load reads into a slot of the tier's own arena, and its bytes are copied into
vLLM's slot only while the job is still wanted; a store copies vLLM's slot into the
arena first and writes from there. An arena slot is reused only once the tier runner
reported its job, i.e. once its I/O provably ended.

The copies are the price of that promise (one memory copy per block and direction, on
the I/O threads, never on the scheduler thread): the benchmark
(:mod:`kvbridge.tools.bench.vllm_tiering`) measures them beside vLLM's own fs tier.

Owns: the arena (:class:`BounceArena`, scheduler thread only), each job's gate
(:class:`JobGate`: the one lock between an I/O thread's copy and the scheduler giving
the job up) and the wrapper tier (:class:`GatedTier`) that moves bytes between them.
May not touch: vLLM (nothing here imports it), the wrapped tier's own state.
"""

from __future__ import annotations

import enum
import errno
import logging
import threading
from collections.abc import Sequence
from typing import Generic, TypeVar, overload

import numpy as np

from kvbridge.offload.blockdigest import LayerDigests
from kvbridge.offload.private_memory import PrivateMemory
from kvbridge.offload.tier import BlockBuffers, Tier
from kvbridge.offload.types import BatchIOError, OffloadError, OffloadKey

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: arenas whose slots an abandoned call may still write into at shutdown: never unmapped
_KEPT_ALIVE: list[object] = []


class GateState(enum.Enum):
    RUNNING = "running"      # I/O on arena slots only; the job may be given up
    COPYING = "copying"      # an I/O thread copies between arena and vLLM's slots
    ABANDONED = "abandoned"  # reported at its deadline: vLLM's slots are no longer ours


class JobGate:
    """Whether a job may still touch vLLM's slots; the scheduler gives it up at its deadline.

    ``enter_copy`` (I/O thread) and ``abandon`` (scheduler thread) exclude each other: a
    copy in progress is never cut short (a memory copy ends; the scheduler asks again next
    step), and no copy starts once the job was given up.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.state = GateState.RUNNING

    def enter_copy(self) -> bool:
        with self._lock:
            if self.state is GateState.ABANDONED:
                return False
            self.state = GateState.COPYING
            return True

    def leave_copy(self) -> None:
        with self._lock:
            if self.state is GateState.COPYING:
                self.state = GateState.RUNNING

    def abandon(self) -> bool:
        """Give the job up (True), unless a copy runs now (False: ask again later)."""
        with self._lock:
            if self.state is GateState.COPYING:
                return False
            self.state = GateState.ABANDONED
            return True

    @property
    def abandoned(self) -> bool:
        with self._lock:
            return self.state is GateState.ABANDONED


class BounceArena:
    """``num_slots`` page-aligned slots of ``block_bytes`` each (private memory advised for
    huge pages, touched only when used: :class:`PrivateMemory` says why the disk wants
    that). Slots are taken and given back on the scheduler thread only."""

    def __init__(self, num_slots: int, block_bytes: int) -> None:
        if num_slots < 1 or block_bytes < 1:
            raise OffloadError("bounce_bytes", f"expected room for at least one block of "
                                               f"{block_bytes} bytes")
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self._memory: PrivateMemory | None = PrivateMemory(num_slots * block_bytes)
        #: the whole arena (what a tier registers for zero-copy or batched I/O)
        self.buffer: memoryview = self._memory.view
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int] | None:
        """``count`` slots, or None when fewer are free (the caller waits or fails)."""
        if count > len(self._free):
            return None
        taken = self._free[-count:] if count else []
        del self._free[len(self._free) - count:]
        return taken[::-1]

    def give(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)

    def view(self, slot: int) -> memoryview:
        start = slot * self.block_bytes
        return self.buffer[start:start + self.block_bytes]

    def close(self) -> None:
        """Unmap, unless a slot is still out (an abandoned call may write it): then kept."""
        if self._memory is None:
            return
        if len(self._free) != self.num_slots:
            logger.error("bounce arena: %d slot(s) still held by I/O that never ended; "
                         "keeping the arena mapped", self.num_slots - len(self._free))
            _KEPT_ALIVE.append(self)
            return
        if not self._memory.close():   # a view of it is still alive somewhere: the GC
            _KEPT_ALIVE.append(self._memory)
        self._memory = None


#: up to this many bytes a copy is a plain slice assignment (under the GIL, but with no
#: numpy wrappers: 0.3 us against 1.6 us at 16 KiB, 5.6 against 8.6 at 256 KiB)
SMALL_COPY_BYTES = 256 << 10


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src``; above ``SMALL_COPY_BYTES`` through numpy (its copy loop runs
    without the GIL, so the other I/O threads go on meanwhile)."""
    if dst.nbytes <= SMALL_COPY_BYTES and dst.format == src.format == "B" \
            and dst.ndim == src.ndim == 1:
        dst[:] = src
        return
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


class JobBlocks(Sequence[Sequence[memoryview]]):
    """A job's buffers as the tier runner sees them: per key, its arena slot (what the
    I/O reads into or writes from); beside it vLLM's slot and its job's gate. Slicing
    (the runner cuts a job into parts) keeps the pairing; ``join`` puts the blocks of
    several jobs in one call (the runner merges small loads), each keeping its gate."""

    def __init__(self, gate: JobGate, arena: Sequence[memoryview],
                 primary: Sequence[memoryview],
                 gates: Sequence[JobGate] | None = None) -> None:
        if len(arena) != len(primary) or (gates is not None and len(gates) != len(arena)):
            raise OffloadError("buffers", f"{len(arena)} arena slots for {len(primary)} blocks")
        #: the first block's gate (every block's, unless ``join`` made this)
        self.gate = gate
        self.arena = list(arena)
        self.primary = list(primary)
        #: per block, its job's gate
        self.gates = list(gates) if gates is not None else [gate] * len(self.arena)

    @classmethod
    def join(cls, jobs: Sequence[JobBlocks]) -> JobBlocks:
        if not jobs:
            raise OffloadError("buffers", "no jobs to join")
        return cls(jobs[0].gate, [v for job in jobs for v in job.arena],
                   [v for job in jobs for v in job.primary],
                   [g for job in jobs for g in job.gates])

    def __len__(self) -> int:
        return len(self.arena)

    @overload
    def __getitem__(self, index: int) -> Sequence[memoryview]: ...

    @overload
    def __getitem__(self, index: slice) -> JobBlocks: ...

    def __getitem__(self, index: int | slice) -> Sequence[memoryview] | JobBlocks:
        if isinstance(index, slice):
            gates = self.gates[index]
            return JobBlocks(gates[0] if gates else self.gate, self.arena[index],
                             self.primary[index], gates)
        return [self.arena[index]]


def _copy_by_job(blocks: JobBlocks, positions: Sequence[int], into_primary: bool,
                 late: str) -> dict[int, OSError]:
    """Copy the blocks at ``positions`` between the arena and vLLM's slots
    (``into_primary``: arena to vLLM's), job by job (runs of consecutive positions with
    one gate) under each job's gate. A job given up is not copied: its blocks get a
    TimeoutError (``late``: when it was given up), returned by position."""
    given_up: dict[int, OSError] = {}
    start = 0
    while start < len(positions):
        gate = blocks.gates[positions[start]]
        end = start + 1
        while end < len(positions) and blocks.gates[positions[end]] is gate:
            end += 1
        run = positions[start:end]
        if gate.enter_copy():
            try:
                for i in run:
                    if into_primary:
                        copy_bytes(blocks.primary[i], blocks.arena[i])
                    else:
                        copy_bytes(blocks.arena[i], blocks.primary[i])
            finally:
                gate.leave_copy()
        else:
            for i in run:
                given_up[i] = TimeoutError(errno.ETIMEDOUT, f"given up at its deadline {late}")
        start = end
    return given_up


class _InnerAttr(Generic[T]):
    """An attribute of a ``GatedTier`` that is its inner tier's (read and written there)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: GatedTier | None, owner: type) -> T:
        value: T = getattr(obj.inner, self.name) if obj is not None else getattr(Tier, self.name)
        return value

    def __set__(self, obj: GatedTier, value: T) -> None:
        setattr(obj.inner, self.name, value)


class GatedTier(Tier):
    """``inner`` with its I/O on arena slots; bytes cross to vLLM's slots under the gate.

    A load reads into the arena, then copies the blocks that loaded into vLLM's slots,
    unless the job was given up (then it fails as a whole: its result is no longer
    read). A store copies vLLM's slots into the arena first (or fails if the job was
    given up before it started), then writes from the arena.
    """

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner.name, inner.block_bytes, verify=inner.verify,
                         num_layers=inner.num_layers)
        self.inner = inner
        self.counters = inner.counters
        self.medium = inner.medium
        self.locality = inner.locality

    # the runner reads these when it cuts or joins jobs; the inner tier may change them
    # when it attaches memory (fs: batched reads)
    load_part_blocks = _InnerAttr[int]()
    store_part_blocks = _InnerAttr[int]()
    merge_load_blocks = _InnerAttr[int]()
    merge_store_blocks = _InnerAttr[int]()

    def attach_primary(self, buffer: memoryview) -> None:
        """``buffer`` is the arena (the only memory the inner tier's I/O touches)."""
        self.inner.attach_primary(buffer)

    def probe(self, keys: Sequence[OffloadKey]) -> list[bool]:
        return self.inner.probe(keys)

    @staticmethod
    def _blocks(buffers: BlockBuffers) -> JobBlocks:
        if not isinstance(buffers, JobBlocks):
            raise OffloadError("buffers", "a gated tier runs jobs of JobBlocks only")
        return buffers

    def load(self, keys: Sequence[OffloadKey], buffers: BlockBuffers,
             digests_out: list[LayerDigests | None]) -> None:
        """Read into the arena; copy what loaded into vLLM's slots, job by job under each
        job's gate. A job given up before its copy fails (its blocks are ``skipped`` with
        a TimeoutError: the other jobs of a joined call are unaffected); ``digests_out``
        gets the digests of exactly the blocks that reached vLLM's slots."""
        blocks = self._blocks(buffers)
        failure: BatchIOError | None = None
        landed: list[LayerDigests | None] = []
        try:
            self.inner.load(keys, [[v] for v in blocks.arena], landed)
            loaded: Sequence[int] = range(len(keys))
        except BatchIOError as exc:
            failure = exc
            loaded = [i for i in range(min(exc.num_succeeded, len(keys)))
                      if i not in exc.skipped]
        given_up = _copy_by_job(blocks, loaded, True, "before its bytes were copied")
        digests_out.extend(d for i, d in zip(loaded, landed, strict=True) if i not in given_up)
        if not given_up:
            if failure is not None:
                raise failure
            return
        skipped = dict(failure.skipped) if failure is not None else {}
        skipped.update(given_up)
        if failure is not None:
            raise BatchIOError(failure.num_succeeded, failure.cause, failure.fence, skipped)
        raise BatchIOError(len(keys), given_up[min(given_up)], None, skipped)

    def store(self, keys: Sequence[OffloadKey], buffers: BlockBuffers,
              digests: Sequence[LayerDigests | None]) -> None:
        """Copy vLLM's slots into the arena, job by job under each job's gate, then write
        from the arena. A job given up before its copy is not stored (its blocks are
        ``skipped`` with a TimeoutError; the other jobs of a joined call are stored)."""
        blocks = self._blocks(buffers)
        given_up = _copy_by_job(blocks, range(len(keys)), False, "before it started")
        if not given_up:
            self.inner.store(keys, [[v] for v in blocks.arena], digests)
            return
        copied = [i for i in range(len(keys)) if i not in given_up]
        try:
            if copied:
                self.inner.store([keys[i] for i in copied],
                                 [[blocks.arena[i]] for i in copied],
                                 [digests[i] for i in copied])
        except BatchIOError as exc:   # its positions are those of ``copied``: map them back
            stop = copied[exc.num_succeeded] if exc.num_succeeded < len(copied) else len(keys)
            skipped = {copied[i]: c for i, c in exc.skipped.items()}
            skipped.update((i, c) for i, c in given_up.items() if i < stop)
            raise BatchIOError(stop, exc.cause, exc.fence, skipped) from exc
        raise BatchIOError(len(keys), given_up[min(given_up)], None, given_up)

    def close(self) -> None:
        self.inner.close()
