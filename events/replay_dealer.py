"""A subscriber's connection to the replay endpoint: the DEALER and sealing.

Owns the replay DEALER socket (made when the first replay is asked for, with the
bounds of :class:`~kvbridge.events.subscriber_config.SubscriberConfig`: receive
high-water mark ``replay_rcvhwm``, ``MAXMSGSIZE`` ``max_message_bytes``), its
discarding after an abandoned request (late replies to it must never be read as
the answer to a new one), and the sealing of each request with the cluster
secret (:mod:`kvbridge.auth`).

May not touch: what is asked for, how a reply is read and delivered, when to
discard and the backoff after failed replays (the subscriber's protocol,
:mod:`~kvbridge.events.subscriber_core`), the bytes of a request
(:mod:`~kvbridge.events.wire`), sequencing, logging.
"""

from __future__ import annotations

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
