"""The connector conformance suite, over every registered connector's cases.

A connector plugs in by returning ``ConformanceCase``s from its plugin's
``conformance_cases()`` (see ``kvbridge.connectors.testing``); this module
picks them up through the registry, so a new connector needs no edit here.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from kvbridge.connectors import registry
from kvbridge.engine.conformance import SCENARIOS, run_case
from tests.conftest import require


def _cases() -> list[Any]:
    params = []
    for name in registry.available():
        try:
            plugin = registry.load(name)
            cases = plugin.conformance_cases()
        except Exception as exc:  # a broken plugin must show up as a failing test
            params.append(pytest.param(name, None, "load", id=f"{name}-unloadable"))
            del exc
            continue
        for case in cases:
            for scenario in SCENARIOS:
                params.append(pytest.param(name, case, scenario, id=f"{case.name}-{scenario}"))
    return params


@pytest.mark.parametrize(("connector", "case", "scenario"), _cases())
def test_conformance(connector: str, case: Any, scenario: str, tmp_path: Path) -> None:


    if case is None:
        registry.load(connector).conformance_cases()  # re-raise the load error
        pytest.fail(f"connector {connector} failed to load")
    for module in case.backends:
        require(module)
    report = run_case(case, tmp_path, scenario)
    if report.skipped:
        pytest.skip(f"{case.name}: {report.skipped}")
    assert report.ok, f"{case.name} / {scenario}:\n  " + "\n  ".join(report.problems)


def test_every_registered_connector_has_a_case() -> None:
    missing = []
    for name in registry.available():
        plugin = registry.load(name)
        if not plugin.conformance_cases():
            missing.append(name)
    assert not missing, f"connectors without conformance cases: {missing}"


def test_registry_lists_the_reference_connector() -> None:
    assert "shared_storage" in registry.available()
    assert importlib.import_module("kvbridge.connectors.shared_storage")
