"""Consumer rank: a request's load, from its order to DONE or FAILED.

Pull: for each source producer rank, send ``begin`` (answered by ``held``: a
promise to keep the blocks ``lease_s`` longer, or none), post the READ, then
send the ``read`` notification once the READ is done here; the producer acks
it. The load is DONE when, for each source, the ack came ``ok`` or the READ
ended inside that source's promise (see :class:`~kvbridge.connectors.nixl.state.RecvTransfer`).
A finished load's blocks are checked (:mod:`.load_checks`) before it counts
as done. Push loads share the completion here (``_complete``, ``_fail``) and
post their ``register`` from :mod:`.push`.

Owns: ``_recv``, ``_by_producer_rid``, ``_done_recving``, ``_failed_recving``,
``_load_errors``, ``_releases``, ``_done_on_promise`` and the load counters.
May not touch: the producer side (leases, holds, push jobs), and the sessions
other than through :mod:`.pump`'s ``_ensure_session`` / ``_drop_session``.
"""

from __future__ import annotations

import time
from typing import Any

from kvbridge.backends.nixl import NixlTransportError, PeerHandle, Transfer, XferOp, XferState
from kvbridge.connectors.nixl import messages
from kvbridge.connectors.nixl.routing import pull_indices
from kvbridge.connectors.nixl.scheduler import LoadOrder, ReleaseOrder
from kvbridge.connectors.nixl.session import PeerSession
from kvbridge.connectors.nixl.state import RecvState, RecvTransfer
from kvbridge.connectors.nixl.worker_state import MAX_SAMPLES, TransferRecord, WorkerState, logger
from kvbridge.connectors.params import TransferMode
from kvbridge.layouts import LayoutError

#: A consumer trusts a producer's ``held`` promise of ``lease_s`` only up to
#: ``lease_s * (1 - GUARANTEE_RATE_MARGIN) - GUARANTEE_SLACK_S`` after sending its
#: ``begin`` (clock rates of two hosts differ by far less than 0.1 %).
GUARANTEE_RATE_MARGIN = 1e-3
GUARANTEE_SLACK_S = 0.005


class LoadPath(WorkerState):
    """The consumer's loads (pull, and the completion push loads share)."""

    def _start_load(self, order: LoadOrder, now: float) -> None:
        # Bootstrapping waits for the peer session, whose handshake has its own deadline
        # (a cold GPU peer's first one takes seconds): the transfer's own clock,
        # ``transfer_timeout_s``, starts when the load is posted (:meth:`_post`).
        recv = RecvTransfer(order.request_id, order.params, order.consumer_block_ids,
                            order.producer_block_ids, order.start,
                            deadline=now + self.handshake_deadline_s
                            + self.settings.transfer_timeout_s, started_at=now,
                            record=order.record, chain=order.chain)
        self._recv[order.request_id] = recv
        self._by_producer_rid[(order.params.producer_engine_id,
                               order.params.producer_request_id)] = order.request_id
        if order.error:
            self._fail(recv, f"refused: {order.error}", now)
            return
        self._ensure_session(order.params, now)

    def _post(self, recv: RecvTransfer, session: PeerSession, now: float) -> None:
        """Post a load on its ready session: pull, its READs (with ``begin`` and the
        ``read`` notifications); push, its ``register`` (:mod:`.push`)."""
        assert self.transport is not None
        recv.deadline = now + self.settings.transfer_timeout_s
        pull = recv.params.mode is TransferMode.PULL
        indices = self._read_indices(recv, session, now) if pull else {}
        if indices is None:
            return  # refused
        transfers: list[object] = []
        try:
            if pull:
                transfers = self._post_reads(recv, session, indices, now)
            else:
                self._post_registers(recv, session)
        except Exception as exc:
            self._fail(recv, f"posting failed: {exc}", now)
            self._drop_session(session.key, now, reason=str(exc))
            return
        self._count_unchecked(recv)
        session.active += 1
        recv.counted_active = True
        expected = frozenset(session.rank_plan.sources)
        recv.posted(expected, transfers, pull)
        if recv.read_notifs:
            self._poll_reads(recv, now)  # a READ over shared memory is often DONE at once

    def _read_indices(self, recv: RecvTransfer, session: PeerSession, now: float
                      ) -> dict[int, tuple[Any, Any, int]] | None:
        """A pull load's index arrays per source producer rank; None: refused (failed).

        This request's own data (its block ids) is checked before any I/O: a bad
        id fails this request alone; the session and every other load on it stay."""
        indices: dict[int, tuple[Any, Any, int]] = {}
        try:
            for p in session.targets:
                if p in session.rank_plan.sources:
                    assert session.local is not None
                    indices[p] = pull_indices(session.rank_plan, session.local.table,
                                              session.remote_tables[p], p,
                                              recv.consumer_block_ids,
                                              recv.producer_block_ids)
        except LayoutError as exc:
            self._counters["requests_refused"] += 1
            self._fail(recv, f"refused: {exc}", now)
            return None
        return indices

    def _post_reads(self, recv: RecvTransfer, session: PeerSession,
                    indices: dict[int, tuple[Any, Any, int]], now: float) -> list[object]:
        """Send ``begin`` and post the READ to each source producer rank (a rank that is
        not a source, or has nothing to read, gets its ``read`` notification at once)."""
        assert self.transport is not None
        rid = recv.params.producer_request_id
        transfers: list[object] = []
        local = session.local
        for p in session.targets:
            peer = session.peers[p]
            if p not in session.rank_plan.sources:
                self.transport.send_notif(peer, messages.encode(messages.ReadDone(
                    rid, self.rank_index, session.expected[p], read=False,
                    record=recv.record)))
                continue
            assert local is not None
            lidx, ridx, runs = indices[p]
            notif = messages.encode(messages.ReadDone(rid, self.rank_index,
                                                      session.expected[p],
                                                      record=recv.record))
            if lidx.size == 0:
                self.transport.send_notif(peer, notif)
                continue
            # ``begin`` first: its ``held`` answer (while the READ runs) lets the
            # load finish when the READ is done, not one ack round trip later;
            # the time is taken before sending, so the promise is conservative
            begin = self._begin_for(recv, session, p)
            recv.begun_at[p] = time.monotonic()
            self.transport.send_notif(peer, messages.encode(begin))
            xfer = self.transport.post(XferOp.READ, local.dlist, lidx,
                                       session.remote_lists[p], ridx, b"",
                                       deadline_s=max(0.001, recv.deadline - now))
            transfers.append(xfer)
            # The ReadDone goes as a standalone notification once the READ is
            # DONE here (its bytes are then in our memory), not attached to the
            # READ: NIXL delivers an attached one only after a flush that waits
            # on the peer's progress (measured +0.3-0.5 ms per READ on one host).
            recv.read_notifs[xfer.transfer_id] = (p, peer, notif)
            recv.nbytes += xfer.nbytes
            recv.num_descs += xfer.num_descs
            recv.num_runs += runs
        return transfers

    def _progress_recv(self, now: float) -> None:
        assert self.transport is not None
        for recv in list(self._recv.values()):
            if recv.state is RecvState.BOOTSTRAPPING:
                key = self._session_key(recv.params)
                session = self._session_ready(key)
                if session is not None:
                    self._post(recv, session, now)
                elif key not in self._connecting:
                    self._ensure_session(recv.params, now)
            if recv.state is RecvState.TRANSFERRING:
                self._poll_reads(recv, now)
            before = recv.state
            state = recv.poll(now)
            if state is RecvState.FAILED:
                refused = recv.error is not None and recv.error.startswith("producer rank")
                self._fail(recv, recv.error or "failed", now, tell_producer=not refused)
                if not refused and before in (RecvState.TRANSFERRING, RecvState.WAITING):
                    # the peer stopped answering: drop it, re-handshake on next use
                    self._drop_session(self._session_key(recv.params), now,
                                       reason=f"request {recv.request_id} timed out")
            elif state is RecvState.DONE:
                bad = self._verify(recv)
                if recv.digest_asks:  # the load ends when its blocks are checked
                    recv.finished_at = time.monotonic()
                if bad:
                    shown = ", ".join(f"region {r} block {b}" for r, b in sorted(bad)[:8])
                    recv.corrupt(f"digest mismatch in {len(bad)} of {recv.num_blocks} blocks "
                                 f"({shown}{', ...' if len(bad) > 8 else ''}; the digest "
                                 f"covers every layer of a block)")
                    self._counters["loads_corrupt"] += 1
                    self._fail(recv, recv.error or "digest mismatch", now,
                               tell_producer=False, blocks=frozenset(bad))
                else:
                    self._complete(recv)

    def _poll_reads(self, recv: RecvTransfer, now: float) -> None:
        """Advance a pull load's READs: tell each producer rank its READ is done (the
        ReadDone it acks) as soon as it is; fail the load on a failed or late READ."""
        assert self.transport is not None
        states = [self.transport.poll(x) for x in recv.transfers if isinstance(x, Transfer)]
        bad = [x for x in recv.transfers if isinstance(x, Transfer)
               and x.state in (XferState.FAILED, XferState.TIMED_OUT)]
        if bad:
            first = bad[0]
            self._counters["transfer_failures"] += 1
            self._fail(recv, f"READ {first.state.value}: {first.error}", now)
            self._drop_session(self._session_key(recv.params), now,
                               reason=f"transfer {first.state.value}")
            return
        for x in recv.transfers:
            if isinstance(x, Transfer) and x.state is XferState.DONE:
                pending = recv.read_notifs.pop(x.transfer_id, None)
                if pending is None:
                    continue
                source, peer, notif = pending
                assert isinstance(peer, PeerHandle)
                recv.read_done(source, time.monotonic())  # seen done: at or after the fact
                try:
                    self.transport.send_notif(peer, notif)
                except NixlTransportError as exc:
                    self._fail(recv, f"read-done notification: {exc}", now)
                    self._drop_session(self._session_key(recv.params), now, reason=str(exc))
                    return
        if all(s is XferState.DONE for s in states):
            recv.transfers_done()
            self._reads_ended = True

    def _complete(self, recv: RecvTransfer) -> None:
        self._recv.pop(recv.request_id, None)
        self._unindex(recv)
        self._done_recving.add(recv.request_id)
        self._counters["loads_done"] += 1
        if recv.done_on_promise:
            # the acks still come; one saying "late" would contradict a promise
            self._counters["loads_done_on_promise"] += 1
            key = (recv.params.producer_engine_id, recv.params.producer_request_id)
            self._done_on_promise[key] = (recv.request_id,
                                          time.monotonic() + 2 * self.settings.lease_s)
            while len(self._done_on_promise) > MAX_SAMPLES:  # oldest first
                del self._done_on_promise[next(iter(self._done_on_promise))]
        self._count_transfer(recv.nbytes, recv.num_descs, recv.duration_s or 0.0, recv.num_runs)
        self._record(TransferRecord(
            recv.request_id, True, recv.nbytes, recv.num_descs, recv.duration_s or 0.0,
            recv.started_at, recv.num_runs,
            tuple(x.nixl_xfer_s for x in recv.transfers
                  if isinstance(x, Transfer) and x.nixl_xfer_s is not None)))
        self._uncount(recv)

    def _fail(self, recv: RecvTransfer, reason: str, now: float, *,
              tell_producer: bool = True,
              blocks: frozenset[tuple[int, int]] | None = None) -> None:
        """Finish ``recv`` as failed: exact local blocks as load errors, one log line.

        ``tell_producer``: queue a release for the producer (it holds the blocks
        under a lease; without a word it would wait for the lease to run out).
        False when the failure *is* the producer's answer (or the READs are done
        and the producer was told). ``blocks``: the local blocks that failed
        (default: every block of the load), e.g. those whose digests differ."""
        recv.fail(reason, now)
        if recv.request_id not in self._recv:
            return
        if tell_producer:
            self._releases.append(ReleaseOrder(recv.request_id, recv.params, recv.record))
        del self._recv[recv.request_id]
        self._unindex(recv)
        self._done_recving.add(recv.request_id)
        self._failed_recving.add(recv.request_id)
        self._load_errors |= recv.local_blocks if blocks is None else blocks
        self._counters["loads_failed"] += 1
        self._record(TransferRecord(recv.request_id, False, recv.nbytes, recv.num_descs,
                                    now - recv.started_at, recv.started_at, recv.num_runs))
        params = recv.params
        logger.warning(
            "nixl load failed: engine=%s rank=%d request=%s producer_engine=%s "
            "producer_request=%s mode=%s blocks=%d state=%s reason=%s",
            self.ctx.engine_id, self.rank_index, recv.request_id, params.producer_engine_id,
            params.producer_request_id, params.mode.value, recv.num_blocks,
            recv.state.value, reason)
        self._uncount(recv)

    def _uncount(self, recv: RecvTransfer) -> None:
        """A posted load no longer uses its session (one that was never posted did not
        count: refused before posting, or failed while bootstrapping)."""
        if not recv.counted_active:
            return
        recv.counted_active = False
        session = self._sessions.get(self._session_key(recv.params))
        if session is not None and session.active > 0:
            session.active -= 1

    def _unindex(self, recv: RecvTransfer) -> None:
        self._by_producer_rid.pop((recv.params.producer_engine_id,
                                   recv.params.producer_request_id), None)

    def _send_releases(self, now: float) -> None:
        keep = []
        for release in self._releases:
            key = self._session_key(release.params)
            session = self._session_ready(key)
            if session is None:
                if key not in self._connecting:
                    self._ensure_session(release.params, now)
                keep.append(release)
                continue
            rid = release.params.producer_request_id
            assert self.transport is not None
            for p in session.targets:
                if release.params.mode is TransferMode.PULL:
                    msg: messages.Notif = messages.ReadDone(rid, self.rank_index,
                                                            session.expected[p], read=False,
                                                            record=release.record)
                else:
                    msg = messages.Register(rid, self.rank_index, session.expected[p],
                                            tuple(0 for _ in self.ctx.spec.regions),
                                            tuple(() for _ in self.ctx.spec.regions),
                                            cancel=True)
                try:
                    self.transport.send_notif(session.peers[p], messages.encode(msg))
                    self._counters["releases_sent"] += 1
                except NixlTransportError as exc:
                    logger.warning("nixl: release of %s to producer rank %d failed: %s "
                                   "(its lease will expire)", rid, p, exc)
        self._releases = keep

    def _find_recv(self, sender: str, producer_rank: int, producer_rid: str
                   ) -> tuple[str | None, RecvTransfer | None]:
        """(producer engine id, the load) a producer rank's answer is about."""
        for key, session in self._sessions.items():
            peer = session.peers.get(producer_rank)
            if peer is None or peer.name != sender:
                continue
            rid = self._by_producer_rid.get((key[0], producer_rid))
            return key[0], (self._recv.get(rid) if rid is not None else None)
        return None, None

    def _on_answer(self, sender: str, msg: messages.Ack | messages.Pushed, now: float) -> None:
        engine_id, recv = self._find_recv(sender, msg.producer_rank, msg.request_id)
        if recv is not None and isinstance(msg, messages.Pushed):
            self._take_digests(recv, msg.producer_rank, msg.digests, msg.algorithm, msg.reason)
        if recv is not None:
            recv.answer(msg.producer_rank, msg.ok, msg.reason, now)
            return
        promised = (self._done_on_promise.get((engine_id, msg.request_id))
                    if engine_id is not None else None)
        if promised is not None and not msg.ok:
            # cannot happen while the producer keeps its promises (and clocks run at
            # about the same rate): say so loudly, the request already finished
            self._counters["promises_contradicted"] += 1
            logger.error("nixl: producer engine=%s rank=%d answered %r for request %s (%s), "
                         "which finished on its promise to hold the blocks",
                         engine_id, msg.producer_rank, msg.reason, promised[0],
                         msg.request_id)

    def _on_held(self, sender: str, msg: messages.Held) -> None:
        _engine_id, recv = self._find_recv(sender, msg.producer_rank, msg.request_id)
        if recv is None:
            return
        self._take_digests(recv, msg.producer_rank, msg.digests, msg.algorithm, msg.reason)
        if not msg.ok:
            return  # no promise: the ack of the read decides
        recv.promised(msg.producer_rank,
                      msg.lease_s * (1.0 - GUARANTEE_RATE_MARGIN) - GUARANTEE_SLACK_S)
