"""The error types of the handshake package."""

from __future__ import annotations


class HandshakeError(ValueError):
    """Handshake data is malformed, incompatible, or the peer could not be reached.

    ``field`` names what was wrong (``"ranks[1].regions[0].base_addrs"``,
    ``"fingerprint.regions[attn].dtype"``, ``"protocol_version"``, ``"timeout"``)
    so the connector and the CLI can point at it; ``reason`` is the message
    without the field. Every failure of decoding, validation and transport in
    this package is a HandshakeError (or a subclass), never a bare KeyError or
    msgpack exception.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


class HandshakeTimeout(HandshakeError):
    """The peer did not answer within the client's timeout after every retry.

    Its ``field`` is ``"timeout"``. A subclass so callers that only care about
    "the handshake failed" catch HandshakeError and still get this one.
    """

    def __init__(self, message: str) -> None:
        super().__init__("timeout", message)
