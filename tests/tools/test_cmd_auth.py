"""`kvbridge auth new-secret|show`: a secret made once, shown only by its fingerprint."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from kvbridge.auth import Secret
from kvbridge.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, main


def test_new_secret_writes_a_private_file_once(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cluster.secret"
    assert main(["auth", "new-secret", "--out", str(out), "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["written"] == str(out)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert report["fingerprint"] == Secret.from_file(out).fingerprint
    assert out.read_text().strip() not in json.dumps(report)
    assert main(["auth", "new-secret", "--out", str(out)]) == EXIT_USAGE  # never overwrites
    assert "exists" in capsys.readouterr().err
    assert main(["auth", "new-secret", "--json"]) == EXIT_OK
    assert len(json.loads(capsys.readouterr().out)["secret"]) == 64


def test_show_names_the_source_and_fingerprint_never_the_secret(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "s"
    out.write_text("a-cluster-secret-that-is-long-enough\n")
    monkeypatch.delenv("KVBRIDGE_SECRET", raising=False)
    monkeypatch.setenv("KVBRIDGE_SECRET_FILE", str(out))
    assert main(["auth", "show", "--json"]) == EXIT_OK
    shown = json.loads(capsys.readouterr().out)
    assert shown == {"configured": True, "source": f"secret file {out}",
                     "fingerprint": Secret.from_file(out).fingerprint}
    monkeypatch.delenv("KVBRIDGE_SECRET_FILE")
    assert main(["auth", "show", "--json"]) == EXIT_FAILURE
    assert json.loads(capsys.readouterr().out) == {"configured": False}
    short = tmp_path / "short"
    short.write_text("short")
    assert main(["auth", "show", "--secret-file", str(short)]) == EXIT_USAGE
    assert "at least 16" in capsys.readouterr().err
