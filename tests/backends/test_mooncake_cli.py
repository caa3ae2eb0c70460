"""`kvbridge mooncake master|bench` end to end (real mooncake_master, real store)."""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import subprocess
import sys

import pytest

from kvbridge.backends.mooncake.master import listening_addresses, port_accepts
from kvbridge.tools.cli import EXIT_OK, EXIT_USAGE, main
from kvbridge.tools.commands.mooncake import parse_pattern
from tests.conftest import assert_figures, require


def test_parse_pattern_units_and_errors() -> None:
    assert parse_pattern("64x2MiB") == (64, 2 << 20)
    assert parse_pattern("4096 x 16KiB") == (4096, 16 << 10)
    assert parse_pattern("3x100") == (3, 100)
    for bad in ("64", "0x2MiB", "64x2PB", "x"):
        with pytest.raises(ValueError, match="pattern"):
            parse_pattern(bad)


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mooncake", "bench", "--pattern", "3y4"]) == EXIT_USAGE
    assert main(["mooncake", "bench", "--master", "127.0.0.1:1"]) == EXIT_USAGE
    assert main(["mooncake", "master", "--port", "70000"]) == EXIT_USAGE
    assert main(["mooncake"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "64x2MiB" in err and "--master and --metadata" in err and "1..65535" in err
    assert main(["mooncake", "master", "--host", "localhost"]) == EXIT_USAGE
    assert main(["mooncake", "master", "--metadata-only", "--host", "203.0.113.77"]) == EXIT_USAGE
    assert main(["mooncake", "master", "--metadata-only", "--port", "5"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "must be an IP address" in err and "cannot be bound on this machine" in err
    assert "--port mean nothing with --metadata-only" in err


def test_master_command_serves_until_interrupted() -> None:
    require("mooncake.store")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.tools.cli", "mooncake", "master", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "no address line within 30 s"
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        host, port = info["rpc_address"].rsplit(":", 1)
        assert host == "127.0.0.1" and port_accepts(host, int(port))
        assert info["metadata_url"].startswith("http://127.0.0.1:") and info["host"] == "127.0.0.1"
        http_port = int(info["metadata_url"].split(":")[2].split("/")[0])
        assert listening_addresses(http_port) == ["127.0.0.1"]  # not Mooncake's 0.0.0.0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == EXIT_OK
        assert not port_accepts(host, int(port))  # the master went with it
        assert not port_accepts(host, http_port)  # and its metadata server
        for pid in info["pid"], info["metadata_pid"]:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_metadata_only_serves_the_protocol_on_its_host_until_interrupted() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge.tools.cli", "mooncake", "master", "--metadata-only",
         "--max-value-bytes", "100", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "no URL line within 30 s"
        assert proc.stdout is not None
        url = json.loads(proc.stdout.readline())["metadata_url"]
        port = int(url.split(":")[2].split("/")[0])
        assert url == f"http://127.0.0.1:{port}/metadata"
        assert listening_addresses(port) == ["127.0.0.1"]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("PUT", "/metadata?key=a", body=b"x" * 100)
        assert conn.getresponse().read() == b"metadata updated"
        conn.request("PUT", "/metadata?key=b", body=b"x" * 101)
        assert conn.getresponse().status == 413
        conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/metadata?key=a")
        assert conn.getresponse().read() == b"x" * 100
        conn.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == EXIT_OK
        assert not port_accepts("127.0.0.1", port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_bench_command_reports_ratios_and_verifies_bytes(
    mooncake_master: object, capsys: pytest.CaptureFixture[str]
) -> None:
    require("torch")
    rpc = mooncake_master.rpc_address  # type: ignore[attr-defined]
    meta = mooncake_master.metadata_url  # type: ignore[attr-defined]
    rc = main(["mooncake", "bench", "--pattern", "8x64KiB", "--pattern", "64x4KiB", "--rounds", "1",
               "--master", rpc, "--metadata", meta, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == EXIT_OK
    assert [(p["num_blocks"], p["block_bytes"]) for p in report["patterns"]] == [(8, 65536), (64, 4096)]
    for p in report["patterns"]:
        assert p["verified"] and p["failed_rounds"] == {"raw": 0, "client": 0}
        for side in ("raw", "client"):  # well-formed figures, no claim about their size
            assert_figures(p[side], ("put_gbps", "get_gbps"))
        assert {"put", "get", "put_best", "get_best"} <= set(p["ratio"])
        assert_figures(p["ratio"], list(p["ratio"]))
