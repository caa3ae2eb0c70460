"""Push, consumer side: a load registers its block ids with the producer ranks.

A push load ``register``s its block ids with every producer rank it notifies
(asking the sources for digests in the same message, :mod:`.load_checks`) and
is DONE when every source sent ``pushed`` (that answer is taken by
:mod:`.loads`, with the pull acks); an aborted load sends a cancelling
``register`` instead, whose answer finishes it once the producer's WRITEs in
flight settled.

Owns: the ``register`` messages a load sends (no state of its own). May not
touch: the producer side of push (:mod:`.push`), the sessions (it reads them),
nor a load's state (:mod:`.loads` fails a load whose cancel could not be sent).
"""

from __future__ import annotations

from kvbridge.backends.transfer import TransportError
from kvbridge.connectors.pd import messages
from kvbridge.connectors.pd.load_checks import LoadChecks
from kvbridge.connectors.pd.session import PeerSession
from kvbridge.connectors.pd.state import RecvTransfer
from kvbridge.connectors.pd.worker_state import WorkerContext


class PushRegisters:
    """Push, consumer: the registrations (and cancelling ones) of the loads."""

    def __init__(self, cx: WorkerContext, checks: LoadChecks) -> None:
        self.cx = cx
        self.checks = checks

    def post(self, recv: RecvTransfer, session: PeerSession) -> None:
        """Consumer, push: ``register`` the load's block ids with every producer rank it
        notifies (asking the sources for digests); raises what sending raises."""
        rid = recv.params.producer_request_id
        for p in session.targets:
            ask = self.checks.ask_for(recv, session, p) \
                if p in session.rank_plan.sources else None
            reg = messages.Register(rid, self.cx.rank_index, session.expected[p],
                                    recv.start, recv.consumer_block_ids,
                                    algorithm=ask.algorithm if ask else "", chain=recv.chain)
            self.cx.io.send_notif(session.peers[p], messages.encode(reg))

    def cancel(self, recv: RecvTransfer, session: PeerSession) -> str | None:
        """Consumer, push: a cancelling ``register`` to every producer rank the load
        notifies; None when sent, else why not (the load then fails)."""
        for p in session.targets:
            # the count of notifying ranks the producer rank computes too (else refused)
            msg = messages.encode(messages.Register(
                recv.params.producer_request_id, self.cx.rank_index, session.expected[p],
                recv.start, recv.consumer_block_ids, cancel=True))
            try:
                self.cx.io.send_notif(session.peers[p], msg)
            except TransportError as exc:
                return str(exc)
        return None
