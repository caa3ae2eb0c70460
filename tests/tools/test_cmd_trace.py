"""`kvbridge trace`: one request's life through real NIXL engines, as events."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from typing import Any

import pytest

from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, main
from kvbridge.tools.commands.trace import format_trace
from kvbridge.tools.trace import TraceRecorder, capture_connector_logs
from tests.conftest import assert_figures, free_port, ready_line, require, stop_process


@pytest.fixture
def nixl() -> None:
    require("nixl_cu12", "NIXL (nixl-cu12)")


def _trace(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    rc = main(["trace", *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def _kinds(report: dict[str, Any]) -> list[str]:
    return [e["kind"] for e in report["events"]]


def test_pull_trace_shows_the_whole_life(nixl: None, capsys: pytest.CaptureFixture[str]) -> None:
    rc, report = _trace(capsys, "--producer", "tp=2", "--consumer", "tp=1")
    assert rc == EXIT_OK and report["ok"]
    events = report["events"]
    kinds = _kinds(report)
    for kind in ("plan", "route", "handshake", "transfer", "transfer_done", "notif_sent",
                 "notif_received", "lease", "freed", "loaded", "result"):
        assert kind in kinds, kind
    assert [e["t_ms"] for e in events] == sorted(e["t_ms"] for e in events)
    plan = next(e for e in events if e["kind"] == "plan")["detail"]
    assert plan["sources"] == ["tp0/pp0", "tp1/pp0"]
    handshake = next(e for e in events if e["kind"] == "handshake")["detail"]
    # a real exchange (not a cached answer); rtt_ms is printed rounded: well-formed only
    assert handshake["cached"] is False and handshake["attempts"] >= 1
    assert_figures(handshake, ("rtt_ms",))
    assert handshake["metadata_bytes"] > 0 and handshake["ranks"] == 2
    done = [e for e in events if e["kind"] == "transfer_done"]
    assert len(done) == 2 and all(e["detail"]["state"] == "DONE" for e in done)
    moved = sum(e["detail"]["bytes"] for e in done)
    summary = report["summary"]
    assert moved == summary["bytes"] == summary["verified_bytes"] > 0
    assert summary["mismatched_bytes"] == 0 and summary["failures"] == []
    # each producer rank got the consumer's ReadDone, answered it, and freed the blocks
    received = [e for e in events if e["kind"] == "notif_received" and e["side"] == "producer"]
    assert {e["rank"] for e in received if e["detail"]["type"] == "ReadDone"} == {0, 1}
    assert {e["rank"] for e in events if e["kind"] == "freed"} == {0, 1}
    text = format_trace(report)
    assert "READ DONE" in text and "rtt" in text and "-> OK" in text


def test_injected_failure_names_its_cause(nixl: None,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc, report = _trace(capsys, "--inject-failure")
    assert rc == EXIT_FAILURE and not report["ok"]
    failures = [e for e in report["events"] if e["kind"] == "failure"]
    assert failures and "posting failed" in failures[0]["detail"]["reason"]
    assert failures[0]["request_id"] == report["request_id"]
    # the connector's structured failure line, captured from its logger
    logs = [e["detail"]["message"] for e in report["events"] if e["kind"] == "log"]
    assert any("pd load failed" in m and report["request_id"] in m for m in logs)
    result = [e for e in report["events"] if e["kind"] == "result" and e["side"] == "consumer"]
    assert result[0]["detail"]["recomputed_tokens"] > 0  # recomputed, not hung
    assert "freed" in _kinds(report)  # the producer still let go of its blocks


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "--producer", "tp=three"]) == EXIT_USAGE
    assert main(["trace", "--model", "no-such-model"]) == EXIT_USAGE
    assert main(["trace", "--kv-config", "[1]"]) == EXIT_USAGE
    assert main(["trace", "--kv-config", '{"no_such_setting": 1}']) == EXIT_USAGE
    assert main(["trace", "--timeout", "0"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "'three'" in err and "no_such_setting" in err


def test_live_producer(nixl: None, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "kvbridge.tools.cli", "serve", "--role",
                              "producer", "--port", str(port), "--control-port",
                              str(free_port()), "--json"],
                             stdout=subprocess.PIPE, text=True)
    try:
        ready = ready_line(serve)
        rc, report = _trace(capsys, "--producer-addr", ready["side_channel"],
                            "--producer-control-port", ready["control"].rsplit(":", 1)[1])
        assert rc == EXIT_OK and report["ok"]
        assert report["summary"]["live_producer"] == ready["side_channel"]
        assert {"handshake", "transfer_done", "loaded"} <= set(_kinds(report))
        deltas = report["summary"]["producer_counter_deltas"]  # the remote side's counters
        assert deltas["finished_sending"] == 1 and deltas["finished"] == 1
    finally:
        stop_process(serve)


def test_recorder_and_log_capture_are_bounded_and_ordered() -> None:
    now = [0.0]
    recorder = TraceRecorder(clock=lambda: now[0])
    now[0] = 0.002
    recorder.add("consumer", 0, "transfer", "r", bytes=10, request_id="clash-is-fine")
    now[0] = 0.001
    recorder.add("producer", 1, "freed", "r")
    assert [e.kind for e in recorder.snapshot()] == ["freed", "transfer"]
    assert recorder.snapshot()[1].detail == {"bytes": 10, "request_id": "clash-is-fine"}
    with capture_connector_logs(recorder):
        logging.getLogger("kvbridge.connectors.pd.worker").warning("pd load failed: %s", 7)
    logging.getLogger("kvbridge.connectors.pd.worker").warning("after: not captured")
    logs = recorder.of_kind("log")
    assert [e.detail["message"] for e in logs] == ["pd load failed: 7"]


def test_trace_shows_each_checked_blocks_digests(nixl: None,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """TP1 -> TP1 pull: every block is checked; the trace lists each with the producer's
    digest and the landed bytes', equal. TP2 -> TP1 (head slices): each block's two
    halves with each producer rank's slice digest, equal; each block counted once."""
    full = ("--kv-config", '{"verify": "full"}')
    rc, report = _trace(capsys, "--prompt-tokens", "48", *full)
    assert rc == EXIT_OK and report["ok"]
    (verify,) = [e for e in report["events"] if e["kind"] == "verify"]
    blocks = verify["detail"]["blocks"]
    assert len(blocks) == 3 and verify["detail"]["verified"] == 3
    assert all(b["ok"] and b["expected"] == b["actual"] for b in blocks)
    assert len({b["actual"] for b in blocks}) == 3  # three different blocks' bytes
    sent = [e["detail"] for e in report["events"] if e["kind"] == "notif_sent"
            and e["detail"]["type"] == "Held"]
    assert sent and sent[0]["digests"] == 3 and sent[0]["algorithm"] == "xxh3-64"
    assert "3 verified, 0 mismatched" in format_trace(report)
    rc, report = _trace(capsys, "--producer", "tp=2", "--consumer", "tp=1",
                        "--prompt-tokens", "48", *full)
    assert rc == EXIT_OK
    (verify,) = [e for e in report["events"] if e["kind"] == "verify"]
    blocks = verify["detail"]["blocks"]
    assert verify["detail"]["unverified"] == 0 and verify["detail"]["verified"] == 3
    assert sorted(b["producer_rank"] for b in blocks) == [0, 0, 0, 1, 1, 1]
    assert all(b["ok"] and b["slice"] and b["expected"] == b["actual"] for b in blocks)


def test_trace_shows_torch_mix64_digests_when_both_sides_use_them(
        nixl: None, capsys: pytest.CaptureFixture[str]) -> None:
    """The algorithm of GPU-memory ranks (forced here on host memory): the trace's landed
    digests are taken with the algorithm asked of the producer, and equal its answer."""
    extra = ("--kv-config", '{"verify": "full", "verify_algorithms": ["torch-mix64-v1"]}')
    rc, report = _trace(capsys, "--prompt-tokens", "48", *extra)
    assert rc == EXIT_OK and report["ok"]
    (verify,) = [e for e in report["events"] if e["kind"] == "verify"]
    blocks = verify["detail"]["blocks"]
    assert len(blocks) == 3 and all(b["ok"] and b["expected"] == b["actual"] for b in blocks)
    sent = [e["detail"] for e in report["events"] if e["kind"] == "notif_sent"
            and e["detail"]["type"] == "Held"]
    assert sent and sent[0]["algorithm"] == "torch-mix64-v1"
