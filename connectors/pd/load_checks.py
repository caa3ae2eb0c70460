"""Consumer rank: verification of landed blocks (wrong bytes are a failed load, never KV).

Which blocks of a load are checked against which producer rank's digests (the
digest ask of a ``begin`` or ``register``), taking the digests from the
producer's ``held`` / ``pushed`` answer, and checking the landed bytes once
the load's transfers are done (whole blocks, and head slices at another TP).
Blocks that cannot be checked are counted unverified (and fail the load when
``verify_allow_unverified`` is false). The pure planning and comparison live in
:mod:`.verify`; this module applies them to a load.

Owns: ``_unverified_logged``, the digest fields of a
:class:`~kvbridge.connectors.pd.state.RecvTransfer`, the sessions'
``digest_regions`` / ``digest_algorithms`` / ``slice_check`` caches, the
``blocks_verified`` / ``digest_mismatches`` / ``blocks_unverified`` counters.
May not touch: a load's state machine (it answers :meth:`LoadChecks.verify` and
:mod:`.loads` acts on it), nor anything of the producer side.
"""

from __future__ import annotations

import time
from dataclasses import replace

from kvbridge.connectors.params import TransferMode
from kvbridge.connectors.pd import messages
from kvbridge.connectors.pd.session import PeerSession
from kvbridge.connectors.pd.state import RecvTransfer
from kvbridge.connectors.pd.verify import (
    MAX_ASK_BLOCKS,
    DigestAsk,
    SliceCheck,
    check_answer,
    check_slices,
    count_slices,
    pick_slice_algorithm,
    plan_ask,
    plan_slice_check,
    slice_bytes,
    whole_block_regions,
)
from kvbridge.connectors.pd.worker_state import WorkerContext
from kvbridge.handshake import AgentMetadata
from kvbridge.layouts.digests import SLICE_ALGORITHMS, block_algorithm_of, pick_algorithm


class LoadChecks:
    """The consumer's checks of landed blocks against the producers' digests."""

    def __init__(self, cx: WorkerContext) -> None:
        self.cx = cx
        self._unverified_logged: set[str] = set()  # reasons logged once

    def begin_for(self, recv: RecvTransfer, session: PeerSession, p: int) -> messages.Begin:
        """The ``begin`` of a pull READ from producer rank ``p``, asking for the digests
        of the blocks this rank will check (see ``connectors.pd.verify``), naming the sealed
        record it loads."""
        rid = recv.params.producer_request_id
        ask = self.ask_for(recv, session, p)
        if ask is None:
            return messages.Begin(rid, self.cx.rank_index, record=recv.record)
        return messages.Begin(rid, self.cx.rank_index, ask.producer_ids, ask.algorithm,
                              recv.record)

    def ask_for(self, recv: RecvTransfer, session: PeerSession, p: int) -> DigestAsk | None:
        """The blocks of ``recv`` this rank checks against producer rank ``p``'s digests
        (None: none); blocks it cannot check are counted unverified, said once."""
        policy = self.cx.settings.verify_policy
        if not policy.enabled:
            return None
        known = session.digest_regions.get(p)
        if known is None:
            known = session.digest_regions[p] = self._digest_regions(session, p)
        regions, why = known
        check = self._slice_check(session)
        slices = check.regions & check.regions_of(p)
        recv.checked_regions |= regions | slices
        recv.unchecked_why = recv.unchecked_why or (check.why if regions else "") or why
        # push: the producer maps registered blocks to its own (ids unused here)
        pull = recv.params.mode is TransferMode.PULL
        ask = plan_ask(policy, recv.request_id, regions, recv.consumer_block_ids,
                       recv.producer_block_ids if pull else recv.consumer_block_ids, slices,
                       check.algorithm)
        if slices:
            ask = replace(ask, slice_ranges=check.ranges[p],
                          slice_sources={r: check.sources[r] for r in slices})
        if ask.unverified:
            self._unverified(recv, ask.unverified, f"more than {MAX_ASK_BLOCKS} blocks in one "
                                                   f"load")
        if not ask.num_blocks:
            return None
        if ask.algorithm not in SLICE_ALGORITHMS:  # whole blocks only: the session's choice
            alg = session.digest_algorithms.get(p)
            assert alg is not None  # regions are checked only with an algorithm in common
            ask = replace(ask, algorithm=alg)
        # a slice algorithm covers the whole ask (a region read whole: its block digest in
        # the slice algorithm's block algorithm)
        recv.digest_asks[p] = ask
        recv.digest_algorithms[p] = ask.algorithm
        return ask

    def take_digests(self, recv: RecvTransfer, producer_rank: int, digests: tuple[bytes, ...],
                      algorithm: str, reason: str) -> None:
        """The first answer of ``producer_rank`` to this load's digest ask (held, pushed)."""
        if producer_rank not in recv.digest_asks or producer_rank in recv.digests:
            return
        ok = bool(digests) and algorithm == recv.digest_asks[producer_rank].algorithm
        recv.digests[producer_rank] = digests if ok else None
        if not ok:  # its slice-region blocks are counted once per block in _verify_slices
            self._unverified(recv, recv.digest_asks[producer_rank].whole_blocks,
                             f"producer rank {producer_rank} sent no digests "
                             f"({reason or 'no reason given'})")

    def count_unchecked(self, recv: RecvTransfer) -> None:
        """After every producer rank was asked: the load's blocks in regions no producer
        rank's digests cover, counted once (not once per producer rank read from)."""
        if not self.cx.settings.verify_policy.enabled:
            return
        unchecked = sum(len(ids) for r, ids in enumerate(recv.consumer_block_ids)
                        if r not in recv.checked_regions)
        if unchecked:
            self._unverified(recv, unchecked, recv.unchecked_why or "no producer rank's digests "
                                                                    "cover these blocks")

    def _digest_regions(self, session: PeerSession, p: int) -> tuple[frozenset[int], str]:
        """The regions this rank checks against producer rank ``p``'s digests (and why
        not the others): the same for every load of the session."""
        remote = next((m for m in session.metadata.ranks if m.rank_index == p), None)
        if not self.cx.digesters:
            return frozenset(), "this rank computes no digests"
        alg = session.digest_algorithms[p] = self._digest_algorithm(remote)
        if remote is None or alg is None:
            return frozenset(), (f"producer rank {p} offers no digests this rank computes "
                                 f"({list(remote.digests) if remote else []} against "
                                 f"{list(self.cx.digesters)}: an older kvbridge, verification "
                                 f"off there, or GPU memory against XXH3-64 only)")
        regions = whole_block_regions(
            session.rank_plan, p, [s.block_bytes_per_layer
                                   for s in self.cx.spec.rank_shapes(self.cx.rank)],
            [r.block_bytes_per_layer for r in remote.regions],
            [s.layer_ids for s in self.cx.spec.rank_shapes(remote.topology)])
        return regions, "blocks not copied whole from one producer rank (head slices at " \
                        "another TP, or another pipeline split)"

    def _digest_algorithm(self, remote: AgentMetadata | None) -> str | None:
        """The algorithm this consumer rank asks producer rank ``remote`` for: the first of
        its own (preference-ordered, computable here) that the producer offers."""
        return pick_algorithm(list(self.cx.digesters), remote.digests) if remote else None

    def _unverified(self, recv: RecvTransfer, num_blocks: int, why: str) -> None:
        recv.unverified += num_blocks
        self.cx.stats.count("blocks_unverified", num_blocks)
        if why not in self._unverified_logged and len(self._unverified_logged) < 64:
            self._unverified_logged.add(why)
            self.cx.log.warning("pd: engine=%s rank=%d: loads from producer engine %s are not "
                           "verified: %s (counted in blocks_unverified; logged once)",
                           self.cx.engine_id, self.cx.rank_index,
                           recv.params.producer_engine_id, why)

    def verify(self, recv: RecvTransfer) -> set[tuple[int, int]]:
        """A finished pull load's blocks whose digests differ (checked against the
        answers of its producer ranks). Unchecked blocks fail too when the policy
        does not allow them."""
        bad: set[tuple[int, int]] = set()
        for p, ask in recv.digest_asks.items():
            packed = recv.digests.get(p)
            if packed is None:
                continue  # counted unverified when the answer came
            # a slice ask's whole regions: block digests in its block algorithm
            digester = self.cx.digesters[block_algorithm_of(recv.digest_algorithms[p])]
            started = time.perf_counter()
            verified, mismatched = check_answer(ask, packed, digester,
                                                whole_load=recv.params.mode is TransferMode.PUSH)
            self.cx.count_digests(started, [() if r in ask.slices else ids
                                          for r, ids in enumerate(ask.consumer_ids)])
            self.cx.stats.count("blocks_verified", verified)
            self.cx.stats.count("digest_mismatches", len(mismatched))
            bad.update(mismatched)
        self._verify_slices(recv, bad)
        if recv.unverified and not self.cx.settings.verify_allow_unverified:
            bad |= set(recv.local_blocks)
        self.cx.observer.verified(recv, bad, self.cx.digesters)
        return bad

    def _slice_check(self, session: PeerSession) -> SliceCheck:
        """Consumer: the regions of ``session``'s plan checked with slice digests (those
        no producer rank covers whole, each of whose sources offers them), in the first
        slice algorithm of this rank's that a producer rank offers; once."""
        if session.slice_check is None:
            offered = {m.rank_index: m.digests for m in session.metadata.ranks}
            alg = pick_slice_algorithm(self.cx.slice_algorithms, offered)
            if alg is None:
                session.slice_check = SliceCheck(
                    why=f"no producer rank offers slice digests this rank computes "
                        f"({list(self.cx.slice_algorithms)}): an older kvbridge, or "
                        f"verification off there")
            else:
                whole = {}
                for p in session.rank_plan.sources:
                    known = session.digest_regions.get(p)
                    if known is None:
                        known = session.digest_regions[p] = self._digest_regions(session, p)
                    whole[p] = known[0]
                offering = [p for p, algs in offered.items() if alg in algs]
                session.slice_check = plan_slice_check(session.rank_plan, whole, offering, alg)
        return session.slice_check

    def _verify_slices(self, recv: RecvTransfer, bad: set[tuple[int, int]]) -> None:
        """Consumer: check and count the slice-region blocks of a finished load; each
        block counts once, verified only when every producer rank it came from matched."""
        asks = {p: a for p, a in recv.digest_asks.items() if a.slices}
        if not asks:
            return
        matched: dict[int, list[tuple[int, int]]] = {}
        failed: set[tuple[int, int]] = set()
        started = time.perf_counter()
        nbytes = 0
        for p, ask in asks.items():
            packed = recv.digests.get(p)
            if packed is None:
                continue  # no answer: its parts stay unchecked (counted below)
            if not any(ask.consumer_ids[r] for r in ask.slices):
                continue  # sampling chose none of its slice blocks (a block algorithm ask)
            slicer = self.cx.slicer(ask.algorithm)
            assert slicer is not None  # slice blocks are asked only in an algorithm of ours
            matched[p], mismatched = check_slices(ask, packed, slicer,
                                                  whole_load=recv.params.mode is TransferMode.PUSH)
            failed.update(mismatched)
            nbytes += sum(len(ask.consumer_ids[r]) * slice_bytes(ask.slice_ranges[r])
                          for r in ask.slices)
        self.cx.stats.count("digest_time_s", time.perf_counter() - started)
        self.cx.stats.count("digest_bytes", nbytes)
        verified, unverified = count_slices(asks, matched, failed)
        self.cx.stats.count("blocks_verified", verified)
        self.cx.stats.count("digest_mismatches", len(failed))
        bad.update(failed)
        if unverified:
            self._unverified(recv, unverified, "a producer rank sent no slice digests for "
                                               "head slices it was asked for")
