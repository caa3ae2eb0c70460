"""Paged block pool of one region with prefix caching, reference counts and LRU reuse.

Invariants (asserted where breaking them would corrupt KV):

* A block is *free* (in the free queue) iff its reference count is 0.
* A cached block (one with a hash) that becomes free keeps its hash and stays
  findable until it is reallocated; reallocation evicts the hash first.
* The free queue is least-recently-freed first, so the oldest cached prefix is
  reused first (vLLM's order).
* Only blocks whose tokens are all computed get a hash (``cache_block``): a
  block being loaded or written by a connector is never findable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvbridge.layouts import BlockHash


class NoFreeBlocks(Exception):
    """Fewer free blocks than requested (the scheduler preempts or waits)."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: expected >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_of: dict[int, BlockHash] = {}
        self._cached: dict[BlockHash, int] = {}
        self.evicted_hashes: list[BlockHash] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh blocks with reference count 1 (evicting their old hashes)."""
        if count > len(self._free):
            raise NoFreeBlocks(f"need {count} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            assert self._ref[block_id] == 0, f"free block {block_id} has references"
            old = self._hash_of.pop(block_id, None)
            if old is not None:
                del self._cached[old]
                self.evicted_hashes.append(old)
            self._ref[block_id] = 1
            blocks.append(block_id)
        return blocks

    def find_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Cached blocks of the longest prefix of ``hashes`` (no references taken)."""
        found = []
        for block_hash in hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks (prefix hits), pulling free ones out of the queue."""
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                del self._free[block_id]
            self._ref[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference of each block; blocks reaching 0 join the free queue.

        Freed in reverse so a request's tail blocks are reused before its head
        (the head is the more shareable prefix).
        """
        for block_id in reversed(list(block_ids)):
            assert self._ref[block_id] > 0, f"double free of block {block_id}"
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                self._free[block_id] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Make a fully computed block findable by ``block_hash``. False if already cached."""
        assert self._ref[block_id] > 0, f"caching unreferenced block {block_id}"
        if block_id in self._hash_of:
            return False
        if block_hash in self._cached:  # same content computed twice: keep the first
            return False
        self._hash_of[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True

    def uncache_block(self, block_id: int) -> None:
        """Forget a block's hash (its bytes are not trusted any more)."""
        old = self._hash_of.pop(block_id, None)
        if old is not None:
            del self._cached[old]

    def hash_of(self, block_id: int) -> BlockHash | None:
        return self._hash_of.get(block_id)

    def check(self) -> None:
        """Assert the invariants (tests call this after every workload)."""
        for block_id in range(self.num_blocks):
            assert (self._ref[block_id] == 0) == (block_id in self._free), block_id
        for block_hash, block_id in self._cached.items():
            assert self._hash_of[block_id] == block_hash
