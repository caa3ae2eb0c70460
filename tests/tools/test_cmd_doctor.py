"""`kvbridge doctor`: real checks, JSON shape, failure reporting with a fix."""

from __future__ import annotations

import json

import pytest

from kvbridge.tools import cmd_doctor
from kvbridge.tools.cli import main
from tests.conftest import missing_backend


def test_doctor_json_reports_backends_and_connectors(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", "--json", "--timeout", "120"])
    report = json.loads(capsys.readouterr().out)
    names = {c["name"]: c for c in report["checks"]}
    assert {"torch", "zmq", "msgpack", "nixl", "mooncake"} <= set(names)
    assert names["torch"]["ok"] and names["zmq"]["ok"] and names["msgpack"]["ok"]
    assert code == (0 if report["ok"] else 1)
    assert report["ok"] == all(c["ok"] for c in report["checks"] if c["required"])
    connectors = {c["name"]: c for c in report["connectors"]}
    assert connectors["shared_storage"]["loaded"] and connectors["shared_storage"]["usable"]
    assert report["environment"]["UCX_MODULES"]  # kvbridge's default applies
    for backend in ("nixl", "mooncake"):  # exercised for real: a broken one must not pass
        if not names[backend]["ok"]:
            missing_backend(f"doctor's {backend} check failed: {names[backend]}")


def test_failed_probe_names_the_cause() -> None:
    with pytest.raises(RuntimeError, match="exited with 3"):
        cmd_doctor._probe("import sys; print('boom', file=sys.stderr); sys.exit(3)", 30)
    with pytest.raises(RuntimeError, match="killed by a signal"):
        cmd_doctor._probe("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", 30)
    with pytest.raises(RuntimeError, match="no answer within"):
        cmd_doctor._probe("import time; time.sleep(30)", 0.5)


def test_a_failing_required_check_exits_1_with_a_fix(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def broken() -> str:
        raise ImportError("No module named 'zmq'")

    monkeypatch.setattr(cmd_doctor, "check_zmq", broken)
    monkeypatch.setattr(cmd_doctor, "check_nixl", lambda timeout_s: "skipped in this test")
    monkeypatch.setattr(cmd_doctor, "check_mooncake", lambda timeout_s: "skipped in this test")
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] zmq" in out and "pip install 'pyzmq>=25'" in out
