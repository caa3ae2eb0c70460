"""kvbridge runs from a source tree, not installed: its connectors are found in code.

As ``tests/gpu/run_gpu_checks.sh`` does on a GPU host, ``PYTHONPATH`` holds only a
folder with a symlink ``kvbridge -> repository root``. The interpreter is a fresh
virtual environment whose site-packages links every entry of this one's (torch,
NIXL, Mooncake, ... : nothing is copied) except what installing kvbridge put there
(its ``*.dist-info``, the editable finder and its ``.pth``), so no kvbridge
packaging metadata, and no ``kvbridge.connectors`` entry point, is visible to it or
to the engine processes it starts (they run the same interpreter). Each run checks
that first, so the test cannot pass on metadata that leaked in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import missing_backend, require

ROOT = Path(__file__).resolve().parents[2]
BUILTINS = {"shared_storage", "nixl", "mooncake_store", "mooncake_te", "offloading", "multi"}

_WHERE_FROM = """
import importlib.metadata as md, json
try:
    md.distribution("kvbridge")
    visible = True
except md.PackageNotFoundError:
    visible = False
entry_points = sorted(e.name for e in md.entry_points(group="kvbridge.connectors"))
import kvbridge
from kvbridge.connectors import registry
plugin = registry.load("nixl")
print(json.dumps({"kvbridge_metadata": visible, "entry_points": entry_points,
                  "file": kvbridge.__file__, "nixl": f"{plugin.__module__}:{plugin.__name__}",
                  "sources": {n: s.origin.value for n, s in registry.sources().items()}}))
"""


def _installed_kvbridge(entry: Path) -> bool:
    """What ``pip install [-e]`` of kvbridge leaves in site-packages."""
    name = entry.name.lower()
    if name == "kvbridge" or name.startswith(("kvbridge-", "kvbridge.", "__editable__.kvbridge",
                                              "__editable___kvbridge")):
        return True
    return name.endswith(".pth") and "kvbridge" in entry.read_text(errors="replace").lower()


@pytest.fixture(scope="module")
def source_tree_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    """(python, environment) of a source-tree run with no kvbridge installed."""
    require("nixl_cu12._api", "NIXL")
    base = tmp_path_factory.mktemp("source-tree")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = str(venv / "bin" / "python")
    theirs = {Path(p) for p in json.loads(subprocess.run(
        [python, "-c", "import json, sysconfig; p = sysconfig.get_paths(); "
                       "print(json.dumps([p['purelib'], p['platlib']]))"],
        check=True, capture_output=True, text=True, timeout=60).stdout)}
    ours = {Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}
    for target in theirs:
        target.mkdir(parents=True, exist_ok=True)
        for folder in ours:
            for entry in folder.iterdir():
                link = target / entry.name
                if not _installed_kvbridge(entry) and not link.exists():
                    link.symlink_to(entry)
    pp = base / "pp"
    pp.mkdir()
    (pp / "kvbridge").symlink_to(ROOT)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONPATH"] = str(pp)
    # mooncake_master's shim sits next to this interpreter, not the fresh one
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return python, env


def _run(source_tree_env: tuple[str, dict[str, str]], args: list[str], tmp_path: Path,
         timeout_s: float) -> subprocess.CompletedProcess[str]:
    python, env = source_tree_env
    return subprocess.run([python, *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=timeout_s)


def test_the_registry_finds_the_builtins_without_kvbridge_metadata(
        source_tree_env: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    proc = _run(source_tree_env, ["-c", _WHERE_FROM], tmp_path, 120)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["kvbridge_metadata"] is False and found["entry_points"] == []
    pp = source_tree_env[1]["PYTHONPATH"]
    assert found["file"] == os.path.join(pp, "kvbridge", "__init__.py")
    assert found["sources"] == {name: "built-in" for name in BUILTINS}
    assert found["nixl"] == "kvbridge.connectors.nixl.plugin:NixlPlugin"


def test_doctor_lists_the_builtins_as_builtin(
        source_tree_env: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    proc = _run(source_tree_env, ["-m", "kvbridge.tools.cli", "doctor", "--json",
                                  "--timeout", "120"], tmp_path, 400)
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    rows = {row["name"]: row for row in report["connectors"]}
    assert set(rows) == BUILTINS
    for row in rows.values():
        assert row["source"] == "built-in" and row["distribution"] is None, row
        assert row["loaded"], row
    checks = {c["name"]: c for c in report["checks"]}
    for backend in ("nixl", "mooncake"):
        if not checks[backend]["ok"]:
            missing_backend(f"doctor's {backend} check failed from a source tree: "
                            f"{checks[backend]}")
    assert report["ok"] and proc.returncode == 0, report


def test_demo_moves_kv_with_the_builtin_nixl_connector(
        source_tree_env: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    """The demo's engine processes run the same interpreter: they resolve ``nixl`` too."""
    proc = _run(source_tree_env, ["-m", "kvbridge.tools.cli", "demo", "--requests", "1",
                                  "--json", "--timeout", "120"], tmp_path, 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["connector"] == "nixl" and summary["failed_requests"] == 0
    assert summary["verified_bytes"] == summary["bytes"] > 0
    assert summary["mismatched_bytes"] == 0
