"""Consumer rank: the sessions to producer engines (handshakes, revalidation, drop, heartbeats).

A load asks for the session to its producer engine (:meth:`Sessions.ensure`);
the handshake runs on one of the rank's handshake threads (each bounded by
:attr:`Sessions.handshake_deadline_s`) and the pump settles it
(:meth:`Sessions.settle`), which says which keys failed so the loads waiting on
them fail (:mod:`.loads` acts on it). A session older than ``revalidate_s`` is
revalidated in the background; a peer that restarted is dropped and
re-handshaken on next use. Heartbeats renew the producers' leases of the loads
in flight.

Owns: ``sessions`` (and each session's ``active`` count of the loads posted on
it), ``_connecting``, ``_abandoned``, ``_revalidating``, ``_local_cache``, the
handshake client and thread pool, ``_last_heartbeat``.
May not touch: a load (it reports the keys whose loads must fail), nor the
producer side.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from kvbridge.auth import Label
from kvbridge.backends.transfer import TransportError
from kvbridge.connectors.params import TransferParams
from kvbridge.connectors.pd import messages
from kvbridge.connectors.pd.session import LocalLists, PeerSession, SessionKey, open_session
from kvbridge.connectors.pd.worker_state import WorkerContext, _Connecting, session_key
from kvbridge.handshake import CompatHeader, FetchResult, HandshakeClient
from kvbridge.layouts import ParallelTopology

#: Handshake threads per rank: a peer that is slow to answer delays only its own
#: handshake, not those of other producers.
HANDSHAKE_THREADS = 4
#: Allowance (s) for the transport's local steps of a handshake (loading the peer's metadata,
#: preparing lists) on top of the side channel's timeouts and backoff.
HANDSHAKE_SLACK_S = 5.0


class Sessions:
    """The consumer's sessions, by producer engine (id, host, port)."""

    def __init__(self, cx: WorkerContext) -> None:
        self.cx = cx
        s = cx.settings
        self.client = HandshakeClient(timeout_s=s.handshake_timeout_s,
                                      retries=s.handshake_retries, expected=cx.header,
                                      auth=cx.auth)
        self.sessions: dict[SessionKey, PeerSession] = {}
        self._connecting: dict[SessionKey, _Connecting] = {}
        self._abandoned: list[Future[PeerSession]] = []  # handshakes past their deadline
        self._revalidating: dict[SessionKey, Future[FetchResult]] = {}
        self._local_cache: dict[ParallelTopology, LocalLists] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._last_heartbeat = time.monotonic()

    # ------------------------------------------------------------------ reads

    def get(self, key: SessionKey) -> PeerSession | None:
        # A revalidation runs in the background and never delays a post: a READ to a
        # restarted peer fails fast (disconnect) and only that request fails.
        return self.sessions.get(key)

    def items(self) -> list[tuple[SessionKey, PeerSession]]:
        return list(self.sessions.items())

    def connecting(self, key: SessionKey) -> bool:
        return key in self._connecting

    @property
    def busy(self) -> bool:
        """Handshakes in flight (a hint for the idle pump's interval)."""
        return bool(self._connecting)

    @property
    def abandoned(self) -> int:
        """Handshakes past their deadline, still running."""
        return len(self._abandoned)

    @property
    def handshake_deadline_s(self) -> float:
        """Longest one handshake may take before its requests fail and it is abandoned:
        every attempt's timeout, the backoff between them, and the transport's local steps."""
        s = self.cx.settings
        return (s.handshake_timeout_s * (s.handshake_retries + 1)
                + self.client.max_backoff_s * s.handshake_retries + HANDSHAKE_SLACK_S)

    # ------------------------------------------------------------------ changes

    def ensure(self, params: TransferParams, now: float) -> None:
        key = session_key(params)
        session = self.sessions.get(key)
        if session is not None:
            if (now - session.validated_at > self.cx.settings.revalidate_s
                    and key not in self._revalidating and session.active == 0):
                self._revalidating[key] = self._pool().submit(
                    self._fetch, session.address, self.cx.header)
            return
        if key in self._connecting:
            return
        cx = self.cx
        future = self._pool().submit(
            open_session, key, cx.io, self._fetch, cx.header, cx.spec, cx.sizes, cx.rank,
            cx.memory, self._hello_doc(), self._local_cache)
        self._connecting[key] = _Connecting(future, now)
        cx.stats.count("handshakes")

    def _fetch(self, address: str, expected: CompatHeader) -> FetchResult:
        """The side channel's answer at ``address`` (on a handshake thread), observed."""
        try:
            result = self.client.fetch(address, expected=expected)
        except Exception as exc:
            self.cx.observer.handshake_failed(address, exc)
            raise
        self.cx.observer.handshake(address, result)
        return result

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=HANDSHAKE_THREADS,
                thread_name_prefix=f"kvb-pd-hs-r{self.cx.rank_index}")
        return self._executor

    def settle(self, now: float) -> list[tuple[SessionKey, str, bool]]:
        """Settle the handshakes and revalidations that finished; returns the keys whose
        loads must fail: ``(key, reason, handshake)`` (``handshake``: no session came,
        so the releases waiting for one go too)."""
        failed: list[tuple[SessionKey, str, bool]] = []
        for future in list(self._abandoned):
            if future.done():  # finished after its deadline: nobody wants it any more
                self._abandoned.remove(future)
                if not future.cancelled() and future.exception() is None:
                    future.result().close(self.cx.io)
        for key, pending in list(self._connecting.items()):
            if not pending.future.done():
                if now - pending.started_at > self.handshake_deadline_s:
                    # a peer that keeps one handshake busy fails its own requests only;
                    # the next request to it starts a fresh handshake
                    del self._connecting[key]
                    self._abandoned.append(pending.future)
                    self.cx.stats.count("handshake_failures")
                    self.cx.stats.count("handshakes_abandoned")
                    failed.append((key, f"handshake with {key[1]}:{key[2]} took longer than "
                                        f"{self.handshake_deadline_s:.1f} s", True))
                continue
            del self._connecting[key]
            try:
                session = pending.future.result()
            except Exception as exc:
                self.cx.stats.count("handshake_failures")
                failed.append((key, f"handshake with {key[1]}:{key[2]} failed: {exc}", True))
                continue
            self.sessions[key] = session
        for key, check in list(self._revalidating.items()):
            if not check.done():
                continue
            del self._revalidating[key]
            current = self.sessions.get(key)
            if current is None:
                continue
            try:
                fresh = check.result().metadata
            except Exception as exc:
                self.cx.log.warning("pd: revalidating %s:%s failed (%s); dropping the "
                                    "session", key[1], key[2], exc)
                reason = f"revalidation failed: {exc}"
                if self.drop(key, reason):
                    failed.append((key, dropped_reason(key, reason), False))
                continue
            if (fresh.incarnation != current.metadata.incarnation
                    or fresh.generation != current.metadata.generation):
                self.cx.stats.count("peer_restarts")
                self.cx.log.warning(
                    "pd: peer %s at %s:%s changed (incarnation %s gen %d -> %s gen %d); "
                    "re-handshaking", key[0], key[1], key[2], current.metadata.incarnation,
                    current.metadata.generation, fresh.incarnation, fresh.generation)
                if self.drop(key, "peer restarted"):
                    failed.append((key, dropped_reason(key, "peer restarted"), False))
            else:
                current.validated_at = now
        return failed

    def use(self, session: PeerSession) -> None:
        """A load was posted on ``session`` (a session in use is not revalidated)."""
        session.active += 1

    def unuse(self, key: SessionKey) -> None:
        """A posted load no longer uses the session at ``key`` (if it is still there)."""
        session = self.sessions.get(key)
        if session is not None and session.active > 0:
            session.active -= 1

    def drop(self, key: SessionKey, reason: str) -> bool:
        """Close the session at ``key`` (re-handshaken on next use); False: there was none.
        The caller fails the loads on it (:func:`dropped_reason` says why)."""
        session = self.sessions.pop(key, None)
        if session is None:
            return False
        self.cx.stats.count("sessions_dropped")
        session.close(self.cx.io)
        self.client.invalidate(session.address)
        return True

    def _hello_doc(self) -> bytes:
        """What our ``hello`` carries: our agent record, sealed afresh with the secret."""
        if self.cx.auth is None:
            return self.cx.agent_doc
        return self.cx.auth.seal_request(Label.PEER_HELLO, self.cx.agent_doc)[0]

    # ------------------------------------------------------------------ heartbeats

    def heartbeat(self, params: TransferParams, now: float) -> None:
        """The scheduler's heartbeat of one load (a long wait for its blocks)."""
        session = self.sessions.get(session_key(params))
        if session is None:
            self.ensure(params, now)
            return
        self._send_heartbeat(session, [params.producer_request_id])

    def _send_heartbeat(self, session: PeerSession, rids: Sequence[str]) -> None:
        msg = messages.encode(messages.Heartbeat(tuple(rids)))
        for p in session.targets:
            try:
                self.cx.io.send_notif(session.peers[p], msg)
                self.cx.stats.count("heartbeats_sent")
            except TransportError as exc:
                self.cx.log.info("pd: heartbeat to producer rank %d failed: %s", p, exc)

    def heartbeats(self, now: float,
                   rids_by_key: Callable[[], Mapping[SessionKey, Sequence[str]]]) -> None:
        """Every ``heartbeat_interval_s``: renew the leases of the loads in flight (by
        session, as ``rids_by_key`` says when asked)."""
        if now - self._last_heartbeat < self.cx.settings.heartbeat_interval_s:
            return
        self._last_heartbeat = now
        for key, rids in rids_by_key().items():
            session = self.sessions.get(key)
            if session is not None:
                self._send_heartbeat(session, rids)

    # ------------------------------------------------------------------ shutdown

    def stop_handshakes(self) -> None:
        """Shutdown, first step: no new handshake; wait (bounded) for those running."""
        if self._executor is None:
            return
        # bounded: a handshake still running past this gives up on the closed transport
        running: list[Future[Any]] = [p.future for p in self._connecting.values()]
        running.extend(self._abandoned)
        running.extend(self._revalidating.values())
        self._executor.shutdown(wait=False, cancel_futures=True)
        wait_futures(running, timeout=self.handshake_deadline_s)
        self._executor = None

    def close(self) -> None:
        """Shutdown, once the loads failed: close every session and finished handshake."""
        transport = self.cx.io
        for future in [p.future for p in self._connecting.values()] + self._abandoned:
            with contextlib.suppress(Exception):  # failed or still running: nothing to close
                future.result(timeout=0).close(transport)
        self._connecting.clear()
        self._abandoned.clear()
        for key in list(self.sessions):
            self.sessions.pop(key).close(transport)
        self._local_cache.clear()


def dropped_reason(key: SessionKey, reason: str) -> str:
    """Why the loads of a dropped session fail."""
    return f"session to {key[1]}:{key[2]} dropped: {reason}"
