"""`kvbridge demo --connector mooncake`: two engine processes through one store."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvbridge.backends.mooncake.master import MooncakeMaster
from kvbridge.tools.cli import main


def test_demo_through_the_store(mooncake_master: MooncakeMaster,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """Two engine processes, the shared master given with --master/--metadata."""
    rc = main(["demo", "--connector", "mooncake", "--master", mooncake_master.rpc_address,
               "--metadata", mooncake_master.metadata_url, "--requests", "4",
               "--model", "tiny-mla", "--producer", "tp=2", "--consumer", "tp=2",
               "--kv-config", json.dumps({"global_segment_size": 16 << 20,
                                          "local_buffer_size": 4 << 20}),
               "--timeout", "120", "--json"])
    summary: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert rc == 0, summary
    assert summary["connector"] == "mooncake" and summary["requests"] == 4
    assert summary["failed_requests"] == 0 and summary["mismatched_bytes"] == 0
    assert summary["external_tokens"] > 0 and summary["verified_bytes"] > 0
    assert summary["bytes"] > 0 and summary["put_bytes"] > 0 and summary["load_errors"] == 0
    assert summary["idle_problems"] == {"producer": [], "consumer": []}


def test_demo_rejects_metadata_without_master(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--connector", "mooncake", "--metadata", "http://127.0.0.1:1/metadata"])
    assert rc == 2
    assert "--metadata needs --master" in capsys.readouterr().err
