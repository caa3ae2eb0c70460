"""Push, consumer side: a load registers its block ids with the producer ranks.

A push load ``register``s its block ids with every producer rank it notifies
(asking the sources for digests in the same message, :mod:`.load_checks`) and
is DONE when every source sent ``pushed`` (that answer is taken by
:mod:`.loads`, with the pull acks); an aborted load sends a cancelling
``register`` instead, whose answer finishes it once the producer's WRITEs in
flight settled.

Owns: the ``register`` messages a load sends. May not touch: the producer
side of push (:mod:`.push`), the sessions (it reads them), nor a load's state
beyond failing it through :mod:`.loads`' ``_fail``.
"""

from __future__ import annotations

from kvbridge.backends.nixl import NixlTransportError
from kvbridge.connectors.nixl import messages
from kvbridge.connectors.nixl.session import PeerSession
from kvbridge.connectors.nixl.state import RecvState, RecvTransfer
from kvbridge.connectors.nixl.worker_state import WorkerState
from kvbridge.connectors.params import TransferMode


class PushRegisters(WorkerState):
    """Push, consumer: the registrations (and cancelling ones) of the loads."""

    def _post_registers(self, recv: RecvTransfer, session: PeerSession) -> None:
        """Consumer, push: ``register`` the load's block ids with every producer rank it
        notifies (asking the sources for digests); raises what sending raises."""
        assert self.transport is not None
        rid = recv.params.producer_request_id
        for p in session.targets:
            ask = self._ask_for(recv, session, p) \
                if p in session.rank_plan.sources else None
            reg = messages.Register(rid, self.rank_index, session.expected[p],
                                    recv.start, recv.consumer_block_ids,
                                    algorithm=ask.algorithm if ask else "", chain=recv.chain)
            self.transport.send_notif(session.peers[p], messages.encode(reg))

    def _cancel_load(self, request_id: str, now: float) -> None:
        """The engine finished a request while it was loading (abort). Pull: its READ
        settles as usual (the blocks stay pinned until then). Push: ask the producer to
        stop; its answer (after in-flight writes settle) finishes the request."""
        recv = self._recv.get(request_id)
        if recv is None or recv.params.mode is not TransferMode.PUSH:
            return
        session = self._sessions.get(self._session_key(recv.params))
        if session is None or recv.state is RecvState.BOOTSTRAPPING:
            self._fail(recv, "cancelled before registration", now)
            return
        assert self.transport is not None
        for p in session.targets:
            # the count of notifying ranks the producer rank computes too (else refused)
            msg = messages.encode(messages.Register(
                recv.params.producer_request_id, self.rank_index, session.expected[p],
                recv.start, recv.consumer_block_ids, cancel=True))
            try:
                self.transport.send_notif(session.peers[p], msg)
            except NixlTransportError as exc:
                self._fail(recv, f"cancel: {exc}", now)
                return
