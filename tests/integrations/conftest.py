"""Fixtures for tests that run real serving engines (vLLM on CPU).

These tests need the separate vLLM venv (``make test-vllm``); every one is
marked ``vllm`` so the main suite deselects them with ``-m "not vllm"``. Run
anywhere else they skip, or fail under ``KVBRIDGE_REQUIRE_BACKENDS=1``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REQUIRE_BACKENDS = os.environ.get("KVBRIDGE_REQUIRE_BACKENDS") == "1"


def require_vllm_env() -> None:
    """Skip (fail under KVBRIDGE_REQUIRE_BACKENDS=1) outside the vLLM venv."""
    for module in ("vllm", "transformers", "tokenizers"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or a broken wheel
            message = f"{module} unavailable ({exc!r}); run `make test-vllm`"
            if REQUIRE_BACKENDS:
                pytest.fail(message + " (KVBRIDGE_REQUIRE_BACKENDS=1)", pytrace=False)
            pytest.skip(message)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm: runs real vLLM API servers (needs .venv-vllm; `make test-vllm`)")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded 2-layer Llama checkpoint (built once per session, ~10 s)."""
    require_vllm_env()
    from kvbridge.integrations.vllm.tiny_model import ensure_tiny_llama

    cached = os.environ.get("KVBRIDGE_TINY_MODEL_DIR")
    out = Path(cached) if cached else tmp_path_factory.mktemp("tiny-llama")
    return ensure_tiny_llama(out)


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = Path(os.environ["KVBRIDGE_VLLM_LOGS"]) if os.environ.get("KVBRIDGE_VLLM_LOGS") \
        else tmp_path_factory.mktemp("vllm-logs")
    path.mkdir(parents=True, exist_ok=True)
    yield path
