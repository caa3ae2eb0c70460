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
  release the GIL; ``setup()`` and ``close()`` hold it, see their docs).
  ``start_batch_put_from``/``start_batch_get_into`` return a
  :class:`PendingBatch` instead of waiting, so a caller can hash, or start
  another batch, while one runs; the deadline is the same;
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

This file owns :class:`MooncakeStoreClient` (the store handle, its buffer
registrations, its counters and each batch call's deadline). Beside it, and
importable from here as before: :mod:`.mooncake_results` (status codes and
per-key results, pure), :mod:`.mooncake_config` (configuration, errors,
argument checks, pure), :mod:`.mooncake_calls` (the binding's import, the
reachability probes and the threads calls run on) and :mod:`.mooncake_batch`
(:class:`PendingBatch`: a batch call in flight, its parts and its deadline). The client looks those
names up here, so a test that replaces ``import_store_class`` or
``tcp_reachable`` in this module replaces what the client calls. Nothing
else of kvbridge is imported (dependency rule of ``backends``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from kvbridge.backends.mooncake.batch import Failed, PendingBatch
from kvbridge.backends.mooncake.calls import Workers as _Workers
from kvbridge.backends.mooncake.calls import http_answers, import_store_class, tcp_reachable
from kvbridge.backends.mooncake.calls import is_loopback as _is_loopback
from kvbridge.backends.mooncake.calls import make_replicate_config as _make_replicate_config
from kvbridge.backends.mooncake.config import (
    SPLIT_MAX_KEY_BYTES,
    SPLIT_MIN_KEYS,
    MooncakeClosedError,
    MooncakeConfig,
    MooncakeConfigError,
    MooncakeError,
    MooncakeSetupError,
    Protocol,
)
from kvbridge.backends.mooncake.config import MiB as MiB
from kvbridge.backends.mooncake.config import MooncakeUnavailable as MooncakeUnavailable
from kvbridge.backends.mooncake.config import check_batch as _check_batch
from kvbridge.backends.mooncake.config import check_keys as _check_keys
from kvbridge.backends.mooncake.config import check_ptr as _check_ptr
from kvbridge.backends.mooncake.results import (
    KeyResult,
    KeyStatus,
    McStatus,
    interpret_exists_batch,
    interpret_get_batch,
    interpret_put_batch,
    interpret_remove,
    uniform,
)
from kvbridge.backends.mooncake.results import interpret_exists as interpret_exists
from kvbridge.backends.mooncake.results import interpret_get as interpret_get
from kvbridge.backends.mooncake.results import interpret_put as interpret_put

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientStats:
    """Counters since setup; a snapshot (see :meth:`MooncakeStoreClient.stats`)."""

    calls: int = 0
    keys: int = 0
    key_errors: int = 0
    timeouts: int = 0
    unreachable: int = 0
    #: batches cut into concurrent calls (``MooncakeConfig.split_calls``), each one ``call``
    cut_batches: int = 0


@dataclass
class _Counters:
    calls: int = 0
    keys: int = 0
    key_errors: int = 0
    timeouts: int = 0
    unreachable: int = 0
    cut_batches: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


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
            return ClientStats(c.calls, c.keys, c.key_errors, c.timeouts, c.unreachable,
                               c.cut_batches)

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
        return self.start_batch_put_from(keys, ptrs, sizes).results()

    def start_batch_put_from(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> PendingBatch:
        """:meth:`batch_put_from` on a worker thread; the caller goes on (the bytes at
        ``ptrs`` must stay unchanged) and collects the results with
        :meth:`PendingBatch.results`, whose deadline is ``op_timeout_s`` from now."""
        keys_l, ptrs_l, sizes_l = _check_batch(keys, ptrs, sizes)
        store, replicate = self._require_store(), self._replicate_config
        return self._start(
            "batch_put_from", len(keys_l),
            lambda s: store.batch_put_from(_part(keys_l, s), _part(ptrs_l, s), _part(sizes_l, s),
                                          replicate),
            lambda raw, s: interpret_put_batch(raw, _part(sizes_l, s)),
            self._split(sizes_l),
        )

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
        return self.start_batch_get_into(keys, ptrs, sizes, exact_size=exact_size).results()

    def start_batch_get_into(
        self,
        keys: Sequence[str],
        ptrs: Sequence[int],
        sizes: Sequence[int],
        *,
        exact_size: bool = True,
    ) -> PendingBatch:
        """:meth:`batch_get_into` on a worker thread; the caller goes on (and may not read
        the destinations) until :meth:`PendingBatch.results`, whose deadline is
        ``op_timeout_s`` from now."""
        keys_l, ptrs_l, sizes_l = _check_batch(keys, ptrs, sizes)
        store = self._require_store()
        return self._start(
            "batch_get_into", len(keys_l),
            lambda s: store.batch_get_into(_part(keys_l, s), _part(ptrs_l, s), _part(sizes_l, s)),
            lambda raw, s: interpret_get_batch(raw, _part(sizes_l, s), exact_size),
            self._split(sizes_l),
        )

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

    def _call(self, op: str, num_keys: int, fn: Callable[[], Any]) -> list[int] | Failed:
        """Run one batch call with the reachability check and the deadline; raw list or uniform failure."""
        return self._start(op, num_keys, lambda _: fn(), None).raw()

    def _split(self, sizes: list[int]) -> list[slice]:
        """How to cut a put or get of keys of ``sizes`` bytes into concurrent calls
        (``MooncakeConfig.split_calls``): many small keys only, where each call's
        per-key work is the cost (4096 x 16 KiB raw, two calls at once against one:
        put 1.7 -> 2.2 GB/s, get 2.6 -> 3.2); keys of 256 KiB and more gained
        nothing (the copy is the cost), so they are never cut."""
        n, parts = len(sizes), min(self.config.split_calls, self.config.num_op_threads)
        if parts <= 1 or n < parts * SPLIT_MIN_KEYS or sum(sizes) > n * SPLIT_MAX_KEY_BYTES:
            return [slice(0, n)]
        bounds = [n * k // parts for k in range(parts + 1)]
        return [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]

    def _start(self, op: str, num_keys: int, fn: Callable[[slice], Any],
               interpret: Callable[[list[int], slice], list[KeyResult]] | None,
               parts: list[slice] | None = None) -> PendingBatch:
        """Submit one batch call (after the reachability check), or one per part of
        ``parts`` (slices of the keys, run at once); the deadline starts now."""
        cfg = self.config
        with self._counters.lock:
            self._counters.calls += 1
            self._counters.keys += num_keys
        if num_keys == 0:
            return PendingBatch(self._collect, self._count, op, 0, [], [], interpret, cfg.op_timeout_s)
        if cfg.check_master_before_ops and not self.is_master_reachable():
            with self._counters.lock:
                self._counters.unreachable += 1
                self._counters.key_errors += num_keys
            logger.warning(
                "mooncake %s of %d keys skipped: master %s unreachable", op, num_keys, cfg.master_address
            )
            return PendingBatch(self._collect, self._count, op, num_keys, [],
                                Failed(uniform(num_keys, McStatus.MASTER_UNREACHABLE)), interpret,
                                cfg.op_timeout_s)
        workers = self._workers
        assert workers is not None
        parts = parts or [slice(0, num_keys)]
        if len(parts) > 1:
            with self._counters.lock:
                self._counters.cut_batches += 1
        return PendingBatch(self._collect, self._count, op, num_keys,
                            [(part, workers.submit(functools.partial(fn, part)))
                             for part in parts], None, interpret, cfg.op_timeout_s)

    def _collect(self, op: str, num_keys: int, fut: Future[Any], deadline: float
                 ) -> list[int] | Failed:
        cfg = self.config
        try:
            raw = fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            with self._counters.lock:
                self._counters.timeouts += 1
                self._counters.key_errors += num_keys
            logger.warning(
                "mooncake %s of %d keys timed out after %.2f s (master %s); call abandoned",
                op, num_keys, cfg.op_timeout_s, cfg.master_address,
            )
            return Failed(uniform(num_keys, McStatus.TIMEOUT))
        except Exception as exc:
            # The binding raises only on argument conversion errors; report them per key.
            logger.warning("mooncake %s of %d keys raised %r", op, num_keys, exc)
            with self._counters.lock:
                self._counters.key_errors += num_keys
            return Failed(uniform(num_keys, McStatus.INTERNAL_ERROR))
        result = list(raw)
        if len(result) != num_keys:
            logger.warning("mooncake %s returned %d results for %d keys", op, len(result), num_keys)
            return Failed(uniform(num_keys, McStatus.INTERNAL_ERROR))
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


def _part(items: list[Any], part: slice) -> list[Any]:
    """``items[part]``, without a copy when the part is all of them (an uncut call)."""
    return items if part.start == 0 and part.stop == len(items) else items[part]
