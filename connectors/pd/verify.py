"""Verified pull loads: which blocks a consumer rank checks, and the check.

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
every replicated region (MLA latent, sliding-window).

SPLIT regions read as head slices at heterogeneous TP (and blocks split over
another pipeline split) are compared with *slice digests*
(``layouts.digests.BlockDigester.slice_digests``, algorithm ``xxh3-64-slices``;
``torch-mix64-v1-slices`` with ``layouts.torch_digests``, for KV in GPU memory):
the digest of exactly the bytes one consumer rank reads from one producer
rank, in ascending order of their offset in the consumer's block
(:func:`slice_layers`); the producer hashes them at their source offsets, the
consumer at their destination offsets. A consumer asks for them in the same
``begin`` (with ``alg`` the slice algorithm, which then covers every region of
the ask; a region read whole has its block digest in the slice algorithm's
block algorithm as slice digest) only from a producer whose handshake lists
that algorithm; the consumer takes the first slice algorithm of its own
preference that a producer rank of the session offers
(:func:`pick_slice_algorithm`). An older producer's head slices stay
unverified as before. A consumer block assembled from several producer ranks
is verified when every one of them sent a matching slice digest
(:func:`count_slices`: each block counts once). The producer takes slice
digests as the hold starts for the consumer ranks it knows (their
``hello`` gave their topology, hence the plan); for a consumer rank it meets
later (its first request) it takes them when the ``begin`` comes, so a
corruption of the held blocks between the hold's start and that ``begin`` is
not seen for those blocks (counted in ``slice_digests_at_begin``). Push: a
``register`` asks with the same algorithm; the producer takes the slice digests
of that consumer rank's registered blocks once every layer is final, before its
remaining WRITEs, and answers a region that rank reads from another producer
rank empty. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvbridge.layouts.digests import (
    ALGORITHM,
    SLICE_ALGORITHM,
    SLICE_ALGORITHMS,
    Digester,
    SliceLayer,
    VerifyPolicy,
    merge_ranges,
    unpack,
)
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
    #: the algorithm asked for: the slice algorithm when a slice region has blocks asked
    algorithm: str = ALGORITHM
    #: regions checked with slice digests (counted by :func:`count_slices`, not here)
    slices: frozenset[int] = frozenset()
    #: per region, the blocks the policy chose before the per-``begin`` bound
    wanted: tuple[int, ...] = ()
    #: consumer: per slice region, the ranges that come from this producer rank
    #: (destination offsets) and the producer ranks its bytes come from
    slice_ranges: Mapping[int, tuple[SliceLayer, ...]] = field(default_factory=dict)
    slice_sources: Mapping[int, frozenset[int]] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return sum(len(ids) for ids in self.consumer_ids)

    @property
    def whole_blocks(self) -> int:
        """Blocks asked of regions checked whole (a producer's answer alone decides them)."""
        return sum(len(ids) for r, ids in enumerate(self.consumer_ids) if r not in self.slices)


def plan_ask(policy: VerifyPolicy, request_id: str, regions: frozenset[int],
             consumer_ids: Sequence[Sequence[int]], producer_ids: Sequence[Sequence[int]],
             slices: frozenset[int] = frozenset(), slice_algorithm: str = SLICE_ALGORITHM
             ) -> DigestAsk:
    """Which of a load's blocks to check (``regions``: :func:`whole_block_regions`;
    ``slices``: regions checked with slice digests in ``slice_algorithm``,
    :class:`SliceCheck`)."""
    cons: list[tuple[int, ...]] = []
    prod: list[tuple[int, ...]] = []
    where: list[tuple[int, ...]] = []
    wanted: list[int] = []
    unverified = 0
    budget = MAX_ASK_BLOCKS
    for r, (c_ids, p_ids) in enumerate(zip(consumer_ids, producer_ids, strict=True)):
        if (r not in regions and r not in slices) or not policy.enabled:
            cons.append(())
            prod.append(())
            where.append(())
            wanted.append(0)
            continue
        picked = policy.chosen(request_id, r, len(c_ids))
        wanted.append(len(picked))
        if len(picked) > budget:
            if r not in slices:  # slice blocks left out are counted by count_slices
                unverified += len(picked) - budget
            picked = picked[:budget]
        budget -= len(picked)
        cons.append(tuple(c_ids[i] for i in picked))
        prod.append(tuple(p_ids[i] for i in picked))
        where.append(tuple(picked))
    sliced = frozenset(r for r in slices if r < len(cons))
    algorithm = slice_algorithm if any(cons[r] for r in sliced) else ALGORITHM
    return DigestAsk(tuple(cons), tuple(prod), unverified, tuple(where),
                     tuple(len(ids) for ids in consumer_ids), algorithm, sliced,
                     tuple(wanted))


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


def _wanted(ask: DigestAsk, packed: Sequence[bytes], r: int, whole_load: bool
            ) -> tuple[int, ...]:
    """The digests an answer gives for region ``r``'s asked blocks, in the ask's order.

    ``whole_load``: ``packed`` has every block of the load (push), of which the asked
    ones are picked; else only the asked ones (pull). Raises :class:`LayoutError` for a
    malformed answer (wrong count)."""
    data = bytes(packed[r]) if r < len(packed) else b""
    if whole_load:
        every = unpack(data, ask.totals[r], f"pushed.dig[{r}]")
        return tuple(every[i] for i in ask.positions[r])
    return unpack(data, len(ask.consumer_ids[r]), f"held.dig[{r}]")


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
        if not ids or r in ask.slices:  # slice regions: check_slices
            continue
        try:
            want = _wanted(ask, packed, r, whole_load)
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


# --------------------------------------------------------------------------- slices


def slice_layers(rank_plan: RankPlan, producer_rank: int, region: int, side: str
                 ) -> tuple[SliceLayer, ...]:
    """The bytes of ``region`` one consumer rank reads from ``producer_rank``: per layer
    (ascending), their ranges in ascending order of their offset in the consumer's
    block, with ``side``'s offsets (``"producer"``: where they are read, ``"consumer"``:
    where they land). Both sides' slice digests over these ranges hash the same bytes
    in the same order; how the planner coalesced them does not matter."""
    if side not in ("producer", "consumer"):
        raise ValueError(f"side must be 'producer' or 'consumer', not {side!r}")
    mask = (rank_plan.producer_ranks == producer_rank) & (rank_plan.regions == region)
    layers = rank_plan.layers[mask]
    consumer_offsets = rank_plan.consumer_offsets[mask]
    offsets = rank_plan.producer_offsets[mask] if side == "producer" else consumer_offsets
    lengths = rank_plan.lengths[mask]
    order = np.lexsort((consumer_offsets, layers))
    out: list[SliceLayer] = []
    for layer in np.unique(layers).tolist():
        sel = order[layers[order] == layer]
        out.append((int(layer), merge_ranges(list(zip(offsets[sel].tolist(),
                                                      lengths[sel].tolist(), strict=True)))))
    return tuple(out)


def slice_bytes(layers: Sequence[SliceLayer]) -> int:
    """Bytes one block's slice digest reads."""
    return sum(n for _layer, ranges in layers for _o, n in ranges)


@dataclass(frozen=True)
class SlicePlan:
    """Producer: what one consumer rank reads from this producer rank, per region (the
    ranges of its slice digests, producer offsets; empty: nothing of that region).

    ``whole``: regions it reads whole and in order (e.g. TP 2 -> 1: a producer rank's
    whole head slice): their slice digest is the block digest, taken at hold start
    for every consumer anyway, so nothing more is hashed for them."""

    layers: tuple[tuple[SliceLayer, ...], ...]
    whole: frozenset[int]

    @property
    def needed(self) -> bool:
        """Whether this consumer rank needs digests besides the block digests."""
        return any(lay and r not in self.whole for r, lay in enumerate(self.layers))


def producer_slice_plan(rank_plan: RankPlan, producer_rank: int, block_bytes: Sequence[int],
                        region_layers: Sequence[Sequence[int]]) -> SlicePlan:
    """The :class:`SlicePlan` of one consumer rank's plan (``plan_consumer_rank``) as seen
    by ``producer_rank``; ``block_bytes[r]`` / ``region_layers[r]``: that rank's bytes of
    one block of one layer, and its layer ids, of region ``r``."""
    layers: list[tuple[SliceLayer, ...]] = []
    whole: set[int] = set()
    for r, nbytes in enumerate(block_bytes):
        lay = slice_layers(rank_plan, producer_rank, r, "producer")
        layers.append(lay)
        if (lay and sorted(layer for layer, _ in lay) == sorted(region_layers[r])
                and all(ranges == ((0, nbytes),) for _, ranges in lay)):
            whole.add(r)
    return SlicePlan(tuple(layers), frozenset(whole))


def take_slice_digests(digester: Digester, plan: SlicePlan,
                       block_ids: Sequence[Sequence[int]], held: Sequence[dict[int, int]]
                       ) -> tuple[dict[int, int], ...]:
    """Producer: ``block id -> slice digest`` per region for one consumer rank's plan:
    ``held``'s block digests (in the slice algorithm's block algorithm, which
    ``digester`` computes) where it reads blocks whole, hashed for the others (only
    ``block_ids``; nothing for a region it reads nothing of)."""
    out: list[dict[int, int]] = []
    for r, ids in enumerate(block_ids):
        if r in plan.whole and r < len(held):
            out.append(held[r])
        elif r < len(plan.layers) and plan.layers[r] and ids:
            unique = list(dict.fromkeys(ids))
            out.append(dict(zip(unique, digester.slice_digests(plan.layers[r], unique),
                                strict=True)))
        else:
            out.append({})
    return tuple(out)


@dataclass(frozen=True)
class SliceCheck:
    """Consumer: the regions of one session's plan checked with slice digests.

    ``sources[r]``: the producer ranks region ``r``'s bytes come from (each must
    answer); ``ranges[p][r]``: the ranges from producer rank ``p`` (destination
    offsets); ``why``: why other regions not read whole are left unverified;
    ``algorithm``: the slice algorithm asked for (:func:`pick_slice_algorithm`)."""

    regions: frozenset[int] = frozenset()
    sources: Mapping[int, frozenset[int]] = field(default_factory=dict)
    ranges: Mapping[int, Mapping[int, tuple[SliceLayer, ...]]] = field(default_factory=dict)
    why: str = ""
    algorithm: str = SLICE_ALGORITHM

    def regions_of(self, producer_rank: int) -> frozenset[int]:
        return frozenset(self.ranges.get(producer_rank, {}))


def pick_slice_algorithm(mine: Sequence[str], offered: Mapping[int, Sequence[str]]
                         ) -> str | None:
    """Consumer: the slice algorithm of a session: the first of ``mine`` (the slice
    algorithms this rank computes, preference order) that a producer rank offers
    (``offered[p]``: its handshake's algorithms). A producer rank predicts it with the
    same rule from the consumer's handshake (:func:`answered_slice_algorithm`)."""
    return next((alg for alg in mine if any(alg in algs for algs in offered.values())), None)


def answered_slice_algorithm(consumer_offers: Sequence[str], mine: Collection[str]
                             ) -> str | None:
    """Producer: the slice algorithm a consumer rank whose handshake offers
    ``consumer_offers`` (its preference order) will ask this rank for, when this rank
    computes ``mine``: the first slice algorithm of the consumer's that this rank offers
    (what :func:`pick_slice_algorithm` picks when this rank is the one offering it)."""
    return next((alg for alg in consumer_offers if alg in SLICE_ALGORITHMS and alg in mine),
                None)


def plan_slice_check(rank_plan: RankPlan, whole: Mapping[int, frozenset[int]],
                     offering: Collection[int], algorithm: str = SLICE_ALGORITHM
                     ) -> SliceCheck:
    """Which regions a consumer rank checks with slice digests in ``algorithm``: those no
    producer rank covers whole (``whole[p]``: :func:`whole_block_regions`) whose every
    source is in ``offering`` (its handshake lists ``algorithm``)."""
    chosen: set[int] = set()
    sources: dict[int, frozenset[int]] = {}
    ranges: dict[int, dict[int, tuple[SliceLayer, ...]]] = {}
    lacking: set[int] = set()
    for region in np.unique(rank_plan.regions).tolist():
        srcs = frozenset(int(p) for p in
                         np.unique(rank_plan.producer_ranks[rank_plan.regions == region]))
        if any(region in whole.get(p, frozenset()) for p in srcs):
            continue  # checked whole
        missing = srcs - set(offering)
        if missing:
            lacking |= missing
            continue
        chosen.add(int(region))
        sources[int(region)] = srcs
        for p in srcs:
            ranges.setdefault(p, {})[int(region)] = slice_layers(rank_plan, p, region,
                                                                 "consumer")
    why = (f"producer rank(s) {sorted(lacking)} offer no {algorithm} digests (an older "
           f"kvbridge, no algorithm in common, or verification off there): the head "
           f"slices read from them are not verified") if lacking else ""
    return SliceCheck(frozenset(chosen), sources, ranges, why, algorithm)


def check_slices(ask: DigestAsk, packed: Sequence[bytes], digester: Digester,
                 whole_load: bool = False) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Consumer: ``(region, consumer block id)`` of the slice-region blocks whose part
    from this producer rank matched its answer, and of those that did not (a malformed
    answer: every asked block of the region). ``whole_load`` as in :func:`check_answer`."""
    matched: list[tuple[int, int]] = []
    bad: list[tuple[int, int]] = []
    for r in sorted(ask.slices):
        ids = ask.consumer_ids[r]
        if not ids:
            continue
        try:
            want = _wanted(ask, packed, r, whole_load)
        except LayoutError:
            bad.extend((r, b) for b in ids)
            continue
        have = digester.slice_digests(ask.slice_ranges[r], ids)
        for b, w, h in zip(ids, want, have, strict=True):
            (matched if w == h else bad).append((r, b))
    return matched, bad


def count_slices(asks: Mapping[int, DigestAsk], matched: Mapping[int, Collection[tuple[int, int]]],
                 bad: Collection[tuple[int, int]]) -> tuple[int, int]:
    """Consumer: (blocks verified, blocks unverified) of a load's slice regions.

    A block is verified when every producer rank its bytes come from sent a slice
    digest its part matched; one that failed nowhere but has a part not checked
    (no answer, the per-``begin`` bound) is unverified; a failed one is neither
    (it is a mismatch). Each block counts once, whatever its number of sources;
    ``matched[p]``: :func:`check_slices` of producer rank ``p``'s answer.
    """
    verified = unverified = 0
    regions = sorted({r for ask in asks.values() for r in ask.slices})
    for r in regions:
        with_r = [a for a in asks.values() if r in a.slices]
        wanted = max((a.wanted[r] for a in with_r if r < len(a.wanted)), default=0)
        sources = next((a.slice_sources[r] for a in with_r if r in a.slice_sources),
                       frozenset())
        ok: set[int] | None = None
        for p in sources:
            got = {b for region, b in matched.get(p, ()) if region == r}
            ok = got if ok is None else ok & got
        failed = {b for region, b in bad if region == r}
        good = len((ok or set()) - failed)
        verified += good
        unverified += max(0, wanted - good - len(failed))
    return verified, unverified
