"""Which control client may read and abort which request: tokens issued at ``submit``.

A ``submit`` without a token gets a new one in its reply; the client sends it
with its later submits (their requests join the same owner), with ``results``
(it gets the finished results of its own requests, and nobody else does) and
with ``abort`` (of its own requests only). Two routers sharing an engine no
longer take each other's results, and a stranger who reaches the port cannot
read or abort what it did not submit.

A token is 16 random bytes and their HMAC-SHA256 (truncated to 16 bytes)
under a key drawn when the engine starts, as 64 hex characters: the engine
checks a token without remembering every token it issued, so clients that
come and go cost nothing once their results are read. A token does not
authenticate a client to the port (anyone who reaches it may ``submit`` and
get a token of their own); it is the capability to its own requests.

Finished results wait for their owner, at most ``MAX_UNREAD_RESULTS`` of them
in all: past that the oldest owner's unread results are dropped, logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections import OrderedDict
from collections.abc import Iterable

from kvbridge.engine.request import RequestResult

logger = logging.getLogger(__name__)

NONCE_BYTES = 16
TAG_BYTES = 16
TOKEN_CHARS = 2 * (NONCE_BYTES + TAG_BYTES)
#: finished results kept for owners that have not asked for them yet
MAX_UNREAD_RESULTS = 65536


class ResultOwners:
    """Owners of one engine's requests, and their unread results. Not thread-safe."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key is not None else secrets.token_bytes(32)
        self._owner: dict[str, str] = {}  # request id -> token, while it runs
        self._unread: OrderedDict[str, list[RequestResult]] = OrderedDict()
        self._num_unread = 0

    def _tag(self, nonce: bytes) -> bytes:
        return hmac.new(self._key, nonce, hashlib.sha256).digest()[:TAG_BYTES]

    def issue(self) -> str:
        nonce = secrets.token_bytes(NONCE_BYTES)
        return (nonce + self._tag(nonce)).hex()

    def valid(self, token: str) -> bool:
        """``token`` was issued by this engine (the decoder checked its form)."""
        raw = bytes.fromhex(token)
        return hmac.compare_digest(self._tag(raw[:NONCE_BYTES]), raw[NONCE_BYTES:])

    def submitted(self, token: str, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._owner[request_id] = token

    def owner(self, request_id: str) -> str | None:
        return self._owner.get(request_id)

    def collect(self, results: Iterable[RequestResult]) -> None:
        """File the engine's finished results under their owners."""
        for result in results:
            token = self._owner.pop(result.request_id, None)
            if token is None:  # not submitted over this port (a local caller's)
                logger.info("request %s finished with no control client to take it",
                            result.request_id)
                continue
            self._unread.setdefault(token, []).append(result)
            self._num_unread += 1
        while self._num_unread > MAX_UNREAD_RESULTS:
            token, dropped = self._unread.popitem(last=False)
            self._num_unread -= len(dropped)
            logger.warning("control port: dropping %d unread results of one client (more "
                           "than %d unread in all): %s", len(dropped), MAX_UNREAD_RESULTS,
                           ", ".join(r.request_id for r in dropped[:8]))

    def take(self, token: str) -> list[RequestResult]:
        """The finished results of ``token``'s requests not taken yet."""
        results = self._unread.pop(token, [])
        self._num_unread -= len(results)
        return results
