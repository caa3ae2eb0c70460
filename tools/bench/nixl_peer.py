"""The out-of-process NIXL *peer* that the NIXL benches and the transport tests talk to.

The peer (:func:`peer_main`, driven through :class:`PeerProcess`) is a second
process holding one :class:`~kvbridge.backends.nixl.NixlTransport` with one
registered buffer filled with a known pattern (:func:`pattern`). It keeps
progressing its worker (NIXL runs without a progress thread, so the passive side
of a READ must poll) and answers small msgpack commands over a socketpair
(length-framed by ``multiprocessing.connection.Connection.send_bytes``/``recv_bytes``;
only bytes cross, no pickle on the wire). It is started with ``subprocess`` as
``python -m kvbridge.tools.bench.nixl_peer peer FD NAME NBYTES SEED``: its
arguments are plain strings and the socket end is inherited with ``pass_fds``.

The benches that use it: :mod:`.nixl_cost` (``kvbridge bench nixl-cost``: the
transport against raw NIXL, re-posting one handle and making one per transfer)
and :mod:`.nixl_scale` (``kvbridge bench nixl-scale``). Also here, for every raw
NIXL side of a bench: :func:`wait_raw_transfer`, the poll of a posted handle
until DONE, bounded by a deadline.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import numpy as np

from kvbridge.backends import apply_env_defaults
from kvbridge.backends.nixl import NixlTransport, NixlTransportError

logger = logging.getLogger(__name__)

__all__ = ["PeerProcess", "pattern", "peer_main", "wait_raw_transfer"]

_PEER_MAX_LIFETIME_S = 900.0


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Deterministic uint8 content of ``nbytes`` for ``seed`` (differs per 8-byte word).

    numpy, not torch: the peer process stays torch-free so that it starts in
    well under a second (importing torch takes seconds on a loaded 2-core box).
    Wrap with ``torch.from_numpy`` where a tensor is wanted.
    """
    words = (nbytes + 7) // 8
    x = np.arange(words, dtype=np.int64) * 2654435761 + (seed * 1000003 + 12345)
    return x.view(np.uint8)[:nbytes].copy()


def wait_raw_transfer(agent: Any, handle: Any, state: str, t_end: float,
                      what: str = "transfer") -> None:
    """Poll raw NIXL's ``handle`` (posted, ``state`` what ``transfer`` returned) until DONE.

    Raises TimeoutError past ``t_end`` (``time.monotonic``) and RuntimeError on any
    other end state; ``what`` names the transfer in both (e.g. "READ")."""
    while state == "PROC":
        if time.monotonic() > t_end:
            raise TimeoutError(f"raw NIXL {what} past its deadline")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"raw NIXL {what} state {state}")


# ------------------------------------------------------------------ the peer


class _DeviceBuffer:
    """The peer's buffer in CUDA memory (``device`` "cuda[:N]"): the same ops as the
    numpy host buffer (slice read, fill), copying through host memory."""

    def __init__(self, nbytes: int, seed: int, device: str) -> None:
        import torch

        host = pattern(nbytes, seed) if seed >= 0 else np.zeros(nbytes, dtype=np.uint8)
        self.tensor = torch.from_numpy(host).to(device)
        self.nbytes = nbytes

    def __getitem__(self, key: slice) -> np.ndarray:
        return np.asarray(self.tensor[key].cpu().numpy())

    def __setitem__(self, key: slice, value: np.ndarray) -> None:
        import torch

        self.tensor[key] = torch.from_numpy(np.ascontiguousarray(value)).to(self.tensor.device)


def peer_main(conn: Any, name: str, nbytes: int, seed: int, device: str = "cpu") -> None:
    """Body of the peer process (see module docstring). Exits on ``close`` or EOF.

    ``device`` "cuda[:N]" puts the buffer in CUDA memory (registered as VRAM)."""
    apply_env_defaults()
    transport = NixlTransport(name)
    buf: Any
    if device == "cpu":
        buf = pattern(nbytes, seed) if seed >= 0 else np.zeros(nbytes, dtype=np.uint8)
        region = transport.register_regions([(buf.ctypes.data, buf.nbytes)])[0]
    else:
        buf = _DeviceBuffer(nbytes, seed, device)
        region = transport.register_regions([buf.tensor])[0]
    peers: dict[str, Any] = {}
    notifs: dict[str, list[bytes]] = {}

    def reply(obj: Any) -> None:
        conn.send_bytes(msgpack.packb(obj, use_bin_type=True))

    reply({"name": transport.name, "md": transport.agent_metadata(), "addr": region.addr,
           "nbytes": region.nbytes, "pid": os.getpid(), "mem_type": region.mem_type,
           "device_id": region.device_id})
    t_end = time.monotonic() + _PEER_MAX_LIFETIME_S
    try:
        while time.monotonic() < t_end:
            for sender, msgs in transport.get_notifs().items():
                notifs.setdefault(sender, []).extend(msgs)
            if not conn.poll(0.0002):
                continue
            try:
                cmd = msgpack.unpackb(conn.recv_bytes(), raw=False)
            except EOFError:
                break
            op = cmd["op"]
            try:
                if op == "notifs":
                    reply(notifs)
                    notifs = {}
                elif op == "read":
                    off, ln = cmd["offset"], cmd["length"]
                    reply(buf[off : off + ln].tobytes())
                elif op == "fill":
                    buf[:] = pattern(nbytes, cmd["seed"])
                    reply(True)
                elif op == "add_peer":
                    peers[cmd["name"]] = transport.add_peer(cmd["name"], cmd["md"])
                    reply(True)
                elif op == "send_notif":
                    transport.send_notif(peers[cmd["name"]], cmd["msg"])
                    reply(True)
                elif op == "counters":
                    reply(transport.counters().__dict__)
                elif op == "close":
                    reply(transport.close(strict=False).__dict__)
                    return
                else:
                    reply({"error": f"unknown op {op!r}"})
            except NixlTransportError as exc:
                reply({"error": str(exc)})
    finally:
        transport.close(strict=False)


class PeerProcess:
    """Parent-side handle of a peer subprocess. Every call is bounded by ``timeout_s``."""

    def __init__(self, name: str, nbytes: int, seed: int = 1, timeout_s: float = 30.0,
                 device: str = "cpu", env: dict[str, str] | None = None) -> None:
        mine, theirs = socket.socketpair()
        self.timeout_s = timeout_s
        try:
            fd = theirs.fileno()
            argv = [sys.executable, "-m", "kvbridge.tools.bench.nixl_peer", "peer", str(fd), name,
                    str(nbytes), str(seed)] + ([device] if device != "cpu" else [])
            self.proc = subprocess.Popen(argv, pass_fds=(fd,), stdin=subprocess.DEVNULL,
                                         env=None if env is None else {**os.environ, **env})
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self._conn = Connection(mine.detach())
        try:
            hello = self._recv()
        except BaseException:
            self.kill()
            raise
        self.name: str = hello["name"]
        self.metadata: bytes = hello["md"]
        self.addr: int = hello["addr"]
        self.nbytes: int = hello["nbytes"]
        self.pid: int = hello["pid"]
        self.mem_type: str = hello.get("mem_type", "DRAM")
        self.device_id: int = hello.get("device_id", 0)

    def _recv(self) -> Any:
        if not self._conn.poll(self.timeout_s):
            raise TimeoutError(f"peer {self.proc.pid} did not answer within {self.timeout_s} s")
        out = msgpack.unpackb(self._conn.recv_bytes(), raw=False)
        if isinstance(out, dict) and "error" in out:
            raise NixlTransportError(f"peer: {out['error']}")
        return out

    def call(self, op: str, **kw: Any) -> Any:
        self._conn.send_bytes(msgpack.packb({"op": op, **kw}, use_bin_type=True))
        return self._recv()

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self.call("read", offset=offset, length=length))

    def notifs(self) -> dict[str, list[bytes]]:
        return {k: [bytes(m) for m in v] for k, v in self.call("notifs").items()}

    def close(self) -> dict[str, int] | None:
        """Ask the peer to close (returns its final counters), then reap the process."""
        result = None
        if self.proc.poll() is None:
            try:
                result = self.call("close")
            except (OSError, EOFError, TimeoutError, NixlTransportError):
                result = None
        self.kill()
        return result

    def kill(self) -> None:
        """Reap the peer: a grace period to exit, then SIGKILL (bounded waits)."""
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self._conn.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _peer_entry(argv: Sequence[str]) -> int:
    """``peer FD NAME NBYTES SEED [DEVICE]``: run :func:`peer_main` on the inherited
    socket ``FD`` (DEVICE: cpu, the default, or cuda[:N])."""
    if len(argv) not in (5, 6) or argv[0] != "peer":
        sys.stderr.write("usage: python -m kvbridge.tools.bench.nixl_peer peer FD NAME NBYTES SEED "
                         "[DEVICE]\n")
        return 2
    fd, name, nbytes, seed = int(argv[1]), argv[2], int(argv[3]), int(argv[4])
    with Connection(fd) as conn:
        peer_main(conn, name, nbytes, seed, argv[5] if len(argv) == 6 else "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(_peer_entry(sys.argv[1:]))
