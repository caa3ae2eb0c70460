"""A process-wide, reference-counted pool of Mooncake store clients.

Why a pool: a client's ``setup()`` takes ~0.35 s and its ``close()`` ~2 s with
the GIL held (it unmounts its segment). A serving engine runs one worker rank
per process, but the reference engine runs every rank (and the scheduler half)
of an engine in one process; one client per rank would multiply both costs and
lend one segment per rank. Halves that ask for the same store and scope share
one client; it is closed when the last of them releases it.

Invariant: every ``acquire`` that returned a client is matched by exactly one
``release`` of the same :class:`PoolKey` (the connector halves do this in
``shutdown``). ``live_keys()`` lets tests check nothing is left open.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kvbridge.backends.mooncake import MooncakeConfig, MooncakeStoreClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolKey:
    """Which client: the store (master + metadata server) and the sharing scope."""

    master_address: str
    metadata_server: str
    scope: str  # "process", or an engine id for per-engine clients


@dataclass
class _Entry:
    client: MooncakeStoreClient
    refs: int


_lock = threading.Lock()
_entries: dict[PoolKey, _Entry] = {}


def acquire(key: PoolKey, config: MooncakeConfig) -> MooncakeStoreClient:
    """The pooled client for ``key``, set up with ``config`` if it does not exist yet.

    The first acquirer's ``config`` wins (segment size, timeouts). Raises what
    :meth:`MooncakeStoreClient.setup` raises (``MooncakeSetupError`` within the
    client's probe timeouts when the master is unreachable). Setup runs with
    the pool lock held so two halves never create two clients for one key.
    """
    with _lock:
        entry = _entries.get(key)
        if entry is not None:
            entry.refs += 1
            return entry.client
        client = MooncakeStoreClient.connect(config)
        _entries[key] = _Entry(client, 1)
        return client


def release(key: PoolKey) -> None:
    """Drop one reference; the last one closes the client (~2 s, see module doc)."""
    with _lock:
        entry = _entries.get(key)
        if entry is None:
            logger.warning("mooncake client pool: release of %s, which is not held", key)
            return
        entry.refs -= 1
        if entry.refs > 0:
            return
        del _entries[key]
    entry.client.close()


def live_keys() -> list[PoolKey]:
    """Keys of clients still open (a leak check after every holder shut down)."""
    with _lock:
        return list(_entries)
