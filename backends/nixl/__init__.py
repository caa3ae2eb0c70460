"""A thin, leak-counted adapter over one NIXL agent (UCX backend) per worker rank.

Why this layer exists: NIXL's Python API is powerful but has sharp edges that
every caller would otherwise rediscover (measured: docs/backends.md, "NIXL"):

* failures are *exceptions* (``nixlRemoteDisconnectError`` ...), not states;
* there is no transfer timeout: a stalled peer leaves a transfer in ``PROC``
  forever, so the deadline is enforced here (``TIMED_OUT``);
* without a progress thread (we run with ``enable_prog_thread=False`` because
  the thread spins and halves bandwidth on small machines) the *passive* side
  must progress its worker, which :meth:`NixlTransport.get_notifs` does;
* handles must be released exactly once, and only once NIXL has settled the
  transfer. Measured (tests/backends/test_nixl_transport.py): NIXL *accepts*
  ``release`` of a handle in ``PROC`` and even ``remove_remote_agent`` during
  one, yet over TCP the stalled peer's bytes still land in local memory once it
  resumes. So a transfer past its deadline is reported TIMED_OUT at once but its
  handle is kept as a *zombie* until NIXL reports DONE or an error for it
  (:meth:`NixlTransport.reap`, run by every :meth:`NixlTransport.get_notifs`);
  only then is ``Transfer.quiesced`` true and its local memory safe to reuse.

Model: memory is registered once (:meth:`register_regions`: each distinct
backing storage once, host tensors as ``DRAM`` -- pinned ones too -- and CUDA
tensors as ``VRAM`` with their device id); descriptor lists are prepared once
(local per region with :meth:`prepare_local`, or arbitrary rows with
:meth:`prepare_local_descs` for sub-block / head-slice reads; remote ones with
:meth:`prepare_remote` right after the handshake, with the *peer's* memory
type); a transfer then only passes *indices* into those lists (:meth:`post`).
Rows may be strided (one row for a layer's every block, see
:mod:`.descs`). Once VRAM is registered, every thread that enters the
transport has the registered CUDA device made current first
(:func:`set_cuda_device`, looked up in this module, where a test replaces it
to record the calls; see :mod:`.memory`).

Invariants (checked by the tests through :meth:`counters`):

* every registration, prepared list, transfer handle and peer that is created
  is counted, and :meth:`close` brings every counter back to zero;
* a :class:`Transfer` reaches exactly one terminal state (DONE, FAILED or
  TIMED_OUT) and never leaves it; DONE and FAILED handles are released at that
  moment, TIMED_OUT handles when NIXL settles them (zombies: counted, not lost);
* a zombie released without NIXL settling it (its peer removed, or ``close``)
  is counted in ``forced_releases`` and its ``quiesced`` stays False: the
  caller must not reuse that transfer's local memory while the peer may live.

The transport is thread-safe through one lock around the agent, because the
agent is created with ``NIXL_THREAD_SYNC_NONE`` (no listener thread).

This file owns :class:`NixlTransport`: the agent, its lock and tables, and
every NIXL call on them; it stays one class (one lock around one agent, whose
invariants above span memory, lists, peers and transfers), which is why it is
over 600 lines. Beside it, importable from here as before: :mod:`.records`
(its errors; the memory types and records of any transport, from
:mod:`kvbridge.backends.transfer`), :mod:`.memory` (memory of an item,
registrations, the CUDA-binding lock), :mod:`.descs` (descriptor rows) and
:mod:`.load` (which NIXL build). They call no agent; nothing else of
kvbridge is imported (dependency rule of ``backends``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbridge.backends.nixl.descs import MAX_LIST_DESCS as MAX_LIST_DESCS
from kvbridge.backends.nixl.descs import (
    DListEntry,
    as_desc_array,
    as_indices,
    block_descs,
    expand_descs,
    strided_descs,
    sub_block_descs,
)
from kvbridge.backends.nixl.lanes import DEFAULT_LANES as DEFAULT_LANES
from kvbridge.backends.nixl.lanes import MAX_LANES as MAX_LANES
from kvbridge.backends.nixl.lanes import Lanes, combined_status, release_parts
from kvbridge.backends.nixl.load import load_nixl_api
from kvbridge.backends.nixl.load import loaded_nixl as loaded_nixl
from kvbridge.backends.nixl.load import nixl_candidates as nixl_candidates
from kvbridge.backends.nixl.load import torch_cuda_major as torch_cuda_major
from kvbridge.backends.nixl.memory import (
    AgentLock,
    Registration,
    check_inside_registrations,
    memory_of,
    registration_of,
    set_cuda_device,
)
from kvbridge.backends.nixl.memory import MemoryOf as MemoryOf
from kvbridge.backends.nixl.records import (
    DRAM,
    MEM_TYPES,
    VRAM,
    DescList,
    NixlTransportError,
    NixlUnavailableError,
    PeerHandle,
    Region,
    Transfer,
    TransportCounters,
    TransportError,
    XferOp,
    XferState,
)

logger = logging.getLogger(__name__)

#: the backends a transfer may use (one list, not one per call)
_UCX = ["UCX"]

__all__ = [
    "DescList",
    "NixlTransport",
    "NixlTransportError",
    "NixlUnavailableError",
    "PeerHandle",
    "Region",
    "Transfer",
    "TransportCounters",
    "TransportError",
    "XferOp",
    "XferState",
    "block_descs",
    "expand_descs",
    "load_nixl_api",
    "memory_of",
    "set_cuda_device",
    "strided_descs",
    "sub_block_descs",
]


class NixlTransport:
    """One NIXL agent (UCX, no progress thread) for one worker rank.

    ``name`` must be unique among agents that talk to each other; the default
    adds a random suffix so that a restarted process gets a new identity.
    ``lanes``: how many agents move the parts of one large host-memory transfer
    at once (:mod:`.nixl_lanes`; 1: this agent alone).
    """

    def __init__(self, name: str | None = None, *, lanes: int = 1) -> None:
        if not isinstance(lanes, int) or isinstance(lanes, bool) or not 1 <= lanes <= MAX_LANES:
            raise NixlTransportError(f"lanes must be an integer in [1, {MAX_LANES}], got {lanes!r}")
        api = load_nixl_api()
        self.name = name or f"kvbridge-{uuid.uuid4().hex[:12]}"
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=["UCX"],
            capture_telemetry=True,  # per-transfer times (Transfer.library_xfer_s), as vLLM's
        )
        self._api = api
        self._cuda_device: int | None = None  # set by the first VRAM registration
        self._thread_device = threading.local()
        self._lock = AgentLock(self._bind_thread)
        try:
            self._agent = api.nixl_agent(self.name, config)
        except Exception as exc:
            raise NixlUnavailableError(f"cannot create NIXL agent {self.name!r}: {exc!r}") from exc
        if "UCX" not in self._agent.backends:
            raise NixlUnavailableError(
                f"NIXL agent {self.name!r} has no UCX backend (plugins: {self._agent.plugin_list})"
            )
        self._lanes: Lanes | None = None
        if lanes > 1:
            try:
                self._lanes = Lanes(api, config, self.name, lanes)
            except Exception as exc:
                raise NixlUnavailableError(f"cannot create NIXL lane agents of {self.name!r}: "
                                           f"{exc!r}") from exc
        self._laned_peers: set[str] = set()
        self._closed = False
        self._regions: list[Region] = []
        self._registrations: list[Registration] = []
        self._dlists: dict[int, DListEntry] = {}
        self._peers: dict[str, PeerHandle] = {}
        self._peer_md: dict[str, bytes] = {}
        self._generations: dict[str, int] = {}
        self._pending: dict[int, Transfer] = {}
        self._zombies: list[Transfer] = []
        self._forced_releases = 0
        self._ids = itertools.count(1)
        self._posted = self._done = self._failed = self._timed_out = 0
        self._bytes_done = 0
        self._cut = 0

    # ------------------------------------------------------------------ memory

    def register_regions(self, regions: Sequence[Any]) -> list[Region]:
        """Register memory once: each item a contiguous tensor (host -> DRAM, CUDA ->
        VRAM with its device id), ``(addr, nbytes)`` of host memory, or ``(addr,
        nbytes, mem_type, device_id)``.

        Each distinct backing storage is registered once, whole (vLLM hands out
        every layer as a view of one allocation); items on a storage that is
        already registered only add a :class:`Region`. All VRAM must be on one
        device (the one made current on NIXL threads). The caller keeps the
        memory alive until :meth:`close`.
        """
        self._check_open()
        infos = [memory_of(item, f"regions[{i}]") for i, item in enumerate(regions)]
        devices = {i.device_id for i in infos if i.mem_type == VRAM}
        if self._cuda_device is not None:
            devices.add(self._cuda_device)
        if len(devices) > 1:
            raise NixlTransportError(f"regions: VRAM on several CUDA devices {sorted(devices)}; "
                                     "one transport serves one device")
        out = []
        with self._lock:
            if devices and self._cuda_device is None:
                self._cuda_device = devices.pop()
                self._bind_thread()
            for info in infos:
                if self._registration_of(info) is None:
                    reg = self._agent.register_memory(
                        [(info.storage_addr, info.storage_nbytes, info.device_id, "")],
                        info.mem_type)
                    self._registrations.append(Registration(
                        info.storage_addr, info.storage_nbytes, info.mem_type, info.device_id,
                        reg))
                    if self._lanes is not None:
                        self._lanes.register(info.storage_addr, info.storage_nbytes,
                                             info.mem_type, info.device_id)
                region = Region(len(self._regions), info.addr, info.nbytes, info.mem_type,
                                info.device_id)
                self._regions.append(region)
                out.append(region)
        return out

    def _registration_of(self, info: MemoryOf) -> Registration | None:
        return registration_of(self._registrations, info)

    @property
    def memory_type(self) -> tuple[str, int]:
        """``(mem_type, device_id)`` of everything registered (DRAM, 0 when nothing is):
        what this rank's handshake document announces to peers."""
        kinds = {(r.mem_type, r.device_id) for r in self._registrations}
        if len(kinds) > 1:
            raise NixlTransportError(f"registered memory mixes {sorted(kinds)}: a rank's KV "
                                     "must be of one memory type")
        return kinds.pop() if kinds else (DRAM, 0)

    def _bind_thread(self) -> None:
        """Make the registered CUDA device current on this thread (once per thread)."""
        device = self._cuda_device
        if device is None or getattr(self._thread_device, "device", None) == device:
            return
        set_cuda_device(device)
        self._thread_device.device = device

    @property
    def regions(self) -> tuple[Region, ...]:
        return tuple(self._regions)

    # ---------------------------------------------------------- descriptor lists

    def prepare_local(self, region_id: int, block_bytes: int, num_blocks: int) -> DescList:
        """Prepare one descriptor per block of a registered region (block i = addr + i*block_bytes)."""
        region = self._region(region_id)
        if block_bytes * num_blocks > region.nbytes:
            raise NixlTransportError(
                f"region {region_id}: {num_blocks} blocks of {block_bytes} B exceed its "
                f"{region.nbytes} B"
            )
        return self.prepare_local_descs(block_descs(region.addr, block_bytes, num_blocks))

    def prepare_local_descs(self, descs: Any) -> DescList:
        """Prepare local rows: ``(addr, len[, dev])`` or strided ``(addr, len, dev,
        stride, count)`` (e.g. head slices of every block of a layer: one row).

        Every descriptor must lie inside one registered storage, all of one memory
        type; the device column must be that registration's device (two-column rows
        get it filled in). Transfers then name descriptors by index.
        """
        arr = as_desc_array(descs, "local descs")
        mem_type = self._check_inside_regions(arr)
        return self._prep(arr, None, mem_type)

    def prepare_remote(self, peer: PeerHandle, descs: Any, mem_type: str = DRAM) -> DescList:
        """Prepare the peer's rows (from its handshake) once per peer, as ``mem_type``:
        the *peer's* memory type, which its handshake document carries. Rows as for
        :meth:`prepare_local_descs`, the device column being the peer's device."""
        if mem_type not in MEM_TYPES:
            raise NixlTransportError(f"mem_type must be one of {MEM_TYPES}, got {mem_type!r}")
        self._check_peer(peer)
        return self._prep(as_desc_array(descs, "remote descs"), peer, mem_type)

    def release_dlist(self, dlist: DescList) -> None:
        """Release a prepared list (no transfer may be using it; idempotent)."""
        with self._lock:
            entry = self._dlists.pop(dlist.list_id, None)
            if entry is not None:
                entry.release()

    def _prep(self, arr: np.ndarray, peer: PeerHandle | None, mem_type: str) -> DescList:
        with self._lock:
            self._check_open()
            target = "NIXL_INIT_AGENT" if peer is None else peer.name
            try:
                handle = self._agent.prep_xfer_dlist(target, arr, mem_type, ["UCX"])
            except Exception as exc:
                raise NixlTransportError(
                    f"prep_xfer_dlist for {'local' if peer is None else peer.name} "
                    f"({arr.shape[0]} descs) failed: {exc!r}"
                ) from exc
            list_id = next(self._ids)
            if arr.shape[1] == 5:
                ends = np.cumsum(arr[:, 4].astype(np.int64))
                num_descs = int(ends[-1])
                entry = DListEntry(handle, arr[:, 1].copy(), ends, peer, mem_type)
            else:
                num_descs = int(arr.shape[0])
                entry = DListEntry(handle, arr[:, 1].copy(), None, peer, mem_type)
            if self._lanes is not None and (peer is None or peer.name in self._laned_peers):
                entry.lane_handles = self._lanes.prep(target, arr, mem_type)
            self._dlists[list_id] = entry
            return DescList(list_id, num_descs, peer)

    # ------------------------------------------------------------------- peers

    def agent_metadata(self) -> bytes:
        """This agent's metadata (connection info + registrations) for the handshake."""
        with self._lock:
            self._check_open()
            return bytes(self._agent.get_agent_metadata())

    def add_peer(self, peer_name: str, metadata: bytes) -> PeerHandle:
        """Load a peer's metadata. Re-adding a name with *new* metadata (a restarted
        peer) first removes the old incarnation, failing its transfers; identical
        metadata returns the current handle."""
        with self._lock:
            self._check_open()
            old = self._peers.get(peer_name)
            if old is not None:
                if self._peer_md.get(peer_name) == metadata:
                    return old
                self.remove_peer(old)
            try:
                loaded = self._agent.add_remote_agent(metadata)
            except Exception as exc:
                raise NixlTransportError(f"add_remote_agent({peer_name!r}) failed: {exc!r}") from exc
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != peer_name:
                if loaded not in self._peers:  # never drop a peer we already hold
                    self._agent.remove_remote_agent(loaded)
                raise NixlTransportError(
                    f"peer_name {peer_name!r} does not match the metadata's agent name {loaded!r}"
                )
            if self._lanes is not None and self._lanes.add_remote(metadata):
                self._laned_peers.add(peer_name)
            gen = self._generations.get(peer_name, 0) + 1
            self._generations[peer_name] = gen
            handle = PeerHandle(peer_name, gen)
            self._peers[peer_name] = handle
            self._peer_md[peer_name] = bytes(metadata)
            return handle

    def remove_peer(self, peer: PeerHandle) -> None:
        """Drop a peer: fail its pending transfers, release its lists, disconnect (idempotent)."""
        with self._lock:
            if self._peers.get(peer.name) != peer:
                return
            for xfer in [t for t in self._pending.values() if t.peer == peer]:
                self._finish(xfer, XferState.FAILED, f"peer {peer.name} removed", in_flight=True)
            for list_id in [k for k, e in self._dlists.items() if e.peer == peer]:
                self._dlists.pop(list_id).release()
            self._reap_locked()  # settle what can be settled while NIXL still knows the peer
            del self._peers[peer.name]
            del self._peer_md[peer.name]
            try:
                self._agent.remove_remote_agent(peer.name)
            except Exception as exc:  # already disconnected: nothing left to free
                logger.warning("remove_remote_agent(%s) failed: %r", peer.name, exc)
            if peer.name in self._laned_peers:
                self._laned_peers.discard(peer.name)
                assert self._lanes is not None
                self._lanes.remove_remote(peer.name)
            # NIXL can no longer report on this peer's zombies (NOT_FOUND): release them
            # by force; their local memory stays unsafe (quiesced False) while the peer lives.
            for z in [z for z in self._zombies if z.peer == peer]:
                self._force_release(z)

    def peer(self, name: str) -> PeerHandle | None:
        return self._peers.get(name)

    # --------------------------------------------------------------- transfers

    def post(
        self,
        op: XferOp | str,
        local: DescList,
        local_idx: Any,
        remote: DescList,
        remote_idx: Any,
        notif: bytes = b"",
        deadline_s: float = 30.0,
    ) -> Transfer:
        """Post one transfer of ``local[local_idx[k]] <-> remote[remote_idx[k]]`` rows.

        ``notif`` (if non-empty) is delivered to the peer after the data. A
        failure to create or post the transfer returns a FAILED transfer (the
        caller handles one failure path); argument errors raise. A host-memory
        transfer without ``notif`` is cut across the lanes (:mod:`.nixl_lanes`)
        when its parts are large enough; it is still one :class:`Transfer`.
        """
        op = op if isinstance(op, XferOp) else XferOp(op)
        if not deadline_s > 0:
            raise NixlTransportError(f"deadline_s must be > 0, got {deadline_s}")
        if remote.peer is None:
            raise NixlTransportError("remote: expected a list from prepare_remote, got a local one")
        # Index checks need no lock: they read the caller's arrays and the lists' sizes
        # (fixed at prepare time); whether the lists are still alive is checked below.
        li = as_indices(local_idx, local.num_descs, "local_idx")
        if remote_idx is local_idx and remote.num_descs >= local.num_descs:
            ri = li  # one array for both sides: checked once, against the smaller bound
        else:
            ri = as_indices(remote_idx, remote.num_descs, "remote_idx")
        if li.size != ri.size:
            raise NixlTransportError(
                f"local_idx and remote_idx must have equal length, got {li.size} and {ri.size}"
            )
        notif = bytes(notif)
        with self._lock:
            self._check_open()
            lentry = self._dlist(local, want_peer=None)
            rentry = self._dlist(remote, want_peer=remote.peer)
            count = int(li.size)
            uniform = lentry.uniform_length
            if uniform is not None and uniform == rentry.uniform_length:
                nbytes = count * uniform  # every row of both lists: one length
            else:
                llen, rlen = lentry.lengths(li), rentry.lengths(ri)
                if not np.array_equal(llen, rlen):
                    k = int(np.flatnonzero(llen != rlen)[0])
                    raise NixlTransportError(
                        f"descriptor {k}: local length {int(llen[k])} != remote length "
                        f"{int(rlen[k])}"
                    )
                nbytes = int(llen.sum())
            now = time.monotonic()
            xfer = Transfer(
                transfer_id=next(self._ids),
                op=op,
                peer=remote.peer,
                nbytes=nbytes,
                num_descs=count,
                notif=notif,
                posted_at=now,
                deadline=now + deadline_s,
            )
            self._posted += 1
            lanes = self._lanes
            ranges = None if lanes is None else lanes.ranges(lentry, rentry, li, notif)
            try:
                if ranges is not None and len(ranges) > 1:
                    assert lanes is not None
                    xfer._lane_parts = lanes.make_parts(
                        op.value, (lentry.lane_handles, rentry.lane_handles), li, ri, ranges)
                    self._cut += 1
                    a, b = ranges[0]
                    first_li, first_ri = li[a:b], ri[a:b]
                else:
                    first_li, first_ri = li, ri
                xfer._handle = self._agent.make_prepped_xfer(
                    op.value, lentry.handle, first_li, rentry.handle, first_ri, notif, _UCX)
            except Exception as exc:
                release_parts(xfer._lane_parts)
                self._finish(xfer, XferState.FAILED, f"make_prepped_xfer: {exc!r}")
                return xfer
            self._pending[xfer.transfer_id] = xfer
            try:
                if xfer._lane_parts:
                    assert lanes is not None
                    status = lanes.run(xfer._lane_parts,
                                       lambda: str(self._agent.transfer(xfer._handle)),
                                       xfer.deadline - time.monotonic())
                else:
                    status = self._agent.transfer(xfer._handle)
            except Exception as exc:  # parts still in flight stay zombies until NIXL settles
                self._finish(xfer, XferState.FAILED, f"transfer: {exc!r}",
                             in_flight=bool(xfer._lane_parts))
                return xfer
            self._advance(xfer, status, "transfer")
            return xfer

    def _status(self, xfer: Transfer) -> str:
        """NIXL's status of every part of ``xfer`` in one word (see ``combined_status``)."""
        status = self._agent.check_xfer_state(xfer._handle)
        return combined_status(str(status), xfer._lane_parts) if xfer._lane_parts else status

    def poll(self, xfer: Transfer) -> XferState:
        """Advance ``xfer``: PENDING until NIXL says DONE, an error turns it FAILED
        (``xfer.error`` has the message), and its deadline turns it TIMED_OUT."""
        with self._lock:
            if xfer.state.terminal:
                return xfer.state
            try:
                status = self._status(xfer)
            except Exception as exc:
                self._finish(xfer, XferState.FAILED, f"check_xfer_state: {exc!r}",
                             in_flight=bool(xfer._lane_parts))
                return xfer.state
            self._advance(xfer, status, "check_xfer_state")
            return xfer.state

    def poll_all(self) -> list[Transfer]:
        """Poll every pending transfer once; return those that became terminal now.

        Deadlines are only enforced when a transfer is polled: a connector calls
        this (or ``poll``) every step."""
        with self._lock:
            return [x for x in list(self._pending.values()) if self.poll(x).terminal]

    def wait(self, xfer: Transfer, interval_s: float = 0.0) -> XferState:
        """Poll until terminal (bounded by the transfer's own deadline). A transfer that
        ``post`` already finished (NIXL ran the copy in ``transfer()``) returns at once:
        terminal states never change, so reading one needs no lock."""
        while xfer.state is XferState.PENDING and self.poll(xfer) is XferState.PENDING:
            if interval_s:
                time.sleep(interval_s)
        return xfer.state

    def _advance(self, xfer: Transfer, status: str, where: str) -> None:
        if status == "DONE":
            self._finish(xfer, XferState.DONE, None)
        elif status == "PROC":
            if time.monotonic() >= xfer.deadline:
                self._finish(
                    xfer,
                    XferState.TIMED_OUT,
                    f"still in progress {time.monotonic() - xfer.posted_at:.3f} s after post "
                    f"(deadline {xfer.deadline - xfer.posted_at:.3f} s)",
                )
        else:
            self._finish(xfer, XferState.FAILED, f"{where} returned {status!r}")

    def _telemetry(self, xfer: Transfer) -> float | None:
        """NIXL's ``xferDuration`` of a DONE transfer, in seconds (None: none given); of a
        cut one, its longest part's (the parts ran at once)."""
        try:
            duration_us = self._agent.get_xfer_telemetry(xfer._handle).xferDuration
            for p in xfer._lane_parts:
                duration_us = max(duration_us, p.agent.get_xfer_telemetry(p.handle).xferDuration)
        except Exception:  # noqa: BLE001 (an older NIXL, or telemetry off: not an error)
            return None
        return duration_us / 1e6 if duration_us and duration_us > 0 else None

    def _finish(
        self, xfer: Transfer, state: XferState, error: str | None, *, in_flight: bool = False
    ) -> None:
        """Record the terminal state. ``in_flight``: NIXL has not settled the handle
        (deadline passed, or we gave up on it), so it is kept as a zombie."""
        xfer.state = state
        xfer.error = error
        xfer.finished_at = time.monotonic()
        self._pending.pop(xfer.transfer_id, None)
        if state is XferState.DONE:
            self._done += 1
            self._bytes_done += xfer.nbytes
            if xfer._handle is not None:
                xfer.library_xfer_s = self._telemetry(xfer)
        elif state is XferState.FAILED:
            self._failed += 1
        else:
            self._timed_out += 1
        if error:
            logger.warning(
                "nixl transfer %d %s to %s (%d descs, %d B) %s: %s",
                xfer.transfer_id, xfer.op.value, xfer.peer.name, xfer.num_descs,
                xfer.nbytes, state.value, error,
            )
        if xfer._handle is None:  # failed before NIXL ever had it
            xfer.quiesced = True
        elif in_flight or state is XferState.TIMED_OUT:
            self._zombies.append(xfer)  # still in flight inside NIXL/UCX: keep the handle
        elif not self._release(xfer, quiesced=True):
            self._zombies.append(xfer)

    def _release(self, xfer: Transfer, *, quiesced: bool) -> bool:
        """Release the NIXL handles (every part's); False if NIXL refuses one (kept as a
        zombie, with the parts not released yet)."""
        try:
            if xfer._lane_parts:
                release_parts(xfer._lane_parts)
            xfer._handle.release()
        except Exception as exc:
            logger.info("nixl transfer %d: release refused (%r); kept as zombie", xfer.transfer_id, exc)
            return False
        xfer._handle = None
        xfer.quiesced = quiesced
        return True

    def _force_release(self, xfer: Transfer) -> None:
        self._zombies.remove(xfer)
        self._forced_releases += 1
        logger.warning(
            "nixl transfer %d %s to %s released unsettled: its local memory may still be "
            "written while that peer lives", xfer.transfer_id, xfer.op.value, xfer.peer.name,
        )
        if not self._release(xfer, quiesced=False):
            xfer._handle = None  # NIXL's own finaliser keeps it on the agent's leak list
            xfer._lane_parts = []

    def reap(self) -> int:
        """Release zombies that NIXL has settled (DONE or error); returns how many remain."""
        with self._lock:
            return self._reap_locked()

    def _reap_locked(self) -> int:
        keep = []
        for z in self._zombies:
            try:
                status = self._status(z)
            except Exception as exc:  # the peer died: nothing more can land
                logger.info("nixl zombie %d settled with %r", z.transfer_id, exc)
                status = "ERR"
            if status == "PROC" or not self._release(z, quiesced=True):
                keep.append(z)
        self._zombies = keep
        return len(keep)

    def pending(self) -> list[Transfer]:
        with self._lock:
            return list(self._pending.values())

    # ----------------------------------------------------------- notifications

    def send_notif(self, peer: PeerHandle, msg: bytes) -> None:
        """Send a standalone notification; raises NixlTransportError if the peer is gone."""
        with self._lock:
            self._check_peer(peer)
            try:
                self._agent.send_notif(peer.name, bytes(msg))
            except Exception as exc:
                raise NixlTransportError(f"send_notif to {peer.name}: {exc!r}") from exc

    def get_notifs(self) -> dict[str, list[bytes]]:
        """New notifications by sender agent name. Also progresses the UCX worker, which
        the passive side of a READ/WRITE must do regularly (no progress thread)."""
        with self._lock:
            self._check_open()
            out = self._agent.get_new_notifs()
            if self._zombies:
                self._reap_locked()
        return {str(k): [bytes(m) for m in v] for k, v in out.items() if v}

    # ---------------------------------------------------------------- counters

    def counters(self) -> TransportCounters:
        with self._lock:
            return TransportCounters(
                registrations=len(self._registrations),
                dlists=len(self._dlists),
                xfer_handles=len(self._pending) + len(self._zombies),
                peers=len(self._peers),
                zombies=len(self._zombies),
                forced_releases=self._forced_releases,
                posted=self._posted,
                done=self._done,
                failed=self._failed,
                timed_out=self._timed_out,
                bytes_done=self._bytes_done,
                cut_transfers=self._cut,
            )

    # ---------------------------------------------------------------- shutdown

    def close(self, *, strict: bool = True) -> TransportCounters:
        """Release everything (idempotent): pending transfers are failed, settled
        zombies released, peers removed (unsettled zombies force-released and
        counted in ``forced_releases``), lists released, memory deregistered.

        Returns the final counters; with ``strict`` raises if any live count is
        not zero (a leak)."""
        with self._lock:
            if self._closed:
                return self.counters()
            for xfer in list(self._pending.values()):
                self._finish(xfer, XferState.FAILED, "transport closed", in_flight=True)
            for peer in list(self._peers.values()):
                self.remove_peer(peer)
            for list_id in list(self._dlists):
                self._dlists.pop(list_id).release()
            for z in list(self._zombies):  # peers already removed: none should be left
                self._force_release(z)
            if self._lanes is not None:
                self._lanes.close()
            self._regions.clear()
            while self._registrations:
                reg = self._registrations.pop()
                try:
                    self._agent.deregister_memory(reg.handle)
                except Exception as exc:
                    logger.error("deregister_memory failed: %r", exc)
            self._closed = True
            final = self.counters()
            if final.forced_releases:
                logger.warning(
                    "nixl transport %s released %d unsettled transfers by force",
                    self.name, final.forced_releases,
                )
        if strict and final.live:
            raise NixlTransportError(f"nixl transport {self.name} leaked at close: {final}")
        return final

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(strict=False)

    # ----------------------------------------------------------------- helpers

    def _check_open(self) -> None:
        if self._closed:
            raise NixlTransportError(f"nixl transport {self.name} is closed")

    def _check_peer(self, peer: PeerHandle) -> None:
        self._check_open()
        current = self._peers.get(peer.name)
        if current is not peer and current != peer:
            raise NixlTransportError(
                f"peer {peer.name} generation {peer.generation} is not current "
                f"(current: {self._peers.get(peer.name)})"
            )

    def _region(self, region_id: int) -> Region:
        if not 0 <= region_id < len(self._regions):
            raise NixlTransportError(
                f"region_id must be in [0, {len(self._regions)}), got {region_id}"
            )
        return self._regions[region_id]

    def _dlist(self, dlist: DescList, want_peer: PeerHandle | None) -> DListEntry:
        if want_peer is not None:
            self._check_peer(want_peer)  # a stale generation is the likelier cause: say so
        entry = self._dlists.get(dlist.list_id)
        if entry is None:
            raise NixlTransportError(f"descriptor list {dlist.list_id} was released or never prepared")
        if want_peer is None and entry.peer is not None:
            raise NixlTransportError("local: expected a list from prepare_local*, got a remote one")
        return entry

    def _check_inside_regions(self, arr: np.ndarray) -> str:
        """Every descriptor of ``arr`` inside one registration, of one memory type (see
        :func:`~.nixl_memory.check_inside_registrations`); returns the memory type."""
        return check_inside_registrations(arr, self._registrations)
