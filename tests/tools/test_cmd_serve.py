"""`kvbridge serve` as an operator starts it: a bad flag or a size this host cannot hold is a
usage error (exit 2, the field named, no traceback) before anything is allocated; SIGHUP
stops it cleanly unless ignored (``nohup``), and it outlives the shell that started it.

Every serve runs as its own process under an address-space limit, so a regression that
allocates fails here instead of filling the shared machine.
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvbridge.auth import new_secret, resolve_auth
from kvbridge.engine.harness import control_exchange
from tests.conftest import free_port, ready_line, require, stop_process

CLI = [sys.executable, "-m", "kvbridge.tools.cli"]
#: address space of one serve here: a NIXL engine of tiny-gqa needs well under 1 GiB RSS
AS_LIMIT_BYTES = 4 << 30


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT_BYTES, AS_LIMIT_BYTES))


def _serve_usage_error(*args: str, env: dict[str, str] | None = None) -> str:
    """stderr of a ``kvbridge serve`` that must stop at once with exit code 2."""
    port = free_port()
    try:
        proc = subprocess.run([*CLI, "serve", "--port", str(port), *args], capture_output=True,
                              text=True, timeout=240, preexec_fn=_limit_memory,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as exc:  # killed by run()
        raise AssertionError(f"serve {args} kept running: not refused") from exc
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("kvbridge serve: "), proc.stderr
    return proc.stderr


def _spec(path: Path, **region: Any) -> str:
    data = {"model": "m", "regions": [dict({
        "name": "attn", "layout": "split", "layer_ids": [0, 1, 2, 3], "block_size": 16,
        "num_kv_heads": 8, "head_dim": 32, "dtype": "float16"}, **region)]}
    path.write_text(json.dumps(data))
    return str(path)


def test_control_port_equal_to_the_side_channel_port_is_a_usage_error() -> None:
    """Before: the side channel bound the port, the control bind raised EADDRINUSE: a
    traceback, exit 1."""
    port = str(free_port())
    err = _serve_usage_error("--port", port, "--control-port", port)
    assert err.startswith(f"kvbridge serve: control_port: {port} is also the side-channel")


def test_tp_zero_is_refused_not_run_as_tp_1() -> None:
    """Before: ``--tp 0`` became tp=1 (``args.tp or 1``) and the engine served."""
    assert _serve_usage_error("--tp", "0").startswith(
        "kvbridge serve: --tp: expected an integer >= 1, got 0")


@pytest.mark.parametrize(("flags", "field"), [
    # before: libzmq bound a random port instead (port arithmetic overflowed)
    (["--events-endpoint", "tcp://127.0.0.1:99999"], "events_endpoint: "),
    # before: a ZMQError traceback (192.0.2.1 is TEST-NET-1: no address of this host;
    # a bind sends no traffic)
    (["--events-endpoint", "tcp://192.0.2.1:5557"], "events_endpoint: cannot bind"),
    # without a cluster secret a non-loopback replay endpoint is refused before a bind
    (["--events-endpoint", "tcp://127.0.0.1:*", "--events-replay-endpoint",
      "tcp://192.0.2.1:5657"], "events_replay_endpoint: the KV events replay endpoint: "
                               "refusing to listen on 192.0.2.1 without a cluster secret"),
])
@pytest.mark.plaintext
def test_a_bad_events_endpoint_is_a_usage_error(flags: list[str], field: str) -> None:
    assert field in _serve_usage_error(*flags)


def test_an_unbindable_replay_endpoint_with_a_secret_is_a_usage_error(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    new_secret(secret)
    err = _serve_usage_error("--secret-file", str(secret), "--events-endpoint",
                             "tcp://127.0.0.1:*", "--events-replay-endpoint",
                             "tcp://192.0.2.1:5657",
                             env={"KVBRIDGE_SECRET_FILE": str(secret), "KVBRIDGE_SECRET": ""})
    assert "events_replay_endpoint: cannot bind tcp://192.0.2.1:5657" in err


@pytest.mark.plaintext
def test_a_non_loopback_host_without_a_secret_is_refused() -> None:
    err = _serve_usage_error("--host", "192.0.2.1")
    assert "refusing to listen on 192.0.2.1 without a cluster secret" in err
    assert "--insecure-no-auth" in err


def test_a_kv_cache_the_host_cannot_hold_is_refused_before_allocating() -> None:
    """Before: torch allocated until it failed (a traceback; without a limit, until the
    machine ran out)."""
    err = _serve_usage_error("--num-blocks", str(10**8))
    assert err.startswith("kvbridge serve: num_blocks: 100000000 blocks of this model"), err
    assert "GiB of KV memory; this host can give" in err


def test_absurd_model_sizes_are_refused(tmp_path: Path) -> None:
    """Before: block_size 1e9 allocated until the machine ran out; 200k layers likewise."""
    err = _serve_usage_error("--model", _spec(tmp_path / "bs.json", block_size=10**9))
    assert "regions[0].block_size: 1000000000 exceeds kvbridge's limit" in err
    err = _serve_usage_error("--model", _spec(tmp_path / "layers.json",
                                              layer_ids=list(range(200_000))))
    assert "model: " in err and "larger than" in err  # a 1.4 MB spec file


# ---------------------------------------------------------------------------- signals

def _call(port: int, message: dict[str, Any], timeout_s: float = 20) -> Any:
    """One control call, sealed with the environment's cluster secret when there is one."""
    with zmq.Context() as context, context.socket(zmq.REQ) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        sock.connect(f"tcp://127.0.0.1:{port}")
        fields = dict(message)
        return control_exchange(sock, resolve_auth(), fields.pop("op"), fields)


def _state(pid: int) -> str | None:
    """The process's state letter (``Z``: exited, not reaped), or None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _serving_through(pid: int, port: int, seconds: float) -> None:
    """Ask ``info`` for ``seconds``: a wrong exit (serve checks its parent every 0.5 s)
    would show within them. Not a readiness wait: there is nothing to wait for."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert _state(pid) not in (None, "Z"), "serve exited"
        assert _call(port, {"op": "info"})["ok"] is True


def test_sighup_stops_serve_cleanly() -> None:
    """Before: SIGHUP (the terminal closed) killed serve with the default action."""
    require("nixl_cu12", "NIXL (nixl-cu12)")
    control = free_port()
    def terminal_child() -> None:
        # as from a terminal: SIGHUP not ignored, even when this test runs under nohup
        # (serve keeps an inherited SIG_IGN by design: the nohup test below)
        _limit_memory()
        signal.signal(signal.SIGHUP, signal.SIG_DFL)

    proc = subprocess.Popen([*CLI, "serve", "--port", str(free_port()), "--control-port",
                             str(control), "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=terminal_child)
    try:
        assert ready_line(proc)["control"] == f"127.0.0.1:{control}"
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=60) == 0
        assert proc.stderr is not None and "kvbridge serve: stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            stop_process(proc)


def test_nohup_serve_outlives_its_shell_and_ignores_sighup(tmp_path: Path) -> None:
    """Before: serve exited as soon as the shell that started it did (it took its
    parent's death for a harness's)."""
    require("nixl_cu12", "NIXL (nixl-cu12)")
    control = free_port()
    out = tmp_path / "nohup.out"
    command = shlex.join([*CLI, "serve", "--port", str(free_port()), "--control-port",
                          str(control), "--json"])
    # the shell stays until its stdin closes, like an operator's login shell
    shell = subprocess.Popen(["bash", "-c", f"ulimit -v {AS_LIMIT_BYTES >> 10}; "
                              f"nohup {command} > {shlex.quote(str(out))} 2>&1 & "
                              f"echo $!; read _ || true"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert shell.stdout is not None and shell.stdin is not None
    pid = int(shell.stdout.readline())
    try:
        deadline = time.monotonic() + 180
        while '"control"' not in (out.read_text() if out.exists() else ""):
            assert time.monotonic() < deadline, f"no ready line: {out.read_text()[-2000:]}"
            assert _state(pid) not in (None, "Z"), out.read_text()[-2000:]
            time.sleep(0.1)
        assert _call(control, {"op": "info"})["ok"] is True
        assert int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) \
            == shell.pid  # the shell is serve's parent ...
        shell.stdin.close()
        assert shell.wait(timeout=30) == 0  # ... and is gone now
        _serving_through(pid, control, 2.0)
        os.kill(pid, signal.SIGHUP)  # what a closing terminal sends; nohup ignores it
        _serving_through(pid, control, 1.0)
    finally:
        if _state(pid) not in (None, "Z"):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while _state(pid) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.1)
        if _state(pid) not in (None, "Z"):
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("serve did not stop on SIGTERM")
        if shell.poll() is None:
            shell.kill()
            shell.wait(timeout=10)
    assert "kvbridge serve: stopped" in out.read_text()
