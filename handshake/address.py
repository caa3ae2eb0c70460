"""``HOST:PORT`` parsing and ZMQ endpoint formatting for the side channel."""

from __future__ import annotations

from kvbridge.handshake.errors import HandshakeError


def parse_address(text: str, field: str = "address") -> tuple[str, int]:
    """``"127.0.0.1:5557"``, ``"[::1]:5557"`` or ``"tcp://host:port"`` -> ``(host, port)``."""
    if not isinstance(text, str):
        raise HandshakeError(field, f"expected HOST:PORT, got {type(text).__name__}")
    rest = text.strip()
    if rest.startswith("tcp://"):
        rest = rest[len("tcp://"):]
    if rest.startswith("["):
        host, sep, port_text = rest[1:].partition("]:")
    else:
        host, sep, port_text = rest.rpartition(":")
        if ":" in host:
            raise HandshakeError(field, f"write an IPv6 address as [ADDR]:PORT, got {text!r}")
    if not sep or not host:
        raise HandshakeError(field, f"expected HOST:PORT, got {text!r}")
    try:
        port = int(port_text)
    except ValueError:
        raise HandshakeError(field, f"port must be an integer, got {port_text!r}") from None
    if not 1 <= port <= 65535:
        raise HandshakeError(field, f"port must be in 1..65535, got {port}")
    return host, port


def format_address(host: str, port: int | str) -> str:
    """``HOST:PORT`` (brackets around an IPv6 host)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def zmq_endpoint(host: str, port: int | str) -> str:
    return f"tcp://{format_address(host, port)}"
