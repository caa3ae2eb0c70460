"""`kvbridge probe`, `kvbridge diff` and `kvbridge handshake` through the CLI entry point."""

from __future__ import annotations

import json

from kvbridge.handshake import TransferMode, decode_engine
from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, main


def test_probe_prints_every_rank_and_saves_a_document(make_store, serve, capsys, tmp_path):
    store = make_store(model="tiny-hybrid", tp=2, pp=2, engine_id="prefill-0")
    server = serve(store, env_secret=True)
    saved = tmp_path / "prefill.kvmeta"
    assert main(["probe", server.address, "--json", "--save", str(saved)]) == EXIT_OK
    out = json.loads(capsys.readouterr().out)
    assert out["engine"]["engine_id"] == "prefill-0"
    assert [r["rank"] for r in out["engine"]["ranks"]] == [
        "pp0/pcp0/tp0", "pp0/pcp0/tp1", "pp1/pcp0/tp0", "pp1/pcp0/tp1"]
    assert out["rtt_s"] > 0 and "clock_offset_s" in out
    assert decode_engine(saved.read_bytes()).engine_id == "prefill-0"
    # what each rank exposes to a peer: every block of every layer it advertises
    for rank, meta in zip(out["engine"]["ranks"], store.snapshot().ranks, strict=True):
        want = sum(len(r.base_addrs) * r.num_blocks * r.stride for r in meta.regions)
        assert rank["exposed_bytes"] == want > 0
        assert (rank["mem_type"], rank["device_id"]) == ("DRAM", 0)
    assert main(["probe", server.address]) == EXIT_OK
    text = capsys.readouterr().out
    assert "round trip" in text and "pp1/pcp0/tp1" in text
    assert "EXPOSED" in text and " DRAM " in text


def test_probe_exit_codes(capsys):
    assert main(["probe", "not-an-address"]) == EXIT_USAGE
    assert "HOST:PORT" in capsys.readouterr().err


def test_diff_live_against_saved_and_exit_codes(make_store, serve, capsys, tmp_path):
    decode = serve(make_store(tp=1, engine_id="decode-0"), env_secret=True)
    prefill = serve(make_store(tp=4, engine_id="prefill-0"), env_secret=True)
    push = serve(make_store(tp=2, engine_id="prefill-push", mode=TransferMode.PUSH),
                 env_secret=True)
    saved = tmp_path / "p.kvmeta"
    assert main(["probe", prefill.address, "--save", str(saved)]) == EXIT_OK
    capsys.readouterr()
    assert main(["diff", decode.address, str(saved)]) == EXIT_OK
    assert "verdict: compatible" in capsys.readouterr().out
    assert main(["diff", decode.address, push.address, "--json"]) == EXIT_FAILURE
    report = json.loads(capsys.readouterr().out)
    assert report["compatible"] is False
    assert "transfer_mode" in {m["field"] for m in report["mismatches"]}
    assert main(["diff", "nonsense", decode.address]) == EXIT_USAGE
    corrupt = tmp_path / "bad.kvmeta"
    corrupt.write_bytes(b"\x81\xa1v\x07")
    assert main(["diff", str(corrupt), decode.address]) == EXIT_FAILURE
    assert "protocol_version" in capsys.readouterr().err


def test_serve_example_stops_after_its_duration(capsys):
    assert main(["handshake", "serve-example", "--model", "tiny-mla", "--tp", "2",
                 "--duration", "0.1", "--json"]) == EXIT_OK
    info = json.loads(capsys.readouterr().out)
    assert info["fake"] is True and info["port"] > 0
    assert main(["handshake", "serve-example", "--tp", "3"]) == EXIT_USAGE
