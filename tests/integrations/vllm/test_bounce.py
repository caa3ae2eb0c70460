"""The arena and gate that let a vLLM tier report a job at its deadline (no vLLM needed).

A real ``FsTier`` on a temp directory runs under ``GatedTier``: its I/O touches only
arena slots, and bytes cross to the "vLLM slots" (here a plain buffer) only while the
job's gate is open.
"""

from __future__ import annotations

import errno
import hashlib
import threading
from pathlib import Path

import pytest

from kvbridge.integrations.vllm.bounce import (
    BounceArena,
    GatedTier,
    GateState,
    JobBlocks,
    JobGate,
)
from kvbridge.offload.faults import FailingWriteIO
from kvbridge.offload.fs import FsTier
from kvbridge.offload.types import BatchIOError

BLOCK = 16 << 10


def content(i: int) -> bytes:
    return hashlib.shake_128(b"bounce|%d" % i).digest(BLOCK)


def make(tmp_path: Path, num: int) -> tuple[GatedTier, BounceArena, bytearray, list[bytes]]:
    tier = GatedTier(FsTier(str(tmp_path), BLOCK, "0123456789abcdef"))
    arena = BounceArena(num, BLOCK)
    tier.attach_primary(arena.buffer)
    primary = bytearray(num * BLOCK)
    return tier, arena, primary, [b"key-%d" % i for i in range(num)]


def blocks(gate: JobGate, arena: BounceArena, slots: list[int], primary: bytearray,
           rows: range) -> JobBlocks:
    view = memoryview(primary)
    return JobBlocks(gate, [arena.view(s) for s in slots],
                     [view[r * BLOCK:(r + 1) * BLOCK] for r in rows])


def test_store_and_load_move_bytes_through_the_arena(tmp_path: Path) -> None:
    tier, arena, primary, keys = make(tmp_path, 4)
    for i in range(4):
        primary[i * BLOCK:(i + 1) * BLOCK] = content(i)
    slots = arena.take(4)
    assert slots is not None and arena.num_free == 0 and arena.take(1) is None
    tier.store(keys, blocks(JobGate(), arena, slots, primary, range(4)), [None] * 4)
    primary[:] = bytes(len(primary))
    digests: list[object] = []
    job = blocks(JobGate(), arena, slots, primary, range(4))
    assert len(job[1:3]) == 2 and job[1:3].primary[0] == job.primary[1]   # slices keep pairs
    tier.load(keys, job, digests)
    assert [bytes(primary[i * BLOCK:(i + 1) * BLOCK]) for i in range(4)] == \
        [content(i) for i in range(4)]
    assert len(digests) == 4
    arena.give(slots)
    assert arena.num_free == 4


def test_a_load_given_up_never_writes_the_slot(tmp_path: Path) -> None:
    tier, arena, primary, keys = make(tmp_path, 2)
    for i in range(2):
        primary[i * BLOCK:(i + 1) * BLOCK] = content(i)
    slots = arena.take(2)
    assert slots is not None
    tier.store(keys, blocks(JobGate(), arena, slots, primary, range(2)), [None] * 2)
    primary[:] = b"\x5a" * len(primary)          # the slots belong to other chunks now
    gate = JobGate()
    assert gate.abandon() and gate.abandoned
    with pytest.raises(BatchIOError) as info:
        tier.load(keys, blocks(gate, arena, slots, primary, range(2)), [])
    failed = set(info.value.skipped) | set(range(info.value.num_succeeded, 2))
    assert failed == {0, 1}
    assert all(isinstance(c, TimeoutError) for c in info.value.skipped.values())
    assert bytes(primary) == b"\x5a" * len(primary)


def test_a_joined_load_copies_each_job_under_its_own_gate(tmp_path: Path) -> None:
    """Three one-block jobs in one call (the runner joins small loads): the job given up
    fails alone and its slot is never written; the others land with their digests."""
    tier, arena, primary, keys = make(tmp_path, 3)
    for i in range(3):
        primary[i * BLOCK:(i + 1) * BLOCK] = content(i)
    slots = arena.take(3)
    assert slots is not None
    tier.store(keys, blocks(JobGate(), arena, slots, primary, range(3)), [None] * 3)
    primary[:] = b"\x5a" * len(primary)
    gates = [JobGate(), JobGate(), JobGate()]
    assert gates[1].abandon()
    joined = JobBlocks.join([blocks(gates[i], arena, [slots[i]], primary, range(i, i + 1))
                             for i in range(3)])
    assert joined.gates == gates and len(joined[1:]) == 2 and joined[1:].gate is gates[1]
    digests: list[object] = []
    with pytest.raises(BatchIOError) as info:
        tier.load(keys, joined, digests)
    assert info.value.num_succeeded == 3 and set(info.value.skipped) == {1}
    assert isinstance(info.value.skipped[1], TimeoutError)
    assert bytes(primary[0:BLOCK]) == content(0)
    assert bytes(primary[BLOCK:2 * BLOCK]) == b"\x5a" * BLOCK
    assert bytes(primary[2 * BLOCK:]) == content(2)
    assert len(digests) == 2 and all(d is not None for d in digests)
    assert bytes(arena.view(slots[0])) == content(0)   # the read landed in the arena only


def test_a_store_given_up_before_it_starts_stores_nothing(tmp_path: Path) -> None:
    tier, arena, primary, keys = make(tmp_path, 1)
    gate = JobGate()
    gate.abandon()
    slots = arena.take(1)
    assert slots is not None
    with pytest.raises(BatchIOError):
        tier.store(keys, blocks(gate, arena, slots, primary, range(1)), [None])
    assert tier.probe(keys) == [False]


def four_jobs_with_job_1_given_up(arena: BounceArena, primary: bytearray
                                  ) -> tuple[JobBlocks, list[int]]:
    """Four one-block store jobs joined in one call, ``content(i)`` in vLLM's slot of
    job ``i``; job 1 was given up at its deadline. Also the arena slots taken."""
    for i in range(4):
        primary[i * BLOCK:(i + 1) * BLOCK] = content(i)
    slots = arena.take(4)
    assert slots is not None
    gates = [JobGate() for _ in range(4)]
    assert gates[1].abandon()
    return JobBlocks.join([blocks(gates[i], arena, [slots[i]], primary, range(i, i + 1))
                           for i in range(4)]), slots


def test_a_joined_store_copies_each_job_under_its_own_gate(tmp_path: Path) -> None:
    """Four one-block jobs in one store call (the runner joins small stores): the job
    given up is not stored and fails alone; the other three are stored from the arena."""
    tier, arena, primary, keys = make(tmp_path, 4)
    joined, slots = four_jobs_with_job_1_given_up(arena, primary)
    with pytest.raises(BatchIOError) as info:
        tier.store(keys, joined, [None] * 4)
    assert info.value.num_succeeded == 4 and set(info.value.skipped) == {1}
    assert isinstance(info.value.skipped[1], TimeoutError)
    assert tier.probe(keys) == [True, False, True, True]
    loaded = bytearray(BLOCK)
    for i in (0, 2, 3):
        tier.inner.load([keys[i]], [[memoryview(loaded)]], [])
        assert bytes(loaded) == content(i), f"block {i} differs"
    assert bytes(arena.view(slots[1])) == bytes(BLOCK)     # never copied


def test_a_failed_write_in_a_joined_store_stops_it_in_the_calls_positions(
        tmp_path: Path) -> None:
    """Job 1 given up, job 2's write fails: the store below saw jobs 0, 2, 3 only, and its
    failure (at its own position 1) is job 2's in the joined call; job 3 was never reached
    (the runner runs it again), job 1 fails alone."""
    io = FailingWriteIO()
    tier = GatedTier(FsTier(str(tmp_path), BLOCK, "0123456789abcdef", io=io))
    arena = BounceArena(4, BLOCK)
    tier.attach_primary(arena.buffer)
    primary = bytearray(4 * BLOCK)
    keys = [b"key-%d" % i for i in range(4)]
    io.fail.add(tier.inner.block_path(keys[2]))
    joined, _ = four_jobs_with_job_1_given_up(arena, primary)
    with pytest.raises(BatchIOError) as info:
        tier.store(keys, joined, [None] * 4)
    assert info.value.num_succeeded == 2
    assert isinstance(info.value.cause, OSError) and info.value.cause.errno == errno.EIO
    assert set(info.value.skipped) == {1} and isinstance(info.value.skipped[1], TimeoutError)
    assert tier.probe(keys) == [True, False, False, False]


def test_the_gate_refuses_to_give_up_a_job_while_it_copies() -> None:
    gate = JobGate()
    assert gate.enter_copy() and gate.state is GateState.COPYING
    assert gate.abandon() is False               # the copy ends first; ask again
    gate.leave_copy()
    assert gate.abandon() is True
    assert gate.enter_copy() is False            # no copy starts once given up
    # the two sides from two threads: exactly one of them wins each round
    for _ in range(200):
        g = JobGate()
        won: list[str] = []
        t = threading.Thread(target=lambda g=g, won=won: won.append("copy")
                             if g.enter_copy() else None)
        t.start()
        if g.abandon():
            won.append("abandon")
        t.join(5)
        assert not t.is_alive()
        assert len(won) == 1, won               # never both


def test_an_arena_with_a_slot_still_out_stays_mapped() -> None:
    arena = BounceArena(2, BLOCK)
    held = arena.take(1)
    assert held is not None
    arena.close()                                # a late call may still write the slot
    arena.view(held[0])[:4] = b"late"            # still mapped: no crash
    arena.give(held)
    done = BounceArena(1, BLOCK)
    done.close()
    with pytest.raises(ValueError):
        done.view(0)[:1] = b"x"                  # released after a clean close
