"""The conformance suite is not vacuous: deliberately broken connectors fail it.

Each broken variant subclasses the reference connector and breaks one rule of
the contract; the suite must name the violation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvbridge.connectors import (
    BlockRef,
    ConnectorConfig,
    ConnectorContext,
    KVRole,
    WorkerConnector,
    registry,
)
from kvbridge.connectors.shared_storage import SharedStoragePlugin, SharedStorageWorker
from kvbridge.connectors.testing import CaseEnv, CaseKind, ConformanceCase
from kvbridge.engine.conformance import run_case


class _SilentOnErrors(SharedStorageWorker):
    """Swallows load errors: the engine would trust blocks that were never loaded."""

    def get_block_ids_with_load_errors(self) -> set[BlockRef]:
        super().get_block_ids_with_load_errors()
        return set()


class _NeverFreesDelayed(SharedStorageWorker):
    """Never reports finished_sending: delayed frees are never released."""

    def get_finished(self, finished_request_ids: frozenset[str]) -> tuple[set[str], set[str]]:
        _, recving = super().get_finished(finished_request_ids)
        return set(), recving


class _LeaksThread(SharedStorageWorker):
    """Does not stop its worker thread on shutdown."""

    instances: list[SharedStorageWorker] = []

    def __init__(self, ctx: ConnectorContext) -> None:
        super().__init__(ctx)
        self.instances.append(self)

    def shutdown(self) -> None:
        return None


def _plugin(name: str, worker: type[SharedStorageWorker]) -> type[SharedStoragePlugin]:
    class Broken(SharedStoragePlugin):
        @classmethod
        def create_worker(cls, ctx: ConnectorContext) -> WorkerConnector:
            return worker(ctx)

    Broken.name = name
    return Broken


def _case(name: str, kind: CaseKind, extra: dict[str, Any]) -> ConformanceCase:
    @contextmanager
    def setup(tmp: Path) -> Iterator[CaseEnv]:
        store = {"path": str(tmp / "store"), **extra}

        def break_loads(engine: Any, step: Any) -> None:
            for path in (tmp / "store").rglob("*.kv"):
                path.write_bytes(path.read_bytes()[:10])

        if kind is CaseKind.PD:
            yield CaseEnv(producer=ConnectorConfig(name, KVRole.PRODUCER, extra=store),
                          consumer=ConnectorConfig(name, KVRole.CONSUMER, extra=store),
                          break_loads=break_loads)
        else:
            yield CaseEnv(consumer=ConnectorConfig(name, KVRole.BOTH, extra=store),
                          break_loads=break_loads)
    return ConformanceCase(name, kind, setup)


@pytest.fixture
def broken() -> Iterator[None]:
    plugins = [_plugin("broken-silent", _SilentOnErrors),
               _plugin("broken-never-frees", _NeverFreesDelayed),
               _plugin("broken-leaks", _LeaksThread)]
    for plugin in plugins:
        registry.register(plugin)
    yield
    for plugin in plugins:
        registry.unregister(plugin.name)
    for worker in _LeaksThread.instances:  # clean up what the broken variant leaked
        SharedStorageWorker.shutdown(worker)
    _LeaksThread.instances.clear()


def test_swallowed_load_errors_are_caught_by_byte_verification(broken: None,
                                                               tmp_path: Path) -> None:
    report = run_case(_case("broken-silent", CaseKind.PD, {}), tmp_path, "failed_load",
                      timeout_s=30)
    text = "\n".join(report.problems)
    assert "no load failure was reported" in text
    assert "mismatched" in text  # the engine verified the bytes it was told were loaded


def test_delayed_frees_never_released_are_caught(broken: None, tmp_path: Path) -> None:
    report = run_case(_case("broken-never-frees", CaseKind.SINGLE, {"save_async": True}),
                      tmp_path, "transfer", timeout_s=3)
    text = "\n".join(report.problems)
    assert "not drained" in text and "delayed frees not released" in text


def test_threads_left_after_shutdown_are_caught(broken: None, tmp_path: Path) -> None:
    report = run_case(_case("broken-leaks", CaseKind.SINGLE, {"save_async": True}),
                      tmp_path, "transfer", timeout_s=30)
    assert any("threads left after shutdown" in p for p in report.problems)
