"""Consumer rank: a request's load, from its order to DONE or FAILED.

Pull: for each source producer rank, send ``begin`` (answered by ``held``: a
promise to keep the blocks ``lease_s`` longer, or none), post the READ, then
send the ``read`` notification once the READ is done here; the producer acks
it. The load is DONE when, for each source, the ack came ``ok`` or the READ
ended inside that source's promise (see :class:`~kvbridge.connectors.pd.state.RecvTransfer`).
A finished load's blocks are checked (:mod:`.load_checks`) before it counts
as done. Push loads share the completion here (``_complete``, ``_fail``) and
post their ``register`` through :mod:`.push_consumer`.

Owns: ``recv`` (the loads in flight), ``_by_producer_rid``, ``_done_recving``,
``_failed_recving``, ``_failed_reported``, ``_load_errors``, ``_releases``,
``_done_on_promise`` and the load counters. Calls: :class:`~.sessions.Sessions`
(ensure, get, drop), :class:`~.load_checks.LoadChecks` (asks, digests, the
check) and :class:`~.push_consumer.PushRegisters` (a push load's registers).
May not touch: the producer side (leases, holds, push jobs).
"""

from __future__ import annotations

import time
from typing import Any

from kvbridge.backends.transfer import PeerHandle, Transfer, TransportError, XferOp, XferState
from kvbridge.connectors.api import BlockRef
from kvbridge.connectors.params import TransferMode
from kvbridge.connectors.pd import messages
from kvbridge.connectors.pd.load_checks import LoadChecks
from kvbridge.connectors.pd.push_consumer import PushRegisters
from kvbridge.connectors.pd.routing import pull_indices
from kvbridge.connectors.pd.scheduler import LoadOrder, ReleaseOrder
from kvbridge.connectors.pd.session import PeerSession, SessionKey
from kvbridge.connectors.pd.sessions import Sessions, dropped_reason
from kvbridge.connectors.pd.state import RecvState, RecvTransfer
from kvbridge.connectors.pd.worker_state import (
    MAX_SAMPLES,
    TransferRecord,
    WorkerContext,
    session_key,
)
from kvbridge.layouts import LayoutError

#: A consumer trusts a producer's ``held`` promise of ``lease_s`` only up to
#: ``lease_s * (1 - GUARANTEE_RATE_MARGIN) - GUARANTEE_SLACK_S`` after sending its
#: ``begin`` (clock rates of two hosts differ by far less than 0.1 %).
GUARANTEE_RATE_MARGIN = 1e-3
GUARANTEE_SLACK_S = 0.005


class Loads:
    """The consumer's loads (pull, and the completion push loads share)."""

    def __init__(self, cx: WorkerContext, sessions: Sessions, checks: LoadChecks,
                 registers: PushRegisters) -> None:
        self.cx = cx
        self.sessions = sessions
        self.checks = checks
        self.registers = registers
        self.recv: dict[str, RecvTransfer] = {}
        self._by_producer_rid: dict[tuple[str, str], str] = {}
        self._releases: list[ReleaseOrder] = []
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._failed_reported: set[str] = set()
        self._load_errors: set[BlockRef] = set()
        #: loads finished on the producers' ``held`` promises before their acks came,
        #: (producer engine id, producer request id) -> (request id, forget at)
        self._done_on_promise: dict[tuple[str, str], tuple[str, float]] = {}

    # ------------------------------------------------------------------ the engine's orders

    def start(self, order: LoadOrder, now: float) -> None:
        self._start_load(order, now)

    def release(self, release: ReleaseOrder, now: float) -> None:
        """The scheduler gave up a load the producer still holds: tell it (next progress)."""
        self._releases.append(release)
        self.sessions.ensure(release.params, now)

    def cancel(self, request_id: str, now: float) -> None:
        """The engine finished a request while it was loading (abort). Pull: its READ
        settles as usual (the blocks stay pinned until then). Push: ask the producer to
        stop; its answer (after in-flight writes settle) finishes the request."""
        recv = self.recv.get(request_id)
        if recv is None or recv.params.mode is not TransferMode.PUSH:
            return
        session = self.sessions.get(session_key(recv.params))
        if session is None or recv.state is RecvState.BOOTSTRAPPING:
            self._fail(recv, "cancelled before registration", now)
            return
        error = self.registers.cancel(recv, session)
        if error is not None:
            self._fail(recv, f"cancel: {error}", now)

    # ------------------------------------------------------------------ what the engine reads

    def take_finished(self) -> set[str]:
        """The loads finished since the last call; their failed ones are kept for
        :meth:`take_failed`."""
        done_recving, self._done_recving = self._done_recving, set()
        # failures reported with *these* finished ids only: the pump may fail more
        # loads before get_failed_recving runs, and those belong to the next report
        # (reporting them now would finish them twice)
        self._failed_reported = self._failed_recving & done_recving
        self._failed_recving -= self._failed_reported
        return done_recving

    def take_failed(self) -> set[str]:
        """The failed ones among the loads the last :meth:`take_finished` reported."""
        failed, self._failed_reported = self._failed_reported, set()
        return failed

    def take_load_errors(self) -> set[BlockRef]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    @property
    def in_flight(self) -> int:
        return len(self.recv)

    @property
    def busy(self) -> bool:
        """Loads or releases a peer may be waiting on (a hint for the idle pump)."""
        return bool(self.recv or self._releases)

    def reading(self) -> bool:
        """A READ of this rank in flight (read without the lock: a hint for the pump's
        interval only; a load that changes meanwhile is seen at the next turn)."""
        try:
            return any(recv.state is RecvState.TRANSFERRING for recv in self.recv.values())
        except RuntimeError:  # the dict changed under us: ask again next turn
            return True

    def producer_rids_by_key(self) -> dict[SessionKey, list[str]]:
        """The producer request ids of the loads in flight, by session (heartbeats)."""
        by_key: dict[SessionKey, list[str]] = {}
        for recv in self.recv.values():
            by_key.setdefault(session_key(recv.params), []).append(
                recv.params.producer_request_id)
        return by_key

    # ------------------------------------------------------------------ sessions' verdicts

    def fail_key(self, key: SessionKey, reason: str, now: float, *,
                 handshake: bool = False) -> None:
        """Fail the loads on the session at ``key``; ``handshake``: no session came, so
        the releases waiting for it go too (nobody is there to tell)."""
        for recv in list(self.recv.values()):
            if session_key(recv.params) == key:
                self._fail(recv, reason, now)
        if handshake:
            self._releases = [r for r in self._releases if session_key(r.params) != key]

    def _drop_session(self, key: SessionKey, now: float, reason: str) -> None:
        if self.sessions.drop(key, reason):
            self.fail_key(key, dropped_reason(key, reason), now)

    def prune(self, now: float) -> None:
        """Forget the loads done on a promise whose acks can no longer come."""
        if self._done_on_promise:
            for key, (_rid, forget_at) in list(self._done_on_promise.items()):
                if now >= forget_at:
                    del self._done_on_promise[key]

    def close(self, now: float) -> None:
        """Shutdown: every load in flight fails."""
        for recv in list(self.recv.values()):
            self._fail(recv, "connector shut down", now)

    # ------------------------------------------------------------------ the load's life

    def _start_load(self, order: LoadOrder, now: float) -> None:
        # Bootstrapping waits for the peer session, whose handshake has its own deadline
        # (a cold GPU peer's first one takes seconds): the transfer's own clock,
        # ``transfer_timeout_s``, starts when the load is posted (:meth:`_post`).
        recv = RecvTransfer(order.request_id, order.params, order.consumer_block_ids,
                            order.producer_block_ids, order.start,
                            deadline=now + self.sessions.handshake_deadline_s
                            + self.cx.settings.transfer_timeout_s, started_at=now,
                            record=order.record, chain=order.chain)
        self.recv[order.request_id] = recv
        self._by_producer_rid[(order.params.producer_engine_id,
                               order.params.producer_request_id)] = order.request_id
        if order.error:
            self._fail(recv, f"refused: {order.error}", now)
            return
        self.sessions.ensure(order.params, now)

    def _post(self, recv: RecvTransfer, session: PeerSession, now: float) -> bool:
        """Post a load on its ready session: pull, its READs (with ``begin`` and the
        ``read`` notifications); push, its ``register`` (:mod:`.push_consumer`). True
        when its READs all ended at once."""
        recv.deadline = now + self.cx.settings.transfer_timeout_s
        pull = recv.params.mode is TransferMode.PULL
        indices = self._read_indices(recv, session, now) if pull else {}
        if indices is None:
            return False  # refused
        transfers: list[object] = []
        try:
            if pull:
                transfers = self._post_reads(recv, session, indices, now)
            else:
                self.registers.post(recv, session)
        except Exception as exc:
            self._fail(recv, f"posting failed: {exc}", now)
            self._drop_session(session.key, now, reason=str(exc))
            return False
        self.checks.count_unchecked(recv)
        self.sessions.use(session)
        recv.counted_active = True
        expected = frozenset(session.rank_plan.sources)
        recv.posted(expected, transfers, pull)
        if recv.read_notifs:  # a READ over shared memory is often DONE at once
            return self._poll_reads(recv, now)
        return False

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
            self.cx.stats.count("requests_refused", 1)
            self._fail(recv, f"refused: {exc}", now)
            return None
        return indices

    def _post_reads(self, recv: RecvTransfer, session: PeerSession,
                    indices: dict[int, tuple[Any, Any, int]], now: float) -> list[object]:
        """Send ``begin`` and post the READ to each source producer rank (a rank that is
        not a source, or has nothing to read, gets its ``read`` notification at once)."""
        rid = recv.params.producer_request_id
        transfers: list[object] = []
        local = session.local
        for p in session.targets:
            peer = session.peers[p]
            if p not in session.rank_plan.sources:
                self.cx.io.send_notif(peer, messages.encode(messages.ReadDone(
                    rid, self.cx.rank_index, session.expected[p], read=False,
                    record=recv.record)))
                continue
            assert local is not None
            lidx, ridx, runs = indices[p]
            notif = messages.encode(messages.ReadDone(rid, self.cx.rank_index,
                                                      session.expected[p],
                                                      record=recv.record))
            if lidx.size == 0:
                self.cx.io.send_notif(peer, notif)
                continue
            # ``begin`` first: its ``held`` answer (while the READ runs) lets the
            # load finish when the READ is done, not one ack round trip later;
            # the time is taken before sending, so the promise is conservative
            begin = self.checks.begin_for(recv, session, p)
            recv.begun_at[p] = time.monotonic()
            self.cx.io.send_notif(peer, messages.encode(begin))
            xfer = self.cx.io.post(XferOp.READ, local.dlist, lidx,
                                       session.remote_lists[p], ridx, b"",
                                       deadline_s=max(0.001, recv.deadline - now))
            transfers.append(xfer)
            # The ReadDone goes as a standalone notification once the READ is
            # DONE here (its bytes are then in our memory), not attached to the
            # READ: a transport may deliver an attached one only after a flush that waits
            # on the peer's progress (measured +0.3-0.5 ms per READ on one host).
            recv.read_notifs[xfer.transfer_id] = (p, peer, notif)
            recv.nbytes += xfer.nbytes
            recv.num_descs += xfer.num_descs
            recv.num_runs += runs
        return transfers

    def progress(self, now: float) -> bool:
        """Post, poll and finish the loads; True when a READ ended in this call."""
        reads_ended = False
        for recv in list(self.recv.values()):
            if recv.state is RecvState.BOOTSTRAPPING:
                key = session_key(recv.params)
                session = self.sessions.get(key)
                if session is not None:
                    reads_ended |= self._post(recv, session, now)
                elif not self.sessions.connecting(key):
                    self.sessions.ensure(recv.params, now)
            if recv.state is RecvState.TRANSFERRING:
                reads_ended |= self._poll_reads(recv, now)
            before = recv.state
            state = recv.poll(now)
            if state is RecvState.FAILED:
                refused = recv.error is not None and recv.error.startswith("producer rank")
                self._fail(recv, recv.error or "failed", now, tell_producer=not refused)
                if not refused and before in (RecvState.TRANSFERRING, RecvState.WAITING):
                    # the peer stopped answering: drop it, re-handshake on next use
                    self._drop_session(session_key(recv.params), now,
                                       reason=f"request {recv.request_id} timed out")
            elif state is RecvState.DONE:
                bad = self.checks.verify(recv)
                if recv.digest_asks:  # the load ends when its blocks are checked
                    recv.finished_at = time.monotonic()
                if bad:
                    shown = ", ".join(f"region {r} block {b}" for r, b in sorted(bad)[:8])
                    recv.corrupt(f"digest mismatch in {len(bad)} of {recv.num_blocks} blocks "
                                 f"({shown}{', ...' if len(bad) > 8 else ''}; the digest "
                                 f"covers every layer of a block)")
                    self.cx.stats.count("loads_corrupt", 1)
                    self._fail(recv, recv.error or "digest mismatch", now,
                               tell_producer=False, blocks=frozenset(bad))
                else:
                    self._complete(recv)
        return reads_ended

    def _poll_reads(self, recv: RecvTransfer, now: float) -> bool:
        """Advance a pull load's READs: tell each producer rank its READ is done (the
        ReadDone it acks) as soon as it is; fail the load on a failed or late READ.
        True when its READs all ended now."""
        states = [self.cx.io.poll(x) for x in recv.transfers if isinstance(x, Transfer)]
        bad = [x for x in recv.transfers if isinstance(x, Transfer)
               and x.state in (XferState.FAILED, XferState.TIMED_OUT)]
        if bad:
            first = bad[0]
            self.cx.stats.count("transfer_failures")
            self._fail(recv, f"READ {first.state.value}: {first.error}", now)
            self._drop_session(session_key(recv.params), now,
                               reason=f"transfer {first.state.value}")
            return False
        for x in recv.transfers:
            if isinstance(x, Transfer) and x.state is XferState.DONE:
                pending = recv.read_notifs.pop(x.transfer_id, None)
                if pending is None:
                    continue
                source, peer, notif = pending
                assert isinstance(peer, PeerHandle)
                recv.read_done(source, time.monotonic())  # seen done: at or after the fact
                try:
                    self.cx.io.send_notif(peer, notif)
                except TransportError as exc:
                    self._fail(recv, f"read-done notification: {exc}", now)
                    self._drop_session(session_key(recv.params), now, reason=str(exc))
                    return False
        if all(s is XferState.DONE for s in states):
            recv.transfers_done()
            return True
        return False

    def _complete(self, recv: RecvTransfer) -> None:
        self.recv.pop(recv.request_id, None)
        self._unindex(recv)
        self._done_recving.add(recv.request_id)
        self.cx.stats.count("loads_done", 1)
        if recv.done_on_promise:
            # the acks still come; one saying "late" would contradict a promise
            self.cx.stats.count("loads_done_on_promise", 1)
            key = (recv.params.producer_engine_id, recv.params.producer_request_id)
            self._done_on_promise[key] = (recv.request_id,
                                          time.monotonic() + 2 * self.cx.settings.lease_s)
            while len(self._done_on_promise) > MAX_SAMPLES:  # oldest first
                del self._done_on_promise[next(iter(self._done_on_promise))]
        self.cx.stats.count_transfer(recv.nbytes, recv.num_descs, recv.duration_s or 0.0, recv.num_runs)
        self.cx.stats.record(TransferRecord(
            recv.request_id, True, recv.nbytes, recv.num_descs, recv.duration_s or 0.0,
            recv.started_at, recv.num_runs,
            tuple(x.library_xfer_s for x in recv.transfers
                  if isinstance(x, Transfer) and x.library_xfer_s is not None)))
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
        if recv.request_id in self.recv:
            self.cx.observer.failure(recv, reason)
        recv.fail(reason, now)
        if recv.request_id not in self.recv:
            return
        if tell_producer:
            self._releases.append(ReleaseOrder(recv.request_id, recv.params, recv.record))
        del self.recv[recv.request_id]
        self._unindex(recv)
        self._done_recving.add(recv.request_id)
        self._failed_recving.add(recv.request_id)
        self._load_errors |= recv.local_blocks if blocks is None else blocks
        self.cx.stats.count("loads_failed", 1)
        self.cx.stats.record(TransferRecord(recv.request_id, False, recv.nbytes, recv.num_descs,
                                    now - recv.started_at, recv.started_at, recv.num_runs))
        params = recv.params
        self.cx.log.warning(
            "pd load failed: engine=%s rank=%d request=%s producer_engine=%s "
            "producer_request=%s mode=%s blocks=%d state=%s reason=%s",
            self.cx.engine_id, self.cx.rank_index, recv.request_id, params.producer_engine_id,
            params.producer_request_id, params.mode.value, recv.num_blocks,
            recv.state.value, reason)
        self._uncount(recv)

    def _uncount(self, recv: RecvTransfer) -> None:
        """A posted load no longer uses its session (one that was never posted did not
        count: refused before posting, or failed while bootstrapping)."""
        if not recv.counted_active:
            return
        recv.counted_active = False
        self.sessions.unuse(session_key(recv.params))

    def _unindex(self, recv: RecvTransfer) -> None:
        self._by_producer_rid.pop((recv.params.producer_engine_id,
                                   recv.params.producer_request_id), None)

    def send_releases(self, now: float) -> None:
        keep = []
        for release in self._releases:
            key = session_key(release.params)
            session = self.sessions.get(key)
            if session is None:
                if not self.sessions.connecting(key):
                    self.sessions.ensure(release.params, now)
                keep.append(release)
                continue
            rid = release.params.producer_request_id
            for p in session.targets:
                if release.params.mode is TransferMode.PULL:
                    msg: messages.Notif = messages.ReadDone(rid, self.cx.rank_index,
                                                            session.expected[p], read=False,
                                                            record=release.record)
                else:
                    msg = messages.Register(rid, self.cx.rank_index, session.expected[p],
                                            tuple(0 for _ in self.cx.spec.regions),
                                            tuple(() for _ in self.cx.spec.regions),
                                            cancel=True)
                try:
                    self.cx.io.send_notif(session.peers[p], messages.encode(msg))
                    self.cx.stats.count("releases_sent", 1)
                except TransportError as exc:
                    self.cx.log.warning("pd: release of %s to producer rank %d failed: %s "
                                   "(its lease will expire)", rid, p, exc)
        self._releases = keep

    def _find_recv(self, sender: str, producer_rank: int, producer_rid: str
                   ) -> tuple[str | None, RecvTransfer | None]:
        """(producer engine id, the load) a producer rank's answer is about."""
        for key, session in self.sessions.items():
            peer = session.peers.get(producer_rank)
            if peer is None or peer.name != sender:
                continue
            rid = self._by_producer_rid.get((key[0], producer_rid))
            return key[0], (self.recv.get(rid) if rid is not None else None)
        return None, None

    def on_answer(self, sender: str, msg: messages.Ack | messages.Pushed, now: float) -> None:
        engine_id, recv = self._find_recv(sender, msg.producer_rank, msg.request_id)
        if recv is not None and isinstance(msg, messages.Pushed):
            self.checks.take_digests(recv, msg.producer_rank, msg.digests, msg.algorithm, msg.reason)
        if recv is not None:
            recv.answer(msg.producer_rank, msg.ok, msg.reason, now)
            return
        promised = (self._done_on_promise.get((engine_id, msg.request_id))
                    if engine_id is not None else None)
        if promised is not None and not msg.ok:
            # cannot happen while the producer keeps its promises (and clocks run at
            # about the same rate): say so loudly, the request already finished
            self.cx.stats.count("promises_contradicted", 1)
            self.cx.log.error("pd: producer engine=%s rank=%d answered %r for request %s (%s), "
                         "which finished on its promise to hold the blocks",
                         engine_id, msg.producer_rank, msg.reason, promised[0],
                         msg.request_id)

    def on_held(self, sender: str, msg: messages.Held) -> None:
        _engine_id, recv = self._find_recv(sender, msg.producer_rank, msg.request_id)
        if recv is None:
            return
        self.checks.take_digests(recv, msg.producer_rank, msg.digests, msg.algorithm, msg.reason)
        if not msg.ok:
            return  # no promise: the ack of the read decides
        recv.promised(msg.producer_rank,
                      msg.lease_s * (1.0 - GUARANTEE_RATE_MARGIN) - GUARANTEE_SLACK_S)
