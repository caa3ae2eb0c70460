"""Verified pull loads (issue 18): which blocks a consumer rank checks, and the check.

A producer rank takes the digests of a request's blocks when it starts to
hold them (prefill is done, the layers are final: ``take_hold_digests``), so
whatever happens to that memory during the hold is caught. A pull consumer
asks, in the ``begin`` it sends before its READ, for the digests of the
producer blocks it is about to read; the producer answers in ``held``.
When the READ is done the consumer digests the blocks that landed and
compares. A block whose digest differs is a failed load of exactly that block.

A digest covers a whole block of one rank in every layer of its region, so it
is compared only where the consumer's block is byte for byte the producer's
block (:func:`whole_block_regions`): one source rank, the same offsets, the
same bytes per block, the same layers. That is every region at equal TP and
every replicated region (MLA latent, sliding-window); SPLIT regions read as
head slices at heterogeneous TP are counted unverified. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvbridge.layouts.digests import Digester, VerifyPolicy, unpack
from kvbridge.layouts.errors import LayoutError
from kvbridge.layouts.plan import RankPlan

#: at most this many block digests asked per ``begin`` (8 bytes each in the answer,
#: well inside a notification); blocks past it are counted unverified
MAX_ASK_BLOCKS = 1 << 16


def whole_block_regions(rank_plan: RankPlan, producer_rank: int,
                        local_block_bytes: Sequence[int], remote_block_bytes: Sequence[int],
                        remote_layers: Sequence[Sequence[int]]) -> frozenset[int]:
    """Regions whose blocks this consumer rank copies whole and unchanged from
    ``producer_rank``: their digests on both sides are of the same bytes.

    ``*_block_bytes[r]``: bytes of one block of one layer of region ``r`` on each
    side; ``remote_layers[r]``: the layer ids of region ``r`` on the producer rank.
    """
    out = set()
    for region in np.unique(rank_plan.regions).tolist():
        mask = rank_plan.regions == region
        if (rank_plan.producer_ranks[mask] != producer_rank).any():
            continue  # parts of a block come from several producer ranks
        if not np.array_equal(rank_plan.producer_offsets[mask], rank_plan.consumer_offsets[mask]):
            continue
        if region >= len(local_block_bytes) or region >= len(remote_block_bytes) or \
                local_block_bytes[region] != remote_block_bytes[region]:
            continue
        layers = sorted(set(rank_plan.layers[mask].tolist()))
        if region >= len(remote_layers) or layers != sorted(remote_layers[region]):
            continue  # another pipeline split: the digests would cover other layers
        out.add(int(region))
    return frozenset(out)


@dataclass(frozen=True)
class DigestAsk:
    """The blocks one consumer rank checks from one producer rank, per region.

    ``consumer_ids[r][i]`` receives ``producer_ids[r][i]``; regions not checked
    have empty lists. ``unverified``: blocks of the checked regions left out by
    the per-``begin`` bound (sampling leaves blocks out on purpose, not counted;
    regions not checked at all are counted once per load by the worker).
    """

    consumer_ids: tuple[tuple[int, ...], ...]
    producer_ids: tuple[tuple[int, ...], ...]
    unverified: int = 0
    #: per region, the position of each checked block in the load's block list
    positions: tuple[tuple[int, ...], ...] = ()
    #: per region, how many blocks the load has (a push answer covers all of them)
    totals: tuple[int, ...] = ()

    @property
    def num_blocks(self) -> int:
        return sum(len(ids) for ids in self.consumer_ids)


def plan_ask(policy: VerifyPolicy, request_id: str, regions: frozenset[int],
             consumer_ids: Sequence[Sequence[int]], producer_ids: Sequence[Sequence[int]]
             ) -> DigestAsk:
    """Which of a load's blocks to check (``regions``: :func:`whole_block_regions`)."""
    cons: list[tuple[int, ...]] = []
    prod: list[tuple[int, ...]] = []
    where: list[tuple[int, ...]] = []
    unverified = 0
    budget = MAX_ASK_BLOCKS
    for r, (c_ids, p_ids) in enumerate(zip(consumer_ids, producer_ids, strict=True)):
        if r not in regions or not policy.enabled:
            cons.append(())
            prod.append(())
            where.append(())
            continue
        picked = policy.chosen(request_id, r, len(c_ids))
        if len(picked) > budget:
            unverified += len(picked) - budget
            picked = picked[:budget]
        budget -= len(picked)
        cons.append(tuple(c_ids[i] for i in picked))
        prod.append(tuple(p_ids[i] for i in picked))
        where.append(tuple(picked))
    return DigestAsk(tuple(cons), tuple(prod), unverified, tuple(where),
                     tuple(len(ids) for ids in consumer_ids))


def take_hold_digests(digester: Digester, block_ids: Sequence[Sequence[int]]
                      ) -> tuple[dict[int, int], ...]:
    """Producer: ``block id -> digest`` per region of a request it starts to hold (its
    layers are final: prefill is done), answered later to any consumer that asks."""
    return tuple(dict(zip(ids, digester.block_digests(r, ids), strict=True))
                 for r, ids in enumerate(block_ids))


def answer_ask(held: Sequence[dict[int, int]], asked: Sequence[Sequence[int]]
               ) -> tuple[bytes, ...] | str:
    """Producer: the packed digests of ``asked`` blocks, or why it will not give them.

    Only blocks this rank holds for the request have digests (``held``: from
    :func:`take_hold_digests`), so a peer cannot make it hash arbitrary memory;
    at most :data:`MAX_ASK_BLOCKS` of them, so the answer fits a notification.
    """
    if len(asked) > len(held):
        return f"asked for {len(asked)} regions; the request has {len(held)}"
    if sum(len(ids) for ids in asked) > MAX_ASK_BLOCKS:  # the answer must fit a notification
        return f"more than {MAX_ASK_BLOCKS} digests asked (one notification's worth)"
    out = []
    for r, ids in enumerate(asked):
        mine = held[r]
        stray = [b for b in ids if b not in mine]
        if stray:
            return f"block {stray[0]} of region {r} is not held for this request"
        out.append(np.asarray([mine[b] for b in ids], dtype="<u8").tobytes())
    return tuple(out)


def check_answer(ask: DigestAsk, packed: Sequence[bytes], digester: Digester,
                 whole_load: bool = False) -> tuple[int, list[tuple[int, int]]]:
    """Consumer: (blocks verified, ``(region, consumer block id)`` of every mismatch).

    ``whole_load``: the answer has the digest of every block of the load (push:
    the producer does not know which blocks the consumer samples), not only of
    the asked ones. A malformed answer (wrong count) counts every asked block
    as a mismatch: nothing in it can be trusted.
    """
    bad: list[tuple[int, int]] = []
    verified = 0
    for r, ids in enumerate(ask.consumer_ids):
        if not ids:
            continue
        try:
            data = bytes(packed[r]) if r < len(packed) else b""
            if whole_load:
                every = unpack(data, ask.totals[r], f"pushed.dig[{r}]")
                want = tuple(every[i] for i in ask.positions[r])
            else:
                want = unpack(data, len(ids), f"held.dig[{r}]")
        except LayoutError:
            bad.extend((r, b) for b in ids)
            continue
        have = digester.block_digests(r, ids)
        for b, w, h in zip(ids, want, have, strict=True):
            if w == h:
                verified += 1
            else:
                bad.append((r, b))
    return verified, bad
