"""The PD core names no transport: NIXL and Mooncake's transfer engine are adapters of it.

``connectors/pd/`` holds sessions, leases, holds, messages, routing, verification
and the worker's parts; a transport reaches them only through
:class:`~kvbridge.connectors.pd.transport.PdTransport` and a
:class:`~kvbridge.connectors.pd.transport.TransportFactory` its adapter passes
in. This test reads every module of the package with :mod:`ast` (no import, so
no backend is needed) and fails on a transport's name anywhere: in code (names,
attributes, imports, string literals) and in comments and docstrings.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PD = Path(__file__).resolve().parents[3] / "connectors" / "pd"

#: transport libraries and their adapters, as they would appear in a name or a sentence
TRANSPORT_NAMES = re.compile(r"nixl|mooncake|ucx|uccl|rdma", re.IGNORECASE)


def _modules() -> list[Path]:
    return sorted(PD.glob("*.py"))


def test_the_core_package_is_there() -> None:
    names = {p.name for p in _modules()}
    assert {"worker.py", "scheduler.py", "transport.py", "sessions.py", "leases.py",
            "messages.py", "routing.py", "verify.py", "holds.py", "loads.py"} <= names


def test_no_transport_name_in_code() -> None:
    found = []
    for path in _modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            words: list[str] = []
            if isinstance(node, ast.Name):
                words.append(node.id)
            elif isinstance(node, ast.Attribute):
                words.append(node.attr)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
                            | ast.alias):
                words.append(node.name)
            elif isinstance(node, ast.ImportFrom):
                words.append(node.module or "")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
                value = node.value
                words.append(value.decode("latin-1") if isinstance(value, bytes) else value)
            elif isinstance(node, ast.arg):
                words.append(node.arg)
            for word in words:
                if TRANSPORT_NAMES.search(word):
                    found.append(f"{path.name}:{getattr(node, 'lineno', '?')}: {word[:60]!r}")
    assert found == []


def test_no_transport_name_in_comments() -> None:
    found = []
    for path in _modules():
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        for tok in tokens:
            if tok.type == tokenize.COMMENT and TRANSPORT_NAMES.search(tok.string):
                found.append(f"{path.name}:{tok.start[0]}: {tok.string[:60]!r}")
    assert found == []


def test_the_check_sees_a_transport_name() -> None:
    """The pattern is not vacuous: it finds each spelling a name would take."""
    for word in ("NixlTransport", "nixl_lanes", "NIXL", "MooncakeError", "mooncake_te",
                 "UCX_TLS", "an RDMA read"):
        assert TRANSPORT_NAMES.search(word), word
    for word in ("PdTransport", "transport", "agent_metadata", "TransferParams"):
        assert not TRANSPORT_NAMES.search(word), word
