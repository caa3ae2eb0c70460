"""Reaching the Mooncake store and bounding each call: the binding's import, probes, call threads.

Owns what lets :class:`~kvbridge.backends.mooncake.MooncakeStoreClient` fail
fast instead of blocking: :func:`tcp_reachable` (a ~70 µs connect to the
master's RPC port), :func:`http_answers` (the metadata server, which lives in
the master process, answers, so the master is not stalled),
:func:`import_store_class` (the binding, with install advice when it is
missing) and :class:`Workers`, the few daemon threads a batch call runs on so
that its caller waits at most ``op_timeout_s`` (daemon threads, unlike
``concurrent.futures``' pool, never hold up interpreter exit behind a call
stuck on a dead master).

May not touch: the client's store handle, registrations or counters, and no
Mooncake call is made here except ``ReplicateConfig()`` (the client decides
what runs on the threads). Imports only :mod:`.mooncake_config` of kvbridge.
"""

from __future__ import annotations

import ipaddress
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from kvbridge.backends.mooncake.config import MooncakeUnavailable

T = TypeVar("T")


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


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def make_replicate_config(replica_num: int) -> Any:
    from mooncake.store import ReplicateConfig

    replicate = ReplicateConfig()
    replicate.replica_num = replica_num
    return replicate


class Workers:
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
