"""Lanes: extra NIXL agents of one rank that move the parts of one large transfer at once.

Why: between two processes on one host UCX moves RMA over CMA
(``process_vm_readv``/``writev``): ``transfer()`` does the copy in the calling
thread, so one agent moves one core's copy at a time (raw NIXL READ, 64 x 2 MiB
here: ~6.3 GB/s against a ~10 GB/s memcpy). One agent cannot copy in two threads
at once: its UCX worker is single-threaded, and with ``NIXL_THREAD_SYNC_STRICT``
(or ``num_workers=2``) two threads posting on it measured no gain. Two agents in
two threads did: ~9.8 GB/s, the memcpy of one core. A *lane* is one more agent
of the same rank, on the same registered memory and the same peers; a transfer
past :data:`MIN_LANE_PART_BYTES` a part is cut into contiguous parts, one per
lane, whose ``transfer()`` calls run at once (lane 0 is the transport's own agent,
in the calling thread; the others in this module's threads).

Invariants:

* a lane never appears to a peer except as a UCX endpoint: it is in no
  handshake document, sends no notification and posts nothing that carries
  one (a transfer with a notification is never cut: its notification must
  follow *all* of its bytes); one-sided READ/WRITE need no record of the
  initiator on the target side, so a peer accepts a lane's READ like its
  agent's;
* a lane agent is only called with the transport's lock held, and only while
  no lane thread runs on it: :meth:`Lanes.run` hands each part's
  ``transfer()`` to its lane's thread and waits for all of them (bounded by
  the transfer's deadline) before the lock is let go; a lane thread still
  running past that makes the lanes *broken*: no transfer is cut again, and
  nothing touches that lane's agent until its call returned;
* only host memory (DRAM) is laned: GPU memory goes over ``cuda_copy`` / CUDA
  IPC, where lanes were not measured, so a transport that registers VRAM uses
  its own agent alone.

This module makes no decision about *what* to transfer: it holds the agents,
mirrors registrations, descriptor lists and peers onto them, cuts index arrays
and runs the parts. Imports only :mod:`.nixl_descs` of kvbridge.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.backends.nixl.descs import DListEntry

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_LANES", "MAX_LANES", "MIN_LANE_PART_BYTES", "LanePart", "Lanes",
           "combined_status", "cut", "lane_threads_alive", "release_parts"]

#: lanes of a rank by default: two copies at once on the 2-core hosts measured
#: (64 x 2 MiB raw READ 6.3 -> 9.8 GB/s; 4 lanes measured 9.2: no core left)
DEFAULT_LANES = 2
MAX_LANES = 16
#: a transfer is cut only into parts of at least this many bytes: below it, the
#: hand-off to a lane thread (~50-100 us) costs more than the second copy saves
MIN_LANE_PART_BYTES = 1 << 20


@dataclass
class LanePart:
    """One part of a cut transfer, posted on a lane agent (lane >= 1)."""

    lane: int
    agent: Any
    handle: Any
    future: Future[Any] | None = None

    def status(self) -> str:
        """NIXL's status of this part ("PROC" while its ``transfer()`` still runs);
        raises what NIXL raised."""
        if self.future is not None:
            if not self.future.done():
                return "PROC"
            status = self.future.result()  # raises the transfer()'s exception
            self.future = None
            if status != "PROC":
                return str(status)
        return str(self.agent.check_xfer_state(self.handle))


def combined_status(first: str, parts: list[LanePart]) -> str:
    """One word for a cut transfer from part 0's status ``first`` and its other
    parts: DONE when all are, an error status as soon as one has one, else PROC;
    raises what NIXL raised for a part."""
    status = first
    for part in parts:
        if status not in ("DONE", "PROC"):
            return status
        other = part.status()
        if other != "DONE":
            status = other
    return status


def release_parts(parts: list[LanePart]) -> None:
    """Release the parts' handles, emptying ``parts`` as it goes; raises (leaving the
    rest) on a part whose ``transfer()`` call has not returned or that NIXL refuses."""
    while parts:
        part = parts[-1]
        if part.future is not None and not part.future.done():
            raise RuntimeError(f"lane {part.lane}'s transfer() has not returned")
        part.handle.release()
        parts.pop()


def cut(lengths: np.ndarray | None, uniform: int | None, count: int,
        lanes: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges of ``count`` descriptors, one per part, about
    equal in bytes, each of at least :data:`MIN_LANE_PART_BYTES` (so fewer parts than
    ``lanes`` where the transfer is small; one part: not cut). ``uniform``: every
    descriptor's length when equal (``lengths`` then unused), else ``lengths`` per
    descriptor."""
    if lanes <= 1 or count < 2:
        return [(0, count)]
    if uniform is not None:
        total = uniform * count
    else:
        assert lengths is not None
        total = int(lengths.sum())
    parts = int(min(lanes, count, total // MIN_LANE_PART_BYTES))
    if parts <= 1:
        return [(0, count)]
    if uniform is not None:
        bounds = [count * k // parts for k in range(parts + 1)]
    else:
        assert lengths is not None
        ends = np.cumsum(lengths.astype(np.int64))
        targets = [total * k // parts for k in range(1, parts)]
        bounds = [0, *(int(np.searchsorted(ends, t, side="left")) + 1 for t in targets), count]
        bounds = sorted(set(min(max(b, 0), count) for b in bounds))
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


class Lanes:
    """The extra agents (lanes 1..n-1) of one transport and the threads that post on them.

    Every method is called with the transport's lock held."""

    def __init__(self, api: Any, config: Any, name: str, lanes: int) -> None:
        if not 2 <= lanes <= MAX_LANES:
            raise ValueError(f"lanes must be in [2, {MAX_LANES}], got {lanes}")
        self.count = lanes
        self.agents: list[Any] = []
        self.broken = False
        self.vram = False
        self._registrations: list[list[Any]] = []  # per lane agent: its registrations
        self._stuck: list[Future[Any]] = []
        try:
            for k in range(1, lanes):
                self.agents.append(api.nixl_agent(f"{name}-lane{k}", config))
                self._registrations.append([])
        except Exception:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(max_workers=lanes - 1,
                                        thread_name_prefix=f"kvbridge-nixl-lane-{name[-8:]}")

    @property
    def usable(self) -> bool:
        return not self.broken and not self.vram

    def _idle(self) -> bool:
        """No lane thread is inside a NIXL call (so the lane agents may be called)."""
        self._stuck = [f for f in self._stuck if not f.done()]
        return not self._stuck

    # ------------------------------------------------ mirrors of the agent's tables

    def register(self, addr: int, nbytes: int, mem_type: str, device_id: int) -> None:
        if mem_type != "DRAM":
            self.vram = True  # lanes are for host memory only (see the module docstring)
            return
        if self.broken:
            return
        try:
            for agent, regs in zip(self.agents, self._registrations, strict=True):
                regs.append(agent.register_memory([(addr, nbytes, device_id, "")], mem_type))
        except Exception as exc:  # transfers still move, on the transport's own agent
            self.broken = True
            logger.warning("nixl lanes: register_memory on a lane failed (%r); transfers are "
                           "not cut", exc)

    def prep(self, target: str, arr: np.ndarray, mem_type: str) -> list[Any]:
        """The same list prepared on every lane agent ([] where lanes are not used)."""
        if not self.usable or mem_type != "DRAM":
            return []
        handles: list[Any] = []
        try:
            for agent in self.agents:
                handles.append(agent.prep_xfer_dlist(target, arr, mem_type, ["UCX"]))
        except Exception as exc:  # the list still works on lane 0: it is just never cut
            logger.warning("nixl lanes: prep_xfer_dlist on a lane failed (%r); that list "
                           "moves on one lane", exc)
            for handle in handles:
                handle.release()
            return []
        return handles

    def add_remote(self, metadata: bytes) -> bool:
        """Load a peer on every lane; False (and the peer is moved on lane 0 only) if a
        lane refuses it."""
        if not self.usable:
            return False
        loaded: list[tuple[Any, str]] = []
        try:
            for agent in self.agents:
                name = agent.add_remote_agent(metadata)
                loaded.append((agent, name.decode() if isinstance(name, bytes) else str(name)))
        except Exception as exc:
            logger.warning("nixl lanes: add_remote_agent on a lane failed (%r); that peer "
                           "moves on one lane", exc)
            for agent, name in loaded:
                agent.remove_remote_agent(name)
            return False
        return True

    def remove_remote(self, peer_name: str) -> None:
        if not self._idle():
            return  # a lane thread is still inside NIXL: leave the lane agents alone
        for agent in self.agents:
            try:
                agent.remove_remote_agent(peer_name)
            except Exception as exc:  # already gone
                logger.info("nixl lanes: remove_remote_agent(%s) failed: %r", peer_name, exc)

    # ------------------------------------------------------------------ posting

    def ranges(self, local: DListEntry, remote: DListEntry, li: np.ndarray,
               notif: bytes) -> list[tuple[int, int]]:
        """How to cut a transfer of ``local[li]`` rows (one range: not cut): never one
        with a notification, nor one whose lists are not on the lanes."""
        count = int(li.size)
        if not self.usable or notif or not local.lane_handles or not remote.lane_handles:
            return [(0, count)]
        uniform = local.uniform_length
        if uniform is not None and uniform == remote.uniform_length:
            return cut(None, uniform, count, self.count)
        return cut(local.lengths(li), None, count, self.count)

    def make_parts(self, op: str, lane_lists: tuple[list[Any], list[Any]],
                   li: np.ndarray, ri: np.ndarray,
                   ranges: list[tuple[int, int]]) -> list[LanePart]:
        """Create the handles of parts 1.. on lanes 1.. (part 0 is the caller's);
        on an error, releases what it made and raises."""
        local_lists, remote_lists = lane_lists
        parts: list[LanePart] = []
        try:
            for lane, (a, b) in enumerate(ranges[1:], start=1):
                agent = self.agents[lane - 1]
                handle = agent.make_prepped_xfer(op, local_lists[lane - 1], li[a:b],
                                                 remote_lists[lane - 1], ri[a:b], b"", ["UCX"])
                parts.append(LanePart(lane, agent, handle))
        except Exception:
            for part in parts:
                part.handle.release()
            raise
        return parts

    def run(self, parts: list[LanePart], first: Callable[[], str], timeout_s: float) -> str:
        """Post parts 1.. in the lane threads and part 0 with ``first()`` here, at once;
        returns the transfer's combined status once every ``transfer()`` call returned
        (bounded by ``timeout_s``, see :meth:`_joined`); raises what NIXL raised."""
        for part in parts:
            part.future = self._pool.submit(part.agent.transfer, part.handle)
        try:
            status = first()
        finally:
            self._joined(parts, timeout_s)
        return combined_status(status, parts)

    def _joined(self, parts: list[LanePart], timeout_s: float) -> None:
        """Wait until every part's ``transfer()`` call returned, at most ``timeout_s``
        in all; past it the lanes are broken (module docstring) and the parts' status
        stays "PROC" until their calls return."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        for part in parts:
            if part.future is None:
                continue
            try:
                part.future.exception(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                self.broken = True
                self._stuck.extend(p.future for p in parts
                                   if p.future is not None and not p.future.done())
                logger.error("nixl lanes: a lane's transfer() did not return within %.3f s; "
                             "transfers are no longer cut", timeout_s)
                return

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Deregister the lanes' memory (lists and peers were released by the transport)."""
        if self._idle():
            for agent, regs in zip(self.agents, self._registrations, strict=False):
                while regs:
                    reg = regs.pop()
                    try:
                        agent.deregister_memory(reg)
                    except Exception as exc:
                        logger.error("nixl lanes: deregister_memory failed: %r", exc)
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def lane_threads_alive(name: str = "") -> int:
    """How many lane threads of the transport named ``name`` (default: of every
    transport) are alive: a closed transport leaves none running."""
    prefix = f"kvbridge-nixl-lane-{name[-8:]}"
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix))
