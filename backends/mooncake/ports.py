"""The host and ports of a local Mooncake store: checking the host, picking ports, probing them.

Owns :func:`check_host` (an IP literal this machine can bind, so every port
binds exactly one address), :func:`url_host`, :func:`pick_free_port`,
:func:`port_accepts` (one bounded TCP connect) and :class:`MasterPorts` (the
three ports of one master: RPC and metrics for ``mooncake_master``, HTTP
metadata for kvbridge's own server).

May not touch: processes (starting, signalling or reaping them is
:mod:`.mooncake_master`'s) or the metadata protocol; a port picked here is
free only "a moment ago", and the caller tolerates the race. Imports nothing
of kvbridge.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

LOOPBACK = "127.0.0.1"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def url_host(host: str) -> str:
    """``host`` as it goes in a URL or ``host:port`` (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host else host


def check_host(host: str) -> str:
    """``host`` if it is an IP literal this machine can bind, else ValueError naming the flag.

    Only literals: a name could resolve to several addresses, and the point is to
    bind exactly one. ``0.0.0.0`` / ``::`` are allowed (every interface, on purpose);
    ``kvbridge doctor`` says so.
    """
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"host must be an IP address such as 127.0.0.1, got {host!r}") from None
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
    except OSError as exc:
        raise ValueError(f"host {host} cannot be bound on this machine ({exc.strerror}); "
                         "give one of its own addresses") from None
    return host


def pick_free_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that was free a moment ago (the caller must tolerate a race)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_accepts(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """True when a TCP connect to ``host:port`` succeeds within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class MasterPorts:
    """The three TCP ports of one master: RPC and metrics (``mooncake_master``), HTTP metadata (kvbridge)."""

    rpc_port: int
    http_port: int
    metrics_port: int

    @staticmethod
    def pick(host: str = LOOPBACK) -> MasterPorts:
        ports: set[int] = set()
        while len(ports) < 3:
            ports.add(pick_free_port(host))
        rpc, http, metrics = sorted(ports)
        return MasterPorts(rpc_port=rpc, http_port=http, metrics_port=metrics)
