"""Raw NIXL benchmark, plus the out-of-process NIXL *peer* used by it and by the tests.

The peer (:func:`peer_main`, driven through :class:`PeerProcess`) is a second
process holding one :class:`~kvbridge.backends.nixl.NixlTransport` with one
registered buffer filled with a known pattern. It keeps progressing its
worker (NIXL runs without a progress thread, so the passive side of a READ
must poll) and answers small msgpack commands over a ``multiprocessing`` pipe
(``send_bytes``/``recv_bytes``: no pickle on the wire). It lives here, not in
the tests, because ``spawn`` children must import their target by module name.

:func:`run_nixl_raw_bench` moves the same blocks three ways: the NIXL library
called directly with one prepared transfer of all blocks, this package's
adapter (one ``post`` per iteration, as a connector does), and a ``torch``
copy of the same bytes in one process (the memory-bandwidth limit).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from . import apply_env_defaults
from .nixl import NixlTransport, NixlTransportError, XferState, block_descs, load_nixl_api

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


def peer_main(conn: Any, name: str, nbytes: int, seed: int) -> None:
    """Body of the peer process (see module docstring). Exits on ``close`` or EOF."""
    apply_env_defaults()
    transport = NixlTransport(name)
    buf = pattern(nbytes, seed) if seed >= 0 else np.zeros(nbytes, dtype=np.uint8)
    region = transport.register_regions([(buf.ctypes.data, buf.nbytes)])[0]
    peers: dict[str, Any] = {}
    notifs: dict[str, list[bytes]] = {}

    def reply(obj: Any) -> None:
        conn.send_bytes(msgpack.packb(obj, use_bin_type=True))

    reply({"name": transport.name, "md": transport.agent_metadata(), "addr": region.addr,
           "nbytes": region.nbytes, "pid": os.getpid()})
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
    """Parent-side handle of a spawned peer. Every call is bounded by ``timeout_s``."""

    def __init__(self, name: str, nbytes: int, seed: int = 1, timeout_s: float = 30.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.timeout_s = timeout_s
        self.proc = ctx.Process(target=peer_main, args=(child, name, nbytes, seed), daemon=True)
        self.proc.start()
        child.close()
        hello = self._recv()
        self.name: str = hello["name"]
        self.metadata: bytes = hello["md"]
        self.addr: int = hello["addr"]
        self.nbytes: int = hello["nbytes"]
        self.pid: int = hello["pid"]

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
        if self.proc.is_alive():
            try:
                result = self.call("close")
            except (OSError, EOFError, TimeoutError, NixlTransportError):
                result = None
        self.kill()
        return result

    def kill(self) -> None:
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self._conn.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -------------------------------------------------------------- benchmark


def _timed(fn: Any, min_iters: int, min_time_s: float, max_iters: int) -> list[float]:
    times: list[float] = []
    t_stop = time.perf_counter() + min_time_s
    while len(times) < max_iters and (len(times) < min_iters or time.perf_counter() < t_stop):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _raw_nixl(op: str, peer: PeerProcess, local: torch.Tensor, nb: int, bb: int,
              min_iters: int, min_time_s: float, deadline_s: float) -> dict[str, Any]:
    """The NIXL library called directly: one prepared transfer of all blocks, re-posted."""
    api = load_nixl_api()
    agent = api.nixl_agent(f"raw-{os.getpid()}-{time.monotonic_ns()}",
                           api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    reg = agent.register_memory(local)
    t0 = time.perf_counter()
    remote_name = agent.add_remote_agent(peer.metadata)
    add_ms = (time.perf_counter() - t0) * 1e3
    ldl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_descs(local.data_ptr(), bb, nb), "DRAM")
    rdl = agent.prep_xfer_dlist(remote_name, block_descs(peer.addr, bb, nb), "DRAM")
    idx = np.arange(nb, dtype=np.int32)
    handle = agent.make_prepped_xfer(op, ldl, idx, rdl, idx)

    def once() -> None:
        t_end = time.monotonic() + deadline_s
        state = agent.transfer(handle)
        while state == "PROC":
            if time.monotonic() > t_end:
                raise TimeoutError("raw NIXL transfer past its deadline")
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL transfer state {state}")

    t0 = time.perf_counter()
    once()
    first_ms = (time.perf_counter() - t0) * 1e3
    times = _timed(once, min_iters, min_time_s, 10_000)
    agent.release_xfer_handle(handle)
    agent.release_dlist_handle(ldl)
    agent.release_dlist_handle(rdl)
    agent.remove_remote_agent(remote_name)
    agent.deregister_memory(reg)
    return {"times": times, "add_remote_agent_ms": add_ms, "first_transfer_ms": first_ms}


def _adapter(op: str, peer: PeerProcess, local: torch.Tensor, nb: int, bb: int,
             min_iters: int, min_time_s: float, deadline_s: float) -> dict[str, Any]:
    """This package's adapter: a fresh ``post`` of all block indices per iteration."""
    transport = NixlTransport()
    transport.register_regions([local])
    ldl = transport.prepare_local(0, bb, nb)
    t0 = time.perf_counter()
    ph = transport.add_peer(peer.name, peer.metadata)
    add_ms = (time.perf_counter() - t0) * 1e3
    rdl = transport.prepare_remote(ph, block_descs(peer.addr, bb, nb))
    idx = np.arange(nb, dtype=np.int32)

    def once() -> None:
        xfer = transport.post(op, ldl, idx, rdl, idx, deadline_s=deadline_s)
        if transport.wait(xfer) is not XferState.DONE:
            raise RuntimeError(f"adapter transfer {xfer.state.value}: {xfer.error}")

    once()
    times = _timed(once, min_iters, min_time_s, 10_000)
    final = transport.close()
    return {"times": times, "add_peer_ms": add_ms, "leaks": final.live}


def run_nixl_raw_bench(
    patterns: Sequence[tuple[int, int]] = ((64, 2 << 20), (4096, 16 << 10)),
    op: str = "READ",
    *,
    min_iters: int = 5,
    min_time_s: float = 1.0,
    deadline_s: float = 30.0,
) -> dict[str, Any]:
    """Benchmark ``op`` (READ or WRITE) for each ``(num_blocks, block_bytes)`` pattern.

    Returns per pattern: GB/s (median iteration) for ``raw_nixl``, ``adapter``
    and ``torch_copy``, the ratios ``adapter_over_raw`` and
    ``raw_over_memcpy``, ``add_remote_agent_ms``, and whether the bytes moved
    were verified. A peer process is spawned per pattern and always reaped.
    """
    import torch

    op = op.upper()
    if op not in ("READ", "WRITE"):
        raise ValueError(f"op must be READ or WRITE, got {op!r}")
    results: list[dict[str, Any]] = []
    for nb, bb in patterns:
        total = nb * bb
        seed = 7
        peer = PeerProcess(f"bench-peer-{os.getpid()}-{nb}x{bb}", total, seed=seed if op == "READ" else -1)
        try:
            if op == "READ":
                local = torch.zeros(total, dtype=torch.uint8)
            else:
                local = torch.from_numpy(pattern(total, seed))
            raw = _raw_nixl(op, peer, local, nb, bb, min_iters, min_time_s, deadline_s)
            ok_raw = _verify(op, peer, local, total, seed)
            if op == "READ":
                local.zero_()
            ad = _adapter(op, peer, local, nb, bb, min_iters, min_time_s, deadline_s)
            ok_ad = _verify(op, peer, local, total, seed)
        finally:
            peer.close()
        src = torch.from_numpy(pattern(total, seed))
        dst = torch.empty_like(src)
        copy_times = _timed(lambda d=dst, s=src: d.copy_(s), min_iters, min_time_s / 2, 10_000)
        raw_gbps = total / statistics.median(raw["times"]) / 1e9
        ad_gbps = total / statistics.median(ad["times"]) / 1e9
        cp_gbps = total / statistics.median(copy_times) / 1e9
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
            "raw_iters": len(raw["times"]),
            "adapter_iters": len(ad["times"]),
            "add_remote_agent_ms": round(raw["add_remote_agent_ms"], 2),
            "adapter_add_peer_ms": round(ad["add_peer_ms"], 2),
            "raw_first_transfer_ms": round(raw["first_transfer_ms"], 2),
            "verified": bool(ok_raw and ok_ad),
            "adapter_leaks": ad["leaks"],
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
