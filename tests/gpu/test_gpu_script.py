"""The GPU check script's CPU-runnable parts (the script itself needs a GPU host).

``run_gpu_checks.sh`` parses its arguments and sets up as on a GPU host;
``--dry-run-cpu`` then runs the transfers check on host memory through the same
code (two processes, real NIXL, bytes verified), so the script cannot rot
unnoticed between GPU sessions.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import require
from tests.gpu import gpu_checks

SCRIPT = Path(__file__).with_name("run_gpu_checks.sh")


def _sh(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout)


def test_shell_script_parses_and_refuses_bad_arguments() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], timeout=30).returncode == 0
    shown = _sh("--help")
    assert shown.returncode == 0 and "--wheels DIR" in shown.stdout
    assert "nixl-cu13==1.5.1 pyzmq" in shown.stdout  # how to fetch the wheels
    bad = _sh("--frobnicate")
    assert bad.returncode == 2 and "unknown argument '--frobnicate'" in bad.stderr
    assert _sh("--budget", "soon").returncode == 2


def test_checks_arguments() -> None:
    args = gpu_checks.parse_args([])
    assert args.checks == gpu_checks.CHECKS and args.device == "cuda:0"
    assert gpu_checks.parse_args(["--checks", "env,transfers"]).checks == ("env", "transfers")
    for bad in (["--checks", "env,nope"], ["--checks", ","], ["--iters", "0"]):
        with pytest.raises(SystemExit) as info:
            gpu_checks.parse_args(bad)
        assert info.value.code == 2


def test_ucx_protocol_summary_and_rates() -> None:
    text = ("[1] UCX INFO | cuda_ipc/cuda : zero-copy 2.1 GB/s |\n"
            "[1] UCX INFO | tcp/lo : bcopy |\n| rc_mlx5/mlx5_0:1 zcopy |\nnot ucx cuda_ipc\n")
    assert gpu_checks.ucx_protocols(text) == {"cuda_ipc": 1, "tcp": 1, "rc_mlx5": 1}
    assert gpu_checks.gbps(2_000_000_000, [2.0, 1.0, 4.0]) == 1.0


def test_write_check_reads_every_byte_of_large_blocks() -> None:
    """The WRITE verification covers the whole peer buffer, 1 MiB per peer call: it
    used to read only the first MiB of each block, so with the 2 MiB blocks of
    the full patterns a wrong second half passed as verified."""
    want = bytes(range(256)) * (4 << 12)  # 4 MiB: two 2 MiB blocks
    calls: list[tuple[int, int]] = []

    def read_from(buf: bytes) -> Callable[[int, int], bytes]:
        def read(offset: int, length: int) -> bytes:
            calls.append((offset, length))
            return buf[offset:offset + length]
        return read

    assert gpu_checks.write_verified(read_from(want), want)
    assert calls == [(off, 1 << 20) for off in range(0, 4 << 20, 1 << 20)]
    wrong = bytearray(want)
    wrong[(2 << 20) - 1] ^= 0xFF  # the last byte of the first block's second MiB
    assert not gpu_checks.write_verified(read_from(bytes(wrong)), want)
    assert gpu_checks.write_verified(read_from(want[:3000]), want[:3000], chunk=1024)
    assert not gpu_checks.write_verified(read_from(want[:2999] + b"x"), want[:3000], chunk=1024)


def test_without_cuda_the_checks_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    torch = require("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the no-CUDA answer cannot be seen here")
    assert gpu_checks.main(["--checks", "env"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_dry_run_on_host_memory_moves_verified_bytes(tmp_path: Path) -> None:
    """The script as a GPU host runs it, on host memory: the set-up check imports every
    module, then the transfers, connector and demos checks run with the KV guarded
    against host reads (the connector check's engines and the demos take the paths of
    GPU ranks), every byte verified, one table printed and a gpu.md written."""
    require("nixl_cu12._api", "NIXL")
    require("mooncake.store", "Mooncake")  # the stores check's staged Mooncake row
    done = _sh("--python", sys.executable, "--wheels", str(tmp_path / "none"),
               "--out", str(tmp_path), "--dry-run-cpu", timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "every kvbridge module imports" in done.stdout
    report = json.loads((tmp_path / "gpu_checks.json").read_text())
    entry = report["checks"]["transfers"]
    assert entry["ok"], entry
    (pattern,) = entry["detail"]["patterns"]
    assert pattern["read_verified"] and pattern["write_verified"] and pattern["leaks"] == 0
    assert pattern["kvbridge_read_gbps"] > 0 and pattern["raw_nixl_read_gbps"] > 0
    assert entry["detail"]["ucx_protocols"]  # UCX_PROTO_INFO lines were seen and counted
    log = (tmp_path / "gpu_checks.log").read_text()
    assert all(f"[ok  ] {check}" in log
               for check in ("transfers", "cost", "connector", "stores", "demos"))
    stores = {r["case"].split()[0]: r for r in report["checks"]["stores"]["detail"]["rows"]}
    assert stores["offload"]["store_gbps"] > 0 and stores["offload"]["load_gbps"] > 0
    assert stores["mooncake"]["staged"] is True  # the guarded KV went through staging
    cost = report["checks"]["cost"]["detail"]["rows"]
    assert {r["case"].split()[-1] for r in cost} == {"READ", "WRITE"}
    assert all(r["kvbridge_gbps"] > 0 and r["raw_per_request_gbps"] > 0 for r in cost)

    connector = report["checks"]["connector"]["detail"]
    assert set(connector) == {name for name, _mode, _tp in gpu_checks.CONNECTOR_CASES}
    for name, _mode, consumer_tp in gpu_checks.CONNECTOR_CASES:
        case = connector[name]
        assert case["producer_memory"] == [["DRAM", 0]], case
        # each request loads its prompt's blocks, the partial last one too (tiny-gqa:
        # 16-token blocks, one region), verified with the digests a GPU rank offers
        per_request = case["external_tokens"] // case["requests"]
        blocks = case["requests"] * -(-per_request // 16)
        assert case["blocks_verified"] == blocks * consumer_tp > 0, (name, case)
        assert case["digest_mismatches"] == case["blocks_unverified"] == 0
        assert case["producer_digest_bytes"] > 0

    rows = report["checks"]["demos"]["detail"]["rows"]
    assert [r["case"] for r in rows] == list(gpu_checks.QUICK_DEMO_CASES)
    for row in rows:
        assert row["ok"] and row["verified_bytes"] > 0 and row["mismatched_bytes"] == 0, row
    doc = (tmp_path / "gpu.md").read_text()
    assert "| demos | nixl-pull | ok |" in doc and "| connector | pull-tp1-tp2 | ok |" in doc
    assert re.search(r"^check +case +result +figures$", done.stdout, re.M)  # the one table


def test_a_demo_row_is_ok_only_with_verified_bytes_and_none_wrong() -> None:
    good = json.dumps({"requests": 4, "verified_bytes": 10, "mismatched_bytes": 0,
                       "latency_ms": {"p50": 1.5}, "first_transfer_ms": 9.0})
    row = gpu_checks.demo_row("x", 0, good, "", 1.0)
    assert row["ok"] and row["p50_ms"] == 1.5 and row["first_transfer_ms"] == 9.0
    wrong = json.dumps({"verified_bytes": 10, "mismatched_bytes": 2})
    assert not gpu_checks.demo_row("x", 1, wrong, "bytes differ\n", 1.0)["ok"]
    assert not gpu_checks.demo_row("x", 0, json.dumps({"verified_bytes": 0,
                                                       "mismatched_bytes": 0}), "", 1.0)["ok"]
    failed = gpu_checks.demo_row("x", 2, "", "kvbridge demo: device: no GPU\n", 1.0)
    assert not failed["ok"] and failed["error"] == "kvbridge demo: device: no GPU"


def test_the_report_renders_every_case_and_failures() -> None:
    report = {"date": "d", "command": "c", "checks": {
        "env": {"ok": True, "detail": {"gpu": "H200", "driver": "580.1", "torch": "2.11",
                                       "torch_cuda": "13.0", "nixl": ["nixl_cu13._api", "x"]}},
        "demos": {"ok": True, "detail": {"rows": [
            {"case": "nixl-pull", "ok": True, "verified_bytes": 5},
            {"case": "mooncake", "ok": None, "not_run": "no wheel"}]}},
        "digests": {"ok": False, "error": "RuntimeError: differ"}}}
    rows = gpu_checks.report_rows(report)
    assert ("demos", "nixl-pull", "ok", "verified_bytes=5") in rows
    assert ("demos", "mooncake", "not run", "not_run=no wheel") in rows
    assert ("digests", "", "FAIL", "RuntimeError: differ") in rows
    doc = gpu_checks.format_markdown(report)
    assert "H200 (driver 580.1)" in doc and "| digests |  | FAIL |" in doc


def test_verified_kv_refuses_unverified_blocks() -> None:
    with pytest.raises(RuntimeError, match="verified KV counters"):
        gpu_checks.verified_kv({}, {"stats": {"worker_stats": {"blocks_verified": 3,
                                                               "blocks_unverified": 1}}}, "x")
