"""`kvbridge bench digests`: torch-mix64-v1 against xxh3-64 on the same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbridge.tools.bench.digests import digest_rates
from kvbridge.tools.cli import EXIT_OK, EXIT_USAGE, main


def test_digest_rates_measure_both_algorithms_over_the_same_blocks() -> None:
    out = digest_rates(8, 4096, iters=1)
    assert out["num_blocks"] == 8 and out["block_bytes"] == 4096 and out["device"] == "cpu"
    assert out["xxh3_gbps"] > 0 and out["torch_mix64_gbps"] > 0 and out["same_on_cpu"] is True
    assert out["xxh3_slices_gbps"] > 0 and out["torch_mix64_slices_gbps"] > 0
    # the Triton kernel's rows are measured on a CUDA device only; here the result says so
    assert out["triton"] == "the Triton rows need a CUDA device (tensors on cpu)"
    assert "triton_mix64_gbps" not in out
    assert "xxh3_slices_gbps" not in digest_rates(2, 16, iters=1)  # no quarter of 8 bytes
    with pytest.raises(ValueError, match="multiple of 8"):
        digest_rates(8, 4095)


def test_bench_digests_prints_one_row_per_pattern(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "digests.json"
    rc = main(["bench", "digests", "--pattern", "4x16KiB", "--pattern", "2x64KiB",
               "--iters", "1", "--json", str(path)])
    assert rc == EXIT_OK
    rows = json.loads(path.read_text())["rows"]
    assert [(r["path"], r["op"], r["raw_name"], r["block_bytes"]) for r in rows] == [
        ("digests", f"torch-mix64-v1{s}", f"xxh3-64{s}", size)
        for size in (16 << 10, 64 << 10) for s in ("", "-slices")]
    assert all(r["verified"] and r["kvbridge"] > 0 and r["raw"] > 0 for r in rows)
    printed = capsys.readouterr().out
    assert "torch-mix64-v1" in printed
    assert "digests: the Triton rows need a CUDA device (tensors on cpu)" in printed


def test_bench_device_cuda_without_cuda_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():  # the case this checks is a host without CUDA
        assert main(["bench", "digests", "--device", "cuda:9999"]) == EXIT_USAGE
        return
    assert main(["bench", "digests", "--device", "cuda"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvbridge bench: device: cuda: ") and "\n" not in err
