"""`kvbridge demo`, `kvbridge serve` and `kvbridge bench nixl` as an operator runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvbridge.tools.commands.bench import parse_pattern
from kvbridge.tools.commands.demo import demo_modules
from tests.conftest import assert_figures, free_port, ready_line, require, stop_process

KVBRIDGE = [sys.executable, "-m", "kvbridge.tools.cli"]


@pytest.fixture(autouse=True)
def _nixl() -> None:
    require("nixl_cu12", "NIXL (nixl-cu12)")


def _run(args: list[str], timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVBRIDGE, *args], capture_output=True, text=True, timeout=timeout_s)


def test_demo_json_summary_and_progress_line() -> None:
    proc = _run(["demo", "--requests", "4", "--producer", "tp=2", "--consumer", "tp=1",
                 "--json"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    for key in ("requests", "failed_requests", "verified_bytes", "mismatched_bytes",
                "throughput_gbps", "latency_ms", "blocks", "bytes"):
        assert key in summary, key
    assert summary["requests"] == 4 and summary["failed_requests"] == 0
    assert summary["mismatched_bytes"] == 0 and summary["verified_bytes"] > 0
    assert summary["bytes"] > 0 and summary["latency_ms"]["p50"] is not None
    # exact percentiles from the consumer's per-transfer records; busy time is the
    # union of the transfers' intervals, so it fits inside the routed run (0.01: the
    # rounding of the printed figures). Well-formed figures only: no claim about speed.
    lat = summary["latency_ms"]
    assert summary["latency_exact"] is True
    assert_figures(lat, ("p50", "p90", "p99"))
    assert_figures(summary, ("throughput_gbps", "busy_s", "elapsed_s"))
    assert lat["p50"] <= lat["p90"] <= lat["p99"]
    assert summary["busy_s"] <= summary["elapsed_s"] + 0.01
    assert summary["idle_problems"] == {"producer": [], "consumer": []}
    assert "[demo]" in proc.stderr and "requests done" in proc.stderr


def test_demo_against_a_served_producer_push() -> None:
    port = free_port()
    serve = subprocess.Popen([*KVBRIDGE, "serve", "--role", "producer", "--mode", "push",
                              "--port", str(port), "--control-port", str(free_port()),
                              "--json"], stdout=subprocess.PIPE, text=True)
    try:
        ready = ready_line(serve)
        assert ready["side_channel"] == f"127.0.0.1:{port}" and ready["mode"] == "push"
        control = int(ready["control"].rsplit(":", 1)[1])
        proc = _run(["demo", "--mode", "push", "--producer-addr", f"127.0.0.1:{port}",
                     "--producer-control-port", str(control), "--requests", "3", "--json"])
        assert proc.returncode == 0, proc.stderr[-2000:]
        summary = json.loads(proc.stdout)
        assert summary["failed_requests"] == 0 and summary["mismatched_bytes"] == 0
        assert summary["producer"].startswith("remote")
        probe = _run(["probe", f"127.0.0.1:{port}", "--json"], timeout_s=30)
        assert probe.returncode == 0 and json.loads(probe.stdout)
    finally:
        assert stop_process(serve) == 0


def test_demo_usage_errors_exit_2() -> None:
    from kvbridge.tools.cli import main

    assert main(["demo", "--producer", "tp=three"]) == 2
    assert main(["demo", "--model", "no-such-model"]) == 2
    assert main(["demo", "--kv-config", "[1]"]) == 2


def test_demo_refuses_a_bad_connector_setting_before_starting_anything(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Refused in this process, naming the setting (a started engine would have died
    instead, and the demo would say "producer: exited ... before ready", exit 1)."""
    from kvbridge.tools.cli import main

    assert main(["demo", "--kv-config", '{"lease_s": -1}']) == 2
    err = capsys.readouterr().err
    assert "kv_connector_extra_config.lease_s" in err and "before ready" not in err
    assert main(["demo", "--connector", "mooncake", "--kv-config", '{"nope": 1}']) == 2
    err = capsys.readouterr().err
    assert "kv_connector_extra_config.nope" in err and "before ready" not in err
    assert main(["demo", "--connector", "offload", "--kv-config", '{"x": 1}']) == 2
    assert "kv_config" in capsys.readouterr().err


def test_bench_nixl_small_pattern() -> None:
    proc = _run(["bench", "nixl", "--pattern", "8x64KiB", "--iters", "1", "--json"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(proc.stdout)["patterns"][0]
    assert row["num_blocks"] == 8 and row["block_bytes"] == 65536
    # well-formed figures, no claim about their size (that is `kvbridge bench`'s job)
    assert_figures(row, ("raw_nixl_gbps", "kvbridge_gbps", "torch_copy_gbps",
                         "kvbridge_over_raw", "raw_over_memcpy"))
    assert row["verified_bytes"] == 8 * 65536 and row["mismatched_bytes"] == 0
    assert row["raw_matches_connector"] and row["nixl_live_handles_after"] == 0


def test_dispatch_tables() -> None:
    assert "nixl" in demo_modules()
    assert parse_pattern("64x2MiB") == (64, 2 << 20)
    assert parse_pattern("4096x16KiB") == (4096, 16 << 10)
    with pytest.raises(ValueError):
        parse_pattern("64")
