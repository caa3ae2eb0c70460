"""A one-sided transfer transport over Mooncake's transfer engine (TE), for the PD core.

:class:`MooncakeTeTransport` has the members of the PD core's transport
protocol (``connectors/pd/transport.py``) and speaks in the neutral records of
:mod:`kvbridge.backends.transfer`. One ``mooncake.engine.TransferEngine`` per
rank, started with ``initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")``: no
metadata server, peers found by ``host:rpc_port``, loopback only.

What TE gives and what this adapter adds (measured on the non-CUDA wheel
0.3.13.post1, tcp, one host; docs/backends.md, "Mooncake transfer engine"):

- **Completion.** ``transfer_check_status(batch)`` is the one non-blocking
  check, and it looks at the batch's *first* task only, freeing the batch once
  that task is done or failed (checking a freed batch is undefined:
  ``get_batch_transfer_status`` on one hung). So every contiguous run is its own
  one-task batch, and a batch is checked until it answers 1 or -1, never after.
- **Failures.** A READ or WRITE outside the peer's registered memory fails
  (``-1``, the peer's server refuses it); an unknown or dead peer fails
  the submit itself (batch id 0, ~3 ms on loopback). TE checks nothing of the
  *local* side over tcp, so :meth:`prepare_local_descs` checks every row lies
  inside this rank's registrations, and :meth:`prepare_remote` that every row
  lies inside the peer's (its metadata lists them).
- **No transfer deadline.** A stalled peer leaves a batch pending; the
  transfer becomes ``TIMED_OUT`` at its deadline and its batches are kept as
  counted *zombies* (its local memory is not ``quiesced``) until TE settles
  them, as the NIXL adapter does.
- **No notifications without a transfer.** TE's ``get_notifies`` carries only
  messages attached to a synchronous transfer. Notifications go over a ZeroMQ
  PULL socket per transport, bound on 127.0.0.1 (its endpoint travels in the
  agent metadata), one PUSH socket per peer; each message is two frames, the
  sender's agent name and the bytes, both bounded. A sender's name is what it
  claims, as for any peer on the loopback side channel: the PD core seals its
  ``hello`` and binds answers to sessions.
- **Host memory only.** The non-CUDA wheel cannot register GPU memory; a CUDA
  tensor is refused (:class:`MooncakeTeError`). Plain ``(addr, nbytes)`` spans
  are taken as host memory.
- **One engine per rank.** No lanes; TE runs its own transfer threads.

Every wait is bounded: notifications are drained without blocking, each
``poll`` is one non-blocking check per pending batch, and :meth:`close` waits
at most ``close_wait_s`` for zombies before counting them as forced releases.
The engine's first contact with a peer (TE's P2P handshake, inside the first
submit) is bounded by TE itself only: a peer that accepts TCP but never
answers can hold that submit (not measured here: the tests use dead peers).

Owns: the engine, its registrations, prepared lists, peers, transfers and the
notification sockets. Imports of kvbridge: :mod:`kvbridge.backends.transfer`
and :mod:`.config` (the Mooncake error base).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq

from kvbridge.backends.mooncake.config import MooncakeError
from kvbridge.backends.transfer import (
    DRAM,
    MEM_TYPES,
    DescList,
    PeerHandle,
    Region,
    Transfer,
    TransportCounters,
    TransportError,
    XferOp,
    XferState,
)

#: the only host the adapter binds and accepts peers on
LOOPBACK = "127.0.0.1"
#: bounds on what a peer hands us: its metadata, its registrations, one notification
MAX_METADATA_BYTES = 1 << 20
MAX_PEER_REGISTRATIONS = 4096
MAX_NOTIF_BYTES = 1 << 20
MAX_NAME_BYTES = 256
#: notifications taken per :meth:`MooncakeTeTransport.get_notifs` (the rest wait for the next)
MAX_NOTIFS_PER_DRAIN = 4096
#: queued notifications per peer before a send is refused rather than buffered without end
NOTIF_SEND_HWM = 1024
#: rows of one prepared list (transfers index rows with int32, as the NIXL adapter's do)
MAX_LIST_DESCS = (1 << 31) - 1
METADATA_VERSION = 1


class MooncakeTeError(TransportError, MooncakeError):
    """The TE transport refused a call (bad argument, unknown handle or peer, closed
    transport, memory it cannot register), or TE could not start."""


def load_engine_class() -> Any:
    """``mooncake.engine.TransferEngine``, or :class:`MooncakeTeError` saying what to install."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise MooncakeTeError(f"cannot import mooncake.engine ({exc}); install "
                              f"mooncake-transfer-engine-non-cuda (kvbridge[mooncake-cpu])") from None
    return TransferEngine


@dataclass
class _List:
    """A prepared list: strided groups ``(addr, len, dev, stride, count)`` and their ends."""

    groups: np.ndarray  # uint64[M, 5]
    ends: np.ndarray  # int64[M]: cumulative counts
    peer: PeerHandle | None

    def rows(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Addresses and lengths of the rows ``idx`` (bounds checked by the caller)."""
        g = np.searchsorted(self.ends, idx, side="right")
        first = self.ends[g] - self.groups[g, 4].astype(np.int64)
        k = (idx - first).astype(np.uint64)
        return self.groups[g, 0] + k * self.groups[g, 3], self.groups[g, 1]


@dataclass
class _Peer:
    handle: PeerHandle
    session: str  # TE's name of the peer: ``host:rpc_port``
    registrations: list[tuple[int, int]]
    push: Any  # zmq PUSH socket to the peer's notification endpoint
    metadata: bytes


@dataclass
class _Pending:
    """What a posted transfer still waits on: its one-task batches."""

    batches: list[int] = field(default_factory=list)
    failed: bool = False


def _as_groups(descs: Any, what: str) -> np.ndarray:
    """Rows ``(addr, len[, dev])`` or strided ``(addr, len, dev, stride, count)`` as strided
    groups uint64[M, 5], every length > 0 and every strided row non-overlapping."""
    arr = np.asarray(descs)
    if arr.ndim != 2 or arr.shape[1] not in (2, 3, 5) or arr.shape[0] == 0:
        raise MooncakeTeError(f"{what}: expected a non-empty array of shape (N, 2), (N, 3) or "
                              f"(N, 5), got {arr.shape}")
    if arr.dtype.kind not in "iu" or (arr.dtype.kind == "i" and (arr < 0).any()):
        raise MooncakeTeError(f"{what}: expected non-negative integer rows, got {arr.dtype}")
    out = np.zeros((arr.shape[0], 5), dtype=np.uint64)
    out[:, :arr.shape[1]] = arr.astype(np.uint64)
    if arr.shape[1] != 5:
        out[:, 3] = out[:, 1]
        out[:, 4] = 1
    if (out[:, 1] == 0).any() or (out[:, 4] == 0).any() \
            or ((out[:, 3] < out[:, 1]) & (out[:, 4] > 1)).any():
        raise MooncakeTeError(f"{what}: every row needs length > 0, count > 0 and stride >= "
                              f"length")
    if float(out[:, 4].astype(np.float64).sum()) > MAX_LIST_DESCS:
        raise MooncakeTeError(f"{what}: more than {MAX_LIST_DESCS} descriptors")
    return out


def _outside(groups: np.ndarray, spans: Sequence[tuple[int, int]]) -> int | None:
    """Index of the first group not inside one of ``spans`` (None: all inside)."""
    last = groups[:, 0].astype(np.float64) + groups[:, 3].astype(np.float64) \
        * (groups[:, 4].astype(np.float64) - 1) + groups[:, 1].astype(np.float64)
    for i in range(groups.shape[0]):
        lo, hi = int(groups[i, 0]), int(last[i])
        if not any(addr <= lo and hi <= addr + nbytes for addr, nbytes in spans):
            return i
    return None


def _indices(idx: Any, bound: int, what: str) -> np.ndarray:
    arr = np.asarray(idx, dtype=np.int64).reshape(-1)
    if arr.size == 0:
        raise MooncakeTeError(f"{what}: expected at least one index")
    if int(arr.min()) < 0 or int(arr.max()) >= bound:
        raise MooncakeTeError(f"{what}: indices must lie in [0, {bound}), got min "
                              f"{int(arr.min())} max {int(arr.max())}")
    return arr


def _runs(local: np.ndarray, remote: np.ndarray, lengths: np.ndarray
          ) -> tuple[list[int], list[int], list[int]]:
    """Merge consecutive rows contiguous on both sides into runs (fewer TE batches)."""
    if local.size == 0:
        return [], [], []
    ends = local[:-1] + lengths[:-1]
    joined = (ends == local[1:]) & (remote[:-1] + lengths[:-1] == remote[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    sums = np.add.reduceat(lengths, starts)
    return local[starts].tolist(), remote[starts].tolist(), sums.tolist()


class MooncakeTeTransport:
    """One TE engine and one notification socket for one worker rank (thread-safe: one lock)."""

    def __init__(self, name: str, *, close_wait_s: float = 1.0) -> None:
        if not name or len(name.encode()) > MAX_NAME_BYTES:
            raise MooncakeTeError(f"name: expected 1..{MAX_NAME_BYTES} bytes, got {name!r}")
        self.name = name
        self.close_wait_s = close_wait_s
        engine = load_engine_class()()
        rc = engine.initialize(LOOPBACK, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise MooncakeTeError(f"TransferEngine.initialize({LOOPBACK!r}, 'P2PHANDSHAKE', "
                                  f"'tcp') returned {rc}")
        self._engine: Any = engine
        self.session = f"{LOOPBACK}:{int(engine.get_rpc_port())}"
        self._zmq = zmq.Context()
        self._pull = self._zmq.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_NOTIF_BYTES)
        self._pull.bind(f"tcp://{LOOPBACK}:0")
        self.notify_endpoint = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._generations: dict[str, int] = {}
        self._regions: list[Region] = []
        self._registrations: list[tuple[int, int]] = []
        self._lists: dict[int, _List] = {}
        self._peers: dict[str, _Peer] = {}
        self._pending: dict[int, tuple[Transfer, _Pending]] = {}
        self._zombies: dict[int, tuple[Transfer, _Pending]] = {}
        self._totals = dict(posted=0, done=0, failed=0, timed_out=0, bytes_done=0,
                            forced_releases=0)
        self._closed = False

    # ---- memory and identity

    def register_regions(self, regions: Sequence[Any]) -> list[Region]:
        """Register host memory: tensors on the CPU, or ``(addr, nbytes)`` spans. Each
        backing storage once, whole; a CUDA tensor is refused (no GPU memory here)."""
        out = []
        with self._lock:
            self._check_open()
            for i, item in enumerate(regions):
                addr, nbytes, storage = self._span_of(item, f"regions[{i}]")
                if not any(a <= storage[0] and storage[0] + storage[1] <= a + n
                           for a, n in self._registrations):
                    rc = self._engine.register_memory(storage[0], storage[1])
                    if rc != 0:
                        raise MooncakeTeError(f"register_memory({storage[0]:#x}, {storage[1]}) "
                                              f"returned {rc}")
                    self._registrations.append(storage)
                region = Region(len(self._regions), addr, nbytes, DRAM, 0)
                self._regions.append(region)
                out.append(region)
        return out

    @staticmethod
    def _span_of(item: Any, what: str) -> tuple[int, int, tuple[int, int]]:
        if isinstance(item, tuple) and len(item) == 2:
            addr, nbytes = int(item[0]), int(item[1])
            if addr <= 0 or nbytes <= 0:
                raise MooncakeTeError(f"{what}: expected (addr > 0, nbytes > 0), got {item}")
            return addr, nbytes, (addr, nbytes)
        device = getattr(item, "device", None)
        if device is None or not hasattr(item, "untyped_storage"):
            raise MooncakeTeError(f"{what}: expected a tensor or (addr, nbytes), got "
                                  f"{type(item).__name__}")
        if device.type != "cpu":
            raise MooncakeTeError(f"{what}: memory on {device} - the TE adapter moves host "
                                  f"memory only (the non-CUDA wheel registers no GPU memory)")
        storage = item.untyped_storage()
        return (int(item.data_ptr()), int(item.numel() * item.element_size()),
                (int(storage.data_ptr()), int(storage.nbytes())))

    @property
    def memory_type(self) -> tuple[str, int]:
        return DRAM, 0

    def agent_metadata(self) -> bytes:
        """This rank's TE session, notification endpoint and registrations (msgpack)."""
        with self._lock:
            self._check_open()
            return bytes(msgpack.packb({"v": METADATA_VERSION, "session": self.session,
                                        "notify": self.notify_endpoint,
                                        "regs": [list(r) for r in self._registrations]}))

    # ---- peers and descriptor lists

    def add_peer(self, peer_name: str, metadata: bytes) -> PeerHandle:
        """A peer from its :meth:`agent_metadata`; new metadata under a known name (a
        restarted peer) replaces the old incarnation, failing its transfers."""
        session, notify, regs = self._decode_metadata(peer_name, metadata)
        with self._lock:
            self._check_open()
            old = self._peers.get(peer_name)
            if old is not None:
                if old.metadata == metadata:
                    return old.handle
                self.remove_peer(old.handle)
            push = self._zmq.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, NOTIF_SEND_HWM)
            push.connect(notify)
            generation = self._generations.get(peer_name, 0) + 1
            self._generations[peer_name] = generation
            handle = PeerHandle(peer_name, generation)
            self._peers[peer_name] = _Peer(handle, session, regs, push, bytes(metadata))
            return handle

    @staticmethod
    def _decode_metadata(peer_name: str, metadata: bytes
                         ) -> tuple[str, str, list[tuple[int, int]]]:
        where = f"metadata of peer {peer_name!r}"
        if not isinstance(metadata, bytes | bytearray) or len(metadata) > MAX_METADATA_BYTES:
            raise MooncakeTeError(f"{where}: expected at most {MAX_METADATA_BYTES} bytes")
        try:
            doc = msgpack.unpackb(metadata, raw=False, max_array_len=MAX_PEER_REGISTRATIONS,
                                  max_map_len=16, max_str_len=512, max_bin_len=0)
        except Exception as exc:
            raise MooncakeTeError(f"{where}: not msgpack ({exc})") from None
        if not isinstance(doc, dict) or doc.get("v") != METADATA_VERSION:
            raise MooncakeTeError(f"{where}: expected version {METADATA_VERSION}")
        session, notify, regs = doc.get("session"), doc.get("notify"), doc.get("regs")
        if not isinstance(session, str) or not session.startswith(f"{LOOPBACK}:"):
            raise MooncakeTeError(f"{where}.session: expected {LOOPBACK}:port, got {session!r}")
        if not isinstance(notify, str) or not notify.startswith(f"tcp://{LOOPBACK}:"):
            raise MooncakeTeError(f"{where}.notify: expected tcp://{LOOPBACK}:port, "
                                  f"got {notify!r}")
        if not isinstance(regs, list) or not all(
                isinstance(r, list) and len(r) == 2 and all(
                    isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 63
                    for v in r) for r in regs):
            raise MooncakeTeError(f"{where}.regs: expected [[addr, nbytes], ...]")
        return session, notify, [(int(a), int(n)) for a, n in regs]

    def remove_peer(self, peer: PeerHandle) -> None:
        """Forget the peer: its lists are dropped, its pending transfers fail."""
        with self._lock:
            entry = self._peers.get(peer.name)
            if entry is None or entry.handle != peer:
                return
            del self._peers[peer.name]
            entry.push.close(linger=0)
            for list_id in [k for k, v in self._lists.items() if v.peer == peer]:
                del self._lists[list_id]
            for xfer, pending in self._pending.values():
                if xfer.peer == peer:
                    pending.failed = True

    def prepare_local_descs(self, descs: Any) -> DescList:
        """Local rows (as the protocol's), each inside this rank's registrations: TE does
        not check the local side over tcp, so this is the only check it gets."""
        groups = _as_groups(descs, "local descs")
        with self._lock:
            self._check_open()
            bad = _outside(groups, self._registrations)
            if bad is not None:
                raise MooncakeTeError(f"local descs: row {bad} {groups[bad].tolist()} is not "
                                      f"inside a registered region")
            return self._add_list(groups, None)

    def prepare_remote(self, peer: PeerHandle, descs: Any, mem_type: str = DRAM) -> DescList:
        """The peer's rows, each inside a registration its metadata announced."""
        if mem_type not in MEM_TYPES:
            raise MooncakeTeError(f"mem_type must be one of {MEM_TYPES}, got {mem_type!r}")
        if mem_type != DRAM:
            raise MooncakeTeError(f"peer {peer.name}: {mem_type} memory; the TE adapter moves "
                                  f"host memory only")
        groups = _as_groups(descs, "remote descs")
        with self._lock:
            entry = self._peer(peer)
            bad = _outside(groups, entry.registrations)
            if bad is not None:
                raise MooncakeTeError(f"remote descs of {peer.name}: row {bad} "
                                      f"{groups[bad].tolist()} is outside its registrations")
            return self._add_list(groups, peer)

    def _add_list(self, groups: np.ndarray, peer: PeerHandle | None) -> DescList:
        ends = np.cumsum(groups[:, 4].astype(np.int64))
        list_id = next(self._ids)
        self._lists[list_id] = _List(groups, ends, peer)
        return DescList(list_id, int(ends[-1]), peer)

    def release_dlist(self, dlist: DescList) -> None:
        with self._lock:
            self._lists.pop(dlist.list_id, None)

    # ---- transfers and notifications

    def post(self, op: XferOp | str, local: DescList, local_idx: Any, remote: DescList,
             remote_idx: Any, notif: bytes = b"", deadline_s: float = 30.0) -> Transfer:
        """Post rows ``local_idx`` <-> ``remote_idx`` (pairwise, equal lengths): one TE batch
        per run contiguous on both sides. ``notif`` goes to the peer once the transfer is
        DONE here (TE attaches none to an asynchronous batch)."""
        op = XferOp(op)
        if not deadline_s > 0:
            raise MooncakeTeError(f"deadline_s must be > 0, got {deadline_s}")
        if len(notif) > MAX_NOTIF_BYTES:
            raise MooncakeTeError(f"notif: {len(notif)} bytes > {MAX_NOTIF_BYTES}")
        with self._lock:
            self._check_open()
            mine, theirs = self._lists.get(local.list_id), self._lists.get(remote.list_id)
            if mine is None or mine.peer is not None:
                raise MooncakeTeError(f"local list {local.list_id} was released or is remote")
            if theirs is None or theirs.peer is None:
                raise MooncakeTeError(f"remote list {remote.list_id} was released or is local")
            peer = self._peer(theirs.peer)
            lidx = _indices(local_idx, local.num_descs, "local_idx")
            ridx = _indices(remote_idx, remote.num_descs, "remote_idx")
            if lidx.size != ridx.size:
                raise MooncakeTeError(f"{lidx.size} local rows against {ridx.size} remote rows")
            laddr, llen = mine.rows(lidx)
            raddr, rlen = theirs.rows(ridx)
            if not np.array_equal(llen, rlen):
                k = int(np.flatnonzero(llen != rlen)[0])
                raise MooncakeTeError(f"row pair {k}: local length {int(llen[k])} != remote "
                                      f"length {int(rlen[k])}")
            starts, rstarts, lengths = _runs(laddr, raddr, llen)
            now = time.monotonic()
            xfer = Transfer(next(self._ids), op, peer.handle, int(llen.sum()), int(lidx.size),
                            bytes(notif), now, now + deadline_s)
            submit = (self._engine.batch_transfer_async_read if op is XferOp.READ
                      else self._engine.batch_transfer_async_write)
            pending = _Pending()
            for a, r, n in zip(starts, rstarts, lengths, strict=True):
                batch = int(submit(peer.session, [a], [r], [n]))
                if batch == 0:  # TE refused the submit: unknown or dead peer
                    pending.failed = True
                    xfer.error = f"TE refused a batch to {peer.session}"
                    break
                pending.batches.append(batch)
            self._totals["posted"] += 1
            self._pending[xfer.transfer_id] = (xfer, pending)
            xfer._handle = pending
            self._advance(xfer, pending, now)
            return xfer

    def _advance(self, xfer: Transfer, pending: _Pending, now: float) -> None:
        """Check each pending batch once (non-blocking); settle the transfer when it can."""
        still = []
        for batch in pending.batches:
            rc = int(self._engine.transfer_check_status(batch))
            if rc == 0:
                still.append(batch)
            elif rc == 1:
                continue  # done; TE freed the batch
            else:  # -1 failed (freed), -2 TE's own timeout (not freed: kept as pending)
                pending.failed = True
                xfer.error = xfer.error or f"TE batch status {rc}"
                if rc == -2:
                    still.append(batch)
        pending.batches = still
        if xfer.state is XferState.PENDING:
            if pending.failed:
                self._finish(xfer, XferState.FAILED, now)
            elif not still:
                self._finish(xfer, XferState.DONE, now)
            elif now >= xfer.deadline:
                xfer.error = f"deadline passed with {len(still)} batch(es) pending"
                self._finish(xfer, XferState.TIMED_OUT, now)
        if not still:
            xfer.quiesced = True
            self._pending.pop(xfer.transfer_id, None)
            self._zombies.pop(xfer.transfer_id, None)
        elif xfer.state is not XferState.PENDING and xfer.transfer_id in self._pending:
            self._zombies[xfer.transfer_id] = self._pending.pop(xfer.transfer_id)

    def _finish(self, xfer: Transfer, state: XferState, now: float) -> None:
        if state is XferState.DONE and xfer.notif:
            try:
                self.send_notif(xfer.peer, xfer.notif)
            except MooncakeTeError as exc:  # the bytes moved, the peer will never know
                state, xfer.error = XferState.FAILED, f"notification not sent: {exc}"
        xfer.state = state
        xfer.finished_at = now
        key = {XferState.DONE: "done", XferState.FAILED: "failed",
               XferState.TIMED_OUT: "timed_out"}[state]
        self._totals[key] += 1
        if state is XferState.DONE:
            self._totals["bytes_done"] += xfer.nbytes

    def poll(self, xfer: Transfer) -> XferState:
        with self._lock:
            held = self._pending.get(xfer.transfer_id) or self._zombies.get(xfer.transfer_id)
            if held is not None and not self._closed:
                self._advance(xfer, held[1], time.monotonic())
            return xfer.state

    def send_notif(self, peer: PeerHandle, msg: bytes) -> None:
        """Queue ``msg`` for the peer (never blocks: a full queue is an error)."""
        if len(msg) > MAX_NOTIF_BYTES:
            raise MooncakeTeError(f"notif: {len(msg)} bytes > {MAX_NOTIF_BYTES}")
        with self._lock:
            entry = self._peer(peer)
            try:
                entry.push.send_multipart([self.name.encode(), bytes(msg)], flags=zmq.NOBLOCK)
            except zmq.Again:
                raise MooncakeTeError(f"send_notif to {peer.name}: {NOTIF_SEND_HWM} "
                                      f"notifications already queued") from None

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications that arrived, by sender name (at most MAX_NOTIFS_PER_DRAIN)."""
        out: dict[str, list[bytes]] = {}
        with self._lock:
            self._check_open()
            for _ in range(MAX_NOTIFS_PER_DRAIN):
                try:
                    frames = self._pull.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 2 or len(frames[0]) > MAX_NAME_BYTES:
                    continue  # not ours: dropped
                try:
                    sender = frames[0].decode()
                except UnicodeDecodeError:
                    continue
                out.setdefault(sender, []).append(frames[1])
        return out

    # ---- accounting and end of life

    def counters(self) -> TransportCounters:
        with self._lock:
            t = self._totals
            return TransportCounters(
                registrations=len(self._registrations), dlists=len(self._lists),
                xfer_handles=len(self._pending), peers=len(self._peers),
                zombies=len(self._zombies), forced_releases=t["forced_releases"],
                posted=t["posted"], done=t["done"], failed=t["failed"],
                timed_out=t["timed_out"], bytes_done=t["bytes_done"])

    def close(self, *, strict: bool = True) -> TransportCounters:
        """Release everything: fail what is pending, wait at most ``close_wait_s`` for TE
        to settle its batches (then count them as forced releases), drop peers and lists,
        deregister the memory, close the sockets. ``strict``: raise if anything was live."""
        with self._lock:
            if self._closed:
                return self.counters()
            live_before = self.counters().live - len(self._registrations)
            until = time.monotonic() + self.close_wait_s
            for xfer, pending in list(self._pending.values()):
                pending.failed = True
                self._advance(xfer, pending, time.monotonic())
            while self._zombies and time.monotonic() < until:
                for xfer, pending in list(self._zombies.values()):
                    self._advance(xfer, pending, time.monotonic())
                time.sleep(0.001)
            self._totals["forced_releases"] += len(self._zombies)
            self._zombies.clear()
            self._pending.clear()
            for entry in list(self._peers.values()):
                self.remove_peer(entry.handle)
            self._lists.clear()
            for addr, _ in self._registrations:
                self._engine.unregister_memory(addr)
            self._registrations.clear()
            self._pull.close(linger=0)
            self._zmq.term()
            self._engine = None  # TE has no close: dropping the engine stops its threads
            self._closed = True
            final = self.counters()
        if strict and live_before:
            raise MooncakeTeError(f"TE transport {self.name} had {live_before} live "
                                  f"lists/handles/peers at close")
        return final

    def _check_open(self) -> None:
        if self._closed:
            raise MooncakeTeError(f"TE transport {self.name} is closed")

    def _peer(self, peer: PeerHandle) -> _Peer:
        self._check_open()
        entry = self._peers.get(peer.name)
        if entry is None or entry.handle != peer:
            raise MooncakeTeError(f"peer {peer.name} (generation {peer.generation}) is not "
                                  f"added (removed, or replaced by a restart)")
        return entry
