"""A bounded, typed client for the Mooncake distributed store.

``MooncakeStoreClient`` wraps ``mooncake.store.MooncakeDistributedStore`` for
the two users in kvbridge: the Mooncake store connector (blocks of paged KV
cache under namespaced keys) and the offload store's ``obj`` tier. It adds
what the raw binding lacks:

- **typed per-key results** (:class:`KeyResult`) instead of bare ints; every
  Mooncake status code has a name (:class:`McStatus`);
- **bounded calls**: the raw binding blocks ~90 s in ``setup()`` when no master
  listens, and ~4.4 s per call once the master has died. This client checks
  that the master's RPC port accepts (a ~70 µs TCP connect on loopback) before
  ``setup()`` and before each operation, and runs each batch call on a worker
  thread that the caller waits for at most ``op_timeout_s`` (the batch calls
  release the GIL; ``setup()`` and ``close()`` hold it, see their docs);
- **validation** of keys, pointers and sizes at the edge, with errors that
  name the field.

Semantics of the store that callers must know (measured on 0.3.13.post1):

- ``batch_put_from`` on an **existing key returns OK and keeps the old value**;
  use :meth:`MooncakeStoreClient.batch_upsert_from` to overwrite. For KV blocks
  keyed by a content hash the old value is the same bytes, so put is right.
- ``batch_get_into`` reports the object's size per key; this client turns a
  size different from the destination size into ``SIZE_MISMATCH`` (a zero-copy
  get into a KV block must fill it exactly). A destination smaller than the
  object gets Mooncake's ``INVALID_PARAMS`` (-600).
- ``remove`` of a key read less than the lease TTL ago (default 10 s) returns
  ``OBJECT_HAS_LEASE`` (-706) unless ``force=True``.
- A put into a full segment can return ``NO_AVAILABLE_HANDLE`` (-200) while the
  master evicts; the next put usually succeeds.
- A restarted master has lost every key; the client re-mounts its segment by
  itself (about 1 s; puts return -200 until then). No re-setup is needed.

Timeouts: when a call outlives ``op_timeout_s`` the caller gets ``TIMEOUT``
for every key and the call is abandoned on its worker thread, where Mooncake
bounds it itself (~4.4 s per RPC to a dead master). **An abandoned get may
still write into its destination buffers until it returns**; call
:meth:`MooncakeStoreClient.wait_idle` before reusing those buffers for other
data when that matters. While abandoned calls hold all worker threads, new
calls queue behind them, and still return within their own deadline.

Thread safety: every public method may be called from any thread; Mooncake's
store is itself thread-safe, and ``num_op_threads`` calls run concurrently.
"""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import logging
import operator
import os
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1 << 20


class McStatus(enum.IntEnum):
    """Mooncake store status codes (``mooncake-store/include/types.h``), plus kvbridge's own.

    Codes >= -1999 come from Mooncake. Codes <= -10000 are produced by this
    client and never by Mooncake: the call was not made (master unreachable,
    client closed) or its answer was not waited for (timeout), or a get
    returned a size other than the destination's.
    """

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SHARD_INDEX_OUT_OF_RANGE = -100
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    CLIENT_NOT_FOUND = -103
    NO_AVAILABLE_HANDLE = -200
    INVALID_VERSION = -300
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    OBJECT_HAS_REPLICATION_TASK = -708
    OBJECT_NO_REPLICATION_TASK = -709
    REPLICA_NOT_FOUND = -710
    REPLICA_ALREADY_EXISTS = -711
    REPLICA_IS_GONE = -712
    TRANSFER_FAIL = -800
    CHECKSUM_MISMATCH = -801
    RPC_FAIL = -900
    ETCD_OPERATION_ERROR = -1000
    ETCD_KEY_NOT_EXIST = -1001
    ETCD_TRANSACTION_FAIL = -1002
    ETCD_CTX_CANCELLED = -1003
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    UNAVAILABLE_IN_CURRENT_MODE = -1011
    FILE_NOT_FOUND = -1100
    FILE_OPEN_FAIL = -1101
    FILE_READ_FAIL = -1102
    FILE_WRITE_FAIL = -1103
    FILE_INVALID_BUFFER = -1104
    FILE_LOCK_FAIL = -1105
    FILE_INVALID_HANDLE = -1106
    BUCKET_NOT_FOUND = -1200
    BUCKET_ALREADY_EXISTS = -1201
    KEYS_EXCEED_BUCKET_LIMIT = -1202
    KEYS_ULTRA_LIMIT = -1203
    UNABLE_OFFLOAD = -1300
    UNABLE_OFFLOADING = -1301
    TASK_NOT_FOUND = -1400
    TASK_PENDING_LIMIT_EXCEEDED = -1401
    # kvbridge-side codes (never returned by Mooncake itself).
    TIMEOUT = -10001
    MASTER_UNREACHABLE = -10002
    CLIENT_CLOSED = -10003
    SIZE_MISMATCH = -10004

    @staticmethod
    def name_of(code: int) -> str:
        """The status name for ``code``, or ``UNKNOWN(code)`` for a code this list lacks."""
        try:
            return McStatus(code).name
        except ValueError:
            return f"UNKNOWN({code})"


class KeyStatus(enum.Enum):
    """What one key's operation amounted to."""

    OK = "ok"
    NOT_FOUND = "not_found"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class KeyResult:
    """The outcome of one key in a batch call.

    ``code`` is :class:`McStatus`-valued (0 on success, negative otherwise);
    ``nbytes`` is the bytes moved (gets and puts) or 0.
    """

    status: KeyStatus
    code: int = 0
    nbytes: int = 0

    @property
    def ok(self) -> bool:
        return self.status is KeyStatus.OK

    @property
    def not_found(self) -> bool:
        return self.status is KeyStatus.NOT_FOUND

    @property
    def code_name(self) -> str:
        return McStatus.name_of(self.code)

    def __str__(self) -> str:
        if self.ok:
            return f"ok({self.nbytes} B)"
        return f"{self.status.value}({self.code_name})"


_NOT_FOUND = KeyResult(KeyStatus.NOT_FOUND, McStatus.OBJECT_NOT_FOUND)
_EXISTS = KeyResult(KeyStatus.OK)
# KeyResult is immutable, so equal results are shared: building one object per
# key costs ~2 us, which is 15 % of a 4096 x 16 KiB get. Caches are bounded.
_CACHE_LIMIT = 4096
_OK_BY_NBYTES: dict[int, KeyResult] = {}
_ERROR_BY_CODE: dict[int, KeyResult] = {McStatus.OBJECT_NOT_FOUND: _NOT_FOUND}


def _ok(nbytes: int) -> KeyResult:
    result = _OK_BY_NBYTES.get(nbytes)
    if result is None:
        result = KeyResult(KeyStatus.OK, 0, nbytes)
        if len(_OK_BY_NBYTES) < _CACHE_LIMIT:
            _OK_BY_NBYTES[nbytes] = result
    return result


def _error(code: int) -> KeyResult:
    result = _ERROR_BY_CODE.get(code)
    if result is None:
        result = KeyResult(KeyStatus.ERROR, code)
        if len(_ERROR_BY_CODE) < _CACHE_LIMIT:
            _ERROR_BY_CODE[code] = result
    return result


# ---- pure interpretation of raw return values (no I/O; unit-tested alone) -------
def interpret_put(code: int, nbytes: int) -> KeyResult:
    """A ``batch_put_from``/``batch_upsert_from`` element: 0 ok, negative error."""
    return _ok(nbytes) if code == 0 else _error(int(code))


def interpret_get(code: int, expected_nbytes: int, exact_size: bool = True) -> KeyResult:
    """A ``batch_get_into`` element: bytes read (>= 0) or a negative code.

    With ``exact_size`` an object whose size differs from the destination is
    ``SIZE_MISMATCH``: the bytes in the buffer are not a whole block.
    """
    code = int(code)
    if code < 0:
        return _error(code)
    if exact_size and code != expected_nbytes:
        return KeyResult(KeyStatus.ERROR, McStatus.SIZE_MISMATCH, code)
    return _ok(code)


def interpret_exists(code: int) -> KeyResult:
    """A ``batch_is_exist`` element: 1 exists, 0 absent, negative error."""
    code = int(code)
    if code == 1:
        return _EXISTS
    if code == 0:
        return _NOT_FOUND
    # The binding documents -1 for "error"; it carries Mooncake's INTERNAL_ERROR name.
    return _error(code)


def interpret_remove(code: int) -> KeyResult:
    """A ``batch_remove`` element: 0 removed, -704 absent, other negative error."""
    code = int(code)
    return _EXISTS if code == 0 else _error(code)


def _ok_batch(sizes: list[int]) -> list[KeyResult]:
    """``[_ok(n) for n in sizes]`` without a Python-level loop per key (hot: 4096-key batches)."""
    if not sizes:
        return []
    first = sizes[0]
    if sizes.count(first) == len(sizes):  # the usual batch: every block the same size
        return [_ok(first)] * len(sizes)
    by_size = {n: _ok(n) for n in set(sizes)}
    return list(map(by_size.__getitem__, sizes))


def interpret_put_batch(codes: list[int], sizes: list[int]) -> list[KeyResult]:
    """:func:`interpret_put` over a batch (fast path when every key succeeded)."""
    if not any(codes):
        return _ok_batch(sizes)
    return [interpret_put(c, n) for c, n in zip(codes, sizes, strict=True)]


def interpret_get_batch(codes: list[int], sizes: list[int], exact_size: bool = True) -> list[KeyResult]:
    """:func:`interpret_get` over a batch (fast path when every key read its full size)."""
    if codes == sizes:
        return _ok_batch(sizes)
    return [interpret_get(c, n, exact_size) for c, n in zip(codes, sizes, strict=True)]


_EXISTS_LUT = {1: _EXISTS, 0: _NOT_FOUND}


def interpret_exists_batch(codes: list[int]) -> list[KeyResult]:
    """:func:`interpret_exists` over a batch."""
    lut = _EXISTS_LUT
    return [lut.get(c) or interpret_exists(c) for c in codes]


def uniform(results_len: int, code: McStatus) -> list[KeyResult]:
    """The same failure for every key of a call that was not made or not waited for."""
    return [_error(code)] * results_len


# ---- errors ---------------------------------------------------------------------
class MooncakeError(RuntimeError):
    """Base of this module's errors (per-key failures are results, not exceptions)."""


class MooncakeConfigError(MooncakeError, ValueError):
    """A configuration field or call argument is invalid; the message names it."""


class MooncakeUnavailable(MooncakeError):
    """The ``mooncake`` wheel cannot be imported here (missing, or its libraries fail to load)."""


class MooncakeSetupError(MooncakeError):
    """``setup()`` failed, or its master / metadata server is unreachable or stalled."""


class MooncakeClosedError(MooncakeError):
    """The client was closed (or never set up) and cannot serve calls."""


# ---- configuration --------------------------------------------------------------
class Protocol(str, enum.Enum):
    TCP = "tcp"
    RDMA = "rdma"


def _split_host_port(value: str, field_name: str) -> tuple[str, int]:
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise MooncakeConfigError(f"{field_name} must be 'host:port', got {value!r}")
    return host.strip("[]"), int(port_text)


@dataclass(frozen=True)
class MooncakeConfig:
    """Everything a client needs to join a store; validated at construction.

    ``master_address`` is the master's ``host:port`` (``MooncakeMaster.rpc_address``);
    ``metadata_server`` the HTTP metadata URL (``MooncakeMaster.metadata_url``),
    or ``P2PHANDSHAKE``/``etcd://...`` as Mooncake accepts them.
    ``global_segment_size`` (bytes) is what this client lends to the store (0
    mounts nothing: a pure reader/writer); ``local_buffer_size`` (bytes) is the
    client's staging buffer. ``device_name`` is the RDMA device list (ignored
    with TCP). ``op_timeout_s`` bounds each batch call; ``probe_timeout_s``
    bounds each reachability check (and the checks before ``setup()``).
    ``check_master_before_ops`` makes every call probe the master first and
    fail fast with ``MASTER_UNREACHABLE`` (~70 µs per call on loopback).
    ``num_op_threads`` calls can run at once (abandoned calls occupy one each).
    """

    master_address: str
    metadata_server: str
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 256 * MiB
    local_buffer_size: int = 64 * MiB
    protocol: Protocol = Protocol.TCP
    device_name: str = ""
    op_timeout_s: float = 5.0
    probe_timeout_s: float = 0.5
    check_master_before_ops: bool = True
    replica_num: int = 1
    num_op_threads: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.protocol, str) and not isinstance(self.protocol, Protocol):
            try:
                object.__setattr__(self, "protocol", Protocol(self.protocol.lower()))
            except ValueError:
                raise MooncakeConfigError(
                    f"protocol must be one of {[p.value for p in Protocol]}, got {self.protocol!r}"
                ) from None
        _split_host_port(self.master_address, "master_address")
        if not self.metadata_server:
            raise MooncakeConfigError("metadata_server must be a URL such as http://127.0.0.1:8080/metadata")
        if not self.local_hostname:
            raise MooncakeConfigError("local_hostname must be this host's address, e.g. 127.0.0.1")
        if self.global_segment_size < 0:
            raise MooncakeConfigError(f"global_segment_size must be >= 0 bytes, got {self.global_segment_size}")
        if self.local_buffer_size < 0:
            raise MooncakeConfigError(f"local_buffer_size must be >= 0 bytes, got {self.local_buffer_size}")
        for name in ("op_timeout_s", "probe_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise MooncakeConfigError(f"{name} must be > 0 seconds, got {value}")
        if self.replica_num < 1:
            raise MooncakeConfigError(f"replica_num must be >= 1, got {self.replica_num}")
        if self.num_op_threads < 1:
            raise MooncakeConfigError(f"num_op_threads must be >= 1, got {self.num_op_threads}")
        if self.protocol is Protocol.RDMA and not self.device_name:
            raise MooncakeConfigError("device_name must name the RDMA device(s) when protocol is rdma")

    @property
    def master_host_port(self) -> tuple[str, int]:
        return _split_host_port(self.master_address, "master_address")

    @property
    def metadata_host_port(self) -> tuple[str, int] | None:
        """Host and port of an ``http://`` metadata server (None for other kinds)."""
        parts = urlsplit(self.metadata_server)
        if parts.scheme not in ("http", "https") or parts.hostname is None:
            return None
        return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


@dataclass(frozen=True)
class ClientStats:
    """Counters since setup; a snapshot (see :meth:`MooncakeStoreClient.stats`)."""

    calls: int = 0
    keys: int = 0
    key_errors: int = 0
    timeouts: int = 0
    unreachable: int = 0


@dataclass
class _Counters:
    calls: int = 0
    keys: int = 0
    key_errors: int = 0
    timeouts: int = 0
    unreachable: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


# ---- helpers --------------------------------------------------------------------
def tcp_reachable(host: str, port: int, timeout_s: float) -> bool:
    """True when a TCP connect to ``host:port`` succeeds within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def http_answers(url: str, timeout_s: float) -> bool:
    """True when an HTTP server at ``url`` answers (any status) within ``timeout_s``.

    Mooncake's metadata server lives in the master process, so an HTTP answer
    also shows the master is not stalled; ``setup()`` against a stalled master
    would block for minutes with the GIL held.
    """
    probe = url + ("&" if "?" in url else "?") + "key=kvbridge-liveness-probe"
    # No proxies: an http_proxy in the environment must not answer for the master.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(probe, timeout=timeout_s) as response:
            response.read(256)
        return True
    except urllib.error.HTTPError:
        return True  # 404 "metadata not found" is the expected answer
    except (OSError, ValueError):
        return False


def import_store_class() -> Any:
    """``mooncake.store.MooncakeDistributedStore``, or :class:`MooncakeUnavailable` saying how to install it."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except Exception as exc:  # ImportError, or OSError from a shared library that fails to load
        raise MooncakeUnavailable(
            f"cannot import mooncake.store ({exc!r}); install `mooncake-transfer-engine-non-cuda` "
            "(no GPU driver) or `mooncake-transfer-engine`, plus Debian libibverbs1 librdmacm1 "
            "libnuma1 libcurl4"
        ) from exc
    return MooncakeDistributedStore


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class _Workers:
    """A few daemon threads running blocking Mooncake calls so callers can stop waiting.

    Daemon threads (unlike ``concurrent.futures``' pool) never hold up
    interpreter exit behind a call stuck on a dead master.
    """

    def __init__(self, num_threads: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._busy = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        with self._lock:
            self._busy += 1
        self._jobs.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, fut = job
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # surfaced to the waiting caller
                        fut.set_exception(exc)
            finally:
                with self._lock:
                    self._busy -= 1
                    if self._busy == 0:
                        self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
            return True

    @property
    def busy(self) -> int:
        with self._lock:
            return self._busy

    def shutdown(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)


# ---- the client -----------------------------------------------------------------
class MooncakeStoreClient:
    """A Mooncake store client with typed per-key results and bounded calls.

    Typical use::

        with MooncakeStoreClient(MooncakeConfig(master.rpc_address, master.metadata_url)) as client:
            client.register_buffer(kv.data_ptr(), kv.nbytes)
            client.batch_put_from(keys, ptrs, sizes)      # -> list[KeyResult]
            client.batch_get_into(keys, ptrs, sizes)      # -> list[KeyResult]
            client.unregister_buffer(kv.data_ptr())

    Construction does no I/O; :meth:`setup` (or ``with``) joins the store.
    Buffers used for zero-copy put/get should be registered (with TCP an
    unregistered buffer works through a staging copy; with RDMA it must be
    registered). Backend failures are per-key results, never exceptions;
    exceptions mean misuse (bad arguments, use after close) or a failed setup.
    """

    def __init__(self, config: MooncakeConfig) -> None:
        if not isinstance(config, MooncakeConfig):
            raise MooncakeConfigError(f"config must be a MooncakeConfig, got {type(config).__name__}")
        self.config = config
        self._store: Any = None
        self._replicate_config: Any = None
        self._workers: _Workers | None = None
        self._registered: dict[int, int] = {}
        self._state_lock = threading.Lock()
        self._closed = False
        self._counters = _Counters()

    # ---- lifecycle -------------------------------------------------------------
    @classmethod
    def connect(cls, config: MooncakeConfig) -> MooncakeStoreClient:
        """Construct and :meth:`setup` in one call."""
        client = cls(config)
        client.setup()
        return client

    def setup(self) -> None:
        """Join the store (~0.2-0.5 s against a live master).

        Checks first, each within ``probe_timeout_s``, that the master's RPC
        port accepts a connection and that an ``http://`` metadata server
        answers HTTP, because Mooncake's ``setup()`` against an absent or
        stalled master blocks ~90 s **holding the GIL** (so no watchdog thread
        can cut it short). A master that stalls between these checks and
        ``setup()`` is not covered. With a loopback
        ``local_hostname``, sets ``MC_TCP_BIND_ADDRESS`` to it unless already
        set, so the transfer engine does not look for a LAN address.
        Raises :class:`MooncakeSetupError` (or :class:`MooncakeUnavailable`).
        """
        with self._state_lock:
            if self._closed:
                raise MooncakeClosedError("this client was closed; create a new one")
            if self._store is not None:
                raise MooncakeSetupError("setup() was already called on this client")
        cfg = self.config
        host, port = cfg.master_host_port
        if not tcp_reachable(host, port, cfg.probe_timeout_s):
            raise MooncakeSetupError(
                f"Mooncake master at {cfg.master_address} does not accept connections "
                f"(checked within {cfg.probe_timeout_s} s); start one with "
                "`kvbridge mooncake master` or fix master_address"
            )
        if cfg.metadata_host_port is not None and not http_answers(
            cfg.metadata_server, cfg.probe_timeout_s
        ):
            raise MooncakeSetupError(
                f"metadata server {cfg.metadata_server} does not answer HTTP within "
                f"{cfg.probe_timeout_s} s; a master started with "
                "--enable_http_metadata_server=true serves it (is the master stalled?)"
            )
        if cfg.protocol is Protocol.TCP and _is_loopback(cfg.local_hostname):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", cfg.local_hostname)
        store_cls = import_store_class()
        store = store_cls()
        started = time.monotonic()
        # Runs on this thread: the binding holds the GIL during setup(), so a
        # watchdog thread could not return early anyway (measured).
        try:
            rc = int(
                store.setup(
                    cfg.local_hostname,
                    cfg.metadata_server,
                    cfg.global_segment_size,
                    cfg.local_buffer_size,
                    cfg.protocol.value,
                    cfg.device_name,
                    cfg.master_address,
                )
            )
        except Exception as exc:
            raise MooncakeSetupError(f"Mooncake setup() raised {exc!r}") from exc
        if rc != 0:
            raise MooncakeSetupError(
                f"Mooncake setup() returned {rc} ({McStatus.name_of(rc)}) for master "
                f"{cfg.master_address}, metadata {cfg.metadata_server}, local_hostname "
                f"{cfg.local_hostname}, protocol {cfg.protocol.value}"
            )
        replicate = _make_replicate_config(cfg.replica_num)
        with self._state_lock:
            self._store = store
            self._replicate_config = replicate
            self._workers = _Workers(cfg.num_op_threads, "mooncake-op")
        logger.info(
            "Mooncake client joined master %s in %.2f s (segment %d B, buffer %d B, %s)",
            cfg.master_address, time.monotonic() - started, cfg.global_segment_size,
            cfg.local_buffer_size, cfg.protocol.value,
        )

    def close(self) -> None:
        """Unregister remaining buffers and close the store. Idempotent.

        Mooncake's own ``close()`` takes ~2 s (it unmounts the segment) and
        ~11 s when the master is dead, holding the GIL throughout (measured):
        close clients at shutdown, not on a latency-sensitive path.
        """
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            store, workers = self._store, self._workers
            registered = list(self._registered)
            self._registered.clear()
        if store is None:
            return
        assert workers is not None
        # Let in-flight calls finish (each is bounded by Mooncake) before tearing down.
        if not workers.wait_idle(self.config.op_timeout_s):
            logger.warning("closing Mooncake client with %d calls still in flight", workers.busy)
        workers.shutdown()
        for ptr in registered:
            with contextlib.suppress(Exception):
                store.unregister_buffer(ptr)
        try:
            rc = int(store.close())
        except Exception as exc:
            logger.warning("Mooncake close() raised %r", exc)
            return
        if rc != 0:
            logger.warning("Mooncake close() returned %d (%s)", rc, McStatus.name_of(rc))

    def __enter__(self) -> MooncakeStoreClient:
        if self._store is None:
            self.setup()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def is_open(self) -> bool:
        return self._store is not None and not self._closed

    @property
    def raw_store(self) -> Any:
        """The underlying ``MooncakeDistributedStore`` (benchmarks and diagnostics only)."""
        return self._require_store()

    def hostname(self) -> str:
        """This client's segment name in the store (``host:port`` of its transfer engine)."""
        return str(self._require_store().get_hostname())

    def stats(self) -> ClientStats:
        c = self._counters
        with c.lock:
            return ClientStats(c.calls, c.keys, c.key_errors, c.timeouts, c.unreachable)

    # ---- reachability ----------------------------------------------------------
    def is_master_reachable(self, timeout_s: float | None = None) -> bool:
        """Fast check (one TCP connect, ~70 µs on loopback) that the master's RPC port accepts.

        Use it to fail fast before a batch: with a dead master each Mooncake
        call blocks ~4.4 s. A True answer does not promise the next call succeeds.
        """
        host, port = self.config.master_host_port
        return tcp_reachable(host, port, self.config.probe_timeout_s if timeout_s is None else timeout_s)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no call (including abandoned, timed-out ones) is running; True if idle."""
        if self._workers is None:
            return True
        return self._workers.wait_idle(self.config.op_timeout_s if timeout_s is None else timeout_s)

    # ---- buffer registration ---------------------------------------------------
    def register_buffer(self, ptr: int, nbytes: int) -> None:
        """Register ``[ptr, ptr + nbytes)`` for zero-copy transfers; keep it alive until unregistered."""
        _check_ptr(ptr, "ptr")
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise MooncakeConfigError(f"nbytes must be a positive int (bytes), got {nbytes!r}")
        store = self._require_store()
        with self._state_lock:
            if ptr in self._registered:
                raise MooncakeConfigError(f"buffer at ptr 0x{ptr:x} is already registered")
        rc = int(store.register_buffer(ptr, nbytes))
        if rc != 0:
            raise MooncakeError(
                f"register_buffer(0x{ptr:x}, {nbytes} B) returned {rc} ({McStatus.name_of(rc)})"
            )
        with self._state_lock:
            self._registered[ptr] = nbytes

    def unregister_buffer(self, ptr: int) -> None:
        """Undo :meth:`register_buffer` for the buffer starting at ``ptr``."""
        store = self._require_store()
        with self._state_lock:
            if ptr not in self._registered:
                raise MooncakeConfigError(f"no buffer registered at ptr 0x{ptr:x}")
            del self._registered[ptr]
        rc = int(store.unregister_buffer(ptr))
        if rc != 0:
            logger.warning("unregister_buffer(0x%x) returned %d (%s)", ptr, rc, McStatus.name_of(rc))

    @property
    def registered_buffers(self) -> dict[int, int]:
        """ptr -> nbytes of the buffers registered through this client."""
        with self._state_lock:
            return dict(self._registered)

    # ---- batch operations ------------------------------------------------------
    def batch_put_from(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[KeyResult]:
        """Store ``sizes[i]`` bytes at ``ptrs[i]`` under ``keys[i]``; an existing key keeps its old value."""
        keys_l, ptrs_l, sizes_l = _check_batch(keys, ptrs, sizes)
        store, replicate = self._require_store(), self._replicate_config
        raw = self._call(
            "batch_put_from", len(keys_l),
            lambda: store.batch_put_from(keys_l, ptrs_l, sizes_l, replicate),
        )
        if isinstance(raw, list):
            return self._count(interpret_put_batch(raw, sizes_l))
        return raw.results

    def batch_upsert_from(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> list[KeyResult]:
        """Like :meth:`batch_put_from`, but overwrites existing keys."""
        keys_l, ptrs_l, sizes_l = _check_batch(keys, ptrs, sizes)
        store, replicate = self._require_store(), self._replicate_config
        raw = self._call(
            "batch_upsert_from", len(keys_l),
            lambda: store.batch_upsert_from(keys_l, ptrs_l, sizes_l, replicate),
        )
        if isinstance(raw, list):
            return self._count(interpret_put_batch(raw, sizes_l))
        return raw.results

    def batch_get_into(
        self,
        keys: Sequence[str],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        *,
        exact_size: bool = True,
    ) -> list[KeyResult]:
        """Read each key's object into ``ptrs[i]`` (capacity ``sizes[i]`` bytes).

        Per key: OK (``nbytes`` read), NOT_FOUND, or ERROR (``SIZE_MISMATCH``
        when ``exact_size`` and the object is not exactly ``sizes[i]`` bytes).
        """
        keys_l, ptrs_l, sizes_l = _check_batch(keys, ptrs, sizes)
        store = self._require_store()
        raw = self._call(
            "batch_get_into", len(keys_l), lambda: store.batch_get_into(keys_l, ptrs_l, sizes_l)
        )
        if isinstance(raw, list):
            return self._count(interpret_get_batch(raw, sizes_l, exact_size))
        return raw.results

    def batch_exists_results(self, keys: Sequence[str]) -> list[KeyResult]:
        """Per key: OK (exists), NOT_FOUND, or ERROR (the check itself failed)."""
        keys_l = _check_keys(keys)
        store = self._require_store()
        raw = self._call("batch_is_exist", len(keys_l), lambda: store.batch_is_exist(keys_l))
        if isinstance(raw, list):
            return self._count(interpret_exists_batch(raw))
        return raw.results

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """True per key that exists; a failed check counts as absent (a miss), and is logged."""
        return [r.ok for r in self.batch_exists_results(keys)]

    def remove(self, keys: Sequence[str], *, force: bool = False) -> list[KeyResult]:
        """Remove keys. Per key: OK, NOT_FOUND, or ERROR (``OBJECT_HAS_LEASE`` within the lease TTL of a read, unless ``force``)."""
        keys_l = _check_keys(keys)
        store = self._require_store()
        raw = self._call(
            "batch_remove", len(keys_l), lambda: store.batch_remove(keys_l, force=bool(force))
        )
        if isinstance(raw, list):
            return self._count([interpret_remove(c) for c in raw])
        return raw.results

    # ---- internals -------------------------------------------------------------
    def _require_store(self) -> Any:
        store = self._store
        if self._closed:
            raise MooncakeClosedError("this Mooncake client is closed")
        if store is None:
            raise MooncakeClosedError("call setup() before using the Mooncake client")
        return store

    def _call(self, op: str, num_keys: int, fn: Callable[[], Any]) -> list[int] | _Failed:
        """Run one batch call with the reachability check and the deadline; raw list or uniform failure."""
        cfg = self.config
        with self._counters.lock:
            self._counters.calls += 1
            self._counters.keys += num_keys
        if num_keys == 0:
            return []
        if cfg.check_master_before_ops and not self.is_master_reachable():
            with self._counters.lock:
                self._counters.unreachable += 1
                self._counters.key_errors += num_keys
            logger.warning(
                "mooncake %s of %d keys skipped: master %s unreachable", op, num_keys, cfg.master_address
            )
            return _Failed(uniform(num_keys, McStatus.MASTER_UNREACHABLE))
        workers = self._workers
        assert workers is not None
        fut = workers.submit(fn)
        try:
            raw = fut.result(timeout=cfg.op_timeout_s)
        except FutureTimeout:
            with self._counters.lock:
                self._counters.timeouts += 1
                self._counters.key_errors += num_keys
            logger.warning(
                "mooncake %s of %d keys timed out after %.2f s (master %s); call abandoned",
                op, num_keys, cfg.op_timeout_s, cfg.master_address,
            )
            return _Failed(uniform(num_keys, McStatus.TIMEOUT))
        except Exception as exc:
            # The binding raises only on argument conversion errors; report them per key.
            logger.warning("mooncake %s of %d keys raised %r", op, num_keys, exc)
            with self._counters.lock:
                self._counters.key_errors += num_keys
            return _Failed(uniform(num_keys, McStatus.INTERNAL_ERROR))
        result = list(raw)
        if len(result) != num_keys:
            logger.warning("mooncake %s returned %d results for %d keys", op, len(result), num_keys)
            return _Failed(uniform(num_keys, McStatus.INTERNAL_ERROR))
        return result

    def _count(self, results: list[KeyResult]) -> list[KeyResult]:
        error = KeyStatus.ERROR
        errors = list(map(_STATUS, results)).count(error)  # C-level pass: hot on big batches
        if errors:
            with self._counters.lock:
                self._counters.key_errors += errors
            first = next(r for r in results if r.status is KeyStatus.ERROR)
            logger.debug("mooncake call: %d of %d keys failed (first: %s)", errors, len(results), first)
        return results

    def __repr__(self) -> str:
        state = "open" if self.is_open else ("closed" if self._closed else "new")
        return f"MooncakeStoreClient(master={self.config.master_address}, {state})"


_STATUS = operator.attrgetter("status")


@dataclass(frozen=True)
class _Failed:
    """A call that was not made or not waited for: the same result for every key."""

    results: list[KeyResult]


def _make_replicate_config(replica_num: int) -> Any:
    from mooncake.store import ReplicateConfig

    replicate = ReplicateConfig()
    replicate.replica_num = replica_num
    return replicate


def _check_ptr(ptr: object, field_name: str) -> None:
    if not isinstance(ptr, int) or isinstance(ptr, bool) or ptr <= 0:
        raise MooncakeConfigError(f"{field_name} must be a non-null address (int), got {ptr!r}")


_STR_ONLY = frozenset((str,))
_INT_ONLY = frozenset((int,))


def _check_keys(keys: Sequence[str]) -> list[str]:
    keys_l = keys if type(keys) is list else list(keys)
    # Fast whole-batch test first, without a Python-level loop per key (4096 keys:
    # ~0.2 ms); find the culprit only on failure.
    if set(map(type, keys_l)) <= _STR_ONLY and all(keys_l):
        return keys_l
    for i, key in enumerate(keys_l):
        if not isinstance(key, str) or not key:
            raise MooncakeConfigError(f"keys[{i}] must be a non-empty str, got {key!r}")
    return keys_l


def _as_int_list(values: Sequence[int], field_name: str) -> list[int]:
    values_l = values if type(values) is list else list(values)
    if not set(map(type, values_l)) <= _INT_ONLY:  # exact ints (no bool), no per-item loop
        try:
            values_l = [int(v) for v in values_l]  # numpy integers, etc.
        except (TypeError, ValueError):
            raise MooncakeConfigError(f"{field_name} must be ints") from None
    return values_l


def _check_batch(
    keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
) -> tuple[list[str], list[int], list[int]]:
    keys_l = _check_keys(keys)
    ptrs_l = _as_int_list(ptrs, "ptrs")
    sizes_l = _as_int_list(sizes, "sizes")
    if not len(keys_l) == len(ptrs_l) == len(sizes_l):
        raise MooncakeConfigError(
            f"keys, ptrs and sizes must have one entry per key; got {len(keys_l)}, "
            f"{len(ptrs_l)}, {len(sizes_l)}"
        )
    if keys_l and min(ptrs_l) <= 0:
        i = next(i for i, p in enumerate(ptrs_l) if p <= 0)
        raise MooncakeConfigError(f"ptrs[{i}] must be a non-null address, got {ptrs_l[i]}")
    if keys_l and min(sizes_l) <= 0:
        i = next(i for i, n in enumerate(sizes_l) if n <= 0)
        raise MooncakeConfigError(f"sizes[{i}] must be > 0 bytes, got {sizes_l[i]}")
    return keys_l, ptrs_l, sizes_l
