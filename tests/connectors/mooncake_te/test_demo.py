"""`kvbridge demo --connector mooncake_te`: the PD core over Mooncake's transfer engine,
producer and consumer in separate processes, every moved byte verified."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvbridge.tools.cli import main
from kvbridge.tools.commands.demo import demo_modules
from tests.conftest import require

KVBRIDGE = [sys.executable, "-m", "kvbridge.tools.cli"]


@pytest.fixture(autouse=True)
def _te() -> None:
    require("mooncake.engine", "Mooncake (mooncake-transfer-engine-non-cuda)")


@pytest.mark.parametrize(("mode", "producer", "consumer"),
                         [("pull", "tp=1", "tp=2"), ("push", "tp=2", "tp=1")])
def test_demo_moves_and_verifies_every_byte(mode: str, producer: str, consumer: str) -> None:
    proc = subprocess.run([*KVBRIDGE, "demo", "--connector", "mooncake_te", "--mode", mode,
                           "--requests", "4", "--producer", producer, "--consumer", consumer,
                           "--json"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    assert summary["connector"] == "mooncake_te" and summary["mode"] == mode
    assert summary["requests"] == 4 and summary["failed_requests"] == 0
    assert summary["mismatched_bytes"] == 0
    assert summary["verified_bytes"] == summary["bytes"] > 0


def test_settings_it_cannot_honour_are_usage_errors() -> None:
    assert "mooncake_te" in demo_modules()
    assert main(["demo", "--connector", "mooncake_te", "--kv-config", '{"lanes": 2}']) == 2
    assert main(["demo", "--connector", "mooncake_te", "--kv-config", '{"nope": 1}']) == 2
