"""Property test of the manager: random interleavings of requests over a tier with bad blocks.

The tier is an in-memory ``Tier`` run by the real ``TierRunner`` (our own interface, not a mocked
backend) whose loads of "bad" keys always fail. For any sequence of lookups,
stores, steps and finishes: no request ever sees the same key fail twice, every
request reaches a final verdict within a bounded number of steps, the async
lookup entries are gone once no request references them, and no slot stays
pinned after every request finished.
"""

from __future__ import annotations

import errno
import threading
from collections import Counter
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.offload.cpu import CpuTier
from kvbridge.offload.manager import OffloadManager
from kvbridge.offload.runner import TierRunner
from kvbridge.offload.tier import BlockBuffers, Tier
from kvbridge.offload.types import BatchIOError, OffloadKey

BLOCK = 64


class MemTier(Tier):
    def __init__(self, bad: set[OffloadKey]) -> None:
        super().__init__("mem", BLOCK)
        self.blobs: dict[OffloadKey, bytes] = {}
        self.bad = bad
        self.lock = threading.Lock()
        self.probed: Counter[OffloadKey] = Counter()
        self.load_attempts: Counter[OffloadKey] = Counter()

    def probe(self, keys: Sequence[OffloadKey]) -> list[bool]:
        with self.lock:
            self.probed.update(keys)
            return [k in self.blobs for k in keys]

    def load(self, keys: Sequence[OffloadKey], buffers: BlockBuffers,
             digests_out: list[tuple[int, ...] | None]) -> None:
        for i, (key, views) in enumerate(zip(keys, buffers, strict=True)):
            with self.lock:
                blob = self.blobs.get(key)
                self.load_attempts[key] += 1
            if blob is None or key in self.bad:
                raise BatchIOError(i, OSError(errno.EIO, "bad block"))
            views[0][:] = blob
            digests_out.append(None)            # stored without digests

    def store(self, keys: Sequence[OffloadKey], buffers: BlockBuffers,
              digests: Sequence[tuple[int, ...] | None]) -> None:
        with self.lock:
            for key, views in zip(keys, buffers, strict=True):
                self.blobs[key] = bytes(views[0])


def key(i: int) -> bytes:
    return b"k%d" % i


ops = st.lists(st.tuples(st.sampled_from(["lookup", "store", "step", "finish", "evict"]),
                         st.integers(0, 3), st.integers(1, 6)), min_size=5, max_size=60)


@settings(max_examples=100, deadline=None)
@given(ops=ops, bad=st.sets(st.integers(0, 5), max_size=3), slots=st.integers(2, 6))
def test_no_request_sees_a_key_fail_twice_and_all_settle(ops, bad, slots) -> None:
    mem = MemTier({key(i) for i in bad})
    tier = TierRunner(mem, read_threads=1, write_threads=1)
    enqueued: Counter[OffloadKey] = Counter()    # every probe enqueue, ever
    tier.cache.on_enqueue = lambda k: enqueued.update((k,))
    m = OffloadManager(CpuTier(slots, BLOCK), [tier])
    live: set[str] = set()
    generation = {r: 0 for r in range(4)}
    try:
        # every block is stored once so the tier can serve it
        spec = m.prepare_store("seed", [key(i) for i in range(6)])
        m.complete_store(spec.keys)
        m.request_finished("seed")
        assert m.wait_idle()
        for op, r, n in ops:
            rid = f"r{r}.{generation[r]}"
            keys = [key(i) for i in range(n)]
            if op == "lookup":
                live.add(rid)
                m.lookup(rid, keys)
            elif op == "store":
                spec = m.prepare_store(rid, keys)
                m.complete_store(spec.keys)
            elif op == "step":
                assert m.wait_idle()
            elif op == "finish" and rid in live:
                m.request_finished(rid)
                live.discard(rid)
                generation[r] += 1
            elif op == "evict":
                spec = m.prepare_store("filler", [b"f%d.%d" % (r, i) for i in range(slots)])
                m.complete_store(spec.keys)
        # every live request settles within a bounded number of steps
        for rid in sorted(live):
            keys = [key(i) for i in range(6)]
            before = set(m.failed_loads(rid))
            for _ in range(50):
                result = m.lookup(rid, keys)
                if result.ready:
                    break
                assert m.wait_idle()
            else:
                raise AssertionError(f"{rid} never settled")
            after = m.failed_loads(rid)
            assert before <= set(after)
            assert not set(after) & set(keys[:result.num_blocks]), "a failed key was a hit"
            m.request_finished(rid)
        assert m.wait_idle()
        assert len(tier.cache) == 0 and tier.cache.num_requests == 0
        assert all(not s.pinned_by for s in m.primary._slots.values())
        assert mem.probed == enqueued
        # at most one failed load per lookup entry: a failure is never retried while
        # any request still references the entry (the livelock rule)
        for i in bad:
            k = key(i)
            assert mem.load_attempts[k] <= enqueued[k], (k, mem.load_attempts[k], enqueued[k])
    finally:
        m.shutdown()
