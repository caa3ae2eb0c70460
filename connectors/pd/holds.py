"""Producer rank: the lease/hold side of what consumer ranks send.

A consumer agent becomes a peer with its ``hello`` (authenticated when a
cluster secret is set); until then its messages wait, bounded
(``MAX_DEFERRED_PER_AGENT``, ``MAX_DEFERRED_AGENTS``), and are rejected when no
hello comes within ``early_grace_s``. From a peer: ``begin`` is answered with
``held`` (a promise from the :class:`~kvbridge.connectors.pd.leases.LeaseTable`,
with the digests asked, :mod:`.hold_digests`), ``read`` with an ``ack``,
heartbeats renew leases, and ``register`` goes to :mod:`.push`. A message that
names another consumer rank than its hello, or a wrong count of notifying
ranks, is rejected: counted, logged once per sender, never acted on. An agent
whose hello does not authenticate is rejected with everything it sent before it
and sends after it, at once (``_unauthenticated``, bounded); an unknown agent's
messages are counted in ``notifs_deferred`` as they arrive and in
``notifs_rejected`` when no hello follows within ``early_grace_s``.

Owns: ``_consumers``, ``_deferred``, ``_pending_acks``, ``_early_begins``,
``_early_begin_ids``, ``_rejected_senders``, ``_unauthenticated``,
``_expected_by_sizes`` and the answers sent to consumers (:meth:`Holds.send_to`).
Calls: the :class:`~.leases.LeaseTable` and :class:`~.hold_digests.HoldDigests`
it is given, and the push sender attached to it. May not touch: the consumer
side (loads, sessions), nor the push jobs beyond handing a ``register`` to
:mod:`.push`.
"""

from __future__ import annotations

import time
from typing import Protocol

from kvbridge.auth import AuthError, Label, is_sealed
from kvbridge.backends.transfer import TransportError
from kvbridge.connectors.params import TransferMode
from kvbridge.connectors.pd import messages
from kvbridge.connectors.pd.hold_digests import HoldDigests
from kvbridge.connectors.pd.leases import LeaseTable, Verdict, VerdictKind
from kvbridge.connectors.pd.routing import expected_notifs, notify_targets
from kvbridge.connectors.pd.scheduler import HoldOrder
from kvbridge.connectors.pd.worker_state import (
    MAX_CONSUMER_PEERS,
    MAX_EARLY_REGISTERS,
    WorkerContext,
    _ConsumerPeer,
    _PushLists,
)
from kvbridge.handshake import decode_agent
from kvbridge.layouts import ParallelTopology
from kvbridge.layouts.digests import SLICE_ALGORITHMS
from kvbridge.layouts.plan import plan_transfer

#: A transport may deliver a consumer rank's READ notification before its hello, so a
#: producer keeps what an agent it does not know yet sends, without acting on
#: it, for ``PdSettings.early_grace_s`` and up to these bounds (per agent, and
#: agents at once); what does not fit, and what its hello never follows, is
#: rejected (``notifs_rejected``)
MAX_DEFERRED_PER_AGENT = 64
MAX_DEFERRED_AGENTS = 64
#: block ids asked by digest-asking ``begin``s waiting for their hold, at most (all agents)
MAX_EARLY_BEGIN_IDS = 1 << 18
#: senders whose rejected notifications were logged (each once), remembered
MAX_LOGGED_SENDERS = 1024


class PushSide(Protocol):
    """What the holds hand to the producer side of push (:class:`~.push.PushSender`)."""

    def on_register(self, sender: str, reg: messages.Register, now: float) -> None: ...
    def prepare(self, consumer: _ConsumerPeer) -> _PushLists | None: ...


class Holds:
    """The producer's answers to consumer ranks: hello, begin, read, heartbeat."""

    def __init__(self, cx: WorkerContext, leases: LeaseTable, digests: HoldDigests) -> None:
        self.cx = cx
        self.leases = leases
        self.digests = digests
        self.push: PushSide | None = None
        self._consumers: dict[str, _ConsumerPeer] = {}
        #: answers to agents that are not (or no more) peers: (queued at, answer)
        self._pending_acks: dict[str, list[tuple[float, messages.Notif]]] = {}
        #: notifications of agents that have not said hello, (received at, msg)
        self._deferred: dict[str, list[tuple[float, messages.Notif]]] = {}
        self._rejected_senders: dict[str, None] = {}  # insertion-ordered, bounded
        #: agents whose hello did not authenticate (insertion-ordered, bounded): what
        #: they send next is rejected at once, not kept for a hello that came
        self._unauthenticated: dict[str, None] = {}
        self._expected_by_sizes: dict[ParallelTopology, int] = {}
        #: digest-asking ``begin``s that came before the hold started (the router can be
        #: faster than the next step), answered when it starts or after
        #: ``early_grace_s``; bounded like early registrations
        self._early_begins: dict[str, list[tuple[float, str, messages.Begin]]] = {}
        self._early_begin_ids = 0  # block ids those begins ask for, bounded

    def attach(self, push: PushSide) -> None:
        """The producer side of push, which registers are handed to (push mode)."""
        self.push = push

    def consumer(self, agent: str) -> _ConsumerPeer | None:
        return self._consumers.get(agent)

    def consumers(self) -> list[_ConsumerPeer]:
        return list(self._consumers.values())

    def start(self, hold: HoldOrder, now: float) -> None:
        """A hold starts (this step): its digests are taken (pull), the reads and begins
        that came before it are answered."""
        if not hold.push:
            self.digests.take(hold.request_id, hold.block_ids, self._consumers.values())
        for verdict in self.leases.hold(hold.request_id, now, hold.record):
            self.answer(verdict)
        for _at, sender, begin in self._early_begins.pop(hold.request_id, []):
            self._early_begin_ids -= sum(len(g) for g in begin.digest_ids)
            self.on_consumer_notif(sender, begin, now)

    def close(self) -> None:
        """Shutdown: every consumer peer is forgotten (its transport peer removed)."""
        for agent in list(self._consumers):
            self._forget_consumer(agent)

    def on_consumer_notif(self, sender: str, msg: messages.Notif, now: float) -> None:
        """What consumer ranks send a producer rank, acted on only from a session.

        The sender must be an agent that said hello (an unknown one's messages
        wait for its hello, bounded, see ``MAX_DEFERRED_PER_AGENT``), and a
        message naming a consumer rank must name the rank that agent's hello
        described, with the count of notifying ranks this producer rank
        computes for that consumer's topology itself. Anything else is
        rejected: counted, logged once per sender, never acted on.
        """
        consumer = self._consumers.get(sender)
        if consumer is None:
            if sender in self._unauthenticated:
                self.reject(sender, f"{type(msg).__name__} from an agent whose hello did "
                                     "not authenticate")
                return
            self._defer(sender, msg, now)
            return
        if isinstance(msg, messages.ReadDone | messages.Register | messages.Begin):
            mine = consumer.meta.rank_index
            if msg.consumer_rank != mine:
                self.reject(sender, f"{type(msg).__name__} names consumer rank "
                                     f"{msg.consumer_rank}, its hello said {mine}")
                return
        if isinstance(msg, messages.ReadDone | messages.Register):
            expected = self._expected_from(consumer)
            if msg.expected != expected:
                self.reject(sender, f"{type(msg).__name__} expects {msg.expected} notifying "
                                     f"consumer ranks; its topology gives {expected}")
                return
        if isinstance(msg, messages.ReadDone):
            verdict = self.leases.notify(msg.request_id, msg.consumer_rank, msg.expected,
                                          sender, now, record=msg.record,
                                          engine=consumer.meta.engine_id)
            if verdict is not None and msg.read:
                self.answer(verdict)
        elif isinstance(msg, messages.Heartbeat):
            for rid in msg.request_ids:
                self.leases.renew(rid, now)
        elif isinstance(msg, messages.Register):
            assert self.push is not None  # attached as the worker is built
            self.push.on_register(sender, msg, now)
        elif isinstance(msg, messages.Begin):
            asked = sum(len(g) for g in msg.digest_ids)
            if (not self.leases.is_held(msg.request_id)
                    and self.leases.ended(msg.request_id) is None
                    and sum(len(v) for v in self._early_begins.values()) < MAX_EARLY_REGISTERS
                    and self._early_begin_ids + asked <= MAX_EARLY_BEGIN_IDS):
                # not held yet (the router beat the producer's next step): answer with the
                # promise, and the digests asked for, once the hold starts
                self._early_begins.setdefault(msg.request_id, []).append((now, sender, msg))
                self._early_begin_ids += asked
                self.cx.stats.count("begins_before_hold")
                return
            lease_s, reason = self.leases.guarantee(msg.request_id, now, record=msg.record,
                                                     engine=consumer.meta.engine_id,
                                                     consumer_rank=msg.consumer_rank)
            digests: tuple[bytes, ...] = ()
            if reason.startswith("refused"):
                self._log_refusal(msg.request_id, consumer.meta.engine_id, msg.consumer_rank,
                                  reason)
                self.send_to(sender, messages.Held(msg.request_id, self.cx.rank_index, False,
                                                    0.0, reason))
                return
            # digests even without a promise: a READ that beat the hold's start (the router
            # is faster than the producer's next step) completes the lease as the hold
            # starts, before this early begin is answered; the digests taken then still
            # describe the blocks it read (the ack decides whether they were still held)
            if msg.digest_ids:
                digests, why = self.digests.slice_digests_for(msg, consumer) \
                    if msg.algorithm in SLICE_ALGORITHMS else self.digests.digests_for(msg)
                reason = reason or why
            self.send_to(sender, messages.Held(msg.request_id, self.cx.rank_index,
                                                lease_s is not None, lease_s or 0.0, reason,
                                                digests, msg.algorithm if digests else ""))

    def _expected_from(self, consumer: _ConsumerPeer) -> int:
        """How many ranks of ``consumer``'s engine notify this producer rank per request."""
        sizes = consumer.meta.topology.sizes()
        expected = self._expected_by_sizes.get(sizes)
        if expected is None:
            plan = plan_transfer(self.cx.spec, self.cx.sizes, sizes)
            expected = expected_notifs(notify_targets(plan), self.cx.rank_index)
            self._expected_by_sizes[sizes] = expected
        return expected

    def _defer(self, sender: str, msg: messages.Notif, now: float) -> None:
        waiting = self._deferred.get(sender)
        if waiting is None:
            if len(self._deferred) >= MAX_DEFERRED_AGENTS:
                self.reject(sender, "no hello from it, and too many such agents at once")
                return
            waiting = self._deferred[sender] = []
        if len(waiting) >= MAX_DEFERRED_PER_AGENT:
            self.reject(sender, f"no hello from it after {MAX_DEFERRED_PER_AGENT} messages")
            return
        waiting.append((now, msg))
        self.cx.stats.count("notifs_deferred")

    def expire(self, now: float) -> None:
        """Leases that ran out (answered), and early begins, answers and deferred
        messages past their time."""
        for verdict in self.leases.expire(now):
            self.answer(verdict)
        for rid, begins in list(self._early_begins.items()):
            if now - begins[0][0] >= self.cx.settings.early_grace_s:
                del self._early_begins[rid]
                for _at, sender, begin in begins:  # no promise, no digests: the ack decides
                    self._early_begin_ids -= sum(len(g) for g in begin.digest_ids)
                    self.send_to(sender, messages.Held(rid, self.cx.rank_index, False, 0.0,
                                                        "not held (yet)"))
        for agent, answers in list(self._pending_acks.items()):
            if now - answers[0][0] >= self.cx.settings.lease_s:  # no hello again: it is gone
                del self._pending_acks[agent]
        for sender, waiting in list(self._deferred.items()):
            if now - waiting[0][0] >= self.cx.settings.early_grace_s:
                del self._deferred[sender]
                for _ in waiting:
                    self.reject(sender, f"no hello from it within "
                                         f"{self.cx.settings.early_grace_s:g} s")

    def reject(self, sender: str, reason: str) -> None:
        self.cx.stats.count("notifs_rejected")
        if sender in self._rejected_senders:
            return
        if len(self._rejected_senders) >= MAX_LOGGED_SENDERS:
            self._rejected_senders.pop(next(iter(self._rejected_senders)))
        self._rejected_senders[sender] = None
        self.cx.log.warning("pd: producer engine=%s rank=%d: rejecting notifications of agent %s "
                       "(%s; logged once per agent, counted in notifs_rejected)",
                       self.cx.engine_id, self.cx.rank_index, sender[:128], reason)

    def _refuse_hello(self, sender: str, reason: str) -> None:
        """A hello that does not authenticate: rejected, and so is what the agent sent
        before it (kept for its hello) and sends after it, at once, each counted."""
        self.reject(sender, reason)
        if sender not in self._unauthenticated and \
                len(self._unauthenticated) >= MAX_LOGGED_SENDERS:
            self._unauthenticated.pop(next(iter(self._unauthenticated)))
        self._unauthenticated[sender] = None
        for _at, waiting in self._deferred.pop(sender, []):
            self.reject(sender, f"{type(waiting).__name__} from an agent whose hello did "
                                 "not authenticate")

    def on_hello(self, sender: str, msg: messages.Hello, now: float) -> None:
        agent = msg.agent
        if self.cx.auth is not None:  # only a member becomes a peer (and may then be answered)
            try:
                agent = self.cx.auth.open_request(Label.PEER_HELLO, agent).body
            except AuthError as exc:
                self._refuse_hello(sender, f"its hello does not authenticate: {exc.reason}")
                return
        elif is_sealed(agent):
            self._refuse_hello(sender, "its hello is sealed with a cluster secret; this rank "
                                       "has none")
            return
        self._unauthenticated.pop(sender, None)
        meta = decode_agent(agent)
        if meta.agent_name != sender:
            raise TransportError(f"hello from {sender} names agent {meta.agent_name}")
        known = self._consumers.get(sender)
        if known is None and len(self._consumers) >= MAX_CONSUMER_PEERS:
            raise TransportError(f"hello from {sender}: already {MAX_CONSUMER_PEERS} "
                                     f"consumer agents; refused")
        peer = self.cx.io.add_peer(sender, meta.agent_blob)
        if known is not None and known.peer == peer:
            return  # a repeated hello (the consumer re-handshook): everything is in place
        if known is not None and known.push is not None:
            self.cx.io.release_dlist(known.push.local_list)
        consumer = _ConsumerPeer(peer, meta)
        if self.cx.settings.mode is TransferMode.PUSH and self.cx.ctx.role.is_producer:
            try:
                assert self.push is not None
                consumer.push = self.push.prepare(consumer)
            except BaseException:
                # refused (e.g. memory its registration does not cover): forget it whole
                self._consumers.pop(sender, None)
                self.cx.io.remove_peer(peer)
                raise
        self._consumers[sender] = consumer
        for _at, pending in self._pending_acks.pop(sender, []):
            self.send_to(sender, pending)
        for _at, waiting in self._deferred.pop(sender, []):
            try:
                self.on_consumer_notif(sender, waiting, now)
            except Exception as exc:  # as in the worker's dispatch: one message, not the rank
                self.cx.stats.count("bad_notifs")
                self.cx.log.warning("pd: notification %s from %s refused: %s",
                               type(waiting).__name__, sender, exc)

    def answer(self, verdict: Verdict) -> None:
        if verdict.ok:
            ack: messages.Notif = messages.Ack(verdict.request_id, self.cx.rank_index, True)
        elif verdict.kind is VerdictKind.REFUSED:
            ack = messages.Ack(verdict.request_id, self.cx.rank_index, False,
                               f"refused on producer rank {self.cx.rank_index}: {verdict.reason}")
            self._log_refusal(verdict.request_id, verdict.peer, verdict.consumer_rank,
                              verdict.reason)
        else:
            ack = messages.Ack(verdict.request_id, self.cx.rank_index, False,
                               f"lease {verdict.kind.value} on producer rank {self.cx.rank_index}")
            log = self.cx.log.warning if verdict.kind is VerdictKind.LATE else self.cx.log.info
            log("pd: producer engine=%s rank=%d request=%s: %s notification from "
                           "consumer rank %d (%s)", self.cx.engine_id, self.cx.rank_index,
                           verdict.request_id, verdict.kind.value, verdict.consumer_rank,
                           verdict.peer)
        self.send_to(verdict.peer, ack)

    def _log_refusal(self, request_id: str, who: str, consumer_rank: int, reason: str) -> None:
        self.cx.log.warning("pd: producer engine=%s rank=%d request=%s: consumer %s rank %d "
                       "refused (%s); counted in holds_refused", self.cx.engine_id,
                       self.cx.rank_index, request_id[:64], who[:128], consumer_rank, reason)

    def send_to(self, agent: str, msg: messages.Notif) -> None:
        consumer = self._consumers.get(agent)
        if consumer is None:  # answered once it says hello (again), within bounds
            pending = self._pending_acks.get(agent)
            if pending is None and len(self._pending_acks) < MAX_DEFERRED_AGENTS:
                pending = self._pending_acks[agent] = []
            if pending is not None and len(pending) < MAX_DEFERRED_PER_AGENT:
                pending.append((time.monotonic(), msg))
            else:
                self.cx.log.info("pd: no hello from %s; dropping the answer %s",
                            agent[:128], type(msg).__name__)
            return
        try:
            self.cx.io.send_notif(consumer.peer, messages.encode(msg))
        except TransportError as exc:
            self.cx.log.warning("pd: cannot answer consumer %s: %s; dropping it", agent, exc)
            self._forget_consumer(agent)

    def _forget_consumer(self, agent: str) -> None:
        consumer = self._consumers.pop(agent, None)
        if consumer is not None and self.cx.transport is not None:
            if consumer.push is not None:
                self.cx.io.release_dlist(consumer.push.local_list)
            self.cx.io.remove_peer(consumer.peer)  # releases its remote lists
