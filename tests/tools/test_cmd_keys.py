"""`kvbridge keys`: namespaces listed, JSON shape and exit codes."""

from __future__ import annotations

import json

import pytest

from kvbridge.layouts import KeyNamespace
from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, main


def test_keys_json_lists_every_namespace(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["keys", "--model", "tiny-gqa", "--tp", "4", "--dcp", "2", "--pp", "2",
               "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == EXIT_OK
    assert data["topology"] == "tp=4,pp=2,dcp=2,pcp=1"
    namespaces = data["namespaces"]
    assert len(namespaces) == data["count"] == 8  # 4 TP ranks x 2 stages, no de-dup under DCP
    assert {(n["tp_rank"], n["pp_rank"]) for n in namespaces} == {
        (t, p) for t in range(4) for p in range(2)}
    assert {n["dcp_rank"] for n in namespaces} == {0, 1}
    for entry in namespaces:
        parsed = KeyNamespace.parse(entry["namespace"])
        assert parsed.tp_rank == entry["tp_rank"] and parsed.fingerprint == data["fingerprint"]
        assert entry["held_by_tp_ranks"] == [entry["tp_rank"]]
        assert entry["tokens_per_key"] == 32


def test_keys_mla_stored_once_per_dcp_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "--model", "tiny-mla", "--tp", "4", "--dcp", "2", "--json"]) == EXIT_OK
    namespaces = json.loads(capsys.readouterr().out)["namespaces"]
    assert [(n["tp_rank"], n["dcp_rank"], n["held_by_tp_ranks"]) for n in namespaces] == [
        (0, 0, [0, 2]), (1, 1, [1, 3])]


def test_keys_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "--model", "tiny-hybrid", "--tp", "8"]) == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    assert "5 namespaces per block" in out[0]
    assert out[1].split()[0].endswith(":attn:tp0-8:pcp0-1:dcp0-1:pp0-1")
    assert out[-1].endswith("held by tp 0,1,2,3,4,5,6,7")


def test_keys_refused_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "--model", "tiny-gqa", "--tp", "3"]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert "tp_size" in err and "8 KV heads" in err
    assert main(["keys", "--model", "tiny-gqa", "--tp", "6", "--dcp", "4"]) == EXIT_USAGE
    assert "dcp_size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["keys", "--model", "tiny-gqa", "--tp", "four"])
    assert info.value.code == EXIT_USAGE


def test_keys_absurd_topology_and_zero_sizes_are_usage_errors(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: ``--topology tp=80000000`` enumerated 80M ranks (for ever, memory rising);
    ``--tp 0`` was listed as tp=1."""
    assert main(["keys", "--model", "tiny-gqa", "--topology", "tp=80000000"]) == EXIT_USAGE
    assert "topology.tp_size: 80000000 exceeds kvbridge's limit of" in capsys.readouterr().err
    assert main(["keys", "--model", "tiny-gqa", "--tp", "0"]) == EXIT_USAGE
    assert "kvbridge keys: --tp: expected an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["keys", "--model", "tiny-gqa", "--pp", "-1"]) == EXIT_USAGE
    assert "--pp: expected an integer >= 1" in capsys.readouterr().err


def test_keys_of_the_widest_allowed_engine(capsys: pytest.CaptureFixture[str]) -> None:
    """256 ranks: one namespace per head group, each written by its first rank."""
    assert main(["keys", "--model", "tiny-gqa", "--tp", "256", "--json"]) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["count"] == 8  # 8 KV heads, each replicated on 32 ranks
    assert [n["writer_tp_rank"] for n in data["namespaces"]] == list(range(0, 256, 32))
    assert data["namespaces"][1]["held_by_tp_ranks"] == list(range(32, 64))
