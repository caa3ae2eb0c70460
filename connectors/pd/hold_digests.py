"""Producer rank: the digests of held blocks, taken and served so consumers can check what they read.

As a pull hold starts (the KV is final) the rank takes the digests of the
request's blocks in its first algorithm, in the others consumers asked for
before, and the head-slice digests of the consumer ranks it knows that read
slices of it (at most ``MAX_HOLD_SLICE_PLANS`` plans, each in the slice algorithm
that consumer rank will ask for); a ``begin`` asking for
digests is answered from them (taken then, of the asked blocks only, when its
consumer rank or algorithm was not known as the hold started).

Owns: ``_hold_digests``, ``_alg_digests``, ``_hold_algs``, ``_hold_slices``,
``_slice_plans`` and the producer's digest counters. May not touch: the leases
or what is sent (:mod:`.holds` answers), the consumer peers (the caller names
them), nor the push jobs' digests (:mod:`.push` takes those when every layer is
final; it asks :meth:`HoldDigests.want` to add an algorithm).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from kvbridge.connectors.pd import messages
from kvbridge.connectors.pd.verify import (
    MAX_ASK_BLOCKS,
    SlicePlan,
    answer_ask,
    answered_slice_algorithm,
    producer_slice_plan,
    take_hold_digests,
    take_slice_digests,
)
from kvbridge.connectors.pd.worker_state import (
    MAX_CONSUMER_PEERS,
    WorkerContext,
    _ConsumerPeer,
)
from kvbridge.layouts import LayoutError, ParallelTopology
from kvbridge.layouts.digests import SLICE_ALGORITHMS
from kvbridge.layouts.plan import plan_consumer_rank

#: consumer-rank plans a producer rank takes slice digests for as a hold starts, at most
#: (more known consumer topologies: the others' are taken when their ``begin`` comes)
MAX_HOLD_SLICE_PLANS = 16


class HoldDigests:
    """The producer's digests of held blocks, taken as holds start and served."""

    def __init__(self, cx: WorkerContext) -> None:
        self.cx = cx
        #: other algorithms consumers asked for, taken as holds start too
        self._hold_algs: set[str] = set()
        #: (request id, algorithm) -> digests per region in a non-first algorithm
        self._alg_digests: dict[tuple[str, str], tuple[dict[int, int], ...]] = {}
        #: block id -> digest per region of each request held (taken when the hold
        #: starts), to answer the digest asks of consumers
        self._hold_digests: dict[str, tuple[dict[int, int], ...]] = {}
        #: per consumer rank topology, what it reads from this rank (slices)
        self._slice_plans: dict[ParallelTopology, SlicePlan | None] = {}
        #: per request held, per (consumer rank topology, slice algorithm) known at hold
        #: start, block id -> slice digest per region (head slices at another TP)
        self._hold_slices: dict[str, dict[tuple[ParallelTopology, str],
                                          tuple[dict[int, int], ...]]] = {}

    @property
    def algorithms(self) -> frozenset[str]:
        """The algorithms besides the first that consumers asked for (taken at hold start)."""
        return frozenset(self._hold_algs)

    def want(self, alg: str) -> None:
        """A consumer asked for ``alg``: take it as every later hold starts too."""
        self._hold_algs.add(alg)

    def forget(self, request_id: str) -> None:
        """The hold of ``request_id`` ended: its digests go."""
        self._hold_digests.pop(request_id, None)
        self._hold_slices.pop(request_id, None)
        for alg in self._hold_algs:
            self._alg_digests.pop((request_id, alg), None)

    def take(self, request_id: str, block_ids: Sequence[Sequence[int]],
             consumers: Iterable[_ConsumerPeer]) -> None:
        """Producer: digests of a request's blocks as its hold starts (the KV is final),
        and the slice digests of the ``consumers`` known now that read slices of it."""
        if self.cx.digester is None:
            return
        try:
            started = time.perf_counter()
            self._hold_digests[request_id] = take_hold_digests(self.cx.digester, block_ids)
            self.cx.count_digests(started, block_ids)
            for alg in self._hold_algs:  # other algorithms consumers asked for before
                started = time.perf_counter()
                self._alg_digests[(request_id, alg)] = take_hold_digests(
                    self.cx.digesters[alg], block_ids)
                self.cx.count_digests(started, block_ids)
        except LayoutError as exc:  # a block id outside the tensors: no digests, said why
            self.cx.log.warning("pd: producer engine=%s rank=%d request=%s: no digests: %s",
                           self.cx.engine_id, self.cx.rank_index, request_id, exc)
            return
        self._take_hold_slices(request_id, block_ids, consumers)

    def digests_for(self, begin: messages.Begin) -> tuple[tuple[bytes, ...], str]:
        """Producer: digests of the blocks a ``begin`` asks for, or () and why not."""
        held = self._held_digests(begin.request_id, begin.algorithm,
                                  self._hold_digests.get(begin.request_id))
        if begin.algorithm not in self.cx.digesters:
            return (), f"no {begin.algorithm} digests on producer rank {self.cx.rank_index}"
        if held is None:
            return (), f"no digests of request {begin.request_id} (not held)"
        answer = answer_ask(held, begin.digest_ids)
        if isinstance(answer, str):
            return (), answer
        self.cx.stats.count("digests_served", sum(len(g) for g in begin.digest_ids))
        return answer, ""

    def _held_digests(self, request_id: str, alg: str,
                      first: tuple[dict[int, int], ...] | None
                      ) -> tuple[dict[int, int], ...] | None:
        """Producer: the digests in ``alg`` of a request whose digests in the first
        algorithm are ``first`` (None: none). An algorithm no consumer asked for before
        is taken now, of the same blocks, and from then on as every hold starts."""
        digester = self.cx.digesters.get(alg)
        if digester is None or first is None or digester is self.cx.digester:
            return first
        have = self._alg_digests.get((request_id, alg))
        if have is None:
            self._hold_algs.add(alg)
            block_ids = [tuple(ids) for ids in first]
            started = time.perf_counter()
            have = take_hold_digests(digester, block_ids)
            self.cx.count_digests(started, block_ids)
            self._alg_digests[(request_id, alg)] = have
        return have

    def slice_plan(self, topology: ParallelTopology) -> SlicePlan | None:
        """Producer: what consumer rank ``topology`` reads from this rank (None: nothing,
        or a topology this model cannot be served to)."""
        if topology not in self._slice_plans:
            if len(self._slice_plans) >= MAX_CONSUMER_PEERS:
                self._slice_plans.clear()  # bounded: recomputed on demand
            try:
                sub = plan_consumer_rank(self.cx.spec, self.cx.sizes,
                                         topology).for_producer(self.cx.rank_index)
            except LayoutError:
                self._slice_plans[topology] = None
            else:
                shapes = self.cx.spec.rank_shapes(self.cx.rank)
                self._slice_plans[topology] = producer_slice_plan(
                    sub, self.cx.rank_index, [s.block_bytes_per_layer for s in shapes],
                    [s.layer_ids for s in shapes]) if sub.num_descriptors else None
        return self._slice_plans[topology]

    def _take_hold_slices(self, request_id: str, block_ids: Sequence[Sequence[int]],
                          consumers: Iterable[_ConsumerPeer]) -> None:
        """Producer, as a hold starts: slice digests of the request's blocks for every
        consumer rank this rank knows that reads head slices of it (its hello listed a
        slice algorithm this rank computes: the one it will ask for), at most
        :data:`MAX_HOLD_SLICE_PLANS` plans."""
        mine = self.cx.slice_algorithms
        if not mine:
            return  # no slice digests offered
        taken: dict[tuple[ParallelTopology, str], tuple[dict[int, int], ...]] = {}
        for consumer in consumers:
            alg = answered_slice_algorithm(consumer.meta.digests, mine)
            key = (consumer.meta.topology, alg or "")
            if alg is None or key in taken:
                continue
            plan = self.slice_plan(consumer.meta.topology)
            if plan is None or not plan.needed:
                continue
            if len(taken) >= MAX_HOLD_SLICE_PLANS:
                break
            slicer = self.cx.slicer(alg)
            assert slicer is not None
            try:  # the block digests in its block algorithm: the slices of regions read whole
                held = self._held_digests(request_id, SLICE_ALGORITHMS[alg],
                                          self._hold_digests[request_id])
                assert held is not None
                started = time.perf_counter()
                taken[key] = take_slice_digests(slicer, plan, block_ids, held)
            except LayoutError as exc:
                self.cx.log.warning("pd: producer engine=%s rank=%d request=%s: no slice "
                               "digests: %s", self.cx.engine_id, self.cx.rank_index,
                               request_id, exc)
                return
            self.cx.count_slices(started, plan, block_ids, "slice_digests_at_hold")
        if taken:
            self._hold_slices[request_id] = taken

    def slice_digests_for(self, begin: messages.Begin, consumer: _ConsumerPeer
                           ) -> tuple[tuple[bytes, ...], str]:
        """Producer: slice digests of the blocks a ``begin`` asks for, as read by the
        consumer rank that sent it: those taken at hold start, else taken now (only of
        asked blocks this rank holds for the request), or () and why not."""
        slicer = self.cx.slicer(begin.algorithm)
        if slicer is None:
            return (), f"no {begin.algorithm} digests on producer rank {self.cx.rank_index}"
        try:  # the block digests in its block algorithm (the slices of regions read whole)
            held = self._held_digests(begin.request_id, SLICE_ALGORITHMS[begin.algorithm],
                                      self._hold_digests.get(begin.request_id))
        except LayoutError as exc:
            return (), f"no slice digests: {exc}"
        if held is None:
            return (), f"no digests of request {begin.request_id} (not held)"
        topology = consumer.meta.topology
        plan = self.slice_plan(topology)
        if plan is None:
            return (), f"consumer rank {topology.describe()} reads nothing of producer rank " \
                       f"{self.cx.rank_index}"
        taken = self._hold_slices.setdefault(begin.request_id, {})
        key = (topology, begin.algorithm)
        mine = taken.get(key)
        if len(begin.digest_ids) > len(held):
            return (), f"asked for {len(begin.digest_ids)} regions; the request has {len(held)}"
        # the consumer rank was not known as the hold started: hash the asked blocks it
        # holds that were not hashed for this consumer topology yet (kept: a repeated ask
        # costs nothing more), at most one answer's worth
        missing = [[b for b in ids if b in held[r] and r not in plan.whole
                    and (mine is None or b not in mine[r])]
                   for r, ids in enumerate(begin.digest_ids)]
        if mine is None or any(missing):
            if sum(len(ids) for ids in missing) > MAX_ASK_BLOCKS:
                return (), f"more than {MAX_ASK_BLOCKS} digests asked"
            started = time.perf_counter()
            try:
                new = take_slice_digests(slicer, plan, missing, held)
            except LayoutError as exc:
                return (), f"no slice digests: {exc}"
            self.cx.count_slices(started, plan, missing, "slice_digests_at_begin")
            mine = tuple(held[r] if r in plan.whole else
                         {**(mine[r] if mine is not None and r < len(mine) else {}),
                          **(new[r] if r < len(new) else {})}
                         for r in range(len(held)))
            taken[key] = mine
        answer = answer_ask(mine, begin.digest_ids)
        if isinstance(answer, str):
            return (), answer
        self.cx.stats.count("digests_served", sum(len(g) for g in begin.digest_ids))
        return answer, ""
