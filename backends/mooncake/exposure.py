"""Where the ports of a Mooncake store listen, as far as this host can tell (for ``kvbridge doctor``).

Owns :func:`listening_addresses` (the kernel's ``/proc/net/tcp{,6}`` LISTEN
table), :func:`local_addresses` (this host's IPv4 addresses),
:class:`PortExposure` and :func:`port_exposure` / :func:`master_exposure`,
which say whether a port listens on the host it was given only or on every
interface (Mooncake's embedded metadata server binds 0.0.0.0 whatever host it
is given: the reason kvbridge runs its own, see :mod:`.mooncake_master`).

May not touch: the master's processes (it only reads /proc and connects), nor
start anything that listens. Imports only :mod:`.mooncake_ports` of kvbridge.
A test that narrows :func:`local_addresses` or redirects
:func:`listening_addresses` replaces them in this module, where
:func:`port_exposure` looks them up.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvbridge.backends.mooncake.ports import port_accepts, url_host

_TCP_LISTEN = "0A"  # st field of /proc/net/tcp{,6}
WILDCARDS = ("0.0.0.0", "::")


def listening_addresses(port: int, proc_net: str | os.PathLike[str] = "/proc/net",
                        ) -> list[str] | None:
    """Local addresses with a TCP socket LISTENing on ``port`` (this network namespace).

    Read from ``/proc/net/tcp`` and ``tcp6``; None when neither can be read (not
    Linux). ``0.0.0.0`` or ``::`` in the answer means every interface.
    """
    found: set[str] = set()
    readable = False
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = (Path(proc_net) / name).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != _TCP_LISTEN:
                continue
            addr_hex, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(addr_hex)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            address = socket.inet_ntop(family, raw)
            if address.startswith("::ffff:"):
                address = address[len("::ffff:"):]
            found.add(address)
    return sorted(found) if readable else None


def local_addresses() -> list[str]:
    """IPv4 addresses of this host's interfaces (loopback included), from SIOCGIFADDR."""
    import fcntl
    import struct

    addresses: set[str] = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(sock.fileno(), 0x8915, request)  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address on this interface
            addresses.add(socket.inet_ntoa(answer[20:24]))
    return sorted(addresses, key=lambda a: (not a.startswith("127."), a))


def _is_local(host: str, local: Sequence[str]) -> bool:
    if host in WILDCARDS or host in local:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class PortExposure:
    """Where one port of a Mooncake store listens, as far as this host can tell.

    ``listening``: the addresses bound (from /proc), None when it cannot tell (a
    remote host, or a port not visible in this network namespace).
    ``accepts``: address -> whether a TCP connect succeeded (this host's own
    addresses for a local port, the given host for a remote one).
    ``every_interface``: True when bound to 0.0.0.0/::, or (without /proc) when
    it accepts on a non-loopback address it was not given; None when unknown.
    """

    name: str
    host: str
    port: int
    listening: list[str] | None
    accepts: dict[str, bool]
    every_interface: bool | None

    def describe(self) -> str:
        where = f"{self.name} {url_host(self.host)}:{self.port}"
        if self.listening is not None and self.listening:
            bound = ", ".join(self.listening)
            if self.every_interface:
                return f"{where} listens on EVERY interface ({bound})"
            return f"{where} listens on {bound} only"
        reached = [a for a, ok in self.accepts.items() if ok]
        if self.every_interface:
            return (f"{where} accepts on {', '.join(reached)}, not only the host it was given "
                    "(likely every interface)")
        if self.listening is not None:  # local, but not in this namespace's table
            return f"{where}: no listener seen in /proc/net/tcp; accepts on {reached or 'nothing'}"
        state = "accepts" if reached else "does not accept"
        return f"{where} {state} connections; which interfaces it listens on cannot be told from here"


def port_exposure(name: str, host: str, port: int, timeout_s: float = 0.5) -> PortExposure:
    """:class:`PortExposure` of ``host:port``: /proc for a local host, plus connect attempts."""
    local = local_addresses()
    if not _is_local(host, local):
        return PortExposure(name, host, port, None,
                            {host: port_accepts(host, port, timeout_s)}, None)
    listening = listening_addresses(port)
    accepts = {addr: port_accepts(addr, port, timeout_s) for addr in local}
    if listening:
        every: bool | None = any(a in WILDCARDS for a in listening)
    else:
        # Not in /proc (another network namespace, or not Linux): judge by connecting.
        others = [a for a, ok in accepts.items() if ok and a != host
                  and not ipaddress.ip_address(a).is_loopback]
        every = bool(others) if any(accepts.values()) else None
    return PortExposure(name, host, port, listening, accepts, every)


def master_exposure(rpc_address: str, metadata_url: str | None = None,
                    metrics_port: int | None = None, timeout_s: float = 0.5,
                    ) -> list[PortExposure]:
    """Exposure of a master's RPC port, its metadata server (an ``http://`` URL) and metrics."""
    from urllib.parse import urlsplit

    host, _, port_text = rpc_address.rpartition(":")
    host = host.strip("[]")
    if not host or not port_text.isdigit():
        raise ValueError(f"master address must be HOST:PORT, got {rpc_address!r}")
    rows = [port_exposure("rpc", host, int(port_text), timeout_s)]
    if metadata_url is not None and metadata_url.startswith("http://"):
        parts = urlsplit(metadata_url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"metadata URL must be http://HOST:PORT/metadata, got {metadata_url!r}")
        rows.append(port_exposure("metadata", parts.hostname, parts.port, timeout_s))
    if metrics_port is not None:
        rows.append(port_exposure("metrics", host, metrics_port, timeout_s))
    return rows
