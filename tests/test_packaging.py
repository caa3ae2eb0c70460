"""The wheel's package list must name every package folder of the repository."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_in_pyproject() -> None:
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]
    listed = set(packages)
    assert len(listed) == len(packages), "a package is listed twice"
    found = {"kvbridge"}
    for init in ROOT.rglob("__init__.py"):
        relative = init.parent.relative_to(ROOT)
        if any(part.startswith(".") for part in relative.parts) or relative.parts[:1] == ("tests",):
            continue
        if relative.parts:
            found.add(".".join(("kvbridge", *relative.parts)))
    assert found == listed, f"missing: {sorted(found - listed)}, stale: {sorted(listed - found)}"


def test_console_script_and_connector_entry_points_resolve() -> None:
    import importlib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    targets = [project["scripts"]["kvbridge"],
               *project["entry-points"]["kvbridge.connectors"].values()]
    for target in targets:
        module_name, _, attr = target.partition(":")
        module = importlib.import_module(module_name)
        assert callable(getattr(module, attr)), target
