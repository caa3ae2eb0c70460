"""The connector registry: built-ins in code, entry points of other distributions, in-process.

Third-party distributions are real packaging metadata (a ``*.dist-info`` with
``entry_points.txt`` in a folder put on ``sys.path``), read by the real
``importlib.metadata``: nothing about the registry is faked.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvbridge.connectors import registry
from kvbridge.connectors.errors import UnknownConnectorError
from kvbridge.connectors.registry import BUILTIN_CONNECTORS, Origin
from kvbridge.connectors.shared_storage import SharedStoragePlugin
from kvbridge.tools.commands import doctor as cmd_doctor

ROOT = Path(__file__).resolve().parents[2]
BUILTINS = {"shared_storage", "nixl", "mooncake_store", "mooncake_te", "offloading", "multi"}


def _distribution(root: Path, name: str, version: str, entries: dict[str, str]) -> None:
    """A minimal installed distribution under ``root`` declaring ``entries`` in the group."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = "".join(f"{key} = {value}\n" for key, value in entries.items())
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{lines}")


def _plugin_module(root: Path, module: str, connector_name: str) -> str:
    """A real plugin module (the reference connector under another name); its ``module:Class``."""
    (root / f"{module}.py").write_text(
        "from kvbridge.connectors.shared_storage import SharedStoragePlugin\n\n\n"
        "class ThirdPartyPlugin(SharedStoragePlugin):\n"
        f"    name = {connector_name!r}\n")
    return f"{module}:ThirdPartyPlugin"


def test_builtins_equal_the_pyproject_entry_points() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert dict(BUILTIN_CONNECTORS) == project["entry-points"][registry.ENTRY_POINT_GROUP]
    assert set(BUILTIN_CONNECTORS) == BUILTINS


def test_builtins_are_listed_and_load_from_code() -> None:
    found = registry.sources()
    for name in BUILTINS:
        assert found[name].origin is Origin.BUILTIN and found[name].distribution is None
        assert found[name].target == BUILTIN_CONNECTORS[name]
        assert found[name].describe() == "built-in"
        plugin = registry.load(name)
        assert plugin.name == name
        assert f"{plugin.__module__}:{plugin.__qualname__}".startswith(f"kvbridge.connectors.{name}")
    assert registry.available()["nixl"] == "kvbridge.connectors.nixl:NixlPlugin"


def test_registry_import_loads_no_connector_module_or_backend() -> None:
    """Knowing the built-ins costs nothing: NIXL and Mooncake load only with their connector."""
    code = ("import sys\n"
            "from kvbridge.connectors import registry\n"
            "assert len(registry.sources()) >= 5\n"
            "heavy = ('kvbridge.connectors.nixl', 'kvbridge.connectors.mooncake_store',\n"
            "         'kvbridge.connectors.offloading', 'nixl_cu12', 'nixl_cu13', 'nixl',\n"
            "         'mooncake')\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_a_third_party_entry_point_adds_a_connector_with_its_distribution(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = _plugin_module(tmp_path, "thirdparty_store_mod", "thirdparty_store")
    _distribution(tmp_path, "thirdparty-store", "1.2", {"thirdparty_store": target})
    monkeypatch.syspath_prepend(str(tmp_path))
    source = registry.sources()["thirdparty_store"]
    assert source.origin is Origin.ENTRY_POINT and source.target == target
    assert source.distribution == "thirdparty-store 1.2"
    assert source.describe() == "entry point of thirdparty-store 1.2"
    plugin = registry.load("thirdparty_store")
    assert issubclass(plugin, SharedStoragePlugin) and plugin.name == "thirdparty_store"
    assert registry.shadowed() == []


def test_a_third_party_entry_point_under_a_builtin_name_is_ignored_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    target = _plugin_module(tmp_path, "shadowing_nixl_mod", "nixl")
    _distribution(tmp_path, "shadow-pkg", "0.3", {"nixl": target})
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=registry.__name__):
        found = registry.sources()
        registry.sources()  # warned once per process, not per lookup
    assert found["nixl"].origin is Origin.BUILTIN
    assert found["nixl"].target == "kvbridge.connectors.nixl:NixlPlugin"
    assert list(found).count("nixl") == 1
    assert registry.load("nixl").__module__.startswith("kvbridge.connectors.nixl")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "shadow-pkg 0.3" in warnings[0] and target in warnings[0]
    assert "kvbridge.connectors.nixl:NixlPlugin" in warnings[0] and "built-in" in warnings[0]
    [ignored] = registry.shadowed()
    assert (ignored.name, ignored.value, ignored.distribution) == ("nixl", target, "shadow-pkg 0.3")
    assert ignored.winner.origin is Origin.BUILTIN
    # doctor lists the built-in as such and warns (not a required check) about the shadow
    rows, _, problems = cmd_doctor.check_connectors()
    nixl_row = next(r for r in rows if r["name"] == "nixl")
    assert nixl_row["source"] == "built-in" and nixl_row["distribution"] is None
    [problem] = [p for p in problems if "shadow-pkg" in p.detail]
    assert problem.name == "connector nixl" and not problem.ok and not problem.required
    assert "shadow-pkg" in problem.fix and "register()" in problem.fix


def test_two_distributions_declaring_one_name_first_on_the_path_wins(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    target_a = _plugin_module(first, "dup_store_a", "dup_store")
    target_b = _plugin_module(second, "dup_store_b", "dup_store")
    _distribution(first, "dup-a", "1.0", {"dup_store": target_a})
    _distribution(second, "dup-b", "1.0", {"dup_store": target_b})
    monkeypatch.syspath_prepend(str(second))
    monkeypatch.syspath_prepend(str(first))  # now first on sys.path
    with caplog.at_level(logging.WARNING, logger=registry.__name__):
        source = registry.sources()["dup_store"]
    assert source.distribution == "dup-a 1.0" and source.target == target_a
    assert registry.load("dup_store").__module__ == "dup_store_a"
    assert any("dup-b 1.0" in r.getMessage() and "dup-a 1.0" in r.getMessage()
               for r in caplog.records)


def test_an_installed_kvbridge_metadata_never_adds_or_changes_connectors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Another kvbridge's metadata (stale, older or newer than the code that runs) is not
    read: its built-in names stay the code's, without a warning, and names only it has
    do not appear (the code that runs has no such connector)."""
    _distribution(tmp_path, "kvbridge", "0.0.1", {
        "nixl": "somewhere_else:NixlPlugin", "retired_connector": "gone_module:GonePlugin"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=registry.__name__):
        found = registry.sources()
    assert "retired_connector" not in found
    assert found["nixl"].origin is Origin.BUILTIN
    assert found["nixl"].target == "kvbridge.connectors.nixl:NixlPlugin"
    assert registry.shadowed() == [] and not caplog.records


def test_an_in_process_registration_replaces_a_builtin_until_unregistered() -> None:
    class Replacement(SharedStoragePlugin):
        name = "nixl"

    registry.register(Replacement)
    try:
        source = registry.sources()["nixl"]
        assert source.origin is Origin.IN_PROCESS and source.target.endswith("Replacement")
        assert source.describe() == "registered in-process"
        assert registry.load("nixl") is Replacement
    finally:
        registry.unregister("nixl")
    assert registry.sources()["nixl"].origin is Origin.BUILTIN


def test_a_broken_entry_point_names_its_distribution(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _distribution(tmp_path, "broken-pkg", "2.0", {"broken_store": "no_such_module_qq:Plugin"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UnknownConnectorError, match=r"no_such_module_qq:Plugin of broken-pkg 2\.0 "
                                                    r"failed to load"):
        registry.load("broken_store")
    with pytest.raises(UnknownConnectorError, match=r"available: .*nixl.*shared_storage"):
        registry.load("no_such_connector_name")
