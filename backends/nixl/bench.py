"""Raw NIXL benchmark, plus the out-of-process NIXL *peer* used by it and by the tests.

The peer (:func:`peer_main`, driven through :class:`PeerProcess`) is a second
process holding one :class:`~kvbridge.backends.nixl.NixlTransport` with one
registered buffer filled with a known pattern. It keeps progressing its
worker (NIXL runs without a progress thread, so the passive side of a READ
must poll) and answers small msgpack commands over a socketpair (length-framed
by ``multiprocessing.connection.Connection.send_bytes``/``recv_bytes``; only
bytes cross, no pickle on the wire). It is started with ``subprocess`` as
``python -m kvbridge.backends.nixl.bench peer FD NAME NBYTES SEED``: its
arguments are plain strings and the socket end is inherited with ``pass_fds``.

:func:`run_nixl_raw_bench` moves the same blocks three ways: the NIXL library
called directly with one prepared transfer of all blocks, this package's
adapter (one ``post`` per iteration, as a connector does), and a ``torch``
copy of the same bytes in one process (the memory-bandwidth limit).
Its raw side re-posts one handle while the adapter makes and releases one per
transfer: :mod:`.nixl_cost` (``kvbridge bench nixl-cost``) compares the adapter
with raw NIXL doing what one request does, and reports the fixed cost per transfer.
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from kvbridge.backends import apply_env_defaults
from kvbridge.backends.nixl import (
    NixlTransport,
    NixlTransportError,
    XferState,
    block_descs,
    load_nixl_api,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = ["PeerProcess", "pattern", "peer_main", "run_nixl_raw_bench"]

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
            argv = [sys.executable, "-m", "kvbridge.backends.nixl.bench", "peer", str(fd), name,
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


# -------------------------------------------------------------- benchmark


class _RawSide:
    """The NIXL library called directly: one prepared transfer of all blocks, re-posted."""

    def __init__(self, op: str, peer: PeerProcess, local: torch.Tensor, nb: int, bb: int,
                 deadline_s: float) -> None:
        api = load_nixl_api()
        self.deadline_s = deadline_s
        self.agent = api.nixl_agent(
            f"raw-{os.getpid()}-{time.monotonic_ns()}",
            api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]),
        )
        self.reg = self.agent.register_memory(local)
        t0 = time.perf_counter()
        self.remote = self.agent.add_remote_agent(peer.metadata)
        self.add_ms = (time.perf_counter() - t0) * 1e3
        self.ldl = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", block_descs(local.data_ptr(), bb, nb), "DRAM"
        )
        self.rdl = self.agent.prep_xfer_dlist(self.remote, block_descs(peer.addr, bb, nb), "DRAM")
        idx = np.arange(nb, dtype=np.int32)
        self.handle = self.agent.make_prepped_xfer(op, self.ldl, idx, self.rdl, idx)

    def once(self) -> None:
        t_end = time.monotonic() + self.deadline_s
        state = self.agent.transfer(self.handle)
        while state == "PROC":
            if time.monotonic() > t_end:
                raise TimeoutError("raw NIXL transfer past its deadline")
            state = self.agent.check_xfer_state(self.handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL transfer state {state}")

    def close(self) -> None:
        self.agent.release_xfer_handle(self.handle)
        self.agent.release_dlist_handle(self.ldl)
        self.agent.release_dlist_handle(self.rdl)
        self.agent.remove_remote_agent(self.remote)
        self.agent.deregister_memory(self.reg)


class _AdapterSide:
    """This package's adapter: a fresh ``post`` of all block indices per iteration,
    as a connector does per request."""

    def __init__(self, op: str, peer: PeerProcess, local: torch.Tensor, nb: int, bb: int,
                 deadline_s: float, lanes: int = 1) -> None:
        self.op, self.deadline_s = op, deadline_s
        self.transport = NixlTransport(lanes=lanes)
        self.transport.register_regions([local])
        self.ldl = self.transport.prepare_local(0, bb, nb)
        t0 = time.perf_counter()
        ph = self.transport.add_peer(peer.name, peer.metadata)
        self.add_ms = (time.perf_counter() - t0) * 1e3
        self.rdl = self.transport.prepare_remote(ph, block_descs(peer.addr, bb, nb))
        self.idx = np.arange(nb, dtype=np.int32)

    def once(self) -> None:
        t = self.transport
        xfer = t.post(self.op, self.ldl, self.idx, self.rdl, self.idx, deadline_s=self.deadline_s)
        if t.wait(xfer) is not XferState.DONE:
            raise RuntimeError(f"adapter transfer {xfer.state.value}: {xfer.error}")

    def close(self) -> int:
        return self.transport.close().live


def run_nixl_raw_bench(
    patterns: Sequence[tuple[int, int]] = ((64, 2 << 20), (4096, 16 << 10)),
    op: str = "READ",
    *,
    min_iters: int = 5,
    min_time_s: float = 2.0,
    deadline_s: float = 30.0,
) -> dict[str, Any]:
    """Benchmark ``op`` (READ or WRITE) for each ``(num_blocks, block_bytes)`` pattern.

    The three ways are *interleaved* (raw, adapter, torch copy, in rotating
    order) so that on a shared, noisy machine they see the same load; each
    reports the median iteration. Returns per pattern: GB/s for ``raw_nixl``, ``adapter`` and
    ``torch_copy`` (one contiguous ``copy_`` of the same bytes in one process),
    ``adapter_over_raw``, ``raw_over_memcpy``, ``add_remote_agent_ms``, the
    first transfer's latency, and whether the bytes moved were verified
    byte for byte. A peer process is spawned per pattern and always reaped.
    """
    import torch

    op = op.upper()
    if op not in ("READ", "WRITE"):
        raise ValueError(f"op must be READ or WRITE, got {op!r}")
    results: list[dict[str, Any]] = []
    for nb, bb in patterns:
        total = nb * bb
        seed = 7
        peer = PeerProcess(f"bench-peer-{os.getpid()}-{nb}x{bb}", total,
                           seed=seed if op == "READ" else -1)
        raw: _RawSide | None = None
        ad: _AdapterSide | None = None
        leaks = -1
        try:
            if op == "READ":
                raw_buf = torch.zeros(total, dtype=torch.uint8)
                ad_buf = torch.zeros(total, dtype=torch.uint8)
            else:
                raw_buf = torch.from_numpy(pattern(total, seed))
                ad_buf = raw_buf.clone()
            raw = _RawSide(op, peer, raw_buf, nb, bb, deadline_s)
            ad = _AdapterSide(op, peer, ad_buf, nb, bb, deadline_s)
            src = torch.from_numpy(pattern(total, seed))
            dst = torch.empty_like(src)
            t0 = time.perf_counter()
            raw.once()
            first_ms = (time.perf_counter() - t0) * 1e3
            ad.once()
            dst.copy_(src)  # warm all three
            ok = _verify(op, peer, raw_buf, total, seed) and _verify(op, peer, ad_buf, total, seed)
            times: dict[str, list[float]] = {"raw": [], "adapter": [], "copy": []}
            steps = (("raw", raw.once), ("adapter", ad.once), ("copy", lambda d=dst, s=src: d.copy_(s)))
            t_stop = time.perf_counter() + min_time_s
            while len(times["raw"]) < min_iters or (
                time.perf_counter() < t_stop and len(times["raw"]) < 10_000
            ):
                k = len(times["raw"]) % len(steps)  # rotate: no way always follows the copy
                for key, fn in steps[k:] + steps[:k]:
                    t0 = time.perf_counter()
                    fn()
                    times[key].append(time.perf_counter() - t0)
            ok = ok and _verify(op, peer, ad_buf, total, seed)
        finally:
            if raw is not None:
                raw.close()
            if ad is not None:
                leaks = ad.close()
            peer.close()
        raw_gbps = total / statistics.median(times["raw"]) / 1e9
        ad_gbps = total / statistics.median(times["adapter"]) / 1e9
        cp_gbps = total / statistics.median(times["copy"]) / 1e9
        results.append({
            "num_blocks": nb,
            "block_bytes": bb,
            "total_bytes": total,
            "op": op,
            "raw_nixl_gbps": round(raw_gbps, 3),
            "adapter_gbps": round(ad_gbps, 3),
            "torch_copy_gbps": round(cp_gbps, 3),
            "adapter_over_raw": round(ad_gbps / raw_gbps, 3),
            "raw_over_memcpy": round(raw_gbps / cp_gbps, 3),
            "iters": len(times["raw"]),
            "add_remote_agent_ms": round(raw.add_ms if raw else -1.0, 2),
            "adapter_add_peer_ms": round(ad.add_ms if ad else -1.0, 2),
            "first_transfer_ms": round(first_ms, 2),
            "verified": bool(ok),
            "adapter_leaks": leaks,
        })
    return {"op": op, "patterns": results}


def _verify(op: str, peer: PeerProcess, local: torch.Tensor, total: int, seed: int) -> bool:
    """Byte-for-byte check of what was moved (READ: the local copy; WRITE: sampled peer bytes)."""
    if op == "READ":
        return bool(np.array_equal(local.numpy(), pattern(total, seed)))
    chunk = min(total, 4 << 20)
    for off in sorted({0, (total - chunk) // 2, total - chunk}):
        if peer.read(off, chunk) != local[off : off + chunk].numpy().tobytes():
            return False
    return True


def _peer_entry(argv: Sequence[str]) -> int:
    """``peer FD NAME NBYTES SEED [DEVICE]``: run :func:`peer_main` on the inherited
    socket ``FD`` (DEVICE: cpu, the default, or cuda[:N])."""
    if len(argv) not in (5, 6) or argv[0] != "peer":
        sys.stderr.write("usage: python -m kvbridge.backends.nixl.bench peer FD NAME NBYTES SEED "
                         "[DEVICE]\n")
        return 2
    fd, name, nbytes, seed = int(argv[1]), argv[2], int(argv[3]), int(argv[4])
    with Connection(fd) as conn:
        peer_main(conn, name, nbytes, seed, argv[5] if len(argv) == 6 else "cpu")
    return 0


if __name__ == "__main__":
    sys.exit(_peer_entry(sys.argv[1:]))
