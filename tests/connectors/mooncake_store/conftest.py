"""Fixtures of the Mooncake store connector tests (a real mooncake_master, never a mock).

``held_store`` keeps the process-scope pooled client of the shared master
open for the whole module, so engines created by the tests share it instead
of paying ~0.35 s setup and ~2 s close each (the pool is what the connector
itself uses; the tests only add a reference).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import pytest

from kvbridge.backends.mooncake import MooncakeStoreClient
from kvbridge.backends.mooncake.master import MooncakeMaster


def run_again_from_store(engine: Any, requests: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Drop the engine's prefix cache and run ``requests`` again under new ids, so their
    KV must come back from the store: ``(the new specs, their results)``."""
    engine.reset_prefix_cache()
    again = [replace(s, request_id=s.request_id + "-again") for s in requests]
    for spec in again:
        engine.add_request(spec)
    return again, engine.run_until_done(timeout_s=60)


def store_extra(master: MooncakeMaster, **overrides: Any) -> dict[str, Any]:
    """Connector settings for ``master`` with small, test-sized buffers, checking every
    loaded block (``verify: full``; the default samples 1/16 of them)."""
    return {"master_address": master.rpc_address, "metadata_server": master.metadata_url,
            "global_segment_size": 32 << 20, "local_buffer_size": 4 << 20,
            "op_timeout_s": 2.0, "verify": "full", **overrides}


@pytest.fixture(scope="module")
def held_store(mooncake_master: MooncakeMaster) -> Iterator[tuple[dict[str, Any],
                                                                   MooncakeStoreClient]]:
    """``(extra settings, pooled client)`` for the shared master; the client stays open."""
    from kvbridge.connectors.mooncake_store import clients
    from kvbridge.connectors.mooncake_store.scheduler import pool_key
    from kvbridge.connectors.mooncake_store.settings import parse_settings

    extra = store_extra(mooncake_master)
    settings = parse_settings(extra)
    key = pool_key(settings, "unused")
    client = clients.acquire(key, settings.client_config())
    yield extra, client
    clients.release(key)
