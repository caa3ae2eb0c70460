"""Start and stop a local ``mooncake_master`` with an HTTP metadata server bound where asked.

The master is the Mooncake store's control plane: it allocates space in the
clients' segments and keeps the key -> replica map. The HTTP metadata server
is what clients use to find each other's transfer endpoints, so the pair is a
complete store for tests, the CLI and demos.

Facts this module is built around (measured: docs/backends.md, "Mooncake store"):

- The RPC port accepts about 1.1 s after start; that is the readiness signal
  (a client's ``setup()`` against a master that is not listening blocks ~90 s).
- ``--rpc_address`` and ``--metrics_host`` are honoured, but the master's
  *embedded* HTTP metadata server listens on **0.0.0.0** whatever
  ``--http_metadata_server_host`` says. So the master is started with
  ``--enable_http_metadata_server=false`` and kvbridge serves the same protocol
  (:mod:`kvbridge.backends.mooncake.metadata`) from a child process bound to
  exactly :attr:`MooncakeMaster.host`; with the embedded server off the master
  listens on its RPC and metrics ports only, both on that host.
- The metadata server is a *child process*, not a thread of the owner: a
  Mooncake client's ``setup()`` holds the GIL while libcurl talks to the
  metadata server, so a client in the same process as an in-thread server
  deadlocks (measured: ``setup()`` never returned). As a process it also dies,
  pauses and restarts with the master (:meth:`kill`, :meth:`pause`,
  :meth:`restart`), as the embedded server did.
- A killed and restarted master has lost every key (and, like the embedded
  server, so has the metadata server); clients re-mount their segments by
  themselves within about a second.

Invariants: every process this class starts is reaped by :meth:`stop` or
:meth:`kill` (also on ``__exit__``); every wait is bounded; ports are chosen
on :attr:`~MooncakeMaster.host` and kept across :meth:`restart` so clients can
reconnect. The metadata port is bound by this process before the metadata
child starts (it inherits the socket), so it never listens anywhere else.

This file owns :class:`MooncakeMaster` (the two child processes: starting,
readiness, signals, reaping, logs), the argv of each (:func:`master_command`,
:func:`metadata_command`), :func:`find_master_binary` and
:func:`master_endpoint`. Beside it, importable from here as before:
:mod:`.mooncake_ports` (the host check, URL form, port picking and probing)
and :mod:`.mooncake_exposure` (where a store's ports listen, for ``kvbridge
doctor``). It may not serve metadata itself (:mod:`.mooncake_metadata` does,
in its own process) nor import anything of kvbridge beyond ``backends``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import http.client
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

from kvbridge.backends.mooncake.exposure import WILDCARDS as WILDCARDS
from kvbridge.backends.mooncake.exposure import PortExposure as PortExposure
from kvbridge.backends.mooncake.exposure import listening_addresses as listening_addresses
from kvbridge.backends.mooncake.exposure import local_addresses as local_addresses
from kvbridge.backends.mooncake.exposure import master_exposure as master_exposure
from kvbridge.backends.mooncake.exposure import port_exposure as port_exposure
from kvbridge.backends.mooncake.metadata import MetadataLimits, bind_listener
from kvbridge.backends.mooncake.ports import (
    LOOPBACK,
    MasterPorts,
    check_host,
    port_accepts,
    url_host,
)
from kvbridge.backends.mooncake.ports import pick_free_port as pick_free_port

logger = logging.getLogger(__name__)

MASTER_BINARY = "mooncake_master"
INSTALL_HINT = (
    "install the Mooncake wheel into this environment: "
    "`pip install mooncake-transfer-engine-non-cuda` on machines without a GPU driver "
    "(or `mooncake-transfer-engine` where libcuda.so.1 exists); it ships `mooncake_master` "
    "and needs the Debian packages libibverbs1 librdmacm1 libnuma1 libcurl4"
)
# Only ports we picked ourselves are re-picked when the master fails to bind them
# (another process may grab a "free" port between our probe and the master's bind).
_PORT_PICK_ATTEMPTS = 3


class MooncakeMasterError(RuntimeError):
    """The master could not be found, started, or stopped as asked."""


class MooncakeMasterNotFound(MooncakeMasterError):
    """No ``mooncake_master`` executable was found."""


def find_master_binary() -> str:
    """Path of ``mooncake_master``: the venv's ``bin/`` next to ``sys.executable``, then PATH.

    The venv entry is a small Python shim that ``execv``s the real binary (so the
    PID we hold is the master's). Raises :class:`MooncakeMasterNotFound` with
    install instructions when neither exists.
    """
    candidate = Path(sys.executable).parent / MASTER_BINARY
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(MASTER_BINARY)
    if found:
        return found
    raise MooncakeMasterNotFound(
        f"`{MASTER_BINARY}` not found next to {sys.executable} nor on PATH; {INSTALL_HINT}"
    )


def master_command(
    binary: str,
    ports: MasterPorts,
    *,
    host: str = LOOPBACK,
    lease_ttl_ms: int | None = None,
    rpc_threads: int | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The argv that starts a master on ``host``, its embedded metadata server off.

    ``ports.http_port`` is not the master's: kvbridge's own metadata server
    (:func:`metadata_command`) serves it, because the embedded one binds 0.0.0.0.
    """
    argv = [
        binary,
        f"--rpc_address={host}",
        f"--rpc_port={ports.rpc_port}",
        "--enable_http_metadata_server=false",
        f"--metrics_host={host}",
        f"--metrics_port={ports.metrics_port}",
        "--logtostderr=true",
    ]
    if lease_ttl_ms is not None:
        if lease_ttl_ms <= 0:
            raise ValueError(f"lease_ttl_ms must be > 0 milliseconds, got {lease_ttl_ms}")
        argv.append(f"--default_kv_lease_ttl={lease_ttl_ms}")
    if rpc_threads is not None:
        if rpc_threads <= 0:
            raise ValueError(f"rpc_threads must be > 0, got {rpc_threads}")
        argv.append(f"--rpc_thread_num={rpc_threads}")
    argv.extend(extra_args)
    return argv


def metadata_command(fd: int, limits: MetadataLimits) -> list[str]:
    """The argv of the metadata child serving the inherited listening socket ``fd``.

    ``-I`` (isolated: no PYTHON* variables, no user site, and since 3.11 no script
    directory on ``sys.path``, which would put ``backends/mooncake/__init__.py`` in front of
    the real ``mooncake``): the module needs the standard library only.
    """
    script = Path(__file__).with_name("metadata.py")
    return [sys.executable, "-I", str(script), f"--fd={fd}", *limits.argv()]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    # PR_SET_PDEATHSIG survives execve: the master gets SIGTERM if the thread that
    # started it dies, so a crashed test run cannot leave masters behind.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


class MooncakeMaster:
    """A ``mooncake_master`` and kvbridge's metadata server, two child processes; a context manager.

    >>> with MooncakeMaster() as master:            # doctest: +SKIP
    ...     cfg = MooncakeConfig(master.rpc_address, master.metadata_url)

    Every port listens on ``host`` only (default 127.0.0.1; an IP literal of this
    machine). Ports left as ``None`` are picked free on ``host`` (and re-picked if
    one cannot be bound at first start); they stay fixed across :meth:`restart`.
    ``metadata_limits`` bounds the metadata server (key and value sizes, total
    bytes, keys, connections, request timeout). Logs of both processes (the
    master's in glog format, the metadata server's lines tagged
    ``kvbridge-metadata``) go to ``log_path``, or to a temporary file deleted by
    :meth:`stop` unless ``keep_log``.

    ``die_with_parent`` (Linux) makes the master receive SIGTERM when the
    *thread* that started it exits, so start it from a long-lived thread
    (pytest's and the CLI's main thread are) or pass ``False``.
    """

    def __init__(
        self,
        *,
        host: str = LOOPBACK,
        rpc_port: int | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        keep_log: bool = False,
        start_timeout_s: float = 20.0,
        stop_timeout_s: float = 5.0,
        lease_ttl_ms: int | None = None,
        rpc_threads: int | None = 2,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        die_with_parent: bool = True,
        metadata_limits: MetadataLimits | None = None,
    ) -> None:
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be > 0 seconds, got {start_timeout_s}")
        if stop_timeout_s <= 0:
            raise ValueError(f"stop_timeout_s must be > 0 seconds, got {stop_timeout_s}")
        self._host = check_host(host)
        self._metadata_limits = metadata_limits or MetadataLimits()
        self._fixed_ports = (rpc_port, http_port, metrics_port)
        self._ports: MasterPorts | None = None
        if all(p is not None for p in self._fixed_ports):
            assert rpc_port is not None and http_port is not None and metrics_port is not None
            self._ports = MasterPorts(rpc_port, http_port, metrics_port)
        self._user_log_path = Path(log_path) if log_path is not None else None
        self._keep_log = keep_log or log_path is not None
        self._log_path: Path | None = self._user_log_path
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self._lease_ttl_ms = lease_ttl_ms
        self._rpc_threads = rpc_threads
        self._extra_args = tuple(extra_args)
        self._binary = binary
        self._die_with_parent = die_with_parent
        self._proc: subprocess.Popen[bytes] | None = None
        self._metadata_proc: subprocess.Popen[bytes] | None = None
        self._log_file: BinaryIO | None = None

    # ---- addresses -------------------------------------------------------------
    @property
    def host(self) -> str:
        """The one address every port of this master listens on."""
        return self._host

    @property
    def metadata_limits(self) -> MetadataLimits:
        return self._metadata_limits

    @property
    def ports(self) -> MasterPorts:
        if self._ports is None:
            raise MooncakeMasterError("ports are chosen at start(); start the master first")
        return self._ports

    @property
    def rpc_port(self) -> int:
        return self.ports.rpc_port

    @property
    def http_port(self) -> int:
        return self.ports.http_port

    @property
    def metrics_port(self) -> int:
        return self.ports.metrics_port

    @property
    def rpc_address(self) -> str:
        """``host:port`` of the master RPC service (a client's ``master_server_addr``)."""
        return f"{url_host(self.host)}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """URL of the HTTP metadata server (a client's ``metadata_server``)."""
        return f"http://{url_host(self.host)}:{self.http_port}/metadata"

    @property
    def metrics_url(self) -> str:
        return f"http://{url_host(self.host)}:{self.metrics_port}/metrics"

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def metadata_pid(self) -> int | None:
        """PID of kvbridge's metadata server process."""
        return self._metadata_proc.pid if self._metadata_proc is not None else None

    @property
    def is_running(self) -> bool:
        """Both processes (master and metadata server) are alive."""
        return all(p is not None and p.poll() is None for p in (self._proc, self._metadata_proc))

    def is_serving(self, timeout_s: float = 0.2) -> bool:
        """True when both processes run, the RPC port accepts and the metadata server answers."""
        return (self.is_running and port_accepts(self.host, self.rpc_port, timeout_s)
                and self.metadata_answers(timeout_s))

    def metadata_answers(self, timeout_s: float = 0.5) -> bool:
        """True when the metadata server answers a GET of a key nobody stores with 404."""
        conn = http.client.HTTPConnection(self.host, self.http_port, timeout=timeout_s)
        try:
            conn.request("GET", "/metadata?key=kvbridge%2Fprobe%2Fnone")
            return conn.getresponse().status == 404
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def log_tail(self, max_bytes: int = 4000) -> str:
        """The end of the master's log, for error messages and debugging."""
        if self._log_path is None or not self._log_path.exists():
            return ""
        with open(self._log_path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            return fh.read().decode("utf-8", "replace")

    # ---- lifecycle -------------------------------------------------------------
    def start(self) -> MooncakeMaster:
        """Start the master and wait (bounded by ``start_timeout_s``) until its RPC port accepts."""
        if self._any_alive():
            raise MooncakeMasterError(f"master already running (pid {self.pid}, metadata "
                                      f"server pid {self.metadata_pid}); stop() it first")
        binary = self._binary or find_master_binary()
        may_repick = any(p is None for p in self._fixed_ports) and self._ports is None
        attempts = _PORT_PICK_ATTEMPTS if may_repick else 1
        last_error: MooncakeMasterError | None = None
        for _ in range(attempts):
            if self._ports is None or may_repick:
                self._ports = self._choose_ports()
            try:
                self._spawn(binary)
                self._wait_ready()
                logger.info(
                    "mooncake_master pid %s serving rpc=%s metadata=%s log=%s",
                    self.pid, self.rpc_address, self.metadata_url, self._log_path,
                )
                return self
            except MooncakeMasterError as exc:
                last_error = exc
                self._reap(force=True)
        assert last_error is not None
        raise last_error

    def stop(self) -> int | None:
        """SIGTERM, wait up to ``stop_timeout_s``, then SIGKILL; returns the exit code (None if never started).

        Idempotent. Deletes the temporary log unless ``keep_log`` or a ``log_path`` was given.
        """
        rc = self._reap(force=False)
        self._close_log()
        if not self._keep_log and self._log_path is not None:
            with contextlib.suppress(OSError):
                self._log_path.unlink()
            self._log_path = None
        return rc

    def kill(self) -> int | None:
        """SIGKILL the master and the metadata server now (fault injection).

        Keeps ports and log for :meth:`restart`; the metadata, like the master's
        keys, is lost (as with the embedded server, which died with the master).
        Returns the master's exit code.
        """
        return self._reap(force=True)

    def pause(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP the master and wait until it is stopped (fault injection).

        Both processes stop (the embedded metadata server stopped with the
        master). A paused master's ports still accept TCP connections (the kernel
        does that), but nothing answers. ``kill()`` returns before the target
        stops, so this waits (bounded) for /proc to report the stopped state.
        """
        self._signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        for pid in (self.pid, self.metadata_pid):
            stat_path = Path(f"/proc/{pid}/stat")
            while True:
                try:
                    # Field 3 of /proc/PID/stat, after the parenthesised command name.
                    state = stat_path.read_text().rsplit(")", 1)[1].split()[0]
                except (OSError, IndexError):
                    return  # not Linux-like /proc: best effort
                if state in ("T", "t"):
                    break
                if time.monotonic() >= deadline:
                    raise MooncakeMasterError(f"pid {pid} did not stop within {timeout_s} s")
                time.sleep(0.005)

    def resume(self) -> None:
        """SIGCONT a paused master (and its metadata server)."""
        self._signal(signal.SIGCONT)

    def _signal(self, sig: signal.Signals) -> None:
        if not self.is_running:
            raise MooncakeMasterError(f"master is not running; cannot send {sig.name}")
        assert self._proc is not None and self._metadata_proc is not None
        self._proc.send_signal(sig)
        self._metadata_proc.send_signal(sig)

    def restart(self) -> MooncakeMaster:
        """Stop (if running) and start again on the same ports. The new master has no keys.

        Both processes are stopped first, also when only one of them died.
        """
        self._reap(force=False)
        binary = self._binary or find_master_binary()
        self._spawn(binary)
        try:
            self._wait_ready()
        except MooncakeMasterError:
            self._reap(force=True)
            raise
        return self

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.rpc_address if self._ports is not None else "unstarted"
        return f"MooncakeMaster({where}, pid={self.pid}, running={self.is_running})"

    # ---- internals -------------------------------------------------------------
    def _any_alive(self) -> bool:
        return any(p is not None and p.poll() is None for p in (self._proc, self._metadata_proc))

    def _choose_ports(self) -> MasterPorts:
        picked = MasterPorts.pick(self.host)  # on host: a port free on 127.0.0.1 may not be on it
        rpc, http, metrics = self._fixed_ports
        return MasterPorts(
            rpc_port=rpc if rpc is not None else picked.rpc_port,
            http_port=http if http is not None else picked.http_port,
            metrics_port=metrics if metrics is not None else picked.metrics_port,
        )

    def _open_log(self) -> BinaryIO:
        if self._log_path is None:
            fd, name = tempfile.mkstemp(prefix="mooncake_master-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
        self._close_log()
        self._log_file = open(self._log_path, "ab")  # noqa: SIM115  (lives as long as the process)
        return self._log_file

    def _close_log(self) -> None:
        if self._log_file is not None:
            with contextlib.suppress(OSError):
                self._log_file.close()
            self._log_file = None

    def _spawn(self, binary: str) -> None:
        log_file = self._open_log()
        try:
            listener = bind_listener(self.host, self.http_port)
        except OSError as exc:
            reason = "in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise MooncakeMasterError(
                f"cannot listen on {url_host(self.host)}:{self.http_port} for the metadata "
                f"server ({reason})") from None
        try:
            self._metadata_proc = subprocess.Popen(
                metadata_command(listener.fileno(), self._metadata_limits),
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                pass_fds=(listener.fileno(),), start_new_session=True,
                preexec_fn=_die_with_parent if self._die_with_parent else None,
            )
        finally:
            listener.close()  # the child holds it now; the port lives and dies with the child
        argv = master_command(
            binary,
            self.ports,
            host=self.host,
            lease_ttl_ms=self._lease_ttl_ms,
            rpc_threads=self._rpc_threads,
            extra_args=self._extra_args,
        )
        logger.debug("starting %s", " ".join(argv))
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                # Its own session: a terminal's Ctrl-C reaches only us, and we stop it cleanly.
                start_new_session=True,
                preexec_fn=_die_with_parent if self._die_with_parent else None,
            )
        except OSError as exc:
            self._reap_one(self._metadata_proc, "the metadata server", force=True)
            raise MooncakeMasterError(f"cannot run {binary}: {exc}") from exc

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        assert self._proc is not None and self._metadata_proc is not None
        while True:
            for name, proc in (("mooncake_master", self._proc),
                               ("the metadata server", self._metadata_proc)):
                rc = proc.poll()
                if rc is not None:
                    raise MooncakeMasterError(
                        f"{name} exited with code {rc} during start "
                        f"(rpc {self.rpc_address}, metadata {self.metadata_url}); "
                        f"log {self._log_path}:\n{self.log_tail()}"
                    )
            if (port_accepts(self.host, self.rpc_port, timeout_s=0.2)
                    and self.metadata_answers(timeout_s=1.0)):
                return
            if time.monotonic() >= deadline:
                raise MooncakeMasterError(
                    f"mooncake_master did not accept on {self.rpc_address} (or the metadata "
                    f"server did not answer on {self.metadata_url}) within "
                    f"{self.start_timeout_s:.1f} s; log {self._log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _reap(self, *, force: bool) -> int | None:
        """Stop both processes; the master's exit code (None if never started)."""
        metadata = self._metadata_proc
        if metadata is not None:
            self._reap_one(metadata, "the metadata server", force=force)
        proc = self._proc
        if proc is None:
            return None
        return self._reap_one(proc, "mooncake_master", force=force)

    def _reap_one(self, proc: subprocess.Popen[bytes], name: str, *, force: bool) -> int | None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if force:
                    proc.kill()
                else:
                    proc.terminate()
                    proc.send_signal(signal.SIGCONT)  # a paused master must run to exit
            try:
                proc.wait(timeout=self.stop_timeout_s if not force else 5.0)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "%s pid %s ignored SIGTERM for %.1f s; sending SIGKILL",
                    name, proc.pid, self.stop_timeout_s,
                )
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(timeout=5.0)
        return proc.returncode


@contextlib.contextmanager
def master_endpoint(master_address: str | None, metadata_server: str | None,
                    ) -> Iterator[tuple[str, str, bool]]:
    """``(rpc address, metadata URL, started here)`` of a store to use for a run.

    A given ``master_address`` is used as it is (then ``metadata_server`` is
    required: a remote master's metadata URL cannot be guessed); without one a
    local :class:`MooncakeMaster` is started and stopped when the block exits.
    """
    if master_address is not None:
        if metadata_server is None:
            raise ValueError("metadata_server is required when master_address is given")
        yield master_address, metadata_server, False
        return
    with MooncakeMaster() as master:
        yield master.rpc_address, master.metadata_url, True
