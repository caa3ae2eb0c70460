"""MooncakeMaster: a real mooncake_master process started, probed, killed, restarted, stopped."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from kvbridge.backends.mooncake import MooncakeConfig, MooncakeSetupError, MooncakeStoreClient
from kvbridge.backends.mooncake.master import (
    MasterPorts,
    MooncakeMaster,
    MooncakeMasterError,
    MooncakeMasterNotFound,
    find_master_binary,
    master_command,
    port_accepts,
)
from tests.conftest import require


def _listening_hosts(port: int) -> set[str]:
    """Local addresses with a LISTEN socket on ``port`` (from /proc/net/tcp)."""
    hosts: set[str] = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state = fields[1], fields[3]
        addr_hex, port_hex = local.split(":")
        if state == "0A" and int(port_hex, 16) == port:
            hosts.add(socket.inet_ntoa(bytes.fromhex(addr_hex)[::-1]))
    return hosts


def test_missing_binary_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MooncakeMasterNotFound, match="mooncake-transfer-engine-non-cuda"):
        find_master_binary()


def test_command_binds_loopback_and_turns_the_embedded_metadata_server_off() -> None:
    argv = master_command("mm", MasterPorts(1, 2, 3), lease_ttl_ms=500)
    assert "--rpc_address=127.0.0.1" in argv and "--rpc_port=1" in argv
    # the embedded server binds 0.0.0.0 whatever host it is given: kvbridge serves port 2
    assert "--enable_http_metadata_server=false" in argv
    assert not any(a.startswith("--http_metadata_server") for a in argv)
    assert "--metrics_port=3" in argv
    assert "--metrics_host=127.0.0.1" in argv and "--default_kv_lease_ttl=500" in argv
    with pytest.raises(ValueError, match="lease_ttl_ms"):
        master_command("mm", MasterPorts(1, 2, 3), lease_ttl_ms=0)


def test_start_kill_restart_stop_on_same_ports() -> None:
    require("mooncake.store")
    master = MooncakeMaster(start_timeout_s=20)
    with master:
        ports = master.ports
        assert master.rpc_address == f"127.0.0.1:{ports.rpc_port}"
        assert master.metadata_url == f"http://127.0.0.1:{ports.http_port}/metadata"
        assert master.is_serving()
        assert _listening_hosts(ports.rpc_port) == {"127.0.0.1"}
        assert _listening_hosts(ports.metrics_port) == {"127.0.0.1"}
        # kvbridge's metadata server, not Mooncake's embedded one (which binds 0.0.0.0)
        assert _listening_hosts(ports.http_port) == {"127.0.0.1"}
        assert master.metadata_answers()
        log_path = master.log_path
        assert log_path is not None and "Master service started" in master.log_tail()
        first_pid = master.pid

        assert master.kill() == -9
        assert not master.is_running and not port_accepts("127.0.0.1", ports.rpc_port)

        assert not port_accepts("127.0.0.1", ports.http_port)  # killed with the master

        master.restart()
        assert master.ports == ports and master.pid != first_pid and master.is_serving()
        assert _listening_hosts(ports.http_port) == {"127.0.0.1"}
        metadata_pid = master.metadata_pid
    assert not master.is_running
    assert metadata_pid is not None and not Path(f"/proc/{metadata_pid}").exists()
    assert not port_accepts("127.0.0.1", ports.http_port)
    assert master.stop() == 0  # idempotent, returns the same exit code
    assert not log_path.exists()  # temporary log removed on stop


def test_failed_start_reports_exit_code_and_log() -> None:
    require("mooncake.store")
    master = MooncakeMaster(extra_args=["--no_such_flag_for_kvbridge=1"], start_timeout_s=10)
    with pytest.raises(MooncakeMasterError, match="exited with code"):
        master.start()
    assert not master.is_running
    master.stop()


def test_setup_without_master_fails_fast_instead_of_blocking(
        tcp_port: int, mooncake_setups: list[str]) -> None:
    require("mooncake.store")
    config = MooncakeConfig(f"127.0.0.1:{tcp_port}", f"http://127.0.0.1:{tcp_port}/metadata")
    with pytest.raises(MooncakeSetupError, match="does not accept connections"):
        MooncakeStoreClient.connect(config)
    # refused by the pre-check: Mooncake's own setup() (~90 s here) was never entered
    assert mooncake_setups == []


def test_a_dead_metadata_server_is_a_dead_master_and_restart_brings_both_back() -> None:
    import os
    import signal

    require("mooncake.store")
    with MooncakeMaster() as master:
        ports, first_pid = master.ports, master.pid
        assert master.metadata_pid is not None
        os.kill(master.metadata_pid, signal.SIGKILL)
        for _ in range(600):  # bounded (30 s): until the kernel has delivered it
            if not master.is_running:
                break
            time.sleep(0.05)
        assert not master.is_running and not master.is_serving()
        with pytest.raises(MooncakeMasterError, match="already running"):
            master.start()  # the master process itself still runs
        master.restart()
        assert master.ports == ports and master.pid != first_pid and master.is_serving()
        assert _listening_hosts(ports.http_port) == {"127.0.0.1"}
