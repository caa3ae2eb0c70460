"""Shared test helpers for every level.

Backends are real. When one is missing, tests that need it are skipped on a
developer machine but *fail* under ``KVBRIDGE_REQUIRE_BACKENDS=1`` (CI), so a
missing install can never hide behind a skip.
"""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Iterator

import pytest

import kvbridge.backends  # noqa: F401  (applies UCX/NIXL/Mooncake env defaults first)

REQUIRE_BACKENDS = os.environ.get("KVBRIDGE_REQUIRE_BACKENDS") == "1"


def require(module: str, what: str | None = None) -> object:
    """Import ``module`` or skip (fail under KVBRIDGE_REQUIRE_BACKENDS=1)."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # ImportError, or a wheel whose shared library fails to load
        message = f"backend {what or module} unavailable: {exc!r}"
        if REQUIRE_BACKENDS:
            pytest.fail(message + " (KVBRIDGE_REQUIRE_BACKENDS=1)", pytrace=False)
        pytest.skip(message)


def missing_backend(message: str) -> None:
    """Skip, or fail under KVBRIDGE_REQUIRE_BACKENDS=1, for a missing capability."""
    if REQUIRE_BACKENDS:
        pytest.fail(message + " (KVBRIDGE_REQUIRE_BACKENDS=1)", pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def tcp_port() -> Iterator[int]:
    yield free_port()
