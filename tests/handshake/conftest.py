"""Fixtures of the handshake tests: fake-but-valid engines served on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvbridge.auth import resolve_auth
from kvbridge.handshake import HandshakeServer, MetadataStore, TransferMode
from kvbridge.handshake.example import example_store
from kvbridge.layouts import ParallelTopology, load_spec


@pytest.fixture
def make_store() -> Callable[..., MetadataStore]:
    def make(model: str = "tiny-gqa", tp: int = 2, pp: int = 1, dcp: int = 1,
             engine_id: str = "engine-a", mode: TransferMode = TransferMode.PULL,
             incarnation: str | None = None) -> MetadataStore:
        return example_store(load_spec(model),
                             ParallelTopology(tp_size=tp, pp_size=pp, dcp_size=dcp),
                             engine_id, mode, incarnation=incarnation)
    return make


@pytest.fixture
def serve() -> Iterator[Callable[..., HandshakeServer]]:
    """Start servers on their own threads; every one is stopped at teardown."""
    servers: list[HandshakeServer] = []

    def start(store: MetadataStore, port: int = 0, *, env_secret: bool = False
              ) -> HandshakeServer:
        """``env_secret``: seal with the environment's cluster secret, as a served engine
        does (for the CLI, which takes it from there too)."""
        if env_secret:
            store.auth = resolve_auth()
        server = HandshakeServer(store, "127.0.0.1", port).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(timeout_s=2.0)
