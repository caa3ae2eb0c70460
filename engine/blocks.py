"""The engine's KV blocks: one pool per region, the blocks kept out of circulation, and
the blocks a worker reported invalid.

:class:`BlockSpace` is the one owner of block bookkeeping in
:class:`~kvbridge.engine.core.Engine`. Other parts ask it for blocks and hand them
back through its methods; only it changes a pool, the quarantine or the invalid
marks. It is also the only caller of a request's block methods, so a request's
block lists and the pools' reference counts change together.

Owns:

* ``pools``: one :class:`~kvbridge.engine.block_pool.BlockPool` per region,
  ``num_blocks`` blocks each, ``tokens_per_block[r]`` tokens per block;
* the quarantine: ``(region, block_id)`` never freed again, because a late
  transfer may still write them (they stay referenced, so ``idle_problems``
  counts them as expected);
* the invalid marks: ``(region, block_id)`` a worker reported invalid and no load
  has claimed yet (a sync load claims them in the step that reports them; an async
  one when its receive finishes).

May not touch: requests' queues or ends (:mod:`kvbridge.engine.scheduling`,
:mod:`kvbridge.engine.lifecycle`), what an invalid block means for a load
(:mod:`kvbridge.engine.loads`), events publishing (:mod:`kvbridge.engine.outlet`).
"""

from __future__ import annotations

from kvbridge.engine.block_pool import BlockPool
from kvbridge.engine.request import EngineRequest, blocks_needed, common_hit_tokens
from kvbridge.events import KVEvent

#: ``(region, block_id)``
BlockRef = tuple[int, int]


class BlockSpace:
    """Every region's blocks of one engine. Not thread-safe."""

    def __init__(self, num_blocks: int, tokens_per_block: tuple[int, ...], *,
                 prefix_caching: bool, emit_events: bool, sorted_allocation: bool) -> None:
        #: tokens one block of region r covers (``block_size * dcp_size`` if token-sharded)
        self.tokens_per_block = tokens_per_block
        #: full blocks become findable by their chained hash
        self.prefix_caching = prefix_caching
        self.pools = [BlockPool(num_blocks, block_size=t, group_idx=r, emit_events=emit_events,
                                sorted_allocation=sorted_allocation)
                      for r, t in enumerate(tokens_per_block)]
        self._quarantined: list[BlockRef] = []
        self._invalid: set[BlockRef] = set()

    @property
    def num_regions(self) -> int:
        return len(self.pools)

    @property
    def max_request_tokens(self) -> int:
        """Tokens of KV one request can ever hold: what the smallest region's pool holds."""
        return min(pool.num_blocks * t for pool, t in zip(self.pools, self.tokens_per_block,
                                                          strict=True))

    def _empty(self) -> list[list[int]]:
        return [[] for _ in range(self.num_regions)]

    # ------------------------------------------------------------------ giving and taking

    def allocate_for(self, req: EngineRequest, total_tokens: int) -> bool:
        """Grow every region's block list to cover ``total_tokens``; all or nothing."""
        needs = [blocks_needed(total_tokens, t) - len(req.block_ids[r])
                 for r, t in enumerate(self.tokens_per_block)]
        if any(need > self.pools[r].num_free for r, need in enumerate(needs)):
            return False
        for r, need in enumerate(needs):
            if need > 0:
                req.extend_blocks(r, self.pools[r].allocate(need))
        return True

    def free_preempted(self, req: EngineRequest) -> None:
        """A preempted request's blocks go back to the pools (its invalid marks stay:
        a report about them may still be claimed)."""
        for r, ids in enumerate(req.block_ids):
            self.pools[r].free(ids)
        req.clear_blocks()

    def release(self, req: EngineRequest) -> None:
        """A finished request's blocks go back to the pools, and their invalid marks
        with them (a freed block's next owner starts clean)."""
        for r, ids in enumerate(req.block_ids):
            self.pools[r].free(ids)
            self._invalid -= {(r, b) for b in ids}
        req.clear_blocks()

    def quarantine_after(self, req: EngineRequest, keep_tokens: int) -> None:
        """Keep the request's blocks past its first ``keep_tokens`` tokens referenced
        forever (a late transfer may still write them); it keeps the rest."""
        for r, t in enumerate(self.tokens_per_block):
            keep = keep_tokens // t
            self._quarantined.extend((r, b) for b in req.block_ids[r][keep:])
            req.set_blocks(r, req.block_ids[r][:keep])

    def quarantine_all(self, req: EngineRequest) -> None:
        """Keep all the request's blocks referenced forever; it holds none afterwards."""
        for r, ids in enumerate(req.block_ids):
            self._quarantined.extend((r, b) for b in ids)
        req.clear_blocks()

    # ------------------------------------------------------------------ prefix cache

    def local_hit(self, req: EngineRequest) -> tuple[int, list[list[int]]]:
        """Tokens of ``req`` this engine's prefix cache holds, and those blocks
        (not yet referenced: :meth:`take_hit`)."""
        if not self.prefix_caching:
            return 0, self._empty()
        found = [self.pools[r].find_prefix(req.hashes[r]) for r in range(self.num_regions)]
        tokens = common_hit_tokens([len(f) for f in found], self.tokens_per_block)
        # at least one token must be computed to produce the next token
        while tokens >= req.num_tokens and tokens > 0:
            tokens = common_hit_tokens([tokens // t - 1 for t in self.tokens_per_block],
                                       self.tokens_per_block)
        blocks = [f[:tokens // t] for f, t in zip(found, self.tokens_per_block, strict=True)]
        return tokens, blocks

    def take_hit(self, req: EngineRequest, hit_blocks: list[list[int]]) -> None:
        """Reference the hit blocks and make them the request's first blocks."""
        for r, ids in enumerate(hit_blocks):
            self.pools[r].touch(ids)
            req.set_blocks(r, ids)

    def undo_hit(self, req: EngineRequest, hit_blocks: list[list[int]] | None) -> None:
        """Give back what :meth:`take_hit` took (the request could not be allocated)."""
        if hit_blocks is None:
            return
        for r in range(self.num_regions):
            self.pools[r].free(req.block_ids[r])
            req.set_blocks(r, [])

    def cache_full_blocks(self, req: EngineRequest) -> None:
        if not self.prefix_caching:
            return
        # what besides the tokens went into each block's hash (see update_hashes)
        extra: tuple[object, ...] | None = (req.spec.cache_salt,) if req.spec.cache_salt \
            else None
        for r, t in enumerate(self.tokens_per_block):
            full = min(req.num_computed_tokens // t, len(req.hashes[r]), len(req.block_ids[r]))
            self.pools[r].cache_full_blocks(req.block_ids[r], req.hashes[r], req.token_ids,
                                            full, extra)

    def drop_unreferenced(self) -> tuple[int, bool]:
        """Forget every cached block no request references: ``(how many, whether that
        left no cached block in any pool)``. A full clear emits no per-hash removals
        (the caller announces ``AllBlocksCleared``)."""
        clears_all = all(pool.num_cached == len(pool.unreferenced_cached())
                         for pool in self.pools)
        count = sum(len(pool.drop_unreferenced(emit=not clears_all)) for pool in self.pools)
        return count, clears_all

    def take_events(self) -> list[KVEvent]:
        return [event for pool in self.pools for event in pool.take_events()]

    # ------------------------------------------------------------------ invalid marks

    def owned(self, req: EngineRequest) -> set[BlockRef]:
        return {(r, b) for r, ids in enumerate(req.block_ids) for b in ids}

    def first_invalid_token(self, req: EngineRequest, start: int, end: int,
                            refs: set[BlockRef]) -> int | None:
        """First token in ``[start, end)`` held by a block in ``refs`` (None: all valid)."""
        first: int | None = None
        for r, t in enumerate(self.tokens_per_block):
            ids = req.block_ids[r]
            for index in range(start // t, min(len(ids), -(-end // t))):
                if (r, ids[index]) in refs:
                    token = max(start, index * t)
                    first = token if first is None else min(first, token)
                    break
        return first

    def mark_invalid(self, refs: set[BlockRef]) -> None:
        self._invalid |= refs

    def unmark_invalid(self, refs: set[BlockRef]) -> None:
        self._invalid -= refs

    def claim_invalid(self, req: EngineRequest) -> set[BlockRef]:
        """The invalid marks on ``req``'s blocks, removed (its receive consumed them)."""
        refs = self._invalid & self.owned(req)
        self._invalid -= refs
        return refs

    # ------------------------------------------------------------------ inspection

    def num_used(self) -> list[int]:
        return [pool.num_used for pool in self.pools]

    @property
    def num_quarantined(self) -> int:
        return len(self._quarantined)

    def problems(self) -> list[str]:
        """Blocks still referenced beyond the quarantine (checks each pool's invariants)."""
        problems = []
        for r, pool in enumerate(self.pools):
            pool.check()
            expected_used = sum(1 for q in self._quarantined if q[0] == r)
            if pool.num_used != expected_used:
                problems.append(f"region {r}: {pool.num_used} blocks still referenced")
        return problems
