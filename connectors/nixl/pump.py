"""The progress pump: what a rank does every engine step, and while the engine idles.

``_progress`` drains NIXL notifications (which also progresses the UCX worker,
as the passive side of a READ must) and dispatches them, settles handshakes
run on the handshake threads (each bounded by :attr:`handshake_deadline_s`),
posts and polls loads, sends releases, progresses pushes, expires leases and
deferred messages, and sends heartbeats. The idle pump thread runs the same
``_progress`` under the same lock when no hook came for ``idle_progress_ms``.
The consumer's sessions (handshakes, revalidation, drop) live here too: they
are settled by the pump and used by every load.

Owns: ``_sessions``, ``_connecting``, ``_abandoned``, ``_revalidating``, the
handshake thread pool, the pump thread, heartbeats. May not touch: what a
notification or a load means (that is :mod:`.loads`, :mod:`.holds` and
:mod:`.push`); it only calls them in order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvbridge.auth import Label
from kvbridge.backends.nixl import NixlTransportError
from kvbridge.connectors.nixl import messages
from kvbridge.connectors.nixl.session import PeerSession, SessionKey, open_session
from kvbridge.connectors.nixl.state import RecvState
from kvbridge.connectors.nixl.worker_state import WorkerState, _Connecting, logger
from kvbridge.connectors.params import TransferParams

#: Handshake threads per rank: a peer that is slow to answer delays only its own
#: handshake, not those of other producers.
HANDSHAKE_THREADS = 4
#: Allowance (s) for NIXL's local steps of a handshake (loading the peer's metadata,
#: preparing lists) on top of the side channel's timeouts and backoff.
HANDSHAKE_SLACK_S = 5.0


class ProgressPump(WorkerState):
    """Drains, settles, polls and times out: every step and while the engine idles."""

    def _pump_loop(self) -> None:
        """Progress while the engine is idle (no hook call for ``idle_progress_ms``).

        An idle engine does not step, yet a peer may be reading from this rank
        (the passive side must progress its UCX worker) or waiting for an ack.
        The pump runs the same :meth:`_progress` as the hooks, under the same
        lock, so the worker's state is only ever touched by one thread at a time.

        While a peer may be waiting on this rank (blocks held under a lease, loads,
        pushes, releases or handshakes in flight) it polls every
        ``busy_progress_ms`` (0.2 ms) at most: a consumer's ``begin`` is then
        answered (and its ``read`` acked) within a fraction of a millisecond
        instead of a full idle interval: one of them is on every pull load's
        critical path. While a READ of this rank is in flight it polls every
        ``read_progress_ms`` (0.05 ms): the READ moves and is seen done only as
        the rank progresses."""
        idle = self.settings.idle_progress_ms / 1000.0
        busy = min(idle, self.settings.busy_progress_ms / 1000.0)
        reading = min(busy, self.settings.read_progress_ms / 1000.0)
        interval = idle
        while not self._pump_stop.wait(interval):
            interval = (reading if self._reading() else busy) if self._peer_may_wait() else idle
            if time.monotonic() - self._last_progress < interval:
                continue
            with self._state_lock:
                if self._closed:
                    return
                try:
                    self._progress()
                except Exception:  # never kill the pump; the next hook reports properly
                    logger.exception("nixl: idle progress failed on rank %d", self.rank_index)

    def _peer_may_wait(self) -> bool:
        """Outstanding work a peer may be waiting on (read without the lock: a
        hint for the pump's interval only, never for the worker's state)."""
        return bool(self._recv or self._push_jobs or self._releases or self._connecting
                    or self._leases.held())

    def _reading(self) -> bool:
        """A READ of this rank in flight (read without the lock: a hint for the pump's
        interval only; a load that changes meanwhile is seen at the next turn)."""
        try:
            return any(recv.state is RecvState.TRANSFERRING for recv in self._recv.values())
        except RuntimeError:  # the dict changed under us: ask again next turn
            return True

    def _progress(self) -> None:
        if self.transport is None or self._closed:
            return
        now = time.monotonic()
        self._last_progress = now
        self._drain_notifs(now)
        self._settle_sessions(now)
        self._reads_ended = False
        self._progress_recv(now)
        if self._reads_ended:
            # a READ just ended (often inside the post: shared memory copies at once);
            # the producers' ``held`` answers arrived meanwhile: take them now, not a
            # step later, so the load completes in this very call
            now = time.monotonic()
            self._drain_notifs(now)
            self._progress_recv(now)
        self._send_releases(now)
        self._progress_pushes(now)
        for verdict in self._leases.expire(now):
            self._answer(verdict)
        self._expire_deferred(now)
        for rid, at in list(self._cancelled.items()):
            if now - at > self.settings.lease_s:
                del self._cancelled[rid]
        if self._done_on_promise:
            for key, (_rid, forget_at) in list(self._done_on_promise.items()):
                if now >= forget_at:
                    del self._done_on_promise[key]
        self._heartbeats(now)

    def _drain_notifs(self, now: float) -> None:
        assert self.transport is not None
        self._handle_batch(self.transport.get_notifs(), now)

    def _handle_batch(self, batch: dict[str, list[bytes]], now: float) -> None:
        for sender, msgs in batch.items():
            for raw in msgs:
                try:
                    msg = messages.decode(raw)
                except messages.NotifError as exc:
                    self._counters["bad_notifs"] += 1
                    logger.warning("nixl: bad notification from %s: %s", sender, exc)
                    continue
                try:
                    self._on_notif(sender, msg, now)
                except Exception as exc:  # one peer's bad message must not stop the rank
                    self._counters["bad_notifs"] += 1
                    logger.warning("nixl: notification %s from %s refused: %s",
                                   type(msg).__name__, sender, exc)

    def _on_notif(self, sender: str, msg: messages.Notif, now: float) -> None:
        if isinstance(msg, messages.Hello):
            self._on_hello(sender, msg, now)
        elif isinstance(msg, messages.Ack | messages.Pushed):
            self._on_answer(sender, msg, now)  # bound to the session's producer agent
        elif isinstance(msg, messages.Held):
            self._on_held(sender, msg)
        else:
            self._on_consumer_notif(sender, msg, now)

    def _ensure_session(self, params: TransferParams, now: float) -> None:
        key = self._session_key(params)
        session = self._sessions.get(key)
        if session is not None:
            if (now - session.validated_at > self.settings.revalidate_s
                    and key not in self._revalidating and session.active == 0):
                self._revalidating[key] = self._pool().submit(
                    self._client.fetch, session.address, expected=self.header)
            return
        if key in self._connecting:
            return
        assert self.transport is not None
        future = self._pool().submit(
            open_session, key, self.transport, self._client, self.header, self.ctx.spec,
            self.sizes, self.rank, self.memory, self._hello_doc(), self._local_cache)
        self._connecting[key] = _Connecting(future, now)
        self._counters["handshakes"] += 1

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=HANDSHAKE_THREADS,
                thread_name_prefix=f"kvb-nixl-hs-r{self.rank_index}")
        return self._executor

    @property
    def handshake_deadline_s(self) -> float:
        """Longest one handshake may take before its requests fail and it is abandoned:
        every attempt's timeout, the backoff between them, and NIXL's local steps."""
        s = self.settings
        return (s.handshake_timeout_s * (s.handshake_retries + 1)
                + self._client.max_backoff_s * s.handshake_retries + HANDSHAKE_SLACK_S)

    def _settle_sessions(self, now: float) -> None:
        for future in list(self._abandoned):
            if future.done():  # finished after its deadline: nobody wants it any more
                self._abandoned.remove(future)
                if not future.cancelled() and future.exception() is None:
                    assert self.transport is not None
                    future.result().close(self.transport)
        for key, pending in list(self._connecting.items()):
            if not pending.future.done():
                if now - pending.started_at > self.handshake_deadline_s:
                    # a peer that keeps one handshake busy fails its own requests only;
                    # the next request to it starts a fresh handshake
                    del self._connecting[key]
                    self._abandoned.append(pending.future)
                    self._counters["handshake_failures"] += 1
                    self._counters["handshakes_abandoned"] += 1
                    self._fail_key(key, f"handshake with {key[1]}:{key[2]} took longer than "
                                        f"{self.handshake_deadline_s:.1f} s", now)
                    self._releases = [r for r in self._releases
                                      if self._session_key(r.params) != key]
                continue
            del self._connecting[key]
            try:
                session = pending.future.result()
            except Exception as exc:
                self._counters["handshake_failures"] += 1
                self._fail_key(key, f"handshake with {key[1]}:{key[2]} failed: {exc}", now)
                self._releases = [r for r in self._releases
                                  if self._session_key(r.params) != key]
                continue
            self._sessions[key] = session
        for key, future in list(self._revalidating.items()):
            if not future.done():
                continue
            del self._revalidating[key]
            current = self._sessions.get(key)
            if current is None:
                continue
            try:
                fresh = future.result().metadata
            except Exception as exc:
                logger.warning("nixl: revalidating %s:%s failed (%s); dropping the session",
                               key[1], key[2], exc)
                self._drop_session(key, now, reason=f"revalidation failed: {exc}")
                continue
            if (fresh.incarnation != current.metadata.incarnation
                    or fresh.generation != current.metadata.generation):
                self._counters["peer_restarts"] += 1
                logger.warning("nixl: peer %s at %s:%s changed (incarnation %s gen %d -> %s gen "
                               "%d); re-handshaking", key[0], key[1], key[2],
                               current.metadata.incarnation, current.metadata.generation,
                               fresh.incarnation, fresh.generation)
                self._drop_session(key, now, reason="peer restarted")
            else:
                current.validated_at = now

    def _session_ready(self, key: SessionKey) -> PeerSession | None:
        # A revalidation runs in the background and never delays a post: a READ to a
        # restarted peer fails fast (disconnect) and only that request fails.
        return self._sessions.get(key)

    def _fail_key(self, key: SessionKey, reason: str, now: float) -> None:
        for recv in list(self._recv.values()):
            if self._session_key(recv.params) == key:
                self._fail(recv, reason, now)

    def _drop_session(self, key: SessionKey, now: float, reason: str) -> None:
        session = self._sessions.pop(key, None)
        if session is None:
            return
        self._counters["sessions_dropped"] += 1
        assert self.transport is not None
        session.close(self.transport)
        self._client.invalidate(session.address)
        self._fail_key(key, f"session to {key[1]}:{key[2]} dropped: {reason}", now)

    def _hello_doc(self) -> bytes:
        """What our ``hello`` carries: our agent record, sealed afresh with the secret."""
        if self.auth is None:
            return self._agent_doc
        return self.auth.seal_request(Label.NIXL_HELLO, self._agent_doc)[0]

    def _heartbeat_params(self, params: TransferParams) -> None:
        session = self._sessions.get(self._session_key(params))
        if session is None:
            self._ensure_session(params, time.monotonic())
            return
        self._send_heartbeat(session, [params.producer_request_id])

    def _send_heartbeat(self, session: PeerSession, rids: Sequence[str]) -> None:
        assert self.transport is not None
        msg = messages.encode(messages.Heartbeat(tuple(rids)))
        for p in session.targets:
            try:
                self.transport.send_notif(session.peers[p], msg)
                self._counters["heartbeats_sent"] += 1
            except NixlTransportError as exc:
                logger.info("nixl: heartbeat to producer rank %d failed: %s", p, exc)

    def _heartbeats(self, now: float) -> None:
        if now - self._last_heartbeat < self.settings.heartbeat_interval_s:
            return
        self._last_heartbeat = now
        by_key: dict[SessionKey, list[str]] = {}
        for recv in self._recv.values():
            by_key.setdefault(self._session_key(recv.params), []).append(
                recv.params.producer_request_id)
        for key, rids in by_key.items():
            session = self._sessions.get(key)
            if session is not None:
                self._send_heartbeat(session, rids)
