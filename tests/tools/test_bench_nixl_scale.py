"""`kvbridge bench nixl-scale`: set-up at size, kvbridge vs raw NIXL, on real NIXL.

The figures are not asserted (no timing thresholds); what is: every first
transfer moved the right bytes, and what kvbridge prepares and sends does not
grow with the number of blocks (strided lists: one row per layer descriptor;
the handshake document the same size at 200 and at 4000 blocks), while
per-block lists do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbridge.tools.cli import EXIT_OK, EXIT_USAGE, main
from tests.conftest import require


def test_scale_bench_rows_detail_and_sizes_that_do_not_grow(tmp_path: Path) -> None:
    require("nixl_cu12._api", "NIXL")
    out = tmp_path / "scale.json"
    rc = main(["bench", "nixl-scale", "--layers", "4", "--pattern", "200x16",
               "--pattern", "4000x16", "--per-block", "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == EXIT_OK, report["paths"]
    rows = report["rows"]
    assert {r["op"] for r in rows} == {"register", "prepare lists", "first transfer",
                                       "set-up total", "handshake doc"}
    assert all(r["verified"] and r["kvbridge"] > 0 and r["raw"] > 0 for r in rows)
    small, large = report["scale"]
    for rep in (small, large):
        for side in ("kvbridge", "raw_nixl", "kvbridge_per_block"):
            assert rep[side]["verified"], (side, rep[side])
            assert set(rep[side]["ms"]) == {"register", "handshake_doc", "prepare_lists",
                                            "first_transfer"}
        assert rep["kvbridge"]["list_rows"] == 2 * 4  # one strided row per layer, per side
        assert rep["kvbridge_per_block"]["list_rows"] == 2 * 4 * rep["num_blocks"]
        assert rep["kvbridge"]["descriptors"] == rep["kvbridge_per_block"]["list_rows"]
    doc_small = small["kvbridge"]["handshake_doc_bytes"]
    assert abs(large["kvbridge"]["handshake_doc_bytes"] - doc_small) <= 16
    assert abs(large["kvbridge"]["agent_metadata_bytes"]
               - small["kvbridge"]["agent_metadata_bytes"]) <= 16


def test_scale_bench_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "nixl-scale", "--layers", "0"]) == EXIT_USAGE
    assert "--layers must be >= 1" in capsys.readouterr().err
