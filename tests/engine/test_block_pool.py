"""Block pool: reference counts, prefix caching, LRU reuse and eviction."""

from __future__ import annotations

import pytest

from kvbridge.engine.block_pool import BlockPool, NoFreeBlocks


def test_allocate_free_and_counts() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and all(pool.ref_count(b) == 1 for b in a)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    pool.free(a)
    assert pool.num_free == 4
    pool.check()
    with pytest.raises(AssertionError, match="double free"):
        pool.free([a[0]])


def test_cached_prefix_survives_free_until_reused() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    assert pool.cache_block(blocks[0], b"h0") and pool.cache_block(blocks[1], b"h1")
    assert not pool.cache_block(blocks[1], b"h1")  # already cached
    assert pool.find_prefix([b"h0", b"h1", b"h2"]) == blocks
    pool.free(blocks)
    assert pool.find_prefix([b"h0", b"h1"]) == blocks  # free but still findable
    pool.touch(pool.find_prefix([b"h0"]))  # a hit takes it out of the free queue
    assert pool.ref_count(blocks[0]) == 1 and pool.num_free == 2
    fresh = pool.allocate(2)  # reuses the never-cached block, then the LRU cached one
    assert blocks[1] in fresh and pool.find_prefix([b"h0", b"h1"]) == [blocks[0]]
    assert pool.num_evicted == 1
    pool.free(fresh)
    pool.free([blocks[0]])
    pool.check()


def test_uncached_block_is_not_found() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"x")
    pool.uncache_block(block)
    assert pool.find_prefix([b"x"]) == []
    pool.free([block])
    pool.check()


@pytest.mark.parametrize("sorted_allocation", [True, False])
def test_allocation_takes_least_recently_freed_blocks_sorted_or_in_queue_order(
        sorted_allocation: bool) -> None:
    """A request frees its blocks tail first, so the free queue runs downwards; the
    next allocation takes the same least recently freed blocks either way, handed out
    ascending (contiguous runs for transfers) or in queue order (vLLM's)."""
    pool = BlockPool(10, sorted_allocation=sorted_allocation)
    first = pool.allocate(8)
    assert first == list(range(8))
    pool.free(first)  # free queue: 8, 9, 7, 6, 5, 4, 3, 2, 1, 0
    queue_order = [8, 9, 7, 6, 5, 4]
    want = sorted(queue_order) if sorted_allocation else queue_order
    assert pool.next_allocation(6) == want
    assert pool.allocate(6) == want
    assert pool.num_free == 4
    pool.check()
