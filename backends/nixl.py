"""A thin, leak-counted adapter over one NIXL agent (UCX backend) per worker rank.

Why this layer exists: NIXL's Python API is powerful but has sharp edges that
every caller would otherwise rediscover (see ``BACKENDS.md``):

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

Descriptor rows are ``(addr, len[, dev])`` -- one row per descriptor -- or
NIXL's strided form ``(addr, len, dev, stride, count)`` (NIXL >= 1.5): one row
stands for ``count`` descriptors of ``len`` bytes, ``stride`` bytes apart, and
index ``sum(count of the rows before) + k`` names the ``k``-th of them. A
layer's per-block list of a real cache (~10^5 blocks) is then one row to build
and prepare instead of 10^5 (:func:`strided_descs`).

CUDA: UCX disables CUDA IPC on a thread without a current CUDA context, so
once VRAM is registered every thread that enters the transport (the engine
thread, a handshake executor, a progress pump) has ``torch.cuda.set_device``
called for the registered device first (:func:`set_cuda_device`), once per
thread.

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

Nothing else of kvbridge is imported here (dependency rule of ``backends``).
"""

from __future__ import annotations

import enum
import importlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import apply_env_defaults

logger = logging.getLogger(__name__)

__all__ = [
    "DescList",
    "NixlTransport",
    "NixlTransportError",
    "NixlUnavailableError",
    "PeerHandle",
    "Region",
    "Transfer",
    "TransportCounters",
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

#: NIXL memory types kvbridge registers and prepares: host memory (pinned or not) and
#: CUDA device memory.
DRAM = "DRAM"
VRAM = "VRAM"
MEM_TYPES = (DRAM, VRAM)

#: Transfers name rows by int32 index (NIXL's index arrays): a list holds at most this many.
MAX_LIST_DESCS = (1 << 31) - 1


class NixlTransportError(RuntimeError):
    """A misuse of the transport (bad argument, unknown handle, closed transport)."""


class NixlUnavailableError(NixlTransportError):
    """NIXL cannot be imported or has no UCX backend on this machine."""


class XferOp(str, enum.Enum):
    """Direction of a transfer, seen from the initiator (the side that posts)."""

    READ = "READ"  # remote -> local
    WRITE = "WRITE"  # local -> remote


class XferState(str, enum.Enum):
    """Lifecycle of a :class:`Transfer`. Only PENDING is non-terminal."""

    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"
    TIMED_OUT = "TIMED_OUT"

    @property
    def terminal(self) -> bool:
        return self is not XferState.PENDING


@dataclass(frozen=True)
class Region:
    """A registered memory region. ``region_id`` indexes :meth:`register_regions` order.

    ``addr``/``nbytes`` span the item given (a tensor, or ``(addr, nbytes)``);
    the NIXL registration behind it is the item's whole backing storage, shared
    by every region on the same storage. ``mem_type`` is ``DRAM`` or ``VRAM``,
    ``device_id`` the CUDA device (0 for host memory).
    """

    region_id: int
    addr: int
    nbytes: int
    mem_type: str = DRAM
    device_id: int = 0


@dataclass(frozen=True)
class MemoryOf:
    """What :func:`memory_of` found about one item to register."""

    addr: int
    nbytes: int
    mem_type: str
    device_id: int
    storage_addr: int  # the backing allocation, registered once for all its views
    storage_nbytes: int


def memory_of(item: Any, where: str = "region") -> MemoryOf:
    """Address, size, memory type and backing storage of a tensor or raw tuple.

    ``item`` is a contiguous tensor (``cpu`` -> DRAM, pinned or not; ``cuda`` ->
    VRAM on its device), ``(addr, nbytes)`` (host memory) or ``(addr, nbytes,
    mem_type, device_id)``. Only the tensor's attributes are read (``device``,
    ``data_ptr``, ``untyped_storage``), so a description of a CUDA tensor
    works on a machine without CUDA.
    """
    if isinstance(item, tuple):
        if len(item) not in (2, 4):
            raise NixlTransportError(f"{where}: expected (addr, nbytes) or (addr, nbytes, "
                                     f"mem_type, device_id), got {item!r}")
        addr, nbytes = int(item[0]), int(item[1])
        mem_type, device_id = (DRAM, 0) if len(item) == 2 else (str(item[2]), int(item[3]))
        storage_addr, storage_nbytes = addr, nbytes
    else:
        if not getattr(item, "is_contiguous", lambda: False)():
            raise NixlTransportError(f"{where}: expected a contiguous tensor")
        device = item.device
        if device.type == "cpu":
            mem_type, device_id = DRAM, 0
        elif device.type == "cuda":
            mem_type = VRAM
            device_id = device.index if device.index is not None else _current_cuda_device()
        else:
            raise NixlTransportError(f"{where}: expected host (cpu) or CUDA memory, got "
                                     f"{device}")
        addr, nbytes = int(item.data_ptr()), int(item.numel() * item.element_size())
        storage = item.untyped_storage()
        storage_addr, storage_nbytes = int(storage.data_ptr()), int(storage.nbytes())
        if not (storage_addr <= addr and addr + nbytes <= storage_addr + storage_nbytes):
            storage_addr, storage_nbytes = addr, nbytes  # not a plain view: register itself
    if mem_type not in MEM_TYPES:
        raise NixlTransportError(f"{where}: mem_type must be one of {MEM_TYPES}, got "
                                 f"{mem_type!r}")
    if device_id < 0 or (mem_type == DRAM and device_id != 0):
        raise NixlTransportError(f"{where}: device_id must be >= 0 (0 for DRAM), got "
                                 f"{device_id}")
    if addr <= 0 or nbytes <= 0:
        raise NixlTransportError(f"{where}: expected addr > 0 and nbytes > 0, got {addr}, "
                                 f"{nbytes}")
    return MemoryOf(addr, nbytes, mem_type, device_id, storage_addr, storage_nbytes)


def _current_cuda_device() -> int:
    import torch

    return int(torch.cuda.current_device())


def set_cuda_device(device_id: int) -> None:
    """Make ``device_id`` the current CUDA device of the calling thread (creates its
    context). Module-level so that a test on a machine without CUDA can record the
    calls in its place."""
    import torch

    torch.cuda.set_device(device_id)


@dataclass(frozen=True)
class PeerHandle:
    """A remote agent added from its metadata.

    ``generation`` increases every time a peer of the same name is (re-)added,
    so lists prepared for an earlier incarnation are refused instead of
    silently addressing a restarted process's memory.
    """

    name: str
    generation: int


@dataclass(frozen=True)
class DescList:
    """A prepared descriptor list; transfers refer to its rows by index.

    ``peer`` is ``None`` for a local list. ``num_descs`` bounds valid indices.
    """

    list_id: int
    num_descs: int
    peer: PeerHandle | None


@dataclass(frozen=True)
class TransportCounters:
    """Live-object counts for leak checks, plus lifetime totals."""

    registrations: int
    dlists: int
    xfer_handles: int
    peers: int
    zombies: int
    forced_releases: int
    posted: int
    done: int
    failed: int
    timed_out: int
    bytes_done: int

    @property
    def live(self) -> int:
        """Sum of the live counts; zero after :meth:`NixlTransport.close`."""
        return self.registrations + self.dlists + self.xfer_handles + self.peers


@dataclass(eq=False)  # identity semantics: each post is a distinct transfer
class Transfer:
    """One posted transfer. Created by :meth:`NixlTransport.post`, advanced by ``poll``.

    Telemetry: ``nbytes`` and ``num_descs`` are computed from the prepared
    lists at post time; ``duration_s`` is post-to-terminal as observed by
    ``poll`` (so its resolution is the caller's polling interval).

    ``quiesced`` is True once NIXL no longer touches this transfer's memory
    (DONE, or an error reported by NIXL). A TIMED_OUT transfer becomes
    quiesced later, when its zombie handle settles; until then its local
    blocks (READ destination / WRITE source) must not be reused.
    """

    transfer_id: int
    op: XferOp
    peer: PeerHandle
    nbytes: int
    num_descs: int
    notif: bytes
    posted_at: float
    deadline: float
    state: XferState = XferState.PENDING
    error: str | None = None
    finished_at: float | None = None
    quiesced: bool = False
    _handle: Any = field(default=None, repr=False)

    @property
    def duration_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.posted_at

    @property
    def gbps(self) -> float | None:
        d = self.duration_s
        return None if not d else self.nbytes / d / 1e9


def load_nixl_api() -> Any:
    """Return NIXL's ``_api`` module: the build that matches torch's CUDA.

    The order and the reason for it come from :func:`nixl_candidates` (the
    ``nixl`` meta package's ``nixl._api`` first: it picks the build for the
    installed CUDA; else ``nixl_cu13`` / ``nixl_cu12``, the one matching
    torch's CUDA major first). :func:`loaded_nixl` says which one loaded.
    """
    apply_env_defaults()  # UCX_MODULES and the CUDA transports must be set before an agent
    global _LOADED
    if _LOADED is not None:
        return importlib.import_module(_LOADED[0])
    errors = []
    names, reason = nixl_candidates()
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # ImportError, or a shared library that fails to load
            errors.append(f"{name}: {exc!r}")
            continue
        _LOADED = (name, reason + (f" ({'; '.join(errors)})" if errors else ""))
        return module
    raise NixlUnavailableError("NIXL is not importable (" + "; ".join(errors) + ")")


_LOADED: tuple[str, str] | None = None


def torch_cuda_major() -> int | None:
    """The CUDA major version torch was built with (None for a CPU build or no torch)."""
    try:
        import torch
    except Exception:
        return None
    version = getattr(torch.version, "cuda", None)
    try:
        return int(str(version).split(".")[0]) if version else None
    except ValueError:
        return None


def nixl_candidates(cuda_major: int | None = None, *, from_torch: bool = True
                    ) -> tuple[list[str], str]:
    """NIXL modules to try, in order, and why that order (for ``kvbridge doctor``).

    ``nixl._api`` (the meta package, which dispatches to the build for the
    installed CUDA) first; then the per-CUDA wheels, the one for torch's CUDA
    major first (a ``nixl_cu12`` next to a CUDA 13 torch links the wrong CUDA
    runtime). A CPU torch prefers ``nixl_cu12``, the build tested here.
    ``cuda_major`` overrides torch's (None with ``from_torch=False``: no CUDA).
    """
    major = torch_cuda_major() if cuda_major is None and from_torch else cuda_major
    if major is not None and major >= 13:
        builds, why = ["nixl_cu13._api", "nixl_cu12._api"], f"torch is built for CUDA {major}"
    elif major is not None:
        builds, why = ["nixl_cu12._api", "nixl_cu13._api"], f"torch is built for CUDA {major}"
    else:
        builds, why = ["nixl_cu12._api", "nixl_cu13._api"], "torch has no CUDA (CPU build)"
    return ["nixl._api", *builds], (f"nixl._api (meta package) first, then "
                                    f"{builds[0].split('.')[0]}: {why}")


def loaded_nixl() -> tuple[str, str] | None:
    """``(module, why)`` of the NIXL build :func:`load_nixl_api` loaded, or None yet."""
    return _LOADED


def strided_descs(addr: int, length: int, stride: int, count: int,
                  device_id: int = 0) -> np.ndarray:
    """One strided row ``(addr, length, device_id, stride, count)`` (uint64[1,5]):
    ``count`` descriptors of ``length`` bytes at ``addr + k * stride``."""
    if length <= 0 or count <= 0 or stride < length or device_id < 0:
        raise NixlTransportError(f"strided descriptor: need length > 0, count > 0, stride >= "
                                 f"length, device_id >= 0; got length={length} count={count} "
                                 f"stride={stride} device_id={device_id}")
    return np.array([[addr, length, device_id, stride, count]], dtype=np.uint64)


def expand_descs(descs: Any) -> np.ndarray:
    """Any accepted rows as one ``(addr, len, dev)`` row per descriptor (uint64[N,3]),
    in index order: the per-block list a strided one stands for."""
    groups = _as_groups(descs, "descs")
    counts = groups[:, 4].astype(np.int64)
    group = np.repeat(np.arange(groups.shape[0]), counts)
    first = np.zeros(groups.shape[0], dtype=np.int64)
    first[1:] = np.cumsum(counts)[:-1]
    k = (np.arange(group.shape[0], dtype=np.int64) - first[group]).astype(np.uint64)
    out = np.empty((group.shape[0], 3), dtype=np.uint64)
    out[:, 0] = groups[group, 0] + k * groups[group, 3]
    out[:, 1] = groups[group, 1]
    out[:, 2] = groups[group, 2]
    return out


def block_descs(addr: int, block_bytes: int, num_blocks: int) -> np.ndarray:
    """Rows ``(addr + i*block_bytes, block_bytes, 0)`` for ``i < num_blocks`` (uint64[N,3])."""
    return sub_block_descs(addr, block_bytes, num_blocks, 0, block_bytes)


def sub_block_descs(
    addr: int, block_bytes: int, num_blocks: int, offset: int, length: int
) -> np.ndarray:
    """Rows for a slice ``[offset, offset+length)`` of every block (uint64[N,3]).

    Heterogeneous-TP plans read a head slice of each remote block; the
    connector prepares one such list per slice and indexes it by block id.
    """
    if block_bytes <= 0 or num_blocks < 0:
        raise NixlTransportError(
            f"block_bytes must be > 0 and num_blocks >= 0, got {block_bytes}, {num_blocks}"
        )
    if offset < 0 or length <= 0 or offset + length > block_bytes:
        raise NixlTransportError(
            f"slice offset={offset} length={length} must lie inside block_bytes={block_bytes}"
        )
    out = np.zeros((num_blocks, 3), dtype=np.uint64)
    out[:, 0] = addr + offset + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    out[:, 1] = length
    return out


def _as_desc_array(descs: Any, what: str) -> np.ndarray:
    """Validate ``descs`` as (addr, len), (addr, len, dev) or strided (addr, len, dev,
    stride, count) rows -> uint64[N,3] or uint64[N,5] (the strided form kept)."""
    arr = np.asarray(descs)
    if arr.ndim != 2 or arr.shape[1] not in (2, 3, 5) or arr.shape[0] == 0:
        raise NixlTransportError(
            f"{what}: expected a non-empty array of shape (N, 2), (N, 3) or strided (N, 5), "
            f"got {arr.shape}"
        )
    if arr.dtype.kind not in "iu":
        raise NixlTransportError(f"{what}: expected integer rows, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and (arr < 0).any():
        raise NixlTransportError(f"{what}: addresses and lengths must be >= 0")
    out = np.zeros((arr.shape[0], 5 if arr.shape[1] == 5 else 3), dtype=np.uint64)
    out[:, : arr.shape[1]] = arr.astype(np.uint64)
    if (out[:, 1] == 0).any():
        raise NixlTransportError(f"{what}: every descriptor length must be > 0")
    if out.shape[1] == 5:
        stride, count = out[:, 3], out[:, 4]
        if (count == 0).any() or ((stride < out[:, 1]) & (count > 1)).any():
            k = int(np.flatnonzero((count == 0) | ((stride < out[:, 1]) & (count > 1)))[0])
            raise NixlTransportError(f"{what}: strided row {k}: count must be > 0 and stride "
                                     f">= len (rows may not overlap), got {out[k].tolist()}")
        span = stride.astype(np.float64) * (count.astype(np.float64) - 1) + out[:, 1]
        if (out[:, 0].astype(np.float64) + span >= 2.0**63).any():
            raise NixlTransportError(f"{what}: a strided row runs past the address space")
        if float(count.astype(np.float64).sum()) > MAX_LIST_DESCS:
            raise NixlTransportError(f"{what}: {int(count.sum())} descriptors exceed "
                                     f"{MAX_LIST_DESCS} (transfers index rows with int32)")
    elif out.shape[0] > MAX_LIST_DESCS:
        raise NixlTransportError(f"{what}: {out.shape[0]} rows exceed {MAX_LIST_DESCS}")
    return out


def _as_groups(descs: Any, what: str) -> np.ndarray:
    """Any accepted rows as strided groups uint64[M,5] (a plain row is a group of one)."""
    arr = _as_desc_array(descs, what)
    if arr.shape[1] == 5:
        return arr
    out = np.empty((arr.shape[0], 5), dtype=np.uint64)
    out[:, :3] = arr
    out[:, 3] = arr[:, 1]
    out[:, 4] = 1
    return out


def _as_indices(idx: Any, bound: int, what: str) -> np.ndarray:
    arr = np.ascontiguousarray(np.asarray(idx, dtype=np.int64).reshape(-1))
    if arr.size == 0:
        raise NixlTransportError(f"{what}: expected at least one index")
    if arr.min() < 0 or arr.max() >= bound:
        raise NixlTransportError(
            f"{what}: indices must lie in [0, {bound}), got min {arr.min()} max {arr.max()}"
        )
    return arr.astype(np.int32)


@dataclass
class _DListEntry:
    """A prepared list. Row lengths are kept per group (a strided row is one group),
    so looking up the lengths of posted indices costs no per-descriptor memory."""

    handle: Any
    group_lengths: np.ndarray  # uint64[M]
    group_ends: np.ndarray | None  # int64[M] cumulative counts; None: every group is one row
    peer: PeerHandle | None
    mem_type: str = DRAM

    def lengths(self, idx: np.ndarray) -> np.ndarray:
        if self.group_ends is None:
            return self.group_lengths[idx]
        return self.group_lengths[np.searchsorted(self.group_ends, idx, side="right")]


@dataclass
class _Registration:
    """One NIXL registration: a distinct backing storage."""

    addr: int
    nbytes: int
    mem_type: str
    device_id: int
    handle: Any


class _AgentLock:
    """The transport's lock; entering it also makes the registered CUDA device
    current on the calling thread (see the module docstring)."""

    def __init__(self, transport: NixlTransport) -> None:
        self._rlock = threading.RLock()
        self._transport = transport

    def __enter__(self) -> None:
        self._rlock.acquire()
        try:
            self._transport._bind_thread()
        except BaseException:
            self._rlock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        self._rlock.release()


class NixlTransport:
    """One NIXL agent (UCX, no progress thread) for one worker rank.

    ``name`` must be unique among agents that talk to each other; the default
    adds a random suffix so that a restarted process gets a new identity.
    """

    def __init__(self, name: str | None = None, *, num_threads: int = 0) -> None:
        api = load_nixl_api()
        self.name = name or f"kvbridge-{uuid.uuid4().hex[:12]}"
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=["UCX"],
            num_threads=num_threads,
        )
        self._api = api
        self._cuda_device: int | None = None  # set by the first VRAM registration
        self._thread_device = threading.local()
        self._lock = _AgentLock(self)
        try:
            self._agent = api.nixl_agent(self.name, config)
        except Exception as exc:
            raise NixlUnavailableError(f"cannot create NIXL agent {self.name!r}: {exc!r}") from exc
        if "UCX" not in self._agent.backends:
            raise NixlUnavailableError(
                f"NIXL agent {self.name!r} has no UCX backend (plugins: {self._agent.plugin_list})"
            )
        self._closed = False
        self._regions: list[Region] = []
        self._registrations: list[_Registration] = []
        self._dlists: dict[int, _DListEntry] = {}
        self._peers: dict[str, PeerHandle] = {}
        self._peer_md: dict[str, bytes] = {}
        self._generations: dict[str, int] = {}
        self._pending: dict[int, Transfer] = {}
        self._zombies: list[Transfer] = []
        self._forced_releases = 0
        self._ids = itertools.count(1)
        self._posted = self._done = self._failed = self._timed_out = 0
        self._bytes_done = 0

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
                    self._registrations.append(_Registration(
                        info.storage_addr, info.storage_nbytes, info.mem_type, info.device_id,
                        reg))
                region = Region(len(self._regions), info.addr, info.nbytes, info.mem_type,
                                info.device_id)
                self._regions.append(region)
                out.append(region)
        return out

    def _registration_of(self, info: MemoryOf) -> _Registration | None:
        for reg in self._registrations:
            if ((reg.mem_type, reg.device_id) == (info.mem_type, info.device_id)
                    and reg.addr <= info.addr
                    and info.addr + info.nbytes <= reg.addr + reg.nbytes):
                return reg
        return None

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
        arr = _as_desc_array(descs, "local descs")
        mem_type = self._check_inside_regions(arr)
        return self._prep(arr, None, mem_type)

    def prepare_remote(self, peer: PeerHandle, descs: Any, mem_type: str = DRAM) -> DescList:
        """Prepare the peer's rows (from its handshake) once per peer, as ``mem_type``:
        the *peer's* memory type, which its handshake document carries. Rows as for
        :meth:`prepare_local_descs`, the device column being the peer's device."""
        if mem_type not in MEM_TYPES:
            raise NixlTransportError(f"mem_type must be one of {MEM_TYPES}, got {mem_type!r}")
        self._check_peer(peer)
        return self._prep(_as_desc_array(descs, "remote descs"), peer, mem_type)

    def release_dlist(self, dlist: DescList) -> None:
        """Release a prepared list (no transfer may be using it; idempotent)."""
        with self._lock:
            entry = self._dlists.pop(dlist.list_id, None)
            if entry is not None:
                entry.handle.release()

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
                entry = _DListEntry(handle, arr[:, 1].copy(), ends, peer, mem_type)
            else:
                num_descs = int(arr.shape[0])
                entry = _DListEntry(handle, arr[:, 1].copy(), None, peer, mem_type)
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
                self._dlists.pop(list_id).handle.release()
            self._reap_locked()  # settle what can be settled while NIXL still knows the peer
            del self._peers[peer.name]
            del self._peer_md[peer.name]
            try:
                self._agent.remove_remote_agent(peer.name)
            except Exception as exc:  # already disconnected: nothing left to free
                logger.warning("remove_remote_agent(%s) failed: %r", peer.name, exc)
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
        caller handles one failure path); argument errors raise.
        """
        op = XferOp(op)
        if not deadline_s > 0:
            raise NixlTransportError(f"deadline_s must be > 0, got {deadline_s}")
        with self._lock:
            self._check_open()
            lentry = self._dlist(local, want_peer=None)
            if remote.peer is None:
                raise NixlTransportError("remote: expected a list from prepare_remote, got a local one")
            rentry = self._dlist(remote, want_peer=remote.peer)
            li = _as_indices(local_idx, local.num_descs, "local_idx")
            ri = _as_indices(remote_idx, remote.num_descs, "remote_idx")
            if li.size != ri.size:
                raise NixlTransportError(
                    f"local_idx and remote_idx must have equal length, got {li.size} and {ri.size}"
                )
            llen, rlen = lentry.lengths(li), rentry.lengths(ri)
            if not np.array_equal(llen, rlen):
                k = int(np.flatnonzero(llen != rlen)[0])
                raise NixlTransportError(
                    f"descriptor {k}: local length {int(llen[k])} != remote length {int(rlen[k])}"
                )
            now = time.monotonic()
            xfer = Transfer(
                transfer_id=next(self._ids),
                op=op,
                peer=remote.peer,
                nbytes=int(llen.sum()),
                num_descs=int(li.size),
                notif=bytes(notif),
                posted_at=now,
                deadline=now + deadline_s,
            )
            self._posted += 1
            try:
                xfer._handle = self._agent.make_prepped_xfer(
                    op.value, lentry.handle, li, rentry.handle, ri, bytes(notif), ["UCX"]
                )
            except Exception as exc:
                self._finish(xfer, XferState.FAILED, f"make_prepped_xfer: {exc!r}")
                return xfer
            self._pending[xfer.transfer_id] = xfer
            try:
                status = self._agent.transfer(xfer._handle)
            except Exception as exc:
                self._finish(xfer, XferState.FAILED, f"transfer: {exc!r}")
                return xfer
            self._advance(xfer, status, "transfer")
            return xfer

    def poll(self, xfer: Transfer) -> XferState:
        """Advance ``xfer``: PENDING until NIXL says DONE, an error turns it FAILED
        (``xfer.error`` has the message), and its deadline turns it TIMED_OUT."""
        with self._lock:
            if xfer.state.terminal:
                return xfer.state
            try:
                status = self._agent.check_xfer_state(xfer._handle)
            except Exception as exc:
                self._finish(xfer, XferState.FAILED, f"check_xfer_state: {exc!r}")
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
        """Poll until terminal (bounded by the transfer's own deadline)."""
        while self.poll(xfer) is XferState.PENDING:
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
        """Release the NIXL handle; False if NIXL refuses (kept as a zombie)."""
        try:
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

    def reap(self) -> int:
        """Release zombies that NIXL has settled (DONE or error); returns how many remain."""
        with self._lock:
            return self._reap_locked()

    def _reap_locked(self) -> int:
        keep = []
        for z in self._zombies:
            try:
                status = self._agent.check_xfer_state(z._handle)
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
                self._dlists.pop(list_id).handle.release()
            for z in list(self._zombies):  # peers already removed: none should be left
                self._force_release(z)
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
        if self._peers.get(peer.name) != peer:
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

    def _dlist(self, dlist: DescList, want_peer: PeerHandle | None) -> _DListEntry:
        if want_peer is not None:
            self._check_peer(want_peer)  # a stale generation is the likelier cause: say so
        entry = self._dlists.get(dlist.list_id)
        if entry is None:
            raise NixlTransportError(f"descriptor list {dlist.list_id} was released or never prepared")
        if want_peer is None and entry.peer is not None:
            raise NixlTransportError("local: expected a list from prepare_local*, got a remote one")
        return entry

    def _check_inside_regions(self, arr: np.ndarray) -> str:
        """Every descriptor of ``arr`` inside one registration, all of one memory type,
        with that registration's device id (filled in for two-column input, whose
        device column is 0); returns the memory type."""
        starts = arr[:, 0].astype(np.int64)
        if arr.shape[1] == 5:
            last = (arr[:, 3] * (arr[:, 4] - np.uint64(1))).astype(np.int64)
            ends = starts + last + arr[:, 1].astype(np.int64)
        else:
            ends = starts + arr[:, 1].astype(np.int64)
        owner = np.full(arr.shape[0], -1, dtype=np.int64)
        for i, r in enumerate(self._registrations):
            owner[(owner < 0) & (starts >= r.addr) & (ends <= r.addr + r.nbytes)] = i
        if (owner < 0).any():
            k = int(np.flatnonzero(owner < 0)[0])
            raise NixlTransportError(
                f"local descs row {k} (addr {int(starts[k]):#x}, len {int(arr[k, 1])}) "
                "is not inside any registered region"
            )
        kinds = {(self._registrations[i].mem_type, self._registrations[i].device_id)
                 for i in np.unique(owner).tolist()}
        if len({m for m, _ in kinds}) > 1:
            raise NixlTransportError(f"local descs span memory types {sorted(kinds)}: a list "
                                     "is of one memory type")
        devices = np.array([r.device_id for r in self._registrations], dtype=np.uint64)[owner]
        wrong = (arr[:, 2] != devices) & (arr[:, 2] != 0)
        if wrong.any():
            k = int(np.flatnonzero(wrong)[0])
            raise NixlTransportError(f"local descs row {k}: device {int(arr[k, 2])}, but its "
                                     f"memory is registered on device {int(devices[k])}")
        arr[:, 2] = devices
        return next(iter(kinds))[0]
