"""A subscriber's connection to the replay endpoint: the DEALER, sealing, backoff.

Owns the replay DEALER socket (made when the first replay is asked for, with the
bounds of :class:`~kvbridge.events.subscriber_config.SubscriberConfig`: receive
high-water mark ``replay_rcvhwm``, ``MAXMSGSIZE`` ``max_message_bytes``), its
discarding after an abandoned request (late replies to it must never be read as
the answer to a new one), the sealing of each request with the cluster secret
(:mod:`kvbridge.auth`), and the backoff after failed replays: no replay for
``replay_backoff_s``, doubling per consecutive failure up to
``replay_backoff_max_s``, reset by one successful replay.

May not touch: what is asked for or how a reply is read and delivered (the
subscriber's replay path, :mod:`~kvbridge.events.subscriber`), the bytes of a
request (:mod:`~kvbridge.events.wire`), sequencing, logging (the subscriber
logs each failure with the backoff this module returns).
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from kvbridge.auth import ClusterAuth, Label

from .errors import EndpointError
from .subscriber_config import SubscriberConfig


class ReplayDealer:
    """The replay endpoint of one subscriber; used from the subscriber's thread only."""

    def __init__(self, config: SubscriberConfig, context: zmq.Context[Any],
                 auth: ClusterAuth | None) -> None:
        self._config = config
        self._ctx = context
        self._auth = auth
        self._socket: zmq.Socket[Any] | None = None
        self.failures = 0  # consecutive failed replays
        self.blocked_until = 0.0  # time.monotonic() before which no replay is tried

    def socket(self) -> zmq.Socket[Any]:
        """The DEALER, connected (made on first use, and again after ``discard``)."""
        if self._socket is None:
            assert self._config.replay_endpoint is not None
            self._socket = self._ctx.socket(zmq.DEALER)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.setsockopt(zmq.RCVHWM, self._config.replay_rcvhwm)
            self._socket.setsockopt(zmq.MAXMSGSIZE, self._config.max_message_bytes)
            try:
                self._socket.connect(self._config.replay_endpoint)
            except zmq.ZMQError as exc:
                self.discard()
                raise EndpointError("replay_endpoint", self._config.replay_endpoint,
                                    zmq.strerror(exc.errno or 0)) from None
        return self._socket

    def discard(self) -> None:
        # Late replies to an abandoned request must never be read as a new answer.
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def close(self) -> None:
        self.discard()

    def seal(self, request: bytes) -> bytes:
        """``request`` as sent: sealed with the cluster secret when there is one."""
        return request if self._auth is None else \
            self._auth.seal_request(Label.EVENTS_REPLAY, request)[0]

    def failed(self) -> float:
        """Start (or extend) the backoff after a timed-out or overrun replay, and
        discard the socket; returns the backoff in seconds."""
        self.failures += 1
        config = self._config
        backoff = min(
            config.replay_backoff_max_s,
            config.replay_backoff_s * 2 ** min(self.failures - 1, 32),
        )
        self.blocked_until = time.monotonic() + backoff
        self.discard()  # late replies to this request must never be read
        return backoff

    def succeeded(self) -> None:
        self.failures = 0
