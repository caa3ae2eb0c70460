"""Paged block pool of one region with prefix caching, reference counts and LRU reuse.

Invariants (asserted where breaking them would corrupt KV):

* A block is *free* (in the free queue) iff its reference count is 0.
* A cached block (one with a hash) that becomes free keeps its hash and stays
  findable until it is reallocated; reallocation evicts the hash first.
* The free queue is least-recently-freed first, so the oldest cached prefix is
  reused first (vLLM's order). Which blocks an allocation takes follows that
  queue; the order they are handed out in is ascending by default (contiguous
  runs for transfers), queue order with ``sorted_allocation=False``.
* Only blocks whose tokens are all computed get a hash (``cache_block``): a
  block being loaded or written by a connector is never findable.

KV events (only with ``emit_events``, as vLLM's ``enable_kv_cache_events``): a
block that becomes findable is announced in a ``BlockStored`` (medium GPU: the
engine's primary blocks) and a hash that stops being findable -- evicted for
reuse, or forgotten -- in a ``BlockRemoved``, in the order they happen.
Invariant: every hash announced stored is announced removed before it can be
announced stored again, so a subscriber's index equals ``cached_hashes()``.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvbridge.events import BlockRemoved, BlockStored, KVEvent, Locality, Medium
from kvbridge.layouts import BlockHash


class NoFreeBlocks(Exception):
    """Fewer free blocks than requested (the scheduler preempts or waits)."""


class BlockPool:
    """Blocks of one region (KV-cache group ``group_idx``), ``block_size`` tokens each."""

    def __init__(self, num_blocks: int, *, block_size: int = 1, group_idx: int | None = None,
                 emit_events: bool = False, sorted_allocation: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: expected >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size: expected >= 1 token, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.group_idx = group_idx
        self.emit_events = emit_events
        self.sorted_allocation = sorted_allocation
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_of: dict[int, BlockHash] = {}
        self._cached: dict[BlockHash, int] = {}
        self.num_evicted = 0
        self._events: list[KVEvent] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh blocks with reference count 1 (evicting their old hashes).

        The blocks are the ``count`` least recently freed; with ``sorted_allocation``
        they are returned in ascending id order (contiguous runs where the free
        queue holds neighbours), else in queue order (vLLM's).
        """
        if count > len(self._free):
            raise NoFreeBlocks(f"need {count} blocks, {len(self._free)} free")
        blocks = []
        evicted: list[BlockHash] = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            assert self._ref[block_id] == 0, f"free block {block_id} has references"
            old = self._hash_of.pop(block_id, None)
            if old is not None:
                del self._cached[old]
                evicted.append(old)
            self._ref[block_id] = 1
            blocks.append(block_id)
        self.num_evicted += len(evicted)
        self._removed(evicted)
        if self.sorted_allocation:
            blocks.sort()
        return blocks

    def next_allocation(self, count: int) -> list[int]:
        """The block ids :meth:`allocate` would return for ``count`` now (nothing taken)."""
        blocks = list(itertools.islice(self._free, count))
        return sorted(blocks) if self.sorted_allocation else blocks

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

    def cache_full_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash],
                          token_ids: Sequence[int], num_full: int,
                          extra_keys: tuple[object, ...] | None = None) -> int:
        """Cache the first ``num_full`` blocks of a request (``block_ids[i]`` holds tokens
        ``[i * block_size, (i + 1) * block_size)`` and has hash ``block_hashes[i]``).

        Blocks already cached are skipped. Each run of consecutive newly cached
        blocks is announced in one ``BlockStored``: its hashes, the hash of the
        block before the run as parent (None for a request's first block), its
        token ids, and ``extra_keys`` (what besides the tokens went into each
        block's hash) once per block. Returns how many blocks became findable.
        """
        num_new = 0
        run_start: int | None = None
        for index in range(num_full):
            if self.cache_block(block_ids[index], block_hashes[index]):
                num_new += 1
                if run_start is None:
                    run_start = index
                continue
            if run_start is not None:
                self._stored(run_start, index, block_hashes, token_ids, extra_keys)
                run_start = None
        if run_start is not None:
            self._stored(run_start, num_full, block_hashes, token_ids, extra_keys)
        return num_new

    def uncache_block(self, block_id: int) -> None:
        """Forget a block's hash (its bytes are not trusted any more)."""
        old = self._hash_of.pop(block_id, None)
        if old is not None:
            del self._cached[old]
            self._removed([old])

    def drop_unreferenced(self, *, emit: bool = True) -> list[BlockHash]:
        """Forget the hash of every cached block no request references (a prefix-cache
        reset); returns the forgotten hashes. ``emit=False``: the caller announces the
        reset itself (e.g. one ``AllBlocksCleared`` for every pool)."""
        dropped = self.unreferenced_cached()
        for block_hash in dropped:
            del self._hash_of[self._cached.pop(block_hash)]
        if emit:
            self._removed(dropped)
        return dropped

    def unreferenced_cached(self) -> list[BlockHash]:
        """Hashes of cached blocks that no request references (a reset would drop them)."""
        return [block_hash for block_id, block_hash in self._hash_of.items()
                if self._ref[block_id] == 0]

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> set[BlockHash]:
        return set(self._cached)

    def take_events(self) -> list[KVEvent]:
        """Events since the last call, oldest first (empty unless ``emit_events``)."""
        events, self._events = self._events, []
        return events

    def _stored(self, start: int, end: int, block_hashes: Sequence[BlockHash],
                token_ids: Sequence[int], extra_keys: tuple[object, ...] | None) -> None:
        if not self.emit_events:
            return
        size = self.block_size
        self._events.append(BlockStored(
            block_hashes=tuple(block_hashes[start:end]),
            parent_block_hash=block_hashes[start - 1] if start else None,
            token_ids=tuple(token_ids[start * size:end * size]),
            block_size=size, medium=Medium.GPU.value,
            extra_keys=(tuple(extra_keys for _ in range(start, end))
                        if extra_keys is not None else None),
            group_idx=self.group_idx, locality=Locality.LOCAL.value))

    def _removed(self, block_hashes: list[BlockHash]) -> None:
        if self.emit_events and block_hashes:
            self._events.append(BlockRemoved(block_hashes=tuple(block_hashes),
                                             medium=Medium.GPU.value, group_idx=self.group_idx,
                                             locality=Locality.LOCAL.value))

    def hash_of(self, block_id: int) -> BlockHash | None:
        return self._hash_of.get(block_id)

    def check(self) -> None:
        """Assert the invariants (tests call this after every workload)."""
        for block_id in range(self.num_blocks):
            assert (self._ref[block_id] == 0) == (block_id in self._free), block_id
        for block_hash, block_id in self._cached.items():
            assert self._hash_of[block_id] == block_hash
