"""The Mooncake store connector: KV blocks in a Mooncake distributed store under namespaced keys.

Producers put every computed block (one object per layer of each rank's part,
see :mod:`.keys`) zero-copy from the registered KV tensors; any engine (a
consumer, or another instance reusing a prefix) looks blocks up asynchronously
and loads them zero-copy. Failures are misses: a failed lookup matches
nothing, a failed get is a load error the engine recomputes, a failed put is
counted and dropped, and every Mooncake call is bounded. Every block put goes
with a digest record of its bytes (a companion key, put beside the KV), and a
reader checks the bytes that landed against it before it calls the block
loaded (``verify``: full, sample or off): wrong bytes are a load error too.

Modules: :mod:`.settings` (extra config), :mod:`.keys` (pure key and lookup
arithmetic), :mod:`.records` (the digest record format, pure), :mod:`.verify`
(a rank's record tables and in-place digests), :mod:`.clients` (process-wide
client pool), :mod:`.lookup` (the scheduler half's existence-check thread),
:mod:`.metadata`, :mod:`.scheduler` and :mod:`.worker` (the two halves),
:mod:`.plans` (the worker's region plans and batch gathering, pure),
:mod:`.load_verify` (which blocks a load checks and what the check found),
:mod:`.plugin`, :mod:`.bench` (``kvbridge bench mooncake``).
"""

from kvbridge.connectors.mooncake_store.keys import (
    RegionLookup,
    layer_key_prefix,
    leading_hits,
    matched_tokens,
    region_lookups,
    store_key,
)
from kvbridge.connectors.mooncake_store.metadata import LoadBlock, SaveBlock, StoreMetadata
from kvbridge.connectors.mooncake_store.plugin import MooncakeStorePlugin
from kvbridge.connectors.mooncake_store.scheduler import MooncakeStoreScheduler
from kvbridge.connectors.mooncake_store.settings import (
    ClientScope,
    MooncakeStoreSettings,
    parse_settings,
)
from kvbridge.connectors.mooncake_store.worker import MooncakeStoreWorker

__all__ = [
    "ClientScope",
    "LoadBlock",
    "MooncakeStorePlugin",
    "MooncakeStoreScheduler",
    "MooncakeStoreSettings",
    "MooncakeStoreWorker",
    "RegionLookup",
    "SaveBlock",
    "StoreMetadata",
    "layer_key_prefix",
    "leading_hits",
    "matched_tokens",
    "parse_settings",
    "region_lookups",
    "store_key",
]
