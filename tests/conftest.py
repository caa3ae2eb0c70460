"""Shared test helpers for every level.

Backends are real. When one is missing, tests that need it are skipped on a
developer machine but *fail* under ``KVBRIDGE_REQUIRE_BACKENDS=1`` (CI), so a
missing install can never hide behind a skip.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import select
import signal
import socket
import subprocess
import time
from collections.abc import Collection, Iterator
from typing import Any

import pytest

import kvbridge.backends  # noqa: F401  (applies UCX/NIXL/Mooncake env defaults first)

REQUIRE_BACKENDS = os.environ.get("KVBRIDGE_REQUIRE_BACKENDS") == "1"


def require(module: str, what: str | None = None) -> object:
    """Import ``module`` or skip (fail under KVBRIDGE_REQUIRE_BACKENDS=1)."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # ImportError, or a wheel whose shared library fails to load
        message = f"backend {what or module} unavailable: {exc!r}"
        if REQUIRE_BACKENDS:
            pytest.fail(message + " (KVBRIDGE_REQUIRE_BACKENDS=1)", pytrace=False)
        pytest.skip(message)


def missing_backend(message: str) -> None:
    """Skip, or fail under KVBRIDGE_REQUIRE_BACKENDS=1, for a missing capability."""
    if REQUIRE_BACKENDS:
        pytest.fail(message + " (KVBRIDGE_REQUIRE_BACKENDS=1)", pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, outside the kernel's
    ephemeral range (see :func:`free_port_run`: nothing takes it by chance meanwhile)."""
    return free_port_run(1)


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux default 32768-60999)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port_run(count: int, taken: Collection[int] = ()) -> int:
    """The first of ``count`` consecutive TCP ports on 127.0.0.1 that were all free a
    moment ago, none in ``taken``, all outside the kernel's ephemeral range: for a
    process that binds ``port + index`` per engine later on. A port inside that range
    can be taken meanwhile by any outgoing connection, even a ZeroMQ socket's retries
    to that very port (a TCP connect to a local port nobody listens on can connect to
    itself and then holds the port): a test that connects before the engines bind
    failed that way in CI with "Address already in use"."""
    low, high = _ephemeral_range()
    # from 20000: Mooncake's transfer engine picks its RPC ports at random below that
    candidates = [start for start in range(20000, 65536 - count, count + 1)
                  if start + count - 1 < low or start > high]
    avoid = set(taken)
    rng = random.Random()
    for _ in range(200):
        start = rng.choice(candidates)
        if avoid & set(range(start - 1, start + count + 1)):
            continue
        socks = []
        try:
            for port in range(start, start + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
        return start
    raise AssertionError(f"no {count} consecutive free ports outside {low}-{high}")


def ready_line(proc: subprocess.Popen[str], timeout_s: float = 120) -> dict[str, Any]:
    """A served process's JSON ready line on stdout, waited for at most ``timeout_s``."""
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert readable, f"no ready line within {timeout_s} s (exit code {proc.poll()})"
    ready: dict[str, Any] = json.loads(proc.stdout.readline())
    return ready


def stop_process(proc: subprocess.Popen[str]) -> int:
    """SIGTERM, bounded; killed if it does not exit (never left running)."""
    proc.terminate()
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
        raise


def sigstop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait (bounded) until the kernel shows it stopped."""
    os.kill(pid, signal.SIGSTOP)
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")


def plaintext_env() -> dict[str, str]:
    """This environment without a cluster secret: for a process a ``plaintext`` test
    starts from a fixture wider than the test (the autouse fixture below runs later)."""
    return {k: v for k, v in os.environ.items()
            if k not in ("KVBRIDGE_SECRET", "KVBRIDGE_SECRET_FILE")}


@pytest.fixture(autouse=True)
def _plaintext_without_secret(request: pytest.FixtureRequest,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``plaintext`` test drives a socket's own protocol (raw frames, vLLM's replay),
    which a cluster secret seals: it and the engines it starts run without one, also
    when ``make test-auth`` configures one for everything else."""
    if request.node.get_closest_marker("plaintext") is not None:
        monkeypatch.delenv("KVBRIDGE_SECRET", raising=False)
        monkeypatch.delenv("KVBRIDGE_SECRET_FILE", raising=False)


@pytest.fixture
def tcp_port() -> Iterator[int]:
    yield free_port()


# ---- Mooncake (section owned by the Mooncake backend; append-only) ------------------
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    from kvbridge.backends.mooncake.master import MooncakeMaster


def _start_mooncake_master(log_dir: object) -> MooncakeMaster:
    """Start a real mooncake_master on 127.0.0.1, or skip/fail when Mooncake is missing."""
    require("mooncake.store", "Mooncake (mooncake-transfer-engine-non-cuda)")
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    from kvbridge.backends.mooncake.master import MooncakeMaster, MooncakeMasterNotFound  # noqa: F811

    master = MooncakeMaster(log_path=os.path.join(str(log_dir), "mooncake_master.log"))
    try:
        master.start()
    except MooncakeMasterNotFound as exc:
        missing_backend(str(exc))
    return master


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """One mooncake_master for the whole run (``.rpc_address``, ``.metadata_url``).

    Shared: never kill or restart it (use ``mooncake_master_fresh``), and
    namespace your keys so tests cannot see each other's objects.
    """
    master = _start_mooncake_master(tmp_path_factory.mktemp("mooncake_master"))
    yield master
    master.stop()


@pytest.fixture
def mooncake_master_fresh(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A mooncake_master of this test's own, free to ``kill()`` and ``restart()``."""
    master = _start_mooncake_master(tmp_path)
    yield master
    master.stop()


# ---- Loopback only (review) ------------------------------------------------------------
# UCX's TCP transport listens on every interface unless told otherwise, so each NIXL
# agent a test creates would accept connections on the machine's LAN address. Tests keep
# it on loopback (inherited by every engine/CLI subprocess); the netns test, whose
# processes talk over veth interfaces, overrides it for its own subprocesses.
os.environ.setdefault("UCX_NET_DEVICES", "lo")


# ---- Outcomes, not timings (review) ----------------------------------------------------
# The default suite asserts no speed, latency or ratio: on a loaded 2-core box any figure
# can be tiny (a rounded latency reads 0.0). `kvbridge bench` reports them; a test of a
# bench checks that it ran, moved verified bytes and printed well-formed figures.
def assert_figures(row: dict[str, Any], keys: tuple[str, ...] | list[str]) -> None:
    """Each ``row[key]`` is a finite, non-negative number (no claim about its size)."""
    import math

    for key in keys:
        value = row[key]
        assert isinstance(value, (int, float)) and not isinstance(value, bool), (key, value)
        assert math.isfinite(value) and value >= 0, (key, value)


@pytest.fixture
def mooncake_setups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Counts how often ``MooncakeStoreClient.setup`` went past its pre-checks to
    Mooncake's own ``setup()`` (it fetches the real store class just before): a client
    that fails fast never gets there. Those pre-checks exist because Mooncake's
    ``setup()`` blocks ~90 s, GIL held, against an absent or stalled master.
    """
    from kvbridge.backends import mooncake

    real = mooncake.import_store_class
    entered: list[str] = []

    def counted() -> Any:
        entered.append("setup")
        return real()

    monkeypatch.setattr(mooncake, "import_store_class", counted)
    return entered


# ---- forged peer claims (hostile-input tests) ----------------------------------------
def forged_topology(**sizes: int) -> Any:
    """A ParallelTopology past kvbridge's bounds (kvbridge.layouts.limits), built without
    its checks: what a hostile peer can put on the wire. Only tests forge one."""
    import dataclasses

    from kvbridge.layouts import ParallelTopology

    topology = object.__new__(ParallelTopology)
    for field in dataclasses.fields(ParallelTopology):
        object.__setattr__(topology, field.name, sizes.get(field.name, field.default))
    return topology
